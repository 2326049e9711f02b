"""Checks for part 1: attention and the online softmax in NumPy.

Each check grades the learner's function on fixed cases (small, readable,
chosen to expose one mistake each) and then on fresh random cases (a new seed
every call): shapes that are not multiples of the block sizes, batch axes,
``Nq != Nk``, causal and not, block sizes from 1 to 64, and scores around
1000, where a softmax without the max subtracted overflows.

A wrong answer is explained by the first :class:`Diagnosis` it matches. Each
diagnosis is recognised by running the *mistaken* algorithm (a few small
functions below, prefixed ``_wrong``/``_variant``) on the same inputs and
comparing, or, for overflow, by a predicate on the answer. Small cases come
before large ones, so "NaN on large inputs" is only reported for code that
already passed on small inputs.

Inputs are float64; the learner gets copies, so code that modifies its
arguments in place cannot disturb the references.
"""

from __future__ import annotations

import math

import numpy as np

from .. import references as ref
from . import inputs, proof
from .core import Diagnosis, Run, require_callable
from .inputs import Watched as _Watched  # noqa: F401  (the tests check that results stay watched)
from .mistakes import MSG_NOT_TILED
from .mistakes import MSG_ACC_NOT_RESCALED_NUMPY
from .mistakes import MSG_L_NOT_RESCALED_NUMPY
from .mistakes import MSG_LSE_BASE2_NUMPY
from .mistakes import MSG_LSE_MIXED_NUMPY
from .mistakes import MSG_LSE_NO_MAX_NUMPY
from .mistakes import MSG_M_INIT_ZERO_NUMPY
from .mistakes import MSG_NO_CAUSAL_NUMPY
from .mistakes import MSG_NO_SCALE_NUMPY

__all__ = ["grade_softmax", "grade_naive_attention", "grade_online_softmax", "grade_tiled_attention"]

# The learner works in float64 like the references; these leave room for a
# learner who computes in float32 on small inputs, and are far below the size
# of any of the mistakes diagnosed here.
ATOL = 1e-6
RTOL = 1e-5

# One plain sentence per diagnosis; the tests look for these texts (those that other
# exercises share or word their own way are in .mistakes, imported above).
MSG_OVERFLOW = (
    "np.exp overflowed on large inputs (exp(1000) is inf, and inf/inf or 0/0 is NaN). "
    "Subtract each row's maximum before exponentiating: softmax(x) == softmax(x - max(x)), "
    "and then the largest exponent is exp(0) = 1."
)
MSG_GLOBAL_MAX = (
    "you subtracted the maximum of the whole array, not of each row: a row far below the "
    "global maximum underflows to 0/0. Take the max along `axis` with keepdims=True."
)
MSG_WHOLE_SUM = (
    "you divided by the sum of the whole array; divide by the sum along `axis` only "
    "(np.sum(e, axis=axis, keepdims=True))."
)
MSG_NO_KEEPDIMS = (
    "the row sums were divided without keepdims=True, so they broadcast along the wrong "
    "axis (row i's values were divided by row j's sum). Use keepdims=True."
)
MSG_WRONG_AXIS = "the softmax was taken along the wrong axis"
MSG_SCALE_D = "the scores were scaled by 1/d; the scale is 1/sqrt(d)."
MSG_SOFTMAX_QUERIES = (
    "the softmax was taken over the queries (axis -2); each query's weights must sum to 1 "
    "over the keys, so normalise along the last axis."
)
MSG_MASK_TRANSPOSED = (
    "the causal mask is transposed: query i saw keys j >= i. Keep the keys j <= i "
    "(np.tril, or k_index <= q_index)."
)
MSG_MASK_STRICT = (
    "the causal mask also hides the diagonal: query i saw only keys j < i (so query 0 sees nothing "
    "and comes out NaN). Keep the keys j <= i (k_index <= q_index, not <)."
)
MSG_MASK_SHIFTED = (
    "the causal mask is off by one: query i also saw key i + 1. Keep the keys j <= i."
)
MSG_MASK_TILE_LOCAL = (
    "the causal mask was built from indices inside the tile (0 .. block_m-1 and 0 .. block_n-1) "
    "instead of positions in the sequence: compare q_start + row with k_start + col "
    "(np.arange(q_start, q_end)[:, None] >= np.arange(k_start, k_end)[None, :])."
)
MSG_MASK_BOTTOM_RIGHT = (
    "the causal mask is aligned bottom-right (query i sees j <= i + Nk - Nq, FlashAttention's "
    "convention); this course aligns it top-left: query i sees keys j <= i."
)
MSG_MASK_AFTER_SOFTMAX = (
    "the mask was applied after the softmax: zeroing weights afterwards leaves rows that no "
    "longer sum to 1. Set the masked scores to -inf before the softmax."
)
MSG_NO_RESCALE = (
    "the running sum is not rescaled when the maximum changes: before adding a block's terms, "
    "multiply the old l by exp(m_old - m_new)."
)
MSG_RESCALE_BACKWARDS = (
    "the running sum is rescaled by exp(m_new - m_old); the factor is exp(m_old - m_new) "
    "(at most 1: the old terms shrink when the max grows)."
)
MSG_NOT_STREAMING = (
    "your values are right, but your function reduced a whole row at once (a max or a sum over "
    "all N entries of the last axis), so it is not an online softmax. Read the row one block at a "
    "time (x[..., start:start + block_size]), keep a running max m and a running sum l, rescale l "
    "by exp(m_old - m_new) when the max grows, and only at the end write exp(x - m) / l."
)
MSG_TAIL_DROPPED = (
    "the last, partial block was dropped: when N is not a multiple of the block size, loop "
    "with range(0, N, block) and slice x[start:start + block] (NumPy clips the end)."
)
MSG_BOTH_NOT_RESCALED = (
    "neither acc nor l_i is rescaled when the maximum changes: multiply both by "
    "alpha = exp(m_old - m_new) before adding the new tile."
)
MSG_KV_TAIL_DROPPED = (
    "the last, partial block of keys/values was dropped: loop over key blocks with "
    "range(0, Nk, block_n) and slice k[start:start + block_n]."
)
MSG_Q_TAIL_DROPPED = (
    "the last, partial block of queries was dropped (those output rows were never written): "
    "loop over query blocks with range(0, Nq, block_m)."
)


# -----------------------------------------------------------------------------
# What the mistaken code would output
# -----------------------------------------------------------------------------
def _like(compute):
    """A Diagnosis predicate: the answer matches what the mistaken code outputs.

    ``compute()`` runs the mistaken algorithm on the case's inputs. Mistaken
    code often produces NaN somewhere (a fully masked tile, a 0/0), so the
    answer matches when it is non-finite in exactly the same places and close
    elsewhere. A mistake that cannot be formed for this case (e.g. a broadcast
    that only works on square arrays) or that is non-finite everywhere (which
    would say nothing) matches nothing.
    """

    def when(actual):
        with np.errstate(all="ignore"):
            try:
                wrong = compute()
            except (ValueError, IndexError, ZeroDivisionError):
                return False
        if wrong is None:
            return False
        wrong = np.asarray(wrong, dtype=np.float64)
        if wrong.shape != actual.shape:
            return False
        bad = ~np.isfinite(wrong)
        if bad.all() or not np.array_equal(bad, ~np.isfinite(actual)):
            return False
        return bool(np.allclose(actual[~bad], wrong[~bad], atol=ATOL, rtol=RTOL))

    return when


def _not_finite(a) -> bool:
    return not np.all(np.isfinite(a))


def _wrong_softmax_whole(x):
    e = np.exp(x - np.max(x))  # also what np.exp(x) / np.exp(x).sum() gives
    return e / e.sum()


def _wrong_softmax_whole_rowmax(x, axis):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / e.sum()


def _wrong_softmax_no_keepdims(x, axis):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis)  # raises unless the shapes happen to broadcast


def _global_max_nan_rows(x, axis):
    """Predicate: non-finite exactly where a row sits far below the global max."""
    far_below = np.max(x, axis=axis, keepdims=True) < np.max(x) - 700.0

    def when(actual):
        bad = ~np.isfinite(actual)
        return bool(far_below.any() and bad.any() and np.array_equal(bad, np.broadcast_to(far_below, x.shape)))

    return when


def _mask(n_q, n_k, kind):
    """Which keys each query may see, for the right and the mistaken causal masks."""
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    if kind == "top-left":
        return j <= i
    if kind == "transposed":
        return j >= i
    if kind == "bottom-right":
        return j <= i + (n_k - n_q)
    if kind == "none":
        return np.ones((n_q, n_k), dtype=bool)
    if kind == "strict":
        return j < i
    if kind == "shifted":
        return j <= i + 1
    raise ValueError(kind)


def _variant_attention(q, k, v, *, causal, scale=None, mask="top-left", axis=-1, mask_after=False):
    """Naive attention with one mistake switched on (or none)."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = sm_scale * (q @ np.swapaxes(k, -1, -2))
    allowed = _mask(q.shape[-2], k.shape[-2], mask) if causal else None
    if causal and not mask_after:
        s = np.where(allowed, s, -np.inf)
    p = ref.softmax(s, axis=axis)
    if causal and mask_after:
        p = np.where(allowed, p, 0.0)
    return p @ v


def _variant_online_softmax(x, block_size, *, rescale="right", drop_tail=False, zero_tail=False, m_init=-np.inf):
    """The online softmax with one mistake switched on (or none).

    ``rescale``: "right" (l * exp(m_old - m_new)), "none" or "backwards".
    ``drop_tail``: the block loop stops before the last partial block;
    ``zero_tail``: the output for that block is also never written (left 0).
    """
    n = x.shape[-1]
    stop = n - n % block_size if drop_tail else n
    m = np.full(x.shape[:-1], m_init)
    l = np.zeros(x.shape[:-1])
    for start in range(0, stop, block_size):
        block = x[..., start : start + block_size]
        m_new = np.maximum(m, block.max(axis=-1))
        factor = {"right": np.exp(m - m_new), "none": 1.0, "backwards": np.exp(m_new - m)}[rescale]
        if rescale == "backwards":
            factor = np.where(np.isfinite(m), factor, 0.0)  # first block: l is 0 anyway
        l = l * factor + np.exp(block - m_new[..., None]).sum(axis=-1)
        m = m_new
    out = np.exp(x - m[..., None]) / l[..., None]
    if zero_tail:
        out[..., stop:] = 0.0
    return out


def _variant_tiled(q, k, v, block_m, block_n, causal, *, rescale_acc=True, rescale_l=True,
                   drop_kv_tail=False, drop_q_tail=False, mask="top-left", m_init=-np.inf):
    """Tiled attention with one mistake switched on (or none): returns ``o``."""
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    sm_scale = 1.0 / math.sqrt(d)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    o = np.zeros(batch + (n_q, v.shape[-1]))
    q_stop = n_q - n_q % block_m if drop_q_tail else n_q
    kv_stop = n_k - n_k % block_n if drop_kv_tail else n_k
    allowed_all = _mask(n_q, n_k, mask) if causal and mask != "tile-local" else None
    for q_start in range(0, q_stop, block_m):
        q_end = min(q_start + block_m, n_q)
        rows = q_end - q_start
        m_i = np.full(batch + (rows,), m_init)
        l_i = np.zeros(batch + (rows,))
        acc = np.zeros(batch + (rows, v.shape[-1]))
        for k_start in range(0, kv_stop, block_n):
            k_end = min(k_start + block_n, n_k)
            s = sm_scale * (q[..., q_start:q_end, :] @ np.swapaxes(k[..., k_start:k_end, :], -1, -2))
            if causal and mask == "tile-local":  # positions inside the tile, not in the sequence
                s = np.where(np.arange(rows)[:, None] >= np.arange(k_end - k_start)[None, :], s, -np.inf)
            elif causal:
                s = np.where(allowed_all[q_start:q_end, k_start:k_end], s, -np.inf)
            m_new = np.maximum(m_i, s.max(axis=-1))
            alpha = np.exp(m_i - m_new)
            p = np.exp(s - m_new[..., None])
            l_i = (l_i * alpha if rescale_l else l_i) + p.sum(axis=-1)
            acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ v[..., k_start:k_end, :]
            m_i = m_new
        o[..., q_start:q_end, :] = acc / l_i[..., None]
    return o


def _scores(q, k, causal):
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(ref.causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    return s


# -----------------------------------------------------------------------------
# Random inputs
# -----------------------------------------------------------------------------
def _batch_shape(rng, max_dims=2) -> tuple[int, ...]:
    return tuple(int(s) for s in rng.integers(1, 4, size=int(rng.integers(0, max_dims + 1))))


def _qkv(rng, batch, n_q, n_k, d, magnitude):
    """q, k, v with scores of size about ``magnitude`` after the 1/sqrt(d) scale.

    q.k is a sum of d products; with entries of std ``a`` it has std
    ``a^2 sqrt(d)``, which the 1/sqrt(d) scale turns into ``a^2``.
    """
    a = math.sqrt(magnitude)
    q = rng.normal(size=batch + (n_q, d)) * a
    k = rng.normal(size=batch + (n_k, d)) * a
    v = rng.normal(size=batch + (n_k, d))
    return q, k, v


def _describe_qkv(batch, n_q, n_k, d, causal, extra=""):
    shape = f"batch {batch}, " if batch else ""
    n = f"Nq=Nk={n_q}" if n_q == n_k else f"Nq={n_q}, Nk={n_k}"
    return f"{shape}{n}, d={d}, causal={causal}{extra}"


# -----------------------------------------------------------------------------
# check_softmax
# -----------------------------------------------------------------------------
def _softmax_cases(rng):
    """(name, x, axis, large) for check_softmax: fixed cases, then random ones."""
    yield "fixed #1: x = [1, 2, 3]", np.array([1.0, 2.0, 3.0]), -1, False
    # Square before non-square: dividing by sums without keepdims broadcasts
    # silently on a square array (and is diagnosed) but raises on the next one.
    yield "fixed #2: a 4x4 array", np.arange(16.0).reshape(4, 4) / 4.0 - np.eye(4), -1, False
    yield "fixed #3: two rows [[0, 0, 0], [1, 2, 4]]", np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 4.0]]), -1, False
    yield "fixed #4: axis=0 of a 3x5 array", np.linspace(-2.0, 3.0, 15).reshape(3, 5) ** 2, 0, False
    yield "fixed #5: large values [1000, 1001, 1002]", np.array([1000.0, 1001.0, 1002.0]), -1, True
    yield "fixed #6: large negative values [-1000, -1001, -1002]", np.array([-1000.0, -1001.0, -1002.0]), -1, True
    yield "fixed #7: rows at +1000 and -1000", np.array([[1000.0, 999.0, 998.0], [-1000.0, -1001.0, -1003.0]]), -1, True
    # Fresh random cases.
    for i in range(3):
        shape = _batch_shape(rng) + (int(rng.integers(1, 50)),)
        x = rng.normal(size=shape) * float(rng.choice([0.5, 3.0, 10.0]))
        yield f"random #{i + 1}: shape {shape}", x, -1, False
    shape = (int(rng.integers(2, 5)), int(rng.integers(2, 6)), int(rng.integers(2, 7)))
    axis = int(rng.integers(0, 3))
    yield f"random #4: shape {shape}, axis={axis}", rng.normal(size=shape) * 2.0, axis, False
    shape = _batch_shape(rng) + (int(rng.integers(2, 50)),)
    offsets = rng.choice([-1000.0, 1000.0], size=shape[:-1] + (1,))
    x = rng.normal(size=shape) * 30.0 + offsets
    yield f"random #5: shape {shape}, values around +-1000", x, -1, True


def grade_softmax(fn, *, seed=None, time_limit_s: float = 10.0):
    """Grade ``fn(x, axis=-1)``: a numerically stable softmax of a NumPy array along ``axis``."""
    __tracebackhide__ = True
    require_callable(fn, "check_softmax")
    run = Run("check_softmax", seed, time_limit_s=time_limit_s)
    for case, x, axis, large in _softmax_cases(run.rng):
        expected = ref.softmax(x, axis=axis)
        with proof.references_forbidden():  # course_utils.references.softmax is what it is compared with
            out = run.call(fn, x.copy(), axis=axis, case=case)
        got = run.array(out, expected_shape=x.shape, case=case)
        ax = axis % x.ndim
        diagnoses = [
            Diagnosis(MSG_WHOLE_SUM, when=_like(lambda x=x: _wrong_softmax_whole(x))),
            Diagnosis(MSG_WHOLE_SUM, when=_like(lambda x=x, axis=axis: _wrong_softmax_whole_rowmax(x, axis))),
            *[
                Diagnosis(f"{MSG_WRONG_AXIS}: axis {other} instead of axis {axis}.",
                          when=_like(lambda x=x, other=other: ref.softmax(x, axis=other)))
                for other in range(x.ndim) if other != ax
            ],
            Diagnosis(MSG_NO_KEEPDIMS, when=_like(lambda x=x, axis=axis: _wrong_softmax_no_keepdims(x, axis))),
        ]
        if large:
            diagnoses += [
                Diagnosis(MSG_GLOBAL_MAX, when=_global_max_nan_rows(x, axis)),
                Diagnosis(MSG_OVERFLOW, when=_not_finite),
            ]
        run.compare(got, expected, case=case, what="the softmax", atol=ATOL, rtol=RTOL, diagnoses=diagnoses)
    return run.passed()


# -----------------------------------------------------------------------------
# check_naive_attention
# -----------------------------------------------------------------------------
def _attention_cases(rng, *, blocks=False):
    """(name, q, k, v, causal, large, block_m, block_n) for the attention checks.

    With ``blocks``, each case also gets block sizes (for check_tiled_attention);
    random cases keep the number of tiles small so a loop-based answer stays fast.
    """
    def fixed(i, batch, n_q, n_k, d, causal, magnitude=1.0, bm=4, bn=4, note=""):
        g = np.random.default_rng(1000 + i)  # fixed cases are the same on every call
        q, k, v = _qkv(g, batch, n_q, n_k, d, magnitude)
        extra = (f", block_m={bm}, block_n={bn}" if blocks else "") + note
        return (f"fixed #{i}: {_describe_qkv(batch, n_q, n_k, d, causal, extra)}", q, k, v, causal,
                magnitude > 100, bm, bn)

    if blocks:
        yield fixed(1, (), 8, 8, 4, False)
        yield fixed(2, (), 8, 8, 4, True)
        yield fixed(3, (), 10, 10, 4, False, bm=4, bn=3)
        yield fixed(4, (), 10, 11, 4, True, bm=3, bn=4)
        yield fixed(5, (), 6, 6, 3, True, bm=1, bn=1)
        yield fixed(6, (), 5, 12, 4, True, bm=2, bn=5)
        yield fixed(7, (), 12, 5, 4, True, bm=5, bn=2)
        yield fixed(8, (), 6, 7, 4, False, bm=64, bn=64)
        yield fixed(9, (2, 2), 20, 20, 8, True, bm=8, bn=4)
        yield fixed(10, (2,), 24, 24, 16, False, magnitude=1000.0, bm=8, bn=8, note=", scores ~1000")
        yield fixed(11, (2,), 24, 24, 16, True, magnitude=1000.0, bm=8, bn=8, note=", scores ~1000")
        name, q, k, v, causal, _, bm, bn = fixed(12, (), 20, 20, 16, True, bm=4, bn=8,
                                                   note=", rows whose scores are all near -1000, 0 or +1000")
        k[..., 0], q[..., 0] = 40.0, np.resize([-100.0, 0.0, 100.0], 20)  # s_ij = 1000 * (-1, 0, 1) + O(1)
        yield name, q, k, v, causal, True, bm, bn
    else:
        yield fixed(1, (), 3, 3, 2, False)
        yield fixed(2, (), 3, 3, 2, True)
        yield fixed(3, (2, 3), 5, 5, 4, False)
        yield fixed(4, (2, 3), 5, 5, 4, True)
        yield fixed(5, (), 3, 6, 4, True)
        yield fixed(6, (), 6, 3, 4, True)
        yield fixed(7, (2,), 4, 7, 8, False)
        yield fixed(8, (2,), 16, 16, 16, False, magnitude=1000.0, note=", scores ~1000")
        yield fixed(9, (2,), 16, 16, 16, True, magnitude=1000.0, note=", scores ~1000")
    # Fresh random cases: both causal settings, Nq != Nk half the time.
    for i, causal in enumerate([False, True, False, True, True]):
        batch = _batch_shape(rng)
        if blocks:
            bm = int(np.exp(rng.uniform(0, math.log(64))).round())
            bn = int(np.exp(rng.uniform(0, math.log(64))).round())
            n_q = int(rng.integers(1, min(96, 16 * bm) + 1))
            n_k = n_q if rng.random() < 0.5 else int(rng.integers(1, min(96, 16 * bn) + 1))
        else:
            bm = bn = 0
            n_q = int(rng.integers(1, 48))
            n_k = n_q if rng.random() < 0.5 else int(rng.integers(1, 48))
        d = int(rng.integers(1, 33))
        magnitude = 1000.0 if i == 4 else float(rng.choice([1.0, 4.0]))
        q, k, v = _qkv(rng, batch, n_q, n_k, d, magnitude)
        extra = (f", block_m={bm}, block_n={bn}" if blocks else "") + (", scores ~1000" if magnitude > 100 else "")
        yield (f"random #{i + 1}: {_describe_qkv(batch, n_q, n_k, d, causal, extra)}", q, k, v, causal,
               magnitude > 100, bm, bn)


def _mask_diagnoses(q, k, v, causal, tiles=None):
    """Mistakes with the causal mask, shared by both attention checks.

    For the tiled check, ``tiles=(block_m, block_n)``: the mistaken mask is
    then also replayed tile by tile, which reproduces the NaN rows a tiled
    loop gets when a query's first tile is fully masked.
    """
    if not causal:
        return []
    mistakes = [(MSG_NO_CAUSAL_NUMPY, "none"), (MSG_MASK_TRANSPOSED, "transposed")]
    if q.shape[-2] != k.shape[-2]:  # before "shifted": with Nk = Nq + 1 they are the same mask
        mistakes.append((MSG_MASK_BOTTOM_RIGHT, "bottom-right"))
    mistakes += [(MSG_MASK_STRICT, "strict"), (MSG_MASK_SHIFTED, "shifted")]
    found = []
    if tiles is not None:
        found.append(Diagnosis(MSG_MASK_TILE_LOCAL,
                               when=_like(lambda: _variant_tiled(q, k, v, *tiles, True, mask="tile-local"))))
    for message, mask in mistakes:
        if tiles is not None:
            found.append(Diagnosis(message, when=_like(lambda mask=mask: _variant_tiled(q, k, v, *tiles, True, mask=mask))))
        found.append(Diagnosis(message, when=_like(lambda mask=mask: _variant_attention(q, k, v, causal=True, mask=mask))))
    return found


def grade_naive_attention(fn, *, seed=None, time_limit_s: float = 10.0):
    """Grade ``fn(q, k, v, causal=False)``: softmax(q k^T / sqrt(d)) v, optionally causal.

    ``q [..., Nq, d]``, ``k``/``v [..., Nk, d]``; causal masking is top-left
    aligned (query i sees keys j <= i), also when ``Nq != Nk``.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_naive_attention")
    run = Run("check_naive_attention", seed, time_limit_s=time_limit_s)
    for case, q, k, v, causal, large, _, _ in _attention_cases(run.rng):
        expected = ref.attention(q, k, v, causal=causal)
        with proof.references_forbidden():  # course_utils.references.attention is what it is compared with
            out = run.call(fn, q.copy(), k.copy(), v.copy(), causal=causal, case=case)
        got = run.array(out, expected_shape=expected.shape, case=case)
        d = q.shape[-1]
        diagnoses = [
            Diagnosis(MSG_NO_SCALE_NUMPY, when=_like(lambda: _variant_attention(q, k, v, causal=causal, scale=1.0))),
            Diagnosis(MSG_SCALE_D, when=_like(lambda: _variant_attention(q, k, v, causal=causal, scale=1.0 / d))),
            *_mask_diagnoses(q, k, v, causal),
        ]
        if causal:
            diagnoses.append(Diagnosis(MSG_MASK_AFTER_SOFTMAX,
                                       when=_like(lambda: _variant_attention(q, k, v, causal=True, mask_after=True))))
        diagnoses.append(Diagnosis(MSG_SOFTMAX_QUERIES,
                                   when=_like(lambda: _variant_attention(q, k, v, causal=causal, axis=-2))))
        if large:
            diagnoses.append(Diagnosis(MSG_OVERFLOW, when=_not_finite))
        run.compare(got, expected, case=case, what="the attention output", atol=ATOL, rtol=RTOL,
                    diagnoses=diagnoses, axes=_axes(got.ndim, "query", "dim"))
    return run.passed()


def _axes(ndim, *last):
    """Axis names for error messages: batch axes, then ``last``."""
    return tuple(f"batch{i}" for i in range(ndim - len(last))) + last


# -----------------------------------------------------------------------------
# check_online_softmax
# -----------------------------------------------------------------------------
def _online_cases(rng):
    """(name, x, block_size, large) for check_online_softmax."""
    yield "fixed #1: x = [0, 1, ..., 9] (the max grows in every block), block_size=3", np.arange(10.0), 3, False
    yield "fixed #2: x = [0, 1, ..., 9], block_size=1", np.arange(10.0), 1, False
    yield "fixed #3: block_size larger than the row (N=5, block_size=8)", np.array([0.5, -1.0, 2.0, 0.0, 1.5]), 8, False
    yield "fixed #4: x = [9, 8, ..., 0], block_size=4", np.arange(9.0, -1.0, -1.0), 4, False
    g = np.random.default_rng(2001)
    yield "fixed #5: shape (2, 3, 17), rising rows, block_size=4", np.sort(g.normal(size=(2, 3, 17)) * 2.0, axis=-1), 4, False
    yield "fixed #6: large rising values (~1000), N=20, block_size=6", 1000.0 + np.linspace(0.0, 30.0, 20), 6, True
    yield ("fixed #7: rows around -1000 and +1000, N=9, block_size=4",
           np.array([[-1000.0], [1000.0]]) + np.linspace(-3.0, 3.0, 9), 4, True)
    for i in range(4):
        block = int(rng.integers(1, 65))
        n = int(rng.integers(1, min(150, 12 * block) + 1))
        shape = _batch_shape(rng) + (n,)
        x = rng.normal(size=shape) * float(rng.choice([1.0, 5.0]))
        if i == 1:  # rising rows: the max changes at every block
            x = np.sort(x, axis=-1)
        yield f"random #{i + 1}: shape {shape}, block_size={block}", x, block, False
    block = int(rng.integers(1, 33))
    shape = _batch_shape(rng) + (int(rng.integers(block + 1, 4 * block + 2)),)
    x = np.sort(rng.normal(size=shape) * 300.0, axis=-1) + rng.choice([-1000.0, 1000.0])
    yield f"random #5: shape {shape}, block_size={block}, values around +-1000", x, block, True


def _watched(x: np.ndarray) -> tuple[np.ndarray, dict]:
    """``x`` watched for whole-row reductions, and the log (off until the call)."""
    log = inputs.row_log(x.shape[-1])
    w = inputs.watch({"x": x}, log)["x"]
    return w, log


def _whole_row_after_call(log, out) -> bool:
    """Whether a row was reduced whole, forgiving reductions of the returned values (a self-check)."""
    out = np.asarray(out, dtype=np.float64) if out is not None else None
    for arr in log["reduced"]:
        if out is not None and arr.shape == out.shape:
            with np.errstate(all="ignore"):
                if np.allclose(np.asarray(arr, dtype=np.float64), out, equal_nan=True):
                    continue
        return True
    return False


def grade_online_softmax(fn, *, seed=None, time_limit_s: float = 10.0):
    """Grade ``fn(x, block_size)``: softmax over the last axis in one streaming pass over blocks.

    The values are graded first; the cases make the usual streaming mistakes
    visible: a max that grows from block to block, lengths that are not
    multiples of ``block_size``, and values around 1000. Then the way they
    were computed: ``x`` is handed over as a :class:`.inputs.Watched`, and right
    values from a max or a sum over a whole row (when the row is longer than
    one block) fail with :data:`MSG_NOT_STREAMING`.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_online_softmax")
    run = Run("check_online_softmax", seed, time_limit_s=time_limit_s)
    for case, x, block, large in _online_cases(run.rng):
        expected = ref.online_softmax(x, block)
        x_in, log = _watched(x)
        with proof.references_forbidden(), inputs.watching(log):
            out = run.call(fn, x_in, block, case=case)
        out = inputs.plain(out)
        log["whole_row"] = _whole_row_after_call(log, out if isinstance(out, np.ndarray) else None)
        got = run.array(out, expected_shape=x.shape, case=case)
        diagnoses = [
            Diagnosis(MSG_NO_RESCALE, when=_like(lambda: _variant_online_softmax(x, block, rescale="none"))),
            Diagnosis(MSG_RESCALE_BACKWARDS, when=_like(lambda: _variant_online_softmax(x, block, rescale="backwards"))),
            Diagnosis(MSG_TAIL_DROPPED, when=_like(lambda: _variant_online_softmax(x, block, drop_tail=True))),
            Diagnosis(MSG_TAIL_DROPPED, when=_like(lambda: _variant_online_softmax(x, block, drop_tail=True, zero_tail=True))),
            Diagnosis(MSG_M_INIT_ZERO_NUMPY, when=_like(lambda: _variant_online_softmax(x, block, m_init=0.0))),
        ]
        if large:
            diagnoses.append(Diagnosis(MSG_OVERFLOW, when=_not_finite))
        run.compare(got, expected, case=case, what="the online softmax", atol=ATOL, rtol=RTOL, diagnoses=diagnoses)
        if log["whole_row"] and x.shape[-1] > block:
            raise run.fail(MSG_NOT_STREAMING, case)
    return run.passed()


# -----------------------------------------------------------------------------
# check_tiled_attention
# -----------------------------------------------------------------------------
def grade_tiled_attention(fn, *, seed=None, time_limit_s: float = 10.0):
    """Grade ``fn(q, k, v, block_m, block_n, causal=False) -> (o, lse)``.

    ``o`` is the attention output ``[..., Nq, d]``; ``lse`` ``[..., Nq]`` is
    the natural-log logsumexp of each query row's scaled, masked scores.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_tiled_attention")
    run = Run("check_tiled_attention", seed, time_limit_s=time_limit_s)
    for case, q, k, v, causal, large, bm, bn in _attention_cases(run.rng, blocks=True):
        o_ref, lse_ref = ref.attention_lse(q, k, v, causal=causal)
        log = inputs.tile_log(math.prod(np.broadcast_shapes(q.shape[:-2], k.shape[:-2])), bm, bn, MSG_NOT_TILED)
        watched = inputs.watch({"q": q, "k": k, "v": v}, log)
        with proof.references_forbidden(), inputs.watching(log):
            out = run.call(fn, watched["q"], watched["k"], watched["v"], bm, bn, causal=causal, case=case)
        if out is None:
            raise run.fail("your function returned None: did you forget a `return`? Return the pair (o, lse).", case)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            what = f"a {type(out).__name__}" if not isinstance(out, (tuple, list)) else f"{len(out)} values"
            raise run.fail(f"your function returned {what}; return the pair (o, lse).", case)
        out = [inputs.plain(a) for a in out]
        o = run.array(out[0], expected_shape=o_ref.shape, case=case, name="o (the first value you returned)")
        lse = run.array(out[1], expected_shape=lse_ref.shape, case=case, name="lse (the second value you returned)")

        def variant(**mistake):
            return _like(lambda: _variant_tiled(q, k, v, bm, bn, causal, **mistake))

        diagnoses = [
            Diagnosis(MSG_NO_SCALE_NUMPY, when=_like(lambda: _variant_attention(q, k, v, causal=causal, scale=1.0))),
            Diagnosis(MSG_BOTH_NOT_RESCALED, when=variant(rescale_acc=False, rescale_l=False)),
            Diagnosis(MSG_ACC_NOT_RESCALED_NUMPY, when=variant(rescale_acc=False)),
            Diagnosis(MSG_L_NOT_RESCALED_NUMPY, when=variant(rescale_l=False)),
            Diagnosis(MSG_KV_TAIL_DROPPED, when=variant(drop_kv_tail=True)),
            Diagnosis(MSG_Q_TAIL_DROPPED, when=variant(drop_q_tail=True)),
            *_mask_diagnoses(q, k, v, causal, tiles=(bm, bn)),
            Diagnosis(MSG_M_INIT_ZERO_NUMPY, when=variant(m_init=0.0)),
        ]
        if large:
            diagnoses.append(Diagnosis(MSG_OVERFLOW, when=_not_finite))
        run.compare(o, o_ref, case=case, what="o", atol=ATOL, rtol=RTOL,
                    diagnoses=diagnoses, axes=_axes(o.ndim, "query", "dim"))

        row_max = _scores(q, k, causal).max(axis=-1)
        lse_diagnoses = [
            Diagnosis(MSG_LSE_BASE2_NUMPY, when=_like(lambda: lse_ref / math.log(2.0))),
            Diagnosis(MSG_LSE_NO_MAX_NUMPY, when=_like(lambda: lse_ref - row_max)),
            Diagnosis(MSG_LSE_MIXED_NUMPY, when=_like(lambda: row_max + (lse_ref - row_max) / math.log(2.0))),
            Diagnosis(MSG_LSE_MIXED_NUMPY, when=_like(lambda: row_max / math.log(2.0) + (lse_ref - row_max))),
        ]
        run.compare(lse, lse_ref, case=case, what="lse", atol=ATOL, rtol=RTOL,
                    diagnoses=lse_diagnoses, axes=_axes(lse.ndim, "query"))
        if log["untiled"]:
            raise run.fail(log["untiled"], case)
    return run.passed()
