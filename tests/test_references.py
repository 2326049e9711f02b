"""course_utils.references against independent computations.

The part 1 references are checked against PyTorch's
``scaled_dot_product_attention`` and ``logsumexp`` in float64 (a separate
implementation), and the streaming algorithms against the direct ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import course_utils  # noqa: F401  (before torch/triton, as everywhere)
import torch
import torch.nn.functional as F

from course_utils import references as ref

RNG = np.random.default_rng(20240601)


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def _qkv(batch, n_q, n_k, d, scale=1.0, n_kv_heads=None):
    kv_batch = batch if n_kv_heads is None else batch[:-1] + (n_kv_heads,)
    q = RNG.normal(size=batch + (n_q, d)) * scale
    k = RNG.normal(size=kv_batch + (n_k, d)) * scale
    v = RNG.normal(size=kv_batch + (n_k, d))
    return q, k, v


# -- softmax ---------------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_matches_torch(axis):
    x = RNG.normal(size=(3, 4, 5)) * 5
    np.testing.assert_allclose(ref.softmax(x, axis=axis), torch.softmax(_t(x), dim=axis).numpy(), rtol=1e-12, atol=1e-15)


def test_softmax_is_stable_for_large_inputs():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0]])
    got = ref.softmax(x)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, torch.softmax(_t(x), dim=-1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(got[0], ref.softmax(np.array([0.0, 1.0, 2.0])), rtol=1e-12)


# -- attention -------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, n_q, n_k, d", [((), 7, 7, 4), ((2, 3), 16, 16, 8), ((2,), 5, 11, 16), ((2,), 11, 5, 16), ((1, 2), 1, 9, 3)])
def test_attention_matches_torch_sdpa(batch, n_q, n_k, d, causal):
    q, k, v = _qkv(batch, n_q, n_k, d)
    expected = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), is_causal=causal).numpy()
    np.testing.assert_allclose(ref.attention(q, k, v, causal=causal), expected, rtol=1e-10, atol=1e-12)


def test_causal_convention_is_top_left_like_torch():
    """Nq != Nk: query i sees keys j <= i (torch's is_causal), not j <= i + Nk - Nq (FlashAttention 2.1+)."""
    n_q, n_k = 2, 4
    q = np.zeros((n_q, 1))  # all scores equal, so each row averages the keys it sees
    k = np.zeros((n_k, 1))
    v = np.arange(n_k, dtype=float)[:, None]
    got = ref.attention(q, k, v, causal=True)[:, 0]
    np.testing.assert_allclose(got, [0.0, 0.5])  # row 0 sees key 0; row 1 sees keys 0, 1
    torch_out = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), is_causal=True).numpy()[:, 0]
    np.testing.assert_allclose(torch_out, [0.0, 0.5])
    bottom_right = [1.0, 1.5]  # row 0 would see keys 0..2, row 1 keys 0..3
    assert not np.allclose(got, bottom_right)
    assert ref.causal_mask(n_q, n_k).tolist() == [[True, False, False, False], [True, True, False, False]]


def test_no_row_is_fully_masked_even_when_nq_exceeds_nk():
    q, k, v = _qkv((), 9, 3, 4)
    o, lse = ref.attention_lse(q, k, v, causal=True)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    # Rows i >= Nk - 1 see every key, so they equal the non-causal rows.
    np.testing.assert_allclose(o[2:], ref.attention(q, k, v)[2:], rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q_heads, n_kv_heads", [(4, 1), (4, 2), (6, 3), (4, 4)])
def test_gqa_matches_torch_enable_gqa_and_repeated_heads(n_q_heads, n_kv_heads, causal):
    q, k, v = _qkv((2, n_q_heads), 10, 12, 8, n_kv_heads=n_kv_heads)
    got = ref.attention(q, k, v, causal=causal)
    expected = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), is_causal=causal, enable_gqa=True).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    # The same by hand: query head h uses kv head h // group_size.
    group_size = n_q_heads // n_kv_heads
    for h in range(n_q_heads):
        one = ref.attention(q[:, h], k[:, h // group_size], v[:, h // group_size], causal=causal)
        np.testing.assert_allclose(got[:, h], one, rtol=1e-12, atol=1e-14)


def test_gqa_rejects_uneven_groups():
    q, k, v = _qkv((1, 4), 3, 3, 2, n_kv_heads=3)
    with pytest.raises(ValueError, match="cannot be shared evenly"):
        ref.attention(q, k, v)


def test_scale_argument():
    q, k, v = _qkv((2,), 6, 6, 8)
    expected = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), scale=0.7).numpy()
    np.testing.assert_allclose(ref.attention(q, k, v, scale=0.7), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_matches_torch_logsumexp(causal):
    q, k, v = _qkv((2, 3), 13, 9, 8, scale=3.0)
    s = _t(q) @ _t(k).transpose(-1, -2) / math.sqrt(8)
    if causal:
        s = s.masked_fill(~torch.ones(13, 9, dtype=torch.bool).tril(), float("-inf"))
    o, lse = ref.attention_lse(q, k, v, causal=causal)
    np.testing.assert_allclose(lse, torch.logsumexp(s, dim=-1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(o, ref.attention(q, k, v, causal=causal), rtol=0, atol=0)


def test_lse_recovers_the_weights():
    """What lse is for: exp(s - lse) are the attention weights (the backward pass recomputes them so)."""
    q, k, v = _qkv((), 5, 7, 4)
    _, lse = ref.attention_lse(q, k, v)
    p = np.exp(q @ k.T / 2.0 - lse[:, None])
    np.testing.assert_allclose(p, ref.softmax(q @ k.T / 2.0), rtol=1e-12)


def test_large_scores_stay_finite():
    q, k, v = _qkv((2,), 16, 16, 16, scale=math.sqrt(1000.0))
    for causal in (False, True):
        o, lse = ref.attention_lse(q, k, v, causal=causal)
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
        assert np.abs(lse).max() > 709  # exp would overflow here without the max trick
        expected = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), is_causal=causal).numpy()
        np.testing.assert_allclose(o, expected, rtol=1e-9, atol=1e-11)


# -- streaming algorithms ----------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 2, 3, 7, 16, 64, 100])
def test_online_softmax_matches_softmax(block_size):
    x = RNG.normal(size=(2, 3, 37)) * 10
    x[0, 0] = np.sort(x[0, 0])  # the max changes at every block
    x[1, 2] += 1000.0
    np.testing.assert_allclose(ref.online_softmax(x, block_size), torch.softmax(_t(x), dim=-1).numpy(), rtol=1e-12, atol=1e-300)


def test_online_softmax_states_end_at_the_row_max_and_sum():
    x = RNG.normal(size=23)
    states = ref.online_softmax_states(x, 5)
    assert len(states) == 5  # four full blocks and a tail of three
    m, l = states[-1]
    assert m == x.max()
    assert math.isclose(l, float(np.exp(x - x.max()).sum()), rel_tol=1e-12)
    assert all(a[0] <= b[0] for a, b in zip(states, states[1:]))  # the running max only grows


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "batch, n_q, n_k, d, block_m, block_n",
    [((), 8, 8, 4, 4, 4), ((), 10, 10, 4, 4, 3), ((2,), 13, 7, 5, 3, 2), ((2,), 7, 13, 5, 2, 3),
     ((2, 2), 20, 20, 8, 1, 1), ((), 6, 9, 4, 64, 64), ((1, 3), 33, 33, 16, 16, 8)],
)
def test_tiled_attention_matches_torch(batch, n_q, n_k, d, block_m, block_n, causal):
    q, k, v = _qkv(batch, n_q, n_k, d, scale=2.0)
    o, lse = ref.tiled_attention(q, k, v, block_m, block_n, causal=causal)
    expected = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), is_causal=causal).numpy()
    np.testing.assert_allclose(o, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref.attention_lse(q, k, v, causal=causal)[1], rtol=1e-12)


def test_tiled_attention_gqa():
    q, k, v = _qkv((2, 4), 12, 12, 8, n_kv_heads=2)
    o, lse = ref.tiled_attention(q, k, v, 5, 4, causal=True)
    expected = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), is_causal=True, enable_gqa=True).numpy()
    np.testing.assert_allclose(o, expected, rtol=1e-10, atol=1e-12)


def test_tiled_attention_never_builds_the_score_matrix():
    """Peak memory of a tile loop stays far below one Nq x Nk float64 matrix."""
    import tracemalloc

    n, d = 1024, 16
    q, k, v = _qkv((), n, n, d)
    tracemalloc.start()
    ref.tiled_attention(q, k, v, 64, 64, causal=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < n * n * 8 / 8, peak  # well under an eighth of the 8 MiB score matrix
