"""Where a forward kernel's warps wait, instruction by instruction: Nsight Compute's stall sampling on its SASS.

``benchmarks/ncu_forward.py`` reads a kernel's counters as totals: lesson 11's Gluon FP8 forward keeps its tensor
pipes 41.5% busy and its exp2 unit 43.5%, issues in 42% of its cycles, and its warps stall most on "barrier"
(``results/ncu_forward.md``). Totals cannot say which barrier. Nsight Compute also samples each warp's program
counter and why it is not issuing, and its source page gives the samples per SASS instruction; this script keeps
that page and ranks it:

    python benchmarks/ncu_source.py KERNEL [KERNEL ...] --out OUT_DIR [--stem ncu_source_h100] [--top 30]

KERNEL is one of ``ncu_forward.py``'s (its one warmed-up launch between cudaProfilerStart/Stop, the same inputs:
GQA 32/8, D = 128, N = 4096, batch 4, not causal). For each, ``ncu --clock-control none --set full --import-source
yes`` writes a report, ``ncu --page source --csv --print-source sass`` prints its instructions, and the summary
(``<stem>.json`` and ``.md`` in OUT_DIR, the CSV in ``OUT_DIR/ncu/``) holds the instructions with the most samples
(each with its share of all samples) and the samples summed by opcode (``BAR``: named barriers; ``SYNCS``: mbarrier
waits; ``WARPGROUP``: wgmma's fences and waits; ``MUFU``: exp2). Needs a CUDA GPU and ``ncu`` on PATH; without
them it says so and exits 0. ``--from-csv OUT_DIR`` rebuilds the summary from kept CSVs (no GPU).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ncu_forward import KERNELS, ncu_run_info, write_summary  # noqa: E402

SOURCE_OPTIONS = ("--clock-control", "none", "--set", "full", "--import-source", "yes", "--profile-from-start", "off")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    """The opcode family of one SASS line: ``@!P0 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80`` -> ``BAR``."""
    words = [w for w in sass.strip().split() if not re.fullmatch(r"@!?U?P[0-9T]+", w)]
    return words[0].split(".")[0] if words else ""


def parse_source_csv(text: str) -> list[dict]:
    """The rows of ``ncu --page source --csv --print-source sass``: ``address``, ``sass``, ``samples`` (the column
    "Warp Stall Sampling (All Samples)") and ``not_issued`` ("... (Not-issued Samples)", 0 where absent), one per
    instruction. Lines before the header (ncu's own messages) are skipped."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "Source" in line and "Sampling" in line)
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    col = {name: i for i, name in enumerate(header)}
    source = next(i for name, i in col.items() if name.strip('"# ') == "Source")
    address = next((i for name, i in col.items() if "Address" in name), None)
    samples = next(i for name, i in col.items() if "Sampling" in name and "All" in name)
    not_issued = next((i for name, i in col.items() if "Sampling" in name and "Not-issued" in name), None)
    rows = []
    for cells in reader:
        if len(cells) <= max(source, samples):
            continue
        rows.append(dict(address=cells[address] if address is not None else str(len(rows)), sass=cells[source].strip(),
                         samples=_number(cells[samples]),
                         not_issued=_number(cells[not_issued]) if not_issued is not None else 0.0))
    return rows


def summarise(rows: list[dict], top: int = 30) -> dict:
    """The ``top`` instructions by samples (each with its % of all samples) and the samples summed by opcode."""
    total = sum(r["samples"] for r in rows) or 1.0
    by_opcode: dict[str, float] = {}
    for r in rows:
        by_opcode[opcode(r["sass"])] = by_opcode.get(opcode(r["sass"]), 0.0) + r["samples"]
    ranked = sorted(rows, key=lambda r: -r["samples"])[:top]
    return dict(total_samples=total, instructions=len(rows),
                top=[dict(r, pct=100 * r["samples"] / total) for r in ranked],
                by_opcode=[dict(opcode=k, samples=v, pct=100 * v / total)
                           for k, v in sorted(by_opcode.items(), key=lambda kv: -kv[1])])


def markdown(summary: dict) -> str:
    lines = ["# Nsight Compute's stall sampling, per SASS instruction\n",
             f"{summary.get('gpu', '')}, torch {summary.get('torch', '')}, triton {summary.get('triton', '')}, "
             f"`ncu --set full --import-source yes` ({summary.get('ncu', '')}), `--page source --print-source sass`; "
             "GQA 32/8, D = 128, N = 4096, batch 4, not causal (`benchmarks/ncu_source.py`).\n"]
    for name, k in summary["kernels"].items():
        if "error" in k:
            lines.append(f"## {name}\n\nnot measured: {k['error']}\n")
            continue
        lines.append(f"## {name}\n\n{k['instructions']} instructions, {k['total_samples']:.0f} samples. By opcode: "
                     + ", ".join(f"{o['opcode']} {o['pct']:.1f}%" for o in k["by_opcode"][:10]) + ".\n")
        lines += ["| address | instruction | samples % | not issued |", "|---|---|---:|---:|"]
        lines += [f"| {r['address']} | `{r['sass'][:70]}` | {r['pct']:.1f} | {r['not_issued']:.0f} |" for r in k["top"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def profile(ncu: str, name: str, out_dir: Path, stem: str, timeout: int = 300) -> tuple[list[dict] | None, str | None]:
    """Profile ``ncu_forward.py name`` into a report, print its source page; ``(rows, None)`` or ``(None, why)``."""
    report = out_dir / "ncu" / f"{stem}_{name}"
    report.parent.mkdir(parents=True, exist_ok=True)
    script = Path(__file__).resolve().parent / "ncu_forward.py"
    done = subprocess.run([ncu, *SOURCE_OPTIONS, "-f", "-o", str(report), sys.executable, str(script), name],
                          capture_output=True, text=True, timeout=timeout)
    rep = report.with_suffix(".ncu-rep")
    if not rep.is_file():
        return None, f"no report; ncu said: {(done.stderr or done.stdout)[-300:]}"
    page = subprocess.run([ncu, "-i", str(rep), "--page", "source", "--csv", "--print-source", "sass"],
                          capture_output=True, text=True, timeout=timeout)
    rep.unlink()  # tens of MB; the page below is what is kept
    try:
        rows = parse_source_csv(page.stdout)
    except StopIteration:
        return None, f"no source page; ncu said: {(page.stderr or page.stdout)[-300:]}"
    (out_dir / "ncu" / f"{stem}_{name}.csv").write_text(page.stdout)
    return rows, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="*", metavar="KERNEL", help=f"any of {', '.join(KERNELS)}")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--stem", default="ncu_source")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--from-csv", action="store_true", help="rebuild the summary from the CSVs kept in --out")
    args = parser.parse_args(argv)
    if args.from_csv:
        summary = json.loads((args.out / f"{args.stem}.json").read_text())
        for name in summary["kernels"]:
            f = args.out / "ncu" / f"{args.stem}_{name}.csv"
            if f.is_file():
                summary["kernels"][name] = summarise(parse_source_csv(f.read_text()), args.top)
        write_summary(args.out, args.stem, summary, markdown(summary))
        return 0
    if not args.kernels or set(args.kernels) - set(KERNELS):
        parser.error(f"name one or more kernels of {', '.join(KERNELS)} (or give --from-csv)")
    ncu, summary = ncu_run_info(kernels={})
    if ncu is None:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.kernels:
        rows, error = profile(ncu, name, args.out, args.stem)
        summary["kernels"][name] = dict(error=error) if error else summarise(rows, args.top)
        # after each kernel: a call stopped by its budget keeps what it had
        write_summary(args.out, args.stem, summary, markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
