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

from course_utils.grading import (GradingError, check_window_backward, check_window_forward,
                                  check_window_tile_bounds)
from course_utils.grading import part5_window as p5
from course_utils.kernels import backward as bw
from course_utils.kernels import forward
from conftest import function_span, module_from_source


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
    with pytest.raises(GradingError, match="three"):
        check_window_tile_bounds(lambda *a: (0, 0))
    with pytest.raises(GradingError, match="Python"):
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


def test_forward_through_the_public_api_passes():
    from course_utils.kernels import flash_attention_with_lse

    assert check_window_forward(lambda q, k, v, *, window_size, sink_size: flash_attention_with_lse(
        q, k, v, True, window_size=window_size, sink_size=sink_size))


def test_forward_course_kernel_passes_with_other_blocks():
    assert check_window_forward(fwd(forward, block_m=32, block_n=32))


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
def test_backward_course_kernels_pass(split_sinks):
    assert check_window_backward(differentiable(bw, split_sinks=split_sinks))


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
