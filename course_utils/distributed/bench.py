"""Ring attention on several GPUs against one GPU and PyTorch's context parallel.

``python -m course_utils.distributed --nproc 2 --bench`` (NVIDIA GPUs, one
per rank). bf16, causal, 32 query heads / 8 kv heads, D = 128, batch 1,
N = 32k..256k. For each N, in tokens per second (N / time):

- ``1 GPU``: the course's ``kernels.flash_attention`` on the whole sequence,
  on rank 0's GPU (the other ranks wait);
- ``ring``: :func:`course_utils.distributed.ring_attention`, zigzag layout,
  every rank on its shard (the time is the slowest rank's);
- ``torch CP``: PyTorch's ``context_parallel`` around
  ``scaled_dot_product_attention`` on the same GPUs, once with each rotate
  method (``set_rotate_method``: ``"allgather"``, ``"alltoall"``); the ring
  is compared with the faster (optional: if it is missing or fails, the row
  says why).

At N = 65536 each rank also records one forward's and one backward's steps
(:func:`course_utils.distributed.timeline_ms`): compute time and the wait
for the transfers that the compute did not hide.

Forward alone, and forward + backward. First, the K/V exchange alone
(:func:`p2p_bandwidth`): GB/s of one ring step's ``batch_isend_irecv`` of a
K/V shard (N = 32k's on 2 ranks), each rank sending to the next while
receiving from the previous, as the ring does (lesson 10's overlap exercise
reads it). Before timing, the ring's output is
compared with the one-GPU output (N <= 128k) and its gradients at the
smallest N. Results go to ``results/ring_bench.{md,json}``. The whole run is
kept to about four minutes on two H200s: fewer repetitions at long N, and a
section (ring, one GPU, torch CP) is left out at an N where its cost,
predicted from the previous N, would pass :data:`TIME_BUDGET_S` (the table
says so). Autotuning the one-GPU forward at 256k alone takes about a minute.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import time

from ..results import CP_ROTATE_METHODS, torch_cp_times
from . import SAFE_ENV, apply_safe_env, run_distributed, shard_sequence, unshard_sequence

apply_safe_env()

NS = (32768, 65536, 131072, 262144)
QUICK_NS = (32768, 65536)
N_Q_HEADS, N_KV_HEADS, HEAD_DIM, BATCH = 32, 8, 128, 1
TIME_BUDGET_S = 190.0  # seconds of measuring, after the processes started (spawn + NCCL set-up: ~20 s more)
CHECK_UP_TO = 131072  # outputs compared with one GPU up to this N
P2P_TOKENS = 16384  # the K/V shard of the exchange measured alone: N = 32k on 2 ranks
TIMELINE_N = 65536  # the ring's per-step timeline is recorded at this N


def _reps(n):
    return 3 if n <= 65536 else (2 if n <= 131072 else 1)


def _timed(fn, reps, active=True):
    """Median milliseconds of ``fn()`` over ``reps`` runs, the slowest rank's (every rank calls this)."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        if active:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append(0.0)
    worst = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def p2p_bandwidth(rank, world, tokens=P2P_TOKENS, reps=None, inner=None, device="cuda"):
    """GB/s of one ring step's K/V exchange, measured alone (every rank calls this; same result on each).

    Each rank sends a ``[2, 1, N_KV_HEADS, tokens, HEAD_DIM]`` block (bf16 on GPUs, float32 on the CPU,
    where gloo runs) to rank + 1 while receiving one from rank - 1, with ``batch_isend_irecv`` as
    :func:`course_utils.distributed.ring_attention_forward` does; ``inner`` exchanges back to back per
    repetition (so a launch's latency is not what is timed), the median over ``reps``, the slowest rank's.
    GB/s = bytes one rank sends / time of one exchange (each direction of a link carries that much).
    """
    import torch
    import torch.distributed as dist

    cuda = device == "cuda"
    reps = reps or (20 if cuda else 3)
    inner = inner or (10 if cuda else 2)
    dtype = torch.bfloat16 if cuda else torch.float32
    blocks = [torch.ones((2, BATCH, N_KV_HEADS, tokens, HEAD_DIM), dtype=dtype, device=device) for _ in range(2)]
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def exchange():
        for i in range(inner):
            send, recv = blocks[i % 2], blocks[(i + 1) % 2]
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                request.wait()
        if cuda:
            torch.cuda.synchronize()

    exchange()  # warm-up: NCCL sets up the pair's connection on the first message
    times = []
    for _ in range(reps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        exchange()
        times.append((time.perf_counter() - start) / inner)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    seconds = float(worst.item())
    sent = blocks[0].numel() * blocks[0].element_size()
    return dict(tokens=tokens, bytes=sent, dtype=str(dtype).replace("torch.", ""), reps=reps, inner=inner,
                ms=seconds * 1e3, gbps=sent / seconds / 1e9,
                how="batch_isend_irecv of one K/V shard to rank + 1 while receiving from rank - 1, every rank at "
                    "once; bytes sent by one rank / time of one exchange (median, slowest rank)")


def _inputs(n, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(BATCH, h, n, HEAD_DIM) for h in (N_Q_HEADS, N_KV_HEADS, N_KV_HEADS, N_Q_HEADS)]
    return [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes]


def _gather_unshard(shard, world):
    return _gather_unshard_layout(shard, world, "zigzag")


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _torch_cp(q, k, v, do, world, reps, rotate_method="allgather"):
    """PyTorch's context parallel on the same GPUs: (fwd ms, fwd+bwd ms, note) or (None, None, why).

    ``rotate_method``: ``"allgather"`` (torch's default: all K/V gathered after the first block) or
    ``"alltoall"`` (the shards passed on), set with its ``set_rotate_method`` for this measurement.
    """
    import torch
    import torch.nn.functional as F

    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
    except Exception as exc:  # noqa: BLE001
        return None, None, f"torch.distributed.tensor.experimental.context_parallel is not available: {exc}"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    note = "SDPA with enable_gqa=True"
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

        set_rotate_method(rotate_method)
        note += f", rotate method {getattr(_cp_options, 'rotate_method', '?')}"
    except Exception as exc:  # noqa: BLE001
        return None, None, f"set_rotate_method({rotate_method!r}) failed: {type(exc).__name__}: {exc}"
    # No math backend: its ring would not be a fused attention (and may gather the whole sequence).
    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    try:
        mesh = init_device_mesh("cuda", (world,))
        q, k, v, do = (t.clone() for t in (q, k, v, do))
        with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2]):
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

            def attend(a, b, c):
                nonlocal note
                with sdpa_kernel(fused):
                    if "repeated" not in note:
                        try:
                            return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
                        except Exception as exc:  # noqa: BLE001
                            # Its ring may not take GQA: give it every query head's K/V (4x the traffic).
                            note = (f"K/V repeated to {a.shape[1]} heads (with enable_gqa=True it raised "
                                    f"{type(exc).__name__})")
                    g = a.shape[1] // b.shape[1]
                    return F.scaled_dot_product_attention(a, b.repeat_interleave(g, 1), c.repeat_interleave(g, 1),
                                                          is_causal=True)

            def fwd():
                with torch.no_grad():
                    attend(*leaves)

            def fwd_bwd():
                attend(*leaves).backward(do)

            fwd()
            fwd_bwd()  # warm-up
            t_fwd = _timed(fwd, reps)
            t_fb = _timed(fwd_bwd, reps)
        return t_fwd, t_fb, note
    except Exception as exc:  # noqa: BLE001
        return None, None, f"context_parallel failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


class _Budget:
    """Decides, the same way on every rank, whether a section of the benchmark can still run.

    A section's cost at N is predicted from its cost at the previous N, times
    4 (attention's work grows like N squared) scaled by the repetitions; it
    runs only if it should end before :data:`TIME_BUDGET_S`. Rank 0 decides
    and broadcasts, so every rank takes the same branch.
    """

    def __init__(self):
        self.began = time.perf_counter()
        self.cost = {}  # section -> (n, seconds)

    def allows(self, section, n):
        import torch
        import torch.distributed as dist

        predicted = 0.0
        if section in self.cost:
            n_prev, seconds = self.cost[section]
            predicted = seconds * (n / n_prev) ** 2 * (_reps(n) + 2) / (_reps(n_prev) + 2)
        left = TIME_BUDGET_S - (time.perf_counter() - self.began)
        verdict = torch.tensor([1.0 if predicted < left else 0.0], device="cuda")
        dist.broadcast(verdict, 0)
        return verdict.item() == 1.0, predicted

    @contextlib.contextmanager
    def section(self, name, n):
        start = time.perf_counter()
        yield
        self.cost[name] = (n, time.perf_counter() - start)


def bench_worker(rank, world, ns):
    """Runs on every rank (NCCL, one GPU each): the measurements for every N in ``ns``."""
    import torch
    import torch.distributed as dist

    from .. import kernels
    from . import ring_attention

    p2p = p2p_bandwidth(rank, world)
    if rank == 0:
        print(f"K/V exchange alone: {json.dumps(p2p)}", flush=True)
    budget = _Budget()
    rows = []
    timeline = None
    for n in ns:
        reps = _reps(n)
        row = dict(n=n, reps=reps)
        rows.append(row)
        ok, predicted = budget.allows("ring", n)
        if not ok:
            row["skipped"] = f"not run: predicted to end after the benchmark's {TIME_BUDGET_S:.0f} s budget"
            continue
        q, k, v, do = _inputs(n)
        ql, kl, vl, dol = (shard_sequence(t, rank, world, "zigzag").contiguous() for t in (q, k, v, do))

        # -- ring on every GPU (the first call autotunes the forward kernel for the shard's shapes) --
        with budget.section("ring", n):
            leaves = [t.detach().requires_grad_(True) for t in (ql, kl, vl)]

            def ring_fwd():
                with torch.no_grad():
                    ring_attention(ql, kl, vl, True)

            def ring_fwd_bwd():
                ring_attention(*leaves, True).backward(dol)

            ring_fwd_bwd()  # warm-up
            row["ring_fwd_ms"] = _timed(ring_fwd, reps)
            row["ring_fwd_bwd_ms"] = _timed(ring_fwd_bwd, reps)
            del leaves

        # -- one GPU, the whole sequence, and the ring's error against it ---------------------
        one = rank == 0
        ok, predicted = budget.allows("one", n)
        if not ok:
            row["one_gpu"] = f"not timed: predicted {predicted:.0f} s (autotuning included) would pass the time budget"
        else:
            with budget.section("one", n):
                with torch.no_grad():
                    o_ring = ring_attention(ql, kl, vl, True)
                    o_full = _gather_unshard(o_ring, world) if n <= CHECK_UP_TO else None
                    if one and o_full is not None:
                        row["o_rel_err_vs_1gpu"] = _rel_err(o_full, kernels.flash_attention(q, k, v, causal=True))
                    del o_ring, o_full
                if n == ns[0]:
                    leaves = [t.detach().requires_grad_(True) for t in (ql, kl, vl)]
                    ring_attention(*leaves, True).backward(dol)
                    grads = [_gather_unshard(t.grad, world) for t in leaves]
                    if one:
                        full_leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                        kernels.flash_attention(*full_leaves, causal=True).backward(do)
                        for name, got, leaf in zip(("dq", "dk", "dv"), grads, full_leaves):
                            row[f"{name}_rel_err_vs_1gpu"] = _rel_err(got, leaf.grad)
                        del full_leaves
                    del leaves, grads
                full_leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

                def one_fwd():
                    with torch.no_grad():
                        kernels.flash_attention(q, k, v, causal=True)

                def one_fwd_bwd():
                    kernels.flash_attention(*full_leaves, causal=True).backward(do)

                fits = torch.ones(1, device="cuda")
                if one:
                    try:
                        one_fwd_bwd()  # warm-up (autotunes the forward at N if the check did not)
                    except torch.cuda.OutOfMemoryError:
                        fits.zero_()
                dist.broadcast(fits, 0)  # every rank takes the same branch
                if fits.item():
                    row["one_gpu_fwd_ms"] = _timed(one_fwd, reps, active=one)
                    row["one_gpu_fwd_bwd_ms"] = _timed(one_fwd_bwd, reps, active=one)
                else:
                    row["one_gpu"] = "out of memory on one GPU"
                del full_leaves
                torch.cuda.empty_cache()

        # -- the ring's steps at one N: how much of each transfer the compute hides ---------
        if n == TIMELINE_N:
            timeline = _ring_timeline(ql, kl, vl, dol)

        # -- PyTorch's context parallel, both ways of moving K/V ----------------------------
        for method in CP_ROTATE_METHODS:
            ok, predicted = budget.allows(f"cp_{method}", n)
            if not ok:
                row[f"torch_cp_{method}_note"] = f"not timed: predicted {predicted:.0f} s would pass the time budget"
                continue
            with budget.section(f"cp_{method}", n):
                t_fwd, t_fb, note = _torch_cp(q, k, v, do, world, reps, method)
            row[f"torch_cp_{method}_fwd_ms"], row[f"torch_cp_{method}_fwd_bwd_ms"] = t_fwd, t_fb
            row[f"torch_cp_{method}_note"] = note
        for key in ("fwd_ms", "fwd_bwd_ms"):  # the faster of the two: the baseline the ring must beat
            times = [row[f"torch_cp_{m}_{key}"] for m in CP_ROTATE_METHODS if row.get(f"torch_cp_{m}_{key}")]
            row[f"torch_cp_{key}"] = min(times) if times else None
        row["elapsed_s"] = round(time.perf_counter() - budget.began, 1)
        del q, k, v, do, ql, kl, vl, dol
        torch.cuda.empty_cache()
        if rank == 0:
            print(f"N={n}: {json.dumps({k: v for k, v in row.items() if k != 'n'})}", flush=True)
    return dict(rows=rows, p2p=p2p, timeline=timeline)


def _ring_timeline(q, k, v, do):
    """This rank's per-step timeline of one ring forward and one backward (after a warm-up), in ms."""
    import torch

    from . import ring_attention_backward, ring_attention_forward, timeline_ms

    with torch.no_grad():
        o, lse = ring_attention_forward(q, k, v, True)  # warm-up
        ring_attention_backward(do, q, k, v, o, lse, True)
        forward, backward = [], []
        o, lse = ring_attention_forward(q, k, v, True, timeline=forward)
        ring_attention_backward(do, q, k, v, o, lse, True, timeline=backward)
    return dict(n=q.shape[2] * torch.distributed.get_world_size(), forward=timeline_ms(forward),
                backward=timeline_ms(backward))


def gpu_check_worker(rank, world, ns, layout="zigzag"):
    """Runs on every rank (NCCL): ring forward + backward against one GPU's, relative errors per N.

    bf16, causal, GQA 32/8, D = 128. Rank 0 returns ``{n: {"o": err, "dq": ..., "dk": ..., "dv": ...}}``
    (largest absolute difference over the largest absolute value of the one-GPU result).
    """
    import torch

    from .. import kernels
    from . import ring_attention

    out = {}
    for n in ns:
        q, k, v, do = _inputs(n, seed=n)
        leaves = [shard_sequence(t, rank, world, layout).contiguous().requires_grad_(True) for t in (q, k, v)]
        o = ring_attention(*leaves, True, layout=layout)
        o.backward(shard_sequence(do, rank, world, layout).contiguous())
        got = [_gather_unshard_layout(t, world, layout) for t in (o.detach(), *(x.grad for x in leaves))]
        if rank == 0:
            full = [t.detach().requires_grad_(True) for t in (q, k, v)]
            o_one = kernels.flash_attention(*full, causal=True)
            o_one.backward(do)
            want = [o_one.detach(), *(x.grad for x in full)]
            out[n] = {name: _rel_err(g, w) for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
            del full, o_one, want
        del q, k, v, do, leaves, o, got
        torch.cuda.empty_cache()
    return out


def _gather_unshard_layout(shard, world, layout):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous())
    return unshard_sequence(parts, world, layout)


def _tok(n, ms):
    return None if not ms else BATCH * n / (ms / 1e3)


def _fmt(x, digits=0):
    return "—" if x is None else (f"{x:,.{digits}f}" if digits else f"{x:,.0f}")


def _ratio(a, b):
    return "—" if not a or not b else f"{a / b:.2f}×"


def _timeline_lines(timelines):
    """Markdown: each rank's per-step compute and exposed wait, forward and backward."""
    if not timelines:
        return []
    n = timelines[0]["n"]
    lines = ["", f"Per ring step at N = {n} (CUDA events on each rank's stream): compute = the step's kernels and "
             "merges; exposed wait = how long the rank then still waited for the step's transfers (0: the "
             "exchange hid behind the compute). The backward's last row is the hop that brings each block's "
             "dK/dV home, with nothing left to compute.", "",
             "| pass | rank | step | compute ms | exposed wait ms |", "|---|---:|---:|---:|---:|"]
    for label in ("forward", "backward"):
        for rank, tl in enumerate(timelines):
            for s in tl[label]:
                lines.append(f"| {label} | {rank} | {s['step']} | {s['compute_ms']:.2f} | {s['exposed_wait_ms']:.2f} |")
    return lines


def write_results(rows, nproc, out, meta, p2p=None, timelines=None):
    """``ring_bench.json`` (meta, rows, ``p2p``: :func:`p2p_bandwidth`'s record, and ``timelines``: each rank's
    per-step timeline, if measured) and its markdown."""
    os.makedirs(out, exist_ok=True)
    extra = {**({"p2p": p2p} if p2p else {}), **({"timelines": timelines} if timelines else {})}
    with open(os.path.join(out, "ring_bench.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, **extra), f, indent=1)
    lines = [
        f"# Ring attention on {nproc} GPUs",
        "",
        f"{meta['gpu']} × {nproc}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. "
        f"bf16, causal, {N_Q_HEADS} query heads / {N_KV_HEADS} kv heads, D = {HEAD_DIM}, batch {BATCH}; "
        "`python -m course_utils.distributed --nproc 2 --bench`. Tokens per second (N / time; the "
        "slowest rank's time); ring = `course_utils.distributed.ring_attention`, zigzag layout; "
        "1 GPU = `course_utils.kernels.flash_attention` on the whole sequence; torch CP = "
        "`torch.distributed.tensor.experimental.context_parallel` around SDPA on the same GPUs, with each of "
        "its rotate methods (`set_rotate_method`: all-gather, all-to-all); ring / torch CP is against the "
        "faster of the two.",
        "",
        "| N | pass | 1 GPU tok/s | ring tok/s | ring / 1 GPU | torch CP all-gather tok/s | "
        "torch CP all-to-all tok/s | ring / torch CP |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in rows:
        n = row["n"]
        if "skipped" in row:
            lines.append(f"| {n} | — | {row['skipped']} | | | | | |")
            continue
        for label, key in (("fwd", "fwd_ms"), ("fwd+bwd", "fwd_bwd_ms")):
            one, ring = (_tok(n, row.get(f"{who}_{key}")) for who in ("one_gpu", "ring"))
            cp = {m: _tok(n, ms) for m, ms in torch_cp_times(row, key).items()}
            best = max((x for x in cp.values() if x), default=None)
            lines.append(f"| {n} | {label} | {_fmt(one)} | {_fmt(ring)} | {_ratio(ring, one)} | "
                         f"{_fmt(cp.get('allgather'))} | {_fmt(cp.get('alltoall'))} | {_ratio(ring, best)} |")
        errs = ", ".join(f"{k.split('_rel')[0]} {v:.1e}" for k, v in row.items() if k.endswith("_rel_err_vs_1gpu"))
        if errs:
            notes.append(f"- N = {n}: largest error of the ring vs one GPU, relative to the largest value: {errs}.")
        if row.get("torch_cp_note"):
            notes.append(f"- N = {n}, torch CP: {row['torch_cp_note']}.")
        for method in CP_ROTATE_METHODS:
            if row.get(f"torch_cp_{method}_note"):
                notes.append(f"- N = {n}, torch CP {method}: {row[f'torch_cp_{method}_note']}.")
        if row.get("one_gpu"):
            notes.append(f"- N = {n}, 1 GPU: {row['one_gpu']}.")
    if p2p:
        notes.append(f"- K/V exchange alone ({p2p['tokens']} tokens, {p2p['bytes'] / 1e6:.1f} MB of {p2p['dtype']} "
                     f"K/V per rank): {p2p['ms']:.3f} ms, {p2p['gbps']:.0f} GB/s per GPU each way ({p2p['how']}).")
    lines += ["", *notes, *_timeline_lines(timelines), "",
              f"Environment of every process: {', '.join(f'{k}={v}' for k, v in SAFE_ENV.items())}."]
    with open(os.path.join(out, "ring_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(nproc=2, out="results", quick=False) -> int:
    import torch
    import triton

    if not torch.cuda.is_available() or torch.cuda.device_count() < nproc:
        print(f"--bench needs {nproc} NVIDIA GPUs; this machine has {torch.cuda.device_count()}.")
        return 2
    ns = QUICK_NS if quick else NS
    began = time.perf_counter()
    per_rank = run_distributed(bench_worker, nproc, args=(ns,), device="cuda")
    rows, p2p = per_rank[0]["rows"], per_rank[0]["p2p"]
    timelines = [r["timeline"] for r in per_rank] if all(r.get("timeline") for r in per_rank) else None
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), nproc=nproc, wall_s=round(time.perf_counter() - began, 1),
                env=SAFE_ENV)
    print(write_results(rows, nproc, out, meta, p2p, timelines))
    print(f"wrote {out}/ring_bench.md and {out}/ring_bench.json in {meta['wall_s']} s")
    return 0
