"""The command line: ``python -m course_utils.bench [options]``."""

from __future__ import annotations

import argparse
import sys
import dataclasses
import json
from pathlib import Path

from .cases import (ALL_PROVIDERS, DEFAULT_NS, LESSON11_PROVIDERS, NO_GPU_MESSAGE, PROVIDERS, QUICK_NS, RESULTS_DIR,
                    STANDARD_SUITE, STEM, Case)
from .ladder import tuning_ladder
from .measure import measure_ceilings, run_case
from .report import environment_info, load_results, markdown_tables, write_csv, write_results
from .training import (FAST_BACKWARD_PROVIDERS, GLUON_PROVIDERS, TRAIN_PROVIDERS, TRAIN_STEM, run_training_case,
                       training_markdown)


def _package():
    """``course_utils.bench`` itself (its docstring, and names tests replace there)."""
    import importlib

    return importlib.import_module(__package__)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m course_utils.bench", description=_package().__doc__.split("\n\n")[0],
                                epilog="Other sweeps: " + "; ".join(f"`python -m course_utils.bench {k}` ({v})" for k, v in SUBCOMMANDS.items()))
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder for the CSV/JSON/markdown/PNG (default: results/)")
    p.add_argument("--causal", dest="causal", action="store_true", default=None, help="causal mask (one custom case)")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="no mask (one custom case)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), help="input dtype (one custom case)")
    p.add_argument("--heads", help="query/kv heads, e.g. 32/8 (one custom case)")
    p.add_argument("--dim", type=int, help="head dim (one custom case)")
    p.add_argument("--tokens", type=int, help="batch x N, fixed across N (default 16384)")
    p.add_argument("--n", help="comma-separated sequence lengths (default 1024,...,16384)")
    p.add_argument("--providers", default=",".join(PROVIDERS),
                   help=f"comma-separated subset of {','.join(PROVIDERS)} (the default), lesson 11's "
                        f"{','.join(LESSON11_PROVIDERS)} added where asked (bench fp8's providers; Gluon needs Hopper)")
    p.add_argument("--quick", action="store_true", help="main case only, N in 1024,4096, short timing")
    p.add_argument("--ladder", action="store_true", help="also time lesson 06's tuning ladder")
    p.add_argument("--no-ceilings", action="store_true", help="skip the matmul / copy ceilings")
    p.add_argument("--training", action="store_true",
                   help="forward + backward of the main case (writes training_bench.*) instead of the forward sweep")
    p.add_argument("--fast-backward", action="store_true",
                   help="with --training: also fast_backward's flat layout behind autograd (two providers)")
    p.add_argument("--gluon", action="store_true",
                   help="with --training (a Hopper GPU): also kernels.hopper_ws_bwd's backward behind autograd, after "
                        "the Gluon forward and after the course's (two providers)")
    p.add_argument("--replot", metavar="DIR", help="re-render markdown and PNG from DIR/forward_bench.json (no GPU)")
    return p.parse_args(argv)


def cases_from_args(args) -> list[Case]:
    """The sweep the options ask for: the standard suite, or one custom case."""
    ns = tuple(int(x) for x in args.n.split(",")) if args.n else (QUICK_NS if args.quick else DEFAULT_NS)
    custom = any(x is not None for x in (args.causal, args.dtype, args.heads, args.dim))
    if args.quick and not custom:
        suite = [STANDARD_SUITE[0]]
    elif custom:
        base = STANDARD_SUITE[0]
        hq, hkv = (int(x) for x in args.heads.split("/")) if args.heads else (base.n_q_heads, base.n_kv_heads)
        suite = [dataclasses.replace(
            base, name="custom", causal=base.causal if args.causal is None else args.causal,
            dtype=args.dtype or base.dtype, n_q_heads=hq, n_kv_heads=hkv, head_dim=args.dim or base.head_dim,
        )]
    else:
        suite = list(STANDARD_SUITE)
    return [dataclasses.replace(c, ns=ns, tokens=args.tokens or c.tokens) for c in suite]


SUBCOMMANDS = {"window": "lesson 08: sliding window and sinks vs FlexAttention",
               "decode": "lesson 09: decoding over a KV cache, GB/s of cache read",
               "fp8": "lesson 11: the bf16 and FP8 forwards vs SDPA flash and cuDNN",
               "mods": "lesson 12: packed documents with soft-cap, ALiBi and sinks vs FlexAttention"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:  # python -m course_utils.bench window|decode|fp8|mods ...
        import importlib

        return importlib.import_module(f"{__package__}.{argv[0]}").main(argv[1:])
    args = _parse(argv)
    if args.replot:
        doc = load_results(Path(args.replot) / f"{STEM}.json")
        paths = write_results(doc["rows"], args.replot, doc["info"], doc["cases"], doc.get("ceilings"), doc.get("ladder"))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    if not _package().gpu_available():  # looked up on the package, so tests can replace it
        print(NO_GPU_MESSAGE)
        return 0
    import course_utils  # noqa: F401  (environment first, before Triton)

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = set(providers) - set(ALL_PROVIDERS)
    if unknown:
        print(f"unknown providers: {', '.join(sorted(unknown))} (choose from {', '.join(ALL_PROVIDERS)})")
        return 2
    cases = cases_from_args(args)
    info = environment_info()
    print(f"{info.get('gpu')} | torch {info.get('torch')} | triton {info.get('triton')} | {info['date']}", flush=True)
    if args.training:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        providers = (TRAIN_PROVIDERS + (FAST_BACKWARD_PROVIDERS if args.fast_backward else ())
                     + (GLUON_PROVIDERS if args.gluon else ()))
        rows = run_training_case(cases[0], providers, log=lambda line: print(line, flush=True))
        write_csv(rows, out / f"{TRAIN_STEM}.csv")
        (out / f"{TRAIN_STEM}.json").write_text(json.dumps({"info": info, "case": dataclasses.asdict(cases[0]), "rows": rows}, indent=1))
        md = training_markdown(rows, cases[0], info)
        (out / f"{TRAIN_STEM}.md").write_text(md)
        print(md)
        return 0
    ceilings = None if args.no_ceilings else measure_ceilings()
    if ceilings:
        print(f"ceilings: matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_gbps']:.0f} GB/s", flush=True)
    rows = []
    out = Path(args.out)

    def log(line):
        print(line, flush=True)

    for case in cases:
        rows += run_case(case, providers, quick=args.quick, log=log)
        write_results(rows, out, info, cases, ceilings, plot=False)  # keep what we have so far
    ladder = tuning_ladder(log=log) if args.ladder else None
    if "fast" in providers:
        from ..kernels import fast

        info["fast_kernel"] = {
            "warp_specialization": {("causal" if c else "non-causal"): on for c, on in fast._WS_STATE["enabled"].items()},
            "warp_specialization_errors": {("causal" if c else "non-causal"): e for c, e in fast._WS_STATE["error"].items()},
            "autotune_error": fast._TUNE_STATE["error"],
        }
    paths = write_results(rows, out, info, cases, ceilings, ladder)
    print(markdown_tables(rows, [dataclasses.asdict(c) for c in cases]))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
