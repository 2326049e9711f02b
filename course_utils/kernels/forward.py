"""The course's FlashAttention forward kernels in Triton, and their launchers.

Two kernels, each taught in a lesson and kept here as the one copy:

- :func:`flash_attention_kernel` (lesson 04): multi-head attention with the
  online softmax, one program per (query block, head, batch element), full
  4-D strides for every tensor, an optional causal mask. Plain ``tl.exp``.
- :func:`_flash_attention_forward_gqa_kernel` (lesson 05): the same idea for
  grouped-query attention (several query heads share one key/value head), with
  the causal loop split in two phases (blocks wholly below the diagonal need
  no mask; only the diagonal blocks do), ``exp2`` with ``log2(e)`` folded into
  the scale, and the per-row logsumexp ``lse`` written for the backward pass.
  Its inner loop is :func:`attn_fwd_inner`, as in Triton's fused-attention
  tutorial (a public name: lesson 08 imports it for its window kernel).

Lesson 08's window/sink kernel (kernel C, :func:`_flash_attention_forward_window_kernel`)
and lesson 12's kernel D (:func:`_flash_attention_forward_mods_kernel`): packed
documents (``cu_seqlens``), soft-capping, ALiBi and sink logits, alone or with
causal and the window, behind compile-time flags (a flag that is off compiles
to nothing). Its tile ranges (:func:`_mods_bounds`, in Python
:func:`mods_tile_bounds`) skip every tile no visible pair touches; its score
modification (:func:`_score_mod`) and mask (:func:`_mods_keep`) are shared
with the backward's kernels. Launcher :func:`flash_attention_mods_forward`,
validation :func:`validate_mods`.

One copy: the solution notebooks ``solutions/04_flash_attention_forward.ipynb``
and ``solutions/05_causal_gqa.ipynb`` define these same ``@triton.jit``
functions. The ``### BEGIN SOLUTION`` / ``### END SOLUTION`` comment lines
below mark the parts the learner writes; they are kept here, so the notebook
cells are this source verbatim (the build tool turns each marked block into a
``# YOUR CODE HERE`` line in the student notebooks). The test
``tests/test_kernels_forward.py`` strips the marker lines from both sides and
requires the rest to be equal, character for character (trailing whitespace
aside). Edit both together.

Launchers: :func:`flash_attention_forward` (kernel A, returns ``o``) and
:func:`flash_attention_gqa_forward` (kernel B, returns ``(o, lse)``); the
package's dispatch (:mod:`course_utils.kernels.dispatch`), which has validated
its input already, passes ``_validated=True`` to skip the checks. Both take
torch tensors ``[B, H, N, D]`` of any strides, fp16, bf16 (GPU only) or fp32,
head dims 16 to 256 (a head dim that is not a power of two is padded to the
next one inside the kernel and masked), and reject bad input with a
``ValueError`` of one sentence (:func:`validate`).
"""

from __future__ import annotations

import math
import numbers
import os

import torch
import triton
import triton.language as tl

__all__ = [
    "flash_attention_kernel",
    "_flash_attention_forward_gqa_kernel",
    "attn_fwd_inner",
    "flash_attention_forward",
    "flash_attention_gqa_forward",
    "validate",
    "validate_window",
    "window_tile_bounds",
    "_flash_attention_forward_window_kernel",
    "flash_attention_window_forward",
    "block_config",
    "window_block_config",
    "LOG2E",
    "mods_tile_bounds",
    "validate_mods",
    "has_mods",
    "document_bounds",
    "mods_arguments",
    "_flash_attention_forward_mods_kernel",
    "flash_attention_mods_forward",
]

#: log2(e): exp(x) == exp2(x * LOG2E). Folded into the scale in kernel B.
LOG2E = 1.4426950408889634


# -----------------------------------------------------------------------------
# Kernel A (lesson 04): multi-head attention, online softmax, any strides.
# -----------------------------------------------------------------------------
@triton.jit
def flash_attention_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr,
    stride_qz, stride_qh, stride_qm, stride_qk,
    stride_kz, stride_kh, stride_kn, stride_kk,
    stride_vz, stride_vh, stride_vn, stride_vk,
    stride_oz, stride_oh, stride_om, stride_ok,
    Z, H, M_size, N_size,
    sm_scale,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Flash attention with online softmax. One program per (batch, head, query-block).

    Q, K, V, O are ``[Z, H, M_size or N_size, D]`` with any strides: every
    address is built from the tensor's own four strides, so a transposed view
    works without a copy. ``D_PAD`` is ``D`` rounded up to a power of two
    (``tl.arange`` needs one); the extra columns are masked.
    """
    pid_m = tl.program_id(0)  # which block of BLOCK_M queries
    pid_h = tl.program_id(1)  # which head
    pid_z = tl.program_id(2)  # which batch element

    # Where this (batch, head) starts in each tensor. Each tensor has its own strides.
    q_base = Q_ptr + pid_z * stride_qz + pid_h * stride_qh
    k_base = K_ptr + pid_z * stride_kz + pid_h * stride_kh
    v_base = V_ptr + pid_z * stride_vz + pid_h * stride_vh
    o_base = O_ptr + pid_z * stride_oz + pid_h * stride_oh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # the query rows of this program
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D  # padded head-dim columns are masked out
    m_ok = offs_m < M_size  # the last query block may run past the sequence

    # Q block [BLOCK_M, D_PAD]: loaded once, reused for every K/V block.
    q = tl.load(
        q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk,
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )

    # Online-softmax state, in float32 whatever the input dtype.
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max of each row
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)  # running sum of exp(s - m_i) @ V

    # Which keys can this query block see? With the causal mask, none after its last row.
    ### BEGIN SOLUTION
    if IS_CAUSAL:
        kv_end = tl.minimum(N_size, (pid_m + 1) * BLOCK_M)
    else:
        kv_end = N_size
    ### END SOLUTION

    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N_size
        # K block loaded transposed, [D_PAD, BLOCK_N], so that q @ k is [BLOCK_M, BLOCK_N].
        k = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kk,
            mask=n_ok[None, :] & d_ok[:, None], other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vk,
            mask=n_ok[:, None] & d_ok[None, :], other=0.0,
        )
        s = tl.dot(q, k) * sm_scale  # scores, float32
        # Keys past the end of the sequence, and (causal) keys after the query, get -inf.
        keep = n_ok[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(keep, s, float("-inf"))

        # Fold this block into the running max, sum and accumulator.
        ### BEGIN SOLUTION
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)  # how much the old max overestimated: rescale the old state
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        ### END SOLUTION

    acc = acc / l_i[:, None]
    tl.store(
        o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_ok,
        acc.to(O_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


# -----------------------------------------------------------------------------
# Kernel B (lesson 05): causal GQA/MQA, two-phase loop, exp2, logsumexp.
# -----------------------------------------------------------------------------
@triton.jit
def attn_fwd_inner(
    acc, l_i, m_i, q,
    k_base, v_base,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, d_ok,
    lo, hi, SEQ_LEN, qk_scale,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold the K/V blocks starting at ``lo, lo + BLOCK_N, ...`` (below ``hi``) into the state.

    Scores are in log2 units (``qk_scale`` = ``sm_scale * log2(e)``), so the
    exponentials are ``exp2``. With ``MASK`` the scores of keys past the end
    of the sequence, and with ``IS_CAUSAL`` also of keys after the query,
    become -inf; without it the caller promises every key is visible, and the
    ``tl.where`` is not compiled at all.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < SEQ_LEN  # a cheap guard on the loads, even where no score is masked
        k = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=n_ok[None, :] & d_ok[:, None], other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=n_ok[:, None] & d_ok[None, :], other=0.0,
        )
        s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASK:
            keep = n_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_attention_forward_gqa_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, LSE_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    sm_scale, SEQ_LEN, N_Q_HEADS, N_KV_HEADS,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """FlashAttention forward for GQA/MQA/MHA: one program per (query block, batch x query head).

    Q and O are ``[B, N_Q_HEADS, SEQ_LEN, HEAD_DIM]``, K and V
    ``[B, N_KV_HEADS, SEQ_LEN, HEAD_DIM]``, LSE is float32
    ``[B, N_Q_HEADS, SEQ_LEN]``; all with any strides. Writes the output and
    the natural-log logsumexp of each query row's scaled scores.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # phase 1 must end exactly where the diagonal starts
    start_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // N_Q_HEADS
    q_head = batch_head % N_Q_HEADS

    # Which key/value head does this query head share? (Groups of consecutive query heads.)
    ### BEGIN SOLUTION
    group_size = N_Q_HEADS // N_KV_HEADS
    kv_head = q_head // group_size
    ### END SOLUTION

    q_base = Q_ptr + batch * stride_qb + q_head * stride_qh
    k_base = K_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = V_ptr + batch * stride_vb + kv_head * stride_vh
    o_base = O_ptr + batch * stride_ob + q_head * stride_oh  # O's own strides, not Q's

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < SEQ_LEN
    q = tl.load(
        q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e) folded in: exp(x) == exp2(x * log2(e))

    # Two phases: K/V blocks [0, mask_lo) need no mask at all (phase 1), the blocks
    # [mask_lo, mask_hi) need one (phase 2). Causal: the diagonal; otherwise: the tail.
    ### BEGIN SOLUTION
    if IS_CAUSAL:
        mask_lo = start_m * BLOCK_M  # keys before this are before every query of the block
        mask_hi = tl.minimum((start_m + 1) * BLOCK_M, SEQ_LEN)
    else:
        mask_lo = SEQ_LEN - SEQ_LEN % BLOCK_N  # only the last, partial block needs a mask
        mask_hi = SEQ_LEN
    ### END SOLUTION
    acc, l_i, m_i = attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base,
        stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok,
        0, mask_lo, SEQ_LEN, qk_scale,
        MASK=False, IS_CAUSAL=IS_CAUSAL, BLOCK_N=BLOCK_N,
    )
    acc, l_i, m_i = attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base,
        stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok,
        mask_lo, mask_hi, SEQ_LEN, qk_scale,
        MASK=True, IS_CAUSAL=IS_CAUSAL, BLOCK_N=BLOCK_N,
    )

    # The logsumexp of each row, in natural log: m_i and log2(l_i) are in log2 units.
    ### BEGIN SOLUTION
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # times ln(2): log2 units -> natural log
    ### END SOLUTION
    tl.store(LSE_ptr + batch * stride_lb + q_head * stride_lh + offs_m * stride_ln, lse, mask=m_ok)

    acc = acc / l_i[:, None]
    tl.store(
        o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        acc.to(O_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


# -----------------------------------------------------------------------------
# Kernel C (lesson 08): causal GQA with a sliding window and attention sinks.
# -----------------------------------------------------------------------------
def window_tile_bounds(start_m, block_m, block_n, seq_len, window_size, sink_size=0):
    """The K/V tiles query block ``start_m`` visits: ``(sink_end, band_start, band_end)``.

    Query block ``start_m`` holds rows ``start_m * block_m`` to
    ``min((start_m + 1) * block_m, seq_len) - 1``. Key ``j`` is visible from
    query ``i`` iff ``j <= i and (i - j < window_size or j < sink_size)``.
    The block visits the sink tiles ``[0, sink_end)`` and the band
    ``[band_start, band_end)``: ``band_start`` is the first row's oldest
    window key rounded DOWN to a multiple of ``block_n``, ``band_end`` the
    last row + 1 (the diagonal), and ``sink_end`` the sink keys rounded UP
    to a multiple of ``block_n`` but never past ``band_start`` (tiles the
    band visits anyway are not visited twice). Every other tile is skipped.
    """
    q_first = start_m * block_m
    band_end = min(q_first + block_m, seq_len)
    band_start = max(q_first - window_size + 1, 0) // block_n * block_n
    sink_end = min(-(-sink_size // block_n) * block_n, band_start)
    return sink_end, band_start, band_end


@triton.jit
def _window_keep(i, j, SEQ_LEN, WINDOW_SIZE, SINK_SIZE, HAS_SINKS: tl.constexpr):
    """True where query ``i`` may see key ``j`` (both broadcast): causal, in the window or a sink, a real key."""
    keep = (j <= i) & (j < SEQ_LEN)
    if HAS_SINKS:
        keep = keep & ((i - j < WINDOW_SIZE) | (j < SINK_SIZE))
    else:
        keep = keep & (i - j < WINDOW_SIZE)
    return keep


@triton.jit
def _window_bounds(q_first, SEQ_LEN, WINDOW_SIZE, SINK_SIZE, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The five K/V offsets that split one query block's loop into its phases.

    ``[0, sink_full)`` sink tiles every row sees whole, ``[sink_full,
    sink_end)`` the last, partial sink tile, ``[band_start, full_start)`` the
    band's partial lower edge, ``[full_start, q_first)`` the band's full
    tiles, ``[q_first, band_end)`` the diagonal. :func:`window_tile_bounds`
    computes ``sink_end, band_start, band_end`` the same way in Python.
    """
    ### BEGIN SOLUTION
    band_end = tl.minimum(q_first + BLOCK_M, SEQ_LEN)
    band_start = tl.maximum(q_first - WINDOW_SIZE + 1, 0) // BLOCK_N * BLOCK_N
    sink_end = tl.minimum((SINK_SIZE + BLOCK_N - 1) // BLOCK_N * BLOCK_N, band_start)
    ### END SOLUTION
    sink_full = tl.minimum(SINK_SIZE // BLOCK_N * BLOCK_N, sink_end)
    # The block's LAST row sees keys from q_first + BLOCK_M - WINDOW_SIZE on: tiles from there
    # (rounded up to a tile) to the diagonal are seen whole by every row.
    full_start = (tl.maximum(q_first + BLOCK_M - WINDOW_SIZE, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_start = tl.minimum(tl.maximum(full_start, band_start), q_first)
    return sink_full, sink_end, band_start, full_start, band_end


@triton.jit
def _attn_fwd_inner_window(
    acc, l_i, m_i, q,
    k_base, v_base,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, d_ok,
    lo, hi, SEQ_LEN, qk_scale, WINDOW_SIZE, SINK_SIZE,
    HAS_SINKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold the PARTIAL K/V blocks ``lo, lo + BLOCK_N, ...`` (below ``hi``) into the state.

    The window/sink mask is applied, and a row that has seen no key yet (all
    of its scores so far -inf) stays at ``m_i = -inf, l_i = 0, acc = 0``
    instead of turning into NaN. Full blocks go through lesson 05's
    :func:`attn_fwd_inner` with ``MASK=False``.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < SEQ_LEN
        k = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=n_ok[None, :] & d_ok[:, None], other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=n_ok[:, None] & d_ok[None, :], other=0.0,
        )
        s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        ### BEGIN SOLUTION
        keep = _window_keep(offs_m[:, None], offs_n[None, :], SEQ_LEN, WINDOW_SIZE, SINK_SIZE, HAS_SINKS)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet has m_new = -inf, and exp2(-inf - (-inf)) is NaN:
        # shift such rows by 0 instead; their p and alpha are then exp2(-inf) = 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        ### END SOLUTION
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_attention_forward_window_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, LSE_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    sm_scale, SEQ_LEN, N_Q_HEADS, N_KV_HEADS, WINDOW_SIZE, SINK_SIZE,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Causal GQA forward with a sliding window of ``WINDOW_SIZE`` keys and ``SINK_SIZE`` sinks.

    Same tensors, strides and grid as :func:`_flash_attention_forward_gqa_kernel`.
    Key ``j`` is visible from query ``i`` iff ``j <= i and (i - j <
    WINDOW_SIZE or j < SINK_SIZE)``. Each query block visits only the sink
    tiles and the tiles of its band, in five phases (:func:`_window_bounds`):
    full tiles without any mask (lesson 05's ``attn_fwd_inner``), partial
    ones with the mask (:func:`_attn_fwd_inner_window`).
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the diagonal phase starts on a tile boundary
    start_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // N_Q_HEADS
    q_head = batch_head % N_Q_HEADS
    kv_head = q_head // (N_Q_HEADS // N_KV_HEADS)

    q_base = Q_ptr + batch * stride_qb + q_head * stride_qh
    k_base = K_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = V_ptr + batch * stride_vb + kv_head * stride_vh
    o_base = O_ptr + batch * stride_ob + q_head * stride_oh

    q_first = start_m * BLOCK_M
    offs_m = q_first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < SEQ_LEN
    q = tl.load(
        q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    sink_full, sink_end, band_start, full_start, band_end = _window_bounds(
        q_first, SEQ_LEN, WINDOW_SIZE, SINK_SIZE, BLOCK_M, BLOCK_N)
    if HAS_SINKS:
        acc, l_i, m_i = attn_fwd_inner(  # 1. sink tiles every row sees whole
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_d, d_ok, 0, sink_full, SEQ_LEN, qk_scale,
            MASK=False, IS_CAUSAL=True, BLOCK_N=BLOCK_N,
        )
        acc, l_i, m_i = _attn_fwd_inner_window(  # 2. the last, partial sink tile
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_d, d_ok, sink_full, sink_end, SEQ_LEN, qk_scale, WINDOW_SIZE, SINK_SIZE,
            HAS_SINKS=HAS_SINKS, BLOCK_N=BLOCK_N,
        )
    acc, l_i, m_i = _attn_fwd_inner_window(  # 3. the band's lower edge: partial tiles
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok, band_start, full_start, SEQ_LEN, qk_scale, WINDOW_SIZE, SINK_SIZE,
        HAS_SINKS=HAS_SINKS, BLOCK_N=BLOCK_N,
    )
    acc, l_i, m_i = attn_fwd_inner(  # 4. the band's full tiles: no mask
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok, full_start, q_first, SEQ_LEN, qk_scale,
        MASK=False, IS_CAUSAL=True, BLOCK_N=BLOCK_N,
    )
    acc, l_i, m_i = _attn_fwd_inner_window(  # 5. the diagonal
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok, q_first, band_end, SEQ_LEN, qk_scale, WINDOW_SIZE, SINK_SIZE,
        HAS_SINKS=HAS_SINKS, BLOCK_N=BLOCK_N,
    )

    # Every real row sees at least itself, so l_i > 0 there; rows past the end may see
    # nothing (l_i = 0): give them 1 so that they compute no NaN (they are not stored).
    l_i = tl.where(m_ok, l_i, 1.0)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE_ptr + batch * stride_lb + q_head * stride_lh + offs_m * stride_ln, lse, mask=m_ok)
    acc = acc / l_i[:, None]
    tl.store(
        o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        acc.to(O_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


# -----------------------------------------------------------------------------
# Kernel D (lesson 12): packed documents (cu_seqlens), soft-capping, ALiBi and
# sink logits, on top of lesson 08's window and sinks.
# -----------------------------------------------------------------------------
def mods_tile_bounds(start_m, block_m, block_n, seq_len, cu_seqlens=None, causal=False,
                     window_size=None, sink_size=0):
    """The K/V tiles query block ``start_m`` visits under the document mask: ``(sinks, band)``.

    Each is ``(lo, full_lo, full_hi, hi)``: the block visits the tiles starting
    at ``lo, lo + block_n, ...`` below ``hi``; those in ``[full_lo, full_hi)``
    are seen whole by every row of the block (no mask), the others are partial
    (masked). ``band`` is the keys of the documents the block's rows lie in
    (from the first row's document start to the last row's document end),
    cut by causality (up to the last row) and the window (from the first row's
    oldest window key); ``sinks`` is the sink tiles below the band (lesson 08's
    ``sink_size`` first keys of the packed sequence; they serve the first
    row's document only), ``(lo, lo, lo, lo)`` when there are none. Every
    tile of these ranges holds a visible pair; every tile outside is skipped.
    The kernel computes the same in :func:`_mods_bounds`.
    """
    q_first = start_m * block_m
    q_last = min(q_first + block_m, seq_len) - 1
    if cu_seqlens is None:
        ds = ds_last = 0
        de = de_first = seq_len
    else:
        cu = [int(c) for c in cu_seqlens]
        seg_first = max(s for s in range(len(cu) - 1) if cu[s] <= q_first)
        seg_last = max(s for s in range(len(cu) - 1) if cu[s] <= q_last)
        ds, de_first, ds_last, de = cu[seg_first], cu[seg_first + 1], cu[seg_last], cu[seg_last + 1]
    return _tile_ranges(q_first, q_last, ds, de, ds_last, de_first, seq_len, block_n, causal,
                        window_size, sink_size)


def _tile_ranges(q_first, q_last, ds, de, ds_last, de_first, seq_len, block_n, causal, window_size, sink_size):
    """:func:`mods_tile_bounds` from the block's rows and its first and last rows' document bounds."""
    def down(x):
        return x // block_n * block_n

    def up(x):
        return -(-x // block_n) * block_n

    def split(lo, full_lo, full_hi, hi):
        f_lo = min(max(full_lo, lo), hi)
        return lo, f_lo, max(min(full_hi, hi), f_lo), hi

    window = window_size is not None
    lo = down(max(ds, q_first - window_size + 1 if window else 0))
    hi = min(de, q_last + 1) if causal else de
    if ds_last == ds:  # one document holds every row: some tiles may be seen whole
        full_lo = up(max(ds, q_last - window_size + 1 if window else 0))
        full_hi = down(min(de, q_first + 1) if causal else de)
    else:
        full_lo = full_hi = hi
    band = split(lo, full_lo, full_hi, hi)
    s_lo = down(ds)
    if window and sink_size > ds:
        s_end = min(sink_size, de_first)
        sinks = split(s_lo, up(ds) if ds_last == ds else lo, down(s_end) if ds_last == ds else lo,
                      max(s_lo, min(up(s_end), lo)))
    else:
        sinks = (s_lo, s_lo, s_lo, s_lo)
    return sinks, band


@triton.jit
def _tanh(x):
    """``tanh(x)`` from ``exp2`` (tl has no tanh): ``(1 - e) / (1 + e)``, ``e = exp(-2|x|)`` <= 1, sign restored."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _score_mod(s, i, j, softcap2, slope2, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Lesson 12's score modification, in log2 units (``s`` is ``q . k * sm_scale * log2(e)``).

    ``c * tanh(s / c)`` keeps its form in log2 units with ``softcap2 = c *
    log2(e)``, and ALiBi's ``- m * |i - j|`` becomes ``- slope2 * |i - j|``
    with ``slope2 = m * log2(e)``. Returns ``(s, t)``: the modified scores and
    ``t = tanh(s / c)`` (the backward's ``1 - t^2``; ``s`` itself without a cap).
    """
    ### BEGIN SOLUTION
    t = s
    if HAS_SOFTCAP:
        t = _tanh(s / softcap2)
        s = softcap2 * t
    if HAS_ALIBI:
        s = s - slope2 * tl.abs(i - j).to(tl.float32)
    ### END SOLUTION
    return s, t


@triton.jit
def _mods_keep(i, j, doc_i, doc_j, SEQ_LEN, WINDOW_SIZE, SINK_SIZE,
               IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
    """True where query ``i`` may see key ``j`` (broadcast): a real key, one document, causal, window/sinks.

    ``doc_i``, ``doc_j`` are the positions where ``i``'s and ``j``'s documents
    start (equal iff one document; ``-1`` for rows past the end).
    """
    ### BEGIN SOLUTION
    keep = j < SEQ_LEN
    if HAS_DOCS:
        keep = keep & (doc_i == doc_j)
    if IS_CAUSAL:
        keep = keep & (j <= i)
    if HAS_WINDOW:
        if HAS_SINKS:
            keep = keep & ((i - j < WINDOW_SIZE) | (j < SINK_SIZE))
        else:
            keep = keep & (i - j < WINDOW_SIZE)
    ### END SOLUTION
    return keep


@triton.jit
def _split_range(lo, full_lo, full_hi, hi):
    """``(lo, f_lo, f_hi, hi)``: ``[lo, f_lo)`` partial, ``[f_lo, f_hi)`` full, ``[f_hi, hi)`` partial."""
    f_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    f_hi = tl.maximum(tl.minimum(full_hi, hi), f_lo)
    return lo, f_lo, f_hi, hi


@triton.jit
def _mods_bounds(q_first, DOC_START, DOC_END, SEQ_LEN, WINDOW_SIZE, SINK_SIZE,
                 IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query block's tile ranges: ``(s_lo, s_flo, s_fhi, s_hi, lo, f_lo, f_hi, hi)`` (:func:`mods_tile_bounds`).

    The band ``[lo, hi)``: from the first row's document start (and oldest
    window key) rounded down to a tile, to the last row's document end (and,
    causal, the last row + 1). Tiles in ``[f_lo, f_hi)`` every row sees whole;
    only a block inside one document has such tiles. The sink tiles ``[s_lo,
    s_hi)`` (window with sinks) lie below the band, in the first row's document.
    """
    q_last = tl.minimum(q_first + BLOCK_M, SEQ_LEN) - 1
    if HAS_DOCS:
        ds = tl.load(DOC_START + q_first)  # where the first row's document starts
        de = tl.load(DOC_END + q_last)  # where the last row's document ends
        de_first = tl.load(DOC_END + q_first)
        one_doc = tl.load(DOC_START + q_last) == ds
    else:
        ds = 0
        de = SEQ_LEN
        de_first = SEQ_LEN
        one_doc = True
    ### BEGIN SOLUTION
    lo = ds
    if HAS_WINDOW:
        lo = tl.maximum(lo, q_first - WINDOW_SIZE + 1)
    lo = lo // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(de, q_last + 1)
    else:
        hi = de
    ### END SOLUTION
    full_lo = ds
    if HAS_WINDOW:
        full_lo = tl.maximum(full_lo, q_last - WINDOW_SIZE + 1)
    full_lo = (full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        full_hi = tl.minimum(de, q_first + 1) // BLOCK_N * BLOCK_N
    else:
        full_hi = de // BLOCK_N * BLOCK_N
    full_lo = tl.where(one_doc, full_lo, hi)
    full_hi = tl.where(one_doc, full_hi, hi)
    lo, f_lo, f_hi, hi = _split_range(lo, full_lo, full_hi, hi)
    s_lo = ds // BLOCK_N * BLOCK_N
    s_flo = s_lo
    s_fhi = s_lo
    s_hi = s_lo
    if HAS_SINKS:
        s_end = tl.minimum(SINK_SIZE, de_first)
        s_hi = tl.where(SINK_SIZE > ds, tl.maximum(s_lo, tl.minimum((s_end + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo)),
                        s_lo)
        s_full_lo = tl.where(one_doc, (ds + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo)
        s_full_hi = tl.where(one_doc, s_end // BLOCK_N * BLOCK_N, lo)
        s_lo, s_flo, s_fhi, s_hi = _split_range(s_lo, s_full_lo, s_full_hi, s_hi)
    return s_lo, s_flo, s_fhi, s_hi, lo, f_lo, f_hi, hi


@triton.jit
def _attn_fwd_inner_mods(
    acc, l_i, m_i, q,
    k_base, v_base,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, d_ok, doc_m, DOC_START,
    lo, hi, SEQ_LEN, qk_scale, softcap2, slope2, WINDOW_SIZE, SINK_SIZE,
    MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold K/V tiles ``lo, lo + BLOCK_N, ...`` (below ``hi``) into the state, scores modified.

    ``MASK``: partial tiles, masked by :func:`_mods_keep`, and a row that has
    seen nothing yet stays at ``m_i = -inf, l_i = 0`` instead of turning into
    NaN (lesson 08's ``m_shift``). Without ``MASK`` the caller promises every
    pair is visible: no mask is compiled at all.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < SEQ_LEN
        k = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=n_ok[None, :] & d_ok[:, None], other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=n_ok[:, None] & d_ok[None, :], other=0.0,
        )
        s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        s, t = _score_mod(s, offs_m[:, None], offs_n[None, :], softcap2, slope2, HAS_SOFTCAP, HAS_ALIBI)
        if MASK:
            if HAS_DOCS:
                doc_n = tl.load(DOC_START + offs_n, mask=n_ok, other=-2)
            else:
                doc_n = offs_n
            keep = _mods_keep(offs_m[:, None], offs_n[None, :], doc_m[:, None], doc_n[None, :], SEQ_LEN,
                              WINDOW_SIZE, SINK_SIZE, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_shift = m_new
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_range_mods(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, d_ok, doc_m, DOC_START, lo, f_lo, f_hi, hi, SEQ_LEN, qk_scale, softcap2, slope2,
    WINDOW_SIZE, SINK_SIZE, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One range of tiles in three phases: ``[lo, f_lo)`` masked, ``[f_lo, f_hi)`` whole, ``[f_hi, hi)`` masked."""
    acc, l_i, m_i = _attn_fwd_inner_mods(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok, doc_m, DOC_START, lo, f_lo, SEQ_LEN, qk_scale, softcap2, slope2,
        WINDOW_SIZE, SINK_SIZE, True, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_inner_mods(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok, doc_m, DOC_START, f_lo, f_hi, SEQ_LEN, qk_scale, softcap2, slope2,
        WINDOW_SIZE, SINK_SIZE, False, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_inner_mods(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok, doc_m, DOC_START, f_hi, hi, SEQ_LEN, qk_scale, softcap2, slope2,
        WINDOW_SIZE, SINK_SIZE, True, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N)
    return acc, l_i, m_i


@triton.jit
def _flash_attention_forward_mods_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, LSE_ptr, DOC_START, DOC_END, SLOPES, SINK_LOGITS,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    sm_scale, SEQ_LEN, N_Q_HEADS, N_KV_HEADS, WINDOW_SIZE, SINK_SIZE, softcap2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINK_LOGITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """GQA forward with packed documents, soft-capping, ALiBi and sink logits (and lesson 08's window/sinks).

    Same tensors, strides and grid as :func:`_flash_attention_forward_gqa_kernel`;
    ``DOC_START``/``DOC_END`` (int32 ``[SEQ_LEN]``) hold where each position's
    document starts and ends, ``SLOPES``/``SINK_LOGITS`` (float32 ``[N_Q_HEADS]``)
    the ALiBi slopes and sink logits; each is read only when its flag is set.
    The block visits the tiles of :func:`_mods_bounds` only: full ones unmasked,
    partial ones masked. A sink logit ``z`` starts the online softmax as one more
    score whose value is 0: ``m_i = z``, ``l_i = 1``, ``acc = 0``.
    """
    start_m = tl.program_id(0)
    if IS_CAUSAL:  # the last query blocks have the most tiles: launch them first, the short ones fill in
        start_m = tl.num_programs(0) - 1 - start_m
    batch_head = tl.program_id(1)
    batch = batch_head // N_Q_HEADS
    q_head = batch_head % N_Q_HEADS
    kv_head = q_head // (N_Q_HEADS // N_KV_HEADS)

    q_base = Q_ptr + batch * stride_qb + q_head * stride_qh
    k_base = K_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = V_ptr + batch * stride_vb + kv_head * stride_vh
    o_base = O_ptr + batch * stride_ob + q_head * stride_oh

    q_first = start_m * BLOCK_M
    offs_m = q_first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < SEQ_LEN
    q = tl.load(
        q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if HAS_DOCS:
        doc_m = tl.load(DOC_START + offs_m, mask=m_ok, other=-1)
    else:
        doc_m = offs_m
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + q_head) * 1.4426950408889634
    qk_scale = sm_scale * 1.4426950408889634

    # The sink logit joins the denominator as a score with no value.
    ### BEGIN SOLUTION
    if HAS_SINK_LOGITS:
        z2 = tl.load(SINK_LOGITS + q_head) * 1.4426950408889634
        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + z2
        l_i = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    ### END SOLUTION
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), dtype=tl.float32)

    s_lo, s_flo, s_fhi, s_hi, lo, f_lo, f_hi, hi = _mods_bounds(
        q_first, DOC_START, DOC_END, SEQ_LEN, WINDOW_SIZE, SINK_SIZE,
        IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, BLOCK_M, BLOCK_N)
    if HAS_SINKS:  # the sink tiles below the band: partial, full, partial
        acc, l_i, m_i = _attn_fwd_range_mods(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_d, d_ok, doc_m, DOC_START, s_lo, s_flo, s_fhi, s_hi, SEQ_LEN, qk_scale, softcap2, slope2,
            WINDOW_SIZE, SINK_SIZE, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_range_mods(  # the band: partial, full, partial
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, d_ok, doc_m, DOC_START, lo, f_lo, f_hi, hi, SEQ_LEN, qk_scale, softcap2, slope2,
        WINDOW_SIZE, SINK_SIZE, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N)

    # Every real row sees itself (or has a sink logit), so l_i > 0 there; rows past the end
    # may see nothing: give them 1 so that they compute no NaN (they are not stored).
    l_i = tl.where(m_ok, l_i, 1.0)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE_ptr + batch * stride_lb + q_head * stride_lh + offs_m * stride_ln, lse, mask=m_ok)
    acc = acc / l_i[:, None]
    tl.store(
        o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        acc.to(O_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


# -----------------------------------------------------------------------------
# Launchers
# -----------------------------------------------------------------------------
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreted(device: torch.device) -> bool:
    """True when Triton kernels on ``device`` run in the CPU interpreter."""
    return device.type == "cpu"


# (the function that answered, device index) -> its answer. Keyed by the function too, so that a test
# which replaces torch.cuda.get_device_capability (to model a T4, say) is asked, not this cache.
_CAPABILITIES: dict = {}


def _capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device; None on the CPU. (course_utils.kernels.targets
    replaces it to compile for a GPU that is not here.)

    Remembered per device: asking torch costs 2-4 us of host time, and every
    forward and backward call asks (``results/NOTES.md``, "Short window forwards").
    """
    if device.type != "cuda":
        return None
    ask = torch.cuda.get_device_capability
    key = (ask, device.index)
    if device.index is not None and key in _CAPABILITIES:
        return _CAPABILITIES[key]
    try:
        answer = tuple(ask(device))
    except (AssertionError, RuntimeError):  # a CPU-only torch asked about "cuda" (configuration tables)
        return None
    if device.index is not None:  # "cuda" without an index means whichever device is current
        _CAPABILITIES[key] = answer
    return answer


def _gpu_without_bf16(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device older than sm_80 (no bf16, e.g. a T4), else None."""
    capability = _capability(device)
    return capability if capability is not None and capability < (8, 0) else None


def bf16_problem(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why bfloat16 cannot run on ``device`` (one sentence), or None.

    The CPU interpreter computes bf16 silently wrong, and GPUs before sm_80
    (Colab's T4) have no bf16. Shared by the forward and backward launchers.
    """
    if dtype != torch.bfloat16:
        return None
    if _interpreted(device):
        return "bfloat16 is computed wrongly by Triton's CPU interpreter: use float32 or float16 on the CPU."
    old = _gpu_without_bf16(device)
    if old:
        return f"bfloat16 needs an sm_80 (Ampere) or newer GPU and this one is sm_{old[0]}{old[1]}: use float16."
    return None


def validate(q, k, v) -> None:
    """Raise ``ValueError`` (one plain sentence) unless q, k, v can go to the kernels.

    Accepted: torch tensors ``[B, H, N, D]`` on one device with one dtype
    (fp16, fp32, or bf16 on a GPU), the same B, N and D, K and V of one shape,
    ``Hq`` a multiple of ``Hkv``, and ``16 <= D <= 256``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch tensor, not {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, N, D], but it has {t.dim()} (shape {tuple(t.shape)}).")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, but they are on {q.device}, {k.device} and {v.device}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have one dtype, but they have {q.dtype}, {k.dtype} and {v.dtype}.")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported: use float16, bfloat16 or float32.")
    problem = bf16_problem(q.dtype, q.device)
    if problem:
        raise ValueError(problem)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, but they are {tuple(k.shape)} and {tuple(v.shape)}.")
    (b, hq, n, d), (bk, hkv, nk, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"q has batch size {b} but k and v have {bk}.")
    if n != nk:
        raise ValueError(f"q has sequence length {n} but k and v have {nk}; these kernels need the same N.")
    if d != dk:
        raise ValueError(f"q has head dim {d} but k and v have {dk}.")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of key/value heads ({hkv}).")
    if not 16 <= d <= 256:
        raise ValueError(f"head dim {d} is not supported: it must be between 16 and 256.")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the tensors are on the CPU but Triton's interpreter is off: move them to the GPU "
                         "(or import course_utils before triton on a machine without one).")


def block_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                 capability: tuple[int, int] | None = None) -> dict:
    """Block sizes and launch options for a head dim and dtype.

    In the CPU interpreter programs run one after another and every step of
    the K/V loop costs about the same few milliseconds whatever the block
    size (NumPy's per-call overhead dominates), so fewer, larger blocks run
    faster: 64 x 32 still gives the course's short sequences (N <= 256)
    several query blocks, several K/V blocks and two diagonal blocks per
    query block, so every code path runs.
    On a GPU the tiles must fit in shared memory with ``num_stages`` copies of
    the K and V tiles in flight: wider heads and 4-byte floats get smaller
    tiles and fewer stages. These are sensible defaults, not tuned optima
    (no autotuning here: it needs a GPU and would hide the lesson).
    """
    if _interpreted(device):
        return dict(BLOCK_M=64, BLOCK_N=32)
    d_pad = triton.next_power_of_2(head_dim)
    capability = capability or _capability(device)
    if capability is not None and capability < (8, 0):
        # Turing (Colab's T4): 64 KiB of shared memory per block and no asynchronous
        # copies, so no multi-stage pipeline; smaller tiles (checked by compiling for
        # sm_75: python -m course_utils.kernels.targets).
        row_bytes = d_pad * (4 if dtype == torch.float32 else 2)
        if row_bytes <= 128:
            return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)
        if row_bytes <= 256:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        if d_pad <= 64:
            return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4 if d_pad <= 128 else 8, num_stages=2)
    if d_pad <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if d_pad <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)


def window_block_config(head_dim: int, dtype: torch.dtype, device: torch.device, window_size: int,
                        capability: tuple[int, int] | None = None) -> dict:
    """:func:`block_config`'s choice for the window/sink forward, with Hopper's measured launch where it won.

    On sm_90, 16-bit inputs and head dims 65-128, 64-query tiles with 4 warps
    and 3 stages (lesson 06's launch: two programs share an SM), and 32-key
    tiles for windows of at most 256 keys (fewer masked keys at each window's
    far edge): ``benchmarks/tune_window.py``, ``results/tune_window.json``
    (H200, bf16, GQA 32/8, D = 128, N = 16k, W in {256, 1024, 4096}, with and
    without 4 sinks), where lesson 05's 128 x 64 tiles with 8 warps ran at
    0.92-1.04x FlexAttention's speed and the fastest launch at 1.06-1.48x.
    Elsewhere (not measured) :func:`block_config`'s choice.
    """
    cfg = block_config(head_dim, dtype, device, capability)
    if _interpreted(device):
        return cfg
    capability = capability or _capability(device)
    if (capability is not None and capability >= (9, 0) and dtype in (torch.float16, torch.bfloat16)
            and triton.next_power_of_2(head_dim) == 128):
        cfg = dict(BLOCK_M=64, BLOCK_N=32 if window_size <= 256 else 64, num_warps=4, num_stages=3)
    return cfg


def _config(q, block_m, block_n, num_warps=None, num_stages=None, base=None):
    cfg = dict(base) if base is not None else block_config(q.shape[-1], q.dtype, q.device)
    for name, value in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("num_warps", num_warps),
                        ("num_stages", num_stages)):
        if value is not None:
            cfg[name] = value
    for name in ("BLOCK_M", "BLOCK_N"):
        size = cfg[name]
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name.lower()} must be a power of two of at least 16 (tl.dot needs 16), not {size}.")
    return cfg


def flash_attention_forward(q, k, v, causal: bool = False, *, block_m: int | None = None, block_n: int | None = None):
    """Multi-head attention with kernel A (:func:`flash_attention_kernel`).

    ``q, k, v``: ``[B, H, N, D]`` torch tensors of any strides (the same H:
    this kernel has no GQA; see :func:`flash_attention_gqa_forward`). Returns
    ``o`` with q's shape and dtype. ``block_m``/``block_n`` override the
    defaults of :func:`block_config`.
    """
    validate(q, k, v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"flash_attention_forward is multi-head only: q has {q.shape[1]} heads and k, v have {k.shape[1]}; "
            "use flash_attention_gqa_forward for grouped-query attention."
        )
    B, H, N, D = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's layout
    if o.numel() == 0:
        return o
    cfg = _config(q, block_m, block_n)
    grid = (triton.cdiv(N, cfg["BLOCK_M"]), H, B)
    flash_attention_kernel[grid](
        q, k, v, o,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        B, H, N, N,
        1.0 / math.sqrt(D),
        D=D, D_PAD=triton.next_power_of_2(D), IS_CAUSAL=bool(causal),
        **cfg,
    )
    return o


def flash_attention_gqa_forward(q, k, v, causal: bool = False, *, block_m: int | None = None, block_n: int | None = None,
                                _validated: bool = False):
    """Grouped-query attention with kernel B (:func:`_flash_attention_forward_gqa_kernel`).

    ``q``: ``[B, Hq, N, D]``; ``k, v``: ``[B, Hkv, N, D]`` with ``Hq`` a
    multiple of ``Hkv`` (``Hkv == Hq`` is MHA, ``Hkv == 1`` MQA); any strides.
    Returns ``(o, lse)``: ``o`` like ``q``, ``lse`` float32 ``[B, Hq, N]``,
    the natural-log logsumexp of each query row's scaled scores (what the
    backward pass needs to rebuild the softmax without storing it).
    ``block_m`` must be a multiple of ``block_n``. ``_validated=True``: the
    caller has run :func:`validate` already (the package's dispatch).
    """
    if not _validated:
        validate(q, k, v)
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, N), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    cfg = _config(q, block_m, block_n)
    if cfg["BLOCK_M"] % cfg["BLOCK_N"]:
        raise ValueError(f"block_m ({cfg['BLOCK_M']}) must be a multiple of block_n ({cfg['BLOCK_N']}).")
    grid = (triton.cdiv(N, cfg["BLOCK_M"]), B * Hq)
    _flash_attention_forward_gqa_kernel[grid](
        q, k, v, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        1.0 / math.sqrt(D), N, Hq, Hkv,
        HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), IS_CAUSAL=bool(causal),
        **cfg,
    )
    return o, lse


def validate_window(causal, window_size, sink_size) -> None:
    """Raise ``ValueError`` (one sentence) unless the window and sink settings make sense.

    ``window_size``: None (no window) or an integer >= 1, only with
    ``causal=True``; ``sink_size``: an integer >= 0, above 0 only with a window.
    """
    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, numbers.Integral):
            raise ValueError(f"window_size must be an integer or None, not {window_size!r}.")
        if window_size < 1:
            raise ValueError(f"window_size must be at least 1 (each query sees itself), not {window_size}.")
        if not causal:
            raise ValueError("a window_size needs causal=True: the sliding window of this course only looks back.")
    if isinstance(sink_size, bool) or not isinstance(sink_size, numbers.Integral):
        raise ValueError(f"sink_size must be an integer, not {sink_size!r}.")
    if sink_size < 0:
        raise ValueError(f"sink_size must be 0 or more, not {sink_size}.")
    if sink_size and window_size is None:
        raise ValueError("sink_size needs a window_size: without a window every earlier key is visible already.")


def flash_attention_window_forward(q, k, v, *, window_size, sink_size=0,
                                   block_m: int | None = None, block_n: int | None = None,
                                   num_warps: int | None = None, num_stages: int | None = None,
                                   _validated: bool = False):
    """Causal GQA attention with a sliding window and sinks, by :func:`_flash_attention_forward_window_kernel`.

    Tensors as in :func:`flash_attention_gqa_forward`; returns ``(o, lse)``.
    Key ``j`` is visible from query ``i`` iff ``j <= i and (i - j <
    window_size or j < sink_size)``. ``block_m``, ``block_n``, ``num_warps`` and
    ``num_stages`` override :func:`window_block_config` (``benchmarks/tune_window.py``
    times them). ``_validated=True``: the caller has run :func:`validate` and
    :func:`validate_window` (with ``causal=True``) already.
    """
    if not _validated:
        validate(q, k, v)
        validate_window(True, window_size, sink_size)
    B, Hq, N, D = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, N), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    cfg = _config(q, block_m, block_n, num_warps, num_stages,
                  base=window_block_config(D, q.dtype, q.device, min(int(window_size), N)))
    if cfg["BLOCK_M"] % cfg["BLOCK_N"]:
        raise ValueError(f"block_m ({cfg['BLOCK_M']}) must be a multiple of block_n ({cfg['BLOCK_N']}).")
    grid = (triton.cdiv(N, cfg["BLOCK_M"]), B * Hq)
    _flash_attention_forward_window_kernel[grid](
        q, k, v, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        1.0 / math.sqrt(D), N, Hq, k.shape[1], min(int(window_size), N), min(int(sink_size), N),
        HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), HAS_SINKS=bool(sink_size),
        **cfg,
    )
    return o, lse


def _validate_cu_seqlens(q, cu_seqlens) -> None:
    """cu_seqlens: an int32 tensor ``[S + 1]`` on q's device, ``0 = cu[0] < ... < cu[S] = N``, and ``B == 1``."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be an int32 torch tensor, not {type(cu_seqlens).__name__}.")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must have dtype torch.int32, not {cu_seqlens.dtype}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-d with at least two entries [0, ..., N], not of shape "
                         f"{tuple(cu_seqlens.shape)}.")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on the inputs' device {q.device}, not {cu_seqlens.device}.")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the packed layout [1, H, N, D] (batch size 1), but the batch size "
                         f"is {q.shape[0]}.")
    cu = cu_seqlens.cpu()  # a few bytes; on a GPU this waits for cu_seqlens to be written
    n = q.shape[2]
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0 (the first document's start), not {int(cu[0])}.")
    if int(cu[-1]) != n:
        raise ValueError(f"cu_seqlens must end at N = {n} (the packed length), not {int(cu[-1])}.")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty document), but it is {cu.tolist()}.")


def _validate_softcap(softcap) -> None:
    """softcap: a finite real number above 0."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap must be a number above 0 (a Python float), not {softcap!r}.")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number above 0, not {softcap}.")


def _validate_per_head(q, x, name) -> None:
    """alibi_slopes, sink_logits: a float32 tensor ``[Hq]`` on q's device."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a float32 torch tensor of shape ({q.shape[1]},), not {type(x).__name__}.")
    if tuple(x.shape) != (q.shape[1],):
        raise ValueError(f"{name} must have one value per query head, shape ({q.shape[1]},), not {tuple(x.shape)}.")
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must have dtype torch.float32, not {x.dtype}.")
    if x.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}, not {x.device}.")


def validate_mods(q, cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None) -> None:
    """Raise ``ValueError`` (one sentence) unless lesson 12's keywords fit ``q`` (checked by :func:`validate`)."""
    if cu_seqlens is not None:
        _validate_cu_seqlens(q, cu_seqlens)
    if softcap is not None:
        _validate_softcap(softcap)
    if alibi_slopes is not None:
        _validate_per_head(q, alibi_slopes, "alibi_slopes")
    if sink_logits is not None:
        _validate_per_head(q, sink_logits, "sink_logits")


def has_mods(cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None) -> bool:
    """True when a call uses any of lesson 12's keywords (it then runs kernel D)."""
    return any(x is not None for x in (cu_seqlens, softcap, alibi_slopes, sink_logits))


def document_bounds(cu_seqlens, n: int):
    """``(doc_start, doc_end)``: int32 ``[n]`` tensors, where each position's document starts and ends."""
    cu_seqlens = cu_seqlens.contiguous()  # any strides (searchsorted wants a contiguous one)
    pos = torch.arange(n, dtype=torch.int32, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens, pos, right=True) - 1  # each position's document
    return cu_seqlens[seg].contiguous(), cu_seqlens[seg + 1].contiguous()


def mods_arguments(q, causal, window_size, sink_size, cu_seqlens, softcap, alibi_slopes, sink_logits):
    """The pointers, scalars and flags kernel D and the backward's kernels share, as two dicts."""
    N = q.shape[2]
    if cu_seqlens is not None:
        doc_start, doc_end = document_bounds(cu_seqlens, N)
    else:
        doc_start = doc_end = q  # never read: HAS_DOCS is off
    pointers = dict(DOC_START=doc_start, DOC_END=doc_end,
                    SLOPES=alibi_slopes.contiguous() if alibi_slopes is not None else q,
                    SINK_LOGITS=sink_logits.detach().contiguous() if sink_logits is not None else q)
    window = min(int(window_size), N) if window_size is not None else N
    flags = dict(WINDOW_SIZE=window, SINK_SIZE=min(int(sink_size), N),
                 softcap2=float(softcap) * LOG2E if softcap is not None else 1.0,
                 IS_CAUSAL=bool(causal), HAS_DOCS=cu_seqlens is not None, HAS_WINDOW=window_size is not None,
                 HAS_SINKS=bool(sink_size), HAS_SOFTCAP=softcap is not None, HAS_ALIBI=alibi_slopes is not None)
    return pointers, flags


def flash_attention_mods_forward(q, k, v, causal: bool = False, *, window_size=None, sink_size=0, cu_seqlens=None,
                                 softcap=None, alibi_slopes=None, sink_logits=None,
                                 block_m: int | None = None, block_n: int | None = None, _validated: bool = False):
    """GQA attention with lesson 12's score modifications, by :func:`_flash_attention_forward_mods_kernel`.

    Tensors as in :func:`flash_attention_gqa_forward`; returns ``(o, lse)``,
    ``lse`` including the sink logit (``log(exp(z_h) + sum_j exp(s_ij))``).
    ``cu_seqlens`` (int32 ``[S + 1]``, B == 1), ``softcap`` (float > 0),
    ``alibi_slopes``, ``sink_logits`` (float32 ``[Hq]``) and lesson 08's
    ``window_size``/``sink_size`` (with ``causal=True``) in any combination;
    semantics in :mod:`course_utils.references`. ``_validated=True``: the
    caller has run :func:`validate`, :func:`validate_window` and
    :func:`validate_mods` already.
    """
    if not _validated:
        validate(q, k, v)
        validate_window(causal, window_size, sink_size)
        validate_mods(q, cu_seqlens, softcap, alibi_slopes, sink_logits)
    B, Hq, N, D = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, N), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    cfg = _config(q, block_m, block_n)
    pointers, flags = mods_arguments(q, causal, window_size, sink_size, cu_seqlens, softcap, alibi_slopes,
                                     sink_logits)
    grid = (triton.cdiv(N, cfg["BLOCK_M"]), B * Hq)
    _flash_attention_forward_mods_kernel[grid](
        q, k, v, o, lse, pointers["DOC_START"], pointers["DOC_END"], pointers["SLOPES"], pointers["SINK_LOGITS"],
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        1.0 / math.sqrt(D), N, Hq, k.shape[1], flags["WINDOW_SIZE"], flags["SINK_SIZE"], flags["softcap2"],
        HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D),
        IS_CAUSAL=flags["IS_CAUSAL"], HAS_DOCS=flags["HAS_DOCS"], HAS_WINDOW=flags["HAS_WINDOW"],
        HAS_SINKS=flags["HAS_SINKS"], HAS_SOFTCAP=flags["HAS_SOFTCAP"], HAS_ALIBI=flags["HAS_ALIBI"],
        HAS_SINK_LOGITS=sink_logits is not None,
        **cfg,
    )
    return o, lse
