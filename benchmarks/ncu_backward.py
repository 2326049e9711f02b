"""Nsight Compute counters of the backward pass: lesson 07's kernels against SDPA's cuDNN and flash backwards.

    python benchmarks/ncu_backward.py --all results/   # ncu once per provider: ncu_backward.{json,md}
    python benchmarks/ncu_backward.py --from-csv results/  # the summary again from the kept raw CSVs
    python benchmarks/ncu_backward.py PROVIDER          # one warmed-up backward of PROVIDER between
                                                        # cudaProfilerStart/Stop (what ncu profiles)

Providers (training_bench's main case at N = 4096: bf16, causal, GQA 32/8, D = 128, batch 4):

- ``course``: ``kernels.flash_attention``'s autograd backward, lesson 07's three kernels at their Hopper
  launch (the ``delta`` preprocess, dK/dV, dQ);
- ``sdpa_cudnn`` / ``sdpa_flash``: ``F.scaled_dot_product_attention``'s backward with that backend alone.

The forward runs before the profiled range, so only the backward's kernels are profiled, every one of them
(a provider's row list is its kernels in launch order). ``ncu --clock-control none --set full``, as
``ncu_forward.py``, whose parsing and counters this script shares. Needs a CUDA GPU and ``ncu`` on PATH.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ncu_forward import PIPES, ncu_rows, ncu_run_info, parse_raw_csv, rebuild_from_csv, summarise, write_summary  # noqa: E402

PROVIDERS = ("course", "sdpa_cudnn", "sdpa_flash")
B, HQ, HKV, N, D = 4, 32, 8, 4096, 128


def one_launch(name: str) -> None:
    """Run ``name``'s forward + backward three times (compile, warm up), then one forward outside and its backward
    inside the profiler range."""
    import course_utils  # noqa: F401  (first)
    import torch

    from course_utils.bench import training

    if name not in PROVIDERS:
        raise SystemExit(f"unknown provider {name!r}: one of {', '.join(PROVIDERS)}")
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (HQ, HKV, HKV))
    do = torch.randn(B, HQ, N, D, device="cuda", dtype=torch.bfloat16)
    step = training.make_training_step(name, q, k, v, do, True)
    for _ in range(3):
        step()
    q.grad = k.grad = v.grad = None
    out = training.make_training_forward(name, q, k, v, True)()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    out.backward(do)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _short(kernel_name: str | None, width: int = 48) -> str:
    name = (kernel_name or "?").split("(")[0]
    return name if len(name) <= width else name[: width - 1] + "…"


def provider_summary(rows: list[dict]) -> dict:
    """A provider's kernels (ncu's raw rows, in launch order): each one's summary and their summed duration."""
    kernels = [summarise(r) for r in rows]
    total = sum(k["duration_us"] or 0.0 for k in kernels)
    return dict(kernels=kernels, total_us=total)


def markdown(summary: dict) -> str:
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [f"# Nsight Compute: the backward kernels\n\n{summary['gpu']}, torch {summary['torch']}, "
             f"triton {summary['triton']}, `ncu --clock-control none --set full` ({summary['ncu']}); bf16, causal, "
             f"GQA {HQ}/{HKV}, D = {D}, N = {N}, batch {B} (training_bench's main case), the backward alone. "
             "`python benchmarks/ncu_backward.py --all results/` (raw counters in `results/ncu/`).\n",
             "| provider | kernel | µs | share of the backward | tensor pipe % | exp2 (xu) / FMA / ALU pipe % | "
             "achieved / theoretical occupancy % | L2 hit % | regs | top stalls (cycles per issue) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, p in summary["providers"].items():
        if "error" in p:
            lines.append(f"| {name} | error: {p['error']} | | | | | | | | |")
            continue
        for s in p["kernels"]:
            share = (s["duration_us"] or 0.0) / p["total_us"] if p["total_us"] else None
            pipes = " / ".join(fmt(s.get("pipes_pct", {}).get(x), ".1f") for x in PIPES)
            stalls = ", ".join(f"{k} {v:.2f}" for k, v in s["top_stalls"].items())
            lines.append(f"| {name} | `{_short(s['kernel_name'])}` | {fmt(s['duration_us'], '.0f')} | "
                         f"{fmt(None if share is None else 100 * share, '.0f')}% | {fmt(s['tensor_pipe_pct'], '.1f')} | "
                         f"{pipes} | {fmt(s['achieved_occupancy_pct'], '.1f')} / "
                         f"{fmt(s['theoretical_occupancy_pct'], '.1f')} | {fmt(s['l2_hit_rate_pct'], '.1f')} | "
                         f"{fmt(s['registers_per_thread'], '.0f')} | {stalls} |")
        lines.append(f"| {name} | **all kernels** | **{p['total_us']:.0f}** | 100% | | | | | | |")
    lines.append("\nThe counters are `ncu_forward.md`'s (see there). Durations are ncu's, one replayed launch each "
                 "(`--clock-control none`), so they need not match the benchmarks' medians.")
    return "\n".join(lines) + "\n"


def profile_all(out_dir: Path, providers=PROVIDERS) -> int:
    ncu, summary = ncu_run_info(providers={})
    if ncu is None:
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in providers:
        rows, error = ncu_rows(ncu, __file__, name, out_dir / "ncu" / f"ncu_backward_{name}.csv", timeout=400)
        summary["providers"][name] = dict(error=error) if error else provider_summary(rows)
        print(name, json.dumps(summary["providers"][name])[:400], flush=True)
    write_summary(out_dir, "ncu_backward", summary, markdown(summary))
    return 0


def from_csv(out_dir: Path) -> int:
    """Rebuild ``ncu_backward.{json,md}`` from the raw CSVs a run kept (no GPU needed)."""
    return rebuild_from_csv(out_dir, "ncu_backward", "providers", PROVIDERS, lambda rows, _: provider_summary(rows),
                            markdown)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("provider", nargs="?", choices=PROVIDERS)
    parser.add_argument("--all", metavar="OUT_DIR", type=Path)
    parser.add_argument("--from-csv", metavar="OUT_DIR", type=Path, help="rebuild the summary from kept CSVs")
    args = parser.parse_args(argv)
    if args.all is not None:
        return profile_all(args.all)
    if args.from_csv is not None:
        return from_csv(args.from_csv)
    if args.provider is None:
        parser.error("name a provider or give --all OUT_DIR")
    one_launch(args.provider)
    return 0


if __name__ == "__main__":
    sys.exit(main())
