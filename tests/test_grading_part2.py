"""check_kv_head, check_flash_forward, check_flash_gqa: planted mistakes get their diagnosis.

The planted kernels are the course's own kernels (course_utils/kernels/forward.py)
with exactly one mistake each: the test copies forward.py's source, replaces
one or two lines inside one function (each replaced text must occur exactly
once there, so a change to forward.py that would make a mutant meaningless
fails loudly), writes it to a temporary module and imports it. Correct kernels
written differently (other block sizes, tl.exp instead of exp2, another kv-head
formula, a single masked loop) must pass.
"""

import inspect
import time
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import pytest
import torch

from conftest import function_span, learner_copy, module_from_source
import triton
import triton.language as tl

from course_utils.grading import GradingError, check_flash_forward, check_flash_gqa, check_kv_head
from course_utils.grading import part2_triton as pt
from course_utils.kernels import flash_attention
from course_utils.kernels import forward as course_forward


forward = learner_copy(course_forward, "learner_forward")

A = "flash_attention_kernel"
B = "_flash_attention_forward_gqa_kernel"
INNER = "attn_fwd_inner"
LAUNCH_A = "flash_attention_forward"


# -- planting mistakes in a copy of forward.py ---------------------------------
_made: dict = {}


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("variants")
    source = inspect.getsource(course_forward)

    def make(name, *edits):
        """forward.py with each ``(function, old, new)`` edit applied, as a module."""
        if name in _made:
            return _made[name]
        src = source
        for func, old, new in edits:
            a, b = function_span(src, func)
            body = src[a:b]
            assert body.count(old) == 1, f"{name}: {old!r} occurs {body.count(old)} times in {func}"
            src = src[:a] + body.replace(old, new) + src[b:]
        _made[name] = module_from_source(folder / f"variant_{name}.py", src)
        return _made[name]

    return make


def mha(module, **blocks):
    return lambda q, k, v, causal=False: module.flash_attention_forward(q, k, v, causal=causal, **blocks)


def gqa(module, **blocks):
    return lambda q, k, v: module.flash_attention_gqa_forward(q, k, v, causal=True, **blocks)


def _fails(check, fn, message, **kwargs):
    """``check(fn)`` fails, naming ``message`` as the likely cause."""
    with pytest.raises(GradingError) as info:
        check(fn, **kwargs)
    text = str(info.value)
    # the message's fixed part: before any block size is filled in, first letter aside (capitalised mid-sentence)
    fixed = message.split("{")[0].split(" (BLOCK")[0][1:70]
    assert "Likely cause: " in text and fixed in text.split("Likely cause: ", 1)[1], text
    return text


# -- check_kv_head --------------------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda h, nq, nkv: h // (nq // nkv),
    lambda h, nq, nkv: h * nkv // nq,
    lambda h, nq, nkv: int(h // (nq / nkv)),
    lambda h, nq, nkv: torch.tensor(h // (nq // nkv)).numpy()[()],  # a NumPy integer
], ids=["group", "scaled", "float-group", "numpy-int"])
def test_kv_head_correct_variants_pass(fn):
    assert check_kv_head(fn)


@pytest.mark.parametrize("fn, message", [
    (lambda h, nq, nkv: h % nkv, pt.MSG_KV_INTERLEAVED),
    (lambda h, nq, nkv: h // nkv, pt.MSG_KV_DIV_NKV),
    (lambda h, nq, nkv: min(nkv - 1, (h + 1) // (nq // nkv)), pt.MSG_KV_OTHER),
], ids=["interleaved", "div-nkv", "other"])
def test_kv_head_mistakes_are_diagnosed(fn, message):
    _fails(check_kv_head, fn, message)


def test_kv_head_float_and_non_int_get_a_sentence():
    with pytest.raises(GradingError, match="use integer division"):
        check_kv_head(lambda h, nq, nkv: h / (nq // nkv))
    with pytest.raises(GradingError, match="return a Python int"):
        check_kv_head(lambda h, nq, nkv: str(h))


def test_kv_head_learner_exception_keeps_its_type():
    with pytest.raises(ZeroDivisionError) as info:
        check_kv_head(lambda h, nq, nkv: h // (nkv // nq))  # group size upside down
    assert any("check_kv_head" in note for note in info.value.__notes__)


# -- check_flash_forward: correct kernels ------------------------------------------
def test_flash_forward_course_kernel_passes():
    # Its time is measured by benchmarks/grading_speed.py, not asserted here.
    assert check_flash_forward(forward.flash_attention_forward)


@pytest.mark.parametrize("make", [
    lambda variant: mha(forward, block_m=32, block_n=32),
    lambda variant: lambda q, k, v, causal=False: forward.flash_attention_gqa_forward(q, k, v, causal=causal)[0],  # the GQA kernel
    lambda variant: mha(variant("a_no_min", (A, "tl.minimum(N_size, (pid_m + 1) * BLOCK_M)", "(pid_m + 1) * BLOCK_M"))),
    lambda variant: mha(variant("a_no_bound", (A, "kv_end = tl.minimum(N_size, (pid_m + 1) * BLOCK_M)", "kv_end = N_size"))),
], ids=["blocks-32x32", "gqa-kernel", "bound-without-min", "no-bound-only-mask"])
def test_flash_forward_correct_variants_pass(variant, make):
    assert check_flash_forward(make(variant))


# -- check_flash_forward: planted mistakes ---------------------------------------
FORWARD_MISTAKES = {
    "causal_ignored": ([(A, "keep = keep & (offs_m[:, None] >= offs_n[None, :])", "keep = keep"),
                        (A, "kv_end = tl.minimum(N_size, (pid_m + 1) * BLOCK_M)", "kv_end = N_size")], pt.MSG_NO_CAUSAL_TRITON),
    "bound_but_no_mask": ([(A, "keep = keep & (offs_m[:, None] >= offs_n[None, :])", "keep = keep")],
                          pt.MSG_DIAG_UNMASKED),
    "mask_strict": ([(A, "offs_m[:, None] >= offs_n[None, :]", "offs_m[:, None] > offs_n[None, :]")], pt.MSG_CAUSAL_STRICT),
    "mask_shifted": ([(A, "offs_m[:, None] >= offs_n[None, :]", "offs_m[:, None] + 1 >= offs_n[None, :]")],
                     pt.MSG_CAUSAL_SHIFTED),
    "bound_skips_diagonal": ([(A, "tl.minimum(N_size, (pid_m + 1) * BLOCK_M)", "tl.minimum(N_size, pid_m * BLOCK_M)")],
                             pt.MSG_DIAG_SKIPPED),
    "acc_not_rescaled": ([(A, "acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot")], pt.MSG_ACC_NOT_RESCALED_TRITON),
    "nothing_rescaled": ([(A, "acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),
                          (A, "l_i = l_i * alpha +", "l_i = l_i +")], pt.MSG_NOT_RESCALED),
    "no_sm_scale": ([(LAUNCH_A, "1.0 / math.sqrt(D),", "1.0,")], pt.MSG_NO_SCALE_TRITON),
    "scaled_twice": ([(A, "s = tl.dot(q, k) * sm_scale", "s = tl.dot(q, k) * sm_scale * sm_scale")], pt.MSG_SCALE_TWICE),
    "exp2_without_log2e": ([(A, "alpha = tl.exp(m_i", "alpha = tl.exp2(m_i"), (A, "p = tl.exp(s", "p = tl.exp2(s")],
                           pt.MSG_EXP2_NO_LOG2E),
    "tail_keys_unmasked": ([(A, "keep = n_ok[None, :]", "keep = offs_n[None, :] >= 0")], pt.MSG_TAIL_UNMASKED),
    "m_i_starts_at_0": ([(A, 'm_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)',
                          "m_i = tl.zeros((BLOCK_M,), dtype=tl.float32)")], pt.MSG_M_INIT_ZERO_TRITON),
    "no_running_max": ([(A, "p = tl.exp(s - m_new[:, None])", "p = tl.exp(s)"),
                        (A, "alpha = tl.exp(m_i - m_new)", "alpha = tl.exp(m_new * 0.0)")], pt.MSG_NO_RUNNING_MAX),
    "l_not_rescaled": ([(A, "l_i = l_i * alpha +", "l_i = l_i +")], pt.MSG_L_NOT_RESCALED_TRITON),
    "exp_with_log2e": ([(A, "s = tl.dot(q, k) * sm_scale", "s = tl.dot(q, k) * sm_scale * 1.4426950408889634")],
                       pt.MSG_EXP_WITH_LOG2E),
    "bound_floored": ([(A, "kv_end = tl.minimum(N_size, (pid_m + 1) * BLOCK_M)",
                        "kv_end = tl.minimum(N_size, (pid_m + 1) * BLOCK_M) // BLOCK_N * BLOCK_N")],
                      pt.MSG_BOUND_FLOORED),
    "batch_stride_ignored": ([(A, "Q_ptr + pid_z * stride_qz + ", "Q_ptr + "), (A, "K_ptr + pid_z * stride_kz + ", "K_ptr + "),
                              (A, "V_ptr + pid_z * stride_vz + ", "V_ptr + "), (A, "O_ptr + pid_z * stride_oz + ", "O_ptr + ")],
                             pt.MSG_BATCH_STRIDE),
    "v_load_unmasked": ([(A, "mask=n_ok[:, None] & d_ok[None, :], other=0.0,", "")], pt.MSG_OOB),
    "o_with_q_strides": ([(A, "pid_z * stride_oz + pid_h * stride_oh", "pid_z * stride_qz + pid_h * stride_qh"),
                          (A, "offs_m[:, None] * stride_om + offs_d[None, :] * stride_ok",
                           "offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk")], pt.MSG_O_STRIDES),
    "head_dim_stride_ignored": ([(A, "offs_d[None, :] * stride_qk,", "offs_d[None, :],"),
                                 (A, "offs_d[:, None] * stride_kk,", "offs_d[:, None],"),
                                 (A, "offs_d[None, :] * stride_vk,", "offs_d[None, :],")], pt.MSG_D_STRIDE),
}


@pytest.mark.parametrize("name", list(FORWARD_MISTAKES))
def test_flash_forward_mistakes_are_diagnosed(variant, name):
    edits, message = FORWARD_MISTAKES[name]
    _fails(check_flash_forward, mha(variant("a_" + name, *edits)), message)


def test_block_size_is_named_in_the_diagnosis(variant):
    edits, message = FORWARD_MISTAKES["acc_not_rescaled"]
    module = variant("a_acc_not_rescaled", *edits)
    assert "BLOCK_N = 32 fits" in _fails(check_flash_forward, mha(module, block_m=64, block_n=32), message)
    assert "BLOCK_N = 16 fits" in _fails(check_flash_forward, mha(module, block_m=32, block_n=16), message)
    edits, message = FORWARD_MISTAKES["bound_skips_diagonal"]
    module = variant("a_bound_skips_diagonal", *edits)
    assert "BLOCK_M = 32 fits" in _fails(check_flash_forward, mha(module, block_m=32, block_n=16), message)


def test_a_failure_replays_with_its_seed(variant):
    edits, message = FORWARD_MISTAKES["tail_keys_unmasked"]
    fn = mha(variant("a_tail_keys_unmasked", *edits))
    first = _fails(check_flash_forward, fn, message)
    seed = int(first.split("seed=")[1].split(")")[0])
    assert _fails(check_flash_forward, fn, message, seed=seed) == first


def test_sdpa_is_not_a_triton_kernel():
    def sdpa(q, k, v, causal=False):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    with pytest.raises(GradingError, match="torch computed attention"):
        check_flash_forward(sdpa)


@triton.jit
def _segfault_kernel(q_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(q_ptr + (1 << 40) + offs)  # mistake: 4 TiB past any allocation
    tl.store(o_ptr + offs, x, mask=offs < n)


def test_faulting_kernel_is_reported_and_pytest_survives():
    # CPU: the interpreter segfaults the forked grading process. GPU: the load faults CUDA
    # in the grading worker process; either way this process carries on.
    def crashing(q, k, v, causal=False):
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _segfault_kernel[(triton.cdiv(o.numel(), 64),)](q, o, o.numel(), BLOCK=64)
        return o

    start = time.perf_counter()
    with pytest.raises(GradingError, match="made the GPU fault" if course_utils.ENV.device == "cuda"
                       else "crashed the grading process"):
        check_flash_forward(crashing)
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("fn, text", [
    (lambda q, k, v, causal=False: forward.flash_attention_forward(q, k, v, causal=causal).half()
     if q.dtype == torch.float32 else forward.flash_attention_forward(q, k, v, causal=causal).float(), "dtype"),
    (lambda q, k, v, causal=False: forward.flash_attention_forward(q, k, v, causal=causal)[:, :, :-1], "shape"),
    (lambda q, k, v, causal=False: forward.flash_attention_forward(q, k, v, causal=causal).cpu().numpy(), "torch tensor"),
], ids=["dtype", "shape", "numpy"])
def test_flash_forward_wrong_result_type_gets_a_sentence(fn, text):
    with pytest.raises(GradingError, match=text):
        check_flash_forward(fn)


# -- check_flash_gqa: correct kernels ---------------------------------------------
def test_flash_gqa_course_kernel_passes():
    assert check_flash_gqa(gqa(forward))


@pytest.mark.parametrize("make", [
    lambda variant: gqa(variant(
        "b_natural_exp",
        (INNER, "alpha = tl.exp2(m_i - m_new)", "alpha = tl.exp(m_i - m_new)"),
        (INNER, "p = tl.exp2(s - m_new[:, None])", "p = tl.exp(s - m_new[:, None])"),
        (B, "qk_scale = sm_scale * 1.4426950408889634", "qk_scale = sm_scale"),
        (B, "lse = (m_i + tl.log2(l_i)) * 0.6931471805599453", "lse = m_i + tl.log(l_i)"),
    ), block_m=128, block_n=64),
    lambda variant: gqa(variant("b_scaled_kv_head", (B, "kv_head = q_head // group_size",
                                                      "kv_head = q_head * N_KV_HEADS // N_Q_HEADS")),
                        block_m=32, block_n=16),
    lambda variant: gqa(variant("b_one_masked_loop", (B, "mask_lo = start_m * BLOCK_M ", "mask_lo = 0 "))),
], ids=["exp-blocks-128x64", "scaled-kv-head-blocks-32x16", "one-masked-loop"])
def test_flash_gqa_correct_variants_pass(variant, make):
    assert check_flash_gqa(make(variant))


# -- check_flash_gqa: planted mistakes ---------------------------------------------
GQA_MISTAKES = {
    "kv_interleaved": ([(B, "kv_head = q_head // group_size", "kv_head = q_head % N_KV_HEADS")], pt.MSG_KV_INTERLEAVED),
    "kv_div_n_kv_heads": ([(B, "kv_head = q_head // group_size", "kv_head = q_head // N_KV_HEADS")], pt.MSG_KV_DIV_NKV),
    "causal_ignored": ([("flash_attention_gqa_forward", "IS_CAUSAL=bool(causal)", "IS_CAUSAL=False")], pt.MSG_NO_CAUSAL_TRITON),
    "no_mask_in_phase_2": ([(INNER, "keep = keep & (offs_m[:, None] >= offs_n[None, :])", "keep = keep")],
                           pt.MSG_DIAG_UNMASKED),
    "mask_strict": ([(INNER, "offs_m[:, None] >= offs_n[None, :]", "offs_m[:, None] > offs_n[None, :]")],
                    pt.MSG_CAUSAL_STRICT),
    "diagonal_unmasked": ([(B, "mask_lo = start_m * BLOCK_M ", "mask_lo = (start_m + 1) * BLOCK_M ")],
                          pt.MSG_DIAG_UNMASKED),
    "diagonal_twice": ([(B, "0, mask_lo, SEQ_LEN, qk_scale,", "0, mask_lo + BLOCK_M, SEQ_LEN, qk_scale,")],
                       pt.MSG_DIAG_TWICE),
    "diagonal_skipped": ([(B, "mask_hi = tl.minimum((start_m + 1) * BLOCK_M, SEQ_LEN)", "mask_hi = start_m * BLOCK_M")],
                         pt.MSG_DIAG_SKIPPED),
    "masked_phase_from_zero": ([(B, "mask_lo, mask_hi, SEQ_LEN, qk_scale,", "0, mask_hi, SEQ_LEN, qk_scale,")],
                               pt.MSG_OVERLAP),
    "acc_not_rescaled": ([(INNER, "acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot")], pt.MSG_ACC_NOT_RESCALED_TRITON),
    "no_sm_scale": ([(B, "qk_scale = sm_scale * 1.4426950408889634", "qk_scale = 1.4426950408889634")], pt.MSG_NO_SCALE_TRITON),
    "exp2_without_log2e": ([(B, "qk_scale = sm_scale * 1.4426950408889634", "qk_scale = sm_scale")],
                           pt.MSG_EXP2_NO_LOG2E),
    "lse_base2": ([(B, "lse = (m_i + tl.log2(l_i)) * 0.6931471805599453", "lse = m_i + tl.log2(l_i)")],
                  pt.MSG_LSE_BASE2_TRITON),
    "lse_mixed_bases": ([(B, "lse = (m_i + tl.log2(l_i)) * 0.6931471805599453", "lse = m_i + tl.log(l_i)")],
                        pt.MSG_LSE_MIXED_TRITON),
    "lse_without_max": ([(B, "lse = (m_i + tl.log2(l_i)) * 0.6931471805599453", "lse = tl.log(l_i)")],
                        pt.MSG_LSE_NO_MAX_TRITON),
    "kv_head_out_of_range": ([(B, "kv_head = q_head // group_size", "kv_head = q_head")], pt.MSG_KV_OUT_OF_RANGE),
    "v_load_unmasked": ([(INNER, "mask=n_ok[:, None] & d_ok[None, :], other=0.0,", "")], pt.MSG_OOB),
    "o_with_q_strides": ([(B, "batch * stride_ob + q_head * stride_oh", "batch * stride_qb + q_head * stride_qh"),
                          (B, "offs_m[:, None] * stride_on + offs_d[None, :] * stride_od",
                           "offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd")], pt.MSG_O_STRIDES),
    # The same, with batch 0's programs storing last, as a GPU may order them (the interpreter runs
    # the grid in order): then o looks like "batch index ignored" too, and both are named.
    "o_with_q_strides_batch0_last": (
        [(B, "batch = batch_head // N_Q_HEADS", "batch = (tl.num_programs(1) - 1 - batch_head) // N_Q_HEADS"),
         (B, "batch * stride_ob + q_head * stride_oh", "batch * stride_qb + q_head * stride_qh"),
         (B, "offs_m[:, None] * stride_on + offs_d[None, :] * stride_od",
          "offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd")], pt.MSG_O_STRIDES),
}


@pytest.mark.parametrize("name", list(GQA_MISTAKES))
def test_flash_gqa_mistakes_are_diagnosed(variant, name):
    edits, message = GQA_MISTAKES[name]
    _fails(check_flash_gqa, gqa(variant("b_" + name, *edits)), message)


def test_wrong_kv_mapping_names_each_head(variant):
    edits, message = GQA_MISTAKES["kv_interleaved"]
    text = _fails(check_flash_gqa, gqa(variant("b_kv_interleaved", *edits)), message)
    assert "0->0, 1->1, 2->2, 3->3, 4->0, 5->1, 6->2, 7->3" in text  # what was read
    assert "expected 0->0, 1->0, 2->1, 3->1, 4->2, 5->2, 6->3, 7->3" in text


def test_sdpa_with_gqa_is_not_a_triton_kernel():
    def sdpa(q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o, torch.zeros(q.shape[:3])

    with pytest.raises(GradingError, match="torch computed attention"):
        check_flash_gqa(sdpa)


@pytest.mark.parametrize("fn, text", [
    (lambda q, k, v: forward.flash_attention_gqa_forward(q, k, v, causal=True)[0], "return the pair"),
    (lambda q, k, v: (lambda o, lse: (o, lse.half()))(*forward.flash_attention_gqa_forward(q, k, v, causal=True)),
     "lse is float32"),
    (lambda q, k, v: (lambda o, lse: (o, lse[..., None]))(*forward.flash_attention_gqa_forward(q, k, v, causal=True)),
     "lse has shape"),
], ids=["no-lse", "lse-half", "lse-shape"])
def test_flash_gqa_wrong_result_type_gets_a_sentence(fn, text):
    with pytest.raises(GradingError, match=text):
        check_flash_gqa(fn)


# -- proof of work: the answer must come from the learner's own kernel, this call ------
@triton.jit
def _noop(o_ptr):
    pass


def _sdpa_after_a_noop_kernel(q, k, v, causal=False):
    o = torch.empty_like(q)
    _noop[(1,)](o)
    return o.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))


def _manual_torch_attention(q, k, v, causal=False):
    o = torch.empty_like(q)
    _noop[(1,)](o)
    p = ((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).float().exp()
    return (p @ v.float() / p.sum(-1, keepdim=True)).to(q.dtype)


_memo = {}


def _memoised(q, k, v, causal=False):
    key = (tuple(q.shape), causal)
    if key not in _memo:
        _memo[key] = forward.flash_attention_forward(q, k, v, causal=causal)
    return _memo[key]


def _scales_k_in_place(q, k, v, causal=False):
    o = forward.flash_attention_forward(q, k, v, causal=causal)
    k.mul_(0.5)  # e.g. pre-scaling k by sm_scale before launching
    return o


@pytest.mark.parametrize("fn, text", [
    (_sdpa_after_a_noop_kernel, "torch computed attention"),
    (_manual_torch_attention, "torch computed a matrix product"),
    (lambda q, k, v, causal=False: flash_attention(q, k, v, causal=causal), "course_utils's own kernel"),
    (_memoised, "no Triton kernel ran|not written by any kernel during this call"),
    (_scales_k_in_place, "changed its input `k` in place"),
    (lambda q, k, v, causal=False: None, "did you forget a `return`"),
], ids=["noop-then-sdpa", "noop-then-torch-math", "course-kernel", "memoised-by-shape", "k-in-place", "no-return"])
def test_flash_forward_refuses_borrowed_answers(fn, text):
    with pytest.raises(GradingError, match=text):
        check_flash_forward(fn)


def test_flash_gqa_refuses_the_course_kernel_and_a_kernel_passed_for_a_launcher():
    from course_utils.kernels import flash_attention_with_lse

    with pytest.raises(GradingError, match="course_utils's own kernel"):
        check_flash_gqa(lambda q, k, v: flash_attention_with_lse(q, k, v, causal=True))
    with pytest.raises(GradingError, match="pass your launcher"):
        check_flash_gqa(forward._flash_attention_forward_gqa_kernel)


def _gqa_sdpa_after_a_noop_kernel(q, k, v):
    o = torch.empty_like(q)
    _noop[(1,)](o)
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = (q.float() @ kk.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    o.copy_(torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True))
    return o, torch.logsumexp(s, -1) * 1.4426950408889634


def _gqa_scales_k_in_place(q, k, v):
    out = forward.flash_attention_gqa_forward(q, k, v, True)
    k.mul_(0.5)  # e.g. k pre-scaled by sm_scale, and left that way
    return out


@pytest.mark.parametrize("fn, text", [
    (_gqa_sdpa_after_a_noop_kernel, "torch computed"),
    (_gqa_scales_k_in_place, "changed its input `k` in place"),
], ids=["noop-then-sdpa", "k-in-place"])
def test_flash_gqa_refuses_torch_behind_a_dummy_kernel_and_an_input_edited_in_place(fn, text):
    with pytest.raises(GradingError, match=text):
        check_flash_gqa(fn)


def test_fixed_cases_have_large_shifted_scores_d128_several_tiles_and_a_repeated_shape():
    for gqa in (False, True):
        cases = pt._fixed_cases(gqa, "cpu")
        shifted = [c for c in cases if c.shifted]
        assert shifted and all(c.D == 128 and c.N > 2 * 128 for c in shifted)
        repeat = [c for c in cases if c.same_shape_as is not None]
        assert repeat and all((c.B, c.Hq, c.N, c.D) == (cases[c.same_shape_as].B, cases[c.same_shape_as].Hq,
                                                         cases[c.same_shape_as].N, cases[c.same_shape_as].D)
                              for c in repeat)
        rng = __import__("numpy").random.default_rng(0)
        q, k, v, q64, k64, v64 = pt._make_inputs(rng, shifted[0], "cpu")
        row_max = pt._scores(q64, ref_repeat(q64, k64), 1 / 128 ** 0.5).max(-1)
        assert row_max.min() < -120 and row_max.max() > 120


def ref_repeat(q64, k64):
    from course_utils import references
    return references.repeat_kv_heads(q64, k64, k64)[0]


# -- check_flash_forward: a tile that grows with N is a softmax, not FlashAttention ---------------
@triton.jit
def _one_tile_kernel(Q, K, V, O, sqz, sqh, sqm, sqk, skz, skh, skn, skk, svz, svh, svn, svk, soz, soh, som, sok,
                     N, sm_scale, D: tl.constexpr, D_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Right answers, no online softmax: every key of the head in one [BLOCK_M, BLOCK_N >= N] tile.
    pid_m, pid_h, pid_z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q = tl.load(Q + pid_z * sqz + pid_h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqk,
                mask=(offs_m[:, None] < N) & d_ok[None, :], other=0.0)
    k = tl.load(K + pid_z * skz + pid_h * skh + offs_n[None, :] * skn + offs_d[:, None] * skk,
                mask=(offs_n[None, :] < N) & d_ok[:, None], other=0.0)
    v = tl.load(V + pid_z * svz + pid_h * svh + offs_n[:, None] * svn + offs_d[None, :] * svk,
                mask=(offs_n[:, None] < N) & d_ok[None, :], other=0.0)
    keep = offs_n[None, :] < N
    if IS_CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    s = tl.where(keep, tl.dot(q, k) * sm_scale, float("-inf"))
    p = tl.exp(s - tl.max(s, axis=1)[:, None])
    o = tl.dot(p.to(v.dtype), v) / tl.sum(p, axis=1)[:, None]
    tl.store(O + pid_z * soz + pid_h * soh + offs_m[:, None] * som + offs_d[None, :] * sok, o.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < N) & d_ok[None, :])


def one_tile_attention(q, k, v, causal=False):
    B, H, N, D = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m, block_n = 32, max(16, triton.next_power_of_2(N))  # the tile grows with N
    _one_tile_kernel[(triton.cdiv(N, block_m), H, B)](
        q, k, v, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(), N, 1.0 / D ** 0.5,
        D=D, D_PAD=triton.next_power_of_2(D), IS_CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n)
    return o


def test_a_single_tile_of_every_key_is_refused_with_why_it_does_not_scale():
    # It computes the right o on every case (a plain softmax in one tile): only its launch gives it away.
    with pytest.raises(GradingError) as info:
        check_flash_forward(one_tile_attention)
    text = str(info.value)
    assert "failed on case fixed 8: B=1, H=1, N=300" in text  # the first case past every fixed block size
    assert pt.MSG_TILE_GROWS.split("{")[0] in text and "BLOCK_N (of _one_tile_kernel)" in text
    assert "512 at N = 300" in text and "online softmax" in text and "O(BLOCK_M x BLOCK_N)" in text
    assert "is wrong" not in text  # not a wrong output: the structure is what fails


def test_a_query_tile_that_grows_with_n_is_refused_too():
    fn = lambda q, k, v, causal=False: forward.flash_attention_forward(  # noqa: E731
        q, k, v, causal=causal, block_m=max(16, triton.next_power_of_2(q.shape[2])), block_n=32)
    with pytest.raises(GradingError, match="tile grows with the sequence: its constexpr BLOCK_M"):
        check_flash_forward(fn)


def test_a_gqa_query_tile_that_grows_with_n_is_refused():
    # Lesson 05's kernel with one query tile covering every row of a head: right answers, no tiling of the rows.
    fn = lambda q, k, v: forward.flash_attention_gqa_forward(  # noqa: E731
        q, k, v, True, block_m=max(16, triton.next_power_of_2(q.shape[2])), block_n=16)
    with pytest.raises(GradingError, match="tile grows with the sequence: its constexpr BLOCK_M") as info:
        check_flash_gqa(fn)
    assert "N=300" in str(info.value) and "is wrong" not in str(info.value)


def test_a_gqa_key_tile_that_covers_every_key_is_refused():
    # Lesson 05's kernel with one key tile over the whole sequence: no online softmax across key blocks (its
    # causal loop needs BLOCK_M a multiple of BLOCK_N, so the query tile covers every row too).
    tile = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731
    fn = lambda q, k, v: forward.flash_attention_gqa_forward(  # noqa: E731
        q, k, v, True, block_m=tile(q.shape[2]), block_n=tile(k.shape[2]))
    with pytest.raises(GradingError, match="tile grows with the sequence: its constexpr BLOCK_[MN]") as info:
        check_flash_gqa(fn)
    assert "N=300" in str(info.value) and "is wrong" not in str(info.value)


# 64, not 128: kernel A's 64 x 128 tiles at D = 128 in float32 need 288 KiB of shared memory (measured on
# the H200, whose limit is 227 KiB), and the random cases draw D = 128 float32 at times.
@pytest.mark.parametrize("block_n", [
    lambda n: 64,  # larger than N on the small cases: fixed, so fine
    lambda n: min(64, max(16, triton.next_power_of_2(n))),  # grows with N, up to a fixed cap
], ids=["fixed-64", "capped-at-64"])
def test_block_sizes_larger_than_small_n_pass(block_n):
    assert check_flash_forward(lambda q, k, v, causal=False: forward.flash_attention_forward(
        q, k, v, causal=causal, block_m=64, block_n=block_n(q.shape[2])))


def test_growing_tile_rule():
    grow = pt._growing_tile
    key = ("kernel", "BLOCK_N")
    assert grow({key: [(64, 64), (160, 256), (300, 512)]})  # grows, covers every key
    assert not grow({key: [(64, 64), (160, 256)]})  # no N past the largest fixed block yet: could be capped
    assert not grow({key: [(64, 64), (160, 128), (300, 128)]})  # capped: loops over key blocks at N = 300
    assert not grow({key: [(64, 512), (160, 512), (300, 512)]})  # fixed (large, but fixed)
    assert not grow({("kernel", "D_PAD"): [(64, 32), (300, 128)]})  # the head dim, not N
    assert "64 at N = 48, 256 at N = 160, 512 at N = 300" in grow({key: [(48, 64), (64, 64), (100, 128), (160, 256),
                                                                           (300, 512)]})
