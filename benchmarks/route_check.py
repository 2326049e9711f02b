"""The Gluon routes' thresholds, timed: each public entry with its route as shipped against the same call with it off.

``kernels.dispatch.GLUON_MIN_N`` / ``GLUON_MIN_WINDOW`` send long forwards and wide windows to lesson 11's Gluon
forward, and ``fast_backward.AUTOGRAD_CONFIG`` sends autograd's backward to its Gluon backward. Each was set from a
few points (results/GPU_VALIDATION.md); this script times, in one process and alternating the order in each of
``--rounds`` rounds, ``kernels.flash_attention`` with the switch as shipped (``on``) and switched off (``off``):

- ``forward``: plain causal at N 4k-16k (16k tokens per batch), and the window at W 1024 / 4096, S 0 / 4, N 8k-64k
  (batch 1), the forward alone (``GLUON_MIN_N`` and ``GLUON_MIN_WINDOW`` set to ``None`` for ``off``);
- ``training``: forward + backward, the window without sinks at W 256 / 1024 / 4096, N 4k / 16k / 64k, and plain
  causal at N 4k-16k (``AUTOGRAD_CONFIG = None`` for ``off``; the forward as shipped in both).

bf16, GQA 32/8, D = 128. Both outputs (and the gradients) are compared before timing; a row whose two results differ
by more than bf16's rounding is recorded with ``status`` "mismatch" and not timed. Prints one line a point and
writes ``--out`` (JSON: ``info``, ``rows`` with ``on_ms``, ``off_ms``, ``on_over_off`` = off_ms / on_ms, the
speed of the route relative to the path without it).

    python benchmarks/route_check.py [--out results/route_check.json] [--rounds 2] [--quick]

Needs a Hopper GPU (elsewhere the switches change nothing: it says so and exits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import course_utils  # noqa: E402,F401  (first, as in every notebook)
import torch  # noqa: E402

from course_utils import bench  # noqa: E402
from course_utils.kernels import dispatch, fast_backward, flash_attention  # noqa: E402

HEADS, KV_HEADS, D, TOKENS = 32, 8, 128, 16384
FORWARD_POINTS = [(None, 0, n) for n in (4096, 8192, 16384)] + [
    (w, s, n) for w in (1024, 4096) for s in (0, 4) for n in (8192, 16384, 32768, 65536)]
TRAINING_POINTS = [(None, 0, n) for n in (4096, 8192, 16384)] + [
    (w, 0, n) for w in (256, 1024, 4096) for n in (4096, 16384, 65536)]
QUICK = {"forward": [(None, 0, 8192), (4096, 0, 16384)], "training": [(None, 0, 8192), (1024, 0, 16384)]}


def switches(on: bool) -> dict:
    """The three switches as shipped (``on``) or off."""
    if on:
        return dict(GLUON_MIN_N=SHIPPED["GLUON_MIN_N"], GLUON_MIN_WINDOW=SHIPPED["GLUON_MIN_WINDOW"],
                    AUTOGRAD_CONFIG=SHIPPED["AUTOGRAD_CONFIG"])
    return dict(GLUON_MIN_N=None, GLUON_MIN_WINDOW=None, AUTOGRAD_CONFIG=None)


SHIPPED = dict(GLUON_MIN_N=dispatch.GLUON_MIN_N, GLUON_MIN_WINDOW=dispatch.GLUON_MIN_WINDOW,
               AUTOGRAD_CONFIG=fast_backward.AUTOGRAD_CONFIG)


def apply(values: dict, mode: str) -> None:
    """Set the switches (only the forward's for ``forward``; only autograd's for ``training``, the forward as
    shipped)."""
    if mode == "forward":
        dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW = values["GLUON_MIN_N"], values["GLUON_MIN_WINDOW"]
    else:
        dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW = SHIPPED["GLUON_MIN_N"], SHIPPED["GLUON_MIN_WINDOW"]
        fast_backward.AUTOGRAD_CONFIG = values["AUTOGRAD_CONFIG"]


def inputs(window_size, n):
    batch = max(1, TOKENS // n) if window_size is None else 1
    g = torch.Generator(device="cuda").manual_seed(n)
    make = lambda h: torch.randn(batch, h, n, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return make(HEADS), make(KV_HEADS), make(KV_HEADS)


def step(mode, q, k, v, window_size, sink_size):
    """One call of the public entry: the forward, or forward + backward (returns what it computed)."""
    kw = dict(window_size=window_size, sink_size=sink_size) if window_size is not None else {}
    if mode == "forward":
        return lambda: (flash_attention(q, k, v, True, **kw),)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def run():
        q.grad = k.grad = v.grad = None
        flash_attention(q, k, v, True, **kw).backward(do)
        return q.grad, k.grad, v.grad
    return run


def measure(mode, point, rounds):
    import triton

    window_size, sink_size, n = point
    q, k, v = inputs(window_size, n)
    runs, results = {}, {}
    for on in (True, False):
        apply(switches(on), mode)
        runs[on] = step(mode, q, k, v, window_size, sink_size)
        results[on] = [t.float() for t in runs[on]()]
    row = dict(mode=mode, window_size=window_size, sink_size=sink_size, n=n, batch=q.shape[0])
    err = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in zip(results[True],
                                                                                            results[False]))
    row["rel_diff"] = err
    if err > 2e-2:
        return dict(row, status="mismatch")
    times = {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            apply(switches(on), mode)
            times[on].append(triton.testing.do_bench(runs[on], warmup=25, rep=100))
    apply(switches(True), mode)
    on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
    return dict(row, status="ok", on_ms=on_ms, off_ms=off_ms, on_over_off=off_ms / on_ms)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="two points per mode")
    args = parser.parse_args(argv)
    if not bench.gpu_available() or torch.cuda.get_device_capability()[0] != 9:
        print("No Hopper GPU here: the Gluon routes do not apply, nothing to time.")
        return 0
    rows = []
    for mode, points in (("forward", FORWARD_POINTS), ("training", TRAINING_POINTS)):
        for point in (QUICK[mode] if args.quick else points):
            row = measure(mode, point, args.rounds)
            rows.append(row)
            w, s, n = point
            what = "causal" if w is None else f"W={w} S={s}"
            print(f"{mode:9s} {what:14s} N={n:6d}: " + (f"on {row['on_ms']:.3f} ms, off {row['off_ms']:.3f} ms, "
                                                          f"route {row['on_over_off']:.3f}x" if row["status"] == "ok"
                                                          else f"{row['status']} (rel diff {row['rel_diff']:.3g})"),
                  flush=True)
            if args.out:
                args.out.write_text(json.dumps(dict(info=bench.environment_info(), shipped={
                    "GLUON_MIN_N": SHIPPED["GLUON_MIN_N"], "GLUON_MIN_WINDOW": SHIPPED["GLUON_MIN_WINDOW"],
                    "AUTOGRAD_CONFIG": repr(SHIPPED["AUTOGRAD_CONFIG"])}, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
