"""How fast the batch grader grades a class, and how much memory it takes.

Builds a synthetic class from ``solutions/`` and ``notebooks/`` (whole lessons,
demonstrations included): learner i answers every exercise correctly (i % 4 == 0),
leaves the stubs (1), plants a known mistake (2: one per lesson, e.g. no max in
the softmax, the running sum not rescaled), or answers 01-03 and leaves the rest
(3). Then grades it with ``python -m course_utils.grade``'s own function and prints
the wall time, the seconds per learner, each notebook's seconds, and the peak
resident memory of the grader's whole process tree (workers and kernels).

    python benchmarks/grade_class.py                 # 20 learners, notebooks 01-05 and 07
    python benchmarks/grade_class.py --learners 1    # the six notebooks for one correct learner
    python benchmarks/grade_class.py --learners 4 --json results/grade_class.json   # also record the run

Target: the full course for one learner in under 2 minutes on a 2-core CPU; on an H200 under 30 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from course_utils import STUB_LINE, build, grade, results  # noqa: E402

NOTEBOOKS = ["01_naive_attention", "02_online_softmax", "03_triton_basics", "04_flash_attention_forward",
             "05_causal_gqa", "07_backward"]
# One planted mistake per lesson: (what the solution says, what the mistaken learner wrote).
MISTAKES = {
    "01_naive_attention": ("e = np.exp(x - m)", "e = np.exp(x)"),
    "02_online_softmax": ("l = l * np.exp(m - m_new) + ", "l = l + "),
    "03_triton_basics": ("x = x - tl.max(x, axis=0)", "x = x"),
    "04_flash_attention_forward": ("kv_end = tl.minimum(N_size, (pid_m + 1) * BLOCK_M)", "kv_end = N_size"),
    "05_causal_gqa": ("return q_head // group_size", "return q_head % n_kv_heads"),
    "07_backward": ("delta = np.sum(do * o, axis=-1)", "delta = np.zeros(o.shape[:-1])"),
}


def answered(stem: str, kind: str):
    """The student notebook ``stem`` as a learner of ``kind`` hands it in."""
    solution = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
    nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code" or STUB_LINE not in cell.source or kind == "stubs":
            continue
        src = grade._source_cell(solution, cell).source
        src = "\n".join(ln for ln in src.split("\n") if ln.strip() not in (build.BEGIN_SOLUTION, build.END_SOLUTION))
        if kind == "mistakes":
            old, new = MISTAKES.get(stem, ("", ""))
            src = src.replace(old, new) if old else src
        cell.source = src
    return nb


def kind_of(i: int, stem: str) -> str:
    kind = ("correct", "stubs", "mistakes", "partial")[i % 4]
    if kind == "partial":
        return "correct" if stem < "04" else "stubs"
    return kind


class PeakMemory(threading.Thread):
    """Samples the resident memory of this process and all its descendants."""

    def __init__(self, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.every_s, self.peak, self.peak_one, self.stop = every_s, 0, 0, False

    def run(self):
        me = os.getpid()
        while not self.stop:
            parents, rss = {}, {}
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
                    rss[int(entry)] = int(Path(f"/proc/{entry}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                except (OSError, ValueError, IndexError):
                    continue
            tree, grew = {me}, True
            while grew:
                more = {p for p, parent in parents.items() if parent in tree} - tree
                tree |= more
                grew = bool(more)
            total = sum(rss.get(p, 0) for p in tree)
            self.peak = max(self.peak, total)
            self.peak_one = max([self.peak_one] + [rss.get(p, 0) for p in tree if p != me])
            time.sleep(self.every_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=None, help="default: the number of cores")
    parser.add_argument("--notebooks", nargs="+", default=NOTEBOOKS)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None,
                        help="append this run's summary to the JSON file's runs (the README quotes results/grade_class.json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grade-class-") as tmp:
        root, out = Path(tmp) / "class", Path(tmp) / "gradebook"
        for i in range(args.learners):
            for stem in args.notebooks:
                folder = root / f"learner{i:02d}"
                folder.mkdir(parents=True, exist_ok=True)
                nbformat.write(answered(stem, kind_of(i, stem)), folder / f"{stem}.ipynb")
        memory = PeakMemory()
        memory.start()
        import resource

        def cpu():
            return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                       for f in ("ru_utime", "ru_stime"))

        start, cpu_start = time.perf_counter(), cpu()
        rows = grade.grade([root], out, jobs=args.jobs, timeout=args.timeout)
        wall, cpu_s = time.perf_counter() - start, cpu() - cpu_start
        memory.stop = True
        memory.join()
    rows = [r for r in rows if r["notebook"] in args.notebooks]
    jobs = args.jobs or os.cpu_count()
    print(f"\n{args.learners} learners x {len(args.notebooks)} notebooks, --jobs {jobs}, {os.cpu_count()} cores: "
          f"{wall:.0f} s wall, {wall / args.learners:.1f} s per learner; {cpu_s:.0f} CPU-seconds in all "
          f"({cpu_s / args.learners:.0f} per learner), load average {os.getloadavg()[0]:.1f}")
    per_nb = {}
    for r in rows:
        per_nb.setdefault(r["notebook"], {})[r["learner"]] = r["notebook_seconds"]
    print("seconds per notebook (median over learners, max):")
    for stem, secs in per_nb.items():
        print(f"  {stem:28s} {statistics.median(secs.values()):6.1f} {max(secs.values()):6.1f}")
    course = {}
    for r in rows:
        course.setdefault(r["learner"], {})[r["notebook"]] = r["notebook_seconds"]
    correct = [sum(v.values()) for name, v in course.items() if int(name[-2:]) % 4 == 0]
    print(f"one correct learner, all notebooks one after another: {statistics.median(correct):.0f} s (median)")
    print(f"peak resident memory: {memory.peak / 2**30:.2f} GiB for the whole process tree, "
          f"{memory.peak_one / 2**30:.2f} GiB for the largest single process")
    statuses = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    print("statuses:", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())))
    wrong = [r for r in rows if int(r["learner"][-2:]) % 4 == 0 and r["status"] != "passed"]
    for r in wrong:  # a correct learner must pass everything
        print(f"NOT PASSED for a correct learner: {r['learner']} {r['notebook']} {r['exercise']} {r['status']}: {r['message']}")
    if args.json:
        record(args.json, dict(
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), cores=os.cpu_count(), jobs=jobs,
            learners=args.learners, notebooks=args.notebooks, wall_s=round(wall, 1), cpu_s=round(cpu_s, 1),
            one_correct_sequential_s=round(statistics.median(correct), 1), peak_gib=round(memory.peak / 2**30, 2),
            peak_one_gib=round(memory.peak_one / 2**30, 2), load_average=round(os.getloadavg()[0], 1),
            statuses=statuses, correct_not_passed=len(wrong)))
    return 0


def record(path: Path, run: dict) -> None:
    """Append ``run`` to the ``runs`` of the JSON file at ``path`` (created if missing)."""
    results.append_run(path, run, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
