"""Forward + backward: lesson 07's kernels behind torch.autograd, next to SDPA."""

from __future__ import annotations

from .cases import TOLERANCE, Case, attention_flops, make_inputs, tflops
from .measure import format_row, is_oom
from .providers import _sdpa_backend


TRAIN_STEM = "training_bench"
TRAIN_PROVIDERS = ("sdpa_flash", "sdpa_cudnn", "course")
# With --fast-backward: the course's forward with fast_backward's flat layout behind autograd (FLAT_DEFAULT, and the
# same with its own dQ kernel), timed beside lesson 07's pair in the same run before either becomes the default.
FAST_BACKWARD_PROVIDERS = ("course_flat", "course_flat_dq")
# With --gluon (a Hopper GPU): kernels.hopper_ws_bwd's backward behind autograd, after lesson 11's Gluon forward
# (hopper_ws_bwd.attention) and after the course's forward (fast_backward's gluon mode at GLUON_DEFAULT: the route
# kernels.flash_attention's autograd takes once AUTOGRAD_CONFIG is set to it).
GLUON_PROVIDERS = ("gluon", "course_gluon_bwd")
TRAIN_LABELS = {"sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN", "course": "course (kernels.flash_attention)",
                "course_flat": "course, flat backward", "course_flat_dq": "course, flat backward + flat dQ",
                "gluon": "Gluon forward + backward", "course_gluon_bwd": "course forward, Gluon backward"}


def fast_backward_config(name: str):
    """The ``fast_backward`` configuration behind provider ``name`` of :data:`FAST_BACKWARD_PROVIDERS`."""
    import dataclasses

    from ..kernels import fast_backward

    return dataclasses.replace(fast_backward.FLAT_DEFAULT, flat_dq=name == "course_flat_dq")
BACKWARD_FLOP_FACTOR = 2.5  # a convention: the one-pass backward does 5 matmuls to the forward's 2
# (the course's two-pass backward does 7, about 3.5 forwards; every provider is counted alike)


def training_flops(batch: int, n_heads: int, n: int, head_dim: int, causal: bool) -> float:
    """FLOPs of forward + backward: the forward's count times (1 + 2.5)."""
    return (1 + BACKWARD_FLOP_FACTOR) * attention_flops(batch, n_heads, n, head_dim, causal)


def make_training_forward(name: str, q, k, v, causal: bool):
    """A zero-argument callable: provider ``name``'s differentiable forward, returning ``o``."""
    import torch.nn.functional as F

    if name == "course":
        from ..kernels import flash_attention

        def forward():
            return flash_attention(q, k, v, causal=causal)
    elif name in FAST_BACKWARD_PROVIDERS:
        from ..kernels.fast_backward import flash_attention_fast_backward

        config = fast_backward_config(name)

        def forward():
            return flash_attention_fast_backward(q, k, v, causal, config=config)
    elif name == "course_gluon_bwd":  # the route kernels.flash_attention's autograd takes with the gluon mode set
        from ..kernels.fast_backward import GLUON_DEFAULT, autograd_config, flash_attention_fast_backward

        if autograd_config(q, k, v, causal, config=GLUON_DEFAULT) is None:
            raise ValueError("the Gluon backward does not apply here (a Hopper GPU, bf16/fp16, D 64 or 128)")

        def forward():
            return flash_attention_fast_backward(q, k, v, causal, config=GLUON_DEFAULT)
    elif name == "gluon":
        from ..kernels import hopper_ws_bwd

        def forward():
            return hopper_ws_bwd.attention(q, k, v, causal, forward="gluon")
    elif name in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(name)

        def forward():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    else:
        raise ValueError(f"unknown training provider {name!r}")
    return forward


def make_training_step(name: str, q, k, v, do, causal: bool):
    """A zero-argument callable: forward, then backward with ``do``; returns ``(o, dq, dk, dv)``.

    ``q, k, v`` must require grad; their ``.grad`` is reset at each call so
    every call does the same work.
    """
    forward = make_training_forward(name, q, k, v, causal)

    def step():
        q.grad = k.grad = v.grad = None
        o = forward()
        o.backward(do)
        return o, q.grad, k.grad, v.grad

    return step


def run_training_case(case: Case, providers=TRAIN_PROVIDERS, log=print) -> list[dict]:
    """Forward + backward of every provider at every N of ``case``.

    Every provider's output and gradients are compared with SDPA flash's
    (relative error of the norm) before it is timed; a mismatch is reported
    as ``wrong`` and not timed.
    """
    import torch
    import triton

    rows = []
    for n in case.ns:
        q, k, v = (t.requires_grad_() for t in make_inputs(case, n))
        do = torch.randn_like(q)
        b = case.batch(n)
        base = None
        for name in providers:
            row = dict(case=case.name, provider=name, dtype=case.dtype, causal=case.causal, batch=b,
                       n_q_heads=case.n_q_heads, n_kv_heads=case.n_kv_heads, n=n, head_dim=case.head_dim,
                       ms=None, tflops=None, peak_mib=None, status="ok", rel_err=None, note="")
            try:
                step = make_training_step(name, q, k, v, do, case.causal)
                got = [t.detach().float() for t in step()]
                if base is None:
                    base = got
                else:
                    row["rel_err"] = max(
                        (torch.linalg.vector_norm(a - r) / torch.linalg.vector_norm(r)).item() for a, r in zip(got, base)
                    )
                del got
                if row["rel_err"] is not None and not row["rel_err"] <= TOLERANCE:
                    row["status"] = "wrong"
                else:
                    row["ms"] = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
                    row["tflops"] = tflops(training_flops(b, case.n_q_heads, n, case.head_dim, case.causal), row["ms"])
            except Exception as exc:  # one provider failing must not stop the sweep
                row["status"] = "OOM" if is_oom(exc) else "error"
                row["note"] = f"{type(exc).__name__}: {str(exc).strip()[:160]}"
            rows.append(row)
            log(format_row(row))
        del q, k, v, do, base
        torch.cuda.empty_cache()
    return rows


def training_markdown(rows: list[dict], case: Case, info: dict | None = None) -> str:
    """The forward + backward table: ms, TFLOP/s and the ratios against SDPA (and, where the rows hold them, the
    :data:`FAST_BACKWARD_PROVIDERS` and :data:`GLUON_PROVIDERS` and their ratios to cuDNN)."""
    info = info or {}
    extra = tuple(p for p in FAST_BACKWARD_PROVIDERS + GLUON_PROVIDERS if any(r["provider"] == p for r in rows))
    lines = [
        f"### Forward + backward: {case.title()}",
        "",
        f"Measured on {info.get('gpu', '?')} ({info.get('date', '?')}): torch {info.get('torch', '?')}, "
        f"triton {info.get('triton', '?')}. Median of `triton.testing.do_bench` over forward + backward; "
        f"TFLOP/s counts the backward as {BACKWARD_FLOP_FACTOR}x the forward (a convention, the one-pass "
        "algorithm's 5 matmuls to the forward's 2; the course's two-pass backward does 7), halved when causal. Outputs and "
        "gradients checked against SDPA flash's before timing.",
        "",
        "| N | B | " + " | ".join(f"{TRAIN_LABELS[p]} ms (TFLOP/s)" for p in TRAIN_PROVIDERS + extra)
        + " | course / flash | course / cuDNN |" + "".join(f" {TRAIN_LABELS[p]} / cuDNN |" for p in extra),
        "|---:|---:|" + "---:|" * (len(TRAIN_PROVIDERS) + 2 + 2 * len(extra)),
    ]
    by = {(r["n"], r["provider"]): r for r in rows}
    for n in sorted({r["n"] for r in rows}):
        cells = []
        for p in TRAIN_PROVIDERS + extra:
            r = by.get((n, p))
            cells.append(f"{r['ms']:.2f} ({r['tflops']:.0f})" if r and r["ms"] else (r["status"] if r else "-"))

        def ratio(other, mine="course"):
            a, o = by.get((n, mine)), by.get((n, other))
            return f"{o['ms'] / a['ms']:.2f}x" if a and o and a["ms"] and o["ms"] else "-"

        lines.append(f"| {n} | {case.batch(n)} | " + " | ".join(cells) + f" | {ratio('sdpa_flash')} | {ratio('sdpa_cudnn')} |"
                     + "".join(f" {ratio('sdpa_cudnn', p)} |" for p in extra))
    return "\n".join(lines) + "\n"


def recorded_markdown(doc: dict) -> str:
    """:func:`training_markdown` of a recorded run (``results/training_bench*.json``: its rows, case and info), as
    the run printed it."""
    case = Case(**{**doc["case"], "ns": tuple(doc["case"]["ns"])})
    return training_markdown(doc["rows"], case, doc["info"])
