"""How long each check takes on correct answers, on this machine.

A check runs every time a learner executes a grader cell, so it has to be
quick on a small CPU: the budget is 5 s for a NumPy check (Parts 1 and 4) and 30 s
for a Triton check on a 2-core machine (in the interpreter). Each check runs
several times with different seeds (so different random cases); the table
shows the measured seconds. The correct answers are the course's references
and kernels, and for ``check_triton_softmax`` the solution of lesson 03.

    python benchmarks/grading_speed.py [--repeats 5] [--part numpy|triton|all]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from pathlib import Path

import course_utils  # noqa: F401  (first, as in every notebook)
from course_utils import references as ref

ROOT = Path(__file__).resolve().parent.parent


def solution_function(notebook: str, name: str):
    """``name`` as defined by a solution notebook, found by running its cells up to it.

    Grader cells (those calling ``check_``) are skipped; printed output is dropped.
    """
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    namespace: dict = {}
    for cell in nb.cells:
        if cell.cell_type != "code" or "check_" in cell.source.replace("import check_", ""):
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(cell.source, f"{notebook}", "exec"), namespace)
        if name in namespace:
            return namespace[name]
    raise LookupError(f"{notebook} defines no {name}")


def numpy_checks():
    from course_utils import grading as g

    def tiled_backward(q, k, v, o, lse, do, causal=False):
        return ref.tiled_attention_backward(q, k, v, o, lse, do, 16, 32, causal=causal)

    return [
        ("check_softmax", g.check_softmax, ref.softmax),
        ("check_naive_attention", g.check_naive_attention, ref.attention),
        ("check_online_softmax", g.check_online_softmax, ref.online_softmax),
        ("check_tiled_attention", g.check_tiled_attention, ref.tiled_attention),
        ("check_tiled_backward", g.check_tiled_backward, tiled_backward),
        ("check_attention_flops", g.check_attention_flops, lambda b, h, n, d, causal: 4 * b * h * n * n * d / (2 if causal else 1)),
        ("check_roofline", g.check_roofline, lambda i, peak, bw: min(peak, i * bw / 1000)),
        ("check_merge_partials", g.check_merge_partials, ref.merge_partials),
        ("check_ring_simulation", g.check_ring_simulation, g.part6_ring.simulate),
    ]


def triton_checks():
    from course_utils import distributed, grading, kernels

    return [
        ("check_kv_head", grading.check_kv_head, lambda q_head, n_q, n_kv: q_head // (n_q // n_kv)),
        ("check_triton_softmax", grading.check_triton_softmax, solution_function("03_triton_basics.ipynb", "triton_softmax")),
        ("check_flash_forward", grading.check_flash_forward, kernels.flash_attention_forward),
        ("check_flash_gqa", grading.check_flash_gqa, lambda q, k, v: kernels.flash_attention_with_lse(q, k, v, causal=True)),
        ("check_flash_backward", grading.check_flash_backward, kernels.flash_attention),
        ("check_decode_split", grading.check_decode_split, _decode_split),
        ("check_decode_combine", grading.check_decode_combine, _decode_combine),
        # starts 2 processes (spawn, gloo): most of its time is importing torch in each
        ("check_ring_attention", grading.check_ring_attention, distributed.ring_attention_forward),
    ]


def _decode_split(q, k_cache, v_cache, cache_seqlens, num_splits):
    from course_utils.kernels import decode

    return decode.decode_split(q, k_cache, v_cache, cache_seqlens, num_splits)


def _decode_combine(o_parts, lse_parts):
    import torch

    from course_utils.kernels import decode

    out = torch.empty(o_parts.shape[:3] + o_parts.shape[4:], dtype=torch.float32, device=o_parts.device)
    return decode.decode_combine(o_parts, lse_parts, out)


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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part", choices=("numpy", "triton", "all"), default="all")
    args = parser.parse_args(argv)
    groups = []
    if args.part in ("numpy", "all"):
        groups.append((5.0, numpy_checks()))
    if args.part in ("triton", "all"):
        groups.append((30.0, triton_checks()))
    print(f"{course_utils.ENV.device}, interpreter {'on' if course_utils.ENV.interpreter else 'off'}")
    print(f"{'check':<24}{'runs':>6}{'min s':>10}{'median s':>10}{'max s':>10}  budget")
    over = False
    for budget, checks in groups:
        for name, check, solution in checks:
            t = measure(check, solution, args.repeats)
            ok = max(t) < budget
            over |= not ok
            print(f"{name:<24}{len(t):>6}{min(t):>10.3f}{statistics.median(t):>10.3f}{max(t):>10.3f}  "
                  f"{'within' if ok else 'OVER'} {budget:g} s")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
