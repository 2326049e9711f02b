"""The course's fastest forward kernel: FlashAttention-2 tuned for Hopper.

Lesson 05 builds a causal GQA forward kernel that is *correct*; this module is
the same algorithm with the changes lesson 06 measures one at a time:

1. **Two-phase causal loop** (``MODE`` 1 then 2). Key blocks strictly left of
   the diagonal need no mask; only the diagonal block pays for ``tl.where``.
2. **exp2 with the scale folded in.** ``exp(x) = exp2(x * log2(e))``, and the
   hardware has an ``exp2`` instruction. Multiplying ``sm_scale * log2(e)``
   into one constant lets the compiler fuse scale and max-subtraction into a
   single FMA per score.
3. **Tensor descriptors (TMA).** On Hopper the *tensor memory accelerator*
   copies a whole tile from global to shared memory with one instruction and
   no address arithmetic in the threads; the compiler pipelines these copies
   ``num_stages`` deep. We pass host-side ``TensorDescriptor`` objects (no
   allocator needed); ``tl.make_tensor_descriptor`` inside the kernel would do
   the same job but needs ``triton.set_allocator`` for its scratch memory.
4. **Two programs per SM.** ``128 x 64`` tiles on one warpgroup (4 warps)
   with 2 pipeline stages need 96 KiB of shared memory, so two programs fit
   on one SM (228 KiB). The warp schedulers then interleave them: while one
   program computes its softmax, the other's matrix products keep the tensor
   cores busy. That is a hardware-scheduled version of FlashAttention-3's
   "ping-pong" of two warpgroups, and it was the largest single gain here.
5. **Launch order.** With a causal mask the last query block does
   ``N / BLOCK_N`` iterations, the first only one. ``ORDER_KV_GROUPED``
   puts the query heads of one GQA group next to each other in the grid
   (they read the *same* K/V tiles, so those are still in L2 for the
   neighbours), then the query blocks longest-first, so every SM starts on
   long work and short blocks fill the tail. ``ORDER_LONGEST_FIRST`` (all
   heads side by side) and ``ORDER_M_MAJOR`` (lesson 05's order) are the
   steps of lesson 06's ladder that led there.
6. **Autotuning** over ``BLOCK_M``/``BLOCK_N``/``num_warps``/``num_stages``,
   the launch order, and warp specialisation (a producer warp feeding the TMA
   copies to two consumer warpgroups), keyed on ``(N, D, causal)`` (and the
   dtype, which the autotuner adds), with configurations that cannot work
   pruned before anything is compiled.

Three ideas that were measured and *not* adopted stay as options of
:func:`launch` for the lesson's ladder: ``lazy_rescale`` (skip most
rescales of the accumulator), ``pipeline_qk`` (issue the next block's
``Q K^T`` before this block's softmax, FlashAttention-3's intra-warpgroup
overlap written by hand) and ``exp_poly`` (half of each tile's exponentials
as a cubic on the FMA units, FlashAttention-4's trick). All three lost on an
H200 (results/NOTES.md).

Two forms compile for sm_90 with Triton 3.6 and are options too:
``warp_specialize`` on 4 warps (a producer partition and two 64-row
consumer warpgroups, FlashAttention-3's split) and ``persistent``
(:func:`launch_persistent`: one program per SM walks the tiles). Both run
:func:`_attn_fwd_tile`, the body of the one-tile kernel. The specialised
ones deadlock on the H200 (results/ws_smoke_h200.txt), so
:func:`refuse_specialised_on_gpu` refuses them on a GPU; the interpreter
runs them.

Public API (the lead routes :func:`course_utils.kernels.flash_attention` here
on capable GPUs):

- :func:`is_supported` says whether the fast path can run these tensors;
- :func:`attention_forward_fast` returns ``(o, lse)`` and falls back to the
  course's lesson-05 kernel (``course_utils.kernels.forward``) otherwise;
- :func:`attention_forward_tuned` is its fast path alone, for callers that
  asked :func:`is_supported` already (the package's dispatch).

Limits, on purpose (each falls back cleanly): NVIDIA compute capability 9.x
(Hopper: H100/H200, where it was measured), bf16/fp16, head dim 64 or 128, ``N`` a multiple of 64, equal
query and key lengths, and no Triton interpreter (the interpreter can still
run :func:`launch` with a fixed configuration, which the tests do).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .forward import _capability

try:  # Host-side TMA descriptors (Triton >= 3.3).
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old Triton: the fast path is off
    TensorDescriptor = None

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts a log2-domain logsumexp back to natural log

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128)
SEQ_MULTIPLE = 64  # N must be a multiple of this: no ragged tiles, so no bounds masks

# Orders of the grid (see ``_program_tile``).
ORDER_M_MAJOR = 0  # like lesson 05: query blocks fastest, in ascending order
ORDER_LONGEST_FIRST = 1  # heads fastest, query blocks longest-row-first
ORDER_KV_GROUPED = 2  # the query heads of one kv head fastest, then query blocks longest-first


def grid_shape(order: int, batch: int, n_q_heads: int, n_kv_heads: int, n_m: int) -> tuple[int, int]:
    """The launch grid for one of the orders above (``n_m`` query blocks per head)."""
    if order == ORDER_KV_GROUPED:
        return (n_q_heads // n_kv_heads * n_m, batch * n_kv_heads)
    if order == ORDER_LONGEST_FIRST:
        return (batch * n_q_heads, n_m)
    return (n_m, batch * n_q_heads)


# --------------------------------------------------------------------------- #
# The kernel
# --------------------------------------------------------------------------- #
@triton.jit
def _tile_at(pid0, pid1, num0, num1, N_Q_HEADS, ORDER: tl.constexpr, CAUSAL: tl.constexpr,
             GROUP_SIZE: tl.constexpr):
    """Which (batch*head, query block) grid position ``(pid0, pid1)`` of a ``num0 x num1`` grid computes."""
    if ORDER == 2:
        # pid0 = member of the GQA group (fastest), then query block;
        # pid1 = (batch, kv_head). Neighbours read the same K/V tiles.
        n_m = num0 // GROUP_SIZE
        start_m = pid0 // GROUP_SIZE
        if CAUSAL:
            start_m = n_m - 1 - start_m  # longest rows first
        n_kv_heads = N_Q_HEADS // GROUP_SIZE
        batch = pid1 // n_kv_heads
        q_head = (pid1 % n_kv_heads) * GROUP_SIZE + pid0 % GROUP_SIZE
        bh = batch * N_Q_HEADS + q_head
    elif ORDER == 1:
        bh = pid0
        start_m = pid1
        if CAUSAL:
            # Reverse: the first programs launched get the last (longest) rows.
            start_m = num1 - 1 - start_m
    else:
        start_m = pid0
        bh = pid1
    return bh, start_m


@triton.jit
def _program_tile(N_CTX, N_Q_HEADS, BLOCK_M: tl.constexpr, ORDER: tl.constexpr, CAUSAL: tl.constexpr,
                  GROUP_SIZE: tl.constexpr):
    """Which (batch*head, query block) this program computes (its place in the grid of :func:`grid_shape`)."""
    return _tile_at(tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1), N_Q_HEADS, ORDER,
                    CAUSAL, GROUP_SIZE)


@triton.jit
def _load_k_transposed(desc_k, K, row, offs_n, offs_d, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """The K^T tile ``[HEAD_DIM, BLOCK_N]`` whose first key is 2-D row ``row``.

    With TMA we copy K's rows and transpose the *view*: free, because the
    tensor cores read the shared-memory tile in either order.
    """
    if USE_TMA:
        k = desc_k.load([row, 0]).T
    else:
        k = tl.load(K + (row + offs_n)[None, :].to(tl.int64) * HEAD_DIM + offs_d[:, None])
    return k


@triton.jit
def _load_v(desc_v, V, row, offs_n, offs_d, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """The V tile ``[BLOCK_N, HEAD_DIM]`` whose first key is 2-D row ``row``."""
    if USE_TMA:
        v = desc_v.load([row, 0])
    else:
        v = tl.load(V + (row + offs_n)[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :])
    return v


@triton.jit
def _exp(x, EXP2: tl.constexpr):
    """``exp2(x)`` (one MUFU.EX2 instruction) or, for the ladder's baseline, ``exp(x)``."""
    if EXP2:
        y = tl.math.exp2(x)
    else:
        y = tl.exp(x)
    return y


# 2**f on [-1/2, 1/2]: a cubic fitted in float64 for the least largest relative error (7.5e-5;
# tests/test_kernels_fast.py checks it), coefficients from the highest power down (Horner's rule).
EXP2_POLY = (0.05517085283669129, 0.242609395726861, 0.6932609592652593, 0.9999281822191615)
_P3, _P2, _P1, _P0 = (tl.constexpr(c) for c in EXP2_POLY)


@triton.jit
def _exp2_poly(x):
    """``exp2(x)`` on the FMA and integer units, not the special-function unit (FlashAttention-4's trick).

    ``x = j + f`` with ``j`` the nearest integer and ``|f| <= 1/2``: adding ``1.5 * 2**23`` rounds ``x``
    to an integer held in the low bits of the sum; ``2**f`` is a cubic; ``2**j`` goes into the result's
    exponent bits by an integer add. ``x`` at or below -126 gives (almost) 0, as ``exp2`` underflows.
    """
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0  # 1.5 * 2**23: round to the nearest integer, j in t's low mantissa bits
    f = x - (t - 12582912.0)
    p = f * _P3 + _P2
    p = p * f + _P1
    p = p * f + _P0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)  # the high bits shift out
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp_scores(x, EXP2: tl.constexpr):
    """``_exp`` of a score tile; ``EXP2 == 2``: half of its columns through :func:`_exp2_poly`.

    The special-function unit does 16 exponentials per clock per SM, the FMA units 128 operations, so
    moving half the exponentials to a cubic (about 8 operations) should balance the two. The split takes
    each thread's neighbouring pair of columns apart (the tensor-core layout keeps pairs together).
    Measured slower on an H200: the special-function unit was not the limit (results/NOTES.md).
    """
    if EXP2 == 2:
        a, b = x.reshape([x.shape[0], x.shape[1] // 2, 2]).split()
        y = tl.join(tl.math.exp2(a), _exp2_poly(b)).reshape([x.shape[0], x.shape[1]])
    else:
        y = _exp(x, EXP2)
    return y


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,
    desc_k, desc_v, K, V,
    kv_row0, start_m, qk_scale, N_CTX,
    offs_m, offs_n, offs_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MODE: tl.constexpr, USE_TMA: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, EXP2: tl.constexpr,
):
    """Online softmax over one range of key blocks.

    ``MODE`` 0: every key (non-causal). ``MODE`` 1: the key blocks strictly
    left of this query block's diagonal (no mask needed). ``MODE`` 2: the key
    blocks on the diagonal, where the causal mask is applied. ``MODE`` 3
    (the one-loop causal baseline of the tuning ladder): every block up to
    the diagonal, all of them masked.
    With ``EXP2`` scores live in the log2 domain: ``qk * qk_scale`` with
    ``qk_scale = sm_scale * log2(e)``, so ``exp2`` gives ``exp(sm_scale * qk)``.
    Without it (ladder baseline) ``qk_scale = sm_scale`` and we call ``exp``.
    """
    if MODE == 0:
        lo, hi = 0, N_CTX
    elif MODE == 1:
        lo, hi = 0, start_m * BLOCK_M
    elif MODE == 2:
        lo, hi = start_m * BLOCK_M, (start_m + 1) * BLOCK_M
        lo = tl.multiple_of(lo, BLOCK_M)
    else:
        lo, hi = 0, (start_m + 1) * BLOCK_M
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_k_transposed(desc_k, K, kv_row0 + start_n, offs_n, offs_d, HEAD_DIM, USE_TMA)
        qk = tl.dot(q, k)
        if MODE >= 2:
            # Causal mask, added in the log2 domain: a large negative number
            # rather than -inf, so that max - max never makes a NaN.
            keep = offs_m[:, None] >= (start_n + offs_n[None, :])
            qk = qk * qk_scale + tl.where(keep, 0.0, -1.0e6)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        elif LAZY_RESCALE:
            # Keep the old (stale) max unless some row's max grew by more than
            # 8 (log2 units): p = exp2(s - m) <= 2^8 is harmless in fp32 and
            # bf16, and the result is exact either way because l_i uses the
            # same max. The [BLOCK_M, D] rescale of acc is then skipped on
            # almost every iteration.
            m_blk = tl.max(qk, 1) * qk_scale
            if tl.max(m_blk - m_i, 0) > 8.0:
                m_new = tl.maximum(m_i, m_blk)
                alpha = _exp(m_i - m_new, EXP2)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = _exp(qk * qk_scale - m_i[:, None], EXP2)
            v = _load_v(desc_v, V, kv_row0 + start_n, offs_n, offs_d, HEAD_DIM, USE_TMA)
            l_i = l_i + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            qk, m_new = _shift_unmasked(qk, m_i, qk_scale)
        if MODE >= 2 or not LAZY_RESCALE:
            acc, l_i, m_i = _online_update(acc, l_i, m_i, qk, m_new, desc_v, V, kv_row0 + start_n,
                                           offs_n, offs_d, HEAD_DIM, USE_TMA, EXP2)
    return acc, l_i, m_i


@triton.jit
def _shift_unmasked(qk, m_i, qk_scale):
    """Scores of an unmasked block, scaled and shifted by the new running max: ``(qk, m_new)``.

    Scale after the max (one multiply per row, not per score), then
    scale-and-subtract in a single FMA per score.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    return qk * qk_scale - m_new[:, None], m_new


@triton.jit
def _online_update(acc, l_i, m_i, qk, m_new, desc_v, V, v_row, offs_n, offs_d,
                   HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr, EXP2: tl.constexpr):
    """Fold one key block into ``(acc, l_i, m_i)``; ``qk`` is already shifted by ``m_new``."""
    p = _exp_scores(qk, EXP2)
    alpha = _exp(m_i - m_new, EXP2)  # 1 where the max did not move
    l_ij = tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _load_v(desc_v, V, v_row, offs_n, offs_d, HEAD_DIM, USE_TMA)
    acc = tl.dot(p.to(v.dtype), v, acc)
    # Updating l_i and m_i last keeps fewer values alive across the dots.
    l_i = l_i * alpha + l_ij
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_inner_pipelined(
    acc, l_i, m_i, q,
    desc_k, desc_v, K, V,
    kv_row0, lo, hi, qk_scale,
    offs_n, offs_d,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr, EXP2: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """The unmasked loop of :func:`_attn_fwd_inner`, software-pipelined by hand.

    In the plain loop the tensor cores wait while the warps compute block
    ``j``'s softmax (exp2, max, sum), and the warps wait while the tensor cores
    compute ``Q K_j^T``. Here iteration ``j`` first *issues* ``Q K_{j+1}^T``,
    then does block ``j``'s softmax and ``P_j V_j``: on Hopper the matmul runs
    asynchronously, so the two overlap. The price is a second score tile kept
    alive in registers. Key blocks ``[lo, hi)``; nothing happens when the
    range is empty (the first query block's phase 1).
    """
    if hi > lo:
        k = _load_k_transposed(desc_k, K, kv_row0 + lo, offs_n, offs_d, HEAD_DIM, USE_TMA)
        qk = tl.dot(q, k)
        for start_n in tl.range(lo + BLOCK_N, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            k = _load_k_transposed(desc_k, K, kv_row0 + start_n, offs_n, offs_d, HEAD_DIM, USE_TMA)
            qk_next = tl.dot(q, k)  # next block's scores, in flight during this block's softmax
            qk, m_new = _shift_unmasked(qk, m_i, qk_scale)
            acc, l_i, m_i = _online_update(acc, l_i, m_i, qk, m_new, desc_v, V, kv_row0 + start_n - BLOCK_N,
                                           offs_n, offs_d, HEAD_DIM, USE_TMA, EXP2)
            qk = qk_next
        qk, m_new = _shift_unmasked(qk, m_i, qk_scale)
        acc, l_i, m_i = _online_update(acc, l_i, m_i, qk, m_new, desc_v, V, kv_row0 + hi - BLOCK_N,
                                       offs_n, offs_d, HEAD_DIM, USE_TMA, EXP2)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_tile(
    bh, start_m,
    Q, K, V, O, Lse,
    desc_q, desc_k, desc_v, desc_o,
    sm_scale, N_CTX, N_Q_HEADS,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    ORDER: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    TWO_PHASE: tl.constexpr,
    EXP2: tl.constexpr,
    PIPELINE_QK: tl.constexpr,
    O_BY_POINTER: tl.constexpr,
):
    """Query block ``start_m`` of (batch, query head) ``bh``: the online softmax over its key blocks, then
    ``O`` and ``lse`` stored (the body of :func:`_attn_fwd_fast_kernel` and of each step of
    :func:`_attn_fwd_persistent_kernel`)."""
    batch = bh // N_Q_HEADS
    q_head = bh % N_Q_HEADS
    kv_head = q_head // GROUP_SIZE
    n_kv_heads = N_Q_HEADS // GROUP_SIZE

    q_row0 = bh * N_CTX + start_m * BLOCK_M  # first row of this Q/O tile
    kv_row0 = (batch * n_kv_heads + kv_head) * N_CTX  # row 0 of this K/V head

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if EXP2:
        qk_scale = sm_scale * 1.4426950408889634  # fold log2(e) into the scale
    else:
        qk_scale = sm_scale

    if USE_TMA:
        q = desc_q.load([q_row0, 0])
    else:
        q_rows = (q_row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * HEAD_DIM + offs_d[None, :])

    if CAUSAL and TWO_PHASE and PIPELINE_QK:
        acc, l_i, m_i = _attn_fwd_inner_pipelined(
            acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, 0, start_m * BLOCK_M, qk_scale,
            offs_n, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, EXP2, WARP_SPECIALIZE,
        )
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, start_m, qk_scale, N_CTX,
            offs_m, offs_n, offs_d, BLOCK_M, BLOCK_N, HEAD_DIM,
            2, USE_TMA, False, False, EXP2,
        )
    elif CAUSAL and TWO_PHASE:
        # Phase 1: full blocks left of the diagonal, no mask.
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, start_m, qk_scale, N_CTX,
            offs_m, offs_n, offs_d, BLOCK_M, BLOCK_N, HEAD_DIM,
            1, USE_TMA, LAZY_RESCALE, WARP_SPECIALIZE, EXP2,
        )
        # Phase 2: the diagonal block(s), masked.
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, start_m, qk_scale, N_CTX,
            offs_m, offs_n, offs_d, BLOCK_M, BLOCK_N, HEAD_DIM,
            2, USE_TMA, False, False, EXP2,
        )
    elif CAUSAL:
        # One loop, every block masked (the ladder's baseline).
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, start_m, qk_scale, N_CTX,
            offs_m, offs_n, offs_d, BLOCK_M, BLOCK_N, HEAD_DIM,
            3, USE_TMA, False, WARP_SPECIALIZE, EXP2,
        )
    elif PIPELINE_QK:
        acc, l_i, m_i = _attn_fwd_inner_pipelined(
            acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, 0, N_CTX, qk_scale,
            offs_n, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, EXP2, WARP_SPECIALIZE,
        )
    else:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, desc_k, desc_v, K, V, kv_row0, start_m, qk_scale, N_CTX,
            offs_m, offs_n, offs_d, BLOCK_M, BLOCK_N, HEAD_DIM,
            0, USE_TMA, LAZY_RESCALE, WARP_SPECIALIZE, EXP2,
        )

    # Epilogue: normalise, and store lse in natural log.
    if EXP2:
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 units -> natural log
    else:
        lse = m_i + tl.log(l_i)
    tl.store(Lse + bh * N_CTX + offs_m, lse)
    out = (acc / l_i[:, None]).to(q.dtype)
    if USE_TMA and not O_BY_POINTER:
        desc_o.store([q_row0, 0], out)
    else:
        o_rows = (q_row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        tl.store(O + o_rows[:, None] * HEAD_DIM + offs_d[None, :], out)


@triton.jit
def _attn_fwd_fast_kernel(
    Q, K, V, O, Lse,
    desc_q, desc_k, desc_v, desc_o,
    sm_scale, N_CTX, N_Q_HEADS,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    ORDER: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    TWO_PHASE: tl.constexpr,
    EXP2: tl.constexpr,
    PIPELINE_QK: tl.constexpr,
    O_BY_POINTER: tl.constexpr = False,
):
    """One program: one query block of one (batch, query head).

    Tensors are contiguous ``[B, H, N, D]``, viewed as 2-D ``[B*H*N, D]``
    matrices (that is what the descriptors describe). ``N_CTX`` is a multiple
    of ``BLOCK_M`` and ``BLOCK_N`` (the wrapper guarantees it), so no tile
    crosses from one head into the next and no bounds masks are needed.
    ``O_BY_POINTER`` stores the output tile by pointers even with TMA: Triton
    3.6's warp-specialisation pass refuses the descriptor store of a 4-warp
    program (see :func:`launch`).
    """
    if CAUSAL:
        tl.static_assert(BLOCK_M % BLOCK_N == 0)
    bh, start_m = _program_tile(N_CTX, N_Q_HEADS, BLOCK_M, ORDER, CAUSAL, GROUP_SIZE)
    _attn_fwd_tile(bh, start_m, Q, K, V, O, Lse, desc_q, desc_k, desc_v, desc_o, sm_scale, N_CTX, N_Q_HEADS,
                   GROUP_SIZE, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, USE_TMA, ORDER, LAZY_RESCALE, WARP_SPECIALIZE,
                   TWO_PHASE, EXP2, PIPELINE_QK, O_BY_POINTER)


@triton.jit
def _attn_fwd_persistent_kernel(
    Q, K, V, O, Lse,
    desc_q, desc_k, desc_v, desc_o,
    sm_scale, N_CTX, N_Q_HEADS, GRID0, GRID1,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ORDER: tl.constexpr,
    TWO_PHASE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Persistent: each program walks the tiles ``program_id, program_id + programs, ...`` of the ``GRID0 x
    GRID1`` grid :func:`grid_shape` gives (in its order: a GQA group's heads side by side, longest rows first),
    each as one program of :func:`_attn_fwd_fast_kernel` would (TMA loads, the output by pointers).

    ``WARP_SPECIALIZE`` specialises this tile loop, not the key loop inside it, as FlashAttention-3 does: the
    producer partition can load the next tile's ``Q`` and first K/V tiles while the consumers finish the last
    tile's epilogue.
    """
    if CAUSAL:
        tl.static_assert(BLOCK_M % BLOCK_N == 0)
    for t in tl.range(tl.program_id(0), GRID0 * GRID1, tl.num_programs(0), warp_specialize=WARP_SPECIALIZE):
        bh, start_m = _tile_at(t % GRID0, t // GRID0, GRID0, GRID1, N_Q_HEADS, ORDER, CAUSAL, GROUP_SIZE)
        _attn_fwd_tile(bh, start_m, Q, K, V, O, Lse, desc_q, desc_k, desc_v, desc_o, sm_scale, N_CTX, N_Q_HEADS,
                       GROUP_SIZE, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, True, ORDER, False, False,
                       TWO_PHASE, True, False, True)


# --------------------------------------------------------------------------- #
# Autotuning: the search space, and the pruning that keeps it small
# --------------------------------------------------------------------------- #
def _set_block_shapes(nargs):
    """Pre-hook: give the host descriptors the tile shapes of the config being run.

    A TMA descriptor encodes the box it copies, so it must match ``BLOCK_M``
    and ``BLOCK_N``; the autotuner calls this before every launch it times.
    """
    if TensorDescriptor is None or not isinstance(nargs.get("desc_q"), TensorDescriptor):
        return
    block_m, block_n, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    nargs["desc_q"].block_shape = [block_m, d]
    nargs["desc_o"].block_shape = [block_m, d]
    nargs["desc_k"].block_shape = [block_n, d]
    nargs["desc_v"].block_shape = [block_n, d]


# The search space: (BLOCK_M, BLOCK_N, num_warps, num_stages, ORDER, WARP_SPECIALIZE).
# A short list on purpose: every entry costs a compile (about a second) per
# (D, causal, dtype, group size) on first use, and a timing per N.
# ``benchmarks/tune_fast.py`` times a wider set side by side; its results on an
# H200 chose these (results/NOTES.md).
CONFIG_SPACE = [
    # 128 x 64 on one warpgroup with 2 stages needs 96 KiB of shared memory, so
    # *two* programs share an SM and the scheduler interleaves them: one's
    # softmax runs while the other's matrix products hold the tensor cores.
    (128, 64, 4, 2, ORDER_KV_GROUPED, False),
    (128, 64, 4, 2, ORDER_M_MAJOR, False),
    (128, 64, 4, 3, ORDER_KV_GROUPED, False),
    (128, 128, 8, 2, ORDER_KV_GROUPED, False),
    (128, 128, 8, 3, ORDER_KV_GROUPED, False),
    (128, 128, 8, 3, ORDER_M_MAJOR, False),
    (128, 128, 4, 2, ORDER_KV_GROUPED, False),  # D <= 64 only (see config_ok)
    (64, 64, 4, 3, ORDER_KV_GROUPED, False),
    (64, 64, 4, 3, ORDER_M_MAJOR, False),
]
# Warp specialisation: Triton splits the loop into a producer warp issuing the
# TMA copies and consumer warpgroups doing the dots and the softmax. The
# autotuner offers it on 8-warp configs only, where Triton 3.6 compiles it to
# the same kernel. On 4 warps it needs the output stored by pointers and, causal,
# one loop (launch(): FlashAttention-3's producer and two 64-row consumers);
# that form is timed by benchmarks/tune_fast.py before it may join the space.
WS_SPACE = [
    (128, 128, 8, 3, ORDER_KV_GROUPED, True),
]


def make_configs(space=CONFIG_SPACE):
    """``triton.Config`` objects for the autotuner from the tuples of a search space."""
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "ORDER": order, "WARP_SPECIALIZE": ws},
            num_warps=w,
            num_stages=s,
            pre_hook=_set_block_shapes,
        )
        for bm, bn, w, s, order, ws in space
    ]


def config_ok(block_m: int, block_n: int, num_warps: int, n_ctx: int, head_dim: int, causal: bool,
              warp_specialize: bool = False) -> bool:
    """Whether one configuration can run (and is worth timing) for this problem.

    - both tiles must divide ``N`` (no ragged tiles: the kernel has no bounds masks);
    - causal needs ``BLOCK_M`` to be a multiple of ``BLOCK_N`` (the diagonal
      phase walks whole key blocks inside one query block);
    - a ``128 x 128`` score tile on only 4 warps next to a ``128 x 128``
      accumulator (D = 128) needs more than the 255 registers a thread may
      have, so it would spill: skip it;
    - on Hopper one warpgroup (4 warps) already owns a 64-row wgmma tile; 8
      warps only paid off here when the tile is at least ``128 x 128``;
    - the autotuner's warp-specialised configs have 8 warps (the 4-warp form,
      :func:`launch`'s, is not in the space until it is measured).
    """
    if n_ctx % block_m or n_ctx % block_n:
        return False
    if causal and block_m % block_n:
        return False
    if num_warps == 4 and block_m * block_n >= 128 * 128 and head_dim >= 128:
        return False
    if num_warps == 8 and block_m * block_n < 128 * 128:
        return False
    if warp_specialize and num_warps != 8:
        return False
    return True


def prune_configs(configs, named_args, **kwargs):
    """``early_config_prune`` hook: drop configs :func:`config_ok` rejects."""
    args = {**named_args, **kwargs}
    n_ctx, head_dim, causal = int(args["N_CTX"]), int(args["HEAD_DIM"]), bool(args["CAUSAL"])
    kept = [
        c for c in configs
        if config_ok(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, n_ctx, head_dim, causal,
                     bool(c.kwargs.get("WARP_SPECIALIZE")))
    ]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def _autotuned(configs):
    return triton.autotune(
        configs=configs,
        # The autotuner appends the tensors' dtypes to the key.
        key=["N_CTX", "HEAD_DIM", "CAUSAL", "LAZY_RESCALE"],
        prune_configs_by={"early_config_prune": prune_configs},
    )(_attn_fwd_fast_kernel)


_tuned_kernel = _autotuned(make_configs())
# The same space plus the warp-specialised configs; tried first. If the
# compiler rejects them (for causal or non-causal), that flag stops using them.
_tuned_kernel_ws = _autotuned(make_configs(WS_SPACE + CONFIG_SPACE))
# COURSE_FAST_WS=0 in the environment switches warp specialisation off,
# COURSE_FAST_WS=noncausal keeps it for the non-causal kernel only.
_WS_ENV = os.environ.get("COURSE_FAST_WS", "1")
_WS_STATE = {"enabled": {True: _WS_ENV not in ("0", "noncausal"), False: _WS_ENV != "0"}, "error": {}}
_TUNE_STATE = {"error": None}
# What runs if autotuning itself fails: a configuration that fits every case.
SAFE_CONFIG = dict(block_m=64, block_n=64, num_warps=4, num_stages=3)


# --------------------------------------------------------------------------- #
# Python side
# --------------------------------------------------------------------------- #
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unsupported_reason(q, k, v) -> str | None:
    """Why the fast path cannot take these tensors, or ``None`` if it can.

    Shapes and dtypes are checked first (they do not depend on the machine),
    then the machine: a CUDA GPU with TMA, and no interpreter.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "inputs must be torch tensors"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "tensors must be [B, H, N, D]"
    b, hq, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        return "k and v must be [B, H_kv, N, D] with q's B, N and D"
    if k.shape[1] == 0 or hq % k.shape[1]:
        return "the number of query heads must be a multiple of the kv heads"
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}: the fast kernel takes bf16 or fp16"
    if d not in SUPPORTED_HEAD_DIMS:
        return f"head dim {d}: the fast kernel takes {SUPPORTED_HEAD_DIMS}"
    if n == 0 or n % SEQ_MULTIPLE:
        return f"N = {n}: the fast kernel needs a multiple of {SEQ_MULTIPLE}"
    if b * hq * n >= 2**31:
        return "too many rows for 32-bit tile coordinates"
    if TensorDescriptor is None:
        return "this Triton has no host tensor descriptors"
    if _interpreting():
        return "the Triton interpreter is on (no GPU): autotuning and TMA need a GPU"
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "inputs are not on a CUDA GPU"
    major, minor = _capability(q.device)
    if major != 9:
        return f"compute capability {major}.{minor}: the fast kernel is built and measured for Hopper (9.x) only"
    return None


def is_supported(q, k, v) -> bool:
    """True when :func:`attention_forward_fast` will run the fast kernel on these tensors."""
    try:
        return unsupported_reason(q, k, v) is None
    except Exception:  # e.g. no CUDA driver at all
        return False


def _descriptors(q, k, v, o, block_m: int, block_n: int):
    """Host TMA descriptors over the 2-D ``[B*H*N, D]`` views."""
    d = q.shape[-1]

    def desc(t, rows):
        return TensorDescriptor(t, shape=[t.numel() // d, d], strides=[d, 1], block_shape=[rows, d])

    return desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(o, block_m)


# Measured on the H200 (twenty-seventh session, benchmarks/ws_smoke.py, results/ws_smoke_h200.txt): every
# one-warpgroup warp-specialised kernel of the course (forward, persistent, window, FP8, the flat backward)
# compiles with Triton 3.6 in about 2 s into 12 warps and then never finishes: a deadlock on the GPU, where
# pytest's timeout cannot reach it. So no such launch runs on a GPU unless this variable is "1".
UNSAFE_WS_ENV = "COURSE_UNSAFE_WARP_SPECIALIZE"


def refuse_specialised_on_gpu(device) -> None:
    """``ValueError`` for a one-warpgroup warp-specialised launch on a GPU (they deadlock there with Triton 3.6),
    unless ``COURSE_UNSAFE_WARP_SPECIALIZE=1`` (``benchmarks/ws_smoke.py`` sets it, each launch in a process it
    can kill). The interpreter runs them: that is how the tests check their arithmetic."""
    if torch.device(device).type == "cuda" and os.environ.get(UNSAFE_WS_ENV) != "1":
        raise ValueError("one-warpgroup warp-specialised kernels deadlock on the H200 with Triton 3.6 (measured: "
                         f"results/ws_smoke_h200.txt), so they are not launched on a GPU; set {UNSAFE_WS_ENV}=1 to "
                         "try one anyway, in a process you can kill")


def _validate_warp_specialize(dtype, use_tma: bool) -> None:
    """A one-warpgroup warp-specialised launch: 16-bit inputs and TMA loads, else ``ValueError``.

    Compiled for sm_90 with Triton 3.6 (``course_utils.kernels.targets``), the specialised loop stops the
    compiler with float32 inputs (their tf32 products: "WGMMA type or shape is not supported") and with
    pointer loads (the warp-specialisation pass's assertion), so such a launch is refused on every machine,
    the interpreter included, instead of failing on a GPU only.
    """
    if dtype not in (torch.float16, torch.bfloat16) or not use_tma:
        raise ValueError(f"a warp-specialised one-warpgroup launch needs 16-bit inputs and TMA loads (got {dtype}, "
                         f"use_tma={use_tma}): Triton does not specialise a loop of tf32 products or pointer loads")


def _prepare(q, k, v, sm_scale):
    q, k, v = (t.contiguous() for t in (q, k, v))
    b, hq, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((b, hq, n), device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    return q, k, v, o, lse, scale


# The compiled kernel of the last :func:`launch` (its ``n_regs``, ``n_spills``
# and ``metadata.shared`` explain occupancy; ``None`` in the interpreter).
LAST_LAUNCH = {"compiled": None}


def launch(
    q, k, v, causal=False, sm_scale=None, *, block_m=128, block_n=64, num_warps=4, num_stages=2,
    use_tma=True, order=ORDER_KV_GROUPED, lazy_rescale=False, warp_specialize=False,
    two_phase=True, exp2=True, pipeline_qk=False, maxnreg=None, exp_poly=False, persistent=False, n_programs=None,
):
    """Run the kernel with one fixed configuration (no autotuning): ``(o, lse)``.

    This is what the lesson's tuning ladder and the CPU tests call; it works in
    the Triton interpreter too (fp32/fp16 there). No fallback: the caller
    makes sure the shapes fit (``N`` a multiple of both block sizes).

    ``warp_specialize`` with ``num_warps=4``: Triton 3.6 compiles the loop for
    Hopper into FlashAttention-3's shape, a producer partition issuing the TMA
    copies and two consumer warpgroups of 64 query rows each (12 warps, their
    registers raised to 232 by ``setmaxnreg``). It does so only for one loop
    with the output stored by pointers, so the output goes by pointers here,
    and a causal launch needs ``two_phase=False`` (one loop, every block
    masked); triton 3.8 refuses the form (its split of the ``Q`` load). On
    the H200 the compiled kernel deadlocks, so a GPU launch is refused
    (:func:`refuse_specialised_on_gpu`).

    ``persistent``: :func:`launch_persistent` (``n_programs`` programs over the
    same tiles; TMA loads, exp2, none of the other options above).
    """
    split_rows = warp_specialize and num_warps == 4  # the producer + two 64-row consumers form
    if split_rows and causal and two_phase:
        raise ValueError("a 4-warp warp-specialised causal launch needs two_phase=False (Triton 3.6 specialises "
                         "only one loop)")
    if persistent:
        if not use_tma or lazy_rescale or not exp2 or pipeline_qk or maxnreg is not None or exp_poly:
            raise ValueError("a persistent launch takes TMA loads and exp2 only (no lazy_rescale, pipeline_qk, "
                             "maxnreg or exp_poly)")
        return launch_persistent(q, k, v, causal, sm_scale, block_m=block_m, block_n=block_n, num_warps=num_warps,
                                 num_stages=num_stages, order=order, warp_specialize=warp_specialize,
                                 two_phase=two_phase, n_programs=n_programs)
    if exp_poly and not exp2:
        raise ValueError("exp_poly=True computes exp2: it needs exp2=True")
    if split_rows:
        _validate_warp_specialize(q.dtype, use_tma)
        refuse_specialised_on_gpu(q.device)
    q, k, v, o, lse, scale = _prepare(q, k, v, sm_scale)
    b, hq, n, d = q.shape
    if n % block_m or n % block_n or (causal and block_m % block_n):
        raise ValueError(f"N={n} must be a multiple of BLOCK_M={block_m} and BLOCK_N={block_n}")
    descs = _descriptors(q, k, v, o, block_m, block_n) if use_tma else (None,) * 4
    n_m = n // block_m
    grid = grid_shape(order, b, hq, k.shape[1], n_m)
    # A cap on registers per thread (a compile option of the NVIDIA backend):
    # fewer registers can let more programs share an SM, at the risk of spills.
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    compiled = _attn_fwd_fast_kernel[grid](
        q, k, v, o, lse, *descs, scale, n, hq,
        GROUP_SIZE=hq // k.shape[1], HEAD_DIM=d, CAUSAL=bool(causal),
        BLOCK_M=block_m, BLOCK_N=block_n, USE_TMA=use_tma, ORDER=order,
        LAZY_RESCALE=lazy_rescale, WARP_SPECIALIZE=warp_specialize,
        TWO_PHASE=two_phase, EXP2=2 if exp_poly else exp2, PIPELINE_QK=pipeline_qk, O_BY_POINTER=split_rows,
        num_warps=num_warps, num_stages=num_stages, **extra,
    )
    LAST_LAUNCH["compiled"] = compiled
    return o, lse


def launch_persistent(q, k, v, causal=False, sm_scale=None, *, block_m=128, block_n=64, num_warps=4, num_stages=2,
                      order=ORDER_KV_GROUPED, warp_specialize=True, two_phase=True, n_programs=None):
    """:func:`launch`'s ``(o, lse)`` from :func:`_attn_fwd_persistent_kernel`: ``n_programs`` programs (default: one
    per SM on a GPU, 4 in the interpreter) walk the tiles of :func:`launch`'s grid, TMA loads, the output by
    pointers.

    ``warp_specialize`` (4 warps, 16-bit inputs): Triton 3.6 compiles the tile loop for Hopper into a producer
    and two consumer warpgroups (12 warps), FlashAttention-3's persistent layout; not measured yet
    (``benchmarks/tune_fast.py`` times it).
    """
    if warp_specialize and num_warps == 4:
        if causal and two_phase:  # compiled for sm_90, the two inner loops stop the pass (a dominance assertion)
            raise ValueError("a 4-warp warp-specialised causal launch needs two_phase=False (the tile loop holds "
                             "one key loop, every block masked)")
        _validate_warp_specialize(q.dtype, True)
        refuse_specialised_on_gpu(q.device)
    q, k, v, o, lse, scale = _prepare(q, k, v, sm_scale)
    b, hq, n, d = q.shape
    if n % block_m or n % block_n or (causal and block_m % block_n):
        raise ValueError(f"N={n} must be a multiple of BLOCK_M={block_m} and BLOCK_N={block_n}")
    if o.numel() == 0:
        return o, lse
    grid0, grid1 = grid_shape(order, b, hq, k.shape[1], n // block_m)
    if n_programs is None:
        n_programs = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    compiled = _attn_fwd_persistent_kernel[(min(int(n_programs), grid0 * grid1),)](
        q, k, v, o, lse, *_descriptors(q, k, v, o, block_m, block_n), scale, n, hq, grid0, grid1,
        GROUP_SIZE=hq // k.shape[1], HEAD_DIM=d, CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n,
        ORDER=order, TWO_PHASE=two_phase, WARP_SPECIALIZE=warp_specialize,
        num_warps=num_warps, num_stages=num_stages,
    )
    LAST_LAUNCH["compiled"] = compiled
    return o, lse


def _launch_tuned(kernel, q, k, v, o, lse, scale, causal, lazy_rescale):
    b, hq, n, d = q.shape
    # Dummy block shapes: the config's pre-hook sets the real ones.
    descs = _descriptors(q, k, v, o, 64, 64)

    def grid(meta):
        return grid_shape(meta["ORDER"], b, hq, k.shape[1], n // meta["BLOCK_M"])

    kernel[grid](
        q, k, v, o, lse, *descs, scale, n, hq,
        GROUP_SIZE=hq // k.shape[1], HEAD_DIM=d, CAUSAL=bool(causal),
        USE_TMA=True, LAZY_RESCALE=lazy_rescale, TWO_PHASE=True, EXP2=True, PIPELINE_QK=False,
    )


def attention_forward_fast(q, k, v, causal=False, sm_scale=None, *, lazy_rescale=False):
    """Attention forward ``(o, lse)`` with the fastest kernel this machine can run.

    ``q [B, Hq, N, D]``, ``k``/``v [B, Hkv, N, D]`` (GQA when ``Hkv < Hq``).
    ``lse`` is float32 ``[B, Hq, N]``, natural log. On unsupported inputs
    (see :func:`unsupported_reason`) it falls back to the lesson-05 kernel.
    """
    if not is_supported(q, k, v):
        return _fallback(q, k, v, causal, sm_scale)
    return attention_forward_tuned(q, k, v, causal=causal, sm_scale=sm_scale, lazy_rescale=lazy_rescale)


def attention_forward_tuned(q, k, v, causal=False, sm_scale=None, *, lazy_rescale=False):
    """The autotuned kernel's ``(o, lse)`` for tensors :func:`is_supported` has accepted (not asked again).

    The package's dispatch (:mod:`course_utils.kernels.dispatch`) decides once and comes
    here; :func:`attention_forward_fast` decides for direct callers. Warp-specialised
    configurations first, then the plain ones, then :data:`SAFE_CONFIG`.
    """
    q, k, v, o, lse, scale = _prepare(q, k, v, sm_scale)
    causal = bool(causal)
    if _WS_STATE["enabled"][causal]:
        try:
            _launch_tuned(_tuned_kernel_ws, q, k, v, o, lse, scale, causal, lazy_rescale)
            return o, lse
        except Exception as exc:  # this compiler cannot warp-specialise this loop
            _WS_STATE["enabled"][causal] = False
            _WS_STATE["error"][causal] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    try:
        _launch_tuned(_tuned_kernel, q, k, v, o, lse, scale, causal, lazy_rescale)
    except Exception as exc:
        # A configuration this compiler rejects in a way the autotuner does not
        # skip: record why, and run one plain configuration instead.
        _TUNE_STATE["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return launch(q, k, v, causal, sm_scale, lazy_rescale=lazy_rescale, **SAFE_CONFIG)
    return o, lse


def best_launch_options(causal: bool) -> dict | None:
    """The autotuner's last pick for causal/non-causal calls, as :func:`launch` keywords."""
    kernel = _tuned_kernel_ws if _WS_STATE["enabled"][bool(causal)] else _tuned_kernel
    cfg = getattr(kernel, "best_config", None)
    if cfg is None:
        return None
    kw = cfg.kwargs
    return dict(block_m=kw["BLOCK_M"], block_n=kw["BLOCK_N"], num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, order=kw["ORDER"], warp_specialize=bool(kw.get("WARP_SPECIALIZE")))


def best_config(causal: bool) -> str | None:
    """The autotuner's last pick, in words (for reports)."""
    if _TUNE_STATE["error"]:
        return f"autotuning failed ({_TUNE_STATE['error']}); ran {SAFE_CONFIG}"
    opts = best_launch_options(causal)
    if opts is None:
        return None
    ws = ", warp-specialized" if opts["warp_specialize"] else ""
    order = {ORDER_M_MAJOR: ", query blocks in order", ORDER_LONGEST_FIRST: ", heads side by side, longest rows first",
             ORDER_KV_GROUPED: ", GQA groups side by side, longest rows first"}[opts["order"]]
    return (f"BLOCK_M={opts['block_m']}, BLOCK_N={opts['block_n']}, num_warps={opts['num_warps']}, "
            f"num_stages={opts['num_stages']}{ws}{order}")


def _fallback(q, k, v, causal, sm_scale):
    """The lesson-05 kernel (``forward.flash_attention_gqa_forward``) for unsupported inputs.

    It is called directly, not through ``course_utils.kernels.flash_attention``,
    so that routing that function here can never loop.
    """
    from . import forward

    d = q.shape[-1]
    if sm_scale is not None and not math.isclose(float(sm_scale), 1.0 / math.sqrt(d)):
        # softmax(c q k^T / sqrt(d)) == softmax(sm_scale q k^T) for c = sm_scale * sqrt(d)
        q = q * (float(sm_scale) * math.sqrt(d))
    return forward.flash_attention_gqa_forward(q, k, v, causal=bool(causal))
