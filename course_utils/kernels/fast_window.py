"""Lesson 08's sliding window and sinks on lesson 06's fast kernel.

Lesson 08's window kernel (:func:`.forward._flash_attention_forward_window_kernel`)
is lesson 05's kernel with five loop phases: the sink tiles, the band's
partial lower edge, the band's full tiles, and the diagonal. This module runs
the same phases, with the same bounds (:func:`.forward._window_bounds`) and
the same mask (:func:`.forward._window_keep`), on the machinery lesson 06
measured for the fast causal kernel (:mod:`.fast`):

- K and V tiles through host TMA descriptors, and ``exp2`` with the scale
  folded in, one FMA per score on the unmasked tiles;
- one warpgroup (4 warps) per program, two programs per SM: the warp
  schedulers interleave one's softmax with the other's matrix products
  (:func:`hopper_config` has the tiles measured for each window);
- the query heads of one GQA group side by side in the grid
  (:data:`.fast.ORDER_KV_GROUPED`): they read the same band of K/V tiles.

The mask is added in the log2 domain as ``-1e6``, not ``-inf``, as in the fast
kernel's diagonal: a row that has seen only masked keys so far (the band's
lower edge) then carries a finite running max and a sum of ones, and its
first visible key rescales them by ``exp2(-1e6 - m)``, which is exactly 0 in
fp32. Every row sees at least itself, so every row ends with the right sum.

A short call (:func:`is_short_call`: a band of under :data:`SHORT_CALL_FLOP`)
loads K and V with pointers instead: its kernel takes less time than Python
needs to make the call, so the host's time is the call's, and a launch with
pointers costs the host less than one with four TMA descriptors.

Public API: :func:`unsupported_reason` / :func:`is_supported` (the fast
kernel's limits: Hopper, bf16/fp16, D of 64 or 128, ``N`` a multiple of 64),
:func:`hopper_config` (the launch measured on an H200), :func:`is_short_call`,
:func:`launch` (one fixed launch; runs in the interpreter too, which is how
the CPU tests check it) and :func:`attention_forward_window` (what the
package's dispatch calls).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import fast
from .launch import BoundLauncher, aligned
from .fast import ORDER_KV_GROUPED, _load_k_transposed, _online_update, _program_tile, _shift_unmasked
from .forward import _window_bounds, _window_keep

__all__ = ["unsupported_reason", "is_supported", "hopper_config", "SHORT_CALL_FLOP", "is_short_call", "launch",
           "attention_forward_window"]


@triton.jit
def _window_tiles(
    acc, l_i, m_i, q,
    desc_k, desc_v, K, V,
    kv_row0, lo, hi, qk_scale, N_CTX, WINDOW_SIZE, SINK_SIZE,
    offs_m, offs_n, offs_d,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr,
    MASK: tl.constexpr, HAS_SINKS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False,
):
    """Fold key tiles ``lo, lo + BLOCK_N, ...`` (below ``hi``) into ``(acc, l_i, m_i)``.

    ``MASK``: the window/sink mask on each score (the partial tiles);
    otherwise every key of every tile is visible (one FMA per score).
    """
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_k_transposed(desc_k, K, kv_row0 + start_n, offs_n, offs_d, HEAD_DIM, USE_TMA)
        qk = tl.dot(q, k)
        if MASK:
            keep = _window_keep(offs_m[:, None], start_n + offs_n[None, :], N_CTX, WINDOW_SIZE, SINK_SIZE,
                                HAS_SINKS)
            qk = qk * qk_scale + tl.where(keep, 0.0, -1.0e6)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:
            qk, m_new = _shift_unmasked(qk, m_i, qk_scale)
        acc, l_i, m_i = _online_update(acc, l_i, m_i, qk, m_new, desc_v, V, kv_row0 + start_n,
                                       offs_n, offs_d, HEAD_DIM, USE_TMA, True)
    return acc, l_i, m_i


@triton.jit
def _sink_and_band_tiles(
    acc, l_i, m_i, q,
    desc_k, desc_v, K, V,
    kv_row0, sink_end, band_start, band_end, qk_scale, N_CTX, WINDOW_SIZE, SINK_SIZE,
    offs_m, offs_n, offs_d,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """The sink tiles ``[0, sink_end)`` and then the band ``[band_start, band_end)`` in ONE loop, every tile masked.

    Triton specialises one loop per kernel, so the two ranges become one: step ``t`` reads tile ``t`` while
    ``t`` is below the sink tiles' count, and the band's tile ``t - n_sink`` after (``sink_end <= band_start``:
    the ranges never overlap). The tile's offset is a scalar computed from ``t``, not a branch.
    """
    n_sink = sink_end // BLOCK_N
    n_tiles = n_sink + (band_end - band_start + BLOCK_N - 1) // BLOCK_N
    for t in tl.range(0, n_tiles, warp_specialize=WARP_SPECIALIZE):
        in_band = (t >= n_sink).to(tl.int32)
        start_n = t * BLOCK_N + in_band * (band_start - n_sink * BLOCK_N)
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_k_transposed(desc_k, K, kv_row0 + start_n, offs_n, offs_d, HEAD_DIM, USE_TMA)
        qk = tl.dot(q, k)
        keep = _window_keep(offs_m[:, None], start_n + offs_n[None, :], N_CTX, WINDOW_SIZE, SINK_SIZE, True)
        qk = qk * qk_scale + tl.where(keep, 0.0, -1.0e6)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
        acc, l_i, m_i = _online_update(acc, l_i, m_i, qk, m_new, desc_v, V, kv_row0 + start_n,
                                       offs_n, offs_d, HEAD_DIM, USE_TMA, True)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_fast_window_kernel(
    Q, K, V, O, Lse,
    desc_q, desc_k, desc_v, desc_o,
    sm_scale, N_CTX, N_Q_HEADS, WINDOW_SIZE, SINK_SIZE,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    ORDER: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """One program: one query block of one (batch, query head), its sink tiles and its band.

    Tensors as in :func:`.fast._attn_fwd_fast_kernel` (contiguous, viewed as
    ``[B*H*N, D]``; ``N_CTX`` a multiple of both blocks). Key ``j`` is visible
    from query ``i`` iff ``j <= i and (i - j < WINDOW_SIZE or j < SINK_SIZE)``.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the diagonal phase starts on a tile boundary
    bh, start_m = _program_tile(N_CTX, N_Q_HEADS, BLOCK_M, ORDER, True, GROUP_SIZE)
    batch = bh // N_Q_HEADS
    q_head = bh % N_Q_HEADS
    kv_head = q_head // GROUP_SIZE
    n_kv_heads = N_Q_HEADS // GROUP_SIZE

    q_first = start_m * BLOCK_M
    q_row0 = bh * N_CTX + q_first
    kv_row0 = (batch * n_kv_heads + kv_head) * N_CTX
    offs_m = q_first + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if USE_TMA:
        q = desc_q.load([q_row0, 0])
    else:
        q_rows = (q_row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * HEAD_DIM + offs_d[None, :])

    sink_full, sink_end, band_start, full_start, band_end = _window_bounds(
        q_first, N_CTX, WINDOW_SIZE, SINK_SIZE, BLOCK_M, BLOCK_N)
    if WARP_SPECIALIZE and HAS_SINKS:  # sinks and band in one loop, every tile masked (one loop specialises)
        acc, l_i, m_i = _sink_and_band_tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, sink_end, band_start,
                                             band_end, qk_scale, N_CTX, WINDOW_SIZE, SINK_SIZE, offs_m, offs_n,
                                             offs_d, BLOCK_N, HEAD_DIM, USE_TMA, True)
    elif WARP_SPECIALIZE:  # the band in one loop, every tile masked (Triton specialises one loop only)
        acc, l_i, m_i = _window_tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, band_start, band_end,
                                      qk_scale, N_CTX, WINDOW_SIZE, SINK_SIZE, offs_m, offs_n, offs_d,
                                      BLOCK_N, HEAD_DIM, USE_TMA, True, False, True)
    elif HAS_SINKS:  # 1. sink tiles every row sees whole, 2. the last, partial sink tile
        acc, l_i, m_i = _window_tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, 0, sink_full, qk_scale,
                                      N_CTX, WINDOW_SIZE, SINK_SIZE, offs_m, offs_n, offs_d,
                                      BLOCK_N, HEAD_DIM, USE_TMA, False, HAS_SINKS)
        acc, l_i, m_i = _window_tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, sink_full, sink_end,
                                      qk_scale, N_CTX, WINDOW_SIZE, SINK_SIZE, offs_m, offs_n, offs_d,
                                      BLOCK_N, HEAD_DIM, USE_TMA, True, HAS_SINKS)
    if not WARP_SPECIALIZE:  # 3. the band's partial lower edge, 4. its full tiles, 5. the diagonal
        acc, l_i, m_i = _window_tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, band_start, full_start,
                                      qk_scale, N_CTX, WINDOW_SIZE, SINK_SIZE, offs_m, offs_n, offs_d,
                                      BLOCK_N, HEAD_DIM, USE_TMA, True, HAS_SINKS)
        acc, l_i, m_i = _window_tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, full_start, q_first,
                                      qk_scale, N_CTX, WINDOW_SIZE, SINK_SIZE, offs_m, offs_n, offs_d,
                                      BLOCK_N, HEAD_DIM, USE_TMA, False, HAS_SINKS)
        acc, l_i, m_i = _window_tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, q_first, band_end,
                                      qk_scale, N_CTX, WINDOW_SIZE, SINK_SIZE, offs_m, offs_n, offs_d,
                                      BLOCK_N, HEAD_DIM, USE_TMA, True, HAS_SINKS)

    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 units -> natural log
    tl.store(Lse + bh * N_CTX + offs_m, lse)
    out = (acc / l_i[:, None]).to(q.dtype)
    if USE_TMA and not WARP_SPECIALIZE:  # a specialised 4-warp program's descriptor store does not compile
        desc_o.store([q_row0, 0], out)
    else:
        o_rows = (q_row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        tl.store(O + o_rows[:, None] * HEAD_DIM + offs_d[None, :], out)


# --------------------------------------------------------------------------- #
# Python side
# --------------------------------------------------------------------------- #
def unsupported_reason(q, k, v) -> str | None:
    """Why this kernel cannot take these tensors (the fast kernel's limits, :func:`.fast.unsupported_reason`)."""
    return fast.unsupported_reason(q, k, v)


def is_supported(q, k, v) -> bool:
    """True when :func:`attention_forward_window` runs this kernel on these tensors."""
    return fast.is_supported(q, k, v)


def hopper_config(window_size: int, head_dim: int, n: int) -> dict:
    """The launch (:func:`launch` keywords) for a window of ``window_size`` keys on Hopper.

    Measured on an H200 (``benchmarks/tune_window.py --fast``, ``results/tune_window_fast.json``:
    bf16, GQA 32/8, D = 128, N = 4k/16k/64k, W in {256, 1024, 4096}, 0 or 4 sinks): one warpgroup on
    64 query rows with 3 stages won or came within 5% of the fastest at every point. The keys: 32 per
    tile for windows up to 256 (1.47-1.66x FlexAttention; a 256-key band crosses few tiles, and
    smaller ones waste fewer masked pairs at its two edges), 64 above (1.17-1.40x). Lesson 06's causal
    launch, ``128 x 64`` tiles with 2 stages, lost at W <= 1024 (0.92-1.11x): its query blocks cross
    twice as many masked tiles at each edge of the band.
    """
    return dict(block_m=64, block_n=32 if window_size <= 256 else 64, num_warps=4, num_stages=3)


# Below this many FLOPs (an upper bound on the band's work: 4 D per query row per key of its window and sinks,
# every query head) the forward's kernel takes about 0.1 ms on an H200, and the call is launch-bound: Python
# launches the kernel with pointer loads 22-25 us sooner than with four host TMA descriptors (each encoded by the
# driver at every launch), while that kernel is about 4% slower (results/NOTES.md, "Short window forwards").
# W = 256 at N = 4k with 32 query heads is 17 GFLOP; W = 256 at 8k (34) and W = 1024 at 4k (69) keep TMA:
# there pointer loads measured 3-16% slower and the host keeps ahead of the GPU.
SHORT_CALL_FLOP = 25e9


def is_short_call(q, window_size: int, sink_size: int = 0) -> bool:
    """True when :func:`attention_forward_window` launches with pointer loads (:data:`SHORT_CALL_FLOP`)."""
    b, hq, n, d = q.shape
    keys = min(int(window_size), n) + min(int(sink_size), n)
    return 4.0 * d * b * hq * n * keys < SHORT_CALL_FLOP


# the kernel's launches, bound once per key on a GPU (launch.py: Triton's binder is host time on every short call)
_WINDOW = BoundLauncher(_attn_fwd_fast_window_kernel)


def launch(q, k, v, *, window_size, sink_size=0, sm_scale=None, block_m=128, block_n=64, num_warps=4,
           num_stages=2, use_tma=True, order=ORDER_KV_GROUPED, maxnreg=None, warp_specialize=False):
    """Run the kernel with one fixed launch: ``(o, lse)``, as :func:`.forward.flash_attention_window_forward`.

    ``window_size`` and ``sink_size`` are clipped to ``N`` as the lesson's
    launcher does. No fallback and no validation (the dispatch validated the
    call): ``N`` must be a multiple of both blocks and ``block_m`` of
    ``block_n``, else ``ValueError``. ``warp_specialize``: the band (and
    the sink tiles before it) in one masked loop, which Triton 3.6 splits on
    4 warps into a producer and two consumer warpgroups (:func:`.fast.launch`
    says more); not measured yet (``benchmarks/tune_window.py --fast``).
    """
    q, k, v, o, lse, scale = fast._prepare(q, k, v, sm_scale)
    b, hq, n, d = q.shape
    if n % block_m or n % block_n or block_m % block_n:
        raise ValueError(f"N={n} must be a multiple of BLOCK_M={block_m} and BLOCK_N={block_n}, "
                         f"and BLOCK_M of BLOCK_N")
    if warp_specialize:
        fast._validate_warp_specialize(q.dtype, use_tma)
        fast.refuse_specialised_on_gpu(q.device)
    if o.numel() == 0:
        return o, lse
    descs = fast._descriptors(q, k, v, o, block_m, block_n) if use_tma else (None,) * 4
    h_kv = k.shape[1]
    window, sink = min(int(window_size), n), min(int(sink_size), n)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    # every argument in the kernel's order, so that on a GPU the launch is bound once per key (launch.py): the
    # key holds every integer and flag Triton specialises on and the shapes behind the descriptors
    key = ((q.dtype, b, hq, h_kv, n, d, window, sink, block_m, block_n, num_warps, num_stages, use_tma, order,
            maxnreg, warp_specialize, aligned(q, k, v, o, lse)) if q.is_cuda else None)
    _WINDOW(key, fast.grid_shape(order, b, hq, h_kv, n // block_m), (
        q, k, v, o, lse, *descs, scale, n, hq, window, sink,
        hq // h_kv, d, block_m, block_n, use_tma, order, bool(sink_size), warp_specialize),
        num_warps=num_warps, num_stages=num_stages, **extra)
    return o, lse


def attention_forward_window(q, k, v, *, window_size, sink_size=0):
    """``(o, lse)`` of causal attention with a window and sinks, by :func:`hopper_config`'s launch.

    For tensors :func:`is_supported` has accepted (the dispatch asks first).
    K and V go through TMA descriptors, except in a short call
    (:func:`is_short_call`), which loads them with pointers.
    """
    return launch(q, k, v, window_size=window_size, sink_size=sink_size,
                  use_tma=not is_short_call(q, window_size, sink_size),
                  **hopper_config(int(window_size), q.shape[-1], q.shape[2]))
