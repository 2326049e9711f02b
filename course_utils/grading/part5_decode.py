"""Checks for lesson 09: decoding with a KV cache, split-KV (flash-decoding).

- :func:`check_merge_partials` grades a NumPy warm-up, ``fn(o_parts,
  lse_parts) -> (o, lse)``: merging partial attention results by their
  logsumexp.
- :func:`check_decode_split` grades ``fn(q, k_cache, v_cache, cache_seqlens,
  num_splits) -> (o_parts, lse_parts)``: the split kernel's partial results.
- :func:`check_decode_combine` grades ``fn(o_parts, lse_parts) -> o``: the
  combine kernel.
- :func:`check_choose_num_splits` grades ``fn(batch, n_q_heads, n_kv_heads,
  context, n_sms, programs_per_sm) -> num_splits``: the split count the
  model of :func:`course_utils.kernels.decode.split_busy_fraction` keeps
  busiest (any count within its tolerance of the best passes).

The references are :func:`course_utils.references.decode_partials` and
:func:`~course_utils.references.merge_partials` in float64. The caches hold
NaN past each sequence's length (and the tensors sit in NaN-filled buffers),
so a kernel that reads past ``cache_seqlens`` shows NaN. The learner is called inside
:class:`.proof.Work`: the graded tensors must be written by the learner's own kernel during the
call (not by torch's attention, softmax, exp or matrix products, not by the course's kernels of
``course_utils.kernels.decode``, not computed in NumPy and copied by a kernel), and the inputs must
come back unchanged (:func:`.inputs.changed_input`). The lesson's launcher may call the course's plain
helpers (``decode.decode_config``, ``decode.LOG2E``). Lengths are ragged,
``T`` goes up to 4, the query heads come in groups (MHA, GQA, MQA), and some
splits see no key. Each known mistake is recognised by computing, in NumPy,
what the mistaken code would output on the same inputs: merging without the
max shift, weights not renormalised, reading past ``cache_seqlens``, a wrong
causal offset for ``T > 1``, a split boundary dropping a token.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .. import references as ref
from ..environment import current
from . import inputs, proof
from .core import Diagnosis, Run, distance_to
from .mistakes import SLACK
from .mistakes import MSG_LSE_NO_MAX_MERGE
from .mistakes import MSG_NO_KERNEL_ATTENTION
from .mistakes import MSG_NO_SHIFT_MERGE
# course_utils.kernels.decode is imported where it is used (see .exercises).

__all__ = ["grade_merge_partials", "grade_decode_split", "grade_decode_combine", "grade_choose_num_splits",
           "splits_busy"]

# -- messages: one plain sentence or two each; the tests look for these texts --
MSG_NOT_RENORMALISED = (
    "the weights are not renormalised: exp(lse_s - m) are relative weights, not shares. "
    "Divide them by their sum (w_s = exp(lse_s - m) / sum_s exp(lse_s - m)), i.e. use "
    "exp(lse_s - lse) with the merged lse."
)
MSG_PLAIN_AVERAGE = (
    "the parts are averaged with equal weights: each part counts in proportion to its "
    "softmax sum, exp(lse_s), so weight part s by exp(lse_s - lse)."
)
MSG_LSE_MAX_ONLY = (
    "the merged lse is the largest part's lse: add log(sum_s exp(lse_s - m)), the "
    "contribution of every part."
)
MSG_PAST_SEQLEN = (
    "the result holds NaN although every valid input is finite: the kernel reads cache entries "
    "past cache_seqlens[b] (they are NaN in this check, garbage in a real cache). Mask every K "
    "and V load with the sequence's (or the split's) end, `offs_n < hi`, with other=0: a -inf "
    "score is not enough, because 0 * NaN is NaN in p @ v."
)
MSG_CAUSAL_OFFSET = (
    "the causal mask among the new tokens is wrong ({kind}): new token t sits at position "
    "cache_seqlens[b] - T + t and sees the keys j <= that position (the mask is aligned to the "
    "bottom right, the end of the cache)."
)
MSG_SPLIT_DROPS = (
    "a split boundary drops a token ({kind}): the splits must tile the keys exactly, "
    "split s covering [s * chunk, min((s + 1) * chunk, L)) with chunk = cdiv(L, num_splits) "
    "and the mask offs_n < hi."
)
MSG_EMPTY_ROW = (
    "a row that sees no key of its split must come out as lse = -inf and o = 0 (its weight in "
    "the merge is then exp(-inf) = 0); guard the division by l_i = 0 and the max of an all--inf row."
)
MSG_PAD_LANES = (
    "the padding lanes of the lse load (splits past num_splits) were loaded as 0, not -inf: "
    "they then count as parts with weight exp(0 - m). Load with other=float('-inf')."
)

_TOL = {  # (atol, rtol) for o; lse atol
    ("cpu", "float32"): (2e-5, 2e-5, 2e-5),
    ("cuda", "float32"): (1e-2, 1e-2, 1e-2),  # tf32 dots (seen: lse off by 3.6e-3 on the H200)
    ("cpu", "float16"): (1e-2, 1e-2, 1e-2),
    ("cuda", "float16"): (1e-2, 1e-2, 1e-2),
    ("cuda", "bfloat16"): (3e-2, 3e-2, 3e-2),
}
NEG = -1e4  # where -inf lse are compared: a finite stand-in, far from any real lse


def _finite_lse(lse):
    return np.where(np.isneginf(lse), NEG, lse)


def _model_nonfinite(actual) -> bool:
    return not np.isfinite(actual).all()


# =============================================================================
# check_merge_partials (NumPy)
# =============================================================================
def _merge_cases(rng):
    """(description, o_parts, lse_parts): fixed cases first, each adding one difficulty."""
    cases = []
    o = rng.standard_normal((1, 2, 4))
    cases.append(("two parts, one row", o, np.array([[0.3, -0.5]])))
    cases.append(("equal lse", rng.standard_normal((3, 3, 8)), np.zeros((3, 3))))
    o = rng.standard_normal((2, 4, 8))
    o[0, 2] = 0.0
    lse = rng.uniform(-2, 2, (2, 4))
    lse[0, 2] = -np.inf
    cases.append(("a part with no key (lse = -inf, o = 0)", o, lse))
    cases.append(("one part only", rng.standard_normal((4, 1, 8)), rng.uniform(-3, 3, (4, 1))))
    cases.append(("large lse (about 1000)", rng.standard_normal((2, 3, 8)), 1000.0 + rng.uniform(-3, 3, (2, 3))))
    cases.append(("very negative lse (about -1000)", rng.standard_normal((2, 3, 8)),
                  -1000.0 + rng.uniform(-3, 3, (2, 3))))
    cases.append(("batch and head axes [2, 3, N, S, d]", rng.standard_normal((2, 3, 5, 4, 16)),
                  rng.uniform(-4, 4, (2, 3, 5, 4))))
    for i in range(3):
        shape = tuple(int(x) for x in rng.integers(1, 5, size=int(rng.integers(1, 3))))
        s, d = int(rng.integers(1, 9)), int(rng.integers(1, 33))
        lse = rng.uniform(-6, 6, shape + (s,)) + rng.uniform(-900, 900)
        cases.append((f"random #{i + 1} (shape {shape + (s, d)})", rng.standard_normal(shape + (s, d)), lse))
    return cases


def _merge_diagnoses(o_parts, lse_parts, large: bool):
    with np.errstate(all="ignore"):
        m = np.max(lse_parts, axis=-1, keepdims=True)
        w = np.exp(lse_parts - m)
        total = np.sum(w, axis=-1, keepdims=True)
        unnormalised = np.sum(w[..., None] * o_parts, axis=-2)
        raw = np.sum(np.exp(lse_parts)[..., None] * o_parts, axis=-2)
        average = np.mean(o_parts, axis=-2)
        lse_no_max = np.log(total)[..., 0]
        lse_max = m[..., 0]
    o_diag = [
        Diagnosis(MSG_NO_SHIFT_MERGE, when=lambda a: large and _model_nonfinite(a)),
        Diagnosis(MSG_NOT_RENORMALISED, expected=unnormalised),
        Diagnosis(MSG_NOT_RENORMALISED, expected=raw),
        Diagnosis(MSG_PLAIN_AVERAGE, expected=average),
    ]
    lse_diag = [
        Diagnosis(MSG_NO_SHIFT_MERGE, when=lambda a: large and _model_nonfinite(a)),
        Diagnosis(MSG_LSE_NO_MAX_MERGE, expected=lse_no_max),
        Diagnosis(MSG_LSE_MAX_ONLY, expected=lse_max),
    ]
    return o_diag, lse_diag


def grade_merge_partials(fn, *, seed=None):
    """Grade ``fn(o_parts, lse_parts) -> (o, lse)`` (NumPy).

    ``o_parts [..., S, d]`` holds S partial attention outputs of each row, each
    normalised by its own softmax sum, and ``lse_parts [..., S]`` their
    natural-log logsumexps (``-inf`` for a part that saw no key). Return the
    merged ``o [..., d]`` and ``lse [...]``. Cases: equal and very unequal
    parts, an empty part, one part, lse near +-1000, batch axes, and fresh
    random ones.
    """
    __tracebackhide__ = True
    run = Run("check_merge_partials", seed)
    for desc, o_parts, lse_parts in _merge_cases(run.rng):
        expected_o, expected_lse = ref.merge_partials(o_parts, lse_parts)
        with proof.references_forbidden():  # course_utils.references.merge_partials is what it is compared with
            out = run.call(fn, o_parts.copy(), lse_parts.copy(), case=desc)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise run.fail(f"your function returned a {type(out).__name__}; return the pair (o, lse).", desc)
        o = run.array(out[0], expected_shape=expected_o.shape, case=desc, name="o")
        lse = run.array(out[1], expected_shape=expected_lse.shape, case=desc, name="lse")
        large = bool(np.max(np.abs(lse_parts[np.isfinite(lse_parts)])) > 80)
        o_diag, lse_diag = _merge_diagnoses(o_parts, lse_parts, large)
        run.compare(o, expected_o, case=desc, what="o", atol=1e-9, rtol=1e-9, diagnoses=o_diag)
        run.compare(lse, expected_lse, case=desc, what="lse", atol=1e-9, rtol=1e-12, diagnoses=lse_diag)
    return run.passed()


# =============================================================================
# check_decode_split (Triton)
# =============================================================================
@dataclasses.dataclass
class _DecodeCase:
    b: int
    hq: int
    hkv: int
    t: int
    n_max: int
    d: int
    lengths: tuple
    num_splits: int
    dtype: str = "float32"
    what: str = ""

    @property
    def desc(self) -> str:
        kind = "MHA" if self.hq == self.hkv else ("MQA" if self.hkv == 1 else f"GQA {self.hq}/{self.hkv}")
        head = f"{self.what}: " if self.what else ""
        return (f"{head}B={self.b}, {kind}, T={self.t}, cache_seqlens={list(self.lengths)} of N_max={self.n_max}, "
                f"D={self.d}, num_splits={self.num_splits}, {self.dtype}")


def _split_cases(rng, device: str) -> list[_DecodeCase]:
    half = "float16"
    cases = [
        _DecodeCase(1, 2, 2, 1, 64, 32, (64,), 2, what="two splits, a full cache"),
        _DecodeCase(1, 2, 2, 1, 64, 32, (50,), 1, what="one split"),
        _DecodeCase(2, 2, 2, 1, 80, 32, (80, 37), 3, what="ragged lengths, NaN past each"),
        _DecodeCase(2, 4, 2, 1, 64, 32, (50, 64), 2, what="GQA: two query heads per kv head"),
        _DecodeCase(2, 4, 2, 3, 64, 32, (64, 21), 2, what="T = 3 new tokens"),
        _DecodeCase(2, 4, 1, 4, 48, 16, (48, 13), 7, what="MQA, T = 4, splits that see no key"),
        _DecodeCase(2, 2, 1, 2, 48, 32, (47, 30), 3, half, what="float16"),
    ]
    for i in range(2):
        hkv = int(rng.integers(1, 3))
        hq = hkv * int(rng.choice([1, 2, 4]))
        t = int(rng.integers(1, 5))
        n_max = int(rng.integers(24, 97))
        lengths = tuple(int(x) for x in rng.integers(t, n_max + 1, size=2))
        d = int(rng.choice([16, 32, 64]))
        cases.append(_DecodeCase(2, hq, hkv, t, n_max, d, lengths, int(rng.integers(1, 6)),
                                 what=f"random #{i + 1}"))
    if device == "cuda":
        cases.append(_DecodeCase(2, 4, 2, 3, 64, 32, (64, 21), 3, "bfloat16", what="bfloat16"))
    return cases


def _decode_inputs(rng, c: _DecodeCase, device: str):
    """Torch q and caches (NaN past each length, in NaN-padded buffers), lengths, and float64 copies."""
    import torch

    dtype = getattr(torch, c.dtype)
    q = rng.standard_normal((c.b, c.hq, c.t, c.d))
    k = rng.standard_normal((c.b, c.hkv, c.n_max, c.d))
    v = rng.standard_normal((c.b, c.hkv, c.n_max, c.d))
    tensors = [torch.from_numpy(x).to(device=device, dtype=dtype) for x in (q, k, v)]
    q64, k64, v64 = (t.double().cpu().numpy() for t in tensors)  # the values the kernel sees
    qt, kt, vt = (inputs.nan_padded(t) for t in tensors)
    for i, n in enumerate(c.lengths):
        kt[i, :, n:] = float("nan")
        vt[i, :, n:] = float("nan")
    seqlens = torch.tensor(c.lengths, dtype=torch.int32, device=device)
    return (qt, kt, vt, seqlens), (q64, k64, v64)


def _partials_model(q, k, v, lengths, num_splits, *, pos_of=None, range_of=None):
    """What a split kernel returns, with the query positions or the split ranges replaced."""
    B, Hq, T, d = q.shape
    o_parts = np.zeros((B, Hq, T, num_splits, d))
    lse_parts = np.full((B, Hq, T, num_splits), -np.inf)
    sm_scale = 1.0 / math.sqrt(d)
    for b in range(B):
        L = int(lengths[b])
        pos = (L - T + np.arange(T)) if pos_of is None else pos_of(L, T)
        kk, vv = ref.repeat_kv_heads(q[b], k[b], v[b])
        chunk = -(-L // num_splits)
        for s in range(num_splits):
            lo, hi = (min(s * chunk, L), min((s + 1) * chunk, L)) if range_of is None else range_of(L, num_splits, s)
            if hi <= lo:
                continue
            sc = sm_scale * (q[b] @ np.swapaxes(kk[:, lo:hi], -1, -2))
            sc = np.where(np.arange(lo, hi) <= np.asarray(pos)[..., None], sc, -np.inf)  # pos: [T] or [Hq, T]
            m = np.max(sc, axis=-1, keepdims=True)
            ok = np.isfinite(m)
            p = np.exp(sc - np.where(ok, m, 0.0))
            l_sum = np.sum(p, axis=-1, keepdims=True)
            o_parts[b, :, :, s] = np.where(ok, (p @ vv[:, lo:hi]) / np.where(ok, l_sum, 1.0), 0.0)
            with np.errstate(divide="ignore"):
                lse_parts[b, :, :, s] = np.where(ok, np.where(ok, m, 0.0) + np.log(np.where(ok, l_sum, 1.0)),
                                                 -np.inf)[..., 0]
    return o_parts, lse_parts


def _split_models(c: _DecodeCase, q, k, v):
    """(message, (o_parts, lse_parts)) for each known mistake of the split kernel, computed lazily."""
    lengths, S = c.lengths, c.num_splits
    models = []
    # With T = 1 these differ from the right answer too (the prefill mask puts the query at 0).
    offsets = [
        ("query t placed at position t, as in prefill's top-left mask", lambda L, T: np.arange(T)),
        ("no mask among the new tokens: each sees all of them", lambda L, T: np.full(T, L - 1)),
        ("off by one: each new token also sees the next one",
         lambda L, T: np.minimum(L - T + np.arange(T) + 1, L - 1)),
        ("off by one: each new token does not see itself", lambda L, T: L - T + np.arange(T) - 1),
        ("the position uses the packed row r = g * T + t, not the new token t = r % T",
         lambda L, T: L - T + (np.arange(c.hq) % (c.hq // c.hkv))[:, None] * T + np.arange(T)[None, :]),
    ]
    for kind, pos_of in offsets:
        models.append((MSG_CAUSAL_OFFSET.format(kind=kind),
                       lambda pos_of=pos_of: _partials_model(q, k, v, lengths, S, pos_of=pos_of)))
    ranges = [
        ("each split stops one key short of its end",
         lambda L, S, s: (min(s * -(-L // S), L), max(min((s + 1) * -(-L // S), L) - 1, min(s * -(-L // S), L)))),
        ("each split starts one key late",
         lambda L, S, s: (min(s * -(-L // S) + 1, L), min((s + 1) * -(-L // S), L))),
        ("chunk = L // num_splits rounds down, so the last keys belong to no split",
         lambda L, S, s: (min(s * (L // S), L), min((s + 1) * (L // S), L))),
    ]
    for kind, range_of in ranges:
        models.append((MSG_SPLIT_DROPS.format(kind=kind),
                       lambda range_of=range_of: _partials_model(q, k, v, lengths, S, range_of=range_of)))
    return models


class _Model(Diagnosis):
    """A diagnosis whose expected answer is one part of a lazily computed model's output."""

    def __init__(self, message, predict, index, right, slack=SLACK):
        super().__init__(message)
        self.predict, self.index, self.right, self.slack = predict, index, right, slack
        self._cache = None

    def matches(self, actual, atol, rtol):
        if self._cache is None:
            self._cache = self.predict()
        wrong = self._cache[self.index]
        if self.index == 1:
            wrong = _finite_lse(wrong)
        if wrong.shape != actual.shape or not np.isfinite(actual).all():
            return False
        if not np.allclose(actual, wrong, atol=atol * self.slack, rtol=rtol * self.slack):
            return False
        # Named only when the answer is nearer this mistake's output than the right one. (Not "outside
        # slack x tolerance of the right answer": a split that drops one key of 32 moves o by less than
        # that under a GPU's tf32 tolerance, and the mistake would go unnamed.)
        near_wrong, near_right = distance_to(actual, wrong, atol, rtol), distance_to(actual, self.right, atol, rtol)
        if near_right is not None and near_right <= near_wrong:
            return False
        self.matched_distance = near_wrong
        return True


def _tolerance(dtype: str):
    return _TOL[(current().device, dtype)]


def _proof_of_work(run, work, before, case, **tensors):
    """Fail ``run`` unless the learner's own kernels wrote the graded tensors and no input was edited.

    ``tensors``: the graded results first (``o_parts``/``lse_parts``, or ``o``), then the inputs of
    ``before`` (:func:`.inputs.snapshot`) under the same names. The sentences are
    :meth:`.proof.Work.problem`'s: torch's attention, softmax, exp or matrix products, the course's
    kernels (``course_utils.kernels.decode``), an answer computed in NumPy (the references) and copied
    by a kernel, or a result no kernel of the learner's wrote.
    """
    graded = {name: t for name, t in tensors.items() if name not in before}
    problem = work.problem(no_kernel=MSG_NO_KERNEL_ATTENTION, **graded)
    if problem:
        raise run.fail(problem, case)
    changed = inputs.changed_input(before, **{name: tensors[name] for name in before})
    if changed:
        raise run.fail(changed, case)


def _run_split_case(run, fn, c: _DecodeCase):
    import torch

    device = current().device
    (q, k, v, seqlens), (q64, k64, v64) = _decode_inputs(run.rng, c, device)
    before = inputs.snapshot(q=q, k_cache=k, v_cache=v, cache_seqlens=seqlens)
    with proof.Work(inputs=(q, k, v, seqlens)) as work:
        out = run.call(fn, q, k, v, seqlens, c.num_splits, case=c.desc)
    if not work.launches:
        raise run.fail(MSG_NO_KERNEL_ATTENTION, c.desc)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        problem = work.problem(no_kernel=MSG_NO_KERNEL_ATTENTION)
        if problem:
            raise run.fail(problem, c.desc)
        raise run.fail(f"your function returned a {type(out).__name__}; return the pair (o_parts, lse_parts).",
                       c.desc)
    o_parts, lse_parts = out
    shape = (c.b, c.hq, c.t, c.num_splits)
    checks = [(o_parts, "o_parts", shape + (c.d,), " o_parts is float32 [B, Hq, T, num_splits, D]."),
              (lse_parts, "lse_parts", shape, " lse_parts is float32 [B, Hq, T, num_splits].")]
    for t, name, want, hint in checks:  # a slip (None, `.numpy()` at the end): say that first
        if not isinstance(t, torch.Tensor):
            inputs.tensor_like(run, t, name, want, torch.float32, q.device, c.desc, hint=hint)
    _proof_of_work(run, work, before, c.desc, o_parts=o_parts, lse_parts=lse_parts,
                   q=q, k_cache=k, v_cache=v, cache_seqlens=seqlens)
    for t, name, want, hint in checks:
        inputs.tensor_like(run, t, name, want, torch.float32, q.device, c.desc, hint=hint)
    expected_o, expected_lse = ref.decode_partials(q64, k64, v64, np.array(c.lengths), c.num_splits)
    atol, rtol, lse_atol = _tolerance(c.dtype)
    got_o = o_parts.detach().cpu().double().numpy()
    got_lse = lse_parts.detach().cpu().double().numpy()
    empty = np.isneginf(expected_lse)
    models = _split_models(c, q64, k64, v64)
    axes = ("batch", "q_head", "t", "split", "col")

    def diagnoses(index, expected):
        found = []
        if empty.any():  # first: bad values in the rows that see no key of their split, and only there
            def empty_row_wrong(a, i=index):
                rows, others = a[empty], a[~empty]  # o: [n, D]; lse: [n]
                if not np.isfinite(others).all():
                    return False
                if i == 0:
                    return not np.isfinite(rows).all() or bool(np.abs(rows).max() > 0)
                return not np.isfinite(rows).all() or bool((rows > NEG / 2).any())

            found.append(Diagnosis(MSG_EMPTY_ROW, when=empty_row_wrong))
        found.append(Diagnosis(MSG_PAST_SEQLEN, when=lambda a: np.isnan(a).any()))
        for message, predict in models:
            found.append(_Model(message, predict, index, expected))
        return found

    run.compare(got_o, expected_o, case=c.desc, what="o_parts", atol=atol, rtol=rtol,
                diagnoses=diagnoses(0, expected_o), axes=axes)
    run.compare(_finite_lse(got_lse), _finite_lse(expected_lse), case=c.desc, what="lse_parts (-inf shown as -1e4)",
                atol=lse_atol, rtol=0.0, diagnoses=diagnoses(1, _finite_lse(expected_lse)), axes=axes[:4])


def grade_decode_split(fn, *, seed=None):
    """Grade ``fn(q, k_cache, v_cache, cache_seqlens, num_splits) -> (o_parts, lse_parts)``: the split kernel.

    ``q`` is ``[B, Hq, T, D]``, the caches ``[B, Hkv, N_max, D]`` (Hq a
    multiple of Hkv), ``cache_seqlens`` int32 ``[B]`` (the new tokens
    included: token t at position ``cache_seqlens[b] - T + t``). Split s of
    sequence b covers the keys ``[s * chunk, min((s + 1) * chunk, L))``,
    ``chunk = cdiv(L, num_splits)``. Return float32 ``o_parts [B, Hq, T,
    num_splits, D]`` (each normalised by its own sum) and ``lse_parts [B, Hq,
    T, num_splits]`` (natural log; ``-inf`` and ``o = 0`` where a row sees no
    key of the split). Entries past each length are NaN. Both must be written by your own
    ``@triton.jit`` kernel during the call, and the inputs left as they were. Isolated on the CPU.
    """
    run = Run("check_decode_split", seed, time_limit_s=60.0)
    for c in _split_cases(run.rng, current().device):
        _run_split_case(run, fn, c)
    return run.passed()


# =============================================================================
# check_decode_combine (Triton)
# =============================================================================
def _combine_cases(rng):
    """(description, B, Hq, T, S, D, lse maker)."""
    cases = [
        ("two splits", 1, 2, 1, 2, 32, lambda shape: rng.uniform(-2, 2, shape)),
        ("ragged: some splits saw no key (lse = -inf, o = 0)", 2, 2, 3, 5, 32, "empty"),
        ("one split", 2, 2, 1, 1, 32, lambda shape: rng.uniform(-2, 2, shape)),
        ("lse about 200: exp overflows float32 without the max shift", 1, 4, 2, 3, 16,
         lambda shape: 200.0 + rng.uniform(-3, 3, shape)),
        ("lse about -200: exp underflows float32 without the max shift", 1, 4, 2, 3, 16,
         lambda shape: -200.0 + rng.uniform(-3, 3, shape)),
        ("many splits (19), D = 48", 1, 2, 2, 19, 48, lambda shape: rng.uniform(-8, 8, shape)),
    ]
    for i in range(2):
        b, hq, t, s = (int(x) for x in rng.integers(1, 4, size=4))
        s += int(rng.integers(0, 8))
        d = int(rng.choice([16, 32, 64]))
        cases.append((f"random #{i + 1}", b, hq, t, s, d, lambda shape: rng.uniform(-6, 6, shape) + rng.uniform(-50, 50)))
    return cases


def _combine_diagnoses(o_parts, lse_parts, large):
    import triton

    s = lse_parts.shape[-1]
    s_pad = triton.next_power_of_2(s)
    o_diag, _ = _merge_diagnoses(o_parts, lse_parts, large)
    if s_pad > s:
        pad = s_pad - s
        o_pad = np.concatenate([o_parts, np.zeros(o_parts.shape[:-2] + (pad, o_parts.shape[-1]))], axis=-2)
        lse_pad = np.concatenate([lse_parts, np.zeros(lse_parts.shape[:-1] + (pad,))], axis=-1)
        o_diag.append(Diagnosis(MSG_PAD_LANES, expected=lambda: ref.merge_partials(o_pad, lse_pad)[0]))
    return o_diag


def grade_decode_combine(fn, *, seed=None):
    """Grade ``fn(o_parts, lse_parts) -> o``: the combine kernel of split-KV decoding.

    ``o_parts`` is float32 ``[B, Hq, T, S, D]`` and ``lse_parts`` float32
    ``[B, Hq, T, S]``, both contiguous and followed in memory by NaN. Return
    float32 ``o [B, Hq, T, D]``, the parts merged by their lse. Cases: one
    split, empty splits (lse = -inf), lse near +-200 (float32's exp overflows
    at 88), a split count that is not a power of two, fresh random ones.
    ``o`` must be written by your own ``@triton.jit`` kernel during the call, and
    the inputs left as they were. Isolated on the CPU; ``seed`` replays a call.
    """
    import torch

    run = Run("check_decode_combine", seed, time_limit_s=60.0)
    device = current().device
    for desc, b, hq, t, s, d, make_lse in _combine_cases(run.rng):
        shape = (b, hq, t, s)
        if make_lse == "empty":
            lse = run.rng.uniform(-3, 3, shape)
            lse[..., 1::2] = -np.inf  # every other split is empty; split 0 never is
        else:
            lse = make_lse(shape)
        o_parts = run.rng.standard_normal(shape + (d,))
        o_parts[np.isneginf(lse)] = 0.0
        o32 = torch.from_numpy(o_parts).to(device=device, dtype=torch.float32)
        l32 = torch.from_numpy(lse).to(device=device, dtype=torch.float32)
        o64, lse64 = o32.double().cpu().numpy(), l32.double().cpu().numpy()
        expected, _ = ref.merge_partials(o64, lse64)
        o_in, lse_in = inputs.guarded_contiguous(o32, after=256), inputs.guarded_contiguous(l32, after=256)
        before = inputs.snapshot(o_parts=o_in, lse_parts=lse_in)
        with proof.Work(inputs=(o_in, lse_in)) as work:
            out = run.call(fn, o_in, lse_in, case=desc)
        if not work.launches:
            raise run.fail(MSG_NO_KERNEL_ATTENTION, desc)
        if not isinstance(out, torch.Tensor):  # a slip (None, `.numpy()` at the end): say that first
            inputs.tensor_like(run, out, "o", (b, hq, t, d), torch.float32, o32.device, desc,
                               hint=" o is float32 [B, Hq, T, D].")
        _proof_of_work(run, work, before, desc, o=out, o_parts=o_in, lse_parts=lse_in)
        inputs.tensor_like(run, out, "o", (b, hq, t, d), torch.float32, o32.device, desc,
                           hint=" o is float32 [B, Hq, T, D].")
        got = out.detach().cpu().double().numpy()
        large = bool(np.max(np.abs(lse64[np.isfinite(lse64)])) > 80)
        run.compare(got, expected, case=desc, what="o", atol=2e-5, rtol=2e-5,
                    diagnoses=_combine_diagnoses(o64, lse64, large), axes=("batch", "q_head", "t", "col"))
    return run.passed()


# =============================================================================
# check_choose_num_splits (the split model; no kernel)
# =============================================================================
MSG_SPLITS_NOT_INT = "your function returned {out!r}; return the number of splits, a positive int."
MSG_SPLITS_TOO_SHORT = (
    "num_splits = {s} cuts the {n} blocks of 64 keys into splits of {chunk} block{plural}, shorter than the "
    "{min_blocks} blocks a split must have: allow only num_splits <= n_blocks // {min_blocks} (and 1 always){keys}."
)
MSG_KEYS_NOT_BLOCKS = "; count the cache in blocks of 64 keys, n_blocks = cdiv(context, 64), not in keys"
MSG_SPLITS_TOO_MANY = "num_splits = {s} is more than the {most} splits the launcher allows (decode.MAX_SPLITS)."
SPLIT_MISTAKES = (  # (switch of splits_busy, the message); the first whose choices fit every case is named
    ("q_heads", "the programs were counted per query head: GQA packing puts the group_size query heads of a kv "
                "head in one program, so programs = batch * n_kv_heads * num_splits."),
    ("no_kv_heads", "the kv heads are missing from the count: each (sequence, kv head) pair has its own "
                    "programs, so programs = batch * n_kv_heads * num_splits."),
    ("slot_waves", "the programs an SM holds were counted as if each read at the SM's full speed (waves of "
                   "n_sms * programs_per_sm slots): decoding is bound by the memory, and the programs of one SM "
                   "share its bandwidth, so an SM that runs k programs takes k programs' time; count "
                   "ceil(programs / n_sms) programs on the busiest SM."),
    ("no_resident", "the ragged end was added as soon as an SM runs a second program: each SM holds "
                    "programs_per_sm programs at once, and only programs past n_sms * programs_per_sm start "
                    "late."),
    ("no_tail", "the busiest SM was not rounded up: when programs / n_sms is not whole, some SMs run one "
                "program more than the others and set the time, so count ceil(programs / n_sms)."),
    ("no_drain", "the ragged end is missing: past n_sms * programs_per_sm programs, add decode.DRAIN_WAVES of "
                 "a program's time (the recorded run of one split at B = 64, 512 programs of a launch that "
                 "holds 396 at once, read well below the ceiling: results/decode_splits.md)."),
    ("no_overhead", "each program's fixed cost is missing: a program costs ceil(n_blocks / num_splits) + "
                    "decode.PROGRAM_OVERHEAD_BLOCKS block reads, which is what makes very short splits poor."),
    ("no_combine", "the combine's cost is missing: more than one split adds decode.COMBINE_BLOCKS block reads "
                   "(the second kernel)."),
    ("no_drain_one_wave", "the ragged end was added to a launch whose programs all fit at once: it is only "
                          "past n_sms * programs_per_sm programs that the last ones start late."),
)


def splits_busy(batch, n_q_heads, n_kv_heads, context, num_splits, n_sms, programs_per_sm, mistake=None) -> float:
    """The model's busy fraction for lesson 09's exercise (T = 1: one block of packed rows), or a mistake's."""
    from ..kernels import decode as _decode
    n_blocks = -(-context // 64)
    heads = {"q_heads": n_q_heads, "no_kv_heads": 1}.get(mistake, n_kv_heads)
    slots = n_sms * (1 if mistake == "no_resident" else programs_per_sm)
    programs = batch * heads * num_splits
    lanes = slots if mistake == "slot_waves" else n_sms  # what the busiest SM's count divides by
    per_sm = programs / lanes if mistake == "no_tail" else math.ceil(programs / lanes)
    per_program = -(-n_blocks // num_splits) + (0.0 if mistake == "no_overhead" else _decode.PROGRAM_OVERHEAD_BLOCKS)
    if (programs > slots and mistake != "no_drain") or mistake == "no_drain_one_wave":
        per_sm += _decode.DRAIN_WAVES
    combine = 0.0 if mistake == "no_combine" or num_splits == 1 else _decode.COMBINE_BLOCKS
    return batch * heads * n_blocks / lanes / (per_sm * per_program + combine)


def _allowed_splits(context):
    from ..kernels import decode as _decode
    n_blocks = -(-context // 64)
    return range(1, max(1, min(_decode.MAX_SPLITS, n_blocks // _decode.MIN_SPLIT_BLOCKS)) + 1)


def _good_splits(case, mistake=None):
    """The split counts within the tolerance of the best one, under the model or under ``mistake``."""
    from ..kernels import decode as _decode
    b, hq, hkv, context, n_sms, per_sm = case
    busy = {s: splits_busy(b, hq, hkv, context, s, n_sms, per_sm, mistake) for s in _allowed_splits(context)}
    best = max(busy.values())
    return {s for s, x in busy.items() if x >= (1 - _decode.SPLIT_TOLERANCE) * best * (1 - 1e-9)}, busy, best


def _choose_cases(rng):
    """(batch, n_q_heads, n_kv_heads, context, n_sms, programs_per_sm, what)."""
    cases = [(1, 32, 1, 512, 132, 3, "MQA at B = 1, a short cache: one program per split"),
             (1, 32, 1, 67584, 132, 3, "MQA at B = 1, a long cache: one program per split")]
    cases += [(b, 32, 8, n, 132, 3, "an H200, 32/8 heads (the benchmark's grid)")
             for b in (1, 4, 16, 64) for n in (1024, 4096, 16384, 65536)]
    cases += [
        (64, 32, 8, 16384, 132, 5, "an H200 with the 2-stage launch (5 per SM)"),
        (64, 8, 8, 16384, 132, 3, "MHA"), (8, 32, 1, 32768, 132, 3, "MQA: 32 query heads, one kv head"),
        (2, 16, 4, 200, 132, 3, "a short cache: 4 blocks"), (3, 64, 8, 8192, 108, 3, "an A100-sized GPU, 3 per SM"),
        (32, 32, 8, 4096, 40, 1, "a small GPU, one program per SM"), (128, 32, 8, 2048, 132, 2, "B = 128"),
        (3, 32, 8, 768, 40, 1, "a small GPU: the combine's cost decides"),
    ]
    for _ in range(6):
        hkv = int(rng.choice([1, 2, 4, 8]))
        cases.append((int(rng.integers(1, 97)), hkv * int(rng.choice([1, 2, 4, 8])), hkv, int(rng.integers(64, 131073)),
                      int(rng.choice([40, 80, 108, 132])), int(rng.integers(1, 5)), "random"))
    return cases


def grade_choose_num_splits(fn, *, seed=None):
    """Grade ``fn(batch, n_q_heads, n_kv_heads, context, n_sms, programs_per_sm) -> num_splits`` (lesson 09).

    One new token per sequence; the cache is ``n_blocks = cdiv(context, 64)``
    blocks; the query heads of a kv head share one program (GQA packing).
    ``programs = batch * n_kv_heads * num_splits``; the busiest SM runs
    ``ceil(programs / n_sms)`` of them, and a launch takes ``(ceil(programs /
    n_sms) + DRAIN_WAVES if programs > n_sms * programs_per_sm) *
    (ceil(n_blocks / num_splits) + PROGRAM_OVERHEAD_BLOCKS) + COMBINE_BLOCKS
    if num_splits > 1`` block reads (the constants are
    ``course_utils.kernels.decode``'s). The busy fraction is ``batch *
    n_kv_heads * n_blocks / n_sms`` over that. Return a count from 1 to
    ``min(MAX_SPLITS, n_blocks // MIN_SPLIT_BLOCKS)`` (1 always allowed) whose
    busy fraction is within ``SPLIT_TOLERANCE`` of the best: any such count
    passes. The course's ``pick_num_splits``, ``model_num_splits`` and
    ``split_busy_fraction`` are refused while it runs.
    """
    __tracebackhide__ = True
    from ..kernels import decode as _decode
    run = Run("check_choose_num_splits", seed, time_limit_s=10.0)
    cases = _choose_cases(run.rng)
    got = []
    for b, hq, hkv, context, n_sms, per_sm, what in cases:
        case = (f"batch={b}, n_q_heads={hq}, n_kv_heads={hkv}, context={context}, n_sms={n_sms}, "
                f"programs_per_sm={per_sm} ({what})")
        with proof.answer_keys_forbidden(_decode.pick_num_splits, _decode.model_num_splits,
                                          _decode.split_busy_fraction):
            out = run.call(fn, b, hq, hkv, context, n_sms, per_sm, case=case)
        integral = isinstance(out, numbers.Integral) or (isinstance(out, float) and out.is_integer())
        if isinstance(out, bool) or not integral or out < 1:
            raise run.fail(MSG_SPLITS_NOT_INT.format(out=out), case)
        got.append((int(out), case))
    keys = [c[:6] for c in cases]
    for (s, case), key in zip(got, keys):
        n_blocks = -(-key[3] // 64)
        if s > _decode.MAX_SPLITS:
            raise run.fail(MSG_SPLITS_TOO_MANY.format(s=s, most=_decode.MAX_SPLITS), case)
        if s > max(1, n_blocks // _decode.MIN_SPLIT_BLOCKS):
            hint = MSG_KEYS_NOT_BLOCKS if s <= key[3] // _decode.MIN_SPLIT_BLOCKS and s > n_blocks else ""
            chunk = -(-n_blocks // s)
            raise run.fail(MSG_SPLITS_TOO_SHORT.format(s=s, n=n_blocks, chunk=chunk, plural="" if chunk == 1 else "s",
                                                       min_blocks=_decode.MIN_SPLIT_BLOCKS, keys=hint), case)
    for (s, case), key in zip(got, keys):
        good, busy, best = _good_splits(key)
        if s in good:
            continue
        lo = min(good)
        message = (f"num_splits = {s} keeps the SMs {busy[s]:.1%} busy by the model; {lo} splits reach "
                   f"{busy[lo]:.1%} (the best is {best:.1%}, and any count within "
                   f"{_decode.SPLIT_TOLERANCE:.0%} of it passes).")
        for mistake, why in SPLIT_MISTAKES:
            if all(g in _good_splits(k, mistake)[0] for (g, _), k in zip(got, keys)):
                message += f"\nLikely cause: {why}"
                break
        raise run.fail(message, case)
    run.max_error = 0.0
    return run.passed()

