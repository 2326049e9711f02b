"""check_merge_partials, check_decode_split, check_decode_combine: planted mistakes get their diagnosis.

The planted kernels are the course's own (course_utils/kernels/decode.py) with
exactly one mistake each: the test copies decode.py's source, replaces one line
(which must occur exactly once, so a change to decode.py that would make a
mutant meaningless fails loudly), writes it to a temporary module and imports
it. Correct answers written differently (other block sizes, natural-log
exponentials, NumPy's logaddexp) must pass.
"""

import inspect
import math

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import numpy as np
import pytest
import torch
import triton

from course_utils import references as ref
from course_utils.grading import GradingError, check_decode_combine, check_decode_split, check_merge_partials
from course_utils.grading import part5_decode as p5
from course_utils.kernels import decode
from conftest import copied_by_a_kernel, module_from_source

_made: dict = {}


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decode_variants")
    source = inspect.getsource(decode).replace("from .forward import", "from course_utils.kernels.forward import")

    def make(name, *edits):
        """decode.py with each ``(old, new)`` edit applied, as a module."""
        if name in _made:
            return _made[name]
        src = source
        for old, new in edits:
            assert src.count(old) == 1, f"{name}: {old!r} occurs {src.count(old)} times in decode.py"
            src = src.replace(old, new)
        _made[name] = module_from_source(folder / f"decode_variant_{name}.py", src)
        return _made[name]

    return make


def split(module, **kw):
    return lambda q, k, v, seqlens, num_splits: module.decode_split(q, k, v, seqlens, num_splits, **kw)


def combine(module):
    def fn(o_parts, lse_parts):
        out = torch.empty(o_parts.shape[:3] + o_parts.shape[4:], dtype=torch.float32, device=o_parts.device)
        return module.decode_combine(o_parts, lse_parts, out)

    return fn


def _fails(check, fn, message):
    """``check(fn)`` fails, naming ``message`` as the likely cause."""
    with pytest.raises(GradingError) as info:
        check(fn)
    text = str(info.value)
    fixed = message.split("{")[0][1:60]
    assert "Likely cause: " in text and fixed in text.split("Likely cause: ", 1)[1], text
    return text


# -- check_merge_partials ---------------------------------------------------------
def _merge_logaddexp(o_parts, lse_parts):
    lse = np.logaddexp.reduce(lse_parts, axis=-1)
    return np.einsum("...s,...sd->...d", np.exp(lse_parts - lse[..., None]), o_parts), lse


def _merge_pairwise(o_parts, lse_parts):  # fold the parts in one at a time, like the online softmax
    o, lse = o_parts[..., 0, :], lse_parts[..., 0]
    for s in range(1, lse_parts.shape[-1]):
        new = np.logaddexp(lse, lse_parts[..., s])
        o = np.exp(lse - new)[..., None] * o + np.exp(lse_parts[..., s] - new)[..., None] * o_parts[..., s, :]
        lse = new
    return o, lse


def _merge_torch(o_parts, lse_parts):
    o, l = torch.from_numpy(o_parts), torch.from_numpy(lse_parts)
    w = torch.softmax(l, dim=-1)
    return (w[..., None] * o).sum(-2).numpy(), torch.logsumexp(l, dim=-1).numpy()


@pytest.mark.parametrize("fn", [_merge_logaddexp, _merge_pairwise, _merge_torch],
                         ids=["logaddexp", "pairwise", "torch-softmax"])
def test_merge_correct_variants_pass(fn):
    assert check_merge_partials(fn)


def test_merge_borrowing_the_reference_is_refused():
    for borrowed in (ref.merge_partials, lambda o, lse: ref.merge_partials(o, lse)):
        text = str(pytest.raises(GradingError, check_merge_partials, borrowed).value)
        assert "called course_utils.references.merge_partials" in text and "cannot be the answer" in text, text


def test_combine_with_the_reference_behind_a_dummy_kernel_is_refused():
    import torch

    from course_utils.grading import check_decode_combine

    def combine(o_parts, lse_parts, *args, **kwargs):  # a launcher that lets the reference do the merge
        o, _ = ref.merge_partials(o_parts.detach().cpu().double().numpy(), lse_parts.detach().cpu().double().numpy())
        return torch.from_numpy(o).to(o_parts)

    text = str(pytest.raises(GradingError, check_decode_combine, combine, isolate=False).value)
    assert "called course_utils.references.merge_partials" in text, text


def _merge_no_shift(o_parts, lse_parts):
    w = np.exp(lse_parts)
    return np.sum((w / w.sum(-1, keepdims=True))[..., None] * o_parts, axis=-2), np.log(w.sum(-1))


def _merge_not_renormalised(o_parts, lse_parts):
    m = lse_parts.max(-1, keepdims=True)
    w = np.exp(lse_parts - m)
    return np.sum(w[..., None] * o_parts, axis=-2), (m + np.log(w.sum(-1, keepdims=True)))[..., 0]


# The half of each mistake that is right comes from a learner's correct merge (the reference is refused inside).
def _merge_average(o_parts, lse_parts):
    return o_parts.mean(-2), _merge_logaddexp(o_parts, lse_parts)[1]


def _merge_lse_no_max(o_parts, lse_parts):
    m = lse_parts.max(-1, keepdims=True)
    return _merge_logaddexp(o_parts, lse_parts)[0], np.log(np.exp(lse_parts - m).sum(-1))


@pytest.mark.parametrize("fn, message", [
    (_merge_no_shift, p5.MSG_NO_SHIFT_MERGE),
    (_merge_not_renormalised, p5.MSG_NOT_RENORMALISED),
    (_merge_average, p5.MSG_PLAIN_AVERAGE),
    (_merge_lse_no_max, p5.MSG_LSE_NO_MAX_MERGE),
], ids=["no-shift", "not-renormalised", "average", "lse-no-max"])
def test_merge_mistakes_are_diagnosed(fn, message):
    with np.errstate(all="ignore"):
        _fails(check_merge_partials, fn, message)


def test_merge_wrong_return_gets_a_sentence():
    with pytest.raises(GradingError, match="return the pair"):
        check_merge_partials(lambda o, l: _merge_logaddexp(o, l)[0])


# -- check_decode_split -------------------------------------------------------------
SPLIT_CORRECT = {  # learner copies of decode.py (the checks refuse course_utils's own kernels)
    "block-16": lambda variant: split(variant("plain"), BLOCK_N=16),
    "natural-exp-block-64": lambda variant: split(variant("natural_exp", (
        "s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units",
        "s = tl.dot(q, k) * (qk_scale * 0.6931471805599453)"), (
        "alpha = tl.exp2(m_i - m_use)", "alpha = tl.exp(m_i - m_use)"), (
        "p = tl.exp2(s - m_use[:, None])", "p = tl.exp(s - m_use[:, None])"), (
        "lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float(\"-inf\"))",
        "lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float(\"-inf\"))")), BLOCK_N=64),
}


@pytest.mark.parametrize("name", list(SPLIT_CORRECT))
def test_split_correct_variants_pass(variant, name):
    assert check_decode_split(SPLIT_CORRECT[name](variant))


SPLIT_MISTAKES = {  # name: (edit, message, words naming the kind of mistake)
    "past-seqlen": (("hi = tl.minimum(lo + chunk, seq_len)", "hi = tl.minimum(lo + chunk, n_cap)"),
                    p5.MSG_PAST_SEQLEN, "past cache_seqlens"),
    "top-left": (("pos = seq_len - T + t", "pos = t"), p5.MSG_CAUSAL_OFFSET, "top-left"),
    "no-causal": (("pos = seq_len - T + t", "pos = seq_len - 1 + 0 * t"), p5.MSG_CAUSAL_OFFSET,
                  "no mask among the new tokens"),
    "causal-plus-one": (("pos = seq_len - T + t", "pos = seq_len - T + t + 1"), p5.MSG_CAUSAL_OFFSET,
                        "also sees the next one"),
    "packed-row-position": (("pos = seq_len - T + t", "pos = seq_len - T + rows"), p5.MSG_CAUSAL_OFFSET,
                            "packed row"),
    "split-short": (("hi = tl.minimum(lo + chunk, seq_len)", "hi = tl.minimum(lo + chunk - 1, seq_len)"),
                    p5.MSG_SPLIT_DROPS, "stops one key short"),
    "chunk-floor": (("chunk = tl.cdiv(seq_len, num_splits)", "chunk = seq_len // num_splits"), p5.MSG_SPLIT_DROPS,
                    "rounds down"),
    "empty-row-nan": (("m_use = tl.where(m_new == float(\"-inf\"), 0.0, m_new)", "m_use = m_new"),
                      p5.MSG_EMPTY_ROW, "sees no key of its split"),
}


@pytest.mark.parametrize("name", list(SPLIT_MISTAKES))
def test_split_mistakes_are_diagnosed(variant, name):
    edit, message, kind = SPLIT_MISTAKES[name]
    text = _fails(check_decode_split, split(variant(name, edit)), message)
    assert kind in text.split("Likely cause: ", 1)[1], text


def test_split_without_a_kernel_fails():
    def no_kernel(q, k, v, seqlens, num_splits):  # right numbers, computed by torch alone
        return _torch_partials(q, k, v, seqlens, num_splits)

    with pytest.raises(GradingError, match="no Triton kernel ran"):
        check_decode_split(no_kernel)


# -- check_decode_combine -------------------------------------------------------------
def test_combine_correct_variants_pass(variant):
    assert check_decode_combine(combine(variant("plain")))  # a learner's copy: the course's own is refused
    exp2 = variant("combine_exp2", ("w = tl.exp(lse - m)", "w = tl.exp2((lse - m) * 1.4426950408889634)"))
    assert check_decode_combine(combine(exp2))


COMBINE_MISTAKES = {
    "no-shift": (("m = tl.max(lse, axis=0)  # every row has a split that sees a key, so m is finite",
                  "m = 0.0"), p5.MSG_NO_SHIFT_MERGE),
    "not-renormalised": (("w = w / tl.sum(w, axis=0)", "w = w"), p5.MSG_NOT_RENORMALISED),
    "pad-lanes": (("mask=s_ok, other=float(\"-inf\"))", "mask=s_ok, other=0.0)"), p5.MSG_PAD_LANES),
}


@pytest.mark.parametrize("name", list(COMBINE_MISTAKES))
def test_combine_mistakes_are_diagnosed(variant, name):
    edit, message = COMBINE_MISTAKES[name]
    _fails(check_decode_combine, combine(variant(name, edit)), message)


def test_a_mistake_that_moves_the_answer_less_than_slack_is_still_named():
    # On a GPU (tf32, tolerance 0.013) a split that drops one key of 32 moved o by 0.046 < 4 x 0.013:
    # seen on the H200 (seed 186369313). The answer is nearer the mistake's output than the right one.
    right = np.full((1, 4), 0.3175)
    wrong = right + np.array([[0.046, -0.03, 0.02, 0.0]])
    actual = wrong + 1e-4  # the mistake, computed with tf32
    atol = rtol = 0.013
    model = p5._Model("a split boundary drops a token", lambda: (wrong, None), 0, right)
    assert model.matches(actual, atol, rtol) and model.distance(actual, atol, rtol) < 0.1
    nearer_right = right + 0.3 * (wrong - right)  # an answer nearer the right one is not blamed on it
    assert not p5._Model("x", lambda: (wrong, None), 0, right).matches(nearer_right, atol, rtol)


# -- proof of work: the answer must come from the learner's own kernels ----------------------------
_copied = copied_by_a_kernel


def _torch_partials(q, k_cache, v_cache, cache_seqlens, num_splits):
    """The split kernel's answer in torch (softmax and matrix products), float32."""
    B, Hq, T, D = q.shape
    group = Hq // k_cache.shape[1]
    o_parts = torch.zeros((B, Hq, T, num_splits, D), dtype=torch.float32, device=q.device)
    lse_parts = torch.full((B, Hq, T, num_splits), -math.inf, dtype=torch.float32, device=q.device)
    for b, length in enumerate(cache_seqlens.tolist()):
        kk = k_cache[b, :, :length].float().repeat_interleave(group, 0)
        vv = v_cache[b, :, :length].float().repeat_interleave(group, 0)
        s = q[b].float() @ kk.transpose(-1, -2) / math.sqrt(D)
        pos = length - T + torch.arange(T, device=q.device)
        chunk = -(-length // num_splits)
        for split_index in range(num_splits):
            lo, hi = min(split_index * chunk, length), min((split_index + 1) * chunk, length)
            keys = torch.arange(length, device=q.device)
            keep = (keys[None, :] >= lo) & (keys[None, :] < hi) & (keys[None, :] <= pos[:, None])
            sc = s.masked_fill(~keep, -math.inf)
            seen = keep.any(-1)
            lse = torch.where(seen, torch.logsumexp(sc, -1), -math.inf)
            p = torch.where(seen[:, None], torch.softmax(sc.masked_fill(~seen[:, None], 0.0), -1), 0.0)
            o_parts[b, :, :, split_index] = p @ vv
            lse_parts[b, :, :, split_index] = lse
    return o_parts, lse_parts


def test_split_borrowing_the_course_kernel_fails():
    text = str(pytest.raises(GradingError, check_decode_split, split(decode)).value)
    assert "course_utils's own kernel `_decode_split_kernel`" in text, text


def test_split_torch_behind_a_dummy_kernel_fails():
    def torch_answer(q, k_cache, v_cache, cache_seqlens, num_splits):
        o_parts, lse_parts = _torch_partials(q, k_cache, v_cache, cache_seqlens, num_splits)
        return _copied(o_parts), _copied(lse_parts)

    text = str(pytest.raises(GradingError, check_decode_split, torch_answer).value)
    assert "while your function ran, torch computed" in text and "own @triton.jit kernel" in text, text


def test_split_references_behind_a_dummy_kernel_fail():
    def reference_answer(q, k_cache, v_cache, cache_seqlens, num_splits):
        o, lse = ref.decode_partials(*(x.double().nan_to_num().cpu().numpy() for x in (q, k_cache, v_cache)),
                                     cache_seqlens.cpu().numpy(), num_splits)
        return (_copied(torch.from_numpy(o).float().to(q.device)),
                _copied(torch.from_numpy(lse).float().to(q.device)))

    text = str(pytest.raises(GradingError, check_decode_split, reference_answer).value)
    assert "called course_utils.references.decode_partials" in text and "cannot be the answer" in text, text


def test_split_result_not_written_by_the_kernel_fails(variant):
    def kernel_then_torch(q, k_cache, v_cache, cache_seqlens, num_splits):
        o_parts, lse_parts = split(variant("plain"))(q, k_cache, v_cache, cache_seqlens, num_splits)
        total = torch.zeros_like(o_parts)
        total += o_parts  # summed by torch into a tensor no kernel wrote
        return total, lse_parts

    text = str(pytest.raises(GradingError, check_decode_split, kernel_then_torch).value)
    assert "o_parts was not written by your Triton kernel: it was computed by torch (aten.add_)" in text, text


def test_split_that_edits_the_cache_in_place_fails(variant):
    def zeroes_the_tail(q, k_cache, v_cache, cache_seqlens, num_splits):
        k_cache.nan_to_num_(0.0)  # the right answer, but the caller's cache is changed
        return split(variant("plain"))(q, k_cache, v_cache, cache_seqlens, num_splits)

    text = str(pytest.raises(GradingError, check_decode_split, zeroes_the_tail).value)
    assert "changed its input `k_cache` in place" in text, text


def test_split_launcher_of_the_lesson_with_decode_config_passes(variant):
    """The lesson's launcher: its own kernel, course_utils.kernels.decode's plain helpers (decode_config, LOG2E)."""
    kernel = variant("plain")._decode_split_kernel

    def split_partials(q, k_cache, v_cache, cache_seqlens, num_splits):
        B, n_q_heads, T, D = q.shape
        n_kv_heads, n_max = k_cache.shape[1], k_cache.shape[2]
        group_size = n_q_heads // n_kv_heads
        block_m = min(64, max(16, triton.next_power_of_2(group_size * T)))
        cfg = decode.decode_config(D, q.dtype, q.device)
        o_parts = torch.empty((B, n_q_heads, T, num_splits, D), dtype=torch.float32, device=q.device)
        lse_parts = torch.empty((B, n_q_heads, T, num_splits), dtype=torch.float32, device=q.device)
        grid = (num_splits, triton.cdiv(group_size * T, block_m), B * n_kv_heads)
        kernel[grid](
            q, k_cache, v_cache, cache_seqlens, cache_seqlens, o_parts, lse_parts, o_parts,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), 0, 0, 0, 0, 0, 0,
            n_q_heads, n_kv_heads, T, n_max, n_max, num_splits, decode.LOG2E / math.sqrt(D),
            D=D, D_PAD=triton.next_power_of_2(max(D, 16)), BLOCK_M=block_m, PAGED=False, SPLIT=True, **cfg,
        )
        return o_parts, lse_parts

    assert check_decode_split(split_partials)


def test_combine_borrowing_the_course_kernel_fails():
    text = str(pytest.raises(GradingError, check_decode_combine, combine(decode)).value)
    assert "course_utils's own kernel `_decode_combine_kernel`" in text, text


def test_combine_torch_behind_a_dummy_kernel_fails():
    def torch_answer(o_parts, lse_parts):
        w = torch.softmax(lse_parts, dim=-1)
        return _copied((w[..., None] * o_parts).sum(-2))

    text = str(pytest.raises(GradingError, check_decode_combine, torch_answer).value)
    assert "torch computed a softmax" in text, text


def test_combine_that_edits_lse_parts_in_place_fails(variant):
    def shifts_lse_in_place(o_parts, lse_parts):
        lse_parts -= lse_parts.amax(-1, keepdim=True)  # the merge does not change, the caller's lse does
        return combine(variant("plain"))(o_parts, lse_parts)

    text = str(pytest.raises(GradingError, check_decode_combine, shifts_lse_in_place).value)
    assert "changed its input `lse_parts` in place" in text, text


# -- check_choose_num_splits (the wave model; lesson 09's exercise 4) ---------------------------
def _learner(mistake=None, pick="smallest", cap=True, min_blocks=4, keys=False):
    """A learner's choose_num_splits, written from the lesson's spec (time counted in keys, not blocks)."""
    from course_utils.grading import check_choose_num_splits  # noqa: F401  (the check these answers are for)

    def choose(batch, n_q_heads, n_kv_heads, context, n_sms, programs_per_sm):
        n = context if keys else math.ceil(context / 64)
        slots = n_sms * (1 if mistake == "no_resident" else programs_per_sm)
        lanes = slots if mistake == "slot_waves" else n_sms
        heads = n_q_heads if mistake == "q_heads" else (1 if mistake == "no_kv_heads" else n_kv_heads)
        most = max(1, n // min_blocks)
        if cap:
            most = min(128, most)
        busy = []
        for s in range(1, most + 1):
            programs = batch * heads * s
            per_sm = programs / lanes if mistake == "no_tail" else math.ceil(programs / lanes)
            if (programs > slots and mistake != "no_drain") or mistake == "no_drain_one_wave":
                per_sm += 0.45
            keys_per_program = 64 * (math.ceil(n / s) + (0 if mistake == "no_overhead" else 1))
            combine = 0 if s == 1 or mistake == "no_combine" else 2 * 64
            busy.append(batch * heads * n * 64 / lanes / (per_sm * keys_per_program + combine))
        best = max(busy)
        if pick == "argmax":
            return busy.index(best) + 1
        return next(s for s, b in enumerate(busy, start=1) if b >= 0.98 * best)

    return choose


def _choose_numpy(batch, n_q_heads, n_kv_heads, context, n_sms, programs_per_sm):
    n_blocks = -(-context // 64)
    s = np.arange(1, max(1, min(128, n_blocks // 4)) + 1)
    programs = batch * n_kv_heads * s
    per_sm = np.ceil(programs / n_sms) + np.where(programs > n_sms * programs_per_sm, 0.45, 0.0)
    time = per_sm * (np.ceil(n_blocks / s) + 1) + np.where(s > 1, 2, 0)
    busy = batch * n_kv_heads * n_blocks / n_sms / time
    return s[np.argmax(busy >= 0.98 * busy.max())]  # a NumPy int


def _choose_float(*args):
    return float(_learner()(*args))  # 3.0 is a count too


@pytest.mark.parametrize("fn", [_learner(), _learner(pick="argmax"), _choose_numpy, _choose_float],
                         ids=["smallest-within-2%", "argmax", "numpy", "float"])
def test_choose_splits_correct_variants_pass(fn):
    from course_utils.grading import check_choose_num_splits

    for seed in (0, 1, 2):
        check_choose_num_splits(fn, seed=seed)


def test_choose_splits_agrees_with_the_launcher():
    """The exercise's model is the launcher's (model_num_splits, where pick_num_splits starts): the same choices
    on the benchmark's grid (an H200), with the residency of the launch at one split (5 per SM for B = 64's
    2-stage launch, 3 otherwise)."""
    for b in (1, 4, 16, 64):
        per_sm = 5 if b * 8 >= 2 * 132 else 3
        for n in (1024, 4096, 16384, 65536):
            model = decode.model_num_splits(b, 8, 1, n // 64, 132)
            assert _learner()(b, 32, 8, n, 132, per_sm) == model
            assert decode.pick_num_splits(b, 8, 1, n, torch.device("cpu"), 64, sm_count=132) in (model, 2 * model)
            for s in (1, 2, 7):
                assert p5.splits_busy(b, 32, 8, n, s, 132, 3) == decode.split_busy_fraction(b, 8, 1, n // 64, s, 132, 3)


CHOOSE_MISTAKES = {m: dict(p5.SPLIT_MISTAKES)[m] for m, _ in p5.SPLIT_MISTAKES}


@pytest.mark.parametrize("mistake", list(CHOOSE_MISTAKES))
@pytest.mark.parametrize("pick", ["smallest", "argmax"])
def test_choose_splits_mistakes_are_diagnosed(mistake, pick):
    from course_utils.grading import check_choose_num_splits

    for seed in (0, 1):
        text = _fails(lambda fn: check_choose_num_splits(fn, seed=seed), _learner(mistake, pick),
                      " " + CHOOSE_MISTAKES[mistake])
        assert "busy by the model" in text


@pytest.mark.parametrize("learner, words", [
    (_learner(min_blocks=1), "shorter than the 4 blocks a split must have"),
    (_learner(keys=True), "count the cache in blocks of 64 keys"),
    (_learner(cap=False, pick="argmax"), "more than the 128 splits"),
    (lambda *a: None, "return the number of splits, a positive int"),
    (lambda *a: 0, "return the number of splits, a positive int"),
    (lambda *a: "4", "return the number of splits, a positive int"),
    (lambda *a: 2.5, "return the number of splits, a positive int"),
], ids=["below-min-chunk", "keys-not-blocks", "past-max-splits", "none", "zero", "str", "fraction"])
def test_choose_splits_bad_counts_get_a_sentence(learner, words):
    from course_utils.grading import check_choose_num_splits

    with pytest.raises(GradingError, match=words):
        check_choose_num_splits(learner, seed=0)


@pytest.mark.parametrize("answer_key", ["pick_num_splits", "model_num_splits", "split_busy_fraction"])
def test_choose_splits_calling_the_course_fails(answer_key):
    from course_utils.grading import check_choose_num_splits

    def borrow(batch, n_q_heads, n_kv_heads, context, n_sms, programs_per_sm):
        if answer_key == "pick_num_splits":
            return decode.pick_num_splits(batch, n_kv_heads, 1, context, torch.device("cpu"), 64, sm_count=n_sms)
        if answer_key == "model_num_splits":
            return decode.model_num_splits(batch, n_kv_heads, 1, -(-context // 64), n_sms)
        n = -(-context // 64)
        busy = [decode.split_busy_fraction(batch, n_kv_heads, 1, n, s, n_sms, programs_per_sm)
                for s in range(1, max(1, min(128, n // 4)) + 1)]
        return busy.index(max(busy)) + 1

    with pytest.raises(GradingError, match=answer_key):
        check_choose_num_splits(borrow, seed=0)
    assert decode.pick_num_splits(1, 8, 1, 16384, torch.device("cpu"), 64, sm_count=132) == 16  # restored after
