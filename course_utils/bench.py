"""The course's GPU benchmark: attention forward, side by side, measured honestly.

``python -m course_utils.bench`` runs the standard sweep and writes, into
``results/`` (or ``--out DIR``), ``forward_bench.csv``, ``forward_bench.json``,
``forward_bench.md`` (the tables) and ``forward_bench.png`` (the plot).

Providers, all on the same inputs in one run:

- ``naive``: PyTorch attention that materialises the ``[N, N]`` score matrix
  (an out-of-memory error is reported as ``OOM``, not a crash);
- ``sdpa_flash`` and ``sdpa_cudnn``: ``torch.nn.functional.scaled_dot_product_attention``
  pinned to its FlashAttention-2 and cuDNN backends (``enable_gqa=True``);
- ``course``: the lesson-05 kernel as taught (``kernels.forward.flash_attention_gqa_forward``);
- ``fast``: the course's fastest kernel (``kernels.fast.attention_forward_fast``).

How we measure (lesson 06 explains why):

- every output is checked against a float32 reference on a slice (batch 0,
  the first and last query heads, the first and last 64 query rows, against
  all keys) *before* it is timed; a wrong provider is reported, not timed;
- time is the median of ``triton.testing.do_bench`` (it warms up, flushes
  the L2 cache between runs and times with CUDA events);
- ``TFLOP/s = 4 * B * Hq * N^2 * D / time``, halved when causal (half the
  score matrix is never computed), the same count for every provider;
- peak memory is what one call allocates on top of its inputs (output included).

The standard sweep: 16k tokens per batch (``B = tokens / N``), ``N`` from 1k
to 16k, for the course's main configuration (bf16, causal, 32 query heads
sharing 8 K/V heads, D = 128) and the others the course reports (non-causal,
D = 64 multi-head causal and non-causal, fp16). ``--ladder`` also times the
tuning steps of lesson 06 one at a time. Without a GPU the command says so in
one sentence and exits 0; ``--replot DIR`` re-renders tables and plot from a
saved ``forward_bench.json`` (no GPU needed).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import json
import math
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "results"
STEM = "forward_bench"

PROVIDERS = ("naive", "sdpa_flash", "sdpa_cudnn", "course", "fast")
LABELS = {
    "naive": "naive PyTorch",
    "sdpa_flash": "SDPA flash",
    "sdpa_cudnn": "SDPA cuDNN",
    "course": "course (05)",
    "fast": "fast",
}
# (numerator, denominator) pairs shown as ratio columns.
RATIOS = (("fast", "sdpa_flash"), ("fast", "sdpa_cudnn"), ("course", "sdpa_flash"))
DEFAULT_NS = (1024, 2048, 4096, 8192, 16384)
QUICK_NS = (1024, 4096)
TOLERANCE = 2e-2  # relative error (norm) allowed against the float32 reference
NO_GPU_MESSAGE = (
    "No CUDA GPU here, so there is nothing to time: the recorded results are in "
    "results/forward_bench.md (run this on a GPU machine to measure your own)."
)
CSV_FIELDS = (
    "case", "provider", "dtype", "causal", "batch", "n_q_heads", "n_kv_heads", "n", "head_dim",
    "ms", "tflops", "peak_mib", "status", "rel_err", "note",
)


# --------------------------------------------------------------------------- #
# What we measure
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of the sweep (everything but N)."""

    name: str
    dtype: str = "bf16"
    causal: bool = True
    n_q_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    tokens: int = 16384  # batch * N, fixed so every N does the same number of query rows
    ns: tuple = DEFAULT_NS

    def batch(self, n: int) -> int:
        return max(1, self.tokens // n)

    def title(self) -> str:
        heads = f"{self.n_q_heads}/{self.n_kv_heads} heads" if self.n_q_heads != self.n_kv_heads else f"{self.n_q_heads} heads (MHA)"
        return f"{self.dtype}, {'causal' if self.causal else 'non-causal'}, {heads}, D={self.head_dim}, {self.tokens} tokens"


STANDARD_SUITE = (
    Case("main"),
    Case("noncausal", causal=False),
    Case("d64_causal", n_kv_heads=32, head_dim=64),
    Case("d64_noncausal", causal=False, n_kv_heads=32, head_dim=64),
    Case("fp16", dtype="fp16"),
)


def attention_flops(batch: int, n_heads: int, n: int, head_dim: int, causal: bool) -> float:
    """Floating-point operations of one attention forward pass.

    Two matrix products per head, ``Q K^T`` and ``P V``, each ``2 * N * N * D``
    (a multiply and an add per term): ``4 * B * H * N^2 * D``. With a causal
    mask only the lower triangle is needed, so half of that is counted (the
    convention FlashAttention's papers and PyTorch's benchmarks use). The
    exponentials are not counted: they run on other units.
    """
    flops = 4.0 * batch * n_heads * n * n * head_dim
    return flops / 2 if causal else flops


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# --------------------------------------------------------------------------- #
# Providers
# --------------------------------------------------------------------------- #
def naive_attention(q, k, v, causal: bool, sm_scale: float):
    """Attention the textbook way: the whole ``[B, H, N, N]`` score matrix in memory."""
    import torch

    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2))
    s.mul_(sm_scale)
    if causal:
        n = q.shape[-2]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        s.masked_fill_(future, float("-inf"))
    p = torch.softmax(s, dim=-1)
    del s
    return torch.matmul(p, v)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def make_provider(name: str, q, k, v, causal: bool):
    """A zero-argument callable running provider ``name`` on these inputs, and a note.

    Returns ``(fn, note)``; ``fn()`` returns the output ``o`` (or ``(o, lse)``).
    Raises ``RuntimeError`` if the provider cannot run these inputs here.
    """
    import torch
    import torch.nn.functional as F

    sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if name == "naive":
        return (lambda: naive_attention(q, k, v, causal, sm_scale)), ""
    if name in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(name)
        gqa = k.shape[1] != q.shape[1]

        def run(kk, vv, enable_gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=enable_gqa)

        try:
            run(k, v, gqa)
            return (lambda: run(k, v, gqa)), ""
        except RuntimeError:
            if not gqa:
                raise
        # This backend refuses GQA here: give it K/V expanded to every query
        # head (outside the timed region) and say so.
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        run(ke, ve, False)
        return (lambda: run(ke, ve, False)), "K/V expanded (backend has no GQA)"
    if name == "course":
        from .kernels import forward

        return (lambda: forward.flash_attention_gqa_forward(q, k, v, causal=causal)), ""
    if name == "fast":
        from .kernels import fast

        reason = fast.unsupported_reason(q, k, v)
        note = f"fell back to the course kernel: {reason}" if reason else ""
        return (lambda: fast.attention_forward_fast(q, k, v, causal=causal)), note
    raise ValueError(f"unknown provider {name!r}")


# --------------------------------------------------------------------------- #
# Checking and timing
# --------------------------------------------------------------------------- #
def make_inputs(case: Case, n: int, seed: int = 0):
    """Fresh random ``q, k, v`` for ``case`` at sequence length ``n`` (never zeros)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case.dtype]
    g = torch.Generator(device="cuda").manual_seed(seed + n)
    b = case.batch(n)
    shape_q = (b, case.n_q_heads, n, case.head_dim)
    shape_kv = (b, case.n_kv_heads, n, case.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def reference_slice(q, k, v, causal: bool, rows: int = 64):
    """Float32 reference for batch 0, the first and last query heads, first/last ``rows`` queries.

    Computed against *all* keys, so it checks the whole softmax of those rows
    (the last rows see every key under the causal mask). Returns
    ``(heads, row_index, o_ref [heads, R, D], lse_ref [heads, R])``.
    """
    import torch

    n, d = q.shape[-2], q.shape[-1]
    group = q.shape[1] // k.shape[1]
    heads = sorted({0, q.shape[1] - 1})
    idx = torch.cat([torch.arange(0, min(rows, n)), torch.arange(max(n - rows, min(rows, n)), n)]).to(q.device)
    outs, lses = [], []
    for h in heads:
        qs = q[0, h, idx].float()
        ks, vs = k[0, h // group].float(), v[0, h // group].float()
        s = (qs @ ks.T) / math.sqrt(d)
        if causal:
            s = s.masked_fill(idx[:, None] < torch.arange(n, device=q.device)[None, :], float("-inf"))
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.softmax(s, dim=-1) @ vs)
    return heads, idx, torch.stack(outs), torch.stack(lses)


def check_output(result, ref) -> tuple[float, float | None]:
    """Relative error (norm) of a provider's output slice, and max |lse error| if it gave lse."""
    import torch

    heads, idx, o_ref, lse_ref = ref
    o, lse = (result if isinstance(result, tuple) else (result, None))
    o_s = torch.stack([o[0, h, idx].float() for h in heads])
    rel = (torch.linalg.vector_norm(o_s - o_ref) / torch.linalg.vector_norm(o_ref)).item()
    lse_err = None
    if lse is not None:
        lse_s = torch.stack([lse[0, h, idx].float() for h in heads])
        lse_err = (lse_s - lse_ref).abs().max().item()
    if not math.isfinite(rel):
        rel = float("inf")
    return rel, lse_err


def peak_memory_mib(fn) -> float:
    """Memory one call of ``fn`` allocates beyond what was already allocated, in MiB."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure(name: str, case: Case, n: int, q, k, v, ref, warmup_ms=25, rep_ms=100) -> dict:
    """One row of the results: check ``name`` on these inputs, then time it."""
    import torch
    import triton

    b = case.batch(n)
    row = dict(
        case=case.name, provider=name, dtype=case.dtype, causal=case.causal, batch=b,
        n_q_heads=case.n_q_heads, n_kv_heads=case.n_kv_heads, n=n, head_dim=case.head_dim,
        ms=None, tflops=None, peak_mib=None, status="ok", rel_err=None, note="",
    )
    try:
        fn, row["note"] = make_provider(name, q, k, v, case.causal)
        result = fn()  # also compiles / autotunes
        rel, lse_err = check_output(result, ref)
        del result
        row["rel_err"] = rel
        if lse_err is not None and lse_err > 5e-2:
            row["status"], row["note"] = "wrong", f"lse off by {lse_err:.3g}"
            return row
        if not rel <= TOLERANCE:
            row["status"] = "wrong"
            return row
        row["peak_mib"] = peak_memory_mib(fn)
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        row["ms"] = ms
        row["tflops"] = tflops(attention_flops(b, case.n_q_heads, n, case.head_dim, case.causal), ms)
        if name == "fast":
            from .kernels import fast

            row["note"] = row["note"] or (fast.best_config(case.causal) or "")
    except Exception as exc:  # one provider failing must not stop the sweep
        if is_oom(exc):
            row["status"], row["note"] = "OOM", "out of memory"
        else:
            row["status"] = "error"
            row["note"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
    finally:
        torch.cuda.empty_cache()
    return row


def run_case(case: Case, providers=PROVIDERS, quick=False, log=print) -> list[dict]:
    """Every provider at every N of ``case``; rows in the order measured."""
    import torch

    rows = []
    warmup, rep = (10, 40) if quick else (25, 100)
    for n in case.ns:
        q, k, v = make_inputs(case, n)
        ref = reference_slice(q, k, v, case.causal)
        for name in providers:
            row = measure(name, case, n, q, k, v, ref, warmup, rep)
            rows.append(row)
            log(format_row(row))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def format_row(row: dict) -> str:
    t = f"{row['tflops']:7.1f} TFLOP/s" if row["tflops"] else f"{row['status']:>15}"
    mem = f"{row['peak_mib']:9.0f} MiB" if row["peak_mib"] is not None else " " * 13
    err = f"err {row['rel_err']:.1e}" if row["rel_err"] is not None else ""
    return f"{row['case']:<14} N={row['n']:<6} {row['provider']:<11} {t} {mem}  {err} {row['note']}"


# --------------------------------------------------------------------------- #
# Ceilings of the machine (for the roofline)
# --------------------------------------------------------------------------- #
def measure_ceilings(size: int = 8192) -> dict:
    """The two numbers a roofline needs, measured: matmul TFLOP/s and copy bandwidth.

    - a bf16 (fp16 before Ampere) ``size^3`` matrix product through cuBLAS, on
      random data (zeros run faster than real data);
    - a device-to-device copy of 2 GiB, counting bytes read plus bytes written.
    """
    import torch
    import triton

    major, _ = torch.cuda.get_device_capability()
    dtype = torch.bfloat16 if major >= 8 else torch.float16
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    matmul = 2.0 * size**3 / (ms * 1e-3) / 1e12
    del a, b
    x = torch.empty(2**30, device="cuda", dtype=torch.float16)  # 2 GiB
    x.normal_()
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    bandwidth = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
    del x, y
    torch.cuda.empty_cache()
    return {"matmul_tflops": matmul, "matmul_dtype": str(dtype).replace("torch.", ""), "matmul_size": size,
            "copy_gbps": bandwidth}


# --------------------------------------------------------------------------- #
# The tuning ladder of lesson 06
# --------------------------------------------------------------------------- #
LADDER_NS = (4096, 16384)


def _course_with(cfg: dict):
    """The lesson-05 launcher with launch options ``cfg`` instead of its defaults."""
    from .kernels import forward

    def run(q, k, v, causal):
        saved = forward.block_config
        forward.block_config = lambda *a, **kw: dict(cfg)
        try:
            return forward.flash_attention_gqa_forward(q, k, v, causal=causal)
        finally:
            forward.block_config = saved

    return run


# Launch options tried for the lesson-05 kernel (BLOCK_M, BLOCK_N, num_warps, num_stages).
COURSE_LAUNCH_GRID = (
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 64, 4, 2),
    (64, 64, 4, 3),
)


def _ladder_steps():
    """(label, what changed, callable(q, k, v, causal) -> output). Each step adds one idea."""
    from .kernels import fast, forward

    fixed = dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
    two_per_sm = dict(fixed, num_stages=2)
    return [
        ("05 as taught", "lesson-05 kernel, its default launch options",
         lambda q, k, v, c: forward.flash_attention_gqa_forward(q, k, v, causal=c)),
        ("05 tuned launch", "same kernel, best of COURSE_LAUNCH_GRID (filled in below)", None),
        ("baseline rewrite", "pointer loads, one masked loop, exp, query blocks in order, 128x64/4 warps/3 stages",
         lambda q, k, v, c: fast.launch(q, k, v, c, use_tma=False, order=fast.ORDER_M_MAJOR, two_phase=False, exp2=False, **fixed)),
        ("+ two-phase causal loop", "mask only the diagonal block",
         lambda q, k, v, c: fast.launch(q, k, v, c, use_tma=False, order=fast.ORDER_M_MAJOR, two_phase=True, exp2=False, **fixed)),
        ("+ exp2, folded scale", "exp2 with sm_scale*log2(e) in one constant",
         lambda q, k, v, c: fast.launch(q, k, v, c, use_tma=False, order=fast.ORDER_M_MAJOR, **fixed)),
        ("+ longest rows first", "heads fastest in the grid, last query blocks first",
         lambda q, k, v, c: fast.launch(q, k, v, c, use_tma=False, order=fast.ORDER_LONGEST_FIRST, **fixed)),
        ("+ TMA descriptors", "tiles copied by the tensor memory accelerator",
         lambda q, k, v, c: fast.launch(q, k, v, c, use_tma=True, order=fast.ORDER_LONGEST_FIRST, **fixed)),
        ("+ two programs per SM", "2 stages instead of 3: 96 KiB of shared memory, so two programs share an SM",
         lambda q, k, v, c: fast.launch(q, k, v, c, order=fast.ORDER_LONGEST_FIRST, **two_per_sm)),
        ("+ GQA groups side by side", "the query heads sharing a K/V head run next to each other (L2 reuse)",
         lambda q, k, v, c: fast.launch(q, k, v, c, order=fast.ORDER_KV_GROUPED, **two_per_sm)),
        ("+ autotune", "best of fast.CONFIG_SPACE per (N, D, causal, dtype)",
         lambda q, k, v, c: fast.attention_forward_fast(q, k, v, causal=c)),
        ("lazy rescale (experiment)", "skip the acc rescale unless the max grew by > 2^8 (autotuned config)",
         lambda q, k, v, c: fast.launch(q, k, v, c, lazy_rescale=True, **_tuned_or_fixed(fast, c, two_per_sm))),
        ("QK^T pipelined by hand (experiment)", "issue the next block's Q K^T before this block's softmax (autotuned config)",
         lambda q, k, v, c: fast.launch(q, k, v, c, pipeline_qk=True, **_tuned_or_fixed(fast, c, two_per_sm))),
    ]


def _tuned_or_fixed(fast, causal, fixed):
    opts = fast.best_launch_options(causal)
    return {k: v for k, v in (opts or fixed).items() if k != "warp_specialize"}


def tuning_ladder(case: Case = STANDARD_SUITE[0], ns=LADDER_NS, log=print) -> dict:
    """Time each step of lesson 06's tuning ladder on ``case`` at each N.

    Also times the lesson-05 kernel at every launch option of
    :data:`COURSE_LAUNCH_GRID` (the best one is the ladder's second step),
    and the flash/cuDNN SDPA backends for scale.
    """
    import torch
    import triton

    out = {"case": dataclasses.asdict(case), "ns": list(ns), "steps": [], "course_grid": [], "sdpa": []}
    steps = _ladder_steps()
    for n in ns:
        q, k, v = make_inputs(case, n, seed=1)
        ref = reference_slice(q, k, v, case.causal)
        b = case.batch(n)
        flops = attention_flops(b, case.n_q_heads, n, case.head_dim, case.causal)

        def timed(fn):
            try:
                res = fn()
                rel, _ = check_output(res, ref)
                del res
                if not rel <= TOLERANCE:
                    return None, rel, "wrong"
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                return tflops(flops, ms), rel, "ok"
            except Exception as exc:
                msg = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
                return None, None, f"error: {type(exc).__name__}: {msg}"

        for name in ("sdpa_flash", "sdpa_cudnn"):
            try:
                fn, note = make_provider(name, q, k, v, case.causal)
                t, rel, status = timed(fn)
            except Exception as exc:
                t, rel, status = None, None, f"error: {type(exc).__name__}"
            out["sdpa"].append(dict(n=n, provider=name, tflops=t, status=status))
            log(f"ladder N={n:<6} {name:<28} {t if t is None else round(t, 1)} {status}")
        best = None
        for cfg in COURSE_LAUNCH_GRID:
            bm, bn, w, s = cfg
            run = _course_with(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s))
            t, rel, status = timed(lambda: run(q, k, v, case.causal))
            out["course_grid"].append(dict(n=n, block_m=bm, block_n=bn, num_warps=w, num_stages=s, tflops=t, status=status))
            log(f"ladder N={n:<6} course {cfg}            {t if t is None else round(t, 1)} {status}")
            if t is not None and (best is None or t > best[0]):
                best = (t, cfg)
        for label, what, fn in steps:
            if fn is None:  # the tuned course launch, from the grid above
                t, detail = (best[0], "BLOCK_M={}, BLOCK_N={}, num_warps={}, num_stages={}".format(*best[1])) if best else (None, "")
                out["steps"].append(dict(n=n, step=label, what=what, tflops=t, status="ok" if best else "error", detail=detail))
                log(f"ladder N={n:<6} {label:<28} {t if t is None else round(t, 1)} {detail}")
                continue
            t, rel, status = timed(lambda: fn(q, k, v, case.causal))
            detail = ""
            if label.startswith("+ autotune"):
                from .kernels import fast

                detail = fast.best_config(case.causal) or ""
            out["steps"].append(dict(n=n, step=label, what=what, tflops=t, status=status, rel_err=rel, detail=detail))
            log(f"ladder N={n:<6} {label:<28} {t if t is None else round(t, 1)} {status} {detail}")
        del q, k, v
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- #
# Writing results
# --------------------------------------------------------------------------- #
def environment_info() -> dict:
    """GPU name, versions and date, recorded next to every result."""
    info = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = torch.cuda.get_device_name()
            info["capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
            info["sm_count"] = p.multi_processor_count
            info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
            info["cudnn"] = torch.backends.cudnn.version()
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def ratio_table(rows: list[dict]) -> dict:
    """``{(case, n): {"fast/sdpa_flash": x, ...}}`` from the rows' TFLOP/s."""
    by = {}
    for r in rows:
        by.setdefault((r["case"], r["n"]), {})[r["provider"]] = r["tflops"]
    out = {}
    for key, t in by.items():
        out[key] = {
            f"{a}/{b}": (t[a] / t[b]) if t.get(a) and t.get(b) else None for a, b in RATIOS
        }
    return out


def _cell(row: dict | None, field: str, fmt: str) -> str:
    if row is None:
        return "-"
    if row.get(field) is None:
        return row.get("status", "-") if row.get("status") != "ok" else "-"
    return format(row[field], fmt)


def markdown_tables(rows: list[dict], cases: list[dict] | None = None, info: dict | None = None) -> str:
    """The results as markdown: per case, TFLOP/s with ratio columns, then peak memory."""
    lines = []
    if info:
        lines.append(
            f"Measured on {info.get('gpu', '?')} ({info.get('date', '?')}): torch {info.get('torch', '?')}, "
            f"triton {info.get('triton', '?')}, CUDA {info.get('cuda', '?')}, cuDNN {info.get('cudnn', '?')}. "
            "Forward pass, median of `triton.testing.do_bench`; TFLOP/s = 4·B·Hq·N²·D / time, halved when causal."
        )
        lines.append("")
    titles = {c["name"]: c for c in (cases or [])}
    ratios = ratio_table(rows)
    case_names = list(dict.fromkeys(r["case"] for r in rows))
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    for name in case_names:
        crows = [r for r in rows if r["case"] == name]
        c = titles.get(name)
        title = Case(**{**c, "ns": tuple(c["ns"])}).title() if c else name
        lines.append(f"### {name}: {title}")
        lines.append("")
        head = ["N", "B"] + [LABELS[p] for p in providers] + [f"{a}/{b.replace('sdpa_', '')}" for a, b in RATIOS]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---:|" * len(head))
        for n in list(dict.fromkeys(r["n"] for r in crows)):
            at = {r["provider"]: r for r in crows if r["n"] == n}
            b = next(iter(at.values()))["batch"]
            cells = [str(n), str(b)] + [_cell(at.get(p), "tflops", ".0f") for p in providers]
            for a, bb in RATIOS:
                x = ratios.get((name, n), {}).get(f"{a}/{bb}")
                cells.append("-" if x is None else f"{x:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(f"Peak memory per call (MiB, output included), {name}:")
        lines.append("")
        head = ["N"] + [LABELS[p] for p in providers]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---:|" * len(head))
        for n in list(dict.fromkeys(r["n"] for r in crows)):
            at = {r["provider"]: r for r in crows if r["n"] == n}
            lines.append("| " + " | ".join([str(n)] + [_cell(at.get(p), "peak_mib", ".0f") for p in providers]) + " |")
        lines.append("")
        notes = sorted({f"{LABELS[r['provider']]}: {r['note']}" for r in crows if r["note"] and r["provider"] != "fast"})
        configs = [f"N={r['n']}: {r['note']}" for r in crows if r["provider"] == "fast" and r["note"]]
        if configs:
            lines.append("Fast kernel's autotuned configs: " + "; ".join(configs) + ".")
            lines.append("")
        for note in notes:
            lines.append(f"- {note}")
        if notes:
            lines.append("")
    return "\n".join(lines)


def ladder_markdown(ladder: dict) -> str:
    """The tuning ladder as a markdown table (TFLOP/s per step and N)."""
    ns = ladder["ns"]
    lines = ["### Tuning ladder (main case): each step adds one idea", ""]
    lines.append("| step | what changed | " + " | ".join(f"N={n}" for n in ns) + " |")
    lines.append("|---|---|" + "---:|" * len(ns))
    steps = list(dict.fromkeys(s["step"] for s in ladder["steps"]))
    for step in steps:
        cells, what = [], ""
        for n in ns:
            s = next((s for s in ladder["steps"] if s["step"] == step and s["n"] == n), None)
            what = s["what"] if s else what
            if s and s.get("detail") and step == "05 tuned launch":
                what = f"same kernel, {s['detail']}"
            cells.append(f"{s['tflops']:.0f}" if s and s["tflops"] else (s["status"][:20] if s else "-"))
        lines.append(f"| {step} | {what} | " + " | ".join(cells) + " |")
    for name in ("sdpa_flash", "sdpa_cudnn"):
        cells = []
        for n in ns:
            s = next((s for s in ladder["sdpa"] if s["provider"] == name and s["n"] == n), None)
            cells.append(f"{s['tflops']:.0f}" if s and s["tflops"] else "-")
        lines.append(f"| {LABELS[name]} | for scale | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in CSV_FIELDS})


def read_csv(path: Path) -> list[dict]:
    """Rows of a results CSV, with numbers as numbers and empty cells as ``None``."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = dict(r)
            for k in ("batch", "n_q_heads", "n_kv_heads", "n", "head_dim"):
                row[k] = int(row[k])
            for k in ("ms", "tflops", "peak_mib", "rel_err"):
                row[k] = float(row[k]) if row[k] not in ("", "None") else None
            row["causal"] = row["causal"] == "True"
            out.append(row)
    return out


def plot_results(rows: list[dict], path: Path, cases: list[dict] | None = None) -> None:
    """TFLOP/s against N for every case, and the main case's peak memory, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    case_names = list(dict.fromkeys(r["case"] for r in rows))
    panels = len(case_names) + 1
    cols = 3 if panels > 2 else panels
    nrows = math.ceil(panels / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    titles = {c["name"]: c for c in (cases or [])}
    styles = {"naive": ":", "sdpa_flash": "--", "sdpa_cudnn": "--", "course": "-", "fast": "-"}
    for ax, name in zip(axes.flat, case_names):
        for p in PROVIDERS:
            pts = [(r["n"], r["tflops"]) for r in rows if r["case"] == name and r["provider"] == p and r["tflops"]]
            if pts:
                ax.plot(*zip(*pts), styles[p], marker="o", label=LABELS[p], lw=2.2 if p == "fast" else 1.4)
        c = titles.get(name)
        ax.set_title(Case(**{**c, "ns": tuple(c["ns"])}).title() if c else name, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    ax = axes.flat[len(case_names)]
    main = case_names[0]
    for p in PROVIDERS:
        pts = [(r["n"], r["peak_mib"]) for r in rows if r["case"] == main and r["provider"] == p and r["peak_mib"]]
        if pts:
            ax.plot(*zip(*pts), styles[p], marker="o", label=LABELS[p])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{main}: peak memory per call", fontsize=9)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("MiB")
    ax.grid(alpha=0.3)
    for extra in list(axes.flat)[panels:]:
        extra.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(rows, out_dir, info=None, cases=None, ceilings=None, ladder=None, stem=STEM, plot=True) -> dict:
    """Write CSV, JSON, markdown (and the PNG plot) for ``rows``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = [dataclasses.asdict(c) if isinstance(c, Case) else c for c in (cases or [])]
    for c in cases:
        c["ns"] = list(c["ns"])
    paths = {k: out_dir / f"{stem}.{k}" for k in ("csv", "json", "md", "png")}
    write_csv(rows, paths["csv"])
    doc = {"info": info or {}, "cases": cases, "ceilings": ceilings, "rows": rows, "ladder": ladder}
    paths["json"].write_text(json.dumps(doc, indent=1))
    md = markdown_tables(rows, cases, info)
    if ceilings:
        md += (f"\nMachine ceilings: {ceilings['matmul_dtype']} {ceilings['matmul_size']}³ matmul "
               f"{ceilings['matmul_tflops']:.0f} TFLOP/s, device copy {ceilings['copy_gbps']:.0f} GB/s.\n")
    if ladder:
        md += "\n" + ladder_markdown(ladder)
    paths["md"].write_text(md)
    if plot and rows:
        try:
            plot_results(rows, paths["png"], cases)
        except ImportError:
            paths.pop("png")
    else:
        paths.pop("png")
    return paths


def recorded_results_path() -> Path | None:
    """Where the shipped results are: ``results/`` in a checkout, else ``course_utils/data/``."""
    for folder in (RESULTS_DIR, Path(__file__).resolve().parent / "data"):
        if (folder / f"{STEM}.json").is_file():
            return folder / f"{STEM}.json"
    return None


def load_results(path: Path | str | None = None) -> dict:
    """The recorded results (``info``, ``cases``, ``ceilings``, ``rows``, ``ladder``)."""
    path = path or recorded_results_path()
    if path is None:
        raise FileNotFoundError(
            f"no recorded results: {RESULTS_DIR / (STEM + '.json')} is missing (run `python -m course_utils.bench` on a GPU)"
        )
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- #
# Forward + backward (lesson 07's kernels behind torch.autograd)
# --------------------------------------------------------------------------- #
TRAIN_STEM = "training_bench"
TRAIN_PROVIDERS = ("sdpa_flash", "sdpa_cudnn", "course")
TRAIN_LABELS = {"sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN", "course": "course (kernels.flash_attention)"}
BACKWARD_FLOP_FACTOR = 2.5  # the backward does 5 matmuls to the forward's 2


def training_flops(batch: int, n_heads: int, n: int, head_dim: int, causal: bool) -> float:
    """FLOPs of forward + backward: the forward's count times (1 + 2.5)."""
    return (1 + BACKWARD_FLOP_FACTOR) * attention_flops(batch, n_heads, n, head_dim, causal)


def make_training_step(name: str, q, k, v, do, causal: bool):
    """A zero-argument callable: forward, then backward with ``do``; returns ``(o, dq, dk, dv)``.

    ``q, k, v`` must require grad; their ``.grad`` is reset at each call so
    every call does the same work.
    """
    import torch.nn.functional as F

    if name == "course":
        from .kernels import flash_attention

        def forward():
            return flash_attention(q, k, v, causal=causal)
    elif name in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(name)

        def forward():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    else:
        raise ValueError(f"unknown training provider {name!r}")

    def step():
        q.grad = k.grad = v.grad = None
        o = forward()
        o.backward(do)
        return o, q.grad, k.grad, v.grad

    return step


def run_training_case(case: Case, providers=TRAIN_PROVIDERS, log=print) -> list[dict]:
    """Forward + backward of every provider at every N of ``case``.

    Every provider's output and gradients are compared with SDPA flash's
    (relative error of the norm) before it is timed; a mismatch is reported
    as ``wrong`` and not timed.
    """
    import torch
    import triton

    rows = []
    for n in case.ns:
        q, k, v = (t.requires_grad_() for t in make_inputs(case, n))
        do = torch.randn_like(q)
        b = case.batch(n)
        base = None
        for name in providers:
            row = dict(case=case.name, provider=name, dtype=case.dtype, causal=case.causal, batch=b,
                       n_q_heads=case.n_q_heads, n_kv_heads=case.n_kv_heads, n=n, head_dim=case.head_dim,
                       ms=None, tflops=None, peak_mib=None, status="ok", rel_err=None, note="")
            try:
                step = make_training_step(name, q, k, v, do, case.causal)
                got = [t.detach().float() for t in step()]
                if base is None:
                    base = got
                else:
                    row["rel_err"] = max(
                        (torch.linalg.vector_norm(a - r) / torch.linalg.vector_norm(r)).item() for a, r in zip(got, base)
                    )
                del got
                if row["rel_err"] is not None and not row["rel_err"] <= TOLERANCE:
                    row["status"] = "wrong"
                else:
                    row["ms"] = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
                    row["tflops"] = tflops(training_flops(b, case.n_q_heads, n, case.head_dim, case.causal), row["ms"])
            except Exception as exc:  # one provider failing must not stop the sweep
                row["status"] = "OOM" if is_oom(exc) else "error"
                row["note"] = f"{type(exc).__name__}: {str(exc).strip()[:160]}"
            rows.append(row)
            log(format_row(row))
        del q, k, v, do, base
        torch.cuda.empty_cache()
    return rows


def training_markdown(rows: list[dict], case: Case, info: dict | None = None) -> str:
    """The forward + backward table: ms, TFLOP/s and the ratios against SDPA."""
    info = info or {}
    lines = [
        f"### Forward + backward: {case.title()}",
        "",
        f"Measured on {info.get('gpu', '?')} ({info.get('date', '?')}): torch {info.get('torch', '?')}, "
        f"triton {info.get('triton', '?')}. Median of `triton.testing.do_bench` over forward + backward; "
        f"TFLOP/s counts the backward as {BACKWARD_FLOP_FACTOR}x the forward, halved when causal. Outputs and "
        "gradients checked against SDPA flash's before timing.",
        "",
        "| N | B | " + " | ".join(f"{TRAIN_LABELS[p]} ms (TFLOP/s)" for p in TRAIN_PROVIDERS)
        + " | course / flash | course / cuDNN |",
        "|---:|---:|" + "---:|" * (len(TRAIN_PROVIDERS) + 2),
    ]
    by = {(r["n"], r["provider"]): r for r in rows}
    for n in sorted({r["n"] for r in rows}):
        cells = []
        for p in TRAIN_PROVIDERS:
            r = by.get((n, p))
            cells.append(f"{r['ms']:.2f} ({r['tflops']:.0f})" if r and r["ms"] else (r["status"] if r else "-"))

        def ratio(other):
            a, o = by.get((n, "course")), by.get((n, other))
            return f"{o['ms'] / a['ms']:.2f}x" if a and o and a["ms"] and o["ms"] else "-"

        lines.append(f"| {n} | {case.batch(n)} | " + " | ".join(cells) + f" | {ratio('sdpa_flash')} | {ratio('sdpa_cudnn')} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #
def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m course_utils.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder for the CSV/JSON/markdown/PNG (default: results/)")
    p.add_argument("--causal", dest="causal", action="store_true", default=None, help="causal mask (one custom case)")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="no mask (one custom case)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), help="input dtype (one custom case)")
    p.add_argument("--heads", help="query/kv heads, e.g. 32/8 (one custom case)")
    p.add_argument("--dim", type=int, help="head dim (one custom case)")
    p.add_argument("--tokens", type=int, help="batch x N, fixed across N (default 16384)")
    p.add_argument("--n", help="comma-separated sequence lengths (default 1024,...,16384)")
    p.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {','.join(PROVIDERS)}")
    p.add_argument("--quick", action="store_true", help="main case only, N in 1024,4096, short timing")
    p.add_argument("--ladder", action="store_true", help="also time lesson 06's tuning ladder")
    p.add_argument("--no-ceilings", action="store_true", help="skip the matmul / copy ceilings")
    p.add_argument("--training", action="store_true",
                   help="forward + backward of the main case (writes training_bench.*) instead of the forward sweep")
    p.add_argument("--replot", metavar="DIR", help="re-render markdown and PNG from DIR/forward_bench.json (no GPU)")
    return p.parse_args(argv)


def cases_from_args(args) -> list[Case]:
    """The sweep the options ask for: the standard suite, or one custom case."""
    ns = tuple(int(x) for x in args.n.split(",")) if args.n else (QUICK_NS if args.quick else DEFAULT_NS)
    custom = any(x is not None for x in (args.causal, args.dtype, args.heads, args.dim))
    if args.quick and not custom:
        suite = [STANDARD_SUITE[0]]
    elif custom:
        base = STANDARD_SUITE[0]
        hq, hkv = (int(x) for x in args.heads.split("/")) if args.heads else (base.n_q_heads, base.n_kv_heads)
        suite = [dataclasses.replace(
            base, name="custom", causal=base.causal if args.causal is None else args.causal,
            dtype=args.dtype or base.dtype, n_q_heads=hq, n_kv_heads=hkv, head_dim=args.dim or base.head_dim,
        )]
    else:
        suite = list(STANDARD_SUITE)
    return [dataclasses.replace(c, ns=ns, tokens=args.tokens or c.tokens) for c in suite]


def main(argv=None) -> int:
    args = _parse(argv)
    if args.replot:
        doc = load_results(Path(args.replot) / f"{STEM}.json")
        paths = write_results(doc["rows"], args.replot, doc["info"], doc["cases"], doc.get("ceilings"), doc.get("ladder"))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    if not gpu_available():
        print(NO_GPU_MESSAGE)
        return 0
    import course_utils  # noqa: F401  (environment first, before Triton)

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        print(f"unknown providers: {', '.join(sorted(unknown))} (choose from {', '.join(PROVIDERS)})")
        return 2
    cases = cases_from_args(args)
    info = environment_info()
    print(f"{info.get('gpu')} | torch {info.get('torch')} | triton {info.get('triton')} | {info['date']}", flush=True)
    if args.training:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = run_training_case(cases[0], log=lambda line: print(line, flush=True))
        write_csv(rows, out / f"{TRAIN_STEM}.csv")
        (out / f"{TRAIN_STEM}.json").write_text(json.dumps({"info": info, "case": dataclasses.asdict(cases[0]), "rows": rows}, indent=1))
        md = training_markdown(rows, cases[0], info)
        (out / f"{TRAIN_STEM}.md").write_text(md)
        print(md)
        return 0
    ceilings = None if args.no_ceilings else measure_ceilings()
    if ceilings:
        print(f"ceilings: matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_gbps']:.0f} GB/s", flush=True)
    rows = []
    out = Path(args.out)

    def log(line):
        print(line, flush=True)

    for case in cases:
        rows += run_case(case, providers, quick=args.quick, log=log)
        write_results(rows, out, info, cases, ceilings, plot=False)  # keep what we have so far
    ladder = tuning_ladder(log=log) if args.ladder else None
    if "fast" in providers:
        from .kernels import fast

        info["fast_kernel"] = {
            "warp_specialization": {("causal" if c else "non-causal"): on for c, on in fast._WS_STATE["enabled"].items()},
            "warp_specialization_errors": {("causal" if c else "non-causal"): e for c, e in fast._WS_STATE["error"].items()},
            "autotune_error": fast._TUNE_STATE["error"],
        }
    paths = write_results(rows, out, info, cases, ceilings, ladder)
    print(markdown_tables(rows, [dataclasses.asdict(c) for c in cases]))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
