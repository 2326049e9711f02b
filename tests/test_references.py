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


# -- lesson 12: packed documents, soft-capping, ALiBi, sink logits ---------------------------------
def _torch_mods(q, k, v, causal=False, window_size=None, sink_size=0, cu_seqlens=None, softcap=None,
                alibi_slopes=None, sink_logits=None):
    """The issue's semantics written directly in torch float64 (autograd differentiates it): the sink
    is one more column of logits whose value is 0; the document mask from segment ids by hand."""
    n_q_heads, n = q.shape[-3], q.shape[-2]
    group = n_q_heads // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes[:, None, None] * (i - j).abs()
    visible = torch.ones(n, n, dtype=torch.bool)
    if cu_seqlens is not None:
        seg = torch.zeros(n, dtype=torch.long)
        for start in cu_seqlens[1:-1]:
            seg[int(start):] += 1
        visible &= seg[:, None] == seg[None, :]
    if causal:
        visible &= j <= i
    if window_size is not None:
        visible &= (i - j < window_size) | (j < sink_size)
    s = s.masked_fill(~visible, float("-inf"))
    if sink_logits is not None:
        s = torch.cat([s, sink_logits[:, None, None].expand(*s.shape[:-1], 1)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[..., :1, :])], dim=-2)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


MODS_CASES = [
    # hq, hkv, n, kwargs
    (2, 2, 12, dict(cu_seqlens=[0, 5, 12])),
    (2, 1, 12, dict(cu_seqlens=[0, 1, 7, 12], causal=True)),
    (2, 2, 10, dict(softcap=1.5)),
    (2, 2, 10, dict(softcap=0.7, causal=True)),
    (3, 3, 9, dict(alibi_slopes=[0.5, 0.25, 0.125])),
    (2, 1, 9, dict(sink_logits=[0.3, -1.0])),
    (2, 2, 9, dict(sink_logits=[2.0, 0.0], causal=True)),
    (4, 2, 16, dict(cu_seqlens=[0, 3, 9, 16], causal=True, window_size=4, sink_size=2, softcap=2.0,
                    alibi_slopes=[0.5, 0.25, 0.1, 0.0], sink_logits=[0.0, 1.0, -2.0, 3.0])),
    (2, 2, 13, dict(cu_seqlens=[0, 6, 13], softcap=3.0, alibi_slopes=[0.2, 0.4], sink_logits=[1.0, -1.0])),
]


def _mods_inputs(hq, hkv, n, kwargs, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.normal(size=(2, h, n, 8)) * s for h, s in ((hq, 2.0), (hkv, 2.0), (hkv, 1.0), (hq, 1.0)))
    np_kwargs = {key: (np.asarray(val, dtype=np.int32) if key == "cu_seqlens" else
                       np.asarray(val) if isinstance(val, list) else val) for key, val in kwargs.items()}
    t_kwargs = {key: (torch.tensor(val, dtype=torch.float64) if isinstance(val, list) and key != "cu_seqlens"
                      else val) for key, val in kwargs.items()}
    return q, k, v, do, np_kwargs, t_kwargs


@pytest.mark.parametrize("hq,hkv,n,kwargs", MODS_CASES)
def test_score_mods_match_torch_autograd(hq, hkv, n, kwargs):
    """Forward, lse and every gradient (the sink logits' and the soft-cap's 1 - tanh^2 included) against
    torch autograd of the semantics written directly, in float64."""
    q, k, v, do, np_kwargs, t_kwargs = _mods_inputs(hq, hkv, n, kwargs)
    o, lse = ref.attention_lse(q, k, v, **np_kwargs)
    tq, tk, tv = (_t(x).requires_grad_() for x in (q, k, v))
    if "sink_logits" in t_kwargs:
        t_kwargs["sink_logits"].requires_grad_()
    to, tlse = _torch_mods(tq, tk, tv, **t_kwargs)
    np.testing.assert_allclose(o, to.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, tlse.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.attention(q, k, v, **np_kwargs), o, rtol=0, atol=0)
    to.backward(_t(do))
    grads = ref.attention_backward(q, k, v, do, **np_kwargs)
    want = [tq.grad, tk.grad, tv.grad]
    if "sink_logits" in kwargs:
        assert len(grads) == 4 and grads[3].shape == (hq,)
        want.append(t_kwargs["sink_logits"].grad)
    else:
        assert len(grads) == 3
    for name, got, expected in zip(("dq", "dk", "dv", "d_sink_logits"), grads, want):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_mods_without_keywords_return_what_they_always_did():
    q, k, v, do, _, _ = _mods_inputs(2, 1, 10, {})
    got = ref.attention_backward(q, k, v, do, causal=True)
    assert len(got) == 3
    tq, tk, tv = (_t(x).requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True).backward(_t(do))
    for g, t in zip(got, (tq, tk, tv)):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_document_mask_by_hand():
    got = ref.document_mask(np.array([0, 2, 5], dtype=np.int32), 5)
    assert got.astype(int).tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1],
                                        [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    # Packed documents are independent sequences: each one's attention alone.
    q, k, v = _qkv((1, 2), 9, 9, 4)
    cu = np.array([0, 4, 9])
    packed = ref.attention(q, k, v, causal=True, cu_seqlens=cu)
    for a, b in zip(cu[:-1], cu[1:]):
        alone = ref.attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], causal=True)
        np.testing.assert_allclose(packed[..., a:b, :], alone, rtol=1e-12, atol=1e-14)


def test_sink_logit_takes_mass_but_adds_no_value():
    """Equal scores (q = 0): a row seeing n keys gives each exp(0) / (n + exp(z)), the sink exp(z) / (...)."""
    q = np.zeros((1, 1, 3, 4))
    k = RNG.normal(size=(1, 1, 3, 4))
    v = np.ones((1, 1, 3, 4))
    z = np.log(2.0)
    o, lse = ref.attention_lse(q, k, v, causal=True, sink_logits=np.array([z]))
    # Row i sees i + 1 keys: o = (i + 1) / (i + 1 + 2), lse = log(i + 1 + 2).
    np.testing.assert_allclose(o[0, 0, :, 0], [1 / 3, 2 / 4, 3 / 5], rtol=1e-12)
    np.testing.assert_allclose(lse[0, 0], np.log([3.0, 4.0, 5.0]), rtol=1e-12)
    # A very negative sink logit is no sink at all.
    o_none = ref.attention(q, k, v, causal=True, sink_logits=np.array([-800.0]))
    np.testing.assert_allclose(o_none, v, rtol=1e-12)


def test_alibi_penalises_distance_and_softcap_bounds_the_scores():
    q = np.zeros((1, 1, 4, 4))
    k = np.zeros((1, 1, 4, 4))
    v = np.eye(4)[None, None]  # o[i] is row i's weights
    o = ref.attention(q, k, v, alibi_slopes=np.array([np.log(2.0)]))
    w = 2.0 ** -np.abs(np.arange(4)[:, None] - np.arange(4)[None, :])  # exp(-ln2 * |i - j|)
    np.testing.assert_allclose(o[0, 0], w / w.sum(axis=1, keepdims=True), rtol=1e-12)
    # Soft-capping: scores of +-1000 become +-c * tanh(1000 / c) ~ +-c.
    q = np.array([[[[1.0], [-1.0]]]]) * np.ones((1, 1, 2, 16)) * 500 / 4
    k = np.ones((1, 1, 2, 16)) / 4
    _, lse = ref.attention_lse(q, k, np.ones((1, 1, 2, 16)), softcap=5.0)
    s = 5.0 * np.tanh(np.array([1000.0, -1000.0]) / 4 / 5.0)
    np.testing.assert_allclose(lse[0, 0], s + np.log(2.0), rtol=1e-12)


@pytest.mark.parametrize("kwargs,words", [
    (dict(cu_seqlens=[1, 4, 8]), "start at 0"),
    (dict(cu_seqlens=[0, 4, 7]), "end at N = 8"),
    (dict(cu_seqlens=[0, 4, 4, 8]), "strictly increasing"),
    (dict(cu_seqlens=[0.0, 8.0]), "integers"),
    (dict(softcap=0.0), "above 0"),
    (dict(softcap=-1.0), "above 0"),
    (dict(alibi_slopes=[0.1, 0.2, 0.3]), "one value per query head"),
    (dict(sink_logits=[0.1]), "one value per query head"),
])
def test_mods_references_refuse_bad_values(kwargs, words):
    q, k, v = _qkv((1, 2), 8, 8, 4)
    kwargs = {key: np.asarray(val) if isinstance(val, list) else val for key, val in kwargs.items()}
    with pytest.raises(ValueError, match=words):
        ref.attention(q, k, v, **kwargs)
