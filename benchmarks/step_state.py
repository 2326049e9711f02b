"""What slows the short window training step in the window grid's process: FlexAttention's compile, Python's
collector, or where the process runs?

    python benchmarks/step_state.py [--out PATH] [--node N] [--fresh-only]

The window grid (``python -m course_utils.bench window``) times the course's forward + backward at W = 256, N = 4k
right after FlexAttention's at the same point, in one process. There it read 0.67, 0.88 and 0.53 ms on an H200 in
three runs, and FlexAttention's step 0.64, 0.82 and 0.51 ms, while ``benchmarks/route_check.py`` (no FlexAttention
in its process) timed the same step at 0.32 ms on the same machine (``results/route_check_h200.json``). This probe
times that step (``window.make_training_step``, ``do_bench`` with the grid's ``--quick``
settings, three times) and its host enqueue time (``host_overhead.host_ms``) in one process:

1. ``fresh``: before anything else;
2. ``after flex``: after FlexAttention's training step at the same point has been compiled and timed;
3. ``after flex, gc frozen``: the same, with every object alive moved out of the collector's generations
   (``gc.freeze()``);
4. ``after flex, gc off``: with the cyclic collector disabled.

For each it also counts the collector's runs per step and the time they took (``gc.callbacks``). Points: W = 256 and
1024 without sinks, N = 4k (batch 1, GQA 32/8, D = 128, bf16). Needs a GPU.

A third guess is the machine's: a process placed on the CPUs of the other socket than the GPU's launches more
slowly. Every row records where the process ran (``placement``: its CPU and that CPU's NUMA node, the GPU's node),
and ``--node N`` pins the process to node N's CPUs first; ``--fresh-only`` stops after the first state (one process
per node, as ``gpu_plan.sh stepstate`` runs them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))


class GcClock:
    """Counts the cyclic collector's runs by generation and the seconds they took, while installed."""

    def __init__(self):
        self.runs = [0, 0, 0]
        self.seconds = 0.0
        self._t0 = None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.runs[info["generation"]] += 1
            self._t0 = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def _read(path):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def node_cpus(node: int) -> set[int]:
    """The CPUs of NUMA node ``node`` (its ``cpulist``, such as ``0-15,32-47``); empty where the node is unknown."""
    cpus = set()
    for part in (_read(f"/sys/devices/system/node/node{node}/cpulist") or "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def placement() -> dict:
    """Where this process runs: its CPU now (``/proc/self/stat``), that CPU's NUMA node, the CPUs it may run on,
    and the first GPU's NUMA node (from ``nvidia-smi``'s PCI bus id; None where any of it cannot be read)."""
    stat = _read("/proc/self/stat")
    cpu = int(stat.rsplit(")", 1)[1].split()[36]) if stat else None
    nodes = sorted(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    cpu_node = next((n for n in nodes if cpu in node_cpus(n)), None)
    gpu_node = None
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.split()[0]
        domain, rest = bus.split(":", 1)
        gpu_node = _read(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}".lower() + "/numa_node")
        gpu_node = int(gpu_node) if gpu_node is not None else None
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        pass
    return dict(cpu=cpu, cpu_node=cpu_node, allowed_cpus=len(os.sched_getaffinity(0)), gpu_node=gpu_node,
                nodes=nodes)


def measure(step, label, reps=100):
    """do_bench (the grid's --quick settings) three times, the host time, and the collector's share per step."""
    import host_overhead as ho
    import torch
    import triton

    times = [triton.testing.do_bench(step, warmup=10, rep=40, return_mode="median") for _ in range(3)]
    host = min(ho.host_ms(step, 50) for _ in range(3))
    torch.cuda.synchronize()
    with GcClock() as clock:
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    row = dict(state=label, do_bench_ms=times, host_ms=host, wall_ms_per_step=wall * 1e3 / reps,
               gc_runs_per_step=[r / reps for r in clock.runs], gc_ms_per_step=clock.seconds * 1e3 / reps,
               gc_objects=len(gc.get_objects()), placement=placement())
    print(json.dumps(row), flush=True)
    return row


def after_flex(steps, cases, q, k, v, do) -> list[dict]:
    """FlexAttention's training step compiled and timed at each case, then ``steps`` timed again: as they are, with
    the collector's generations frozen, with the collector off."""
    import triton

    from course_utils.bench import window

    rows = []
    for case in cases:
        flex = window.make_training_step("flex", q, k, v, do, case)
        flex()
        flex_ms = statistics.median(triton.testing.do_bench(flex, warmup=10, rep=40, return_mode="median")
                                    for _ in range(3))
        rows.append(dict(state="flex", window_size=case.window_size, do_bench_ms=[flex_ms]))
        print(json.dumps(rows[-1]), flush=True)
    for label, before, after in (("after flex", None, None), ("after flex, gc frozen", gc.freeze, gc.unfreeze),
                                 ("after flex, gc off", gc.disable, gc.enable)):
        if before:
            before()
        try:
            rows += [dict(measure(step, label), window_size=w) for w, step in steps.items()]
        finally:
            if after:
                after()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    parser.add_argument("--node", type=int, default=None, help="run on this NUMA node's CPUs only")
    parser.add_argument("--fresh-only", action="store_true", help="time the first state only")
    args = parser.parse_args(argv)
    if args.node is not None:
        cpus = node_cpus(args.node)
        if not cpus:
            print(f"no NUMA node {args.node} here")
            return 0
        os.sched_setaffinity(0, cpus)
    import course_utils  # noqa: F401  (first, as in every notebook)
    import torch

    from course_utils import bench
    from course_utils.bench import window

    if not bench.gpu_available():
        print(bench.NO_GPU_MESSAGE)
        return 0
    rows = []
    n = 4096
    q, k, v = window.make_inputs(n, requires_grad=True)
    do = torch.randn_like(q)
    cases = [window.WindowCase(w, 0, n) for w in (256, 1024)]
    steps = {case.window_size: window.make_training_step("course", q, k, v, do, case) for case in cases}
    for w, step in steps.items():
        step()
        rows.append(dict(measure(step, "fresh"), window_size=w, node=args.node))
    if not args.fresh_only:
        rows += after_flex(steps, cases, q, k, v, do)
    if args.out:
        args.out.write_text(json.dumps(dict(info=bench.environment_info(), rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
