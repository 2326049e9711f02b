"""GPU benchmark of lesson 08: sliding-window attention with sinks, against FlexAttention.

``python -m course_utils.bench window`` times, on one GPU, in one run:

- ``course``: ``course_utils.kernels.flash_attention`` / ``flash_attention_with_lse``
  with ``causal=True, window_size=W, sink_size=S`` (lesson 08's kernels);
- ``flex``: ``torch.nn.attention.flex_attention.flex_attention``, compiled with
  ``torch.compile``, its block mask built once per (W, S, N) outside the timing;
- ``sdpa_mask``: ``torch.nn.functional.scaled_dot_product_attention`` with a
  boolean ``[N, N]`` mask (PyTorch picks the backend), where memory allows;
- ``causal``: the course's plain causal attention (no window) at the same N,
  for the plot: its time grows like N², the window's like N.

Cases: bf16, GQA 32 query heads / 8 kv heads, D = 128, batch 1, causal,
``W`` in {256, 1024, 4096}, ``S`` in {0, 4}, ``N`` from 4k to 64k; the forward
alone and forward + backward. Every output is checked against a float32
reference before it is timed (forward: a slice of rows against all keys;
gradients: the whole first GQA group at N <= 8192, and agreement with
FlexAttention beyond); a wrong provider is reported, not timed. Time is the
median of ``triton.testing.do_bench``. TFLOP/s count only the visible
(query, key) pairs: ``4 * D * pairs * B * Hq`` for the forward, 2.5 times that
more for the backward (:data:`course_utils.bench.BACKWARD_FLOP_FACTOR`), so
computing masked scores earns nothing.

Writes ``results/window_bench.json``, ``window_bench.md`` (tables and ratios)
and ``window_bench.png`` (log-log time against N beside plain causal).
Without a GPU it says so in one sentence and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from . import BACKWARD_FLOP_FACTOR, environment_info, gpu_available
from .measure import check_output as forward_error  # noqa: F401  (the forward's check, one definition)
from .measure import relative_error, time_checked_forward, time_checked_training
from .providers import flex_compiled
from .report import course_over_flex, find_row, merge_rows_by

from .cases import RESULTS_DIR  # the repository's results/ (one definition)
STEM = "window_bench"

WINDOWS = (256, 1024, 4096)
SINKS = (0, 4)
NS = (4096, 8192, 16384, 32768, 65536)
QUICK = dict(windows=(1024,), sinks=(0, 4), ns=(8192, 32768))
N_Q_HEADS, N_KV_HEADS, HEAD_DIM, BATCH = 32, 8, 128, 1
SDPA_MAX_N = 32768  # a bool [N, N] mask, plus what the backend makes of it; larger N is not attempted
GRAD_REFERENCE_MAX_N = 8192  # the float32 gradient reference holds [group, N, N] scores
TOLERANCE = 2e-2  # relative error (norm) against the reference
PROVIDERS = ("course", "flex", "sdpa_mask")
LABELS = {"course": "course (lesson 08)", "flex": "FlexAttention", "sdpa_mask": "SDPA + bool mask",
          "causal": "course, plain causal"}
NO_GPU_MESSAGE = (
    "No CUDA GPU here, so there is nothing to time: run `python -m course_utils.bench window` on a GPU "
    "machine (it writes results/window_bench.md)."
)


@dataclasses.dataclass(frozen=True)
class WindowCase:
    """One point of the sweep."""

    window_size: int
    sink_size: int
    n: int

    @property
    def name(self) -> str:
        return f"W={self.window_size} S={self.sink_size}"


def cases(windows=WINDOWS, sinks=SINKS, ns=NS) -> list[WindowCase]:
    """Every (W, S, N) of the sweep, W and S outermost."""
    return [WindowCase(w, s, n) for w in windows for s in sinks for n in ns]


def visible_pairs(n: int, window_size: int | None, sink_size: int = 0) -> int:
    """How many (query, key) pairs the window/sink mask keeps in one head of length ``n``.

    Row ``i`` sees ``min(i + 1, W)`` keys of its window plus the sinks behind
    it, ``clip(i + 1 - W, 0, S)``; ``window_size=None`` is plain causal.
    """
    if window_size is None:
        return n * (n + 1) // 2
    w, s = min(window_size, n), min(sink_size, n)
    in_window = w * (w + 1) // 2 + (n - w) * w  # rows 0..w-1 see i + 1 keys, the rest w
    behind = sum(min(max(i + 1 - w, 0), s) for i in range(w, min(n, w + s)))  # rows still gaining sinks
    behind += max(n - (w + s), 0) * s
    return in_window + behind


def window_flops(n: int, window_size: int | None, sink_size: int = 0, *, batch=BATCH, n_q_heads=N_Q_HEADS,
                 head_dim=HEAD_DIM, training: bool = False) -> float:
    """FLOPs of the visible pairs: 4 D per pair per query head (two matrix products), times 3.5 with the backward."""
    flops = 4.0 * head_dim * visible_pairs(n, window_size, sink_size) * batch * n_q_heads
    return flops * (1 + BACKWARD_FLOP_FACTOR) if training else flops


# --------------------------------------------------------------------------- #
# Providers (GPU)
# --------------------------------------------------------------------------- #
_MASK_MODS = {}


def _mask_mod(window_size, sink_size, device):
    """FlexAttention's mask_mod for the window and sinks, one per (W, S).

    W and S are captured as 0-d tensors, not Python ints, so that dynamo
    does not specialise (and recompile) on their values.
    """
    import torch

    key = (window_size, sink_size, str(device))
    if key not in _MASK_MODS:
        w = torch.tensor(window_size, device=device)
        s = torch.tensor(sink_size, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & ((q_idx - kv_idx < w) | (kv_idx < s))

        _MASK_MODS[key] = mask_mod
    return _MASK_MODS[key]


def make_forward(name: str, q, k, v, case: WindowCase):
    """A zero-argument callable computing provider ``name``'s forward (``o`` or ``(o, lse)``).

    Everything that is not the attention itself (FlexAttention's block mask,
    SDPA's boolean mask) is built here, outside what gets timed.
    """
    import torch
    import torch.nn.functional as F

    w, s, n = case.window_size, case.sink_size, case.n
    if name == "course":
        from ..kernels import flash_attention_with_lse

        return lambda: flash_attention_with_lse(q, k, v, True, window_size=w, sink_size=s)
    if name == "causal":
        from ..kernels import flash_attention_with_lse

        return lambda: flash_attention_with_lse(q, k, v, True)
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(_mask_mod(w, s, q.device), B=None, H=None, Q_LEN=n, KV_LEN=n, device=q.device)
        flex = flex_compiled()
        return lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    if name == "sdpa_mask":
        if n > SDPA_MAX_N:
            raise MemoryError(f"not attempted above N = {SDPA_MAX_N} (the [N, N] mask)")
        i = torch.arange(n, device=q.device)
        mask = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < w) | (i[None, :] < s))
        group = q.shape[1] // k.shape[1]
        if q.requires_grad:  # training: K/V expanded inside the step, so that gradients reach k and v
            return lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)
        # The backends that take an arbitrary mask do not all take GQA: K/V expanded once, outside the timing.
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)
    raise ValueError(f"unknown provider {name!r}")


def make_training_step(name: str, q, k, v, do, case: WindowCase):
    """A zero-argument callable: forward then backward with ``do``; returns ``(o, dq, dk, dv)``."""
    if name in ("course", "causal"):
        from ..kernels import flash_attention

        window = dict(window_size=case.window_size, sink_size=case.sink_size) if name == "course" else {}

        def forward():
            return flash_attention(q, k, v, True, **window)
    else:
        forward = make_forward(name, q, k, v, case)

    def step():
        q.grad = k.grad = v.grad = None
        o = forward()
        o = o[0] if isinstance(o, tuple) else o
        o.backward(do)
        return o, q.grad, k.grad, v.grad

    return step


# --------------------------------------------------------------------------- #
# References (float32, GPU)
# --------------------------------------------------------------------------- #
def make_inputs(n: int, seed: int = 0, *, requires_grad=False):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed + n)
    q = torch.randn(BATCH, N_Q_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(BATCH, N_KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def _mask_rows(rows, n, window_size, sink_size, device):
    import torch

    j = torch.arange(n, device=device)[None, :]
    i = rows[:, None]
    if window_size is None:
        return j <= i
    return (j <= i) & ((i - j < window_size) | (j < sink_size))


def reference_forward(q, k, v, window_size, sink_size, rows: int = 64):
    """Float32 ``(heads, idx, o, lse)`` for batch 0, the first and last query heads, the first/last ``rows`` queries."""
    import torch

    n = q.shape[-2]
    group = q.shape[1] // k.shape[1]
    heads = sorted({0, q.shape[1] - 1})
    idx = torch.cat([torch.arange(0, rows), torch.arange(n - rows, n)]).to(q.device)
    outs, lses = [], []
    for h in heads:
        s = (q[0, h, idx].float() @ k[0, h // group].float().T) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~_mask_rows(idx, n, window_size, sink_size, q.device), float("-inf"))
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.softmax(s, -1) @ v[0, h // group].float())
    return heads, idx, torch.stack(outs), torch.stack(lses)


def reference_group_grads(q, k, v, do, window_size, sink_size):
    """Float32 ``(o, dq, dk, dv)`` of batch 0's first GQA group (query heads 0..group-1, kv head 0), by autograd."""
    import torch

    group = q.shape[1] // k.shape[1]
    n = q.shape[-2]
    qs = q[0, :group].detach().float().requires_grad_()
    ks = k[0, :1].detach().float().requires_grad_()
    vs = v[0, :1].detach().float().requires_grad_()
    s = (qs @ ks.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    rows = torch.arange(n, device=q.device)
    s = s.masked_fill(~_mask_rows(rows, n, window_size, sink_size, q.device), float("-inf"))
    o = torch.softmax(s, -1) @ vs
    o.backward(do[0, :group].float())
    return o.detach(), qs.grad, ks.grad, vs.grad


def grads_error(got, want) -> float:
    """Largest relative error (norm) over ``(o, dq, dk, dv)`` of the first GQA group."""
    o, dq, dk, dv = got
    group = want[1].shape[0]
    pieces = (o[0, :group], dq[0, :group], dk[0, :1], dv[0, :1])
    return max(relative_error(a, b) for a, b in zip(pieces, want))


# --------------------------------------------------------------------------- #
# Measuring
# --------------------------------------------------------------------------- #
def _row(provider, case, mode):
    return dict(provider=provider, mode=mode, window_size=case.window_size if provider != "causal" else None,
                sink_size=case.sink_size if provider != "causal" else 0, n=case.n, batch=BATCH,
                n_q_heads=N_Q_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM,
                ms=None, tflops=None, status="ok", rel_err=None, note="")


def _flops(row, training):
    window = row["window_size"]
    return window_flops(row["n"], window, row["sink_size"] if window else 0, training=training)


def measure_forward(name, case, q, k, v, ref, warmup=25, rep=100) -> dict:
    """Check then time one provider's forward (:func:`~course_utils.bench.measure.time_checked_forward`)."""
    row = _row(name, case, "forward")
    return time_checked_forward(row, lambda: make_forward(name, q, k, v, case), ref, _flops(row, False), warmup, rep,
                                tol=TOLERANCE)


def measure_training(name, case, q, k, v, do, want, warmup=25, rep=100, baseline=None, ref=None) -> tuple[dict, object]:
    """Check then time forward + backward.

    ``ref``: the forward's float32 slice (:func:`reference_forward`), always
    checked; ``want``: the float32 gradients of the first GQA group, or None
    at large N, where the gradients are compared with ``baseline``
    (FlexAttention's) when given.
    """
    row = _row(name, case, "training")
    return time_checked_training(row, lambda: make_training_step(name, q, k, v, do, case), _flops(row, True),
                                 ref=ref, want=want, grads_error=grads_error, baseline=baseline,
                                 baseline_note="checked against FlexAttention (no float32 reference at this N)",
                                 warmup=warmup, rep=rep, tol=TOLERANCE)


def format_row(row: dict) -> str:
    t = f"{row['tflops']:7.1f} TFLOP/s {row['ms']:8.3f} ms" if row["tflops"] else f"{row['status']:>28}"
    err = f"err {row['rel_err']:.1e}" if row["rel_err"] is not None else ""
    w = "causal" if row["window_size"] is None else f"W={row['window_size']} S={row['sink_size']}"
    return f"{row['mode']:<8} {w:<14} N={row['n']:<6} {row['provider']:<10} {t}  {err} {row['note']}"


def run(windows=WINDOWS, sinks=SINKS, ns=NS, training=True, log=print, warmup=25, rep=100) -> list[dict]:
    """The whole sweep; rows in the order measured."""
    import torch

    rows = []
    for n in ns:
        q, k, v = make_inputs(n)
        causal_case = WindowCase(0, 0, n)
        rows.append(measure_forward("causal", causal_case, q, k, v, reference_forward(q, k, v, None, 0), warmup, rep))
        log(format_row(rows[-1]))
        for w in windows:
            for s in sinks:
                case = WindowCase(w, s, n)
                ref = reference_forward(q, k, v, w, s)
                for name in PROVIDERS:
                    rows.append(measure_forward(name, case, q, k, v, ref, warmup, rep))
                    log(format_row(rows[-1]))
        del q, k, v
        torch.cuda.empty_cache()
        if not training:
            continue
        q, k, v = make_inputs(n, requires_grad=True)
        do = torch.randn_like(q)
        want = reference_group_grads(q, k, v, do, None, 0) if n <= GRAD_REFERENCE_MAX_N else None
        ref = reference_forward(q, k, v, None, 0)
        rows.append(measure_training("causal", causal_case, q, k, v, do, want, warmup, rep, ref=ref)[0])
        log(format_row(rows[-1]))
        for w in windows:
            for s in sinks:
                case = WindowCase(w, s, n)
                want = reference_group_grads(q, k, v, do, w, s) if n <= GRAD_REFERENCE_MAX_N else None
                ref = reference_forward(q, k, v, w, s)
                flex_row, flex_got = measure_training("flex", case, q, k, v, do, want, warmup, rep, ref=ref)
                for name in PROVIDERS:
                    if name == "flex":
                        row = flex_row
                    else:
                        row = measure_training(name, case, q, k, v, do, want, warmup, rep, baseline=flex_got,
                                               ref=ref)[0]
                    rows.append(row)
                    log(format_row(row))
                del flex_got
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #
def _find(rows, provider, mode, w, s, n):
    return find_row(rows, provider, mode, n, dict(window_size=w, sink_size=s))


def ratios(rows: list[dict]) -> list[dict]:
    """course / FlexAttention TFLOP/s for every (mode, W, S, N) where both were timed."""
    return course_over_flex(rows, ("window_size", "sink_size"))


def _cell(row, field="tflops"):
    if row is None:
        return "—"
    if row[field] is None:
        return row["status"]
    return f"{row[field]:.0f}" if field == "tflops" else f"{row[field]:.2f}"


def markdown(rows: list[dict], info: dict | None = None) -> str:
    """The tables: per mode and (W, S), TFLOP/s of visible pairs per provider and N, and the ratios."""
    lines = ["# Sliding-window attention with sinks: course vs FlexAttention", ""]
    if info:
        lines += [f"{info.get('gpu', '?')}, torch {info.get('torch', '?')}, triton {info.get('triton', '?')}, "
                  f"{info.get('date', '')}. bf16, causal, {N_Q_HEADS}/{N_KV_HEADS} heads, D={HEAD_DIM}, batch "
                  f"{BATCH}. TFLOP/s of visible (query, key) pairs (forward 4·D per pair per query head; "
                  f"forward + backward {1 + BACKWARD_FLOP_FACTOR}× that); every output checked before timing.", ""]
    ns = sorted({r["n"] for r in rows})
    configs = sorted({(r["window_size"], r["sink_size"]) for r in rows if r["provider"] != "causal"})
    for mode, title in (("forward", "Forward"), ("training", "Forward + backward")):
        if not any(r["mode"] == mode for r in rows):
            continue
        lines += [f"## {title}", "",
                  "| W | S | N | course ms | course TFLOP/s | Flex TFLOP/s | SDPA+mask TFLOP/s | course / Flex | "
                  "plain causal ms |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for w, s in configs:
            for n in ns:
                course = _find(rows, "course", mode, w, s, n)
                flex = _find(rows, "flex", mode, w, s, n)
                sdpa = _find(rows, "sdpa_mask", mode, w, s, n)
                causal = _find(rows, "causal", mode, None, 0, n)
                ratio = (f"{course['tflops'] / flex['tflops']:.2f}×" if course and flex and course["tflops"]
                         and flex["tflops"] else "—")
                lines.append(f"| {w} | {s} | {n} | {_cell(course, 'ms')} | {_cell(course)} | {_cell(flex)} | "
                             f"{_cell(sdpa)} | {ratio} | {_cell(causal, 'ms')} |")
        rs = [r["course_over_flex"] for r in ratios(rows) if r["mode"] == mode]
        if rs:
            lines += ["", f"course / FlexAttention ({title.lower()}): min {min(rs):.2f}×, median "
                          f"{sorted(rs)[len(rs) // 2]:.2f}×, max {max(rs):.2f}× over {len(rs)} points."]
        lines.append("")
    problems = [r for r in rows if r["status"] not in ("ok",)]
    if problems:
        lines += ["## Not timed", ""] + [f"- {format_row(r).strip()}" for r in problems] + [""]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Log-log time against N: the course's windowed kernels (per W, S), FlexAttention, plain causal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("forward", "training") if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 4.4), layout="constrained", squeeze=False)
    configs = sorted({(r["window_size"], r["sink_size"]) for r in rows if r["provider"] != "causal"})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, mode in zip(axes[0], modes):
        def series(provider, w, s):
            pts = sorted((r["n"], r["ms"]) for r in rows if r["mode"] == mode and r["provider"] == provider and r["ms"]
                         and (provider == "causal" or (r["window_size"], r["sink_size"]) == (w, s)))
            return [p[0] for p in pts], [p[1] for p in pts]

        for c, (w, s) in enumerate(configs):
            colour = colours[c % len(colours)]
            x, y = series("course", w, s)
            ax.plot(x, y, marker="o", color=colour, label=f"course W={w} S={s}")
            x, y = series("flex", w, s)
            ax.plot(x, y, marker="x", ls=":", color=colour, label=f"Flex W={w} S={s}")
        x, y = series("causal", None, 0)
        ax.plot(x, y, marker="s", color="black", lw=2, label="course, plain causal")
        if x:
            ax.plot(x, [y[0] * (n / x[0]) for n in x], color="grey", ls="--", lw=1, label="∝ N (linear)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"{'forward' if mode == 'forward' else 'forward + backward'}, bf16, GQA 32/8, D=128, batch 1")
        ax.legend(fontsize=6, ncol=2)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _key(row):
    return row["provider"], row["mode"], row["window_size"], row["sink_size"], row["n"]


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with every row that ``new`` measures again replaced, then the rest of ``new``."""
    return merge_rows_by(old, new, _key)


def write_results(rows: list[dict], out_dir: Path, info: dict | None = None) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{STEM}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps({"info": info or {}, "rows": rows, "ratios": ratios(rows)}, indent=1) + "\n")
    paths["md"].write_text(markdown(rows, info))
    plot(rows, paths["png"])
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.bench window", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where to write window_bench.* (results/)")
    parser.add_argument("--quick", action="store_true", help="W=1024, N in {8k, 32k} only, shorter timing")
    parser.add_argument("--windows", type=int, nargs="+", default=None)
    parser.add_argument("--sinks", type=int, nargs="+", default=None)
    parser.add_argument("--ns", type=int, nargs="+", default=None)
    parser.add_argument("--forward-only", action="store_true", help="skip forward + backward")
    parser.add_argument("--replot", type=Path, default=None, help="re-render md/png from a saved window_bench.json")
    parser.add_argument("--append", action="store_true",
                        help="merge into the existing window_bench.json (a sweep split over several runs)")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        write_results(saved["rows"], args.out, saved.get("info"))
        return 0
    if not gpu_available():
        print(NO_GPU_MESSAGE)
        return 0
    base = QUICK if args.quick else dict(windows=WINDOWS, sinks=SINKS, ns=NS)
    windows = tuple(args.windows or base["windows"])
    sinks = tuple(args.sinks if args.sinks is not None else base["sinks"])
    ns = tuple(args.ns or base["ns"])
    warmup, rep = (10, 40) if args.quick else (25, 100)
    rows = run(windows, sinks, ns, training=not args.forward_only, warmup=warmup, rep=rep)
    saved = Path(args.out) / f"{STEM}.json"
    if args.append and saved.exists():
        rows = merge_rows(json.loads(saved.read_text())["rows"], rows)
    info = environment_info()
    paths = write_results(rows, args.out, info)
    print(markdown(rows, info))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
