"""Time lesson 08's window/sink forward kernel at fixed launch configurations, beside FlexAttention.

The window kernel launches with :func:`course_utils.kernels.forward.block_config`'s
choice (lesson 05's 128 x 64 tiles, 8 warps, 3 stages). This script times it
at other tile sizes, warp counts and pipeline depths, on the benchmark's heads
(bf16, causal, GQA 32/8, D = 128, batch 1), against compiled FlexAttention
with the same block mask in the same run, each output checked against a
float32 reference first. TFLOP/s count visible (query, key) pairs only.

    python benchmarks/tune_window.py [--n 16384] [--out results/tune_window.json]

With ``--fast`` it times the window forward on lesson 06's machinery instead
(``course_utils.kernels.fast_window``: TMA, one warpgroup per program, GQA
groups side by side) at the ``FAST_CANDIDATES`` launches and the warp-specialised
``FAST_WS_CANDIDATES``, beside the lesson kernel's
shipped launch and FlexAttention.

With ``--backward`` it times the window backward instead: lesson 08's kernels
at other ``BackwardConfig`` launches (tiles, warps, stages), forward +
backward, against FlexAttention's forward + backward, the gradients of the
first GQA group checked against float32 autograd first.

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import course_utils  # noqa: F401  (first, as in every notebook)
from course_utils import bench

# (block_m, block_n, num_warps, num_stages); None = block_config's choice
CANDIDATES = [
    None,
    (128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2),
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3),
]

# fast_window.launch's (block_m, block_n, num_warps, num_stages); None = fast_window.hopper_config's choice
FAST_CANDIDATES = [
    None,
    (128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 2),
]

# fast_window.launch's warp-specialised one-warpgroup launches (twenty-sixth session, not yet timed; with sinks since
# the twenty-seventh, the sink tiles and the band in one loop): every tile masked in one loop, compiled for sm_90
# with triton 3.6 into a producer and two consumer warpgroups, 12 warps of 168 registers, no spills
# (results/sm90_compiles.json's ws_window_forward, S = 0 and 4).
# On the H200 they deadlock (results/ws_smoke_h200.txt): refused there, fast.refuse_specialised_on_gpu.
FAST_WS_CANDIDATES = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2)]

# BackwardConfig(dkdv_block_m, dkdv_block_n, dq_block_m, dq_block_n, dkdv_warps, dkdv_stages, dq_warps, dq_stages)
# Compiled as the H200 does (triton 3.6, course_utils.kernels.targets), the window dK/dV kernel spills at W = 1024
# (values per thread): 98 at 32 x 64 on 4 warps (the shipped launch for W <= 1024, and the fastest in
# results/tune_window.json), 30 at 32 x 128 on 8 warps, 144 at 64 x 128 on 8 warps (W = 4096's). The last four
# (twenty-sixth session, not yet timed) spill less or nothing there: 16 x 64 on 4 warps 16 (2 stages) or 40
# (3 stages), two programs per SM; 16 x 64 on 8 warps none (240 registers); 32 x 128 on 8 warps, 2 stages, none.
BACKWARD_CANDIDATES = [
    None,
    (64, 128, 128, 64, 8, 3, 8, 3), (32, 128, 128, 32, 8, 3, 8, 3), (64, 128, 128, 32, 8, 2, 8, 2),
    (64, 64, 64, 64, 4, 3, 4, 3), (32, 64, 64, 32, 4, 3, 4, 3),
    (16, 64, 64, 32, 4, 2, 4, 3), (16, 64, 64, 32, 4, 3, 4, 3), (16, 64, 64, 32, 8, 2, 4, 3),
    (32, 128, 128, 32, 8, 2, 8, 3),
]


# fast_backward's flat mode with a window (twenty-sixth session, not yet timed; no sinks, so S = 0 only): the dK/dV
# kernel over one TMA loop, lesson 08's dQ. Compiled for sm_90 with triton 3.6 at W = 1024, none spills (lesson 08's
# dK/dV kernel spills 98 at its shipped launch there); (mode, block_m1, block_n1, block_m2, block_n2, warps, stages,
# use_tma, warp_specialize[, flat_dq]) as fast_backward.FastBackwardConfig takes them.
FLAT_BACKWARD_CANDIDATES = [
    ("flat", 32, 128, 128, 32, 4, 2, True, True),
    ("flat", 32, 64, 128, 32, 4, 2, True, True),
    ("flat", 64, 128, 128, 32, 8, 3, True),
    ("flat", 32, 128, 128, 32, 8, 2, True),
    # with the flat mode's own dQ kernel (flat_dq, specialised too; twenty-seventh session, not yet timed)
    ("flat", 32, 128, 128, 32, 4, 2, True, True, True),
    ("flat", 32, 64, 128, 64, 4, 2, True, True, True),
]


def _time_all(fns, error_of, flops, title, **key) -> list[dict]:
    """Check each ``(label, fn)`` (``error_of(fn())`` at most 2e-2), time it, print them fastest first.

    ``fns[0]`` is FlexAttention, the one the others are compared with.
    """
    import triton

    results = []
    for label, fn in fns:
        try:
            err = error_of(fn())
            if not err <= 2e-2:
                raise RuntimeError(f"wrong: relative error {err:.2e}")
            ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
            results.append(dict(key, name=label, ms=ms, tflops=flops / ms * 1e-9))
        except Exception as exc:  # one configuration failing must not stop the sweep
            msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
            results.append(dict(key, name=label, ms=None, note=f"{type(exc).__name__}: {msg}"))
    flex = results[0]
    print(f"\n== {title}")
    for r in sorted(results, key=lambda r: r["ms"] or 1e9):
        if r["ms"] is None:
            print(f"  {r['name']:<60} {r['note']}")
        else:
            vs = f" {flex['ms'] / r['ms']:.2f}x Flex" if flex["ms"] else ""
            print(f"  {r['name']:<60} {r['ms']:.3f} ms {r['tflops']:5.0f} TFLOP/s{vs}")
    return results


def _forward_rows(n, windows, sinks, fast=False) -> list[dict]:
    from course_utils.bench import window as wb
    from course_utils.kernels import fast_window, forward

    q, k, v = wb.make_inputs(n)
    rows = []
    for w in windows:
        for s in sinks:
            ref = wb.reference_forward(q, k, v, w, s)
            fns = [("flex", wb.make_forward("flex", q, k, v, wb.WindowCase(w, s, n)))]
            for c in ([None] if fast else CANDIDATES):
                opts = {} if c is None else dict(block_m=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3])
                label = "course, shipped launch" if c is None else f"course {c[0]}x{c[1]} w{c[2]} s{c[3]}"
                fns.append((label, lambda opts=opts: forward.flash_attention_window_forward(
                    q, k, v, window_size=w, sink_size=s, **opts)))
            for c in (FAST_CANDIDATES if fast else []):
                opts = (fast_window.hopper_config(w, q.shape[-1], n) if c is None
                        else dict(block_m=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3]))
                label = "fast, hopper_config" if c is None else f"fast {c[0]}x{c[1]} w{c[2]} s{c[3]}"
                fns.append((label, lambda opts=opts: fast_window.launch(q, k, v, window_size=w, sink_size=s, **opts)))
            for c in (FAST_WS_CANDIDATES if fast else []):
                opts = dict(block_m=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3], warp_specialize=True)
                fns.append((f"fast {c[0]}x{c[1]} w{c[2]} s{c[3]} ws", lambda opts=opts: fast_window.launch(
                    q, k, v, window_size=w, sink_size=s, **opts)))
            rows += _time_all(fns, lambda got: wb.forward_error(got, ref)[0], wb.window_flops(n, w, s),
                              f"forward, W={w} S={s} N={n}", mode="forward", n=n, W=w, S=s)
    return rows


def _backward_rows(n, windows, sinks) -> list[dict]:
    import torch

    from course_utils.bench import window as wb
    from course_utils.kernels import flash_attention_with_lse
    from course_utils.kernels import fast_backward as fb
    from course_utils.kernels.backward import BackwardConfig, attention_backward

    q, k, v = wb.make_inputs(n, requires_grad=True)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    do = torch.randn_like(q)
    rows = []
    for w in windows:
        for s in sinks:
            want = wb.reference_group_grads(q, k, v, do, w, s)
            fns = [("flex", wb.make_training_step("flex", q, k, v, do, wb.WindowCase(w, s, n)))]
            for c in BACKWARD_CANDIDATES:
                cfg = None if c is None else BackwardConfig(*c)

                def step(cfg=cfg, w=w, s=s):
                    o, lse = flash_attention_with_lse(qd, kd, vd, True, window_size=w, sink_size=s)
                    return (o, *attention_backward(qd, kd, vd, o, lse, do, True, config=cfg, window_size=w,
                                                   sink_size=s))

                fns.append(("course, shipped launch" if cfg is None else f"course {cfg!r}", step))
            for c in (FLAT_BACKWARD_CANDIDATES if s == 0 else []):
                flat = fb.FastBackwardConfig(*c)

                def flat_step(flat=flat, w=w):
                    o, lse = flash_attention_with_lse(qd, kd, vd, True, window_size=w)
                    return (o, *fb.attention_backward_fast(qd, kd, vd, o, lse, do, True, config=flat, window_size=w))

                fns.append((f"course {flat.short()}", flat_step))
            rows += _time_all(fns, lambda got: wb.grads_error(got, want), wb.window_flops(n, w, s, training=True),
                              f"forward + backward, W={w} S={s} N={n}", mode="forward + backward", n=n, W=w, S=s)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[16384])
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--backward", action="store_true", help="time forward + backward configurations")
    parser.add_argument("--fast", action="store_true", help="time fast_window's launches (forward)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not bench.gpu_available():
        print(bench.NO_GPU_MESSAGE)
        return 0

    import torch

    rows = []
    for n in args.n:
        if args.backward:
            rows += _backward_rows(n, args.windows, args.sinks)
        else:
            rows += _forward_rows(n, args.windows, args.sinks, fast=args.fast)
        torch.cuda.empty_cache()
    if args.out:
        bench.write_sweep(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
