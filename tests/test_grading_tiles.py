"""check_tile_copy (lesson 03): right copies pass however they tile; each planted mistake gets its message."""

import course_utils  # noqa: F401  (before triton)

import pytest
import torch
import torch._dynamo  # noqa: F401  (proof.Work's first dispatch mode imports it: ~2 s in every forked check otherwise)
import triton
import triton.language as tl

from course_utils.grading import GradingError, check_tile_copy
from course_utils.grading.part2_tiles import MSG_COL_STRIDE, MSG_NO_KERNEL_TILE_COPY, MSG_ROW_STRIDE_TILE_COPY, MSG_SENTINEL, MSG_SWAPPED


@triton.jit
def _copy(x_ptr, y_ptr, n_rows, n_cols, sxr, sxc, syr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
          MISTAKE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if MISTAKE == 1:  # rows located with n_cols
        offs = rows[:, None] * n_cols + cols[None, :] * sxc
    elif MISTAKE == 2:  # column stride ignored
        offs = rows[:, None] * sxr + cols[None, :]
    elif MISTAKE == 3:  # rows and columns swapped
        offs = rows[:, None] * sxc + cols[None, :] * sxr
    else:
        offs = rows[:, None] * sxr + cols[None, :] * sxc
    tile = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + rows[:, None] * syr + cols[None, :], tile, mask=mask)


@triton.jit
def _copy_rows(x_ptr, y_ptr, n_rows, n_cols, sxr, sxc, syr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # Written differently: one program per block of rows, looping over the column blocks.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        m = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        t = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :] * sxc, mask=m, other=0.0)
        tl.store(y_ptr + rows[:, None] * syr + cols[None, :], t, mask=m)


def _launch(mistake=0, block_r=16, block_c=32):
    def copy(x):
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(x.shape[0], block_r), triton.cdiv(x.shape[1], block_c))
        _copy[grid](x, y, x.shape[0], x.shape[1], x.stride(0), x.stride(1), y.stride(0),
                    BLOCK_R=block_r, BLOCK_C=block_c, MISTAKE=mistake)
        return y
    return copy


def _by_rows(x):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _copy_rows[(triton.cdiv(x.shape[0], 8),)](x, y, x.shape[0], x.shape[1], x.stride(0), x.stride(1), y.stride(0),
                                             BLOCK_R=8, BLOCK_C=64)
    return y


@pytest.mark.parametrize("fn", [_launch(block_r=32, block_c=16), _by_rows], ids=["32x16", "by-rows"])
def test_correct_copies_pass(fn):
    assert check_tile_copy(fn, seed=0)


@pytest.mark.parametrize("mistake, message", [(1, MSG_ROW_STRIDE_TILE_COPY), (2, MSG_COL_STRIDE), (3, MSG_SWAPPED)],
                         ids=["row-stride", "col-stride", "swapped"])
def test_planted_mistakes_get_their_message(mistake, message):
    with pytest.raises(GradingError) as info:
        check_tile_copy(_launch(mistake), seed=0)
    assert message in str(info.value)


def test_torch_copy_is_not_a_kernel():
    with pytest.raises(GradingError, match="no Triton kernel ran"):
        check_tile_copy(lambda x: x.contiguous().clone(), seed=0)
    assert "no Triton kernel ran" in MSG_NO_KERNEL_TILE_COPY


def _one_column_off(x):
    # A kernel runs, but the copy returned was read one column to the right: the last element
    # comes from the memory after the matrix (a shifted base pointer, or an offset without its mask).
    _launch()(x)
    return torch.as_strided(x, x.shape, x.stride(), x.storage_offset() + x.stride(1)).clone()


def test_reading_outside_the_matrix_shows_the_sentinel():
    with pytest.raises(GradingError) as info:
        check_tile_copy(_one_column_off, seed=0)
    assert MSG_SENTINEL in str(info.value)


# -----------------------------------------------------------------------------
# Proof of work: the copy returned must be written by the learner's own kernel during the call
# -----------------------------------------------------------------------------
def _the_input_itself(x):
    _launch()(x)  # a kernel runs, but what comes back is x
    return x


def _torch_clone(x):
    _launch()(x)
    return x.clone()


def _torch_contiguous(x):
    _launch()(x)
    return x.contiguous()  # x itself where x is contiguous, a torch copy elsewhere


def _copied_into_y_by_torch(x):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y.copy_(x)
    _launch()(x)  # the kernel writes a tensor of its own, not y
    return y


@pytest.mark.parametrize("fn, why", [
    (_the_input_itself, "it is one of the inputs"),
    (_torch_clone, "computed by torch (aten.clone)"),
    (_torch_contiguous, "it is one of the inputs"),
    (_copied_into_y_by_torch, "computed by torch (aten.copy_)"),
], ids=["x-itself", "clone", "contiguous", "copy_-behind-a-kernel"])
def test_a_copy_not_made_by_the_kernel_is_refused(fn, why):
    with pytest.raises(GradingError) as info:
        check_tile_copy(fn, seed=0)
    text = str(info.value)
    assert "y was not written by your Triton kernel" in text and why in text, text


def _copy_then_clear_x(x):
    y = _launch()(x)
    x.zero_()  # the caller's tensor is destroyed
    return y


def test_an_input_edited_in_place_is_refused():
    with pytest.raises(GradingError, match=r"changed its input `x` in place"):
        check_tile_copy(_copy_then_clear_x, seed=0)


def _into_a_bigger_buffer(x):
    # Correct and written differently: y is a view of a larger buffer the kernel writes, the copy
    # is then made contiguous with torch (a copy of the kernel's own output keeps its origin).
    buf = torch.empty((x.shape[0] + 2, x.shape[1] + 3), dtype=x.dtype, device=x.device)
    y = buf[1:1 + x.shape[0], 2:2 + x.shape[1]]
    grid = (triton.cdiv(x.shape[0], 16), triton.cdiv(x.shape[1], 16))
    _copy[grid](x, y, x.shape[0], x.shape[1], x.stride(0), x.stride(1), y.stride(0),
                BLOCK_R=16, BLOCK_C=16, MISTAKE=0)
    return y.contiguous()


def test_a_kernel_writing_a_view_then_a_torch_contiguous_copy_passes():
    assert check_tile_copy(_into_a_bigger_buffer, seed=1)
