"""GPU benchmark of lesson 11: the course's bf16 and FP8 forwards against SDPA flash and cuDNN.

``python -m course_utils.bench fp8`` times, on one GPU, in one run:

- ``course_bf16``: the course's bf16 forward (``course_utils.kernels.flash_attention``, which routes to
  lesson 06's Hopper kernel where it supports the call);
- ``course_fp8``: ``course_utils.kernels.flash_attention_fp8`` on e4m3 inputs quantised once outside the
  timing (what a model with FP8 activations hands it), V made K-major inside the call (timed);
- ``sdpa_flash``, ``sdpa_cudnn``: ``torch.nn.functional.scaled_dot_product_attention`` with one backend
  (bf16: SDPA has no FP8), ``enable_gqa=True``;
- with ``--gluon`` (a Hopper GPU; not behind the package's entries yet): ``gluon_bf16``, lesson 11's
  warp-specialised Gluon forward (``kernels.hopper_ws.attention``, its simple loop), and ``gluon_fp8``, its FP8
  entry (``hopper_ws.attention_fp8``) on the same e4m3 inputs as ``course_fp8``, V made K-major inside the call
  (timed, as for ``course_fp8``).

Cases: GQA 32 query heads / 8 kv heads, D = 128 (``--dim 64`` for the other), causal and not, N from 1k to
16k with 16k tokens per batch (``B = 16384 / N``). Every output is checked against a float32 reference on the
first batch element before it is timed (FP8: relative RMS error below :data:`FP8_TOLERANCE`, bf16 below
:data:`BF16_TOLERANCE`); a wrong provider is reported, not timed. Time is the median of
``triton.testing.do_bench``; TFLOP/s count ``4 B H N² D`` (half with the causal mask). The run is repeated
``--repeats`` times and each ratio reported with its spread (min-max over the repeats).
FlashAttention-3's published H100 figures (:data:`FA3_PAPER`) are printed beside ours as a labelled
reference: another GPU and another paper, so no ratio is drawn from them.

Writes ``results/fp8_bench.json`` and ``fp8_bench.md``. Without a GPU it says so in one sentence and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from .cases import RESULTS_DIR, attention_flops, gpu_available, tflops

STEM = "fp8_bench"
NS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
PROVIDERS = ("course_bf16", "course_fp8", "sdpa_flash", "sdpa_cudnn")
GLUON_PROVIDERS = ("gluon_bf16", "gluon_fp8")  # --gluon: lesson 11's Gluon forwards (kernels.hopper_ws), Hopper only
ALL_PROVIDERS = PROVIDERS + GLUON_PROVIDERS
LABELS = {"course_bf16": "course bf16", "course_fp8": "course FP8", "sdpa_flash": "SDPA flash",
          "sdpa_cudnn": "SDPA cuDNN", "gluon_bf16": "Gluon bf16", "gluon_fp8": "Gluon FP8"}
RATIOS = ("course_bf16", "course_fp8", "gluon_bf16", "gluon_fp8")  # the providers whose ratio to cuDNN is reported
FP8_PROVIDERS = ("course_fp8", "gluon_fp8")
BF16_TOLERANCE = 2e-2  # relative RMS error against the float32 reference
FP8_TOLERANCE = 8e-2  # e4m3 inputs and P: about 5e-2 measured on the CPU (tests/test_kernels_fp8.py)
#: FlashAttention-3 (arXiv 2407.08608), H100 SXM5, head dim 128, 16k tokens: the paper's figures, TFLOP/s.
FA3_PAPER = {
    "source": "FlashAttention-3, arXiv 2407.08608 (H100 SXM5, D = 128, 16k tokens): published figures",
    "bf16_causal_tflops_fa3": 616, "bf16_causal_tflops_cudnn": 539, "fp8_tflops_fa3_approx": 1200,
    "ablation_tflops": {"full": 661, "no_gemm_softmax_pipelining": 582, "no_warp_specialization": 570},
}
NO_GPU_MESSAGE = ("No CUDA GPU here, so there is nothing to time: run `python -m course_utils.bench fp8` on a GPU "
                  "machine (it writes results/fp8_bench.md).")


def cases(ns=NS, causal=(True, False), tokens=TOKENS) -> list[dict]:
    """Every point of the sweep: ``dict(n, batch, causal)``, ``batch = tokens // n`` (at least 1)."""
    return [dict(n=n, batch=max(1, tokens // n), causal=c) for c in causal for n in ns]


def rel_rms(got, want) -> float:
    """``sqrt(mean((got - want)^2) / mean(want^2))`` of two torch tensors, in float64."""
    got, want = got.double(), want.double()
    return float(((got - want) ** 2).mean().sqrt() / (want ** 2).mean().sqrt().clamp_min(1e-30))


def tolerance(provider: str) -> float:
    return FP8_TOLERANCE if provider in FP8_PROVIDERS else BF16_TOLERANCE


def spread(values) -> dict:
    """Median, min and max of repeated measurements (None when there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return dict(median=None, min=None, max=None)
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def summarise(rows: list[dict]) -> list[dict]:
    """One line per (N, causal): each provider's median TFLOP/s, and the ratios to cuDNN with their spread.

    ``rows`` hold one measurement each (``provider, n, causal, repeat, ms, tflops, status``); ratios are
    taken within one repeat (the same minute of the machine), then summarised over the repeats.
    """
    out = []
    keys = sorted({(r["n"], r["causal"]) for r in rows}, key=lambda k: (not k[1], k[0]))
    run_providers = _providers_of(rows)
    for n, causal in keys:
        mine = [r for r in rows if r["n"] == n and r["causal"] == causal and r.get("status") == "ok"]
        line = dict(n=n, causal=causal)
        for p in run_providers:
            line[f"{p}_tflops"] = spread([r["tflops"] for r in mine if r["provider"] == p])["median"]
        for p in (p for p in RATIOS if p in run_providers):
            ratios = []
            for rep in sorted({r["repeat"] for r in mine}):
                by = {r["provider"]: r for r in mine if r["repeat"] == rep}
                if p in by and "sdpa_cudnn" in by:
                    ratios.append(by["sdpa_cudnn"]["ms"] / by[p]["ms"])
            s = spread(ratios)
            line[f"{p}_over_cudnn"], line[f"{p}_over_cudnn_min"], line[f"{p}_over_cudnn_max"] = s["median"], s["min"], s["max"]
        out.append(line)
    return out


def _providers_of(rows) -> tuple:
    """The providers a run timed, in table order: the four of every run, and the Gluon ones where it timed them."""
    asked = {r["provider"] for r in rows}
    return PROVIDERS + tuple(p for p in GLUON_PROVIDERS if p in asked)


def _fmt(x, spec=".0f"):
    return "—" if x is None else format(x, spec)


def markdown(doc: dict, stem: str = STEM) -> str:
    """The recorded run as markdown (the lesson renders this): the table, then FA3's figures, labelled. ``stem`` names
    the recorded file the header points to (``results/<stem>.json``)."""
    info = doc.get("info", {})
    providers = _providers_of(doc.get("rows", []))
    ratios = [p for p in RATIOS if p in providers]
    # the first runs' column titles, kept: "bf16 / cuDNN" is the course's bf16 forward
    titles = {"course_bf16": "bf16 / cuDNN", "course_fp8": "FP8 / cuDNN", "gluon_bf16": "Gluon bf16 / cuDNN",
              "gluon_fp8": "Gluon FP8 / cuDNN"}
    lines = [f"Recorded on {info.get('gpu', '?')}, {info.get('date', '?')} (`results/{stem}.json`), "
             f"GQA {N_Q_HEADS}/{N_KV_HEADS}, D = {doc.get('head_dim', HEAD_DIM)}, {TOKENS} tokens per batch, "
             f"{doc.get('repeats', 1)} repeat(s); ratios are medians (min–max) over the repeats.", "",
             "| mask | N | " + " | ".join(LABELS[p] for p in providers) + " | "
             + " | ".join(titles[p] for p in ratios) + " |",
             "|---|---:|" + "---:|" * (len(providers) + len(ratios))]
    for s in doc.get("summary") or summarise(doc.get("rows", [])):
        ratio = {p: (f"{_fmt(s[f'{p}_over_cudnn'], '.2f')}× ({_fmt(s[f'{p}_over_cudnn_min'], '.2f')}–"
                     f"{_fmt(s[f'{p}_over_cudnn_max'], '.2f')})" if s.get(f"{p}_over_cudnn") is not None else "—")
                 for p in ratios}
        lines.append(f"| {'causal' if s['causal'] else 'none'} | {s['n']} | " + " | ".join(
            _fmt(s.get(f"{p}_tflops")) for p in providers) + " | " + " | ".join(ratio[p] for p in ratios) + " |")
    failed = [r for r in doc.get("rows", []) if r.get("status") != "ok"]
    if failed:
        lines += ["", "Not timed: " + "; ".join(f"{r['provider']} N={r['n']} causal={r['causal']}: {r['status']}"
                                               for r in failed[:8])]
    ref = doc.get("fa3_paper", FA3_PAPER)
    lines += ["", f"For reference, not compared: {ref['source']}: bf16 causal {ref['bf16_causal_tflops_fa3']} "
              f"TFLOP/s (cuDNN {ref['bf16_causal_tflops_cudnn']}), FP8 about {ref['fp8_tflops_fa3_approx']}; "
              "ablation " + ", ".join(f"{k} {v}" for k, v in ref["ablation_tflops"].items()) + "."]
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# GPU side
# --------------------------------------------------------------------------- #
def make_inputs(n: int, batch: int, head_dim: int = HEAD_DIM, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed + n)
    q = torch.randn(batch, N_Q_HEADS, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, N_KV_HEADS, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, N_KV_HEADS, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def make_forward(provider: str, q, k, v, causal: bool):
    """A zero-argument callable computing ``o`` for one provider on these (bf16) inputs."""
    import torch.nn.functional as F

    from ..kernels import flash_attention, flash_attention_fp8, quantize_fp8

    if provider == "course_bf16":
        return lambda: flash_attention(q, k, v, causal)
    if provider in FP8_PROVIDERS:
        (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(t) for t in (q, k, v))
        if provider == "course_fp8":
            return lambda: flash_attention_fp8(q8, k8, v8, causal, q_scale=qs, k_scale=ks, v_scale=vs)
        from ..kernels import hopper_ws

        return lambda: hopper_ws.attention_fp8(q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs, causal)[0]
    if provider == "gluon_bf16":
        from ..kernels import hopper_ws

        return lambda: hopper_ws.attention(q, k, v, causal)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[provider]

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return run


def reference(q, k, v, causal: bool):
    """float32 attention of the first batch element (SDPA's math backend, heads repeated for GQA)."""
    import torch.nn.functional as F

    group = q.shape[1] // k.shape[1]
    q0 = q[:1].float()
    k0, v0 = (t[:1].float().repeat_interleave(group, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q0, k0, v0, is_causal=causal)


def measure(provider, case, q, k, v, want, repeat, head_dim, warmup=25, rep=100) -> dict:
    import triton

    row = dict(provider=provider, n=case["n"], batch=case["batch"], causal=case["causal"], repeat=repeat,
               ms=None, tflops=None, error=None, status="ok")
    try:
        fn = make_forward(provider, q, k, v, case["causal"])
        got = fn()[:1].float()
        row["error"] = rel_rms(got, want)
        if not math.isfinite(row["error"]) or row["error"] > tolerance(provider):
            row["status"] = f"wrong output (relative RMS error {row['error']:.3g})"
            return row
        row["ms"] = triton.testing.do_bench(fn, warmup=warmup, rep=rep)
        flops = attention_flops(case["batch"], N_Q_HEADS, case["n"], head_dim, case["causal"])
        row["tflops"] = tflops(flops, row["ms"])
    except Exception as exc:  # a backend that does not run this shape here: reported, not fatal
        row["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return row


def run(ns=NS, head_dim=HEAD_DIM, repeats=3, providers=PROVIDERS, log=print) -> list[dict]:
    rows = []
    for case in cases(ns):
        q, k, v = make_inputs(case["n"], case["batch"], head_dim)
        want = reference(q, k, v, case["causal"])
        for repeat in range(repeats):
            for p in providers:
                row = measure(p, case, q, k, v, want, repeat, head_dim)
                rows.append(row)
                log(f"{p:12s} N={case['n']:6d} causal={case['causal']!s:5s} #{repeat}: "
                    + (f"{row['tflops']:.0f} TFLOP/s (err {row['error']:.2g})" if row["status"] == "ok" else row["status"]))
    return rows


def write_results(rows, out_dir: Path, info: dict, head_dim: int, repeats: int) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = dict(info=info, head_dim=head_dim, repeats=repeats, rows=rows, summary=summarise(rows), fa3_paper=FA3_PAPER)
    paths = {"json": out_dir / f"{STEM}.json", "md": out_dir / f"{STEM}.md"}
    paths["json"].write_text(json.dumps(doc, indent=1))
    paths["md"].write_text(markdown(doc) + "\n")
    return paths


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m course_utils.bench fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder for fp8_bench.json/.md (default: results/)")
    p.add_argument("--n", help="comma-separated sequence lengths (default 1024,...,16384)")
    p.add_argument("--dim", type=int, default=HEAD_DIM, help="head dim (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the whole sweep, for the spread (default 3)")
    p.add_argument("--providers", default=",".join(PROVIDERS),
                   help=f"comma-separated subset of {','.join(ALL_PROVIDERS)}")
    p.add_argument("--gluon", action="store_true",
                   help=f"add {' and '.join(GLUON_PROVIDERS)}, lesson 11's Gluon forwards (a Hopper GPU)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    providers += [p for p in GLUON_PROVIDERS if args.gluon and p not in providers]
    unknown = set(providers) - set(ALL_PROVIDERS)
    if unknown:
        print(f"unknown providers: {', '.join(sorted(unknown))} (choose from {', '.join(ALL_PROVIDERS)})")
        return 2
    if not gpu_available():
        print(NO_GPU_MESSAGE)
        return 0
    import course_utils  # noqa: F401  (environment first, before Triton)

    from .report import environment_info

    ns = tuple(int(x) for x in args.n.split(",")) if args.n else NS
    info = environment_info()
    print(f"{info.get('gpu')} | torch {info.get('torch')} | triton {info.get('triton')} | {info['date']}", flush=True)
    rows = run(ns, args.dim, args.repeats, providers, log=lambda line: print(line, flush=True))
    paths = write_results(rows, Path(args.out), info, args.dim, args.repeats)
    print(markdown(json.loads(paths["json"].read_text())))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
