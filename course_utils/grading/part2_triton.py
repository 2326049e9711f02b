"""Checks for lessons 04 and 05: the FlashAttention forward pass in Triton.

- :func:`check_kv_head` grades a plain-Python warm-up, ``fn(q_head,
  n_q_heads, n_kv_heads) -> kv_head``, the query-head to key/value-head
  mapping of grouped-query attention.
- :func:`check_flash_forward` grades ``fn(q, k, v, causal=False) -> o`` for
  multi-head attention (lesson 04's kernel).
- :func:`check_flash_gqa` grades ``fn(q, k, v) -> (o, lse)``: causal
  attention with GQA/MQA and the natural-log logsumexp of each row (lesson
  05's kernel, and the classmate's kernel of lesson 05b).

The Triton checks compare with the float64 references of
:mod:`course_utils.references`, on fixed cases first (each adds one
difficulty: a tail block, a batch, a transposed layout, ...) and then on fresh
random cases every call. Every input lives in a NaN-filled buffer
(:func:`.inputs.nan_padded` and friends), so a load that reads past the end of
a row, a head or the sequence brings NaN into the output instead of plausible
garbage. A Triton kernel must run (:func:`.proof.count_launches`), and on the
CPU the check runs in a forked process (:func:`.isolation.isolated`), so a
kernel that crashes the interpreter does not take the notebook down.

A wrong answer is explained by the first diagnosis whose mistake it matches.
Each is recognised by computing, in NumPy, what the mistaken kernel would
output on the same inputs. Several mistakes (a causal loop that skips or
repeats the diagonal block, an accumulator that is not rescaled) give
outputs that depend on the learner's block sizes, so the models try every
power of two from 16 up and name the one that fits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import numpy as np

from .. import references as ref
from ..environment import current
from . import inputs, isolation, proof
from .core import Diagnosis, Run, distance_to, require_callable

__all__ = ["check_kv_head", "check_flash_forward", "check_flash_gqa"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# -- messages: one plain sentence or two each; the tests look for these texts --
MSG_NO_KERNEL = (
    "no Triton kernel ran: your function must compute attention by launching your "
    "@triton.jit kernel (`kernel[grid](...)`), not with torch code such as "
    "torch.nn.functional.scaled_dot_product_attention."
)
MSG_KV_INTERLEAVED = (
    "this is `q_head % n_kv_heads`, the interleaved mapping. The query heads that share a "
    "key/value head are consecutive: heads 0 .. group_size-1 use kv head 0, the next "
    "group_size use kv head 1, so kv_head = q_head // group_size with "
    "group_size = n_q_heads // n_kv_heads."
)
MSG_KV_DIV_NKV = (
    "this is `q_head // n_kv_heads`: divide by the group size (group_size = n_q_heads // "
    "n_kv_heads, the number of query heads per kv head), not by the number of kv heads."
)
MSG_KV_OUT_OF_RANGE = (
    "query heads {heads} came out NaN while the others read a real kv head: they read a kv head that "
    "does not exist (an index >= n_kv_heads = {n_kv}, in the memory after k and v). The map must stay "
    "below n_kv_heads: kv_head = q_head // group_size, with group_size = n_q_heads // n_kv_heads = {group}."
)
MSG_KV_OTHER = "kv_head = q_head // group_size, with group_size = n_q_heads // n_kv_heads."
MSG_KV_FLOAT = (
    "returned a float: use integer division `//` (a head index is an int; `/` gives a float)."
)
MSG_NO_CAUSAL = (
    "the causal mask was not applied: with causal=True, query i must not see keys j > i "
    "(set those scores to -inf with tl.where(offs_m[:, None] >= offs_n[None, :], s, -inf))."
)
MSG_CAUSAL_STRICT = (
    "the causal mask is off by one: it hides the diagonal too (query i sees only keys j < i, "
    "so row 0 sees nothing and comes out NaN). Keep keys with offs_m >= offs_n, not >."
)
MSG_CAUSAL_SHIFTED = (
    "the causal mask is off by one: query i also sees key i + 1. Keep keys with "
    "offs_m[:, None] >= offs_n[None, :]."
)
MSG_DIAG_SKIPPED = (
    "the causal loop stops before the diagonal block (BLOCK_M = {block} fits): each query "
    "block only sees the keys of earlier blocks, so the first block's rows come out NaN. "
    "The keys a query block can see end at min(N, (pid_m + 1) * BLOCK_M), and the diagonal "
    "block needs the masked pass."
)
MSG_DIAG_UNMASKED = (
    "the diagonal block was processed without the causal mask (BLOCK_M = {block} fits): "
    "each row also sees the later keys of its own query block. Mask that block with "
    "offs_m[:, None] >= offs_n[None, :] (in a two-phase loop, the unmasked phase must end "
    "at pid_m * BLOCK_M, where the masked diagonal phase starts)."
)
MSG_DIAG_TWICE = (
    "the diagonal block was counted twice (BLOCK_M = {block} fits): the unmasked phase ran "
    "up to (pid_m + 1) * BLOCK_M and the masked phase then did the diagonal block again. "
    "Phase 1 covers [0, pid_m * BLOCK_M), phase 2 [pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M)."
)
MSG_OVERLAP = (
    "keys before the diagonal block were counted twice (BLOCK_M = {block} fits): the masked "
    "phase started at 0 instead of at pid_m * BLOCK_M, where the unmasked phase ended."
)
MSG_TAIL_UNMASKED = (
    "keys past the end of the sequence were not masked (BLOCK_N = {block} fits): in the last, "
    "partial K/V block the padding keys load as 0, score 0 and count in the softmax. Set "
    "their scores to -inf with tl.where(offs_n[None, :] < N, s, -inf)."
)
MSG_ACC_NOT_RESCALED = (
    "the accumulator is not rescaled (BLOCK_N = {block} fits): when the running max grows "
    "from m_i to m_new, multiply acc by alpha = exp(m_i - m_new) before adding p @ v, as "
    "you do for l_i."
)
MSG_NOT_RESCALED = (
    "neither acc nor l_i is rescaled when the running max grows (BLOCK_N = {block} fits): "
    "multiply both by alpha = exp(m_i - m_new) before adding the new block."
)
MSG_NO_SCALE = "the scores are not scaled: multiply q @ k^T by sm_scale = 1/sqrt(D) before the softmax."
MSG_SCALE_TWICE = "the scores were scaled twice (by 1/D): multiply by sm_scale = 1/sqrt(D) once."
MSG_EXP2_NO_LOG2E = (
    "the kernel uses exp2 on natural-log scores: exp(x) == exp2(x * log2(e)), so fold "
    "log2(e) = 1.4427 into the scale (qk_scale = sm_scale * 1.4427) when you use tl.exp2."
)
MSG_M_INIT_ZERO = (
    "the rows whose scores are all far below 0 (about -150) came out NaN while the others are right: "
    "m_i starts at 0 instead of -inf, so for those rows exp(s - m_i) underflows to 0 for every key, "
    "l_i stays 0 and o = 0/0. Start the running max at -inf: tl.full([BLOCK_M], float('-inf'), tl.float32)."
)
MSG_NO_RUNNING_MAX = (
    "the rows whose scores are large (about +-150) came out inf or NaN while small scores are right: "
    "the scores are exponentiated without subtracting the running max (exp(150) overflows, exp(-150) "
    "underflows to 0). Keep m_i, the largest score seen so far, use p = exp(s - m_new) and rescale acc "
    "and l_i by alpha = exp(m_i - m_new)."
)
MSG_L_NOT_RESCALED = (
    "l_i is not rescaled (BLOCK_N = {block} fits): when the running max grows from m_i to m_new, "
    "multiply l_i by alpha = exp(m_i - m_new) before adding the new block's row sums, as you do for acc."
)
MSG_EXP_WITH_LOG2E = (
    "the kernel uses tl.exp on scores that include the log2(e) = 1.4427 factor: that factor is for "
    "tl.exp2 (exp(x) == exp2(x * log2(e))). With tl.exp, scale by sm_scale alone."
)
MSG_BOUND_FLOORED = (
    "the causal loop's end is rounded down to a whole K/V block (BLOCK_M, BLOCK_N = {block} fits): the "
    "keys of the last, partial block before min(N, (pid_m + 1) * BLOCK_M) are never visited. Loop "
    "`for start_n in range(0, kv_end, BLOCK_N)` with kv_end = min(N, (pid_m + 1) * BLOCK_M), and mask "
    "the keys past kv_end, or round the number of blocks up with tl.cdiv."
)
MSG_O_STRIDES = (
    "the output was written with q's strides: here q is shared across the batch (batch stride "
    "0), so every batch element wrote into the first one's place. Address O with its own "
    "strides (o.stride()), which differ from q's whenever q is not laid out like o."
)
MSG_BATCH_STRIDE = (
    "only the first batch element is right: every program read and wrote batch 0, so the batch "
    "index is not used in the addresses (or its stride is 0). Add pid_z * stride_qz (and stride_kz, "
    "stride_vz, stride_oz) to each tensor's base pointer, with each tensor's own batch stride."
)
MSG_OR_O_STRIDES = (
    " Or the output was written with q's strides: here q is shared across the batch (batch stride 0), "
    "so every batch element wrote into the first one's place, and batch 0's store came last. Address O "
    "with its own strides (o.stride())."
)
MSG_D_STRIDE = (
    "this is the first case whose head dim is not contiguous (q.stride(-1) != 1). A kernel "
    "that passes the other cases and fails here usually steps along D by 1 instead of by "
    "the head-dim stride: multiply offs_d by stride_qk / stride_kk / stride_vk."
)
MSG_OOB = (
    "the output holds NaN although the inputs have none: a load reads past the end of the "
    "data (here everything past the last row, head or column is NaN; in real memory it is "
    "garbage). Mask every tl.load whose offsets can pass the end: the last, partial block of "
    "queries or keys (offs < N) and, if D is padded, the head-dim columns (offs_d < D)."
)
MSG_LSE_BASE2 = (
    "lse is in base 2: m_i and log2(l_i) are in log2 units when you use exp2. Multiply "
    "(m_i + log2(l_i)) by ln(2) = 0.6931 to get the natural-log lse the backward pass uses."
)
MSG_LSE_MIXED = (
    "lse mixes bases: one of m_i and log(l_i) is in log2 units and the other in natural "
    "log. With exp2, use (m_i + tl.log2(l_i)) * ln(2); with exp, m_i + tl.log(l_i)."
)
MSG_LSE_NO_MAX = (
    "lse is missing the running max: l_i sums exp(s - m_i), so lse = m_i + log(l_i), "
    "not log(l_i) alone."
)

# o: (atol, rtol); lse: atol. Float32 is exact in the interpreter but uses tf32
# tensor cores on a GPU (about 1e-3 relative); half precision rounds p before
# the p @ v product. All are far below the errors the diagnoses describe.
_TOLERANCES = {
    ("cpu", "float32"): (2e-4, 2e-4, 2e-4),
    ("cuda", "float32"): (3e-3, 3e-3, 1e-2),
    ("cpu", "float16"): (1e-2, 1e-2, 1e-2),
    ("cuda", "float16"): (1e-2, 1e-2, 1e-2),
    ("cuda", "bfloat16"): (3e-2, 3e-2, 3e-2),
}

_BLOCKS = (16, 32, 64, 128, 256)  # block sizes the models try

# A mistaken kernel's output matches its model only up to the kernel's own rounding,
# which some mistakes amplify (without 1/sqrt(D) the softmax is sharp, and tf32's score
# errors show). So models are matched with this many times the check's tolerance; the
# mistakes differ from each other and from the right answer by far more.
_SLACK = 4.0

LAYOUTS = {
    "contiguous": "contiguous",
    "padded": "rows and heads spaced apart (NaN between them)",
    "transposed": "a [B, N, H, D] buffer viewed as [B, H, N, D]",
    "dstride": "head dim not contiguous (stride(-1) != 1)",
    "qbcast": "q shared across the batch (q.stride(0) == 0)",
}


# =============================================================================
# check_kv_head: the q-head -> kv-head mapping, in plain Python
# =============================================================================
def _kv_combos(rng):
    """(n_q_heads, n_kv_heads) pairs: MHA first, then MQA, then GQA, then random."""
    small = [(n, n) for n in range(1, 9)] + [(n, 1) for n in range(2, 9)]
    small += [(nq, nkv) for nq in range(2, 17) for nkv in range(2, nq) if nq % nkv == 0]
    random = []
    for _ in range(6):
        nkv = int(rng.integers(1, 17))
        random.append((nkv * int(rng.integers(1, 9)), nkv))
    return small + random


def check_kv_head(fn, *, seed=None):
    """Grade ``fn(q_head, n_q_heads, n_kv_heads) -> kv_head`` (plain Python ints).

    In grouped-query attention ``n_q_heads`` query heads share ``n_kv_heads``
    key/value heads (``n_q_heads`` a multiple of ``n_kv_heads``), each kv head
    serving ``group_size = n_q_heads // n_kv_heads`` consecutive query heads.
    Every small combination is tried (MHA, MQA, GQA up to 16 query heads),
    then fresh random ones; every query head of each.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_kv_head")
    run = Run("check_kv_head", seed, time_limit_s=10.0)
    for n_q, n_kv in _kv_combos(run.rng):
        case = f"n_q_heads={n_q}, n_kv_heads={n_kv}"
        got = []
        for q_head in range(n_q):
            out = run.call(fn, q_head, n_q, n_kv, case=f"{case}, q_head={q_head}")
            if isinstance(out, float):
                raise run.fail(f"your function {MSG_KV_FLOAT} (got {out!r} for q_head={q_head})", case)
            try:
                value = operator.index(out)
            except TypeError:
                raise run.fail(
                    f"your function returned a {type(out).__name__} for q_head={q_head}; return a Python int.",
                    case) from None
            got.append(value)
        got = np.array(got, dtype=np.float64)
        q = np.arange(n_q)
        expected = q // (n_q // n_kv)
        diagnoses = [
            Diagnosis(MSG_KV_INTERLEAVED, expected=q % n_kv),
            Diagnosis(MSG_KV_DIV_NKV, expected=q // n_kv),
            Diagnosis(MSG_KV_OTHER, when=lambda a: True),
        ]
        run.compare(got, expected, case=case, what="the kv head", atol=0.0, rtol=0.0,
                    diagnoses=diagnoses, axes=("q_head",))
    return run.passed()


# =============================================================================
# Inputs
# =============================================================================
@dataclasses.dataclass
class _Case:
    desc: str
    B: int
    Hq: int
    Hkv: int
    N: int
    D: int
    dtype: str
    layout: str
    causal: bool
    v_offsets: bool = False  # kv head j's values shifted by j, so heads are told apart at a glance
    shifted: bool = False  # query rows' scores shifted by up to +-1000 (see _SHIFTS)
    same_shape_as: int | None = None  # a repeat of fixed case i's shape with new values


def _describe(c: _Case, prefix: str, gqa: bool) -> str:
    heads = f"Hq={c.Hq}, Hkv={c.Hkv}" if gqa else f"H={c.Hq}"
    kind = ""
    if gqa:
        kind = " (MHA)" if c.Hq == c.Hkv else " (MQA)" if c.Hkv == 1 else f" (GQA, group_size {c.Hq // c.Hkv})"
    causal = "" if gqa else (", causal" if c.causal else ", not causal")
    extra = ", kv head j's values shifted by j" if c.v_offsets else ""
    if c.shifted:
        extra += ", rows whose scores are all near -150, -60, 0, +60 or +150"
    if c.same_shape_as is not None:
        extra += f", the shape of fixed {c.same_shape_as + 1} again with new values"
    return (f"{prefix}: B={c.B}, {heads}{kind}, N={c.N}, D={c.D}, {c.dtype}{causal}, "
            f"{LAYOUTS[c.layout]}{extra}")


def _guarded_contiguous(t):
    """A contiguous copy of ``t`` followed by NaN in memory (reads past its end read NaN)."""
    import torch

    n = t.numel()
    buf = torch.full((n + 4096,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[:n].view(t.shape)
    view.copy_(t)
    return view


def _dstrided(t, pad):
    """``t`` viewed from a NaN-filled ``[B, H, D, N + pad]`` buffer: the head dim has stride N + pad."""
    import torch

    B, H, N, D = t.shape
    buf = torch.full((B, H, D, N + pad), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[..., :N].transpose(-1, -2)
    view.copy_(t)
    return view


def _place(t, layout, rng):
    if layout == "contiguous":
        return _guarded_contiguous(t)
    if layout == "padded":
        return inputs.nan_padded(t, cols=int(rng.integers(1, 9)))
    if layout == "transposed":
        return inputs.nan_padded(t, transpose_heads=True)
    if layout == "dstride":
        return _dstrided(t, int(rng.integers(1, 9)))
    raise ValueError(layout)


def _make_inputs(rng, c: _Case, device):
    """q, k, v torch tensors laid out as the case says, and their float64 values."""
    import torch

    dtype = getattr(torch, c.dtype)
    qv = rng.standard_normal((c.B if c.layout != "qbcast" else 1, c.Hq, c.N, c.D))
    kv = rng.standard_normal((c.B, c.Hkv, c.N, c.D))
    vv = rng.standard_normal((c.B, c.Hkv, c.N, c.D))
    if c.v_offsets:
        vv = vv + np.arange(c.Hkv)[None, :, None, None]
    if c.shifted:  # s_ij = q_i0 * ALPHA / sqrt(D) + O(1): every key of row i shifted alike
        kv[..., 0] = _SHIFT_ALPHA
        beta = np.resize(np.array(_SHIFTS) * math.sqrt(c.D) / _SHIFT_ALPHA, c.N)
        qv[..., 0] = np.round(beta)  # the reference uses the values after rounding to the dtype
    q, k, v = (torch.tensor(x, dtype=dtype, device=device) for x in (qv, kv, vv))
    if c.layout == "qbcast":
        q = _guarded_contiguous(q).expand(c.B, c.Hq, c.N, c.D)
        k, v = inputs.nan_padded(k), inputs.nan_padded(v)
    else:
        q, k, v = (_place(t, c.layout, rng) for t in (q, k, v))
    q64, k64, v64 = (t.detach().cpu().double().numpy() for t in (q, k, v))
    return q, k, v, q64, k64, v64


_SHIFT_ALPHA = 16.0
# Row i's scores sit near _SHIFTS[i % 5]. The kernels compute scores in float32, where exp
# overflows above 88.7 and underflows below -103.9, so +-150 is beyond both; larger shifts
# would only add float32 rounding (about |s| * 6e-8) to a correct kernel's scores.
_SHIFTS = (-150.0, 0.0, 150.0, -60.0, 60.0)


def _fixed_cases(gqa: bool, device: str) -> list[_Case]:
    f32, f16 = "float32", "float16"
    half = "bfloat16" if device == "cuda" and current().bf16_ok else f16
    # Scores near +-1000 need exact products: float32 in the interpreter (whose tl.dot is exact there),
    # the GPU's half precision there (fp32 would use tf32, whose rounding of q, k shows at 1000).
    big = f32 if device == "cpu" else half
    if not gqa:
        cases = [
            _Case("", 1, 2, 2, 64, 32, f32, "contiguous", False),
            _Case("", 1, 2, 2, 160, 32, f32, "contiguous", True),
            _Case("", 2, 2, 2, 48, 32, f32, "qbcast", True),
            _Case("", 1, 2, 2, 100, 64, f32, "padded", False),
            _Case("", 1, 2, 2, 100, 16, f16, "padded", True),
            _Case("", 2, 3, 3, 80, 64, half, "transposed", True),
            _Case("", 1, 2, 2, 50, 32, f32, "dstride", False),
            _Case("", 1, 1, 1, 300, 128, big, "padded", True, shifted=True),
            _Case("", 1, 2, 2, 64, 32, f32, "contiguous", False, same_shape_as=0),
        ]
    else:
        cases = [
            _Case("", 1, 2, 2, 160, 32, f32, "contiguous", True),
            _Case("", 1, 8, 4, 64, 16, f32, "contiguous", True, v_offsets=True),
            _Case("", 2, 4, 2, 48, 32, f32, "qbcast", True),
            _Case("", 1, 4, 2, 100, 64, f32, "padded", True),
            _Case("", 2, 4, 1, 80, 32, half, "transposed", True),
            _Case("", 1, 4, 2, 50, 32, f16, "dstride", True),
            _Case("", 1, 2, 1, 300, 128, big, "padded", True, shifted=True),
            _Case("", 1, 2, 2, 160, 32, f32, "contiguous", True, same_shape_as=0),
        ]
    if device == "cuda":  # bigger, and the GPU's own half precision
        cases.append(_Case("", 2, 8, 2 if gqa else 8, 1000, 128, half, "padded", True))
        cases.append(_Case("", 1, 4, 4, 777, 64, "float16", "transposed", gqa))  # check_flash_gqa is always causal
    for i, c in enumerate(cases):
        c.desc = _describe(c, f"fixed {i + 1}", gqa)
    return cases


def _random_cases(rng, gqa: bool, device: str, count: int = 3) -> list[_Case]:
    """Fresh shapes every call: N not a multiple of the blocks, batches, groups, layouts, dtypes."""
    gpu = device == "cuda"
    dtypes = ["float32", "float16"] + (["bfloat16"] if gpu and current().bf16_ok else [])
    layouts = ["contiguous", "padded", "transposed", "dstride"]
    kinds = list(rng.permutation(["MHA", "GQA", "MQA"])) if gqa else ["MHA"] * count
    cases = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        if kind == "MHA":
            hkv = int(rng.integers(1, 5))
            hq = hkv
        elif kind == "MQA":
            hkv, hq = 1, int(rng.choice([2, 4, 8]))
        else:
            group = int(rng.choice([2, 4, 8]))
            hkv = int(rng.integers(1, (16 if gpu else 8) // group + 1))
            hq = hkv * group
        n = int(rng.integers(17, 1200 if gpu else 161))
        b = int(rng.integers(1, 3 if not gpu else 4))
        if not gpu:  # keep the interpreter to a few seconds: at most ~1300 query rows per head
            while b * hq * n > 1300 and b > 1:
                b -= 1
            n = min(n, max(17, 1300 // (b * hq)))
        c = _Case("", b, hq, hkv, n, int(rng.choice([16, 32, 64, 128])),
                  str(rng.choice(dtypes)), str(rng.choice(layouts)),
                  True if gqa else bool(rng.integers(2)))
        c.desc = _describe(c, f"random {i + 1}", gqa)
        cases.append(c)
    return cases


# =============================================================================
# What mistaken kernels output (NumPy, float64)
# =============================================================================
def _scores(q64, k64, scale):
    return scale * (q64 @ np.swapaxes(k64, -1, -2))


def _weighted(s, v, w, phantom=None):
    """Attention where key j counts ``w[i, j]`` times for query i.

    ``phantom[i]`` extra keys with score 0 and value 0 also count (what a kernel
    sees when it loads padding keys as 0 and forgets to mask their scores).
    Rows with nothing to attend to come out NaN (0/0), as in a kernel.
    Returns ``(o, lse)``.
    """
    with np.errstate(all="ignore"):
        s = np.where(w > 0, s, -np.inf)
        m = np.max(s, axis=-1)
        if phantom is not None:
            m = np.maximum(m, np.where(phantom > 0, 0.0, -np.inf))
        e = np.where(w > 0, w * np.exp(s - m[..., None]), 0.0)
        l = e.sum(-1)
        if phantom is not None:
            l = l + phantom * np.exp(-m)
        o = (e @ v) / l[..., None]
        lse = m + np.log(l)
    return o, lse


def _online(s, v, block_n, rescale_acc=True, rescale_l=True):
    """The online softmax over K/V blocks of ``block_n``, optionally without the rescaling."""
    with np.errstate(all="ignore"):
        m = np.full(s.shape[:-1], -np.inf)
        l = np.zeros(s.shape[:-1])
        acc = np.zeros(s.shape[:-1] + (v.shape[-1],))
        for start in range(0, s.shape[-1], block_n):
            sb = s[..., start:start + block_n]
            m_new = np.maximum(m, sb.max(-1))
            alpha = np.exp(m - m_new)
            p = np.exp(sb - m_new[..., None])
            l = (l * alpha if rescale_l else l) + p.sum(-1)
            acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ v[..., start:start + block_n, :]
            m = m_new
        return acc / l[..., None]


def _same(actual, wrong, atol, rtol) -> bool:
    """``actual`` is ``wrong``: non-finite in the same places, close elsewhere."""
    if wrong is None or wrong.shape != actual.shape:
        return False
    bad = ~np.isfinite(wrong)
    if bad.all() or (bad != ~np.isfinite(actual)).any():
        return False
    return bool(np.allclose(actual[~bad], wrong[~bad], atol=atol, rtol=rtol))


class _Model(Diagnosis):
    """A mistake recognised by its predicted output, for each candidate block size."""

    def __init__(self, message, predict, sizes=(None,)):
        super().__init__(message)
        self.template, self.predict, self.sizes = message, predict, sizes

    def matches(self, actual, atol, rtol):
        for size in self.sizes:
            with np.errstate(all="ignore"):
                wrong = self.predict(size)
            if _same(actual, wrong, atol * _SLACK, rtol * _SLACK):
                self.message = self.template.format(block=size)
                self.matched_distance = distance_to(actual, wrong, atol, rtol)
                return True
        return False


class _KvMapping(Diagnosis):
    """Each query head's output is the attention of some kv head: say which, if not the right one."""

    def __init__(self, q64, k64, v64, causal):
        super().__init__("")
        self.q64, self.k64, self.v64, self.causal = q64, k64, v64, causal

    def matches(self, actual, atol, rtol):
        n_q, n_kv = self.q64.shape[1], self.k64.shape[1]
        if n_kv < 2 and n_q < 2:
            return False
        read = []
        for h in range(n_q):
            for j in range(n_kv):
                o = ref.attention(self.q64[:, h], self.k64[:, j], self.v64[:, j], causal=self.causal)
                if _same(actual[:, h], o, atol * _SLACK, rtol * _SLACK):
                    read.append(j)
                    break
            else:
                return False
        group = n_q // n_kv
        want = [h // group for h in range(n_q)]
        if read == want:
            return False
        shown = min(n_q, 16)
        pairs = ", ".join(f"{h}->{j}" for h, j in zip(range(shown), read))
        want_pairs = ", ".join(f"{h}->{j}" for h, j in zip(range(shown), want))
        more = ", ..." if n_q > shown else ""
        head = (f"query heads read the wrong key/value heads (query head -> kv head): "
                f"{pairs}{more}; expected {want_pairs}{more} (n_q_heads={n_q}, n_kv_heads={n_kv}, "
                f"group_size={group}). ")
        q = np.arange(n_q)
        if read == list(q % n_kv):
            why = MSG_KV_INTERLEAVED
        elif read == list(q // n_kv):
            why = MSG_KV_DIV_NKV
        else:
            why = MSG_KV_OTHER
        self.message = head + why[0].upper() + why[1:]
        return True


class _KvOutOfRange(Diagnosis):
    """Some query heads came out non-finite while the others read a real kv head: a map past the last kv head."""

    def __init__(self, q64, k64, v64, causal):
        super().__init__("")
        self.q64, self.k64, self.v64, self.causal = q64, k64, v64, causal

    def matches(self, actual, atol, rtol):
        n_q, n_kv = self.q64.shape[1], self.k64.shape[1]
        bad = [h for h in range(n_q) if not np.isfinite(actual[:, h]).all()]
        if not bad or len(bad) == n_q or n_kv == n_q and n_q == 1:
            return False
        # A kv head that does not exist is read by every row of its query heads: each row is
        # non-finite. NaN in some rows only (the last block's, say) is a read past the end instead.
        if not all((~np.isfinite(actual[:, h])).any(axis=-1).all() for h in bad):
            return False
        for h in range(n_q):
            if h in bad:
                continue
            if not any(_same(actual[:, h], ref.attention(self.q64[:, h], self.k64[:, j], self.v64[:, j],
                                                         causal=self.causal), atol * _SLACK, rtol * _SLACK)
                       for j in range(n_kv)):
                return False
        heads = ", ".join(str(h) for h in bad[:16]) + (", ..." if len(bad) > 16 else "")
        self.message = MSG_KV_OUT_OF_RANGE.format(heads=heads, n_kv=n_kv, group=n_q // n_kv)
        return True


def _causal_weights(n, kind, block_m):
    """Weights ``w[i, j]`` (how often key j counts for query i) of a causal loop, and phantom counts.

    ``block_m`` is the learner's query-block size; ``start``/``end`` are the
    first key of each row's diagonal block and the key after it.
    """
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    start = (i // block_m) * block_m
    end = start + block_m
    below = j <= i
    phantom = np.maximum(0, end[:, 0] - n).astype(np.float64)
    if kind == "skip":
        return (j < start).astype(float), None
    if kind == "unmasked":
        return (j < end).astype(float), phantom
    if kind == "unmasked_guarded":
        return (j < end).astype(float), None
    if kind == "twice":
        return (j < end).astype(float) + ((j >= start) & below), phantom
    if kind == "twice_guarded":
        return (j < end).astype(float) + ((j >= start) & below), None
    if kind == "shifted":  # j <= i + 1, but the loop still stops at the end of the query block
        return ((j <= i + 1) & (j < end)).astype(float), None
    if kind == "overlap":
        return (j < start).astype(float) + below, None
    raise ValueError(kind)


def _floored_weights(n, block_m, block_n):
    """A causal loop whose end min(N, (pid_m + 1) * BLOCK_M) is rounded down to a multiple of BLOCK_N."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    end = np.minimum(n, (i // block_m + 1) * block_m) // block_n * block_n
    w = ((j <= i) & (j < end)).astype(float)
    return w


def _shift_diagnoses(row_max):
    """Rows with scores near -1000 or +1000 wrong while the rest are right: which stability mistake."""
    low, high = row_max < -110.0, row_max > 90.0

    def bad_rows(actual):
        return ~np.isfinite(actual).all(-1)

    def m_init_zero(actual):
        bad = bad_rows(actual)
        return bool(bad.any() and not (bad & ~low).any() and bad[low].all())

    def no_max(actual):
        bad = bad_rows(actual)
        return bool(bad.any() and not (bad & ~(low | high)).any() and bad[high].all())

    return [Diagnosis(MSG_M_INIT_ZERO, when=m_init_zero), Diagnosis(MSG_NO_RUNNING_MAX, when=no_max)]


def _output_diagnoses(c: _Case, q64, k64, v64, expected, o_atol, o_rtol, gqa: bool):
    """The known mistakes for the output ``o``, most specific first."""
    n, d = c.N, c.D
    blocks = tuple(b for b in _BLOCKS if b < 2 * n) or (16,)
    k_rep, v_rep = ref.repeat_kv_heads(q64, k64, v64)
    sm_scale = 1.0 / math.sqrt(d)

    @functools.lru_cache(maxsize=None)
    def scores(scale=sm_scale):
        return _scores(q64, k_rep, scale)

    def masked(s):
        return np.where(ref.causal_mask(n, n), s, -np.inf) if c.causal else s

    def causal_loop(kind):
        return lambda bm: _weighted(scores(), v_rep, _causal_weights(n, kind, bm)[0],
                                    _causal_weights(n, kind, bm)[1])[0]

    def mask_kind(w):
        return lambda _: _weighted(scores(), v_rep, w)[0]

    def scaled(scale):
        return lambda _: ref.attention(q64, k64, v64, causal=c.causal, scale=scale)

    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    out = []
    if c.layout == "qbcast":
        def o_with_q_strides(actual):
            # Every batch element wrote into the first one's place: its rows hold some batch's
            # right answer, and at least one of them a later batch's (reading k, v per batch).
            close = [np.isclose(actual[0], expected[b], atol=o_atol * _SLACK, rtol=o_rtol * _SLACK).all(-1)
                     for b in range(c.B)]
            per_row = np.logical_or.reduce(close)
            later = np.logical_or.reduce(close[1:]) & ~close[0]
            rest_ok = np.allclose(actual[1:], expected[1:], atol=o_atol, rtol=o_rtol)
            return bool(per_row.all() and later.any() and not rest_ok)
        out.append(Diagnosis(MSG_O_STRIDES, when=o_with_q_strides))
    if c.B > 1:
        def batch_stride_ignored(actual):
            # Every batch element computed and wrote batch 0's attention: o[0] right, the rest not.
            first_ok = np.allclose(actual[0], expected[0], atol=o_atol * _SLACK, rtol=o_rtol * _SLACK)
            return bool(first_ok and not np.allclose(actual[1:], expected[1:], atol=o_atol, rtol=o_rtol))
        # With q shared across the batch, O written with q's strides looks the same whenever batch 0's
        # programs store last (on a GPU the order is not fixed): name both.
        message = MSG_BATCH_STRIDE + (MSG_OR_O_STRIDES if c.layout == "qbcast" else "")
        out.append(Diagnosis(message, when=batch_stride_ignored))
    if gqa:
        out.append(_KvMapping(q64, k64, v64, c.causal))
        out.append(_KvOutOfRange(q64, k64, v64, c.causal))
    if c.causal:
        out += [
            _Model(MSG_NO_CAUSAL, mask_kind(np.ones((n, n)))),
            _Model(MSG_CAUSAL_STRICT, mask_kind((j < i).astype(float))),
            _Model(MSG_CAUSAL_SHIFTED, mask_kind((j <= i + 1).astype(float))),
            _Model(MSG_CAUSAL_SHIFTED, causal_loop("shifted"), blocks),
            _Model(MSG_DIAG_SKIPPED, causal_loop("skip"), blocks),
            _Model(MSG_DIAG_TWICE, causal_loop("twice"), blocks),
            _Model(MSG_DIAG_TWICE, causal_loop("twice_guarded"), blocks),
            _Model(MSG_DIAG_UNMASKED, causal_loop("unmasked"), blocks),
            _Model(MSG_DIAG_UNMASKED, causal_loop("unmasked_guarded"), blocks),
            _Model(MSG_OVERLAP, causal_loop("overlap"), blocks),
        ]
    else:
        def tail(bn):
            pad = -n % bn
            return None if pad == 0 else _weighted(scores(), v_rep, np.ones((n, n)), np.full(n, float(pad)))[0]
        out.append(_Model(MSG_TAIL_UNMASKED, tail, blocks))
    if c.causal:
        pairs = tuple((bm, bn) for bm in blocks for bn in blocks)
        out.append(_Model(MSG_BOUND_FLOORED, lambda mn: _weighted(scores(), v_rep, _floored_weights(n, *mn))[0], pairs))
    if c.shifted:
        out += _shift_diagnoses(masked(scores()).max(-1))
    out += [
        _Model(MSG_ACC_NOT_RESCALED, lambda bn: _online(masked(scores()), v_rep, bn, rescale_acc=False), blocks),
        _Model(MSG_L_NOT_RESCALED, lambda bn: _online(masked(scores()), v_rep, bn, rescale_l=False), blocks),
        _Model(MSG_NOT_RESCALED, lambda bn: _online(masked(scores()), v_rep, bn, False, False), blocks),
        _Model(MSG_NO_SCALE, scaled(1.0)),
        _Model(MSG_SCALE_TWICE, scaled(1.0 / d)),
        _Model(MSG_EXP2_NO_LOG2E, scaled(sm_scale * LN2)),
        _Model(MSG_EXP_WITH_LOG2E, scaled(sm_scale * LOG2E)),
    ]
    if c.layout == "dstride":
        out.append(Diagnosis(MSG_D_STRIDE, when=lambda a: True))
    out.append(Diagnosis(MSG_OOB, when=lambda a: bool((~np.isfinite(a)).any())))
    return out


def _lse_diagnoses(c: _Case, q64, k64, lse):
    """The known mistakes for ``lse``."""
    k_rep = ref.repeat_kv_heads(q64, k64, k64)[0]
    s = _scores(q64, k_rep, 1.0 / math.sqrt(c.D))
    if c.causal:
        s = np.where(ref.causal_mask(c.N, c.N), s, -np.inf)
    m = s.max(-1)
    log_l = lse - m  # natural log of sum exp(s - m)
    return [
        Diagnosis(MSG_LSE_BASE2, expected=lse * LOG2E),
        Diagnosis(MSG_LSE_MIXED, expected=m * LOG2E + log_l),
        Diagnosis(MSG_LSE_MIXED, expected=m + log_l * LOG2E),
        Diagnosis(MSG_LSE_NO_MAX, expected=log_l),
        Diagnosis(MSG_LSE_NO_MAX, expected=log_l * LOG2E),
    ]


# =============================================================================
# The Triton checks
# =============================================================================
def _tensor_like(run, out, name, shape, dtype, device, case, hint=""):
    """A plain sentence for a result that is not the tensor expected."""
    import torch

    if out is None:
        raise run.fail(f"{name} is None: did you forget a `return`?", case)
    if not isinstance(out, torch.Tensor):
        raise run.fail(f"{name} is a {type(out).__name__}; return a torch tensor.{hint}", case)
    if tuple(out.shape) != tuple(shape):
        raise run.fail(f"{name} has shape {tuple(out.shape)}, expected {tuple(shape)}.{hint}", case)
    if out.dtype != dtype:
        raise run.fail(f"{name} has dtype {out.dtype}, expected {dtype}.{hint}", case)
    if out.device != device:
        raise run.fail(f"{name} is on {out.device}; the inputs are on {device}.", case)


def _tolerance(dtype: str):
    return _TOLERANCES[(current().device, dtype)]


def _run_case(run, fn, c: _Case, gqa: bool):
    import torch

    device = current().device
    q, k, v, q64, k64, v64 = _make_inputs(run.rng, c, device)
    before = inputs.snapshot(q=q, k=k, v=v)
    with proof.Work(inputs=(q, k, v)) as work:
        if gqa:
            out = run.call(fn, q, k, v, case=c.desc)
        else:
            out = run.call(fn, q, k, v, causal=c.causal, case=c.desc)
    if out is None:
        raise run.fail("your function returned None: did you forget a `return`?"
                       + (" Return the pair (o, lse)." if gqa else " Return o."), c.desc)
    if gqa:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            problem = work.problem(no_kernel=MSG_NO_KERNEL)
            if problem:
                raise run.fail(problem, c.desc)
            raise run.fail(f"your function returned a {type(out).__name__}; return the pair (o, lse).", c.desc)
        o, lse = out
    else:
        o, lse = out, None
    if not isinstance(o, torch.Tensor):  # a slip (e.g. `.numpy()` at the end): say that first
        _tensor_like(run, o, "o", q.shape, q.dtype, q.device, c.desc)
    if gqa and not isinstance(lse, torch.Tensor):
        _tensor_like(run, lse, "lse", q.shape[:3], torch.float32, q.device, c.desc)
    problem = work.problem(no_kernel=MSG_NO_KERNEL, **({"o": o, "lse": lse} if gqa else {"o": o}))
    if problem:
        raise run.fail(problem, c.desc)
    changed = inputs.changed_input(before, q=q, k=k, v=v)
    if changed:
        raise run.fail(changed, c.desc)
    _tensor_like(run, o, "o", q.shape, q.dtype, q.device, c.desc)
    if gqa:
        _tensor_like(run, lse, "lse", q.shape[:3], torch.float32, q.device, c.desc,
                     hint=" lse is float32 [B, Hq, N], one number per query row, whatever q's dtype.")
    expected_o, expected_lse = ref.attention_lse(q64, k64, v64, causal=c.causal)
    atol, rtol, lse_atol = _tolerance(c.dtype)
    got = o.detach().cpu().double().numpy()
    run.compare(got, expected_o, case=c.desc, what="the output o", atol=atol, rtol=rtol,
                diagnoses=_output_diagnoses(c, q64, k64, v64, expected_o, atol, rtol, gqa),
                axes=("batch", "head", "row", "col"))
    if gqa:
        got_lse = lse.detach().cpu().double().numpy()
        run.compare(got_lse, expected_lse, case=c.desc, what="lse", atol=lse_atol, rtol=0.0,
                    diagnoses=_lse_diagnoses(c, q64, k64, expected_lse),
                    axes=("batch", "head", "row"))


def _check(fn, *, exercise, gqa, seed=None):
    run = Run(exercise, seed, time_limit_s=60.0)
    device = current().device
    for c in _fixed_cases(gqa, device) + _random_cases(run.rng, gqa, device):
        _run_case(run, fn, c, gqa)
    return run.passed()


def _check_flash_forward(fn, *, seed=None):
    return _check(fn, exercise="check_flash_forward", gqa=False, seed=seed)


def _check_flash_gqa(fn, *, seed=None):
    return _check(fn, exercise="check_flash_gqa", gqa=True, seed=seed)


_isolated_forward = isolation.isolated(_check_flash_forward)
_isolated_gqa = isolation.isolated(_check_flash_gqa)


def check_flash_forward(fn, *, seed=None, isolate=None, timeout_s=240.0):
    """Grade ``fn(q, k, v, causal=False) -> o``: multi-head attention by a Triton kernel.

    ``q, k, v`` are torch ``[B, H, N, D]`` tensors (the same H) of any
    strides; ``o`` must have q's shape and dtype. About ten cases: N not a
    multiple of any block, batches, a transposed ``[B, N, H, D]`` layout, a
    head dim with a stride, q shared across the batch (batch stride 0),
    causal and not, float32 and float16 (bfloat16 too on a GPU), then fresh
    random ones. All inputs sit in NaN-filled memory. On the CPU the check
    runs in a separate process, so a crash cannot kill the notebook;
    ``timeout_s`` bounds the whole check. ``seed`` replays a call.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_flash_forward", "your launcher")
    return _isolated_forward(fn, seed=seed, isolate=isolate, timeout_s=timeout_s)


def check_flash_gqa(fn, *, seed=None, isolate=None, timeout_s=240.0):
    """Grade ``fn(q, k, v) -> (o, lse)``: causal attention with GQA/MQA by a Triton kernel.

    ``q`` is ``[B, Hq, N, D]``, ``k`` and ``v`` ``[B, Hkv, N, D]`` with Hq a
    multiple of Hkv (query head ``h`` uses kv head ``h // (Hq // Hkv)``), any
    strides. ``o`` has q's shape and dtype; ``lse`` is float32 ``[B, Hq, N]``,
    the natural-log logsumexp of each query row's scaled, masked scores.
    Cases as in :func:`check_flash_forward`, plus MHA, GQA (group 2 to 8) and
    MQA, and kv heads whose values are shifted apart so that a wrong mapping
    is named. Isolated on the CPU; ``seed`` replays a call.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_flash_gqa", "your launcher")
    return _isolated_gqa(fn, seed=seed, isolate=isolate, timeout_s=timeout_s)
