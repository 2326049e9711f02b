"""How long each part 1 check takes on the reference solutions.

A check runs every time a learner executes a grader cell, so it has to be
quick on a small CPU (the budget is 5 s per check on a 2-core machine). Each
check is run several times with different seeds (so different random cases)
and the table shows the measured seconds.

    python benchmarks/grading_speed.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import course_utils  # noqa: F401  (first, as in every notebook)
from course_utils import references as ref
from course_utils.grading import part1_numpy as p1

BUDGET_S = 5.0

CHECKS = [
    ("check_softmax", p1.check_softmax, ref.softmax),
    ("check_naive_attention", p1.check_naive_attention, ref.attention),
    ("check_online_softmax", p1.check_online_softmax, ref.online_softmax),
    ("check_tiled_attention", p1.check_tiled_attention, ref.tiled_attention),
]


def measure(check, solution, repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``check(solution)``, seeds 0..repeats-1."""
    times = []
    for seed in range(repeats):
        start = time.perf_counter()
        check(solution, seed=seed)
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"{'check':<24}{'runs':>6}{'min s':>10}{'median s':>10}{'max s':>10}  within {BUDGET_S:g} s")
    worst = 0.0
    for name, check, solution in CHECKS:
        t = measure(check, solution, args.repeats)
        worst = max(worst, max(t))
        ok = "yes" if max(t) < BUDGET_S else "NO"
        print(f"{name:<24}{len(t):>6}{min(t):>10.4f}{statistics.median(t):>10.4f}{max(t):>10.4f}  {ok}")
    return 0 if worst < BUDGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
