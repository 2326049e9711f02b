"""Decoding attention with a KV cache: split-KV (flash-decoding), ragged lengths, paged caches.

Lesson 09. At inference time each step brings ``T`` new queries per sequence
(``T = 1`` in plain generation, a few with speculative decoding) against a
cache of thousands of keys. One program per (batch element, query head) would
leave most of a GPU's SMs idle, so the keys of each sequence are cut into
``num_splits`` ranges, one program per range, and the partial results are
merged by their logsumexp, the rule of the online softmax one level up:

- :func:`_decode_split_kernel`: one program per (split, block of packed query
  rows, batch element x kv head). The ``group_size * T`` query rows that share
  a kv head are packed into one tile, so each K/V tile is loaded once for the
  whole group (GQA packing). It writes each row's partial output (normalised by
  its own sum) and partial ``lse`` (natural log; ``-inf`` and ``o = 0`` for a
  row that sees no key of its split). With one split it writes the final
  output directly and no combine runs.
- :func:`_decode_combine_kernel`: one program per (batch, query head, new
  token): ``o = sum_s w_s o_s`` with ``w_s = exp(lse_s - m) / sum exp(lse - m)``
  and ``m`` the largest ``lse_s``.

Split ``s`` of sequence ``b`` covers the keys ``[s * chunk, min((s + 1) *
chunk, L))`` with ``L = cache_seqlens[b]`` and ``chunk = cdiv(L, num_splits)``
(the grader of lesson 09 uses the same ranges). The ``T`` queries sit at
positions ``L - T .. L - 1``: query ``t`` sees the keys ``j <= L - T + t``.

One copy: ``solutions/09_decoding.ipynb`` defines these same ``@triton.jit``
functions (``tests/test_kernels_decode.py`` compares them, marker lines
aside). The launcher is :func:`decode_attention`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .forward import _DTYPES, _interpreted, bf16_problem

__all__ = [
    "decode_attention",
    "launch_decode",
    "decode_split",
    "decode_combine",
    "pick_num_splits",
    "model_num_splits",
    "split_busy_fraction",
    "validate_decode",
    "decode_config",
    "launch_config",
    "launch_splits",
    "FULL_GRID_PROGRAMS_PER_SM",
    "LONE_MIN_BLOCKS",
    "programs_per_sm_of_launch",
    "_decode_split_kernel",
    "_decode_combine_kernel",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_T = 16  # new tokens per sequence the launcher accepts
MAX_SPLITS = 128


@triton.jit
def _decode_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART, O,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tb, stride_tp,
    stride_ob, stride_oh, stride_ot, stride_od,
    n_q_heads, n_kv_heads, T, n_cap, page_size, num_splits, qk_scale,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Attention of the packed query rows of one kv head over one split of the cache.

    Row ``r`` of the tile is query head ``kv_head * group_size + r // T``,
    new token ``t = r % T``. ``K``/``V`` are ``[B, Hkv, N_max, D]``, or with
    ``PAGED`` ``[num_pages, Hkv, page_size, D]`` addressed through
    ``BLOCK_TABLE`` ``[B, max_pages]``. ``O_PART`` (float32 ``[B, Hq, T,
    num_splits, D]``) and ``LSE_PART`` (``[B, Hq, T, num_splits]``) are
    contiguous; without ``SPLIT`` the normalised result goes straight to ``O``.
    """
    pid_s = tl.program_id(0)  # which split of the keys
    pid_m = tl.program_id(1)  # which block of packed query rows
    pid_bh = tl.program_id(2)  # which (batch element, kv head)
    b = pid_bh // n_kv_heads
    kv_head = pid_bh % n_kv_heads
    group_size = n_q_heads // n_kv_heads

    seq_len = tl.minimum(tl.load(SEQLENS + b), n_cap)  # valid keys of this sequence, new ones included
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group_size * T
    q_head = kv_head * group_size + rows // T
    t = rows % T
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D

    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh + t[:, None] * stride_qt
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )

    # lo, hi: the keys of this split; pos: each row's position in its sequence.
    ### BEGIN SOLUTION
    chunk = tl.cdiv(seq_len, num_splits)
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    pos = seq_len - T + t
    ### END SOLUTION

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    k_head = K + kv_head.to(tl.int64) * stride_kh
    v_head = V + kv_head.to(tl.int64) * stride_vh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi  # never past this split, so never past seq_len
        if PAGED:  # token j lives in page block_table[b, j // page_size], row j % page_size
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
        s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        # keep: True where row r may see key offs_n (inside this split, at or before the row's position).
        ### BEGIN SOLUTION
        keep = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        ### END SOLUTION
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0, not NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0.0  # False for a row that sees no key of this split
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        part = ((b * n_q_heads + q_head) * T + t) * num_splits + pid_s
        tl.store(O_PART + part.to(tl.int64)[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE_PART + part, lse, mask=row_ok)
    else:
        tl.store(
            O + b.to(tl.int64) * stride_ob + q_head[:, None] * stride_oh + t[:, None] * stride_ot
            + offs_d[None, :] * stride_od,
            o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _decode_combine_kernel(
    O_PART, LSE_PART, O,
    stride_ob, stride_oh, stride_ot, stride_od,
    n_q_heads, T, num_splits,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    """Merge the ``num_splits`` partial results of one (batch, query head, new token) row by their lse."""
    row = tl.program_id(0)  # ((b * n_q_heads + q_head) * T + t)
    t = row % T
    q_head = (row // T) % n_q_heads
    b = row // (T * n_q_heads)
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    lse = tl.load(LSE_PART + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    o_parts = tl.load(
        O_PART + (row.to(tl.int64) * num_splits + offs_s)[:, None] * D + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    )
    # o [D_PAD]: the parts merged by their lse (float32).
    ### BEGIN SOLUTION
    m = tl.max(lse, axis=0)  # every row has a split that sees a key, so m is finite
    w = tl.exp(lse - m)
    w = w / tl.sum(w, axis=0)
    o = tl.sum(w[:, None] * o_parts, axis=0)
    ### END SOLUTION
    tl.store(
        O + b.to(tl.int64) * stride_ob + q_head * stride_oh + t * stride_ot + offs_d * stride_od,
        o.to(O.dtype.element_ty), mask=d_ok,
    )


# -----------------------------------------------------------------------------
# Launchers
# -----------------------------------------------------------------------------
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device, programs: int | None = None, *,
                  num_splits: int = 1, split_blocks: int | None = None, capability: tuple[int, int] | None = None,
                  sm_count: int | None = None) -> dict:
    """``BLOCK_N`` and launch options of the split kernel for a head dim and dtype.

    In the interpreter each K/V step costs about the same whatever its size,
    so the blocks are large enough for few steps and small enough that the
    course's short caches still span several blocks and splits. On a GPU the
    K and V tiles of ``num_stages`` steps in flight must fit in shared memory
    (smaller on sm_75); sensible defaults, not tuned optima.

    ``programs``: the launch's programs (all ``num_splits`` of them);
    ``split_blocks``: the K/V blocks each program reads at most. Hopper's launch
    (16-bit, 64-key tiles) then takes its pipeline depth from how the programs
    fill the SMs (``benchmarks/tune_decode.py``, ``results/tune_decode.json``):

    - one split giving every SM at least :data:`FULL_GRID_PROGRAMS_PER_SM`
      programs (B = 64 with 8 kv heads on an H200's 132 SMs): 2 stages, 38
      instead of 70 KiB of shared memory, so 5 programs fit on an SM instead
      of 3, and more programs in flight hide the memory's latency better than
      a deeper pipeline in each (B = 64, one split, 1k context 3258 -> 3563
      GB/s, 4k 4306 GB/s, against cuDNN's 3479 and 4292);
    - at most one program per SM, each reading at least
      :data:`LONE_MIN_BLOCKS` blocks: 4 stages, so a program alone on its SM
      keeps three tiles in flight instead of two (B = 16, one split, 4k context
      3459 -> 3511 GB/s; 1k 2270 -> 2275). Short programs do not repay the
      deeper prologue (B = 4, 4 splits of 4 blocks: 1072 -> 1038);
    - otherwise 3 stages.

    ``capability`` and ``sm_count`` answer for that GPU, whatever ``device`` is.
    """
    if _interpreted(device) and capability is None:
        return dict(BLOCK_N=32)
    capability = capability or tuple(torch.cuda.get_device_capability(device))
    sms = _sm_count(device) if sm_count is None else sm_count  # 0: not known (no GPU asked)
    grid = None if programs is None else _grid(programs, num_splits, split_blocks, sms)
    return dict(_gpu_config(triton.next_power_of_2(max(head_dim, 16)), dtype.itemsize, capability, grid))


def _grid(programs: int, num_splits: int, split_blocks: int | None, n_sms: int) -> str | None:
    """How a launch's programs fill the SMs, for its pipeline depth (:func:`decode_config`): ``"full"``, one
    split with at least :data:`FULL_GRID_PROGRAMS_PER_SM` per SM; ``"lone"``, at most one per SM, each reading at
    least :data:`LONE_MIN_BLOCKS` blocks; else ``None`` (also when the SM count is not known, ``n_sms = 0``)."""
    if n_sms <= 0:
        return None
    if num_splits == 1 and programs >= FULL_GRID_PROGRAMS_PER_SM * n_sms:
        return "full"
    if programs <= n_sms and split_blocks is not None and split_blocks >= LONE_MIN_BLOCKS:
        return "lone"
    return None


def _launch_shape(q, k_cache, block_table=None) -> tuple[int, int, int]:
    """``(block_m, m_blocks, capacity)``: the packed query rows per program, the blocks of them, and the keys
    the caches can hold per sequence."""
    _, Hq, T, _ = q.shape
    Hkv = k_cache.shape[1]
    block_m = _rows_per_block(Hq // Hkv, T)
    capacity = k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[2]
    return block_m, triton.cdiv((Hq // Hkv) * T, block_m), capacity


def launch_splits(q, k_cache, block_table=None) -> int:
    """The split count :func:`launch_decode` picks for these inputs (:func:`pick_num_splits`)."""
    _, m_blocks, capacity = _launch_shape(q, k_cache, block_table)
    return pick_num_splits(q.shape[0], k_cache.shape[1], m_blocks, capacity, q.device,
                           decode_config(q.shape[3], q.dtype, q.device)["BLOCK_N"], paged=block_table is not None)


def launch_config(q, k_cache, num_splits: int, block_table=None) -> dict:
    """:func:`decode_config` for this launch: its programs and the blocks each split reads."""
    B, D, Hkv = q.shape[0], q.shape[3], k_cache.shape[1]
    _, m_blocks, capacity = _launch_shape(q, k_cache, block_table)
    block_n = decode_config(D, q.dtype, q.device)["BLOCK_N"]
    return decode_config(D, q.dtype, q.device, B * Hkv * m_blocks * num_splits, num_splits=num_splits,
                         split_blocks=triton.cdiv(triton.cdiv(capacity, num_splits), block_n))


@functools.lru_cache(maxsize=None)
def _gpu_config(d_pad: int, itemsize: int, capability: tuple, grid: str | None = None) -> tuple:
    """The launch for a padded head dim, an element size and a GPU; ``grid``: one split's programs fill every
    SM at least twice (``"full"``), the programs are at most one per SM and long enough (``"lone"``), or
    neither (``None``)."""
    if capability < (8, 0):  # sm_75 (a T4): 64 KiB of shared memory per program
        return (("BLOCK_N", 32 if d_pad > 64 or itemsize > 2 else 64), ("num_warps", 4), ("num_stages", 2))
    if itemsize > 2 or d_pad > 128:
        return (("BLOCK_N", 32), ("num_warps", 4), ("num_stages", 3))
    stages = {"full": 2, "lone": 4}.get(grid, 3) if capability >= (9, 0) else 3  # measured on Hopper only
    return (("BLOCK_N", 64), ("num_warps", 4), ("num_stages", stages))


FULL_GRID_PROGRAMS_PER_SM = 2  # one split with at least this many programs per SM: 2 stages (decode_config)
LONE_MIN_BLOCKS = 16  # at most one program per SM, each reading at least this many blocks: 4 stages (decode_config)

# The split-count model (see pick_num_splits). Each constant says where it comes from.
PROGRAMS_PER_SM = 3  # split programs an H200 SM holds at once with the 3-stage launch: 96 registers x 128
#                      threads and 70 KiB of shared memory each (triton 3.6 on the H200, results/tune_decode.json)
ONE_SPLIT_PROGRAMS_PER_SM = 5  # ... and with the 2-stage launch of one split over a full grid: 94 registers,
#                                38 KiB (the same run); decode_config's FULL_GRID_PROGRAMS_PER_SM rule
MIN_SPLIT_BLOCKS = 4  # never a split shorter than 4 K/V blocks
PROGRAM_OVERHEAD_BLOCKS = 1.0  # a program's fixed cost (q tile, first loads' latency, its output), in block reads
COMBINE_BLOCKS = 2.0  # the combine kernel's launch and work, once per call with more than one split
DRAIN_WAVES = 0.45  # past what the SMs hold at once, the launch ends raggedly: about 0.45 of one program's time
#                     (fitted to results/decode_splits.json: B = 64, one split, 512 programs of the 3-stage launch
#                     on 396 slots, read 86-87% of the ceiling at 4k-64k contexts; the fit per context is 0.39-0.53)
SPLIT_TOLERANCE = 0.02  # pick the fewest splits within 2% of the best prediction (the model is no finer)


def split_busy_fraction(batch: int, n_kv_heads: int, m_blocks: int, n_blocks: int, num_splits: int, n_sms: int,
                        programs_per_sm: float, *, drain: float = DRAIN_WAVES, overhead: float = PROGRAM_OVERHEAD_BLOCKS,
                        combine: float = COMBINE_BLOCKS) -> float:
    """The model's busy fraction of a decode launch with ``num_splits`` splits (1.0: every SM reading, always).

    ``programs = batch * n_kv_heads * m_blocks * num_splits`` (the query heads of
    a kv head share one program: GQA packing), each reading ``ceil(n_blocks /
    num_splits)`` K/V blocks. Decoding is bound by the memory's bandwidth, and
    the programs that one SM holds share that SM's part of it: an SM that runs
    ``k`` programs takes ``k`` programs' time, side by side or one after
    another. So the busiest SM's ``ceil(programs / n_sms)`` programs set the
    time, counted in block reads of one program at an SM's share::

        time = (ceil(programs / n_sms) + drain * [programs > n_sms * programs_per_sm])
               * (ceil(n_blocks / num_splits) + overhead) + combine * [num_splits > 1]
        busy = (batch * n_kv_heads * m_blocks * n_blocks / n_sms) / time

    ``drain``: an SM holds ``programs_per_sm`` programs at once; the programs
    past ``n_sms * programs_per_sm`` start as earlier ones finish, at staggered
    times and on whichever SMs free up first, and the launch ends raggedly;
    ``overhead``: each program's fixed cost (short splits pay it more often);
    ``combine``: the second kernel, once.
    """
    programs = batch * n_kv_heads * m_blocks * num_splits
    per_sm = math.ceil(programs / n_sms)
    per_program = math.ceil(n_blocks / num_splits) + overhead
    ragged = drain if programs > n_sms * programs_per_sm else 0.0
    time = (per_sm + ragged) * per_program + (combine if num_splits > 1 else 0.0)
    return batch * n_kv_heads * m_blocks * n_blocks / n_sms / time


def programs_per_sm_of_launch(one_split_programs: int, num_splits: int, n_sms: int) -> int:
    """What an SM holds at once of the launch :func:`decode_config` makes (an H200's compile).

    One split over a full grid (at least :data:`FULL_GRID_PROGRAMS_PER_SM` programs
    per SM) launches with 2 stages: :data:`ONE_SPLIT_PROGRAMS_PER_SM`; other
    launches with 3: :data:`PROGRAMS_PER_SM` (a launch of at most one program
    per SM may take 4 stages, 2 per SM, but then no program waits for a slot
    and the model does not use the count). Other GPUs get the same counts (not
    measured).
    """
    full = _grid(one_split_programs * num_splits, num_splits, None, n_sms) == "full"
    return ONE_SPLIT_PROGRAMS_PER_SM if full else PROGRAMS_PER_SM


@functools.lru_cache(maxsize=4096)
def _best_splits(batch: int, n_kv_heads: int, m_blocks: int, n_blocks: int, n_sms: int) -> int:
    max_splits = _max_splits(n_blocks)
    one = batch * n_kv_heads * m_blocks
    busy = [split_busy_fraction(batch, n_kv_heads, m_blocks, n_blocks, s, n_sms,
                                programs_per_sm_of_launch(one, s, n_sms)) for s in range(1, max_splits + 1)]
    best = max(busy)
    return next(s for s, b in enumerate(busy, start=1) if b >= (1 - SPLIT_TOLERANCE) * best)


def _max_splits(n_blocks: int) -> int:
    """The most splits of ``n_blocks`` key blocks: each at least MIN_SPLIT_BLOCKS blocks, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, n_blocks // MIN_SPLIT_BLOCKS))


def model_num_splits(batch: int, n_kv_heads: int, m_blocks: int, n_blocks: int, n_sms: int) -> int:
    """The split count the model alone picks (:func:`split_busy_fraction`; lesson 09's exercise 4): of the
    counts allowed, the fewest whose predicted busy fraction is within :data:`SPLIT_TOLERANCE` of the best.
    :func:`pick_num_splits` starts from it. A plain function over the cached :func:`_best_splits`, so that
    exercise 4's grader can make it refuse to answer (it swaps a function's code)."""
    return _best_splits(batch, n_kv_heads, m_blocks, n_blocks, n_sms)


PAGED_SPLIT_FACTOR = 4  # a paged cache at <= 1 program per SM: 4x the model's count (pick_num_splits)
PAGED_MAX_SPLITS = 32  # ... and at most 32, the most the paged sweep measured (it was the best there at B = 1)
LONE_SPLIT_FACTOR = 2  # a contiguous cache at <= 1 program per SM, long splits: 2x the model's count (pick_num_splits)
LONE_SPLIT_MIN_BLOCKS = 128  # ... when each of the doubled splits still reads at least this many blocks (8k keys)


def pick_num_splits(batch: int, n_kv_heads: int, m_blocks: int, max_len: int, device: torch.device,
                    block_n: int = 64, sm_count: int | None = None, *, paged: bool = False) -> int:
    """How many splits of the keys: the count the model predicts keeps the SMs busiest.

    The model (:func:`split_busy_fraction`): ``batch * n_kv_heads * m_blocks``
    programs run without splitting, and ``num_splits`` multiplies them. They
    share the memory's bandwidth SM by SM, so the SM that gets the most of them
    (``ceil(programs / sm_count)``) sets the time; past what the SMs hold at once
    (:func:`programs_per_sm_of_launch`) the launch also ends raggedly
    (:data:`DRAIN_WAVES` of a program's time); every program pays a fixed
    :data:`PROGRAM_OVERHEAD_BLOCKS` (short splits pay it more often) and more
    than one split pays the combine (:data:`COMBINE_BLOCKS`). Splits are at
    least :data:`MIN_SPLIT_BLOCKS` blocks of ``block_n`` keys (at most
    :data:`MAX_SPLITS`); of the counts allowed, the fewest whose predicted busy
    fraction is within :data:`SPLIT_TOLERANCE` of the best. On an H200 (132
    SMs, 32/8 heads, one new token) this gives 16 splits at ``B = 1`` and a
    16k context (128 programs, one per SM), 4 at ``B = 4``, and one split at
    ``B = 16`` and ``B = 64`` at every context: 128 programs, one per SM, and
    512, which the 2-stage launch holds at once (5 per SM).
    ``python -m course_utils.bench decode --splits`` measures GB/s against
    ``num_splits`` to check the model (``results/decode_splits.md``);
    :func:`model_num_splits` is the model's count alone.

    Long contexts, measured past the model: where the model's count leaves at
    most one program per SM, a program alone on its SM reads less than the
    SM's share of the bandwidth, as the paged cache below shows more
    strongly; two programs per SM (3 stages) read more. So where each of
    :data:`LONE_SPLIT_FACTOR` times as many splits still reads at least
    :data:`LONE_SPLIT_MIN_BLOCKS` blocks, the count is doubled: 8 splits at
    ``B = 4`` from a 64k context and 2 at ``B = 16`` from 16k
    (``results/tune_decode_long.json``, run 2: 0.97 -> 0.99x cuDNN at ``B = 4`` and
    128k, 0.96 -> 0.98x at ``B = 16`` and 64k; at ``B = 16`` and 16k 0.995 ->
    0.990x, within the spread between runs). Where the doubled splits would be
    shorter the model's count stands: it did not pay at ``B = 1`` and 16k
    (16 -> 32 splits of 8 blocks: 2131 -> 2110 GB/s, ``results/decode_splits.md``)
    or ``B = 16`` and 4k (1 -> 2: 3476 -> 3400). This is an empirical factor
    on top of the model, not part of it.

    ``paged``: the caches are pages behind a block table. Each key's address
    is then a load from the table, a gather that one program likely cannot
    run far ahead of, so one program per SM does not keep the SM's share of
    the bandwidth in flight. Where the model's count gives at most one
    program per SM, a paged cache gets :data:`PAGED_SPLIT_FACTOR` times as
    many splits (at most what the blocks allow, and at most
    :data:`PAGED_MAX_SPLITS`): 32 at ``B = 1``, 16 at
    ``B = 4`` and 4 at ``B = 16`` (16k context), the best counts the paged
    sweep measured there (``results/tune_decode_paged.json``:
    1759 / 3150 / 3943 GB/s with the shipped tiles, against 1759 / 2665 /
    2974 for the 2-lane rule it replaced). Past one program per SM
    (``B = 64``) the count is the model's.

    ``max_len`` is the caches' capacity, not ``cache_seqlens``: reading the
    lengths would stall the GPU to copy them to the host every step. On the
    CPU (the interpreter runs programs one after another) a small count, so
    the combine still runs in the lessons. ``sm_count`` answers for a GPU of
    that many SMs, whatever ``device`` is.
    """
    n_blocks = max(1, triton.cdiv(max_len, block_n))
    if sm_count is None and device.type != "cuda":
        return max(1, min(2, n_blocks // 2))
    sms = _sm_count(device) if sm_count is None else sm_count
    splits = model_num_splits(batch, n_kv_heads, m_blocks, n_blocks, sms)
    lone = batch * n_kv_heads * m_blocks * splits <= sms
    if paged and lone:
        splits = min(_max_splits(n_blocks), PAGED_SPLIT_FACTOR * splits, PAGED_MAX_SPLITS)
    elif lone and n_blocks // (LONE_SPLIT_FACTOR * splits) >= LONE_SPLIT_MIN_BLOCKS:
        splits = min(_max_splits(n_blocks), LONE_SPLIT_FACTOR * splits)
    return splits


def validate_decode(q, k_cache, v_cache, cache_seqlens, num_splits=None, block_table=None,
                    check_lengths: bool = True) -> None:
    """Raise ``ValueError`` (one plain sentence) unless the inputs fit :func:`decode_attention`.

    With ``check_lengths`` the lengths are checked against the caches'
    capacity and against ``T`` (one copy of two numbers from the device).
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch tensor, not {type(t).__name__}.")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions, but it has {t.dim()} (shape {tuple(t.shape)}).")
    if not (q.device == k_cache.device == v_cache.device == cache_seqlens.device):
        raise ValueError("q, k_cache, v_cache and cache_seqlens must be on one device.")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must have one dtype, but they have {q.dtype}, {k_cache.dtype} and {v_cache.dtype}.")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported: use float16, bfloat16 or float32.")
    problem = bf16_problem(q.dtype, q.device)
    if problem:
        raise ValueError(problem)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, but they are {tuple(k_cache.shape)} and {tuple(v_cache.shape)}.")
    (b, hq, t, d), (_, hkv, _, dk) = q.shape, k_cache.shape
    if not 1 <= t <= MAX_T:
        raise ValueError(f"q holds {t} new tokens per sequence; decoding takes 1 to {MAX_T}.")
    if d != dk:
        raise ValueError(f"q has head dim {d} but the caches have {dk}.")
    if not 16 <= d <= 256:
        raise ValueError(f"head dim {d} is not supported: it must be between 16 and 256.")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of key/value heads ({hkv}).")
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens must be an int32 tensor of shape ({b},), but it is {cache_seqlens.dtype} of shape {tuple(cache_seqlens.shape)}.")
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"q has batch size {b} but the caches have {k_cache.shape[0]}.")
        capacity = k_cache.shape[2]
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != b or block_table.device != q.device:
            raise ValueError(f"block_table must be an int32 tensor [B, max_pages] with B = {b} on q's device.")
        capacity = block_table.shape[1] * k_cache.shape[2]
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an int from 1 to {MAX_SPLITS}, or None, not {num_splits!r}.")
    if q.device.type == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the tensors are on the CPU but Triton's interpreter is off: move them to the GPU "
                             "(or import course_utils before triton on a machine without one).")
    if check_lengths and b > 0:
        lo, hi = torch.stack([cache_seqlens.min(), cache_seqlens.max()]).tolist()
        if hi > capacity:
            raise ValueError(f"cache_seqlens holds {hi}, more than the {capacity} tokens the cache can hold.")
        if lo < t:
            raise ValueError(f"cache_seqlens holds {lo}, fewer than the {t} new tokens, which are part of the cache.")


def _rows_per_block(group_size: int, t: int) -> int:
    """``BLOCK_M``: the packed rows ``group_size * T``, padded to a power of two (16 to 64)."""
    return min(64, max(16, triton.next_power_of_2(group_size * t)))


def decode_split(q, k_cache, v_cache, cache_seqlens, num_splits: int, block_table=None, *, BLOCK_N=None,
                 out=None, kernel=None, num_warps=None, num_stages=None, extra=None):
    """Launch the split kernel: ``(o_parts, lse_parts)``, float32 ``[B, Hq, T, S, D]`` and ``[B, Hq, T, S]``.

    With ``out`` given and one split, the result goes to ``out`` instead and
    ``(out, None)`` is returned. ``kernel`` replaces the module's kernel (the
    lesson passes its own). ``BLOCK_N``, ``num_warps`` and ``num_stages``
    replace :func:`decode_config`'s choice (``benchmarks/tune_decode.py``). ``extra``: more keyword
    arguments for the launch (a ``kernel`` that takes more, :mod:`.fast_decode`'s).
    """
    kernel = _decode_split_kernel if kernel is None else kernel
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    paged = block_table is not None
    block_m, m_blocks, capacity = _launch_shape(q, k_cache, block_table)
    cfg = launch_config(q, k_cache, num_splits, block_table)
    for key, value in (("BLOCK_N", BLOCK_N), ("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None:
            cfg[key] = value
    direct = out is not None and num_splits == 1
    if direct:
        o_parts = lse_parts = out  # unused by the kernel
    else:
        o_parts = torch.empty((B, Hq, T, num_splits, D), dtype=torch.float32, device=q.device)
        lse_parts = torch.empty((B, Hq, T, num_splits), dtype=torch.float32, device=q.device)
    o = out if direct else o_parts
    if paged:
        table, stride_tb, stride_tp = block_table, block_table.stride(0), block_table.stride(1)
    else:
        table, stride_tb, stride_tp = cache_seqlens, 0, 0  # never read
    page_size = k_cache.shape[2]
    grid = (num_splits, m_blocks, B * Hkv)
    kernel[grid](
        q, k_cache, v_cache, cache_seqlens, table, o_parts, lse_parts, o,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), stride_tb, stride_tp,
        *(o.stride() if direct else (0, 0, 0, 0)),
        Hq, Hkv, T, capacity, page_size, num_splits, LOG2E / math.sqrt(D),
        D=D, D_PAD=triton.next_power_of_2(max(D, 16)), BLOCK_M=block_m, PAGED=paged, SPLIT=not direct, **cfg,
        **(extra or {}),
    )
    return (out, None) if direct else (o_parts, lse_parts)


def decode_combine(o_parts, lse_parts, out, *, kernel=None, extra=None):
    """Launch the combine kernel: merge ``o_parts``/``lse_parts`` into ``out`` ``[B, Hq, T, D]``; returns ``out``.
    ``kernel`` and ``extra`` as in :func:`decode_split`."""
    kernel = _decode_combine_kernel if kernel is None else kernel
    B, Hq, T, S, D = o_parts.shape
    kernel[(B * Hq * T,)](
        o_parts, lse_parts, out, *out.stride(), Hq, T, S,
        D=D, D_PAD=triton.next_power_of_2(max(D, 16)), S_PAD=triton.next_power_of_2(S), **(extra or {}),
    )
    return out


def launch_decode(q, k_cache, v_cache, cache_seqlens, num_splits=None, block_table=None):
    """:func:`decode_attention` without its input checks: nothing copied from the device.

    The checks of :func:`decode_attention` read ``cache_seqlens`` on the host,
    which makes the CPU wait for the GPU at every call; an inference engine
    that knows its inputs are right (and the benchmark, once it has checked
    them) launches the kernels with this instead.
    """
    if num_splits is None:
        num_splits = launch_splits(q, k_cache, block_table)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    if num_splits == 1:
        return decode_split(q, k_cache, v_cache, cache_seqlens, 1, block_table, out=out)[0]
    o_parts, lse_parts = decode_split(q, k_cache, v_cache, cache_seqlens, num_splits, block_table)
    return decode_combine(o_parts, lse_parts, out)


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, num_splits=None, block_table=None):
    """Attention of ``T`` new queries per sequence over a KV cache (flash-decoding).

    ``q``: ``[B, Hq, T, D]``, ``1 <= T <= 16``. ``k_cache``, ``v_cache``:
    ``[B, Hkv, N_max, D]``, or paged ``[num_pages, Hkv, page_size, D]`` with
    ``block_table`` int32 ``[B, max_pages]`` (page ``block_table[b, p]`` holds
    tokens ``p * page_size .. (p + 1) * page_size - 1`` of sequence ``b``).
    ``cache_seqlens``: int32 ``[B]``, the valid tokens of each sequence, the
    new ones included: query ``t`` sits at position ``cache_seqlens[b] - T +
    t`` and sees the keys up to it. Entries past a sequence's length are never
    read. ``Hq`` a multiple of ``Hkv`` (MHA, GQA, MQA). ``num_splits=None``
    picks the split count (:func:`pick_num_splits`). Returns ``o`` with
    ``q``'s shape and dtype. Bad input raises a ``ValueError`` of one
    sentence; checking the lengths copies two numbers from the device.
    """
    validate_decode(q, k_cache, v_cache, cache_seqlens, num_splits, block_table)
    return launch_decode(q, k_cache, v_cache, cache_seqlens, num_splits, block_table)
