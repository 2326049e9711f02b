"""course_utils.kernels.gluon_cpu: the Gluon kernels' own Python run on the CPU with a model of Hopper's barriers,
TMA copies and products, against float64 references, in CI.

The GPU tests (tests/test_hopper_ws*.py) run the compiled kernels on a Hopper GPU; these run every loop, the FP8
entry and the backward's two kernels where no GPU is, and show that the model catches what it is for: a wait on
the wrong phase (a deadlock), a copy its barrier was not told of, a slot released too early, a forgotten scale.
"""

import math
from pathlib import Path

import pytest
import torch

from conftest import markdown_text, module_from_source, record_calls
from course_utils import references
from course_utils.kernels import fp8, gluon_cpu, hopper_ws, hopper_ws_bwd


def _rel(got, want) -> float:
    want = torch.as_tensor(want).double()
    return ((got.double() - want).norm() / want.norm()).item()


def _forward(module, causal, d, loop="serial", fma=False, buffers=2, n=384, seed=0):
    g = torch.Generator().manual_seed(n + d)
    q, k, v = (torch.randn(1, h, n, d, generator=g).bfloat16() for h in (4, 2, 2))
    with gluon_cpu.running(seed=seed, host_modules=(module, )):
        o, lse = module._launch(q, k, v, causal, 1 / math.sqrt(d), buffers, loop, fma)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=causal)
    return o, lse, ro, rl


@pytest.mark.parametrize("causal,d,loop,fma,buffers", [
    (True, 128, "serial", False, 2), (False, 128, "serial", True, 3), (True, 64, "pipelined", False, 2),
    (True, 128, "pingpong", False, 2), (False, 64, "pingpong", True, 3), (True, 128, "overlap", False, 2),
    (False, 128, "overlap", True, 2), (True, 64, "overlap", True, 3), (True, 128, "overlap_pingpong", False, 2),
    (False, 64, "overlap_pingpong", True, 3)])
def test_every_forward_loop_computes_attention(causal, d, loop, fma, buffers):
    o, lse, ro, rl = _forward(hopper_ws, causal, d, loop, fma, buffers)
    assert o.dtype == torch.bfloat16 and _rel(o, ro) < 1e-2, _rel(o, ro)  # P in bf16: about 2e-3
    assert (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@pytest.mark.parametrize("causal,d,loop,buffers,block_size", [
    (True, 128, "serial", 2, 128), (False, 64, "overlap", 4, 256), (True, 128, "pingpong", 3, 128),
    (True, 64, "overlap", 2, 128), (True, 128, "overlap_pingpong", 2, 128)])
def test_the_fp8_entry_computes_attention_on_e4m3_tiles(causal, d, loop, buffers, block_size):
    g = torch.Generator().manual_seed(d + buffers)
    q, k, v = (torch.randn(1, h, 512, d, generator=g) for h in (4, 2, 2))
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t, block_size) for t in (q, k, v))
    vt8 = v8.transpose(2, 3).contiguous()
    hopper_ws._validate_fp8_inputs(q8, k8, vt8, qs, ks, vs, block_size)  # attention_fp8's checks but the device's
    with gluon_cpu.running(seed=buffers):
        o, lse = hopper_ws._launch(q8, k8, vt8, causal, 1 / math.sqrt(d), buffers, loop, True, (qs, ks, vs),
                                   block_size)
    deq = [fp8.dequantize_fp8(x, s, block_size).double().numpy() for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    ro, rl = references.attention_lse(*deq, causal=causal)
    # P in e4m3 costs about 2e-2 (the course's FP8 kernel's own error; check_fp8_forward allows 0.12)
    assert o.dtype == torch.bfloat16 and _rel(o, ro) < 0.035, _rel(o, ro)
    assert (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@pytest.mark.parametrize("causal,block_size,n", [(True, 128, 768), (False, 128, 512), (True, 256, 1024),
                                                 (False, 512, 1024)])
def test_the_fp8_entry_s_wide_tiles_compute_attention(causal, block_size, n):
    """attention_fp8(block_n=256): each tile of 256 keys holds two scale blocks of 128 (or lies in one longer block),
    each half its own k_scale and v_scale; with the blocks' magnitudes 150x apart, as accurate as 128-key tiles."""
    g = torch.Generator().manual_seed(n + block_size)
    q, k, v = (torch.randn(1, h, n, 64, generator=g) for h in (4, 2, 2))
    blocks = torch.tensor([1.0, 30.0, 0.2, 5.0, 1.0, 0.05, 3.0, 0.5])[: n // 128]
    scale = blocks[None, None, :, None].repeat_interleave(128, 2)
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t, block_size) for t in (q, k * scale.sqrt(), v * scale))
    vt8 = v8.transpose(2, 3).contiguous()
    with gluon_cpu.running(seed=n):
        o, lse = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, block_size=block_size, block_n=256)
        narrow, _ = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, block_size=block_size)
    deq = [fp8.dequantize_fp8(x, s, block_size).double().numpy() for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    ro, rl = references.attention_lse(*deq, causal=causal)
    assert o.dtype == torch.bfloat16 and _rel(o, ro) < 0.035 and _rel(o, ro) < 1.2 * _rel(narrow, ro), (
        _rel(o, ro), _rel(narrow, ro))
    assert (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


def test_a_causal_wide_tile_makes_the_first_rows_as_a_128_key_tile_does():
    """The diagonal tile of a query block in a wide tile's first half: no row sees the second half, so P takes the
    first half's own v_scale and rounds to e4m3 exactly as the 128-key tiles do (a row's largest P is 256). Scaled
    by the halves' ratio instead, the sequence's first rows, of a few keys each, were up to 0.1 off (an H100, the
    forty-seventh session: 48 elements past 3e-2 against lesson 11's Triton kernel)."""
    g = torch.Generator().manual_seed(47)
    q, k, v = (torch.randn(1, h, 512, 64, generator=g) for h in (2, 1, 1))
    v = v * torch.tensor([1.0, 1.7, 1.0, 1.3]).repeat_interleave(128)[None, None, :, None]  # each second half larger
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    vt8 = v8.transpose(2, 3).contiguous()
    with gluon_cpu.running(seed=47):
        o, _ = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, True, block_n=256)
        narrow, _ = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, True)
    # the first query block's one tile is such a diagonal: its rows bit for bit as the 128-key tiles make them
    assert torch.equal(o[:, :, :128], narrow[:, :, :128])
    assert not torch.equal(o[:, :, 256:384], narrow[:, :, 256:384])  # there P's first tile has the halves' ratio


def test_a_wide_tile_that_scales_both_halves_alike_is_wrong(tmp_path):
    """The planted mistake: the second half of a wide tile with the first half's v_scale ratio (one scale per tile,
    as with 128-key tiles) is wrong where the two halves' blocks differ."""
    planted = _planted(tmp_path, hopper_ws, "p1 = gl.exp2(gl.fma(s1, ts1, -(off - gl.log2(r1))[:, None]))",
                       "p1 = gl.exp2(gl.fma(s1, ts1, -(off - gl.log2(r0))[:, None]))", "planted_ws_wide")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 512, 64, generator=g) for h in (2, 1, 1))
    v = v * torch.tensor([1.0, 20.0, 1.0, 20.0]).repeat_interleave(128)[None, None, :, None]
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    with gluon_cpu.running(host_modules=(planted, )):
        o, _ = planted.attention_fp8(q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs, block_n=256)
    deq = [fp8.dequantize_fp8(x, s).double().numpy() for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    assert _rel(o, references.attention(*deq)) > 0.2


@pytest.mark.parametrize("window,sinks,n,d,loop,fp8_tiles", [
    (256, 0, 768, 64, "serial", False), (200, 4, 768, 128, "serial", False), (128, 130, 1024, 64, "pingpong", False),
    (64, 1, 512, 64, "serial", False), (300, 4, 768, 64, "serial", True)])
def test_the_window_visits_its_tiles_and_masks_their_edges(window, sinks, n, d, loop, fp8_tiles):
    """Lesson 08's window: the sink tiles, then the window's; a row may see nothing of its first tile."""
    g = torch.Generator().manual_seed(window + sinks)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (4, 2, 2))
    with gluon_cpu.running(seed=window):
        if fp8_tiles:
            (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
            o, lse = hopper_ws.attention_fp8(q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs, True,
                                             window_size=window, sink_size=sinks)
            q, k, v = (fp8.dequantize_fp8(x, s) for x, s in ((q8, qs), (k8, ks), (v8, vs)))
        else:
            q, k, v = (t.bfloat16() for t in (q, k, v))
            o, lse = hopper_ws.attention(q, k, v, True, window_size=window, sink_size=sinks, loop=loop)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=True, window_size=window,
                                      sink_size=sinks)
    assert _rel(o, ro) < (0.035 if fp8_tiles else 1e-2), _rel(o, ro)
    assert (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@pytest.mark.parametrize("causal,d,loop,n_programs,n", [
    (True, 64, "serial", 3, 512), (False, 64, "pingpong", 2, 384), (True, 128, "pingpong", 5, 640),
    (True, 64, "serial", 64, 256)])  # more programs than work tiles
def test_the_persistent_grid_walks_every_work_tile_once(causal, d, loop, n_programs, n):
    """Programs of several work tiles each: two Q buffers in turn, the ring's position running on across tiles."""
    g = torch.Generator().manual_seed(n + n_programs)
    q, k, v = (torch.randn(2, h, n, d, generator=g).bfloat16() for h in (4, 2, 2))
    with gluon_cpu.running(seed=n_programs):
        o, lse = hopper_ws._launch_persistent(q, k, v, causal, 1 / math.sqrt(d), 2, loop, False, n_programs)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=causal)
    assert _rel(o, ro) < 1e-2, _rel(o, ro)
    assert (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@pytest.mark.parametrize("window,sinks,n,loop,n_programs", [
    (256, 0, 768, "serial", 3), (200, 4, 640, "pingpong", 2), (128, 130, 512, "serial", 5),
    (64, 1, 384, "serial", 64),  # more programs than work tiles
    (1000, 2, 384, "pingpong", 4)])  # a window wider than N (the route passes it unclipped): plain causal work
def test_the_persistent_grid_walks_each_work_tile_s_window(window, sinks, n, loop, n_programs):
    """The persistent grid under lesson 08's window: each work tile's sink tiles, then its window's, the ring's
    position running on across work tiles of different lengths (a block near the start sees fewer tiles)."""
    g = torch.Generator().manual_seed(window + n_programs)
    q, k, v = (torch.randn(2, h, n, 64, generator=g).bfloat16() for h in (4, 2, 2))
    with gluon_cpu.running(seed=n_programs):
        o, lse = hopper_ws._launch_persistent(q, k, v, True, 1 / 8, 2, loop, False, n_programs, window_size=window,
                                              sink_size=sinks)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=True, window_size=window,
                                      sink_size=sinks)
    assert _rel(o, ro) < 1e-2, _rel(o, ro)
    assert (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@pytest.mark.parametrize("causal,d,loop,buffers,block_size,n_programs,window,sinks", [
    (True, 128, "serial", 3, 128, 3, None, 0), (False, 64, "pingpong", 2, 256, 5, None, 0),
    (True, 64, "serial", 2, 128, 64, None, 0),  # more programs than work tiles
    (True, 64, "pingpong", 3, 128, 4, 300, 4)])
def test_the_persistent_grid_walks_every_fp8_work_tile_once(causal, d, loop, buffers, block_size, n_programs, window,
                                                            sinks):
    """FP8 on the persistent grid: each work tile's q_scale (its head's and query block's) and its tiles' k and v
    scales, V transposed, the ring running on across work tiles; as accurate as the one-program-per-tile entry."""
    g = torch.Generator().manual_seed(d + n_programs)
    q, k, v = (torch.randn(2, h, 512, d, generator=g) for h in (4, 2, 2))
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t, block_size) for t in (q, k, v))
    vt8 = v8.transpose(2, 3).contiguous()
    hopper_ws._validate_fp8_inputs(q8, k8, vt8, qs, ks, vs, block_size)
    hopper_ws._validate_persistent(q8, buffers, loop)
    with gluon_cpu.running(seed=n_programs):
        o, lse = hopper_ws._launch_persistent(q8, k8, vt8, causal, 1 / math.sqrt(d), buffers, loop, False, n_programs,
                                              window_size=window, sink_size=sinks, scales=(qs, ks, vs),
                                              block_size=block_size)
    deq = [fp8.dequantize_fp8(x, s, block_size).double().numpy() for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    ro, rl = references.attention_lse(*deq, causal=causal, window_size=window, sink_size=sinks)
    assert o.dtype == torch.bfloat16 and _rel(o, ro) < 0.035, _rel(o, ro)
    assert (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@pytest.mark.parametrize("causal,fp8_tiles,window,heads,n_programs", [
    (True, False, None, 1, 3), (False, False, None, 4, 5), (True, False, None, 2, 64),
    (True, False, 200, 4, 3), (True, True, None, 4, 3), (False, True, None, 1, 2), (True, True, 300, 2, 5),
    (True, False, None, 4, None), (True, True, None, 4, None), (True, False, 200, 2, None),
    (False, True, None, 2, None)])
def test_either_grid_walked_a_few_heads_at_a_time_makes_the_same_output(causal, fp8_tiles, window, heads, n_programs):
    """heads_together: the same work tiles in another order (a kv head's query heads side by side), so the same o
    and lse bit for bit as the grid's default walk, on the persistent grid (``n_programs``) and with a program per
    tile (None); each work tile's own head (its q scale under FP8, its kv head) whichever program runs it."""
    g = torch.Generator().manual_seed(heads + (n_programs or 0))
    q, k, v = (torch.randn(2, h, 512, 64, generator=g) for h in (4, 2, 2))
    sinks = 0 if window is None else 3
    if fp8_tiles:
        (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
        args = (q8, k8, v8.transpose(2, 3).contiguous(), causal, 1 / 8, 2, "serial", True)
        extra = dict(scales=(qs, ks, vs), window_size=window, sink_size=sinks)
    else:
        args = (*(t.bfloat16() for t in (q, k, v)), causal, 1 / 8, 2, "serial", True)
        extra = dict(window_size=window, sink_size=sinks)
    if n_programs is None:
        launch = hopper_ws._launch
    else:
        launch, args = hopper_ws._launch_persistent, (*args, n_programs)
    with gluon_cpu.running(seed=heads):
        want_o, want_lse = launch(*args, **extra)
        o, lse = launch(*args, **extra, heads_together=heads)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    if fp8_tiles:
        deq = [fp8.dequantize_fp8(x, s).double().numpy() for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    else:
        deq = [t.bfloat16().double().numpy() for t in (q, k, v)]
    ro, _ = references.attention_lse(*deq, causal=causal, window_size=window, sink_size=sinks)
    assert _rel(o, ro) < (0.035 if fp8_tiles else 1e-2), _rel(o, ro)


def _causal_blocks(n, batch, heads, programs=132):
    """The causal forward's work tiles in the order of a walk ``heads`` rows at a time (:func:`hopper_ws._walk`;
    32 query heads), each costing its key tiles and one more (its Q and epilogue)."""
    n_m, rows = n // 128, batch * 32
    return [n_m - (t % (n_m * heads)) // heads + 1 for t in range(n_m * rows)]


def _round_robin_load(costs, programs=132):
    """The persistent grid: program ``t % programs`` runs tile ``t``; the busiest program's load over the mean."""
    loads = [0] * programs
    for t, c in enumerate(costs):
        loads[t % programs] += c
    return max(loads) * programs / sum(costs)


def _dispatch_load(costs, programs=132):
    """A program per tile, started in walk order on whichever SM is free first (the GPU's block scheduler): the last
    SM's end over the mean."""
    import heapq

    ends = [0] * programs
    for c in costs:
        heapq.heappush(ends, heapq.heappop(ends) + c)
    return max(ends) * programs / sum(costs)


def test_the_kv_head_order_keeps_the_causal_load_even_on_either_grid():
    """kv_head_order: a kv head's query heads side by side, at least four rows a run where H allows. In the causal
    load models over 132 SMs (16k tokens a batch, 32 query heads) it balances the persistent grid as well as its
    default walk, and a program per tile better than today's walk, a row at a time; the figures its docstring
    quotes."""
    assert [hopper_ws.kv_head_order(32, g) for g in (1, 2, 4, 8, 32)] == [4, 4, 4, 8, 32]
    assert [hopper_ws.kv_head_order(h, g) for h, g in ((6, 3), (12, 3), (2, 1))] == [6, 6, 2]  # as far as H allows
    heads = hopper_ws.kv_head_order(32, 4)
    for n, batch in ((4096, 4), (8192, 2), (16384, 1)):
        walks = {r: _causal_blocks(n, batch, r) for r in (1, heads, batch * 32)}
        assert _round_robin_load(walks[heads]) == pytest.approx(_round_robin_load(walks[batch * 32]), abs=1e-9)
        assert _dispatch_load(walks[heads]) < _dispatch_load(walks[1]), n
    walks = {r: _causal_blocks(4096, 4, r) for r in (1, 4)}
    assert [round(_dispatch_load(walks[r]) - 1, 3) for r in (1, 4)] == [0.033, 0.002]
    assert [round(_round_robin_load(walks[r]) - 1, 3) for r in (1, 4)] == [0.12, 0.031]
    assert round(_dispatch_load(_causal_blocks(16384, 1, 1)) - 1, 3) == 0.003
    doc = " ".join(hopper_ws.kv_head_order.__doc__.split())
    assert "3.3% after the mean" in doc and "0.2% after it four rows" in doc and "12% with one row and 3.1%" in doc
    notes = " ".join((Path(__file__).resolve().parents[1] / "results" / "NOTES.md").read_text().split())
    for quote in ("the last SM ends 3.3% after the mean at 4k (B = 4) and about 0.3% at 16k",
                  "then ends 0.2% after the mean at 4k", "(3.1% either way, where one row at a time would be 12%)"):
        assert quote in notes, quote


@pytest.mark.parametrize("options,message", [
    (dict(heads_together=3), "dividing B"), (dict(persistent=True, heads_together=3), "dividing B"),
    (dict(persistent=True, heads_together=0), "whole number"), (dict(persistent=True, heads_together=2.0), "whole")])
def test_heads_together_is_refused_when_it_splits_a_run(options, message):
    q = torch.zeros(2, 4, 256, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        hopper_ws.attention(q, k, k, **options)


def _backward(module, causal, d, block_m, buffers, dq_block_n, n=384, seed=0, window_size=None, sink_size=0):
    g = torch.Generator().manual_seed(n + d + block_m)
    q, do = (torch.randn(1, 4, n, d, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 2, n, d, generator=g).bfloat16() for _ in range(2))
    window = dict(window_size=window_size, sink_size=sink_size)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=causal, **window)
    o, lse = torch.from_numpy(ro).bfloat16(), torch.from_numpy(rl).float()
    delta = (o.float() * do.float()).sum(-1)  # lesson 07's preprocess
    with gluon_cpu.running(seed=seed, host_modules=(module, )):
        dk, dv = module._launch_dkdv(q, k, v, do, lse, delta, causal, 1 / math.sqrt(d), buffers, block_m, **window)
        dq = module._launch_dq(q, k, v, do, lse, delta, causal, 1 / math.sqrt(d), buffers, dq_block_n, **window)
    want = references.attention_backward(*(t.double().numpy() for t in (q, k, v, do)), causal=causal, **window)
    return (dq, dk, dv), want


@pytest.mark.parametrize("causal,d,block_m,buffers,dq_block_n", [
    (True, 128, 64, 2, 64), (False, 128, 32, 3, 128), (True, 64, 32, 2, 128), (False, 64, 64, 3, 64)])
def test_the_backwards_kernels_compute_the_gradients(causal, d, block_m, buffers, dq_block_n):
    grads, want = _backward(hopper_ws_bwd, causal, d, block_m, buffers, dq_block_n)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2, (name, _rel(got, ref))


@pytest.mark.parametrize("causal,window,heads", [(True, None, 2), (False, None, 4), (True, 200, 4), (True, None, 1)])
def test_the_backwards_kernels_walked_a_few_kv_heads_at_a_time_make_the_same_gradients(causal, window, heads):
    """attention_backward(heads_together=R): dK/dV's programs take R (batch, kv head) rows' key blocks at a time, the
    first (longest) blocks of each run first, and dQ's the query blocks of those rows' query heads; the same tiles,
    so the same gradients bit for bit as the default walk (each key block's own row, whichever program runs it)."""
    g = torch.Generator().manual_seed(heads)
    q, do = (torch.randn(2, 4, 512, 64, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(2, 2, 512, 64, generator=g).bfloat16() for _ in range(2))
    mask = dict(window_size=window, sink_size=0 if window is None else 3)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=causal, **mask)
    o, lse = torch.from_numpy(ro).bfloat16(), torch.from_numpy(rl).float()
    delta = (o.float() * do.float()).sum(-1)  # lesson 07's preprocess (a Triton kernel: a GPU's, where one is)

    def backward(rows):  # as backward_validated launches them: dQ walks the rows' query heads (GQA 2)
        dk, dv = hopper_ws_bwd._launch_dkdv(q, k, v, do, lse, delta, causal, 1 / 8, **mask, heads_together=rows)
        return hopper_ws_bwd._launch_dq(q, k, v, do, lse, delta, causal, 1 / 8, **mask,
                                        heads_together=None if rows is None else 2 * rows), dk, dv

    with gluon_cpu.running(seed=heads, host_modules=(hopper_ws_bwd, )):
        want, got = backward(None), backward(heads)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    ref = references.attention_backward(*(t.double().numpy() for t in (q, k, v, do)), causal=causal, **mask)
    assert all(_rel(a, r) < 1e-2 for a, r in zip(got, ref))


def test_the_causal_backward_s_dkdv_walk_leaves_the_last_sm_far_behind_one_kv_head_at_a_time():
    """dK/dV's programs under the causal mask (a key block sees the queries from it on: the first blocks longest)
    in the dispatch load model over 132 SMs at 16k tokens a batch, GQA 32/8, 128-key blocks: one (batch, kv head)
    row's blocks after another leaves the last SM 13% past the mean at 4k and 11% at 8k; four rows at a time,
    0.2% and 0.05% (the figures results/NOTES.md quotes)."""
    def costs(n, rows, heads):  # a block's query tiles (times the group, a constant) and one more
        n_kb = n // 128
        return [n_kb - (t % (n_kb * heads)) // heads + 1 for t in range(n_kb * rows)]

    got = {(n, r): round(_dispatch_load(costs(n, 16384 // n * 8, r)) - 1, 4) for n in (4096, 8192) for r in (1, 4)}
    assert got == {(4096, 1): 0.1344, (4096, 4): 0.0018, (8192, 1): 0.1121, (8192, 4): 0.0005}, got
    notes = " ".join((Path(__file__).resolve().parents[1] / "results" / "NOTES.md").read_text().split())
    assert "the last SM 13% past the mean at 4k and 11% at 8k; four rows at a time, 0.2% and 0.05%" in notes
    lesson = " ".join(markdown_text("11_hopper_and_fp8").split())  # lesson 11's backward section, at 4k
    assert "leaves the last SM 13% past the mean; walking four rows at a time, each run's first blocks first" in lesson
    assert "heads_together=4)`), 0.2%." in lesson


@pytest.mark.parametrize("window,sinks,n,d,block_m,dq_block_n", [
    (256, 0, 768, 64, 64, 64), (200, 4, 768, 64, 32, 128), (128, 130, 1024, 64, 64, 64), (1000, 0, 512, 128, 32, 64)])
def test_the_backwards_kernels_under_a_window(window, sinks, n, d, block_m, dq_block_n):
    """dK/dV visit the query tiles that see their keys (all after a block of sink keys), dQ the forward's tiles."""
    grads, want = _backward(hopper_ws_bwd, True, d, block_m, 2, dq_block_n, n=n, window_size=window,
                            sink_size=sinks)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert _rel(got, ref) < 1e-2, (name, _rel(got, ref))


# -- what the model catches: planted mistakes in copies of the kernels' source ------------------------------------
def _planted(tmp_path, module, old, new, name):
    src = open(module.__file__).read()
    assert src.count(old) == 1, old  # one place, the one meant
    return module_from_source(tmp_path / f"{name}.py", src.replace(old, new), name=f"course_utils.kernels.{name}")


def test_a_loader_that_waits_for_the_phase_itself_deadlocks(tmp_path):
    """A fresh barrier counts as completed for the phase *before* 0: waiting with the slot's own phase (not
    ``phase ^ 1``) blocks the loader before its first copy, and the consumers wait for that copy."""
    planted = _planted(tmp_path, hopper_ws, "mbarrier.wait(empty_bars.index(idx), phase ^ 1)",
                       "mbarrier.wait(empty_bars.index(idx), phase)", "planted_ws_phase")
    with pytest.raises(gluon_cpu.Deadlock, match="every partition waits"):
        _forward(planted, True, 64)


def test_a_copy_its_barrier_was_not_told_of_is_refused(tmp_path):
    planted = _planted(tmp_path, hopper_ws, "    mbarrier.expect(v_bars.index(idx), v_desc.block_type.nbytes)\n"
                       "    if V_T:", "    if V_T:", "planted_ws_expect")
    with pytest.raises(RuntimeError, match="more bytes than its barrier expected"):
        _forward(planted, False, 64)


def test_an_overlapped_loop_that_releases_the_wrong_slot_deadlocks(tmp_path):
    """``loop="overlap"`` holds two slots at a time (tile j's K, tile j - 1's V): releasing slot j instead of
    j - 1 leaves slot 0 taken for ever, and the loader waits for it."""
    planted = _planted(tmp_path, hopper_ws, "    mbarrier.arrive(empty_bars.index(prev), count=1)\n    return p,",
                       "    mbarrier.arrive(empty_bars.index(j % NB), count=1)\n    return p,", "planted_ws_release")
    with pytest.raises(gluon_cpu.Deadlock):
        _forward(planted, False, 64, loop="overlap", n=512)


def test_an_fp8_epilogue_without_the_last_v_scale_is_wrong(tmp_path):
    planted = _planted(tmp_path, hopper_ws, "acc = acc * gl.convert_layout(v_prev / l_i,",
                       "acc = acc * gl.convert_layout(1.0 / l_i,", "planted_ws_vscale")
    q, k, v = (torch.randn(1, h, 256, 64) * 3 for h in (2, 1, 1))
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    with gluon_cpu.running(host_modules=(planted, )):
        o, _ = planted._launch(q8, k8, v8.transpose(2, 3).contiguous(), False, 0.125, 2, "serial", True,
                               (qs, ks, vs), 128)
    deq = [fp8.dequantize_fp8(x, s).double().numpy() for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    assert _rel(o, references.attention(*deq)) > 0.5


def test_a_dk_without_the_softmax_scale_is_wrong(tmp_path):
    planted = _planted(tmp_path, hopper_ws_bwd, "(dk * sm_scale).to(", "dk.to(", "planted_bwd_scale")
    (dq, dk, dv), (rdq, rdk, rdv) = _backward(planted, True, 64, 64, 2, 64, n=256)
    assert _rel(dq, rdq) < 1e-2 and _rel(dv, rdv) < 1e-2 and _rel(dk, rdk) > 1.0


def test_the_public_entries_take_cpu_tensors_inside_the_model_only():
    q, k, v = (torch.randn(1, h, 256, 64).bfloat16() for h in (4, 2, 2))
    with pytest.raises(ValueError, match="Hopper GPU"):
        hopper_ws.attention(q, k, v, causal=True)
    with gluon_cpu.running():
        assert gluon_cpu.active()
        o, _ = hopper_ws.attention(q, k, v, causal=True)
        (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t.float()) for t in (q, k, v))
        o8, _ = hopper_ws.attention_fp8(q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs, causal=True)
    assert not gluon_cpu.active()
    want = references.attention(*(t.double().numpy() for t in (q, k, v)), causal=True)
    assert _rel(o, want) < 1e-2 and _rel(o8, want) < 0.05


def test_a_slot_released_before_its_product_completes_is_a_race(tmp_path):
    """``P V`` reads V's slot until ``warpgroup_mma_wait`` completes it: releasing the slot first lets the loader
    refill it under the product. With ``linger`` the loader acts in that window, and the model says so."""
    old = '''    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty_bars.index(idx), count=1)  # counts once per partition; the slot needs both consumers'''
    new = '''    mbarrier.arrive(empty_bars.index(idx), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))'''
    planted = _planted(tmp_path, hopper_ws, old, new, "planted_ws_early_release")
    q, k, v = (torch.randn(1, h, 512, 64).bfloat16() for h in (2, 1, 1))
    with pytest.raises(gluon_cpu.RaceError, match="still be reading"):
        with gluon_cpu.running(host_modules=(planted, ), linger=0.01):
            planted._launch(q, k, v, False, 0.125, 2)
    with gluon_cpu.running(linger=0.01):  # the kernel as it is, under the same schedule
        o, _ = hopper_ws._launch(q, k, v, False, 0.125, 2)
    assert _rel(o, references.attention(*(t.double().numpy() for t in (q, k, v)))) < 1e-2


# The tests below run the course's Triton kernels (lesson 05's forward, lesson 07's delta kernel, the FP8 kernels) on
# CPU tensors beside the model, which only Triton's interpreter can do; on a GPU machine the compiled routes are
# tested in tests/test_hopper_ws.py and test_hopper_ws_bwd.py instead.
needs_interpreter = pytest.mark.skipif(not __import__("course_utils").ENV.interpreter,
                                       reason="the course's Triton kernels run on CPU tensors in Triton's interpreter "
                                       "only (a GPU machine runs the compiled routes' tests in tests/test_hopper_ws*.py)")


@needs_interpreter
@pytest.mark.parametrize("forward", hopper_ws_bwd.FORWARDS)
def test_a_training_step_through_autograd(forward):
    """hopper_ws_bwd.attention: the forward, then autograd's backward by the Gluon kernels (and lesson 07's delta
    kernel, in Triton's interpreter), against float64."""
    g = torch.Generator().manual_seed(7)  # fp16: Triton's interpreter computes bf16 wrongly (the course's forward)
    q, do = (torch.randn(1, 4, 256, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(1, 2, 256, 64, generator=g).half() for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with gluon_cpu.running():
        o = hopper_ws_bwd.attention(q, k, v, True, forward=forward)
        o.backward(do)
    want = references.attention_backward(*(t.detach().double().numpy() for t in (q, k, v, do)), causal=True)
    assert _rel(o.detach(), references.attention(*(t.detach().double().numpy() for t in (q, k, v)), causal=True)) < 1e-2
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        assert _rel(got, ref) < 1e-2, name


@needs_interpreter
@pytest.mark.parametrize("d,causal", [(64, True), (128, False)])
def test_every_launch_of_the_gluon_backward_computes_the_gradients(d, causal):
    """The backward's whole search space in the model (tests/test_hopper_ws_bwd.py runs it compiled on a Hopper
    GPU): every launch right against float64, the one launch too big for shared memory refused."""
    from conftest import every_gluon_backward_launch

    g = torch.Generator().manual_seed(d)  # fp16: the course's forward computes bf16 wrongly in the interpreter
    q, do = (torch.randn(1, 4, 256, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(1, 2, 256, d, generator=g).half() for _ in range(2))
    with gluon_cpu.running():
        ran, refused = every_gluon_backward_launch(q, k, v, do, causal)
    assert len(ran) == (16 if d == 64 else 14) and len(refused) == 16 - len(ran)


@needs_interpreter
@pytest.mark.parametrize("causal", [True, False])
def test_the_gluon_forward_is_the_route_launch_forward_takes_when_it_is_set(monkeypatch, causal):
    """dispatch.GLUON_MIN_N: 4096 by default (None: the route is off); set, plain attention of at least that many tokens
    at D = 128 runs hopper_ws.attention (the same o and lse bit for bit; without the causal mask on its persistent
    grid) where it can run: a Hopper GPU, here its model. A window, a shorter N, D = 64 or a CPU outside the model
    keep the course's kernels."""
    from course_utils import kernels
    from course_utils.kernels import dispatch

    g = torch.Generator().manual_seed(5)  # fp16: the course's entry refuses bf16 on a CPU (the interpreter's bf16)
    q, k, v = (torch.randn(1, h, 256, 128, generator=g).half() for h in (4, 2, 2))
    assert dispatch.GLUON_MIN_N == 4096 and not dispatch.gluon_applies(q, k, v)  # N = 256
    assert not dispatch.gluon_applies(q, k, v, min_n=256)  # a CPU outside the model
    with gluon_cpu.running():
        assert dispatch.gluon_applies(q, k, v, min_n=256)
        assert not dispatch.gluon_applies(q, k, v, min_n=512)
        assert not dispatch.gluon_applies(q, k, v, 64, min_n=256)  # a window: lesson 08's kernels
        assert not dispatch.gluon_applies(q[..., :64], k[..., :64], v[..., :64], min_n=256)  # D = 64: not timed
        monkeypatch.setattr(dispatch, "GLUON_MIN_N", 256)
        assert dispatch.GLUON_NONCAUSAL_PERSISTENT is True and dispatch.GLUON_FMA is True
        calls = record_calls(monkeypatch, (hopper_ws, "_launch_persistent"), (hopper_ws, "_launch"))
        o, lse = kernels.flash_attention_with_lse(q, k, v, causal)
        # without the causal mask the persistent grid (GLUON_NONCAUSAL_PERSISTENT), with it a program per tile
        assert calls == (["_launch"] if causal else ["_launch_persistent"])
        want_o, want_lse = hopper_ws.attention(q, k, v, causal, fma=True, persistent=not causal)
        if not causal:  # switched off: a program per tile
            monkeypatch.setattr(dispatch, "GLUON_NONCAUSAL_PERSISTENT", False)
            calls.clear()
            kernels.flash_attention_with_lse(q, k, v, causal)
            assert calls == ["_launch"]
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=causal)
    assert _rel(o, ro) < 1e-2 and (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@needs_interpreter
@pytest.mark.parametrize("window,sinks", [(256, 0), (200, 4)])
def test_a_wide_window_takes_the_gluon_forward_when_gluon_min_window_is_set(monkeypatch, window, sinks):
    """dispatch.GLUON_MIN_WINDOW: 1024 by default (None: a window keeps lesson 08's kernels); set with
    GLUON_WINDOW_MIN_N (8192 by default; plain attention's GLUON_MIN_N does not send a window), a window at least that
    wide runs hopper_ws.attention with the window and sinks on its persistent grid (o and lse bit for bit;
    GLUON_WINDOW_PERSISTENT), where it can run; a narrower one does not. GLUON_FMA passes ``fma``."""
    from course_utils import kernels
    from course_utils.kernels import dispatch

    g = torch.Generator().manual_seed(window)  # fp16: the course's entry refuses bf16 on a CPU (the interpreter's bf16)
    q, k, v = (torch.randn(1, h, 768, 128, generator=g).half() for h in (4, 2, 2))
    assert dispatch.GLUON_MIN_WINDOW == 1024 and dispatch.GLUON_WINDOW_PERSISTENT is True
    assert dispatch.GLUON_WINDOW_MIN_N == 8192
    monkeypatch.setattr(dispatch, "GLUON_MIN_N", 256)
    monkeypatch.setattr(dispatch, "GLUON_MIN_WINDOW", 200)
    with gluon_cpu.running():
        assert not dispatch.gluon_applies(q, k, v, window)  # N below GLUON_WINDOW_MIN_N: lesson 08's kernels
        monkeypatch.setattr(dispatch, "GLUON_MIN_WINDOW", None)
        monkeypatch.setattr(dispatch, "GLUON_WINDOW_MIN_N", 256)
        assert not dispatch.gluon_applies(q, k, v, window)  # no GLUON_MIN_WINDOW: lesson 08's kernels
        monkeypatch.setattr(dispatch, "GLUON_MIN_WINDOW", 200)
        assert dispatch.gluon_applies(q, k, v, window) and not dispatch.gluon_applies(q, k, v, 128)
        assert not dispatch.gluon_applies(q, k, v, window, min_n=1024)  # N below GLUON_WINDOW_MIN_N
        monkeypatch.setattr(dispatch, "GLUON_MIN_N", None)  # plain attention's threshold leaves windows alone
        assert dispatch.gluon_applies(q, k, v, window) and not dispatch.gluon_applies(q, k, v)
        monkeypatch.setattr(dispatch, "GLUON_MIN_N", 256)
        calls = record_calls(monkeypatch, (hopper_ws, "_launch_persistent"), (hopper_ws, "_launch"))
        o, lse = kernels.flash_attention_with_lse(q, k, v, True, window_size=window, sink_size=sinks)
        assert calls == ["_launch_persistent"]
        want_o, want_lse = hopper_ws.attention(q, k, v, True, window_size=window, sink_size=sinks, persistent=True,
                                               fma=True)
        monkeypatch.setattr(dispatch, "GLUON_WINDOW_PERSISTENT", False)  # a program per tile
        calls.clear()
        kernels.flash_attention_with_lse(q, k, v, True, window_size=window, sink_size=sinks)
        assert calls == ["_launch"]
        assert dispatch.GLUON_FMA is True  # the softmax's scale in one FMA, as shipped; off, the kernel without it
        monkeypatch.setattr(dispatch, "GLUON_FMA", False)
        monkeypatch.setattr(dispatch, "GLUON_WINDOW_PERSISTENT", True)
        o_plain, lse_plain = kernels.flash_attention_with_lse(q, k, v, True, window_size=window, sink_size=sinks)
        want_plain = hopper_ws.attention(q, k, v, True, window_size=window, sink_size=sinks, persistent=True)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    assert torch.equal(o_plain, want_plain[0]) and torch.equal(lse_plain, want_plain[1])
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=True, window_size=window,
                                      sink_size=sinks)
    for o, lse in ((o, lse), (o_plain, lse_plain)):
        assert _rel(o, ro) < 1e-2 and (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


def _record_walks(monkeypatch, module, name) -> list:
    """Wrap ``module.name`` so that each call appends the ``heads_together`` it was given (the walk a route chose)."""
    walks, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        walks.append(kwargs.get("heads_together"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return walks


def _route_inputs(seed, batch=2, n=256):
    """q, k, v for a route through the public entry in the model: 4 query heads on 2 kv heads, D = 128, fp16 (the
    course's entry refuses bf16 on a CPU: the interpreter's bf16)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h, n, 128, generator=g).half() for h in (4, 2, 2))


@needs_interpreter
def test_the_forward_route_walks_a_kv_head_at_a_time_only_when_switched_on(monkeypatch):
    """dispatch.GLUON_WALK_KV_HEADS (on as shipped): plain attention without the causal mask on the persistent grid
    walks a kv head's query heads at a time (hopper_ws.kv_head_order), o and lse the kernel's own bit for bit; the
    causal mask (a program per tile) and windows keep the default walk."""
    from course_utils import kernels
    from course_utils.kernels import dispatch

    q, k, v = _route_inputs(21)
    assert dispatch.GLUON_WALK_KV_HEADS is True  # as shipped
    monkeypatch.setattr(dispatch, "GLUON_MIN_N", 256)
    walks = _record_walks(monkeypatch, hopper_ws, "_launch_persistent")
    with gluon_cpu.running():
        o, lse = kernels.flash_attention_with_lse(q, k, v, False)
        monkeypatch.setattr(dispatch, "GLUON_WALK_KV_HEADS", False)
        kernels.flash_attention_with_lse(q, k, v, False)
        assert walks == [4, None]  # the two query heads of a kv head, doubled to four rows; off: the default walk
        monkeypatch.setattr(dispatch, "GLUON_WALK_KV_HEADS", True)
        assert dispatch.gluon_heads_together(q, k, True) is None  # causal: a program per tile, no walk
        assert dispatch.gluon_heads_together(q, k, True, 1024) is None  # a window keeps its walk
        monkeypatch.setattr(dispatch, "GLUON_NONCAUSAL_PERSISTENT", False)
        assert dispatch.gluon_heads_together(q, k, False) is None  # a program per tile: nothing to walk
        want_o, want_lse = hopper_ws.attention(q, k, v, False, fma=True, persistent=True, heads_together=4)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=False)
    assert _rel(o, ro) < 1e-2 and (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@needs_interpreter
def test_a_window_s_route_walks_a_kv_head_at_a_time_only_when_switched_on(monkeypatch):
    """dispatch.GLUON_WALK_WINDOWS (off as shipped): a window on the Gluon route's persistent grid walks a kv head's
    query heads at a time (hopper_ws.kv_head_order) when it is on, o and lse the kernel's own bit for bit and right
    against float64; off, and on a program per tile (nothing to walk), the default walk."""
    from course_utils import kernels
    from course_utils.kernels import dispatch

    q, k, v = _route_inputs(25, batch=1, n=384)
    window, sinks = 200, 4
    assert dispatch.GLUON_WALK_WINDOWS is False  # as shipped
    monkeypatch.setattr(dispatch, "GLUON_WINDOW_MIN_N", 256)
    monkeypatch.setattr(dispatch, "GLUON_MIN_WINDOW", 128)
    walks = _record_walks(monkeypatch, hopper_ws, "_launch_persistent")
    with gluon_cpu.running():
        kernels.flash_attention_with_lse(q, k, v, True, window_size=window, sink_size=sinks)
        monkeypatch.setattr(dispatch, "GLUON_WALK_WINDOWS", True)
        o, lse = kernels.flash_attention_with_lse(q, k, v, True, window_size=window, sink_size=sinks)
        assert walks == [None, 4]  # off: the default walk; on: a kv head's two query heads, doubled to four rows
        monkeypatch.setattr(dispatch, "GLUON_WINDOW_PERSISTENT", False)
        assert dispatch.gluon_heads_together(q, k, True, window) is None  # a program per tile: nothing to walk
        monkeypatch.setattr(dispatch, "GLUON_WALK_KV_HEADS", False)  # the two switches are apart
        monkeypatch.setattr(dispatch, "GLUON_WINDOW_PERSISTENT", True)
        assert dispatch.gluon_heads_together(q, k, True, window) == 4
        assert dispatch.gluon_heads_together(q, k, False) is None
        want_o, want_lse = hopper_ws.attention(q, k, v, True, window_size=window, sink_size=sinks, fma=True,
                                               persistent=True, heads_together=4)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=True, window_size=window,
                                      sink_size=sinks)
    assert _rel(o, ro) < 1e-2 and (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@needs_interpreter
def test_the_causal_route_walks_its_program_per_tile_only_when_switched_on(monkeypatch):
    """dispatch.GLUON_WALK_CAUSAL (off as shipped): plain causal attention on the Gluon route (a program per tile)
    walks a kv head's query heads at a time when it is on, on a grid whose shape tells every partition the walk
    (hopper_ws._grid_tile), o and lse the kernel's own bit for bit and right against float64; off, row by row."""
    from course_utils import kernels
    from course_utils.kernels import dispatch

    q, k, v = _route_inputs(27)
    assert dispatch.GLUON_WALK_CAUSAL is False  # as shipped
    monkeypatch.setattr(dispatch, "GLUON_MIN_N", 256)
    walks = _record_walks(monkeypatch, hopper_ws, "_launch")
    with gluon_cpu.running():
        kernels.flash_attention_with_lse(q, k, v, True)
        monkeypatch.setattr(dispatch, "GLUON_WALK_CAUSAL", True)
        o, lse = kernels.flash_attention_with_lse(q, k, v, True)
        assert walks == [None, 4]  # a kv head's two query heads, doubled to four rows
        assert dispatch.gluon_heads_together(q, k, False) == 4  # without the mask: GLUON_WALK_KV_HEADS's
        monkeypatch.setattr(dispatch, "GLUON_WALK_KV_HEADS", False)  # the switches are apart
        assert dispatch.gluon_heads_together(q, k, True) == 4 and dispatch.gluon_heads_together(q, k, False) is None
        want_o, want_lse = hopper_ws.attention(q, k, v, True, fma=True, heads_together=4)
        plain_o, plain_lse = hopper_ws.attention(q, k, v, True, fma=True)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    assert torch.equal(o, plain_o) and torch.equal(lse, plain_lse)  # the same tiles, in another order
    ro, rl = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=True)
    assert _rel(o, ro) < 1e-2 and (lse.double() - torch.from_numpy(rl)).abs().max().item() < 1e-4


@needs_interpreter
def test_the_backward_route_walks_its_rows_only_when_switched_on(monkeypatch):
    """fast_backward.GLUON_WALK_ROWS (4 as shipped): autograd's Gluon backward walks that many (batch, kv head)
    rows at a time where it divides B * H_kv and there is no window, its gradients the kernels' own bit for bit and
    right against float64; rows that do not divide, and windows, keep one row after another."""
    from course_utils import kernels
    from course_utils.kernels import fast_backward as fb

    g = torch.Generator().manual_seed(23)  # fp16: Triton's interpreter computes bf16 wrongly (the course's forward)
    q, do = (torch.randn(2, 4, 256, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(2, 2, 256, 64, generator=g).half() for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert fb.GLUON_WALK_ROWS == 4  # as shipped; here B * H_kv = 4 rows, so two
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", fb.GLUON_DEFAULT)
    walks = _record_walks(monkeypatch, hopper_ws_bwd, "backward_validated")
    monkeypatch.setattr(fb, "GLUON_WALK_ROWS", 2)
    with gluon_cpu.running():
        kernels.flash_attention(q, k, v, True).backward(do)
        o, lse = kernels.flash_attention_with_lse(q.detach(), k.detach(), v.detach(), True)
        direct = hopper_ws_bwd.attention_backward(q.detach(), k.detach(), v.detach(), o, lse, do, True,
                                                  heads_together=2)
    assert walks[0] == 2
    assert fb.gluon_walk_rows(k) == 2 and fb.gluon_walk_rows(k, 1024) is None  # a window: one row after another
    monkeypatch.setattr(fb, "GLUON_WALK_ROWS", 3)
    assert fb.gluon_walk_rows(k) is None  # 3 does not divide B * H_kv = 4
    for got, want in zip((q.grad, k.grad, v.grad), direct):
        assert torch.equal(got, want)
    want = references.attention_backward(*(t.detach().double().numpy() for t in (q, k, v, do)), causal=True)
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        assert _rel(got, ref) < 1e-2, name


@needs_interpreter
@pytest.mark.parametrize("causal", [True, False])
def test_the_gluon_fp8_entry_is_the_route_flash_attention_fp8_takes_when_it_is_set(monkeypatch, causal):
    """fp8.GLUON_MIN_N: 4096 by default (None: off); set, flash_attention_fp8 at D = 128 and at least that many tokens runs
    hopper_ws.attention_fp8 (its o bit for bit, in the caller's dtype) where it can: a Hopper GPU, here its model.
    Shorter inputs, D = 64 or a CPU outside the model keep the Triton kernels."""
    from course_utils.kernels import flash_attention_fp8, quantize_fp8

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, h, 256, 128, generator=g) for h in (4, 2, 2))
    (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(t) for t in (q, k, v))
    vt8 = v8.transpose(2, 3).contiguous()
    assert fp8.GLUON_MIN_N == 4096 and not fp8.gluon_fp8_applies(q8, k8, vt8, qs, ks, vs)  # N = 256
    assert not fp8.gluon_fp8_applies(q8, k8, vt8, qs, ks, vs, min_n=256)  # a CPU outside the model
    with gluon_cpu.running():
        assert fp8.gluon_fp8_applies(q8, k8, vt8, qs, ks, vs, min_n=256)
        assert not fp8.gluon_fp8_applies(q8, k8, vt8, qs, ks, vs, min_n=512)
        small = [quantize_fp8(t[..., :64]) for t in (q, k, v)]
        assert not fp8.gluon_fp8_applies(small[0][0], small[1][0], small[2][0].transpose(2, 3).contiguous(),
                                         small[0][1], small[1][1], small[2][1], min_n=256)  # D = 64: not timed
        monkeypatch.setattr(fp8, "GLUON_MIN_N", 256)
        o = flash_attention_fp8(q8, k8, v8, causal, q_scale=qs, k_scale=ks, v_scale=vs)
        from_bf16 = flash_attention_fp8(q, k, v, causal)  # quantised inside, the same e4m3 inputs
        want = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal)[0]
        monkeypatch.setattr(fp8, "GLUON_PERSISTENT", True)  # the route on the entry's persistent grid
        calls = record_calls(monkeypatch, (hopper_ws, "_launch_persistent"), (hopper_ws, "_launch"))
        o_persistent = flash_attention_fp8(q8, k8, v8, causal, q_scale=qs, k_scale=ks, v_scale=vs)
        assert calls == ["_launch_persistent"]
        want_persistent = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, persistent=True)[0]
    assert o.dtype == torch.float32 and torch.equal(o, want.float()) and torch.equal(from_bf16, o)
    assert torch.equal(o_persistent, want_persistent.float())
    ref = references.attention(*(fp8.dequantize_fp8(t, s).double().numpy() for t, s in ((q8, qs), (k8, ks), (v8, vs))),
                               causal=causal)
    assert _rel(o, ref) < 5e-2 and _rel(o_persistent, ref) < 5e-2


@needs_interpreter
@pytest.mark.parametrize("persistent", [False, True])
def test_the_fp8_route_walks_a_kv_head_at_a_time_only_when_switched_on(monkeypatch, persistent):
    """fp8.GLUON_WALK (off until a route check times it): on, flash_attention_fp8's Gluon route walks its grid a kv
    head's query heads at a time (hopper_ws.kv_head_order), on either grid, o bit for bit the kernel's own with that
    walk and its default walk's (the same tiles: each takes its own q_scale)."""
    from course_utils.kernels import flash_attention_fp8

    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, h, 256, 128, generator=g) for h in (4, 2, 2))
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    vt8 = v8.transpose(2, 3).contiguous()
    assert fp8.GLUON_WALK is False  # as shipped
    monkeypatch.setattr(fp8, "GLUON_MIN_N", 256)
    monkeypatch.setattr(fp8, "GLUON_PERSISTENT", persistent)
    walks = _record_walks(monkeypatch, hopper_ws, "_launch_persistent" if persistent else "_launch")
    with gluon_cpu.running():
        o_default = flash_attention_fp8(q8, k8, v8, True, q_scale=qs, k_scale=ks, v_scale=vs)
        monkeypatch.setattr(fp8, "GLUON_WALK", True)
        o = flash_attention_fp8(q8, k8, v8, True, q_scale=qs, k_scale=ks, v_scale=vs)
        want = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, True, persistent=persistent, heads_together=4)[0]
    assert walks == [None, 4, 4]  # off, on (a kv head's two query heads, doubled to four rows), the direct call
    assert torch.equal(o, want.float()) and torch.equal(o, o_default)


@needs_interpreter
def test_the_fp8_route_takes_the_wide_tiles_only_when_switched_on(monkeypatch):
    """fp8.GLUON_WIDE (off until a GPU times it): on, flash_attention_fp8's Gluon route runs attention_fp8 with
    block_n=256 (its output bit for bit) where N is a multiple of 256, and the 128-key tiles elsewhere and on the
    persistent grid."""
    from course_utils.kernels import flash_attention_fp8

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, h, 512, 128, generator=g) for h in (4, 2, 2))
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    vt8 = v8.transpose(2, 3).contiguous()
    monkeypatch.setattr(fp8, "GLUON_MIN_N", 256)
    assert fp8.GLUON_WIDE is False
    seen = []
    entry = hopper_ws.attention_fp8
    monkeypatch.setattr(hopper_ws, "attention_fp8", lambda *a, **kw: seen.append(kw.get("block_n")) or entry(*a, **kw))
    with gluon_cpu.running():
        narrow = flash_attention_fp8(q8, k8, v8, True, q_scale=qs, k_scale=ks, v_scale=vs)
        monkeypatch.setattr(fp8, "GLUON_WIDE", True)
        wide = flash_attention_fp8(q8, k8, v8, True, q_scale=qs, k_scale=ks, v_scale=vs)
        want = entry(q8, k8, vt8, qs, ks, vs, True, block_n=256)[0]
        short = [quantize[..., :384, :] for quantize in (q8, k8, v8)]
        flash_attention_fp8(*short, True, q_scale=qs[..., :3], k_scale=ks[..., :3], v_scale=vs[..., :3])  # N = 384
        monkeypatch.setattr(fp8, "GLUON_PERSISTENT", True)
        flash_attention_fp8(q8, k8, v8, True, q_scale=qs, k_scale=ks, v_scale=vs)
    assert seen == [128, 256, 128, 128] and torch.equal(wide, want.float()) and not torch.equal(wide, narrow)


@needs_interpreter
@pytest.mark.parametrize("window_size", [None, 200])
def test_the_gluon_mode_is_the_route_kernels_flash_attention_takes_when_it_is_set(monkeypatch, window_size):
    """fast_backward's gluon mode behind kernels.flash_attention's autograd: outside a Hopper GPU (or the model of
    one) it does not apply and lesson 07's pair runs; set as AUTOGRAD_CONFIG inside the model, the gradients are
    hopper_ws_bwd's bit for bit (the route adds nothing of its own), and right against float64."""
    from course_utils import kernels
    from course_utils.kernels import fast_backward as fb

    g = torch.Generator().manual_seed(11)  # fp16: Triton's interpreter computes bf16 wrongly (the course's forward)
    q, do = (torch.randn(1, 4, 256, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(1, 2, 256, 64, generator=g).half() for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert fb.autograd_config(q, k, v, True, window_size, config=fb.GLUON_DEFAULT) is None
    assert "Hopper GPU" in fb.unsupported_reason(q, k, v, fb.GLUON_DEFAULT)
    assert fb.autograd_config(q, k, v, True, window_size, 4, config=fb.GLUON_DEFAULT) is None  # sinks: lesson 07's
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", fb.GLUON_DEFAULT)
    with gluon_cpu.running():
        assert fb.autograd_config(q, k, v, True, window_size) == fb.GLUON_DEFAULT
        assert fb.autograd_config(q, k, v, True, window_size, softcap=30.0) is None  # a lesson 12 keyword
        o = kernels.flash_attention(q, k, v, True, window_size=window_size)
        o.backward(do)
        o2, lse = kernels.flash_attention_with_lse(q.detach(), k.detach(), v.detach(), True, window_size=window_size)
        direct = hopper_ws_bwd.attention_backward(q.detach(), k.detach(), v.detach(), o2, lse, do, True,
                                                  window_size=window_size)
    assert torch.equal(o.detach(), o2)
    for got, want in zip((q.grad, k.grad, v.grad), direct):
        assert torch.equal(got, want)
    want = references.attention_backward(*(t.detach().double().numpy() for t in (q, k, v, do)), causal=True,
                                         window_size=window_size)
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        assert _rel(got, ref) < 1e-2, name


@needs_interpreter
def test_sinks_under_a_window_of_every_key_take_the_gluon_route(monkeypatch):
    """Sinks select nothing more under a window of at least N keys, so such a call takes the Gluon backward (as
    one without sinks would) where sinks under a shorter window keep lesson 07's pair while GLUON_SINKS is False;
    the gradients are right against float64 with the sinks, and through the route the Gluon backward's own."""
    from course_utils import kernels
    from course_utils.kernels import fast_backward as fb

    g = torch.Generator().manual_seed(13)
    q, do = (torch.randn(1, 4, 128, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(1, 2, 128, 64, generator=g).half() for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", fb.GLUON_DEFAULT)
    monkeypatch.setattr(fb, "GLUON_SINKS", False)
    calls = record_calls(monkeypatch, (hopper_ws_bwd, "backward_validated"))
    with gluon_cpu.running():
        assert fb.autograd_config(q, k, v, True, 127, 4) is None  # query 127 does not see key 0 but for the sinks
        assert fb.autograd_config(q, k, v, True, 128, 4) == fb.GLUON_DEFAULT
        assert fb.autograd_config(q, k, v, True, 4096, 4) == fb.GLUON_DEFAULT
        kernels.flash_attention(q, k, v, True, window_size=128, sink_size=4).backward(do)
        assert calls == ["backward_validated"]
        want = references.attention_backward(*(t.detach().double().numpy() for t in (q, k, v, do)), causal=True,
                                             window_size=128, sink_size=4)
        for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
            assert _rel(got, ref) < 1e-2, name
        monkeypatch.setattr(fb, "GLUON_SINKS", None)  # sinks beyond the window: the model's pick (here: it fits)
        assert fb.autograd_config(q, k, v, True, 40, 4) == fb.GLUON_DEFAULT
        q.grad = k.grad = v.grad = None
        kernels.flash_attention(q, k, v, True, window_size=40, sink_size=4).backward(do)
        assert calls == ["backward_validated"] * 2
        o, lse = kernels.flash_attention_with_lse(q.detach(), k.detach(), v.detach(), True, window_size=40,
                                                  sink_size=4)
        direct = hopper_ws_bwd.attention_backward(q.detach(), k.detach(), v.detach(), o, lse, do, True,
                                                  window_size=40, sink_size=4)
    want = references.attention_backward(*(t.detach().double().numpy() for t in (q, k, v, do)), causal=True,
                                         window_size=40, sink_size=4)
    for name, got, same, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), direct, want):
        assert torch.equal(got, same), name
        assert _rel(got, ref) < 1e-2, name


def test_the_sink_keys_program_fits_from_windows_of_an_sm_share():
    """fast_backward.sink_walk_fits: the Gluon backward takes sinks where the program of the sink keys (N query rows)
    walks no longer than an SM's share of the grid (each other program: about W + 128 rows)."""
    from course_utils.kernels import fast_backward as fb

    fits = fb.sink_walk_fits
    assert not fits(1, 8, 1024, 128, 132) and fits(1, 8, 4096, 128, 132)  # the window grid: 32/8 heads, batch 1
    assert fits(1, 8, 1984, 128, 132) and not fits(1, 8, 1983, 128, 132)  # 132 * 128 == 8 * (1984 + 128)
    assert fits(4, 8, 1024, 128, 132) and not fits(1, 1, 4096, 128, 132)  # more sequences or heads, fewer
    assert fits(1, 8, 256, 128, 0)  # the CPU's model (no SMs): programs run one after another


@needs_interpreter
def test_a_training_step_through_the_route_checks_the_call_once(monkeypatch):
    """Host time: kernels.flash_attention resolves autograd's configuration once a step and passes it on, so neither
    the autograd function's forward nor its backward asks autograd_config again, and the backward launches
    hopper_ws_bwd's kernels without the checks the forward made (backward_validated, not attention_backward);
    flash_attention_fast_backward, whose caller checked nothing, resolves it once, in the forward."""
    from course_utils import kernels
    from course_utils.kernels import fast_backward as fb

    calls = record_calls(monkeypatch, (fb, "autograd_config"), (hopper_ws_bwd, "attention_backward"),
                         (hopper_ws_bwd, "backward_validated"))
    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(1, 4, 128, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(1, 2, 128, 64, generator=g).half().requires_grad_() for _ in range(2))
    q.requires_grad_()
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", fb.GLUON_DEFAULT)
    with gluon_cpu.running():
        kernels.flash_attention(q, k, v, True).backward(do)
        assert calls == ["autograd_config", "backward_validated"]
        grads = [t.grad for t in (q, k, v)]
        q.grad = k.grad = v.grad = None
        fb.flash_attention_fast_backward(q, k, v, True).backward(do)
        assert calls == ["autograd_config", "backward_validated"] * 2
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        assert torch.equal(got, want)


def test_a_descriptor_layout_is_made_once_per_box_and_dtype():
    """hopper_ws._descriptor remembers each box's shared-memory layout (making one costs host time on every launch):
    the same box and dtype give the same layout object, another box another, and inside gluon_cpu.running() the
    model's layout, not the one remembered for the GPU."""
    t = torch.zeros(256, 64, dtype=torch.float16)
    a, b = hopper_ws._descriptor(t, [64, 64]), hopper_ws._descriptor(t[128:], [64, 64])
    assert a.layout is b.layout and a.layout.swizzle_byte_width == 128
    assert hopper_ws._descriptor(t, [32, 64]).layout is not a.layout
    assert hopper_ws._descriptor(t.bfloat16(), [64, 64]).layout is not a.layout
    with gluon_cpu.running():
        assert not isinstance(hopper_ws._descriptor(t, [64, 64]).layout, type(a.layout))


def test_a_wait_that_leaves_the_product_it_needs_in_flight_is_caught(tmp_path):
    """``warpgroup_mma_wait(1)`` completes all but the newest product: in the overlapped loop ``Q Kᵀ`` must be
    issued before ``P V`` for the wait to return the scores. Issued the other way round, the model says so."""
    old = '''    s = warpgroup_mma(q, k_smem.index(j % NB).permute((1, 0)), gl.zeros([M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    acc = warpgroup_mma(p_op, _v_operand(v_smem, prev), acc, is_async=True)'''
    new = '''    acc = warpgroup_mma(p_op, _v_operand(v_smem, prev), acc, is_async=True)
    s = warpgroup_mma(q, k_smem.index(j % NB).permute((1, 0)), gl.zeros([M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)'''
    planted = _planted(tmp_path, hopper_ws, old, new, "planted_ws_wait_order")
    with pytest.raises(gluon_cpu.RaceError, match="newest products in flight"):
        _forward(planted, False, 64, loop="overlap")


def test_fp16_holds_every_e4m3_value_exactly():
    """The FP8 overlap carries P from one step to the next in fp16 and converts it back at the product
    (``hopper_ws._overlap_step``): every finite e4m3 value survives the round trip bit for bit."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[torch.isfinite(codes.float())]
    assert finite.numel() == 254  # all but the two NaNs (e4m3fn has no infinities)
    back = finite.to(torch.float16).to(torch.float8_e4m3fn)
    assert torch.equal(back.view(torch.uint8), finite.view(torch.uint8))
