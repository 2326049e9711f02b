"""How long each cell of the solution notebooks takes, run top to bottom as a learner runs them.

Each notebook of ``solutions/`` runs in a fresh kernel with the course's notebook client (as ``make
solutions`` runs them; nothing is written back), one after another, and each code cell's seconds are
read from the timing nbclient records: from the kernel's ``execute_input`` to its ``execute_reply``.
Prints each notebook's time and its slowest cells; ``--json`` appends the run to a file (the README's
"every cell runs in seconds" quotes ``results/cell_times.json``).

    python benchmarks/cell_times.py                            # every notebook
    python benchmarks/cell_times.py 08 09 --top 5              # the notebooks whose names start so
    python benchmarks/cell_times.py --json results/cell_times.json

On a CPU the Triton cells run in Triton's interpreter, as on a learner's laptop; on a GPU, compiled.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from course_utils import ENV, build, results  # noqa: E402


def cell_seconds(cell) -> float | None:
    """The seconds from the kernel's ``execute_input`` to its ``execute_reply`` (nbclient's ``record_timing``)."""
    timing = cell.get("metadata", {}).get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return None
    parse = datetime.datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def first_line(source: str) -> str:
    return next((ln.strip() for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")[:70]


def time_notebook(path: Path, timeout_s: int) -> dict:
    """Run ``path`` in a fresh kernel; {"notebook", "wall_s", "cells_s", "cells": [{"index", "seconds", "first_line"}]}."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    build.notebook_client(nb, timeout=timeout_s, kernel_name="python3", record_timing=True,
                          resources={"metadata": {"path": str(path.parent)}}).execute()
    wall = time.perf_counter() - start
    cells = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.source.strip():
            seconds = cell_seconds(cell)
            if seconds is None:
                raise RuntimeError(f"{path.name}: cell {index} has no execution timing")
            cells.append({"index": index, "seconds": round(seconds, 2), "first_line": first_line(cell.source)})
    return {"notebook": path.stem, "wall_s": round(wall, 1), "cells_s": round(sum(c["seconds"] for c in cells), 1),
            "cells": cells}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefixes", nargs="*", help="the notebooks whose names start so (default: all)")
    parser.add_argument("--top", type=int, default=3, help="the slowest cells printed per notebook")
    parser.add_argument("--timeout", type=int, default=600, help="a cell's time limit, seconds")
    parser.add_argument("--json", type=Path, default=None, help="append this run to the JSON file's runs")
    args = parser.parse_args()
    paths = [p for p in sorted((ROOT / "solutions").glob("*.ipynb"))
             if not args.prefixes or any(p.stem.startswith(x) for x in args.prefixes)]
    machine = ENV.gpu_name or "no GPU: Triton's interpreter on the CPU"
    print(f"{machine}, {os.cpu_count()} cores; torch {importlib.metadata.version('torch')}, "
          f"triton {importlib.metadata.version('triton')}")
    notebooks = []
    for path in paths:
        row = time_notebook(path, args.timeout)
        notebooks.append(row)
        slowest = sorted(row["cells"], key=lambda c: -c["seconds"])[:args.top]
        print(f"{row['notebook']:36s} {row['wall_s']:6.1f} s with the kernel's start, {row['cells_s']:6.1f} s of "
              f"cells; slowest: " + "; ".join(f"cell {c['index']} {c['seconds']:.1f} s (`{c['first_line'][:40]}`)"
                                               for c in slowest), flush=True)
    worst = max((dict(c, notebook=r["notebook"]) for r in notebooks for c in r["cells"]), key=lambda c: c["seconds"])
    print(f"slowest cell of all: {worst['notebook']} cell {worst['index']}, {worst['seconds']:.1f} s "
          f"(`{worst['first_line']}`); load average {os.getloadavg()[0]:.1f}")
    if args.json:
        results.append_run(args.json, dict(
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=machine, cores=os.cpu_count(),
            torch=importlib.metadata.version("torch"), triton=importlib.metadata.version("triton"),
            load_average=round(os.getloadavg()[0], 1), notebooks=notebooks), __doc__.split("\n\n")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
