"""How much of a forward + backward step is the host's: launch time against GPU time, per provider.

    python benchmarks/host_overhead.py [--json PATH --note TEXT] [--cprofile CASE]

For each case (bf16, GQA 32/8, D = 128) and provider it prints three numbers:

- ``host_ms``: the time the Python call takes to enqueue one step, measured while the GPU is kept
  busy by ``torch.cuda._sleep`` so that the host never waits for it;
- ``gpu_ms``: the median of ``triton.testing.do_bench`` over the same step (what the benches report);
- ``kernels_ms`` and ``launches``: the sum of the step's kernel durations and their number, from
  ``torch.profiler``.

Where ``host_ms`` is close to ``gpu_ms`` and ``kernels_ms`` is well below it, the step is launch-bound:
the GPU waits for Python, and the benches' time is the host's. ``--json`` appends the run (with
``--note``, what it measured) to the ``runs`` of that file (``results/host_overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from course_utils import bench  # noqa: E402
from course_utils.bench import cases, training, window  # noqa: E402

# (label, kind, N, window_size, sink_size). "training": training_bench's main case (its batch holds 16k
# tokens); "causal" and "window": window_bench's inputs (batch 1), plain causal or with the window.
CASES = [
    ("causal N=1k B=16", "training", 1024, None, 0),
    ("causal N=4k B=1", "causal", 4096, None, 0),
    ("W=256 S=0 N=4k", "window", 4096, 256, 0),
    ("W=1024 S=4 N=4k", "window", 4096, 1024, 4),
    ("W=1024 S=0 N=16k", "window", 16384, 1024, 0),
]


def steps(kind, n, w, s):
    """``{provider: step}`` for one case, on the inputs of the benchmark it comes from."""
    if kind == "training":
        q, k, v = (t.requires_grad_() for t in cases.make_inputs(cases.STANDARD_SUITE[0], n))
    else:
        q, k, v = window.make_inputs(n, requires_grad=True)
    do = torch.randn_like(q)
    if kind != "window":
        return {name: training.make_training_step(name, q, k, v, do, True)
                for name in ("course", "sdpa_flash", "sdpa_cudnn")}
    case = window.WindowCase(w, s, n)
    return {name: window.make_training_step(name, q, k, v, do, case) for name in ("course", "flex")}


def host_ms(step, reps=20):
    """Enqueue time of one step, with the GPU busy the whole time (the host never waits for it)."""
    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, far longer than the loop below
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / reps


def kernel_ms(step, reps=5):
    """(summed kernel time per step, kernels per step) from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in events)
    return total_us / 1e3 / reps, len(events) / reps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="append this run to the file's runs")
    parser.add_argument("--note", default="", help="what this run measured (stored with it)")
    parser.add_argument("--cprofile", default=None, metavar="CASE",
                        help="also print cProfile's top functions for the course's step of this case label")
    args = parser.parse_args(argv)
    if not bench.gpu_available():
        print(bench.NO_GPU_MESSAGE)
        return 0
    rows = []
    for label, kind, n, w, s in CASES:
        for name, step in steps(kind, n, w, s).items():
            row = dict(case=label, provider=name, host_ms=host_ms(step),
                       gpu_ms=triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))
            row["kernels_ms"], row["launches"] = kernel_ms(step)
            rows.append(row)
            print(f"{label:18s} {name:11s} host {row['host_ms']:6.3f} ms  gpu {row['gpu_ms']:6.3f} ms  "
                  f"kernels {row['kernels_ms']:6.3f} ms in {row['launches']:4.1f} launches", flush=True)
    if args.cprofile:
        import cProfile
        import pstats

        label, kind, n, w, s = next(c for c in CASES if c[0] == args.cprofile)
        step = steps(kind, n, w, s)["course"]
        step()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        with cProfile.Profile() as prof:
            for _ in range(20):
                step()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.json:
        data = json.loads(args.json.read_text()) if args.json.exists() else {"runs": []}
        info = dict(torch=torch.__version__, triton=triton.__version__, device=torch.cuda.get_device_name(),
                    date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        data["runs"].append(dict(info=info, note=args.note, rows=rows))
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
