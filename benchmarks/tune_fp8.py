"""Time lesson 11's FP8 forward at fixed launch configurations, beside the course's bf16 forward and cuDNN.

``kernels.fp8.fp8_config`` picks one configuration (untuned defaults); this script times every candidate
on e4m3 inputs quantised once outside the timing (V made K-major once too: the kernel alone is timed),
checks each output against a float32 reference first, and prints each configuration's TFLOP/s and its
ratio to the course's bf16 forward and to SDPA's cuDNN backend measured in the same run. It then times
``fp8_config``'s launch from a persistent grid (``launch_fp8_persistent``: one program per SM over an LPT
schedule of the tiles) against the ordinary grid.

    python benchmarks/tune_fp8.py [--ns 4096 16384] [--no-sweep] [--out tune_fp8.json]
    python benchmarks/tune_fp8.py --hopper [--ns 4096 16384] [--exp-f16 | --exp-poly | --maxnreg | --ws]
                                  [--head-dims 128 64] [--out tune_fp8_hopper.json]

``--hopper`` times the Hopper launch instead (``fp8.launch_fp8_hopper``: TMA, the scales folded into one
FMA per score, ``acc`` accumulated in the tensor cores; optionally the exponentials two at a time in fp16)
at each candidate, at D = 128 and 64, beside the lesson kernel's launch, the course's bf16 forward and cuDNN.
``--exp-poly`` times POLY_SHAPES with and without half the exponentials as a cubic on the FMA units;
``--maxnreg`` times MAXNREG_SHAPES, hopper_config's tiles with caps on registers per thread (D = 128).
``--ws`` times WS_SHAPES warp-specialised (``WARP_SPECIALIZE=True``: a producer and two consumer warpgroups,
Triton 3.6 only; compiled for sm_90 in ``results/sm90_compiles.json``'s ``fp8_ws``) and WS_PERSISTENT_SHAPES
persistent with their tile loop specialised, beside hopper_config's launch.

Needs a CUDA GPU with FP8 (sm_89 or sm_90).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import course_utils  # noqa: F401  (first, as in every notebook)


def case_inputs(n: int, d: int, causal: bool, *, hq: int = 32, hkv: int = 8, tokens: int = 16384,
                device: str = "cuda") -> dict:
    """One case's bf16 inputs (batch ``tokens // n``), their e4m3 copies (V K-major), a float32 reference
    of batch element 0, and the FLOPs (``attention_flops``)."""
    import torch

    from course_utils.bench.cases import attention_flops
    from course_utils.kernels import fp8

    b = max(1, tokens // n)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q[:1].float(), k[:1].float(), v[:1].float(),
                                                           is_causal=causal, enable_gqa=True)
    return dict(b=b, q=q, k=k, v=v, q8=q8, qs=qs, k8=k8, ks=ks, vt8=v8.transpose(2, 3).contiguous(), vs=vs,
                ref=ref, flops=attention_flops(b, hq, n, d, causal))


def _time_bf16_and_cudnn(c: dict, causal: bool) -> tuple[float, float]:
    """Milliseconds of the course's bf16 forward and of SDPA's cuDNN backend on the case's inputs."""
    import torch
    import triton.testing

    from course_utils.kernels import flash_attention

    q, k, v = c["q"], c["k"], c["v"]
    ms_bf16 = triton.testing.do_bench(lambda: flash_attention(q, k, v, causal))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        ms_cudnn = triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    return ms_bf16, ms_cudnn


def check_candidate(run, ref, cfg) -> tuple[float | None, str | None]:
    """``(error, None)`` when ``run()``'s batch element 0 matches ``ref`` within FP8's tolerance, else
    ``(error or None, why)``: the exception's name when it raised (a launch this compiler or GPU rejects),
    ``"wrong"`` when it is off. Says which on the console; the sweep times only the first kind."""
    from course_utils.bench.fp8 import FP8_TOLERANCE, rel_rms

    try:
        err = rel_rms(run()[:1].float(), ref)
    except Exception as exc:  # noqa: BLE001 - one configuration failing must not stop the sweep
        print(f"  {cfg}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})",
              flush=True)
        return None, type(exc).__name__
    if not err <= FP8_TOLERANCE:
        print(f"  {cfg}: wrong (relative RMS error {err:.3g})", flush=True)
        return err, "wrong"
    return err, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-sweep", action="store_true", help="only the persistent grid against the ordinary one")
    parser.add_argument("--hopper", action="store_true", help="sweep the Hopper launch (launch_fp8_hopper)")
    parser.add_argument("--exp-f16", action="store_true", help="with --hopper: also the fp16 exponentials (EXP_F16=1, 2)")
    parser.add_argument("--exp-poly", action="store_true",
                        help="with --hopper: POLY_SHAPES with and without half the exponentials on the FMA units "
                             "(EXP_POLY=0, 1), instead of HOPPER_SHAPES")
    parser.add_argument("--maxnreg", action="store_true",
                        help="with --hopper: MAXNREG_SHAPES (register caps, D = 128) instead of HOPPER_SHAPES")
    parser.add_argument("--ws", action="store_true",
                        help="with --hopper: WS_SHAPES warp-specialised, beside hopper_config's launch")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], choices=[128, 64])
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU here: this script times GPU kernels.")
        return 0
    import triton.testing

    from course_utils.bench.fp8 import FP8_TOLERANCE, rel_rms
    from course_utils.kernels import fp8

    if args.hopper:
        return _sweep_hopper(args)
    d = 128
    candidates = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
                  for bm, bn, w, st in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))]
    rows, persistent = [], []
    for n, causal in itertools.product(args.ns, (True, False)):
        c = case_inputs(n, d, causal)
        b, flops, ref, q8, qs, k8, ks, vt8, vs = (c[key] for key in ("b", "flops", "ref", "q8", "qs", "k8", "ks",
                                                                     "vt8", "vs"))
        ms_bf16, ms_cudnn = _time_bf16_and_cudnn(c, causal)
        print(f"N={n} causal={causal}: course bf16 {flops / ms_bf16 / 1e9:.0f} TFLOP/s, "
              f"cuDNN {flops / ms_cudnn / 1e9:.0f}", flush=True)
        grid_ms = triton.testing.do_bench(lambda: fp8.launch_fp8(q8, k8, vt8, qs, ks, vs, causal, 128, torch.bfloat16))

        def run_persistent():
            return fp8.launch_fp8_persistent(q8, k8, vt8, qs, ks, vs, causal, 128, torch.bfloat16)
        err = rel_rms(run_persistent()[:1].float(), ref)
        if err <= FP8_TOLERANCE:
            ms = triton.testing.do_bench(run_persistent)
            persistent.append(dict(n=n, causal=causal, batch=b, grid_ms=grid_ms, persistent_ms=ms, err=err,
                                   persistent_over_grid=grid_ms / ms, vs_cudnn=ms_cudnn / ms))
            print(f"  persistent grid ({torch.cuda.get_device_properties(0).multi_processor_count} programs, LPT): "
                  f"{flops / ms / 1e9:.0f} TFLOP/s, {grid_ms / ms:.2f}x the ordinary grid", flush=True)
        else:
            print(f"  persistent grid: wrong (relative RMS error {err:.3g})", flush=True)
        for cfg in ([] if args.no_sweep else candidates):
            def run():
                return fp8.launch_fp8(q8, k8, vt8, qs, ks, vs, causal, 128, torch.bfloat16, config=cfg)
            err, note = check_candidate(run, ref, cfg)
            if note:
                continue
            ms = triton.testing.do_bench(run)
            row = dict(n=n, causal=causal, batch=b, **cfg, ms=ms, tflops=flops / ms / 1e9, err=err,
                       vs_bf16=ms_bf16 / ms, vs_cudnn=ms_cudnn / ms)
            rows.append(row)
            print(f"  {cfg}: {row['tflops']:.0f} TFLOP/s, {row['vs_bf16']:.2f}x course bf16, "
                  f"{row['vs_cudnn']:.2f}x cuDNN (err {err:.3g})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=__import__("triton").__version__, rows=rows, persistent=persistent), f, indent=1)
    return 0


# (BLOCK_M, BLOCK_N, num_warps, num_stages, ORDER): 2 = a GQA group's heads side by side, longest rows first; 0 = lesson 05's
HOPPER_SHAPES = {128: [(128, 128, 8, 3, 2), (128, 128, 8, 4, 2), (128, 128, 8, 3, 0), (128, 128, 8, 2, 2),
                       (128, 64, 4, 3, 2), (128, 64, 4, 4, 2), (128, 64, 4, 3, 0), (128, 64, 4, 2, 2),
                       (128, 64, 8, 3, 2), (64, 64, 4, 3, 2), (64, 64, 4, 4, 2)],
                 64: [(128, 128, 4, 2, 2), (128, 128, 4, 3, 2), (128, 128, 8, 2, 2), (128, 128, 8, 3, 2),
                      (128, 64, 4, 3, 2), (128, 64, 4, 4, 2), (64, 64, 4, 3, 2)]}
# The fastest shapes of tune_fp8_hopper.json's runs, and 64 x 128 (not causal only), for --exp-poly.
POLY_SHAPES = {128: [(128, 64, 4, 3, 2), (64, 64, 4, 3, 2), (128, 128, 8, 3, 2), (64, 128, 4, 3, 2)],
               64: [(128, 128, 4, 3, 2), (64, 64, 4, 3, 2), (128, 64, 4, 3, 2)]}


# For --maxnreg (D = 128, per mask): (BLOCK_M, BLOCK_N, num_warps, num_stages, ORDER, maxnreg or None). hopper_config's
# tiles with 2 and 3 stages, with and without a cap on registers, so that more programs share an SM: the Hopper
# launch waits on fixed-latency dependencies with two programs per SM (results/ncu_forward.md).
MAXNREG_SHAPES = {True: [(64, 64, 4, 3, 2, None), (64, 64, 4, 2, 2, None), (64, 64, 4, 3, 2, 128),
                         (64, 64, 4, 2, 2, 128)],
                  False: [(64, 128, 4, 3, 2, None), (64, 128, 4, 2, 2, None), (64, 128, 4, 2, 2, 168),
                          (64, 128, 4, 3, 2, 168), (128, 64, 4, 2, 2, 168),
                          # not yet timed (twenty-sixth session): compiled for sm_90 with triton 3.6, 64 x 64 on 2
                          # stages capped at 128 spills nothing without the mask either: four programs per SM
                          (64, 64, 4, 2, 2, 128)]}


# For --ws: (BLOCK_M, BLOCK_N, num_warps, num_stages, ORDER), each launched with WARP_SPECIALIZE=True (4 warps: a
# producer and two consumer warpgroups; the causal mask on every block, in one loop). Not yet timed (twenty-seventh
# session). Compiled for sm_90 with triton 3.6 (results/sm90_compiles.json's fp8_ws):
# each makes 12 warps of 168 registers raised to 232 by setmaxnreg, with no spills.
WS_SHAPES = {128: [(128, 64, 4, 2, 2), (128, 64, 4, 3, 2), (128, 128, 4, 2, 2), (128, 128, 4, 3, 2), (64, 128, 4, 2, 2)],
             64: [(128, 64, 4, 2, 2), (128, 128, 4, 2, 2), (128, 128, 4, 3, 2)]}
# ... and persistent (PERSISTENT=True: one program per SM walks the tiles, the tile loop specialised), as
# fast.launch_persistent does for bf16; the same compile record, the same 12 warps.
# On the H200 both kinds deadlock (results/ws_smoke_h200.txt): refused there, recorded as failed.
WS_PERSISTENT_SHAPES = {128: [(128, 64, 4, 2, 2), (128, 128, 4, 2, 2)], 64: [(128, 64, 4, 2, 2), (128, 128, 4, 2, 2)]}


def hopper_candidates(args, d: int, causal: bool) -> list[dict]:
    """The ``launch_fp8_hopper`` configs the --hopper sweep times for one case, as chosen by the options."""
    def cfg(bm, bn, w, st, order, exp_f16=0, exp_poly=0, maxnreg=None):
        # maxnreg=None lifts hopper_config's own cap (launch_fp8_hopper merges the candidate over it)
        return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, ORDER=order, EXP_F16=exp_f16,
                    EXP_POLY=exp_poly, maxnreg=maxnreg)

    if args.maxnreg:
        return [cfg(*shape[:5], maxnreg=shape[5]) for shape in MAXNREG_SHAPES[causal]] if d == 128 else []
    if getattr(args, "ws", False):  # hopper_config's launch first: the one the specialised ones must beat
        from course_utils.kernels import fp8

        shipped = fp8.hopper_config(d, 128, causal)
        first = cfg(shipped["BLOCK_M"], shipped["BLOCK_N"], shipped["num_warps"], shipped["num_stages"], 2,
                    maxnreg=shipped.get("maxnreg"))
        return [first] + [dict(cfg(*shape), maxnreg=None, WARP_SPECIALIZE=True) for shape in WS_SHAPES[d]
                          if not (causal and shape[0] % shape[1])] + [
            dict(cfg(*shape), maxnreg=None, WARP_SPECIALIZE=True, PERSISTENT=True) for shape in WS_PERSISTENT_SHAPES[d]]
    if args.exp_poly:  # the causal loop needs BLOCK_M % BLOCK_N == 0
        return [cfg(*shape, exp_poly=poly) for shape in POLY_SHAPES[d] for poly in (0, 1)
                if not (causal and shape[0] % shape[1])]
    return [cfg(*shape, exp_f16=f16) for shape in HOPPER_SHAPES[d] for f16 in ((0, 1, 2) if args.exp_f16 else (0,))]


def _sweep_hopper(args) -> int:
    import torch
    import triton.testing

    from course_utils.kernels import fp8

    rows = []
    for d, n, causal in itertools.product(args.head_dims, args.ns, (True, False)):
        candidates = hopper_candidates(args, d, causal)
        if not candidates:
            continue
        c = case_inputs(n, d, causal)
        b, flops, ref, q8, qs, k8, ks, vt8, vs = (c[key] for key in ("b", "flops", "ref", "q8", "qs", "k8", "ks",
                                                                     "vt8", "vs"))
        ms_bf16, ms_cudnn = _time_bf16_and_cudnn(c, causal)
        ms_lesson = triton.testing.do_bench(
            lambda: fp8.launch_fp8(q8, k8, vt8, qs, ks, vs, causal, 128, torch.bfloat16))
        print(f"D={d} N={n} causal={causal}: course bf16 {flops / ms_bf16 / 1e9:.0f} TFLOP/s, cuDNN "
              f"{flops / ms_cudnn / 1e9:.0f}, lesson FP8 kernel {flops / ms_lesson / 1e9:.0f}", flush=True)
        base = dict(d=d, n=n, causal=causal, batch=b, bf16_ms=ms_bf16, cudnn_ms=ms_cudnn, lesson_fp8_ms=ms_lesson)
        for cfg in candidates:

            def run():
                return fp8.launch_fp8_hopper(q8, k8, vt8, qs, ks, vs, causal, 128, torch.bfloat16, config=cfg)
            err, note = check_candidate(run, ref, cfg)
            if note:
                rows.append(dict(base, **cfg, ms=None, err=err, note=note))
                continue
            compiled = fp8.HOPPER_LAST["compiled"]
            ms = triton.testing.do_bench(run)
            row = dict(base, **cfg, ms=ms, tflops=flops / ms / 1e9, err=err, vs_bf16=ms_bf16 / ms,
                       vs_cudnn=ms_cudnn / ms, vs_lesson_fp8=ms_lesson / ms,
                       registers=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None))
            rows.append(row)
            print(f"  {cfg}: {row['tflops']:.0f} TFLOP/s, {row['vs_cudnn']:.2f}x cuDNN, {row['vs_bf16']:.2f}x bf16, "
                  f"{row['vs_lesson_fp8']:.2f}x the lesson's FP8 kernel (err {err:.3g}; {row['registers']} registers, "
                  f"{row['spills']} spilled)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=__import__("triton").__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
