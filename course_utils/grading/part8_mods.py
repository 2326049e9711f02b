"""Checks for lesson 12: packed sequences (document masking) and score modifications.

The semantics are issue 25's, the same as :mod:`course_utils.references`'s: for query
head ``h``, query ``i`` and key ``j`` of one packed sequence, ``s_ij = q_i . k_j /
sqrt(D)``; with ``softcap = c``, ``s_ij <- c tanh(s_ij / c)``; with ALiBi (slope
``m_h``), ``s_ij <- s_ij - m_h |i - j|``; key ``j`` is visible from ``i`` iff both
lie in the same segment of ``cu_seqlens`` (and ``j <= i`` if causal); with a sink
logit ``z_h``, ``lse_i = log(exp(z_h) + sum_visible exp(s_ij))`` and ``p_ij =
exp(s_ij - lse_i)`` (the sink takes probability mass and has no value).

- :func:`grade_doc_tile_bounds` grades a plain Python function ``fn(cu_seqlens,
  block_m, block_n, start_m, causal) -> (kv_lo, kv_hi, partial)``: the K/V tiles
  ``range(kv_lo, kv_hi, block_n)`` one query block visits, and the starts of those
  that need the mask. Answers are compared tile by tile (skipped / full / partial),
  so any ``kv_hi`` giving the same tiles passes.
- :func:`grade_mods_forward` grades a Triton forward ``fn(q, k, v, *, cu_seqlens,
  causal, softcap, alibi_slopes, sink_logits) -> (o, lse)`` on packed ``[1, H, N,
  D]`` inputs (GQA), in a separate process on the CPU, with NaN-padded strided
  inputs and a proof of work (:class:`.proof.Work`).
- :func:`grade_mods_backward` grades a NumPy function ``fn(q, k, v, o, lse, do, *,
  cu_seqlens, causal, softcap, alibi_slopes, sink_logits) -> (dq, dk, dv, dsink)``
  (``[H, N, D]`` float64, one packed sequence): the backward's new terms, the
  soft-cap's derivative ``1 - tanh^2`` on dS and the sink's gradient ``dsink_h =
  -sum_i exp(z_h - lse_i) (dO_i . O_i)``.

Mistakes are recognised by re-enacting them in float64 on the same inputs
(:func:`_forward_variant`, :func:`_backward_variant`); the ones that depend on
which tiles the kernel visits (documents leaking inside a visited tile, the
soft-cap applied after the mask) are re-enacted for each block size a kernel
might use (:func:`visited_pairs`).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np

from .. import references as ref
from ..environment import current
from . import inputs, proof
from .core import Diagnosis, Run, require_callable
from .mistakes import Model

__all__ = ["grade_doc_tile_bounds", "grade_mods_forward", "grade_mods_backward", "document_of", "visited_pairs"]

# -- messages: one plain sentence or two each; the tests look for these texts --
# check_doc_tile_bounds
MSG_LO_BLOCK = (
    "the key range starts at the query block's own tile: the block's first row sees its whole "
    "document from its start, so kv_lo is the start of the FIRST row's document, "
    "cu_seqlens[d] <= start_m * block_m, rounded down to a multiple of block_n."
)
MSG_LO_LAST_ROW = (
    "the key range starts at the document of the block's LAST row: rows before it may belong to an "
    "earlier document, which starts earlier. kv_lo comes from the first row's document."
)
MSG_LO_UNALIGNED = (
    "kv_lo is not a multiple of block_n: the loop visits whole tiles, range(kv_lo, kv_hi, block_n), so "
    "round the document's start DOWN to a tile (the mask hides the keys before it)."
)
MSG_HI_FUTURE = (
    "with causal=True the key range runs past the diagonal: keys after the block's last row, "
    "min((start_m + 1) * block_m, N), are in the future of every row of the block; stop there."
)
MSG_HI_NOT_CAUSAL = (
    "with causal=False a row sees its whole document, keys after it too: the key range ends where "
    "the document of the block's last row ends, not at the diagonal."
)
MSG_HI_WHOLE = (
    "the key range runs to the end of the packed sequence: tiles after the last row's document "
    "(or, causal, after the diagonal) hold no key any row of the block sees; skip them."
)
MSG_BOUNDARY_FULL = (
    "a tile that a document boundary crosses was called full: only where every row of the block and "
    "every key of the tile lie in the same document (and, causal, the tile is at or below the block's "
    "first row) can the mask be skipped. Elsewhere documents would leak into each other."
)
MSG_ALL_PARTIAL = (
    "every visited tile is marked partial: the answer would be right but slow. A tile whose keys all "
    "lie in the one document of all the block's rows (and, causal, below the diagonal) needs no mask."
)
MSG_PARTIAL_OUTSIDE = (
    "partial lists a tile the loop does not visit: partial holds the start offsets (multiples of "
    "block_n) of visited tiles, range(kv_lo, kv_hi, block_n), that need the mask."
)
MSG_PAST_END = (
    "the range visits a tile that starts at or after N (the end of the packed sequence): there is no "
    "key there; stop at the last document's end."
)
# check_mods_forward
MSG_DOC_LEAK = (
    "documents leak across a boundary: key j is visible from query i only when both lie in the same "
    "segment [cu_seqlens[d], cu_seqlens[d + 1]). A visited tile can hold the end of the previous "
    "document or the start of the next one, so mask with keep = (j >= row_lo) & (j < row_hi) "
    "(and j <= i if causal) in every tile you do not know to be full."
)
MSG_SOFTCAP_AFTER_MASK = (
    "the soft-cap was applied after the mask: softcap * tanh(-inf / softcap) is -softcap, not -inf, so "
    "the masked keys of each visited tile come back with weight exp(-softcap - m). Cap (and bias) the "
    "scores first, mask last."
)
MSG_NO_SOFTCAP = (
    "the scores are not soft-capped: with softcap = c, s <- c * tanh(s / c), on the scaled scores "
    "s = q.k / sqrt(D), before the ALiBi bias and the mask."
)
MSG_SOFTCAP_FORM = (
    "the soft-cap has the wrong form: it is c * tanh(s / c), dividing by c inside the tanh AND "
    "multiplying by c outside (small scores stay as they are, large ones bend towards +-c)."
)
MSG_ALIBI_INSIDE_CAP = (
    "ALiBi's bias went inside the soft-cap: cap the scores first, s <- c * tanh(s / c), then subtract "
    "m_h * |i - j| (the bias itself is not capped)."
)
MSG_ALIBI_SIGN = (
    "ALiBi's bias has the wrong sign: subtract m_h * |i - j| (a farther key scores lower), do not add it."
)
MSG_ALIBI_DISTANCE = (
    "ALiBi's distance is wrong: it is the absolute distance |i - j|. Without causal, keys after the query "
    "(j > i) are penalised too, so i - j (negative there) must go through tl.abs."
)
MSG_ALIBI_SCALED = (
    "ALiBi's bias was multiplied by 1/sqrt(D): it is subtracted from the scaled scores, "
    "s = q.k / sqrt(D) - m_h |i - j|, not scaled with them."
)
MSG_ALIBI_HEAD = (
    "ALiBi's slope is read for the wrong head: every query head has its own slope, "
    "alibi_slopes[q_head], not the slope of its kv head."
)
MSG_NO_ALIBI = "ALiBi's bias is missing: subtract alibi_slopes[q_head] * |i - j| from every score."
MSG_SINK_MISSING = (
    "the sink logit is not in the softmax's denominator: fold exp(z_h) into l_i once per row (after the "
    "tile loop, in the kernel's base-2 units: z * log2(e)), rescaling l_i and acc to the new max."
)
MSG_SINK_NUMERATOR = (
    "the sink logit was added to the numerator: the sink takes probability mass but has no value, so "
    "exp(z_h - m) joins l_i (the denominator) only; acc is rescaled to the new max, never added to."
)
MSG_SINK_NOT_IN_LSE = (
    "lse is missing the sink: lse_i = log(exp(z_h) + sum_j exp(s_ij)), from the same l_i that divides o "
    "(the backward recomputes p_ij = exp(s_ij - lse_i), which must already leave the sink its share)."
)
MSG_SINK_BASE = (
    "the sink logit is in the wrong base: the running max and sum are in base 2 (scores times log2(e)), "
    "so the sink enters exp2 as z_h * log2(e), not as z_h."
)
MSG_SINK_SCALED = (
    "the sink logit was multiplied by sm_scale: it is a logit already, on the scale of the scaled scores; "
    "use z_h as it is (times log2(e) in base 2)."
)
MSG_NO_TRITON_MODS = (
    "no Triton kernel ran: flash_attention_mods must launch your @triton.jit kernel "
    "(`_mods_fwd_kernel[grid](...)`) and return its (o, lse)."
)
# check_mods_backward
MSG_SOFTCAP_NO_DERIVATIVE = (
    "dq/dk miss the soft-cap's derivative: the capped score is c * tanh(s / c), whose derivative is "
    "1 - tanh(s / c)^2, so multiply dS by (1 - t^2) (t = tanh(s / c)) before dq = scale * dS K and "
    "dk = scale * dS^T Q."
)
MSG_SOFTCAP_DERIVATIVE_FORM = (
    "the soft-cap's derivative is 1 - tanh(s / c)^2, the square of the tanh t, not of the capped score "
    "c * t (and not 1 - t)."
)
MSG_DSINK_SIGN = (
    "dsink has the wrong sign: raising z_h takes mass from every visible key, so dsink_h = "
    "-sum_i exp(z_h - lse_i) * (dO_i . O_i)."
)
MSG_DSINK_NO_DELTA = (
    "dsink is missing each row's weight delta_i = dO_i . O_i: dsink_h = -sum_i exp(z_h - lse_i) * delta_i "
    "(the sink's probability in row i times how the loss changes when o_i shrinks)."
)
MSG_DSINK_UNNORMALISED = (
    "dsink uses exp(z_h) without the row's normaliser: the sink's probability in row i is "
    "exp(z_h - lse_i), lse_i being the row's lse (which includes the sink)."
)
MSG_DSINK_NOT_SUMMED = (
    "dsink must be one number per head, summed over the queries: return an array of shape [H]."
)

_FWD_TOL = {("cpu", "float32"): (2e-4, 2e-4, 2e-4), ("cuda", "float32"): (3e-3, 3e-3, 1e-2),
            ("cpu", "float16"): (1e-2, 1e-2, 1e-2), ("cuda", "float16"): (1e-2, 1e-2, 1e-2),
            ("cuda", "bfloat16"): (3e-2, 3e-2, 3e-2)}
_BWD_TOL = 1e-8  # float64 NumPy against float64

# Block sizes (block_m, block_n) a kernel might use: the tile-dependent models try each.
_BLOCK_PAIRS = [(bm, bn) for bm in (16, 32, 64, 128) for bn in (16, 32, 64, 128)]


# =============================================================================
# The document mask and the tiles it needs
# =============================================================================
def document_of(cu_seqlens, n: int) -> np.ndarray:
    """The document index of each position ``0..n-1`` (``cu_seqlens[d] <= i < cu_seqlens[d + 1]``)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    return np.searchsorted(cu, np.arange(n), side="right") - 1


def _doc_mask(cu, n, causal):
    doc = document_of(cu, n)
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= np.arange(n)[None, :] <= np.arange(n)[:, None]
    return keep


def _bounds_variant(cu, block_m, block_n, start_m, causal, mistake=None):
    """``(kv_lo, kv_hi, partial)`` of the right answer, or of a known mistake."""
    cu = [int(x) for x in cu]
    n = cu[-1]
    doc = document_of(cu, n)
    q0, q1 = start_m * block_m, min((start_m + 1) * block_m, n)
    d_first, d_last = int(doc[q0]), int(doc[q1 - 1])
    lo = cu[d_first]
    if mistake == "lo_block":
        lo = q0
    elif mistake == "lo_last_row":
        lo = cu[d_last]
    if mistake != "lo_unaligned":
        lo = lo // block_n * block_n
    hi = q1 if causal else cu[d_last + 1]
    if mistake == "hi_doc":
        hi = cu[d_last + 1]
    elif mistake == "hi_diagonal":
        hi = q1
    elif mistake == "hi_whole":
        hi = n
    partial = []
    for t in range(lo, hi, block_n):
        t_last = min(t + block_n, n) - 1
        inside = t + block_n <= n  # a tile that runs past N must be masked (its last slots hold no key)
        one_doc = d_first == d_last and doc[t] == d_first and doc[t_last] == d_first and inside
        below = not causal or t_last <= q0
        if mistake == "partial_diagonal_only":
            full = below
        elif mistake == "partial_rows_ignored":
            full = doc[t] == doc[t_last] == d_first and below and inside
        elif mistake == "partial_all":
            full = False
        else:
            full = one_doc and below
        if not full:
            partial.append(t)
    return lo, hi, partial


def tile_classes(cu, block_m, block_n, start_m, causal) -> np.ndarray:
    """Per K/V tile of the sequence: 0 skipped, 1 full, 2 partial, from the mask itself (brute force).

    A tile is full when every real row of the block sees every key of it and it ends at or before
    N (a tile running past N is masked: without the mask its empty slots would count as keys).
    """
    n = int(cu[-1])
    keep = _doc_mask(cu, n, causal)[start_m * block_m:min((start_m + 1) * block_m, n)]
    out = np.zeros(-(-n // block_n), dtype=np.int64)
    for t in range(out.size):
        tile = keep[:, t * block_n:min((t + 1) * block_n, n)]
        out[t] = 0 if not tile.any() else (1 if tile.all() and (t + 1) * block_n <= n else 2)
    return out


def _classes_of(lo, hi, partial, n, block_n):
    out = np.zeros(-(-n // block_n), dtype=np.int64)
    for t in range(lo, hi, block_n):
        if 0 <= t < n and t % block_n == 0:
            out[t // block_n] = 2 if t in partial else 1
    return out


_BOUNDS_DIAGNOSES = [
    ("lo_block", MSG_LO_BLOCK),
    ("lo_last_row", MSG_LO_LAST_ROW),
    ("hi_doc", MSG_HI_FUTURE),
    ("hi_diagonal", MSG_HI_NOT_CAUSAL),
    ("hi_whole", MSG_HI_WHOLE),
    ("partial_diagonal_only", MSG_BOUNDARY_FULL),
    ("partial_rows_ignored", MSG_BOUNDARY_FULL),
    ("partial_all", MSG_ALL_PARTIAL),
]


def random_cu_seqlens(rng, n: int, n_docs: int) -> list[int]:
    """``n_docs`` documents of random lengths (each at least 1) packed into ``n`` tokens."""
    n_docs = max(1, min(n_docs, n))
    cuts = sorted(rng.choice(np.arange(1, n), size=n_docs - 1, replace=False).tolist()) if n_docs > 1 else []
    return [0] + [int(c) for c in cuts] + [n]


def _bounds_cases(rng):
    """(cu_seqlens, block_m, block_n, causal): fixed ones, then random ones."""
    cases = [
        ([0, 37, 40, 100, 150], 32, 32, True), ([0, 37, 40, 100, 150], 32, 32, False),
        ([0, 64, 128, 192, 256], 64, 32, True), ([0, 64, 128, 192, 256], 64, 64, False),
        ([0, 250], 64, 32, True), ([0, 1, 2, 3, 70, 71, 200], 64, 16, False),
        ([0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 32, 16, True),
        ([0, 100, 101, 300], 128, 64, False), ([0, 5, 133], 16, 32, True), ([0, 90, 97, 256, 260], 32, 64, False),
    ]
    for _ in range(8):
        block_n = int(rng.choice([16, 32, 64]))
        block_m = int(rng.choice([16, 32, 64, 128]))
        n = int(rng.integers(2, 400))
        cases.append((random_cu_seqlens(rng, n, int(rng.integers(1, 12))), block_m, block_n, bool(rng.random() < 0.5)))
    return cases


def grade_doc_tile_bounds(fn, *, seed=None):
    """Grade ``fn(cu_seqlens, block_m, block_n, start_m, causal) -> (kv_lo, kv_hi, partial)``.

    ``cu_seqlens`` is a list of ints, ``0 = cu[0] < ... < cu[S] = N``. Query block
    ``start_m`` (rows ``start_m * block_m`` up to ``min((start_m + 1) * block_m,
    N)``) visits the K/V tiles ``range(kv_lo, kv_hi, block_n)`` (``kv_lo`` a
    multiple of ``block_n``); ``partial`` lists the starts of the visited tiles
    that need the mask. Exact: every tile holding a key some row of the block
    sees is visited and no other; a tile is left out of ``partial`` only when
    every row of the block sees every key of it and the tile ends at or before
    N (rows past N do not count).
    Every query block of fixed and fresh random packings is tried.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_doc_tile_bounds")
    from ..kernels.forward import mods_tile_bounds  # where it is used (see .exercises)

    run = Run("check_doc_tile_bounds", seed, time_limit_s=10.0)
    for cu, block_m, block_n, causal in _bounds_cases(run.rng):
        n = cu[-1]
        case = f"cu_seqlens={cu}, block_m={block_m}, block_n={block_n}, causal={causal}"
        blocks = range(-(-n // block_m))
        got = []
        for start_m in blocks:
            with proof.answer_keys_forbidden(mods_tile_bounds):  # the package's own answer (kernel D's bounds)
                out = run.call(fn, list(cu), block_m, block_n, start_m, causal, case=f"{case}, start_m={start_m}")
            where = f"{case}, start_m={start_m}"
            try:
                lo, hi, partial = out
                lo, hi = operator.index(lo), operator.index(hi)
                partial = {operator.index(p) for p in partial}
            except (TypeError, ValueError):
                raise run.fail(f"your function returned {out!r}; return (kv_lo, kv_hi, partial): two Python ints "
                               "and a list of ints (the starts of the tiles that need the mask).", where) from None
            if lo % block_n:
                raise run.fail(MSG_LO_UNALIGNED + f" (got kv_lo={lo})", where)
            visited = set(range(lo, hi, block_n))
            if partial - visited:
                raise run.fail(MSG_PARTIAL_OUTSIDE + f" (got {sorted(partial - visited)} outside "
                               f"range({lo}, {hi}, {block_n}))", where)
            if any(t >= n or t < 0 for t in visited):
                raise run.fail(MSG_PAST_END + f" (got range({lo}, {hi}, {block_n}) with N={n})", where)
            got.append(_classes_of(lo, hi, partial, n, block_n))
        got = np.array(got, dtype=np.float64)
        expected = np.array([tile_classes(cu, block_m, block_n, m, causal) for m in blocks], dtype=np.float64)
        diagnoses = []
        for mistake, message in _BOUNDS_DIAGNOSES:
            wrong = []
            for m in blocks:
                lo, hi, partial = _bounds_variant(cu, block_m, block_n, m, causal, mistake)
                wrong.append(_classes_of(lo, hi, set(partial), n, block_n))
            diagnoses.append(Diagnosis(message, expected=np.array(wrong, dtype=np.float64)))
        run.compare(got, expected, case=case + " (0 skipped, 1 full, 2 partial)", what="the tiles visited",
                    atol=0.0, rtol=0.0, diagnoses=diagnoses, axes=("start_m", "tile"))
    return run.passed()


# =============================================================================
# The forward: models of the right answer and of the mistakes
# =============================================================================
def visited_pairs(cu, n, block_m, block_n, causal, n_keys=None) -> np.ndarray:
    """``[n, n_keys]``: True where key slot j lies in a tile that query i's block visits (the right tile bounds).

    ``n_keys`` (default ``n``) longer than ``n`` keeps the slots past the end that the last tile of
    a range covers (a kernel loads them as zeros and masks them).
    """
    n_keys = n if n_keys is None else n_keys
    key = (tuple(int(x) for x in cu), n, block_m, block_n, causal, n_keys)
    if key not in _VISITED:
        out = np.zeros((n, n_keys), dtype=bool)
        for start_m in range(-(-n // block_m)):
            lo, hi, _ = _bounds_variant(cu, block_m, block_n, start_m, causal)
            end = min(-(-hi // block_n) * block_n, n_keys)
            out[start_m * block_m:min((start_m + 1) * block_m, n), lo:end] = True
        if len(_VISITED) > 64:
            _VISITED.clear()
        _VISITED[key] = out
    return _VISITED[key]


_VISITED: dict = {}


def _softmax_out(s, v, z=None, numerator=False):
    """``(o, lse)`` of scores ``s`` (-inf: hidden) with an optional sink logit ``z [H]``."""
    with np.errstate(all="ignore"):
        m = np.max(s, axis=-1)
        if z is not None:
            m = np.maximum(m, z[:, None])
        e = np.exp(s - m[..., None])
        l_keys = e.sum(-1)
        l = l_keys if z is None else l_keys + np.exp(z[:, None] - m)
        o = (e @ v) / l[..., None]
        if numerator and z is not None:
            o = o + (np.exp(z[:, None] - m) / l)[..., None]
        return o, m + np.log(l), m + np.log(l_keys)


def _forward_variant(q, k, v, cu, causal, softcap, slopes, sinks, mistake=None, blocks=None, cache=None):
    """``(o, lse)`` in float64 of one packed sequence (``q [Hq, N, D]``, ``k, v [Hkv, N, D]``), or of a mistake.

    ``blocks = (block_m, block_n)``: the tiles a kernel visits, for the mistakes that
    only show inside visited tiles. ``cache`` (a dict) keeps the scores, which do not depend
    on the blocks, between calls for the same inputs.
    """
    key = (mistake, None if blocks is None else max(blocks))
    if cache is not None and key in cache:
        s, bias, v, keep, n, n_keys, scale = cache[key]
    else:
        s, bias, v, keep, n, n_keys, scale = _variant_scores(q, k, v, cu, causal, softcap, slopes, mistake, blocks)
        if cache is not None:
            cache[key] = (s, bias, v, keep, n, n_keys, scale)
    return _variant_softmax(s, bias, v, keep, n, n_keys, scale, cu, causal, softcap, sinks, mistake, blocks)


def _variant_scores(q, k, v, cu, causal, softcap, slopes, mistake, blocks):
    """The first half of :func:`_forward_variant`: the modified scores and the document mask."""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    h, n, d = q.shape
    after_mask = mistake in ("softcap_after_mask", "softcap_after_mask_bias")
    if after_mask:  # capped after the mask, even the slots past N of the last tile count: zeros, score -c
        pad = max(blocks)
        k = np.concatenate([k, np.zeros((h, pad, d))], axis=1)
        v = np.concatenate([v, np.zeros((h, pad, v.shape[-1]))], axis=1)
    n_keys = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    s = scale * (q @ np.swapaxes(k, -1, -2))
    i, j = np.arange(n)[:, None], np.arange(n_keys)[None, :]
    bias = 0.0
    if slopes is not None:
        slope = np.asarray(slopes, dtype=np.float64)
        if mistake == "alibi_kv_head":
            slope = slope[np.arange(h) // group]  # the kv head's index: q_head // group_size
        dist = (i - j) if mistake == "alibi_signed" else np.abs(i - j)
        bias = slope[:, None, None] * dist
        if mistake == "alibi_sign":
            bias = -bias
        elif mistake == "alibi_scaled":
            bias = bias * scale
        elif mistake == "no_alibi":
            bias = 0.0
    with np.errstate(all="ignore"):
        if softcap is not None and mistake != "no_softcap" and not after_mask:
            c = float(softcap)
            if mistake == "softcap_no_outer":
                s = np.tanh(s / c)
            elif mistake == "softcap_no_inner":
                s = c * np.tanh(s)
            elif mistake == "alibi_inside_cap":
                s, bias = c * np.tanh((s - bias) / c), 0.0
            else:
                s = c * np.tanh(s / c)
        if mistake != "softcap_after_mask_bias":
            s = s - bias
    doc = np.concatenate([document_of(cu, n), np.full(n_keys - n, -1)])
    keep = (doc[:n, None] == doc[None, :]) & ((j <= i) if causal else True)
    return s, bias, v, keep, n, n_keys, scale


def _variant_softmax(s, bias, v, keep, n, n_keys, scale, cu, causal, softcap, sinks, mistake, blocks):
    """The second half of :func:`_forward_variant`: the tiles' mask mistakes, the sink, the softmax."""
    after_mask = mistake in ("softcap_after_mask", "softcap_after_mask_bias")
    i, j = np.arange(n)[:, None], np.arange(n_keys)[None, :]
    doc = np.concatenate([document_of(cu, n), np.full(n_keys - n, -1)])
    if mistake in ("leak_all", "leak_lower", "leak_upper") or after_mask:
        seen = visited_pairs(cu, n, *blocks, causal, n_keys)
        cu_arr = np.asarray(cu)
        row_lo, row_hi = cu_arr[doc[:n]][:, None], cu_arr[doc[:n] + 1][:, None]
        causal_ok = (j <= i) if causal else (j < n)
        if mistake == "leak_all":
            keep = seen & causal_ok
        elif mistake == "leak_lower":
            keep = seen & causal_ok & (j < row_hi)
        elif mistake == "leak_upper":
            keep = seen & causal_ok & (j >= row_lo)
        else:  # masked, then capped: c * tanh(-inf / c) = -c. "softcap_after_mask": bias, mask, cap;
            c = float(softcap)  # "softcap_after_mask_bias": mask, cap, then the bias
            with np.errstate(all="ignore"):
                s = np.where(keep, c * np.tanh(s / c), np.where(seen, -c, -np.inf))
                if mistake == "softcap_after_mask_bias":
                    s = s - bias
            keep = seen
    s = np.where(keep, s, -np.inf)
    z = None if sinks is None or mistake == "no_sink" else np.asarray(sinks, dtype=np.float64)
    if z is not None and mistake == "sink_base":
        z = z * math.log(2.0)
    elif z is not None and mistake == "sink_scaled":
        z = z * scale
    o, lse, lse_keys = _softmax_out(s, v, z, numerator=mistake == "sink_numerator")
    if mistake == "sink_not_in_lse":
        lse = lse_keys
    return o, lse


def _forward_diagnoses(c, q64, k64, v64, which, cache=None):
    """The diagnoses that fit case ``c`` for output ``which`` (0: o, 1: lse); ``cache`` shared by both."""
    args = (q64, k64, v64, c.cu, c.causal, c.softcap, c.slopes, c.sinks)
    cache = {} if cache is None else cache
    scores = cache.setdefault("scores", {})

    def predict(mistake):
        def fn(blocks):
            key = (mistake, blocks)
            if key not in cache:
                cache[key] = _forward_variant(*args, mistake=mistake, blocks=blocks, cache=scores)
            return cache[key][which]
        return fn

    def model(message, mistake, tiled=False):
        return Model(message, predict(mistake), _BLOCK_PAIRS if tiled else (None,))

    diagnoses = []
    if c.softcap is not None:
        diagnoses += [model(MSG_NO_SOFTCAP, "no_softcap"), model(MSG_SOFTCAP_FORM, "softcap_no_outer"),
                      model(MSG_SOFTCAP_FORM, "softcap_no_inner")]
        if c.slopes is not None:
            diagnoses.append(model(MSG_ALIBI_INSIDE_CAP, "alibi_inside_cap"))
    if c.slopes is not None:
        diagnoses += [model(MSG_NO_ALIBI, "no_alibi"), model(MSG_ALIBI_SIGN, "alibi_sign"),
                      model(MSG_ALIBI_SCALED, "alibi_scaled")]
        if not c.causal:
            diagnoses.append(model(MSG_ALIBI_DISTANCE, "alibi_signed"))
        if c.n_q_heads > c.n_kv_heads:
            diagnoses.append(model(MSG_ALIBI_HEAD, "alibi_kv_head"))
    if c.sinks is not None:
        if which == 1:
            # lse is compared only once o has passed, and a sink missing from the denominator would have
            # changed o: its lse (the keys' alone) is sink_not_in_lse's exactly, so it is left out here
            # (on a GPU, rounding decided between the two).
            diagnoses.append(model(MSG_SINK_NOT_IN_LSE, "sink_not_in_lse"))
        else:
            diagnoses.append(model(MSG_SINK_MISSING, "no_sink"))
        diagnoses += [model(MSG_SINK_NUMERATOR, "sink_numerator"), model(MSG_SINK_BASE, "sink_base"),
                      model(MSG_SINK_SCALED, "sink_scaled")]
    # The mistakes that depend on the tiles visited, tried for each block size (the slowest models: last).
    if len(c.cu) > 2:
        diagnoses += [model(MSG_DOC_LEAK, m, tiled=True) for m in ("leak_all", "leak_lower", "leak_upper")]
    if c.softcap is not None:
        diagnoses.append(model(MSG_SOFTCAP_AFTER_MASK, "softcap_after_mask", tiled=True))
        if c.slopes is not None:
            diagnoses.append(model(MSG_SOFTCAP_AFTER_MASK, "softcap_after_mask_bias", tiled=True))
    return diagnoses


@dataclasses.dataclass
class _Case:
    name: str
    n_q_heads: int
    n_kv_heads: int
    cu: list
    D: int
    causal: bool
    softcap: float | None
    slopes: np.ndarray | None
    sinks: np.ndarray | None
    dtype: str = "float32"
    transpose: bool = False

    @property
    def N(self):
        return self.cu[-1]


def alibi_slopes(n_heads: int) -> np.ndarray:
    """The ALiBi paper's slopes for ``n_heads`` heads (a power of two): ``2^(-8 (h + 1) / n_heads)``."""
    return 2.0 ** (-8.0 * (np.arange(n_heads) + 1) / n_heads)


def _forward_cases(rng, device):
    """Small on purpose: in the CPU interpreter every (program, K/V tile) costs milliseconds."""
    z2, z4 = np.array([0.5, 2.0]), np.array([1.5, -0.5, 3.0, 0.0])
    cases = [
        # All three modifications first: most mistakes show (and are told apart) on the first case.
        _Case("fixed: GQA 4/2, not causal, 6 documents (one of 1 token), softcap 1.5 + ALiBi + sinks", 4, 2,
              [0, 30, 31, 70, 100, 101, 150], 16, False, 1.5, alibi_slopes(4), z4),
        _Case("fixed: GQA 4/2, causal, 8 documents, softcap 1.5 + ALiBi + sinks, D = 32", 4, 2,
              [0, 1, 17, 18, 60, 64, 100, 120, 130], 32, True, 1.5, alibi_slopes(4), z4, transpose=True),
        _Case("fixed: MHA 2/2, causal, 4 documents (one of 3 tokens), softcap 2", 2, 2, [0, 37, 40, 100, 150], 16,
              True, 2.0, None, None),
        _Case("fixed: GQA 4/2, not causal, 5 documents, ALiBi", 4, 2, [0, 20, 50, 51, 90, 130], 16, False, None,
              alibi_slopes(4), None),
        _Case("fixed: MQA 2/1, causal, 3 documents, learned sinks", 2, 1, [0, 45, 70, 100], 16, True, None, None, z2,
              transpose=True),
        _Case("fixed: MHA 2/2, not causal, one document, softcap 3 + sinks, fp16", 2, 2, [0, 90], 16, False, 3.0,
              None, z2, "float16"),
    ]
    n_kv = int(rng.integers(1, 3))
    n_q = n_kv * int(rng.choice([1, 2]))
    n = int(rng.integers(40, 160))
    cu = random_cu_seqlens(rng, n, int(rng.integers(1, 7)))
    causal = bool(rng.random() < 0.6)
    softcap = float(rng.uniform(1.0, 4.0)) if rng.random() < 0.6 else None
    slopes = rng.uniform(0.05, 1.0, n_q) if rng.random() < 0.6 else None
    sinks = rng.uniform(-1.0, 3.0, n_q) if rng.random() < 0.6 else None
    dtype = "float16" if rng.random() < 0.3 else "float32"
    mods = ", ".join(x for x, on in (("softcap", softcap), ("ALiBi", slopes is not None),
                                     ("sinks", sinks is not None)) if on) or "no score mods"
    cases.append(_Case(f"random: {n_q}/{n_kv} heads, cu_seqlens={cu}, causal={causal}, {mods}, {dtype}", n_q, n_kv,
                       cu, 16, causal, softcap, slopes, sinks, dtype, bool(rng.random() < 0.5)))
    # One shape twice, with new values: an answer kept from an earlier call cannot pass.
    cases.append(dataclasses.replace(cases[2], name=cases[2].name + ", again with new values"))
    if device == "cuda" and current().bf16_ok:
        cases.append(_Case("fixed: GQA 4/2, causal, 6 documents, softcap 20 + ALiBi + sinks, bf16", 4, 2,
                           [0, 100, 260, 300, 301, 450, 512], 64, True, 20.0, alibi_slopes(4), z4, "bfloat16"))
    return cases


def _inputs(run, c: _Case, device):
    import torch

    dtype = getattr(torch, c.dtype)
    raw = [run.rng.standard_normal((1, h, c.N, c.D)) for h in (c.n_q_heads, c.n_kv_heads, c.n_kv_heads)]
    q64, k64, v64 = (torch.from_numpy(a).to(dtype).double().numpy() for a in raw)
    q, k, v = (inputs.nan_padded(torch.from_numpy(a).to(dtype).to(device), transpose_heads=c.transpose and i == 1)
               for i, a in enumerate((q64, k64, v64)))
    # cu_seqlens with garbage after it (a read past cu_seqlens[S] sees -7), slopes and sinks NaN-guarded.
    cu_buf = torch.full((len(c.cu) + 16,), -7, dtype=torch.int32, device=device)
    cu = cu_buf[:len(c.cu)]
    cu.copy_(torch.tensor(c.cu, dtype=torch.int32))
    extra = {}
    for name, values in (("alibi_slopes", c.slopes), ("sink_logits", c.sinks)):
        extra[name] = None if values is None else inputs.guarded_contiguous(
            torch.tensor(values, dtype=torch.float32, device=device), after=64)
    return (q64, k64, v64), (q, k, v), cu, extra


def _right_forward(c, q64, k64, v64):
    """The float64 reference's ``(o, lse)`` of case ``c`` (``[1, Hq, N, D]``, ``[1, Hq, N]``)."""
    return ref.attention_lse(q64, k64, v64, causal=c.causal, cu_seqlens=np.asarray(c.cu), softcap=c.softcap,
                             alibi_slopes=c.slopes, sink_logits=c.sinks)


def grade_mods_forward(fn, *, seed=None):
    """Grade ``fn(q, k, v, *, cu_seqlens, causal, softcap, alibi_slopes, sink_logits) -> (o, lse)``.

    One packed sequence: ``q [1, Hq, N, D]``, ``k``/``v [1, Hkv, N, D]`` (MHA, GQA,
    MQA), ``cu_seqlens`` int32 ``[S + 1]``; ``softcap`` a float or None,
    ``alibi_slopes`` and ``sink_logits`` float32 ``[Hq]`` or None; ``o`` like
    ``q``, ``lse`` float32 ``[1, Hq, N]`` (natural log, the sink included).
    Causal and not, documents of one token and documents that cross tiles,
    every combination of the three modifications, NaN-padded strided inputs
    (and garbage after ``cu_seqlens``), fp32 and fp16 (bf16 too on a GPU),
    fresh random cases per call, against the float64 reference. ``o`` and
    ``lse`` must be written by your own Triton kernel during the call, and the
    inputs left as they were.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_mods_forward")
    env = current()
    run = Run("check_mods_forward", seed, time_limit_s=30.0)
    for c in _forward_cases(run.rng, env.device):
        (q64, k64, v64), (q, k, v), cu, extra = _inputs(run, c, env.device)
        before = inputs.snapshot(q=q, k=k, v=v, cu_seqlens=cu, **{k_: t for k_, t in extra.items() if t is not None})
        with proof.Work(inputs=(q, k, v, cu, *extra.values())) as work:
            out = run.call(fn, q, k, v, cu_seqlens=cu, causal=c.causal, softcap=c.softcap, case=c.name, **extra)
        if not isinstance(out, tuple) or len(out) != 2:
            raise run.fail(f"your function returned a {type(out).__name__}; return a pair (o, lse).", c.name)
        problem = work.problem(no_kernel=MSG_NO_TRITON_MODS, o=out[0], lse=out[1])
        if problem:
            raise run.fail(problem, c.name)
        changed = inputs.changed_input(before, q=q, k=k, v=v, cu_seqlens=cu,
                                       **{k_: t for k_, t in extra.items() if t is not None})
        if changed:
            raise run.fail(changed, c.name)
        o = inputs.tensor_out(run, out[0], "o", q.shape, c.name)
        lse = inputs.tensor_out(run, out[1], "lse", q.shape[:3], c.name)
        want_o, want_lse = _right_forward(c, q64, k64, v64)
        atol, rtol, lse_atol = _FWD_TOL[(env.device, c.dtype)]
        models = {}  # the mistakes' outputs, computed once for o and lse
        run.compare(o[0], want_o[0], case=c.name, what="the output o", atol=atol, rtol=rtol,
                    axes=("q_head", "i", "d"), diagnoses=_forward_diagnoses(c, q64[0], k64[0], v64[0], 0, models))
        run.compare(lse[0], want_lse[0], case=c.name, what="lse", atol=lse_atol, rtol=0.0, axes=("q_head", "i"),
                    diagnoses=_forward_diagnoses(c, q64[0], k64[0], v64[0], 1, models))
    return run.passed()


# =============================================================================
# The backward's new terms (NumPy)
# =============================================================================
def _backward_variant(q, k, v, do, cu, causal, softcap, slopes, sinks, mistake=None):
    """``(dq, dk, dv, dsink)`` in float64 (MHA ``[H, N, D]``) from the right forward, or of a mistake."""
    o, lse = _forward_variant(q, k, v, cu, causal, softcap, slopes, sinks)
    h, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    s = scale * (q @ np.swapaxes(k, -1, -2))
    t = None
    if softcap is not None:
        t = np.tanh(s / softcap)
        s = softcap * t
    if slopes is not None:
        s = s - np.asarray(slopes)[:, None, None] * np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    p = np.where(_doc_mask(cu, n, causal), np.exp(s - lse[..., None]), 0.0)
    dv = np.swapaxes(p, -1, -2) @ do
    delta = np.sum(do * o, axis=-1)
    ds = p * (do @ np.swapaxes(v, -1, -2) - delta[..., None])
    if t is not None:
        if mistake == "softcap_derivative_capped":
            ds = ds * (1 - (softcap * t) ** 2)
        elif mistake == "softcap_derivative_linear":
            ds = ds * (1 - t)
        elif mistake != "softcap_no_derivative":
            ds = ds * (1 - t ** 2)
    dsink = None
    if sinks is not None:
        z = np.asarray(sinks, dtype=np.float64)[:, None]
        share = np.exp(z - lse)
        if mistake == "dsink_unnormalised":
            share = np.exp(z) * np.ones_like(lse)
        weight = np.ones_like(delta) if mistake == "dsink_no_delta" else delta
        dsink = -np.sum(share * weight, axis=-1)
        if mistake == "dsink_sign":
            dsink = -dsink
    return scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, dv, dsink


def _backward_cases(rng):
    z2 = np.array([0.5, 2.0])
    cases = [
        _Case("fixed: 2 heads, causal, 3 documents, softcap 1.5", 2, 2, [0, 30, 33, 70], 16, True, 1.5, None, None),
        _Case("fixed: 2 heads, causal, 4 documents, sinks", 2, 2, [0, 10, 40, 41, 64], 16, True, None, None, z2),
        _Case("fixed: 3 heads, not causal, 3 documents, softcap 2 + ALiBi + sinks", 3, 3, [0, 25, 60, 80], 16, False,
              2.0, np.array([0.5, 0.25, 0.125]), np.array([1.0, -1.0, 2.5])),
        _Case("fixed: 1 head, causal, one document, softcap 0.7 + sinks", 1, 1, [0, 50], 16, True, 0.7, None,
              np.array([0.0])),
    ]
    h = int(rng.integers(1, 4))
    n = int(rng.integers(20, 90))
    cu = random_cu_seqlens(rng, n, int(rng.integers(1, 6)))
    causal = bool(rng.random() < 0.5)
    softcap = float(rng.uniform(0.5, 3.0)) if rng.random() < 0.7 else None
    slopes = rng.uniform(0.05, 1.0, h) if rng.random() < 0.5 else None
    sinks = rng.uniform(-1.0, 3.0, h) if (rng.random() < 0.7 or softcap is None) else None
    cases.append(_Case(f"random: {h} heads, cu_seqlens={cu}, causal={causal}, softcap={softcap and round(softcap, 3)}, "
                       f"ALiBi={slopes is not None}, sinks={sinks is not None}", h, h, cu, 16, causal, softcap,
                       slopes, sinks))
    # One shape twice, with new values: an answer kept from an earlier call cannot pass.
    cases.append(dataclasses.replace(cases[2], name=cases[2].name + ", again with new values"))
    return cases


def _right_backward(c, q, k, v, do):
    """The float64 reference's ``(dq, dk, dv, dsink)`` of case ``c`` (``[H, N, D]`` arrays, ``dsink [H]``)."""
    grads = ref.attention_backward(q[None], k[None], v[None], do[None], causal=c.causal, cu_seqlens=np.asarray(c.cu),
                                   softcap=c.softcap, alibi_slopes=c.slopes, sink_logits=c.sinks)
    dq, dk, dv = (g[0] for g in grads[:3])
    dsink = grads[3] if c.sinks is not None else None
    return dq, dk, dv, dsink


def grade_mods_backward(fn, *, seed=None):
    """Grade ``fn(q, k, v, o, lse, do, *, cu_seqlens, causal, softcap, alibi_slopes, sink_logits)``.

    NumPy float64, one packed sequence, one kv head per query head: ``q, k, v,
    o, do [H, N, D]``, ``lse [H, N]`` (the forward's, the sink included),
    ``cu_seqlens`` a NumPy int array, ``softcap`` a float or None,
    ``alibi_slopes`` / ``sink_logits`` ``[H]`` arrays or None. Returns ``(dq, dk,
    dv, dsink)``, ``dsink [H]`` (None without sinks). Compared with the float64
    reference on fixed and fresh random cases; the inputs must be left as they were.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_mods_backward")
    run = Run("check_mods_backward", seed, time_limit_s=20.0)
    for c in _backward_cases(run.rng):
        q, k, v, do = (run.rng.standard_normal((c.n_q_heads, c.N, c.D)) for _ in range(4))
        o, lse = _forward_variant(q, k, v, c.cu, c.causal, c.softcap, c.slopes, c.sinks)
        given = dict(q=q, k=k, v=v, o=o, lse=lse, do=do)
        copies = {name: a.copy() for name, a in given.items()}
        kwargs = dict(cu_seqlens=np.asarray(c.cu), causal=c.causal, softcap=c.softcap,
                      alibi_slopes=None if c.slopes is None else c.slopes.copy(),
                      sink_logits=None if c.sinks is None else c.sinks.copy())
        with proof.references_forbidden():
            out = run.call(fn, *copies.values(), case=c.name, **kwargs)
        for name, a in copies.items():
            if not np.array_equal(a, given[name]):
                raise run.fail(f"your function changed its input {name} in place; leave the inputs as they were "
                               "(compute into new arrays).", c.name)
        if not isinstance(out, tuple) or len(out) != 4:
            raise run.fail(f"your function returned a {type(out).__name__}; return four values (dq, dk, dv, dsink).",
                           c.name)
        want = _right_backward(c, q, k, v, do)
        for which, label in ((2, "dv"), (1, "dk"), (0, "dq")):
            got = run.array(out[which], expected_shape=q.shape, case=c.name, name=label)
            diagnoses = []
            if c.softcap is not None and which < 2:
                diagnoses = [Diagnosis(MSG_SOFTCAP_NO_DERIVATIVE, expected=_lazy(c, q, k, v, do, "softcap_no_derivative", which)),
                             Diagnosis(MSG_SOFTCAP_DERIVATIVE_FORM, expected=_lazy(c, q, k, v, do, "softcap_derivative_capped", which)),
                             Diagnosis(MSG_SOFTCAP_DERIVATIVE_FORM, expected=_lazy(c, q, k, v, do, "softcap_derivative_linear", which))]
            run.compare(got, want[which], case=c.name, what=label, atol=_BWD_TOL, rtol=_BWD_TOL,
                        axes=("head", "i" if which == 0 else "j", "d"), diagnoses=diagnoses)
        if c.sinks is None:
            continue
        dsink = out[3]
        if dsink is None:
            raise run.fail("dsink is None, but this case has sink logits: return their gradient, one per head.", c.name)
        dsink = np.asarray(dsink, dtype=np.float64) if not hasattr(dsink, "detach") else dsink.detach().cpu().double().numpy()
        if dsink.shape != (c.n_q_heads,):
            raise run.fail(MSG_DSINK_NOT_SUMMED + f" (got shape {dsink.shape})", c.name)
        diagnoses = [Diagnosis(message, expected=_lazy(c, q, k, v, do, mistake, 3)) for mistake, message in
                     (("dsink_sign", MSG_DSINK_SIGN), ("dsink_no_delta", MSG_DSINK_NO_DELTA),
                      ("dsink_unnormalised", MSG_DSINK_UNNORMALISED))]
        run.compare(dsink, want[3], case=c.name, what="dsink", atol=_BWD_TOL, rtol=_BWD_TOL, axes=("head",),
                    diagnoses=diagnoses)
    return run.passed()


def _lazy(c, q, k, v, do, mistake, which):
    return lambda: _backward_variant(q, k, v, do, c.cu, c.causal, c.softcap, c.slopes, c.sinks, mistake)[which]
