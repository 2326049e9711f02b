"""check_tiled_backward and check_flash_backward: planted mistakes get their diagnosis.

NumPy: a tiled backward written the way lesson 07 teaches it, with exactly
one mistake switched on at a time.

Triton: each planted mistake is made by editing the text of the course's own
kernels (course_utils/kernels/backward.py) in one place and loading the
edited copy as a module, so every planted kernel is the real kernel with
exactly one realistic bug. Correct answers written differently (other block
sizes, per-query-head partial gradients summed afterwards, no tiling at all
in NumPy) must pass; answers without Triton in the backward must not.
"""

import math
import re
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import numpy as np
import pytest
import torch

from conftest import learner_copy, module_from_source

from course_utils import references as ref
from course_utils.grading import GradingError
from course_utils.grading import part4_backward as p4
from course_utils.grading import check_flash_backward, check_tiled_backward
from course_utils.kernels import backward as course_bw
from course_utils.kernels import flash_attention_with_lse

LOG2E = 1.4426950408889634


bw = learner_copy(course_bw, "learner_backward")


# -----------------------------------------------------------------------------
# NumPy
# -----------------------------------------------------------------------------
def tiled_backward(q, k, v, o, lse, do, causal=False, *, block_m=16, block_n=8, mistake=None):
    """A learner's tiled backward, with an optional planted mistake."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_q, n_k = q.shape[-2], k.shape[-2]
    if mistake == "delta_rowsum_do":
        delta = do.sum(-1)
    elif mistake == "delta_rowsum_do_v":
        delta = (do * v).sum(-1)
    elif mistake == "delta_missing":
        delta = np.zeros(do.shape[:-1])
    else:
        delta = (do * o).sum(-1)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for j0 in range(0, n_k, block_n):
        kj, vj = k[..., j0:j0 + block_n, :], v[..., j0:j0 + block_n, :]
        cols = np.arange(j0, j0 + kj.shape[-2])
        first = 0 if (not causal or mistake == "no_causal_mask") else (j0 // block_m) * block_m
        for i0 in range(first, n_q, block_m):
            qi, doi = q[..., i0:i0 + block_m, :], do[..., i0:i0 + block_m, :]
            rows = np.arange(i0, i0 + qi.shape[-2])
            s = scale * (qi @ np.swapaxes(kj, -1, -2))
            li = lse[..., i0:i0 + block_m, None]
            p = np.exp2(s * LOG2E - li) if mistake == "lse_base2" else np.exp(s - li)
            if causal and mistake not in ("no_causal_mask", "diagonal_unmasked"):
                p = np.where(cols[None, :] <= rows[:, None], p, 0.0)
            dv[..., j0:j0 + block_n, :] += np.swapaxes(p, -1, -2) @ doi
            ds = p * (doi @ np.swapaxes(vj, -1, -2) - delta[..., i0:i0 + block_m, None])
            dq[..., i0:i0 + block_m, :] += (1.0 if mistake == "dq_no_scale" else scale) * (ds @ kj)
            dk[..., j0:j0 + block_n, :] += (1.0 if mistake == "dk_no_scale" else scale) * (np.swapaxes(ds, -1, -2) @ qi)
    return dq, dk, dv


def backward_without_tiles(q, k, v, o, lse, do, causal=False):
    # Correct and written differently: the whole matrix, P rebuilt from lse.
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = np.exp(scale * q @ np.swapaxes(k, -1, -2) - lse[..., None])
    if causal:
        p = np.tril(p)
    ds = p * (do @ np.swapaxes(v, -1, -2) - np.einsum("...d,...d->...", do, o)[..., None])
    return scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, np.swapaxes(p, -1, -2) @ do


@pytest.mark.parametrize("blocks", [(16, 8), (1, 1), (5, 7), (64, 64)])
def test_tiled_correct_answers_pass(blocks):
    bm, bn = blocks
    assert check_tiled_backward(lambda *a, causal=False: tiled_backward(*a, causal, block_m=bm, block_n=bn))

    def with_block_defaults(q, k, v, o, lse, do, causal=False, block_m=bm, block_n=bn):
        return tiled_backward(q, k, v, o, lse, do, causal, block_m=block_m, block_n=block_n)

    assert check_tiled_backward(with_block_defaults)


def test_tiled_whole_matrix_answer_is_refused_as_not_tiled():
    # Right values (np.tril is top-left aligned like the course's mask), but no tiles.
    with pytest.raises(GradingError, match="did not tile: it computed the scores q @ k\\^T of shape \\(150, 150\\)"):
        check_tiled_backward(backward_without_tiles)

    def tiles_only_queries(q, k, v, o, lse, do, causal=False, block_m=16, block_n=16):
        return tiled_backward(q, k, v, o, lse, do, causal, block_m=block_m, block_n=10_000)

    with pytest.raises(GradingError, match="did not tile"):
        check_tiled_backward(tiles_only_queries)


def test_tiled_backward_may_not_call_the_references():
    with pytest.raises(GradingError, match="called course_utils.references.tiled_attention_backward"):
        check_tiled_backward(lambda q, k, v, o, lse, do, causal=False:
                             ref.tiled_attention_backward(q, k, v, o, lse, do, 16, 16, causal))


@pytest.mark.parametrize("mistake,message", [
    ("delta_rowsum_do", p4.MSG_DELTA),
    ("delta_rowsum_do_v", p4.MSG_DELTA),
    ("delta_missing", p4.MSG_DELTA),
    ("dq_no_scale", p4.MSG_DQ_SCALE),
    ("dk_no_scale", p4.MSG_DK_SCALE),
    ("no_causal_mask", p4.MSG_NO_CAUSAL_BACKWARD),
    ("diagonal_unmasked", p4.MSG_DIAGONAL_UNMASKED),
    ("lse_base2", p4.MSG_LSE_BASE),
])
def test_tiled_planted_mistakes_are_diagnosed(mistake, message):
    def fn(*a, causal=False):
        # 4 x 4 tiles: on N=13 some tiles are skipped, so "diagonal not masked" differs from "no mask"
        return tiled_backward(*a, causal, block_m=4, block_n=4, mistake=mistake)
    with pytest.raises(GradingError) as info:
        check_tiled_backward(fn)
    assert message in str(info.value)
    assert "reproduce with" in str(info.value)


def test_tiled_wrong_return_type_is_explained():
    with pytest.raises(GradingError, match="tuple"):
        check_tiled_backward(lambda *a, causal=False: tiled_backward(*a, causal)[:2])
    with pytest.raises(GradingError, match="shape"):
        check_tiled_backward(lambda *a, causal=False: tuple(x.T for x in tiled_backward(*a, causal)))
    with pytest.raises(GradingError, match="check_tiled_backward expects a function, but got a str"):
        check_tiled_backward("not a function")


def test_tiled_seed_replays_the_same_cases():
    seen = []

    def spy(q, k, v, o, lse, do, causal=False):
        seen.append((q.shape, causal, float(q.ravel()[0])))
        return tiled_backward(q, k, v, o, lse, do, causal)

    check_tiled_backward(spy, seed=123)
    first, seen[:] = list(seen), []
    check_tiled_backward(spy, seed=123)
    assert seen == first
    check_tiled_backward(spy, seed=124)
    assert seen[-1] != first[-1]


# -----------------------------------------------------------------------------
# Triton
# -----------------------------------------------------------------------------
SOURCE = Path(course_bw.__file__).read_text()


def planted(tmp_path, name, *edits):
    """The course's backward module with ``edits`` (old, new) applied, loaded afresh."""
    text = SOURCE
    for old, new in edits:
        assert text.count(old) >= 1, f"planting {name}: {old!r} not found in backward.py"
        text = text.replace(old, new)
    return module_from_source(tmp_path / f"planted_{name}.py", text).flash_attention_differentiable


PLANTS = {
    "delta_rowsum_do": ([("delta = tl.sum(o * do, axis=1)", "delta = tl.sum(do, axis=1)")], p4.MSG_DELTA),
    "delta_missing": ([("delta = tl.sum(o * do, axis=1)", "delta = tl.sum(o * do, axis=1) * 0.0")], p4.MSG_DELTA),
    "dq_no_scale": ([("    dq *= sm_scale\n", "")], p4.MSG_DQ_SCALE),
    "dk_no_scale": ([("    dk *= sm_scale\n", "")], p4.MSG_DK_SCALE),
    "gqa_first_head_only": ([("for g in range(0, group_size):", "for g in range(0, 1):")], p4.MSG_GQA),
    "gqa_last_head_only": ([("for g in range(0, group_size):", "for g in range(group_size - 1, group_size):")], p4.MSG_GQA),
    "no_causal_mask": ([("CAUSAL=bool(causal),", "CAUSAL=False,")], p4.MSG_NO_CAUSAL_BACKWARD),
    "gqa_without_plus_g": ([("q_head = kv_head * group_size + g", "q_head = kv_head * group_size")], p4.MSG_GQA_NO_G),
    "dq_key_tail_unmasked": ([("            p = tl.where(offs_n[None, :] < N_K, p, 0.0)", "            p = p")],
                             p4.MSG_DQ_TAIL_UNMASKED),
    "diagonal_unmasked": ([("        if MASK:", "        if False:")], p4.MSG_DIAGONAL_UNMASKED),
    "lse_base2": ([("lse[None, :] * 1.4426950408889634", "lse[None, :]"),
                   ("lse2 = lse * 1.4426950408889634", "lse2 = lse")], p4.MSG_LSE_BASE),
}


@pytest.mark.parametrize("name", list(PLANTS))
def test_flash_planted_mistakes_are_diagnosed(tmp_path, name):
    edits, message = PLANTS[name]
    fn = planted(tmp_path, name, *edits)
    with pytest.raises(GradingError) as info:
        check_flash_backward(fn)
    if name == "diagonal_unmasked" and course_utils.ENV.device == "cuda" and p4.MSG_NO_CAUSAL_BACKWARD in str(info.value):
        # The GPU's dK/dV tiles hold 128 keys: on a case with N <= 128 every tile crosses the
        # diagonal, so "diagonal tiles unmasked" is exactly "no causal mask" there.
        assert re.search(r"N=(\d+)", str(info.value)) and int(re.search(r"N=(\d+)", str(info.value)).group(1)) <= 128
    else:
        assert message in str(info.value), str(info.value)


def test_flash_reading_past_the_sequence_is_caught(tmp_path):
    # A row mask that lets 16 rows too many through: the tiles of q, k, v and
    # do then take in rows of their NaN padding, and the NaN reaches dk and dv.
    fn = planted(tmp_path, "rows_past_the_end",
                 ("tile = tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)",
                  "tile = tl.load(ptrs, mask=offs_rows[:, None] < n_rows + 16, other=0.0)"))
    with pytest.raises(GradingError, match="non-finite"):
        check_flash_backward(fn)


def test_flash_course_function_passes():
    # Its time is measured by benchmarks/grading_speed.py, not asserted here.
    assert check_flash_backward(bw.flash_attention_differentiable)


class PerQueryHeadPartials(torch.autograd.Function):
    """Correct, designed differently: dK, dV per query head (kv heads repeated), then summed.

    Also other block sizes, and contiguous copies of every input.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = flash_attention_with_lse(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        group = q.shape[1] // k.shape[1]
        k_rep, v_rep = (t.repeat_interleave(group, 1).contiguous() for t in (k, v))
        dq, dk_rep, dv_rep = bw.attention_backward(q, k_rep, v_rep, o, lse, do.contiguous(), causal=ctx.causal,
                                                   config=bw.BackwardConfig(32, 32, 64, 32))
        shape = (k.shape[0], k.shape[1], group) + tuple(k.shape[2:])
        return dq, dk_rep.view(shape).sum(2), dv_rep.view(shape).sum(2), None


def test_flash_correct_answer_written_differently_passes():
    assert check_flash_backward(lambda q, k, v, causal=False: PerQueryHeadPartials.apply(q, k, v, causal))


def test_a_gqa_answer_that_stores_each_head_s_part_in_bf16_passes():
    """A right GQA backward may store each query head's dK in bf16 and add the group's heads up after (the course's
    PerQueryHeadPartials above; flash-attn 2's GQA backward). Where large parts cancel (rows of scores near +-150),
    the two stores may move the sum by more than the plain tolerance allows: a GPU run rejected that answer once
    (dk 0.082 expected, 0 got, from parts -8.17 and 8.25). Here both answers carry the same error of their
    arithmetic, within the plain tolerance when the parts are added in float (the course's fused kernel); stored in
    bf16 first, one element passes only with the check's extra tolerance (the roundoff of the parts' magnitudes),
    and an answer off by twice the whole tolerance still fails."""
    from course_utils.grading import inputs
    from course_utils.grading.core import Run

    rng = np.random.default_rng(0)
    raw = [rng.standard_normal((1, h, 150, 64)) for h in (2, 1, 1, 2)]
    inputs.shift_scores(raw[0], raw[1])
    q, k, v, do = (torch.from_numpy(a).to(torch.bfloat16).double().numpy() for a in raw)
    right = ref.attention_backward(q, k, v, do)[1]
    _, parts, _ = ref.attention_backward(q, *ref.repeat_kv_heads(q, k, v), do)
    parts = parts + 0.025  # each head's part off by the same 0.025: its arithmetic's error
    fused = parts.reshape(1, 1, 2, 150, 64).sum(axis=2)
    stored = torch.from_numpy(parts).to(torch.bfloat16).double().numpy().reshape(1, 1, 2, 150, 64).sum(axis=2)
    atol, rtol = p4.TOLERANCE["bfloat16"]
    bf16_roundoff = torch.finfo(torch.bfloat16).eps / 2
    assert bf16_roundoff == 2.0**-8  # bf16's 8-bit significand
    extra = p4._group_sum_roundoff(q, k, v, do, False, bf16_roundoff)[1]

    def compare(got, extra_tol):
        Run("check_flash_backward", 0).compare(got, right, case="c", what="dk", atol=atol, rtol=rtol,
                                               extra_tol=extra_tol)

    compare(fused, 0.0)
    with pytest.raises(GradingError, match="dk is wrong in 1 of 9600 elements"):
        compare(stored, 0.0)  # without the extra tolerance
    compare(stored, extra)
    far = right + 2 * (atol + rtol * np.abs(right) + extra) * (np.arange(right.size) == 7).reshape(right.shape)
    with pytest.raises(GradingError, match="dk is wrong in 1 of 9600 elements"):
        compare(far, extra)
    assert p4._group_sum_roundoff(q, *ref.repeat_kv_heads(q, k, v), do, False, bf16_roundoff) == {}


def _math_attention(q, k, v, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


class TritonForwardTorchBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, _ = flash_attention_with_lse(q, k, v, causal=causal)
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            o = _math_attention(q.float(), k.float(), v.float(), ctx.causal)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do.float())
        return dq, dk, dv, None


def test_math_only_answers_are_rejected():
    with pytest.raises(GradingError, match="torch computed attention"):
        check_flash_backward(_math_attention)
    with pytest.raises(GradingError, match="torch computed attention .*in the backward pass"):
        check_flash_backward(lambda q, k, v, causal=False: TritonForwardTorchBackward.apply(q, k, v, causal))


def test_the_course_backward_is_refused():
    from course_utils.kernels import flash_attention

    with pytest.raises(GradingError, match="course_utils's own kernel `_?attn_bwd.*in the backward pass"):
        check_flash_backward(lambda q, k, v, causal=False: flash_attention(q, k, v, causal=causal))


def test_not_differentiable_output_is_explained():
    with pytest.raises(GradingError, match="no grad_fn"):
        check_flash_backward(lambda q, k, v, causal=False: flash_attention_with_lse(q, k, v, causal=causal)[0])


def test_flash_bad_fn_raises_type_error():
    with pytest.raises(GradingError, match="check_flash_backward expects a function"):
        check_flash_backward(42, isolate=False)
