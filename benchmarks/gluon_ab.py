"""Lesson 11's Gluon forwards against earlier versions of the same kernels, one process: FP8 and bf16.

A change to a kernel that the routes launch is timed here against the kernel before it, each version in one
process, alternating their order round by round, beside cuDNN's bf16 forward. Its first use (forty-sixth session,
``results/gluon_ab_h100.json``, ``results/NOTES.md``): the FP8 forward handing P to ``P V`` without a shuffle
(V's keys reordered to match, commit 97f89d4) and the softmax's row max and sum as trees (12c20b6), both slower or no
faster on an H100 and reverted; to time them again, check out 12c20b6 and give it 93fe29b's module as a variant.

- each ``--variant NAME=FILE``: a copy of ``kernels/hopper_ws.py`` from another commit, beside it (make one with
  ``git show REV:course_utils/kernels/hopper_ws.py > course_utils/kernels/_base_hopper_ws.py``);
- ``current``: ``kernels.hopper_ws`` as it is;
- ``cudnn``: SDPA's cuDNN backend on the bf16 inputs (for FP8: those the e4m3 ones were quantised from).

The kernels alone are timed (e4m3 inputs and V's copies made once, outside), GQA 32/8, D = 128, 16k tokens a batch,
N 4k-16k, causal and not, as the public routes launch them (the serial loop; bf16 with the FMA softmax, and
without the causal mask on the persistent grid); ``--kinds fp8 bf16``. Each output is checked against
cuDNN's first. ``--wide`` (FP8) adds ``current_wide`` and ``current_wide3``: the current module's wide tiles
(``block_n=256``, FA3's 256 keys a tile) with 2 slots (as ``fp8.GLUON_WIDE``'s route) and 3. ``--orders`` adds the
current module's persistent grid walked a kv head's query heads at a time (``heads_together=
hopper_ws.kv_head_order(32, 4)``: the programs that run together read one kv head's K/V tiles), and as by default
where the route runs a program per tile. Writes ``--out`` (JSON rows: each
version's ms and TFLOP/s, ``<name>_over_cudnn``, ``current_over_<name>`` = name_ms / current_ms, and for the current
module's other calls ``current_X``, ``X_over_current`` = current_ms / theirs: ``wide``, ``wide3``, ``grouped``,
``persistent``, ``tiles``, ...). ``--kinds bwd``: the Gluon backward (autograd's route) walked :data:`BWD_ROWS` (batch,
kv head) rows at a time against its default walk (``grouped_over_current``).

    python benchmarks/gluon_ab.py --variant before=course_utils/kernels/_base_hopper_ws.py --out ab.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import course_utils  # noqa: E402,F401  (first, as in every notebook)
import torch  # noqa: E402

from course_utils.bench import fp8 as fp8_bench  # noqa: E402
from course_utils.bench.cases import attention_flops, tflops  # noqa: E402
from course_utils.bench.measure import relative_error  # noqa: E402
from course_utils.kernels import dispatch, fp8, hopper_ws, hopper_ws_bwd  # noqa: E402


# --wide's calls of the current module: the wide tiles with the route's 2 slots, and with 3 (208 KiB of shared
# memory, which the H100 and H200 hold; more stages ahead of the consumers, one program per SM either way)
WIDE = {"current_wide": dict(block_n=256), "current_wide3": dict(block_n=256, num_buffers=3)}


def orders(kind, causal):
    """--orders' calls of the current module: the persistent grid walked as by default (where the route runs a
    program per tile) and a kv head's query heads at a time (GQA 32/8: four query heads)."""
    heads = hopper_ws.kv_head_order(fp8_bench.N_Q_HEADS, fp8_bench.N_Q_HEADS // fp8_bench.N_KV_HEADS)
    grouped = dict(persistent=True, heads_together=heads)
    if kind == "bf16" and dispatch.gluon_persistent(causal, None):  # the route's call is the persistent grid
        return {"current_grouped": grouped}
    return {"current_persistent": dict(persistent=True), "current_persistent_grouped": grouped}


def _fp8_call(module, q8, k8, v8, scales, causal, **options):
    """``module``'s FP8 entry on V's K-major copy, made once (12c20b6's version of this script also handed a module
    that reads V's keys reordered its own copy); ``options`` go to the entry."""
    qs, ks, vs = scales
    vt8 = v8.transpose(2, 3).contiguous()
    return lambda: module.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, **options)[0]


def _time(row, calls, rounds, flops):
    """Each of ``calls`` timed ``rounds`` times, their order reversed every other round (triton's do_bench, L2
    flushed); each one's median ms and TFLOP/s of ``flops`` into ``row``."""
    import triton

    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(reversed(calls))):
            times[name].append(triton.testing.do_bench(calls[name], warmup=25, rep=100))
    for name, ts in times.items():
        row[f"{name}_ms"] = statistics.median(ts)
        row[f"{name}_tflops"] = tflops(flops, row[f"{name}_ms"])


def measure(modules, kind, n, causal, rounds, wide=False, order=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = max(1, fp8_bench.TOKENS // n)
    q, k, v = fp8_bench.make_inputs(n, batch)
    if kind == "fp8":
        (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
        calls = {name: _fp8_call(m, q8, k8, v8, (qs, ks, vs), causal) for name, m in modules.items()}
        if wide:  # the current module's wide tiles (FA3's: 256 keys a tile, two scale blocks each), 2 and 3 slots
            for name, options in WIDE.items():
                calls[name] = _fp8_call(hopper_ws, q8, k8, v8, (qs, ks, vs), causal, **options)
        for name, options in (orders(kind, causal) if order else {}).items():
            calls[name] = _fp8_call(hopper_ws, q8, k8, v8, (qs, ks, vs), causal, **options)
        tolerance = fp8_bench.FP8_TOLERANCE
    else:
        persistent = dispatch.gluon_persistent(causal, None)  # as the public route runs it
        calls = {name: (lambda m=m: m.attention(q, k, v, causal, fma=True, persistent=persistent)[0])
                 for name, m in modules.items()}
        for name, options in (orders(kind, causal) if order else {}).items():
            calls[name] = lambda options=options: hopper_ws.attention(q, k, v, causal, fma=True, **options)[0]
        tolerance = fp8_bench.BF16_TOLERANCE

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    calls["cudnn"] = cudnn
    outs = {name: fn() for name, fn in calls.items()}
    row = dict(kind=kind, n=n, batch=batch, causal=causal)
    timed = [name for name in calls if name != "cudnn"]
    for name in timed:
        row[f"{name}_vs_cudnn"] = relative_error(outs[name], outs["cudnn"])
    if max(row[f"{name}_vs_cudnn"] for name in timed) > tolerance:
        return dict(row, status="mismatch")
    _time(row, calls, rounds, attention_flops(batch, fp8_bench.N_Q_HEADS, n, fp8_bench.HEAD_DIM, causal))
    for name in timed:
        row[f"{name}_over_cudnn"] = row["cudnn_ms"] / row[f"{name}_ms"]
        if name.startswith("current_"):  # the current module's other calls
            row[f"{name.removeprefix('current_')}_over_current"] = row["current_ms"] / row[f"{name}_ms"]
        elif name != "current":
            row[f"current_over_{name}"] = row[f"{name}_ms"] / row["current_ms"]
    return dict(row, status="ok")


# --kinds bwd: the Gluon backward's programs walked this many (batch, kv head) rows at a time against one row after
# another (hopper_ws_bwd.attention_backward's heads_together; four rows: the load model's choice, results/NOTES.md)
BWD_ROWS = 4


def measure_backward(n, causal, rounds):
    """The Gluon backward as autograd's route launches it (``hopper_ws_bwd.backward_validated``: lesson 07's delta,
    dK/dV, the Gluon dQ) with its default walk (``current``) and :data:`BWD_ROWS` rows at a time
    (``current_grouped``), one process, alternating; each gradient of the walk checked against the default's."""
    batch = max(1, fp8_bench.TOKENS // n)
    q, k, v = fp8_bench.make_inputs(n, batch)
    do = torch.randn_like(q)
    o, lse = hopper_ws.attention(q, k, v, causal, fma=True)
    calls = {"current": lambda: hopper_ws_bwd.backward_validated(q, k, v, o, lse, do, causal, None),
             "current_grouped": lambda: hopper_ws_bwd.backward_validated(q, k, v, o, lse, do, causal, None,
                                                                         heads_together=BWD_ROWS)}
    want, got = calls["current"](), calls["current_grouped"]()
    row = dict(kind="bwd", n=n, batch=batch, causal=causal,
               grouped_vs_current=max(relative_error(a, b) for a, b in zip(got, want)))
    if row["grouped_vs_current"] > fp8_bench.BF16_TOLERANCE:
        return dict(row, status="mismatch")
    _time(row, calls, rounds, 2.5 * attention_flops(batch, fp8_bench.N_Q_HEADS, n, fp8_bench.HEAD_DIM, causal))
    row["grouped_over_current"] = row["current_ms"] / row["current_grouped_ms"]
    return dict(row, status="ok")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                        help="a copy of kernels/hopper_ws.py from another commit, beside it")
    parser.add_argument("--out", default="gluon_ab.json")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ns", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--kinds", nargs="+", choices=("fp8", "bf16", "bwd"), default=["fp8", "bf16", "bwd"],
                        help="bwd: the Gluon backward walked BWD_ROWS rows at a time against its default walk")
    parser.add_argument("--wide", action="store_true",
                        help="FP8: also the current module's wide tiles (attention_fp8(block_n=256), 2 and 3 slots): "
                             "wide_over_current, wide3_over_current")
    parser.add_argument("--orders", action="store_true",
                        help="also the current module's grids walked a kv head's query heads at a time, and the "
                             "grid the route does not run: grouped_over_current, persistent_over_current, ...")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        print("needs a Hopper GPU (the Gluon kernels compile for sm_90 only)")
        return 0
    modules = {}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        if Path(path).resolve().parent != Path(hopper_ws.__file__).resolve().parent:
            raise SystemExit(f"{path} must sit beside kernels/hopper_ws.py (its relative imports)")
        modules[name] = importlib.import_module(f"course_utils.kernels.{Path(path).stem}")
    modules["current"] = hopper_ws
    info = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=__import__("triton").__version__,
                rounds=args.rounds, variants=args.variant, wide=args.wide, orders=args.orders)
    rows = []
    for kind in args.kinds:
        for causal in (True, False):
            for n in args.ns:
                if kind == "bwd":
                    row = measure_backward(n, causal, args.rounds)
                else:
                    row = measure(modules, kind, n, causal, args.rounds, args.wide, args.orders)
                rows.append(row)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
                Path(args.out).write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
