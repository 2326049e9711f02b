"""Lesson 12's kernels: packed documents (cu_seqlens), soft-capping, ALiBi and sink logits.

Forward (o and lse) and backward (dq, dk, dv and d_sink_logits through
autograd) of each modification alone and of all of them together with causal,
the window and sinks, against the float64 references; GQA/MQA, strided
layouts, N not a multiple of the tiles. No NaN where a row's first tile holds
nothing it may see. Tile skipping observed in the interpreter: every tile
holding a visible pair is visited once, no other, and only partial tiles are
masked. The ValueErrors, one per bad value. Plain calls still take the old
kernels.
"""

import re

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import numpy as np
import pytest
import torch

from conftest import DEVICE, ON_GPU, tolerance
from course_utils import references as ref
from course_utils.kernels import backward as bw
from course_utils.kernels import dispatch, flash_attention, flash_attention_with_lse, forward

BF16 = ON_GPU and course_utils.ENV.bf16_ok


def _inputs(hq, hkv, n, d, dtype=torch.float32, layout="contiguous", seed=0, b=1):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv, hkv, hq))
    if layout == "bnhd":  # [B, N, H, D] memory viewed as [B, H, N, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert not q.is_contiguous()
    elif layout == "sliced":  # a head-dim stride of 2
        q, k, v = (torch.stack([t, t], dim=-1)[..., 0] for t in (q, k, v))
        assert q.stride(-1) == 2
    return q, k, v, do


def _np(t):
    return t.detach().double().cpu().numpy()


def _keywords(hq, kwargs):
    """(torch keywords for the kernels, NumPy keywords for the references) from plain Python values."""
    t_kw, np_kw = {}, {}
    for key, val in kwargs.items():
        if key == "cu_seqlens":
            t_kw[key] = torch.tensor(val, dtype=torch.int32, device=DEVICE)
            np_kw[key] = np.asarray(val)
        elif key in ("alibi_slopes", "sink_logits"):
            val = list(val)[:hq]
            t_kw[key] = torch.tensor(val, dtype=torch.float32, device=DEVICE)
            np_kw[key] = np.asarray(val, dtype=np.float64)
        else:
            t_kw[key] = np_kw[key] = val
    return t_kw, np_kw


SLOPES = [0.5, 0.25, 0.125, 0.0625]
SINKS = [1.0, -0.5, 2.5, 0.0]
ALL = dict(cu_seqlens=[0, 21, 90, 91, 150], causal=True, window_size=30, sink_size=5, softcap=4.0,
           alibi_slopes=SLOPES, sink_logits=SINKS)
CASES = [
    # hq, hkv, n, d, dtype, layout, keywords
    (2, 1, 130, 16, torch.float32, "contiguous", dict(cu_seqlens=[0, 30, 37, 130])),  # blocks across documents
    (2, 2, 130, 16, torch.float32, "bnhd", dict(cu_seqlens=[0, 64, 100, 130], causal=True)),  # one on a tile edge
    (2, 2, 100, 32, torch.float32, "contiguous", dict(softcap=2.0, causal=True)),
    (4, 2, 100, 16, torch.float32, "sliced", dict(alibi_slopes=SLOPES)),
    (2, 1, 100, 24, torch.float32, "contiguous", dict(sink_logits=[0.5, 3.0], causal=True)),  # D padded
    (4, 2, 150, 32, torch.float32, "bnhd", ALL),
    (4, 1, 150, 16, torch.float32, "contiguous", dict(ALL, causal=False, window_size=None, sink_size=0)),
]
if BF16:  # the GPU's own blocks (128 x 64), bf16
    CASES += [(8, 2, 1000, 128, torch.bfloat16, "bnhd", dict(ALL, cu_seqlens=[0, 300, 301, 700, 1000],
                                                             window_size=256, alibi_slopes=SLOPES * 2,
                                                             sink_logits=SINKS * 2)),
              (4, 4, 600, 64, torch.bfloat16, "contiguous", dict(cu_seqlens=[0, 100, 600], softcap=50.0))]


def _tol(dtype, what="o"):
    """Tolerances here: conftest's for the dtype, an fp32 grade coarser for gradients and bf16's sums."""
    tol = tolerance(dtype)
    return dict(atol=tol, rtol=tol) if what == "o" or dtype != torch.float32 or ON_GPU else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hq,hkv,n,d,dtype,layout,kwargs", CASES)
def test_mods_forward_and_backward_match_references(hq, hkv, n, d, dtype, layout, kwargs):
    q, k, v, do = _inputs(hq, hkv, n, d, dtype, layout)
    t_kw, np_kw = _keywords(hq, kwargs)
    o, lse = flash_attention_with_lse(q, k, v, **t_kw)
    want_o, want_lse = ref.attention_lse(_np(q), _np(k), _np(v), **np_kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    np.testing.assert_allclose(_np(o), want_o, **_tol(dtype))
    np.testing.assert_allclose(_np(lse), want_lse, atol=tolerance(dtype), rtol=0)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if "sink_logits" in t_kw:
        t_kw["sink_logits"] = t_kw["sink_logits"].clone().requires_grad_()
        leaves.append(t_kw["sink_logits"])
    out = flash_attention(*leaves[:3], **t_kw)
    torch.testing.assert_close(out.detach(), o)  # the same kernel as flash_attention_with_lse
    out.backward(do)
    want = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), **np_kw)
    assert len(want) == len(leaves)
    for name, leaf, w in zip(("dq", "dk", "dv", "d_sink_logits"), leaves, want):
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), name
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(_np(leaf.grad) / scale, w / scale, **_tol(dtype, "grad"), err_msg=name)


def test_each_modification_changes_the_answer():
    """Guards the tests above: every keyword really acts (the plain answer is far off)."""
    q, k, v, _ = _inputs(2, 2, 100, 16)
    plain = flash_attention(q, k, v, True)
    for key, val in dict(cu_seqlens=[0, 40, 100], softcap=1.0, alibi_slopes=[0.3, 0.3], sink_logits=[2.0, 2.0]).items():
        t_kw, _ = _keywords(2, {key: val})
        changed = flash_attention(q, k, v, True, **t_kw)
        assert (changed - plain).abs().max() > 0.05, key


def test_sink_logits_alone_get_a_gradient():
    """Only the sink logits require grad: autograd still runs, and their gradient is the reference's."""
    q, k, v, do = _inputs(2, 1, 70, 16)
    z = torch.tensor([0.3, -1.2], device=DEVICE, requires_grad=True)
    flash_attention(q, k, v, True, sink_logits=z).backward(do)
    want = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=True, sink_logits=_np(z))[3]
    np.testing.assert_allclose(_np(z.grad), want, **_tol(torch.float32, "grad"))


@pytest.mark.parametrize("kwargs", [
    dict(cu_seqlens=[0, 5, 100], causal=False),  # block 0: rows 5.. see nothing of tile 0..31 but key 0..4
    dict(cu_seqlens=[0, 40, 41, 100], causal=True),  # a one-token document in the middle of a block
    dict(cu_seqlens=[0, 3, 100], causal=True, window_size=4, sink_size=2),  # the sink tile: doc 2 sees none of it
    dict(cu_seqlens=[0, 70, 100], causal=True, softcap=0.5, sink_logits=[-30.0]),  # a sink of ~zero mass
])
def test_rows_whose_first_tile_is_empty_give_no_nan(kwargs):
    q, k, v, do = _inputs(1, 1, 100, 16)
    q = q * (5 if ON_GPU else 20)  # large scores (tf32 on a GPU: its rounding grows with them)
    t_kw, np_kw = _keywords(1, kwargs)
    o, lse = forward.flash_attention_mods_forward(q, k, v, kwargs.get("causal", False), block_m=64, block_n=32,
                                                  **{key: val for key, val in t_kw.items() if key != "causal"})
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    want_o, want_lse = ref.attention_lse(_np(q), _np(k), _np(v), **np_kw)
    np.testing.assert_allclose(_np(o), want_o, **_tol(torch.float32))
    grads = bw.attention_backward(q, k, v, o, lse, do, **t_kw)
    assert all(torch.isfinite(g).all() for g in grads)


def test_plain_calls_take_the_old_kernels(monkeypatch):
    """Without lesson 12's keywords kernel D is never launched (plain calls compile exactly as before)."""
    launched = []
    real = forward.flash_attention_mods_forward
    monkeypatch.setattr(forward, "flash_attention_mods_forward", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    q, k, v, _ = _inputs(2, 1, 40, 16)
    dispatch.launch_forward(q, k, v, True)
    dispatch.launch_forward(q, k, v, True, 8, 2)
    assert launched == []
    dispatch.launch_forward(q, k, v, True, softcap=3.0)
    assert launched == [1]


# ---------------------------------------------------------------------------
# Bad input: one ValueError of one sentence per bad value
# ---------------------------------------------------------------------------
def _bad(name):
    q = torch.zeros(1, 2, 16, 16, device=DEVICE)
    cu = lambda *xs, dtype=torch.int32: torch.tensor(xs, dtype=dtype, device=DEVICE)  # noqa: E731
    per_head = lambda *xs, dtype=torch.float32: torch.tensor(xs, dtype=dtype, device=DEVICE)  # noqa: E731
    return {
        "start": dict(cu_seqlens=cu(1, 8, 16)),
        "end": dict(cu_seqlens=cu(0, 8, 15)),
        "increasing": dict(cu_seqlens=cu(0, 8, 8, 16)),
        "int64": dict(cu_seqlens=cu(0, 16, dtype=torch.int64)),
        "list": dict(cu_seqlens=[0, 16]),
        "2-d": dict(cu_seqlens=cu(0, 16)[None]),
        "softcap 0": dict(softcap=0.0),
        "softcap < 0": dict(softcap=-2.0),
        "softcap nan": dict(softcap=float("nan")),
        "softcap bool": dict(softcap=True),
        "slopes shape": dict(alibi_slopes=per_head(0.1, 0.2, 0.3)),
        "slopes dtype": dict(alibi_slopes=per_head(0.1, 0.2, dtype=torch.float64)),
        "sinks shape": dict(sink_logits=per_head(0.1)),
        "sinks dtype": dict(sink_logits=per_head(0.1, 0.2, dtype=torch.float16)),
    }[name], q


@pytest.mark.parametrize("name,words", [
    ("start", "start at 0"), ("end", "end at N = 16"), ("increasing", "strictly increasing"),
    ("int64", "torch.int32"), ("list", "int32 torch tensor"), ("2-d", "1-d"),
    ("softcap 0", "above 0"), ("softcap < 0", "above 0"), ("softcap nan", "finite"), ("softcap bool", "number"),
    ("slopes shape", "alibi_slopes must have one value per query head"), ("slopes dtype", "torch.float32"),
    ("sinks shape", "sink_logits must have one value per query head"), ("sinks dtype", "torch.float32"),
])
def test_bad_values_get_one_sentence(name, words):
    kwargs, q = _bad(name)
    for fn in (flash_attention, flash_attention_with_lse):
        with pytest.raises(ValueError, match=re.escape(words)) as info:
            fn(q, q, q, True, **kwargs)
        message = str(info.value)
        assert message.endswith(".") and message.count(". ") == 0, message


def test_cu_seqlens_needs_batch_size_one():
    q = torch.zeros(2, 1, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("batch size 1")):
        flash_attention(q, q, q, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32, device=DEVICE))


# ---------------------------------------------------------------------------
# Tile skipping: the tile bounds against a brute-force mask, and observed in the interpreter
# ---------------------------------------------------------------------------
TILE_CASES = [
    # n, keywords (causal, window_size, sink_size, cu_seqlens)
    (200, dict(cu_seqlens=[0, 21, 90, 91, 200], causal=False)),
    (200, dict(cu_seqlens=[0, 21, 90, 91, 200], causal=True)),
    (190, dict(cu_seqlens=[0, 64, 128, 190], causal=True)),  # documents on tile edges: every tile full or skipped
    (200, dict(cu_seqlens=[0, 150, 200], causal=True, window_size=40)),
    (200, dict(cu_seqlens=[0, 37, 200], causal=True, window_size=20, sink_size=45)),  # sinks beyond document 1
    (200, dict(cu_seqlens=[0, 100, 200], causal=True, window_size=20, sink_size=33)),
]


def _tile_states(mask, rows, cols):
    """{(row tile start, col tile start): every pair visible?} for the tiles holding a visible pair.

    Columns past the end are padding no row sees (a tile running past the last key must be masked: its
    missing keys load as zeros, scores of 0); rows past the end are not stored, so they do not count."""
    mask = np.pad(mask, ((0, 0), (0, -mask.shape[1] % cols)))
    out = {}
    for bi in range(0, mask.shape[0], rows):
        for bj in range(0, mask.shape[1], cols):
            tile = mask[bi:bi + rows, bj:bj + cols]
            if tile.any():
                out[(bi, bj)] = bool(tile.all())
    return out


def _mask(n, kwargs):
    return ref._score_mask(n, n, kwargs.get("causal", False), kwargs.get("window_size"), kwargs.get("sink_size", 0),
                           np.asarray(kwargs["cu_seqlens"])) & np.ones((n, n), dtype=bool)


def _check_tiles(got, want, sinks):
    """Visited once each, exactly the visible tiles; masked exactly the partial ones (with sinks, a tile the
    sinks make full may still be masked: only the window's full tiles are known in advance)."""
    assert set(got) == set(want), (f"missing {sorted(set(want) - set(got))}, "
                                   f"visited though invisible {sorted(set(got) - set(want))}")
    assert all(masked or want[t] for t, masked in got.items()), "a partial tile was computed without the mask"
    if not sinks:
        assert all(masked != want[t] for t, masked in got.items()), "a full tile was masked"


@pytest.mark.parametrize("block_m,block_n", [(64, 32), (32, 32), (128, 16)])
@pytest.mark.parametrize("n,kwargs", TILE_CASES)
def test_mods_tile_bounds_visit_exactly_the_visible_tiles(n, kwargs, block_m, block_n):
    want = _tile_states(_mask(n, kwargs), block_m, block_n)
    got = {}
    for start_m in range(-(-n // block_m)):
        for lo, f_lo, f_hi, hi in forward.mods_tile_bounds(start_m, block_m, block_n, n, **kwargs):
            assert lo <= f_lo <= f_hi <= hi and lo % block_n == 0
            assert all(x % block_n == 0 or x == hi for x in (f_lo, f_hi)), "a phase starts inside a tile"
            for start, masked in [(t, True) for t in range(lo, f_lo, block_n)] + \
                                 [(t, False) for t in range(f_lo, f_hi, block_n)] + \
                                 [(t, True) for t in range(f_hi, hi, block_n)]:
                assert (start_m * block_m, start) not in got, "a tile visited twice"
                got[(start_m * block_m, start)] = masked
    _check_tiles(got, want, kwargs.get("sink_size", 0) > 0)


def test_mods_tile_bounds_on_random_cases():
    """Fresh random documents, windows, sinks and tiles (no documents too): the same exact-visit rule."""
    rng = np.random.default_rng(1212)
    for _ in range(150):
        n = int(rng.integers(1, 160))
        block_m, block_n = (int(x) for x in rng.choice([16, 32, 64], size=2))
        cuts = sorted(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 6))), replace=False)) if n > 1 else []
        kwargs = dict(cu_seqlens=[0, *map(int, cuts), n], causal=bool(rng.integers(0, 2)))
        if kwargs["causal"] and rng.integers(0, 2):
            kwargs.update(window_size=int(rng.integers(1, 80)), sink_size=int(rng.integers(0, 40)))
        with_docs = bool(rng.integers(0, 4))
        want = _tile_states(_mask(n, kwargs) if with_docs else
                            _mask(n, dict(kwargs, cu_seqlens=[0, n])), block_m, block_n)
        got = {}
        for start_m in range(-(-n // block_m)):
            bounds = forward.mods_tile_bounds(start_m, block_m, block_n, n,
                                              **dict(kwargs, cu_seqlens=kwargs["cu_seqlens"] if with_docs else None))
            for lo, f_lo, f_hi, hi in bounds:
                for start in range(lo, hi, block_n):
                    assert (start_m * block_m, start) not in got, (n, block_m, block_n, kwargs)
                    got[(start_m * block_m, start)] = not f_lo <= start < f_hi
        _check_tiles(got, want, kwargs.get("sink_size", 0) > 0)


def test_packing_cost_follows_the_visible_pairs():
    """16 documents packed into one sequence: about 1/16 of the causal tiles are visited."""
    n, block = 4096, 64
    cu = np.linspace(0, n, 17).astype(int)
    causal = sum(hi - lo for s in range(n // block) for (lo, _, _, hi) in
                 forward.mods_tile_bounds(s, block, block, n, causal=True)[1:])
    packed = sum(-(-(hi - lo) // block) for s in range(n // block) for (lo, _, _, hi) in
                 forward.mods_tile_bounds(s, block, block, n, cu_seqlens=cu, causal=True)[1:])
    assert packed / (causal // block) < 1.3 / 16


def _recorder(monkeypatch, module, name, rows_arg, lo_arg, mask_arg):
    """Replace jit helper ``name`` by a wrapper recording (first row/key, lo, hi, MASK) per call."""
    calls = []

    def value(x):
        x = getattr(x, "value", x)
        return int(np.asarray(x.handle.data).reshape(-1)[0]) if hasattr(x, "handle") else int(x)

    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((value(args[rows_arg]), value(args[lo_arg]), value(args[lo_arg + 1]), bool(value(args[mask_arg]))))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _visited(calls, step):
    seen = {}
    for first, lo, hi, masked in calls:
        for start in range(lo, hi, step):
            assert (first, start) not in seen, f"tile {start} visited twice by the block starting at {first}"
            seen[(first, start)] = masked
    return seen


@pytest.mark.interpreter("records the loops in Triton's interpreter")
@pytest.mark.parametrize("n,kwargs", [TILE_CASES[1], TILE_CASES[4]])
def test_kernels_visit_exactly_the_visible_tiles(monkeypatch, n, kwargs):
    """Forward, dQ and dK/dV: every tile holding a visible pair once, no other; only partial tiles masked."""
    q, k, v, do = _inputs(1, 1, n, 16)
    t_kw, _ = _keywords(1, dict(kwargs, softcap=3.0))
    mask = _mask(n, kwargs)
    sinks = kwargs.get("sink_size", 0) > 0
    calls = _recorder(monkeypatch, forward, "_attn_fwd_inner_mods", 10, 15, 23)
    o, lse = forward.flash_attention_mods_forward(q, k, v, block_m=64, block_n=32, **t_kw)
    _check_tiles(_visited(calls, 32), _tile_states(mask, 64, 32), sinks)
    calls = _recorder(monkeypatch, bw, "_dq_inner_mods", 11, 15, 27)
    calls_kv = _recorder(monkeypatch, bw, "_dkdv_inner_mods", 12, 16, 28)
    bw.attention_backward(q, k, v, o, lse, do, config=bw.BackwardConfig(16, 32, 64, 32), **t_kw)
    _check_tiles(_visited(calls, 32), _tile_states(mask, 64, 32), sinks)
    # dK/dV: key blocks of 32 on the rows, query tiles of 16 on the columns.
    _check_tiles(_visited(calls_kv, 16), _tile_states(mask.T, 32, 16), sinks)
