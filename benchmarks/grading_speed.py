"""How long each check takes on correct answers, on this machine.

A check runs every time a learner executes a grader cell, so it has to be
quick on a small CPU: the budget is 5 s for a NumPy check (Parts 1 and 4) and 30 s
for a Triton check on a 2-core machine (in the interpreter). Each check runs
several times with different seeds (so different random cases); the table
shows the measured seconds. The correct answers are the solution notebooks'
functions (the checks refuse the course's references in the streaming and
tiled exercises and the course's kernels in the Triton ones, so a learner's
own code is what is timed), and the references where they are allowed.

    python benchmarks/grading_speed.py [--repeats 5] [--part numpy|triton|all] [--only check_x ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import statistics
import time
from pathlib import Path

import course_utils  # noqa: F401  (first, as in every notebook)

ROOT = Path(__file__).resolve().parent.parent


def solution_function(notebook: str, name: str):
    """``name`` as defined by a solution notebook, found by running its cells up to it.

    Grader cells (those calling ``check_``) are skipped; printed output is dropped. Each cell's
    source is registered in :mod:`linecache` under its own name, as Jupyter does, so that
    ``inspect.getsource`` finds it (Triton's compiler reads a ``@triton.jit`` kernel's source on a
    GPU, and the grading worker ships kernels as source).
    """
    import linecache

    import nbformat

    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    namespace: dict = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or re.search(r"^check_\w+\(", cell.source, re.MULTILINE):
            continue
        filename = f"<{notebook} cell {index}>"
        lines = cell.source.splitlines(keepends=True)
        linecache.cache[filename] = (len(cell.source), None, lines, filename)  # mtime None: kept by checkcache
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(cell.source, filename, "exec"), namespace)
        if name in namespace:
            return namespace[name]
    raise LookupError(f"{notebook} defines no {name}")


# A correct answer for each exercise, made on demand: by default the function that the exercise's grader cell
# passes in its solution notebook (`check_x(name)`: :func:`grader_cell_answer`); here, the exercises answered
# otherwise (a formula the check allows). (check_ring_attention starts 3 processes, spawn and
# gloo: most of its time is importing torch in each.)
ANSWERS = {
    "check_attention_flops": lambda: lambda b, h, n, d, causal: 4 * b * h * n * n * d / (2 if causal else 1),
    "check_roofline": lambda: lambda i, peak, bw: min(peak, i * bw / 1000),
    "check_kv_head": lambda: lambda q_head, n_q, n_kv: q_head // (n_q // n_kv),
}


def grader_cell_answer(exercise):
    """The solution notebook's answer to ``exercise``: the name its first grader cell passes (``check_x(name)``),
    defined by running the notebook's cells up to it; None where that cell passes no plain name."""
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / f"{exercise.lesson}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        found = re.search(rf"^{exercise.name}\((\w+)\)", cell.source, re.MULTILINE)
        if found:
            return solution_function(f"{exercise.lesson}.ipynb", found.group(1))
    return None


def _grading():
    from course_utils import grading

    return grading


def budget_s(exercise) -> float:
    """The budget of one check: 5 s for a NumPy or arithmetic check, 30 s for one that runs Triton."""
    return 30.0 if exercise.isolated or exercise.name == "check_ring_attention" else 5.0


def in_part(exercise, part: str) -> bool:
    """Whether ``exercise`` belongs to ``part`` (numpy: a 5-s budget, triton: a 30-s one; all)."""
    triton = budget_s(exercise) > 5.0 or exercise.name == "check_kv_head"
    return part == "all" or (part == "triton") == triton


def timed_checks(part: str = "all", only=None):
    """``(exercise, answer)`` for each exercise of the table in ``part`` (and in ``only``, a list of names, if
    given) that has an answer, in the table's order."""
    for exercise in _grading().EXERCISES:
        if in_part(exercise, part) and (not only or exercise.name in only):
            answer = ANSWERS[exercise.name]() if exercise.name in ANSWERS else grader_cell_answer(exercise)
            if answer is not None:
                yield exercise, answer


def measure(check, solution, repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``check(solution)``, seeds 0..repeats-1."""
    times = []
    for seed in range(repeats):
        start = time.perf_counter()
        check(solution, seed=seed)
        times.append(time.perf_counter() - start)
    return times


def cpu_seconds(check, solution, seed: int = 0) -> float:
    """CPU seconds (this process and its grading child) of one ``check(solution)``: load-independent."""
    import resource

    def used():
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    start = used()
    check(solution, seed=seed)
    return used() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part", choices=("numpy", "triton", "all"), default="all")
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="time these checks alone (check_... names)")
    args = parser.parse_args(argv)
    print(f"{course_utils.ENV.device}, interpreter {'on' if course_utils.ENV.interpreter else 'off'}")
    print(f"{'check':<28}{'runs':>6}{'min s':>10}{'median s':>10}{'max s':>10}{'cpu s':>8}  budget")
    over = False
    timed = set()
    for exercise, solution in timed_checks(args.part, args.only):
        timed.add(exercise.name)
        check, budget = exercise.check, budget_s(exercise)
        t = measure(check, solution, args.repeats)
        cpu = cpu_seconds(check, solution, seed=args.repeats)
        ok = max(t) < budget
        over |= not ok
        print(f"{exercise.name:<28}{len(t):>6}{min(t):>10.3f}{statistics.median(t):>10.3f}{max(t):>10.3f}{cpu:>8.2f}  "
              f"{'within' if ok else 'OVER'} {budget:g} s", flush=True)
    untimed = [e.name for e in _grading().EXERCISES
               if in_part(e, args.part) and (not args.only or e.name in args.only) and e.name not in timed]
    if untimed:
        print("not timed here (no answer in ANSWERS, and no plain name in the grader cell): " + ", ".join(untimed))
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
