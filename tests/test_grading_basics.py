"""check_triton_softmax: planted mistakes get their diagnosis, correct kernels pass.

Each planted kernel is a small, realistic first attempt at a row softmax with
exactly one mistake. The correct kernels are written in different ways
(block sizes, several rows per program, exp2, a loop over column blocks), so
the check is not tied to one way of writing the kernel.
"""

import time

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import pytest
import torch
import triton
import triton.language as tl

from course_utils.grading import GradingError, check_triton_softmax
from course_utils.grading import part2_basics as pb
from course_utils.grading.outcome import KernelError
from conftest import module_from_source

LOG2E = 1.4426950408889634


# -- correct kernels, written differently -------------------------------------
@triton.jit
def _softmax_one_row(x_ptr, y_ptr, x_row_stride, y_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * y_row_stride + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


def softmax_reference_kernel(x, block=None):
    y = torch.empty_like(x)
    block = block or triton.next_power_of_2(x.shape[1])
    _softmax_one_row[(x.shape[0],)](x, y, x.stride(0), y.stride(0), x.shape[1], BLOCK=block)
    return y


@triton.jit
def _softmax_rows_exp2(x_ptr, y_ptr, x_row_stride, y_row_stride, n_rows, n_cols,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # Several rows per program, a 2-D tile, and exp2 with log2(e) folded in.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=-float("inf"))
    x = x.to(tl.float32) * 1.4426950408889634
    e = tl.exp2(x - tl.max(x, axis=1)[:, None])
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def softmax_rows_exp2(x):
    y = torch.empty_like(x)
    rows, block = 4, 2 * triton.next_power_of_2(x.shape[1])  # a block larger than needed
    _softmax_rows_exp2[(triton.cdiv(x.shape[0], rows),)](
        x, y, x.stride(0), y.stride(0), x.shape[0], x.shape[1], ROWS=rows, BLOCK=block)
    return y


@triton.jit
def _softmax_looped(x_ptr, y_ptr, x_row_stride, y_row_stride, n_cols, BLOCK: tl.constexpr):
    # A fixed block and an online softmax over the column blocks (any width).
    row = tl.program_id(0)
    m = -float("inf")
    l = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        tl.store(y_ptr + row * y_row_stride + cols, (tl.exp(x - m) / l).to(y_ptr.dtype.element_ty),
                 mask=cols < n_cols)


def softmax_looped(x):
    y = torch.empty_like(x)
    _softmax_looped[(x.shape[0],)](x, y, x.stride(0), y.stride(0), x.shape[1], BLOCK=32)
    return y


@pytest.mark.parametrize("fn", [softmax_reference_kernel,
                                lambda x: softmax_reference_kernel(x, block=max(512, triton.next_power_of_2(x.shape[1]))),
                                softmax_rows_exp2, softmax_looped],
                         ids=["one-row", "block-512", "rows-exp2", "looped"])
def test_correct_kernels_pass(fn):
    result = check_triton_softmax(fn)
    assert result and result.cases >= 15


# -- planted mistakes ---------------------------------------------------------
@triton.jit
def _no_load_mask(x_ptr, y_ptr, x_row_stride, y_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols).to(tl.float32)  # mistake: no mask
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * y_row_stride + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty),
             mask=cols < n_cols)


@triton.jit
def _other_zero(x_ptr, y_ptr, x_row_stride, y_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)  # mistake
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * y_row_stride + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unstable(x_ptr, y_ptr, x_row_stride, y_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x)  # mistake: no max subtracted
    tl.store(y_ptr + row * y_row_stride + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _no_store_mask(x_ptr, y_ptr, x_row_stride, y_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * y_row_stride + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty))  # mistake


@triton.jit
def _segfault(x_ptr, y_ptr, x_row_stride, y_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    # mistake: an offset far past any allocation (2**40 elements: 4 TiB away)
    x = tl.load(x_ptr + row * x_row_stride + (1 << 40) + cols).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, x.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


def _launch(kernel):
    def fn(x):
        y = torch.empty_like(x)
        kernel[(x.shape[0],)](x, y, x.stride(0), y.stride(0), x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
        return y
    return fn


def stride_is_n_cols(x):
    # mistake: the row stride is taken to be the number of columns
    y = torch.empty_like(x)
    _softmax_one_row[(x.shape[0],)](x, y, x.shape[1], y.stride(0), x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


def _fails_with(fn, text, **kwargs):
    with pytest.raises(GradingError) as info:
        check_triton_softmax(fn, **kwargs)
    message = str(info.value)
    assert text in message, message
    return message


def test_missing_mask_is_diagnosed():
    msg = _fails_with(_launch(_no_load_mask), pb.MSG_MISSING_MASK)
    assert "tail" in msg  # reported on the first case with a tail, before the strided ones


@pytest.mark.parametrize("allocate", [
    lambda x: torch.empty_like(x),
    lambda x: torch.zeros_like(x),
    lambda x: torch.empty(x.shape, dtype=x.dtype, device=x.device),
    lambda x: torch.zeros(*x.shape, dtype=x.dtype, device=x.device),
    lambda x: x.new_empty(x.shape),
], ids=["empty_like", "zeros_like", "empty", "zeros", "new_empty"])
def test_missing_store_mask_is_caught_by_the_guard_zone(allocate):
    # In the interpreter the programs run in order, so each row's overrun into the next row
    # is overwritten and the values come out right; only the guard after the last row sees it.
    def fn(x):
        y = allocate(x)
        _no_store_mask[(x.shape[0],)](x, y, x.stride(0), y.stride(0), x.shape[1],
                                      BLOCK=triton.next_power_of_2(x.shape[1]))
        return y
    msg = _fails_with(fn, pb.MSG_STORE_PAST_END)
    assert "5 rows x 100 columns" in msg  # the first case with a tail


def test_guard_zone_hands_out_ordinary_tensors_and_restores_torch():
    x = torch.randn(3, 5)
    originals = [torch.empty_like, torch.zeros_like, torch.empty, torch.zeros]
    with pb._GuardedOutputs(x) as guard:
        y = torch.empty_like(x)
        other = torch.empty(4, 5)  # another shape: torch's own allocation
        y.copy_(x)
    assert y.is_contiguous() and y.shape == x.shape and torch.equal(y, x)
    assert len(guard.zones) == 1 and other.shape == (4, 5) and not guard.overrun()
    y.view(-1).as_strided((16,), (1,))[15] = 1.0  # one element past the end
    assert guard.overrun()
    assert [torch.empty_like, torch.zeros_like, torch.empty, torch.zeros] == originals


def test_other_zero_is_diagnosed_with_the_padding_count():
    msg = _fails_with(_launch(_other_zero), "the masked load fills the padding lanes with `other=0`")
    # The first case with a tail has 100 columns in a block of 128: 28 padding lanes.
    assert "each of the 28 padding lanes" in msg, msg


def test_other_zero_with_a_larger_block_is_still_recognised():
    def fn(x):
        y = torch.empty_like(x)
        _other_zero[(x.shape[0],)](x, y, x.stride(0), y.stride(0), x.shape[1], BLOCK=512)
        return y
    msg = _fails_with(fn, "padding lanes")
    assert "each of the 448 padding lanes" in msg, msg  # first case: 64 columns in a block of 512


def test_unstable_softmax_is_diagnosed():
    msg = _fails_with(_launch(_unstable), pb.MSG_UNSTABLE)
    assert "+-1000" in msg  # the first large-magnitude case


def test_row_stride_assumed_n_cols_is_diagnosed():
    msg = _fails_with(stride_is_n_cols, pb.MSG_ROW_STRIDE_SOFTMAX)
    assert "rows not contiguous" in msg


def test_torch_softmax_is_turned_down():
    _fails_with(lambda x: torch.softmax(x, dim=-1), "torch computed a softmax (torch.softmax")


def test_launching_a_kernel_is_not_enough():
    # Launching a kernel is necessary, not sufficient: a wrong kernel result still fails.
    def fn(x):
        _launch(_other_zero)(x)
        return torch.zeros_like(x)
    with pytest.raises(GradingError, match="y was not written by your Triton kernel: it was allocated"):
        check_triton_softmax(fn)


def test_faulting_kernel_is_reported_and_pytest_survives():
    # CPU: the interpreter segfaults the forked grading process (pytest's faulthandler may
    # print "Fatal Python error" from it). GPU: the load faults CUDA in the worker process.
    start = time.perf_counter()
    _fails_with(_launch(_segfault), "made the GPU fault" if course_utils.ENV.device == "cuda" else "crashed the grading process")
    assert time.perf_counter() - start < 60
    assert check_triton_softmax(softmax_reference_kernel)  # the next correct check passes


def _forgot_return(x):
    y = softmax_reference_kernel(x)  # noqa: F841  (mistake: no `return y`)


@pytest.mark.parametrize(
    "fn, text",
    [
        (lambda x: softmax_reference_kernel(x)[:, :-1] if x.shape[1] > 1 else softmax_reference_kernel(x)[:0],
         "the softmax of each row has the input's shape"),
        (lambda x: softmax_reference_kernel(x).float().half() if x.dtype == torch.float32
         else softmax_reference_kernel(x).float(), "return the input's dtype"),
        (lambda x: (softmax_reference_kernel(x), None), "return a torch tensor"),
        (_forgot_return, "did you forget `return y`"),
    ],
    ids=["shape", "dtype", "tuple", "none"],
)
def test_wrong_return_gets_a_plain_sentence(fn, text):
    message = _fails_with(fn, text)
    assert "Traceback" not in message


def test_check_survives_a_parent_that_ran_multithreaded_torch():
    # A large op in this (parent) process starts torch's OpenMP threads; without care, the
    # forked grading process then hangs on its first large op (see isolation._child).
    a = torch.randn(1000, 1000)
    assert torch.isfinite(torch.softmax(a @ a, dim=-1)).all()
    assert check_triton_softmax(softmax_reference_kernel, timeout_s=30)


def test_learner_exception_keeps_its_own_traceback():
    def fn(x):
        raise ValueError("my own bug")
    with pytest.raises(KernelError, match="my own bug") as info:
        check_triton_softmax(fn)
    assert str(info.value).startswith("check_triton_softmax: your code raised")


def test_seed_replays_the_random_cases():
    a = check_triton_softmax(softmax_reference_kernel, seed=1234)
    b = check_triton_softmax(softmax_reference_kernel, seed=1234)
    assert (a.seed, a.cases, a.max_error) == (b.seed, b.cases, b.max_error)


def test_whole_check_passes_the_reference_kernel_with_its_default_seed():
    assert check_triton_softmax(softmax_reference_kernel)


def test_lesson_03_student_stub_raises_and_solution_passes(tmp_path):
    # The notebook's exercise cell: the solution passes the check, and the student version
    # (what `python -m course_utils.build` makes of it) raises until the kernel is written.
    from pathlib import Path

    import nbformat

    from course_utils.build import student_source

    nb = nbformat.read(Path(__file__).resolve().parent.parent / "solutions" / "03_triton_basics.ipynb", as_version=4)
    (cell,) = [c.source for c in nb.cells if c.cell_type == "code" and "def softmax_kernel(" in c.source]
    header = "import course_utils\nimport torch\nimport triton\nimport triton.language as tl\n\n"

    def load(name, src):
        return module_from_source(tmp_path / f"{name}.py", header + src)

    assert check_triton_softmax(load("nb03_solution", cell).triton_softmax)
    student = load("nb03_student", student_source(cell, "03 exercise"))
    with pytest.raises(NotImplementedError, match="softmax_kernel"):
        student.triton_softmax(torch.randn(2, 8))


# -- wide rows, borrowed answers, inputs changed in place ---------------------------
def test_a_block_fixed_in_advance_is_diagnosed_on_wide_rows():
    def fixed_block(x):
        y = torch.empty_like(x)
        _softmax_one_row[(x.shape[0],)](x, y, x.stride(0), y.stride(0), min(x.shape[1], 1024), BLOCK=1024)
        return y

    msg = _fails_with(fixed_block, "only the first 1024 columns of each row were used")
    assert "5000 columns" in msg


@triton.jit
def _noop(y_ptr):
    pass


def test_borrowed_answers_and_inputs_changed_in_place_are_refused():
    def noop_then_torch(x):
        y = torch.empty_like(x)
        _noop[(1,)](y)
        return y.copy_(x.float().exp().div(x.float().exp().sum(-1, keepdim=True)).to(x.dtype))

    def scales_x_in_place(x):
        y = softmax_reference_kernel(x)
        x.mul_(2.0)
        return y

    _fails_with(noop_then_torch, "torch computed an exponential")
    _fails_with(scales_x_in_place, "changed its input `x` in place")
    _fails_with(lambda x: None, "did you forget `return y`")
    with pytest.raises(GradingError, match="pass your launcher"):
        check_triton_softmax(_softmax_one_row)


@triton.jit
def _store_at_input_stride(x_ptr, y_ptr, x_row_stride, y_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    # mistake: y's rows addressed with x's row stride
    tl.store(y_ptr + row * x_row_stride + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


def test_output_rows_at_the_input_stride_are_not_blamed_on_a_store_mask():
    def fn(x):
        y = torch.empty_like(x)
        _store_at_input_stride[(x.shape[0],)](x, y, x.stride(0), y.stride(0), x.shape[1],
                                              BLOCK=triton.next_power_of_2(x.shape[1]))
        return y
    msg = _fails_with(fn, pb.MSG_OUT_ROW_STRIDE)
    assert "rows not contiguous" in msg and pb.MSG_STORE_PAST_END not in msg
