"""Nsight Compute counters of the course's forward kernels on one GPU (lessons 05, 06 and 11).

    python benchmarks/ncu_forward.py --all results/ [--kernels K ...]  # ncu once per kernel: ncu_forward.{json,md}
    python benchmarks/ncu_forward.py --from-csv results/  # the summary again from the kept raw CSVs
    ... --stem ncu_forward_h100                          # with --all / --from-csv: another GPU's files
    python benchmarks/ncu_forward.py KERNEL             # one warmed-up launch of KERNEL between
                                                         # cudaProfilerStart/Stop (what ncu profiles)

Kernels (bf16 unless said, GQA 32/8, D = 128, N = 4096, batch 4, not causal):

- ``lesson05``: lesson 05's kernel (``kernels.forward.flash_attention_gqa_forward``), its own launch;
- ``fast_1_per_sm``: lesson 06's fast kernel, 128 x 128 tiles, 8 warps, 3 stages (one program per SM);
- ``fast_2_per_sm``: the same kernel, 128 x 64 tiles, 4 warps, 2 stages (two programs fit one SM);
- ``fp8``: lesson 11's FP8 kernel with ``fp8_config``'s launch, e4m3 inputs quantised beforehand;
- ``fp8_hopper``: the FP8 forward's Hopper launch (``fp8.launch_fp8_hopper``, ``hopper_config``'s tiles);
- ``fast_2_per_sm_poly``, ``fp8_hopper_poly``: the same two launches with half of each tile's exponentials
  computed on the FMA units (``fast._exp_scores``);
- ``gluon_serial``, ``gluon_overlap``, ``gluon_overlap_pingpong``: lesson 11's warp-specialised Gluon forward
  (``hopper_ws.attention``, two K/V buffers) with its serial loop, FA3's overlap of each softmax under the
  previous tile's ``P V``, and that overlap with the consumers' ping-pong and the FMA softmax scale: the counters
  that say why FA3's schedules measured slower here (``results/hopper_ws_probe.json``);
- ``gluon_fp8_serial``, ``gluon_fp8_overlap``: its FP8 entry (``hopper_ws.attention_fp8``) with the serial loop
  (the course's fastest FP8 forward) and FA3's overlap, e4m3 inputs quantised beforehand; ``gluon_fp8_wide``: the
  serial loop on FA3's wider FP8 tiles (``block_n=256``);

``--kernels`` profiles only some of them and keeps the other kernels' rows of an earlier run.

Each is profiled with ``ncu --clock-control none --set full`` (the clocks as they run, not locked to base) and
the raw counters are kept; the summary holds the duration, the tensor pipes' utilisation, the achieved
and theoretical occupancy, the L2 hit rate, registers and shared memory, and the five largest warp-stall
reasons (cycles per issued instruction). Needs a CUDA GPU and ``ncu`` on PATH.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

KERNELS = ("lesson05", "fast_1_per_sm", "fast_2_per_sm", "fp8", "fp8_hopper", "fast_2_per_sm_poly", "fp8_hopper_poly",
           "gluon_serial", "gluon_overlap", "gluon_overlap_pingpong", "gluon_fp8_serial", "gluon_fp8_overlap",
           "gluon_fp8_wide")
# lesson 11's Gluon loops: the kernel's name -> hopper_ws.attention's options
GLUON_LOOPS = {"gluon_serial": dict(loop="serial"), "gluon_overlap": dict(loop="overlap"),
               "gluon_overlap_pingpong": dict(loop="overlap_pingpong", fma=True)}
B, HQ, HKV, N, D = 4, 32, 8, 4096, 128
# Counters kept in the summary: (label, exact raw-metric name).
NAMED = [
    ("duration_us", "gpu__time_duration.sum"),  # converted from the unit ncu prints
    ("tensor_pipe_pct", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("achieved_occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("theoretical_occupancy_pct", "sm__maximum_warps_per_active_cycle_pct"),
    ("l2_hit_rate_pct", "lts__t_sector_hit_rate.pct"),
    ("registers_per_thread", "launch__registers_per_thread"),
    ("dynamic_shared_bytes", "launch__shared_mem_per_block_dynamic"),
    ("blocks_per_sm_limit_registers", "launch__occupancy_limit_registers"),
    ("blocks_per_sm_limit_shared", "launch__occupancy_limit_shared_mem"),
    ("dram_throughput_pct", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("sm_throughput_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("spill_instructions", "sass__inst_executed_register_spilling"),  # local-memory loads/stores of spilled registers
]
# The instruction pipes' utilisation (% of peak, of the active cycles): the tensor cores beside the special-function
# unit (xu: exp2), the FMA units and the integer/logic unit (alu), which a kernel's softmax shares out.
PIPES = {"xu": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
         "fma": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
         "alu": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"}


def one_launch(name: str) -> None:
    """Warm ``name`` up (compile, autotune), then launch it once inside cudaProfilerStart/Stop."""
    import course_utils  # noqa: F401  (first)
    import torch

    from course_utils.kernels import fast, forward, fp8

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    if name == "lesson05":
        def run():
            return forward.flash_attention_gqa_forward(q, k, v, False)
    elif name == "fast_1_per_sm":
        def run():
            return fast.launch(q, k, v, False, block_m=128, block_n=128, num_warps=8, num_stages=3)
    elif name == "fast_2_per_sm":
        def run():
            return fast.launch(q, k, v, False, block_m=128, block_n=64, num_warps=4, num_stages=2)
    elif name == "fast_2_per_sm_poly":
        def run():
            return fast.launch(q, k, v, False, block_m=128, block_n=64, num_warps=4, num_stages=2, exp_poly=True)
    elif name in GLUON_LOOPS:
        from course_utils.kernels import hopper_ws

        def run():
            return hopper_ws.attention(q, k, v, False, **GLUON_LOOPS[name])
    elif name.startswith(("fp8", "gluon_fp8")):  # e4m3 inputs quantised beforehand, V K-major
        (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
        vt8 = v8.transpose(2, 3).contiguous()
        if name.startswith("gluon_fp8"):
            from course_utils.kernels import hopper_ws

            # gluon_fp8_wide: the serial loop on FA3's wide FP8 tiles (block_n=256)
            options = dict(block_n=256) if name == "gluon_fp8_wide" else dict(loop=name.removeprefix("gluon_fp8_"))

            def run():
                return hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, False, **options)
        elif name == "fp8":
            def run():
                return fp8.launch_fp8(q8, k8, vt8, qs, ks, vs, False, 128, torch.bfloat16)
        else:
            config = dict(EXP_POLY=1) if name == "fp8_hopper_poly" else None

            def run():
                return fp8.launch_fp8_hopper(q8, k8, vt8, qs, ks, vs, False, 128, torch.bfloat16, config=config)
    else:
        raise SystemExit(f"unknown kernel {name!r}: one of {', '.join(KERNELS)}")
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
NOT_STALLS = ("selected", "not_selected")  # issuing, or eligible while another warp issued: not waiting


def parse_raw_csv(text: str) -> list[dict]:
    """The rows of ``ncu --csv --page raw`` (header, units, then one row per kernel), as dicts.

    The duration is converted to microseconds from the unit in the units row.
    """
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, data = rows[0], rows[1], rows[2:]
    unit = dict(zip(header, units)).get("gpu__time_duration.sum", "ns")
    out = []
    for r in data:
        if len(r) != len(header):
            continue
        row = dict(zip(header, r))
        if _number(row.get("gpu__time_duration.sum")) is not None:
            row["gpu__time_duration.sum"] = _number(row["gpu__time_duration.sum"]) * _TO_US.get(unit, 1e-3)
        out.append(row)
    return out


def _number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def summarise(raw: dict) -> dict:
    """The summary counters of one kernel's raw row (see :data:`NAMED`), tensor pipes and top stalls."""
    out = {"kernel_name": raw.get("Kernel Name")}
    for label, metric in NAMED:
        out[label] = _number(raw.get(metric))
    stalls = {m.removeprefix("smsp__average_warps_issue_stalled_").removesuffix("_per_issue_active.ratio"): _number(v)
              for m, v in raw.items()
              if m.startswith("smsp__average_warps_issue_stalled_") and m.endswith("_per_issue_active.ratio")
              and _number(v) is not None}
    out["pipes_pct"] = {label: _number(raw.get(metric)) for label, metric in PIPES.items()}
    out["stalls"] = stalls
    out["top_stalls"] = dict(sorted(((k, v) for k, v in stalls.items() if k not in NOT_STALLS),
                                    key=lambda kv: -kv[1])[:5])
    return out


def markdown(summary: dict, stem: str = "ncu_forward") -> str:
    how = "" if stem == "ncu_forward" else f" --stem {stem}"
    lines = [f"# Nsight Compute: the course's forward kernels\n\n{summary['gpu']}, torch {summary['torch']}, "
             f"triton {summary['triton']}, `ncu --clock-control none --set full` ({summary['ncu']}); bf16 "
             f"(FP8: e4m3), GQA {HQ}/{HKV}, D = {D}, N = {N}, batch {B}, not causal. "
             f"`python benchmarks/ncu_forward.py --all results/{how}` (raw counters in `results/ncu/`).\n",
             "| kernel | µs | tensor pipe % | exp2 (xu) / FMA / ALU pipe % | achieved / theoretical occupancy % | "
             "L2 hit % | regs | top stalls (cycles per issue) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, s in summary["kernels"].items():
        name = f"{name} ({s['run']})" if s.get("run") else name
        if "error" in s:
            lines.append(f"| {name} | error: {s['error']} | | | | | | |")
            continue
        tensor = s["tensor_pipe_pct"]
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in s["top_stalls"].items())
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        pipes = " / ".join(fmt(s.get("pipes_pct", {}).get(p), ".1f") for p in PIPES)
        lines.append(f"| {name} | {fmt(s['duration_us'], '.0f')} | {fmt(tensor, '.1f')} | {pipes} | "
                     f"{fmt(s['achieved_occupancy_pct'], '.1f')} / {fmt(s['theoretical_occupancy_pct'], '.1f')} | "
                     f"{fmt(s['l2_hit_rate_pct'], '.1f')} | {fmt(s['registers_per_thread'], '.0f')} | {stalls} |")
    lines.append("\nTensor pipe %: `sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active` (cycles the tensor "
                 "pipes were busy, of the SMs' active cycles). exp2 (xu) / FMA / ALU: the same for the special-"
                 "function unit (`sm__inst_executed_pipe_xu`), the FMA units and the integer/logic unit. "
                 "Occupancy: warps resident per SM, of its 64. Stalls: "
                 "`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`, the five largest, leaving out "
                 "`selected` and `not_selected` (issuing, or ready while another warp issued). A row marked (earlier "
                 "run) was profiled in an earlier `--all` run (`--kernels` profiles a subset and keeps the rest).")
    return "\n".join(lines) + "\n"


NCU_OPTIONS = ("--clock-control", "none", "--set", "full", "--profile-from-start", "off", "--csv", "--page", "raw")


def ncu_run_info(**sections) -> tuple[str | None, dict | None]:
    """``(ncu's path, the run's header: GPU, torch, triton and ncu versions, plus sections)``, or ``(None, None)``
    after saying why nothing can be measured here (no CUDA GPU or no ``ncu`` on PATH)."""
    import torch
    import triton

    ncu = shutil.which("ncu")
    if ncu is None or not torch.cuda.is_available():
        print("needs a CUDA GPU and Nsight Compute's `ncu` on PATH; nothing measured.")
        return None, None
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return ncu, dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                     ncu=version, **sections)


def ncu_rows(ncu: str, script: str, name: str, csv_path: Path, timeout: int = 300) -> tuple[list[dict] | None, str | None]:
    """Profile ``python script name`` (its launches between cudaProfilerStart/Stop) with :data:`NCU_OPTIONS`:
    ``(the raw rows, None)``, the raw CSV kept at ``csv_path``; or ``(None, why)`` when ncu gave no kernel row."""
    done = subprocess.run([ncu, *NCU_OPTIONS, sys.executable, script, name], capture_output=True, text=True,
                          env=dict(os.environ), timeout=timeout)
    try:
        rows = parse_raw_csv(done.stdout)
        if not rows:
            raise ValueError("no kernel rows")
    except (StopIteration, IndexError, ValueError) as exc:
        return None, f"{type(exc).__name__}; ncu said: {(done.stderr or done.stdout)[-300:]}"
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    csv_path.write_text(done.stdout[done.stdout.index('"ID"'):])
    return rows, None


def write_summary(out_dir: Path, stem: str, summary: dict, text: str) -> None:
    """``<stem>.json`` (the summary) and ``<stem>.md`` (its table, ``text``) in ``out_dir``; the table printed too."""
    (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    (out_dir / f"{stem}.md").write_text(text)
    print(text)


def profile_all(out_dir: Path, kernels=KERNELS, stem: str = "ncu_forward") -> int:
    ncu, summary = ncu_run_info(kernels={})
    if ncu is None:
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = out_dir / f"{stem}.json"
    if tuple(kernels) != KERNELS and earlier.is_file():  # keep the other kernels' rows, from their own run
        kept = json.loads(earlier.read_text())["kernels"]
        summary["kernels"] = {name: dict(row, run=row.get("run", "earlier run")) for name, row in kept.items()}
    for name in kernels:
        rows, error = ncu_rows(ncu, __file__, name, out_dir / "ncu" / f"{stem}_{name}.csv")
        summary["kernels"][name] = dict(error=error) if error else summarise(rows[-1])
        print(name, json.dumps(summary["kernels"][name])[:600], flush=True)
    write_summary(out_dir, stem, summary, markdown(summary, stem))
    return 0


def rebuild_from_csv(out_dir: Path, stem: str, section: str, names, entry, render) -> int:
    """Rebuild ``<stem>.{json,md}`` in ``out_dir`` from the raw CSVs a run kept there (no GPU needed): each of
    ``names`` with a CSV gets ``summary[section][name] = entry(rows, earlier_entry)``; ``render`` writes the md."""
    summary = json.loads((out_dir / f"{stem}.json").read_text())
    for name in names:
        f = out_dir / "ncu" / f"{stem}_{name}.csv"
        if f.is_file():
            summary[section][name] = entry(parse_raw_csv(f.read_text()), summary[section].get(name, {}))
    write_summary(out_dir, stem, summary, render(summary))
    return 0


def from_csv(out_dir: Path, stem: str = "ncu_forward") -> int:
    """Rebuild ``<stem>.{json,md}`` from the raw CSVs a run kept (no GPU needed); a row keeps its ``run``."""
    def entry(rows, earlier):
        return dict(summarise(rows[-1]), **({"run": earlier["run"]} if earlier.get("run") else {}))

    return rebuild_from_csv(out_dir, stem, "kernels", KERNELS, entry, lambda summary: markdown(summary, stem))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", nargs="?", choices=KERNELS)
    parser.add_argument("--all", metavar="OUT_DIR", type=Path)
    parser.add_argument("--from-csv", metavar="OUT_DIR", type=Path, help="rebuild the summary from kept CSVs")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=KERNELS, help="with --all: only these")
    parser.add_argument("--stem", default="ncu_forward",
                        help="the summary's file name and the CSVs' prefix (another GPU's run: ncu_forward_h100)")
    args = parser.parse_args(argv)
    if args.all is not None:
        return profile_all(args.all, tuple(args.kernels), args.stem)
    if args.from_csv is not None:
        return from_csv(args.from_csv, args.stem)
    if args.kernel is None:
        parser.error("name a kernel or give --all OUT_DIR")
    one_launch(args.kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
