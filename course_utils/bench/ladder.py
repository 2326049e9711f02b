"""The tuning ladder of lesson 06: each step adds one idea, timed on the main case."""

from __future__ import annotations

import dataclasses

from .cases import STANDARD_SUITE, TOLERANCE, Case, attention_flops, make_inputs, tflops
from .measure import check_output, reference_slice
from .providers import make_provider

LADDER_NS = (4096, 16384)


def course_with_options(cfg: dict):
    """The lesson-05 launcher with launch options ``cfg`` instead of its defaults.

    ``cfg`` has ``BLOCK_M``, ``BLOCK_N``, ``num_warps`` and ``num_stages``; the
    result is called as ``run(q, k, v, causal)``. Lesson 06 uses it to let the
    learner try configurations of their lesson-05 kernel on a GPU.
    """
    from ..kernels import forward

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


_course_with = course_with_options  # the name the ladder used first


def _ladder_steps():
    """(label, what changed, callable(q, k, v, causal) -> output). Each step adds one idea."""
    from ..kernels import fast, forward

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
                from ..kernels import fast

                detail = fast.best_config(case.causal) or ""
            out["steps"].append(dict(n=n, step=label, what=what, tflops=t, status=status, rel_err=rel, detail=detail))
            log(f"ladder N={n:<6} {label:<28} {t if t is None else round(t, 1)} {status} {detail}")
        del q, k, v
        torch.cuda.empty_cache()
    return out
