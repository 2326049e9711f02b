"""Decoding with the work cut into equal shares, one per program (a "lean" or stream-K schedule).

Lesson 09's split kernel (:mod:`.decode`) cuts each sequence's keys into
``num_splits`` equal ranges, so a launch has ``B * Hkv * num_splits``
programs. Those rarely divide evenly among the SMs: at ``B = 16`` with 8 kv
heads and one split, 128 programs leave 4 of an H200's 132 SMs idle for the
whole call, and at ``B = 1`` 16 splits give 128 programs again. Decoding is
bound by the memory's bandwidth and every SM reads its share of it, so an
idle SM is 3% of the read rate lost.

This module numbers all the K/V blocks of the call, segment after segment (a
segment is one (batch element, kv head, block of packed query rows), the
rows one program of lesson 09 serves), and gives program ``p`` the blocks
``[p * c, (p + 1) * c)`` of that numbering, ``c = cdiv(total, programs)``.
A program's share can start inside one segment and end inside the next:
it writes a partial result (``o``, ``lse``) for each segment piece it reads,
in slot ``p - first(segment)`` of that segment, and a second kernel merges
each row's slots by their logsumexp, lesson 09's combine with a count of
slots per row. ``programs`` is a multiple of the SM count, so every SM reads
the same number of blocks.

The blocks are counted against the caches' capacity, not ``cache_seqlens``
(which would need a copy to the host at every step, as
:func:`.decode.pick_num_splits` explains): blocks past a sequence's length
are skipped, so with ragged lengths the shares are equal in blocks counted,
not in blocks read. The result is correct either way.

On Hopper the merge is launched with programmatic dependent launch
(``launch_pdl``): the split kernel lets it start as soon as all of its
programs are running (``gdc_launch_dependents``), and the merge waits for
the split kernel's writes (``gdc_wait``) instead of for a whole launch.

Measured on an H200 (results/NOTES.md, "Decoding in equal shares"): from a 64k
context the lean schedule read as much as lesson 09's splits or up to 2.5%
more (``B = 1`` at 128k); at 16k and shorter it read less at 10 of 12 points
(its programs loop over pieces, and short shares pay the merge), so
:func:`launch_decode` uses it only from :data:`LEAN_MIN_BLOCKS` blocks on,
for contiguous caches on a Hopper GPU (the only one it was measured on), and
not where lesson 09's launch is at most one program per SM and the PDL launch
below doubles it (``B = 1``): there twice lesson 09's splits read more on an
H200 and on an H100 (:func:`lean_rule`).

Elsewhere on Hopper (contiguous caches) :func:`launch_decode` runs lesson 09's
two kernels themselves, called as functions from two wrappers
(:func:`_split_released`, :func:`_combine_waiting`) so that the combine is
launched by PDL, at :func:`pdl_num_splits`'s count: twice lesson 09's where
its launch is at most one program per SM and the doubled splits are long
enough (``results/pdl_splits.json``; NOTES, "The decode combine by PDL").

The loop over a piece's blocks is a copy of lesson 09's (``_decode_split_kernel``'s): that kernel is the
notebook's, written by the learner, so it cannot call a helper the lesson does not have.

Public API: :func:`lean_shares` (the schedule's numbers, a plain function),
:func:`launch` (one fixed launch; runs in the interpreter too, which is how
the CPU tests check it), :func:`decode_lean`, :func:`lean_reason`,
:func:`launch_pdl_splits`, :func:`pdl_num_splits`, :func:`schedule_of`, :func:`launch_choice`, and
:func:`launch_decode` / :func:`decode_attention`, the package's decoding
entry (``course_utils.kernels.decode_attention``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import decode
from .forward import _capability

__all__ = ["LeanShares", "lean_shares", "launch", "plan_of", "decode_lean", "lean_reason", "lean_rule", "launch_decode",
           "decode_attention", "launch_pdl_splits", "pdl_num_splits", "pdl_splits_of", "schedule_of", "launch_choice",
           "PROGRAMS_PER_SM", "MIN_SHARE_BLOCKS", "LEAN_MIN_BLOCKS", "PDL_ONE_WAVE_MIN_BLOCKS",
           "PDL_TWO_PER_SM_MIN_BLOCKS"]

try:  # grid dependency control (Triton >= 3.4); without it the merge is launched the plain way
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

PROGRAMS_PER_SM = 3  # programs per SM the shares are cut for: 3 read the most of 1-4 at 64k-128k contexts on an
#                      H200 (results/NOTES.md, "Decoding in equal shares"); 3 is what one SM holds of the 3-stage launch
MIN_SHARE_BLOCKS = 2  # never a share of fewer K/V blocks than this
LEAN_MIN_BLOCKS = 1024  # the lean schedule from this many K/V blocks per sequence's capacity (64k keys of 64):
#                         level with or ahead of lesson 09's splits there, mostly behind them at 16k and shorter;
#                         not where the PDL launch doubles a launch of at most one program per SM (lean_rule)
# Below that, lesson 09's kernels with the combine launched by PDL, at more splits where a launch of at most one
# program per SM leaves room (pdl_num_splits; results/pdl_splits.json, an H200): twice lesson 09's count when the
# doubled launch is still at most one program per SM and each split reads at least PDL_ONE_WAVE_MIN_BLOCKS blocks,
# or when each doubled split still reads at least PDL_TWO_PER_SM_MIN_BLOCKS blocks.
PDL_ONE_WAVE_MIN_BLOCKS = 2  # B = 1, 1k: 4 -> 8 splits of 2 blocks (64 programs), 0.84-0.86x -> 1.003x cuDNN
PDL_TWO_PER_SM_MIN_BLOCKS = 8  # B = 4, 4k and 16k: 4 -> 8 splits (256 programs), +2%; splits of 2 blocks at
#                                B = 1, 4k and B = 4, 1k (256 programs) lost 3%


@triton.jit
def _lean_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tb, stride_tp,
    n_q_heads, n_kv_heads, T, n_cap, page_size, m_blocks, n_blocks, total_units, share, max_parts, qk_scale,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``p``: blocks ``[p * share, (p + 1) * share)`` of the call, one partial per segment piece."""
    if PDL:  # the merge may be scheduled now: it waits for this kernel's writes itself
        gdc_launch_dependents()
    p = tl.program_id(0)
    u = p * share
    u_end = tl.minimum(u + share, total_units)
    group_size = n_q_heads // n_kv_heads
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    while u < u_end:
        # The piece: blocks [blk0, blk1) of segment `seg` = (b * n_kv_heads + kv_head) * m_blocks + m_block.
        seg = u // n_blocks
        blk0 = u - seg * n_blocks
        piece_end = tl.minimum(u_end, (seg + 1) * n_blocks)
        blk1 = blk0 + (piece_end - u)
        m_block = seg % m_blocks
        kv_head = (seg // m_blocks) % n_kv_heads
        b = seg // (m_blocks * n_kv_heads)

        seq_len = tl.minimum(tl.load(SEQLENS + b), n_cap)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < group_size * T
        q_head = kv_head * group_size + rows // T
        t = rows % T
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh + t[:, None] * stride_qt
            + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )
        lo = blk0 * BLOCK_N
        hi = tl.minimum(blk1 * BLOCK_N, seq_len)
        pos = seq_len - T + t
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
        k_head = K + kv_head.to(tl.int64) * stride_kh
        v_head = V + kv_head.to(tl.int64) * stride_vh
        for start_n in range(lo, hi, BLOCK_N):  # lesson 09's loop, unchanged
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            if PAGED:
                page = tl.load(BLOCK_TABLE + b * stride_tb + (offs_n // page_size) * stride_tp, mask=n_ok, other=0)
                k_rows = page.to(tl.int64) * stride_kb + (offs_n % page_size) * stride_kn
                v_rows = page.to(tl.int64) * stride_vb + (offs_n % page_size) * stride_vn
            else:
                k_rows = b.to(tl.int64) * stride_kb + offs_n.to(tl.int64) * stride_kn
                v_rows = b.to(tl.int64) * stride_vb + offs_n.to(tl.int64) * stride_vn
            k = tl.load(k_head + k_rows[None, :] + offs_d[:, None] * stride_kd,
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_head + v_rows[:, None] + offs_d[None, :] * stride_vd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, k) * qk_scale
            keep = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p_ = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p_, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p_.to(v.dtype), v)
            m_i = m_new
        seen = l_i > 0.0  # False for a piece past the sequence's end
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        slot = p - (seg * n_blocks) // share  # this program's place among the segment's pieces
        part = ((b * n_q_heads + q_head) * T + t) * max_parts + slot
        tl.store(O_PART + part.to(tl.int64)[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE_PART + part, lse, mask=row_ok)
        u = piece_end


@triton.jit
def _lean_combine_kernel(
    O_PART, LSE_PART, O,
    stride_ob, stride_oh, stride_ot, stride_od,
    n_q_heads, n_kv_heads, T, m_blocks, n_blocks, share, max_parts,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge one (batch, query head, new token) row's pieces by their lse (lesson 09's combine)."""
    row = tl.program_id(0)  # ((b * n_q_heads + q_head) * T + t)
    t = row % T
    q_head = (row // T) % n_q_heads
    b = row // (T * n_q_heads)
    group_size = n_q_heads // n_kv_heads
    kv_head = q_head // group_size
    m_block = ((q_head % group_size) * T + t) // BLOCK_M
    seg = (b * n_kv_heads + kv_head) * m_blocks + m_block
    n_parts = (seg * n_blocks + n_blocks - 1) // share - (seg * n_blocks) // share + 1
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < n_parts
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    if PDL:  # the split kernel's writes, visible from here on
        gdc_wait()
    lse = tl.load(LSE_PART + row * max_parts + offs_s, mask=s_ok, other=float("-inf"))
    o_parts = tl.load(O_PART + (row.to(tl.int64) * max_parts + offs_s)[:, None] * D + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)
    w = w / tl.sum(w, axis=0)
    o = tl.sum(w[:, None] * o_parts, axis=0)
    tl.store(O + b.to(tl.int64) * stride_ob + q_head * stride_oh + t * stride_ot + offs_d * stride_od,
             o.to(O.dtype.element_ty), mask=d_ok)


@triton.jit
def _split_released(
    Q, K, V, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART, O,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tb, stride_tp,
    stride_ob, stride_oh, stride_ot, stride_od,
    n_q_heads, n_kv_heads, T, n_cap, page_size, num_splits, qk_scale,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """Lesson 09's split kernel, called as a function, after letting the combine be scheduled (``PDL``)."""
    if PDL:
        gdc_launch_dependents()
    decode._decode_split_kernel(
        Q, K, V, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART, O,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_tb, stride_tp,
        stride_ob, stride_oh, stride_ot, stride_od,
        n_q_heads, n_kv_heads, T, n_cap, page_size, num_splits, qk_scale,
        D, D_PAD, BLOCK_M, BLOCK_N, PAGED, SPLIT,
    )


@triton.jit
def _combine_waiting(
    O_PART, LSE_PART, O,
    stride_ob, stride_oh, stride_ot, stride_od,
    n_q_heads, T, num_splits,
    D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """Lesson 09's combine kernel, called as a function once the split kernel's writes are visible (``PDL``)."""
    if PDL:
        gdc_wait()
    decode._decode_combine_kernel(O_PART, LSE_PART, O, stride_ob, stride_oh, stride_ot, stride_od,
                                  n_q_heads, T, num_splits, D, D_PAD, S_PAD)


class LeanShares:
    """The schedule of one call: ``segments`` of ``n_blocks`` blocks each, ``share`` blocks per program,
    ``programs`` launched, and at most ``max_parts`` pieces per segment."""

    __slots__ = ("segments", "n_blocks", "share", "programs", "max_parts")

    def __init__(self, segments, n_blocks, share, programs, max_parts):
        self.segments, self.n_blocks, self.share = segments, n_blocks, share
        self.programs, self.max_parts = programs, max_parts

    def __repr__(self):
        return (f"LeanShares(segments={self.segments}, n_blocks={self.n_blocks}, share={self.share}, "
                f"programs={self.programs}, max_parts={self.max_parts})")

    def pieces(self, program: int) -> list[tuple[int, int, int, int]]:
        """``(segment, first block, end block, slot)`` of each piece ``program`` reads (what the kernel does)."""
        out = []
        u, end = program * self.share, min((program + 1) * self.share, self.segments * self.n_blocks)
        while u < end:
            seg = u // self.n_blocks
            piece_end = min(end, (seg + 1) * self.n_blocks)
            out.append((seg, u - seg * self.n_blocks, piece_end - seg * self.n_blocks,
                        program - (seg * self.n_blocks) // self.share))
            u = piece_end
        return out

    def parts_of(self, segment: int) -> int:
        """How many pieces segment ``segment`` is cut into (what the merge reads)."""
        first = segment * self.n_blocks
        return (first + self.n_blocks - 1) // self.share - first // self.share + 1


def lean_shares(segments: int, n_blocks: int, n_sms: int, programs_per_sm: int = PROGRAMS_PER_SM,
                min_blocks: int = MIN_SHARE_BLOCKS, max_parts: int = decode.MAX_SPLITS) -> LeanShares:
    """Cut ``segments * n_blocks`` K/V blocks into equal shares for ``n_sms * programs_per_sm`` programs.

    Each share is ``cdiv(total, n_sms * programs_per_sm)`` blocks, at least
    ``min_blocks`` (fewer programs then); a segment is cut into at most
    ``cdiv(n_blocks, share) + 1`` pieces, and never more than ``max_parts``
    (lesson 09's most splits: the merge holds a row's pieces in one tile), so
    a call of few segments (one sequence, one kv head) gets longer shares and
    fewer programs.
    """
    if segments < 1 or n_blocks < 1 or n_sms < 1 or programs_per_sm < 1 or min_blocks < 1 or max_parts < 2:
        raise ValueError("segments, n_blocks, n_sms, programs_per_sm and min_blocks must be positive, "
                         "and max_parts at least 2")
    total = segments * n_blocks
    share = max(min_blocks, triton.cdiv(total, n_sms * programs_per_sm), triton.cdiv(n_blocks, max_parts - 1))
    programs = triton.cdiv(total, share)
    max_parts = min(programs, triton.cdiv(n_blocks, share) + 1)
    return LeanShares(segments, n_blocks, share, programs, max_parts)


def plan_of(q, k_cache, block_table=None, *, n_sms: int, programs_per_sm: int = PROGRAMS_PER_SM,
            min_blocks: int = MIN_SHARE_BLOCKS, BLOCK_N: int | None = None) -> tuple[LeanShares, int]:
    """``(plan, BLOCK_N)`` of one call: its segments (batch x kv heads x blocks of packed query rows), its
    blocks of ``BLOCK_N`` keys (:func:`.decode.decode_config`'s unless given) against the caches' capacity,
    cut by :func:`lean_shares`."""
    _, m_blocks, capacity = decode._launch_shape(q, k_cache, block_table)
    block_n = BLOCK_N or decode.decode_config(q.shape[3], q.dtype, q.device)["BLOCK_N"]
    plan = lean_shares(q.shape[0] * k_cache.shape[1] * m_blocks, triton.cdiv(capacity, block_n), n_sms,
                       programs_per_sm, min_blocks)
    return plan, block_n


def launch(q, k_cache, v_cache, cache_seqlens, block_table=None, *, n_sms: int, programs_per_sm: int = PROGRAMS_PER_SM,
           min_blocks: int = MIN_SHARE_BLOCKS, BLOCK_N: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None, pdl: bool | None = None):
    """``o`` ``[B, Hq, T, D]`` by the lean schedule (:func:`lean_shares` for ``n_sms`` SMs). No validation
    (:func:`.decode.decode_attention` validates). ``pdl=None``: on a Hopper GPU or newer."""
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    block_m, m_blocks, capacity = decode._launch_shape(q, k_cache, block_table)
    plan, block_n = plan_of(q, k_cache, block_table, n_sms=n_sms, programs_per_sm=programs_per_sm,
                            min_blocks=min_blocks, BLOCK_N=BLOCK_N)
    n_blocks = plan.n_blocks
    gpu = q.device.type == "cuda" and not decode._interpreted(q.device)
    cfg = decode.decode_config(D, q.dtype, q.device, plan.programs if gpu else None, num_splits=2,
                               split_blocks=plan.share)
    cfg["BLOCK_N"] = block_n
    for key, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None:
            cfg[key] = value
    if pdl is None:
        pdl = _pdl_ok(q.device)
    o_parts = torch.empty((B, Hq, T, plan.max_parts, D), dtype=torch.float32, device=q.device)
    lse_parts = torch.empty((B, Hq, T, plan.max_parts), dtype=torch.float32, device=q.device)
    paged = block_table is not None
    if paged:
        table, stride_tb, stride_tp = block_table, block_table.stride(0), block_table.stride(1)
    else:
        table, stride_tb, stride_tp = cache_seqlens, 0, 0  # never read
    d_pad = triton.next_power_of_2(max(D, 16))
    _lean_split_kernel[(plan.programs,)](
        q, k_cache, v_cache, cache_seqlens, table, o_parts, lse_parts,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), stride_tb, stride_tp,
        Hq, Hkv, T, capacity, k_cache.shape[2], m_blocks, n_blocks, plan.segments * n_blocks, plan.share,
        plan.max_parts, decode.LOG2E / math.sqrt(D),
        D=D, D_PAD=d_pad, BLOCK_M=block_m, PAGED=paged, PDL=pdl, **cfg,
    )
    extra = {"launch_pdl": True} if pdl else {}
    _lean_combine_kernel[(B * Hq * T,)](
        o_parts, lse_parts, out, *out.stride(), Hq, Hkv, T, m_blocks, n_blocks, plan.share, plan.max_parts,
        D=D, D_PAD=d_pad, S_PAD=triton.next_power_of_2(plan.max_parts), BLOCK_M=block_m, PDL=pdl, **extra,
    )
    return out


def launch_pdl_splits(q, k_cache, v_cache, cache_seqlens, num_splits: int, block_table=None, *,
                      pdl: bool | None = None):
    """Lesson 09's two kernels at ``num_splits`` (:func:`.decode.launch_decode`'s launch), the combine launched
    by programmatic dependent launch (``pdl=None``: on a Hopper GPU or newer). No validation."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    if num_splits == 1:  # no combine to launch early
        return decode.decode_split(q, k_cache, v_cache, cache_seqlens, 1, block_table, out=out)[0]
    if pdl is None:
        pdl = _pdl_ok(q.device)
    o_parts, lse_parts = decode.decode_split(q, k_cache, v_cache, cache_seqlens, num_splits, block_table,
                                             kernel=_split_released, extra={"PDL": pdl})
    return decode.decode_combine(o_parts, lse_parts, out, kernel=_combine_waiting,
                                 extra={"PDL": pdl, **({"launch_pdl": True} if pdl else {})})


def pdl_num_splits(batch: int, n_kv_heads: int, m_blocks: int, n_blocks: int, num_splits: int, n_sms: int) -> int:
    """The split count with the combine launched by PDL, from lesson 09's ``num_splits`` (:func:`.decode.pick_num_splits`).

    The PDL launch hides most of the combine's cost, which is what kept lesson
    09's count low where its programs are few. So where lesson 09 already
    splits (``num_splits >= 2``) and its launch is at most one program per SM,
    the count is doubled if the doubled launch is still at most one program
    per SM with splits of at least :data:`PDL_ONE_WAVE_MIN_BLOCKS` blocks, or
    if each doubled split still reads at least :data:`PDL_TWO_PER_SM_MIN_BLOCKS`
    blocks. One split stays one: going to two adds the combine itself, which
    lost at ``B = 16`` (0.985 -> 0.96x cuDNN at 1k, ``results/pdl_probe.json``).
    An empirical rule over the decode grid's points (``results/pdl_splits.json``), not a model.
    """
    programs = batch * n_kv_heads * m_blocks * num_splits
    doubled = 2 * num_splits
    if num_splits < 2 or programs > n_sms or doubled > decode.MAX_SPLITS:
        return num_splits
    per_split = n_blocks // doubled
    one_wave = 2 * programs <= n_sms and per_split >= PDL_ONE_WAVE_MIN_BLOCKS
    return doubled if one_wave or per_split >= PDL_TWO_PER_SM_MIN_BLOCKS else num_splits


def pdl_splits_of(q, k_cache) -> int:
    """:func:`pdl_num_splits` for a call on a contiguous cache (this GPU's SM count)."""
    _, m_blocks, capacity = decode._launch_shape(q, k_cache)
    block_n = decode.decode_config(q.shape[3], q.dtype, q.device)["BLOCK_N"]
    return pdl_num_splits(q.shape[0], k_cache.shape[1], m_blocks, triton.cdiv(capacity, block_n),
                          decode.launch_splits(q, k_cache), decode._sm_count(q.device))


def _pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch: on a Hopper GPU or newer, with Triton's grid dependency control."""
    return (device.type == "cuda" and not decode._interpreted(device) and gdc_wait is not None
            and _capability(device) >= (9, 0))


def decode_lean(q, k_cache, v_cache, cache_seqlens, block_table=None):
    """:func:`launch` with this GPU's SM count (for tensors :func:`.decode.validate_decode` accepted)."""
    return launch(q, k_cache, v_cache, cache_seqlens, block_table, n_sms=decode._sm_count(q.device))


def lean_reason(q, k_cache, block_table=None) -> str | None:
    """Why :func:`launch_decode` keeps lesson 09's splits for these inputs (``None``: it runs the lean schedule)."""
    if q.device.type != "cuda" or decode._interpreted(q.device):
        return "not on a GPU: the interpreter runs lesson 09's kernels"
    block_n = decode.decode_config(q.shape[3], q.dtype, q.device)["BLOCK_N"]
    rule = dict(paged=block_table is not None, capability=_capability(q.device))
    reason = lean_rule(k_cache.shape[2], block_n, **rule)
    if reason is None and _pdl_ok(q.device):  # a long contiguous cache: does the PDL launch double lesson 09's?
        reason = lean_rule(k_cache.shape[2], block_n, **rule,
                           pdl_doubles=pdl_splits_of(q, k_cache) > decode.launch_splits(q, k_cache))
    return reason


def lean_rule(capacity: int, block_n: int, *, paged: bool = False,
              capability: tuple[int, int] = (9, 0), pdl_doubles: bool = False) -> str | None:
    """:func:`lean_reason`'s rule for a GPU: Hopper or newer (where it was measured) and a contiguous cache of at
    least :data:`LEAN_MIN_BLOCKS` blocks, unless ``pdl_doubles``: lesson 09's launch is at most one program per SM
    and :func:`pdl_num_splits` doubles it (``B = 1`` on 132 SMs). There the PDL launch at twice the splits read
    1.000-1.002x cuDNN at 64k against the lean schedule's 0.987x, and 0.995-0.996x against 0.995-0.997x at 128k
    (an H200, ``results/pdl_splits.json``); 0.996-0.997x against 0.981-0.993x at both (an H100,
    ``results/tune_decode_lean_h100.json``), each pair in the same run."""
    if tuple(capability) < (9, 0):
        return (f"compute capability {capability[0]}.{capability[1]}: the lean schedule was measured on Hopper only, "
                "other GPUs keep lesson 09's splits")
    if paged:
        return "a paged cache: pick_num_splits has measured rules for pages, the lean schedule was not measured"
    if triton.cdiv(capacity, block_n) < LEAN_MIN_BLOCKS:
        return f"a cache of {capacity} keys: the lean schedule starts at {LEAN_MIN_BLOCKS} blocks of {block_n}"
    if pdl_doubles:
        return ("lesson 09's launch has at most one program per SM, and the PDL combine at twice its splits reads "
                "more than the lean schedule there")
    return None


def schedule_of(q, k_cache, block_table=None, num_splits=None) -> tuple[str, int | None]:
    """What :func:`launch_decode` runs for these inputs: ``("lean", None)`` where :func:`lean_reason` allows it
    (and ``num_splits`` is not given); on a Hopper GPU with a contiguous cache ``("pdl", S)``, lesson 09's kernels
    with the PDL combine at ``num_splits`` or :func:`pdl_splits_of`'s count; else ``("plain", S)``, lesson 09's
    launch at ``num_splits`` or :func:`.decode.launch_splits`'s count."""
    if num_splits is None and lean_reason(q, k_cache, block_table) is None:
        return "lean", None
    if block_table is None and _pdl_ok(q.device):
        return "pdl", pdl_splits_of(q, k_cache) if num_splits is None else num_splits
    return "plain", decode.launch_splits(q, k_cache, block_table) if num_splits is None else num_splits


def launch_decode(q, k_cache, v_cache, cache_seqlens, num_splits=None, block_table=None):
    """What :func:`decode_attention` runs, without its checks: :func:`schedule_of`'s choice."""
    schedule, splits = schedule_of(q, k_cache, block_table, num_splits)
    if schedule == "lean":
        return decode_lean(q, k_cache, v_cache, cache_seqlens)
    if schedule == "pdl":
        return launch_pdl_splits(q, k_cache, v_cache, cache_seqlens, splits, pdl=True)
    return decode.launch_decode(q, k_cache, v_cache, cache_seqlens, splits, block_table)


def launch_choice(q, k_cache, block_table=None) -> str:
    """:func:`schedule_of` in the decode bench's words: ``"lean"``, ``"pdl num_splits=S"`` (lesson 09's kernels,
    the combine launched by PDL) or ``"num_splits=S"`` (one split launches no combine, so it never says pdl)."""
    schedule, splits = schedule_of(q, k_cache, block_table)
    if schedule == "lean":
        return "lean"
    return f"pdl num_splits={splits}" if schedule == "pdl" and splits > 1 else f"num_splits={splits}"


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, num_splits=None, block_table=None):
    """The package's decoding entry: :func:`.decode.decode_attention`'s arguments, checks and result, run by
    :func:`launch_decode` (lesson 09's splits; on Hopper with the PDL combine, or the lean schedule for long
    contiguous caches)."""
    decode.validate_decode(q, k_cache, v_cache, cache_seqlens, num_splits, block_table)
    return launch_decode(q, k_cache, v_cache, cache_seqlens, num_splits, block_table)
