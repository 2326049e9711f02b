"""Other layouts of the backward, measured against lesson 07's pair: the Triton ones were slower, the Gluon one faster.

Lesson 07's backward (:mod:`.backward`) launches two kernels after the
``delta`` preprocess: one program per key block for ``dK, dV`` and one per
query block for ``dQ``. Both recompute ``P``, so the pair does 7 matrix
products per tile where a one-pass backward does 5. This module keeps the
same tile arithmetic and lays the work out differently, in one kernel,
:func:`_attn_bwd_fast`, with two modes:

- ``"fused"`` (deterministic). Program ``i`` computes ``dK, dV`` for key
  block ``i`` (every query head of its GQA group, in a fixed order) and then
  ``dQ`` for query block ``i`` of the same heads. Under a causal mask key
  block ``i`` is seen by the query blocks after it and query block ``i`` sees
  the key blocks before it, so every program does the same work: one launch
  with no long tail. No two programs write the same rows, so the gradients
  are the same bit for bit on every run.
- ``"atomic"`` (one pass). The ``dK, dV`` loop also computes each tile's
  ``dS K`` and adds it into an fp32 ``dQ`` buffer (5 products per tile,
  FlashAttention-2's scheme), with ``tl.atomic_add`` or, ``use_tma``, TMA's
  bulk reduce-add. The order in which programs add into a row changes from
  run to run and fp32 addition is not associative, so ``dQ`` differs in its
  last bits between runs.

Measured on the H200 (``benchmarks/tune_backward.py``, ``results/tune_backward.json``:
bf16, causal, GQA 32/8, D = 128, triton 3.6), every configuration of both
modes was slower than lesson 07's pair (13.5-13.7 ms at N = 16k against
14.2 ms for the best fused one and 14.6 ms for the best atomic one; cuDNN
10.5 ms): at 255 registers per thread the compiler spills 50-150 values per
thread in both, where lesson 07's dQ kernel fits and its dK/dV kernel
spills 40 (compiled as the H200 does: :mod:`.targets`). Halving the
key block to 64 on 8 warps (run 3) did not bring either under the limit
(255 registers, 4-90 spilled) and ran 1.9-2.8x slower than the pair. So
:func:`course_utils.kernels.backward.attention_backward` (and autograd through
it) stays on lesson 07's kernels, and this kernel runs only when
:func:`attention_backward_fast` is called.

A third mode, ``"flat"`` (twenty-sixth session, compiled without a GPU and
not yet timed), keeps lesson 07's two kernels' split of the work and changes
the dK/dV kernel, :func:`_attn_bwd_dkdv_flat`: its tiles come through TMA
descriptors, and the group's query heads and their query blocks are one flat
loop, so that ``warp_specialize`` can split it the way FlashAttention-3's
backward is split, a producer issuing the copies and two consumer warpgroups
of half the key block each. Compiled for sm_90 with the H200's triton 3.6
(:mod:`.targets`), ``32 x 128`` on 4 warps became 12 warps with no spills
(the pair's dK/dV kernel spills 40 values per thread at its launch). Causal,
that one loop masks every block. ``dQ`` is lesson 07's kernel
(:func:`.backward.launch_dq`, which does not spill), or with ``flat_dq``
:func:`_attn_bwd_dq_flat`: lesson 07's dQ step with its tiles, ``lse`` and
``delta`` too, through TMA descriptors, one loop that Triton 3.6 also
specialises (lesson 07's dQ kernel does not: its ``lse`` and ``delta``,
loaded by pointers before the loop, stop the compiler's pass), 12 warps
and no spills at ``128 x 32`` and ``128 x 64`` (twenty-seventh session, not
yet timed).

A fourth mode, ``"gluon"``, is lesson 11's backward written in Gluon
(:mod:`.hopper_ws_bwd`: a TMA loader warp and two consumer warpgroups for
dK/dV, and its mirror image for dQ; deterministic, a Hopper GPU only). Its
configuration maps onto this one's fields: ``block_m1`` the dK/dV kernel's
query rows per tile (32 or 64), ``block_n1`` its 128 keys, ``block_m2`` the
dQ kernel's 128 query rows, ``block_n2`` its keys per tile (64 or 128),
``num_stages`` the tiles in flight (2 or 3), 4 warps, always through TMA.
On an H100 (``results/hopper_ws_bwd_probe_h100.json``) :data:`GLUON_DEFAULT`
ran at 1.13-1.24x lesson 07's pair and 0.86-0.91x cuDNN's backward, and as
a whole training step (``python -m course_utils.bench --training --gluon``,
three runs, ``results/training_bench_gluon_h100*.json``) at 1.03-1.14x the
step with lesson 07's pair: it is the autograd default.

Autograd: :class:`FastBackwardFunction` is lesson 07's autograd function
with this module's backward; ``kernels.flash_attention`` uses it when
:data:`AUTOGRAD_CONFIG` is set (:data:`GLUON_DEFAULT` by default), and it
runs that configuration wherever :func:`autograd_config` says it applies: on
a Hopper GPU; lesson 07's pair everywhere else, and for sinks or lesson
12's keywords.

It covers self-attention (``N_q == N_k``), ``N`` a multiple of the largest
block, ``D`` of 64 or 128, 16-bit inputs, causal or not, MHA/GQA/MQA;
:func:`unsupported_reason` says what it does not take. It runs in the
interpreter too (all but TMA's reduce-add), which is how
``tests/test_kernels_fast_backward.py`` checks it on the CPU; every
configuration in :data:`CONFIGS` is checked on a Hopper GPU by
``tests/test_gpu_fast_backward.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backward import BackwardConfig, FlashAttentionFunction, launch_dq, launch_preprocess
from .fast import refuse_specialised_on_gpu
from .decode import _sm_count
from .forward import _capability

try:  # host-side TMA descriptors (Triton >= 3.3); without them use_tma is refused
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["FastBackwardConfig", "CONFIGS", "default_config", "supports", "unsupported_reason",
           "attention_backward_fast", "MODES", "AUTOGRAD_CONFIG", "autograd_config", "FastBackwardFunction",
           "flash_attention_fast_backward", "GLUON_DEFAULT", "WINDOW_MODES", "GLUON_SINKS", "sink_walk_fits",
           "GLUON_WALK_ROWS", "gluon_walk_rows"]

MODES = ("fused", "atomic", "flat", "gluon")
WINDOW_MODES = ("flat", "gluon")  # the modes that take lesson 08's window (the gluon mode its sinks too)


@dataclass(frozen=True)
class FastBackwardConfig:
    """One launch of :func:`_attn_bwd_fast`.

    ``block_m1 x block_n1``: the dK/dV loop's query and key tiles (the key
    block stays in registers, the query blocks stream past it);
    ``block_m2 x block_n2``: the dQ loop's (the mirror image; ``"fused"`` only,
    and ``block_m2 == block_n1`` so that program ``i`` owns key block ``i`` and
    query block ``i``). ``mode``: ``"fused"`` (deterministic) or ``"atomic"``.
    ``use_tma``: the dK/dV loop loads its ``q`` and ``dO`` tiles through TMA
    descriptors, and the atomic mode adds its ``dQ`` tiles with TMA's
    reduce-add (one bulk ``cp.reduce.async.bulk`` per tile instead of one
    atomic per element).
    ``"flat"``: ``block_m1 x block_n1`` (``num_warps``, ``num_stages``) is
    :func:`_attn_bwd_dkdv_flat`'s launch, which always loads through TMA
    (``use_tma`` must be True); ``block_m2 x block_n2`` is lesson 07's dQ
    kernel's, on its Hopper launch's 8 warps and 3 stages.
    ``warp_specialize`` (``"flat"`` only): the dK/dV loop as
    ``tl.range(..., warp_specialize=True)``.
    ``flat_dq`` (``"flat"`` only): ``dQ`` by :func:`_attn_bwd_dq_flat` (every
    tile through TMA, ``lse`` and ``delta`` too; one loop, specialised with
    ``warp_specialize``) at ``block_m2 x block_n2`` on this config's warps and
    stages, instead of lesson 07's dQ kernel.
    ``"gluon"``: :mod:`.hopper_ws_bwd`'s kernels, ``block_m1`` and ``block_n2``
    its ``block_m`` and ``dq_block_n``, ``num_stages`` its ``num_buffers``; the
    other fields are fixed by its layout (``block_n1 = block_m2 = 128``, 4 warps,
    ``use_tma``), checked by :func:`unsupported_reason` at the call.
    """

    mode: str = "fused"
    block_m1: int = 64
    block_n1: int = 128
    block_m2: int = 128
    block_n2: int = 64
    num_warps: int = 8
    num_stages: int = 2
    use_tma: bool = False
    warp_specialize: bool = False
    flat_dq: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for value in (self.block_m1, self.block_n1, self.block_m2, self.block_n2):
            if value < 16 or value & (value - 1):
                raise ValueError(f"block sizes must be powers of two >= 16 (tl.dot needs 16), got {value}")
        if self.block_n1 % self.block_m1 or self.block_m2 % self.block_n2:
            raise ValueError("block_n1 must be a multiple of block_m1, and block_m2 of block_n2 "
                             "(the causal loops split at block boundaries)")
        if self.mode == "fused" and self.block_m2 != self.block_n1:
            raise ValueError("the fused mode needs block_m2 == block_n1: program i owns key block i and query block i")
        if self.mode == "flat" and not self.use_tma:
            raise ValueError("the flat mode loads every tile through TMA descriptors: it needs use_tma=True")
        if self.warp_specialize and self.mode != "flat":
            raise ValueError("warp_specialize is the flat mode's (its dK/dV loop is the one that compiles so)")
        if self.flat_dq and self.mode != "flat":
            raise ValueError("flat_dq is the flat mode's (its dQ kernel loads through TMA like its dK/dV kernel)")

    @property
    def largest_block(self) -> int:
        return max(self.block_m1, self.block_n1, self.block_m2, self.block_n2)

    def short(self) -> str:
        tail = f" dq {self.block_m2}x{self.block_n2}" if self.mode in ("fused", "flat", "gluon") else ""
        if self.mode == "flat":  # always TMA: say whether it is warp-specialised instead
            return (f"flat dkdv {self.block_m1}x{self.block_n1} w{self.num_warps} s{self.num_stages}"
                    + (" ws" if self.warp_specialize else "") + tail + (" flat" if self.flat_dq else ""))
        return (f"{self.mode} dkdv {self.block_m1}x{self.block_n1}{tail} "
                f"w{self.num_warps} s{self.num_stages}" + (" tma" if self.use_tma else ""))


# The fastest configurations of each mode on the H200 (benchmarks/tune_backward.py,
# results/tune_backward.json); tests/test_gpu_fast_backward.py checks every one of them.
CONFIGS = (
    FastBackwardConfig("fused", 64, 128, 128, 64, 8, 3),  # the fused default: 14.28 ms at N = 16k
    FastBackwardConfig("fused", 64, 128, 128, 64, 8, 3, True),
    FastBackwardConfig("fused", 64, 64, 64, 64, 4, 2),
    FastBackwardConfig("atomic", 64, 128, 128, 64, 8, 3),  # the atomic default: 14.58 ms at N = 16k
    FastBackwardConfig("atomic", 64, 128, 128, 64, 8, 2),
    FastBackwardConfig("atomic", 64, 128, 128, 64, 8, 3, True),
)

_DEFAULT = {"fused": CONFIGS[0], "atomic": CONFIGS[3]}


# The flat mode's launch until one is measured: 32 x 128 on 8 warps, not specialised (209 registers, no spills when
# compiled for sm_90 with triton 3.6: results/sm90_compiles.json), with lesson 07's dQ launch. The specialised
# 4-warp launches deadlock on the H200 (results/ws_smoke_h200.txt): fast.refuse_specialised_on_gpu.
FLAT_DEFAULT = FastBackwardConfig("flat", 32, 128, 128, 32, 8, 2, True)


@functools.lru_cache(maxsize=None)
def _gluon_config_reason(config: FastBackwardConfig) -> str | None:
    """Why the gluon mode cannot run ``config`` whatever the inputs (the fields its layout fixes, its options), or
    ``None``; remembered per configuration, which every training step asks about."""
    from . import hopper_ws_bwd

    fixed = dict(block_n1=hopper_ws_bwd.BLOCK_N, block_m2=hopper_ws_bwd.DQ_BLOCK_M, num_warps=4, use_tma=True,
                 warp_specialize=False, flat_dq=False)
    wrong = [f"{name}={getattr(config, name)!r}" for name, want in fixed.items() if getattr(config, name) != want]
    if wrong:
        return (f"the gluon mode's layout fixes {', '.join(f'{n}={w!r}' for n, w in fixed.items())} "
                f"(got {', '.join(wrong)})")
    try:
        hopper_ws_bwd._validate_options(config.num_stages, config.block_m1, "gluon", config.block_n2)
    except ValueError as exc:
        return str(exc)
    return None


def _gluon_reason(q, k, v, config: FastBackwardConfig) -> str | None:
    """Why the gluon mode cannot run ``config`` on these inputs (its fields, then the inputs and the machine), or
    ``None``. Asked at the call, not when the config is made: :mod:`.hopper_ws_bwd` is Gluon, which the package
    does not import until a gluon-mode call needs it."""
    reason = _gluon_config_reason(config)
    if reason:
        return reason
    from .hopper_ws import unsupported_reason as gluon_reason

    return gluon_reason(q, k, v)


# The gluon mode's launch: the fastest of hopper_ws_probe.py --kind bwd on an H100
# (results/hopper_ws_bwd_probe_h100.json: 64-row dK/dV tiles, the Gluon dQ on 64-key tiles, two slots).
GLUON_DEFAULT = FastBackwardConfig("gluon", 64, 128, 128, 64, 4, 2, True)


def default_config(mode: str = "fused") -> FastBackwardConfig:
    """The configuration :func:`attention_backward_fast` uses for ``mode`` (the fastest measured, D = 128;
    the flat mode's is not measured yet)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return {"flat": FLAT_DEFAULT, "gluon": GLUON_DEFAULT}.get(mode) or _DEFAULT[mode]


def unsupported_reason(q, k, v, config: FastBackwardConfig | None = None) -> str | None:
    """Why the fast backward cannot take this call (``None``: it can)."""
    cfg = config or default_config()
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: the fast backward takes float16 or bfloat16"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k and v must share one dtype"
    if q.shape[-1] not in (64, 128):
        return f"head dim {q.shape[-1]}: the fast backward takes 64 or 128"
    if q.shape[2] != k.shape[2]:
        return "the fast backward takes self-attention only (as many keys as queries)"
    if cfg.use_tma and TensorDescriptor is None:
        return "use_tma (and the flat mode) need triton.tools.tensor_descriptor (Triton >= 3.3)"
    if q.shape[2] % cfg.largest_block:
        return f"N = {q.shape[2]} is not a multiple of {cfg.largest_block} (the largest block)"
    if cfg.mode == "gluon":
        return _gluon_reason(q, k, v, cfg)
    return None


def supports(q, k, v, config: FastBackwardConfig | None = None) -> bool:
    """``True`` when :func:`attention_backward_fast` takes these inputs."""
    return unsupported_reason(q, k, v, config) is None


# -----------------------------------------------------------------------------
# The kernel, in three stages: the dK/dV tile step (and, atomic, its dQ share),
# the dQ tile step, and the program that runs the loops.
# -----------------------------------------------------------------------------
@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                stride_qn, stride_qd, stride_don, stride_dod, stride_dqn, stride_dqd,
                offs_n, offs_d, lo, hi, qk_scale, sm_scale, desc_q, desc_do, desc_dq, row0,
                BLOCK_M: tl.constexpr, MASK: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr):
    """dK, dV (keys on the rows) from query blocks [lo, hi); with ATOMIC_DQ also dQ's share.

    With USE_TMA the q and dO tiles come through descriptors over the 2-D
    ``[B*H_q*N, D]`` views (``row0``: this head's first row there).
    """
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if USE_TMA:
            q = desc_q.load([row0 + start_m, 0])
            do = desc_do.load([row0 + start_m, 0])
        else:
            q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd)
            do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod)
        lse2 = tl.load(lse_base + offs_m) * 1.4426950408889634  # natural log -> base 2
        delta = tl.load(delta_base + offs_m)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASK:  # the diagonal tiles: key j is invisible to query i < j
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = (p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        if ATOMIC_DQ:  # this tile's share of dQ = sm_scale * dS K, added into the fp32 buffer
            dq = tl.dot(tl.trans(ds_t), k) * sm_scale
            if USE_TMA:
                desc_dq.atomic_add([row0 + start_m, 0], dq)
            else:
                tl.atomic_add(dq_base + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd, dq,
                              sem="relaxed")
    return dk, dv


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
              offs_m, offs_d, lo, hi, qk_scale, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """dQ of one query block from key blocks [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASK:
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _attn_bwd_fast(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, desc_q, desc_do, desc_dq,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lseb, stride_lseh, stride_deltab, stride_deltah,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    n_kv_heads, group_size, N, sm_scale,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    kv_head = pid_bh % n_kv_heads
    offs_d = tl.arange(0, HEAD_DIM)
    qk_scale = sm_scale * 1.4426950408889634
    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh

    # Stage 1: dK, dV of key block `pid`, summed over the group's query heads in a fixed order.
    start_n = pid * BLOCK_N1
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    for g in range(0, group_size):
        q_head = kv_head * group_size + g
        q_base = Q + b * stride_qb + q_head * stride_qh
        do_base = DO + b * stride_dob + q_head * stride_doh
        lse_base = LSE + b * stride_lseb + q_head * stride_lseh
        delta_base = DELTA + b * stride_deltab + q_head * stride_deltah
        dq_base = DQ + b * stride_dqb + q_head * stride_dqh
        row0 = (b * n_kv_heads * group_size + q_head) * N  # this head's first row in the 2-D views
        if CAUSAL:  # queries before start_n see none of these keys; the next BLOCK_N1 rows cross the diagonal
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                                 stride_qn, stride_qd, stride_don, stride_dod, stride_dqn, stride_dqd,
                                 offs_n, offs_d, start_n, start_n + BLOCK_N1, qk_scale, sm_scale,
                                 desc_q, desc_do, desc_dq, row0, BLOCK_M1, True, ATOMIC_DQ, USE_TMA)
            lo = start_n + BLOCK_N1
        else:
            lo = 0
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                             stride_qn, stride_qd, stride_don, stride_dod, stride_dqn, stride_dqd,
                             offs_n, offs_d, lo, N, qk_scale, sm_scale,
                             desc_q, desc_do, desc_dq, row0, BLOCK_M1, False, ATOMIC_DQ, USE_TMA)
    dk *= sm_scale
    tl.store(DK + b * stride_dkb + kv_head * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty))
    tl.store(DV + b * stride_dvb + kv_head * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty))

    # Stage 2 (fused mode): dQ of query block `pid` of each of the group's heads. Causal,
    # it sees key blocks [0, start_m) whole and [start_m, start_m + BLOCK_M2) across the diagonal.
    if not ATOMIC_DQ:
        start_m = pid * BLOCK_M2
        offs_m = start_m + tl.arange(0, BLOCK_M2)
        for g in range(0, group_size):
            q_head = kv_head * group_size + g
            q = tl.load(Q + b * stride_qb + q_head * stride_qh + offs_m[:, None] * stride_qn
                        + offs_d[None, :] * stride_qd)
            do = tl.load(DO + b * stride_dob + q_head * stride_doh + offs_m[:, None] * stride_don
                         + offs_d[None, :] * stride_dod)
            lse2 = tl.load(LSE + b * stride_lseb + q_head * stride_lseh + offs_m) * 1.4426950408889634
            delta = tl.load(DELTA + b * stride_deltab + q_head * stride_deltah + offs_m)
            dq = tl.zeros([BLOCK_M2, HEAD_DIM], dtype=tl.float32)
            if CAUSAL:
                dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, 0, start_m, qk_scale, BLOCK_N2, False)
                dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, start_m, start_m + BLOCK_M2, qk_scale, BLOCK_N2, True)
            else:
                dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, 0, N, qk_scale, BLOCK_N2, False)
            dq *= sm_scale
            tl.store(DQ + b * stride_dqb + q_head * stride_dqh + offs_m[:, None] * stride_dqn
                     + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty))


@triton.jit
def _attn_bwd_dkdv_flat(desc_q, desc_do, desc_k, desc_v, LSE, DELTA, DK, DV, N, group_size, sm_scale, window_size,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """dK, dV of key block ``program_id(0)`` of one (batch, kv head): every (query head, query block) in one loop.

    Contiguous tensors as 2-D views: Q, dO ``[B*H_q*N, D]``, K, V, dK, dV
    ``[B*H_kv*N, D]``; LSE (natural log), DELTA ``[B*H_q*N]``. The loop runs
    over ``i = g * n_m + m``, query head ``g`` of the group and query block
    ``m`` (causal: from the key block's own rows on; with ``WINDOW`` (causal,
    no sinks) only up to the last query within ``window_size`` of one of its
    keys), so that it is one loop
    Triton can warp-specialise; causal, every block is masked (a branch
    between masked and unmasked blocks does not compile specialised). The
    outputs are stored by pointers (a descriptor store does not compile in
    a specialised 4-warp program).
    """
    start_n = tl.program_id(0) * BLOCK_N
    kv_row = tl.program_id(1) * N + start_n  # this key block's first row in the 2-D views
    q_row0 = tl.program_id(1) * group_size * N  # the group's first query head's row 0
    offs_n = start_n + tl.arange(0, BLOCK_N)
    qk_scale = sm_scale * 1.4426950408889634
    k = desc_k.load([kv_row, 0])
    v = desc_v.load([kv_row, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:  # queries before the key block see none of it
        lo = start_n
    else:
        lo = 0
    if WINDOW:  # query i sees key j iff 0 <= i - j < window_size: none past start_n + BLOCK_N - 1 + window_size - 1
        n_m = tl.cdiv(tl.minimum(N, start_n + BLOCK_N + window_size - 1) - lo, BLOCK_M)
    else:
        n_m = (N - lo) // BLOCK_M
    for i in tl.range(0, group_size * n_m, warp_specialize=WARP_SPECIALIZE):
        g = i // n_m
        start_m = lo + (i - g * n_m) * BLOCK_M
        row = q_row0 + g * N + start_m
        q = desc_q.load([row, 0])
        do = desc_do.load([row, 0])
        lse2 = tl.load(LSE + row + tl.arange(0, BLOCK_M)) * 1.4426950408889634  # natural log -> base 2
        delta = tl.load(DELTA + row + tl.arange(0, BLOCK_M))
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if CAUSAL:
            distance = start_m + tl.arange(0, BLOCK_M)[None, :] - offs_n[:, None]  # i - j
            if WINDOW:
                p_t = tl.where((distance >= 0) & (distance < window_size), p_t, 0.0)
            else:
                p_t = tl.where(distance >= 0, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    dk *= sm_scale
    rows = (kv_row + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    tl.store(DK + rows[:, None] * HEAD_DIM + cols[None, :], dk.to(DK.dtype.element_ty))
    tl.store(DV + rows[:, None] * HEAD_DIM + cols[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _attn_bwd_dq_flat(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, DQ, N, group_size, sm_scale,
                      window_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """dQ of one query block of one (batch, query head): lesson 07's dQ step with every tile through TMA.

    The 2-D views of :func:`_attn_bwd_dkdv_flat`; LSE and DELTA as ``[1, B*H_q*N]``, read through
    descriptors too: a vector loaded by pointers outside the loop stops Triton 3.6's warp-specialisation pass
    (an assertion in ``WSLowerToken.cpp``), as in :func:`.fp8._fp8_hopper_kernel`. Causal, the one loop masks
    every block; the longest rows run first.
    """
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)  # batch * H_q + query head
    row = bh * N + start_m
    kv_row0 = (bh // group_size) * N  # its kv head's row 0 (B*H_q = group_size * B*H_kv)
    q = desc_q.load([row, 0])
    do = desc_do.load([row, 0])
    lse2 = desc_lse.load([0, row]).reshape([BLOCK_M]) * 1.4426950408889634  # natural log -> base 2
    delta = desc_delta.load([0, row]).reshape([BLOCK_M])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        hi = start_m + BLOCK_M
    else:
        hi = N
    if WINDOW:  # the block's first query sees keys from start_m - window_size + 1 on
        lo = (tl.maximum(start_m - window_size + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([kv_row0 + start_n, 0])
        v = desc_v.load([kv_row0 + start_n, 0])
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if CAUSAL:
            distance = offs_m[:, None] - (start_n + tl.arange(0, BLOCK_N))[None, :]  # i - j
            if WINDOW:
                p = tl.where((distance >= 0) & (distance < window_size), p, 0.0)
            else:
                p = tl.where(distance >= 0, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq *= sm_scale
    rows = (row + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(DQ + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], dq.to(DQ.dtype.element_ty))


def _desc_2d(t, rows):
    """A TMA descriptor over contiguous ``t`` viewed as ``[numel / D, D]``, ``rows`` rows a box."""
    d = t.shape[-1]
    return TensorDescriptor(t, shape=[t.numel() // d, d], strides=[d, 1], block_shape=[rows, d])


def _compile_stats(compiled) -> dict:
    """Registers per thread, spills, shared memory (bytes) and warps of a compiled launch (``None`` in the interpreter)."""
    meta = getattr(compiled, "metadata", None)
    return dict(registers=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                shared=getattr(meta, "shared", None), warps=getattr(meta, "num_warps", None))


def _flat_backward(q, k, v, do, lse, delta, causal, sm_scale, config, window_size=None):
    """The flat mode: dK, dV by :func:`_attn_bwd_dkdv_flat`, dQ by :func:`_attn_bwd_dq_flat` (``flat_dq``) or by
    lesson 07's (with a window, lesson 08's) kernel (:func:`.backward.launch_dq`); ``(compiled dK/dV launch,
    compiled dQ launch or None, grads)``."""
    B, n_q_heads, N, D = q.shape
    n_kv_heads = k.shape[1]
    q, k, v, do = (t.contiguous() for t in (q, k, v, do))
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    if config.warp_specialize and config.num_warps == 4:
        refuse_specialised_on_gpu(q.device)
    m1, n1 = config.block_m1, config.block_n1
    compiled = _attn_bwd_dkdv_flat[(N // n1, B * n_kv_heads)](
        _desc_2d(q, m1), _desc_2d(do, m1), _desc_2d(k, n1), _desc_2d(v, n1),
        lse, delta, dk, dv, N, n_q_heads // n_kv_heads, sm_scale, 0 if window_size is None else int(window_size),
        BLOCK_M=config.block_m1, BLOCK_N=config.block_n1, HEAD_DIM=D, CAUSAL=bool(causal),
        WINDOW=window_size is not None, WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if config.flat_dq:
        m2, n2 = config.block_m2, config.block_n2

        def row_desc(t):  # [B, H_q, N] fp32 as one row, m2 values a box
            return TensorDescriptor(t, shape=[1, t.numel()], strides=[t.numel(), 1], block_shape=[1, m2])
        compiled_dq = _attn_bwd_dq_flat[(N // m2, B * n_q_heads)](
            _desc_2d(q, m2), _desc_2d(do, m2), _desc_2d(k, n2), _desc_2d(v, n2), row_desc(lse), row_desc(delta),
            dq, N, n_q_heads // n_kv_heads, sm_scale, 0 if window_size is None else int(window_size),
            BLOCK_M=m2, BLOCK_N=n2, HEAD_DIM=D, CAUSAL=bool(causal), WINDOW=window_size is not None,
            WARP_SPECIALIZE=config.warp_specialize, num_warps=config.num_warps, num_stages=config.num_stages,
        )
    else:
        compiled_dq = None
        launch_dq(q, k, v, do, lse, delta, dq, causal, sm_scale,
                  BackwardConfig(dq_block_m=config.block_m2, dq_block_n=config.block_n2, dq_warps=8, dq_stages=3),
                  window_size=None if window_size is None else int(window_size))
    return compiled, compiled_dq, (dq, dk, dv)


def _validate_call(q, k, v, causal, config, window_size, sink_size=0) -> None:
    """What :func:`attention_backward_fast` takes at ``config``, else ``ValueError`` in one sentence."""
    reason = unsupported_reason(q, k, v, config)
    if reason:
        raise ValueError(reason)
    if sink_size and (config.mode != "gluon" or window_size is None):
        raise ValueError("sinks run in the gluon mode only, with a window")
    if window_size is not None:
        if config.mode not in WINDOW_MODES or not causal:
            raise ValueError("a window runs in the flat and gluon modes, with causal=True")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be a positive integer, got {window_size!r}")
    if config.mode != "gluon" and (k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        raise ValueError(f"{q.shape[1]} query heads cannot be shared evenly among {k.shape[1]} kv heads")


def attention_backward_fast(q, k, v, o, lse, do, causal=False, sm_scale=None, *, delta=None,
                            config: FastBackwardConfig | None = None, mode: str | None = None, stats=None,
                            window_size=None, sink_size=0, _validated=False):
    """``(dq, dk, dv)`` by the fast backward; the arguments are :func:`.backward.attention_backward`'s.

    ``delta = rowsum(do * o)`` ([B, H_q, N] fp32) may be passed in;
    otherwise lesson 07's preprocess kernel computes it. ``config`` (or ``mode``,
    which picks that mode's :func:`default_config`) chooses the launch.
    Raises ``ValueError`` with :func:`unsupported_reason`'s sentence for
    inputs it does not cover. ``window_size`` (``causal=True``, the flat
    and gluon modes only): key ``j`` visible from query ``i`` iff
    ``0 <= i - j < window_size``, lesson 08's window; with ``sink_size`` (the gluon mode only) also every
    ``j < sink_size`` with ``j <= i``. ``stats``, a dict, receives what the compiler
    made of the launch (registers per thread, spills, shared memory in bytes,
    warps per program; the flat mode's: its dK/dV kernel's, and with
    ``flat_dq`` its dQ kernel's under ``"dq"``; the gluon mode leaves it as it is). The gluon mode
    computes ``delta`` itself (:func:`.hopper_ws_bwd.attention_backward`). ``_validated=True``: the call was
    checked already (autograd's backward, whose forward checked it), so the checks, host time on every training
    step, are skipped.
    """
    if config is None:
        config = default_config(mode or "fused")
    elif mode is not None and mode != config.mode:
        raise ValueError(f"mode={mode!r} contradicts config.mode={config.mode!r}")
    if not _validated:
        _validate_call(q, k, v, causal, config, window_size, sink_size)
    if config.mode == "gluon":
        from .hopper_ws_bwd import attention_backward, backward_validated

        return (backward_validated if _validated else attention_backward)(
            q, k, v, o, lse, do, causal, sm_scale, window_size=window_size, sink_size=sink_size,
            num_buffers=config.num_stages, block_m=config.block_m1, dq_block_n=config.block_n2,
            heads_together=gluon_walk_rows(k, window_size))
    B, n_q_heads, N, D = q.shape
    n_kv_heads = k.shape[1]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    lse = lse.float().contiguous()  # the kernel reads each row's lse at stride 1
    if delta is None:  # lesson 07's step 1, one kernel
        delta = torch.zeros((B, n_q_heads, N), device=q.device, dtype=torch.float32)
        if q.numel():
            launch_preprocess(o, do, delta, 64)
    delta = delta.float().contiguous()
    if config.mode == "flat":
        if q.numel() == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        compiled, compiled_dq, grads = _flat_backward(q, k, v, do, lse, delta, causal, sm_scale, config, window_size)
        if stats is not None:
            stats.update(_compile_stats(compiled))
            if compiled_dq is not None:
                stats["dq"] = _compile_stats(compiled_dq)
        return grads
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    atomic = config.mode == "atomic"
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic else torch.empty_like(q)
    if q.numel() == 0:
        return dq.to(q.dtype), dk.zero_(), dv.zero_()
    descs = (None, None, None)
    if config.use_tma:  # descriptors over the 2-D [B*H_q*N, D] views of contiguous tensors
        q, do = q.contiguous(), do.contiguous()
        descs = (_desc_2d(q, config.block_m1), _desc_2d(do, config.block_m1),
                 _desc_2d(dq, config.block_m1) if atomic else None)
    compiled = _attn_bwd_fast[(N // config.block_n1, B * n_kv_heads)](
        q, k, v, do, lse, delta, dk, dv, dq, *descs,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1),
        *dk.stride(), *dv.stride(), *dq.stride(),
        n_kv_heads, n_q_heads // n_kv_heads, N, sm_scale,
        BLOCK_M1=config.block_m1, BLOCK_N1=config.block_n1, BLOCK_M2=config.block_m2, BLOCK_N2=config.block_n2,
        HEAD_DIM=D, CAUSAL=bool(causal), ATOMIC_DQ=atomic, USE_TMA=config.use_tma,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if stats is not None:
        stats.update(_compile_stats(compiled))
    return (dq.to(q.dtype) if atomic else dq), dk, dv


# -----------------------------------------------------------------------------
# Autograd through the fast backward
# -----------------------------------------------------------------------------
# The configuration whose backward kernels.flash_attention's autograd runs instead of lesson 07's pair, where
# autograd_config says it applies (None: lesson 07's pair everywhere). The gluon mode: lesson 11's Gluon backward,
# on a Hopper GPU only. Timed as a training step on an H100 (results/training_bench_gluon_h100*.json, three runs,
# causal, N = 4k-16k): 1.03-1.14x the step with lesson 07's pair, 0.84-0.93x cuDNN's. No layout of this module's own
# Triton kernels was measured faster than lesson 07's pair (results/tune_backward.json).
AUTOGRAD_CONFIG: FastBackwardConfig | None = GLUON_DEFAULT

# Whether autograd's backward takes the gluon mode for a window with sinks too (where the sinks select keys beyond
# the window: under a window of at least N keys a call with sinks is one without): True always, False never, None
# where sink_walk_fits says the sink keys' program ends in time. That dK/dV program walks every later query block,
# where lesson 07's pair spreads those far queries over programs of their own (backward._window_backward);
# benchmarks/route_check.py's "sinks" points time the two against each other.
GLUON_SINKS: bool | None = None

# How many (batch, kv head) rows at a time the gluon mode's dK/dV programs walk (its dQ the query heads of those rows;
# hopper_ws_bwd.attention_backward's heads_together), without a window: None, one row after another. Under the
# causal mask a row's first key blocks are its longest, so one row at a time leaves long blocks to the end of the
# grid (the last SM 13% past the mean at 4k in the load model of tests/test_gluon_cpu.py, 0.2% walking four rows).
# The route both ways on an H100 (route_check.py --modes walkbwd walkbwd_noncausal, two processes of four rounds,
# results/route_check_walk_h100{,_run2}.json; forward + backward, 16k tokens a batch) read four rows 1.044x / 0.995x /
# 1.016x and 1.059x / 1.014x / 1.011x causal, 1.028x / 1.028x / 1.033x and 1.014x / 1.022x / 1.000x not, at 4k / 8k /
# 16k; the A/B of the backward alone before it (results/gluon_ab_walk_h100.json) 1.050x / 1.021x / 0.983x causal,
# 1.027x / 1.034x / 1.000x not. Not timed on an H200.
GLUON_WALK_ROWS: int | None = 4


def gluon_walk_rows(k, window_size=None) -> int | None:
    """The gluon mode's ``heads_together`` for a call: :data:`GLUON_WALK_ROWS` where it is set, there is no window
    and it divides ``B * H_kv`` (``k``'s first two dims), else ``None`` (one row after another)."""
    rows = GLUON_WALK_ROWS
    if rows is None or window_size is not None or (k.shape[0] * k.shape[1]) % rows:
        return None
    return rows


def sink_walk_fits(batch: int, n_kv_heads: int, window_size: int, block_n: int, n_sms: int) -> bool:
    """Whether the Gluon backward's dK/dV program of the first key block (the sink keys: it walks all ``N`` query
    rows) takes no longer than one SM's share of the whole grid, in which every other program walks about
    ``window_size + block_n`` rows: ``n_sms * block_n <= batch * n_kv_heads * (window_size + block_n)`` (``N``
    drops out: ``N / block_n`` programs a (batch, kv head)). It is launched first, so then it ends with the rest.
    With one sequence, 8 kv heads and 128-key blocks on 132 SMs: windows from 1984 keys on."""
    return n_sms * block_n <= batch * n_kv_heads * (window_size + block_n)


def autograd_config(q, k, v, causal, window_size=None, sink_size=0, *, config=None, **mods) -> FastBackwardConfig | None:
    """The configuration autograd's backward runs for this call, or ``None`` for lesson 07's pair.

    ``config`` (default :data:`AUTOGRAD_CONFIG`) where it applies: no lesson 12 keyword (``mods``:
    ``cu_seqlens``, ``softcap``, ``alibi_slopes``, ``sink_logits``, all ``None``), a window only in
    the flat and gluon modes with ``causal``, inputs :func:`supports` takes, and on a GPU a Hopper one (the CPU's
    interpreter runs it too, the gluon mode's inside :func:`.gluon_cpu.running`, which is how the tests check
    the route). Sinks under a window of at least ``N`` keys change nothing (every key a query sees is already
    in its window), so there the call counts as one without sinks; other sinks take the gluon mode as
    :data:`GLUON_SINKS` says.
    """
    cfg = AUTOGRAD_CONFIG if config is None else config
    if sink_size and window_size is not None and window_size >= q.shape[2]:
        sink_size = 0  # the window holds every earlier key: the sinks select nothing more
    if cfg is None or any(m is not None for m in mods.values()):
        return None
    if sink_size and not (window_size is not None and cfg.mode == "gluon" and _gluon_takes_sinks(q, k, window_size,
                                                                                                 cfg)):
        return None
    if window_size is not None and (cfg.mode not in WINDOW_MODES or not causal):
        return None
    if q.device.type == "cuda" and _capability(q.device)[0] != 9:
        return None
    if cfg.mode == "gluon":
        from . import gluon_cpu

        if not gluon_cpu.can_run(q):  # asked before supports() imports Gluon: elsewhere it is never loaded
            return None
    return cfg if supports(q, k, v, cfg) else None


def _gluon_takes_sinks(q, k, window_size, cfg: FastBackwardConfig) -> bool:
    """:data:`GLUON_SINKS`, or where it is ``None`` :func:`sink_walk_fits` on this call's device (on a CPU, in the
    Gluon model, every call fits: its programs run one after another)."""
    if GLUON_SINKS is not None:
        return GLUON_SINKS
    return sink_walk_fits(q.shape[0], k.shape[1], int(window_size), cfg.block_n1, _sm_count(q.device))


class FastBackwardFunction(FlashAttentionFunction):
    """:class:`.backward.FlashAttentionFunction` with the backward of :func:`attention_backward_fast` at
    :func:`autograd_config`'s configuration (lesson 07's pair where that is ``None``); the forward, and what
    it saves, are the parent's. One more argument after the parent's: ``config`` (``None``:
    :data:`AUTOGRAD_CONFIG`), resolved once, in the forward, by :func:`autograd_config`; with ``validated=True`` the
    caller has checked the call and resolved it already (``kernels.flash_attention`` passes autograd_config's
    answer), so neither the forward nor the backward asks again: each check is host time on every step."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, window_size=None, sink_size=0, validated=False,
                cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None, config=None):
        o = FlashAttentionFunction.forward(ctx, q, k, v, causal, window_size, sink_size, validated,
                                           cu_seqlens, softcap, alibi_slopes, sink_logits)
        if not validated:
            config = autograd_config(q, k, v, causal, window_size, sink_size, config=config, cu_seqlens=cu_seqlens,
                                     softcap=softcap, alibi_slopes=alibi_slopes, sink_logits=sink_logits)
        ctx.fast_config = config
        return o

    @staticmethod
    def backward(ctx, do):
        cfg = ctx.fast_config
        if cfg is None:
            return (*FlashAttentionFunction.backward(ctx, do), None)
        q, k, v, o, lse = ctx.saved_tensors[:5]
        window_size, sink_size = ctx.window
        dq, dk, dv = attention_backward_fast(q, k, v, o, lse, do, ctx.causal, config=cfg, window_size=window_size,
                                             sink_size=sink_size if cfg.mode == "gluon" else 0, _validated=True)
        return (dq, dk, dv) + (None,) * 9


def flash_attention_fast_backward(q, k, v, causal=False, *, window_size=None, config=None):
    """``kernels.flash_attention(q, k, v, causal, window_size=...)``, differentiable with this module's backward at
    ``config`` (default :data:`AUTOGRAD_CONFIG`) where :func:`autograd_config` says it applies, lesson 07's
    elsewhere: how ``python -m course_utils.bench --training --fast-backward`` times a configuration beside
    lesson 07's pair before one becomes the default."""
    return FastBackwardFunction.apply(q, k, v, bool(causal), window_size, 0, False, None, None, None, None, config)
