"""The backward's dK, dV with warp specialisation written by hand, in Gluon (lessons 07 and 11).

Lesson 07's backward runs two kernels after the ``delta`` preprocess: one program per key block for ``dK, dV``
and one per query block for ``dQ``. Its dK/dV kernel holds two ``[BLOCK_N, D]`` fp32 accumulators and, at its
8-warp launch, spills about 40 values per thread (``kernels.fast_backward``'s docstring); Triton 3.6's automatic
warp specialisation of the same loop deadlocked on the H200. This module writes that kernel the way
FlashAttention-3's backward is laid out, with :mod:`.hopper_ws`'s machinery (``gl.warp_specialize``, TMA into a
ring of slots, mbarriers, ``wgmma``); ``dQ`` by the mirror image of it, :func:`attn_bwd_dq_ws` (the forward's
shape: 128 query rows a program, two consumers of 64, key tiles streamed past them; ``dQ += dS K``), or lesson
07's kernel (:func:`.backward.launch_dq`). FA3 adds ``dS K`` into dQ with atomics inside the dK/dV loop; two
deterministic kernels are kept here, as lesson 07 does.

One program owns 128 keys of one (batch, kv head), in three partitions:

* **the loader** (1 warp, 24 registers): the program's K and V, as two 64-key halves, once; then, for every query
  head of the GQA group and every query block that sees the keys (causal: from the key block's own rows on),
  the block's Q and dO tiles into a ring of ``num_buffers`` slots (each waited for on its *empty* barrier,
  announced on its own *ready* barriers, one for Q and one for dO);
* **two consumers** (a warpgroup of 4 warps each, 240 registers): each owns 64 of the keys and accumulates
  their ``dK`` and ``dV`` in registers, transposed so that every product has the keys as its rows
  (``wgmma``'s M): ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` issued together, ``Pᵀ = exp2(Sᵀ scale - lse)`` computed
  under ``dPᵀ``, ``dSᵀ = Pᵀ (dPᵀ - delta)``, then ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` issued together; the
  slot is released when both consumers have used it. While one consumer computes, the other's products run.

With ``window_size`` (and ``sink_size``), lesson 08's window: a dK/dV program visits only the query tiles that
see its keys (all of them after a block that holds sink keys), dQ the forward's tile list
(:func:`.hopper_ws.window_plan`); both mask only the tiles that cross an edge. ``heads_together`` walks dK/dV's
key blocks a few (batch, kv head) rows at a time, so that under the causal mask every row's long first blocks
start early (one row after another, the GPU starts the last rows' longest blocks last); autograd's route walks
``fast_backward.GLUON_WALK_ROWS`` rows at a time.
:func:`attention` puts them behind autograd (with the Gluon forward or the course's). Both compiled here for sm_90
and checked (``tests/test_hopper_ws_bwd.py``), and run on the CPU by
:mod:`.gluon_cpu`'s model (``tests/test_gluon_cpu.py``); checked against float64 on an H200 and an H100,
not yet timed.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .backward import default_config, launch_dq, launch_preprocess
from .forward import _capability
from .launch import BoundLauncher, aligned
from .hopper_ws import (_descriptor, _validate_device, _validate_heads_together, _validate_inputs,
                        _validate_window, _walk, program_coords, window_kv_tile, window_plan, window_tile_masked)
from .chips import TARGETS

BLOCK_N = 128  # keys per program: two consumers of 64 (wgmma's M per warpgroup)
BLOCK_MS = (32, 64)  # dK/dV: query rows per tile (a product's N and, for dK and dV, its reduction)
DQ_BLOCK_M = 128  # dQ: query rows per program, two consumers of 64
DQ_BLOCK_NS = (64, 128)  # dQ: keys per tile
DQ_KERNELS = ("gluon", "lesson07")
CONSUMER_REGS, LOADER_REGS, MAXNREG = 240, 24, 168  # 3 warpgroups x 168 = 240 + 240 + 24: one program per SM
LOG2E = 1.4426950408889634


@gluon.jit
def _query_tile(i, n_m, lo, kv_head, N, GROUP: gl.constexpr, BLOCK_M: gl.constexpr):
    """Step ``i`` of the loop: query head ``g`` of the group, its block ``m``; the block's first row (in the 2-D
    views of q, do, lse and delta) and its first query position."""
    g = i // n_m
    start_m = lo + (i - g * n_m) * BLOCK_M
    return (kv_head * GROUP + g) * N + start_m, start_m


@gluon.jit
def _loop_bounds(N, window_size, sink_size, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOW: gl.constexpr, HEADS: gl.constexpr):
    """The key block's first key, its (batch, kv head), the first query that sees it, query blocks per head and
    steps in all. ``WINDOW`` (lesson 08's, causal): a block without sink keys is seen by no query
    ``window_size`` or more past its last key. ``HEADS`` (not 0): the programs, in the order the GPU starts them,
    walk the key blocks ``HEADS`` (batch, kv head) rows at a time, the first blocks (the longest under the causal
    mask) of each run first (:func:`.hopper_ws._walk`); 0, each row's blocks in turn."""
    if HEADS == 0:
        start_n = gl.program_id(0) * BLOCK_N
        kv_head = gl.program_id(1)
    else:
        n_kb = N // BLOCK_N
        last, kv_head = _walk(gl.program_id(1) * n_kb + gl.program_id(0), n_kb, HEADS)
        start_n = (n_kb - 1 - last) * BLOCK_N  # _walk counts the forward's way, from the last block: turned back
    if CAUSAL:
        lo = start_n  # queries before the key block see none of it
    else:
        lo = start_n * 0
    hi = N
    if WINDOW:
        if start_n >= sink_size:
            hi = start_n + BLOCK_N - 1 + window_size  # the first query past the window of the block's last key
            if hi > N:
                hi = N
    n_m = (hi - lo + BLOCK_M - 1) // BLOCK_M
    return start_n, kv_head, lo, n_m, GROUP * n_m


@gluon.jit
def _load_partition(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bars, do_bars, kv_bars,
                    empty_bars, N, window_size, sink_size, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, HEADS: gl.constexpr):
    """The producer: each half's K and V once, then Q and dO tile by tile into the ring's free slots."""
    start_n, kv_head, lo, n_m, n_steps = _loop_bounds(N, window_size, sink_size, GROUP, BLOCK_M, BLOCK_N, CAUSAL,
                                                      WINDOW, HEADS)
    HALF: gl.constexpr = BLOCK_N // 2
    NB: gl.constexpr = q_smem.type.shape[0]
    for half in gl.static_range(2):
        row = kv_head * N + start_n + half * HALF
        mbarrier.expect(kv_bars.index(half), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, 0], kv_bars.index(half), k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [row, 0], kv_bars.index(half), v_smem.index(half))
    for i in range(n_steps):
        row, start_m = _query_tile(i, n_m, lo, kv_head, N, GROUP, BLOCK_M)
        idx = i % NB
        mbarrier.wait(empty_bars.index(idx), ((i // NB) & 1) ^ 1)  # a fresh barrier counts as released
        mbarrier.expect(q_bars.index(idx), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, 0], q_bars.index(idx), q_smem.index(idx))
        mbarrier.expect(do_bars.index(idx), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row, 0], do_bars.index(idx), do_smem.index(idx))


@gluon.jit
def _consumer(HALF_IDX: gl.constexpr, q_smem, do_smem, k_smem, v_smem, q_bars, do_bars, kv_bars, empty_bars,
              lse_ptr, delta_ptr, dk_ptr, dv_ptr, qk_scale, sm_scale, N, window_size, sink_size, GROUP: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
              WINDOW: gl.constexpr, HEADS: gl.constexpr):
    """A consumer warpgroup: keys ``HALF_IDX * 64 ...`` of the block, their ``dK`` and ``dV``."""
    start_n, kv_head, lo, n_m, n_steps = _loop_bounds(N, window_size, sink_size, GROUP, BLOCK_M, BLOCK_N, CAUSAL,
                                                      WINDOW, HEADS)
    HALF: gl.constexpr = BLOCK_N // 2
    NB: gl.constexpr = q_smem.type.shape[0]
    # wgmma's accumulator layouts, the keys down the rows: Sᵀ and dPᵀ [64 keys, BLOCK_M queries], dK and dV
    # [64 keys, D]
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    keys = start_n + HALF_IDX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    k = k_smem.index(HALF_IDX)
    v = v_smem.index(HALF_IDX)
    mbarrier.wait(kv_bars.index(HALF_IDX), 0)
    for i in range(n_steps):
        row, start_m = _query_tile(i, n_m, lo, kv_head, N, GROUP, BLOCK_M)
        idx = i % NB
        phase = (i // NB) & 1
        lse2 = gl.load(lse_ptr + row + cols) * 1.4426950408889634  # natural log -> base 2
        mbarrier.wait(q_bars.index(idx), phase)
        # (the zero accumulators made here, not before the loop: one held across it would cost 32 registers)
        s_t = warpgroup_mma(k, q_smem.index(idx).permute((1, 0)), gl.zeros([HALF, BLOCK_M], gl.float32, st_layout),
                            use_acc=False, is_async=True)
        mbarrier.wait(do_bars.index(idx), phase)
        dp_t = warpgroup_mma(v, do_smem.index(idx).permute((1, 0)), gl.zeros([HALF, BLOCK_M], gl.float32, st_layout),
                             use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, ))  # Sᵀ done; dPᵀ may still run
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
        if WINDOW:  # the blocks that cross the diagonal or the window's edge: lesson 08's rule
            if (start_m < start_n + BLOCK_N) | (start_m + BLOCK_M - 1 - start_n >= window_size):
                d = start_m + cols[None, :] - keys[:, None]
                p_t = gl.where((d >= 0) & ((d < window_size) | (keys[:, None] < sink_size)), p_t, 0.0)
        elif CAUSAL:
            if start_m < start_n + BLOCK_N:  # the blocks that cross the diagonal: query i sees key j iff i >= j
                p_t = gl.where(start_m + cols[None, :] >= keys[:, None], p_t, 0.0)
        delta = gl.load(delta_ptr + row + cols)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, ))
        # dSᵀ before dV's product is issued: Pᵀ in fp32 and dPᵀ are then dead by the time the two 16-bit
        # operands are made (issuing dV first, under dSᵀ's arithmetic, spilled 8-14 values at D = 128)
        ds_t = p_t * (dp_t - delta[None, :])
        dv = warpgroup_mma(gl.convert_layout(p_t.to(k_smem.dtype), op_layout), do_smem.index(idx), dv,
                           is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(k_smem.dtype), op_layout), q_smem.index(idx), dk,
                           is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty_bars.index(idx), count=1)  # counts once per partition; the slot needs both consumers
    rows = kv_head * N + start_n + HALF_IDX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    offs = rows[:, None].to(gl.int64) * HEAD_DIM + d[None, :]
    gl.store(dk_ptr + offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty))
    gl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty))


@gluon.jit
def attn_bwd_dkdv_ws(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr, qk_scale, sm_scale, N,
                     window_size, sink_size, WINDOW: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                     NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr, HEADS: gl.constexpr):
    """The buffers and barriers the partitions share, then the three partitions (the first is the default);
    ``HEADS`` as :func:`_loop_bounds` takes it."""
    HALF: gl.constexpr = BLOCK_N // 2
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUF, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_BUF, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, HALF, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, HALF, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    do_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bars.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(do_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # both consumers release a slot
    # the tuples are written out in the call (see hopper_ws.attn_fwd_ws)
    gl.warp_specialize([
        (_consumer, (0, q_smem, do_smem, k_smem, v_smem, q_bars, do_bars, kv_bars, empty_bars, lse_ptr, delta_ptr,
                     dk_ptr, dv_ptr, qk_scale, sm_scale, N, window_size, sink_size, GROUP, BLOCK_M, BLOCK_N,
                     HEAD_DIM, CAUSAL, WINDOW, HEADS)),
        (_consumer, (1, q_smem, do_smem, k_smem, v_smem, q_bars, do_bars, kv_bars, empty_bars, lse_ptr, delta_ptr,
                     dk_ptr, dv_ptr, qk_scale, sm_scale, N, window_size, sink_size, GROUP, BLOCK_M, BLOCK_N,
                     HEAD_DIM, CAUSAL, WINDOW, HEADS)),
        (_load_partition, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bars, do_bars,
                           kv_bars, empty_bars, N, window_size, sink_size, GROUP, BLOCK_M, BLOCK_N, CAUSAL,
                           WINDOW, HEADS)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# -----------------------------------------------------------------------------
# dQ: one program per 128 query rows, the key tiles streamed past them
# -----------------------------------------------------------------------------
@gluon.jit
def _dq_coords(N, H: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr):
    """This program's query block, its first row of q (do, lse, delta, dq) and of its kv head, its key tiles,
    and how many of them (the last ones) cross the diagonal under the causal mask; the forward's tiles, walked as
    the grid's shape says (:func:`.hopper_ws.program_coords`)."""
    start_m, q_row, kv_row, n_tiles = program_coords(N, H, GROUP, BLOCK_M, CAUSAL)
    if CAUSAL:
        n_tiles = (start_m + 1) * (BLOCK_M // BLOCK_N)
        n_masked = BLOCK_M // BLOCK_N
    else:
        n_tiles = N // BLOCK_N
        n_masked = 0
    return start_m, q_row, kv_row, n_tiles, n_masked


@gluon.jit
def _dq_load_partition(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bars, k_bars, v_bars,
                       empty_bars, N, window_size, sink_size, H: gl.constexpr, GROUP: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """The producer: each half's Q and dO once (one barrier per half), then K and V tile by tile (under a window,
    the forward's tile list: :func:`.hopper_ws.window_plan`)."""
    start_m, q_row, kv_row, n_tiles, n_masked = _dq_coords(N, H, GROUP, BLOCK_M, BLOCK_N, CAUSAL)
    lo = 0
    ns = 0
    if WINDOW:
        lo, ns, n_tiles = window_plan(start_m, window_size, sink_size, BLOCK_M, BLOCK_N)
    HALF: gl.constexpr = BLOCK_M // 2
    NB: gl.constexpr = k_smem.type.shape[0]
    for half in gl.static_range(2):
        mbarrier.expect(q_bars.index(half), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + half * HALF, 0], q_bars.index(half), q_smem.index(half))
        tma.async_copy_global_to_shared(do_desc, [q_row + half * HALF, 0], q_bars.index(half), do_smem.index(half))
    for j in range(n_tiles):
        idx = j % NB
        kv_tile = j
        if WINDOW:
            kv_tile = window_kv_tile(j, lo, ns)
        mbarrier.wait(empty_bars.index(idx), ((j // NB) & 1) ^ 1)  # a fresh barrier counts as released
        mbarrier.expect(k_bars.index(idx), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + kv_tile * BLOCK_N, 0], k_bars.index(idx),
                                        k_smem.index(idx))
        mbarrier.expect(v_bars.index(idx), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + kv_tile * BLOCK_N, 0], v_bars.index(idx),
                                        v_smem.index(idx))


@gluon.jit
def _dq_tile(q, do, k_smem, v_smem, k_bars, v_bars, empty_bars, j, kv_tile, dq, lse2, delta, qk_scale, rows,
             window_size, sink_size, BLOCK_N: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr,
             op_layout: gl.constexpr):
    """Step ``j`` of the ring, key tile ``kv_tile``: ``S = Q Kᵀ`` and ``dP = dO Vᵀ`` issued together, ``P``
    under ``dP``, ``dS``, then ``dQ += dS K``; the slot released. ``MASK``: 0 none, 1 causal, 2 lesson 08's
    window."""
    NB: gl.constexpr = k_smem.type.shape[0]
    M: gl.constexpr = q.type.shape[0]
    idx = j % NB
    phase = (j // NB) & 1
    mbarrier.wait(k_bars.index(idx), phase)
    s = warpgroup_mma(q, k_smem.index(idx).permute((1, 0)), gl.zeros([M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    mbarrier.wait(v_bars.index(idx), phase)
    dp = warpgroup_mma(do, v_smem.index(idx).permute((1, 0)), gl.zeros([M, BLOCK_N], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S done; dP may still run
    p = gl.exp2(s * qk_scale - lse2[:, None])
    if MASK == 2:
        cols = kv_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        d = rows[:, None] - cols[None, :]
        p = gl.where((d >= 0) & ((d < window_size) | (cols[None, :] < sink_size)), p, 0.0)
    elif MASK:
        cols = kv_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(rows[:, None] >= cols[None, :], p, 0.0)
    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
    ds = gl.convert_layout((p * (dp - delta[:, None])).to(k_smem.dtype), op_layout)
    dq = warpgroup_mma(ds, k_smem.index(idx), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    mbarrier.arrive(empty_bars.index(idx), count=1)  # counts once per partition; the slot needs both consumers
    return dq


@gluon.jit
def _dq_consumer(HALF_IDX: gl.constexpr, q_smem, do_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars,
                 lse_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale, N, window_size, sink_size, H: gl.constexpr,
                 GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """A consumer warpgroup: rows ``HALF_IDX * 64 ...`` of the block, their ``dQ``."""
    start_m, q_row, kv_row, n_tiles, n_masked = _dq_coords(N, H, GROUP, BLOCK_M, BLOCK_N, CAUSAL)
    HALF: gl.constexpr = BLOCK_M // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row0 = q_row + HALF_IDX * HALF
    offs = gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    rows = start_m * BLOCK_M + HALF_IDX * HALF + offs  # query positions, for the mask
    lse2 = gl.load(lse_ptr + row0 + offs) * 1.4426950408889634  # natural log -> base 2
    delta = gl.load(delta_ptr + row0 + offs)
    dq = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    q = q_smem.index(HALF_IDX)
    do = do_smem.index(HALF_IDX)
    mbarrier.wait(q_bars.index(HALF_IDX), 0)
    if WINDOW:  # the sink tiles, then the window's: masked where they cross its edge or the diagonal
        lo, ns, n_tiles = window_plan(start_m, window_size, sink_size, BLOCK_M, BLOCK_N)
        for j in range(n_tiles):
            kv_tile = window_kv_tile(j, lo, ns)
            if window_tile_masked(j, kv_tile, ns, start_m, window_size, BLOCK_M, BLOCK_N):
                dq = _dq_tile(q, do, k_smem, v_smem, k_bars, v_bars, empty_bars, j, kv_tile, dq, lse2, delta,
                              qk_scale, rows, window_size, sink_size, BLOCK_N, 2, s_layout, op_layout)
            else:
                dq = _dq_tile(q, do, k_smem, v_smem, k_bars, v_bars, empty_bars, j, kv_tile, dq, lse2, delta,
                              qk_scale, rows, window_size, sink_size, BLOCK_N, 0, s_layout, op_layout)
    else:
        for j in range(n_tiles - n_masked):
            dq = _dq_tile(q, do, k_smem, v_smem, k_bars, v_bars, empty_bars, j, j, dq, lse2, delta, qk_scale, rows,
                          0, 0, BLOCK_N, False, s_layout, op_layout)
        for j in range(n_tiles - n_masked, n_tiles):  # the diagonal's tiles (causal only)
            dq = _dq_tile(q, do, k_smem, v_smem, k_bars, v_bars, empty_bars, j, j, dq, lse2, delta, qk_scale, rows,
                          0, 0, BLOCK_N, True, s_layout, op_layout)
    out_rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    gl.store(dq_ptr + out_rows[:, None].to(gl.int64) * HEAD_DIM + d[None, :],
             (dq * sm_scale).to(dq_ptr.dtype.element_ty))


@gluon.jit
def attn_bwd_dq_ws(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale, N,
                   window_size, sink_size, WINDOW: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """dQ's buffers and barriers, then its three partitions (the forward's shape: :func:`.hopper_ws.attn_fwd_ws`,
    and its grid: the walk is the grid's shape, :func:`.hopper_ws._grid_tile`)."""
    HALF: gl.constexpr = BLOCK_M // 2
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, HALF, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # both consumers release a slot
    gl.warp_specialize([
        (_dq_consumer, (0, q_smem, do_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, lse_ptr, delta_ptr,
                        dq_ptr, qk_scale, sm_scale, N, window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM,
                        CAUSAL, WINDOW)),
        (_dq_consumer, (1, q_smem, do_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, lse_ptr, delta_ptr,
                        dq_ptr, qk_scale, sm_scale, N, window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM,
                        CAUSAL, WINDOW)),
        (_dq_load_partition, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bars, k_bars,
                              v_bars, empty_bars, N, window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N, CAUSAL,
                              WINDOW)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# the two kernels' launches, bound once per key on a GPU (launch.py: Triton's binder costs host time on every step)
_DKDV, _DQ = BoundLauncher(attn_bwd_dkdv_ws), BoundLauncher(attn_bwd_dq_ws)


def _launch_dq(q, k, v, do, lse, delta, causal, sm_scale, num_buffers=2, block_n=64, window_size=None, sink_size=0,
               descriptors=None, heads_together=None):
    """``dq`` by :func:`attn_bwd_dq_ws` for validated inputs (``tests/`` compile it from CPU tensors).

    ``descriptors``: a dict that the call's TMA descriptors are kept in and taken from (:func:`_descriptors`);
    ``heads_together``: the programs walk the query blocks that many (batch, query head) rows at a time, told by
    the grid's shape (:func:`.hopper_ws._grid_tile`; by default one row's blocks after another)."""
    b, h, n, d = q.shape
    q, k, v, do = (t.contiguous() for t in (q, k, v, do))
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    dq = torch.empty_like(q)
    window, sink, group = 0 if window_size is None else int(window_size), int(sink_size), h // k.shape[1]
    heads = 1 if heads_together is None else int(heads_together)
    key = ((q.dtype, b, h, n, d, window, sink, window_size is not None, group, block_n, num_buffers, bool(causal),
            aligned(lse, delta, dq)) if q.is_cuda else None)
    _DQ(key, (heads, n // DQ_BLOCK_M, b * h // heads), (  # hopper_ws._grid_tile's grid: heads rows at a time
        *_descriptors(descriptors, (q, DQ_BLOCK_M // 2), (do, DQ_BLOCK_M // 2), (k, block_n), (v, block_n)),
        lse, delta, dq, sm_scale * LOG2E, sm_scale, n, window, sink, window_size is not None, h, group,
        DQ_BLOCK_M, block_n, d, num_buffers, bool(causal), CONSUMER_REGS, LOADER_REGS), num_warps=4,
        maxnreg=MAXNREG)
    return dq


def _descriptors(memo, *boxes):
    """The TMA descriptors of ``(tensor, rows)`` pairs, boxes of ``rows`` × D over all heads' rows in one 2-D view
    (N is a multiple of the boxes, so no box crosses into the next head). ``memo`` (a dict, or None): one
    backward's descriptors, so that dK/dV's and dQ's kernels share those they would make alike (each is host
    time: results/host_step_h100.json)."""
    made = []
    for t, rows in boxes:
        key = (id(t), rows)
        desc = None if memo is None else memo.get(key)
        if desc is None:
            desc = _descriptor(t.view(-1, t.shape[-1]), [rows, t.shape[-1]])
            if memo is not None:
                memo[key] = desc
        made.append(desc)
    return made


def _validate_options(num_buffers, block_m, dq_kernel="gluon", dq_block_n=64) -> None:
    if num_buffers not in (2, 3):
        raise ValueError(f"num_buffers must be 2 or 3 (got {num_buffers})")
    if block_m not in BLOCK_MS:
        raise ValueError(f"block_m must be one of {BLOCK_MS} (got {block_m})")
    if dq_kernel not in DQ_KERNELS:
        raise ValueError(f"dq_kernel must be one of {DQ_KERNELS} (got {dq_kernel!r})")
    if dq_block_n not in DQ_BLOCK_NS:
        raise ValueError(f"dq_block_n must be one of {DQ_BLOCK_NS} (got {dq_block_n})")


def _validate_dq_shared(head_dim, num_buffers, dq_block_n) -> None:
    """The Gluon dQ kernel's tiles (Q and dO once, ``num_buffers`` K/V tiles, 16-bit) in Hopper's shared memory."""
    tiles = 2 * (2 * DQ_BLOCK_M * head_dim + 2 * num_buffers * dq_block_n * head_dim)
    if tiles > TARGETS[90][1]:
        raise ValueError(f"dQ's tiles need {tiles // 1024} KiB of shared memory at D = {head_dim} with "
                         f"num_buffers={num_buffers} and dq_block_n={dq_block_n}, more than Hopper's "
                         f"{TARGETS[90][1] // 1024} KiB: take 2 buffers or 64-key tiles")


def _launch_dkdv(q, k, v, do, lse, delta, causal, sm_scale, num_buffers=2, block_m=64, window_size=None,
                 sink_size=0, descriptors=None, heads_together=None):
    """``(dk, dv)`` by :func:`attn_bwd_dkdv_ws` for validated inputs (``tests/`` compile it from CPU tensors).

    ``lse`` (natural log) and ``delta`` float32 ``[B, H, N]``; ``descriptors`` as :func:`_launch_dq`'s;
    ``heads_together``: the programs walk the key blocks that many (batch, kv head) rows at a time
    (:func:`_loop_bounds`; by default one row's blocks after another)."""
    b, h, n, d = q.shape
    h_kv = k.shape[1]
    q, k, v, do = (t.contiguous() for t in (q, k, v, do))
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    window, sink, group = 0 if window_size is None else int(window_size), int(sink_size), h // h_kv
    heads = 0 if heads_together is None else int(heads_together)
    key = ((q.dtype, b, h, h_kv, n, d, window, sink, window_size is not None, block_m, num_buffers, bool(causal),
            heads, aligned(lse, delta, dk, dv)) if q.is_cuda else None)
    _DKDV(key, (n // BLOCK_N, b * h_kv), (
        *_descriptors(descriptors, (q, block_m), (do, block_m), (k, BLOCK_N // 2), (v, BLOCK_N // 2)),
        lse, delta, dk, dv, sm_scale * LOG2E, sm_scale, n, window, sink, window_size is not None, group, block_m,
        BLOCK_N, d, num_buffers, bool(causal), CONSUMER_REGS, LOADER_REGS, heads), num_warps=4, maxnreg=MAXNREG)
    return dk, dv


def attention_backward(q, k, v, o, lse, do, causal: bool = False, sm_scale: float | None = None, *,
                       window_size: int | None = None, sink_size: int = 0, num_buffers: int = 2, block_m: int = 64,
                       dq_kernel: str = "gluon", dq_block_n: int = 64, heads_together: int | None = None):
    """``(dq, dk, dv)`` of attention on a Hopper GPU: lesson 07's ``delta`` kernel, ``dK, dV`` by
    :func:`attn_bwd_dkdv_ws`, ``dQ`` by :func:`attn_bwd_dq_ws` (``dq_kernel="gluon"``) or lesson 07's kernel
    (``"lesson07"``). The arguments are :func:`.backward.attention_backward`'s (``o`` and ``lse`` from the
    forward, ``lse`` in natural log).

    bf16 or fp16, D 64 or 128, N a multiple of 128, GQA/MQA/MHA. ``num_buffers``: tiles in flight in either
    kernel (2 or 3); ``block_m``: dK/dV's query rows per tile (32 or 64); ``dq_block_n``: dQ's keys per tile (64
    or 128). ``window_size``, ``sink_size`` (with ``causal``): lesson 08's window, each kernel visiting only the
    tiles it needs (``dq_kernel="gluon"`` only). ``heads_together``: dK/dV's programs walk the key blocks that
    many (batch, kv head) rows at a time, the first (longest under the causal mask) blocks of each run first, and
    dQ's the query blocks of those rows' query heads (``dq_kernel="gluon"``); by default one row after another.
    """
    _validate_inputs(q, k, v)
    if do.shape != q.shape or o.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"o and do must be q's shape {tuple(q.shape)} and lse [B, H, N] (got o {tuple(o.shape)}, "
                         f"do {tuple(do.shape)}, lse {tuple(lse.shape)})")
    _validate_options(num_buffers, block_m, dq_kernel, dq_block_n)
    _validate_window(causal, window_size, sink_size, "serial")
    if window_size is not None and dq_kernel != "gluon":
        raise ValueError("a window runs with dq_kernel='gluon'")
    if dq_kernel == "gluon":
        _validate_dq_shared(q.shape[-1], num_buffers, dq_block_n)
    _validate_heads_together(k, heads_together, "B * H_kv")
    _validate_device(q)
    return backward_validated(q, k, v, o, lse, do, causal, sm_scale, window_size=window_size, sink_size=sink_size,
                              num_buffers=num_buffers, block_m=block_m, dq_kernel=dq_kernel, dq_block_n=dq_block_n,
                              heads_together=heads_together)


def backward_validated(q, k, v, o, lse, do, causal, sm_scale, *, window_size=None, sink_size=0, num_buffers=2,
                       block_m=64, dq_kernel="gluon", dq_block_n=64, heads_together=None):
    """:func:`attention_backward` for a call already checked: its launches without its checks, which cost host time
    on every step (``kernels.flash_attention``'s autograd checks each call once, in the forward)."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    b, h, n, d = q.shape
    delta = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    launch_preprocess(o, do, delta, 64)
    lse = lse.float().contiguous()
    q, k, v, do = (t.contiguous() for t in (q, k, v, do))
    descriptors = {}  # dK/dV's and dQ's kernels share the descriptors whose boxes agree
    dk, dv = _launch_dkdv(q, k, v, do, lse, delta, causal, sm_scale, num_buffers, block_m, window_size, sink_size,
                          descriptors, heads_together)
    if dq_kernel == "gluon":
        q_heads = None if heads_together is None else heads_together * (h // k.shape[1])
        return _launch_dq(q, k, v, do, lse, delta, causal, sm_scale, num_buffers, dq_block_n, window_size,
                          sink_size, descriptors, q_heads), dk, dv
    dq = torch.empty_like(q)
    launch_dq(q, k, v, do, lse, delta, dq, causal, sm_scale,
              default_config(d, q.device.type, _capability(q.device), q.dtype))
    return dq, dk, dv


# -----------------------------------------------------------------------------
# Behind autograd: a training step with these kernels
# -----------------------------------------------------------------------------
FORWARDS = ("gluon", "course")


class GluonAttentionFunction(torch.autograd.Function):
    """``o`` by :func:`.hopper_ws.attention` (``forward="gluon"``) or the course's forward dispatch (``"course"``),
    ``dq, dk, dv`` by :func:`attention_backward` from the saved ``o`` and ``lse``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, forward, options):
        window = {key: options[key] for key in ("window_size", "sink_size") if key in options}
        if forward == "gluon":
            from .hopper_ws import attention as gluon_forward

            o, lse = gluon_forward(q, k, v, causal, **window)
        else:
            from .dispatch import launch_forward

            o, lse = launch_forward(q, k, v, causal, **window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.options = causal, options
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, lse, do.contiguous(), ctx.causal, **ctx.options)
        return dq, dk, dv, None, None, None


def attention(q, k, v, causal: bool = False, *, forward: str = "gluon", **options):
    """Differentiable attention with this module's backward: ``o``, and through autograd ``dq, dk, dv``.

    ``forward``: ``"gluon"`` (:func:`.hopper_ws.attention`, serial loop) or ``"course"`` (what
    ``kernels.flash_attention`` runs); ``options``: :func:`attention_backward`'s keywords. The inputs as
    :func:`attention_backward` takes them (a Hopper GPU, or the CPU inside :func:`.gluon_cpu.running`).
    """
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS} (got {forward!r})")
    _validate_inputs(q, k, v)
    _validate_options(options.get("num_buffers", 2), options.get("block_m", 64), options.get("dq_kernel", "gluon"),
                      options.get("dq_block_n", 64))
    _validate_window(causal, options.get("window_size"), options.get("sink_size", 0), "serial")
    _validate_device(q)
    return GluonAttentionFunction.apply(q, k, v, causal, forward, options)
