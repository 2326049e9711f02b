"""One rank's block work of the ring, timed on one GPU: ``python -m course_utils.distributed --blocks``.

While K/V travel, a rank of the ring computes: one attention call per block
pair that :func:`~course_utils.distributed.step_plan` keeps, each returning
``(o, lse)``, and a merge of each into the running output
(on a GPU the ring merges with one Triton kernel, :mod:`course_utils.kernels.merge`:
the ``course_fused_merge`` provider; ``course`` is the same blocks with the torch merge
:func:`~course_utils.distributed.merge_partials_`); the backward, one
backward call per pair. Those calls are all the ring's work apart from the
exchange it overlaps, so their time on one GPU, at the shapes a rank of a
``world_size`` ring sees, says how much of the gap to PyTorch's context
parallel (which does the same blocks with SDPA's kernels) is kernels and how
much is merges. This module times them for the course's block path and for
SDPA's flash and cuDNN kernels doing the same blocks, each followed by the
same merge, and writes ``results/ring_blocks.{md,json}``.
"""

from __future__ import annotations

import datetime
import json
import os

from . import DIAGONAL, n_chunks, step_plan

NS = (65536, 131072)
N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
PROVIDERS = ("course", "course_fused_merge", "flash", "cudnn")


def rank_blocks(n: int, world_size: int, rank: int = 0, layout: str = "zigzag", causal: bool = True):
    """The calls rank ``rank`` makes over the whole ring (sequence length ``n``), in order.

    A list of dicts: ``step``, ``q_start``/``q_len`` (rows of the rank's
    query shard), ``k_start``/``k_len`` (rows of the K/V block held at that
    step), ``causal`` (the diagonal block: the causal mask applies) and
    ``merged`` (False for the first block of the whole shard: it is copied,
    not merged).
    """
    chunk_len = n // n_chunks(world_size, layout)
    shard = n // world_size
    calls = []
    for step in range(world_size):
        src = (rank - step) % world_size
        for i, j, kind in step_plan(rank, src, world_size, layout, causal):
            calls.append(dict(step=step, q_start=0 if i is None else i * chunk_len, q_len=shard if i is None else chunk_len,
                              k_start=0 if j is None else j * chunk_len, k_len=shard if j is None else chunk_len,
                              causal=kind == DIAGONAL, merged=not (step == 0 and i is None)))
    return calls


def visible_pairs(call) -> int:
    """(query, key) pairs a call computes: all of them, or the lower triangle with the diagonal."""
    q, k = call["q_len"], call["k_len"]
    return q * (q + 1) // 2 if call["causal"] else q * k


def _block_fns(provider):
    """``(forward, backward)`` of one block: ``forward(q, k, v, causal) -> (o, lse [B, H, n] float32, saved)``
    and ``backward(do, q, k, v, o, lse, causal, saved) -> grads``, ``saved`` what the backward needs besides."""
    import torch

    from ..kernels import flash_attention_with_lse
    from ..kernels.backward import attention_backward

    if provider in ("course", "course_fused_merge"):
        return (lambda q, k, v, c: (*flash_attention_with_lse(q, k, v, causal=c), None),
                lambda do, q, k, v, o, lse, c, saved: attention_backward(q, k, v, o, lse, do, causal=c))
    aten = torch.ops.aten
    if provider == "flash":
        def fwd(q, k, v, c):
            out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, c)
            return out[0], out[1], out

        def bwd(do, q, k, v, o, lse, c, saved):
            _, _, cq, ck, mq, mk, seed, offset, _ = saved
            return aten._scaled_dot_product_flash_attention_backward(do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, c,
                                                                    seed, offset)
        return fwd, bwd
    if provider == "cudnn":
        def fwd(q, k, v, c):
            out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, c)
            return out[0], out[1].reshape(q.shape[:3]), out

        def bwd(do, q, k, v, o, lse, c, saved):
            _, lse_raw, cq, ck, mq, mk, seed, offset, _ = saved
            return aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse_raw, seed, offset, None,
                                                                    cq, ck, mq, mk, 0.0, c)
        return fwd, bwd
    raise ValueError(f"unknown provider {provider!r}; expected one of {PROVIDERS}")


def time_rank(n, world_size=2, provider="course", rank=0, seed=0):
    """Milliseconds of one rank's block work at sequence length ``n``: a dict, and the rank's output.

    ``kernels_ms``: the forward's block calls alone; ``forward_ms``: the same
    with every merge (the rank's whole forward but the exchange);
    ``backward_ms``: the backward's block calls. ``course_fused_merge`` is the
    course's blocks with :func:`course_utils.kernels.merge.merge_partials`, one
    kernel per merge, instead of the torch merge. K/V of the held blocks are
    slices of one tensor (the bytes are the same). SDPA's kernels get K/V
    repeated to every query head once, outside the timing (its flash kernel
    takes no GQA): ``repeated`` says so.
    """
    import torch
    from triton.testing import do_bench

    from . import merge_partials_

    g = torch.Generator(device="cuda").manual_seed(seed)
    shard = n // world_size
    q = torch.randn(1, N_Q_HEADS, shard, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, N_KV_HEADS, shard, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    do = torch.randn_like(q)
    repeated = provider not in ("course", "course_fused_merge")
    if provider == "course_fused_merge":  # the same blocks, merged by one Triton kernel each
        from ..kernels.merge import merge_partials as merge_partials_
    if repeated:
        k, v = (t.repeat_interleave(N_Q_HEADS // N_KV_HEADS, 1) for t in (k, v))
    fwd, bwd = _block_fns(provider)
    calls = rank_blocks(n, world_size, rank)
    views = [(q[:, :, c["q_start"]:c["q_start"] + c["q_len"]], k[:, :, c["k_start"]:c["k_start"] + c["k_len"]],
              v[:, :, c["k_start"]:c["k_start"] + c["k_len"]], do[:, :, c["q_start"]:c["q_start"] + c["q_len"]])
             for c in calls]
    acc = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device="cuda")

    def kernels():
        return [fwd(qb, kb, vb, c["causal"]) for c, (qb, kb, vb, _) in zip(calls, views)]

    def forward():
        for c, (qb, kb, vb, _) in zip(calls, views):
            o_b, lse_b, _ = fwd(qb, kb, vb, c["causal"])
            rows = slice(c["q_start"], c["q_start"] + c["q_len"])
            if c["merged"]:
                merge_partials_(acc[:, :, rows], lse[:, :, rows], o_b, lse_b)
            else:
                acc[:, :, rows].copy_(o_b)
                lse[:, :, rows].copy_(lse_b)

    # each block's own (o, lse) for its backward call (the flash backward takes its lse as the forward returned it)
    saved = [fwd(qb, kb, vb, c["causal"]) for c, (qb, kb, vb, _) in zip(calls, views)]

    def backward():
        for c, (qb, kb, vb, dob), (o_b, lse_b, s) in zip(calls, views, saved):
            bwd(dob, qb, kb, vb, o_b, lse_b if s is None else s[1], c["causal"], s)

    forward()
    out = acc.clone()
    row = dict(n=n, world_size=world_size, provider=provider, repeated=repeated, calls=len(calls),
               merges=sum(c["merged"] for c in calls),
               tflop_fwd=4 * N_Q_HEADS * HEAD_DIM * sum(visible_pairs(c) for c in calls) / 1e12)
    row["kernels_ms"] = do_bench(kernels, warmup=50, rep=300)
    row["forward_ms"] = do_bench(forward, warmup=50, rep=300)
    row["backward_ms"] = do_bench(backward, warmup=50, rep=300)
    return row, out


def write_results(rows, out, meta):
    """``ring_blocks.json`` and ``ring_blocks.md`` in ``out``; returns the markdown.

    The table is :func:`course_utils.results.markdown`'s, the one lesson 10 shows.
    """
    from .. import results

    os.makedirs(out, exist_ok=True)
    doc = dict(meta=meta, rows=rows)
    with open(os.path.join(out, "ring_blocks.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [f"# The ring's block work on one GPU (one rank of {meta['world_size']})", "",
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. bf16, causal, zigzag, "
             f"{N_Q_HEADS} query heads / {N_KV_HEADS} kv heads, D = {HEAD_DIM}, batch 1; "
             "`python -m course_utils.distributed --blocks`. Milliseconds (`triton.testing.do_bench`, median) of "
             "rank 0's block calls over the whole ring, without the exchange: kernels = the forward's attention "
             "calls alone; forward = the same with every merge (`merge_partials_` for every provider but "
             "course_fused_merge, which merges with one Triton kernel, `course_utils.kernels.merge`); "
             "backward = the backward's block calls. TFLOP/s count visible pairs only. flash and cuDNN = SDPA's "
             "kernels (`torch.ops.aten._scaled_dot_product_{flash,cudnn}_attention` and their backwards), with K/V "
             "repeated to every query head once, outside the timing. course / this = this provider's time over "
             "the course's: above 1, the course's blocks are faster.", "",
             *results.markdown("ring_blocks", doc=doc).splitlines()[2:], ""]
    lines += [f"- N = {r['n']}, {r['provider']}: not timed ({r['error']})." for r in rows if "error" in r]
    lines += [f"- N = {r['n']}, {r['provider']}: rank output vs the course's, largest error relative to the "
              f"largest value: {r['rel_err_vs_course']:.1e}." for r in rows if r.get("rel_err_vs_course") is not None]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "ring_blocks.md"), "w") as f:
        f.write(text)
    return text


def main(out="results", world_size=2, ns=NS) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("--blocks times GPU kernels; this machine has no GPU.")
        return 2
    rows = []
    for n in ns:
        reference = None
        for provider in PROVIDERS:
            try:
                row, o = time_rank(n, world_size, provider)
            except Exception as exc:  # noqa: BLE001  (a backend this torch or GPU lacks: recorded, not fatal)
                rows.append(dict(n=n, provider=provider, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))
                continue
            if reference is None:
                reference = o
            else:
                row["rel_err_vs_course"] = float((o - reference).abs().max() / reference.abs().max())
            rows.append(row)
            print(row, flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), world_size=world_size)
    print(write_results(rows, out, meta))
    return 0
