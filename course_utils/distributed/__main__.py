"""``python -m course_utils.distributed --nproc 2 [--bench]``: the ring attention demo / benchmark.

Without ``--bench``: start ``--nproc`` processes (gloo and Triton's
interpreter on the CPU by default; ``--device cuda`` for NCCL on GPUs),
run ring attention forward and backward on a small case in every process,
and print the largest error of ``o, dq, dk, dv`` against single-process
float64 attention, for both layouts, causal and not.
With ``--bench`` (GPUs): time it at long sequences and write
``results/ring_bench.{md,json}`` (:mod:`course_utils.distributed.bench`).
With ``--blocks`` (one GPU): time one rank's block work alone against SDPA's
kernels and write ``results/ring_blocks.{md,json}``
(:mod:`course_utils.distributed.blocks`).
Started by ``torchrun --nproc-per-node 2 -m course_utils.distributed``, each
process is one rank (NCCL if there is a GPU, else gloo) and rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import apply_safe_env

apply_safe_env()  # before anything can initialise torch.distributed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.distributed", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of processes (ranks); default 2")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo + Triton interpreter (default); cuda: NCCL, one GPU per rank")
    parser.add_argument("--n", type=int, default=128, help="sequence length of the demo (default 128)")
    parser.add_argument("--bench", action="store_true", help="time ring attention on GPUs and write results/ring_bench.*")
    parser.add_argument("--quick", action="store_true", help="with --bench: only the shortest sequence lengths")
    parser.add_argument("--blocks", action="store_true",
                        help="time one rank's block work (kernels and merges, no exchange) on one GPU against SDPA's "
                             "flash and cuDNN kernels, and write results/ring_blocks.* (course_utils.distributed.blocks)")
    parser.add_argument("--out", default="results", help="with --bench or --blocks: folder for the results")
    args = parser.parse_args(argv)

    import course_utils  # before triton
    from . import demo_cases, demo_errors, run_distributed

    if args.blocks:
        from .blocks import main as blocks_main

        return blocks_main(out=args.out, world_size=args.nproc)
    if args.bench:
        from .bench import main as bench_main

        return bench_main(nproc=args.nproc, out=args.out, quick=args.quick)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    device = course_utils.DEVICE if under_torchrun else args.device
    worst = 0.0
    # the course's dtype where the ranks run: fp32 in the interpreter, bf16 (fp16 before sm_80) on GPUs
    dtype_name = "float32" if device == "cpu" else str(course_utils.ENV.dtype).replace("torch.", "")
    cases = [dict(n=args.n, d=32, n_q_heads=4, n_kv_heads=2, causal=causal, layout=layout, seed=0,
                  dtype_name=dtype_name) for layout in ("zigzag", "contiguous") for causal in (False, True)]
    if under_torchrun:  # torchrun started the processes: this is one rank
        results = _torchrun_rank(cases, device)
        if results is None:  # not rank 0: rank 0 prints
            return 0
        args.nproc = len(results)
    else:
        results = run_distributed(demo_cases, args.nproc, args=(cases,), device=args.device)
    for index, case in enumerate(cases):
        layout, causal = case["layout"], case["causal"]
        errors = demo_errors([r[index] for r in results], args.nproc, **case)
        worst = max(worst, *errors.values())
        print(f"{args.nproc} ranks, {layout:10s} causal={causal!s:5s} N={args.n} {dtype_name}: largest error vs "
              "float64 attention in one process: "
              + ", ".join(f"{name} {value:.2e}" for name, value in errors.items()), flush=True)
    tolerance = 1e-4 if dtype_name == "float32" else 5e-2
    print("OK" if worst <= tolerance else f"FAILED: largest error {worst:.2e} > {tolerance:g}")
    return 0 if worst <= tolerance else 1


def _torchrun_rank(cases, device):
    """One rank under ``torchrun``: run the demo cases; rank 0 gets every rank's results, the others None."""
    import torch
    import torch.distributed as dist

    from . import demo_cases

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        mine = demo_cases(dist.get_rank(), dist.get_world_size(), cases)
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return gathered
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
