"""FP8 (e4m3) attention forward (lesson 11): block quantisation and an FP8 FlashAttention kernel.

Public API (torch tensors ``[B, H, N, D]``)::

    x8, scale = quantize_fp8(x, block_size=128)
    o = flash_attention_fp8(q, k, v, causal=False, *, q_scale=None, k_scale=None, v_scale=None, block_size=128)

- :func:`quantize_fp8` keeps one float32 scale per ``block_size`` tokens of
  each head: ``scale[b, h, j] = amax(|x[b, h, j*bs:(j+1)*bs, :]|) / 448``, and
  ``x8 = x / scale`` rounded to ``torch.float8_e4m3fn`` (so ``|x8| <= 448``,
  e4m3's largest finite value). ``x ~ x8.float() * scale[:, :, n // bs, None]``.
- :func:`flash_attention_fp8` takes either bf16/fp16/fp32 tensors (quantised
  here, the result in q's dtype) or e4m3 tensors with their three scales (the
  result in bf16 on a GPU; float32 in the CPU interpreter, which computes
  bf16 wrongly). GQA/MQA/MHA, causal or not, any strides, head dims 16-256.

The kernel (:func:`_flash_attention_fp8_kernel`) is lesson 05's two-phase
online softmax with both products in e4m3:

- ``Q K^T`` takes the e4m3 tiles as they are; the scales are folded into the
  score scale: a query row's ``q_scale * sm_scale * log2(e)`` (one number per
  row, computed once per program) times the K tile's ``k_scale`` (one number
  per tile, since a tile never straddles two scale blocks);
- ``P V``: ``p`` lies in ``[0, 1]`` after the max is subtracted, so it is
  quantised with the fixed scale :data:`P_SCALE` = 256 (``p8 = p * 256``;
  see below), and the product is rescaled by ``v_scale / 256`` once per tile;
- V is handed over **K-major** (transposed, ``[B, H, D, N]`` with the keys
  contiguous): Hopper's FP8 ``wgmma`` reads both operands of a product
  K-major from shared memory, and for ``P V`` the reduction runs over the
  keys. (Triton's tutorial 06 transposes V the same way for its FP8 path.)

Why 256 for P: the largest ``p`` of every row is exactly 1, which maps to 256,
a power of two, so multiplying by it and dividing by it are exact in
floating point; 256 leaves e4m3's top (256-448) unused, which costs under one
binade at the bottom (e4m3's normals reach down to 2**-6: with 256, every
``p >= 2**-14`` is a normal number, with 448 every ``p >= 2**-14.8``).
Lesson 11 measures the three choices (1, 256, 448) on the CPU.

In Triton's interpreter (no GPU) ``tl.dot`` takes e4m3 tensors too: torch
rounds to e4m3 on the CPU (``.to(torch.float8_e4m3fn)``), and the
interpreter computes the product of the rounded values exactly (numpy has no
FP8; it holds them in float32). So the same kernel runs on both machines,
with one difference: Triton's interpreter's float32 -> e4m3 cast inside a
kernel loses the carry into the exponent (``import course_utils`` repairs it,
``environment._patch_interpreter_fp8_cast``; :func:`to_e4m3` works around it
without the repair).
On a GPU it is written for sm_89/sm_90 (``tl.float8e4nv``).

On a Hopper GPU, for D of 64 or 128 and N a multiple of the tile,
:func:`flash_attention_fp8` runs :func:`launch_fp8_hopper` instead: the same
arithmetic with one FMA per score for the scales, P's 256 folded into the
exponent, V's scale folded into the accumulator's rescale (so ``P V``
accumulates inside the tensor cores), TMA descriptors and lesson 06's launch
order, tuned per mask (:func:`hopper_config`, ``results/tune_fp8_hopper.json``).
Two options of its ``config`` were measured slower on the H200 and stay for
the lesson's comparison: ``EXP_F16`` (the exponentials two at a time in fp16)
and ``EXP_POLY`` (half of them as a cubic on the FMA units, ``fast._exp_scores``).

One copy: ``solutions/11_hopper_and_fp8.ipynb`` defines these same
``@triton.jit`` functions (``tests/test_kernels_fp8.py`` compares them).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from course_utils.kernels.fast import (ORDER_KV_GROUPED, _exp_scores, _program_tile, _tile_at, grid_shape,
                                       refuse_specialised_on_gpu)  # absolute: the graders load a copy of this file

try:  # host-side TMA descriptors (Triton >= 3.3); without them the Hopper launch is off
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = [
    "E4M3_MAX",
    "P_SCALE",
    "quantize_fp8",
    "dequantize_fp8",
    "flash_attention_fp8",
    "to_e4m3",
    "attn_fwd_fp8_inner",
    "_flash_attention_fp8_kernel",
    "_flash_attention_fp8_persistent_kernel",
    "_fp8_attention_tile",
    "validate_fp8",
    "fp8_config",
    "launch_fp8",
    "launch_fp8_persistent",
    "persistent_schedule",
    "lpt_schedule",
    "schedule_makespan",
    "hopper_config",
    "hopper_unsupported_reason",
    "launch_fp8_hopper",
    "GLUON_MIN_N",
    "GLUON_PERSISTENT",
    "GLUON_WIDE",
    "GLUON_WALK",
    "FAST_TRANSPOSE",
    "transpose_keys",
    "transpose_tiled",
    "_transpose_tiles_kernel",
    "gluon_fp8_applies",
    "_fp8_hopper_kernel",
]

#: e4m3's largest finite value (``torch.finfo(torch.float8_e4m3fn).max``).
E4M3_MAX = 448.0
#: The fixed scale of P in the P V product (p in [0, 1] -> [0, 256]); see the module's docstring.
P_SCALE = 256.0
LOG2E = 1.4426950408889634

_FP8 = torch.float8_e4m3fn
_HIGH = (torch.float16, torch.bfloat16, torch.float32)


# -----------------------------------------------------------------------------
# Block quantisation
# -----------------------------------------------------------------------------
def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two of at least 16, not {block_size!r}.")
    return block_size


def quantize_fp8(x, block_size: int = 128):
    """``(x8, scale)``: ``x`` ``[B, H, N, D]`` in e4m3 with one float32 scale per ``block_size`` tokens of each head.

    ``scale`` is ``[B, H, cdiv(N, block_size)]``, ``amax / 448`` of its block
    (a block of zeros gets scale 1), positive and finite; ``x8 = x / scale``
    rounded to ``torch.float8_e4m3fn``, so ``|x8| <= 448`` and
    ``x ~ x8.float() * scale[:, :, n // block_size, None]``.
    """
    block_size = _check_block_size(block_size)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a 4-dimensional torch tensor [B, H, N, D], not {getattr(x, 'shape', type(x))}.")
    if not x.dtype.is_floating_point or x.dtype in (_FP8, torch.float8_e5m2):
        raise ValueError(f"x must be a float16, bfloat16 or float32 tensor to quantise, not {x.dtype}.")
    b, h, n, d = x.shape
    n_blocks = triton.cdiv(n, block_size)
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("x holds inf or NaN: e4m3 has no infinity, so it cannot be quantised.")
    pad = n_blocks * block_size - n
    if pad:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    blocks = xf.reshape(b, h, n_blocks, block_size, d)
    amax = blocks.abs().amax(dim=(3, 4)) if blocks.numel() else torch.zeros((b, h, n_blocks), device=x.device)
    tiny = torch.finfo(torch.float32).tiny
    scale = torch.where(amax > 0, (amax / E4M3_MAX).clamp_min(tiny), torch.ones_like(amax))
    x8 = (blocks / scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(_FP8)
    x8 = x8.reshape(b, h, n_blocks * block_size, d)[:, :, :n]
    return x8.contiguous(), scale.contiguous()


def dequantize_fp8(x8, scale, block_size: int = 128):
    """float32 ``x8.float() * scale`` per block: what the e4m3 tensor and its scales stand for."""
    block_size = _check_block_size(block_size)
    n = x8.shape[2]
    per_row = scale.float().repeat_interleave(block_size, dim=2)[:, :, :n]
    return x8.float() * per_row[..., None]


@triton.jit
def _transpose_tiles_kernel(X, Y, stride_xb, stride_xh, stride_xn, stride_xd, H, N, D, BLOCK: tl.constexpr):
    """``Y[b, h, :, :] = X[b, h, :, :]ᵀ`` for one ``BLOCK x BLOCK`` tile of bytes: read along X's rows, written
    along Y's (``tl.trans`` moves the tile between the two through the registers' layouts)."""
    bh = tl.program_id(2).to(tl.int64)  # a head's offset in bytes can pass 2**31 in a long cache
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # keys
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # head dims
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    x = tl.load(X + (bh // H) * stride_xb + (bh % H) * stride_xh + rows[:, None] * stride_xn
                + cols[None, :] * stride_xd, mask=mask)
    y = Y + bh * D * N + cols[:, None] * N + rows[None, :]
    tl.store(y, tl.trans(x), mask=tl.trans(mask))


# Whether flash_attention_fp8 makes V's K-major copy with _transpose_tiles_kernel (one pass, 64 x 64 tiles) instead of
# torch's strided copy, which the entry pays on every call. On an H100 (benchmarks/route_check.py --modes
# fp8transpose, two runs, results/route_check_fp8_h100.json and route_check_fp8_min4k_h100_run2.json) the entry ran
# 1.10x and 1.10x at 4k, 1.07x and 1.05x at 8k, 1.03x and 1.03x at 16k (causal, e4m3 inputs, 16k tokens a batch).
FAST_TRANSPOSE: bool = True


def transpose_keys(v8):
    """V's K-major copy ``[B, H, D, N]`` (the keys contiguous) of the e4m3 ``v8`` ``[B, H, N, D]``, any strides: on a
    GPU while :data:`FAST_TRANSPOSE` by :func:`_transpose_tiles_kernel` (its bytes), else torch's copy."""
    if not (FAST_TRANSPOSE and v8.is_cuda):
        return v8.transpose(2, 3).contiguous()
    return transpose_tiled(v8)


def transpose_tiled(v8):
    """:func:`transpose_keys`'s copy by :func:`_transpose_tiles_kernel`, on any device Triton runs on (the CPU's
    interpreter included), for a tensor of one-byte elements."""
    b, h, n, d = v8.shape
    vt8 = torch.empty((b, h, d, n), device=v8.device, dtype=v8.dtype)
    x, y = v8.view(torch.uint8), vt8.view(torch.uint8)
    block = 64
    _transpose_tiles_kernel[(triton.cdiv(n, block), triton.cdiv(d, block), b * h)](
        x, y, *x.stride(), h, n, d, BLOCK=block)
    return vt8


# -----------------------------------------------------------------------------
# The kernel
# -----------------------------------------------------------------------------
@triton.jit
def to_e4m3(x, INTERPRETED: tl.constexpr):
    """``x`` (float32, ``0 <= x <= 448``) rounded to e4m3: ``x.to(tl.float8e4nv)``.

    Triton's interpreter drops the carry when a value rounds up to the next
    power of two (124.5 becomes 64, not 128; ``import course_utils`` repairs
    that cast), so there ``x`` is first rounded to e4m3's grid in float32 (3
    mantissa bits; below 2**-6 the subnormals' fixed step of 2**-9), after
    which the cast is exact with or without the repair. On a GPU it is the
    plain cast (the branch is not compiled).
    """
    if INTERPRETED:
        ulp = tl.exp2(tl.floor(tl.log2(tl.maximum(x, 0.015625))) - 3.0)
        x = tl.floor(x / ulp + 0.5) * ulp
    return x.to(tl.float8e4nv)


@triton.jit
def attn_fwd_fp8_inner(
    acc, l_i, m_i, q, q_scale,
    k_base, vt_base, ks_base, vs_base,
    stride_kn, stride_kd, stride_vd, stride_vn, stride_ksn, stride_vsn,
    offs_m, offs_d, d_ok,
    lo, hi, SEQ_LEN,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    P_SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Fold the K/V blocks ``lo, lo + BLOCK_N, ...`` (below ``hi``) into the state, both products in e4m3.

    ``q`` is the e4m3 Q tile, ``q_scale`` its rows' ``q_scale * sm_scale *
    log2(e)`` (float32 ``[BLOCK_M]``); K is ``[N, D]`` and V K-major (``V^T``,
    ``[D, N]``, keys contiguous), both e4m3, with one scale per
    ``SCALE_BLOCK`` keys (``SCALE_BLOCK`` a multiple of ``BLOCK_N``: one
    scale per tile). Scores are in log2 units, as in lesson 05.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < SEQ_LEN
        k = tl.load(  # K^T tile [D_PAD, BLOCK_N], e4m3
            k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=n_ok[None, :] & d_ok[:, None], other=0.0,
        )
        vt = tl.load(  # V^T tile [D_PAD, BLOCK_N], e4m3: from K-major V the keys are contiguous
            vt_base + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn,
            mask=d_ok[:, None] & n_ok[None, :], other=0.0,
        )
        k_scale = tl.load(ks_base + (start_n // SCALE_BLOCK) * stride_ksn)  # one scale per tile
        v_scale = tl.load(vs_base + (start_n // SCALE_BLOCK) * stride_vsn)
        ### BEGIN SOLUTION
        s = tl.dot(q, k) * (q_scale[:, None] * k_scale)  # the scales folded into the score scale
        if MASK:
            keep = n_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p8 = to_e4m3(p * P_SCALE, INTERPRETED)  # p in [0, 1] -> [0, P_SCALE], exact for p = 1
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt)) * (v_scale / P_SCALE)
        m_i = m_new
        ### END SOLUTION
    return acc, l_i, m_i


@triton.jit
def _fp8_attention_tile(
    start_m, batch_head,
    Q_ptr, K_ptr, VT_ptr, O_ptr, QS_ptr, KS_ptr, VS_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vd, stride_vn,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    sm_scale, SEQ_LEN, N_Q_HEADS, N_KV_HEADS,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    P_SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One output tile: query block ``start_m`` of (batch x query head) ``batch_head`` (see the kernel below)."""
    batch = batch_head // N_Q_HEADS
    q_head = batch_head % N_Q_HEADS
    kv_head = q_head // (N_Q_HEADS // N_KV_HEADS)

    q_base = Q_ptr + batch * stride_qb + q_head * stride_qh
    k_base = K_ptr + batch * stride_kb + kv_head * stride_kh
    vt_base = VT_ptr + batch * stride_vb + kv_head * stride_vh
    o_base = O_ptr + batch * stride_ob + q_head * stride_oh
    ks_base = KS_ptr + batch * stride_ksb + kv_head * stride_ksh
    vs_base = VS_ptr + batch * stride_vsb + kv_head * stride_vsh

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < SEQ_LEN
    q = tl.load(
        q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )
    # Each query row's scale, with sm_scale and log2(e) folded in: one multiply per score later.
    q_scale = tl.load(QS_ptr + batch * stride_qsb + q_head * stride_qsh + (offs_m // SCALE_BLOCK) * stride_qsn,
                      mask=m_ok, other=1.0) * (sm_scale * 1.4426950408889634)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), dtype=tl.float32)

    if IS_CAUSAL:
        mask_lo = start_m * BLOCK_M
        mask_hi = tl.minimum((start_m + 1) * BLOCK_M, SEQ_LEN)
    else:
        mask_lo = SEQ_LEN - SEQ_LEN % BLOCK_N
        mask_hi = SEQ_LEN
    acc, l_i, m_i = attn_fwd_fp8_inner(
        acc, l_i, m_i, q, q_scale, k_base, vt_base, ks_base, vs_base,
        stride_kn, stride_kd, stride_vd, stride_vn, stride_ksn, stride_vsn,
        offs_m, offs_d, d_ok, 0, mask_lo, SEQ_LEN,
        MASK=False, IS_CAUSAL=IS_CAUSAL, BLOCK_N=BLOCK_N, SCALE_BLOCK=SCALE_BLOCK, P_SCALE=P_SCALE,
        INTERPRETED=INTERPRETED,
    )
    acc, l_i, m_i = attn_fwd_fp8_inner(
        acc, l_i, m_i, q, q_scale, k_base, vt_base, ks_base, vs_base,
        stride_kn, stride_kd, stride_vd, stride_vn, stride_ksn, stride_vsn,
        offs_m, offs_d, d_ok, mask_lo, mask_hi, SEQ_LEN,
        MASK=True, IS_CAUSAL=IS_CAUSAL, BLOCK_N=BLOCK_N, SCALE_BLOCK=SCALE_BLOCK, P_SCALE=P_SCALE,
        INTERPRETED=INTERPRETED,
    )
    l_i = tl.where(m_ok, l_i, 1.0)  # rows past the end (not stored) must not divide by 0
    acc = acc / l_i[:, None]
    tl.store(
        o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        acc.to(O_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _flash_attention_fp8_kernel(
    Q_ptr, K_ptr, VT_ptr, O_ptr, QS_ptr, KS_ptr, VS_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vd, stride_vn,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    sm_scale, SEQ_LEN, N_Q_HEADS, N_KV_HEADS,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    P_SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """FP8 attention forward: one program per (query block, batch x query head), lesson 05's grid.

    Q ``[B, Hq, N, D]``, K ``[B, Hkv, N, D]`` and VT (V transposed, ``[B, Hkv,
    D, N]``) are e4m3 with any strides; QS ``[B, Hq, n_blocks]``, KS and VS
    ``[B, Hkv, n_blocks]`` are their float32 scales (``n_blocks = cdiv(N,
    SCALE_BLOCK)``). O ``[B, Hq, N, D]`` gets the output.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    tl.static_assert(SCALE_BLOCK % BLOCK_N == 0)  # a K/V tile never straddles two scale blocks
    _fp8_attention_tile(
        tl.program_id(0), tl.program_id(1),
        Q_ptr, K_ptr, VT_ptr, O_ptr, QS_ptr, KS_ptr, VS_ptr,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vd, stride_vn, stride_ob, stride_oh, stride_on, stride_od,
        stride_qsb, stride_qsh, stride_qsn, stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsn,
        sm_scale, SEQ_LEN, N_Q_HEADS, N_KV_HEADS,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, IS_CAUSAL=IS_CAUSAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        SCALE_BLOCK=SCALE_BLOCK, P_SCALE=P_SCALE, INTERPRETED=INTERPRETED,
    )


@triton.jit
def _flash_attention_fp8_persistent_kernel(
    SCHEDULE, MAX_TILES, N_BLOCKS_M,
    Q_ptr, K_ptr, VT_ptr, O_ptr, QS_ptr, KS_ptr, VS_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vd, stride_vn,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    sm_scale, SEQ_LEN, N_Q_HEADS, N_KV_HEADS,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    P_SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The same tiles from one program per SM: program ``p`` runs the tiles of row ``p`` of SCHEDULE.

    SCHEDULE is int32 ``[n_programs, MAX_TILES]``: tile ``t = batch_head * N_BLOCKS_M + start_m``, in
    the order the program runs them, ``-1`` past the end of its list (:func:`persistent_schedule`).
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    tl.static_assert(SCALE_BLOCK % BLOCK_N == 0)  # a K/V tile never straddles two scale blocks
    row = SCHEDULE + tl.program_id(0) * MAX_TILES
    for j in range(0, MAX_TILES):
        t = tl.load(row + j)
        if t >= 0:
            _fp8_attention_tile(
                t % N_BLOCKS_M, t // N_BLOCKS_M,
                Q_ptr, K_ptr, VT_ptr, O_ptr, QS_ptr, KS_ptr, VS_ptr,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vd, stride_vn, stride_ob, stride_oh, stride_on, stride_od,
        stride_qsb, stride_qsh, stride_qsn, stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsn,
        sm_scale, SEQ_LEN, N_Q_HEADS, N_KV_HEADS,
        HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD, IS_CAUSAL=IS_CAUSAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        SCALE_BLOCK=SCALE_BLOCK, P_SCALE=P_SCALE, INTERPRETED=INTERPRETED,
            )


# -----------------------------------------------------------------------------
# Python side
# -----------------------------------------------------------------------------
def fp8_config(head_dim: int, block_size: int, device: torch.device) -> dict:
    """Tile sizes and launch options: ``BLOCK_N`` divides ``block_size`` (one scale per K/V tile).

    In the interpreter 64 x 32 tiles (as for lesson 05's kernel). On a GPU, for
    D <= 128, 128 x 128 tiles with 8 warps and 3 stages: the fastest of 24
    configurations measured on the H200 (``benchmarks/tune_fp8.py``,
    ``results/tune_fp8.json``: 1.08-1.16x the course's bf16 forward and
    0.96-1.04x cuDNN at N = 4k and 16k, against 0.90-0.93x and 0.77-0.83x for
    the 128 x 64 tiles it replaced). A K/V tile of 128 keys holds one scale
    block, and e4m3 tiles are half the bytes of bf16 ones, so the 128 x 128
    tiles fit three stages. For D <= 64 (4 warps, 128 x 64) and D > 128 (64 x
    64) the defaults are not measured.
    Triton's FP8 ``tl.dot`` on Hopper wants a reduction of at least 32, so on
    a GPU the head dim is padded to 32 or more.
    """
    if device.type == "cpu":
        cfg = dict(BLOCK_M=64, BLOCK_N=32)
        d_pad = max(16, triton.next_power_of_2(head_dim))
    else:
        d_pad = max(32, triton.next_power_of_2(head_dim))
        if d_pad > 128:
            cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
        elif d_pad > 64:
            cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
        else:
            cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], block_size)
    cfg["HEAD_DIM_PAD"] = d_pad
    return cfg


def _check_tensors(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch tensor, not {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, N, D], but it has {t.dim()} (shape {tuple(t.shape)}).")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, but they are on {q.device}, {k.device} and {v.device}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have one dtype, but they have {q.dtype}, {k.dtype} and {v.dtype}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, but they are {tuple(k.shape)} and {tuple(v.shape)}.")
    (b, hq, n, d), (bk, hkv, nk, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"q has batch size {b} but k and v have {bk}.")
    if n != nk:
        raise ValueError(f"q has sequence length {n} but k and v have {nk}; this kernel needs the same N.")
    if d != dk:
        raise ValueError(f"q has head dim {d} but k and v have {dk}.")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of key/value heads ({hkv}).")
    if not 16 <= d <= 256:
        raise ValueError(f"head dim {d} is not supported: it must be between 16 and 256.")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the tensors are on the CPU but Triton's interpreter is off: move them to the GPU "
                         "(or import course_utils before triton on a machine without one).")


def validate_fp8(q, k, v, q_scale=None, k_scale=None, v_scale=None, block_size: int = 128) -> bool:
    """Raise ``ValueError`` (one sentence) unless the call can go to the FP8 kernel; True for e4m3 inputs."""
    block_size = _check_block_size(block_size)
    _check_tensors(q, k, v)
    scales = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    if q.dtype == torch.float8_e5m2:
        raise ValueError("float8_e5m2 inputs are not supported: quantise to float8_e4m3fn (quantize_fp8).")
    if q.dtype != _FP8:
        if q.dtype not in _HIGH:
            raise ValueError(f"dtype {q.dtype} is not supported: use float8_e4m3fn with scales, or float16, bfloat16 "
                             "or float32.")
        given = [name for name, s in scales.items() if s is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given for {q.dtype} inputs: scales belong to float8_e4m3fn inputs "
                             "(other inputs are quantised inside).")
        if q.dtype == torch.bfloat16 and q.device.type == "cpu":
            raise ValueError("bfloat16 is computed wrongly by Triton's CPU interpreter: use float32 or float16 on the CPU.")
        return False
    missing = [name for name, s in scales.items() if s is None]
    if missing:
        raise ValueError(f"float8_e4m3fn inputs need their scales, but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing: pass what quantize_fp8 returns.")
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    n_blocks = triton.cdiv(n, block_size)
    for name, s, h in (("q_scale", q_scale, hq), ("k_scale", k_scale, hkv), ("v_scale", v_scale, hkv)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (b, h, n_blocks) \
                or s.device != q.device:
            got = f"{type(s).__name__} {tuple(s.shape)} {s.dtype} on {s.device}" if isinstance(s, torch.Tensor) \
                else type(s).__name__
            raise ValueError(f"{name} must be a float32 tensor [B, H, cdiv(N, block_size)] = [{b}, {h}, {n_blocks}] "
                             f"on {q.device} (block_size={block_size}), but it is {got}.")
    return True


def launch_fp8(q8, k8, vt8, q_scale, k_scale, v_scale, causal: bool, block_size: int, out_dtype, config=None):
    """Run the kernel on validated e4m3 tensors; ``vt8`` is V transposed (``[B, Hkv, D, N]``, any strides).

    ``config`` replaces :func:`fp8_config`'s launch options (``benchmarks/tune_fp8.py`` sweeps them).
    """
    b, hq, n, d = q8.shape
    o = torch.empty((b, hq, n, d), dtype=out_dtype, device=q8.device)
    if o.numel() == 0:
        return o
    cfg = dict(fp8_config(d, block_size, q8.device), **(config or {}))
    grid = (triton.cdiv(n, cfg["BLOCK_M"]), b * hq)
    _flash_attention_fp8_kernel[grid](
        q8, k8, vt8, o, q_scale, k_scale, v_scale,
        *q8.stride(), *k8.stride(), *vt8.stride(), *o.stride(),
        *q_scale.stride(), *k_scale.stride(), *v_scale.stride(),
        1.0 / math.sqrt(d), n, hq, k8.shape[1],
        HEAD_DIM=d, IS_CAUSAL=bool(causal), SCALE_BLOCK=block_size, P_SCALE=P_SCALE,
        INTERPRETED=q8.device.type == "cpu", **cfg,
    )
    return o


def persistent_schedule(n_blocks_m: int, batch_heads: int, causal: bool, n_programs: int, block_m: int,
                        block_n: int, seq_len: int) -> list[list[int]]:
    """Each persistent program's tiles (``t = batch_head * n_blocks_m + start_m``), by :func:`lpt_schedule`.

    A tile's cost is the K/V blocks it visits (causal: query block ``m`` stops at its diagonal) plus
    one for its prologue and epilogue, the load model of lesson 11's exercise 3.
    """
    n_kv = triton.cdiv(seq_len, block_n)
    tiles, costs = [], []
    for bh in range(batch_heads):
        for m in range(n_blocks_m):
            visits = min(n_kv, triton.cdiv(min((m + 1) * block_m, seq_len), block_n)) if causal else n_kv
            tiles.append(bh * n_blocks_m + m)
            costs.append(visits + 1)
    return lpt_schedule(tiles, costs, n_programs)


_SCHEDULES: dict = {}


def _schedule_tensor(n_blocks_m, batch_heads, causal, n_programs, block_m, block_n, seq_len, device):
    """:func:`persistent_schedule` as int32 ``[n_programs, max_tiles]`` on ``device`` (-1 padded; cached)."""
    key = (n_blocks_m, batch_heads, bool(causal), n_programs, block_m, block_n, seq_len, str(device))
    if key not in _SCHEDULES:
        programs = persistent_schedule(n_blocks_m, batch_heads, causal, n_programs, block_m, block_n, seq_len)
        width = max(1, max(len(p) for p in programs))
        rows = [p + [-1] * (width - len(p)) for p in programs]
        _SCHEDULES[key] = torch.tensor(rows, dtype=torch.int32, device=device)
    return _SCHEDULES[key]


def launch_fp8_persistent(q8, k8, vt8, q_scale, k_scale, v_scale, causal: bool, block_size: int, out_dtype,
                          n_programs: int | None = None, config=None):
    """:func:`launch_fp8`'s output from a persistent grid: ``n_programs`` programs (one per SM by default)
    loop over the tiles :func:`persistent_schedule` gives them, longest first."""
    b, hq, n, d = q8.shape
    o = torch.empty((b, hq, n, d), dtype=out_dtype, device=q8.device)
    if o.numel() == 0:
        return o
    cfg = dict(fp8_config(d, block_size, q8.device), **(config or {}))
    if n_programs is None:
        n_programs = (torch.cuda.get_device_properties(q8.device).multi_processor_count
                      if q8.device.type == "cuda" else 4)
    n_m = triton.cdiv(n, cfg["BLOCK_M"])
    schedule = _schedule_tensor(n_m, b * hq, causal, n_programs, cfg["BLOCK_M"], cfg["BLOCK_N"], n, q8.device)
    _flash_attention_fp8_persistent_kernel[(n_programs,)](
        schedule, schedule.shape[1], n_m,
        q8, k8, vt8, o, q_scale, k_scale, v_scale,
        *q8.stride(), *k8.stride(), *vt8.stride(), *o.stride(),
        *q_scale.stride(), *k_scale.stride(), *v_scale.stride(),
        1.0 / math.sqrt(d), n, hq, k8.shape[1],
        HEAD_DIM=d, IS_CAUSAL=bool(causal), SCALE_BLOCK=block_size, P_SCALE=P_SCALE,
        INTERPRETED=q8.device.type == "cpu", **cfg,
    )
    return o


# -----------------------------------------------------------------------------
# The Hopper launch: the same arithmetic with lesson 06's machinery
# -----------------------------------------------------------------------------
# What the lesson's kernel above spends per score besides the two products, and what this one does instead:
# - the scales: ``s * (q_scale * k_scale)``, then ``- m``: two operations per score. Here the max is taken
#   of the raw scores and scaled once per row (the row scale is positive), so scale-and-subtract is one FMA.
# - P's fixed scale: ``p * 256`` is one multiply per score. Here ``log2(256) = 8`` is folded into the
#   exponent's shift: ``exp2(x - (m - 8)) = 256 * exp2(x - m)``, the same number.
# - V's scale: ``acc * alpha + (P V) * v_scale`` is two operations per output element. Here ``acc`` is kept in
#   units of the current tile's ``v_scale``: one multiply by ``alpha * v_prev / v_scale`` (one number per row),
#   and the product accumulates straight into ``acc`` inside the tensor cores.
# - the loads: TMA descriptors instead of masked pointer loads (no bounds masks: ``N`` is a multiple of the
#   tiles), and lesson 06's launch order (a GQA group's heads side by side, longest rows first).
HOPPER_HEAD_DIMS = (64, 128)
HOPPER_LAST = {"compiled": None}  # the last launch's compiled kernel (n_regs, n_spills; None in the interpreter)


@triton.jit
def _exp2_f16x2(x, INTERPRETED: tl.constexpr):
    """``exp2`` of fp16 ``x``, two at a time (``ex2.approx.f16x2``: half the special-function unit's work)."""
    if INTERPRETED:
        y = tl.math.exp2(x.to(tl.float32)).to(tl.float16)
    else:
        y = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=True,
                                      pack=2)
    return y


@triton.jit
def _fp8_hopper_inner(acc, l_i, m_i, v_prev, q, row_scale_q,
                      desc_k, desc_vt, KS, VS, kv_row0, vt_row0, ks_base,
                      lo, hi, offs_m, offs_n,
                      BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr, MASK: tl.constexpr,
                      EXP_F16: tl.constexpr, EXP_POLY: tl.constexpr, INTERPRETED: tl.constexpr,
                      WARP_SPECIALIZE: tl.constexpr = False):
    """Fold K/V blocks ``[lo, hi)`` into ``(acc, l_i, m_i)``; ``acc`` is in units of ``v_prev``."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([kv_row0 + start_n, 0]).T  # K^T [D, BLOCK_N], a view of the shared-memory tile
        s = tl.dot(q, k)  # raw e4m3 product, float32
        blk = start_n // SCALE_BLOCK
        row_scale = row_scale_q * tl.load(KS + ks_base + blk)  # q_scale * k_scale * sm_scale * log2(e), > 0
        if MASK:
            s = tl.where(offs_m[:, None] >= start_n + offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * row_scale)
        x = s * row_scale[:, None] - (m_new - 8.0)[:, None]  # one FMA; exp2(x) = 256 * exp2(score - max)
        alpha = tl.math.exp2(m_i - m_new)
        if EXP_F16 == 0:
            if EXP_POLY:  # half the columns on the FMA units (fast._exp_scores)
                p = _exp_scores(x, 2)
            else:
                p = tl.math.exp2(x)  # in [0, 256]
            l_i = l_i * alpha + tl.sum(p, 1)
            p8 = to_e4m3(p, INTERPRETED)
        else:  # two exponentials per instruction in fp16 (x <= 8, p <= 256: fp16's range holds both)
            p16 = _exp2_f16x2(x.to(tl.float16), INTERPRETED)
            if EXP_F16 == 1:
                l_i = l_i * alpha + tl.sum(p16.to(tl.float32), 1)
            else:
                l_i = l_i * alpha + tl.sum(p16, 1).to(tl.float32)
            if INTERPRETED:  # Triton's interpreter's casts to e4m3 drop the carry unrepaired (see to_e4m3)
                p8 = to_e4m3(p16.to(tl.float32), INTERPRETED)
            else:
                p8 = p16.to(tl.float8e4nv)  # cvt.rn.satfinite.e4m3x2.f16x2: two per instruction
        v_scale = tl.load(VS + ks_base + blk)
        acc = acc * (alpha * (v_prev / v_scale))[:, None]
        vt = desc_vt.load([vt_row0, start_n])  # V^T [D, BLOCK_N], keys contiguous (K-major)
        acc = tl.dot(p8, vt.T, acc)
        v_prev = v_scale
        m_i = m_new
    return acc, l_i, m_i, v_prev


@triton.jit
def _fp8_hopper_tile(bh, start_m, desc_q, desc_k, desc_vt, desc_o, O, QS, KS, VS,
                     sm_scale, N_CTX, N_Q_HEADS, N_BLOCKS_SCALE,
                     GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                     EXP_F16: tl.constexpr, EXP_POLY: tl.constexpr, INTERPRETED: tl.constexpr,
                     SPECIALISED_FORM: tl.constexpr, WS_KEY_LOOP: tl.constexpr):
    """Query block ``start_m`` of (batch, query head) ``bh``: the body of :func:`_fp8_hopper_kernel` and of each
    step of :func:`_fp8_hopper_persistent_kernel`. ``SPECIALISED_FORM``: the form a specialised loop needs (one
    query scale per tile, causal in one masked loop, the output by pointers); ``WS_KEY_LOOP``: the key loop is
    the one specialised."""
    batch = bh // N_Q_HEADS
    kv_bh = batch * (N_Q_HEADS // GROUP_SIZE) + (bh % N_Q_HEADS) // GROUP_SIZE
    q_row0 = bh * N_CTX + start_m * BLOCK_M
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([q_row0, 0])
    if SPECIALISED_FORM:  # one scale for the whole tile, as a row vector
        tile_scale = tl.load(QS + bh * N_BLOCKS_SCALE + (start_m * BLOCK_M) // SCALE_BLOCK)
        row_scale_q = tl.full([BLOCK_M], 1.0, tl.float32) * (tile_scale * (sm_scale * 1.4426950408889634))
    else:
        row_scale_q = tl.load(QS + bh * N_BLOCKS_SCALE + offs_m // SCALE_BLOCK) * (sm_scale * 1.4426950408889634)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    v_prev = 1.0
    kv_row0 = kv_bh * N_CTX
    ks_base = kv_bh * N_BLOCKS_SCALE
    if CAUSAL and SPECIALISED_FORM:  # one loop, every block masked: only one loop specialises
        acc, l_i, m_i, v_prev = _fp8_hopper_inner(
            acc, l_i, m_i, v_prev, q, row_scale_q, desc_k, desc_vt, KS, VS, kv_row0, kv_bh * HEAD_DIM, ks_base,
            0, (start_m + 1) * BLOCK_M, offs_m, offs_n, BLOCK_N, SCALE_BLOCK, True, EXP_F16, EXP_POLY, INTERPRETED,
            WS_KEY_LOOP)
    elif CAUSAL:  # two phases: the blocks left of the diagonal unmasked, then the diagonal masked
        acc, l_i, m_i, v_prev = _fp8_hopper_inner(
            acc, l_i, m_i, v_prev, q, row_scale_q, desc_k, desc_vt, KS, VS, kv_row0, kv_bh * HEAD_DIM, ks_base,
            0, start_m * BLOCK_M, offs_m, offs_n, BLOCK_N, SCALE_BLOCK, False, EXP_F16, EXP_POLY, INTERPRETED)
        acc, l_i, m_i, v_prev = _fp8_hopper_inner(
            acc, l_i, m_i, v_prev, q, row_scale_q, desc_k, desc_vt, KS, VS, kv_row0, kv_bh * HEAD_DIM, ks_base,
            start_m * BLOCK_M, (start_m + 1) * BLOCK_M, offs_m, offs_n, BLOCK_N, SCALE_BLOCK, True, EXP_F16, EXP_POLY, INTERPRETED)
    else:
        acc, l_i, m_i, v_prev = _fp8_hopper_inner(
            acc, l_i, m_i, v_prev, q, row_scale_q, desc_k, desc_vt, KS, VS, kv_row0, kv_bh * HEAD_DIM, ks_base,
            0, N_CTX, offs_m, offs_n, BLOCK_N, SCALE_BLOCK, False, EXP_F16, EXP_POLY, INTERPRETED,
            WS_KEY_LOOP)
    out = acc * (v_prev / l_i)[:, None]
    if SPECIALISED_FORM:  # by pointers: the 4-warp specialised form refuses the descriptor store
        o_rows = (q_row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        tl.store(O + o_rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], out.to(O.dtype.element_ty))
    else:
        desc_o.store([q_row0, 0], out.to(desc_o.dtype))




@triton.jit
def _fp8_hopper_kernel(desc_q, desc_k, desc_vt, desc_o, O, QS, KS, VS,
                       sm_scale, N_CTX, N_Q_HEADS, N_BLOCKS_SCALE,
                       GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                       ORDER: tl.constexpr, EXP_F16: tl.constexpr, EXP_POLY: tl.constexpr,
                       INTERPRETED: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False):
    """One query block of one (batch, query head), on contiguous tensors viewed as 2-D matrices.

    Q ``[B*Hq*N, D]``, K ``[B*Hkv*N, D]``, V^T ``[B*Hkv*D, N]`` (e4m3), O ``[B*Hq*N, D]``; the scales
    ``[B, H, N_BLOCKS_SCALE]`` contiguous. ``SCALE_BLOCK`` is a multiple of ``BLOCK_N``.

    ``WARP_SPECIALIZE`` (4 warps): the form Triton 3.6 turns into a producer and two consumer warpgroups
    (see :func:`launch_fp8_hopper`): one loop (causal: every block masked), the output stored through the
    pointer ``O``, and the query tile's scale read as one number (``BLOCK_M <= SCALE_BLOCK``: the tile lies in
    one scale block), because a vector of scales loaded by pointers before the loop stops the compiler's
    warp-specialisation pass (an internal assertion in ``WSLowerToken.cpp``).
    """
    tl.static_assert(SCALE_BLOCK % BLOCK_N == 0)
    if CAUSAL:  # the diagonal phase covers whole key blocks
        tl.static_assert(BLOCK_M % BLOCK_N == 0)
    if WARP_SPECIALIZE:
        tl.static_assert(SCALE_BLOCK % BLOCK_M == 0)
    bh, start_m = _program_tile(N_CTX, N_Q_HEADS, BLOCK_M, ORDER, CAUSAL, GROUP_SIZE)
    _fp8_hopper_tile(bh, start_m, desc_q, desc_k, desc_vt, desc_o, O, QS, KS, VS, sm_scale, N_CTX, N_Q_HEADS,
                     N_BLOCKS_SCALE, GROUP_SIZE, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, SCALE_BLOCK, EXP_F16, EXP_POLY,
                     INTERPRETED, WARP_SPECIALIZE, WARP_SPECIALIZE)


@triton.jit
def _fp8_hopper_persistent_kernel(desc_q, desc_k, desc_vt, desc_o, O, QS, KS, VS,
                                  sm_scale, N_CTX, N_Q_HEADS, N_BLOCKS_SCALE, GRID0, GRID1,
                                  GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                                  ORDER: tl.constexpr, EXP_F16: tl.constexpr, EXP_POLY: tl.constexpr,
                                  INTERPRETED: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Persistent: each program walks the tiles ``program_id, program_id + programs, ...`` of the ``GRID0 x GRID1``
    grid of :func:`_fp8_hopper_kernel`'s launch, in the specialised form; ``WARP_SPECIALIZE`` specialises this
    tile loop (as :func:`.fast._attn_fwd_persistent_kernel` does), not the key loop inside it."""
    tl.static_assert(SCALE_BLOCK % BLOCK_N == 0)
    tl.static_assert(SCALE_BLOCK % BLOCK_M == 0)
    if CAUSAL:
        tl.static_assert(BLOCK_M % BLOCK_N == 0)
    for t in tl.range(tl.program_id(0), GRID0 * GRID1, tl.num_programs(0), warp_specialize=WARP_SPECIALIZE):
        bh, start_m = _tile_at(t % GRID0, t // GRID0, GRID0, GRID1, N_Q_HEADS, ORDER, CAUSAL, GROUP_SIZE)
        _fp8_hopper_tile(bh, start_m, desc_q, desc_k, desc_vt, desc_o, O, QS, KS, VS, sm_scale, N_CTX, N_Q_HEADS,
                         N_BLOCKS_SCALE, GROUP_SIZE, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, SCALE_BLOCK, EXP_F16,
                         EXP_POLY, INTERPRETED, True, False)


def hopper_config(head_dim: int, block_size: int, causal: bool = False) -> dict:
    """The Hopper kernel's tiles and launch: the fastest of ``benchmarks/tune_fp8.py --hopper`` on the H200.

    ``results/tune_fp8_hopper.json`` (N = 4k and 16k, 16k tokens, GQA 32/8) chose the tiles: causal, ``64 x 64``
    on 4 warps (133 registers: several programs share an SM) at D = 128 and 64 (run 2); not causal, ``64 x 128``
    on 4 warps at D = 128 (run 3: 1-4% ahead of ``128 x 64``; the causal loop's diagonal phase needs
    ``BLOCK_M`` a multiple of ``BLOCK_N``, so only without the mask) and ``128 x 128`` on 4 warps, 3 stages at
    D = 64 (run 2). At D = 128 ``results/tune_fp8_maxnreg.json`` (``--maxnreg``) then chose 2 stages with a cap
    on registers per thread, so that more programs fit on an SM (shared memory and registers both): ``64 x 64``
    capped at 128 (four programs per SM) with the mask, ``64 x 128`` capped at 168 (three) without it. Under
    either cap ptxas serialises the kernel's wgmma for want of registers (its warning C7512, Triton 3.6; the
    uncapped launches have none): the extra programs per SM were measured to be worth more than the products'
    overlap within one program.
    """
    if causal:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
        if head_dim > 64:
            cfg.update(num_stages=2, maxnreg=128)
    elif head_dim > 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], block_size)
    return cfg


def hopper_unsupported_reason(q8, block_size: int, config=None, causal: bool = False) -> str | None:
    """Why :func:`launch_fp8_hopper` cannot take these (validated) e4m3 inputs; ``None`` if it can."""
    b, hq, n, d = q8.shape
    cfg = dict(hopper_config(d, block_size, causal), **(config or {}))
    if d not in HOPPER_HEAD_DIMS:
        return f"head dim {d}: the Hopper launch takes {HOPPER_HEAD_DIMS}"
    if n == 0 or n % max(cfg["BLOCK_M"], cfg["BLOCK_N"]) or block_size % cfg["BLOCK_N"]:
        return f"N = {n} and block_size = {block_size}: the Hopper launch needs N a multiple of " \
               f"{max(cfg['BLOCK_M'], cfg['BLOCK_N'])} and block_size of {cfg['BLOCK_N']}"
    if b * hq * n >= 2**31:  # the kernel's tile coordinates are 32-bit rows of the 2-D views, as in .fast
        return "too many rows for 32-bit tile coordinates"
    if TensorDescriptor is None:
        return "this Triton has no host tensor descriptors"
    if q8.device.type != "cuda":
        return "the Hopper launch runs on a GPU (the tests run it in the interpreter through launch_fp8_hopper)"
    if torch.cuda.get_device_capability(q8.device)[0] != 9:
        return "not a Hopper GPU (compute capability 9.x)"
    return None


def launch_fp8_hopper(q8, k8, vt8, q_scale, k_scale, v_scale, causal: bool, block_size: int, out_dtype,
                      config=None):
    """:func:`launch_fp8`'s output from :func:`_fp8_hopper_kernel` (``N`` a multiple of ``BLOCK_M``, D of 64 or 128).

    Runs in the interpreter too (the CPU tests call it directly); ``config``'s keys replace
    :func:`hopper_config`'s (``maxnreg=None``: no register cap). ``WARP_SPECIALIZE``: the key loop specialised
    (a producer and two consumer warpgroups); ``PERSISTENT`` (with ``N_PROGRAMS``, default one per SM):
    :func:`_fp8_hopper_persistent_kernel`, whose tile loop ``WARP_SPECIALIZE`` then specialises instead.
    """
    b, hq, n, d = q8.shape
    hkv = k8.shape[1]
    cfg = dict(hopper_config(d, block_size, causal), **(config or {}))
    bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    order = cfg.pop("ORDER", ORDER_KV_GROUPED)
    exp_f16 = cfg.pop("EXP_F16", 0)
    exp_poly = cfg.pop("EXP_POLY", 0)
    warp_specialize = bool(cfg.pop("WARP_SPECIALIZE", False))
    persistent = bool(cfg.pop("PERSISTENT", False))
    n_programs = cfg.pop("N_PROGRAMS", None)
    if (warp_specialize or persistent) and block_size % bm:
        raise ValueError(f"a warp-specialised or persistent launch needs BLOCK_M = {bm} to divide block_size = "
                         f"{block_size} (one query scale per tile)")
    if warp_specialize and cfg.get("num_warps", 4) == 4:
        refuse_specialised_on_gpu(q8.device)
    if cfg.get("maxnreg") is None:  # a config's maxnreg=None: no cap on registers per thread
        cfg.pop("maxnreg", None)
    q8, k8, vt8 = q8.contiguous(), k8.contiguous(), vt8.contiguous()
    scales = [s.contiguous() for s in (q_scale, k_scale, v_scale)]
    o = torch.empty((b, hq, n, d), dtype=out_dtype, device=q8.device)

    def desc(t, rows, cols, box):
        return TensorDescriptor(t, shape=[rows, cols], strides=[cols, 1], block_shape=box)

    descs = (desc(q8, b * hq * n, d, [bm, d]), desc(k8, b * hkv * n, d, [bn, d]),
             desc(vt8, b * hkv * d, n, [d, bn]), desc(o, b * hq * n, d, [bm, d]))
    grid = grid_shape(order, b, hq, hkv, n // bm)
    if persistent:  # n_programs (default one per SM; 4 in the interpreter) walk the grid's tiles
        if n_programs is None:
            n_programs = torch.cuda.get_device_properties(q8.device).multi_processor_count if q8.is_cuda else 4
        HOPPER_LAST["compiled"] = _fp8_hopper_persistent_kernel[(min(int(n_programs), grid[0] * grid[1]),)](
            *descs, o, *scales, 1.0 / math.sqrt(d), n, hq, triton.cdiv(n, block_size), grid[0], grid[1],
            GROUP_SIZE=hq // hkv, HEAD_DIM=d, CAUSAL=bool(causal), BLOCK_M=bm, BLOCK_N=bn, SCALE_BLOCK=block_size,
            ORDER=order, EXP_F16=exp_f16, EXP_POLY=exp_poly, INTERPRETED=q8.device.type == "cpu",
            WARP_SPECIALIZE=warp_specialize, **cfg,
        )
        return o
    HOPPER_LAST["compiled"] = _fp8_hopper_kernel[grid](
        *descs, o, *scales, 1.0 / math.sqrt(d), n, hq, triton.cdiv(n, block_size),
        GROUP_SIZE=hq // hkv, HEAD_DIM=d, CAUSAL=bool(causal), BLOCK_M=bm, BLOCK_N=bn, SCALE_BLOCK=block_size,
        ORDER=order, EXP_F16=exp_f16, EXP_POLY=exp_poly, INTERPRETED=q8.device.type == "cpu",
        WARP_SPECIALIZE=warp_specialize, **cfg,
    )
    return o


# Lesson 11's Gluon FP8 entry (hopper_ws.attention_fp8, its serial loop) from this many tokens on, where
# gluon_fp8_applies says it can run. On an H100, over three ladders (results/fp8_bench_gluon_h100*.json), it ran
# 1.01-1.16x this module's Hopper launch at N >= 4096 and 0.84-0.95x at N <= 2048 (the two main sweeps,
# results/forward_bench_lesson11_h100*.json: 0.94-1.16x at N >= 4096, 0.83-0.96x below). None: never.
GLUON_MIN_N: int | None = 4096
# Whether that route runs the entry's persistent grid (hopper_ws.attention_fp8(..., persistent=True): one program per
# SM walking the work tiles, the next tile's Q loading under this one's loop) rather than a program per tile. Off:
# on an H100 the persistent grid ran 0.95-0.995x a program per tile causal and 0.94-0.95x without the mask, N 4k-16k
# (benchmarks/route_check.py --modes fp8persistent fp8persistent_noncausal, results/route_check_fp8_h100.json).
GLUON_PERSISTENT: bool = False
# Whether that route (a program per tile) runs the entry's wide tiles, FA3's 256 keys a K/V tile
# (hopper_ws.attention_fp8(..., block_n=256)) where N is a multiple of 256. Off until timed on a GPU: compiled for sm_90
# and checked in the CPU model only (results/NOTES.md; benchmarks/gluon_ab.py --wide and route_check.py --modes fp8wide
# time it).
GLUON_WIDE: bool = False
# Whether that route walks its grid a kv head's query heads at a time (hopper_ws.kv_head_order; a program per tile
# reads the walk from its grid's shape, hopper_ws._grid_tile). The forty-eighth session's kernel A/B of a program per
# tile walked so (results/gluon_ab_walk_h100.json, an H100) read 0.960x / 1.033x / 1.032x causal and 1.037x / 1.026x /
# 1.047x without the mask at 4k / 8k / 16k; not yet timed as a route (route_check.py --modes fp8walk
# fp8walk_noncausal), so off.
GLUON_WALK: bool = False


def gluon_fp8_applies(q8, k8, vt8, q_scale, k_scale, v_scale, block_size: int = 128, *,
                      min_n: int | None = None) -> bool:
    """Whether :func:`flash_attention_fp8` runs lesson 11's Gluon FP8 entry for these e4m3 inputs: ``min_n``
    (default :data:`GLUON_MIN_N`) set and reached, D = 128 (the head dim it was timed at), and inputs
    ``hopper_ws.attention_fp8`` takes on this machine (a Hopper GPU, or the CPU inside ``gluon_cpu.running()``)."""
    min_n = GLUON_MIN_N if min_n is None else min_n
    if min_n is None or q8.shape[-1] != 128 or q8.shape[2] < min_n:
        return False
    from . import gluon_cpu

    if not gluon_cpu.can_run(q8):  # before importing Gluon: elsewhere it is never loaded
        return False
    from .hopper_ws import unsupported_reason  # Gluon: imported only where the route is set and can run

    return unsupported_reason(q8, k8, vt8, (q_scale, k_scale, v_scale), block_size) is None


def flash_attention_fp8(q, k, v, causal: bool = False, *, q_scale=None, k_scale=None, v_scale=None,
                        block_size: int = 128):
    """Attention ``softmax(q k^T / sqrt(D)) v`` with both products in FP8 (e4m3).

    Either bf16/fp16 (fp32 on a CPU, or anywhere) inputs, quantised here with
    :func:`quantize_fp8` (one scale per ``block_size`` tokens of each head),
    the result in q's dtype; or ``torch.float8_e4m3fn`` inputs with their
    three scales as :func:`quantize_fp8` makes them, the result in bf16 on a
    GPU (float32 in the CPU interpreter). ``q`` is ``[B, Hq, N, D]``, ``k,
    v`` ``[B, Hkv, N, D]`` (``Hq`` a multiple of ``Hkv``), any strides, ``16 <=
    D <= 256``. Bad input raises a ``ValueError`` of one sentence. Where :data:`GLUON_MIN_N` is set and
    :func:`gluon_fp8_applies`, lesson 11's Gluon FP8 entry computes it (on its persistent grid while
    :data:`GLUON_PERSISTENT`; on its wide tiles while :data:`GLUON_WIDE`; walked a kv head at a time while
    :data:`GLUON_WALK`).
    """
    fp8_in = validate_fp8(q, k, v, q_scale, k_scale, v_scale, block_size)
    if fp8_in:
        out_dtype = torch.float32 if q.device.type == "cpu" else torch.bfloat16
        q8, k8, v8 = q, k, v
    else:
        out_dtype = q.dtype
        (q8, q_scale), (k8, k_scale), (v8, v_scale) = (quantize_fp8(t, block_size) for t in (q, k, v))
    vt8 = transpose_keys(v8)  # K-major: [B, Hkv, D, N], the keys contiguous
    if gluon_fp8_applies(q8, k8, vt8, q_scale, k_scale, v_scale, block_size):
        from .hopper_ws import attention_fp8 as gluon_fp8
        from .hopper_ws import kv_head_order

        wide = GLUON_WIDE and not GLUON_PERSISTENT and q8.shape[2] % 256 == 0
        heads = kv_head_order(q8.shape[1], q8.shape[1] // k8.shape[1]) if GLUON_WALK else None
        return gluon_fp8(q8, k8, vt8, q_scale, k_scale, v_scale, causal, block_size=block_size,
                         persistent=GLUON_PERSISTENT, block_n=256 if wide else 128,
                         heads_together=heads)[0].to(out_dtype)
    if hopper_unsupported_reason(q8, block_size, causal=causal) is None:
        return launch_fp8_hopper(q8, k8, vt8, q_scale, k_scale, v_scale, causal, block_size, out_dtype)
    return launch_fp8(q8, k8, vt8, q_scale, k_scale, v_scale, causal, block_size, out_dtype)


# -----------------------------------------------------------------------------
# A persistent kernel's schedule (lesson 11, exercise 2): the course's answer
# -----------------------------------------------------------------------------
def lpt_schedule(tiles, costs, n_programs):
    """Each program's tiles, longest first to the least-loaded program (LPT, Graham 1969).

    ``tiles`` a list of hashable tiles (e.g. ``(query_block, head)``),
    ``costs`` their costs, ``n_programs`` >= 1. Returns ``n_programs`` lists;
    every tile appears in exactly one, and the longest program's load is at
    most ``4/3`` of the best possible.
    """
    import heapq

    heap = [(0.0, p) for p in range(n_programs)]
    out = [[] for _ in range(n_programs)]
    for i in sorted(range(len(tiles)), key=lambda i: -costs[i]):
        load, p = heapq.heappop(heap)
        out[p].append(tiles[i])
        heapq.heappush(heap, (load + costs[i], p))
    return out


def schedule_makespan(schedule, tiles, costs) -> float:
    """The largest program load of ``schedule`` (lists of tiles), with each tile's cost from ``tiles``/``costs``."""
    cost_of = dict(zip(tiles, costs))
    return max((sum(cost_of[t] for t in program) for program in schedule), default=0.0)
