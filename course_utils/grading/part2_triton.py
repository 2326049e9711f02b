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
(:func:`.inputs.nan_padded` and :data:`.inputs.LAYOUTS`), so a load that reads past the end of
a row, a head or the sequence brings NaN into the output instead of plausible
garbage. A Triton kernel must run (:func:`.proof.count_launches`), and on the
CPU the check runs in a forked process (:mod:`.isolation`), so a
kernel that crashes the interpreter does not take the notebook down.

A wrong answer is explained by the first diagnosis whose mistake it matches.
Each is recognised by computing, in NumPy, what the mistaken kernel would
output on the same inputs (the models and their messages are in
:mod:`.mistakes`; this module picks the ones that fit each case). Several mistakes (a causal loop that skips or
repeats the diagonal block, an accumulator that is not rescaled) give
outputs that depend on the learner's block sizes, so the models try every
power of two from 16 up and name the one that fits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import operator

import numpy as np

from .. import references as ref
from ..environment import current
from . import inputs, proof
from .core import Diagnosis, Forbidden, Run, require_callable
from .mistakes import (
    MSG_BOUND_FLOORED,
    MSG_CAUSAL_SHIFTED,
    MSG_CAUSAL_STRICT,
    MSG_DIAG_SKIPPED,
    MSG_DIAG_TWICE,
    MSG_DIAG_UNMASKED,
    MSG_EXP2_NO_LOG2E,
    MSG_EXP_WITH_LOG2E,
    MSG_KV_DIV_NKV,
    MSG_KV_INTERLEAVED,
    MSG_KV_OTHER,
    MSG_KV_OUT_OF_RANGE,
    MSG_NO_RUNNING_MAX,
    MSG_NOT_RESCALED,
    MSG_OVERLAP,
    MSG_SCALE_TWICE,
    MSG_TAIL_UNMASKED,
    SLACK,
    KvMapping,
    KvOutOfRange,
    Model,
    causal_weights,
    floored_weights,
    online,
    shift_diagnoses,
    weighted,
)
from .mistakes import MSG_ACC_NOT_RESCALED_TRITON
from .mistakes import MSG_L_NOT_RESCALED_TRITON
from .mistakes import MSG_LSE_BASE2_TRITON
from .mistakes import MSG_LSE_MIXED_TRITON
from .mistakes import MSG_LSE_NO_MAX_TRITON
from .mistakes import MSG_M_INIT_ZERO_TRITON  # noqa: F401  (named by shift_diagnoses)
from .mistakes import MSG_NO_CAUSAL_TRITON
from .mistakes import MSG_NO_KERNEL_ATTENTION
from .mistakes import MSG_NO_SCALE_TRITON

__all__ = ["grade_kv_head", "grade_flash_forward", "grade_flash_gqa"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# -- messages: one plain sentence or two each; the tests look for these texts. The mistakes that
# a NumPy model recognises are in .mistakes with their messages; these are this check's own. --
MSG_KV_FLOAT = (
    "returned a float: use integer division `//` (a head index is an int; `/` gives a float)."
)
# The cause, in words both diagnoses of O written with q's strides share: which one a kernel
# meets depends on the order in which its programs store (see _output_diagnoses).
MSG_O_STRIDES_CAUSE = "the output was written with q's strides instead of its own (o.stride())."
MSG_O_STRIDES = (
    MSG_O_STRIDES_CAUSE + " Here q is shared across the batch (batch stride 0), so every batch element "
    "wrote into the first one's place. Address O with its own strides, which differ from q's whenever "
    "q is not laid out like o."
)
MSG_BATCH_STRIDE = (
    "only the first batch element is right: every program read and wrote batch 0, so the batch "
    "index is not used in the addresses (or its stride is 0). Add pid_z * stride_qz (and stride_kz, "
    "stride_vz, stride_oz) to each tensor's base pointer, with each tensor's own batch stride."
)
MSG_OR_O_STRIDES = (
    " Or " + MSG_O_STRIDES_CAUSE + " Here q is shared across the batch (batch stride 0), so every batch "
    "element wrote into the first one's place, and batch 0's store came last. Address O with its own "
    "strides."
)
MSG_TILE_GROWS = (
    "your kernel's tile grows with the sequence: its constexpr {name} was {values}, always at least N, so "
    "one tile holds every key (or every query) of a head. That is a plain softmax over one tile, not "
    "FlashAttention, and it does not scale: the tile lives in registers and shared memory, which a few "
    "thousand keys overflow on any GPU. FlashAttention keeps BLOCK_M and BLOCK_N fixed (16 to 128, whatever "
    "N is), launches one program per block of queries, and loops over the keys block by block with the "
    "online softmax (running max m_i, running sum l_i, acc rescaled by exp(m_old - m_new)), so its memory "
    "stays O(BLOCK_M x BLOCK_N) however long the sequence."
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


def grade_kv_head(fn, *, seed=None):
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
    shifted: bool = False  # query rows' scores shifted by up to +-150 (see inputs.SHIFTS)
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
            f"{inputs.LAYOUTS[c.layout]}{extra}")


def _make_inputs(rng, c: _Case, device):
    """q, k, v torch tensors laid out as the case says, and their float64 values."""
    import torch

    dtype = getattr(torch, c.dtype)
    qv = rng.standard_normal((c.B if c.layout != "qbcast" else 1, c.Hq, c.N, c.D))
    kv = rng.standard_normal((c.B, c.Hkv, c.N, c.D))
    vv = rng.standard_normal((c.B, c.Hkv, c.N, c.D))
    if c.v_offsets:
        vv = vv + np.arange(c.Hkv)[None, :, None, None]
    if c.shifted:  # row i's scores near inputs.SHIFTS[i % 5]
        inputs.shift_scores(qv, kv)  # the reference uses the values after rounding to the dtype
    q, k, v = (torch.tensor(x, dtype=dtype, device=device) for x in (qv, kv, vv))
    if c.layout == "qbcast":
        q = inputs.guarded_contiguous(q).expand(c.B, c.Hq, c.N, c.D)
        k, v = inputs.nan_padded(k), inputs.nan_padded(v)
    else:
        q, k, v = (inputs.laid_out(t, c.layout, rng) for t in (q, k, v))
    q64, k64, v64 = (t.detach().cpu().double().numpy() for t in (q, k, v))
    return q, k, v, q64, k64, v64


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
# The known mistakes for each case (their models: .mistakes)
# =============================================================================
def _scores(q64, k64, scale):
    return scale * (q64 @ np.swapaxes(k64, -1, -2))


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
        return lambda bm: weighted(scores(), v_rep, causal_weights(n, kind, bm)[0],
                                   causal_weights(n, kind, bm)[1])[0]

    def mask_kind(w):
        return lambda _: weighted(scores(), v_rep, w)[0]

    def scaled(scale):
        return lambda _: ref.attention(q64, k64, v64, causal=c.causal, scale=scale)

    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    out = []
    if c.layout == "qbcast":
        def o_with_q_strides(actual):
            # Every batch element wrote into the first one's place: its rows hold some batch's
            # right answer, and at least one of them a later batch's (reading k, v per batch).
            close = [np.isclose(actual[0], expected[b], atol=o_atol * SLACK, rtol=o_rtol * SLACK).all(-1)
                     for b in range(c.B)]
            per_row = np.logical_or.reduce(close)
            later = np.logical_or.reduce(close[1:]) & ~close[0]
            rest_ok = np.allclose(actual[1:], expected[1:], atol=o_atol, rtol=o_rtol)
            return bool(per_row.all() and later.any() and not rest_ok)
        out.append(Diagnosis(MSG_O_STRIDES, when=o_with_q_strides))
    if c.B > 1:
        def batch_stride_ignored(actual):
            # Every batch element computed and wrote batch 0's attention: o[0] right, the rest not.
            first_ok = np.allclose(actual[0], expected[0], atol=o_atol * SLACK, rtol=o_rtol * SLACK)
            return bool(first_ok and not np.allclose(actual[1:], expected[1:], atol=o_atol, rtol=o_rtol))
        # With q shared across the batch, O written with q's strides looks the same whenever batch 0's
        # programs store last (on a GPU the order is not fixed): name both.
        message = MSG_BATCH_STRIDE + (MSG_OR_O_STRIDES if c.layout == "qbcast" else "")
        out.append(Diagnosis(message, when=batch_stride_ignored))
    if gqa:
        out.append(KvMapping(q64, k64, v64, c.causal))
        out.append(KvOutOfRange(q64, k64, v64, c.causal))
    if c.causal:
        out += [
            Model(MSG_NO_CAUSAL_TRITON, mask_kind(np.ones((n, n)))),
            Model(MSG_CAUSAL_STRICT, mask_kind((j < i).astype(float))),
            Model(MSG_CAUSAL_SHIFTED, mask_kind((j <= i + 1).astype(float))),
            Model(MSG_CAUSAL_SHIFTED, causal_loop("shifted"), blocks),
            Model(MSG_DIAG_SKIPPED, causal_loop("skip"), blocks),
            Model(MSG_DIAG_TWICE, causal_loop("twice"), blocks),
            Model(MSG_DIAG_TWICE, causal_loop("twice_guarded"), blocks),
            Model(MSG_DIAG_UNMASKED, causal_loop("unmasked"), blocks),
            Model(MSG_DIAG_UNMASKED, causal_loop("unmasked_guarded"), blocks),
            Model(MSG_OVERLAP, causal_loop("overlap"), blocks),
        ]
    else:
        def tail(bn):
            pad = -n % bn
            return None if pad == 0 else weighted(scores(), v_rep, np.ones((n, n)), np.full(n, float(pad)))[0]
        out.append(Model(MSG_TAIL_UNMASKED, tail, blocks))
    if c.causal:
        pairs = tuple((bm, bn) for bm in blocks for bn in blocks)
        out.append(Model(MSG_BOUND_FLOORED, lambda mn: weighted(scores(), v_rep, floored_weights(n, *mn))[0], pairs))
    if c.shifted:
        out += shift_diagnoses(masked(scores()).max(-1))
    out += [
        Model(MSG_ACC_NOT_RESCALED_TRITON, lambda bn: online(masked(scores()), v_rep, bn, rescale_acc=False), blocks),
        Model(MSG_L_NOT_RESCALED_TRITON, lambda bn: online(masked(scores()), v_rep, bn, rescale_l=False), blocks),
        Model(MSG_NOT_RESCALED, lambda bn: online(masked(scores()), v_rep, bn, False, False), blocks),
        Model(MSG_NO_SCALE_TRITON, scaled(1.0)),
        Model(MSG_SCALE_TWICE, scaled(1.0 / d)),
        Model(MSG_EXP2_NO_LOG2E, scaled(sm_scale * LN2)),
        Model(MSG_EXP_WITH_LOG2E, scaled(sm_scale * LOG2E)),
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
        Diagnosis(MSG_LSE_BASE2_TRITON, expected=lse * LOG2E),
        Diagnosis(MSG_LSE_MIXED_TRITON, expected=m * LOG2E + log_l),
        Diagnosis(MSG_LSE_MIXED_TRITON, expected=m + log_l * LOG2E),
        Diagnosis(MSG_LSE_NO_MAX_TRITON, expected=log_l),
        Diagnosis(MSG_LSE_NO_MAX_TRITON, expected=log_l * LOG2E),
    ]


# =============================================================================
# The tile sizes a launch chose: FlashAttention's are fixed, a whole-sequence tile grows with N
# =============================================================================
_LARGEST_BLOCK = max(_BLOCKS)  # no fixed tile a learner may pick is larger: past it, a tile >= N grew with N


def _constexpr_ints(kernel, args, kwargs) -> dict[str, int]:
    """The launch's integer constexpr arguments that are powers of two (tile sizes), by name ({} if unknown)."""
    try:
        names = list(kernel.arg_names)
        params = getattr(kernel, "params", None)
        if params is not None:  # JITFunction
            constexprs = {p.name for p in params if p.is_constexpr}
        else:  # the interpreter's InterpretedFunction: read the annotations
            sig = inspect.signature(kernel.fn).parameters
            constexprs = {n for n, p in sig.items()
                          if "constexpr" in (p.annotation if isinstance(p.annotation, str)
                                             else getattr(p.annotation, "__name__", ""))}
        values = dict(zip(names, args))
        values.update({k: v for k, v in kwargs.items() if k in names})
    except Exception:  # noqa: BLE001  (a kernel of an unexpected kind: no evidence, no verdict)
        return {}
    return {n: int(v) for n, v in values.items() if n in constexprs and isinstance(v, int)
            and not isinstance(v, bool) and v >= 16 and v & (v - 1) == 0}


@contextlib.contextmanager
def _tile_sizes(history: dict | None = None, n: int = 0, judge_launch=None):
    """Record, for each launch of the learner's kernels in the block, its power-of-two constexprs.

    ``judge_launch(name, kernel, args, kwargs, tensors)``, if given, judges each launch first (lesson
    06's two-programs-per-SM options); it raises :class:`.core.Forbidden` to refuse one.

    Yields ``{(kernel name, constexpr name): largest value}``, filled as kernels launch. With
    ``history`` (the earlier cases' records, see :func:`_growing_tile`) and this case's ``n``, a
    launch whose tile grew with N is refused before it runs (on a GPU a tile of every key may not
    even fit): :class:`.core.Forbidden`, which the learner's ``except Exception`` cannot hide and
    ``Run.call`` reports as a GradingError of this case.
    """
    seen: dict[tuple[str, str], int] = {}

    def before_launch(name, kernel, args, kwargs, tensors):
        if judge_launch is not None:
            judge_launch(name, kernel, args, kwargs, tensors)
        tiles = {(name, constexpr): value for constexpr, value in _constexpr_ints(kernel, args, kwargs).items()}
        if history is not None:
            grown = _growing_tile({key: history.get(key, []) + [(n, value)] for key, value in tiles.items()})
            if grown:
                raise Forbidden(grown)
        for key, value in tiles.items():
            seen[key] = max(seen.get(key, 0), value)

    with proof.watching_learner_launches(before_launch):
        yield seen


def _growing_tile(history: dict) -> str | None:
    """The message for a constexpr that grew with N and covered every row, or None.

    ``history``: ``{(kernel, constexpr): [(N, value), ...]}`` over the cases so far. A tile is
    flagged when it was at least N in every case, took more than one value, and some case had N
    past the largest fixed block (so a tile capped at 64, 128 or 256 never is).
    """
    for (kernel, name), seen in history.items():
        if len({v for _, v in seen}) > 1 and all(v >= n for n, v in seen) and max(n for n, _ in seen) > _LARGEST_BLOCK:
            by_n = sorted(dict(seen).items())
            values = ", ".join(f"{v} at N = {n}" for n, v in ([by_n[0]] + by_n[-2:] if len(by_n) > 3 else by_n))
            return MSG_TILE_GROWS.format(name=f"{name} (of {kernel})", values=values)
    return None


# =============================================================================
# The Triton checks
# =============================================================================
def _tolerance(dtype: str):
    return _TOLERANCES[(current().device, dtype)]


def _run_case(run, fn, c: _Case, gqa: bool, history: dict | None = None, judge_launch=None):
    """One case of a forward check: inputs, the learner's call, proof of work, then o (and lse) compared.

    ``history`` and ``judge_launch``: see :func:`_tile_sizes`. Returns the launch's tile sizes.
    """
    import torch

    device = current().device
    q, k, v, q64, k64, v64 = _make_inputs(run.rng, c, device)
    before = inputs.snapshot(q=q, k=k, v=v)
    with proof.Work(inputs=(q, k, v)) as work, _tile_sizes(history, c.N, judge_launch) as tiles:
        if gqa:
            out = run.call(fn, q, k, v, case=c.desc)
        else:
            out = run.call(fn, q, k, v, causal=c.causal, case=c.desc)
    if out is None:
        raise run.fail("your function returned None: did you forget a `return`?"
                       + (" Return the pair (o, lse)." if gqa else " Return o."), c.desc)
    if gqa:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            problem = work.problem(no_kernel=MSG_NO_KERNEL_ATTENTION)
            if problem:
                raise run.fail(problem, c.desc)
            raise run.fail(f"your function returned a {type(out).__name__}; return the pair (o, lse).", c.desc)
        o, lse = out
    else:
        o, lse = out, None
    if not isinstance(o, torch.Tensor):  # a slip (e.g. `.numpy()` at the end): say that first
        inputs.tensor_like(run, o, "o", q.shape, q.dtype, q.device, c.desc)
    if gqa and not isinstance(lse, torch.Tensor):
        inputs.tensor_like(run, lse, "lse", q.shape[:3], torch.float32, q.device, c.desc)
    problem = work.problem(no_kernel=MSG_NO_KERNEL_ATTENTION, **({"o": o, "lse": lse} if gqa else {"o": o}))
    if problem:
        raise run.fail(problem, c.desc)
    changed = inputs.changed_input(before, q=q, k=k, v=v)
    if changed:
        raise run.fail(changed, c.desc)
    inputs.tensor_like(run, o, "o", q.shape, q.dtype, q.device, c.desc)
    if gqa:
        inputs.tensor_like(run, lse, "lse", q.shape[:3], torch.float32, q.device, c.desc,
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
    return tiles


def _check(fn, *, exercise, gqa, seed=None):
    run = Run(exercise, seed, time_limit_s=60.0)
    device = current().device
    # (kernel, constexpr) -> [(N, value), ...]: lessons 04's and 05's kernels must keep their tiles as N grows
    # (refused at the launch of the first case past every fixed block size, N = 300)
    history: dict = {}
    for c in _fixed_cases(gqa, device) + _random_cases(run.rng, gqa, device):
        tiles = _run_case(run, fn, c, gqa, history)
        if history is not None:
            for key, value in tiles.items():
                history.setdefault(key, []).append((c.N, value))
    return run.passed()


def grade_flash_forward(fn, *, seed=None):
    """Grade ``fn(q, k, v, causal=False) -> o``: multi-head attention by a Triton kernel.

    ``q, k, v`` are torch ``[B, H, N, D]`` tensors (the same H) of any
    strides; ``o`` must have q's shape and dtype. About ten cases: N not a
    multiple of any block, batches, a transposed ``[B, N, H, D]`` layout, a
    head dim with a stride, q shared across the batch (batch stride 0),
    causal and not, float32 and float16 (bfloat16 too on a GPU), then fresh
    random ones. All inputs sit in NaN-filled memory. A launch whose tile grows
    with N (a power-of-two constexpr at least N in every case, past the largest
    fixed block of 256) is refused: one tile of every key is a softmax, not
    FlashAttention. On the CPU the check
    runs in a separate process, so a crash cannot kill the notebook;
    ``timeout_s`` bounds the whole check. ``seed`` replays a call.
    """
    return _check(fn, exercise="check_flash_forward", gqa=False, seed=seed)


def grade_flash_gqa(fn, *, seed=None):
    """Grade ``fn(q, k, v) -> (o, lse)``: causal attention with GQA/MQA by a Triton kernel.

    ``q`` is ``[B, Hq, N, D]``, ``k`` and ``v`` ``[B, Hkv, N, D]`` with Hq a
    multiple of Hkv (query head ``h`` uses kv head ``h // (Hq // Hkv)``), any
    strides. ``o`` has q's shape and dtype; ``lse`` is float32 ``[B, Hq, N]``,
    the natural-log logsumexp of each query row's scaled, masked scores.
    Cases as in :func:`check_flash_forward`, plus MHA, GQA (group 2 to 8) and
    MQA, and kv heads whose values are shifted apart so that a wrong mapping
    is named. A launch whose tile grows with N is refused, as there.
    Isolated on the CPU; ``seed`` replays a call.
    """
    return _check(fn, exercise="check_flash_gqa", gqa=True, seed=seed)


