"""Where a short training step's host time goes, through the Gluon backward's route and through lesson 07's.

    python benchmarks/host_step.py [--package DIR] [--profile PATH]

At the window grid's shortest point without sinks (W = 256, N = 4k, batch 1, GQA 32/8, D = 128, bf16; the point
where the grid's forward + backward was host-bound), it prints the host's enqueue time (``host_overhead.host_ms``:
the GPU kept busy, so the host never waits; the best of three runs of 50 calls) of:

- the step ``flash_attention(q, k, v, True, window_size=256).backward(do)`` with ``fast_backward.AUTOGRAD_CONFIG`` as
  shipped (the Gluon backward) and set to ``None`` (lesson 07's pair), and of the forward alone, with and without grad;
- the backward alone (``torch.autograd.backward`` on a kept graph) through the Gluon route;
- ``hopper_ws_bwd.attention_backward`` called directly, one ``hopper_ws._descriptor``, one ``autograd_config``;
- each launch of the step through ``kernel[grid]`` and through the compiled kernel's ``run`` (``host_overhead.py
  --launches``'s ``launch_costs``);

and with ``--profile PATH`` writes cProfile's tables of 20 steps there. ``--package DIR`` imports ``course_utils``
from ``DIR`` instead (``git archive REV course_utils | tar -x -C DIR``: the same measurements of an earlier commit,
in the same call). Needs a Hopper GPU (the Gluon route runs there only).
"""

from __future__ import annotations

import argparse
import io
import pstats
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, default=None, help="import course_utils from this folder")
    parser.add_argument("--profile", type=Path, default=None, help="write cProfile's tables of 20 steps here")
    args = parser.parse_args(argv)
    if args.package:
        sys.path.insert(0, str(args.package.resolve()))
    import course_utils  # noqa: F401  (first, as in every notebook)

    print("course_utils from", course_utils.__file__)
    sys.path.insert(1, str(HERE))
    import host_overhead as ho  # noqa: E402  (puts the repository on the path after the package above)
    import torch

    from course_utils import bench
    from course_utils.kernels import fast_backward, flash_attention, hopper_ws, hopper_ws_bwd

    if not bench.gpu_available():
        print(bench.NO_GPU_MESSAGE)
        return 0

    def us(call, reps=50):
        return min(ho.host_ms(call, reps) for _ in range(3)) * 1e3

    w, n = 256, 4096
    q, k, v = ho.window.make_inputs(n, requires_grad=True)
    do = torch.randn_like(q)

    def step():
        q.grad = k.grad = v.grad = None
        flash_attention(q, k, v, True, window_size=w).backward(do)

    def forward_no_grad():
        with torch.no_grad():
            flash_attention(q, k, v, True, window_size=w)

    def forward_grad():
        flash_attention(q, k, v, True, window_size=w)

    shipped = fast_backward.AUTOGRAD_CONFIG
    for name, config in (("gluon", shipped), ("lesson07", None)):
        fast_backward.AUTOGRAD_CONFIG = config
        print(f"W={w} S=0 N={n // 1024}k {name}: step host {us(step):.0f} us, fwd(no grad) {us(forward_no_grad):.0f} us, "
              f"fwd(grad) {us(forward_grad):.0f} us", flush=True)
    fast_backward.AUTOGRAD_CONFIG = shipped
    o = flash_attention(q, k, v, True, window_size=w)

    def backward_alone():
        q.grad = k.grad = v.grad = None
        torch.autograd.backward(o, do, retain_graph=True)

    lse = torch.zeros(q.shape[:3], device="cuda")
    qd, kd, vd, od = (t.detach() for t in (q, k, v, o))
    calls = {
        "gluon: backward alone host": (backward_alone, 50),
        "hopper_ws_bwd.attention_backward host": (
            lambda: hopper_ws_bwd.attention_backward(qd, kd, vd, od, lse, do, True, window_size=w), 50),
        "one _descriptor": (lambda: hopper_ws._descriptor(qd.view(-1, 128), [64, 128]), 200),
        "autograd_config": (lambda: fast_backward.autograd_config(q, k, v, True, w, 0), 200),
    }
    for label, (call, reps) in calls.items():
        print(f"W={w} S=0 N={n // 1024}k {label} {us(call, reps):.1f} us", flush=True)
    if args.profile:
        out = io.StringIO()
        stats = pstats.Stats(ho.profile_steps(step), stream=out)
        for key, count in (("tottime", 30), ("cumulative", 40), ("ncalls", 30)):
            stats.sort_stats(key).print_stats(count)
        args.profile.write_text(out.getvalue())
        print("profile:", out.getvalue().splitlines()[0].strip(), flush=True)
    for row in ho.launch_costs(ho.capture_launches(step), reps=200):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
