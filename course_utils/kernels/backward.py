"""The FlashAttention-2 backward pass in Triton, with grouped-query attention.

Given what the forward pass saved (``q, k, v``, the output ``o`` and the
natural-log logsumexp ``lse`` of each query row) and the upstream gradient
``do``, three kernels compute ``dq, dk, dv`` without ever holding an
``N x N`` matrix:

1. :func:`attn_bwd_preprocess` - ``delta = rowsum(do * o)``, one float per
   query row. It is the ``D`` in ``dS = P * (dP - D)``: the softmax Jacobian's
   correction term, computed once instead of once per key block.
2. :func:`_attn_bwd_dkdv` - one program per (block of keys, kv head). It keeps
   its ``dk`` and ``dv`` tiles in registers and loops over every query block
   of every query head in its GQA group, recomputing ``P`` from ``q``, ``k``
   and ``lse``. Because one program owns a kv head's rows, the sum over the
   group's query heads happens in a fixed order inside the program: no atomics,
   and the result is the same bit for bit on every run.
3. :func:`_attn_bwd_dq` - one program per (block of queries, query head),
   looping over the key blocks of its kv head. ``dq`` gets its own kernel so
   that no two programs ever add into the same rows.

Exponentials use ``exp2`` (one hardware instruction) with ``log2(e)`` folded
into the scale: ``P = exp(s * sm_scale - lse) = exp2(s * sm_scale * log2(e) -
lse * log2(e))``; ``lse`` stays a natural log everywhere outside the kernels.

:class:`FlashAttentionFunction` wires the package's forward dispatch
(:func:`course_utils.kernels.dispatch.launch_forward`, imported downward: this
module never imports the package face ``course_utils.kernels``) and this
backward into ``torch.autograd``.

The ``@triton.jit`` functions here are the ones lesson 07
(``solutions/07_backward.ipynb``) defines, with ``### BEGIN/END SOLUTION``
lines around the learner's parts; ``tests/test_backward.py`` keeps the two
identical. Edit both together. The helpers later lessons reuse have public
names (lesson 08 imports :func:`load_tile`, :func:`store_tile`,
:func:`attn_bwd_preprocess`, :func:`dkdv_inner` and :func:`attn_bwd_dq_window`);
a leading underscore marks what only this module calls.

Section 5 holds lesson 12's kernels (:func:`_attn_bwd_dkdv_mods`,
:func:`_attn_bwd_dq_mods`): documents, soft-cap (``dS *= 1 - tanh^2``), ALiBi
(no gradient) and the sink logit (inside ``lse``; its own gradient is
:func:`sink_logits_grad`, a torch reduction).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from course_utils.kernels.dispatch import check_call, launch_forward  # absolute: tests load copies of this file
from course_utils.kernels.launch import BoundLauncher, aligned
from course_utils.kernels.forward import (
    _capability, _mods_bounds, _mods_keep, _score_mod, _split_range, _window_bounds, _window_keep, bf16_problem,
    has_mods, mods_arguments, validate_mods, validate_window,
)


__all__ = [
    "attention_backward",
    "FlashAttentionFunction",
    "flash_attention_differentiable",
    "BackwardConfig",
    "default_config",
    "check_backward_inputs",
    "load_tile",
    "store_tile",
    "attn_bwd_preprocess",
    "dkdv_inner",
    "attn_bwd_dq_window",
    "sink_logits_grad",
]

# log2(e): exp(x) == exp2(x * LOG2E). The kernels write it out as a literal:
# a @triton.jit function reads no Python global that is not a tl.constexpr.
LOG2E = 1.4426950408889634


# -----------------------------------------------------------------------------
# Loading helpers: rows past the end of the sequence and columns past the head
# dim are masked (the head dim is padded to a power of two for tl.arange).
# EVEN and PAD_D are compile-time flags, so the common case pays for no mask.
# -----------------------------------------------------------------------------
@triton.jit
def load_tile(ptrs, offs_rows, n_rows, offs_d, head_dim, EVEN: tl.constexpr, PAD_D: tl.constexpr):
    if EVEN:
        if PAD_D:
            tile = tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        if PAD_D:
            tile = tl.load(ptrs, mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < head_dim), other=0.0)
        else:
            tile = tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)
    return tile


@triton.jit
def store_tile(ptrs, tile, offs_rows, n_rows, offs_d, head_dim, EVEN: tl.constexpr, PAD_D: tl.constexpr):
    if EVEN:
        if PAD_D:
            tl.store(ptrs, tile, mask=offs_d[None, :] < head_dim)
        else:
            tl.store(ptrs, tile)
    else:
        if PAD_D:
            tl.store(ptrs, tile, mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < head_dim))
        else:
            tl.store(ptrs, tile, mask=offs_rows[:, None] < n_rows)


# -----------------------------------------------------------------------------
# 1. delta = rowsum(dO * O)
# -----------------------------------------------------------------------------
@triton.jit
def attn_bwd_preprocess(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_deltab, stride_deltah,
    n_q_heads, N_Q, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr, PAD_D: tl.constexpr, ACC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_q_heads
    q_head = pid_bh % n_q_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = O + b * stride_ob + q_head * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    do_ptrs = DO + b * stride_dob + q_head * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod
    o = load_tile(o_ptrs, offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D).to(ACC)
    do = load_tile(do_ptrs, offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D).to(ACC)
    # delta_i = sum over d of o[i, d] * do[i, d]: one number per query row.
    delta = tl.sum(o * do, axis=1)
    delta_ptrs = DELTA + b * stride_deltab + q_head * stride_deltah + offs_m
    if EVEN_M:
        tl.store(delta_ptrs, delta)
    else:
        tl.store(delta_ptrs, delta, mask=offs_m < N_Q)


_PREPROCESS = BoundLauncher(attn_bwd_preprocess)  # launch_preprocess's launches, bound once per key on a GPU


# -----------------------------------------------------------------------------
# 2. dK, dV: one program per (key block, batch * kv head)
# -----------------------------------------------------------------------------
@triton.jit
def dkdv_inner(
    dk, dv, k, v,
    q_base, do_base, lse_base, delta_base,
    stride_qn, stride_qd, stride_don, stride_dod,
    offs_n, offs_d, start_m_lo, start_m_hi, N_Q, head_dim, qk_scale,
    BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr, PAD_D: tl.constexpr, MASK: tl.constexpr,
):
    """Add the contributions of query blocks [start_m_lo, start_m_hi) of ONE query head.

    Works on transposed tiles (keys on the rows) so that dk and dv, which are
    [BLOCK_N, D], come straight out of ``tl.dot``.
    """
    for start_m in range(start_m_lo, start_m_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                      offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
        do = load_tile(do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                       offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
        if EVEN_M:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        else:
            # lse = +inf on rows past the end makes their P exactly 0.
            lse = tl.load(lse_base + offs_m, mask=offs_m < N_Q, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
        # P^T = exp(sm_scale * K Q^T - lse) = exp2(qk_scale * K Q^T - lse * log2(e)),
        # zeroed where key j > query i on the diagonal tiles (MASK). Then
        # dV += P^T dO,  dP^T = V dO^T,  dS^T = P^T * (dP^T - delta),  dK += dS^T Q
        # (sm_scale is applied to dK once, by the caller). The products take
        # P^T and dS^T in the inputs' dtype; the sums stay in fp32.
        s_t = tl.dot(k, tl.trans(q))
        p_t = tl.math.exp2(s_t * qk_scale - lse[None, :] * 1.4426950408889634)
        if MASK:  # tiles on the diagonal: key j is invisible to query i < j
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lseb, stride_lseh,
    stride_deltab, stride_deltah,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_kv_heads, group_size, N_Q, N_K, head_dim, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr,
    ACC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    kv_head = pid_bh % n_kv_heads
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634

    k = load_tile(K + b * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                  offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    v = load_tile(V + b * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                  offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)

    # The group's query heads, one after another, always in the same order:
    # the GQA sum is deterministic.
    for g in range(0, group_size):
        q_head = kv_head * group_size + g
        q_base = Q + b * stride_qb + q_head * stride_qh
        do_base = DO + b * stride_dob + q_head * stride_doh
        lse_base = LSE + b * stride_lseb + q_head * stride_lseh
        delta_base = DELTA + b * stride_deltab + q_head * stride_deltah
        # Which query rows see these keys? Causal: BLOCK_N is a multiple of
        # BLOCK_M, so query blocks start at start_n: those before it see none of
        # these keys (skipped), the ones in [start_n, start_n + BLOCK_N) cross the
        # diagonal (masked), the rest, up to N_Q, see every key of the block (no
        # mask work). Not causal: every query row, unmasked, and no masked range.
        # Set [diag_lo, diag_hi) (masked) and [full_lo, full_hi) (unmasked).
        if CAUSAL:
            diag_lo, diag_hi = start_n, tl.minimum(start_n + BLOCK_N, N_Q)
            full_lo, full_hi = start_n + BLOCK_N, N_Q
        else:
            diag_lo, diag_hi = 0, 0
            full_lo, full_hi = 0, N_Q
        dk, dv = dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                            stride_qn, stride_qd, stride_don, stride_dod,
                            offs_n, offs_d, diag_lo, diag_hi, N_Q, head_dim, qk_scale,
                            BLOCK_M, EVEN_M, PAD_D, True)
        dk, dv = dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                            stride_qn, stride_qd, stride_don, stride_dod,
                            offs_n, offs_d, full_lo, full_hi, N_Q, head_dim, qk_scale,
                            BLOCK_M, EVEN_M, PAD_D, False)

    # dK = sm_scale * dS^T Q: the scale is applied once, here, not in every tile.
    dk *= sm_scale
    store_tile(DK + b * stride_dkb + kv_head * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
               dk.to(DK.dtype.element_ty), offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    store_tile(DV + b * stride_dvb + kv_head * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
               dv.to(DV.dtype.element_ty), offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)


# -----------------------------------------------------------------------------
# 3. dQ: one program per (query block, batch * query head)
# -----------------------------------------------------------------------------
@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, start_n_lo, start_n_hi, N_K, head_dim, qk_scale,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr, MASK: tl.constexpr,
):
    """Add the contributions of key blocks [start_n_lo, start_n_hi) to one dq tile."""
    for start_n in range(start_n_lo, start_n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                      offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
        v = load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                      offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
        # P = exp2(qk_scale * Q K^T - lse2), zeroed where key j > query i on the
        # diagonal tiles (MASK) and, when N_K is not a multiple of BLOCK_N, for
        # the keys past the end (loaded as zeros, their score 0 is not -inf).
        # Then dP = dO V^T,  dS = P * (dP - delta),  dq += dS K.
        s = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASK:
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        if not EVEN_N:  # keys past the end were loaded as zeros: their P must be 0
            p = tl.where(offs_n[None, :] < N_K, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lseb, stride_lseh,
    stride_deltab, stride_deltah,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    n_q_heads, group_size, N_Q, N_K, head_dim, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr,
    ACC: tl.constexpr,
):
    # With a causal mask the last query block has the most key blocks to visit:
    # launch it first, so the short programs fill in at the end.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_q_heads
    q_head = pid_bh % n_q_heads
    kv_head = q_head // group_size
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634

    q = load_tile(Q + b * stride_qb + q_head * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                  offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
    do = load_tile(DO + b * stride_dob + q_head * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                   offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
    lse_ptrs = LSE + b * stride_lseb + q_head * stride_lseh + offs_m
    delta_ptrs = DELTA + b * stride_deltab + q_head * stride_deltah + offs_m
    if EVEN_M:
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    else:
        lse = tl.load(lse_ptrs, mask=offs_m < N_Q, other=0.0)
        delta = tl.load(delta_ptrs, mask=offs_m < N_Q, other=0.0)
    lse2 = lse * 1.4426950408889634  # the natural-log lse, in base 2

    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    # Which keys does this query block see? Causal: BLOCK_M is a multiple of
    # BLOCK_N, so key blocks before start_m are fully visible (no mask), those
    # in [start_m, start_m + BLOCK_M) cross the diagonal (masked), and later ones
    # are skipped; clip both to N_K. Not causal: every key, unmasked, and no
    # masked range. Set [full_lo, full_hi) (unmasked) and [diag_lo, diag_hi) (masked).
    if CAUSAL:
        full_lo, full_hi = 0, tl.minimum(start_m, N_K)
        diag_lo, diag_hi = start_m, tl.minimum(start_m + BLOCK_M, N_K)
    else:
        full_lo, full_hi = 0, N_K
        diag_lo, diag_hi = 0, 0
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, full_lo, full_hi, N_K, head_dim, qk_scale,
                   BLOCK_N, EVEN_N, PAD_D, False)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, diag_lo, diag_hi, N_K, head_dim, qk_scale,
                   BLOCK_N, EVEN_N, PAD_D, True)
    # dQ = sm_scale * dS K: the scale is applied once, here, not in every tile.
    dq *= sm_scale
    store_tile(DQ + b * stride_dqb + q_head * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
               dq.to(DQ.dtype.element_ty), offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)


# -----------------------------------------------------------------------------
# 4. Lesson 08: the same two kernels with a sliding window and attention sinks.
# Key j is visible from query i iff j <= i and (i - j < WINDOW_SIZE or j < SINK_SIZE).
# Full tiles reuse the helpers above with MASK=False; partial tiles go through
# the masked helpers below, which share the mask (_window_keep) with the forward.
# -----------------------------------------------------------------------------
@triton.jit
def _dkdv_inner_window(
    dk, dv, k, v,
    q_base, do_base, lse_base, delta_base,
    stride_qn, stride_qd, stride_don, stride_dod,
    offs_n, offs_d, start_m_lo, start_m_hi, N_Q, head_dim, qk_scale, WINDOW_SIZE, SINK_SIZE,
    BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr, PAD_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """:func:`dkdv_inner` on partial tiles: P^T is zeroed where the window/sink mask hides key j from query i."""
    for start_m in range(start_m_lo, start_m_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                      offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
        do = load_tile(do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                       offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
        lse = tl.load(lse_base + offs_m, mask=offs_m < N_Q, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
        s_t = tl.dot(k, tl.trans(q))
        p_t = tl.math.exp2(s_t * qk_scale - lse[None, :] * 1.4426950408889634)
        ### BEGIN SOLUTION
        keep = _window_keep(offs_m[None, :], offs_n[:, None], N_Q, WINDOW_SIZE, SINK_SIZE, HAS_SINKS)
        p_t = tl.where(keep, p_t, 0.0)
        ### END SOLUTION
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_window(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lseb, stride_lseh,
    stride_deltab, stride_deltah,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_kv_heads, group_size, N_Q, N_K, head_dim, sm_scale, WINDOW_SIZE, SINK_SIZE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """dK, dV of one key block with the window and sinks (same grid as :func:`_attn_bwd_dkdv`)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    kv_head = pid_bh % n_kv_heads
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634

    k = load_tile(K + b * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                  offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    v = load_tile(V + b * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                  offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)

    # Which query blocks see these keys? [start_n, diag_end): the diagonal, partial;
    # [diag_end, full_end): every row sees every key of the block; [full_end, q_end):
    # partial again (the window's far edge). A block holding sink keys is seen by every
    # later query: q_end = N_Q, and full_end = N_Q too if ALL its keys are sinks.
    ### BEGIN SOLUTION
    diag_end = tl.minimum(start_n + BLOCK_N, N_Q)
    full_end = tl.minimum(tl.maximum((start_n + WINDOW_SIZE) // BLOCK_M * BLOCK_M, diag_end), N_Q)
    q_end = tl.minimum(start_n + BLOCK_N + WINDOW_SIZE - 1, N_Q)
    if HAS_SINKS:
        full_end = tl.where(start_n + BLOCK_N <= SINK_SIZE, N_Q, full_end)
        q_end = tl.where(start_n < SINK_SIZE, N_Q, q_end)
    ### END SOLUTION
    for g in range(0, group_size):
        q_head = kv_head * group_size + g
        q_base = Q + b * stride_qb + q_head * stride_qh
        do_base = DO + b * stride_dob + q_head * stride_doh
        lse_base = LSE + b * stride_lseb + q_head * stride_lseh
        delta_base = DELTA + b * stride_deltab + q_head * stride_deltah
        dk, dv = _dkdv_inner_window(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                    stride_qn, stride_qd, stride_don, stride_dod,
                                    offs_n, offs_d, start_n, diag_end, N_Q, head_dim, qk_scale,
                                    WINDOW_SIZE, SINK_SIZE, BLOCK_M, EVEN_M, PAD_D, HAS_SINKS)
        dk, dv = dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                            stride_qn, stride_qd, stride_don, stride_dod,
                            offs_n, offs_d, diag_end, full_end, N_Q, head_dim, qk_scale,
                            BLOCK_M, EVEN_M, PAD_D, False)
        dk, dv = _dkdv_inner_window(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                    stride_qn, stride_qd, stride_don, stride_dod,
                                    offs_n, offs_d, full_end, q_end, N_Q, head_dim, qk_scale,
                                    WINDOW_SIZE, SINK_SIZE, BLOCK_M, EVEN_M, PAD_D, HAS_SINKS)

    dk *= sm_scale
    store_tile(DK + b * stride_dkb + kv_head * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
               dk.to(DK.dtype.element_ty), offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    store_tile(DV + b * stride_dvb + kv_head * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
               dv.to(DV.dtype.element_ty), offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)


@triton.jit
def _attn_bwd_dkdv_sinks(
    Q, K, V, DO, LSE, DELTA, DK_PART, DV_PART,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lseb, stride_lseh,
    stride_deltab, stride_deltah,
    n_kv_heads, group_size, N_Q, head_dim, sm_scale, WINDOW_SIZE, SINK_SIZE, CHUNK,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """The sink keys' dK, dV from the queries that see them only as sinks, spread over programs.

    Package-only (lesson 08's "Speed" section): in :func:`_attn_bwd_dkdv_window` the one
    program owning the sink keys walks every later query block, N / W times the work of the
    others, and the whole kernel waits for it. Here program ``(c, s, b * n_kv_heads + kv_head)``
    takes sink keys ``[s * BLOCK_S, (s + 1) * BLOCK_S)`` and the ``c``-th chunk of ``CHUNK``
    query rows, keeps only the pairs with ``i - j >= WINDOW_SIZE`` (the window kernel, run
    with ``SINK_SIZE = 0``, has the others) and writes an fp32 partial sum to
    ``DK_PART/DV_PART[c, b * n_kv_heads + kv_head, s * BLOCK_S + row, :]``. The launcher adds
    the partials up in a fixed order: no atomics, the same bits on every run.
    """
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // n_kv_heads
    kv_head = pid_bh % n_kv_heads
    start_s = pid_s * BLOCK_S
    offs_n = start_s + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634

    k = load_tile(K + b * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                  offs_n, SINK_SIZE, offs_d, head_dim, False, PAD_D)
    v = load_tile(V + b * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                  offs_n, SINK_SIZE, offs_d, head_dim, False, PAD_D)
    dk = tl.zeros([BLOCK_S, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_S, BLOCK_D], dtype=ACC)
    # Chunks tile [WINDOW_SIZE rounded down to BLOCK_M, N_Q); this key block's first far row
    # is start_s + WINDOW_SIZE, so the earlier tiles of the first chunks are skipped.
    chunk_lo = WINDOW_SIZE // BLOCK_M * BLOCK_M + pid_c * CHUNK
    lo = tl.maximum(chunk_lo, (start_s + WINDOW_SIZE) // BLOCK_M * BLOCK_M)
    hi = tl.minimum(chunk_lo + CHUNK, N_Q)
    for g in range(0, group_size):
        q_head = kv_head * group_size + g
        q_base = Q + b * stride_qb + q_head * stride_qh
        do_base = DO + b * stride_dob + q_head * stride_doh
        lse_base = LSE + b * stride_lseb + q_head * stride_lseh
        delta_base = DELTA + b * stride_deltab + q_head * stride_deltah
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = load_tile(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                          offs_m, N_Q, offs_d, head_dim, False, PAD_D)
            do = load_tile(do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                           offs_m, N_Q, offs_d, head_dim, False, PAD_D)
            lse = tl.load(lse_base + offs_m, mask=offs_m < N_Q, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
            s_t = tl.dot(k, tl.trans(q))
            p_t = tl.math.exp2(s_t * qk_scale - lse[None, :] * 1.4426950408889634)
            far = ((offs_m[None, :] - offs_n[:, None]) >= WINDOW_SIZE) & (offs_n[:, None] < SINK_SIZE) \
                & (offs_m[None, :] < N_Q)
            p_t = tl.where(far, p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
    dk *= sm_scale
    rows = tl.arange(0, BLOCK_S)
    part = (pid_c * tl.num_programs(2) + pid_bh) * (tl.num_programs(1) * BLOCK_S * BLOCK_D) + start_s * BLOCK_D
    tl.store(DK_PART + part + rows[:, None] * BLOCK_D + offs_d[None, :], dk)
    tl.store(DV_PART + part + rows[:, None] * BLOCK_D + offs_d[None, :], dv)


@triton.jit
def _add_sink_partials(
    DK_PART, DV_PART, DK, DV,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_kv_heads, SINK_SIZE, head_dim, CHUNKS, PART_ROWS,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    """``dk, dv[sink rows] += the sum of :func:`_attn_bwd_dkdv_sinks`'s partials``, chunk 0 first.

    Program ``(s, b * n_kv_heads + kv_head)`` owns sink keys ``[s * BLOCK_S, (s + 1) * BLOCK_S)``
    of one kv head and adds the ``CHUNKS`` partials in order, so the bits are the same on every
    run. One launch for both gradients, where the same sum in torch ops took ten (the step is
    launch-bound at short sequences: ``benchmarks/host_overhead.py``).
    """
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    kv_head = pid_bh % n_kv_heads
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    far_k = tl.zeros([BLOCK_S, BLOCK_D], dtype=ACC)
    far_v = tl.zeros([BLOCK_S, BLOCK_D], dtype=ACC)
    for c in range(0, CHUNKS):  # fixed order: chunk 0, 1, ...
        part = (c * tl.num_programs(1) + pid_bh) * (PART_ROWS * BLOCK_D)
        far_k += tl.load(DK_PART + part + rows[:, None] * BLOCK_D + offs_d[None, :])
        far_v += tl.load(DV_PART + part + rows[:, None] * BLOCK_D + offs_d[None, :])
    ok = (rows[:, None] < SINK_SIZE) & (offs_d[None, :] < head_dim)
    dk_ptrs = DK + b * stride_dkb + kv_head * stride_dkh + rows[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + b * stride_dvb + kv_head * stride_dvh + rows[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    dk = tl.load(dk_ptrs, mask=ok, other=0.0).to(ACC) + far_k
    dv = tl.load(dv_ptrs, mask=ok, other=0.0).to(ACC) + far_v
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _dq_inner_window(
    dq, q, do, lse2, delta,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, start_n_lo, start_n_hi, N_K, head_dim, qk_scale, WINDOW_SIZE, SINK_SIZE,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """:func:`_dq_inner` on partial tiles: P is zeroed where the window/sink mask hides key j from query i."""
    for start_n in range(start_n_lo, start_n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                      offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
        v = load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                      offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
        s = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        keep = _window_keep(offs_m[:, None], offs_n[None, :], N_K, WINDOW_SIZE, SINK_SIZE, HAS_SINKS)
        p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def attn_bwd_dq_window(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lseb, stride_lseh,
    stride_deltab, stride_deltah,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    n_q_heads, group_size, N_Q, N_K, head_dim, sm_scale, WINDOW_SIZE, SINK_SIZE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """dQ of one query block with the window and sinks: the forward's five phases (:func:`_window_bounds`)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_q_heads
    q_head = pid_bh % n_q_heads
    kv_head = q_head // group_size
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634

    q = load_tile(Q + b * stride_qb + q_head * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                  offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
    do = load_tile(DO + b * stride_dob + q_head * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                   offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
    lse = tl.load(LSE + b * stride_lseb + q_head * stride_lseh + offs_m, mask=offs_m < N_Q, other=0.0)
    delta = tl.load(DELTA + b * stride_deltab + q_head * stride_deltah + offs_m, mask=offs_m < N_Q, other=0.0)
    lse2 = lse * 1.4426950408889634

    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    sink_full, sink_end, band_start, full_start, band_end = _window_bounds(
        start_m, N_K, WINDOW_SIZE, SINK_SIZE, BLOCK_M, BLOCK_N)
    if HAS_SINKS:
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_d, 0, sink_full, N_K, head_dim, qk_scale, BLOCK_N, EVEN_N, PAD_D, False)
        dq = _dq_inner_window(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                              offs_m, offs_d, sink_full, sink_end, N_K, head_dim, qk_scale, WINDOW_SIZE, SINK_SIZE,
                              BLOCK_N, EVEN_N, PAD_D, HAS_SINKS)
    dq = _dq_inner_window(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                          offs_m, offs_d, band_start, full_start, N_K, head_dim, qk_scale, WINDOW_SIZE, SINK_SIZE,
                          BLOCK_N, EVEN_N, PAD_D, HAS_SINKS)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, full_start, start_m, N_K, head_dim, qk_scale, BLOCK_N, EVEN_N, PAD_D, False)
    dq = _dq_inner_window(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                          offs_m, offs_d, start_m, band_end, N_K, head_dim, qk_scale, WINDOW_SIZE, SINK_SIZE,
                          BLOCK_N, EVEN_N, PAD_D, HAS_SINKS)
    dq *= sm_scale
    store_tile(DQ + b * stride_dqb + q_head * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
               dq.to(DQ.dtype.element_ty), offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)


# -----------------------------------------------------------------------------
# 5. Lesson 12: packed documents, soft-capping, ALiBi and sink logits.
# The scores are recomputed and modified exactly as in the forward
# (forward._score_mod); the soft-cap multiplies dS by 1 - tanh^2, ALiBi has no
# gradient, and the sink logit is already inside lse (its own gradient comes
# from lse, O and dO: sink_logits_grad). Tiles outside every visible pair are
# skipped; only partial tiles are masked (forward._mods_keep).
# -----------------------------------------------------------------------------
@triton.jit
def _dkdv_inner_mods(
    dk, dv, k, v,
    q_base, do_base, lse_base, delta_base,
    stride_qn, stride_qd, stride_don, stride_dod,
    offs_n, offs_d, doc_n, DOC_START, start_m_lo, start_m_hi, N_Q, head_dim, qk_scale, softcap2, slope2,
    WINDOW_SIZE, SINK_SIZE,
    BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr, PAD_D: tl.constexpr, MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """:func:`dkdv_inner` with the scores modified, and masked only when ``MASK`` (partial tiles)."""
    for start_m in range(start_m_lo, start_m_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                      offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
        do = load_tile(do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                       offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
        # lse = +inf on rows past the end makes their P exactly 0.
        lse = tl.load(lse_base + offs_m, mask=offs_m < N_Q, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale  # [BLOCK_N, BLOCK_M], log2 units
        s_t, t_t = _score_mod(s_t, offs_m[None, :], offs_n[:, None], softcap2, slope2, HAS_SOFTCAP, HAS_ALIBI)
        p_t = tl.math.exp2(s_t - lse[None, :] * 1.4426950408889634)
        if MASK:
            if HAS_DOCS:
                doc_m = tl.load(DOC_START + offs_m, mask=offs_m < N_Q, other=-1)
            else:
                doc_m = offs_m
            keep = _mods_keep(offs_m[None, :], offs_n[:, None], doc_m[None, :], doc_n[:, None], N_Q,
                              WINDOW_SIZE, SINK_SIZE, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS)
            p_t = tl.where(keep, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        ### BEGIN SOLUTION
        if HAS_SOFTCAP:  # d(c * tanh(x / c)) / dx = 1 - tanh(x / c)^2
            ds_t = ds_t * (1.0 - t_t * t_t)
        ### END SOLUTION
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _dkdv_bounds_mods(start_n, DOC_START, DOC_END, N_Q, WINDOW_SIZE, SINK_SIZE,
                      IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, f_lo, f_hi, hi)``: the query tiles that see key block ``start_n`` (``[f_lo, f_hi)``: every pair).

    Rows ``[lo, hi)``: from the first key's document start (causal: the first
    key) rounded down to a query tile, to the last key's document end (window:
    at most the last key + ``WINDOW_SIZE``; a block holding sink keys: the end
    of the last sink key's document). Rows that see every key of the block:
    one document holds every key, the row is at or after the last key
    (causal) and within the window of the first key (unless every key is a
    sink).
    """
    n_last = tl.minimum(start_n + BLOCK_N, N_Q) - 1
    if HAS_DOCS:
        ds = tl.load(DOC_START + start_n)
        de = tl.load(DOC_END + n_last)
        one_doc = tl.load(DOC_START + n_last) == ds
    else:
        ds = 0
        de = N_Q
        one_doc = True
    lo = ds
    full_lo = ds
    if IS_CAUSAL:
        lo = start_n
        full_lo = tl.maximum(ds, n_last)
    lo = lo // BLOCK_M * BLOCK_M
    full_lo = (full_lo + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    hi = de
    full_hi = de
    if HAS_WINDOW:
        hi = tl.minimum(de, n_last + WINDOW_SIZE)
        full_hi = tl.minimum(de, start_n + WINDOW_SIZE)
        if HAS_SINKS:
            if HAS_DOCS:
                de_sink = tl.load(DOC_END + tl.minimum(n_last, SINK_SIZE - 1))
            else:
                de_sink = N_Q
            hi = tl.where(start_n < SINK_SIZE, tl.maximum(hi, de_sink), hi)
            full_hi = tl.where(n_last < SINK_SIZE, de, full_hi)
    full_hi = full_hi // BLOCK_M * BLOCK_M
    full_lo = tl.where(one_doc, full_lo, hi)
    full_hi = tl.where(one_doc, full_hi, hi)
    return _split_range(lo, full_lo, full_hi, hi)


@triton.jit
def _attn_bwd_dkdv_mods(
    Q, K, V, DO, LSE, DELTA, DK, DV, DOC_START, DOC_END, SLOPES,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lseb, stride_lseh,
    stride_deltab, stride_deltah,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_kv_heads, group_size, N_Q, N_K, head_dim, sm_scale, WINDOW_SIZE, SINK_SIZE, softcap2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr, ACC: tl.constexpr,
):
    """dK, dV of one key block with lesson 12's modifications (same grid as :func:`_attn_bwd_dkdv`)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    kv_head = pid_bh % n_kv_heads
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634

    k = load_tile(K + b * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                  offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    v = load_tile(V + b * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                  offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    if HAS_DOCS:
        doc_n = tl.load(DOC_START + offs_n, mask=offs_n < N_K, other=-2)
    else:
        doc_n = offs_n
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    lo, f_lo, f_hi, hi = _dkdv_bounds_mods(start_n, DOC_START, DOC_END, N_Q, WINDOW_SIZE, SINK_SIZE,
                                           IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, BLOCK_M, BLOCK_N)
    for g in range(0, group_size):
        q_head = kv_head * group_size + g
        q_base = Q + b * stride_qb + q_head * stride_qh
        do_base = DO + b * stride_dob + q_head * stride_doh
        lse_base = LSE + b * stride_lseb + q_head * stride_lseh
        delta_base = DELTA + b * stride_deltab + q_head * stride_deltah
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(SLOPES + q_head) * 1.4426950408889634
        dk, dv = _dkdv_inner_mods(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                  stride_qn, stride_qd, stride_don, stride_dod,
                                  offs_n, offs_d, doc_n, DOC_START, lo, f_lo, N_Q, head_dim, qk_scale, softcap2,
                                  slope2, WINDOW_SIZE, SINK_SIZE, BLOCK_M, EVEN_M, PAD_D, True,
                                  IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI)
        dk, dv = _dkdv_inner_mods(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                  stride_qn, stride_qd, stride_don, stride_dod,
                                  offs_n, offs_d, doc_n, DOC_START, f_lo, f_hi, N_Q, head_dim, qk_scale, softcap2,
                                  slope2, WINDOW_SIZE, SINK_SIZE, BLOCK_M, EVEN_M, PAD_D, False,
                                  IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI)
        dk, dv = _dkdv_inner_mods(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                  stride_qn, stride_qd, stride_don, stride_dod,
                                  offs_n, offs_d, doc_n, DOC_START, f_hi, hi, N_Q, head_dim, qk_scale, softcap2,
                                  slope2, WINDOW_SIZE, SINK_SIZE, BLOCK_M, EVEN_M, PAD_D, True,
                                  IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI)

    dk *= sm_scale
    store_tile(DK + b * stride_dkb + kv_head * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
               dk.to(DK.dtype.element_ty), offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
    store_tile(DV + b * stride_dvb + kv_head * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
               dv.to(DV.dtype.element_ty), offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)


@triton.jit
def _dq_inner_mods(
    dq, q, do, lse2, delta,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, doc_m, DOC_START, start_n_lo, start_n_hi, N_K, head_dim, qk_scale, softcap2, slope2,
    WINDOW_SIZE, SINK_SIZE,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr, MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """:func:`_dq_inner` with the scores modified, and masked only when ``MASK`` (partial tiles)."""
    for start_n in range(start_n_lo, start_n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                      offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
        v = load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                      offs_n, N_K, offs_d, head_dim, EVEN_N, PAD_D)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s, t = _score_mod(s, offs_m[:, None], offs_n[None, :], softcap2, slope2, HAS_SOFTCAP, HAS_ALIBI)
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            if HAS_DOCS:
                doc_n = tl.load(DOC_START + offs_n, mask=offs_n < N_K, other=-2)
            else:
                doc_n = offs_n
            keep = _mods_keep(offs_m[:, None], offs_n[None, :], doc_m[:, None], doc_n[None, :], N_K,
                              WINDOW_SIZE, SINK_SIZE, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _dq_range_mods(
    dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, doc_m, DOC_START, lo, f_lo, f_hi, hi, N_K, head_dim, qk_scale, softcap2, slope2,
    WINDOW_SIZE, SINK_SIZE,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """One range of key tiles in three phases: ``[lo, f_lo)`` masked, ``[f_lo, f_hi)`` whole, ``[f_hi, hi)`` masked."""
    dq = _dq_inner_mods(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                        offs_m, offs_d, doc_m, DOC_START, lo, f_lo, N_K, head_dim, qk_scale, softcap2, slope2,
                        WINDOW_SIZE, SINK_SIZE, BLOCK_N, EVEN_N, PAD_D, True,
                        IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI)
    dq = _dq_inner_mods(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                        offs_m, offs_d, doc_m, DOC_START, f_lo, f_hi, N_K, head_dim, qk_scale, softcap2, slope2,
                        WINDOW_SIZE, SINK_SIZE, BLOCK_N, EVEN_N, PAD_D, False,
                        IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI)
    dq = _dq_inner_mods(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                        offs_m, offs_d, doc_m, DOC_START, f_hi, hi, N_K, head_dim, qk_scale, softcap2, slope2,
                        WINDOW_SIZE, SINK_SIZE, BLOCK_N, EVEN_N, PAD_D, True,
                        IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI)
    return dq


@triton.jit
def _attn_bwd_dq_mods(
    Q, K, V, DO, LSE, DELTA, DQ, DOC_START, DOC_END, SLOPES,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lseb, stride_lseh,
    stride_deltab, stride_deltah,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    n_q_heads, group_size, N_Q, N_K, head_dim, sm_scale, WINDOW_SIZE, SINK_SIZE, softcap2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr, ACC: tl.constexpr,
):
    """dQ of one query block with lesson 12's modifications: the forward's tile ranges (``_mods_bounds``)."""
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # the last query blocks have the most key tiles: launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // n_q_heads
    q_head = pid_bh % n_q_heads
    kv_head = q_head // group_size
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634

    q = load_tile(Q + b * stride_qb + q_head * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                  offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
    do = load_tile(DO + b * stride_dob + q_head * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                   offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)
    lse = tl.load(LSE + b * stride_lseb + q_head * stride_lseh + offs_m, mask=offs_m < N_Q, other=0.0)
    delta = tl.load(DELTA + b * stride_deltab + q_head * stride_deltah + offs_m, mask=offs_m < N_Q, other=0.0)
    lse2 = lse * 1.4426950408889634
    if HAS_DOCS:
        doc_m = tl.load(DOC_START + offs_m, mask=offs_m < N_Q, other=-1)
    else:
        doc_m = offs_m
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + q_head) * 1.4426950408889634

    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    s_lo, s_flo, s_fhi, s_hi, lo, f_lo, f_hi, hi = _mods_bounds(
        start_m, DOC_START, DOC_END, N_K, WINDOW_SIZE, SINK_SIZE,
        IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, BLOCK_M, BLOCK_N)
    if HAS_SINKS:
        dq = _dq_range_mods(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                            offs_m, offs_d, doc_m, DOC_START, s_lo, s_flo, s_fhi, s_hi, N_K, head_dim, qk_scale,
                            softcap2, slope2, WINDOW_SIZE, SINK_SIZE, BLOCK_N, EVEN_N, PAD_D,
                            IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI)
    dq = _dq_range_mods(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                        offs_m, offs_d, doc_m, DOC_START, lo, f_lo, f_hi, hi, N_K, head_dim, qk_scale,
                        softcap2, slope2, WINDOW_SIZE, SINK_SIZE, BLOCK_N, EVEN_N, PAD_D,
                        IS_CAUSAL, HAS_DOCS, HAS_WINDOW, HAS_SINKS, HAS_SOFTCAP, HAS_ALIBI)
    dq *= sm_scale
    store_tile(DQ + b * stride_dqb + q_head * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
               dq.to(DQ.dtype.element_ty), offs_m, N_Q, offs_d, head_dim, EVEN_M, PAD_D)


# -----------------------------------------------------------------------------
# Launch configuration
# -----------------------------------------------------------------------------
class BackwardConfig:
    """Block sizes, warps and pipeline stages of the two main kernels.

    ``dkdv_block_n`` must be a multiple of ``dkdv_block_m`` and ``dq_block_m``
    of ``dq_block_n`` (the causal loops split at block boundaries).
    ``split_sinks`` (window backward with sinks): the sink keys' far queries get
    programs of their own (:func:`_attn_bwd_dkdv_sinks`); ``False`` runs lesson
    08's kernel alone, whose sink-key program walks every later query block.
    """

    def __init__(self, dkdv_block_m=16, dkdv_block_n=32, dq_block_m=32, dq_block_n=16,
                 dkdv_warps=4, dkdv_stages=1, dq_warps=4, dq_stages=1, pre_block_m=None, split_sinks=True):
        if dkdv_block_n % dkdv_block_m or dq_block_m % dq_block_n:
            raise ValueError("dkdv_block_n must be a multiple of dkdv_block_m, and dq_block_m of dq_block_n")
        for value in (dkdv_block_m, dkdv_block_n, dq_block_m, dq_block_n):
            if value < 16 or value & (value - 1):
                raise ValueError(f"block sizes must be powers of two >= 16 (tl.dot needs 16), got {value}")
        self.dkdv_block_m, self.dkdv_block_n = dkdv_block_m, dkdv_block_n
        self.dq_block_m, self.dq_block_n = dq_block_m, dq_block_n
        self.dkdv_warps, self.dkdv_stages = dkdv_warps, dkdv_stages
        self.dq_warps, self.dq_stages = dq_warps, dq_stages
        self.pre_block_m = pre_block_m or dq_block_m
        self.split_sinks = split_sinks

    def __repr__(self):
        return (f"BackwardConfig(dkdv {self.dkdv_block_m}x{self.dkdv_block_n} w{self.dkdv_warps} s{self.dkdv_stages}, "
                f"dq {self.dq_block_m}x{self.dq_block_n} w{self.dq_warps} s{self.dq_stages})")


def default_config(head_dim: int, device_type: str, capability: tuple[int, int] | None = None,
                   dtype: torch.dtype | None = None, window_size: int | None = None) -> BackwardConfig:
    """Small blocks in the CPU interpreter; blocks tuned for Hopper on a GPU.

    The GPU choice follows the usual FlashAttention-2 split: the dK/dV kernel
    holds two [BLOCK_N, D] fp32 accumulators, so it streams narrow query
    blocks past wide key blocks; the dQ kernel is the mirror image.
    ``window_size`` (lesson 08's kernels; the window's keys, at most the
    sequence's) picks the window backward's measured launch on Hopper.
    """
    if device_type != "cuda":
        return BackwardConfig(32, 64, 64, 32, 4, 1, 4, 1)
    if (window_size is not None and dtype in (torch.float16, torch.bfloat16) and 64 < head_dim <= 128
            and capability is not None and capability >= (9, 0)):
        # Measured on an H200 (benchmarks/tune_window.py --backward, results/tune_window.json: bf16, GQA 32/8,
        # D = 128, N = 16k, with and without 4 sinks): windows up to 1024 keys run fastest with 4-warp
        # tiles half the size of the causal ones (each query block sees few key blocks, and lesson 06's
        # two programs per SM hide the latency); 4096-key windows with the causal tiles and 64-key dQ tiles.
        if window_size <= 1024:
            return BackwardConfig(32, 64, 64, 32, 4, 3, 4, 3)
        return BackwardConfig(64, 128, 128, 64, 8, 3, 8, 3)
    if dtype in (torch.float32, torch.float64):
        # 4- and 8-byte tiles: the 16-bit configurations below would need up to 257 KiB of
        # shared memory at D = 128 in fp32 (measured by compiling for sm_90; H100/H200 allow
        # 227 KiB, an A100 163 KiB, a T4 64 KiB).
        if dtype == torch.float32 and head_dim <= 128 and (capability is None or capability >= (8, 0)):
            return BackwardConfig(32, 64, 64, 32, 4, 2, 4, 2)  # 128 KiB at D = 128
        return BackwardConfig(16, 32, 32, 16, 4, 1, 4, 1)
    if capability is not None and capability < (8, 0):
        # Turing (Colab's T4): 64 KiB of shared memory, no asynchronous copies: one
        # stage and small tiles (checked by compiling for sm_75, kernels/targets.py).
        return BackwardConfig(32, 64, 64, 32, 4, 1, 4, 1) if head_dim <= 64 else BackwardConfig(16, 32, 32, 16, 4, 1, 4, 1)
    if head_dim <= 64:  # not measured for speed: half of D=128's accumulators, so 4 warps
        return BackwardConfig(32, 128, 128, 32, 4, 3, 4, 3)
    if head_dim <= 128:
        # Measured on an H200 (bf16, causal, GQA 32/8, D=128, N = 1k..16k; triton 3.6,
        # 2026-11-30), the best of 10 dK/dV x 8 dQ configurations. 4 warps with
        # BLOCK_N=128 was 2-3x slower: two 128x128 fp32 accumulators do not fit
        # in 128 threads' registers.
        return BackwardConfig(64, 128, 128, 32, 8, 3, 8, 3)
    return BackwardConfig(16, 64, 64, 16, 8, 1, 8, 1)  # D up to 256: small tiles, not tuned


# -----------------------------------------------------------------------------
# The launcher
# -----------------------------------------------------------------------------
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_backward_inputs(q, k, v, o, lse, do):
    """Raise ``ValueError`` (one sentence) unless the tensors fit :func:`attention_backward`."""
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d torch tensor [B, H, N, D]; got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} has dtype {t.dtype}; use float16, bfloat16 or float32 (float64 for gradcheck)")
    B, n_q_heads, N_Q, D = q.shape
    Bk, n_kv_heads, N_K, Dk = k.shape
    if Bk != B or Dk != D or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must be [B, H_kv, N_k, D] with q's B and D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if n_kv_heads == 0 or n_q_heads % n_kv_heads:
        raise ValueError(f"{n_q_heads} query heads cannot be shared evenly among {n_kv_heads} kv heads")
    if tuple(o.shape) != tuple(q.shape) or tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"o and do must have q's shape {tuple(q.shape)}; got {tuple(o.shape)}, {tuple(do.shape)}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, n_q_heads, N_Q):
        raise ValueError(f"lse must be a [B, H_q, N] tensor {(B, n_q_heads, N_Q)}; got {getattr(lse, 'shape', type(lse))}")
    problem = bf16_problem(q.dtype, q.device)
    if problem:
        raise ValueError(problem)
    if not 1 <= D <= 256:
        raise ValueError(f"head dim {D} is not supported (1 to 256)")
    devices = {t.device for t in (q, k, v, o, lse, do)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def attention_backward(q, k, v, o, lse, do, causal=False, sm_scale=None, *, config: BackwardConfig | None = None,
                       window_size=None, sink_size=0, cu_seqlens=None, softcap=None, alibi_slopes=None,
                       sink_logits=None, _validated: bool = False):
    """``(dq, dk, dv)`` of FlashAttention from what the forward saved, in Triton.

    ``q``, ``o``, ``do``: ``[B, H_q, N_q, D]``; ``k``, ``v``: ``[B, H_kv, N_k, D]``
    with ``H_q`` a multiple of ``H_kv`` (GQA; MQA when ``H_kv == 1``);
    ``lse``: ``[B, H_q, N_q]``, the natural-log logsumexp of each row's scaled
    scores, any float dtype. Any strides. ``causal`` is top-left aligned.
    ``sm_scale`` defaults to ``1/sqrt(D)``. The gradients have the inputs'
    dtypes; every sum is accumulated in fp32. float64 inputs (for
    ``torch.autograd.gradcheck`` in the interpreter) are accumulated in
    float64, but the scale and ``log2(e)`` reach the kernels as fp32
    scalars, so they agree with exact gradients to about 1e-7, not 1e-15.
    ``config`` overrides :func:`default_config`. ``window_size`` and
    ``sink_size`` (with ``causal=True``, lesson 08) run the window kernels:
    key ``j`` is visible from query ``i`` iff ``j <= i and (i - j <
    window_size or j < sink_size)``.

    Lesson 12's keywords (``cu_seqlens``, ``softcap``, ``alibi_slopes``,
    ``sink_logits``; semantics in :mod:`course_utils.references`) run the
    kernels of section 5 (:func:`_attn_bwd_dkdv_mods`, :func:`_attn_bwd_dq_mods`),
    with ``lse`` the forward's (the sink logit inside it). The return value is
    ``(dq, dk, dv)`` always; the sink logits' gradient is
    :func:`sink_logits_grad`. With sinks (``sink_size``) the sink keys' far
    queries are not split over programs of their own here (lesson 08's
    ``split_sinks`` applies to the window kernels only).

    ``_validated=True`` (:class:`FlashAttentionFunction`'s backward): the
    forward checked the call and autograd hands back ``do`` with ``o``'s
    shape, dtype and device, so the inputs are not checked again.
    """
    mods = has_mods(cu_seqlens, softcap, alibi_slopes, sink_logits)
    if not _validated:
        check_backward_inputs(q, k, v, o, lse, do)
        validate_window(causal, window_size, sink_size)
        if mods:
            validate_mods(q, cu_seqlens, softcap, alibi_slopes, sink_logits)
    B, n_q_heads, N_Q, D = q.shape
    n_kv_heads, N_K = k.shape[1], k.shape[2]
    group_size = n_q_heads // n_kv_heads
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    capability = _capability(q.device)
    # The window's measured launch is for lesson 08's kernels; lesson 12's (mods) keep the causal tiles.
    cfg = config or default_config(D, "cuda" if capability else q.device.type, capability, q.dtype,
                                   None if window_size is None or mods else min(int(window_size), N_K))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    PAD_D = BLOCK_D != D
    # fp32 statistics and accumulators, except for float64 inputs (gradcheck),
    # which get float64 all the way through.
    acc_torch = torch.float64 if q.dtype == torch.float64 else torch.float32
    ACC = tl.float64 if acc_torch == torch.float64 else tl.float32
    lse = lse.to(acc_torch)

    delta = torch.empty((B, n_q_heads, N_Q), device=q.device, dtype=acc_torch)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    if q.numel() == 0 or k.numel() == 0:  # nothing to launch; no query sees any key
        return dq.zero_(), dk.zero_(), dv.zero_()

    launch_preprocess(o, do, delta, cfg.pre_block_m)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(),
              lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1))
    if mods:
        _mods_backward(q, k, v, lse, delta, do, dq, dk, dv, common, cfg, group_size, sm_scale, BLOCK_D, PAD_D, ACC,
                       causal, window_size, sink_size, cu_seqlens, softcap, alibi_slopes, sink_logits)
        return dq, dk, dv
    if window_size is not None:
        _window_backward(q, k, v, lse, delta, do, dq, dk, dv, common, cfg, group_size, sm_scale,
                         min(int(window_size), N_Q), min(int(sink_size), N_Q), BLOCK_D, PAD_D, ACC)
        return dq, dk, dv
    bm, bn = cfg.dkdv_block_m, cfg.dkdv_block_n
    _attn_bwd_dkdv[(triton.cdiv(N_K, bn), B * n_kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(),
        n_kv_heads, group_size, N_Q, N_K, D, sm_scale,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, CAUSAL=bool(causal),
        EVEN_M=N_Q % bm == 0, EVEN_N=N_K % bn == 0, PAD_D=PAD_D, ACC=ACC,
        num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
    )
    launch_dq(q, k, v, do, lse, delta, dq, causal, sm_scale, cfg)
    return dq, dk, dv


def launch_preprocess(o, do, delta, block_m: int):
    """Step 1 into ``delta`` (``[B, H_q, N_q]``, fp32 or fp64): ``rowsum(dO * O)`` by :func:`attn_bwd_preprocess`."""
    B, n_q_heads, N_Q, D = o.shape
    BLOCK_D = max(16, triton.next_power_of_2(D))
    strides = (*o.stride(), *do.stride(), delta.stride(0), delta.stride(1))
    # every argument in the kernel's order, so that on a GPU the launch is bound once per key (launch.py)
    key = (o.dtype, do.dtype, delta.dtype, strides, n_q_heads, N_Q, D, block_m, aligned(o, do, delta)) if o.is_cuda else None
    _PREPROCESS(key, (triton.cdiv(N_Q, block_m), B * n_q_heads), (
        o, do, delta, *strides, n_q_heads, N_Q, D,
        block_m, BLOCK_D, N_Q % block_m == 0, BLOCK_D != D, tl.float64 if delta.dtype == torch.float64 else tl.float32))


def launch_dq(q, k, v, do, lse, delta, dq, causal, sm_scale, cfg: BackwardConfig, *, window_size=None, sink_size=0):
    """Step 3 into ``dq`` at ``cfg``'s dQ launch (``lse``, ``delta`` in ``delta``'s dtype): :func:`_attn_bwd_dq`,
    or with ``window_size`` (causal, lesson 08) :func:`attn_bwd_dq_window`.

    :mod:`.fast_backward`'s ``"flat"`` mode runs these kernels for ``dQ`` too.
    """
    B, n_q_heads, N_Q, D = q.shape
    n_kv_heads, N_K = k.shape[1], k.shape[2]
    BLOCK_D = max(16, triton.next_power_of_2(D))
    bm, bn = cfg.dq_block_m, cfg.dq_block_n
    args = (q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1), *dq.stride(),
            n_q_heads, n_q_heads // n_kv_heads, N_Q, N_K, D, sm_scale)
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, EVEN_M=N_Q % bm == 0, EVEN_N=N_K % bn == 0,
                  PAD_D=BLOCK_D != D, ACC=tl.float64 if delta.dtype == torch.float64 else tl.float32,
                  num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)
    grid = (triton.cdiv(N_Q, bm), B * n_q_heads)
    if window_size is None:
        _attn_bwd_dq[grid](*args, CAUSAL=bool(causal), **common)
    else:
        attn_bwd_dq_window[grid](*args, window_size, sink_size, HAS_SINKS=sink_size > 0, **common)


def _window_backward(q, k, v, lse, delta, do, dq, dk, dv, common, cfg, group_size, sm_scale,
                     window_size, sink_size, BLOCK_D, PAD_D, ACC):
    """Launch lesson 08's dK/dV and dQ kernels (the window and sinks) into ``dq, dk, dv``."""
    B, n_q_heads, N_Q, D = q.shape
    n_kv_heads, N_K = k.shape[1], k.shape[2]
    if N_Q != N_K:
        raise ValueError(f"a window needs as many queries as keys, but there are {N_Q} queries and {N_K} keys.")
    bm, bn = cfg.dkdv_block_m, cfg.dkdv_block_n
    # With sinks, the program that owns the sink keys would walk every later query block
    # (lesson 08's kernel does): spread that far part over programs of its own instead,
    # and run the window kernel without sinks (it then covers every pair with i - j < W).
    split = cfg.split_sinks and sink_size > 0 and N_Q > window_size
    dkdv_sinks = 0 if split else sink_size
    _attn_bwd_dkdv_window[(triton.cdiv(N_K, bn), B * n_kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(),
        n_kv_heads, group_size, N_Q, N_K, D, sm_scale, window_size, dkdv_sinks,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, HAS_SINKS=dkdv_sinks > 0,
        EVEN_M=N_Q % bm == 0, EVEN_N=N_K % bn == 0, PAD_D=PAD_D, ACC=ACC,
        num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
    )
    if split:
        _sink_far_gradients(q, k, v, lse, delta, do, dk, dv, common, cfg, group_size, sm_scale,
                            window_size, sink_size, BLOCK_D, PAD_D, ACC)
    launch_dq(q, k, v, do, lse, delta, dq, True, sm_scale, cfg, window_size=window_size, sink_size=sink_size)


def _mods_backward(q, k, v, lse, delta, do, dq, dk, dv, common, cfg, group_size, sm_scale, BLOCK_D, PAD_D, ACC,
                   causal, window_size, sink_size, cu_seqlens, softcap, alibi_slopes, sink_logits):
    """Launch lesson 12's dK/dV and dQ kernels (documents, soft-cap, ALiBi; sinks are in lse) into ``dq, dk, dv``."""
    B, n_q_heads, N_Q, D = q.shape
    n_kv_heads, N_K = k.shape[1], k.shape[2]
    if N_Q != N_K:
        raise ValueError(f"these keywords need as many queries as keys, but there are {N_Q} queries and {N_K} keys.")
    pointers, flags = mods_arguments(q, causal, window_size, sink_size, cu_seqlens, softcap, alibi_slopes,
                                     sink_logits)
    scalars = (flags["WINDOW_SIZE"], flags["SINK_SIZE"], flags["softcap2"])
    modes = {name: flags[name] for name in ("IS_CAUSAL", "HAS_DOCS", "HAS_WINDOW", "HAS_SINKS", "HAS_SOFTCAP",
                                            "HAS_ALIBI")}
    docs = (pointers["DOC_START"], pointers["DOC_END"], pointers["SLOPES"])
    bm, bn = cfg.dkdv_block_m, cfg.dkdv_block_n
    _attn_bwd_dkdv_mods[(triton.cdiv(N_K, bn), B * n_kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *docs, *common, *dk.stride(), *dv.stride(),
        n_kv_heads, group_size, N_Q, N_K, D, sm_scale, *scalars,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, **modes,
        EVEN_M=N_Q % bm == 0, EVEN_N=N_K % bn == 0, PAD_D=PAD_D, ACC=ACC,
        num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
    )
    bm, bn = cfg.dq_block_m, cfg.dq_block_n
    _attn_bwd_dq_mods[(triton.cdiv(N_Q, bm), B * n_q_heads)](
        q, k, v, do, lse, delta, dq, *docs, *common, *dq.stride(),
        n_q_heads, group_size, N_Q, N_K, D, sm_scale, *scalars,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, **modes,
        EVEN_M=N_Q % bm == 0, EVEN_N=N_K % bn == 0, PAD_D=PAD_D, ACC=ACC,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
    )


def sink_logits_grad(o, do, lse, sink_logits):
    """The gradient of the sink logits ``[Hq]``: ``sum over batch and queries of -exp(z_h - lse_i) * (dO_i . O_i)``.

    The sink's probability in row ``i`` is ``p_i = exp(z_h - lse_i)`` and its
    value is 0, so ``dL/dz_h = sum_i p_i (0 - delta_i)`` with ``delta_i = dO_i .
    O_i``, the same ``delta`` as every other score's (a small torch reduction,
    float32, in the logits' dtype).
    """
    delta = (do.float() * o.float()).sum(-1)  # [B, Hq, N]
    z = sink_logits.detach().float()[None, :, None]
    return (-torch.exp(z - lse.float()) * delta).sum(dim=(0, 2)).to(sink_logits.dtype)


def _sink_chunks(rows: int, block_m: int, programs_per_chunk: int, device: torch.device) -> int:
    """How many query chunks :func:`_attn_bwd_dkdv_sinks` spreads ``rows`` far rows over.

    On a GPU: enough programs to give every SM about four; in the interpreter three (each
    program costs the same there, and three still tests the adding up of partials)."""
    tiles = triton.cdiv(rows, block_m)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(tiles, triton.cdiv(4 * sms, programs_per_chunk)))
    return max(1, min(tiles, 3))


def _sink_far_gradients(q, k, v, lse, delta, do, dk, dv, common, cfg, group_size, sm_scale,
                        window_size, sink_size, BLOCK_D, PAD_D, ACC):
    """Add the sink keys' dK, dV from the queries beyond their window (``i - j >= window_size``)."""
    B, n_kv_heads, N_Q = q.shape[0], k.shape[1], q.shape[2]
    bm = cfg.dkdv_block_m
    block_s = min(64, max(16, triton.next_power_of_2(sink_size)))
    sink_blocks = triton.cdiv(sink_size, block_s)
    rows = N_Q - window_size // bm * bm
    chunks = _sink_chunks(rows, bm, sink_blocks * B * n_kv_heads, q.device)
    chunk = bm * triton.cdiv(triton.cdiv(rows, bm), chunks)
    chunks = triton.cdiv(rows, chunk)
    acc_torch = torch.float64 if ACC == tl.float64 else torch.float32
    shape = (chunks, B * n_kv_heads, sink_blocks * block_s, BLOCK_D)
    dk_part = torch.empty(shape, device=q.device, dtype=acc_torch)
    dv_part = torch.empty(shape, device=q.device, dtype=acc_torch)
    _attn_bwd_dkdv_sinks[(chunks, sink_blocks, B * n_kv_heads)](
        q, k, v, do, lse, delta, dk_part, dv_part, *common,
        n_kv_heads, group_size, N_Q, q.shape[3], sm_scale, window_size, sink_size, chunk,
        BLOCK_M=bm, BLOCK_S=block_s, BLOCK_D=BLOCK_D, PAD_D=PAD_D, ACC=ACC,
        num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
    )
    _add_sink_partials[(sink_blocks, B * n_kv_heads)](
        dk_part, dv_part, dk, dv, *dk.stride(), *dv.stride(),
        n_kv_heads, sink_size, q.shape[3], chunks, sink_blocks * block_s,
        BLOCK_S=block_s, BLOCK_D=BLOCK_D, ACC=ACC, num_warps=4, num_stages=1,
    )


# -----------------------------------------------------------------------------
# torch.autograd wiring
# -----------------------------------------------------------------------------
class FlashAttentionFunction(torch.autograd.Function):
    """FlashAttention with a Triton forward AND a Triton backward.

    The forward saves only ``q, k, v, o`` and the per-row ``lse`` (O(N) extra
    memory), not the ``N x N`` probabilities: the backward recomputes them
    tile by tile from ``q``, ``k`` and ``lse``. Positional arguments after
    ``validated`` are lesson 12's (``cu_seqlens, softcap, alibi_slopes,
    sink_logits``); ``sink_logits`` gets a gradient (:func:`sink_logits_grad`).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False, window_size=None, sink_size=0, validated=False,
                cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None):
        mods = dict(cu_seqlens=cu_seqlens, softcap=softcap, alibi_slopes=alibi_slopes, sink_logits=sink_logits)
        if not validated:  # a direct caller; course_utils.kernels.flash_attention has checked already
            check_call(q, k, v, causal, window_size, sink_size, **mods)
        o, lse = launch_forward(q, k, v, bool(causal), window_size, sink_size, **mods)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, alibi_slopes, sink_logits)
        ctx.causal = bool(causal)
        ctx.window = (window_size, sink_size)
        ctx.softcap = softcap
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_seqlens, alibi_slopes, sink_logits = ctx.saved_tensors
        window_size, sink_size = ctx.window
        dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal=ctx.causal,
                                        window_size=window_size, sink_size=sink_size, cu_seqlens=cu_seqlens,
                                        softcap=ctx.softcap, alibi_slopes=alibi_slopes, sink_logits=sink_logits,
                                        _validated=True)
        d_sink = None
        if sink_logits is not None and ctx.needs_input_grad[10]:
            d_sink = sink_logits_grad(o, do, lse, sink_logits)
        return dq, dk, dv, None, None, None, None, None, None, None, d_sink


def flash_attention_differentiable(q, k, v, causal=False):
    """``o = FlashAttention(q, k, v)`` that ``torch.autograd`` can differentiate.

    ``q [B, H_q, N, D]``, ``k``/``v [B, H_kv, N, D]``; see
    :func:`attention_backward` for what is supported.
    """
    return FlashAttentionFunction.apply(q, k, v, causal)
