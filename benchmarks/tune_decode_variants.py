"""Two rewrites of lesson 09's split kernel, timed beside the course's launch and SDPA's cuDNN.

The course decodes with two kernels (``kernels.decode``): the split kernel
reads the cache with pointer loads and writes float32 partial results, and the
combine kernel merges them. At most points of ``results/decode_bench.md`` it
reads 97-100% of cuDNN's GB/s. This script measures two changes that could
close the rest, in one kernel with two switches (``VARIANTS``):

- ``tma``: K and V tiles loaded through device-side TMA descriptors
  (``tl.make_tensor_descriptor``, Hopper). Each program builds its
  descriptors with the split's end as the row bound, so the hardware fills
  the rows past it with zeros and no mask is computed per element;
- ``fused``: the combine done by the split kernel itself. Each split
  program writes its part, then adds one to a counter of its (batch, kv head);
  the program that finds the others done merges the parts in split order (so
  the result does not depend on which finished last) and resets the counter.
  One launch instead of two, and no second kernel to wait for.

Every point of the decode grid (bf16, 32 / 8 heads, D = 128, one new token,
every sequence at the full context, caches up to ``--max-gib``) is timed at
the split count the course picks, half of it and twice it, with the stages of
the course's launch and with 3, in ``--rounds`` rounds so that the spread shows;
each call is checked against a float32 reference first, and every provider is
replayed from a CUDA graph, as ``python -m course_utils.bench decode`` does.

    python benchmarks/tune_decode_variants.py [--out results/decode_variants.json] [--rounds 2] [--points 1:1024]

Needs a CUDA GPU (with ``tma``, a Hopper one); ``launch`` also runs in Triton's interpreter (the tests).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import course_utils  # noqa: F401  (first, as in every notebook)
import torch
import triton
import triton.language as tl

from course_utils import bench
from course_utils.bench import decode as db
from course_utils.kernels import decode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_decode import parse_point  # noqa: E402  (the sibling sweep's B:L parser)

VARIANTS = {"tma": dict(USE_TMA=True, FUSE_COMBINE=False), "fused": dict(USE_TMA=False, FUSE_COMBINE=True)}
NO_GPU_MESSAGE = ("No CUDA GPU here, so there is nothing to time: run `python benchmarks/tune_decode_variants.py` "
                  "on a GPU machine (the recorded run is results/decode_variants.md).")


@triton.jit
def _split_variant_kernel(
    Q, K, V, SEQLENS, O_PART, LSE_PART, O, COUNTER,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ob, stride_oh,
    n_q_heads, n_kv_heads, num_splits, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    USE_TMA: tl.constexpr, FUSE_COMBINE: tl.constexpr,
):
    """Lesson 09's split kernel for one new token per sequence and a contiguous cache ``[B, Hkv, N_max, D]``
    (rows of ``D`` contiguous elements), with TMA loads (``USE_TMA``) or the combine (``FUSE_COMBINE``)."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)  # (batch element, kv head)
    b = pid_bh // n_kv_heads
    kv_head = pid_bh % n_kv_heads
    group_size = n_q_heads // n_kv_heads
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < group_size
    q_head = kv_head * group_size + rows
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    seq_len = tl.load(SEQLENS + b)
    chunk = tl.cdiv(seq_len, num_splits)
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    k_head = K + b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_head = V + b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    if USE_TMA:  # rows from hi on read as zeros: the descriptor ends where the split does
        k_desc = tl.make_tensor_descriptor(k_head, shape=[hi, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(v_head, shape=[hi, D], strides=[D, 1], block_shape=[BLOCK_N, D])

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if USE_TMA:
            k = tl.trans(k_desc.load([start_n, 0]))
            v = v_desc.load([start_n, 0])
        else:
            k = tl.load(k_head + offs_n.to(tl.int64)[None, :] * D + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            v = tl.load(v_head + offs_n.to(tl.int64)[:, None] * D + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        s = tl.where(n_ok[None, :], tl.dot(q, k) * qk_scale, float("-inf"))  # log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_rows = O + b.to(tl.int64) * stride_ob + q_head[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        first = (b * n_q_heads + q_head) * num_splits  # this row's part 0
        tl.store(O_PART + (first + pid_s).to(tl.int64)[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(LSE_PART + first + pid_s, lse, mask=row_ok)
        if FUSE_COMBINE:
            tl.debug_barrier()  # every thread's part is written before the counter says so
            if tl.atomic_add(COUNTER + pid_bh, 1, sem="acq_rel") == num_splits - 1:  # the last split to finish
                tl.atomic_xchg(COUNTER + pid_bh, 0)  # ready for the next call
                mm = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
                ll = tl.zeros((BLOCK_M,), dtype=tl.float32)
                oo = tl.zeros((BLOCK_M, D), dtype=tl.float32)
                for sp in range(0, num_splits):  # in split order: the same sum whoever merges
                    lse_s = tl.load(LSE_PART + first + sp, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    o_s = tl.load(O_PART + (first + sp).to(tl.int64)[:, None] * D + offs_d[None, :],
                                  mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
                    m_new = tl.maximum(mm, lse_s)
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                    a = tl.exp(mm - m_use)
                    w = tl.exp(lse_s - m_use)
                    ll = ll * a + w
                    oo = oo * a[:, None] + w[:, None] * o_s
                    mm = m_new
                tl.store(o_rows, (oo / tl.where(row_ok, ll, 1.0)[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_rows, o.to(O.dtype.element_ty), mask=row_ok[:, None])


_counters: dict = {}


def _scratch(size: int, alignment: int, stream):
    """Global memory for device-side TMA descriptors (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def launch(q, k, v, seqlens, num_splits: int, variant: str, num_stages: int, block_n: int = 64, num_warps: int = 4):
    """One decode call through the variant kernel: ``o`` ``[B, Hq, 1, D]``. Without ``FUSE_COMBINE`` and with
    more than one split, the course's combine kernel merges the parts."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if T != 1 or k.stride(3) != 1 or k.stride(2) != D or v.stride(2) != D or Hq // Hkv > 16:
        raise ValueError("the variants take one new token, contiguous cache rows and at most 16 query heads per kv head")
    flags = VARIANTS[variant]
    if flags["USE_TMA"]:
        triton.set_allocator(_scratch)
    out = torch.empty_like(q)
    split = num_splits > 1
    o_parts = torch.empty((B, Hq, T, num_splits, D), dtype=torch.float32, device=q.device) if split else out
    lse_parts = torch.empty((B, Hq, T, num_splits), dtype=torch.float32, device=q.device) if split else out
    key = (q.device, B * Hkv)
    if key not in _counters:  # zero once; the last split of each call leaves it zero again
        _counters[key] = torch.zeros(B * Hkv, dtype=torch.int32, device=q.device)
    _split_variant_kernel[(num_splits, B * Hkv)](
        q, k, v, seqlens, o_parts, lse_parts, out, _counters[key],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        Hq, Hkv, num_splits, decode.LOG2E / math.sqrt(D),
        D=D, BLOCK_M=16, BLOCK_N=block_n, SPLIT=split, **flags, num_warps=num_warps, num_stages=num_stages,
    )
    if split and not flags["FUSE_COMBINE"]:
        decode.decode_combine(o_parts, lse_parts, out)
    return out


def counts_around(pick: int, context: int, block_n: int = 64) -> list[int]:
    """The course's split count, half and twice it, among those the launcher allows (at least 4 blocks each)."""
    most = decode._max_splits(-(-context // block_n))
    return sorted(s for s in {max(1, pick // 2), pick, 2 * pick} if s <= most)


def measure(batch: int, context: int, round_: int, rep_ms: int = 30) -> list[dict]:
    """Every provider at one point: the course's launch, SDPA's cuDNN, each variant at each count and stage."""
    q, k, v, seqlens, refs, nbytes = db.point_inputs(batch, context)
    pick = decode.launch_splits(q, k)
    rows = []

    def timed(name, fn, **extra):
        row = dict(batch=batch, context=context, round=round_, name=name, gbps=None, **extra)
        try:  # checked twice: the fused variant's counter must be back at zero after a call
            ms, gbps = db.checked_gbps(fn, refs, nbytes, rep_ms, calls=2)
            row.update(ms=ms, gbps=gbps)
        except Exception as exc:  # one variant failing must not stop the sweep
            row["note"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"
        rows.append(row)

    fn, _ = db.make_provider("sdpa_cudnn", q, k, v, seqlens)
    timed("sdpa_cudnn", fn)
    shipped = decode.launch_config(q, k, pick)
    timed("course", lambda: decode.launch_decode(q, k, v, seqlens), num_splits=pick,
          num_stages=shipped.get("num_stages"))
    for variant in VARIANTS:
        for s in counts_around(pick, context):
            stages = decode.launch_config(q, k, s)["num_stages"]
            for st in sorted({stages, 3}):
                timed(variant, lambda s=s, st=st, variant=variant: launch(q, k, v, seqlens, s, variant, st),
                      num_splits=s, num_stages=st)
    del q, k, v
    torch.cuda.empty_cache()
    return rows


def summary(doc: dict) -> list[dict]:
    """Per point, for the course and each variant: the lowest and highest ratio to cuDNN over the rounds
    (``course_utils.results``' ``decode_variants`` table holds each round's)."""
    from course_utils import results

    table = results.rows("decode_variants", doc=doc)
    out = []
    for b, n in sorted({(r["B"], r["context"]) for r in table}):
        ratios = {name: [r[f"{name}_over_cudnn"] for r in table if (r["B"], r["context"]) == (b, n)
                         and r[f"{name}_over_cudnn"] is not None] for name in ("course",) + tuple(VARIANTS)}
        out.append(dict(batch=b, context=n, **{name: (min(x), max(x)) if x else None for name, x in ratios.items()}))
    return out


def markdown(doc: dict) -> str:
    """The summary as the markdown written beside the JSON."""
    def cell(x):
        return "—" if x is None else (f"{x[0]:.2f}×" if f"{x[0]:.2f}" == f"{x[1]:.2f}" else f"{x[0]:.2f}–{x[1]:.2f}×")

    info, lines = doc["info"], summary(doc)
    out = ["# Two rewrites of lesson 09's split kernel, against cuDNN", "",
           f"{info.get('gpu', '?')} (torch {info.get('torch', '?')}, triton {info.get('triton', '?')}, "
           f"{info.get('date', '?')}); bf16, 32 query heads / 8 kv heads, D = 128, one new token, every sequence at "
           "the full context; every provider replayed from a CUDA graph. Each cell: GB/s / SDPA cuDNN's GB/s in the "
           "same round, lowest–highest over the rounds; a variant's cell is its best launch (split count: the "
           "course's, half, twice; stages: the course's launch's and 3). `python benchmarks/tune_decode_variants.py`.",
           "", "| B | context | course (two kernels, pointer loads) | `tma` (device TMA descriptors) | "
           "`fused` (combine in the split kernel) |", "|---:|---:|---:|---:|---:|"]
    for line in lines:
        out.append(f"| {line['batch']} | {line['context']} | {cell(line['course'])} | {cell(line['tma'])} | "
                   f"{cell(line['fused'])} |")
    wins = {name: sum(1 for line in lines if line[name] and line["course"] and line[name][0] > line["course"][1])
            for name in VARIANTS}
    out += ["", "Points where a variant's lowest ratio is above the course's highest: "
            + ", ".join(f"`{name}` {n} of {len(lines)}" for name, n in wins.items()) + ".", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON) and a .md beside it")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-gib", type=float, default=20.0, help="largest cache of the grid, GiB")
    parser.add_argument("--points", type=parse_point, nargs="+", default=None, metavar="B:L",
                        help="batch:context points instead")
    args = parser.parse_args(argv)
    if not bench.gpu_available():
        print(NO_GPU_MESSAGE)
        return 0
    points = args.points or db.grid(args.max_gib)
    rows = []
    for rnd in range(1, args.rounds + 1):
        for b, n in points:
            rows += measure(b, n, rnd)
            print(f"round {rnd}, B={b}, context={n}: done", flush=True)
    text = markdown(dict(info=bench.environment_info(), rows=rows))
    print(text)
    if args.out:
        bench.write_sweep(args.out, rows)
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
