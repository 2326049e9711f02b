"""GPU benchmark of lesson 12: packed documents with score modifications, against FlexAttention.

``python -m course_utils.bench mods`` times, on one GPU, in one run:

- ``course``: ``course_utils.kernels.flash_attention`` / ``flash_attention_with_lse`` with
  ``causal=True, cu_seqlens=..., softcap=... | alibi_slopes=... | sink_logits=...``;
- ``flex``: ``torch.nn.attention.flex_attention.flex_attention``, compiled with ``torch.compile``,
  its block mask (the documents, causal) built once per case outside the timing, the same
  ``score_mod`` (soft-cap, ALiBi); the sinks, which no ``score_mod`` can express, folded in from
  the ``lse`` it returns (``o * exp(lse - logaddexp(lse, z))``), inside the timing;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with a float bias
  ``[1, Hq, N, N]`` (ALiBi, ``-inf`` across documents) or, for the sinks, one extra key of zeros
  whose bias column is ``z_h``; up to :data:`SDPA_MAX_N` (the bias's memory). SDPA has no soft-cap:
  not timed there;
- ``causal``: the course's plain causal attention over the whole packed sequence (no documents),
  at the same N: packing ``S`` documents should cost about the visible share of it.

Cases: bf16, GQA 32 query heads / 8 kv heads, D = 128, batch 1, causal, ``N`` in {8k, 16k, 32k}
packed with 4 or 16 documents of random lengths (seeded: :func:`cu_seqlens_for`), soft-capping 50,
ALiBi (the ALiBi paper's slopes), learned sinks (seeded logits); the forward alone and forward +
backward. Every output is checked against a float32 reference before it is timed (forward: a
slice of rows against all keys; gradients: the first GQA group at N <= 8192, agreement with
FlexAttention beyond); a wrong provider is reported, not timed. Time is the median of
``triton.testing.do_bench``. TFLOP/s count only the visible (query, key) pairs, those inside one
document at or below the diagonal: ``4 * D * pairs * Hq``, 3.5 times that with the backward.

Writes ``results/mods_bench.json`` and ``mods_bench.md`` (tables and ratios).
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
from .window import _cell  # a table cell of the same benchmark rows

from .cases import RESULTS_DIR  # the repository's results/ (one definition)
STEM = "mods_bench"

MODS = ("softcap", "alibi", "sinks")
DOCS = (4, 16)
NS = (8192, 16384, 32768)
QUICK = dict(mods=MODS, docs=(16,), ns=(8192,))
N_Q_HEADS, N_KV_HEADS, HEAD_DIM, BATCH = 32, 8, 128, 1
SOFTCAP = 50.0
SEED = 0
SDPA_MAX_N = 16384  # a bf16 [1, 32, N, N] bias is 17 GB at 16k, 69 GB at 32k: not attempted above
GRAD_REFERENCE_MAX_N = 8192  # the float32 gradient reference holds [group, N, N] scores
TOLERANCE = 2e-2  # relative error (norm) against the reference
PROVIDERS = ("course", "flex", "sdpa")
LABELS = {"course": "course (lesson 12)", "flex": "FlexAttention", "sdpa": "SDPA + bias",
          "causal": "course, plain causal (no documents)"}
NO_GPU_MESSAGE = (
    "No CUDA GPU here, so there is nothing to time: run `python -m course_utils.bench mods` on a GPU "
    "machine (it writes results/mods_bench.md)."
)


@dataclasses.dataclass(frozen=True)
class ModsCase:
    """One point of the sweep: a score modification, how many documents, the packed length."""

    mod: str
    n_docs: int
    n: int

    @property
    def name(self) -> str:
        return f"{self.mod}, {self.n_docs} docs"


def cases(mods=MODS, docs=DOCS, ns=NS) -> list[ModsCase]:
    """Every (mod, documents, N) of the sweep, the modification outermost."""
    return [ModsCase(m, d, n) for m in mods for d in docs for n in ns]


def cu_seqlens_for(n: int, n_docs: int, seed: int = SEED) -> list[int]:
    """``n_docs`` documents of random lengths (at least 1 token each) packed into ``n`` tokens, seeded."""
    import numpy as np

    n_docs = max(1, min(n_docs, n))
    rng = np.random.default_rng([seed, n, n_docs])
    cuts = sorted(rng.choice(np.arange(1, n), size=n_docs - 1, replace=False).tolist()) if n_docs > 1 else []
    return [0] + [int(c) for c in cuts] + [n]


def visible_pairs(cu_seqlens, causal: bool = True) -> int:
    """How many (query, key) pairs the document mask keeps: ``L (L + 1) / 2`` per document (``L²`` not causal)."""
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    return sum(L * (L + 1) // 2 if causal else L * L for L in lengths)


def mods_flops(cu_seqlens, *, batch=BATCH, n_q_heads=N_Q_HEADS, head_dim=HEAD_DIM, training: bool = False) -> float:
    """FLOPs of the visible pairs: 4 D per pair per query head (two matrix products), 3.5 times that with the backward."""
    flops = 4.0 * head_dim * visible_pairs(cu_seqlens) * batch * n_q_heads
    return flops * (1 + BACKWARD_FLOP_FACTOR) if training else flops


def alibi_slopes(n_heads: int):
    """The ALiBi paper's slopes, ``2^(-8 (h + 1) / n_heads)`` (float32 list)."""
    return [2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)]


def mod_inputs(case: ModsCase, device, *, requires_grad: bool = False) -> dict:
    """The keyword arguments of the course's call for ``case``: ``cu_seqlens`` and one modification."""
    import torch

    extra = dict(cu_seqlens=torch.tensor(cu_seqlens_for(case.n, case.n_docs), dtype=torch.int32, device=device),
                 softcap=None, alibi_slopes=None, sink_logits=None)
    if case.mod == "softcap":
        extra["softcap"] = SOFTCAP
    elif case.mod == "alibi":
        extra["alibi_slopes"] = torch.tensor(alibi_slopes(N_Q_HEADS), dtype=torch.float32, device=device)
    elif case.mod == "sinks":
        g = torch.Generator(device="cpu").manual_seed(SEED + 1)
        z = (torch.randn(N_Q_HEADS, generator=g) + 2.0).to(device)  # about as heavy as a row of a few keys
        extra["sink_logits"] = z.requires_grad_(requires_grad)
    else:
        raise ValueError(f"unknown modification {case.mod!r} (one of {', '.join(MODS)})")
    return extra


def _document_ids(cu, n, device):
    import torch

    return torch.searchsorted(cu.to(torch.int64), torch.arange(n, device=device), right=True) - 1


# --------------------------------------------------------------------------- #
# FlexAttention's functions (CPU-testable)
# --------------------------------------------------------------------------- #
def flex_mask_mod(doc):
    """FlexAttention's ``mask_mod`` for causal documents: ``doc[q] == doc[kv] and kv <= q``."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def flex_score_mod(softcap=None, alibi_slopes=None):
    """FlexAttention's ``score_mod``: the soft-cap, then ALiBi (None: no score_mod at all)."""
    import torch

    if softcap is None and alibi_slopes is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if alibi_slopes is not None:
            score = score - alibi_slopes[h] * (q_idx - kv_idx).abs()
        return score

    return score_mod


def fold_sinks(o, lse, sink_logits):
    """``(o, lse)`` with a sink logit per head folded in: ``o * exp(lse - lse')``, ``lse' = logaddexp(lse, z)``."""
    import torch

    lse_sink = torch.logaddexp(lse.float(), sink_logits.float()[None, :, None])
    return (o * torch.exp(lse.float() - lse_sink)[..., None].to(o.dtype)), lse_sink


def sdpa_bias(q, extra):
    """``(bias, with_sink_key)``: SDPA's float bias ``[1, Hq, N, N (+1)]`` in q's dtype, -inf across documents.

    ALiBi: ``-m_h |i - j|`` on the visible pairs. Sinks: a first column ``z_h`` for one extra key of
    zeros (its score is 0, so the bias alone is its logit, and its value 0 adds nothing to o).
    """
    import torch

    n = q.shape[-2]
    doc = _document_ids(extra["cu_seqlens"], n, q.device)
    i = torch.arange(n, device=q.device)
    visible = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    if extra["softcap"] is not None:
        raise ValueError("SDPA has no soft-cap (it is not a bias): not timed")
    if extra["alibi_slopes"] is not None:
        dist = (i[:, None] - i[None, :]).abs().float()
        bias = -extra["alibi_slopes"].float()[:, None, None] * dist
        return bias.masked_fill(~visible, float("-inf")).to(q.dtype)[None], False
    bias = torch.zeros(visible.shape, device=q.device).masked_fill(~visible, float("-inf"))
    if extra["sink_logits"] is not None:
        z = extra["sink_logits"].detach().float()
        bias = torch.cat([z[:, None, None].expand(-1, n, 1), bias[None].expand(z.numel(), -1, -1)], dim=-1)
        return bias.to(q.dtype)[None], True
    return bias.to(q.dtype)[None, None], False


# --------------------------------------------------------------------------- #
# Providers
# --------------------------------------------------------------------------- #
def _flex_with_lse(flex, q, k, v, score_mod, block_mask):
    """``(o, lse)`` from FlexAttention: ``return_aux=AuxRequest(lse=True)`` where it exists, else ``return_lse``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # older torch
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_lse=True)
    o, aux = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                  return_aux=AuxRequest(lse=True))
    return o, aux.lse


def make_forward(name: str, q, k, v, case: ModsCase, extra: dict):
    """A zero-argument callable computing provider ``name``'s forward (``o`` or ``(o, lse)``).

    What is not the attention itself (FlexAttention's block mask, SDPA's bias) is built here,
    outside what gets timed.
    """
    import torch
    import torch.nn.functional as F

    if name == "course":
        from ..kernels import flash_attention_with_lse

        return lambda: flash_attention_with_lse(q, k, v, True, **extra)
    if name == "causal":
        from ..kernels import flash_attention_with_lse

        return lambda: flash_attention_with_lse(q, k, v, True)
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        n = case.n
        doc = _document_ids(extra["cu_seqlens"], n, q.device)
        block_mask = create_block_mask(flex_mask_mod(doc), B=None, H=None, Q_LEN=n, KV_LEN=n, device=q.device)
        score_mod = flex_score_mod(extra["softcap"], extra["alibi_slopes"])
        flex = flex_compiled()
        if extra["sink_logits"] is None:
            return lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
        return lambda: fold_sinks(*_flex_with_lse(flex, q, k, v, score_mod, block_mask), extra["sink_logits"])
    if name == "sdpa":
        if case.n > SDPA_MAX_N:
            raise MemoryError(f"not attempted above N = {SDPA_MAX_N} (the [Hq, N, N] bias)")
        bias, sink_key = sdpa_bias(q, extra)
        group = q.shape[1] // k.shape[1]

        def expand(t):
            t = t.repeat_interleave(group, 1)
            if sink_key:  # the sink: one key of zeros in front, its logit in the bias's first column
                t = torch.cat([torch.zeros_like(t[:, :, :1]), t], dim=2)
            return t

        if q.requires_grad:  # training: K/V expanded inside the step, so that gradients reach k and v
            return lambda: F.scaled_dot_product_attention(q, expand(k), expand(v), attn_mask=bias)
        ke, ve = expand(k), expand(v)
        return lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=bias)
    raise ValueError(f"unknown provider {name!r}")


def make_training_step(name: str, q, k, v, do, case: ModsCase, extra: dict):
    """A zero-argument callable: forward then backward with ``do``; returns ``(o, dq, dk, dv, dsink)``."""
    sinks = extra.get("sink_logits")
    if name in ("course", "causal"):
        from ..kernels import flash_attention

        kwargs = extra if name == "course" else {}

        def forward():
            return flash_attention(q, k, v, True, **kwargs)
    else:
        forward = make_forward(name, q, k, v, case, extra)

    def step():
        q.grad = k.grad = v.grad = None
        if sinks is not None:
            sinks.grad = None
        o = forward()
        o = o[0] if isinstance(o, tuple) else o
        o.backward(do)
        return o, q.grad, k.grad, v.grad, (None if sinks is None else sinks.grad)

    return step


# --------------------------------------------------------------------------- #
# References (float32)
# --------------------------------------------------------------------------- #
def make_inputs(n: int, seed: int = SEED, *, requires_grad=False, device="cuda"):
    import torch

    g = torch.Generator(device=device).manual_seed(seed + n)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(BATCH, N_Q_HEADS, n, HEAD_DIM, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(BATCH, N_KV_HEADS, n, HEAD_DIM, device=device, dtype=dtype, generator=g) for _ in range(2))
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def _scores(qh, kh, rows, extra, h, n):
    """Float32 modified, masked scores of query rows ``rows`` of head ``h`` against all keys."""
    import torch

    s = (qh.float() @ kh.float().T) / math.sqrt(qh.shape[-1])
    if extra["softcap"] is not None:
        s = extra["softcap"] * torch.tanh(s / extra["softcap"])
    j = torch.arange(n, device=s.device)
    if extra["alibi_slopes"] is not None:
        s = s - extra["alibi_slopes"][h].float() * (rows[:, None] - j[None, :]).abs().float()
    doc = _document_ids(extra["cu_seqlens"], n, s.device)
    visible = (doc[rows][:, None] == doc[None, :]) & (j[None, :] <= rows[:, None])
    return s.masked_fill(~visible, float("-inf"))


def _lse_with_sink(s, extra, h):
    import torch

    lse = torch.logsumexp(s, -1)
    if extra["sink_logits"] is not None:
        lse = torch.logaddexp(lse, extra["sink_logits"][h].float())
    return lse


def reference_forward(q, k, v, extra, rows: int = 64):
    """Float32 ``(heads, idx, o, lse)`` for batch 0, the first and last query heads, the first/last ``rows`` queries."""
    import torch

    n = q.shape[-2]
    group = q.shape[1] // k.shape[1]
    heads = sorted({0, q.shape[1] - 1})
    idx = torch.cat([torch.arange(0, rows), torch.arange(n - rows, n)]).to(q.device)
    outs, lses = [], []
    with torch.no_grad():
        for h in heads:
            s = _scores(q[0, h, idx], k[0, h // group], idx, extra, h, n)
            lse = _lse_with_sink(s, extra, h)
            lses.append(lse)
            outs.append(torch.exp(s - lse[:, None]) @ v[0, h // group].float())
    return heads, idx, torch.stack(outs), torch.stack(lses)


def reference_group_grads(q, k, v, do, extra):
    """Float32 ``(o, dq, dk, dv, dsink)`` of batch 0's first GQA group (query heads 0..group-1, kv head 0)."""
    import torch

    group = q.shape[1] // k.shape[1]
    n = q.shape[-2]
    qs = q[0, :group].detach().float().requires_grad_()
    ks = k[0, 0].detach().float().requires_grad_()
    vs = v[0, 0].detach().float().requires_grad_()
    sinks = extra["sink_logits"]
    local = dict(extra)
    if sinks is not None:
        local["sink_logits"] = sinks.detach().float().requires_grad_()
    rows = torch.arange(n, device=q.device)
    outs = []
    for h in range(group):
        s = _scores(qs[h], ks, rows, local, h, n)
        lse = _lse_with_sink(s, local, h)
        outs.append(torch.exp(s - lse[:, None]) @ vs)
    o = torch.stack(outs)
    o.backward(do[0, :group].float())
    dsink = None if sinks is None else local["sink_logits"].grad[:group]
    return o.detach(), qs.grad, ks.grad[None], vs.grad[None], dsink


def grads_error(got, want) -> float:
    """Largest relative error (norm) over ``(o, dq, dk, dv[, dsink])`` of the first GQA group."""
    o, dq, dk, dv, dsink = got
    group = want[1].shape[0]
    pieces = [(o[0, :group], want[0]), (dq[0, :group], want[1]), (dk[0, :1], want[2]), (dv[0, :1], want[3])]
    if want[4] is not None:
        if dsink is None:
            return float("inf")
        pieces.append((dsink[:group], want[4]))
    return max(relative_error(a, b) for a, b in pieces)


# --------------------------------------------------------------------------- #
# Measuring
# --------------------------------------------------------------------------- #
def _row(provider, case, mode):
    cu = cu_seqlens_for(case.n, case.n_docs) if provider != "causal" else [0, case.n]
    return dict(provider=provider, mode=mode, mod=case.mod if provider != "causal" else None,
                n_docs=case.n_docs if provider != "causal" else 1, n=case.n, batch=BATCH, n_q_heads=N_Q_HEADS,
                n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, visible_pairs=visible_pairs(cu), ms=None, tflops=None,
                status="ok", rel_err=None, note="")


def _flops(row, training):
    cu = [0, row["n"]] if row["provider"] == "causal" else cu_seqlens_for(row["n"], row["n_docs"])
    return mods_flops(cu, training=training)


def measure_forward(name, case, q, k, v, extra, ref, warmup=25, rep=100) -> dict:
    """Check then time one provider's forward (:func:`~course_utils.bench.measure.time_checked_forward`)."""
    row = _row(name, case, "forward")
    return time_checked_forward(row, lambda: make_forward(name, q, k, v, case, extra), ref, _flops(row, False),
                                warmup, rep, tol=TOLERANCE)


def measure_training(name, case, q, k, v, do, extra, want, warmup=25, rep=100, baseline=None,
                     ref=None) -> tuple[dict, object]:
    """Check then time forward + backward (``want``: the float32 gradients of the first GQA group, or None)."""
    row = _row(name, case, "training")
    if name == "sdpa" and extra.get("sink_logits") is not None:
        want = None if want is None else want[:4] + (None,)  # SDPA's bias is built once: no dsink
        baseline = None if baseline is None else baseline[:4] + (None,)
        row["note"] = "sink logits held fixed (no dsink)"
    return time_checked_training(row, lambda: make_training_step(name, q, k, v, do, case, extra), _flops(row, True),
                                 ref=ref, want=want, grads_error=grads_error, baseline=baseline,
                                 baseline_note="checked against FlexAttention", warmup=warmup, rep=rep,
                                 tol=TOLERANCE)


def format_row(row: dict) -> str:
    t = f"{row['tflops']:7.1f} TFLOP/s {row['ms']:8.3f} ms" if row["tflops"] else f"{row['status']:>28}"
    err = f"err {row['rel_err']:.1e}" if row["rel_err"] is not None else ""
    what = "causal" if row["mod"] is None else f"{row['mod']}, {row['n_docs']} docs"
    return f"{row['mode']:<8} {what:<18} N={row['n']:<6} {row['provider']:<7} {t}  {err} {row['note']}"


def run(mods=MODS, docs=DOCS, ns=NS, training=True, log=print, warmup=25, rep=100) -> list[dict]:
    """The whole sweep; rows in the order measured."""
    import torch

    rows = []
    for n in ns:
        q, k, v = make_inputs(n)
        causal_case = ModsCase("softcap", 1, n)
        plain = dict(cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=q.device), softcap=None,
                     alibi_slopes=None, sink_logits=None)
        rows.append(measure_forward("causal", causal_case, q, k, v, plain, reference_forward(q, k, v, plain), warmup, rep))
        log(format_row(rows[-1]))
        for mod in mods:
            for d in docs:
                case = ModsCase(mod, d, n)
                extra = mod_inputs(case, q.device)
                ref = reference_forward(q, k, v, extra)
                for name in PROVIDERS:
                    rows.append(measure_forward(name, case, q, k, v, extra, ref, warmup, rep))
                    log(format_row(rows[-1]))
        del q, k, v
        torch.cuda.empty_cache()
        if not training:
            continue
        q, k, v = make_inputs(n, requires_grad=True)
        do = torch.randn_like(q)
        want = reference_group_grads(q, k, v, do, plain) if n <= GRAD_REFERENCE_MAX_N else None
        rows.append(measure_training("causal", causal_case, q, k, v, do, plain, want, warmup, rep,
                                     ref=reference_forward(q, k, v, plain))[0])
        log(format_row(rows[-1]))
        for mod in mods:
            for d in docs:
                case = ModsCase(mod, d, n)
                extra = mod_inputs(case, q.device, requires_grad=True)
                want = reference_group_grads(q, k, v, do, extra) if n <= GRAD_REFERENCE_MAX_N else None
                ref = reference_forward(q, k, v, extra)
                flex_row, flex_got = measure_training("flex", case, q, k, v, do, extra, want, warmup, rep, ref=ref)
                for name in PROVIDERS:
                    row = flex_row if name == "flex" else measure_training(
                        name, case, q, k, v, do, extra, want, warmup, rep, baseline=flex_got, ref=ref)[0]
                    rows.append(row)
                    log(format_row(row))
                del flex_got
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #
def _find(rows, provider, mode, mod, n_docs, n):
    return find_row(rows, provider, mode, n, dict(mod=mod, n_docs=n_docs))


def ratios(rows: list[dict]) -> list[dict]:
    """course / FlexAttention TFLOP/s for every (mode, mod, documents, N) where both were timed."""
    return course_over_flex(rows, ("mod", "n_docs"))


def markdown(rows: list[dict], info: dict | None = None) -> str:
    """The tables: per mode, TFLOP/s of visible pairs per provider, the ratios, and time against plain causal."""
    lines = ["# Packed documents with score modifications: course vs FlexAttention", ""]
    if info:
        lines += [f"{info.get('gpu', '?')}, torch {info.get('torch', '?')}, triton {info.get('triton', '?')}, "
                  f"{info.get('date', '')}. bf16, causal, {N_Q_HEADS}/{N_KV_HEADS} heads, D={HEAD_DIM}, batch "
                  f"{BATCH}, documents of random lengths (seed {SEED}); soft-cap {SOFTCAP:g}, ALiBi slopes "
                  f"2^(-8(h+1)/H), sink logits N(2, 1). TFLOP/s of visible (query, key) pairs (forward 4·D per pair "
                  f"per query head; forward + backward {1 + BACKWARD_FLOP_FACTOR}× that); every output checked "
                  "before timing.", ""]
    ns = sorted({r["n"] for r in rows})
    configs = sorted({(r["mod"], r["n_docs"]) for r in rows if r["provider"] != "causal"},
                     key=lambda c: (MODS.index(c[0]) if c[0] in MODS else 99, c[1]))
    for mode, title in (("forward", "Forward"), ("training", "Forward + backward")):
        if not any(r["mode"] == mode for r in rows):
            continue
        lines += [f"## {title}", "",
                  "| mod | docs | N | visible / causal pairs | course ms | course TFLOP/s | Flex TFLOP/s | "
                  "SDPA TFLOP/s | course / Flex | course ms / plain causal ms |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for mod, d in configs:
            for n in ns:
                course = _find(rows, "course", mode, mod, d, n)
                flex = _find(rows, "flex", mode, mod, d, n)
                sdpa = _find(rows, "sdpa", mode, mod, d, n)
                causal = _find(rows, "causal", mode, None, 1, n)
                if course is None and flex is None:
                    continue
                share = visible_pairs(cu_seqlens_for(n, d)) / (n * (n + 1) / 2)
                ratio = (f"{course['tflops'] / flex['tflops']:.2f}×" if course and flex and course["tflops"]
                         and flex["tflops"] else "—")
                time_share = (f"{course['ms'] / causal['ms']:.3f}" if course and causal and course["ms"]
                              and causal["ms"] else "—")
                lines.append(f"| {mod} | {d} | {n} | {share:.3f} | {_cell(course, 'ms')} | {_cell(course)} | "
                             f"{_cell(flex)} | {_cell(sdpa)} | {ratio} | {time_share} |")
        rs = [r["course_over_flex"] for r in ratios(rows) if r["mode"] == mode]
        if rs:
            lines += ["", f"course / FlexAttention ({title.lower()}): min {min(rs):.2f}×, median "
                          f"{sorted(rs)[len(rs) // 2]:.2f}×, max {max(rs):.2f}× over {len(rs)} points."]
        lines.append("")
    problems = [r for r in rows if r["status"] not in ("ok",)]
    if problems:
        lines += ["## Not timed", ""] + [f"- {format_row(r).strip()}" for r in problems] + [""]
    return "\n".join(lines)


def _key(row):
    return row["provider"], row["mode"], row["mod"], row["n_docs"], row["n"]


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with every row that ``new`` measures again replaced, then the rest of ``new``."""
    return merge_rows_by(old, new, _key)


def write_results(rows: list[dict], out_dir: Path, info: dict | None = None) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{STEM}.{ext}" for ext in ("json", "md")}
    paths["json"].write_text(json.dumps({"info": info or {}, "rows": rows, "ratios": ratios(rows)}, indent=1) + "\n")
    paths["md"].write_text(markdown(rows, info))
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.bench mods", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where to write mods_bench.* (results/)")
    parser.add_argument("--quick", action="store_true", help="16 documents, N = 8k only, shorter timing")
    parser.add_argument("--mods", nargs="+", choices=MODS, default=None)
    parser.add_argument("--docs", type=int, nargs="+", default=None)
    parser.add_argument("--ns", type=int, nargs="+", default=None)
    parser.add_argument("--forward-only", action="store_true", help="skip forward + backward")
    parser.add_argument("--replot", type=Path, default=None, help="re-render the markdown from a saved mods_bench.json")
    parser.add_argument("--append", action="store_true",
                        help="merge into the existing mods_bench.json (a sweep split over several runs)")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        write_results(saved["rows"], args.out, saved.get("info"))
        return 0
    if not gpu_available():
        print(NO_GPU_MESSAGE)
        return 0
    import course_utils  # noqa: F401  (environment first, before Triton)

    base = QUICK if args.quick else dict(mods=MODS, docs=DOCS, ns=NS)
    mods = tuple(args.mods or base["mods"])
    docs = tuple(args.docs or base["docs"])
    ns = tuple(args.ns or base["ns"])
    warmup, rep = (10, 40) if args.quick else (25, 100)
    rows = run(mods, docs, ns, training=not args.forward_only, warmup=warmup, rep=rep)
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
