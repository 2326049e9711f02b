"""Checks for lesson 06 (measuring performance): counting FLOPs, the roofline.

Both exercises are small formulas, so the checks grade them on many fixed
and random cases at once and recognise the usual slips: a causal count not
halved, one matmul counted instead of two, a missing batch or head factor,
the roofline's ``min`` written as ``max``, GB/s not turned into TFLOP/s.
"""

from __future__ import annotations

import numbers

import numpy as np

from .core import Diagnosis, Run

__all__ = ["check_attention_flops", "check_roofline"]


def _number(run: Run, out, case: str) -> float:
    """The learner's scalar answer as a float, or one plain sentence."""
    if out is None:
        raise run.fail("your function returned None: did you forget a `return`?", case)
    if isinstance(out, bool) or not isinstance(out, (numbers.Real, np.floating, np.integer)):
        raise run.fail(f"your function returned a {type(out).__name__}; return a number.", case)
    return float(out)


def _flops(b, h, n, d, causal):
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def check_attention_flops(fn, *, seed=None):
    """Grade ``fn(batch, n_heads, n, head_dim, causal) -> FLOPs`` of one attention forward.

    ``4 * batch * n_heads * n**2 * head_dim``, halved when causal. Fixed
    cases, then fresh random ones (batch 1-16, heads 1-64, N up to 32k,
    head dims 16-256).
    """
    __tracebackhide__ = True
    run = Run("check_attention_flops", seed)
    cases = [(4, 32, 4096, 128, True), (1, 8, 1000, 64, False), (3, 5, 7, 16, False), (2, 1, 64, 16, True)]
    for _ in range(12):
        cases.append((int(run.rng.integers(1, 17)), int(run.rng.integers(1, 65)), int(run.rng.integers(1, 32769)),
                      int(run.rng.choice([16, 32, 64, 80, 96, 128, 256])), bool(run.rng.integers(0, 2))))
    got, want, names = [], [], []
    for b, h, n, d, causal in cases:
        case = f"batch={b}, n_heads={h}, n={n}, head_dim={d}, causal={causal}"
        got.append(_number(run, run.call(fn, b, h, n, d, causal, case=case), case))
        want.append(_flops(b, h, n, d, causal))
        names.append(case)
    got, want = np.array(got), np.array(want)
    causal = np.array([c[4] for c in cases])
    b = np.array([c[0] for c in cases], dtype=float)
    h = np.array([c[1] for c in cases], dtype=float)
    n = np.array([c[2] for c in cases], dtype=float)
    d = np.array([c[3] for c in cases], dtype=float)
    diagnoses = [
        Diagnosis("the causal count is not halved: with the mask only the lower triangle of S is useful work, "
                  "and the convention counts exactly half.", expected=want * np.where(causal, 2, 1)),
        Diagnosis("this is half the count: either only one matmul is counted (there are two, S = Q K^T and "
                  "O = P V) or a multiply-add is counted as one FLOP (it is two): 4 * B * H * N^2 * D.",
                  expected=want / 2),
        Diagnosis("the batch size is missing.", expected=want / b),
        Diagnosis("the number of heads is missing.", expected=want / h),
        Diagnosis("the causal count is the exact lower triangle, N(N+1)/2 per row block; the convention "
                  "(and the benchmark's) is exactly half of N^2.",
                  expected=np.where(causal, 4.0 * b * h * d * n * (n + 1) / 2, want)),
        Diagnosis("the head dim enters squared or not at all: it is D (the length of the dot products).",
                  expected=want / d),
    ]
    bad = ~np.isclose(got, want, rtol=1e-9, atol=0)
    first = int(np.argmax(bad)) if bad.any() else 0
    run.compare(got, want, case=names[first] if bad.any() else "all", what="the FLOP count", atol=0, rtol=1e-9,
                diagnoses=diagnoses, axes=("case",))
    return run.passed()


def check_roofline(fn, *, seed=None):
    """Grade ``fn(intensity, peak_tflops, bandwidth_gbps) -> TFLOP/s``, the roofline.

    ``min(peak_tflops, intensity * bandwidth_gbps / 1000)``: a kernel doing
    ``intensity`` FLOPs per byte moved cannot beat the bandwidth times that,
    nor the peak. Fixed cases on both sides of the ridge, then random ones.
    """
    __tracebackhide__ = True
    run = Run("check_roofline", seed)
    # The last one is so memory-bound that even a GB/s-for-TB/s slip stays below the peak.
    cases = [(10.0, 800.0, 4000.0), (1000.0, 800.0, 4000.0), (200.0, 800.0, 4000.0), (0.5, 65.0, 300.0), (0.01, 800.0, 4000.0)]
    for _ in range(12):
        peak = float(run.rng.uniform(10, 1000))
        bw = float(run.rng.uniform(100, 5000))
        ridge = peak * 1000 / bw
        cases.append((float(ridge * run.rng.choice([0.01, 0.3, 0.9, 1.5, 10.0])), peak, bw))
    got, want = [], []
    for intensity, peak, bw in cases:
        case = f"intensity={intensity:.4g} FLOP/byte, peak={peak:.4g} TFLOP/s, bandwidth={bw:.4g} GB/s"
        got.append(_number(run, run.call(fn, intensity, peak, bw, case=case), case))
        want.append(min(peak, intensity * bw / 1000))
    got, want = np.array(got), np.array(want)
    i, p, bw = (np.array([c[k] for c in cases]) for k in range(3))
    diagnoses = [
        Diagnosis("this is max(...): the roofline is the LOWER of the two limits, min(peak, intensity x bandwidth).",
                  expected=np.maximum(p, i * bw / 1000)),
        Diagnosis("the units: intensity (FLOP/byte) x bandwidth (GB/s) is GFLOP/s; divide by 1000 for TFLOP/s.",
                  expected=np.minimum(p, i * bw)),
        Diagnosis("the peak caps nothing here: memory-bound kernels are below the slope, compute-bound ones at "
                  "the peak; use min(peak, intensity x bandwidth).", expected=i * bw / 1000),
        Diagnosis("this always returns the peak: below the ridge point the bandwidth is the limit.", expected=p),
    ]
    run.compare(got, want, case="the roofline cases", what="the attainable TFLOP/s", atol=1e-9, rtol=1e-9,
                diagnoses=diagnoses, axes=("case",))
    return run.passed()
