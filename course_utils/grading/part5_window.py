"""Checks for lesson 08: sliding-window attention with attention sinks.

Key ``j`` is visible from query ``i`` iff ``j <= i and (i - j < window_size
or j < sink_size)`` (:func:`course_utils.references.window_mask`).

- :func:`check_window_tile_bounds` grades a plain Python function
  ``fn(start_m, block_m, block_n, seq_len, window_size, sink_size) ->
  (sink_end, band_start, band_end)``: the K/V tiles one query block visits.
- :func:`check_dkdv_bounds` grades a plain Python function ``fn(start_n,
  block_m, block_n, seq_len, window_size, sink_size) -> (diag_end, full_end,
  q_end)``: the query blocks one dK/dV program walks, judged by what the
  walk does (every visible pair folded in once, full blocks without the
  mask, no query block that sees none of the keys), so bounds written
  differently but walking the same blocks pass.
- :func:`check_window_forward` grades a Triton forward
  ``fn(q, k, v, *, window_size, sink_size) -> (o, lse)`` (torch ``[B, H, N,
  D]``, GQA, causal), in a separate process on the CPU, with NaN-padded,
  strided inputs and a proof of work (:class:`.proof.Work`: ``o`` and ``lse``
  written by the learner's own kernel; q, k, v left as they were).
- :func:`check_window_backward` grades a differentiable
  ``fn(q, k, v, *, window_size, sink_size) -> o`` whose backward runs Triton
  kernels: ``dv``, then ``dk``, then ``dq`` against float64 references; ``dk``
  and ``dv`` must be written by the learner's dK/dV kernel (the course's
  delta and dQ kernels, and its forward, are allowed).
- :func:`check_sink_split` (optional) grades the backward with the sink keys' far
  queries split off: ``fn(q, k, v, o, lse, do, *, window_size, sink_size,
  num_chunks) -> (dq, dk, dv, dk_part, dv_part)``; the partials (one per chunk of
  query rows, written by the learner's own kernel) must sum to the float64 far
  gradients, the gradients must match the references, and a second run must give
  the same bits (the partials added in a fixed order).

Mistakes are recognised by re-enacting them in float64 on the same inputs.
Mask mistakes (the window off by one, sinks visible before their time) change
which pairs are visible. Loop mistakes (a band start not rounded down to a
tile, sink tiles skipped, sink tiles visited twice, no guard for rows whose
first visited tile is fully masked) are re-enacted by :func:`_visits`, which
runs the kernel's five phases tile by tile for each block size a kernel might
use and counts how often each (query, key) pair is folded in. The dK/dV
kernel's loop mistakes (sink keys not accumulated over every later query, the
far edge's loop stopping one query block short) are re-enacted the same way,
column by column (:func:`_dkdv_coverage`, :func:`_dkdv_short_coverage`).
"""

from __future__ import annotations

import math
import operator

import numpy as np

from .. import references as ref
from ..environment import current
from . import inputs, proof
from .core import Diagnosis, Run, distance_to, pick_diagnosis, require_callable
from .mistakes import SLACK, Model, weighted
from .mistakes import MSG_NO_TRITON_BACKWARD_WINDOW
from .mistakes import MSG_NO_TRITON_WINDOW
from .mistakes import MSG_NOT_DIFFERENTIABLE_WINDOW

__all__ = ["grade_window_tile_bounds", "grade_dkdv_bounds", "grade_window_forward", "grade_window_backward",
           "grade_sink_split"]

# One plain sentence (or two) per diagnosis; the tests look for these texts.
MSG_NOT_ALIGNED = (
    "the band's first tile is not aligned: band_start must be a multiple of block_n (round "
    "max(q_first - window_size + 1, 0) DOWN to one), or the tiles of the band straddle two "
    "blocks and the phases overlap."
)
MSG_BOUNDS_OFF_BY_ONE = (
    "the window is off by one at its lower edge: the block's first row q_first sees keys "
    "q_first - window_size + 1 to q_first (window_size keys, itself included), so the band starts at the "
    "tile holding key max(q_first - window_size + 1, 0)."
)
MSG_SINKS_SKIPPED = (
    "the sink tiles are skipped: the first sink_size keys are visible from every later query, so "
    "the tiles [0, sink_end) must be visited too, sink_end being sink_size rounded UP to a multiple "
    "of block_n (but not past band_start)."
)
MSG_SINK_ROUNDED_DOWN = (
    "the last, partial sink tile is skipped: sink_end must be sink_size rounded UP to a multiple "
    "of block_n, not down (a tile holding even one sink key must be visited)."
)
MSG_SINKS_TWICE = (
    "sink tiles are visited twice: when the band already starts at or below the sinks' last "
    "tile, sink_end must stop at band_start (sink_end = min(round_up(sink_size), band_start))."
)
MSG_BAND_END = (
    "the band does not end at the diagonal: band_end is the block's last row + 1, "
    "min((start_m + 1) * block_m, seq_len); keys after it are in the future of every row."
)
MSG_WINDOW_OFF_BY_ONE = (
    "the window is off by one: query i sees window_size keys, i - window_size + 1 to i, "
    "so keep i - j < window_size (not <=, and not < window_size - 1)."
)
MSG_SINKS_FUTURE = (
    "sinks are visible in the future: a sink key j < sink_size is visible only from queries "
    "i >= j. Keep (j <= i) AND (i - j < window_size OR j < sink_size), with the causal test "
    "outside the OR."
)
MSG_NAN_EMPTY_TILE = (
    "rows whose first visited tile is fully masked come out as NaN: their running max is still "
    "-inf after that tile, and exp2(-inf - (-inf)) is NaN. Where m_new is -inf, shift by 0 "
    "instead (m_shift = tl.where(m_new == -inf, 0, m_new)), so that alpha and p are exp2(-inf) = 0."
)
MSG_BWD_SINKS = (
    "dK/dV of the sink keys are not accumulated over every query: a key block holding sink keys "
    "is seen by EVERY later query, so its loop over query blocks must run to the end of the "
    "sequence (q_end = N), not stop at the window's far edge."
)
MSG_BWD_LAST_Q_BLOCK = (
    "dK/dV miss the last query block of a key block's range: the loop over query blocks stops one "
    "block short of the window's far edge. The last phase must run over [full_end, q_end) with "
    "q_end = min(start_n + BLOCK_N + window_size - 1, N), not rounded down to a multiple of BLOCK_M "
    "and not minus BLOCK_M: range(full_end, q_end, BLOCK_M) already visits the last, partial query "
    "block, whose first rows still see the block's last keys."
)
MSG_DKDV_NOT_YOURS = (
    "{what}: the dK/dV kernel is this exercise (your _attn_bwd_dkdv_window), so launch the one you "
    "wrote. The course gives only the delta kernel (attn_bwd_preprocess) and the dQ kernel "
    "(attn_bwd_dq_window)."
)
# The course's kernels lesson 08's backward may launch (it imports them); any other is a course dK/dV.
_COURSE_BACKWARD_KERNELS_OK = ("attn_bwd_preprocess", "attn_bwd_dq_window")

# Block sizes (block_m, block_n) a kernel might use: the models try each.
_BLOCK_PAIRS = [(bm, bn) for bm in (16, 32, 64, 128) for bn in (16, 32, 64, 128) if bm % bn == 0]
# The dK/dV kernel's pairs: its BLOCK_N is a multiple of its BLOCK_M.
_DKDV_PAIRS = [(bm, bn) for bm in (16, 32, 64, 128) for bn in (16, 32, 64, 128) if bn % bm == 0]

# Same tolerances as the lesson 05 and 07 checks.
_FWD_TOL = {("cpu", "float32"): (2e-4, 2e-4, 2e-4), ("cuda", "float32"): (3e-3, 3e-3, 1e-2),
            ("cpu", "float16"): (1e-2, 1e-2, 1e-2), ("cuda", "float16"): (1e-2, 1e-2, 1e-2),
            ("cuda", "bfloat16"): (3e-2, 3e-2, 3e-2)}
_BWD_TOL = {"float32": (3e-3, 3e-3), "float16": (2e-2, 2e-2), "bfloat16": (6e-2, 6e-2)}
_BWD_TOL_GPU_FP32 = (1e-2, 1e-2)


# =============================================================================
# check_window_tile_bounds
# =============================================================================
def _bounds_variant(start_m, block_m, block_n, seq_len, window_size, sink_size, mistake):
    q_first = start_m * block_m
    band_end = min(q_first + block_m, seq_len)
    low = max(q_first - window_size + 1, 0)
    band_start = low // block_n * block_n
    sink_end = -(-sink_size // block_n) * block_n
    if mistake == "unaligned":
        band_start = low
    elif mistake == "lower_minus_one":
        band_start = max(q_first - window_size, 0) // block_n * block_n
    elif mistake == "lower_plus_one":
        band_start = max(q_first - window_size + 2, 0) // block_n * block_n
    elif mistake == "band_end_block":
        band_end = q_first + block_m
    elif mistake == "band_end_plus_one":
        band_end = min(q_first + block_m + 1, seq_len)
    if mistake == "sinks_skipped":
        sink_end = 0
    elif mistake == "sink_rounded_down":
        sink_end = sink_size // block_n * block_n
    if mistake != "sinks_twice":
        sink_end = min(sink_end, band_start)
    return sink_end, band_start, band_end


_BOUNDS_DIAGNOSES = [
    ("sinks_skipped", MSG_SINKS_SKIPPED),
    ("sink_rounded_down", MSG_SINK_ROUNDED_DOWN),
    ("sinks_twice", MSG_SINKS_TWICE),
    ("unaligned", MSG_NOT_ALIGNED),
    ("lower_minus_one", MSG_BOUNDS_OFF_BY_ONE),
    ("lower_plus_one", MSG_BOUNDS_OFF_BY_ONE),
    ("band_end_block", MSG_BAND_END),
    ("band_end_plus_one", MSG_BAND_END),
]


def _bounds_cases(rng):
    """(block_m, block_n, seq_len, window_size, sink_size): fixed ones, then random ones."""
    cases = [
        (64, 32, 250, 97, 40), (64, 32, 256, 1, 0), (64, 32, 256, 33, 0), (64, 32, 256, 64, 4),
        (128, 64, 1000, 256, 4), (64, 64, 300, 500, 0), (32, 16, 100, 17, 200), (16, 16, 64, 16, 16),
        (128, 32, 700, 129, 33), (64, 16, 200, 65, 1),
    ]
    for _ in range(8):
        block_n = int(rng.choice([16, 32, 64]))
        block_m = block_n * int(rng.choice([1, 2, 4]))
        seq_len = int(rng.integers(1, 600))
        window_size = int(rng.integers(1, seq_len + 80))
        sink_size = int(rng.choice([0, 4, int(rng.integers(0, seq_len + 1))]))
        cases.append((block_m, block_n, seq_len, window_size, sink_size))
    return cases


def _three_ints(run, out, where, names, case):
    """A bounds function's answer ``out`` (for ``where``, "start_m=3") as three Python ints, else the check's
    failure saying what came back and what to return (``names``: "sink_end, band_start, band_end")."""
    __tracebackhide__ = True
    try:
        values = tuple(operator.index(x) for x in out)
    except TypeError:
        raise run.fail(f"your function returned {out!r} for {where}; return three Python ints ({names}).",
                       case) from None
    if len(values) != 3:
        raise run.fail(f"your function returned {len(values)} values for {where}; return three: ({names}).", case)
    return values


def grade_window_tile_bounds(fn, *, seed=None):
    """Grade ``fn(start_m, block_m, block_n, seq_len, window_size, sink_size) -> (sink_end, band_start, band_end)``.

    Query block ``start_m`` (rows ``start_m * block_m`` up to ``(start_m + 1)
    * block_m``, at most ``seq_len``) visits K/V tiles ``[0, sink_end)`` and
    ``[band_start, band_end)``; ``sink_end`` and ``band_start`` are multiples
    of ``block_n``. The answer must be exact: every tile holding a key some
    row of the block sees, and no other tile. Every query block of fixed and
    fresh random settings is tried.
    """
    __tracebackhide__ = True
    from ..kernels.forward import window_tile_bounds  # where it is used (see .exercises)

    run = Run("check_window_tile_bounds", seed, time_limit_s=10.0)
    for block_m, block_n, seq_len, window_size, sink_size in _bounds_cases(run.rng):
        case = (f"block_m={block_m}, block_n={block_n}, seq_len={seq_len}, window_size={window_size}, "
                f"sink_size={sink_size}")
        got = []
        n_blocks = -(-seq_len // block_m)
        for start_m in range(n_blocks):
            with proof.answer_keys_forbidden(window_tile_bounds):  # lesson 08 shows it beside the exercise
                out = run.call(fn, start_m, block_m, block_n, seq_len, window_size, sink_size,
                               case=f"{case}, start_m={start_m}")
            got.append(_three_ints(run, out, f"start_m={start_m}", "sink_end, band_start, band_end", case))
        got = np.array(got, dtype=np.float64)
        blocks = range(n_blocks)
        expected = np.array([window_tile_bounds(m, block_m, block_n, seq_len, window_size, sink_size)
                             for m in blocks], dtype=np.float64)
        diagnoses = [Diagnosis(message, expected=np.array(
            [_bounds_variant(m, block_m, block_n, seq_len, window_size, sink_size, mistake) for m in blocks],
            dtype=np.float64)) for mistake, message in _BOUNDS_DIAGNOSES]
        run.compare(got, expected, case=case, what="(sink_end, band_start, band_end)", atol=0.0, rtol=0.0,
                    diagnoses=diagnoses, axes=("start_m", "bound"))
    return run.passed()


# =============================================================================
# check_dkdv_bounds
# =============================================================================
MSG_DKDV_UNALIGNED = (
    "a phase starts inside a query block: the loops run range(lo, hi, block_m) from diag_end and from "
    "full_end, so both must be multiples of block_m (or N, where nothing follows). Otherwise the blocks of "
    "the next phase overlap the last block of the one before, and on a GPU a block starting at an odd row "
    "reads past the end of q."
)
MSG_DKDV_DIAG_OFF_BY_ONE = (
    "the diagonal ends one row early: the block's last key is start_n + block_n - 1, and query rows "
    "start_n .. start_n + block_n - 1 all sit on the diagonal, so diag_end = start_n + block_n "
    "(exclusive, like every end here), capped at N."
)
MSG_DKDV_DIAG_BLOCK_M = (
    "the diagonal is block_n rows tall, not block_m: the key block holds block_n keys, and each of the "
    "block_n // block_m query blocks in [start_n, start_n + block_n) has queries before some of those keys, "
    "so all of them need the causal mask. diag_end = min(start_n + block_n, N)."
)
MSG_DKDV_PAST_END = (
    "the walk visits query blocks past the end of the sequence: cap every bound at N "
    "(diag_end = min(start_n + block_n, N) for the last key block)."
)
MSG_DKDV_FULL_LAST_KEY = (
    "full_end counts the window from the block's last key, but a query block is full only if its last "
    "row i still sees the block's FIRST key: i - start_n < window_size. So the full blocks end at or "
    "before start_n + window_size: full_end = (start_n + window_size) rounded DOWN to a multiple of block_m."
)
MSG_DKDV_FULL_ROUNDED_UP = (
    "full_end is rounded up: the query block holding row start_n + window_size has rows that no longer "
    "see key start_n, so it is not full. Round (start_n + window_size) DOWN to a multiple of block_m."
)
MSG_DKDV_FULL_OFF_BY_ONE = (
    "full_end is one short: a full block's last row i must satisfy i - start_n < window_size, i.e. "
    "i <= start_n + window_size - 1, so a block ending exactly at start_n + window_size is still full "
    "(full_end = (start_n + window_size) // block_m * block_m, not from start_n + window_size - 1)."
)
MSG_DKDV_FULL_BEFORE_DIAG = (
    "full_end falls inside the diagonal when the window is shorter than the key block, and then the far "
    "edge's loop starts there and visits diagonal blocks a second time: keep full_end >= diag_end "
    "(max(..., diag_end)), then cap it at N."
)
MSG_DKDV_NO_FAR_EDGE = (
    "the loop runs past the window's far edge: the last query that sees the block's last key "
    "start_n + block_n - 1 is start_n + block_n - 1 + window_size - 1; query blocks after it see none of "
    "the keys (unless they are sinks) and are wasted work. q_end = min(start_n + block_n + window_size - 1, N)."
)
MSG_DKDV_FAR_EDGE_MISSING = (
    "the window's far edge is missing: after the full blocks come query blocks that see some of the keys "
    "but not all (the block's last keys are still in their window, its first ones no longer). Walk them "
    "with the mask, up to q_end = min(start_n + block_n + window_size - 1, N)."
)
MSG_DKDV_FAR_FROM_FIRST_KEY = (
    "q_end is set by the block's first key, but the far edge belongs to its LAST key start_n + block_n - 1, "
    "seen by queries up to start_n + block_n + window_size - 2: q_end = min(start_n + block_n + window_size - 1, N)."
)
MSG_DKDV_FAR_OFF_BY_ONE = (
    "q_end is one short: the last query that sees key start_n + block_n - 1 is "
    "start_n + block_n - 1 + window_size - 1, so the exclusive end is start_n + block_n + window_size - 1."
)
MSG_DKDV_SINKS_ALL_ONLY = (
    "q_end = N only for a key block made entirely of sinks: a block holding even ONE sink key "
    "(start_n < sink_size) is seen by every later query, so its walk must run to N too."
)
MSG_DKDV_SINKS_FULL_ANY = (
    "full_end = N for a key block that holds only SOME sinks: its other keys are still hidden from far "
    "queries, so those blocks need the mask. full_end = N only when every key is a sink "
    "(start_n + block_n <= sink_size)."
)
MSG_DKDV_SINKS_NOT_FULL = (
    "the sink blocks' far queries go through the mask although they see every key: when all keys of "
    "the block are sinks (start_n + block_n <= sink_size), every later query block sees all of them, so "
    "full_end = N (no mask work)."
)
MSG_DKDV_SINKS_LE = (
    "a key block starting AT sink_size holds no sink (the sinks are keys 0 .. sink_size - 1): use "
    "start_n < sink_size, not <=, or that block walks to N for nothing."
)

# Codes of the walk, per (key block, query row): masked visits + _UNMASKED * unmasked visits.
_UNMASKED = 4


def _dkdv_bounds_variant(start_n, block_m, block_n, seq_len, window_size, sink_size, mistake=None):
    """The course's ``(diag_end, full_end, q_end)`` for the key block at ``start_n``, or a mistaken one."""
    n, w, s, bm = seq_len, window_size, sink_size, block_m
    diag_end = min(start_n + block_n, n)
    if mistake == "diag_minus_one":
        diag_end = min(start_n + block_n - 1, n)
    elif mistake == "diag_block_m":
        diag_end = min(start_n + block_m, n)
    elif mistake == "diag_no_cap":
        diag_end = start_n + block_n
    full = (start_n + w) // bm * bm
    if mistake == "full_last_key":
        full = (start_n + block_n - 1 + w) // bm * bm
    elif mistake == "full_rounded_up":
        full = -(-(start_n + w) // bm) * bm
    elif mistake == "full_minus_one":
        full = (start_n + w - 1) // bm * bm
    full_end = min(full if mistake == "full_no_max" else max(full, diag_end), n)
    q_end = min(start_n + block_n + w - 1, n)
    if mistake == "no_far_edge":
        q_end = n
    elif mistake == "far_edge_missing":
        q_end = full_end
    elif mistake == "far_from_first_key":
        q_end = min(start_n + w, n)
    elif mistake == "far_minus_one":
        q_end = min(start_n + block_n + w - 2, n)
    elif mistake == "far_floor":
        q_end = q_end // bm * bm
    elif mistake == "far_minus_block":
        q_end = q_end - bm
    if s and mistake != "sinks_ignored":
        all_sinks = start_n + block_n <= s
        any_sink = start_n <= s if mistake == "sinks_le" else start_n < s
        if mistake == "sinks_full_any":
            all_sinks = any_sink
        if all_sinks and mistake != "sinks_not_full":
            full_end = n
        if any_sink and mistake != "sinks_all_only" or all_sinks:
            q_end = n
    return diag_end, full_end, q_end


_DKDV_BOUNDS_DIAGNOSES = [
    ("diag_minus_one", MSG_DKDV_DIAG_OFF_BY_ONE),
    ("diag_block_m", MSG_DKDV_DIAG_BLOCK_M),
    ("diag_no_cap", MSG_DKDV_PAST_END),
    ("full_last_key", MSG_DKDV_FULL_LAST_KEY),
    ("full_rounded_up", MSG_DKDV_FULL_ROUNDED_UP),
    ("full_minus_one", MSG_DKDV_FULL_OFF_BY_ONE),
    ("full_no_max", MSG_DKDV_FULL_BEFORE_DIAG),
    ("no_far_edge", MSG_DKDV_NO_FAR_EDGE),
    ("far_edge_missing", MSG_DKDV_FAR_EDGE_MISSING),
    ("far_from_first_key", MSG_DKDV_FAR_FROM_FIRST_KEY),
    ("far_minus_one", MSG_DKDV_FAR_OFF_BY_ONE),
    ("far_floor", MSG_BWD_LAST_Q_BLOCK),
    ("far_minus_block", MSG_BWD_LAST_Q_BLOCK),
    ("sinks_ignored", MSG_BWD_SINKS),
    ("sinks_all_only", MSG_DKDV_SINKS_ALL_ONLY),
    ("sinks_full_any", MSG_DKDV_SINKS_FULL_ANY),
    ("sinks_not_full", MSG_DKDV_SINKS_NOT_FULL),
    ("sinks_le", MSG_DKDV_SINKS_LE),
]


def _dkdv_walk(start_n, bounds, block_m, seq_len):
    """What the kernel's three loops do with ``bounds``: ``(codes, strays, starts)``.

    ``codes[i]`` = masked visits of row ``i`` + ``_UNMASKED`` * unmasked ones
    (rows of ``[0, seq_len)``); ``strays`` counts visited blocks wholly outside
    ``[start_n, seq_len)`` (beyond ``seq_len + 2 * block_m`` the walk is cut short
    and counts one more); ``starts`` lists ``(first row, masked)`` of every
    visited block inside.
    """
    diag_end, full_end, q_end = bounds
    codes = np.zeros(seq_len, dtype=np.int64)
    strays, starts = 0, []
    limit = seq_len + 2 * block_m
    for lo, hi, masked in ((start_n, diag_end, True), (diag_end, full_end, False), (full_end, q_end, True)):
        if hi <= lo:
            continue
        if lo < start_n - 2 * block_m:
            strays += 1
            lo = start_n - 2 * block_m
        if hi > limit:
            strays += 1
            hi = limit
        for first in range(lo, hi, block_m):
            rows = slice(max(first, 0), min(first + block_m, seq_len))
            if first >= seq_len or first + block_m <= start_n:
                strays += 1
                continue
            codes[rows] += 1 if masked else _UNMASKED
            starts.append((first, masked))
    return codes, strays, starts


def _dkdv_codes(bounds_of, block_m, block_n, seq_len):
    """The walk of every key block as one array ``[key block, row + 1]`` (the last column: stray blocks)."""
    out = []
    for start_n in range(0, seq_len, block_n):
        codes, strays, _ = _dkdv_walk(start_n, bounds_of(start_n), block_m, seq_len)
        out.append(np.append(codes, strays))
    return np.array(out, dtype=np.float64)


def _dkdv_problem(start_n, bounds, block_m, block_n, seq_len, window_size, sink_size, mask):
    """One sentence on what the walk of this key block does wrong, or None."""
    n, bm = seq_len, block_m
    keys = slice(start_n, min(start_n + block_n, n))
    seen = mask[:, keys]
    any_key, all_keys = seen.any(axis=1), seen.all(axis=1)
    codes, strays, starts = _dkdv_walk(start_n, bounds, bm, n)
    diag_end, full_end, q_end = bounds
    for lo, hi, name in ((diag_end, full_end, "diag_end"), (full_end, q_end, "full_end")):
        if hi > lo and lo % bm and lo != n:
            return (f"{name} = {lo} is not a multiple of block_m = {bm}, and the loop that starts there visits "
                    f"query blocks from row {lo} on.")
    masked, unmasked = codes % _UNMASKED, codes // _UNMASKED
    for i in range(n):
        if any_key[i] and masked[i] + unmasked[i] == 0:
            j = start_n + int(np.argmax(seen[i]))
            return f"query row {i} sees key {j}, but no phase of the walk visits it: its dK/dV contribution is missing."
        if masked[i] + unmasked[i] > 1:
            return (f"query row {i} is visited {masked[i] + unmasked[i]} times (the phases overlap): its "
                    "contribution to dK/dV is added more than once.")
        if unmasked[i] and not all_keys[i]:
            j = start_n + int(np.argmin(seen[i]))
            return (f"query row {i} is in the unmasked phase [diag_end, full_end), but it does not see key {j}: "
                    "without the mask that pair is folded in anyway.")
    if strays:
        return "the walk visits query blocks outside the sequence, or before the key block."
    for first, _ in starts:
        if not any_key[first:first + bm].any():
            return (f"the walk visits the query block at row {first}, whose rows see none of keys "
                    f"[{keys.start}, {keys.stop}): wasted work.")
    for first, was_masked in starts:
        should_be_full = first >= start_n + block_n and (first + bm <= start_n + window_size
                                                         or start_n + block_n <= sink_size)
        if was_masked and should_be_full:
            return (f"the query block at row {first} sees every key of the block (its last row is within the window "
                    "of key start_n, or all keys are sinks) but goes through the mask: it belongs in "
                    "[diag_end, full_end), the run the kernel does without mask work.")
    return None


def _dkdv_bounds_cases(rng):
    """(block_m, block_n, seq_len, window_size, sink_size): a small exhaustive grid, then random ones."""
    cases = [(bm, bn, n, w, s)
             for bm, bn in ((16, 16), (16, 32), (16, 64), (32, 64))
             for n in (100, 192)
             for w in (1, 2, 16, 18, 40, 64, 96, 300)
             for s in (0, 4, 32, 64)]
    for _ in range(8):
        block_m = int(rng.choice([16, 32, 64]))
        block_n = block_m * int(rng.choice([1, 2, 4]))
        seq_len = int(rng.integers(1, 400))
        window_size = int(rng.integers(1, seq_len + 40))
        sink_size = int(rng.choice([0, 4, int(rng.integers(0, seq_len + 1))]))
        cases.append((block_m, block_n, seq_len, window_size, sink_size))
    return cases


def _dkdv_case_name(block_m, block_n, seq_len, window_size, sink_size):
    return (f"block_m={block_m}, block_n={block_n}, seq_len={seq_len}, window_size={window_size}, "
            f"sink_size={sink_size}")


def _dkdv_diagnosis(cases, answers):
    """The first known mistake whose walk is the learner's in every case, or None."""
    actual = np.concatenate([_dkdv_codes(got.__getitem__, *c[:3]).ravel() for c, got in zip(cases, answers)])

    def walk_of(mistake):
        return np.concatenate([_dkdv_codes(lambda s, c=c: _dkdv_bounds_variant(s, *c, mistake), *c[:3]).ravel()
                               for c in cases])

    diagnoses = [Diagnosis(message, expected=lambda m=mistake: walk_of(m)) for mistake, message in _DKDV_BOUNDS_DIAGNOSES]
    return pick_diagnosis(diagnoses, actual, 0.0, 0.0)


def grade_dkdv_bounds(fn, *, seed=None):
    """Grade ``fn(start_n, block_m, block_n, seq_len, window_size, sink_size) -> (diag_end, full_end, q_end)``.

    The dK/dV program of the key block ``[start_n, start_n + block_n)`` (``start_n``
    a multiple of ``block_n``, ``block_n`` a multiple of ``block_m``) walks query
    blocks ``range(start_n, diag_end, block_m)`` with the mask (the diagonal),
    ``range(diag_end, full_end, block_m)`` without it (every row sees every key)
    and ``range(full_end, q_end, block_m)`` with it (the window's far edge, or
    the queries that see the keys only as sinks). The check runs that walk for
    every key block of a grid of settings and fresh random ones and wants:
    every visible (query, key) pair folded in exactly once, the unmasked run
    holding only full blocks and every block whose rows all lie within the
    window of the block's first key (or after the sinks, when all its keys
    are sinks), and no query block visited that sees none of the keys. Bounds
    written differently that walk the same blocks pass.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_dkdv_bounds")
    run = Run("check_dkdv_bounds", seed, time_limit_s=20.0)
    cases = _dkdv_bounds_cases(run.rng)
    answers = []  # every case's answers first: a diagnosis must fit the whole walk, not one case
    for block_m, block_n, seq_len, window_size, sink_size in cases:
        case = _dkdv_case_name(block_m, block_n, seq_len, window_size, sink_size)
        got = {}
        for start_n in range(0, seq_len, block_n):
            with proof.answer_keys_forbidden(_dkdv_bounds_variant):  # the grader's own walk is the answer
                out = run.call(fn, start_n, block_m, block_n, seq_len, window_size, sink_size,
                               case=f"{case}, start_n={start_n}")
            got[start_n] = _three_ints(run, out, f"start_n={start_n}", "diag_end, full_end, q_end", case)
        answers.append(got)
    for (block_m, block_n, seq_len, window_size, sink_size), got in zip(cases, answers):
        mask = ref.window_mask(seq_len, seq_len, window_size, sink_size)
        for start_n, bounds in got.items():
            problem = _dkdv_problem(start_n, bounds, block_m, block_n, seq_len, window_size, sink_size, mask)
            if problem is None:
                continue
            right = _dkdv_bounds_variant(start_n, block_m, block_n, seq_len, window_size, sink_size)
            text = (f"for the key block at start_n={start_n} your (diag_end, full_end, q_end) = {bounds}; "
                    f"{problem} (The right bounds there: {right}.)")
            diagnosis = _dkdv_diagnosis(cases, answers)
            if diagnosis is None and problem.startswith(("diag_end =", "full_end =")):
                diagnosis = Diagnosis(MSG_DKDV_UNALIGNED)
            if diagnosis is not None:
                text += f"\nLikely cause: {diagnosis.message}"
            raise run.fail(text, _dkdv_case_name(block_m, block_n, seq_len, window_size, sink_size))
    return run.passed()


# =============================================================================
# Models of the kernel's loops
# =============================================================================
def _variant_mask(n, window_size, sink_size, mistake=None):
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    if mistake == "window_plus_one":
        return (j <= i) & ((i - j <= window_size) | (j < sink_size))
    if mistake == "window_minus_one":
        return (j <= i) & ((i - j < window_size - 1) | (j < sink_size))
    if mistake == "no_sinks":
        return ref.window_mask(n, n, window_size, 0)
    if mistake == "sinks_future":
        return ((j <= i) & (i - j < window_size)) | (j < sink_size)
    return ref.window_mask(n, n, window_size, sink_size)


def _phases(q_first, block_m, block_n, n, window_size, sink_size, bounds):
    """The kernel's five (lo, hi, masked) phases for one query block (``_window_bounds`` in Python)."""
    if bounds == "unaligned":
        band_end = min(q_first + block_m, n)
        band_start = max(q_first - window_size + 1, 0)
        sink_end = min(-(-sink_size // block_n) * block_n, band_start)
    else:
        sink_end, band_start, band_end = _bounds_variant(
            q_first // block_m, block_m, block_n, n, window_size, sink_size, bounds)
    sink_full = min(sink_size // block_n * block_n, sink_end)
    full_start = -(-max(q_first + block_m - window_size, 0) // block_n) * block_n
    full_start = min(max(full_start, band_start), q_first)
    return [(0, sink_full, False), (sink_full, sink_end, True), (band_start, full_start, True),
            (full_start, q_first, False), (q_first, band_end, True)]


def _visits(n, block_m, block_n, window_size, sink_size, *, bounds=None, mask_mistake=None, guard=True):
    """``(count, nan_rows)``: how often the kernel's loops fold key j into row i, and NaN rows.

    ``bounds`` names a mistake in the tile bounds, ``mask_mistake`` one in the
    mask of the partial tiles; ``guard=False`` re-enacts a kernel without the
    -inf guard: a row meeting a masked tile in which it sees nothing, before
    it has seen any key, turns NaN.
    """
    mask = _variant_mask(n, window_size, sink_size, mask_mistake)
    count = np.zeros((n, n))
    nan_rows = np.zeros(n, dtype=bool)
    for q_first in range(0, n, block_m):
        rows = slice(q_first, min(q_first + block_m, n))
        seen = np.zeros(rows.stop - rows.start, dtype=bool)
        for lo, hi, masked in _phases(q_first, block_m, block_n, n, window_size, sink_size, bounds):
            for start in range(lo, hi, block_n):
                cols = slice(start, min(start + block_n, n))
                if cols.start >= cols.stop:
                    continue
                visible = mask[rows, cols] if masked else np.ones((seen.size, cols.stop - cols.start), bool)
                if not guard and masked:
                    nan_rows[rows] |= ~seen & ~visible.any(axis=1)
                count[rows, cols] += visible
                seen |= visible.any(axis=1)
    return count, nan_rows


class _NanRows(Diagnosis):
    """NaN exactly in (some of) the rows an unguarded kernel would turn NaN, for some block sizes."""

    def __init__(self, message, n, window_size, sink_size):
        super().__init__(message)
        self.args = (n, window_size, sink_size)

    def matches(self, actual, atol, rtol):
        nan_rows = ~np.isfinite(actual).reshape(-1, actual.shape[-2], actual.shape[-1]).all(axis=(0, 2))
        if not nan_rows.any():
            return False
        n, window_size, sink_size = self.args
        for block_m, block_n in _BLOCK_PAIRS:
            predicted = _visits(n, block_m, block_n, window_size, sink_size, guard=False)[1]
            if predicted.any() and not (nan_rows & ~predicted).any():
                return True
        return False


# =============================================================================
# check_window_forward (Triton)
# =============================================================================
class _Case:
    def __init__(self, name, B, n_q_heads, n_kv_heads, N, D, window_size, sink_size, dtype, transpose):
        self.name, self.B, self.n_q_heads, self.n_kv_heads = name, B, n_q_heads, n_kv_heads
        self.N, self.D, self.window_size, self.sink_size = N, D, window_size, sink_size
        self.dtype, self.transpose = dtype, transpose


def _forward_cases(rng, device):
    """Small on purpose: in the CPU interpreter every (program, K/V tile) costs milliseconds."""
    cases = [
        _Case("fixed: MHA, N=100, window 5, no sinks (rows with an empty first tile)", 1, 2, 2, 100, 16, 5, 0,
              "float32", False),
        _Case("fixed: MQA 2/1, N=130, window 20, 70 sinks (sinks over several tiles)", 1, 2, 1, 130, 16, 20, 70,
              "float32", False),
        _Case("fixed: GQA 4/2, N=80, window 40, 4 sinks", 1, 4, 2, 80, 16, 40, 4, "float32", True),
        _Case("fixed: one head, N=90, window 1, 3 sinks, fp16", 1, 1, 1, 90, 16, 1, 3, "float16", True),
        _Case("fixed: GQA 2/1, N=50, window 200 (> N), no sinks", 2, 2, 1, 50, 32, 200, 0, "float32", False),
    ]
    n_kv = int(rng.integers(1, 3))
    group = 3 - n_kv
    n = int(rng.integers(40, 131))
    if n % 16 == 0:
        n += 1
    window_size = int(rng.integers(1, n))
    sink_size = int(rng.choice([0, 1, 4, int(rng.integers(1, n))]))
    dtype = "float16" if rng.random() < 0.3 else "float32"
    cases.append(_Case(f"random: {n_kv * group} q heads / {n_kv} kv heads, N={n}, window {window_size}, "
                       f"{sink_size} sinks, {dtype}", 1, n_kv * group, n_kv, n, 16, window_size, sink_size, dtype,
                       bool(rng.random() < 0.5)))
    if device == "cuda" and current().bf16_ok:
        cases.append(_Case("fixed: GQA 4/2, N=300, window 64, 4 sinks, bf16", 1, 4, 2, 300, 64, 64, 4,
                           "bfloat16", False))
    return cases


def _inputs(run, c: _Case, device):
    import torch

    dtype = getattr(torch, c.dtype)
    raw = [run.rng.standard_normal((c.B, h, c.N, c.D)) for h in (c.n_q_heads, c.n_kv_heads, c.n_kv_heads)]
    # Use the values rounded to the test dtype in the references: only the kernel's arithmetic is graded.
    q64, k64, v64 = (torch.from_numpy(a).to(dtype).double().numpy() for a in raw)
    q, k, v = (inputs.nan_padded(torch.from_numpy(a).to(dtype).to(device), transpose_heads=c.transpose and i == 1)
               for i, a in enumerate((q64, k64, v64)))
    return (q64, k64, v64), (q, k, v)


def _forward_diagnoses(c: _Case, q64, k64, v64):
    k_rep, v_rep = ref.repeat_kv_heads(q64, k64, v64)
    s = (q64 @ np.swapaxes(k_rep, -1, -2)) / math.sqrt(c.D)
    n, w, sinks = c.N, c.window_size, c.sink_size

    def loops(bounds=None, mask_mistake=None):
        def predict(blocks):
            block_m, block_n = blocks
            count = _visits(n, block_m, block_n, w, sinks, bounds=bounds, mask_mistake=mask_mistake)[0]
            return weighted(s, v_rep, count)[0]
        return predict

    def loop_model(message, predict):  # a loop mistake, re-enacted for each block size pair
        return Model(message, predict, _BLOCK_PAIRS)

    diagnoses = [_NanRows(MSG_NAN_EMPTY_TILE, n, w, sinks)]
    if w < n:
        diagnoses += [loop_model(MSG_WINDOW_OFF_BY_ONE, loops(mask_mistake="window_plus_one"))]
        if w > 1:
            diagnoses += [loop_model(MSG_WINDOW_OFF_BY_ONE, loops(mask_mistake="window_minus_one"))]
    if sinks:
        diagnoses += [loop_model(MSG_SINKS_FUTURE, loops(mask_mistake="sinks_future")),
                      loop_model(MSG_SINKS_SKIPPED, loops("sinks_skipped")),
                      loop_model(MSG_SINK_ROUNDED_DOWN, loops("sink_rounded_down")),
                      loop_model(MSG_SINKS_TWICE, loops("sinks_twice"))]
    diagnoses += [loop_model(MSG_NOT_ALIGNED, loops("unaligned"))]
    return diagnoses


def grade_window_forward(fn, *, seed=None):
    """Grade ``fn(q, k, v, *, window_size, sink_size) -> (o, lse)``: causal GQA with a window and sinks.

    ``q [B, Hq, N, D]``, ``k``/``v [B, Hkv, N, D]``; ``o`` like ``q``, ``lse``
    float32 ``[B, Hq, N]`` (natural log). Inputs are NaN-padded views with
    unusual strides, N is never a multiple of 16; windows of 1 and longer
    than N, sinks inside one tile, over several tiles, none; fp32 and fp16
    on the CPU (bf16 too on a GPU that has it); fresh random cases per call.
    ``o`` and ``lse`` must be written by your own Triton kernel during the call
    (not by torch, the references or course_utils's kernels), and q, k, v must
    be left as they were.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_window_forward")
    env = current()
    run = Run("check_window_forward", seed, time_limit_s=30.0)
    for c in _forward_cases(run.rng, env.device):
        (q64, k64, v64), (q, k, v) = _inputs(run, c, env.device)
        before = inputs.snapshot(q=q, k=k, v=v)
        with proof.Work(inputs=(q, k, v)) as work:
            out = run.call(fn, q, k, v, window_size=c.window_size, sink_size=c.sink_size, case=c.name)
        if not isinstance(out, tuple) or len(out) != 2:
            raise run.fail(f"your function returned a {type(out).__name__}; return a pair (o, lse).", c.name)
        if not work.launches:
            raise run.fail(MSG_NO_TRITON_WINDOW, c.name)
        # o and lse must come from the learner's kernel: not torch (SDPA, softmax, @), not the
        # course's kernels, not the references (refused while the function runs).
        problem = work.problem(no_kernel=MSG_NO_TRITON_WINDOW, o=out[0], lse=out[1])
        if problem:
            raise run.fail(problem, c.name)
        changed = inputs.changed_input(before, q=q, k=k, v=v)
        if changed:
            raise run.fail(changed, c.name)
        o = inputs.tensor_out(run, out[0], "o", q.shape, c.name)
        lse = inputs.tensor_out(run, out[1], "lse", q.shape[:3], c.name)
        want_o, want_lse = ref.attention_lse(q64, k64, v64, causal=True, window_size=c.window_size,
                                             sink_size=c.sink_size)
        atol, rtol, lse_atol = _FWD_TOL[(env.device, c.dtype)]
        run.compare(o, want_o, case=c.name, what="the output o", atol=atol, rtol=rtol,
                    axes=("b", "q_head", "i", "d"), diagnoses=_forward_diagnoses(c, q64, k64, v64))
        run.compare(lse, want_lse, case=c.name, what="lse", atol=lse_atol, rtol=0.0, axes=("b", "q_head", "i"))
    return run.passed()


# =============================================================================
# check_window_backward (Triton, through torch.autograd)
# =============================================================================
def _grads_with(q64, k64, v64, do64, weights, window_size, sink_size):
    """dq, dk, dv of the right forward when the backward folds pair (i, j) in ``weights[i, j]`` times."""
    k_rep, v_rep = ref.repeat_kv_heads(q64, k64, v64)
    group = q64.shape[1] // k64.shape[1]
    scale = 1.0 / math.sqrt(q64.shape[-1])
    s = scale * (q64 @ np.swapaxes(k_rep, -1, -2))
    n = s.shape[-1]
    right = np.broadcast_to(ref.window_mask(n, n, window_size, sink_size), s.shape)
    lse = weighted(s, v_rep, right.astype(float))[1]
    p_right = np.where(right, np.exp(s - lse[..., None]), 0.0)
    o = p_right @ v_rep
    p = np.where(weights > 0, weights * np.exp(np.minimum(s - lse[..., None], 50.0)), 0.0)
    dv = np.swapaxes(p, -1, -2) @ do64
    ds = p * (do64 @ np.swapaxes(v_rep, -1, -2) - np.sum(do64 * o, axis=-1, keepdims=True))
    dq = scale * ds @ k_rep
    dk = scale * np.swapaxes(ds, -1, -2) @ q64
    return dq, ref.sum_kv_groups(dk, group), ref.sum_kv_groups(dv, group)


def _dkdv_coverage(n, block_m, block_n, window_size, sink_size):
    """Which (i, j) a dK/dV loop that ignores the sinks (q_end at the window's edge) still folds in."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    q_end = np.minimum(j // block_n * block_n + block_n + window_size - 1, n)
    q_end = -(-q_end // block_m) * block_m  # the loop runs whole query blocks
    return ref.window_mask(n, n, window_size, sink_size) & (i < q_end)


def _dkdv_short_coverage(n, block_m, block_n, window_size, sink_size, mistake, sinks_too):
    """Which (i, j) a dK/dV kernel folds in when its far-edge loop stops one query block short.

    The right kernel visits, for the key block at ``start_n``, the diagonal ``[start_n,
    diag_end)``, the full blocks ``[diag_end, full_end)`` and the far edge ``range(full_end,
    q_end, block_m)``. The mistaken ``q_end`` is ``q_end - block_m`` (``mistake="minus"``) or
    ``q_end`` rounded down to a multiple of ``block_m`` (``"floor"``), for the sink key blocks
    too (``sinks_too``) or only for the others (the sinks' ``q_end = N`` set after it).
    """
    window_size, sink_size = min(window_size, n), min(sink_size, n)
    i = np.arange(n)[:, None]
    start_n = np.arange(n) // block_n * block_n
    diag_end = np.minimum(start_n + block_n, n)
    full_end = np.minimum(np.maximum((start_n + window_size) // block_m * block_m, diag_end), n)
    q_end = np.minimum(start_n + block_n + window_size - 1, n)
    sink_block = start_n < sink_size
    if sink_size:
        full_end = np.where(start_n + block_n <= sink_size, n, full_end)
        if not sinks_too:
            q_end = np.where(sink_block, n, q_end)
    short = q_end - block_m if mistake == "minus" else q_end // block_m * block_m
    if sink_size and not sinks_too:
        short = np.where(sink_block, n, short)
    # range(full_end, short, block_m) visits whole blocks: rows up to the end of the last one.
    steps = np.maximum(-(-(short - full_end) // block_m), 0)
    reach = np.where(short > full_end, full_end + steps * block_m, full_end)
    return ref.window_mask(n, n, window_size, sink_size) & (i < reach[None, :])


class _GradModel(Diagnosis):
    """A backward mistake, re-enacted in float64 (for each block size pair when ``per_block``)."""

    def __init__(self, message, predict, which, per_block=False):
        super().__init__(message)
        self.predict, self.which, self.per_block = predict, which, per_block

    def matches(self, actual, atol, rtol):
        for blocks in (_DKDV_PAIRS if self.per_block else [None]):
            wrong = self.predict(blocks)[self.which]
            if np.allclose(actual, wrong, atol=atol * SLACK, rtol=rtol * SLACK):
                self.matched_distance = distance_to(actual, wrong, atol, rtol)
                return True
        return False


def _backward_diagnoses(c, q64, k64, v64, do64, which):
    n, w, sinks = c.N, c.window_size, c.sink_size
    cache = {}

    def with_mask(mistake):
        def predict(_):
            if mistake not in cache:
                weights = _variant_mask(n, w, sinks, mistake).astype(float)
                cache[mistake] = _grads_with(q64, k64, v64, do64, weights, w, sinks)
            return cache[mistake]
        return predict

    def sinks_cut(blocks):
        key = ("cut",) + blocks
        if key not in cache:
            cover = _dkdv_coverage(n, *blocks, w, sinks).astype(float)
            cache[key] = _grads_with(q64, k64, v64, do64, cover, w, sinks)
        return cache[key]

    def one_block_short(mistake, sinks_too):
        def predict(blocks):
            key = ("short", mistake, sinks_too) + blocks
            if key not in cache:
                cover = _dkdv_short_coverage(n, *blocks, w, sinks, mistake, sinks_too).astype(float)
                cache[key] = _grads_with(q64, k64, v64, do64, cover, w, sinks)
            return cache[key]
        return predict

    diagnoses = []
    if sinks and which > 0:
        diagnoses.append(_GradModel(MSG_BWD_SINKS, with_mask("no_sinks"), which))
        diagnoses.append(_GradModel(MSG_BWD_SINKS, sinks_cut, which, per_block=True))
    if which > 0 and w < n:
        for mistake in ("minus", "floor"):
            for sinks_too in ((False, True) if sinks else (False,)):
                diagnoses.append(_GradModel(MSG_BWD_LAST_Q_BLOCK, one_block_short(mistake, sinks_too), which,
                                            per_block=True))
    if w < n:
        diagnoses.append(_GradModel(MSG_WINDOW_OFF_BY_ONE, with_mask("window_plus_one"), which))
        if w > 1:
            diagnoses.append(_GradModel(MSG_WINDOW_OFF_BY_ONE, with_mask("window_minus_one"), which))
    if sinks:
        diagnoses.append(_GradModel(MSG_SINKS_FUTURE, with_mask("sinks_future"), which))
    return diagnoses


def _dkdv_not_yours(work, **grads):
    """A sentence if the backward ran a course kernel the lesson does not give, or one wrote dK or dV."""
    for launch in work.launches:
        if launch.course and launch.name not in _COURSE_BACKWARD_KERNELS_OK:
            return MSG_DKDV_NOT_YOURS.format(
                what=f"your backward ran course_utils's kernel `{launch.name}` (through course_utils.kernels)")
    for name, t in grads.items():
        if t is None:
            continue
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        kind, kernel = work.writer.get(key, (None, ""))
        if kind == "course":
            return MSG_DKDV_NOT_YOURS.format(what=f"{name} was written by course_utils's kernel `{kernel}`")
    return None


def _backward_cases(rng, device):
    cases = [
        _Case("fixed: GQA 2/1, N=70, window 20, 3 sinks", 1, 2, 1, 70, 16, 20, 3, "float32", True),
        _Case("fixed: one head, N=100, window 9, 40 sinks (sinks over two tiles)", 1, 1, 1, 100, 16, 9, 40,
              "float32", False),
        _Case("fixed: one head, N=50, window 1, no sinks, fp16", 1, 1, 1, 50, 16, 1, 0, "float16", True),
        # Several key blocks AND several query blocks per key block's range for every block size up
        # to 128 (N > 2 * 128, window < N - 128): a dK/dV loop that stops one query block short of
        # the window's far edge shows here.
        _Case("fixed: one head, N=300, window 100, no sinks (several key and query blocks)", 1, 1, 1, 300, 16,
              100, 0, "float32", False),
    ]
    n = int(rng.integers(40, 90))
    if n % 16 == 0:
        n += 1
    w = int(rng.integers(1, n))
    s = int(rng.choice([0, 2, int(rng.integers(1, n))]))
    cases.append(_Case(f"random: GQA 2/1, N={n}, window {w}, {s} sinks", 1, 2, 1, n, 16, w, s,
                       "float32", bool(rng.random() < 0.5)))
    if device == "cuda" and current().bf16_ok:
        cases.append(_Case("fixed: GQA 4/2, N=300, window 64, 4 sinks, bf16", 1, 4, 2, 300, 64, 64, 4,
                           "bfloat16", False))
    return cases


def grade_window_backward(fn, *, seed=None):
    """Grade ``fn(q, k, v, *, window_size, sink_size) -> o``, differentiable, Triton in both passes.

    For each case the check calls ``fn``, then ``torch.autograd.grad(o, (q,
    k, v), do)``, and compares ``o``, ``dv``, ``dk``, ``dq`` with float64
    references (:func:`course_utils.references.attention_backward` with the
    window and sinks). NaN-padded strided inputs, GQA and MQA, sinks over
    several tiles, a sequence of several key and query blocks for any block
    size up to 128, fresh random cases per call. ``o`` must come from a Triton
    kernel (yours or course_utils's forward); the backward may use the course's
    delta and dQ kernels, but dK and dV must be written by your own dK/dV
    kernel, no torch math (autograd of a torch forward) may compute them, and
    q, k, v, do must be left as they were.
    """
    __tracebackhide__ = True
    import torch

    require_callable(fn, "check_window_backward")
    env = current()
    run = Run("check_window_backward", seed, time_limit_s=60.0)
    for c in _backward_cases(run.rng, env.device):
        dtype = getattr(torch, c.dtype)
        atol, rtol = _BWD_TOL_GPU_FP32 if (c.dtype == "float32" and env.device == "cuda") else _BWD_TOL[c.dtype]
        raw = [run.rng.standard_normal((c.B, h, c.N, c.D)) for h in (c.n_q_heads, c.n_kv_heads, c.n_kv_heads,
                                                                      c.n_q_heads)]
        q64, k64, v64, do64 = (torch.from_numpy(a).to(dtype).double().numpy() for a in raw)
        q, k, v = (inputs.nan_padded_leaf(torch.from_numpy(a).to(dtype).to(env.device), c.transpose and i == 1)
                   for i, a in enumerate((q64, k64, v64)))
        do = inputs.nan_padded(torch.from_numpy(do64).to(dtype).to(env.device), transpose_heads=True)
        before = inputs.snapshot(q=q, k=k, v=v, do=do)
        # The forward may be the course's (check_window_forward grades the learner's): it must be a kernel.
        with proof.Work(inputs=(q, k, v, do), course_kernels_ok=True) as forward_work:
            o = run.call(fn, q, k, v, window_size=c.window_size, sink_size=c.sink_size, case=c.name)
        if not isinstance(o, torch.Tensor):
            raise run.fail(f"your function returned a {type(o).__name__}; return the output tensor o.", c.name)
        if not forward_work.launches:
            raise run.fail(MSG_NO_TRITON_WINDOW, c.name)
        problem = forward_work.problem(no_kernel=MSG_NO_TRITON_WINDOW, o=o)
        if problem:
            raise run.fail(problem, c.name)
        o_right = ref.attention(q64, k64, v64, causal=True, window_size=c.window_size, sink_size=c.sink_size)
        got_o = run.array(o, expected_shape=o_right.shape, case=c.name, name="o")
        run.compare(got_o, o_right, case=c.name, what="the forward output o", atol=atol, rtol=rtol,
                    axes=("b", "q_head", "i", "d"))
        if o.grad_fn is None:
            raise run.fail(MSG_NOT_DIFFERENTIABLE_WINDOW, c.name)
        # The backward may launch the course's delta and dQ kernels (lesson 08 gives them); dK and dV
        # must come from the learner's own dK/dV kernel.
        with proof.Work(inputs=(q, k, v, do, o), course_kernels_ok=True) as backward_work:
            grads = run.call(torch.autograd.grad, o, (q, k, v), do, allow_unused=True, case=c.name + " (backward)")
        run.cases -= 1  # the forward and the backward of one case count once
        if not backward_work.launches:
            raise run.fail(MSG_NO_TRITON_BACKWARD_WINDOW, c.name)
        problem = backward_work.problem(no_kernel=MSG_NO_TRITON_BACKWARD_WINDOW,
                                        **{label: g for label, g in zip(("dq", "dk", "dv"), grads) if g is not None})
        if problem:
            raise run.fail(problem + " (in the backward pass: the gradients must come from your backward "
                           "kernels, not from torch)", c.name)
        problem = _dkdv_not_yours(backward_work, dk=grads[1], dv=grads[2])
        if problem:
            raise run.fail(problem, c.name)
        changed = inputs.changed_input(before, q=q, k=k, v=v, do=do)
        if changed:
            raise run.fail(changed, c.name)
        right = ref.attention_backward(q64, k64, v64, do64, causal=True, window_size=c.window_size,
                                       sink_size=c.sink_size)
        for which, label, shape in ((2, "dv", v.shape), (1, "dk", k.shape), (0, "dq", q.shape)):
            if grads[which] is None:
                raise run.fail(f"{label} is None: your backward must return a gradient for {label[1:]}.", c.name)
            got = run.array(grads[which], expected_shape=tuple(shape), case=c.name, name=label)
            run.compare(got, right[which], case=c.name, what=label, atol=atol, rtol=rtol,
                        axes=("b", "kv_head" if which else "q_head", "i" if which == 0 else "j", "d"),
                        diagnoses=_backward_diagnoses(c, q64, k64, v64, do64, which))
    return run.passed()


# =============================================================================
# check_sink_split (optional): the sink keys' far queries in programs of their own
# =============================================================================
MSG_SPLIT_ONE_PROGRAM = (
    "all the sink keys' far queries went into one partial: the point of the split is to spread those "
    "rows over several programs (program c takes the c-th chunk of query rows), each writing a partial "
    "of its own. Use num_chunks chunks (fewer only when the far rows do not fill them)."
)
MSG_SPLIT_EMPTY_CHUNK = (
    "a partial is all zeros: every chunk of far rows holds some pairs, so each program must write its "
    "OWN slot of the partial buffers (index the slot by the program's chunk, pid_c). Programs adding into "
    "one shared slot (tl.atomic_add) would also add in an order that changes from run to run on a GPU."
)
MSG_SPLIT_EVERY_CHUNK = (
    "each partial holds ALL the far rows, so the sum counts them once per chunk: program c must take only "
    "its own chunk of query rows, [chunk_lo, chunk_lo + CHUNK), not run to N from the first far row."
)
MSG_SPLIT_NEAR_PAIRS = (
    "the partials also hold the sink keys' pairs INSIDE the window: keep only i - j >= window_size in the "
    "sink kernel. The window kernel, run with sink_size=0, already has every pair with i - j < window_size, "
    "so these are counted twice."
)
MSG_SPLIT_NOT_ADDED = (
    "the sink keys' dK/dV lack their far queries: the partials were not added to dk and dv. After the "
    "sink kernel, add dk_part.sum(0) and dv_part.sum(0) (chunk 0 first, always the same order) to the "
    "first sink_size rows of dk and dv."
)
MSG_SPLIT_TWICE = (
    "the sink keys' far queries are counted twice: the window dK/dV kernel still ran WITH the sinks (its "
    "sink block walked every later query) and the partials were added on top. Run it with sink_size=0 "
    "(HAS_SINKS=False) when you split."
)
MSG_SPLIT_NOT_REPRODUCIBLE = (
    "two runs on the same inputs gave different bits: the partials were added in an order that changes "
    "from run to run (atomics, or an order that depends on something other than the chunk index). Add them "
    "in a fixed order, e.g. dk_part.sum(0) or a loop over c = 0, 1, ..., so every run gives the same bits."
)
MSG_NO_TRITON_SPLIT = (
    "no Triton kernel of yours ran: the split backward must launch your window dK/dV kernel and your "
    "sink kernel (the course's delta and dQ kernels may compute the rest)."
)


def _split_cases(rng):
    """Small on purpose (two backward runs per case in the interpreter); far rows over several chunks."""
    cases = [(_Case("fixed: GQA 2/1, N=170, window 20, 40 sinks, 3 chunks", 1, 2, 1, 170, 16, 20, 40, "float32", True),
              3)]
    n = int(rng.integers(140, 200))
    w = int(rng.integers(1, n - 130))
    s = int(rng.choice([4, int(rng.integers(1, 70))]))
    chunks = int(rng.integers(2, 5))
    cases.append((_Case(f"random: one head, N={n}, window {w}, {s} sinks, {chunks} chunks", 1, 1, 1, n, 16, w, s,
                        "float32", False), chunks))
    return cases


def _sink_block(sink_size):
    """The sink kernel's key block (lesson 08's launcher, as the package's): 16 to 64 keys."""
    return min(64, max(16, 1 << max(sink_size - 1, 0).bit_length()))


def _split_inputs(run, c, device):
    import torch

    dtype = getattr(torch, c.dtype)
    raw = [run.rng.standard_normal((c.B, h, c.N, c.D)) for h in (c.n_q_heads, c.n_kv_heads, c.n_kv_heads,
                                                                  c.n_q_heads)]
    q64, k64, v64, do64 = (torch.from_numpy(a).to(dtype).double().numpy() for a in raw)
    o64, lse64 = ref.attention_lse(q64, k64, v64, causal=True, window_size=c.window_size, sink_size=c.sink_size)

    def make():
        q, k, v = (inputs.nan_padded(torch.from_numpy(a).to(dtype).to(device), transpose_heads=c.transpose and i == 1)
                   for i, a in enumerate((q64, k64, v64)))
        o = inputs.nan_padded(torch.from_numpy(o64).to(dtype).to(device))
        do = inputs.nan_padded(torch.from_numpy(do64).to(dtype).to(device), transpose_heads=True)
        lse = torch.from_numpy(lse64).to(torch.float32).to(device)
        return q, k, v, o, lse, do

    return (q64, k64, v64, do64), make


def _split_call(run, fn, tensors, c, chunks):
    """Call the learner once under proof of work: ``(dq, dk, dv, dk_part, dv_part)`` as checked tensors."""
    import torch

    q, k, v, o, lse, do = tensors
    before = inputs.snapshot(q=q, k=k, v=v, o=o, lse=lse, do=do)
    with proof.Work(inputs=tensors, course_kernels_ok=True) as work:
        out = run.call(fn, q, k, v, o, lse, do, window_size=c.window_size, sink_size=c.sink_size,
                       num_chunks=chunks, case=c.name)
    if not isinstance(out, tuple) or len(out) != 5 or not all(isinstance(t, torch.Tensor) for t in out):
        raise run.fail("return five tensors: (dq, dk, dv, dk_part, dv_part).", c.name)
    names = ("dq", "dk", "dv", "dk_part", "dv_part")
    if not work.launches:
        raise run.fail(MSG_NO_TRITON_SPLIT, c.name)
    problem = work.problem(no_kernel=MSG_NO_TRITON_SPLIT, **dict(zip(names[1:], out[1:])))
    if problem:
        raise run.fail(problem, c.name)
    problem = _dkdv_not_yours(work, dk=out[1], dv=out[2], dk_part=out[3], dv_part=out[4])
    if problem:
        raise run.fail(problem.replace("the dK/dV kernel is this exercise (your _attn_bwd_dkdv_window)",
                                       "the dK/dV kernels are this exercise (your _attn_bwd_dkdv_window and "
                                       "_attn_bwd_dkdv_sinks)"), c.name)
    changed = inputs.changed_input(before, q=q, k=k, v=v, o=o, lse=lse, do=do)
    if changed:
        raise run.fail(changed, c.name)
    return out


def grade_sink_split(fn, *, seed=None):
    """Grade ``fn(q, k, v, o, lse, do, *, window_size, sink_size, num_chunks) -> (dq, dk, dv, dk_part, dv_part)``.

    The window backward with the sinks split off (lesson 08, optional): the window dK/dV
    kernel runs without sinks, and a kernel of the learner's gives the sink keys' far
    queries (``i - j >= window_size``) programs of their own, one chunk of query rows each,
    each writing an fp32 partial ``dk_part[c], dv_part[c]`` (``[chunks, B, n_kv_heads,
    sink_size, D]``, ``chunks <= num_chunks``), added to dk and dv in a fixed order. The
    check wants: several non-zero partials where the far rows fill several chunks, their
    sum equal to the float64 far gradients of the sink keys, dq, dk, dv equal to
    :func:`course_utils.references.attention_backward`, the same bits from a second run on
    the same inputs, and dk, dv and the partials written by the learner's kernels (the
    course's delta and dQ kernels are allowed, its dK/dV kernels are not).
    """
    __tracebackhide__ = True
    require_callable(fn, "check_sink_split")
    env = current()
    run = Run("check_sink_split", seed, time_limit_s=90.0)
    for c, chunks in _split_cases(run.rng):
        atol, rtol = _BWD_TOL_GPU_FP32 if env.device == "cuda" else _BWD_TOL[c.dtype]
        (q64, k64, v64, do64), make = _split_inputs(run, c, env.device)
        n, w, s = c.N, c.window_size, c.sink_size
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        mask = ref.window_mask(n, n, w, s)
        far = mask & (i - j >= w) & (j < s)
        sink_pairs = (j <= i) & (j < s)

        def grads(weights):
            return _grads_with(q64, k64, v64, do64, weights.astype(float), w, s)

        first = _split_call(run, fn, make(), c, chunks)
        dq, dk, dv, dk_part, dv_part = first
        shape = (c.B, c.n_kv_heads, s, c.D)
        for name, part in (("dk_part", dk_part), ("dv_part", dv_part)):
            if part.dim() != 5 or tuple(part.shape[1:]) != shape or not 1 <= part.shape[0] <= chunks:
                raise run.fail(f"{name} has shape {tuple(part.shape)}; expected [chunks, {', '.join(map(str, shape))}] "
                               f"with 1 <= chunks <= num_chunks = {chunks}.", c.name)
        parts = {name: run.array(p, expected_shape=tuple(p.shape), case=c.name, name=name)
                 for name, p in (("dk_part", dk_part), ("dv_part", dv_part))}
        if chunks >= 2 and n - w > 128 and parts["dv_part"].shape[0] < 2:
            raise run.fail(f"your partials hold 1 chunk, although num_chunks = {chunks} and the {n - w} far rows "
                           f"fill several query blocks.\nLikely cause: {MSG_SPLIT_ONE_PROGRAM}", c.name)
        for name, p in parts.items():
            empty = [int(ci) for ci in range(p.shape[0]) if not np.any(p[ci])]
            if empty:
                raise run.fail(f"{name}[{empty[0]}] is all zeros.\nLikely cause: {MSG_SPLIT_EMPTY_CHUNK}", c.name)
        right_far = grads(far)
        for which, name in ((2, "dv_part"), (1, "dk_part")):
            p = parts[name]
            # A far mask without i - j >= W adds the window pairs of the rows the sink kernel visits:
            # from the key block's first far row, rounded down to the kernel's BLOCK_M (tried: 16..128).
            near = [Diagnosis(MSG_SPLIT_NEAR_PAIRS, expected=lambda bm=bm, x=which: grads(
                far | (sink_pairs & (i >= np.maximum(w // bm * bm, (j // _sink_block(s) * _sink_block(s) + w)
                                                     // bm * bm))))[x][:, :, :s]) for bm in (16, 32, 64, 128)]
            run.compare(p.sum(0), right_far[which][:, :, :s], case=c.name,
                        what=f"{name}.sum(0) (the sink keys' far gradients)", atol=atol, rtol=rtol,
                        axes=("b", "kv_head", "j", "d"), diagnoses=[
                            Diagnosis(MSG_SPLIT_EVERY_CHUNK, expected=p.shape[0] * right_far[which][:, :, :s])] + near)
        right = ref.attention_backward(q64, k64, v64, do64, causal=True, window_size=w, sink_size=s)
        wrong = {"not_added": lambda: grads(ref.window_mask(n, n, w, 0)), "twice": lambda: grads(mask.astype(float) + far)}
        for which, label, t in ((2, "dv", dv), (1, "dk", dk), (0, "dq", dq)):
            got = run.array(t, expected_shape=right[which].shape, case=c.name, name=label)
            run.compare(got, right[which], case=c.name, what=label, atol=atol, rtol=rtol,
                        axes=("b", "kv_head" if which else "q_head", "i" if which == 0 else "j", "d"),
                        diagnoses=[] if which == 0 else [
                            Diagnosis(MSG_SPLIT_NOT_ADDED, expected=lambda x=which: wrong["not_added"]()[x]),
                            Diagnosis(MSG_SPLIT_TWICE, expected=lambda x=which: wrong["twice"]()[x])])
        second = _split_call(run, fn, make(), c, chunks)
        run.cases -= 1  # the second run of a case is part of it
        for label, a, b in zip(("dk", "dv", "dk_part", "dv_part"), first[1:], second[1:]):
            if a.shape != b.shape or not bool((a.detach().cpu() == b.detach().cpu()).all()):
                raise run.fail(f"{label} differs between two runs on the same inputs.\nLikely cause: "
                               f"{MSG_SPLIT_NOT_REPRODUCIBLE}", c.name)
    return run.passed()
