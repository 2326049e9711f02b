"""A Hopper forward with warp specialisation written by hand, in Gluon (lesson 11).

Triton 3.6's ``tl.range(..., warp_specialize=True)`` builds FA3's shape of kernel for Hopper, and every such
kernel of the course deadlocked on the H200 (``results/ws_smoke_h200.txt``). Gluon, Triton's lower-level
language (``triton.experimental.gluon``), lets the same kernel be written with its partitions, buffers and
barriers spelled out, and that one runs (``results/hopper_ws_probe.json``, ``benchmarks/hopper_ws_probe.py``).

One program computes 128 query rows of one head, in three partitions (``gl.warp_specialize``):

* **the loader** (1 warp, 24 registers): TMA copies of the program's two 64-row halves of ``Q``, then of each
  K/V tile into a ring of ``num_buffers`` slots, each slot waited for on its *empty* barrier and announced on
  its *ready* barriers (one for K, one for V, so ``Q Kᵀ`` can start before V lands);
* **two consumers** (a warpgroup of 4 warps each, 240 registers): each owns 64 of the rows and runs the online
  softmax with both products on ``wgmma`` (``warpgroup_mma``); a tile's slot is released when both have used
  it (its empty barrier counts two arrivals). While one consumer's softmax runs on the ALUs, the warp
  schedulers give the tensor cores to the other's products: FA3's overlap of two warpgroups, left to the
  hardware instead of ordered by named barriers.

``loop="pipelined"`` adds FA3's other overlap inside a warpgroup: tile ``j + 1``'s ``Q Kᵀ`` is issued before
tile ``j``'s softmax. Measured on the H200 it was slower (each iteration waits for both products).
``loop="overlap"`` is FA3's form of it: tile ``j``'s ``Q Kᵀ`` and tile ``j - 1``'s ``P V`` issued together, the
softmax run while ``P V`` is still on the tensor cores. ``loop="pingpong"`` orders the two consumers as FA3 does
(each issues its ``Q Kᵀ`` on its turn, two mbarriers passing the turn); ``loop="overlap_pingpong"`` is FA3's
whole schedule, both (each step's two products issued on the consumer's turn); ``fma=True`` folds the softmax's
scale into one fused multiply-add. These four compiled here, run on the CPU by :mod:`.gluon_cpu`, and checked
against float64 on an H200 and an H100 (``tests/test_hopper_ws.py``); timed on the H100, each slower than the
simple loop but ping-pong and ``fma`` (``results/hopper_ws_probe_h100.json``).

With ``window_size`` (and ``sink_size``), lesson 08's window: each program's loader and consumers walk the same
list of key tiles (:func:`window_plan`: the sink tiles, then the window's up to the diagonal), and only the
tiles that cross the window's edge, the diagonal or the sinks are masked (the serial and ping-pong loops; run
on the CPU by :mod:`.gluon_cpu`, and checked on an H200 and an H100; not yet timed).

:func:`attention_fp8` runs the same partitions on e4m3 tiles (FA3's FP8 forward; FP8 ``wgmma`` at twice bf16's
rate, the tiles half the shared memory): V handed over transposed (FP8 ``wgmma`` reads B K-major), the scales of
``kernels.quantize_fp8`` folded as in ``fp8.launch_fp8_hopper`` (one FMA per score, P as ``256 p`` in e4m3, the
accumulator in units of the tile's ``v_scale``). Checked on an H200 and an H100; on the H100 1.29-1.36x cuDNN's
bf16 forward, 1.03-1.12x the course's Triton FP8 kernel (``results/hopper_ws_fp8_probe_h100.json``).

``attention_fp8(..., block_n=256)`` takes FA3's wider FP8 tiles (its 224 keys are not a power of two): 256 keys a
K/V tile, each half its own scale block (:func:`_wide_softmax`), so half as many waits, barriers, row reductions and
rescales of the accumulator per key; the serial loop only (compiled for sm_90 without spills but in the causal
diagonal tile, run on the CPU by :mod:`.gluon_cpu`; not yet timed, so no route takes it).

``attention(..., persistent=True)`` runs :func:`attn_fwd_ws_persistent`: one program per SM walking the work
tiles longest first, two Q buffers so that the next tile's Q lands while this one runs, the K/V ring's position
running on across tiles (compiled with no spills, 192 KiB of shared memory at D = 128; run on the CPU by
:mod:`.gluon_cpu`, checked on an H200 and an H100; on the H100 0.95x cuDNN at non-causal 16k, one case).
``attention_fp8(..., persistent=True)`` runs the FP8 tiles on the same grid (each work tile's ``q_scale``, its key
tiles' scales, V transposed; all four K/V slots fit in 160 KiB; run on the CPU by :mod:`.gluon_cpu` and compiled
for sm_90 without spills, checked on an H100; there 0.94-0.995x a program per tile, N 4k-16k,
``results/route_check_fp8_h100.json``, so ``fp8.GLUON_PERSISTENT`` leaves it off). By default the persistent grid
walks every head's longest block first, so the programs that run together read K/V tiles of every kv head at once,
and a program per tile takes one head's blocks after another, so under the causal mask the last heads' long blocks
start last. ``heads_together`` walks either grid a few (batch, query head) rows at a time, each run's longest
blocks first (:func:`kv_head_order`: a kv head's query heads; run on the CPU by :mod:`.gluon_cpu`, the same output
bit for bit; plain attention's route without the causal mask takes it, ``dispatch.GLUON_WALK_KV_HEADS``, and the
causal route while ``dispatch.GLUON_WALK_CAUSAL``). A program per tile reads the walk from its grid's shape
(:func:`_grid_tile`, through :func:`program_coords`), so the loader's arguments, which lesson 11's exercise
gives, stay as they are, and the backward's dQ, which takes the forward's tiles, walks the same way.

On a CPU Triton cannot run it (Gluon has no interpreter): ``tests/test_hopper_ws.py`` compiles it for sm_90
there, and :mod:`.gluon_cpu` runs its Python with a model of the barriers, copies and products
(``tests/test_gluon_cpu.py``); on a Hopper GPU ``tests/test_hopper_ws.py`` runs it.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import gluon_cpu  # imports nothing of this module at import time
from .chips import TARGETS

BLOCK_M = 128  # query rows per program: two consumers of 64 (wgmma's M per warpgroup)
BLOCK_N = 128  # keys per K/V tile
HEAD_DIMS = (64, 128)
CONSUMER_REGS, LOADER_REGS, MAXNREG = 240, 24, 168  # 3 warpgroups x 168 = 240 + 240 + 24: one program per SM
LOG2E = 1.4426950408889634
gluon_cpu.host_module(__name__)  # its descriptors and layouts, under gluon_cpu.running()


@gluon.jit
def _block_rows(start_m, off_hz, N, H: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                CAUSAL: gl.constexpr):
    """Query block ``start_m`` of (batch, query head) ``off_hz``: its first row of q (and o) and its kv head's
    first row of k and v, in the 2-D views, and its key tiles (``BLOCK_M == BLOCK_N``)."""
    kv_row = (off_hz // H * (H // GROUP) + off_hz % H // GROUP) * N  # q_head -> kv_head
    q_row = off_hz * N + start_m * BLOCK_M
    if CAUSAL:
        n_tiles = start_m + 1  # the last tile holds the diagonal
    else:
        n_tiles = N // BLOCK_M
    return q_row, kv_row, n_tiles


@gluon.jit
def _key_tiles(n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """:func:`_block_rows`'s count of ``BLOCK_M``-key tiles as tiles of ``BLOCK_N`` keys (FP8's wide tiles: 256), the
    last one holding the diagonal under the causal mask (the keys past it masked)."""
    if BLOCK_N != BLOCK_M:
        n_tiles = (n_tiles * BLOCK_M + BLOCK_N - 1) // BLOCK_N
    return n_tiles


@gluon.jit
def _grid_tile(N, BLOCK_M: gl.constexpr):
    """This program's ``(start_m, off_hz)`` on a grid of ``(k, N / BLOCK_M, B * H / k)`` programs: the GPU starts
    them ``program_id(0)`` fastest, so ``k`` (batch, query head) rows at a time, their blocks of one length side by
    side, the longest first (:func:`_walk`'s order). ``k`` is the grid's first extent, so every partition (and
    lesson 11's loader, through :func:`program_coords`) takes the same tile with no argument of its own; ``k = 1``:
    each row's blocks in turn."""
    return N // BLOCK_M - 1 - gl.program_id(1), gl.program_id(2) * gl.num_programs(0) + gl.program_id(0)


@gluon.jit
def program_coords(N, H: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """This program's query block (the longest rows first under the causal mask; rows side by side as the grid's
    shape says, :func:`_grid_tile`), then :func:`_block_rows`."""
    start_m, off_hz = _grid_tile(N, BLOCK_M)
    q_row, kv_row, n_tiles = _block_rows(start_m, off_hz, N, H, GROUP, BLOCK_M, CAUSAL)
    return start_m, q_row, kv_row, n_tiles


@gluon.jit
def _walk(tile, n_m, HEADS: gl.constexpr):
    """Work tile ``tile`` of a walk over the (query block, row) tiles ``HEADS`` (batch, query head) rows at a time:
    within each run of ``HEADS`` rows the longest query blocks first (under the causal mask), the rows' blocks of
    one length side by side; ``(start_m, off_hz)``. ``HEADS = 1``: each row's blocks in turn; ``HEADS = B * H``:
    every row's longest block first."""
    span = n_m * HEADS
    w = tile % span
    return n_m - 1 - w // HEADS, tile // span * HEADS + w % HEADS


@gluon.jit
def window_plan(start_m, window_size, sink_size, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Under lesson 08's window (causal; ``BLOCK_N`` dividing ``BLOCK_M``), query block ``start_m``'s key tiles:
    ``ns`` sink tiles (0, 1, ...), then the window's from ``lo`` to the diagonal; ``(lo, ns, n_tiles)``."""
    first = start_m * BLOCK_M - window_size + 1  # the oldest key the block's first row sees
    if first < 0:
        first = 0
    lo = first // BLOCK_N
    ns = (sink_size + BLOCK_N - 1) // BLOCK_N
    if ns > lo:
        ns = lo  # sink tiles the window reaches are the window's
    last = (start_m * BLOCK_M + BLOCK_M - 1) // BLOCK_N  # the tile of the block's last row's own key
    return lo, ns, ns + last - lo + 1


@gluon.jit
def window_kv_tile(j, lo, ns):
    """Step ``j``'s key tile under a window: the sink tiles first, then the window's from ``lo``."""
    kv_tile = j
    if j >= ns:
        kv_tile = j + lo - ns
    return kv_tile


@gluon.jit
def window_tile_masked(j, kv_tile, ns, start_m, window_size, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Whether step ``j`` (key tile ``kv_tile``, :func:`window_plan`'s order) needs the window's mask for query
    block ``start_m``: a sink tile, a tile that reaches the diagonal, or one that starts before the key the
    block's last row still sees (a tile from there on lies inside every row's window)."""
    whole_from = start_m * BLOCK_M + BLOCK_M - window_size
    return (j < ns) | (kv_tile * BLOCK_N + BLOCK_N > start_m * BLOCK_M) | (kv_tile * BLOCK_N < whole_from)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, N,
                    window_size, sink_size, H: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, V_T: gl.constexpr, WINDOW: gl.constexpr):
    """The producer: Q's two halves once, then K and V tile by tile into the ring's free slots.

    ``V_T`` (FP8): V comes transposed, ``[B * H_kv * D, N]``, and a tile is the ``[D, BLOCK_N]`` box at the
    tile's keys. ``WINDOW``: the tiles of :func:`window_plan`, in its order."""
    start_m, q_row, kv_row, n_tiles = program_coords(N, H, GROUP, BLOCK_M, CAUSAL)
    n_tiles = _key_tiles(n_tiles, BLOCK_M, BLOCK_N)
    lo = 0
    ns = 0
    if WINDOW:
        lo, ns, n_tiles = window_plan(start_m, window_size, sink_size, BLOCK_M, BLOCK_N)
    vt_row = kv_row // N * v_smem.type.shape[1]  # kv_head's first row of V^T (used with V_T only)
    HALF: gl.constexpr = BLOCK_M // 2
    NB: gl.constexpr = k_smem.type.shape[0]
    for half in gl.static_range(2):
        mbarrier.expect(q_bars.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + half * HALF, 0], q_bars.index(half), q_smem.index(half))
    for j in range(n_tiles):
        idx = j % NB
        phase = (j // NB) & 1
        kv_tile = j
        if WINDOW:
            kv_tile = window_kv_tile(j, lo, ns)
        mbarrier.wait(empty_bars.index(idx), phase ^ 1)  # a fresh barrier counts as released: the first pass waits not
        _copy_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, idx, kv_row, vt_row, kv_tile, BLOCK_N, V_T)


@gluon.jit
def _copy_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, idx, kv_row, vt_row, kv_tile, BLOCK_N: gl.constexpr,
             V_T: gl.constexpr):
    """Key tile ``kv_tile`` of the kv head whose rows start at ``kv_row``: K, then V, into ring slot ``idx``, each
    copy announced on its own ready barrier. ``V_T`` (FP8): V transposed, ``[B * H_kv * D, N]``, whose tile is the
    ``[D, BLOCK_N]`` box at the tile's keys in the kv head's rows from ``vt_row``."""
    mbarrier.expect(k_bars.index(idx), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row + kv_tile * BLOCK_N, 0], k_bars.index(idx), k_smem.index(idx))
    mbarrier.expect(v_bars.index(idx), v_desc.block_type.nbytes)
    if V_T:
        tma.async_copy_global_to_shared(v_desc, [vt_row, kv_tile * BLOCK_N], v_bars.index(idx), v_smem.index(idx))
    else:
        tma.async_copy_global_to_shared(v_desc, [kv_row + kv_tile * BLOCK_N, 0], v_bars.index(idx),
                                        v_smem.index(idx))


@gluon.jit
def _tile_scales(j, qk_scale, v_prev, ks_ptr, vs_ptr, scale_base, BLOCK_N: gl.constexpr, SCALE_BLOCK: gl.constexpr,
                 FP8: gl.constexpr):
    """Tile ``j``'s score scale and V scale. FP8: ``qk_scale`` (the program's ``q_scale * sm_scale * log2(e)``)
    times the tile's ``k_scale``, and its ``v_scale`` (a tile never straddles two scale blocks); else
    ``qk_scale`` and ``v_prev`` as they are."""
    tile_scale = qk_scale
    v_scale = v_prev
    if FP8:
        blk = j * BLOCK_N // SCALE_BLOCK
        tile_scale = qk_scale * gl.load(ks_ptr + scale_base + blk)
        v_scale = gl.load(vs_ptr + scale_base + blk)
    return tile_scale, v_scale


@gluon.jit
def _rescale(acc, alpha, v_prev, v_scale, FP8: gl.constexpr):
    """The accumulator moved onto the new max; with FP8 also into the units of the tile's ``v_scale`` (``acc``
    holds ``O / v_scale`` so that ``P8 V8`` adds into it inside the tensor cores)."""
    if FP8:
        acc = acc * (alpha * (v_prev / v_scale))[:, None]
    else:
        acc = acc * alpha[:, None]
    return acc


@gluon.jit
def _v_operand(v_smem, idx):
    """Slot ``idx`` of V as ``P V``'s B operand ``[BLOCK_N, D]``. FP8 keeps V transposed, ``[D, BLOCK_N]``, and
    reads it through a transposed view: Hopper's FP8 ``wgmma`` takes B only K-major (the keys contiguous)."""
    v = v_smem.index(idx)
    if v_smem.dtype.is_fp8():
        v = v.permute((1, 0))
    return v


@gluon.jit
def _softmax_core(s, kv_tile, m_i, l_i, qk_scale, rows, window_size, sink_size, BLOCK_N: gl.constexpr,
                  MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, P_DTYPE: gl.constexpr,
                  FMA: gl.constexpr):
    """One tile's online softmax on the scores ``s``: the new max and sum, the factor ``alpha`` that rescales the
    accumulator, and P for ``P V``.

    ``FMA``: the max is taken on the raw scores (the scale is positive) and ``s * scale - m`` is one fused
    multiply-add per score, instead of a multiply over the tile and then a subtraction. FP8 (``P_DTYPE`` e4m3,
    always ``FMA``): P is made in ``[0, 256]`` (``fp8.P_SCALE``) by subtracting 8 less,
    ``exp2(x - (m - 8)) = 256 exp2(x - m)``, exact and free; ``l_i`` counts in the same units.

    ``MASK``: 0 none, 1 causal (key ``j`` visible from query ``i`` iff ``j <= i``), 2 lesson 08's window (also
    ``i - j < window_size`` or ``j < sink_size``), where a row may see none of a tile's keys before it has seen
    any: its max is then taken as 0 in the exponentials, so that they give 0 and not ``-inf - (-inf)``."""
    FP8: gl.constexpr = P_DTYPE.is_fp8()
    if not FMA:
        s = s * qk_scale
    if MASK == 2:
        cols = kv_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        d = rows[:, None] - cols[None, :]
        s = gl.where((d >= 0) & ((d < window_size) | (cols[None, :] < sink_size)), s, -float("inf"))
    elif MASK:
        cols = kv_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(rows[:, None] >= cols[None, :], s, -float("inf"))
    if FMA:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = m_new
    if MASK == 2:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    if FMA:
        if FP8:
            p = gl.exp2(gl.fma(s, qk_scale, -(m_use - 8.0)[:, None]))
        else:
            p = gl.exp2(gl.fma(s, qk_scale, -m_use[:, None]))
    else:
        p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    # P stays in registers as wgmma's A operand (k_width: 32 bits of values per register, two 16-bit or four 8-bit)
    K_WIDTH: gl.constexpr = 4 if FP8 else 2
    p_op = gl.convert_layout(p.to(P_DTYPE), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=K_WIDTH))
    return m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), p_op


@gluon.jit
def _wide_scales(j, qk_scale, ks_ptr, vs_ptr, scale_base, BLOCK_N: gl.constexpr, SCALE_BLOCK: gl.constexpr):
    """A wide FP8 tile's scales, half by half (each half one scale block of 128 keys or inside a longer one):
    ``qk_scale`` times each half's ``k_scale``, and each half's ``v_scale``."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    blk0 = j * BLOCK_N // SCALE_BLOCK
    blk1 = (j * BLOCK_N + HALF_N) // SCALE_BLOCK
    ts0 = qk_scale * gl.load(ks_ptr + scale_base + blk0)
    ts1 = qk_scale * gl.load(ks_ptr + scale_base + blk1)
    return ts0, ts1, gl.load(vs_ptr + scale_base + blk0), gl.load(vs_ptr + scale_base + blk1)


@gluon.jit
def _as_rows(x, s_layout: gl.constexpr):
    """A row vector reduced from a half of the scores, named as ``s_layout``'s rows (the same registers)."""
    return gl.convert_layout(x, gl.SliceLayout(1, s_layout), assert_trivial=True)


@gluon.jit
def _wide_softmax(s, kv_tile, m_i, l_i, ts0, ts1, vs0, vs1, rows, row0, BLOCK_N: gl.constexpr, MASK: gl.constexpr,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, P_DTYPE: gl.constexpr):
    """:func:`_softmax_core` on a wide FP8 tile (256 keys, two scale blocks of 128): each half its own score scale
    and ``v_scale``. The halves are the scores' top column bit, the thread's own registers, so splitting and joining
    them moves nothing. The accumulator takes the larger ``v_scale`` (``v_ref``) as its unit; the other half's P is
    made smaller by the ratio inside the exponent (``exp2(x - m + 8 + log2 r)``, free), and ``l_i`` adds each
    half's row sum divided by it again (a multiply a row). Returns the new max and sum, ``alpha``, P as ``P V``'s A
    operand and ``v_ref``.

    Where the causal mask hides the whole second half from this consumer's rows (``row0`` on; the diagonal tile of
    a query block in the tile's first half), ``v_ref`` is the first half's own ``v_scale``: P is then made exactly
    as in a 128-key tile, each row's largest score giving 256, exact in e4m3. Scaled by ``r < 1`` it would round
    (up to 6%), and a row of a few keys (the sequence's first rows) leans on that one value."""
    M: gl.constexpr = s.type.shape[0]
    HALF_N: gl.constexpr = BLOCK_N // 2
    s0, s1 = gl.split(gl.permute(gl.reshape(s, [M, 2, HALF_N]), (0, 2, 1)))
    if MASK:  # half by half: a thread holds 32 of a half's columns, 64 of the tile's
        HALF_COLS: gl.constexpr = gl.SliceLayout(0, s0.type.layout)
        r = gl.convert_layout(rows - kv_tile * BLOCK_N, gl.SliceLayout(1, s0.type.layout), assert_trivial=True)
        cols = gl.arange(0, HALF_N, layout=HALF_COLS)
        s0 = gl.where(r[:, None] >= cols[None, :], s0, -float("inf"))
        s1 = gl.where(r[:, None] >= (cols + HALF_N)[None, :], s1, -float("inf"))
    m_new = gl.maximum(m_i, gl.maximum(_as_rows(gl.max(s0, axis=1), s_layout) * ts0,
                                       _as_rows(gl.max(s1, axis=1), s_layout) * ts1))
    v_ref = gl.maximum(vs0, vs1)
    if MASK:
        if kv_tile * BLOCK_N + HALF_N >= row0 + M:  # no row of ours sees the second half (see the docstring)
            v_ref = vs0
    r0 = vs0 / v_ref
    r1 = vs1 / v_ref
    HALF_ROWS: gl.constexpr = gl.SliceLayout(1, s0.type.layout)
    off = gl.convert_layout(m_new - 8.0, HALF_ROWS, assert_trivial=True)
    p0 = gl.exp2(gl.fma(s0, ts0, -(off - gl.log2(r0))[:, None]))
    p1 = gl.exp2(gl.fma(s1, ts1, -(off - gl.log2(r1))[:, None]))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + _as_rows(gl.sum(p0, axis=1), s_layout) / r0 + _as_rows(gl.sum(p1, axis=1), s_layout) / r1
    p = gl.reshape(gl.permute(gl.join(p0, p1), (0, 2, 1)), [M, BLOCK_N])
    p_op = gl.convert_layout(p.to(P_DTYPE), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))
    return m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), p_op, v_ref


@gluon.jit
def _softmax_step(s, kv_tile, m_i, l_i, acc, tile_scale, v_prev, v_scale, rows, window_size, sink_size,
                  BLOCK_N: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  P_DTYPE: gl.constexpr, FMA: gl.constexpr):
    """:func:`_softmax_core` with the accumulator rescaled at once (every loop but ``"overlap"``)."""
    m_new, l_i, alpha, p_op = _softmax_core(s, kv_tile, m_i, l_i, tile_scale, rows, window_size, sink_size, BLOCK_N,
                                            MASK, s_layout, o_layout, P_DTYPE, FMA)
    return m_new, l_i, _rescale(acc, alpha, v_prev, v_scale, P_DTYPE.is_fp8()), p_op


@gluon.jit
def _tile(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, j, kv_tile, m_i, l_i, acc, v_prev, qk_scale,
          ks_ptr, vs_ptr, scale_base, rows, row0, window_size, sink_size, BLOCK_N: gl.constexpr,
          SCALE_BLOCK: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
          ME: gl.constexpr, PINGPONG: gl.constexpr, FMA: gl.constexpr):
    """Step ``j`` of the ring, key tile ``kv_tile`` (the same but under a window): wait for K, ``S = Q Kᵀ``, the
    softmax, wait for V, ``acc += P V``, release the slot.

    ``PINGPONG`` (FA3's ordering of two warpgroups): consumer ``ME`` issues its ``Q Kᵀ`` only on its turn and
    then hands the turn to the other, so the two take the tensor cores in alternation and one's softmax runs
    under the other's product. A turn is an mbarrier of one arrival per consumer; consumer 0 goes first (a
    fresh barrier counts as completed for the phase before 0)."""
    NB: gl.constexpr = k_smem.type.shape[0]
    M: gl.constexpr = q.type.shape[0]
    idx = j % NB
    phase = (j // NB) & 1
    # FP8's two scales for the tile, loaded while the loader's copy and then Q Kᵀ are in flight (a wide tile's four)
    WIDE: gl.constexpr = BLOCK_N > M * 2  # more keys than the program's 128 rows: FP8's wide tiles of 256
    if WIDE:
        ts0, ts1, vs0, vs1 = _wide_scales(kv_tile, qk_scale, ks_ptr, vs_ptr, scale_base, BLOCK_N, SCALE_BLOCK)
    else:
        tile_scale, v_scale = _tile_scales(kv_tile, qk_scale, v_prev, ks_ptr, vs_ptr, scale_base, BLOCK_N,
                                           SCALE_BLOCK, v_smem.dtype.is_fp8())
    mbarrier.wait(k_bars.index(idx), phase)
    s = gl.zeros([M, BLOCK_N], gl.float32, s_layout)
    if PINGPONG:
        mbarrier.wait(turn_bars.index(ME), (j & 1) ^ (1 - ME))
    s = warpgroup_mma(q, k_smem.index(idx).permute((1, 0)), s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - ME), count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    if WIDE:
        m_i, l_i, alpha, p_op, v_scale = _wide_softmax(s, kv_tile, m_i, l_i, ts0, ts1, vs0, vs1, rows, row0, BLOCK_N,
                                                       MASK, s_layout, o_layout, v_smem.dtype)
        acc = _rescale(acc, alpha, v_prev, v_scale, True)
    else:
        m_i, l_i, acc, p_op = _softmax_step(s, kv_tile, m_i, l_i, acc, tile_scale, v_prev, v_scale, rows,
                                            window_size, sink_size, BLOCK_N, MASK, s_layout, o_layout, v_smem.dtype,
                                            FMA)
    mbarrier.wait(v_bars.index(idx), phase)
    acc = warpgroup_mma(p_op, _v_operand(v_smem, idx), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty_bars.index(idx), count=1)  # counts once per partition; the slot needs both consumers
    return m_i, l_i, acc, v_scale


@gluon.jit
def _overlap_step(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, j, p_prev, m_i, l_i, acc, v_prev,
                  qk_scale, ks_ptr, vs_ptr, scale_base, rows, BLOCK_N: gl.constexpr, SCALE_BLOCK: gl.constexpr,
                  MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, ME: gl.constexpr,
                  PINGPONG: gl.constexpr, FMA: gl.constexpr):
    """Tile ``j``'s ``Q Kᵀ`` and tile ``j - 1``'s ``P V`` issued together; tile ``j``'s softmax runs while
    ``P V`` is still on the tensor cores (``warpgroup_mma_wait(1)`` waits for the older product only).
    ``v_prev`` is tile ``j - 1``'s V scale (FP8). ``PINGPONG`` (FA3's whole schedule): the two products are
    issued on this consumer's turn, which then passes to the other (turn ``j - 1`` of each, as in :func:`_tile`)."""
    NB: gl.constexpr = k_smem.type.shape[0]
    M: gl.constexpr = q.type.shape[0]
    FP8: gl.constexpr = v_smem.dtype.is_fp8()
    prev = (j - 1) % NB
    tile_scale, v_scale = _tile_scales(j, qk_scale, v_prev, ks_ptr, vs_ptr, scale_base, BLOCK_N, SCALE_BLOCK, FP8)
    mbarrier.wait(k_bars.index(j % NB), (j // NB) & 1)
    mbarrier.wait(v_bars.index(prev), ((j - 1) // NB) & 1)
    if PINGPONG:
        mbarrier.wait(turn_bars.index(ME), ((j - 1) & 1) ^ (1 - ME))
    p_op = p_prev
    if FP8:
        p_op = p_prev.to(gl.float8e4nv)  # P travels between steps in fp16 (see the end of this step)
    s = warpgroup_mma(q, k_smem.index(j % NB).permute((1, 0)), gl.zeros([M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    acc = warpgroup_mma(p_op, _v_operand(v_smem, prev), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - ME), count=1)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # Q Kᵀ done; P V may still run
    m_i, l_i, alpha, p = _softmax_core(s, j, m_i, l_i, tile_scale, rows, 0, 0, BLOCK_N, MASK, s_layout, o_layout,
                                       v_smem.dtype, FMA)
    # acc is rescaled only once P V has added into it. p_prev passes through the wait as well: P V reads its
    # registers until it finishes, and a value the code no longer names is dead to the compiler, which would give
    # the new P the same registers; ptxas then finds the softmax writing a running wgmma's input and serialises
    # every wgmma of the kernel (its warning C7513), and the overlap is gone. FP8's P is carried to the next step
    # in fp16, which holds every e4m3 value exactly: an 8-bit tensor carried across the loop is repacked byte by
    # byte each step (898 PRMT in the kernel against 96; results/sm90_gluon.json), and Triton 3.6 cannot pass one
    # through the wait.
    if FP8:
        p = p.to(gl.float16)
    acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev))
    mbarrier.arrive(empty_bars.index(prev), count=1)
    return p, m_i, l_i, _rescale(acc, alpha, v_prev, v_scale, FP8), v_scale


@gluon.jit
def _overlapped_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, n_tiles, m_i, l_i, acc, v_prev,
                     qk_scale, ks_ptr, vs_ptr, scale_base, rows, BLOCK_N: gl.constexpr, SCALE_BLOCK: gl.constexpr,
                     CAUSAL: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, ME: gl.constexpr,
                     PINGPONG: gl.constexpr, FMA: gl.constexpr):
    """FA3's overlap inside a warpgroup: each tile's softmax under the previous tile's ``P V``. The causal mask
    on the first tile (a no-op unless it is also the last) and on the last. ``PINGPONG``: each step's products
    on the consumer's turn (the prologue's and the epilogue's take none: both consumers skip the same ones)."""
    NB: gl.constexpr = k_smem.type.shape[0]
    M: gl.constexpr = q.type.shape[0]
    tile_scale, v_scale = _tile_scales(0, qk_scale, v_prev, ks_ptr, vs_ptr, scale_base, BLOCK_N, SCALE_BLOCK,
                                       v_smem.dtype.is_fp8())
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    m_i, l_i, acc, p = _softmax_step(s, 0, m_i, l_i, acc, tile_scale, v_prev, v_scale, rows, 0, 0, BLOCK_N, CAUSAL,
                                     s_layout, o_layout, v_smem.dtype, FMA)
    v_prev = v_scale
    if v_smem.dtype.is_fp8():
        p = p.to(gl.float16)  # carried in fp16 (:func:`_overlap_step`)
    for j in range(1, n_tiles - 1):
        p, m_i, l_i, acc, v_prev = _overlap_step(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, j, p, m_i,
                                                 l_i, acc, v_prev, qk_scale, ks_ptr, vs_ptr, scale_base, rows,
                                                 BLOCK_N, SCALE_BLOCK, False, s_layout, o_layout, ME, PINGPONG, FMA)
    if n_tiles > 1:
        p, m_i, l_i, acc, v_prev = _overlap_step(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars,
                                                 n_tiles - 1, p, m_i, l_i, acc, v_prev, qk_scale, ks_ptr, vs_ptr,
                                                 scale_base, rows, BLOCK_N, SCALE_BLOCK, CAUSAL, s_layout, o_layout,
                                                 ME, PINGPONG, FMA)
    last = (n_tiles - 1) % NB
    mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // NB) & 1)
    if v_smem.dtype.is_fp8():
        p = p.to(gl.float8e4nv)
    acc = warpgroup_mma(p, _v_operand(v_smem, last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty_bars.index(last), count=1)
    return m_i, l_i, acc, v_prev


@gluon.jit
def _pipelined_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, n_tiles, m_i, l_i, acc, qk_scale, rows,
                    BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                    FMA: gl.constexpr):
    """Tile ``j``'s softmax while the tensor cores compute tile ``j + 1``'s ``Q Kᵀ`` (FA3's overlap inside a
    warpgroup); each step then waits for both products. bf16/fp16 only."""
    NB: gl.constexpr = k_smem.type.shape[0]
    M: gl.constexpr = q.type.shape[0]
    one = gl.to_tensor(1.0)  # no V scales here
    zeros = gl.zeros([M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zeros, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    for j in range(n_tiles - 1):
        idx = j % NB
        phase = (j // NB) & 1
        mbarrier.wait(k_bars.index((j + 1) % NB), ((j + 1) // NB) & 1)
        s_next = warpgroup_mma(q, k_smem.index((j + 1) % NB).permute((1, 0)), zeros, use_acc=False, is_async=True)
        m_i, l_i, acc, p16 = _softmax_step(s, j, m_i, l_i, acc, qk_scale, one, one, rows, 0, 0, BLOCK_N, False,
                                           s_layout, o_layout, v_smem.dtype, FMA)
        mbarrier.wait(v_bars.index(idx), phase)
        acc = warpgroup_mma(p16, v_smem.index(idx), acc, is_async=True)
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
        mbarrier.arrive(empty_bars.index(idx), count=1)
    j = n_tiles - 1
    idx = j % NB
    phase = (j // NB) & 1
    m_i, l_i, acc, p16 = _softmax_step(s, j, m_i, l_i, acc, qk_scale, one, one, rows, 0, 0, BLOCK_N, CAUSAL,
                                       s_layout, o_layout, v_smem.dtype, FMA)
    mbarrier.wait(v_bars.index(idx), phase)
    acc = warpgroup_mma(p16, v_smem.index(idx), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty_bars.index(idx), count=1)
    return m_i, l_i, acc


@gluon.jit
def _causal_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, step, n_tiles, m_i, l_i, acc, v_prev,
                 qk_scale, ks_ptr, vs_ptr, scale_base, rows, row0, BLOCK_N: gl.constexpr,
                 SCALE_BLOCK: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                 ME: gl.constexpr, PINGPONG: gl.constexpr, FMA: gl.constexpr):
    """Key tiles ``0 .. n_tiles - 1`` at ring positions from ``step`` (the serial and ping-pong loops): unmasked,
    then under ``CAUSAL`` the diagonal tile, masked, last. ``rows`` are this consumer's query rows, from ``row0``."""
    n_full = n_tiles
    if CAUSAL:
        n_full = n_tiles - 1
    for j in range(n_full):
        m_i, l_i, acc, v_prev = _tile(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, step + j, j, m_i, l_i,
                                      acc, v_prev, qk_scale, ks_ptr, vs_ptr, scale_base, rows, row0, 0, 0, BLOCK_N,
                                      SCALE_BLOCK, False, s_layout, o_layout, ME, PINGPONG, FMA)
    if CAUSAL:
        m_i, l_i, acc, v_prev = _tile(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, step + n_full, n_full,
                                      m_i, l_i, acc, v_prev, qk_scale, ks_ptr, vs_ptr, scale_base, rows, row0, 0,
                                      0, BLOCK_N, SCALE_BLOCK, True, s_layout, o_layout, ME, PINGPONG, FMA)
    return m_i, l_i, acc, v_prev


@gluon.jit
def _window_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, step, start_m, m_i, l_i, acc, v_prev,
                 qk_scale, ks_ptr, vs_ptr, scale_base, rows, window_size, sink_size, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, SCALE_BLOCK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                 ME: gl.constexpr, PINGPONG: gl.constexpr, FMA: gl.constexpr):
    """Query block ``start_m``'s tiles under lesson 08's window (:func:`window_plan`'s order: the sink tiles, then
    the window's) at ring positions from ``step``, masked where they cross its edge or the diagonal; also returns
    how many tiles that was."""
    lo, ns, n_tiles = window_plan(start_m, window_size, sink_size, BLOCK_M, BLOCK_N)
    row0 = start_m * BLOCK_M + ME * (BLOCK_M // 2)  # this consumer's first row (rows' first)
    for j in range(n_tiles):
        kv_tile = window_kv_tile(j, lo, ns)
        if window_tile_masked(j, kv_tile, ns, start_m, window_size, BLOCK_M, BLOCK_N):
            m_i, l_i, acc, v_prev = _tile(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, step + j, kv_tile,
                                          m_i, l_i, acc, v_prev, qk_scale, ks_ptr, vs_ptr, scale_base, rows, row0,
                                          window_size, sink_size, BLOCK_N, SCALE_BLOCK, 2, s_layout, o_layout, ME,
                                          PINGPONG, FMA)
        else:
            m_i, l_i, acc, v_prev = _tile(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, step + j, kv_tile,
                                          m_i, l_i, acc, v_prev, qk_scale, ks_ptr, vs_ptr, scale_base, rows, row0,
                                          window_size, sink_size, BLOCK_N, SCALE_BLOCK, 0, s_layout, o_layout, ME,
                                          PINGPONG, FMA)
    return m_i, l_i, acc, v_prev, n_tiles


@gluon.jit
def _block_scales(qk_scale, qs_ptr, off_hz, start_m, kv_row, N, N_SB, BLOCK_M: gl.constexpr, SCALE_BLOCK: gl.constexpr,
                  FP8: gl.constexpr):
    """Query block ``start_m`` of (batch, query head) ``off_hz``: its score scale and its kv head's first k_scale /
    v_scale. FP8: the block's rows lie in one scale block, so its ``q_scale`` is one number folded into
    ``qk_scale``; in 16 bits ``qk_scale`` as it is (the scales are not read)."""
    scale_base = kv_row // N * N_SB
    if FP8:
        qk_scale = qk_scale * gl.load(qs_ptr + off_hz * N_SB + start_m * BLOCK_M // SCALE_BLOCK)
    return qk_scale, scale_base


@gluon.jit
def _consumer(HALF_IDX: gl.constexpr, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, o_ptr,
              lse_ptr, qs_ptr, ks_ptr, vs_ptr, qk_scale, N, N_SB, window_size, sink_size, H: gl.constexpr,
              GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              SCALE_BLOCK: gl.constexpr, CAUSAL: gl.constexpr, LOOP: gl.constexpr, FMA: gl.constexpr,
              WINDOW: gl.constexpr):
    """A consumer warpgroup: rows ``HALF_IDX * 64 ...`` of the block, then its part of ``o`` and ``lse``.

    FP8 (e4m3 tiles): the program's query rows lie in one scale block, so ``q_scale`` is one number folded into
    ``qk_scale``; ``acc`` is carried in units of the last tile's ``v_scale`` (``v_prev``) and ``l_i`` in P's
    units of 1/256, both undone at the end."""
    FP8: gl.constexpr = v_smem.dtype.is_fp8()
    start_m, q_row, kv_row, n_tiles = program_coords(N, H, GROUP, BLOCK_M, CAUSAL)
    n_tiles = _key_tiles(n_tiles, BLOCK_M, BLOCK_N)
    HALF: gl.constexpr = BLOCK_M // 2
    ROW0: gl.constexpr = HALF_IDX * HALF
    # wgmma's accumulator layouts: 4 warps down the rows, instructions 16 rows x (the tile's width) x 32 bytes
    # of the reduction (16 values in 16 bits, 32 in FP8)
    K_INSTR: gl.constexpr = 32 if FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_INSTR])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, K_INSTR])
    rows = start_m * BLOCK_M + ROW0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([HALF], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    v_prev = gl.to_tensor(1.0)
    _, off_hz = _grid_tile(N, BLOCK_M)  # the program's (batch, query head) row: FP8's q_scale
    qk_scale, scale_base = _block_scales(qk_scale, qs_ptr, off_hz, start_m, kv_row, N, N_SB, BLOCK_M, SCALE_BLOCK,
                                         FP8)
    q = q_smem.index(HALF_IDX)
    mbarrier.wait(q_bars.index(HALF_IDX), 0)
    if LOOP == "pipelined":
        m_i, l_i, acc = _pipelined_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, n_tiles, m_i, l_i, acc,
                                        qk_scale, rows, BLOCK_N, CAUSAL, s_layout, o_layout, FMA)
    elif LOOP == "overlap" or LOOP == "overlap_pingpong":
        m_i, l_i, acc, v_prev = _overlapped_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, n_tiles,
                                                 m_i, l_i, acc, v_prev, qk_scale, ks_ptr, vs_ptr, scale_base, rows,
                                                 BLOCK_N, SCALE_BLOCK, CAUSAL, s_layout, o_layout, HALF_IDX,
                                                 LOOP == "overlap_pingpong", FMA)
    elif WINDOW:
        m_i, l_i, acc, v_prev, _ = _window_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, 0, start_m,
                                                m_i, l_i, acc, v_prev, qk_scale, ks_ptr, vs_ptr, scale_base, rows,
                                                window_size, sink_size, BLOCK_M, BLOCK_N, SCALE_BLOCK, s_layout,
                                                o_layout, HALF_IDX, LOOP == "pingpong", FMA)
    else:
        m_i, l_i, acc, v_prev = _causal_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, 0, n_tiles,
                                             m_i, l_i, acc, v_prev, qk_scale, ks_ptr, vs_ptr, scale_base, rows,
                                             start_m * BLOCK_M + ROW0, BLOCK_N, SCALE_BLOCK, CAUSAL, s_layout,
                                             o_layout, HALF_IDX, LOOP == "pingpong", FMA)
    acc, lse2 = _normalise(acc, m_i, l_i, v_prev, o_layout, FP8)
    _store_rows(o_ptr, lse_ptr, acc, lse2, q_row + ROW0, s_layout, o_layout)


@gluon.jit
def _normalise(acc, m_i, l_i, v_prev, o_layout: gl.constexpr, FP8: gl.constexpr):
    """A consumer's rows at the end of their keys: ``o`` (``acc`` over the softmax's sum; FP8 also back from the
    last tile's ``v_scale`` units) and ``lse`` in base 2 (FP8's ``l_i`` counted P in units of 1/256)."""
    if FP8:
        acc = acc * gl.convert_layout(v_prev / l_i, gl.SliceLayout(1, o_layout))[:, None]
        lse2 = m_i + gl.log2(l_i) - 8.0
    else:
        acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        lse2 = m_i + gl.log2(l_i)
    return acc, lse2


@gluon.jit
def _store_rows(o_ptr, lse_ptr, acc, lse2, row0, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """A consumer's epilogue: its rows of ``o`` (``acc``, normalised) and of ``lse`` (``lse2`` in base 2, stored
    in natural log as the course's ``lse``), from row ``row0`` of the 2-D views."""
    M: gl.constexpr = acc.type.shape[0]
    HEAD_DIM: gl.constexpr = acc.type.shape[1]
    o_rows = row0 + gl.arange(0, M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + o_rows[:, None].to(gl.int64) * HEAD_DIM + cols[None, :], acc.to(o_ptr.dtype.element_ty))
    lse_rows = row0 + gl.arange(0, M, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + lse_rows, lse2 * 0.6931471805599453)


@gluon.jit
def attn_fwd_ws(q_desc, k_desc, v_desc, o_ptr, lse_ptr, qs_ptr, ks_ptr, vs_ptr, qk_scale, N, N_SB, window_size,
                sink_size, H: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr, SCALE_BLOCK: gl.constexpr, CAUSAL: gl.constexpr,
                CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, LOOP: gl.constexpr, FMA: gl.constexpr,
                WINDOW: gl.constexpr):
    """The buffers and barriers the partitions share, then the three partitions (the first is the default).

    FP8 (e4m3 descriptors): ``v_desc`` is over V transposed and ``qs_ptr``, ``ks_ptr``, ``vs_ptr`` are the
    scales ``[B, H, N_SB]`` of ``SCALE_BLOCK`` tokens; otherwise they are not read."""
    HALF: gl.constexpr = BLOCK_M // 2
    V_T: gl.constexpr = v_desc.dtype.is_fp8()
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF, v_desc.block_type.shape[0],
                                                      v_desc.block_type.shape[1]], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # the ping-pong loops
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # both consumers release a slot
    # the tuples are written out in the call: a tuple held in a variable would turn its constexprs into tensors;
    # the literal 0 / 1 stays a constexpr, so each consumer is its own specialisation of _consumer
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, o_ptr, lse_ptr,
                     qs_ptr, ks_ptr, vs_ptr, qk_scale, N, N_SB, window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N,
                     HEAD_DIM, SCALE_BLOCK, CAUSAL, LOOP, FMA, WINDOW)),
        (_consumer, (1, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, o_ptr, lse_ptr,
                     qs_ptr, ks_ptr, vs_ptr, qk_scale, N, N_SB, window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N,
                     HEAD_DIM, SCALE_BLOCK, CAUSAL, LOOP, FMA, WINDOW)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, N,
                           window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N, CAUSAL, V_T, WINDOW)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# -----------------------------------------------------------------------------
# Persistent: one program per SM walking the (query block, head) tiles
# -----------------------------------------------------------------------------
@gluon.jit
def _work_tile(tile, N, BH, HEADS: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
               CAUSAL: gl.constexpr):
    """Work tile ``tile`` of the persistent grid: ``HEADS = 0``, all ``BH`` (batch, query head) rows' longest
    blocks first (under the causal mask, a greedy longest-first order over the programs); else walked ``HEADS``
    rows at a time (:func:`_walk`); then :func:`_block_rows`, and the row ``off_hz``."""
    if HEADS == 0:
        start_m = N // BLOCK_M - 1 - tile // BH
        off_hz = tile % BH
    else:
        start_m, off_hz = _walk(tile, N // BLOCK_M, HEADS)
    q_row, kv_row, n_tiles = _block_rows(start_m, off_hz, N, H, GROUP, BLOCK_M, CAUSAL)
    return start_m, off_hz, q_row, kv_row, n_tiles


@gluon.jit
def _persistent_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars, empty_bars,
                       N, BH, HEADS: gl.constexpr, window_size, sink_size, H: gl.constexpr, GROUP: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, V_T: gl.constexpr,
                       WINDOW: gl.constexpr):
    """The producer of the persistent grid: per work tile, Q's two halves into the tile's Q buffer (two buffers,
    so the next tile's Q lands while this one runs), then its K/V tiles into the ring, whose position runs on
    across work tiles (:func:`_copy_kv`, as :func:`_load_partition`). ``WINDOW``: each work tile's tiles of
    :func:`window_plan`, in its order."""
    HALF: gl.constexpr = BLOCK_M // 2
    NB: gl.constexpr = k_smem.type.shape[0]
    step = 0
    t = 0
    for tile in range(gl.program_id(0), (N // BLOCK_M) * BH, gl.num_programs(0)):
        start_m, off_hz, q_row, kv_row, n_tiles = _work_tile(tile, N, BH, HEADS, H, GROUP, BLOCK_M, CAUSAL)
        vt_row = kv_row // N * v_smem.type.shape[1]  # used with V_T only
        lo = 0
        ns = 0
        if WINDOW:
            lo, ns, n_tiles = window_plan(start_m, window_size, sink_size, BLOCK_M, BLOCK_N)
        buf = t % 2
        for half in gl.static_range(2):
            slot = buf * 2 + half
            mbarrier.wait(q_empty.index(slot), ((t // 2) & 1) ^ 1)  # the consumer of 2 tiles ago is done with it
            mbarrier.expect(q_bars.index(slot), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row + half * HALF, 0], q_bars.index(slot), q_smem.index(slot))
        for j in range(n_tiles):
            idx = (step + j) % NB
            kv_tile = j
            if WINDOW:
                kv_tile = window_kv_tile(j, lo, ns)
            mbarrier.wait(empty_bars.index(idx), (((step + j) // NB) & 1) ^ 1)
            _copy_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, idx, kv_row, vt_row, kv_tile, BLOCK_N, V_T)
        step += n_tiles
        t += 1


@gluon.jit
def _persistent_consumer(HALF_IDX: gl.constexpr, q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars, empty_bars,
                         turn_bars, o_ptr, lse_ptr, qs_ptr, ks_ptr, vs_ptr, qk_scale, N, N_SB, BH,
                         HEADS: gl.constexpr, window_size, sink_size, H: gl.constexpr, GROUP: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         SCALE_BLOCK: gl.constexpr, CAUSAL: gl.constexpr, LOOP: gl.constexpr, FMA: gl.constexpr,
                         WINDOW: gl.constexpr):
    """A consumer of the persistent grid: its 64 rows of each work tile (as :func:`_consumer`'s serial and
    ping-pong loops, the ring's position running on), releasing the tile's Q half after its last ``Q Kᵀ``.
    ``WINDOW``: each work tile's :func:`window_plan`, masked where a tile crosses the window's edge or the
    diagonal, as :func:`_consumer`'s window loop. FP8 (e4m3 tiles): each work tile's scales as in
    :func:`_consumer`."""
    FP8: gl.constexpr = v_smem.dtype.is_fp8()
    HALF: gl.constexpr = BLOCK_M // 2
    ROW0: gl.constexpr = HALF_IDX * HALF
    K_INSTR: gl.constexpr = 32 if FP8 else 16  # as in _consumer
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_INSTR])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, K_INSTR])
    step = 0
    t = 0
    for tile in range(gl.program_id(0), (N // BLOCK_M) * BH, gl.num_programs(0)):
        start_m, off_hz, q_row, kv_row, n_tiles = _work_tile(tile, N, BH, HEADS, H, GROUP, BLOCK_M, CAUSAL)
        slot = (t % 2) * 2 + HALF_IDX
        rows = start_m * BLOCK_M + ROW0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([HALF], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        v_prev = gl.to_tensor(1.0)
        tile_qk_scale, scale_base = _block_scales(qk_scale, qs_ptr, off_hz, start_m, kv_row, N, N_SB, BLOCK_M,
                                                  SCALE_BLOCK, FP8)
        q = q_smem.index(slot)
        mbarrier.wait(q_bars.index(slot), (t // 2) & 1)
        if WINDOW:
            m_i, l_i, acc, v_prev, n_tiles = _window_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars,
                                                          step, start_m, m_i, l_i, acc, v_prev, tile_qk_scale, ks_ptr,
                                                          vs_ptr, scale_base, rows, window_size, sink_size, BLOCK_M,
                                                          BLOCK_N, SCALE_BLOCK, s_layout, o_layout, HALF_IDX,
                                                          LOOP == "pingpong", FMA)
        else:
            m_i, l_i, acc, v_prev = _causal_loop(q, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, step,
                                                 n_tiles, m_i, l_i, acc, v_prev, tile_qk_scale, ks_ptr, vs_ptr,
                                                 scale_base, rows, start_m * BLOCK_M + ROW0, BLOCK_N, SCALE_BLOCK,
                                                 CAUSAL, s_layout, o_layout, HALF_IDX, LOOP == "pingpong", FMA)
        mbarrier.arrive(q_empty.index(slot), count=1)  # the tile's products have completed: its Q half is free
        acc, lse2 = _normalise(acc, m_i, l_i, v_prev, o_layout, FP8)
        _store_rows(o_ptr, lse_ptr, acc, lse2, q_row + ROW0, s_layout, o_layout)
        step += n_tiles
        t += 1


@gluon.jit
def attn_fwd_ws_persistent(q_desc, k_desc, v_desc, o_ptr, lse_ptr, qs_ptr, ks_ptr, vs_ptr, qk_scale, N, N_SB, BH,
                           HEADS: gl.constexpr, window_size, sink_size, H: gl.constexpr, GROUP: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr,
                           SCALE_BLOCK: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           LOADER_REGS: gl.constexpr, LOOP: gl.constexpr, FMA: gl.constexpr, WINDOW: gl.constexpr):
    """:func:`attn_fwd_ws` as a persistent grid (serial or ping-pong, lesson 08's window with ``WINDOW``; FP8 as
    :func:`attn_fwd_ws` takes it): two Q buffers of two halves each, with a ready and an empty barrier per
    half-buffer, and the K/V ring."""
    HALF: gl.constexpr = BLOCK_M // 2
    V_T: gl.constexpr = v_desc.dtype.is_fp8()
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [4, HALF, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF, v_desc.block_type.shape[0],
                                                      v_desc.block_type.shape[1]], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # one consumer uses each half
    for i in gl.static_range(2):
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)
    gl.warp_specialize([
        (_persistent_consumer, (0, q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars, empty_bars, turn_bars,
                                o_ptr, lse_ptr, qs_ptr, ks_ptr, vs_ptr, qk_scale, N, N_SB, BH, HEADS, window_size,
                                sink_size, H, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, SCALE_BLOCK, CAUSAL, LOOP, FMA,
                                WINDOW)),
        (_persistent_consumer, (1, q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars, empty_bars, turn_bars,
                                o_ptr, lse_ptr, qs_ptr, ks_ptr, vs_ptr, qk_scale, N, N_SB, BH, HEADS, window_size,
                                sink_size, H, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, SCALE_BLOCK, CAUSAL, LOOP, FMA,
                                WINDOW)),
        (_persistent_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_bars, v_bars,
                              empty_bars, N, BH, HEADS, window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N, CAUSAL, V_T,
                              WINDOW)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _operands(q, k, v, scales, block_n=BLOCK_N):
    """The launches' shared setup: ``o`` (bf16 from FP8, else ``q``'s dtype), ``lse``, the three TMA descriptors
    over the rows of all heads in one 2-D view (N is a multiple of the boxes, so no box crosses into the next
    head; FP8's V^T ``[B * H_kv * D, N]``, a tile D rows of BLOCK_N keys, the keys contiguous), and the scales
    with their blocks per head (``lse`` stands for the scales in 16 bits: not read)."""
    b, h, n, d = q.shape
    fp8 = q.dtype == _FP8
    q, k, v = (t.contiguous() for t in (q, k, v))
    o = torch.empty(q.shape, device=q.device, dtype=torch.bfloat16 if fp8 else q.dtype)
    lse = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    q_desc = _descriptor(q.view(-1, d), [BLOCK_M // 2, d])
    k_desc = _descriptor(k.view(-1, d), [block_n, d])
    if fp8:
        v_desc = _descriptor(v.view(-1, n), [d, block_n])
        qs, ks, vs = (s.contiguous() for s in scales)
        n_sb = qs.shape[-1]
    else:
        v_desc = _descriptor(v.view(-1, d), [block_n, d])
        qs = ks = vs = lse
        n_sb = 1
    return o, lse, (q_desc, k_desc, v_desc), (qs, ks, vs), n_sb


def _launch_persistent(q, k, v, causal, sm_scale, num_buffers, loop="serial", fma=False, n_programs=None,
                       window_size=None, sink_size=0, scales=None, block_size=BLOCK_M, heads_together=None):
    """:func:`attn_fwd_ws_persistent` for validated inputs: ``n_programs`` (default one per SM) walk the
    ``N / 128 * B * H`` work tiles, ``heads_together`` (batch, query head) rows at a time (default all of them:
    :func:`_work_tile`); ``window_size`` / ``sink_size``: lesson 08's window (causal); FP8 as :func:`_launch` takes
    it (``fma`` implied)."""
    b, h, n, d = q.shape
    o, lse, descs, scale_ptrs, n_sb = _operands(q, k, v, scales)
    work = n // BLOCK_M * b * h
    heads = 0 if heads_together is None else int(heads_together)  # 0: every row's longest block first
    if n_programs is None:
        n_programs = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    attn_fwd_ws_persistent[(max(1, min(int(n_programs), work)), )](
        *descs, o, lse, *scale_ptrs, sm_scale * LOG2E, n, n_sb, b * h, heads,
        0 if window_size is None else int(window_size), int(sink_size), h, h // k.shape[1], BLOCK_M, BLOCK_N, d,
        num_buffers, block_size, causal, CONSUMER_REGS, LOADER_REGS, loop, fma or q.dtype == _FP8,
        window_size is not None, num_warps=4, maxnreg=MAXNREG)
    return o, lse


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}
_FP8 = torch.float8_e4m3fn


# (layout class, box, dtype) -> the box's shared-memory layout, made once: making it costs microseconds of host time,
# for every descriptor of every training step (results/NOTES.md, "host time"); keyed by the class too, which
# gluon_cpu.running() replaces with its model's
_LAYOUTS: dict = {}


def _descriptor(t2d, box):
    """A TMA descriptor over the 2-D tensor ``t2d`` with boxes ``box``, in wgmma's default swizzled layout."""
    key = (gl.NVMMASharedLayout, tuple(box), t2d.dtype)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(list(box), _GL_DTYPES[t2d.dtype])
    return TensorDescriptor.from_tensor(t2d, box, layout)


MAX_GRID_BLOCKS = 65535  # CUDA's limit on a grid's second and third extents


def _validate_grid(n) -> None:
    """A program per tile puts its query blocks on the grid's second extent (:func:`_grid_tile`; the backward's dQ
    too): at most :data:`MAX_GRID_BLOCKS` of them."""
    if n // BLOCK_M > MAX_GRID_BLOCKS:
        raise ValueError(f"N = {n} is more than these kernels' grids hold ({MAX_GRID_BLOCKS} blocks of {BLOCK_M} query "
                         f"rows: N <= {MAX_GRID_BLOCKS * BLOCK_M})")


def _validate_inputs(q, k, v) -> None:
    """What this kernel covers, else ``ValueError`` in one sentence."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, N, D] with k and v alike (got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)})")
    b, h, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(f"k and v must be [B, H_kv, N, D] with H a multiple of H_kv (q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)})")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"this kernel takes bf16 or fp16 q, k, v of one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d} is not supported: {HEAD_DIMS} only")
    if n % BLOCK_M:
        raise ValueError(f"N = {n} must be a multiple of {BLOCK_M} (a program's rows; no masked edge tiles here)")
    _validate_grid(n)


def _validate_fp8_inputs(q8, k8, vt8, q_scale, k_scale, v_scale, block_size) -> None:
    """The FP8 entry's inputs as ``fp8.quantize_fp8`` makes them (V transposed), else ``ValueError``."""
    if q8.dim() != 4 or k8.dim() != 4 or vt8.dim() != 4:
        raise ValueError("q8, k8 must be [B, H, N, D] and vt8 [B, H_kv, D, N]")
    if any(t.dtype != _FP8 for t in (q8, k8, vt8)):
        raise ValueError(f"q8, k8, vt8 must be torch.float8_e4m3fn (got {q8.dtype}, {k8.dtype}, {vt8.dtype}): "
                         "quantise them with kernels.quantize_fp8")
    b, h, n, d = q8.shape
    if k8.shape[0] != b or k8.shape[2:] != (n, d) or h % k8.shape[1] or vt8.shape != (b, k8.shape[1], d, n):
        raise ValueError(f"k8 must be [B, H_kv, N, D] with H a multiple of H_kv and vt8 [B, H_kv, D, N] (q8 "
                         f"{tuple(q8.shape)}, k8 {tuple(k8.shape)}, vt8 {tuple(vt8.shape)})")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d} is not supported: {HEAD_DIMS} only")
    if n % BLOCK_M:
        raise ValueError(f"N = {n} must be a multiple of {BLOCK_M} (a program's rows; no masked edge tiles here)")
    _validate_grid(n)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < BLOCK_M \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two of at least {BLOCK_M} (a program's rows share one "
                         f"q_scale), not {block_size!r}")
    n_sb = -(-n // block_size)
    for name, s, heads in (("q_scale", q_scale, h), ("k_scale", k_scale, k8.shape[1]),
                           ("v_scale", v_scale, k8.shape[1])):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (b, heads, n_sb):
            raise ValueError(f"{name} must be float32 [{b}, {heads}, {n_sb}] (one per {block_size} tokens of each "
                             f"head, as quantize_fp8 makes it), not {getattr(s, 'shape', s)}")


def _validate_device(q) -> None:
    """A Hopper GPU, else ``ValueError``: Gluon compiles for one and has no interpreter (CPU tensors pass inside
    :func:`.gluon_cpu.running`, which runs the kernels' Python with a model of the machine)."""
    if not gluon_cpu.can_run(q):
        raise ValueError("the hand-specialised kernel runs on a Hopper GPU (sm_90) only (or on the CPU inside "
                         "gluon_cpu.running(), a model of one): Gluon has no interpreter "
                         f"and wgmma is Hopper's (got a {q.device.type} tensor)")


def unsupported_reason(q, k, v, scales=None, block_size: int = BLOCK_M) -> str | None:
    """Why :func:`attention` (with ``scales``, the three FP8 scales: :func:`attention_fp8`, ``v`` transposed) cannot
    take these inputs on this machine, in one sentence, or ``None``: the routes of the course's public entries ask
    this before they hand a call to these kernels (:mod:`.hopper_ws_bwd` takes what :func:`attention` takes)."""
    try:
        if scales is None:
            _validate_inputs(q, k, v)
        else:
            _validate_fp8_inputs(q, k, v, *scales, block_size)
        _validate_device(q)
    except ValueError as exc:
        return str(exc)
    return None


def _validate_options(num_buffers, loop, fp8: bool) -> None:
    """``num_buffers`` and ``loop``, else ``ValueError``: three K/V slots at most in 16 bits (shared memory)."""
    if num_buffers not in ((2, 3, 4) if fp8 else (2, 3)):
        raise ValueError(f"num_buffers must be {'2, 3 or 4 with FP8' if fp8 else '2 or 3'} (got {num_buffers})")
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS} (got {loop!r})")
    if fp8 and loop == "pipelined":
        raise ValueError("loop='pipelined' is bf16/fp16 only (it was measured slower than 'serial')")


def _validate_wide(q8, block_n, num_buffers, loop, window_size, persistent) -> None:
    """``block_n``: 128, or FP8's wide tiles of 256 where they run, else ``ValueError`` in one sentence."""
    if block_n == BLOCK_N:
        return
    if block_n != 2 * BLOCK_N:
        raise ValueError(f"block_n must be {BLOCK_N} or {2 * BLOCK_N} (got {block_n!r})")
    if loop != "serial" or window_size is not None or persistent:
        raise ValueError("block_n=256 runs the serial loop only, a program per tile and no window")
    if num_buffers > 3:
        raise ValueError(f"block_n=256 fits three K/V slots at most in shared memory (got num_buffers={num_buffers})")
    if q8.shape[2] % block_n:
        raise ValueError(f"block_n=256 needs N a multiple of 256 (got N = {q8.shape[2]})")


WINDOW_LOOPS = ("serial", "pingpong")  # the loops that take lesson 08's window


def _validate_window(causal, window_size, sink_size, loop) -> None:
    """Lesson 08's window and sinks (``kernels.forward.validate_window``'s rules), on the loops that take it."""
    if window_size is None:
        if sink_size:
            raise ValueError("sink_size needs a window_size")
        return
    if not causal:
        raise ValueError("a window_size needs causal=True (lesson 08's window looks back only)")
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"window_size must be a positive integer, not {window_size!r}")
    if isinstance(sink_size, bool) or not isinstance(sink_size, int) or sink_size < 0:
        raise ValueError(f"sink_size must be a non-negative integer, not {sink_size!r}")
    if loop not in WINDOW_LOOPS:
        raise ValueError(f"a window runs with loop in {WINDOW_LOOPS} (got {loop!r})")


def _launch(q, k, v, causal, sm_scale, num_buffers, loop="serial", fma=False, scales=None, block_size=BLOCK_M,
            window_size=None, sink_size=0, block_n=BLOCK_N, heads_together=None):
    """Descriptors, outputs and the launch, for inputs already validated (``tests/`` compile it from CPU tensors).

    FP8: ``q, k`` e4m3, ``v`` the transposed ``vt8`` ``[B, H_kv, D, N]``, ``scales`` ``(q_scale, k_scale,
    v_scale)``; ``o`` is bf16 and ``fma`` is implied. ``window_size`` (causal): lesson 08's window, with
    ``sink_size`` sinks; ``block_n`` keys per K/V tile (256: FP8's wide tiles, :func:`_wide_softmax`);
    ``heads_together``: the programs walk the tiles that many rows at a time, told by the grid's first extent
    (:func:`_grid_tile`; by default 1, each row's blocks in turn)."""
    b, h, n, d = q.shape
    fp8 = q.dtype == _FP8
    o, lse, descs, (qs, ks, vs), n_sb = _operands(q, k, v, scales, block_n)
    heads = 1 if heads_together is None else int(heads_together)
    grid = (heads, n // BLOCK_M, b * h // heads)
    window = window_size is not None
    attn_fwd_ws[grid](*descs, o, lse, qs, ks, vs, sm_scale * LOG2E, n, n_sb,
                      int(window_size) if window else 0, int(sink_size), h, h // k.shape[1], BLOCK_M, block_n, d,
                      num_buffers, block_size, causal, CONSUMER_REGS, LOADER_REGS, loop, fma or fp8, window,
                      num_warps=4, maxnreg=MAXNREG)
    return o, lse


LOOPS = ("serial", "pipelined", "pingpong", "overlap", "overlap_pingpong")


def _validate_persistent(q, num_buffers, loop) -> None:
    """The persistent grid's cover: the serial and ping-pong loops (with or without a window), its tiles in shared
    memory (an FP8 tile is half a bf16 one)."""
    if loop not in WINDOW_LOOPS:
        raise ValueError(f"the persistent grid runs loop in {WINDOW_LOOPS} (got {loop!r})")
    d = q.shape[-1]
    # two Q buffers of two halves, the ring of K and V tiles
    tiles = q.element_size() * (4 * (BLOCK_M // 2) * d + 2 * num_buffers * BLOCK_N * d)
    if tiles > TARGETS[90][1]:  # 16-bit tiles only: FP8's four slots fit (160 KiB at D = 128)
        raise ValueError(f"the persistent grid's tiles need {tiles // 1024} KiB of shared memory at D = {d} with "
                         f"num_buffers={num_buffers}, more than Hopper's {TARGETS[90][1] // 1024} KiB: take 2 "
                         "buffers")


def _validate_heads_together(x, heads_together, rows_are: str = "B * H") -> None:
    """``heads_together``: the grid's walk, a whole number of ``x``'s (batch, head) rows at a time (the forward's
    two grids, the backward's two kernels)."""
    if heads_together is None:
        return
    rows = x.shape[0] * x.shape[1]
    if isinstance(heads_together, bool) or not isinstance(heads_together, int) or heads_together < 1 \
            or rows % heads_together:
        raise ValueError(f"heads_together must be a whole number dividing {rows_are} = {rows} (got "
                         f"{heads_together!r})")


def kv_head_order(q_heads: int, group: int, at_least: int = 4) -> int:
    """A ``heads_together`` that walks the grid a kv head at a time: the ``group`` query heads that share a kv head
    side by side (the programs that run together read one kv head's K/V tiles), doubled while fewer than
    ``at_least`` and ``q_heads`` allows. Under the causal mask the runs' longest blocks then start first on every
    SM, where one row at a time leaves long blocks to the end: in a load model of 132 SMs at 4k (B = 4, 32 heads,
    each block costing its key tiles and one more), the last SM ends 3.3% after the mean when the GPU starts a
    program per tile one row at a time (today's order) and 0.2% after it four rows at a time; on the persistent grid
    (programs take every 132nd tile) 12% with one row and 3.1% with four, as with all rows at once
    (``tests/test_gluon_cpu.py`` recomputes these)."""
    heads = group
    while heads < at_least and q_heads % (2 * heads) == 0:
        heads *= 2
    return heads


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, *, window_size: int | None = None,
              sink_size: int = 0, num_buffers: int = 2, loop: str = "serial", fma: bool = False,
              persistent: bool = False, heads_together: int | None = None):
    """``(o, lse)`` of attention over ``q`` ``[B, H, N, D]`` and ``k``, ``v`` ``[B, H_kv, N, D]`` on a Hopper GPU.

    bf16 or fp16, D 64 or 128, N a multiple of 128, GQA/MQA/MHA; ``lse`` float32 ``[B, H, N]`` (natural log).
    ``num_buffers``: K/V tiles in flight (2 or 3 at D = 128: 160 or 224 KiB of shared memory). ``loop``: how
    each consumer runs its tiles, ``"serial"`` (measured fastest, with ``"pingpong"``), ``"pipelined"`` (the
    next tile's ``Q Kᵀ`` before this one's softmax; measured slower), ``"pingpong"`` (the consumers take turns at
    ``Q Kᵀ``), ``"overlap"`` (each softmax under the previous tile's ``P V``, FA3's form) or
    ``"overlap_pingpong"`` (both, FA3's schedule; both measured slower). ``fma``: the softmax's scale in one
    fused multiply-add. ``window_size`` (with ``causal``, ``loop`` ``"serial"`` or ``"pingpong"``): lesson 08's
    window, key ``j`` visible from query ``i`` iff ``j <= i`` and (``i - j < window_size`` or ``j <
    sink_size``); each program visits only its sink tiles and the window's.
    ``persistent``: one program per SM walks the (query block, head) tiles, the longest first, the next tile's Q
    loading while this one runs (:func:`attn_fwd_ws_persistent`; serial or ping-pong, with or without a window).
    ``heads_together``: the programs walk the (query block, row) tiles that many (batch, query head) rows at a
    time, each run's longest blocks first, its rows' blocks of one length side by side (a divisor of ``B * H``;
    :func:`kv_head_order` gives a kv head's query heads); by default the persistent grid takes every row's longest
    block first, and a program per tile each row's blocks in turn.
    """
    _validate_inputs(q, k, v)
    _validate_options(num_buffers, loop, False)
    _validate_window(causal, window_size, sink_size, loop)
    if persistent:
        _validate_persistent(q, num_buffers, loop)
    _validate_heads_together(q, heads_together)
    _validate_device(q)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if persistent:
        return _launch_persistent(q, k, v, causal, sm_scale, num_buffers, loop, fma, window_size=window_size,
                                  sink_size=sink_size, heads_together=heads_together)
    return _launch(q, k, v, causal, sm_scale, num_buffers, loop, fma, window_size=window_size, sink_size=sink_size,
                   heads_together=heads_together)


def attention_fp8(q8, k8, vt8, q_scale, k_scale, v_scale, causal: bool = False, *, block_size: int = BLOCK_M,
                  window_size: int | None = None, sink_size: int = 0, num_buffers: int = 2, loop: str = "serial",
                  persistent: bool = False, block_n: int = BLOCK_N, heads_together: int | None = None):
    """``(o, lse)`` of attention over e4m3 inputs on a Hopper GPU: the same three partitions with both products
    in FP8 (``wgmma`` at twice bf16's rate), ``o`` bf16.

    ``q8`` ``[B, H, N, D]``, ``k8`` ``[B, H_kv, N, D]``, ``vt8`` V transposed ``[B, H_kv, D, N]`` (FP8 ``wgmma``
    reads ``P V``'s B operand K-major), each with its float32 scale ``[B, heads, N / block_size]`` as
    ``kernels.quantize_fp8`` makes them; ``block_size`` a power of two of at least 128. The arithmetic is
    ``fp8.launch_fp8_hopper``'s: the scales folded into one FMA per score, P quantised as ``256 p``
    (``fp8.P_SCALE``), the accumulator carried in units of the tile's ``v_scale``. ``num_buffers`` 2-4 (an FP8
    tile is half a bf16 one); ``loop`` any of :data:`LOOPS` but ``"pipelined"``; ``window_size``, ``sink_size``,
    ``persistent`` (serial or ping-pong; all four slots fit) and ``heads_together`` as in :func:`attention`.
    ``block_n=256``: FA3's wider FP8 tiles, each of two scale blocks (:func:`_wide_softmax`; the serial loop, a
    program per tile, no window, ``N`` a multiple of 256, two or three slots), half as many waits, barriers and
    rescales per key.
    """
    _validate_fp8_inputs(q8, k8, vt8, q_scale, k_scale, v_scale, block_size)
    _validate_options(num_buffers, loop, True)
    _validate_window(causal, window_size, sink_size, loop)
    if persistent:
        _validate_persistent(q8, num_buffers, loop)
    _validate_wide(q8, block_n, num_buffers, loop, window_size, persistent)
    _validate_heads_together(q8, heads_together)
    _validate_device(q8)
    scales, sm_scale = (q_scale, k_scale, v_scale), 1.0 / math.sqrt(q8.shape[-1])
    if persistent:
        return _launch_persistent(q8, k8, vt8, causal, sm_scale, num_buffers, loop, True, window_size=window_size,
                                  sink_size=sink_size, scales=scales, block_size=block_size,
                                  heads_together=heads_together)
    return _launch(q8, k8, vt8, causal, sm_scale, num_buffers, loop, True, scales, block_size, window_size,
                   sink_size, block_n, heads_together=heads_together)
