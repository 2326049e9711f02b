"""Lesson 08's checks: planted mistakes get their diagnosis, correct variants pass.

The tile bounds: learner-style Python functions, each with one mistake.
The kernels: each planted mistake is made by editing the text of the course's
own kernels (course_utils/kernels/forward.py or backward.py) in one place and
loading the edited copy as a module, so every planted kernel is the real
kernel with exactly one realistic bug.
"""

import inspect
import types

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import pytest
import torch
import torch._dynamo  # noqa: F401  (proof.Work's first dispatch mode imports it: ~2 s in every forked check otherwise)
import triton
import triton.language as tl

from course_utils.grading import (GradingError, check_window_backward, check_window_forward,
                                  check_window_tile_bounds)
from course_utils.grading import part5_window as p5
from course_utils.kernels import backward as bw
from course_utils.kernels import forward
from conftest import copied_by_a_kernel, function_span, module_from_source


def _fails(check, fn, message, **kwargs):
    """``check(fn)`` fails, naming ``message`` as the likely cause."""
    with pytest.raises(GradingError) as info:
        check(fn, **kwargs)
    text = str(info.value)
    assert "Likely cause: " in text and message[1:70] in text.split("Likely cause: ", 1)[1], text
    return text


# -----------------------------------------------------------------------------
# check_window_tile_bounds
# -----------------------------------------------------------------------------
def bounds_loop(start_m, block_m, block_n, seq_len, window_size, sink_size):
    # Correct and written differently: test each tile against the block's rows.
    q_first, q_last = start_m * block_m, min((start_m + 1) * block_m, seq_len) - 1
    band = [t for t in range(0, seq_len, block_n) if t <= q_last and t + block_n - 1 >= q_first - window_size + 1]
    sinks = [t for t in range(0, seq_len, block_n) if t < sink_size and t < band[0]]
    return (sinks[-1] + block_n if sinks else 0), band[0], q_last + 1


def bounds_math(start_m, block_m, block_n, seq_len, window_size, sink_size):
    import math
    q_first = start_m * block_m
    band_start = block_n * (max(0, q_first - window_size + 1) // block_n)
    return min(block_n * math.ceil(sink_size / block_n), band_start), band_start, min(q_first + block_m, seq_len)


# The course's own code typed into the notebook (a new function with the same code): passes, while calling
# course_utils.kernels.forward.window_tile_bounds itself is refused (below).
bounds_as_the_course_writes_it = types.FunctionType(forward.window_tile_bounds.__code__, forward.window_tile_bounds.__globals__,
                                                    "bounds_as_the_course_writes_it")


@pytest.mark.parametrize("fn", [bounds_loop, bounds_math, bounds_as_the_course_writes_it])
def test_bounds_correct_variants_pass(fn):
    assert check_window_tile_bounds(fn)


def _planted_bounds(mistake):
    def fn(start_m, block_m, block_n, seq_len, window_size, sink_size):
        q_first = start_m * block_m
        band_end = min(q_first + block_m, seq_len)
        band_start = max(0, q_first - window_size + 1) // block_n * block_n
        if mistake == "unaligned":
            band_start = max(0, q_first - window_size + 1)
        if mistake == "off_by_one":
            band_start = max(0, q_first - window_size) // block_n * block_n
        if mistake == "band_end":
            band_end = q_first + block_m
        sink_end = (sink_size + block_n - 1) // block_n * block_n
        if mistake == "rounded_down":
            sink_end = sink_size // block_n * block_n
        if mistake == "no_sinks":
            sink_end = 0
        if mistake != "twice":
            sink_end = min(sink_end, band_start)
        return sink_end, band_start, band_end
    return fn


@pytest.mark.parametrize("mistake,message", [
    ("unaligned", p5.MSG_NOT_ALIGNED),
    ("off_by_one", p5.MSG_BOUNDS_OFF_BY_ONE),
    ("band_end", p5.MSG_BAND_END),
    ("rounded_down", p5.MSG_SINK_ROUNDED_DOWN),
    ("no_sinks", p5.MSG_SINKS_SKIPPED),
    ("twice", p5.MSG_SINKS_TWICE),
])
def test_bounds_mistakes_are_diagnosed(mistake, message):
    _fails(check_window_tile_bounds, _planted_bounds(mistake), message)


def test_bounds_wrong_type_gets_a_sentence():
    with pytest.raises(GradingError, match=r"returned 2 values for start_m=0; return three: \(sink_end, band_start"):
        check_window_tile_bounds(lambda *a: (0, 0))
    with pytest.raises(GradingError, match=r"for start_m=0; return three Python ints \(sink_end, band_start, band_end\)"):
        check_window_tile_bounds(lambda *a: (0.0, 0.5, 1.0))


# -----------------------------------------------------------------------------
# Planting mistakes in copies of forward.py and backward.py
# -----------------------------------------------------------------------------
_made = {}


def planted(tmp_path_factory, module, name, *edits):
    """``module``'s source with each ``(function, old, new)`` edit applied (every occurrence), loaded."""
    if name in _made:
        return _made[name]
    src = inspect.getsource(module)
    for func, old, new in edits:
        a, b = function_span(src, func)
        body = src[a:b]
        assert old in body, f"{name}: {old!r} is not in {func}"
        src = src[:a] + body.replace(old, new) + src[b:]
    _made[name] = module_from_source(tmp_path_factory.mktemp("planted") / f"planted_{name}.py", src)
    return _made[name]


def fwd(module, **blocks):
    return lambda q, k, v, *, window_size, sink_size: module.flash_attention_window_forward(
        q, k, v, window_size=window_size, sink_size=sink_size, **blocks)


FORWARD_MISTAKES = {
    "window_off_by_one": (p5.MSG_WINDOW_OFF_BY_ONE, [("_window_keep", "i - j < WINDOW_SIZE", "i - j <= WINDOW_SIZE")]),
    "sinks_in_the_future": (p5.MSG_SINKS_FUTURE, [(
        "_window_keep", "keep = keep & ((i - j < WINDOW_SIZE) | (j < SINK_SIZE))",
        "keep = (keep & (i - j < WINDOW_SIZE)) | (j < SINK_SIZE)")]),
    "sink_tiles_skipped": (p5.MSG_SINKS_SKIPPED, [(
        "_window_bounds", "sink_end = tl.minimum((SINK_SIZE + BLOCK_N - 1) // BLOCK_N * BLOCK_N, band_start)",
        "sink_end = band_start * 0")]),
    "partial_sink_tile_skipped": (p5.MSG_SINK_ROUNDED_DOWN, [(
        "_window_bounds", "(SINK_SIZE + BLOCK_N - 1) // BLOCK_N", "SINK_SIZE // BLOCK_N")]),
    "sink_tiles_twice": (p5.MSG_SINKS_TWICE, [(
        "_window_bounds", "sink_end = tl.minimum((SINK_SIZE + BLOCK_N - 1) // BLOCK_N * BLOCK_N, band_start)",
        "sink_end = (SINK_SIZE + BLOCK_N - 1) // BLOCK_N * BLOCK_N + band_start * 0")]),
    "lower_bound_not_aligned": (p5.MSG_NOT_ALIGNED, [(
        "_window_bounds", "tl.maximum(q_first - WINDOW_SIZE + 1, 0) // BLOCK_N * BLOCK_N",
        "tl.maximum(q_first - WINDOW_SIZE + 1, 0)")]),
    "nan_on_empty_first_tile": (p5.MSG_NAN_EMPTY_TILE, [(
        "_attn_fwd_inner_window", 'm_shift = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_shift = m_new")]),
}


@pytest.mark.parametrize("name", list(FORWARD_MISTAKES))
def test_forward_mistakes_are_diagnosed(tmp_path_factory, name):
    message, edits = FORWARD_MISTAKES[name]
    if name == "partial_sink_tile_skipped" and course_utils.ENV.device == "cuda":
        # The GPU's key tiles hold 64 keys, more than any fixed case's sinks: a partial sink
        # tile rounded down to nothing is the whole sink tile skipped, and that is what is said.
        message = p5.MSG_SINKS_SKIPPED
    module = planted(tmp_path_factory, forward, name, *edits)
    _fails(check_window_forward, fwd(module), message)


def test_forward_nan_diagnosis_with_other_blocks(tmp_path_factory):
    message, edits = FORWARD_MISTAKES["nan_on_empty_first_tile"]
    module = planted(tmp_path_factory, forward, "nan_on_empty_first_tile", *edits)
    _fails(check_window_forward, fwd(module, block_m=32, block_n=32), message)


def test_forward_course_kernel_passes_with_other_blocks(tmp_path_factory):
    # The course's kernel typed into the notebook (an unedited copy of forward.py, loaded as the
    # learner's own module): passes. The course's module itself is refused (below).
    module = planted(tmp_path_factory, forward, "forward_unchanged")
    assert check_window_forward(fwd(module, block_m=32, block_n=32))


def test_forward_sdpa_is_not_a_triton_kernel():
    def sdpa(q, k, v, *, window_size, sink_size):
        n = q.shape[2]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        mask = (j <= i) & ((i - j < window_size) | (j < sink_size))
        kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        s = (q.double() @ kk.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
        s = s.masked_fill(~mask, float("-inf"))
        return (torch.softmax(s, -1) @ vv.double()).to(q.dtype), torch.logsumexp(s, -1).float()

    with pytest.raises(GradingError, match="no Triton kernel ran"):
        check_window_forward(sdpa)


# -----------------------------------------------------------------------------
# check_window_backward
# -----------------------------------------------------------------------------
def lesson_config(module, q, split_sinks=False):
    """The package's tiles for ``q``; by default lesson 08's dK/dV kernel alone (the planted edits are in it)."""
    cfg = module.default_config(q.shape[-1], q.device.type, course_utils.ENV.capability, q.dtype)
    cfg.split_sinks = split_sinks
    return cfg


def differentiable(module, config=None, split_sinks=False):
    from course_utils.kernels import flash_attention_with_lse

    class Planted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, window_size, sink_size):
            o, lse = flash_attention_with_lse(q, k, v, True, window_size=window_size, sink_size=sink_size)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.window = (window_size, sink_size)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            cfg = config or lesson_config(module, q, split_sinks)
            grads = module.attention_backward(q, k, v, o, lse, do, causal=True, config=cfg,
                                              window_size=ctx.window[0], sink_size=ctx.window[1])
            return (*grads, None, None)

    return lambda q, k, v, *, window_size, sink_size: Planted.apply(q, k, v, window_size, sink_size)


BACKWARD_MISTAKES = {
    "sinks_not_accumulated": (p5.MSG_BWD_SINKS, [(
        "_attn_bwd_dkdv_window", "q_end = tl.where(start_n < SINK_SIZE, N_Q, q_end)", "")]),
    "sinks_ignored_in_dkdv": (p5.MSG_BWD_SINKS, [(
        "_attn_bwd_dkdv_window", "    if HAS_SINKS:\n        full_end", "    if not HAS_SINKS:\n        full_end")]),
    "window_off_by_one": (p5.MSG_WINDOW_OFF_BY_ONE, [(
        "_dkdv_inner_window", "N_Q, WINDOW_SIZE, SINK_SIZE, HAS_SINKS)", "N_Q, WINDOW_SIZE + 1, SINK_SIZE, HAS_SINKS)")]),
    "sinks_in_the_future": (p5.MSG_SINKS_FUTURE, [(
        "_dkdv_inner_window", "p_t = tl.where(keep, p_t, 0.0)",
        "p_t = tl.where(keep | (offs_n[:, None] < SINK_SIZE), p_t, 0.0)")]),
    # The far edge's q_end rounded down to whole query blocks: the last, partial query block is skipped.
    "last_query_block_skipped": (p5.MSG_BWD_LAST_Q_BLOCK, [(
        "_attn_bwd_dkdv_window", "q_end = tl.minimum(start_n + BLOCK_N + WINDOW_SIZE - 1, N_Q)\n",
        "q_end = tl.minimum(start_n + BLOCK_N + WINDOW_SIZE - 1, N_Q) // BLOCK_M * BLOCK_M\n")]),
}


@pytest.mark.parametrize("name", list(BACKWARD_MISTAKES))
def test_backward_mistakes_are_diagnosed(tmp_path_factory, name):
    message, edits = BACKWARD_MISTAKES[name]
    module = planted(tmp_path_factory, bw, "bw_" + name, *edits)
    _fails(check_window_backward, differentiable(module), message)


def test_backward_sink_diagnosis_with_other_blocks(tmp_path_factory):
    message, edits = BACKWARD_MISTAKES["sinks_not_accumulated"]
    module = planted(tmp_path_factory, bw, "bw_sinks_not_accumulated", *edits)
    _fails(check_window_backward, differentiable(module, bw.BackwardConfig(16, 32, 32, 16, split_sinks=False)), message)


@pytest.mark.parametrize("split_sinks", [False, True], ids=["lesson-kernel", "sinks-split"])
def test_backward_course_kernels_pass(tmp_path_factory, split_sinks):
    # The course's backward typed into the notebook (an unedited copy of backward.py: every backward
    # kernel the learner's own) behind the course's forward: passes. The course's own module is refused.
    module = planted(tmp_path_factory, bw, "bw_unchanged")
    assert check_window_backward(differentiable(module, split_sinks=split_sinks))


def test_backward_math_only_is_rejected():
    def math_only(q, k, v, *, window_size, sink_size):
        n = q.shape[2]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        mask = (j <= i) & ((i - j < window_size) | (j < sink_size))
        kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        s = (q @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv

    with pytest.raises(GradingError, match="no Triton kernel ran"):
        check_window_backward(math_only)


def test_the_course_s_own_tile_bounds_is_refused_as_the_answer():
    # Lesson 08 imports window_tile_bounds two cells before asking for it (issue 21: it used to pass).
    from course_utils.kernels.forward import window_tile_bounds

    with pytest.raises(GradingError, match=r"called course_utils\.kernels\.forward\.window_tile_bounds: it is the "
                                           r"course's own answer"):
        check_window_tile_bounds(lambda *args: window_tile_bounds(*args))
    assert window_tile_bounds(1, 4, 4, 16, 3, 0) == window_tile_bounds(1, 4, 4, 16, 3, 0)  # restored after the check


# -----------------------------------------------------------------------------
# Proof of work: borrowed answers and inputs edited in place
# -----------------------------------------------------------------------------
@triton.jit
def _dummy(x_ptr):
    tl.store(x_ptr, 0.0)


def _launch_dummy(like):
    """A kernel of "the learner's" that does nothing useful: it writes one number nobody reads."""
    _dummy[(1,)](torch.empty(1, dtype=torch.float32, device=like.device))


def _window_mask(n, window_size, sink_size, device):
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (j <= i) & ((i - j < window_size) | (j < sink_size))


def _sdpa_behind_a_dummy_kernel(q, k, v, *, window_size, sink_size):
    _launch_dummy(q)
    mask = _window_mask(q.shape[2], window_size, sink_size, q.device)
    kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    s = (q.float() @ kk.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    return o, torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)


def _references_behind_a_dummy_kernel(q, k, v, *, window_size, sink_size):
    from course_utils import references

    _launch_dummy(q)
    o, lse = references.attention_lse(*(t.detach().cpu().double().numpy() for t in (q, k, v)), causal=True,
                                      window_size=window_size, sink_size=sink_size)
    return torch.tensor(o, dtype=q.dtype, device=q.device), torch.tensor(lse, dtype=torch.float32, device=q.device)


def _public_api_with_lse(q, k, v, *, window_size, sink_size):
    from course_utils.kernels import flash_attention_with_lse

    return flash_attention_with_lse(q, k, v, True, window_size=window_size, sink_size=sink_size)


def _public_api_flash_attention(q, k, v, *, window_size, sink_size):
    from course_utils.kernels import flash_attention

    o = flash_attention(q, k, v, causal=True, window_size=window_size, sink_size=sink_size)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return o, lse


@pytest.mark.parametrize("fn, message", [
    (_sdpa_behind_a_dummy_kernel, "while your function ran, torch computed"),
    (_references_behind_a_dummy_kernel, "your function called course_utils.references.attention_lse: the "
                                         "references are what the check compares with"),
    (_public_api_with_lse, "your function ran course_utils's own kernel `_flash_attention_forward_window_kernel`"),
    (_public_api_flash_attention, "your function ran course_utils's own kernel `_flash_attention_forward_window_kernel`"),
    (fwd(forward, block_m=32, block_n=32), "your function ran course_utils's own kernel"),
], ids=["sdpa", "references", "flash_attention_with_lse", "flash_attention", "window-forward-module"])
def test_forward_borrowed_answers_are_refused(fn, message):
    with pytest.raises(GradingError) as info:
        check_window_forward(fn)
    assert message in str(info.value), str(info.value)


def test_forward_input_scaled_in_place_is_refused(tmp_path_factory):
    # q.mul_(sm_scale) and a kernel told the scale is 1: o and lse are right, but the caller's q is changed.
    module = planted(tmp_path_factory, forward, "forward_unscaled", (
        "flash_attention_window_forward", "1.0 / math.sqrt(D), N, Hq", "1.0, N, Hq"))

    def scaled_in_place(q, k, v, *, window_size, sink_size):
        q.mul_(q.shape[-1] ** -0.5)
        return module.flash_attention_window_forward(q, k, v, window_size=window_size, sink_size=sink_size)

    with pytest.raises(GradingError, match=r"changed its input `q` in place"):
        check_window_forward(scaled_in_place)


def test_forward_on_contiguous_copies_passes(tmp_path_factory):
    # Correct and written differently: the kernel reads torch's contiguous copies of q, k, v, and o comes
    # back as a torch copy of what the kernel wrote (a copy keeps its origin).
    module = planted(tmp_path_factory, forward, "forward_unchanged")

    def on_copies(q, k, v, *, window_size, sink_size):
        o, lse = module.flash_attention_window_forward(q.contiguous(), k.contiguous(), v.contiguous(),
                                                       window_size=window_size, sink_size=sink_size)
        return o.clone(), lse

    assert check_window_forward(on_copies)


def _math_window_attention(q, k, v, window_size, sink_size):
    mask = _window_mask(q.shape[2], window_size, sink_size, q.device)
    kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    s = (q @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv


def _torch_forward_behind_a_dummy_kernel(q, k, v, *, window_size, sink_size):
    _launch_dummy(q)  # then autograd differentiates torch's math: no backward kernel of ours at all
    return _math_window_attention(q, k, v, window_size, sink_size)


class _TorchBackward(torch.autograd.Function):
    """The course's forward (allowed), and a backward that is torch autograd behind a dummy kernel."""

    @staticmethod
    def forward(ctx, q, k, v, window_size, sink_size):
        from course_utils.kernels import flash_attention_with_lse

        ctx.save_for_backward(q, k, v)
        ctx.window = (window_size, sink_size)
        return flash_attention_with_lse(q, k, v, True, window_size=window_size, sink_size=sink_size)[0]

    @staticmethod
    def backward(ctx, do):
        _launch_dummy(do)
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
            o = _math_window_attention(q, k, v, *ctx.window)
            return (*torch.autograd.grad(o, (q, k, v), do), None, None)


def _public_api_differentiable(q, k, v, *, window_size, sink_size):
    from course_utils.kernels import flash_attention

    return flash_attention(q, k, v, True, window_size=window_size, sink_size=sink_size)


_launder = copied_by_a_kernel


class _CourseBackwardCopied(torch.autograd.Function):
    """The course's whole backward, its dK and dV copied out by the learner's copy kernel."""

    @staticmethod
    def forward(ctx, q, k, v, window_size, sink_size):
        from course_utils.kernels import flash_attention_with_lse

        o, lse = flash_attention_with_lse(q, k, v, True, window_size=window_size, sink_size=sink_size)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window = (window_size, sink_size)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = bw.attention_backward(q, k, v, o, lse, do, causal=True, window_size=ctx.window[0],
                                           sink_size=ctx.window[1])
        return dq, _launder(dk), _launder(dv), None, None


def _course_dkdv_copied_by_a_kernel(q, k, v, *, window_size, sink_size):
    return _CourseBackwardCopied.apply(q, k, v, window_size, sink_size)


@pytest.mark.parametrize("fn, message", [
    (_torch_forward_behind_a_dummy_kernel, "while your function ran, torch computed"),
    (lambda q, k, v, *, window_size, sink_size: _TorchBackward.apply(q, k, v, window_size, sink_size),
     "(in the backward pass: the gradients must come from your backward kernels, not from torch)"),
    (differentiable(bw), "your backward ran course_utils's kernel `_attn_bwd_dkdv_window` (through "
                         "course_utils.kernels): the dK/dV kernel is this exercise"),
    (_public_api_differentiable, "your backward ran course_utils's kernel `_attn_bwd_dkdv_window`"),
    (_course_dkdv_copied_by_a_kernel, "your backward ran course_utils's kernel `_attn_bwd_dkdv_window`"),
], ids=["torch-forward", "torch-autograd-backward", "course-backward-module", "flash_attention",
        "course-dkdv-laundered"])
def test_backward_borrowed_answers_are_refused(fn, message):
    with pytest.raises(GradingError) as info:
        check_window_backward(fn)
    text = str(info.value)
    assert message in text, text
    if "torch computed" in message:
        assert "(in the backward pass" not in text  # refused in the forward already


def test_backward_do_edited_in_place_is_refused(tmp_path_factory):
    module = planted(tmp_path_factory, bw, "bw_unchanged")

    class DoubledDo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, window_size, sink_size):
            from course_utils.kernels import flash_attention_with_lse

            o, lse = flash_attention_with_lse(q, k, v, True, window_size=window_size, sink_size=sink_size)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.window = (window_size, sink_size)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            do.mul_(2.0)  # the caller's do is changed; the gradients are halved back, so they are right
            grads = module.attention_backward(q, k, v, o, lse, do, causal=True, config=lesson_config(module, q),
                                              window_size=ctx.window[0], sink_size=ctx.window[1])
            return (*(g / 2 for g in grads), None, None)

    with pytest.raises(GradingError, match=r"changed its input `do` in place"):
        check_window_backward(lambda q, k, v, *, window_size, sink_size: DoubledDo.apply(q, k, v, window_size,
                                                                                         sink_size))


def test_backward_last_query_block_skipped_with_wide_key_blocks(tmp_path_factory):
    # q_end - BLOCK_M, with the GPU's 64 x 128 dK/dV tiles: every case of N <= 128 fits in one key block,
    # whose range ends at N anyway; only the case of N = 300 (three key blocks) shows it.
    module = planted(tmp_path_factory, bw, "bw_last_query_block_minus", (
        "_attn_bwd_dkdv_window", "q_end = tl.minimum(start_n + BLOCK_N + WINDOW_SIZE - 1, N_Q)\n",
        "q_end = tl.minimum(start_n + BLOCK_N + WINDOW_SIZE - 1, N_Q) - BLOCK_M\n"))
    text = _fails(check_window_backward, differentiable(module, bw.BackwardConfig(64, 128, 128, 32, split_sinks=False)),
                  p5.MSG_BWD_LAST_Q_BLOCK)
    assert "N=300" in text


def test_backward_lesson_layout_passes(tmp_path_factory):
    # Correct and written differently, as lesson 08 is: the learner's own forward and dK/dV kernel (from
    # copies), the course's delta and dQ kernels (allowed: the lesson gives them).
    import math

    fwd_module = planted(tmp_path_factory, forward, "forward_unchanged")
    bw_module = planted(tmp_path_factory, bw, "bw_unchanged")

    def backward(q, k, v, o, lse, do, window_size, sink_size):  # lesson 08's attention_backward_window
        B, n_q_heads, N, D = q.shape
        n_kv_heads = k.shape[1]
        cfg = bw.default_config(D, q.device.type, course_utils.ENV.capability, q.dtype)
        BLOCK_D = max(16, triton.next_power_of_2(D))
        PAD_D = BLOCK_D != D
        delta = torch.empty((B, n_q_heads, N), device=q.device, dtype=torch.float32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        window_size, sink_size = min(window_size, N), min(sink_size, N)
        bw.attn_bwd_preprocess[(triton.cdiv(N, cfg.pre_block_m), B * n_q_heads)](
            o, do, delta, *o.stride(), *do.stride(), delta.stride(0), delta.stride(1), n_q_heads, N, D,
            BLOCK_M=cfg.pre_block_m, BLOCK_D=BLOCK_D, EVEN_M=N % cfg.pre_block_m == 0, PAD_D=PAD_D, ACC=tl.float32)
        common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(),
                  lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1))
        bm, bn = cfg.dkdv_block_m, cfg.dkdv_block_n
        bw_module._attn_bwd_dkdv_window[(triton.cdiv(N, bn), B * n_kv_heads)](
            q, k, v, do, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(),
            n_kv_heads, n_q_heads // n_kv_heads, N, N, D, 1.0 / math.sqrt(D), window_size, sink_size,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, HAS_SINKS=sink_size > 0,
            EVEN_M=N % bm == 0, EVEN_N=N % bn == 0, PAD_D=PAD_D, ACC=tl.float32, num_warps=cfg.dkdv_warps)
        bm, bn = cfg.dq_block_m, cfg.dq_block_n
        bw.attn_bwd_dq_window[(triton.cdiv(N, bm), B * n_q_heads)](
            q, k, v, do, lse, delta, dq, *common, *dq.stride(),
            n_q_heads, n_q_heads // n_kv_heads, N, N, D, 1.0 / math.sqrt(D), window_size, sink_size,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, HAS_SINKS=sink_size > 0,
            EVEN_M=N % bm == 0, EVEN_N=N % bn == 0, PAD_D=PAD_D, ACC=tl.float32, num_warps=cfg.dq_warps)
        return dq, dk, dv

    class Lesson(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, window_size, sink_size):
            o, lse = fwd_module.flash_attention_window_forward(q, k, v, window_size=window_size, sink_size=sink_size)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.window = (window_size, sink_size)
            return o

        @staticmethod
        def backward(ctx, do):
            return (*backward(*ctx.saved_tensors, do, *ctx.window), None, None)

    assert check_window_backward(lambda q, k, v, *, window_size, sink_size: Lesson.apply(q, k, v, window_size,
                                                                                         sink_size))


def test_backward_dk_written_by_the_course_s_dq_kernel_is_refused(tmp_path_factory):
    # Only kernels the lesson gives ran (besides the learner's), but dK is the course dQ kernel's output.
    module = planted(tmp_path_factory, bw, "bw_unchanged")

    class DqKernelWritingDk(_CourseBackwardCopied):
        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            dq, _, dv = module.attention_backward(q, k, v, o, lse, do, causal=True, config=lesson_config(module, q),
                                                  window_size=ctx.window[0], sink_size=ctx.window[1])
            dk = torch.zeros_like(k)
            bw.attn_bwd_dq_window[(1, 1)](  # one block of "dq" for kv head 0, written into dk
                k, q, v, do, lse, lse, dk, *k.stride(), *q.stride(), *v.stride(), *do.stride(),
                lse.stride(0), lse.stride(1), lse.stride(0), lse.stride(1), *dk.stride(),
                1, 1, 16, 16, q.shape[-1], 1.0, 1, 0, BLOCK_M=16, BLOCK_N=16, BLOCK_D=16, HAS_SINKS=False,
                EVEN_M=True, EVEN_N=True, PAD_D=False, ACC=tl.float32)
            return dq, dk, dv, None, None

    with pytest.raises(GradingError, match=r"dk was written by course_utils's kernel `attn_bwd_dq_window`: the "
                                           r"dK/dV kernel is this exercise"):
        check_window_backward(lambda q, k, v, *, window_size, sink_size: DqKernelWritingDk.apply(
            q, k, v, window_size, sink_size))


# -----------------------------------------------------------------------------
# check_dkdv_bounds: the query blocks one dK/dV program walks
# -----------------------------------------------------------------------------
from course_utils.grading import check_dkdv_bounds  # noqa: E402


def dkdv_bounds_from_the_mask(start_n, block_m, block_n, seq_len, window_size, sink_size):
    # Correct and written differently: classify each query block from the mask itself, as the column
    # view does. Its full_end is sometimes LARGER than the course's (a last, short query block that
    # happens to see every key goes unmasked), and its q_end ends on a block boundary.
    import numpy as np
    from course_utils import references

    mask = references.window_mask(seq_len, seq_len, window_size, sink_size)[:, start_n:start_n + block_n]
    diag_end = min(start_n + block_n, seq_len)
    full_end = q_end = diag_end
    for first in range(diag_end, seq_len, block_m):
        tile = mask[first:first + block_m]
        if tile.all() and full_end == first:
            full_end = q_end = min(first + block_m, seq_len)
        elif tile.any():
            q_end = min(first + block_m, seq_len)
    return diag_end, full_end, q_end


def dkdv_bounds_as_in_triton(start_n, block_m, block_n, seq_len, window_size, sink_size):
    # Correct and written as the kernel would (ceil by adding block_m - 1; the sinks first).
    if start_n + block_n <= sink_size:
        return min(start_n + block_n, seq_len), seq_len, seq_len
    diag_end = min(start_n + block_n, seq_len)
    full_end = min(max((start_n + window_size) // block_m * block_m, diag_end), seq_len)
    far = seq_len if start_n < sink_size else start_n + block_n + window_size - 1
    q_end = min((far + block_m - 1) // block_m * block_m, seq_len)
    return diag_end, full_end, q_end


@pytest.mark.parametrize("fn", [dkdv_bounds_from_the_mask, dkdv_bounds_as_in_triton])
def test_dkdv_bounds_correct_variants_pass(fn):
    assert check_dkdv_bounds(fn)


def _planted_dkdv_bounds(mistake):
    """A learner's dkdv_query_bounds with one mistake (written here, not from the check's own model)."""
    def fn(start_n, block_m, block_n, seq_len, window_size, sink_size):
        n, w = seq_len, window_size
        last_key = start_n + block_n - 1
        diag_end = {"diag_minus_one": min(last_key, n), "diag_block_m": min(start_n + block_m, n),
                    "diag_no_cap": last_key + 1}.get(mistake, min(last_key + 1, n))
        reach = {"full_last_key": last_key + w, "full_minus_one": start_n + w - 1}.get(mistake, start_n + w)
        full = reach // block_m * block_m
        if mistake == "full_rounded_up":
            full = (reach + block_m - 1) // block_m * block_m
        full_end = min(full, n) if mistake == "full_no_max" else min(max(full, diag_end), n)
        q_end = {"no_far_edge": n, "far_edge_missing": full_end, "far_from_first_key": min(start_n + w, n),
                 "far_minus_one": min(last_key + w - 1, n)}.get(mistake, min(last_key + w, n))
        if mistake == "far_floor":
            q_end = q_end // block_m * block_m
        if mistake == "far_minus_block":
            q_end -= block_m
        if sink_size > 0 and mistake != "sinks_ignored":
            has_sink = start_n <= sink_size if mistake == "sinks_le" else start_n < sink_size
            only_sinks = start_n + block_n <= sink_size
            if (only_sinks or (mistake == "sinks_full_any" and has_sink)) and mistake != "sinks_not_full":
                full_end = n
            if has_sink and (mistake != "sinks_all_only" or only_sinks):
                q_end = n
        return diag_end, full_end, q_end
    return fn


@pytest.mark.parametrize("mistake,message", [
    ("diag_minus_one", p5.MSG_DKDV_DIAG_OFF_BY_ONE),
    ("diag_block_m", p5.MSG_DKDV_DIAG_BLOCK_M),
    ("diag_no_cap", p5.MSG_DKDV_PAST_END),
    ("full_last_key", p5.MSG_DKDV_FULL_LAST_KEY),
    ("full_rounded_up", p5.MSG_DKDV_FULL_ROUNDED_UP),
    ("full_minus_one", p5.MSG_DKDV_FULL_OFF_BY_ONE),
    ("full_no_max", p5.MSG_DKDV_FULL_BEFORE_DIAG),
    ("no_far_edge", p5.MSG_DKDV_NO_FAR_EDGE),
    ("far_edge_missing", p5.MSG_DKDV_FAR_EDGE_MISSING),
    ("far_from_first_key", p5.MSG_DKDV_FAR_FROM_FIRST_KEY),
    ("far_minus_one", p5.MSG_DKDV_FAR_OFF_BY_ONE),
    ("far_floor", p5.MSG_BWD_LAST_Q_BLOCK),
    ("far_minus_block", p5.MSG_BWD_LAST_Q_BLOCK),
    ("sinks_ignored", p5.MSG_BWD_SINKS),
    ("sinks_all_only", p5.MSG_DKDV_SINKS_ALL_ONLY),
    ("sinks_full_any", p5.MSG_DKDV_SINKS_FULL_ANY),
    ("sinks_not_full", p5.MSG_DKDV_SINKS_NOT_FULL),
    ("sinks_le", p5.MSG_DKDV_SINKS_LE),
])
def test_dkdv_bounds_mistakes_are_diagnosed(mistake, message):
    _fails(check_dkdv_bounds, _planted_dkdv_bounds(mistake), message)


def test_dkdv_bounds_unknown_misalignment_is_named():
    # A full_end that is not a multiple of block_m, and not one of the known mistakes: the alignment rule.
    def fn(start_n, block_m, block_n, seq_len, window_size, sink_size):
        d, f, q = dkdv_bounds_as_in_triton(start_n, block_m, block_n, seq_len, window_size, sink_size)
        return d, (f + 3 if f + 3 < q else f), q

    _fails(check_dkdv_bounds, fn, p5.MSG_DKDV_UNALIGNED)


def test_dkdv_bounds_borrowed_from_the_grader_is_refused():
    with pytest.raises(GradingError, match=r"_dkdv_bounds_variant: it is the course's own answer"):
        check_dkdv_bounds(lambda *args: p5._dkdv_bounds_variant(*args))
    assert p5._dkdv_bounds_variant(0, 16, 32, 64, 8, 0) == p5._dkdv_bounds_variant(0, 16, 32, 64, 8, 0)  # restored


def test_dkdv_bounds_wrong_type_gets_a_sentence():
    with pytest.raises(GradingError, match=r"returned 2 values for start_n=0; return three: \(diag_end, full_end"):
        check_dkdv_bounds(lambda *a: (0, 0))
    with pytest.raises(GradingError, match=r"for start_n=0; return three Python ints \(diag_end, full_end, q_end\)"):
        check_dkdv_bounds(lambda *a: (0.0, 0.5, 1.0))
    with pytest.raises(GradingError, match="expects a function"):
        check_dkdv_bounds(3)


# -----------------------------------------------------------------------------
# check_sink_split (optional exercise): the sink keys' far queries in programs of their own
# -----------------------------------------------------------------------------
from course_utils.grading import check_sink_split  # noqa: E402


def split_backward(module, mistake=None):
    """Lesson 08's exercise 5 as a learner writes it, on ``module``'s kernels (a planted copy of backward.py).

    The window backward runs with the dK/dV kernel told there are no sinks; the sink kernel writes one
    fp32 partial per chunk of query rows; the launcher adds them in a fixed order. ``mistake`` plants one
    in the launcher: "not_added", "window_with_sinks" (the dK/dV kernel still walks the sinks' far queries),
    "varying_order" (the partials added in an order that changes from call to call), "one_chunk";
    "zeros_and_loop" is correct and written differently (zeroed buffers, the partials added in a loop).
    """
    import math

    calls = [0]

    def fn(q, k, v, o, lse, do, *, window_size, sink_size, num_chunks):
        B, n_q_heads, N, D = q.shape
        n_kv_heads = k.shape[1]
        cfg = module.default_config(D, q.device.type, course_utils.ENV.capability, q.dtype)
        cfg.split_sinks = False
        window_size, sink_size = min(window_size, N), min(sink_size, N)
        dkdv_sinks = sink_size if mistake == "window_with_sinks" else 0
        BLOCK_D = max(16, triton.next_power_of_2(D))
        delta = (o.float() * do.float()).sum(-1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(),
                  lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1))
        # the window kernels (dK/dV without sinks, dQ with them): the package's launcher, told not to split
        module._window_backward(q, k, v, lse, delta, do, dq, dk, dv, common, cfg, n_q_heads // n_kv_heads,
                                1.0 / math.sqrt(D), window_size, sink_size, BLOCK_D, BLOCK_D != D, tl.float32) \
            if dkdv_sinks else _window_backward_without_sinks(module, q, k, v, lse, delta, do, dq, dk, dv, common, cfg,
                                                              window_size, sink_size, BLOCK_D)
        bm = cfg.dkdv_block_m
        block_s = min(64, max(16, triton.next_power_of_2(sink_size)))
        sink_blocks = triton.cdiv(sink_size, block_s)
        rows = N - window_size // bm * bm
        chunks = 1 if mistake == "one_chunk" else num_chunks
        chunk = bm * triton.cdiv(triton.cdiv(rows, bm), chunks)
        chunks = triton.cdiv(rows, chunk)
        shape = (chunks, B * n_kv_heads, sink_blocks * block_s, BLOCK_D)
        alloc = torch.zeros if mistake == "zeros_and_loop" else torch.empty
        dk_buf = alloc(shape, device=q.device, dtype=torch.float32)
        dv_buf = alloc(shape, device=q.device, dtype=torch.float32)
        module._attn_bwd_dkdv_sinks[(chunks, sink_blocks, B * n_kv_heads)](
            q, k, v, do, lse, delta, dk_buf, dv_buf, *common,
            n_kv_heads, n_q_heads // n_kv_heads, N, D, 1.0 / math.sqrt(D), window_size, sink_size, chunk,
            BLOCK_M=bm, BLOCK_S=block_s, BLOCK_D=BLOCK_D, PAD_D=BLOCK_D != D, ACC=tl.float32)
        dk_part, dv_part = (buf[:, :, :sink_size, :D].reshape(chunks, B, n_kv_heads, sink_size, D)
                            for buf in (dk_buf, dv_buf))
        calls[0] += 1
        if mistake != "not_added":
            for grad, part in ((dk, dk_part), (dv, dv_part)):
                if mistake in ("varying_order", "zeros_and_loop"):  # varying: the chunk order rotates per call
                    order = [(c + calls[0]) % chunks if mistake == "varying_order" else c for c in range(chunks)]
                    far = part[order[0]].clone()
                    for c in order[1:]:
                        far = far + part[c]
                else:
                    far = part.sum(0)
                grad[:, :, :sink_size] = (grad[:, :, :sink_size].float() + far).to(grad.dtype)
        return dq, dk, dv, dk_part, dv_part

    return fn


def _window_backward_without_sinks(module, q, k, v, lse, delta, do, dq, dk, dv, common, cfg, window_size, sink_size,
                                   BLOCK_D):
    """The window dK/dV kernel with sink_size=0 and the dQ kernel with the sinks (as lesson 08's launcher)."""
    import math

    B, n_q_heads, N, D = q.shape
    n_kv_heads = k.shape[1]
    bm, bn = cfg.dkdv_block_m, cfg.dkdv_block_n
    module._attn_bwd_dkdv_window[(triton.cdiv(N, bn), B * n_kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(),
        n_kv_heads, n_q_heads // n_kv_heads, N, N, D, 1.0 / math.sqrt(D), window_size, 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, HAS_SINKS=False,
        EVEN_M=N % bm == 0, EVEN_N=N % bn == 0, PAD_D=BLOCK_D != D, ACC=tl.float32)
    bm, bn = cfg.dq_block_m, cfg.dq_block_n
    bw.attn_bwd_dq_window[(triton.cdiv(N, bm), B * n_q_heads)](
        q, k, v, do, lse, delta, dq, *common, *dq.stride(),
        n_q_heads, n_q_heads // n_kv_heads, N, N, D, 1.0 / math.sqrt(D), window_size, sink_size,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BLOCK_D, HAS_SINKS=sink_size > 0,
        EVEN_M=N % bm == 0, EVEN_N=N % bn == 0, PAD_D=BLOCK_D != D, ACC=tl.float32)


def test_sink_split_lesson_launcher_passes(tmp_path_factory):
    module = planted(tmp_path_factory, bw, "bw_unchanged")
    assert check_sink_split(split_backward(module))


@pytest.mark.parametrize("mistake", ["zeros_and_loop"])
def test_sink_split_correct_variant_passes(tmp_path_factory, mistake):
    module = planted(tmp_path_factory, bw, "bw_unchanged")
    assert check_sink_split(split_backward(module, mistake))


SPLIT_KERNEL_MISTAKES = {
    # the far mask without i - j >= W: the sink keys' window pairs are added by both kernels
    "near_pairs_too": (p5.MSG_SPLIT_NEAR_PAIRS, [(
        "_attn_bwd_dkdv_sinks", "(offs_m[None, :] - offs_n[:, None]) >= WINDOW_SIZE", "(offs_m[None, :] - offs_n[:, None]) >= 0")]),
    # every program walks all the far rows, whatever its chunk
    "every_chunk_all_rows": (p5.MSG_SPLIT_EVERY_CHUNK, [
        ("_attn_bwd_dkdv_sinks", "+ pid_c * CHUNK", "+ 0 * pid_c * CHUNK"),
        ("_attn_bwd_dkdv_sinks", "hi = tl.minimum(chunk_lo + CHUNK, N_Q)", "hi = N_Q + 0 * CHUNK")]),
    # every program writes the first chunk's slot (zeroed buffers: the other partials stay 0)
    "one_slot": (p5.MSG_SPLIT_EMPTY_CHUNK, [(
        "_attn_bwd_dkdv_sinks", "part = (pid_c * tl.num_programs(2) + pid_bh)", "part = (0 * pid_c * tl.num_programs(2) + pid_bh)")]),
}


@pytest.mark.parametrize("name", list(SPLIT_KERNEL_MISTAKES))
def test_sink_split_kernel_mistakes_are_diagnosed(tmp_path_factory, name):
    message, edits = SPLIT_KERNEL_MISTAKES[name]
    module = planted(tmp_path_factory, bw, "bw_split_" + name, *edits)
    _fails(check_sink_split, split_backward(module, "zeros_and_loop" if name == "one_slot" else None), message)


@pytest.mark.parametrize("mistake,message", [
    ("not_added", p5.MSG_SPLIT_NOT_ADDED),
    ("window_with_sinks", p5.MSG_SPLIT_TWICE),
    ("varying_order", p5.MSG_SPLIT_NOT_REPRODUCIBLE),
    ("one_chunk", p5.MSG_SPLIT_ONE_PROGRAM),
])
def test_sink_split_launcher_mistakes_are_diagnosed(tmp_path_factory, mistake, message):
    module = planted(tmp_path_factory, bw, "bw_unchanged")
    _fails(check_sink_split, split_backward(module, mistake), message)


def test_sink_split_that_edits_do_in_place_is_refused(tmp_path_factory):
    right = split_backward(planted(tmp_path_factory, bw, "bw_unchanged"))

    def edits_do(q, k, v, o, lse, do, **kwargs):
        out = right(q, k, v, o, lse, do, **kwargs)
        do.mul_(0.5)
        return out

    with pytest.raises(GradingError, match="changed its input `do` in place"):
        check_sink_split(edits_do)


def test_sink_split_course_kernels_are_refused():
    with pytest.raises(GradingError, match=r"your backward ran course_utils's kernel `_attn_bwd_dkdv_window`.*the dK/dV "
                                           r"kernels are this exercise"):
        check_sink_split(split_backward(bw))
