"""Lesson 08's kernels: sliding-window attention with sinks, forward and backward.

Against the float64 references (course_utils.references with window_size and
sink_size): MHA/GQA/MQA, non-contiguous layouts, N not a multiple of the
blocks, window 1, a window longer than N, more sinks than N, fp32 and fp16 on
the CPU (bf16 too on a GPU). The tile bounds against a brute-force mask, the
public keywords' ValueErrors, and the one-copy rule for the lesson notebook.
"""

import ast
import inspect
import re
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)
import course_utils.plots

import numpy as np
import pytest
import torch

from course_utils import references as ref
from course_utils.kernels import backward as bw
from course_utils.kernels import flash_attention, flash_attention_with_lse, forward

ROOT = Path(__file__).resolve().parent.parent
DEVICE = course_utils.ENV.device

# (atol, rtol) for o and the gradients, atol for lse.
TOL = {torch.float32: (2e-5, 2e-5, 1e-5) if DEVICE == "cpu" else (1e-2, 1e-2, 3e-3),
       torch.float16: (1e-2, 1e-2, 1e-3), torch.bfloat16: (6e-2, 6e-2, 1e-2)}


def _inputs(b, hq, hkv, n, d, dtype, layout="contiguous", seed=0):
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


FORWARD_CASES = [
    # b, hq, hkv, n, d, dtype, layout, window_size, sink_size
    (1, 2, 2, 100, 32, torch.float32, "contiguous", 1, 0),  # window 1: each query sees only itself
    (1, 4, 2, 77, 48, torch.float16, "bnhd", 20, 3),  # GQA, partial sink tile, D padded, transposed
    (2, 3, 1, 130, 16, torch.float32, "sliced", 33, 40),  # MQA, sinks past the first tile, window not a tile
    (1, 2, 1, 90, 32, torch.float32, "contiguous", 500, 0),  # window > N: plain causal
    (1, 2, 2, 70, 32, torch.float16, "contiguous", 5, 200),  # sinks > N: plain causal again
    (1, 2, 1, 256, 32, torch.float32, "contiguous", 64, 32),  # N, window and sinks multiples of the tiles
]
if DEVICE == "cuda" and course_utils.ENV.bf16_ok:  # the GPU's own blocks (128 x 64) and bf16
    FORWARD_CASES += [(2, 8, 2, 1000, 128, torch.bfloat16, "bnhd", 256, 4),
                      (1, 4, 1, 700, 64, torch.float16, "contiguous", 100, 130)]


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype,layout,window_size,sink_size", FORWARD_CASES)
def test_window_forward_matches_reference(b, hq, hkv, n, d, dtype, layout, window_size, sink_size):
    q, k, v, _ = _inputs(b, hq, hkv, n, d, dtype, layout)
    o, lse = flash_attention_with_lse(q, k, v, causal=True, window_size=window_size, sink_size=sink_size)
    want_o, want_lse = ref.attention_lse(_np(q), _np(k), _np(v), causal=True,
                                         window_size=window_size, sink_size=sink_size)
    atol, rtol, lse_atol = TOL[dtype]
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    np.testing.assert_allclose(_np(o), want_o, atol=atol, rtol=rtol)
    np.testing.assert_allclose(_np(lse), want_lse, atol=lse_atol, rtol=0)
    # The output-only entry point runs the same kernel.
    torch.testing.assert_close(flash_attention(q, k, v, True, window_size=window_size, sink_size=sink_size), o)


def test_window_changes_the_answer():
    """Guards the tests above: the window really masks (the plain causal answer is far off)."""
    q, k, v, _ = _inputs(1, 2, 2, 64, 16, torch.float32)
    windowed = flash_attention(q, k, v, causal=True, window_size=8)
    plain = flash_attention(q, k, v, causal=True)
    assert (windowed - plain).abs().max() > 0.1


def test_window_as_long_as_n_is_plain_causal():
    q, k, v, _ = _inputs(1, 2, 1, 80, 32, torch.float32, seed=3)
    atol, rtol, _ = TOL[torch.float32]
    torch.testing.assert_close(flash_attention(q, k, v, True, window_size=80),
                               flash_attention(q, k, v, True), atol=atol, rtol=rtol)


@pytest.mark.parametrize("sink_size", [0, 3])
def test_a_window_of_n_keys_or_more_runs_plain_causal_attention(monkeypatch, sink_size):
    """dispatch.window_in_effect: a window of at least N keys hides nothing the causal mask does not, and its sinks
    select nothing more, so the public entries run plain causal attention's kernels (forward and backward), the same
    o, lse and gradients bit for bit; a window of N - 1 keys hides key 0 from the last query and keeps the window's
    kernel. The window's kernels still take such windows when called directly (lesson 08's forward launcher and lesson
    07's window backward, checked here)."""
    from conftest import record_calls

    from course_utils.kernels import dispatch

    n = 80
    q, k, v, do = _inputs(1, 4, 2, n, 32, torch.float32, seed=5)
    assert dispatch.window_in_effect(q, n, sink_size) == (None, 0)
    assert dispatch.window_in_effect(q, n + 100, sink_size) == (None, 0)
    assert dispatch.window_in_effect(q, n - 1, sink_size) == (n - 1, sink_size)
    assert dispatch.window_in_effect(q, None, 0) == (None, 0)
    calls = record_calls(monkeypatch, (forward, "flash_attention_window_forward"),
                         (forward, "flash_attention_gqa_forward"))
    plain = flash_attention_with_lse(q, k, v, True)
    for window_size in (n, n + 100):
        got = flash_attention_with_lse(q, k, v, True, window_size=window_size, sink_size=sink_size)
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), window_size
    assert calls == ["flash_attention_gqa_forward"] * 3
    flash_attention_with_lse(q, k, v, True, window_size=n - 1, sink_size=sink_size)
    assert calls[-1] == "flash_attention_window_forward"
    grads = []
    for window_size in (None, n):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        sinks = sink_size if window_size else 0
        flash_attention(*leaves, causal=True, window_size=window_size, sink_size=sinks).backward(do)
        grads.append([leaf.grad for leaf in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    o, lse = forward.flash_attention_window_forward(q, k, v, window_size=n + 100, sink_size=sink_size)
    want_o, want_lse = ref.attention_lse(_np(q), _np(k), _np(v), causal=True)
    atol, rtol, lse_atol = TOL[torch.float32]
    np.testing.assert_allclose(_np(o), want_o, atol=atol, rtol=rtol)
    np.testing.assert_allclose(_np(lse), want_lse, atol=lse_atol, rtol=0)
    got = bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=n + 100, sink_size=sink_size)
    want = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=True)  # lesson 07's window kernels too
    for g, w in zip(got, want):
        np.testing.assert_allclose(_np(g), w, atol=atol, rtol=rtol)


BACKWARD_CASES = [
    # b, hq, hkv, n, d, dtype, layout, window_size, sink_size
    (1, 2, 2, 100, 32, torch.float32, "contiguous", 1, 0),
    (1, 4, 2, 77, 24, torch.float32, "bnhd", 20, 3),  # GQA: dK/dV summed over the group, sinks
    (1, 3, 1, 90, 16, torch.float16, "contiguous", 17, 70),  # MQA, sinks across tiles
    (1, 2, 1, 60, 32, torch.float32, "sliced", 300, 0),  # window > N
]
if DEVICE == "cuda" and course_utils.ENV.bf16_ok:
    BACKWARD_CASES += [(1, 8, 2, 1000, 128, torch.bfloat16, "bnhd", 256, 4)]


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype,layout,window_size,sink_size", BACKWARD_CASES)
def test_window_backward_matches_reference(b, hq, hkv, n, d, dtype, layout, window_size, sink_size):
    q, k, v, do = _inputs(b, hq, hkv, n, d, dtype, layout, seed=1)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = flash_attention(*leaves, causal=True, window_size=window_size, sink_size=sink_size)
    o.backward(do)
    want = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=True,
                                  window_size=window_size, sink_size=sink_size)
    atol, rtol, _ = TOL[dtype]
    if dtype == torch.float16:
        atol = rtol = 2e-2
    elif dtype == torch.bfloat16:
        atol = rtol = 8e-2
    for name, leaf, w in zip(("dq", "dk", "dv"), leaves, want):
        assert leaf.grad.dtype == dtype and leaf.grad.shape == leaf.shape, name
        np.testing.assert_allclose(_np(leaf.grad), w, atol=atol, rtol=rtol, err_msg=name)


def test_sink_keys_collect_gradients_from_every_query():
    """dV of a sink key is the sum of P over ALL later queries, not only those within the window."""
    q, k, v, do = _inputs(1, 1, 1, 96, 16, torch.float32, seed=2)
    do = torch.ones_like(do)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    flash_attention(*leaves, causal=True, window_size=4, sink_size=1).backward(do)
    want_dv = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=True, window_size=4, sink_size=1)[2]
    atol, rtol, _ = TOL[torch.float32]
    np.testing.assert_allclose(_np(leaves[2].grad)[0, 0, 0], want_dv[0, 0, 0], atol=atol, rtol=rtol)
    # Queries 4.. see key 0 only as a sink: their share of dV[0] must be there.
    only_window = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=True, window_size=4)[2]
    assert abs(want_dv[0, 0, 0] - only_window[0, 0, 0]).max() > 1.0


def test_backward_launcher_with_other_blocks():
    q, k, v, do = _inputs(1, 4, 2, 75, 16, torch.float32, seed=4)
    o, lse = ref.attention_lse(_np(q), _np(k), _np(v), causal=True, window_size=9, sink_size=2)
    got = bw.attention_backward(q, k, v, torch.from_numpy(o).to(DEVICE, torch.float32), torch.from_numpy(lse).to(DEVICE, torch.float32), do,
                                causal=True, window_size=9, sink_size=2, config=bw.BackwardConfig(16, 32, 32, 16))
    want = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=True, window_size=9, sink_size=2)
    atol, rtol, _ = TOL[torch.float32]
    for g, w in zip(got, want):
        np.testing.assert_allclose(_np(g), w, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------
# The visible-tile bounds
# ---------------------------------------------------------------------------
def _visible_tiles(start_m, block_m, block_n, n, window_size, sink_size):
    """Brute force: the K/V tiles holding at least one key some row of the query block sees."""
    mask = ref.window_mask(n, n, window_size, sink_size)[start_m * block_m:(start_m + 1) * block_m]
    return {j // block_n for j in np.flatnonzero(mask.any(axis=0))}


@pytest.mark.parametrize("block_m,block_n", [(64, 32), (32, 32), (128, 64), (16, 16)])
def test_tile_bounds_visit_exactly_the_visible_tiles(block_m, block_n):
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 400))
        window_size = int(rng.integers(1, 2 * n + 2))
        sink_size = int(rng.choice([0, 1, 4, int(rng.integers(0, n + 40))]))
        for start_m in range(-(-n // block_m)):
            sink_end, band_start, band_end = forward.window_tile_bounds(
                start_m, block_m, block_n, n, window_size, sink_size)
            assert sink_end % block_n == 0 and band_start % block_n == 0 and sink_end <= band_start < band_end
            visited = set(range(0, sink_end // block_n)) | set(range(band_start // block_n, -(-band_end // block_n)))
            assert visited == _visible_tiles(start_m, block_m, block_n, n, window_size, sink_size), \
                (n, window_size, sink_size, start_m)


def test_tile_bounds_cost_grows_like_n_times_w():
    """At a fixed window the number of visited tiles per query block stays constant as N grows."""
    def tiles(n):
        total = 0
        for start_m in range(n // 128):
            sink_end, lo, hi = forward.window_tile_bounds(start_m, 128, 64, n, 1024, 4)
            total += sink_end // 64 + -(-hi // 64) - lo // 64
        return total
    assert tiles(65536) / tiles(32768) < 2.05


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    (dict(causal=False, window_size=8), "causal=True"),
    (dict(causal=True, window_size=0), "at least 1"),
    (dict(causal=True, window_size=2.5), "integer"),
    (dict(causal=True, window_size=True), "integer"),
    (dict(causal=True, window_size=8, sink_size=-1), "0 or more"),
    (dict(causal=True, window_size=8, sink_size=1.0), "integer"),
    (dict(causal=True, sink_size=4), "needs a window_size"),
])
def test_bad_window_values_get_one_sentence(kwargs, words):
    q, k, v, _ = _inputs(1, 1, 1, 16, 16, torch.float32)
    for fn in (flash_attention, flash_attention_with_lse):
        with pytest.raises(ValueError, match=re.escape(words)) as info:
            fn(q, k, v, **kwargs)
        message = str(info.value)
        assert message.endswith(".") and message.count(". ") == 0, message


@pytest.mark.parametrize("kwargs,words", [
    (dict(causal=False, window_size=8), "causal=True"),
    (dict(causal=True, sink_size=4), "needs a window_size"),
])
def test_references_refuse_what_the_kernels_refuse(kwargs, words):
    x = np.zeros((4, 8))
    for fn in (ref.attention, ref.attention_lse):
        with pytest.raises(ValueError, match=re.escape(words)):
            fn(x, x, x, **kwargs)
    with pytest.raises(ValueError, match=re.escape(words)):
        ref.attention_backward(x, x, x, x, **kwargs)


def test_numpy_integers_are_accepted():
    q, k, v, _ = _inputs(1, 1, 1, 40, 16, torch.float32)
    a = flash_attention(q, k, v, True, window_size=np.int64(7), sink_size=np.int32(2))
    b = flash_attention(q, k, v, True, window_size=7, sink_size=2)
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------
# One copy: the lesson notebook's kernels are the package's kernels
# ---------------------------------------------------------------------------
def _strip(src: str) -> str:
    lines = [line.rstrip() for line in src.strip("\n").splitlines()
             if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")]
    return "\n".join(lines)


def _notebook_jit_functions(path):
    import nbformat

    found = {}
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                found[node.name] = ast.get_source_segment(source, node, padded=True)
                start = node.decorator_list[0].lineno - 1
                found[node.name] = "\n".join(source.splitlines()[start:node.end_lineno])
    return found


def test_notebook_kernels_are_the_package_kernels():
    path = ROOT / "solutions" / "08_sliding_window_and_sinks.ipynb"
    taught = _notebook_jit_functions(path)
    expected = {"_window_keep": forward, "_window_bounds": forward, "_attn_fwd_inner_window": forward,
                "_flash_attention_forward_window_kernel": forward,
                "_dkdv_inner_window": bw, "_attn_bwd_dkdv_window": bw}
    assert set(expected) <= set(taught), f"the notebook does not define {set(expected) - set(taught)}"
    for name, src in taught.items():
        module = expected.get(name, forward if hasattr(forward, name) else bw)
        package = inspect.getsource(getattr(module, name).fn)
        assert _strip(src) == _strip(package), f"{name} differs between the notebook and {module.__name__}"


# ---------------------------------------------------------------------------
# Tile skipping, observed: the loops' (lo, hi) recorded in the interpreter
# ---------------------------------------------------------------------------
def _recorded(monkeypatch, module, helpers, rows_arg, lo_arg):
    """Replace ``module``'s jit helpers by wrappers that record (first row/key, lo, hi, masked) per call."""
    calls = []

    def value(x):
        return int(np.asarray(x.handle.data).reshape(-1)[0]) if hasattr(x, "handle") else int(x)

    for name, masked in helpers.items():
        original = getattr(module, name)

        def wrapper(*args, _original=original, _masked=masked, **kwargs):
            calls.append((value(args[rows_arg]), value(args[lo_arg]), value(args[lo_arg + 1]), _masked))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return calls


def _tiles(calls, step):
    """{(block start, tile start): masked?} from recorded loop calls; a tile visited twice fails."""
    seen = {}
    for first, lo, hi, masked in calls:
        for start in range(lo, hi, step):
            assert (first, start) not in seen, f"tile {start} visited twice by the block starting at {first}"
            seen[(first, start)] = masked
    return seen


@pytest.mark.interpreter("records the loops in Triton's interpreter")
@pytest.mark.parametrize("n,w,s", [(200, 40, 5), (150, 1, 0), (130, 100, 70)])
def test_forward_and_dq_visit_exactly_the_visible_tiles(monkeypatch, n, w, s):
    """Every tile holding a visible pair is visited once, no other; only full tiles skip the mask."""
    block_m, block_n = 64, 32
    states = course_utils.plots.window_tile_states(n, block_m, block_n, w, s)
    want = {(bi * block_m, bj * block_n): states[bi, bj] for bi, bj in zip(*np.nonzero(states))}
    q, k, v, do = _inputs(1, 1, 1, n, 16, torch.float32)
    calls = _recorded(monkeypatch, forward, {"attn_fwd_inner": False, "_attn_fwd_inner_window": True}, 10, 13)
    o, lse = forward.flash_attention_window_forward(q, k, v, window_size=w, sink_size=s,
                                                    block_m=block_m, block_n=block_n)
    got = _tiles(calls, block_n)
    assert set(got) == set(want)
    assert all(got[t] or want[t] == course_utils.plots.FULL for t in got), "a partial tile was computed without the mask"
    # The dQ kernel runs the same phases with its own blocks.
    calls = _recorded(monkeypatch, bw, {"_dq_inner": False, "_dq_inner_window": True}, 11, 13)
    bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=w, sink_size=s,
                          config=bw.BackwardConfig(16, 32, 64, 32))
    states = course_utils.plots.window_tile_states(n, 64, 32, w, s)
    want = {(bi * 64, bj * 32): states[bi, bj] for bi, bj in zip(*np.nonzero(states))}
    got = _tiles(calls, 32)
    assert set(got) == set(want)
    assert all(got[t] or want[t] == course_utils.plots.FULL for t in got)


@pytest.mark.interpreter("records the loops in Triton's interpreter")
@pytest.mark.parametrize("n,w,s", [(200, 40, 5), (130, 9, 70)])
def test_dkdv_visits_exactly_the_query_blocks_that_see_its_keys(monkeypatch, n, w, s):
    block_m, block_n = 16, 32  # the dK/dV kernel: key blocks of 32, query blocks of 16
    mask = ref.window_mask(n, n, w, s)
    want = {}
    for bj in range(0, n, block_n):
        for bi in range(0, n, block_m):
            tile = mask[bi:bi + block_m, bj:bj + block_n]
            if tile.any():
                want[(bj, bi)] = bool(tile.all())
    q, k, v, do = _inputs(1, 1, 1, n, 16, torch.float32)
    o, lse = forward.flash_attention_window_forward(q, k, v, window_size=w, sink_size=s)
    calls = _recorded(monkeypatch, bw, {"dkdv_inner": False, "_dkdv_inner_window": True}, 12, 14)
    bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=w, sink_size=s,
                          config=bw.BackwardConfig(block_m, block_n, 32, 16, split_sinks=False))
    got = _tiles(calls, block_m)
    assert set(got) == set(want), "the dK/dV loop visits query blocks that see none of its keys, or misses some"
    assert all(masked or want[t] for t, masked in got.items()), "a partial tile was computed without the mask"
    # The package's default spreads the sink keys' far queries over programs of their own: the
    # window kernel then visits only the band, as if there were no sinks.
    band = ref.window_mask(n, n, w, 0)
    calls.clear()
    bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=w, sink_size=s,
                          config=bw.BackwardConfig(block_m, block_n, 32, 16))
    want_band = {(bj, bi) for bj in range(0, n, block_n) for bi in range(0, n, block_m)
                 if band[bi:bi + block_m, bj:bj + block_n].any()}
    assert set(_tiles(calls, block_m)) == want_band


@pytest.mark.parametrize("b,hq,hkv,n,d,w,s", [
    (1, 4, 2, 200, 16, 40, 5),     # GQA, N not a multiple of the tiles
    (2, 2, 1, 130, 32, 9, 70),     # sinks in two blocks of 64, most keys sinks
    (1, 3, 3, 257, 24, 64, 1),     # one sink, padded head dim
])
def test_split_sink_gradients_equal_the_lesson_kernels(monkeypatch, b, hq, hkv, n, d, w, s):
    """The sink keys' far queries in programs of their own: same dq, dk, dv as lesson 08's single
    program (to fp32 rounding: only the order of the sums differs), the same bits on every run,
    and the split really ran, over more than one query chunk."""
    q, k, v, do = _inputs(b, hq, hkv, n, d, torch.float32, seed=3)
    o, lse = flash_attention_with_lse(q, k, v, causal=True, window_size=w, sink_size=s)
    cfg = bw.default_config(d, DEVICE, course_utils.ENV.capability, q.dtype)
    chunks = []
    real = bw._sink_chunks
    monkeypatch.setattr(bw, "_sink_chunks", lambda *a: chunks.append(real(*a)) or chunks[-1])
    split = bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=w, sink_size=s, config=cfg)
    again = bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=w, sink_size=s, config=cfg)
    assert len(chunks) == 2 and chunks[0] > 1, f"the split ran {len(chunks)} times over {chunks} chunks"
    cfg.split_sinks = False
    lesson = bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=w, sink_size=s, config=cfg)
    assert len(chunks) == 2, "split_sinks=False still split"
    scale = max(float(t.abs().max()) for t in lesson)
    for name, a, b_, c in zip(("dq", "dk", "dv"), split, again, lesson):
        assert torch.equal(a, b_), f"{name} differs between two runs"
        torch.testing.assert_close(a, c, rtol=0, atol=(1e-5 if DEVICE == "cpu" else 2e-3) * scale, msg=name)


def test_tile_picture_and_widget_build_headless():
    import matplotlib

    matplotlib.use("Agg")
    from course_utils import plots, widgets

    states = plots.window_tile_states(256, 64, 32, 100, 4)
    # Block 3 (rows 192..255) sees keys 93..255 and the sinks 0..3: the sink tile partial, tile 32..63
    # skipped, 64..159 partial (row 255 starts at 156), 160..191 full, the diagonal partial.
    assert list(states[3]) == [plots.DIAGONAL, plots.SKIPPED, plots.DIAGONAL, plots.DIAGONAL,
                               plots.DIAGONAL, plots.FULL, plots.DIAGONAL, plots.DIAGONAL]
    ax = plots.plot_window_tiles(128, 64, 32, 5, 0)
    assert "16 partial" not in ax.get_title() and "skipped" in ax.get_title()
    matplotlib.pyplot.close(ax.figure)
    widget = widgets.window_explorer(n=64, block_m=32, block_n=16, window_size=8, sink_size=2)
    assert [c.description for c in widget.children[:2]] == ["window W", "sinks S"]


# -- the window kernels' Hopper launches (benchmarks/tune_window.py) fit an H200 -----------------------
HOPPER_WINDOW_SCRIPT = r"""
import json
import torch
from course_utils.kernels import targets, forward, backward

out = []
for w in (256, 1024, 4096):
    q = torch.zeros(1, 4, 8192, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 8192, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 8192)
    with targets._as_if_on_a_gpu(90), targets._captured_launches() as launches:
        forward.flash_attention_window_forward(q, k, k, window_size=w, sink_size=4)
        backward.attention_backward(q, k, k, q, lse, q, True, window_size=w, sink_size=4)
    for kernel, args, kwargs in launches:
        c = targets.compile_launch(kernel, args, kwargs, 90, f"W={w}", registers=True)
        tiles = {name: kwargs[name] for name in ("BLOCK_M", "BLOCK_N") if name in kwargs}
        out.append(dict(w=w, kernel=c.kernel, fits=c.fits, spill=c.spill_bytes, warps=c.num_warps,
                        stages=c.num_stages, **tiles))
print(json.dumps(out))
"""


def test_the_window_kernels_hopper_launches_are_the_measured_ones_and_fit_an_h200():
    """Compiled for sm_90 here (ptxas, no GPU): the launch window_block_config and default_config(window_size=)
    choose for bf16, D = 128 (results/tune_window.json's winners) fits in shared memory, and every kernel but
    dK/dV spills nothing. The dK/dV kernel holds two fp32 [BLOCK_N, D] accumulators beside K and V and spills
    at each of its launches (98-144 values per thread with the H200's triton 3.6): they were chosen by their
    measured time, spills included (results/NOTES.md, twenty-sixth session)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", HOPPER_WINDOW_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    launches = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(c["fits"] for c in launches), launches
    assert all(c["spill"] == 0 for c in launches if c["kernel"] != "_attn_bwd_dkdv_window"), launches
    fwd = {c["w"]: c for c in launches if c["kernel"] == "_flash_attention_forward_window_kernel"}
    assert {w: (c["BLOCK_M"], c["BLOCK_N"], c["warps"], c["stages"]) for w, c in fwd.items()} == {
        256: (64, 32, 4, 3), 1024: (64, 64, 4, 3), 4096: (64, 64, 4, 3)}
    dkdv = {c["w"]: (c["BLOCK_M"], c["BLOCK_N"], c["warps"]) for c in launches if c["kernel"] == "_attn_bwd_dkdv_window"}
    assert dkdv == {256: (32, 64, 4), 1024: (32, 64, 4), 4096: (64, 128, 8)}
    dq = {c["w"]: (c["BLOCK_M"], c["BLOCK_N"], c["warps"]) for c in launches if c["kernel"] == "attn_bwd_dq_window"}
    assert dq == {256: (64, 32, 4), 1024: (64, 32, 4), 4096: (128, 64, 8)}


def test_window_launches_elsewhere_are_block_config_and_the_causal_backward_tiles():
    """Only what was measured changes: other GPUs, dtypes and head dims keep the plain kernels' launches."""
    cuda = torch.device("cuda")
    for cap in ((8, 0), (7, 5)):
        assert forward.window_block_config(128, torch.bfloat16, cuda, 256, capability=cap) == \
            forward.block_config(128, torch.bfloat16, cuda, capability=cap)
    for d, dtype in ((64, torch.bfloat16), (256, torch.float16), (128, torch.float32)):
        assert forward.window_block_config(d, dtype, cuda, 256, capability=(9, 0)) == \
            forward.block_config(d, dtype, cuda, capability=(9, 0))
        assert repr(bw.default_config(d, "cuda", (9, 0), dtype, window_size=256)) == \
            repr(bw.default_config(d, "cuda", (9, 0), dtype))
    assert forward.window_block_config(128, torch.bfloat16, torch.device("cpu"), 256) == \
        forward.block_config(128, torch.bfloat16, torch.device("cpu"))
    assert repr(bw.default_config(128, "cuda", (8, 0), torch.bfloat16, window_size=256)) == \
        repr(bw.default_config(128, "cuda", (8, 0), torch.bfloat16))


def test_lesson_12s_kernels_keep_the_causal_tiles_with_a_window(monkeypatch):
    """default_config(window_size=) is lesson 08's measured launch; with mods (cu_seqlens, softcap, ...) the
    backward asks for the causal tiles, as before the window launch was tuned."""
    asked = []
    real = bw.default_config
    monkeypatch.setattr(bw, "default_config", lambda *a, **k: asked.append(a[4:] + tuple(k.values())) or real(*a, **k))
    q, k, v, do = _inputs(1, 2, 1, 96, 16, torch.float32)
    cu = torch.tensor([0, 40, 96], dtype=torch.int32, device=q.device)
    for mods in ({}, dict(cu_seqlens=cu)):
        o, lse = flash_attention_with_lse(q, k, v, causal=True, window_size=20, sink_size=2, **mods)
        bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=20, sink_size=2, **mods)
    assert asked == [(20,), (None,)]
