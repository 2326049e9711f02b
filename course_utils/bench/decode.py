"""The decoding benchmark (lesson 09): GB/s of KV cache read, against a ceiling measured in the same run.

``python -m course_utils.bench decode`` (GPU only) times one decoding step,
bf16, 32 query heads sharing 8 kv heads, D = 128, one new token per sequence
(T = 1), over a grid of batch sizes (1 to 64) and context lengths (1k to
128k; points whose K + V caches would pass ``--max-cache-gib`` are left
out), and writes ``results/decode_bench.md`` and ``results/decode_bench.json``
(or into ``--out DIR``).

Providers, all on the same inputs:

- ``course``: :func:`course_utils.kernels.decode_attention`'s kernels, with its
  own choice of ``num_splits`` (or of the lean schedule, ``splits`` = ``lean``,
  or on Hopper lesson 09's kernels with the combine launched by PDL, ``pdl S``:
  :mod:`course_utils.kernels.fast_decode`), timed through
  ``fast_decode.launch_decode`` (the
  kernels without the input checks, whose check of ``cache_seqlens`` copies
  two numbers to the host each call) after the checked call was verified
  against the reference; ``course_paged`` the same over a copy of the cache
  in shuffled pages of 16 tokens (points up to 4 GiB of cache);
- ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``: PyTorch's
  ``scaled_dot_product_attention`` pinned to each backend, ``enable_gqa=True``
  (a backend that refuses the shape is reported, not timed); ``SDPA best``
  is the fastest of them at each point;
- ``flex``: ``torch.nn.attention.flex_attention`` compiled (its decoding path
  for short queries), with ``enable_gqa=True``, where it runs;
- ``ceiling``: the fastest of a few ways to only read K and V at each point
  (a Triton kernel that sums them, in several tile sizes and warps, and
  ``torch.sum``): the bandwidth a decode kernel could reach here.

How we measure: every output is first compared with a float32 reference for
the first and last sequences of the batch (a wrong provider is reported, not
timed); time is the median of ``triton.testing.do_bench`` (it flushes the L2
cache between calls, so even small caches come from HBM); ``GB/s = bytes of
K and V cache read / time`` (``2 * B * Hkv * L * D * 2`` bytes), the same
count for every provider. The run takes about two minutes on an H200.
Without a GPU the command says so in one sentence and exits 0.

``python -m course_utils.bench decode --splits`` measures instead the course's
GB/s against ``num_splits`` at a few points (B = 1, 4, 16 and 64; see
:data:`SPLIT_POINTS`; at B = 64 also the 3-stage launch of one split, which the model's
drain is fitted to), each count checked against the reference first and
timed the same way, beside the read ceiling and the busy fraction that the
model of :func:`course_utils.kernels.decode.split_busy_fraction` predicts, and
writes ``results/decode_splits.md`` and ``.json``: the check of the model
behind ``pick_num_splits``. It also records what the split kernel compiled to
at two splits (registers, shared memory: the 3-stage launch) and how many
programs of it fit on one SM, the model's ``PROGRAMS_PER_SM``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from .cases import RESULTS_DIR  # the repository's results/ (one definition)
STEM = "decode_bench"

N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = (1, 4, 16, 64)
CONTEXTS = (1024, 4096, 16384, 65536, 131072)
SDPA_BACKENDS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
PROVIDERS = ("course", "course_paged") + SDPA_BACKENDS + ("flex", "ceiling")
PAGE_SIZE = 16  # vLLM's default
PAGED_MAX_GIB = 4.0  # the paged copy doubles the memory: only points with caches up to this size
LABELS = {"course": "course", "course_paged": "course, paged", "sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN",
          "sdpa_efficient": "SDPA mem-efficient", "flex": "FlexAttention", "ceiling": "read ceiling"}
TOLERANCE = 2e-2  # relative error (norm) allowed against the float32 reference
NO_GPU_MESSAGE = (
    "No CUDA GPU here, so there is nothing to time: run `python -m course_utils.bench decode` "
    "on a GPU machine (the recorded results are in results/decode_bench.md)."
)
SPLITS_STEM = "decode_splits"
SPLIT_POINTS = ((1, 16384), (16, 4096), (64, 4096), (64, 16384), (64, 65536), (16, 1024), (4, 16384))  # (B, context)
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
NOT_SHIPPED = "3 stages, not shipped"  # the note of the extra one-split row where the launch ships 2 stages
NO_GPU_SPLITS_MESSAGE = (
    "No CUDA GPU here, so there is nothing to time: run `python -m course_utils.bench decode --splits` "
    "on a GPU machine (it writes results/decode_splits.md)."
)


def cache_bytes(batch: int, context: int, n_kv_heads: int = N_KV_HEADS, head_dim: int = HEAD_DIM,
                element_size: int = 2) -> int:
    """Bytes of K and V cache one decoding step reads: ``2 * B * Hkv * L * D * element_size``."""
    return 2 * batch * n_kv_heads * context * head_dim * element_size


def gb_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def grid(max_cache_gib: float, batches=BATCHES, contexts=CONTEXTS) -> list[tuple[int, int]]:
    """The (batch, context) points whose caches fit in ``max_cache_gib``."""
    return [(b, n) for b in batches for n in contexts if cache_bytes(b, n) <= max_cache_gib * 2**30]


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


# --------------------------------------------------------------------------- #
# The read-only ceiling: a kernel that streams K and V and does nothing else
# --------------------------------------------------------------------------- #
_stream_kernel = None


def _make_stream_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_cache_kernel(K, V, OUT, n_tokens, chunk, D: tl.constexpr, BLOCK_N: tl.constexpr):
        """Sum the K and V rows of one chunk of one (batch, kv head): every byte read once."""
        pid_c = tl.program_id(0)
        pid_bh = tl.program_id(1)
        base = pid_bh.to(tl.int64) * n_tokens * D
        offs_d = tl.arange(0, D)
        acc = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        lo = pid_c * chunk
        hi = tl.minimum(lo + chunk, n_tokens)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            ok = (offs_n < hi)[:, None]
            ptr = base + offs_n.to(tl.int64)[:, None] * D + offs_d[None, :]
            acc += tl.load(K + ptr, mask=ok, other=0.0).to(tl.float32)
            acc += tl.load(V + ptr, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + pid_bh * tl.num_programs(0) + pid_c, tl.sum(acc))

    return stream_cache_kernel


def read_ceiling(k, v, chunk: int | None = None, block_n: int = 64, num_warps: int = 4, chunks_per_sm: int = 4):
    """Stream contiguous ``k`` and ``v`` ``[B, Hkv, L, D]`` once; returns the per-program sums.

    ``chunk`` (tokens per program) defaults to what gives every SM several
    programs: ``B * Hkv * L / (4 * SMs)`` rounded down to a power of two,
    between ``block_n`` and 2048.
    """
    import torch
    import triton

    global _stream_kernel
    if _stream_kernel is None:
        _stream_kernel = _make_stream_kernel()
    B, H, L, D = k.shape
    if chunk is None:
        sms = torch.cuda.get_device_properties(k.device).multi_processor_count if k.is_cuda else 4
        want = max(1, B * H * L // (chunks_per_sm * sms))
        chunk = min(2048, max(block_n, 1 << (want.bit_length() - 1)))
    n_chunks = triton.cdiv(L, chunk)
    out = torch.empty((B * H, n_chunks), dtype=torch.float32, device=k.device)
    _stream_kernel[(n_chunks, B * H)](k, v, out, L, chunk, D=D, BLOCK_N=block_n, num_warps=num_warps, num_stages=4)
    return out


# (block_n, num_warps, chunks_per_sm) of the stream kernel tried at each point, besides torch.sum.
CEILING_CONFIGS = ((32, 4, 4), (64, 4, 4), (64, 8, 4), (128, 8, 4), (64, 4, 16), (32, 4, 16))


def fastest_reader(k, v, rep_ms: int = 20):
    """The fastest way found here to read ``k`` and ``v`` once, and its name: the read ceiling.

    One stream kernel cannot be the best at every size, so a few are timed
    (``do_bench``, L2 flushed) with ``torch.sum`` beside them.
    """
    import torch
    import triton

    candidates = [(f"Triton stream, BLOCK_N={bn}, {nw} warps, {c} chunks/SM",
                   lambda bn=bn, nw=nw, c=c: read_ceiling(k, v, block_n=bn, num_warps=nw, chunks_per_sm=c))
                  for bn, nw, c in CEILING_CONFIGS]
    candidates.append(("torch.sum", lambda: (k.sum(dtype=torch.float32), v.sum(dtype=torch.float32))))
    best = None
    for name, fn in candidates:
        ms = triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")
        if best is None or ms < best[0]:
            best = (ms, name, fn)
    return best[2], best[1]


# --------------------------------------------------------------------------- #
# Providers
# --------------------------------------------------------------------------- #
_flex_compiled = None
_flex_seconds = [0.0]  # time spent in FlexAttention (mostly compiling)
FLEX_BUDGET_S = 60.0


def make_provider(name: str, q, k, v, seqlens):
    """A zero-argument callable for provider ``name`` (returns ``o``), and a note. Raises if it cannot run."""
    import torch
    import torch.nn.functional as F

    if name == "course":
        from ..kernels import fast_decode

        out = fast_decode.decode_attention(q, k, v, seqlens)  # the checked call (raises on bad input)
        del out
        return (lambda: fast_decode.launch_decode(q, k, v, seqlens)), fast_decode.launch_choice(q, k)
    if name == "course_paged":
        from ..kernels import decode

        if cache_bytes(k.shape[0], k.shape[2], element_size=k.element_size()) > PAGED_MAX_GIB * 2**30:
            raise RuntimeError(f"caches over {PAGED_MAX_GIB:g} GiB are not copied into pages")
        k_pages, v_pages, table = paged_copy(k, v, PAGE_SIZE)
        decode.decode_attention(q, k_pages, v_pages, seqlens, block_table=table)  # the checked call
        return (lambda: decode.launch_decode(q, k_pages, v_pages, seqlens, block_table=table)), \
            f"pages of {PAGE_SIZE}, shuffled"
    if name in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                   "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        run()
        return run, ""
    if name == "flex":
        global _flex_compiled
        from torch.nn.attention.flex_attention import flex_attention

        if _flex_compiled is None:  # dynamic shapes: one compilation for the whole grid, not one per point
            _flex_compiled = torch.compile(flex_attention, dynamic=True)

        def run():
            return _flex_compiled(q, k, v, enable_gqa=True)

        run()
        return run, ""
    if name == "ceiling":
        if not k.is_cuda:  # no do_bench without a GPU: the one stream kernel
            return (lambda: read_ceiling(k, v)), "streams K and V only"
        fn, which = fastest_reader(k, v)
        return fn, f"streams K and V only: {which}"
    raise ValueError(f"unknown provider {name!r}")


def cuda_graphed(fn):
    """``fn`` captured once in a CUDA graph; returns the graph's replay.

    Inference engines run decode steps from CUDA graphs (a step is a few
    microseconds of GPU work, shorter than launching its kernels from Python),
    so the benchmark replays every provider the same way: what is timed is the
    GPU's work, not Python's. Raises if ``fn`` cannot be captured.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (allocations, autotuning, compilation)
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def paged_copy(k, v, page_size: int, seed: int = 0):
    """``k``, ``v`` ``[B, Hkv, L, D]`` dealt into shuffled pages ``[B * L / page_size, Hkv, page_size, D]``, and the table."""
    import torch

    B, H, L, D = k.shape
    n = L // page_size
    g = torch.Generator(device=k.device).manual_seed(seed)
    where = torch.randperm(B * n, device=k.device, generator=g)  # page p of sequence b goes to slot where[b * n + p]
    pages = []
    for t in (k, v):
        paged = torch.empty((B * n, H, page_size, D), dtype=t.dtype, device=t.device)
        paged[where] = t.view(B, H, n, page_size, D).permute(0, 2, 1, 3, 4).reshape(B * n, H, page_size, D)
        pages.append(paged)
    return pages[0], pages[1], where.view(B, n).to(torch.int32)


def reference(q, k, v, b: int):
    """Float32 attention of sequence ``b``'s new token over its whole cache: ``[Hq, 1, D]``."""
    import torch

    group = q.shape[1] // k.shape[1]
    qs = q[b].float().reshape(k.shape[1], group, q.shape[-1])  # [Hkv, group, D]
    s = qs @ k[b].float().transpose(-1, -2) / math.sqrt(q.shape[-1])  # [Hkv, group, L]
    o = torch.softmax(s, dim=-1) @ v[b].float()
    return o.reshape(q.shape[1], 1, q.shape[-1])


def rel_error(o, refs) -> float:
    import torch

    errs = []
    for b, want in refs.items():
        got = o[b].float()
        errs.append((torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item())
    worst = max(errs)
    return worst if math.isfinite(worst) else float("inf")


def point_inputs(batch: int, context: int, device: str = "cuda", dtype=None):
    """One point of the grid, seeded by it: ``(q, k, v, cache_seqlens, refs, nbytes)``.

    ``q`` ``[B, 32, 1, 128]``, ``k`` and ``v`` ``[B, 8, context, 128]`` (bf16 by default), every sequence at the full
    context; ``refs`` the float32 :func:`reference` of the first and last sequence (for :func:`rel_error`);
    ``nbytes`` the cache bytes one step reads.
    """
    import torch

    g = torch.Generator(device=device).manual_seed(batch * 1_000_003 + context)
    dt = torch.bfloat16 if dtype is None else dtype
    q = torch.randn(batch, N_Q_HEADS, 1, HEAD_DIM, device=device, dtype=dt, generator=g)
    k = torch.randn(batch, N_KV_HEADS, context, HEAD_DIM, device=device, dtype=dt, generator=g)
    v = torch.randn(batch, N_KV_HEADS, context, HEAD_DIM, device=device, dtype=dt, generator=g)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    refs = {b: reference(q, k, v, b) for b in sorted({0, batch - 1})}
    return q, k, v, seqlens, refs, cache_bytes(batch, context, element_size=q.element_size())


def checked_gbps(fn, refs, nbytes: int, rep_ms: int = 30, calls: int = 1) -> tuple[float, float]:
    """``(ms, GB/s)`` of ``fn`` replayed from a CUDA graph, after checking its output against ``refs`` ``calls``
    times (a tuning script's row); raises ``RuntimeError`` when a call is wrong."""
    import triton

    for _ in range(calls):
        err = rel_error(fn(), refs)
        if not err <= TOLERANCE:
            raise RuntimeError(f"wrong: relative error {err:.2e}")
    ms = triton.testing.do_bench(cuda_graphed(fn), warmup=10, rep=rep_ms, return_mode="median")
    return ms, gb_per_s(nbytes, ms)


def measure_point(batch: int, context: int, providers=PROVIDERS, log=print, rep_ms: int = 60,
                  device: str = "cuda", dtype=None, graphs: bool = True) -> list[dict]:
    """Check, then time, every provider at one (batch, context) point (bf16 on the GPU by default).

    With ``graphs`` (on a GPU) each provider is timed replaying a CUDA graph of one call.
    """
    import torch
    import triton

    q, k, v, seqlens, refs, nbytes = point_inputs(batch, context, device, dtype)
    rows = []
    for name in providers:
        if name == "flex" and _flex_seconds[0] > FLEX_BUDGET_S:
            rows.append(dict(batch=batch, context=context, provider=name, ms=None, gbps=None, status="skip",
                             rel_err=None, note=f"FlexAttention's compilations passed {FLEX_BUDGET_S} s"))
            continue
        t0 = time.perf_counter()
        row = dict(batch=batch, context=context, provider=name, ms=None, gbps=None, status="ok",
                   rel_err=None, note="")
        try:
            fn, row["note"] = make_provider(name, q, k, v, seqlens)
            if name != "ceiling":
                row["rel_err"] = rel_error(fn(), refs)
                if not row["rel_err"] <= TOLERANCE:
                    row["status"] = "wrong"
            if row["status"] == "ok":
                if graphs and device == "cuda":
                    try:
                        fn = cuda_graphed(fn)
                    except Exception as exc:  # noqa: BLE001  (timed from Python instead, and said so)
                        torch.cuda.synchronize()
                        row["note"] = (row["note"] + "; " if row["note"] else "") + \
                            f"not capturable in a CUDA graph ({type(exc).__name__}): launched from Python"
                row["ms"] = triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
                row["gbps"] = gb_per_s(nbytes, row["ms"])
        except Exception as exc:  # a backend that refuses the shape, or no FlexAttention here
            row["status"] = "skip"
            row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            if device == "cuda":
                torch.cuda.empty_cache()
        if name == "flex":
            _flex_seconds[0] += time.perf_counter() - t0
        rows.append(row)
        log(format_row(row))
    del q, k, v
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def format_row(row: dict) -> str:
    head = f"B={row['batch']:>3} L={row['context']:>6} {row['provider']:<15}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['note']}"
    err = "" if row["rel_err"] is None else f" (rel err {row['rel_err']:.1e})"
    return f"{head} {row['ms']:.4f} ms {row['gbps']:7.0f} GB/s{err} {row['note']}"


# --------------------------------------------------------------------------- #
# Tables
# --------------------------------------------------------------------------- #
def summarise(rows: list[dict]) -> list[dict]:
    """One line per point: each provider's GB/s, the best SDPA backend, the ratios."""
    points = {}
    for r in rows:
        points.setdefault((r["batch"], r["context"]), {})[r["provider"]] = r
    lines = []
    for (b, n), by in sorted(points.items()):
        def gbps(p):
            r = by.get(p)
            return r["gbps"] if r and r["status"] == "ok" else None

        sdpa = {p: gbps(p) for p in SDPA_BACKENDS if gbps(p)}
        best = max(sdpa, key=sdpa.get) if sdpa else None
        course, ceiling = gbps("course"), gbps("ceiling")
        line = dict(batch=b, context=n, course=course, course_paged=gbps("course_paged"), flex=gbps("flex"),
                    ceiling=ceiling,
                    sdpa_best=sdpa.get(best), sdpa_best_backend=best,
                    num_splits=(by.get("course") or {}).get("note", ""), **{p: sdpa.get(p) for p in SDPA_BACKENDS})
        line["course_vs_sdpa"] = course / line["sdpa_best"] if course and line["sdpa_best"] else None
        line["course_vs_ceiling"] = course / ceiling if course and ceiling else None
        line["course_vs_flex"] = course / line["flex"] if course and line["flex"] else None
        lines.append(line)
    return lines


def _f(x, fmt):
    return "—" if x is None else format(x, fmt)


def markdown(rows: list[dict], info: dict) -> str:
    lines = summarise(rows)
    out = [
        "# Decoding benchmark: GB/s of KV cache read",
        "",
        f"{info.get('gpu', '?')} (torch {info.get('torch', '?')}, triton {info.get('triton', '?')}, "
        f"cuDNN {info.get('cudnn', '?')}, {info.get('date', '?')}); bf16, {N_Q_HEADS} query heads / "
        f"{N_KV_HEADS} kv heads, D = {HEAD_DIM}, one new token per sequence, every sequence at the full "
        "context. GB/s = bytes of K and V cache read / median time (`triton.testing.do_bench`, L2 flushed); "
        "each output checked against a float32 reference first. "
        + ("Every provider is timed replaying a CUDA graph of one call, as inference engines run decode "
           "steps (Python's launch time left out for all alike). " if info.get("cuda_graphs") else
           "Every provider is launched from Python (`--no-graphs`). ")
        + "`python -m course_utils.bench decode`.",
        "",
        "| B | context | course GB/s | SDPA best GB/s (backend) | FlexAttention GB/s | read ceiling GB/s "
        "| course / SDPA best | course / ceiling | course / Flex | splits | course, paged GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for ln in lines:
        backend = LABELS.get(ln["sdpa_best_backend"], "—") if ln["sdpa_best_backend"] else "—"
        out.append(
            f"| {ln['batch']} | {ln['context']} | {_f(ln['course'], '.0f')} | {_f(ln['sdpa_best'], '.0f')} ({backend}) "
            f"| {_f(ln['flex'], '.0f')} | {_f(ln['ceiling'], '.0f')} | {_f(ln['course_vs_sdpa'], '.2f')}× "
            f"| {_f(ln['course_vs_ceiling'], '.0%')} | {_f(ln['course_vs_flex'], '.2f')}× "
            f"| {ln['num_splits'].replace('num_splits=', '')} | {_f(ln['course_paged'], '.0f')} |"
        )
    out += ["", "Every SDPA backend, GB/s:", "",
            "| B | context | " + " | ".join(LABELS[p] for p in SDPA_BACKENDS) + " |",
            "|---:|---:|" + "---:|" * len(SDPA_BACKENDS)]
    for ln in lines:
        out.append(f"| {ln['batch']} | {ln['context']} | " + " | ".join(_f(ln[p], ".0f") for p in SDPA_BACKENDS) + " |")
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        out += ["", "Not timed:", ""]
        out += [f"- B={r['batch']}, L={r['context']}, {LABELS[r['provider']]}: {r['status']} ({r['note']})"
                for r in skipped]
    out += ["", "Targets (issue 14): at least the best SDPA backend everywhere; >= 1.3× it at B = 1 with "
            "contexts <= 16k; >= 90% of the read ceiling at B >= 16.", ""]
    checks = target_checks(lines)
    out += [f"- {c}" for c in checks] + [""]
    return "\n".join(out)


def target_checks(lines: list[dict]) -> list[str]:
    """The issue's targets, stated with the measured ratios."""
    def ok(x, bar):
        return x is not None and x >= bar

    vs = [ln["course_vs_sdpa"] for ln in lines if ln["course_vs_sdpa"] is not None]
    small = [ln["course_vs_sdpa"] for ln in lines if ln["batch"] == 1 and ln["context"] <= 16384
             and ln["course_vs_sdpa"] is not None]
    big = [ln["course_vs_ceiling"] for ln in lines if ln["batch"] >= 16 and ln["course_vs_ceiling"] is not None]
    res = []
    if vs:
        res.append(f"course / SDPA best: {min(vs):.2f}× to {max(vs):.2f}× "
                   f"({'met' if all(ok(x, 1.0) for x in vs) else 'NOT met'} at every point)")
    if small:
        res.append(f"B = 1, context <= 16k: {min(small):.2f}× to {max(small):.2f}× SDPA best "
                   f"({'met' if all(ok(x, 1.3) for x in small) else 'NOT met'}: target 1.3×)")
    if big:
        res.append(f"B >= 16: {min(big):.0%} to {max(big):.0%} of the read ceiling "
                   f"({'met' if all(ok(x, 0.9) for x in big) else 'NOT met'}: target 90%)")
    return res


# --------------------------------------------------------------------------- #
# GB/s against num_splits: the check of pick_num_splits's model
# --------------------------------------------------------------------------- #
def split_counts(context: int, pick: int, counts=SPLIT_COUNTS, block_n: int = 64) -> list[int]:
    """The split counts measured at one point: ``counts`` the launcher allows there, and the model's pick."""
    from ..kernels import decode

    most = decode._max_splits(-(-context // block_n))
    return sorted({s for s in counts if s <= most} | {pick})


def model_of(batch: int, context: int, num_splits: int, sm_count: int, block_n: int = 64,
             programs_per_sm: int | None = None) -> float:
    """The busy fraction :func:`~course_utils.kernels.decode.split_busy_fraction` predicts (the bench's shape), for
    the launch the course ships (``programs_per_sm`` None) or one holding ``programs_per_sm`` per SM."""
    from ..kernels import decode

    if programs_per_sm is None:
        programs_per_sm = decode.programs_per_sm_of_launch(batch * N_KV_HEADS, num_splits, sm_count)
    return decode.split_busy_fraction(batch, N_KV_HEADS, 1, -(-context // block_n), num_splits, sm_count,
                                      programs_per_sm)


def programs_per_sm(n_regs: int, num_warps: int, shared_bytes: int) -> int:
    """Programs of one kernel resident on an H100/H200 SM: lesson 06's rule (its reference,
    :func:`course_utils.grading.part3_performance.programs_per_sm`), with shared memory in bytes as the
    compiler reports it."""
    from ..grading.part3_performance import programs_per_sm as rule

    return rule(n_regs, num_warps, shared_bytes / 1024)


class _Recorder:
    """Stands in for the split kernel in ``decode.decode_split(kernel=...)``: launches it, keeps what compiled."""

    def __init__(self, kernel):
        self.kernel, self.compiled = kernel, None

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.compiled = launch(*args, **kwargs)
            return self.compiled

        return run


def compiled_split_kernel(q, k, v, seqlens) -> dict:
    """Registers, shared memory and warps of the split kernel as compiled here, and the programs per SM."""
    from ..kernels import decode

    recorder = _Recorder(decode._decode_split_kernel)
    decode.decode_split(q, k, v, seqlens, 2, kernel=recorder)
    c = recorder.compiled
    try:
        n_regs, shared, warps = int(c.n_regs), int(c.metadata.shared), int(c.metadata.num_warps)
    except (AttributeError, TypeError):  # the interpreter returns no compiled kernel
        return dict(n_regs=None, shared_bytes=None, num_warps=None, programs_per_sm=None)
    return dict(n_regs=n_regs, shared_bytes=shared, num_warps=warps, programs_per_sm=programs_per_sm(n_regs, warps, shared))


def measure_splits(batch: int, context: int, counts=SPLIT_COUNTS, log=print, rep_ms: int = 60, device: str = "cuda",
                   dtype=None, graphs: bool = True, sm_count: int | None = None) -> tuple[list[dict], dict]:
    """GB/s of the course's decode at each split count at one point, checked first; and the point's summary."""
    import torch
    import triton

    from ..kernels import decode

    q, k, v, seqlens, refs, nbytes = point_inputs(batch, context, device, dtype)
    sms = sm_count or (torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132)
    block_n = decode.decode_config(HEAD_DIM, q.dtype, q.device)["BLOCK_N"]
    pick = decode.model_num_splits(batch, N_KV_HEADS, 1, triton.cdiv(context, block_n), sms)  # the model's own
    ceiling_fn, ceiling_note = make_provider("ceiling", q, k, v, seqlens)
    ceiling_ms = triton.testing.do_bench(ceiling_fn, warmup=10, rep=rep_ms, return_mode="median")
    rows = []
    launches = [(s, None) for s in split_counts(context, pick, counts, block_n)]
    if decode.launch_config(q, k, 1).get("num_stages") == 2:
        launches.append((1, 3))  # the 3-stage launch of one split too: the run the model's drain is fitted to
    for s, stages in launches:
        row = dict(batch=batch, context=context, num_splits=s,
                   num_stages=stages or decode.launch_config(q, k, s).get("num_stages"),
                   ms=None, gbps=None, status="ok", rel_err=None,
                   predicted_busy=model_of(batch, context, s, sms, block_n,
                                           decode.PROGRAMS_PER_SM if stages is not None else None),
                   model_pick=s == pick and stages is None, note="" if stages is None else NOT_SHIPPED)
        try:
            if stages is None:
                decode.decode_attention(q, k, v, seqlens, num_splits=s)  # the checked call
                fn = (lambda s=s: decode.launch_decode(q, k, v, seqlens, num_splits=s))
            else:
                fn = (lambda: decode.decode_split(q, k, v, seqlens, 1, out=torch.empty_like(q), num_stages=3)[0])
            row["rel_err"] = rel_error(fn(), refs)
            if not row["rel_err"] <= TOLERANCE:
                row["status"] = "wrong"
            else:
                if graphs and device == "cuda":
                    fn = cuda_graphed(fn)
                row["ms"] = triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
                row["gbps"] = gb_per_s(nbytes, row["ms"])
        except Exception as exc:  # noqa: BLE001  (reported, not timed)
            row["status"], row["note"] = "skip", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        rows.append(row)
        log(f"B={batch:>3} L={context:>6} num_splits={s:>3} ({row['num_stages']} stages): "
            + (f"{row['gbps']:7.0f} GB/s" if row["gbps"] else row["status"])
            + f", model {row['predicted_busy']:.0%} busy" + (" (model's pick)" if row["model_pick"] else ""))
    point = dict(batch=batch, context=context, sm_count=sms, block_n=block_n, ceiling_gbps=gb_per_s(nbytes, ceiling_ms),
                 ceiling_note=ceiling_note, model_pick=pick, **compiled_split_kernel(q, k, v, seqlens))
    timed = [r for r in rows if r["gbps"] and r["note"] != NOT_SHIPPED]
    if timed:
        best = max(timed, key=lambda r: r["gbps"])
        at_pick = next((r["gbps"] for r in timed if r["model_pick"]), None)
        point.update(best_splits=best["num_splits"], best_gbps=best["gbps"],
                     pick_over_best=at_pick / best["gbps"] if at_pick else None)
    del q, k, v
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows, point


def _splits(n: int) -> str:
    return f"{n} split" + ("" if n == 1 else "s")


def splits_markdown(rows: list[dict], points: list[dict], info: dict) -> str:
    from ..kernels import decode

    out = [
        "# Decoding: GB/s against num_splits, and the model behind pick_num_splits",
        "",
        f"{info.get('gpu', '?')} (torch {info.get('torch', '?')}, triton {info.get('triton', '?')}, "
        f"{info.get('date', '?')}); bf16, {N_Q_HEADS} query heads / {N_KV_HEADS} kv heads, D = {HEAD_DIM}, one new "
        "token, every sequence at the full context. GB/s = bytes of K and V cache read / median time "
        "(`triton.testing.do_bench`, L2 flushed, " + ("a CUDA graph of one call replayed" if info.get("cuda_graphs")
                                                       else "launched from Python")
        + "); each split count checked against a float32 reference first. Model: "
        f"`decode.split_busy_fraction` with {decode.PROGRAMS_PER_SM} programs per SM "
        f"({decode.ONE_SPLIT_PROGRAMS_PER_SM} for one split over a full grid, the 2-stage launch), drain "
        f"{decode.DRAIN_WAVES}, overhead {decode.PROGRAM_OVERHEAD_BLOCKS} and combine {decode.COMBINE_BLOCKS} "
        "blocks. `python -m course_utils.bench decode --splits`.",
        "",
    ]
    for pt in points:
        b, n = pt["batch"], pt["context"]
        compiled = (f"the split kernel (at 2 splits) compiled to {pt['n_regs']} registers, {pt['shared_bytes'] / 1024:.0f} KiB of "
                    f"shared memory, {pt['num_warps']} warps: {pt['programs_per_sm']} programs per SM"
                    if pt.get("n_regs") else "the split kernel's registers not read")
        out += [f"## B = {b}, context {n}", "",
                f"Read ceiling {pt['ceiling_gbps']:.0f} GB/s; {compiled}; the model picks {_splits(pt['model_pick'])}"
                + (f", {pt['pick_over_best']:.0%} of the best measured ({_splits(pt['best_splits'])}, "
                   f"{pt['best_gbps']:.0f} GB/s)." if pt.get("pick_over_best") else "."),
                "", "| num_splits | stages | GB/s | of the ceiling | model's busy fraction | |",
                "|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            if (r["batch"], r["context"]) != (b, n):
                continue
            got = f"{r['gbps']:.0f} | {r['gbps'] / pt['ceiling_gbps']:.0%}" if r["gbps"] else f"{r['status']} | —"
            out.append(f"| {r['num_splits']} | {r.get('num_stages') or '?'} | {got} | {r['predicted_busy']:.0%} | "
                       + ("model's pick" if r["model_pick"] else r.get("note", "")) + " |")
        out.append("")
    out += ["## The model against the measurement", ""] + [f"- {c}" for c in splits_checks(rows, points)] + [""]
    return "\n".join(out)


PICK_WITHIN = 0.97  # the model's pick should read at least this share of the best measured count's GB/s


def splits_checks(rows: list[dict], points: list[dict]) -> list[str]:
    """How well the model did: its pick against the best measured count, and its busy fraction against the GB/s."""
    out = []
    for pt in points:
        mine = [r for r in rows if (r["batch"], r["context"]) == (pt["batch"], pt["context"]) and r["gbps"]]
        if not mine or not pt.get("pick_over_best"):
            out.append(f"B = {pt['batch']}, context {pt['context']}: the model's pick was not timed")
            continue
        gap = sum(abs(r["gbps"] / pt["ceiling_gbps"] - r["predicted_busy"]) for r in mine) / len(mine)
        verdict = "met" if pt["pick_over_best"] >= PICK_WITHIN else "NOT met"
        out.append(f"B = {pt['batch']}, context {pt['context']}: the pick ({_splits(pt['model_pick'])}) reads "
                   f"{pt['pick_over_best']:.0%} of the best count's GB/s (num_splits = {pt['best_splits']}; {verdict}: "
                   f"{PICK_WITHIN:.0%}); measured share of the ceiling minus the model's busy fraction: "
                   f"{100 * gap:.0f} points on average")
    return out


def write_splits(rows, points, out_dir: Path, info: dict) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{SPLITS_STEM}.json", "md": out_dir / f"{SPLITS_STEM}.md"}
    paths["json"].write_text(json.dumps({"info": info, "points": points, "rows": rows}, indent=1))
    paths["md"].write_text(splits_markdown(rows, points, info))
    return paths


def main_splits(args) -> int:
    if not gpu_available():
        print(NO_GPU_SPLITS_MESSAGE)
        return 0
    import course_utils  # noqa: F401  (configures the environment before triton)

    start = time.perf_counter()
    rows, points = [], []
    for batch, context in SPLIT_POINTS:
        r, pt = measure_splits(batch, context, graphs=not args.no_graphs)
        rows += r
        points.append(pt)
    info = environment_info()
    info["cuda_graphs"] = not args.no_graphs
    info["seconds"] = round(time.perf_counter() - start, 1)
    paths = write_splits(rows, points, args.out, info)
    print(splits_markdown(rows, points, info))
    print(f"wrote {paths['md']} and {paths['json']} in {info['seconds']} s")
    return 0


def environment_info() -> dict:
    from . import environment_info as info

    return info()


def write_results(rows, out_dir: Path, info: dict) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{STEM}.json", "md": out_dir / f"{STEM}.md"}
    paths["json"].write_text(json.dumps({"info": info, "rows": rows, "summary": summarise(rows)}, indent=1))
    paths["md"].write_text(markdown(rows, info))
    return paths


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m course_utils.bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR,
                   help="where to write decode_bench.{md,json} (decode_splits.{md,json} with --splits)")
    p.add_argument("--max-cache-gib", type=float, default=16.0,
                   help="leave out points whose K + V caches pass this size (default 16)")
    p.add_argument("--quick", action="store_true", help="four points only")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles per shape)")
    p.add_argument("--no-graphs", action="store_true",
                   help="launch every provider from Python instead of replaying a CUDA graph")
    p.add_argument("--splits", action="store_true",
                   help="GB/s against num_splits at a few points, beside the model (writes decode_splits.{md,json})")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.splits:
        return main_splits(args)
    if not gpu_available():
        print(NO_GPU_MESSAGE)
        return 0
    import course_utils  # noqa: F401  (configures the environment before triton)

    providers = tuple(p for p in PROVIDERS if not (args.no_flex and p == "flex"))
    points = grid(args.max_cache_gib, (1, 16) if args.quick else BATCHES, (4096, 16384) if args.quick else CONTEXTS)
    start = time.perf_counter()
    rows = []
    for batch, context in points:
        rows += measure_point(batch, context, providers, graphs=not args.no_graphs)
    info = environment_info()
    info["cuda_graphs"] = not args.no_graphs
    info["seconds"] = round(time.perf_counter() - start, 1)
    paths = write_results(rows, args.out, info)
    print(markdown(rows, info))
    print(f"wrote {paths['md']} and {paths['json']} in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
