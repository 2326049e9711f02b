"""Checking each provider's output against a reference, then timing it; the machine's ceilings."""

from __future__ import annotations

import math

from .cases import LESSON11_PROVIDERS, PROVIDERS, TOLERANCE, Case, attention_flops, make_inputs, tflops
from .providers import make_provider

LSE_TOLERANCE = 5e-2  # the largest |lse error| a provider that returns lse may have against the float32 reference


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
    rel = relative_error(o_s, o_ref)
    lse_err = None
    if lse is not None:
        lse_s = torch.stack([lse[0, h, idx].float() for h in heads])
        lse_err = (lse_s - lse_ref).abs().max().item()
    return rel, lse_err


def relative_error(got, want) -> float:
    """``|got - want| / |want|`` (vector norms, in float32); infinity where that is not a finite number."""
    import torch

    want = want.float()
    rel = (torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want)).item()
    return rel if math.isfinite(rel) else float("inf")


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


def tolerance(name: str) -> float:
    """The relative error provider ``name`` may have against the float32 reference: ``TOLERANCE``, and for lesson
    11's providers ``bench fp8``'s (e4m3 inputs and P: looser)."""
    if name in LESSON11_PROVIDERS:
        from .fp8 import tolerance as fp8_tolerance

        return fp8_tolerance(name)
    return TOLERANCE


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def record_failure(row: dict, exc: BaseException) -> None:
    """Say in ``row`` why a provider was not timed: ``OOM`` (the GPU's memory, or the host's), ``n/a`` (a provider
    that cannot express the case raises a ValueError that says it is "not timed"), else ``error`` with the
    exception's first line."""
    if isinstance(exc, MemoryError) or is_oom(exc):
        row["status"], row["note"] = "OOM", str(exc)[:120] if isinstance(exc, MemoryError) else "out of memory"
    elif isinstance(exc, ValueError) and "not timed" in str(exc):
        row["status"], row["note"] = "n/a", str(exc)[:120]
    else:
        text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        row["status"], row["note"] = "error", f"{type(exc).__name__}: {text}"


def time_checked_forward(row: dict, make, ref, flops: float, warmup=25, rep=100, tol=TOLERANCE) -> dict:
    """Fill ``row`` for one forward provider of lessons 08 and 12's benches: ``make()`` builds the call, its
    output (``o`` or ``(o, lse)``) is checked against ``ref`` (:func:`reference_slice`'s tuple) and timed only if
    right, ``flops`` counting the visible pairs. A failure is recorded, not raised (:func:`record_failure`)."""
    import torch
    import triton

    try:
        fn = make()
        result = fn()  # compiles
        rel, lse_err = check_output(result, ref)
        del result
        row["rel_err"] = rel
        lse_wrong = lse_err is not None and lse_err > LSE_TOLERANCE
        if not rel <= tol or lse_wrong:
            row["status"] = "wrong"
            row["note"] = f"lse off by {lse_err:.3g}" if lse_wrong else ""
            return row
        row["ms"] = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        row["tflops"] = tflops(flops, row["ms"])
    except Exception as exc:  # one provider failing must not stop the sweep
        record_failure(row, exc)
    finally:
        torch.cuda.empty_cache()
    return row


def time_checked_training(row: dict, make, flops: float, *, ref=None, want=None, grads_error=None, baseline=None,
                          baseline_note="checked against FlexAttention", warmup=25, rep=100,
                          tol=TOLERANCE) -> tuple[dict, tuple | None]:
    """Fill ``row`` for one forward + backward provider of lessons 08 and 12's benches; returns ``(row, got)``.

    ``make()`` builds the step, which returns ``(o, dq, dk, dv, ...)`` (None where a provider has no such
    gradient). ``ref``: the forward's float32 slice, always checked first; ``want``: the float32 gradients of the
    first GQA group, compared by ``grads_error(got, want)``; where there is none (large N), ``baseline`` (another
    provider's ``got``, FlexAttention's) is compared instead and ``baseline_note`` added to the row's note. Timed
    only if right; ``got`` is None unless it was.
    """
    import torch
    import triton

    got = None
    try:
        step = make()
        got = tuple(None if t is None else t.detach() for t in step())
        if ref is not None:
            rel_o = check_output(got[0], ref)[0]
            if not rel_o <= tol:
                row["status"], row["rel_err"], row["note"] = "wrong", rel_o, "the forward output o"
                return row, None
        if want is not None:
            row["rel_err"] = grads_error(got, want)
        elif baseline is not None:
            row["rel_err"] = max(relative_error(a, b) for a, b in zip(got, baseline) if a is not None and b is not None)
            row["note"] = (row["note"] + "; " if row["note"] else "") + baseline_note
        if row["rel_err"] is not None and not row["rel_err"] <= tol:
            row["status"] = "wrong"
            return row, None
        row["ms"] = triton.testing.do_bench(step, warmup=warmup, rep=rep, return_mode="median")
        row["tflops"] = tflops(flops, row["ms"])
    except Exception as exc:  # one provider failing must not stop the sweep
        record_failure(row, exc)
        got = None
    finally:
        torch.cuda.empty_cache()
    return row, got


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
        if lse_err is not None and lse_err > LSE_TOLERANCE:
            row["status"], row["note"] = "wrong", f"lse off by {lse_err:.3g}"
            return row
        if not rel <= tolerance(name):
            row["status"] = "wrong"
            return row
        row["peak_mib"] = peak_memory_mib(fn)
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        row["ms"] = ms
        row["tflops"] = tflops(attention_flops(b, case.n_q_heads, n, case.head_dim, case.causal), ms)
        if name == "fast":
            from ..kernels import fast

            row["note"] = row["note"] or (fast.best_config(case.causal) or "")
    except Exception as exc:  # one provider failing must not stop the sweep
        record_failure(row, exc)
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
