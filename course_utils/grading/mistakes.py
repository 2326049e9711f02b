"""The known mistakes: what each would output, computed in NumPy, and what to tell the learner.

A wrong answer is explained by the first :class:`~.core.Diagnosis` whose
mistake it reproduces. The pieces here are shared by the per-lesson checks
(the ``part*`` modules, which pick the mistakes that fit each case):

- the messages, one text each. Where two exercises explain the same mistake
  in their own words (NumPy in lessons 01-02, a Triton kernel in lessons
  04-05, ...), each text has its own name, ending in the exercise it is for:
  ``MSG_NO_CAUSAL_NUMPY``, ``MSG_NO_CAUSAL_TRITON``, ``MSG_NO_CAUSAL_BACKWARD``;
- :func:`weighted`: attention where each (query, key) pair counts a given
  number of times (0: masked), the output of a kernel whose loops visit the
  wrong keys, or some twice;
- :func:`online`: the online softmax over K/V blocks, optionally without
  rescaling ``acc`` or ``l_i``;
- :class:`Model`: a mistake recognised by its predicted output, tried for
  each block size a kernel might use (the size that fits is named);
- :func:`causal_weights`, :func:`floored_weights`: which keys a mistaken
  causal loop visits;
- :class:`KvMapping`, :class:`KvOutOfRange`: query heads reading the wrong
  key/value head, or one that does not exist;
- :func:`shift_diagnoses`: the stability mistakes seen on rows whose scores
  are all far from 0 (:data:`.inputs.SHIFTS`).
"""

from __future__ import annotations

import numpy as np

from .. import references as ref
from .core import Diagnosis, distance_to

# A mistaken kernel's output matches its model only up to the kernel's own rounding,
# which some mistakes amplify (without 1/sqrt(D) the softmax is sharp, and tf32's score
# errors show). So models are matched with this many times the check's tolerance; the
# mistakes differ from each other and from the right answer by far more.
SLACK = 4.0

# One plain sentence (or two) per message; the tests look for these texts.

# -- Proof of work: no (Triton) kernel ran, or not in the pass that must run one. One text per exercise. --
MSG_NO_KERNEL_SOFTMAX = (
    "no Triton kernel ran: your function must compute the softmax by launching your "
    "@triton.jit kernel (`kernel[grid](...)`), not with torch.softmax or other torch code."
)
MSG_NO_KERNEL_TILE_COPY = ("no Triton kernel ran: copy the tensor by launching your @triton.jit kernel, "
                           "not with torch (x.clone(), x.contiguous(), indexing).")
MSG_NO_KERNEL_ATTENTION = (
    "no Triton kernel ran: your function must compute attention by launching your "
    "@triton.jit kernel (`kernel[grid](...)`), not with torch code such as "
    "torch.nn.functional.scaled_dot_product_attention."
)
MSG_NO_TRITON_WINDOW = (
    "no Triton kernel ran: compute the attention with your Triton kernel (lesson 08's "
    "_flash_attention_forward_window_kernel), not with torch or NumPy."
)
MSG_NO_TRITON_RING = (
    "no Triton kernel ran: compute each block with the course's kernels "
    "(course_utils.kernels.flash_attention_with_lse), not with torch operations."
)
MSG_NO_TRITON_BACKWARD_FLASH = (
    "no Triton kernel ran during backward: the gradients came from torch operations (for example "
    "autograd through a math implementation). Write a torch.autograd.Function whose backward "
    "launches your Triton kernels."
)
MSG_NO_TRITON_BACKWARD_WINDOW = (
    "no Triton kernel ran during the backward pass: the gradients must come from your Triton "
    "backward kernels (attention_backward with window_size and sink_size), not from torch."
)
MSG_NOT_DIFFERENTIABLE_FLASH = (
    "o has no grad_fn: autograd cannot differentiate it. Return the output of "
    "YourFunction.apply(q, k, v, causal) (a torch.autograd.Function), and do not detach it."
)
MSG_NOT_DIFFERENTIABLE_WINDOW = (
    "o has no grad_fn: return the output of a torch.autograd.Function's apply, and do not detach it."
)
MSG_NOT_TILED = (
    "your values are right, but your function did not tile: it computed {what} of shape {shape} at once, "
    "larger than one tile (block_m={bm} query rows x block_n={bn} keys). Loop over query blocks "
    "q[..., i0:i0 + block_m, :] and key blocks k[..., j0:j0 + block_n, :], and only ever form one "
    "block_m x block_n tile of scores at a time."
)

# -- Rows located as if packed (lesson 03's softmax, the tile copy). --
MSG_ROW_STRIDE_SOFTMAX = (
    "the rows were located with `row * n_cols`, as if they were packed one after another. "
    "They are not always: a view such as `x[:, :n]` of a wider tensor keeps the wider "
    "tensor's row stride. Pass `x.stride(0)` (and the output's `y.stride(0)`) to the kernel "
    "and step by it."
)
MSG_ROW_STRIDE_TILE_COPY = ("the rows were located with `rows * n_cols`, as if they were packed one after another; "
                            "a slice of a wider tensor keeps the wider tensor's row stride: use x.stride(0).")

# -- The same mistakes in NumPy (lessons 01-02, _NUMPY) and in the Triton forward (lessons 04-05, _TRITON). --
MSG_NO_SCALE_NUMPY = "the scores are not scaled: multiply q @ k^T by 1/sqrt(d) before the softmax."
MSG_NO_SCALE_TRITON = "the scores are not scaled: multiply q @ k^T by sm_scale = 1/sqrt(D) before the softmax."
MSG_NO_CAUSAL_NUMPY = "the causal mask was not applied: with causal=True, query i must not see keys j > i."
MSG_NO_CAUSAL_TRITON = (
    "the causal mask was not applied: with causal=True, query i must not see keys j > i "
    "(set those scores to -inf with tl.where(offs_m[:, None] >= offs_n[None, :], s, -inf))."
)
MSG_NO_CAUSAL_BACKWARD = (
    "the backward pass has no causal mask: P recomputed as exp(S - lse) is not 0 above the "
    "diagonal by itself (lse comes from the masked row). Zero P where key j > query i, and skip "
    "the tiles entirely above the diagonal."
)
MSG_M_INIT_ZERO_NUMPY = (
    "the rows whose values are all far below 0 (around -1000) came out NaN while the others are right: "
    "the running max m starts at 0 instead of -inf, so for those rows every exp(x - m) underflows to 0 "
    "and the running sum stays 0 (0/0). Start it at -inf: np.full(shape, -np.inf)."
)
MSG_M_INIT_ZERO_TRITON = (
    "the rows whose scores are all far below 0 (about -150) came out NaN while the others are right: "
    "m_i starts at 0 instead of -inf, so for those rows exp(s - m_i) underflows to 0 for every key, "
    "l_i stays 0 and o = 0/0. Start the running max at -inf: tl.full([BLOCK_M], float('-inf'), tl.float32)."
)
MSG_ACC_NOT_RESCALED_NUMPY = (
    "acc (the unnormalised output) is not rescaled when the maximum changes: multiply it by "
    "alpha = exp(m_old - m_new) before adding p @ v."
)
MSG_ACC_NOT_RESCALED_TRITON = (
    "the accumulator is not rescaled (BLOCK_N = {block} fits): when the running max grows "
    "from m_i to m_new, multiply acc by alpha = exp(m_i - m_new) before adding p @ v, as "
    "you do for l_i."
)
MSG_L_NOT_RESCALED_NUMPY = (
    "the running sum l_i is not rescaled when the maximum changes: multiply it by "
    "alpha = exp(m_old - m_new) before adding the tile's row sums."
)
MSG_L_NOT_RESCALED_TRITON = (
    "l_i is not rescaled (BLOCK_N = {block} fits): when the running max grows from m_i to m_new, "
    "multiply l_i by alpha = exp(m_i - m_new) before adding the new block's row sums, as you do for acc."
)
MSG_LSE_BASE2_NUMPY = "lse is in base 2; it must be the natural-log logsumexp (multiply a log2 result by ln 2)."
MSG_LSE_BASE2_TRITON = (
    "lse is in base 2: m_i and log2(l_i) are in log2 units when you use exp2. Multiply "
    "(m_i + log2(l_i)) by ln(2) = 0.6931 to get the natural-log lse the backward pass uses."
)
MSG_LSE_MIXED_NUMPY = (
    "lse mixes bases: one of m_i and log(l_i) is in log2 units and the other in natural log. "
    "With np.exp, lse = m_i + np.log(l_i)."
)
MSG_LSE_MIXED_TRITON = (
    "lse mixes bases: one of m_i and log(l_i) is in log2 units and the other in natural "
    "log. With exp2, use (m_i + tl.log2(l_i)) * ln(2); with exp, m_i + tl.log(l_i)."
)
MSG_LSE_NO_MAX_NUMPY = (
    "lse is missing the running max: with l_i = sum exp(s - m_i), lse = m_i + log(l_i), "
    "not log(l_i)."
)
MSG_LSE_NO_MAX_TRITON = (
    "lse is missing the running max: l_i sums exp(s - m_i), so lse = m_i + log(l_i), "
    "not log(l_i) alone."
)
MSG_LSE_NO_MAX_MERGE = "the merged lse is missing the max: lse = m + log(sum_s exp(lse_s - m))."

# -- Merging partial results without the max shift (lesson 09's merge, lesson 10's ring). --
MSG_NO_SHIFT_MERGE = (
    "the merge overflows: exp(lse_s) is inf once lse_s > 709 in float64 (88 in float32), "
    "and 0 below -745, so the weights become inf/inf or 0/0. Subtract the largest lse first: "
    "w_s = exp(lse_s - m) with m = max_s lse_s."
)
MSG_NO_SHIFT_RING = (
    "the merge exponentiates lse without subtracting the max first: exp(lse) overflows to inf once "
    "the scores are large (lse > 709 in float64, > 88 in float32) and inf / inf is NaN. Shift by "
    "m = max(lse_a, lse_b): weights exp(lse_a - m) and exp(lse_b - m), new lse = m + log(sum of weights) "
    "(np.logaddexp / torch.logaddexp do this)."
)

# -- The Triton forward's other mistakes (lessons 04-05), recognised by the models below. --
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
MSG_BOUND_FLOORED = (
    "the causal loop's end is rounded down to a whole K/V block (BLOCK_M, BLOCK_N = {block} fits): the "
    "keys of the last, partial block before min(N, (pid_m + 1) * BLOCK_M) are never visited. Loop "
    "`for start_n in range(0, kv_end, BLOCK_N)` with kv_end = min(N, (pid_m + 1) * BLOCK_M), and mask "
    "the keys past kv_end, or round the number of blocks up with tl.cdiv."
)
MSG_NOT_RESCALED = (
    "neither acc nor l_i is rescaled when the running max grows (BLOCK_N = {block} fits): "
    "multiply both by alpha = exp(m_i - m_new) before adding the new block."
)
MSG_SCALE_TWICE = "the scores were scaled twice (by 1/D): multiply by sm_scale = 1/sqrt(D) once."
MSG_EXP2_NO_LOG2E = (
    "the kernel uses exp2 on natural-log scores: exp(x) == exp2(x * log2(e)), so fold "
    "log2(e) = 1.4427 into the scale (qk_scale = sm_scale * 1.4427) when you use tl.exp2."
)
MSG_EXP_WITH_LOG2E = (
    "the kernel uses tl.exp on scores that include the log2(e) = 1.4427 factor: that factor is for "
    "tl.exp2 (exp(x) == exp2(x * log2(e))). With tl.exp, scale by sm_scale alone."
)
MSG_NO_RUNNING_MAX = (
    "the rows whose scores are large (about +-150) came out inf or NaN while small scores are right: "
    "the scores are exponentiated without subtracting the running max (exp(150) overflows, exp(-150) "
    "underflows to 0). Keep m_i, the largest score seen so far, use p = exp(s - m_new) and rescale acc "
    "and l_i by alpha = exp(m_i - m_new)."
)


# =============================================================================
# What mistaken kernels output (float64)
# =============================================================================
def weighted(s, v, w, phantom=None):
    """Attention where key j counts ``w[..., i, j]`` times for query i (0: masked).

    ``phantom[i]`` extra keys with score 0 and value 0 also count (what a kernel
    sees when it loads padding keys as 0 and forgets to mask their scores).
    Rows with nothing to attend to come out NaN (0/0), as in a kernel, with
    lse -inf. Returns ``(o, lse)``.
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


def online(s, v, block_n, rescale_acc=True, rescale_l=True):
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


def same(actual, wrong, atol, rtol) -> bool:
    """``actual`` is ``wrong``: non-finite in the same places, close elsewhere."""
    if wrong is None or wrong.shape != actual.shape:
        return False
    bad = ~np.isfinite(wrong)
    if bad.all() or (bad != ~np.isfinite(actual)).any():
        return False
    return bool(np.allclose(actual[~bad], wrong[~bad], atol=atol, rtol=rtol))


class Model(Diagnosis):
    """A mistake recognised by its predicted output, for each candidate block size.

    ``predict(size)`` is what the mistaken kernel outputs when it uses block
    size ``size`` (one of ``sizes``: ints, pairs such as ``(block_m,
    block_n)``, or ``None`` for a mistake that does not depend on them), or
    None where the mistake cannot be formed. The first size whose output the
    answer reproduces (:func:`same`, within :data:`SLACK` times the tolerance)
    is filled into the message's ``{block}``.
    """

    def __init__(self, message, predict, sizes=(None,)):
        super().__init__(message)
        self.template, self.predict, self.sizes = message, predict, sizes

    def matches(self, actual, atol, rtol):
        for size in self.sizes:
            with np.errstate(all="ignore"):
                wrong = self.predict(size)
            if same(actual, wrong, atol * SLACK, rtol * SLACK):
                self.message = self.template.format(block=size)
                self.matched_distance = distance_to(actual, wrong, atol, rtol)
                return True
        return False


class KvMapping(Diagnosis):
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
                if same(actual[:, h], o, atol * SLACK, rtol * SLACK):
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


class KvOutOfRange(Diagnosis):
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
            if not any(same(actual[:, h], ref.attention(self.q64[:, h], self.k64[:, j], self.v64[:, j],
                                                        causal=self.causal), atol * SLACK, rtol * SLACK)
                       for j in range(n_kv)):
                return False
        heads = ", ".join(str(h) for h in bad[:16]) + (", ..." if len(bad) > 16 else "")
        self.message = MSG_KV_OUT_OF_RANGE.format(heads=heads, n_kv=n_kv, group=n_q // n_kv)
        return True


def causal_weights(n, kind, block_m):
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


def floored_weights(n, block_m, block_n):
    """A causal loop whose end min(N, (pid_m + 1) * BLOCK_M) is rounded down to a multiple of BLOCK_N."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    end = np.minimum(n, (i // block_m + 1) * block_m) // block_n * block_n
    w = ((j <= i) & (j < end)).astype(float)
    return w


def shift_diagnoses(row_max):
    """Rows with scores near -150 or +150 wrong while the rest are right: which stability mistake."""
    low, high = row_max < -110.0, row_max > 90.0

    def bad_rows(actual):
        return ~np.isfinite(actual).all(-1)

    def m_init_zero(actual):
        bad = bad_rows(actual)
        return bool(bad.any() and not (bad & ~low).any() and bad[low].all())

    def no_max(actual):
        bad = bad_rows(actual)
        return bool(bad.any() and not (bad & ~(low | high)).any() and bad[high].all())

    return [Diagnosis(MSG_M_INIT_ZERO_TRITON, when=m_init_zero), Diagnosis(MSG_NO_RUNNING_MAX, when=no_max)]
