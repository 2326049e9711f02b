"""The part 1 checks against planted mistakes and against correct answers written differently.

Every diagnosis that course_utils.grading.part1_numpy claims has a planted
wrong implementation here that must be rejected with a GradingError naming
that diagnosis. Correct implementations in other styles must pass, on
several seeds (the random cases change with the seed).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

import course_utils  # noqa: F401  (configures the environment first, as the notebooks do)
from course_utils.grading import GradingError, Passed
from course_utils.grading import part1_numpy as p1
from course_utils.grading import check_naive_attention, check_online_softmax, check_softmax, check_tiled_attention

SEEDS = [0, 1, 2, 3, 12345]

# The planted mistakes overflow and divide 0 by 0 on purpose; NumPy's warnings about it are noise here.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def rejected(check, fn, message, **kwargs):
    """Assert that ``check`` rejects ``fn`` with ``message`` as the likely cause."""
    with pytest.raises(GradingError) as info:
        check(fn, **kwargs)
    text = str(info.value)
    assert message in text, f"expected diagnosis {message!r} in:\n{text}"
    return text


def passes(check, fn, seeds=SEEDS):
    for seed in seeds:
        result = check(fn, seed=seed)
        assert isinstance(result, Passed), result
        assert result.cases >= 10


# =============================================================================
# Softmax
# =============================================================================
def softmax_stable(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_via_logsumexp(x, axis=-1):
    # log-softmax done by hand, then exp: no scipy.
    m = np.max(x, axis=axis, keepdims=True)
    lse = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
    return np.exp(x - lse)


def softmax_moveaxis_loop(x, axis=-1):
    # Row by row over a 2-D view, in Python.
    y = np.moveaxis(np.asarray(x, dtype=float), axis, -1)
    flat = y.reshape(-1, y.shape[-1])
    out = np.empty_like(flat)
    for r, row in enumerate(flat):
        e = np.exp(row - row.max())
        out[r] = e / e.sum()
    return np.moveaxis(out.reshape(y.shape), -1, axis)


@pytest.mark.parametrize("fn", [softmax_stable, softmax_via_logsumexp, softmax_moveaxis_loop])
def test_softmax_correct_styles_pass(fn):
    passes(check_softmax, fn)


def test_softmax_unstable_overflows():
    def unstable(x, axis=-1):
        e = np.exp(x)
        return e / e.sum(axis=axis, keepdims=True)

    text = rejected(check_softmax, unstable, p1.MSG_OVERFLOW)
    assert "large values" in text  # the small cases passed first


def test_softmax_global_max():
    def global_max(x, axis=-1):
        e = np.exp(x - x.max())
        return e / e.sum(axis=axis, keepdims=True)

    rejected(check_softmax, global_max, p1.MSG_GLOBAL_MAX)


@pytest.mark.parametrize("which", ["global", "rowmax"])
def test_softmax_whole_sum(which):
    def whole(x, axis=-1):
        e = np.exp(x - (x.max() if which == "global" else x.max(axis=axis, keepdims=True)))
        return e / e.sum()

    rejected(check_softmax, whole, p1.MSG_WHOLE_SUM)


def test_softmax_wrong_axis():
    def axis0(x, axis=-1):
        return softmax_stable(x, axis=0)

    rejected(check_softmax, axis0, "axis 0 instead of axis -1")


def test_softmax_ignores_axis_argument():
    def last_axis_only(x, axis=-1):
        return softmax_stable(x, axis=-1)

    rejected(check_softmax, last_axis_only, "axis 1 instead of axis 0")


def test_softmax_no_keepdims():
    def no_keepdims(x, axis=-1):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis)

    rejected(check_softmax, no_keepdims, p1.MSG_NO_KEEPDIMS)


# =============================================================================
# Naive attention
# =============================================================================
def attention_matmul(q, k, v, causal=False):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s + np.triu(np.full((n_q, n_k), -np.inf), k=1)  # adding -inf above the diagonal
    return softmax_stable(s) @ v


def attention_einsum(q, k, v, causal=False):
    s = np.einsum("...id,...jd->...ij", q, k) * q.shape[-1] ** -0.5
    if causal:
        i = np.arange(s.shape[-2])[:, None]
        j = np.arange(s.shape[-1])[None, :]
        s = np.where(j <= i, s, -np.inf)
    p = softmax_via_logsumexp(s)
    return np.einsum("...ij,...jd->...id", p, v)


def attention_row_loop(q, k, v, causal=False):
    # One query at a time, keeping only the keys it may see.
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for i in range(q.shape[-2]):
        stop = min(i + 1, k.shape[-2]) if causal else k.shape[-2]
        s = np.einsum("...d,...jd->...j", q[..., i, :], k[..., :stop, :]) / math.sqrt(q.shape[-1])
        w = softmax_stable(s)
        out[..., i, :] = np.einsum("...j,...jd->...d", w, v[..., :stop, :])
    return out


@pytest.mark.parametrize("fn", [attention_matmul, attention_einsum, attention_row_loop])
def test_attention_correct_styles_pass(fn):
    passes(check_naive_attention, fn)


def _scores(q, k, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return scale * (q @ np.swapaxes(k, -1, -2))


def test_attention_no_scale():
    rejected(check_naive_attention, lambda q, k, v, causal=False: attention_matmul(q * math.sqrt(q.shape[-1]), k, v, causal),
             p1.MSG_NO_SCALE_NUMPY)


def test_attention_scale_1_over_d():
    rejected(check_naive_attention, lambda q, k, v, causal=False: attention_matmul(q / math.sqrt(q.shape[-1]), k, v, causal),
             p1.MSG_SCALE_D)


def test_attention_softmax_over_queries():
    def over_queries(q, k, v, causal=False):
        s = _scores(q, k)
        if causal:
            s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
        return softmax_stable(s, axis=-2) @ v

    rejected(check_naive_attention, over_queries, p1.MSG_SOFTMAX_QUERIES)


def test_attention_unstable_softmax_overflows():
    def unstable(q, k, v, causal=False):
        s = _scores(q, k)
        if causal:
            s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
        e = np.exp(s)
        return e / e.sum(-1, keepdims=True) @ v

    text = rejected(check_naive_attention, unstable, p1.MSG_OVERFLOW)
    assert "scores ~1000" in text


def test_attention_causal_ignored():
    rejected(check_naive_attention, lambda q, k, v, causal=False: attention_matmul(q, k, v, False), p1.MSG_NO_CAUSAL_NUMPY)


def test_attention_mask_transposed():
    def transposed(q, k, v, causal=False):
        s = _scores(q, k)
        if causal:
            s = np.where(np.triu(np.ones(s.shape[-2:], bool)), s, -np.inf)
        return softmax_stable(s) @ v

    rejected(check_naive_attention, transposed, p1.MSG_MASK_TRANSPOSED)


@pytest.mark.parametrize("kind, message", [("strict", p1.MSG_MASK_STRICT), ("shifted", p1.MSG_MASK_SHIFTED)])
def test_attention_mask_off_by_one(kind, message):
    def off_by_one(q, k, v, causal=False):
        s = _scores(q, k)
        if causal:
            i, j = np.arange(s.shape[-2])[:, None], np.arange(s.shape[-1])[None, :]
            s = np.where(j < i if kind == "strict" else j <= i + 1, s, -np.inf)
        return softmax_stable(s) @ v

    rejected(check_naive_attention, off_by_one, message)


def test_online_softmax_m_starting_at_0_is_not_called_an_overflow():
    text = rejected(check_online_softmax, _online_planted(m_init=0.0), p1.MSG_M_INIT_ZERO_NUMPY)
    assert p1.MSG_OVERFLOW not in text


def test_attention_mask_after_softmax():
    def after(q, k, v, causal=False):
        p = softmax_stable(_scores(q, k))
        if causal:
            p = p * np.tril(np.ones(p.shape[-2:]))
        return p @ v

    rejected(check_naive_attention, after, p1.MSG_MASK_AFTER_SOFTMAX)


def test_attention_mask_bottom_right():
    def bottom_right(q, k, v, causal=False):
        s = _scores(q, k)
        if causal:
            n_q, n_k = s.shape[-2:]
            s = np.where(np.tril(np.ones((n_q, n_k), bool), k=n_k - n_q), s, -np.inf)
        return softmax_stable(s) @ v

    text = rejected(check_naive_attention, bottom_right, p1.MSG_MASK_BOTTOM_RIGHT)
    assert "Nq=3, Nk=6" in text  # the square cases passed


# =============================================================================
# Online softmax
# =============================================================================
def online_vectorised(x, block_size):
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    for start in range(0, x.shape[-1], block_size):
        b = x[..., start:start + block_size]
        m_new = np.maximum(m, b.max(-1))
        l = l * np.exp(m - m_new) + np.exp(b - m_new[..., None]).sum(-1)
        m = m_new
    return np.exp(x - m[..., None]) / l[..., None]


def online_running_lse(x, block_size):
    # Keep the running logsumexp instead of (m, l): lse = logaddexp(lse, lse(block)).
    lse = np.full(x.shape[:-1], -np.inf)
    for start in range(0, x.shape[-1], block_size):
        b = x[..., start:start + block_size]
        bm = b.max(-1)
        lse = np.logaddexp(lse, bm + np.log(np.exp(b - bm[..., None]).sum(-1)))
    return np.exp(x - lse[..., None])


def online_scalar_rows(x, block_size):
    # Pure Python floats, row by row, block by block.
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    for r, row in enumerate(flat):
        m, l = -math.inf, 0.0
        n_blocks = math.ceil(len(row) / block_size)
        for b in range(n_blocks):
            block = row[b * block_size:(b + 1) * block_size]
            m_new = max(m, max(block))
            l = l * math.exp(m - m_new) + sum(math.exp(t - m_new) for t in block)
            m = m_new
        out[r] = [math.exp(t - m) / l for t in row]
    return out.reshape(x.shape)


def online_in_place(x, block_size):
    # Buffers updated in place with out=, block maxima as methods, a transposed view.
    xt = np.moveaxis(x, -1, 0)
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    m_new = np.empty_like(m)
    for start in range(0, xt.shape[0], block_size):
        block = xt[start:start + block_size]
        np.maximum(m, block.max(axis=0), out=m_new)
        l *= np.exp(m - m_new)
        l += np.exp(block - m_new).sum(axis=0)
        m[...] = m_new
    return np.exp(x - m[..., None]) / l[..., None]


@pytest.mark.parametrize("fn", [online_vectorised, online_running_lse, online_scalar_rows, online_in_place])
def test_online_softmax_correct_styles_pass(fn):
    passes(check_online_softmax, fn)


def whole_row_softmax(x, block_size):
    # Right values, but not streaming at all.
    return softmax_stable(x)


def streamed_max_then_whole_sum(x, block_size):
    # The max is streamed, but the sum is taken over the whole row afterwards (two passes).
    m = np.full(x.shape[:-1], -np.inf)
    for start in range(0, x.shape[-1], block_size):
        m = np.maximum(m, x[..., start:start + block_size].max(-1))
    e = np.exp(x - m[..., None])
    return e / e.sum(-1, keepdims=True)


def whole_row_max_then_streamed_sum(x, block_size):
    # The sum is streamed, but against the max of the whole row, known in advance.
    m = np.max(x, axis=-1)
    l = np.zeros(x.shape[:-1])
    for start in range(0, x.shape[-1], block_size):
        l = l + np.exp(x[..., start:start + block_size] - m[..., None]).sum(-1)
    return np.exp(x - m[..., None]) / l[..., None]


@pytest.mark.parametrize("fn", [whole_row_softmax, streamed_max_then_whole_sum, whole_row_max_then_streamed_sum])
def test_online_softmax_right_values_without_streaming_are_explained(fn):
    text = rejected(check_online_softmax, fn, p1.MSG_NOT_STREAMING)
    assert "fixed #1" in text  # the first case already shows it


def test_online_softmax_whole_row_is_fine_when_it_is_one_block():
    # Row length <= block_size: the whole row *is* the first block, so a whole-row softmax
    # streams it (fixed case #3 has N=5, block_size=8).
    def fn(x, block_size):
        return softmax_stable(x) if x.shape[-1] <= block_size else online_vectorised(x, block_size)

    passes(check_online_softmax, fn)


def test_row_watcher_leaves_values_and_types_alone():
    x = np.random.default_rng(1).normal(size=(3, 7))
    w, log = p1._watched(x)
    log["active"] = True
    y = np.exp(w[:, 2:4] - w[:, 2:4].max(-1, keepdims=True))
    assert isinstance(y, p1._Watched) and not log["reduced"]
    assert np.array_equal(np.asarray(y), np.exp(x[:, 2:4] - x[:, 2:4].max(-1, keepdims=True)))
    assert type(w.sum(-1)) is np.ndarray and log["reduced"]


def _online_planted(rescale="right", stop_early=False, zero_tail=False, stable=True, m_init=-np.inf):
    def fn(x, block_size):
        n = x.shape[-1]
        stop = n - n % block_size if stop_early else n
        m = np.full(x.shape[:-1], m_init) if stable else np.zeros(x.shape[:-1])
        l = np.zeros(x.shape[:-1])
        for start in range(0, stop, block_size):
            b = x[..., start:start + block_size]
            m_new = np.maximum(m, b.max(-1)) if stable else m
            if rescale == "right":
                l = l * np.exp(m - m_new)
            elif rescale == "backwards":
                l = l * np.where(np.isfinite(m), np.exp(m_new - m), 0.0)
            l = l + np.exp(b - m_new[..., None]).sum(-1)
            m = m_new
        out = np.exp(x - m[..., None]) / l[..., None]
        if zero_tail:
            out[..., stop:] = 0.0
        return out

    return fn


def test_online_softmax_planted_helper_is_right_when_unplanted():
    passes(check_online_softmax, _online_planted(), seeds=[7])


def test_online_softmax_not_rescaled():
    rejected(check_online_softmax, _online_planted(rescale="none"), p1.MSG_NO_RESCALE)


def test_online_softmax_rescaled_backwards():
    rejected(check_online_softmax, _online_planted(rescale="backwards"), p1.MSG_RESCALE_BACKWARDS)


@pytest.mark.parametrize("zero_tail", [False, True])
def test_online_softmax_tail_dropped(zero_tail):
    rejected(check_online_softmax, _online_planted(stop_early=True, zero_tail=zero_tail), p1.MSG_TAIL_DROPPED)


def test_online_softmax_unstable_overflows():
    text = rejected(check_online_softmax, _online_planted(stable=False, rescale="none"), p1.MSG_OVERFLOW)
    assert "large" in text


# =============================================================================
# Tiled attention
# =============================================================================
def tiled_vectorised(q, k, v, block_m, block_n, causal=False):
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    o = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = np.zeros(q.shape[:-1])
    for qs in range(0, n_q, block_m):
        qb = q[..., qs:qs + block_m, :]
        rows = np.arange(qs, qs + qb.shape[-2])
        m = np.full(qb.shape[:-1], -np.inf)
        l = np.zeros(qb.shape[:-1])
        acc = np.zeros(qb.shape[:-1] + (v.shape[-1],))
        for ks in range(0, n_k, block_n):
            if causal and ks > rows[-1]:
                break  # every later tile is fully masked
            s = np.einsum("...id,...jd->...ij", qb, k[..., ks:ks + block_n, :]) / math.sqrt(d)
            if causal:
                cols = np.arange(ks, min(ks + block_n, n_k))
                s = s + np.where(cols[None, :] <= rows[:, None], 0.0, -np.inf)
            m_new = np.maximum(m, s.max(-1))
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new[..., None])
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + p @ v[..., ks:ks + block_n, :]
            m = m_new
        o[..., qs:qs + block_m, :] = acc / l[..., None]
        lse[..., qs:qs + block_m] = m + np.log(l)
    return o, lse


def tiled_exp2(q, k, v, block_m, block_n, causal=False):
    # The Triton kernels' style: scores in log2 units, exp2, lse converted back to ln at the end.
    log2e = 1.0 / math.log(2.0)
    qk_scale = log2e / math.sqrt(q.shape[-1])
    n_q, n_k = q.shape[-2], k.shape[-2]
    o = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = np.zeros(q.shape[:-1])
    for qs in range(0, n_q, block_m):
        qe = min(qs + block_m, n_q)
        m2 = np.full(q.shape[:-2] + (qe - qs,), -np.inf)
        l = np.zeros_like(m2)
        acc = np.zeros(m2.shape + (v.shape[-1],))
        for ks in range(0, n_k, block_n):
            ke = min(ks + block_n, n_k)
            s2 = (q[..., qs:qe, :] @ np.swapaxes(k[..., ks:ke, :], -1, -2)) * qk_scale
            if causal:
                s2 = np.where(np.arange(ks, ke)[None, :] <= np.arange(qs, qe)[:, None], s2, -np.inf)
            m_new = np.maximum(m2, s2.max(-1))
            alpha = np.exp2(m2 - m_new)
            p = np.exp2(s2 - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[..., ks:ke, :]
            m2 = m_new
        o[..., qs:qe, :] = acc / l[..., None]
        lse[..., qs:qe] = (m2 + np.log2(l)) * math.log(2.0)
    return o, lse


def tiled_returns_list(q, k, v, block_m, block_n, causal=False):
    o, lse = tiled_vectorised(q, k, v, block_m, block_n, causal)
    return [o, lse]


@pytest.mark.parametrize("fn", [tiled_vectorised, tiled_exp2, tiled_returns_list])
def test_tiled_correct_styles_pass(fn):
    passes(check_tiled_attention, fn)


def _tiled_planted(scale=True, rescale_acc=True, rescale_l=True, drop_kv_tail=False, drop_q_tail=False,
                   mask="top-left", stable=True, lse_kind="ln", m_init=-np.inf):
    """A tiled attention with the requested mistakes; returns (o, lse)."""

    def fn(q, k, v, block_m, block_n, causal=False):
        n_q, d = q.shape[-2:]
        n_k = k.shape[-2]
        sm = 1 / math.sqrt(d) if scale else 1.0
        o = np.zeros(q.shape[:-1] + (v.shape[-1],))
        lse = np.zeros(q.shape[:-1])
        q_stop = n_q - n_q % block_m if drop_q_tail else n_q
        kv_stop = n_k - n_k % block_n if drop_kv_tail else n_k
        for qs in range(0, q_stop, block_m):
            qe = min(qs + block_m, n_q)
            m = np.full(q.shape[:-2] + (qe - qs,), m_init if stable else 0.0)
            l = np.zeros_like(m)
            acc = np.zeros(m.shape + (v.shape[-1],))
            for ks in range(0, kv_stop, block_n):
                ke = min(ks + block_n, n_k)
                s = sm * (q[..., qs:qe, :] @ np.swapaxes(k[..., ks:ke, :], -1, -2))
                if causal:
                    i = np.arange(qs, qe)[:, None]
                    j = np.arange(ks, ke)[None, :]
                    allowed = {"top-left": j <= i, "transposed": j >= i, "bottom-right": j <= i + n_k - n_q,
                               "none": np.ones((qe - qs, ke - ks), bool), "tile-local": (j - ks) <= (i - qs)}[mask]
                    s = np.where(allowed, s, -np.inf)
                m_new = np.maximum(m, s.max(-1)) if stable else m
                alpha = np.exp(m - m_new)
                p = np.exp(s - m_new[..., None])
                l = (l * alpha if rescale_l else l) + p.sum(-1)
                acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ v[..., ks:ke, :]
                m = m_new
            o[..., qs:qe, :] = acc / l[..., None]
            lse[..., qs:qe] = {"ln": m + np.log(l), "log2": (m + np.log(l)) / math.log(2.0), "no max": np.log(l),
                               "mixed": m + np.log2(l)}[lse_kind]
        return o, lse

    return fn


def test_tiled_planted_helper_is_right_when_unplanted():
    passes(check_tiled_attention, _tiled_planted(), seeds=[7])


@pytest.mark.parametrize(
    "mistake, message",
    [
        (dict(scale=False), p1.MSG_NO_SCALE_NUMPY),
        (dict(rescale_acc=False), p1.MSG_ACC_NOT_RESCALED_NUMPY),
        (dict(rescale_l=False), p1.MSG_L_NOT_RESCALED_NUMPY),
        (dict(rescale_acc=False, rescale_l=False), p1.MSG_BOTH_NOT_RESCALED),
        (dict(drop_kv_tail=True), p1.MSG_KV_TAIL_DROPPED),
        (dict(drop_q_tail=True), p1.MSG_Q_TAIL_DROPPED),
        (dict(mask="none"), p1.MSG_NO_CAUSAL_NUMPY),
        (dict(mask="transposed"), p1.MSG_MASK_TRANSPOSED),
        (dict(mask="bottom-right"), p1.MSG_MASK_BOTTOM_RIGHT),
        (dict(stable=False), p1.MSG_OVERFLOW),
        (dict(lse_kind="log2"), p1.MSG_LSE_BASE2_NUMPY),
        (dict(lse_kind="no max"), p1.MSG_LSE_NO_MAX_NUMPY),
        (dict(lse_kind="mixed"), p1.MSG_LSE_MIXED_NUMPY),
        (dict(mask="tile-local"), p1.MSG_MASK_TILE_LOCAL),
        (dict(m_init=0.0), p1.MSG_M_INIT_ZERO_NUMPY),
    ],
    ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else "",
)
def test_tiled_planted_mistakes(mistake, message):
    rejected(check_tiled_attention, _tiled_planted(**mistake), message)


def test_tiled_returns_o_only():
    text = rejected(check_tiled_attention, lambda q, k, v, bm, bn, causal=False: tiled_vectorised(q, k, v, bm, bn, causal)[0],
                    "your function returned a ndarray; return the pair (o, lse).")
    assert "Likely cause" not in text


def test_tiled_lse_with_keepdims_shape():
    def keepdims(q, k, v, bm, bn, causal=False):
        o, lse = tiled_vectorised(q, k, v, bm, bn, causal)
        return o, lse[..., None]

    rejected(check_tiled_attention, keepdims, "lse (the second value you returned) has shape (8, 1), expected (8,).")


# =============================================================================
# What every check shares: hard-coded answers, types, exceptions, hangs, time
# =============================================================================
CHECKS = {
    "softmax": (check_softmax, softmax_stable),
    "naive_attention": (check_naive_attention, attention_matmul),
    "online_softmax": (check_online_softmax, online_vectorised),
    "tiled_attention": (check_tiled_attention, tiled_vectorised),
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_hard_coded_answers_fail_on_random_cases(name):
    check, good = CHECKS[name]
    recorded = []

    def recorder(*args, **kwargs):
        recorded.append(good(*args, **kwargs))
        return recorded[-1]

    check(recorder, seed=1)
    replay = iter(recorded)

    def hard_coded(*args, **kwargs):
        return next(replay)  # the answers of the seed-1 call, in order

    with pytest.raises(GradingError) as info:
        check(hard_coded, seed=2)
    assert "case random #" in str(info.value)
    assert "seed=2" in str(info.value)


@pytest.mark.parametrize("name", list(CHECKS))
def test_learner_exception_propagates_with_a_note(name):
    check, _ = CHECKS[name]

    def broken(*args, **kwargs):
        raise ValueError("my own bug")

    with pytest.raises(ValueError, match="my own bug") as info:
        check(broken, seed=0)
    notes = getattr(info.value, "__notes__", [])
    assert any(f"[check_{name}] raised by your function on case fixed #1" in n for n in notes), notes


@pytest.mark.parametrize("name", list(CHECKS))
def test_hanging_function_is_stopped(name):
    check, _ = CHECKS[name]

    def hangs(*args, **kwargs):
        while True:
            pass

    start = time.perf_counter()
    with pytest.raises(GradingError, match=r"ran for more than 0\.3 s"):
        check(hangs, seed=0, time_limit_s=0.3)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "answer, sentence",
    [
        (lambda x, axis=-1: None, "is None: did you forget a `return`?"),
        (lambda x, axis=-1: softmax_stable(x).tolist(), "is a list; return a NumPy array."),
        (lambda x, axis=-1: (softmax_stable(x, axis) > 0.5).astype(int), "should be a floating-point array"),
        (lambda x, axis=-1: softmax_stable(x, axis)[..., :-1], "has shape (2,), expected (3,)."),
    ],
    ids=["none", "list", "int", "shape"],
)
def test_wrong_type_or_shape_gets_one_plain_sentence(answer, sentence):
    text = rejected(check_softmax, answer, sentence)
    assert "Likely cause" not in text
    assert len(text.splitlines()) == 2  # where, then the one sentence


def test_attention_wrong_shape_sentence():
    text = rejected(check_naive_attention, lambda q, k, v, causal=False: attention_matmul(q, k, v, causal)[..., 0],
                    "has shape (3,), expected (3, 2).")
    assert "Likely cause" not in text


def test_failure_names_seed_case_and_location():
    def no_scale(q, k, v, causal=False):
        return softmax_stable(q @ np.swapaxes(k, -1, -2)) @ v

    with pytest.raises(GradingError) as info:
        check_naive_attention(no_scale, seed=99)
    text = str(info.value)
    assert "case fixed #1" in text
    assert "check_naive_attention(fn, seed=99)" in text
    assert "[query=" in text and "dim=" in text


def test_same_seed_replays_the_same_cases():
    seen = {0: [], 1: []}

    for run in (0, 1):
        def record(x, block_size, run=run):
            seen[run].append((x.copy(), block_size))
            return online_vectorised(x, block_size)

        check_online_softmax(record, seed=42)
    assert len(seen[0]) == len(seen[1])
    for (a, ba), (b, bb) in zip(seen[0], seen[1]):
        assert ba == bb and np.array_equal(a, b)


def test_random_cases_cover_what_the_brief_asks():
    """Across seeds: batch axes, Nq != Nk, causal both ways, partial tail blocks, block sizes 1..64."""
    cases = []
    for seed in range(20):
        run = p1.Run("x", seed)
        cases += [c for c in p1._attention_cases(run.rng, blocks=True) if c[0].startswith("random")]
    assert any(q.ndim > 2 for _, q, *_ in cases)
    assert any(q.shape[-2] != k.shape[-2] for _, q, k, *_ in cases)
    assert {c[4] for c in cases} == {True, False}
    assert any(q.shape[-2] % bm and k.shape[-2] % bn for _, q, k, _, _, _, bm, bn in cases)
    block_sizes = [b for c in cases for b in c[6:8]]
    assert min(block_sizes) == 1 and max(block_sizes) <= 64 and max(block_sizes) > 32
    large = [c for c in cases if c[5]]
    assert large and all(np.abs(p1._scores(q, k, False)).max() > 709 for _, q, k, *_ in large)


def test_each_check_passes_vectorised_solutions():
    # Their times are measured by benchmarks/grading_speed.py, not asserted here.
    # (course_utils.references is the answer key: refused, below.)
    for check, fn in [(check_softmax, softmax_stable), (check_naive_attention, attention_matmul),
                      (check_online_softmax, online_vectorised), (check_tiled_attention, tiled_vectorised)]:
        assert check(fn, seed=3)


# -- the references are off limits in the streaming/tiled exercises ----------------
@pytest.mark.parametrize("check, fn", [
    (check_online_softmax, lambda x, block_size: __import__("course_utils").references.online_softmax(x, block_size)),
    (check_online_softmax, lambda x, block_size: __import__("course_utils").references.softmax(x)),
    (check_tiled_attention, lambda q, k, v, bm, bn, causal=False:
        __import__("course_utils").references.attention_lse(q, k, v, causal=causal)),
    # lesson 01: the reference is the answer key there too (issue 21: it used to pass)
    (check_softmax, lambda x, axis=-1: __import__("course_utils").references.softmax(x, axis=axis)),
    (check_naive_attention, lambda q, k, v, causal=False:
        __import__("course_utils").references.attention(q, k, v, causal=causal)),
    (check_naive_attention, lambda q, k, v, causal=False: softmax_stable(
        q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])) @ v if not causal else
        __import__("course_utils").references.attention(q, k, v, causal=True)),
], ids=["online_softmax", "softmax", "attention_lse", "01 softmax", "01 attention", "01 attention, causal only"])
def test_references_are_refused_in_the_streaming_exercises(check, fn):
    with pytest.raises(GradingError, match="called course_utils.references"):
        check(fn)


def test_a_reference_imported_earlier_and_an_except_exception_do_not_escape():
    from course_utils.references import tiled_attention as borrowed

    def sneaky(q, k, v, bm, bn, causal=False):
        try:
            return borrowed(q, k, v, bm, bn, causal=causal)
        except Exception:  # the refusal is not an Exception: this does not swallow it
            return None

    with pytest.raises(GradingError, match="references.tiled_attention"):
        check_tiled_attention(sneaky)
    from course_utils import references as ref
    assert ref.tiled_attention.__code__.co_name == "tiled_attention" and borrowed(
        np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), 1, 1)[0].shape == (2, 2)  # restored


def test_time_limit_is_not_swallowed_by_except_exception():
    def stubborn(x, axis=-1):
        while True:
            try:
                time.sleep(0.05)
            except Exception:
                continue

    start = time.perf_counter()
    with pytest.raises(GradingError, match="ran for more than 0.5 s.*probably a loop that never ends"):
        check_softmax(stubborn, time_limit_s=0.5)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("check", [check_softmax, check_online_softmax, check_tiled_attention])
def test_a_non_callable_gets_one_sentence(check):
    with pytest.raises(GradingError, match=f"{check.__name__} expects a function, but got a ndarray"):
        check(np.zeros(3))


# -- the streaming and tiling watchers: not escapable, not fooled by a self-check -----
def _whole_max_via(idiom):
    def fn(x, block_size):
        if idiom == "np.array":
            m = np.array(x, dtype=np.float64).max(-1, keepdims=True)
        elif idiom == "view":
            m = x.view(np.ndarray).max(-1, keepdims=True)
        elif idiom == "np.sort":
            m = np.sort(x, axis=-1)[..., -1:]
        else:  # np.cumsum for the sum
            e = np.exp(x - np.sort(x)[..., -1:])
            return e / np.cumsum(e, axis=-1)[..., -1:]
        e = np.exp(x - m)
        return e / e.sum(-1, keepdims=True)
    return fn


@pytest.mark.parametrize("idiom", ["np.array", "view", "np.sort", "np.cumsum"])
def test_online_softmax_watcher_sees_through_copies_sort_and_cumsum(idiom):
    rejected(check_online_softmax, _whole_max_via(idiom), p1.MSG_NOT_STREAMING)


def test_online_softmax_that_checks_its_own_output_passes():
    def careful(x, block_size):
        out = online_vectorised(np.asarray(x), block_size)
        assert np.allclose(out.sum(-1), 1.0)
        return out

    passes(check_online_softmax, careful)


def _whole_score_matrix(q, k, v, block_m, block_n, causal=False):
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return e @ v / e.sum(-1, keepdims=True), (m + np.log(e.sum(-1, keepdims=True)))[..., 0]


def _keys_whole_einsum(q, k, v, block_m, block_n, causal=False):
    outs, lses = [], []
    for i0 in range(0, q.shape[-2], block_m):  # tiles the queries only
        s = np.einsum("...id,...jd->...ij", np.array(q[..., i0:i0 + block_m, :]), k) / math.sqrt(q.shape[-1])
        if causal:
            s = np.where(np.arange(k.shape[-2])[None, :] <= np.arange(i0, i0 + s.shape[-2])[:, None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        outs.append(e @ v / e.sum(-1, keepdims=True))
        lses.append((m + np.log(e.sum(-1, keepdims=True)))[..., 0])
    return np.concatenate(outs, -2), np.concatenate(lses, -1)


@pytest.mark.parametrize("fn", [_whole_score_matrix, _keys_whole_einsum], ids=["whole-matrix", "keys-whole-einsum"])
def test_tiled_attention_that_does_not_tile_is_refused(fn):
    with pytest.raises(GradingError, match="did not tile"):
        check_tiled_attention(fn)
