"""check_tma_transpose (lesson 11, exercise 4): V made K-major by the learner's kernel, through tensor descriptors.

Correct answers written differently (device descriptors, host descriptors, another box height) pass; each
planted mistake gets its own sentence: coordinates given in tiles, the box stored without its transpose,
pointer loads instead of descriptors, torch's transpose behind a kernel, v edited in place, v.T returned.
"""

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import pytest
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from course_utils.grading import GradingError, check_tma_transpose
from course_utils.grading import part7_hopper as p7


def _allocator(device):
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


@triton.jit
def _device_kernel(V, VT, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    v_desc = tl.make_tensor_descriptor(V, shape=[R, D], strides=[D, 1], block_shape=[BLOCK_R, D])
    vt_desc = tl.make_tensor_descriptor(VT, shape=[D, R], strides=[R, 1], block_shape=[D, BLOCK_R])
    row = tl.program_id(0) * BLOCK_R
    vt_desc.store([0, row], tl.trans(v_desc.load([row, 0])))


@triton.jit
def _host_kernel(v_desc, vt_desc, BLOCK_R: tl.constexpr):
    row = tl.program_id(0) * BLOCK_R
    vt_desc.store([0, row], tl.trans(v_desc.load([row, 0])))


@triton.jit
def _tile_index_kernel(V, VT, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    v_desc = tl.make_tensor_descriptor(V, shape=[R, D], strides=[D, 1], block_shape=[BLOCK_R, D])
    vt_desc = tl.make_tensor_descriptor(VT, shape=[D, R], strides=[R, 1], block_shape=[D, BLOCK_R])
    pid = tl.program_id(0)
    vt_desc.store([0, pid], tl.trans(v_desc.load([pid, 0])))


@triton.jit
def _untransposed_kernel(V, VT, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    v_desc = tl.make_tensor_descriptor(V, shape=[R, D], strides=[D, 1], block_shape=[BLOCK_R, D])
    out_desc = tl.make_tensor_descriptor(VT, shape=[R, D], strides=[D, 1], block_shape=[BLOCK_R, D])
    row = tl.program_id(0) * BLOCK_R
    out_desc.store([row, 0], v_desc.load([row, 0]))


@triton.jit
def _pointer_kernel(V, VT, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    keep = rows[:, None] < R
    tile = tl.load(V + rows[:, None] * D + cols[None, :], mask=keep)
    tl.store(VT + cols[None, :] * R + rows[:, None], tile, mask=keep)


def _launch(kernel, block_r=64):
    def transpose_tma(v):
        vt = torch.empty((v.shape[1], v.shape[0]), dtype=v.dtype, device=v.device)
        _allocator(v.device)
        kernel[(triton.cdiv(v.shape[0], block_r),)](v, vt, v.shape[0], D=v.shape[1], BLOCK_R=block_r)
        return vt

    return transpose_tma


def _host(v, block_r=32):
    vt = torch.empty((v.shape[1], v.shape[0]), dtype=v.dtype, device=v.device)
    _host_kernel[(triton.cdiv(v.shape[0], block_r),)](TensorDescriptor.from_tensor(v, [block_r, v.shape[1]]),
                                                      TensorDescriptor.from_tensor(vt, [v.shape[1], block_r]),
                                                      BLOCK_R=block_r)
    return vt


@pytest.mark.parametrize("fn", [_launch(_device_kernel), _launch(_device_kernel, 16), _host],
                         ids=["device-descriptors", "16-row-boxes", "host-descriptors"])
def test_correct_transposes_pass(fn):
    assert check_tma_transpose(fn)


def _torch_behind_a_kernel(v):
    vt = _launch(_pointer_kernel)(v)
    return vt.copy_(v.T)


def _edits_v(v):
    vt = _launch(_device_kernel)(v)
    v.mul_(2.0)
    return vt


def _view(v):
    _launch(_device_kernel)(v)
    return v.T


@pytest.mark.parametrize("fn, message", [
    pytest.param(_launch(_tile_index_kernel), p7.MSG_TMA_TILE_COORDS, marks=pytest.mark.interpreter(
        "the interpreter asserts a box's 16-byte alignment; on a GPU a misaligned box is a hardware fault")),
    (_launch(_untransposed_kernel), p7.MSG_TMA_NOT_TRANSPOSED),
    (_launch(_pointer_kernel), p7.MSG_NO_DESCRIPTOR),
    (_torch_behind_a_kernel, "computed by torch"),
    (_edits_v, "changed its input `v` in place"),
    (_view, "it is one of the inputs|not written by your"),
    (lambda v: v.T.contiguous(), p7.MSG_NO_KERNEL_TMA),
], ids=["tile-coordinates", "not-transposed", "pointer-loads", "torch-behind-a-kernel", "v-in-place", "v.T-view",
        "no-kernel"])
def test_mistakes_get_their_sentence(fn, message):
    with pytest.raises(GradingError) as info:
        check_tma_transpose(fn)
    text = str(info.value)
    if message.startswith(("the ", "vt ", "your kernel", "no Triton")):
        assert message.split("`")[0][:70] in text, text
    else:
        assert any(m in text for m in message.split("|")), text


def test_the_launcher_is_asked_for_not_the_kernel():
    with pytest.raises(GradingError, match="pass your launcher"):
        check_tma_transpose(_device_kernel)
