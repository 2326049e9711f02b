"""Cap the FP8 Hopper launch's registers so that more programs share an SM (``maxnreg``), beside cuDNN's bf16.

``results/ncu_forward.md`` says the Hopper launch (``fp8.launch_fp8_hopper``) waits on fixed-latency
dependencies with two programs (8 warps) per SM and no pipe saturated. More programs per SM would hide more of
that latency; what keeps them out is registers (170 per thread at ``64 x 128``) and shared memory (3 stages).
This script times ``hopper_config``'s tiles with 2 and 3 stages, with and without a register cap, at D = 128,
N = 4k and 16k, causal and not (16k tokens, GQA 32/8), each output checked against a float32 reference first
(``tune_fp8.check_candidate``), and prints TFLOP/s, the ratio to cuDNN in the same run, registers, spills and
shared memory. The shipped launch (``hopper_config``) is not changed by it.

    python benchmarks/tune_fp8_maxnreg.py results/tune_fp8_maxnreg.json

Needs a Hopper GPU.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tune_fp8  # noqa: E402  (the case setup and the candidate check)

# (BLOCK_M, BLOCK_N, num_stages, maxnreg or None), 4 warps each, per mask
SHAPES = {True: [(64, 64, 3, None), (64, 64, 2, None), (64, 64, 3, 128), (64, 64, 2, 128)],
          False: [(64, 128, 3, None), (64, 128, 2, None), (64, 128, 2, 168), (64, 128, 3, 168), (128, 64, 2, 168)]}


def config(bm: int, bn: int, stages: int, maxnreg: int | None) -> dict:
    """``launch_fp8_hopper``'s ``config`` for one candidate."""
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=stages)
    if maxnreg:
        cfg["maxnreg"] = maxnreg
    return cfg


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import torch
    import triton.testing

    from course_utils.kernels import fp8

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper); nothing measured.")
        return 0
    rows = []
    for n, causal in itertools.product((4096, 16384), (True, False)):
        c = tune_fp8.case_inputs(n, 128, causal)
        ms_bf16, ms_cudnn = tune_fp8._time_bf16_and_cudnn(c, causal)
        for shape in SHAPES[causal]:
            cfg = config(*shape)

            def run(cfg=cfg):
                return fp8.launch_fp8_hopper(c["q8"], c["k8"], c["vt8"], c["qs"], c["ks"], c["vs"], causal, 128,
                                             torch.bfloat16, config=cfg)
            err, note = tune_fp8.check_candidate(run, c["ref"], cfg)
            row = dict(d=128, n=n, causal=causal, batch=c["b"], bf16_ms=ms_bf16, cudnn_ms=ms_cudnn, EXP_F16=0,
                       EXP_POLY=0, ORDER=2, **cfg, err=err, note=note)
            if not note:
                k = fp8.HOPPER_LAST["compiled"]
                ms = triton.testing.do_bench(run)
                row.update(ms=ms, tflops=c["flops"] / ms / 1e9, vs_cudnn=ms_cudnn / ms, registers=k.n_regs,
                           spills=k.n_spills, shared=k.metadata.shared)
                print(n, causal, cfg, f"{row['tflops']:.0f} {row['vs_cudnn']:.3f}x regs {k.n_regs} spills "
                      f"{k.n_spills} smem {k.metadata.shared}", flush=True)
            rows.append(row)
    if argv:
        Path(argv[0]).write_text(json.dumps(dict(rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
