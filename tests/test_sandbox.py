"""A learner's kernel that faults, hangs or crashes is contained, on the CPU and on a GPU.

The same tests run on both machines. On the CPU the checks fork a child (an
out-of-bounds access segfaults the interpreter there); on a GPU they run in a
worker process with its own CUDA context (a far store faults CUDA there and
leaves that context unusable). Either way the message says what happened,
and the next correct check in the same process passes.
"""

import time

import course_utils  # noqa: F401  (before triton: switches the interpreter on)
import pytest
import torch
import triton
import triton.language as tl

from course_utils.grading import GradingError, check_flash_forward
from course_utils import transport
from course_utils.grading import isolation, outcome

from conftest import DEVICE, ON_GPU


@triton.jit
def _learner_forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                            sob, soh, son, sod, H, N, scale, D: tl.constexpr, D_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, FAULT: tl.constexpr, HANG: tl.constexpr):
    # A learner's plain FlashAttention forward (one query block per program), with two
    # planted mistakes behind flags: a store 2**40 elements away, and a loop that never ends.
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd,
                mask=(rows[:, None] < N) & (d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    end = tl.minimum((pid_m + 1) * BLOCK_M, N) if IS_CAUSAL else N
    if HANG:
        end = end + (tl.load(q_ptr) == tl.load(q_ptr)).to(tl.int32) * 2_000_000_000  # "the last key"
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols[None, :] < N
        if IS_CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None])
        kv_ok = (cols[:, None] < N) & (d[None, :] < D)
        k = tl.load(k_ptr + b * skb + h * skh + cols[:, None] * skn + d[None, :] * skd, mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + b * svb + h * svh + cols[:, None] * svn + d[None, :] * svd, mask=kv_ok, other=0.0)
        s = tl.where(ok, tl.dot(q, tl.trans(k)).to(tl.float32) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = o_ptr + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod
    if FAULT:
        out = out + (1 << 40)
    tl.store(out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=(rows[:, None] < N) & (d[None, :] < D))


def _launcher(fault=False, hang=False):
    def forward(q, k, v, causal=False):
        B, H, N, D = q.shape
        o = torch.empty_like(q)
        grid = (triton.cdiv(N, 32), B * H)
        _learner_forward_kernel[grid](q, k, v, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                                      H, N, D ** -0.5, D=D, D_PAD=max(16, triton.next_power_of_2(D)), IS_CAUSAL=causal, BLOCK_M=32, BLOCK_N=32,
                                      FAULT=fault, HANG=hang)
        return o
    return forward


correct_forward = _launcher()


def test_a_correct_learner_kernel_passes():
    assert check_flash_forward(correct_forward)


def test_a_faulting_kernel_gets_a_message_and_the_next_check_passes():
    expected = "made the GPU fault" if ON_GPU else "crashed the grading process"
    with pytest.raises(GradingError, match=expected) as info:
        check_flash_forward(_launcher(fault=True))
    assert "mask=" in str(info.value) and "Your notebook is fine" in str(info.value)
    if ON_GPU:
        assert "check_on_cpu(check_flash_forward" in str(info.value)
    assert check_flash_forward(correct_forward)  # the same process, right after
    x = torch.ones(4, device=DEVICE)
    assert (x @ x).item() == 4  # and this process's device still works


def test_a_kernel_that_never_ends_is_stopped_by_the_time_limit():
    check_flash_forward(correct_forward)  # compile and start the worker first: the limit is for the check
    start = time.monotonic()
    with pytest.raises(GradingError, match="did not finish within 20 s"):
        check_flash_forward(_launcher(hang=True), timeout_s=20)
    assert time.monotonic() - start < 60
    assert check_flash_forward(correct_forward)


def test_a_function_that_cannot_travel_runs_here_and_says_so_once(capsys):
    # A generator in the closure cannot be pickled: the check falls back to this process.
    gen = (i for i in range(3))

    def forward(q, k, v, causal=False):
        assert gen is not None
        return correct_forward(q, k, v, causal)

    isolation._TOLD_IN_PROCESS = False
    assert check_flash_forward(forward, isolate="worker")
    assert check_flash_forward(forward, isolate="worker")
    err = capsys.readouterr().err
    assert err.count("runs your code in this notebook's own process") == 1


def test_in_process_cuda_fault_is_explained_in_one_sentence():
    text = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert outcome.is_cuda_fault(text) and not outcome.is_cuda_fault("ValueError: shapes differ")
    message = outcome.cuda_fault_message("check_flash_gqa", text, in_process=True)
    assert "restart the kernel" in message and "check_on_cpu(check_flash_gqa" in message


def test_kernels_from_a_notebook_travel_by_source():
    # A kernel defined in a notebook cell has no file: it reaches the worker as source.
    import linecache
    import pickle

    src = ("import triton, triton.language as tl\n"
           "@triton.jit\n"
           "def cell_kernel(x, N: tl.constexpr):\n"
           "    offs = tl.arange(0, N)\n"
           "    tl.store(x + offs, tl.load(x + offs) + 1)\n")
    filename = "<ipython-input-7-cell>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(src, filename, "exec"), namespace)
    payload = transport.dumps(namespace["cell_kernel"])
    del linecache.cache[filename]  # as in another process
    rebuilt = pickle.loads(payload)
    assert rebuilt is not namespace["cell_kernel"] and type(rebuilt) is type(namespace["cell_kernel"])
    x = torch.zeros(8, device=DEVICE)
    rebuilt[(1,)](x, N=8)
    assert x.sum().item() == 8


def test_kernels_of_two_cells_keep_their_own_source_in_the_worker():
    # cloudpickle names every code object it sends "<dynamic-code>". Two cells whose kernels sit one
    # line apart must not share that name in the worker: the higher kernel would take in the other's
    # last (indented) line and fail to parse (seen on the H200 with planted backward kernels).
    import inspect
    import linecache
    import pickle

    body = ("@triton.jit\n"
            "def cell_kernel(x, N: tl.constexpr):\n"
            "    offs = tl.arange(0, N)\n"
            "    tl.store(x + offs,\n"
            "             tl.load(x + offs) + {add})\n")
    payloads = []
    for name, blank_lines, add in (("<cell-a>", 2, 1), ("<cell-b>", 1, 2)):
        src = "import triton, triton.language as tl\n" + "\n" * blank_lines + body.format(add=add)
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        namespace = {"__name__": "__main__"}
        exec(compile(src, name, "exec"), namespace)
        payloads.append(transport.dumps(namespace["cell_kernel"]))
        del linecache.cache[name]  # as in another process
    for add, payload in ((1, payloads[0]), (2, payloads[1])):
        kernel = pickle.loads(payload)
        assert inspect.getsource(kernel.fn) == body.format(add=add)  # what a compiled kernel parses
        x = torch.zeros(8, device=DEVICE)
        kernel[(1,)](x, N=8)
        assert x.sum().item() == 8 * add
