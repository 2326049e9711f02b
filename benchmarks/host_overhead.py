"""How much of a forward + backward step is the host's: launch time against GPU time, per provider.

    python benchmarks/host_overhead.py [--json PATH --note TEXT] [--cprofile CASE]
    python benchmarks/host_overhead.py --layers PATH
    python benchmarks/host_overhead.py --launches CASE

For each case (bf16, GQA 32/8, D = 128) and provider it prints three numbers:

- ``host_ms``: the time the Python call takes to enqueue one step, measured while the GPU is kept
  busy by ``torch.cuda._sleep`` so that the host never waits for it;
- ``gpu_ms``: the median of ``triton.testing.do_bench`` over the same step (what the benches report);
- ``kernels_ms`` and ``launches``: the sum of the step's kernel durations and their number, from
  ``torch.profiler``.

Where ``host_ms`` is close to ``gpu_ms`` and ``kernels_ms`` is well below it, the step is launch-bound:
the GPU waits for Python, and the benches' time is the host's. ``--json`` appends the run (with
``--note``, what it measured) to the ``runs`` of that file (``results/host_overhead.json``).

``--layers PATH`` times the window forward instead, one layer of the course's call at a time
(:func:`forward_layers`: the public call, the dispatch, the launcher, the bare Triton launch and the
helpers between them), each layer's host time alone, and for the public call, the pointer-load launch,
the bare launch and FlexAttention also ``do_bench``'s time and the time of a CUDA graph of one call
(the kernel's time without the host), at :data:`LAYER_POINTS`; it writes ``results/window_host_layers.json``.

``--launches CASE`` prices Triton's own share of the course's step for one case label of :data:`CASES`: every launch
of one step is captured (:func:`capture_launches`) and replayed three ways (:func:`launch_costs`): through
``kernel[grid](...)`` as the course launches, through the compiled kernel's ``run`` with the arguments bound once
(what a launcher that remembered them would pay), and Triton's argument binder alone.
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
from course_utils.bench import cases, decode, training, window  # noqa: E402

# (label, kind, N, window_size, sink_size). "training": training_bench's main case (its batch holds 16k
# tokens); "causal" and "window": window_bench's inputs (batch 1), plain causal or with the window.
CASES = [
    ("causal N=1k B=16", "training", 1024, None, 0),
    ("causal N=4k B=1", "causal", 4096, None, 0),
    ("W=256 S=0 N=4k", "window", 4096, 256, 0),
    ("W=1024 S=4 N=4k", "window", 4096, 1024, 4),
    ("W=1024 S=0 N=16k", "window", 16384, 1024, 0),
]


# (window_size, sink_size, N) of the window grid where the host time was in question (batch 1, as the grid).
LAYER_POINTS = [(256, 0, 4096), (1024, 4, 4096), (256, 0, 16384)]
# The layers whose GPU time is also taken (do_bench, and a CUDA graph of one call).
TIMED_LAYERS = ("public flash_attention_with_lse", "launch use_tma=False", "raw kernel launch (descriptors made)",
                "flex")


LAYERS_WHAT = ("microseconds per call, bf16, batch 1, GQA 32/8, D = 128 (the window grid's inputs). Plain names: "
               "host enqueue time of that layer alone (GPU kept busy by torch.cuda._sleep, 200 calls); "
               "'do_bench X': triton.testing.do_bench of X (L2 flushed); 'graph X': do_bench of a CUDA graph of one "
               "call of X. 'flex': FlexAttention, compiled, block mask built once.")


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


def forward_layers(n, w, s):
    """``{layer: zero-argument call}`` for the window forward at one point, outermost first.

    From ``kernels.flash_attention_with_lse`` down to the bare launch of
    ``fast_window``'s kernel with its outputs and four TMA descriptors made
    beforehand, and the helpers each layer runs (validation, the support
    check, the allocation, the descriptors); ``flex`` is FlexAttention's
    compiled call with its block mask built once.
    """
    from course_utils import kernels
    from course_utils.kernels import dispatch, fast, fast_window, forward

    q, k, v = window.make_inputs(n)
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    cfg = fast_window.hopper_config(w, d, n)
    qc, kc, vc, o, lse, scale = fast._prepare(q, k, v, None)
    descs = fast._descriptors(qc, kc, vc, o, cfg["block_m"], cfg["block_n"])
    grid = fast.grid_shape(fast.ORDER_KV_GROUPED, b, hq, hkv, n // cfg["block_m"])

    def bare_launch():
        fast_window._attn_fwd_fast_window_kernel[grid](
            qc, kc, vc, o, lse, *descs, scale, n, hq, w, s, GROUP_SIZE=hq // hkv, HEAD_DIM=d,
            BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], USE_TMA=True, ORDER=fast.ORDER_KV_GROUPED,
            HAS_SINKS=bool(s), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    return {
        "public flash_attention_with_lse": lambda: kernels.flash_attention_with_lse(q, k, v, True, window_size=w,
                                                                                    sink_size=s),
        "check_call": lambda: dispatch.check_call(q, k, v, True, w, s),
        "launch_forward": lambda: dispatch.launch_forward(q, k, v, True, w, s),
        "attention_forward_window": lambda: fast_window.attention_forward_window(q, k, v, window_size=w, sink_size=s),
        "launch use_tma=False": lambda: fast_window.launch(q, k, v, window_size=w, sink_size=s, use_tma=False, **cfg),
        "raw kernel launch (descriptors made)": bare_launch,
        "_descriptors": lambda: fast._descriptors(qc, kc, vc, o, cfg["block_m"], cfg["block_n"]),
        "_prepare": lambda: fast._prepare(q, k, v, None),
        "fast.unsupported_reason": lambda: fast.unsupported_reason(q, k, v),
        "forward.validate": lambda: forward.validate(q, k, v),
        "get_device_capability": lambda: torch.cuda.get_device_capability(q.device),
        "bf16_problem": lambda: forward.bf16_problem(q.dtype, q.device),
        "hopper_config": lambda: fast_window.hopper_config(w, d, n),
        "flex": window.make_forward("flex", q, k, v, window.WindowCase(w, s, n)),
    }


def measure_layers(points=LAYER_POINTS, log=print) -> dict:
    """``{"W=.. S=.. N=..": {name: microseconds}}``: every layer's host time, and GPU times of TIMED_LAYERS."""
    out = {}
    for w, s, n in points:
        layers = forward_layers(n, w, s)
        row = {name: round(host_ms(fn, reps=200) * 1e3, 1) for name, fn in layers.items()}
        for name in TIMED_LAYERS:
            row[f"do_bench {name}"] = round(
                triton.testing.do_bench(layers[name], warmup=25, rep=100, return_mode="median") * 1e3, 1)
            replay = decode.cuda_graphed(layers[name])  # the GPU's time alone, no host in the way
            row[f"graph {name}"] = round(
                triton.testing.do_bench(replay, warmup=25, rep=100, return_mode="median") * 1e3, 1)
        out[f"W={w} S={s} N={n}"] = row
        log(f"W={w} S={s} N={n}: " + ", ".join(f"{key} {val} us" for key, val in row.items()))
    return out


def layers_markdown(doc: dict) -> str:
    """The table of ``results/NOTES.md``'s section on the window forward's host time, from ``--layers``' file."""
    lines = ["| point | kernel (graph), course | kernel (graph), FlexAttention | course / Flex, kernels "
             "| course, public call's host time | course, `do_bench` | Flex, `do_bench` |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    public = "public flash_attention_with_lse"
    for key, row in doc["points"].items():
        ratio = row["graph flex"] / row[f"graph {public}"]
        lines.append(f"| {key} | {row[f'graph {public}']:.1f} us | {row['graph flex']:.1f} us | {ratio:.2f}x "
                     f"| {row[public]:.0f} us | {row[f'do_bench {public}']:.1f} us | {row['do_bench flex']:.1f} us |")
    return "\n".join(lines)


def capture_launches(step) -> list[tuple]:
    """``[(kernel, args, kwargs, grid, compiled)]``: every Triton launch one call of ``step`` makes, in order (GPU),
    recorded by :func:`course_utils.kernels.targets._captured_launches` (the autograd engine's thread included)."""
    from course_utils.kernels import targets

    with targets._captured_launches(launch=True) as launches:
        step()
        torch.cuda.synchronize()
    return launches


def launch_costs(captured, reps=300) -> list[dict]:
    """Host microseconds of each captured launch, the best of three :func:`host_ms` runs of ``reps`` calls.

    ``kernel[grid]``: as the course launches (Triton binds the arguments, builds the cache key, checks the globals,
    then launches); ``compiled.run``: the compiled kernel's launcher with the arguments bound once beforehand;
    ``binder``: Triton's generated binder alone (``arguments``: how many it binds).
    """
    from triton.runtime.driver import driver

    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    rows = []
    for fn, args, kwargs, grid, compiled in captured:
        binder = fn.device_caches[device][4]
        bound = binder(*args, **kwargs)[0]
        grid = grid(bound) if callable(grid) else grid
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        values = tuple(bound.values())
        calls = {
            "kernel[grid]": lambda: fn[grid](*args, **kwargs),
            "compiled.run": lambda: compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata,
                                                 None, None, None, *values),
            "binder": lambda: binder(*args, **kwargs),
        }
        row = dict(kernel=fn.__name__, arguments=len(values))
        row.update({name: round(min(host_ms(call, reps) for _ in range(3)) * 1e3, 1) for name, call in calls.items()})
        rows.append(row)
    return rows


def profile_steps(step, reps=20):
    """A ``cProfile.Profile`` of ``reps`` calls of ``step``, with the GPU kept busy (the host never waits for it)."""
    import cProfile

    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    with cProfile.Profile() as prof:
        for _ in range(reps):
            step()
    torch.cuda.synchronize()
    return prof


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
    parser.add_argument("--layers", type=Path, default=None, metavar="PATH",
                        help="time the window forward layer by layer instead (writes PATH)")
    parser.add_argument("--launches", default=None, metavar="CASE", choices=[c[0] for c in CASES],
                        help="price Triton's per-launch host time in the course's step of this case instead")
    parser.add_argument("--cprofile", default=None, metavar="CASE",
                        help="also print cProfile's top functions for the course's step of this case label")
    args = parser.parse_args(argv)
    if not bench.gpu_available():
        print(bench.NO_GPU_MESSAGE)
        return 0
    if args.launches:
        label, kind, n, w, s = next(c for c in CASES if c[0] == args.launches)
        rows = launch_costs(capture_launches(steps(kind, n, w, s)["course"]))
        for row in rows:
            print(f"{row['kernel']:32s} {row['arguments']:3d} arguments: kernel[grid] {row['kernel[grid]']:6.1f} us, "
                  f"compiled.run {row['compiled.run']:6.1f} us, binder {row['binder']:6.1f} us", flush=True)
        print(f"{label}, {len(rows)} launches: " + ", ".join(
            f"{name} {sum(r[name] for r in rows):.1f} us" for name in ("kernel[grid]", "compiled.run")))
        return 0
    if args.layers:
        info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), what=LAYERS_WHAT,
                    command="python benchmarks/host_overhead.py --layers " + str(args.layers))
        args.layers.write_text(json.dumps(dict(info=info, points=measure_layers()), indent=1) + "\n")
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
        import pstats

        label, kind, n, w, s = next(c for c in CASES if c[0] == args.cprofile)
        pstats.Stats(profile_steps(steps(kind, n, w, s)["course"])).sort_stats("tottime").print_stats(25)
    if args.json:
        data = json.loads(args.json.read_text()) if args.json.exists() else {"runs": []}
        info = dict(torch=torch.__version__, triton=triton.__version__, device=torch.cuda.get_device_name(),
                    date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        data["runs"].append(dict(info=info, note=args.note, rows=rows))
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
