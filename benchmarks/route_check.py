"""The Gluon routes' thresholds, timed: each public entry with its route as shipped against the same call with it off.

``kernels.dispatch.GLUON_MIN_N`` / ``GLUON_WINDOW_MIN_N`` / ``GLUON_MIN_WINDOW`` send long forwards and long, wide
windows to lesson 11's Gluon forward, and ``fast_backward.AUTOGRAD_CONFIG`` sends autograd's backward to its Gluon
backward. Each was set from a few points (results/GPU_VALIDATION.md); this script times, in one process and
alternating the order in each of ``--rounds`` rounds, ``kernels.flash_attention`` with the switch as shipped (``on``)
and switched off (``off``):

- ``forward``: plain causal at N 4k-16k (16k tokens per batch), and the window at W 1024 / 4096, S 0 / 4, N 8k-64k
  (batch 1), the forward alone (the three thresholds set to ``None`` for ``off``);
- ``training``: forward + backward, the window without sinks at W 256 / 1024 / 4096, N 4k / 16k / 64k, and plain
  causal at N 4k-16k (``AUTOGRAD_CONFIG = None`` for ``off``; the forward as shipped in both);
- ``sinks``: forward + backward with 4 sinks at the same windows and lengths (where the window is shorter than N),
  the Gluon backward (``fast_backward.GLUON_SINKS = True``, ``on``) against lesson 07's pair (``False``, ``off``),
  the forward as shipped in both; each row also says which of the two ``fast_backward.sink_walk_fits`` picks
  (``model_picks_gluon``: what ships, ``GLUON_SINKS = None``);
- ``fma``: the forward alone where the Gluon forward runs (plain causal from 8k, the windows as ``forward``), with
  the softmax's scale in one fused multiply-add (``dispatch.GLUON_FMA = True``, ``on``) against without it
  (``False``, ``off``);
- ``persistent``: the forward alone without the causal mask at 8k and 16k, on the Gluon forward's persistent grid
  (``dispatch.GLUON_NONCAUSAL_PERSISTENT = True``, ``on``) against a program per tile (``False``, ``off``);
- ``min4k`` and ``min4k_noncausal``: the forward alone at 4k (16k tokens a batch), causal and not, with the Gluon
  forward's threshold at 4096 tokens (``dispatch.GLUON_MIN_N = MIN_N_CANDIDATE``, as shipped, ``on``) against the
  threshold before it, 8192 (``MIN_N_BEFORE``), which leaves 4k to lesson 06's fast kernel (``off``); the Gluon
  forward with its switches as shipped (the FMA softmax; the persistent grid without the causal mask); and
  ``min4k_window``: lesson 08's window at 4k (W 1024 / 4096, S 0 / 4, batch 1) with the window's own threshold
  lowered to 4096 (``dispatch.GLUON_WINDOW_MIN_N = MIN_N_CANDIDATE``, ``on``: the Gluon forward's persistent grid)
  against 8192 as shipped (``off``: lesson 08's kernels);
- ``fp8persistent`` and ``fp8persistent_noncausal``: ``kernels.flash_attention_fp8`` on e4m3 inputs quantised once
  (as ``bench fp8`` times it), N 4k-16k (16k tokens a batch), causal and not, with its Gluon route on the persistent
  grid (``fp8.GLUON_PERSISTENT = True``, ``on``) against a program per tile (``False``, ``off``);
- ``fp8transpose``: the same calls (causal), V's K-major copy made by ``fp8.transpose_tiled``
  (``fp8.FAST_TRANSPOSE = True``, ``on``) against torch's strided copy (``False``, ``off``);
- ``fp8wide`` and ``fp8wide_noncausal``: the same calls, causal and not, on the Gluon entry's wide tiles of 256 keys
  (``fp8.GLUON_WIDE = True``, ``on``) against its tiles of 128 (``False``, ``off``);
- ``walk``: the forward alone without the causal mask at 4k-16k (16k tokens a batch) on the persistent grid walked
  a kv head at a time (``dispatch.GLUON_WALK_KV_HEADS = True``, ``on``) against its default walk (``False``, ``off``);
- ``walkbwd`` and ``walkbwd_noncausal``: forward + backward at 4k-16k, causal and not, the Gluon backward's dK/dV
  walking :data:`WALK_ROWS` (batch, kv head) rows at a time (``fast_backward.GLUON_WALK_ROWS``, ``on``) against one
  row after another (``None``, ``off``);
- ``walkwindow``: the forward alone with lesson 08's window on the Gluon route's persistent grid (W 1024 / 4096,
  S 0 / 4, N 16k and 64k, batch 1) walked a kv head at a time (``dispatch.GLUON_WALK_WINDOWS = True``, ``on``) against
  its default walk (``False``, ``off``);
- ``fp8walk`` and ``fp8walk_noncausal``: ``kernels.flash_attention_fp8``'s calls as ``fp8persistent`` times them,
  its Gluon route walked a kv head at a time (``fp8.GLUON_WALK = True``, ``on``) against its default walk
  (``False``, ``off``);
- ``walkcausal``: the forward alone with the causal mask at 4k-16k (16k tokens a batch), a program per tile walked a
  kv head at a time (``dispatch.GLUON_WALK_CAUSAL = True``, ``on``) against each row's blocks in turn (``False``,
  ``off``);
- ``fullwindow``: forward + backward with a window as wide as the sequence (W = N = 4096, S 0 / 4, batch 1), which
  the public entries run as plain causal attention (``dispatch.window_in_effect``, ``on``) against the same call
  left to the window's kernels (``off``: ``kernels.window_in_effect`` passing every window through).

bf16, GQA 32/8, D = 128, on the window bench's inputs (batch 1) and, for plain causal attention, the training bench's
main case (16k tokens a batch). Both outputs (and the gradients) are compared before timing (relative error of the
norm, the benches' ``TOLERANCE``); a row whose two results differ by more is recorded as "mismatch" and not timed. Prints one line a point and
writes ``--out`` (JSON: ``info``, ``rows`` with ``on_ms``, ``off_ms``, ``on_over_off`` = off_ms / on_ms, the
speed of the route relative to the path without it).

    python benchmarks/route_check.py [--out results/route_check.json] [--rounds 2] [--quick] [--modes MODE ...]

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
from course_utils.bench import cases, training, window  # noqa: E402
from course_utils import kernels  # noqa: E402
from course_utils.kernels import dispatch, fast_backward, fp8  # noqa: E402

FORWARD_POINTS = [(None, 0, n) for n in (4096, 8192, 16384)] + [
    (w, s, n) for w in (1024, 4096) for s in (0, 4) for n in (8192, 16384, 32768, 65536)]
TRAINING_POINTS = [(None, 0, n) for n in (4096, 8192, 16384)] + [
    (w, 0, n) for w in (256, 1024, 4096) for n in (4096, 16384, 65536)]
SINK_POINTS = [(w, 4, n) for w in (256, 1024, 4096) for n in (4096, 16384, 65536) if w < n]
FMA_POINTS = [p for p in FORWARD_POINTS if p[2] >= 8192]
PERSISTENT_POINTS = [(None, 0, n) for n in (8192, 16384)]  # without the causal mask
MIN_N_CANDIDATE = 4096  # the threshold ``min4k`` times (``on``) ...
MIN_N_BEFORE = 8192  # ... against the one before it (``off``: 4k runs lesson 06's kernel)
MIN_N_POINTS = [(None, 0, MIN_N_CANDIDATE)]
MIN_N_WINDOW_POINTS = [(w, s, MIN_N_CANDIDATE) for w in (1024, 4096) for s in (0, 4)]  # windows wide enough
FP8_POINTS = [(None, 0, n) for n in (4096, 8192, 16384)]  # flash_attention_fp8's Gluon route (from fp8.GLUON_MIN_N)
# timed without the causal mask
WALK_POINTS = [(None, 0, n) for n in (4096, 8192, 16384)]  # the walks' A/B points (benchmarks/gluon_ab.py)
WALK_ROWS = 4  # (batch, kv head) rows the backward's walk takes at a time ``on`` (gluon_ab.BWD_ROWS)
WALK_WINDOW_POINTS = [(w, s, n) for w in (1024, 4096) for s in (0, 4) for n in (16384, 65536)]
FULL_WINDOW_POINTS = [(4096, s, 4096) for s in (0, 4)]  # windows of N keys: plain causal attention
NONCAUSAL_MODES = ("persistent", "min4k_noncausal", "fp8persistent_noncausal", "fp8wide_noncausal", "walk",
                   "walkbwd_noncausal", "fp8walk_noncausal")
# flash_attention_fp8's calls
FP8_MODES = ("fp8persistent", "fp8persistent_noncausal", "fp8transpose", "fp8wide", "fp8wide_noncausal", "fp8walk",
             "fp8walk_noncausal")

QUICK = {"forward": [(None, 0, 8192), (4096, 0, 16384)], "training": [(None, 0, 8192), (1024, 0, 16384)],
         "sinks": [(1024, 4, 16384)], "fma": [(None, 0, 16384), (1024, 0, 16384)], "persistent": [(None, 0, 16384)],
         "min4k": MIN_N_POINTS, "min4k_noncausal": MIN_N_POINTS, "min4k_window": MIN_N_WINDOW_POINTS[:1],
         "fp8persistent": [(None, 0, 16384)],
         "fp8persistent_noncausal": [(None, 0, 16384)], "fp8transpose": [(None, 0, 4096)],
         "fp8wide": [(None, 0, 16384)], "fp8wide_noncausal": [(None, 0, 16384)], "walk": WALK_POINTS[:1],
         "walkbwd": WALK_POINTS[:1], "walkbwd_noncausal": WALK_POINTS[:1], "walkwindow": [(4096, 0, 65536)],
         "fullwindow": FULL_WINDOW_POINTS[:1], "walkcausal": WALK_POINTS[:1], "fp8walk": [(None, 0, 4096)],
         "fp8walk_noncausal": [(None, 0, 4096)]}
MODES = {"forward": FORWARD_POINTS, "training": TRAINING_POINTS, "sinks": SINK_POINTS, "fma": FMA_POINTS,
         "persistent": PERSISTENT_POINTS, "min4k": MIN_N_POINTS, "min4k_noncausal": MIN_N_POINTS,
         "min4k_window": MIN_N_WINDOW_POINTS,
         "fp8persistent": FP8_POINTS, "fp8persistent_noncausal": FP8_POINTS, "fp8transpose": FP8_POINTS,
         "fp8wide": FP8_POINTS, "fp8wide_noncausal": FP8_POINTS, "walk": WALK_POINTS, "walkbwd": WALK_POINTS,
         "walkbwd_noncausal": WALK_POINTS, "walkwindow": WALK_WINDOW_POINTS, "fullwindow": FULL_WINDOW_POINTS,
         "walkcausal": WALK_POINTS, "fp8walk": FP8_POINTS, "fp8walk_noncausal": FP8_POINTS}
SHIPPED = dict(GLUON_MIN_N=dispatch.GLUON_MIN_N, GLUON_WINDOW_MIN_N=dispatch.GLUON_WINDOW_MIN_N,
               GLUON_MIN_WINDOW=dispatch.GLUON_MIN_WINDOW,
               AUTOGRAD_CONFIG=fast_backward.AUTOGRAD_CONFIG, GLUON_SINKS=fast_backward.GLUON_SINKS,
               GLUON_FMA=dispatch.GLUON_FMA, GLUON_NONCAUSAL_PERSISTENT=dispatch.GLUON_NONCAUSAL_PERSISTENT,
               FP8_GLUON_PERSISTENT=fp8.GLUON_PERSISTENT, FP8_FAST_TRANSPOSE=fp8.FAST_TRANSPOSE,
               FP8_GLUON_WIDE=fp8.GLUON_WIDE, GLUON_WALK_KV_HEADS=dispatch.GLUON_WALK_KV_HEADS,
               GLUON_WALK_ROWS=fast_backward.GLUON_WALK_ROWS, GLUON_WALK_WINDOWS=dispatch.GLUON_WALK_WINDOWS,
               GLUON_WALK_CAUSAL=dispatch.GLUON_WALK_CAUSAL, FP8_GLUON_WALK=fp8.GLUON_WALK)


def _every_window(q, window_size=None, sink_size=0) -> tuple:
    """``fullwindow``'s ``off``: ``kernels.window_in_effect`` passing every window through as given."""
    return window_size, sink_size


def set_route(mode: str, on: bool) -> None:
    """``forward``: the two forward thresholds as shipped (``on``) or off, autograd's backward untouched (a forward
    never runs it); ``training``: autograd's backward as shipped or off, with the forward as shipped; ``sinks``:
    the Gluon backward for sinks always (``on``) or never, the rest as shipped; ``fma``: the Gluon forward's FMA
    softmax on or off, the rest as shipped; ``persistent``: the persistent grid without the causal mask on or off;
    ``min4k`` / ``min4k_noncausal``: the Gluon forward's threshold at :data:`MIN_N_CANDIDATE` or
    :data:`MIN_N_BEFORE`; ``min4k_window``: the window's threshold the same way;
    ``fp8persistent`` / ``fp8persistent_noncausal``: the FP8 route's persistent grid on or off; ``fp8transpose``:
    the FP8 entry's tiled transpose of V on or off; ``fp8wide`` / ``fp8wide_noncausal``: the FP8 route's wide tiles
    on or off; ``walk``: the persistent grid walked a kv head at a time or by default; ``walkbwd`` /
    ``walkbwd_noncausal``: the Gluon backward's walk :data:`WALK_ROWS` rows at a time or one row after another;
    ``walkwindow``: a window's persistent grid walked a kv head at a time or by default; ``walkcausal``: plain
    causal attention's program per tile walked a kv head at a time or row by row; ``fp8walk`` /
    ``fp8walk_noncausal``: the FP8 route walked a kv head at a time or by default; ``fullwindow``: a window of
    ``N`` keys or more run as plain causal attention (``dispatch.window_in_effect``) or by the window's kernels."""
    forward_on = on or mode != "forward"
    dispatch.GLUON_FMA = on if mode == "fma" else SHIPPED["GLUON_FMA"]
    dispatch.GLUON_NONCAUSAL_PERSISTENT = on if mode == "persistent" else SHIPPED["GLUON_NONCAUSAL_PERSISTENT"]
    dispatch.GLUON_MIN_N = SHIPPED["GLUON_MIN_N"] if forward_on else None
    dispatch.GLUON_WINDOW_MIN_N = SHIPPED["GLUON_WINDOW_MIN_N"] if forward_on else None
    if mode in ("min4k", "min4k_noncausal"):
        dispatch.GLUON_MIN_N = MIN_N_CANDIDATE if on else MIN_N_BEFORE
    if mode == "min4k_window":
        dispatch.GLUON_WINDOW_MIN_N = MIN_N_CANDIDATE if on else MIN_N_BEFORE
    dispatch.GLUON_MIN_WINDOW = SHIPPED["GLUON_MIN_WINDOW"] if forward_on else None
    fast_backward.AUTOGRAD_CONFIG = SHIPPED["AUTOGRAD_CONFIG"] if on or mode != "training" else None
    fast_backward.GLUON_SINKS = on if mode == "sinks" else SHIPPED["GLUON_SINKS"]
    fp8.GLUON_PERSISTENT = on if mode.startswith("fp8persistent") else SHIPPED["FP8_GLUON_PERSISTENT"]
    fp8.FAST_TRANSPOSE = on if mode == "fp8transpose" else SHIPPED["FP8_FAST_TRANSPOSE"]
    fp8.GLUON_WIDE = on if mode.startswith("fp8wide") else SHIPPED["FP8_GLUON_WIDE"]
    dispatch.GLUON_WALK_KV_HEADS = on if mode == "walk" else SHIPPED["GLUON_WALK_KV_HEADS"]
    walked = WALK_ROWS if on else None
    fast_backward.GLUON_WALK_ROWS = walked if mode.startswith("walkbwd") else SHIPPED["GLUON_WALK_ROWS"]
    dispatch.GLUON_WALK_WINDOWS = on if mode == "walkwindow" else SHIPPED["GLUON_WALK_WINDOWS"]
    dispatch.GLUON_WALK_CAUSAL = on if mode == "walkcausal" else SHIPPED["GLUON_WALK_CAUSAL"]
    fp8.GLUON_WALK = on if mode.startswith("fp8walk") else SHIPPED["FP8_GLUON_WALK"]
    kernels.window_in_effect = _every_window if mode == "fullwindow" and not on else dispatch.window_in_effect


def restore() -> None:
    """Every switch as shipped."""
    dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW = SHIPPED["GLUON_MIN_N"], SHIPPED["GLUON_MIN_WINDOW"]
    dispatch.GLUON_WINDOW_MIN_N = SHIPPED["GLUON_WINDOW_MIN_N"]
    fast_backward.AUTOGRAD_CONFIG, fast_backward.GLUON_SINKS = SHIPPED["AUTOGRAD_CONFIG"], SHIPPED["GLUON_SINKS"]
    dispatch.GLUON_FMA = SHIPPED["GLUON_FMA"]
    dispatch.GLUON_NONCAUSAL_PERSISTENT = SHIPPED["GLUON_NONCAUSAL_PERSISTENT"]
    fp8.GLUON_PERSISTENT, fp8.FAST_TRANSPOSE = SHIPPED["FP8_GLUON_PERSISTENT"], SHIPPED["FP8_FAST_TRANSPOSE"]
    fp8.GLUON_WIDE = SHIPPED["FP8_GLUON_WIDE"]
    dispatch.GLUON_WALK_KV_HEADS = SHIPPED["GLUON_WALK_KV_HEADS"]
    fast_backward.GLUON_WALK_ROWS = SHIPPED["GLUON_WALK_ROWS"]
    dispatch.GLUON_WALK_WINDOWS = SHIPPED["GLUON_WALK_WINDOWS"]
    dispatch.GLUON_WALK_CAUSAL = SHIPPED["GLUON_WALK_CAUSAL"]
    fp8.GLUON_WALK = SHIPPED["FP8_GLUON_WALK"]
    kernels.window_in_effect = dispatch.window_in_effect


def make_step(mode, point):
    """The public entry's call at ``point`` on the inputs of the bench it comes from (the window bench's batch of 1;
    for plain causal attention the training bench's main case, 16k tokens a batch), as a zero-argument callable
    returning what it computed: ``(o,)`` or ``(o, dq, dk, dv)``."""
    w, s, n = point
    # the others time the forward alone
    backward = mode in ("training", "sinks", "walkbwd", "walkbwd_noncausal", "fullwindow")
    causal = mode not in NONCAUSAL_MODES
    if mode in FP8_MODES:  # bench fp8's inputs and its course_fp8 provider
        from course_utils.bench import fp8 as fp8_bench

        q, k, v = fp8_bench.make_inputs(n, max(1, fp8_bench.TOKENS // n))
        forward = fp8_bench.make_forward("course_fp8", q, k, v, causal)
        return lambda: (forward(),)
    if w is None:
        q, k, v = cases.make_inputs(cases.STANDARD_SUITE[0], n)
        if backward:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            return training.make_training_step("course", q, k, v, torch.randn_like(q), causal)
        forward = training.make_training_forward("course", q, k, v, causal)
        return lambda: (forward(),)
    q, k, v = window.make_inputs(n, requires_grad=backward)
    case = window.WindowCase(w, s, n)
    if backward:
        return window.make_training_step("course", q, k, v, torch.randn_like(q), case)
    forward = window.make_forward("course", q, k, v, case)
    return lambda: forward()[:1]


def measure(mode, point, rounds):
    import triton

    step = make_step(mode, point)
    results = {}
    for on in (True, False):
        set_route(mode, on)
        results[on] = step()
    w, s, n = point
    row = dict(mode=mode, window_size=w, sink_size=s, n=n)
    # each tensor against the same one with the route off: relative error of the norm, as the benches check
    row["rel_diff"] = max((torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float())).item()
                          for a, b in zip(results[True], results[False]))
    if mode == "sinks":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        row["model_picks_gluon"] = fast_backward.sink_walk_fits(window.BATCH, window.N_KV_HEADS, w,
                                                                fast_backward.GLUON_DEFAULT.block_n1, sms)
    if row["rel_diff"] > cases.TOLERANCE:
        restore()
        return dict(row, status="mismatch")
    times = {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            set_route(mode, on)
            times[on].append(triton.testing.do_bench(step, warmup=25, rep=100))
    restore()
    on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
    return dict(row, status="ok", on_ms=on_ms, off_ms=off_ms, on_over_off=off_ms / on_ms)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a point or two per mode")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args(argv)
    if not bench.gpu_available() or torch.cuda.get_device_capability()[0] != 9:
        print("No Hopper GPU here: the Gluon routes do not apply, nothing to time.")
        return 0
    rows = []
    for mode in args.modes:
        points = MODES[mode]
        for point in (QUICK[mode] if args.quick else points):
            row = measure(mode, point, args.rounds)
            rows.append(row)
            w, s, n = point
            what = ("not causal" if mode in NONCAUSAL_MODES else "causal") if w is None else f"W={w} S={s}"
            print(f"{mode:9s} {what:14s} N={n:6d}: " + (f"on {row['on_ms']:.3f} ms, off {row['off_ms']:.3f} ms, "
                                                          f"route {row['on_over_off']:.3f}x" if row["status"] == "ok"
                                                          else f"{row['status']} (rel diff {row['rel_diff']:.3g})"),
                  flush=True)
            if args.out:
                shipped = {key: repr(value) if key == "AUTOGRAD_CONFIG" else value for key, value in SHIPPED.items()}
                args.out.write_text(json.dumps(dict(info=bench.environment_info(), shipped=shipped, rows=rows),
                                               indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
