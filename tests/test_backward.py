"""The backward pass: NumPy references, the Triton kernels, the autograd wiring.

- the float64 references agree with torch autograd and with each other;
- ``attention_backward`` (Triton, in the CPU interpreter here) matches the
  references for fp32/fp16, MHA/GQA/MQA, causal or not, N not a multiple of
  the blocks, head dims that are not powers of two, non-contiguous inputs,
  ``Nq != Nk`` and several block configurations;
- ``torch.autograd.gradcheck`` on float64 (the interpreter runs fp64 kernels);
- ``FlashAttentionFunction`` end to end (Triton forward + Triton backward);
- bad input raises ``ValueError``;
- the lesson notebook's kernels are this module's kernels, character for character.
"""

import inspect
import json
import re
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import numpy as np
import pytest
import torch

from course_utils import references as ref
from course_utils.kernels import backward as bw
from course_utils.kernels.forward import bf16_problem

from conftest import DEVICE, tolerance

ROOT = Path(__file__).resolve().parent.parent


def _rand(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)


def _np(t):
    return t.detach().double().cpu().numpy()


# -----------------------------------------------------------------------------
# references
# -----------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (3, 1)])
def test_reference_backward_matches_torch_autograd(causal, heads):
    hq, hkv = heads
    q, do = _rand((2, hq, 19, 8), 1, torch.float64), _rand((2, hq, 19, 8), 2, torch.float64)
    k, v = _rand((2, hkv, 19, 8), 3, torch.float64), _rand((2, hkv, 19, 8), 4, torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    g = hq // hkv
    hidden = torch.ones(19, 19, dtype=torch.bool, device=DEVICE).triu(1)
    if not causal:
        hidden.zero_()
    s = leaves[0] @ leaves[1].repeat_interleave(g, 1).transpose(-1, -2) / np.sqrt(8)
    o = torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ leaves[2].repeat_interleave(g, 1)
    o.backward(do)
    got = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=causal)
    for mine, leaf in zip(got, leaves):
        np.testing.assert_allclose(mine, _np(leaf.grad), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("blocks", [(1, 1), (4, 8), (16, 4), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_reference_matches_the_full_one(blocks, causal):
    rng = np.random.default_rng(0)
    q, do = rng.standard_normal((2, 4, 21, 8)), rng.standard_normal((2, 4, 21, 8))
    k, v = rng.standard_normal((2, 2, 30, 8)), rng.standard_normal((2, 2, 30, 8))
    o, lse = ref.attention_lse(q, k, v, causal=causal)
    want = ref.attention_backward(q, k, v, do, causal=causal)
    got = ref.tiled_attention_backward(q, k, v, o, lse, do, *blocks, causal=causal)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-12, rtol=1e-10)


def test_sum_kv_groups_is_the_adjoint_of_repeat_kv_heads():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, 3, 5, 4))
    q = np.zeros((2, 6, 5, 4))
    big = rng.standard_normal((2, 6, 5, 4))
    k_rep, _ = ref.repeat_kv_heads(q, k, k)
    # <repeat(k), big> == <k, sum_groups(big)>
    assert np.isclose(np.sum(k_rep * big), np.sum(k * ref.sum_kv_groups(big, 2)))


def test_references_reject_bad_shapes():
    q, k = np.zeros((3, 4, 8)), np.zeros((2, 4, 8))
    with pytest.raises(ValueError):
        ref.attention_backward(q, k, k, q, causal=False)
    with pytest.raises(ValueError):
        ref.attention_backward(np.zeros((2, 4, 8)), k, k, np.zeros((2, 4, 5)))
    q = np.zeros((2, 4, 8))
    o, lse = ref.attention_lse(q, k, k)
    with pytest.raises(ValueError):
        ref.tiled_attention_backward(q, k, k, o, lse, q, 0, 4)
    with pytest.raises(ValueError):
        ref.tiled_attention_backward(q, k, k, o, lse[..., :3], q, 4, 4)


# -----------------------------------------------------------------------------
# the Triton kernels
# -----------------------------------------------------------------------------
def _run_kernel(B, hq, hkv, n_q, n_k, d, causal, dtype, *, transposed=False, config=None, seed=0):
    q64, do64 = _rand((B, hq, n_q, d), seed, torch.float64), _rand((B, hq, n_q, d), seed + 1, torch.float64)
    k64, v64 = _rand((B, hkv, n_k, d), seed + 2, torch.float64), _rand((B, hkv, n_k, d), seed + 3, torch.float64)
    q, k, v, do = (t.to(dtype) for t in (q64, k64, v64, do64))
    if transposed:  # [B, N, H, D] storage viewed as [B, H, N, D]
        q, k, v, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
        assert not q.is_contiguous()
    qn, kn, vn, don = (_np(t) for t in (q, k, v, do))
    o, lse = ref.attention_lse(qn, kn, vn, causal=causal)
    got = bw.attention_backward(q, k, v, torch.from_numpy(o).to(DEVICE, dtype), torch.from_numpy(lse).to(DEVICE, torch.float32), do,
                                causal=causal, config=config)
    want = ref.attention_backward(qn, kn, vn, don, causal=causal)
    return got, want, (q, k, v)


CASES = [
    # B, hq, hkv, n_q, n_k, d, causal, dtype, transposed, config
    (1, 2, 2, 64, 64, 16, False, torch.float32, False, None),  # MHA, N a multiple of every block
    (2, 4, 2, 37, 37, 24, True, torch.float32, True, None),  # GQA, odd N, D padded, non-contiguous
    (1, 3, 1, 50, 50, 16, True, torch.float16, False, None),  # MQA, fp16
    (1, 4, 2, 45, 45, 32, False, torch.float16, True, bw.BackwardConfig(16, 32, 32, 16)),
    (1, 2, 1, 70, 70, 40, True, torch.float32, False, bw.BackwardConfig(16, 16, 16, 16)),
    (1, 2, 2, 23, 41, 16, True, torch.float32, False, bw.BackwardConfig(16, 32, 32, 16)),  # Nq < Nk
    (1, 2, 1, 41, 23, 16, True, torch.float32, False, bw.BackwardConfig(16, 32, 32, 16)),  # Nq > Nk
]


@pytest.mark.parametrize("B,hq,hkv,n_q,n_k,d,causal,dtype,transposed,config", CASES)
def test_triton_backward_matches_reference(B, hq, hkv, n_q, n_k, d, causal, dtype, transposed, config):
    got, want, inputs = _run_kernel(B, hq, hkv, n_q, n_k, d, causal, dtype, transposed=transposed, config=config)
    tol = tolerance(dtype)
    for name, g, w, x in zip(("dq", "dk", "dv"), got, want, inputs):
        assert g.dtype == x.dtype and tuple(g.shape) == tuple(x.shape), name
        np.testing.assert_allclose(_np(g), w, atol=tol, rtol=tol, err_msg=name)


def test_triton_backward_is_deterministic():
    a, _, _ = _run_kernel(1, 4, 2, 40, 40, 16, True, torch.float32, seed=5)
    b, _, _ = _run_kernel(1, 4, 2, 40, 40, 16, True, torch.float32, seed=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


class _ReferenceForward(torch.autograd.Function):
    """float64 attention by torch math (the course forward has no fp64) + the Triton backward.

    gradcheck then compares the Triton backward with finite differences of
    exact attention: it tests the backward kernels, in float64, through autograd.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = ref.attention_lse(_np(q), _np(k), _np(v), causal=causal)
        o, lse = torch.from_numpy(o).to(DEVICE), torch.from_numpy(lse).to(DEVICE)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*bw.attention_backward(q, k, v, o, lse, do, causal=ctx.causal, config=bw.BackwardConfig(16, 16, 16, 16)), None)


def test_gradcheck_float64():
    # Slow mode on a tiny problem (one backward per output element): fast_mode
    # was measured to pass a dK doubled by mistake at N=21, its projected
    # tolerance being loose, while this rejects dK off by 1%. D=4 is padded
    # to 16 inside the kernel; causal with GQA (2 query heads, 1 kv head).
    q = _rand((1, 2, 5, 4), 7, torch.float64).requires_grad_()
    k = _rand((1, 1, 5, 4), 8, torch.float64).requires_grad_()
    v = _rand((1, 1, 5, 4), 9, torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: _ReferenceForward.apply(a, b, c, True), (q, k, v),
                                    eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("entry", ["flash_attention_differentiable", "kernels.flash_attention"])
def test_autograd_function_end_to_end(entry):
    from course_utils import kernels

    q = _rand((2, 4, 45, 32), 11).requires_grad_()
    k = _rand((2, 2, 45, 32), 12).requires_grad_()
    v = _rand((2, 2, 45, 32), 13).requires_grad_()
    do = _rand((2, 4, 45, 32), 14)
    fn = bw.flash_attention_differentiable if entry == "flash_attention_differentiable" else kernels.flash_attention
    o = fn(q, k, v, causal=True)
    assert o.grad_fn is not None and type(o.grad_fn).__name__.startswith("FlashAttentionFunction")
    o.backward(do)
    want = ref.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=True)
    tol = tolerance(torch.float32)
    np.testing.assert_allclose(_np(o), ref.attention(_np(q), _np(k), _np(v), causal=True), atol=tol / 2, rtol=tol / 2)
    for leaf, w in zip((q, k, v), want):
        np.testing.assert_allclose(_np(leaf.grad), w, atol=tol, rtol=tol)


def test_public_flash_attention_skips_autograd_when_no_grad_is_needed():
    from course_utils import kernels

    q, k, v = (_rand((1, 2, 40, 16), s) for s in (1, 2, 3))
    assert kernels.flash_attention(q, k, v).grad_fn is None
    with torch.no_grad():
        assert kernels.flash_attention(q.requires_grad_(), k, v).grad_fn is None


def test_bad_input_raises_value_error():
    torch.set_default_device(DEVICE)  # every tensor below, on the kernels' device
    try:
        _bad_inputs()
    finally:
        torch.set_default_device(None)


def _bad_inputs():
    q, k = torch.zeros(1, 3, 16, 16), torch.zeros(1, 2, 16, 16)
    lse = torch.zeros(1, 3, 16)
    with pytest.raises(ValueError, match="kv heads"):
        bw.attention_backward(q, k, k, q, lse, q)
    q = torch.zeros(1, 4, 16, 16)
    with pytest.raises(ValueError, match="lse"):
        bw.attention_backward(q, k, k, q, torch.zeros(1, 4, 15), q)
    with pytest.raises(ValueError, match="dtype"):
        qi = q.to(torch.int32)
        bw.attention_backward(qi, k.to(torch.int32), k.to(torch.int32), qi, torch.zeros(1, 4, 16), qi)
    with pytest.raises(ValueError, match="head dim"):
        big = torch.zeros(1, 2, 4, 300)
        bw.attention_backward(big, big, big, big, torch.zeros(1, 2, 4), big)
    with pytest.raises(ValueError, match="4-d"):
        bw.attention_backward(q[0], k, k, q, torch.zeros(1, 4, 16), q)
    h = torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16)
    if bf16_problem(torch.bfloat16, h.device):  # the interpreter, or a GPU before sm_80
        with pytest.raises(ValueError, match="bfloat16"):
            bw.attention_backward(h, h, h, h, torch.zeros(1, 2, 16), h)
    with pytest.raises(ValueError, match="multiple"):
        bw.BackwardConfig(32, 48, 64, 32)


# -----------------------------------------------------------------------------
# one copy of each kernel: the notebook defines the same @triton.jit functions
# -----------------------------------------------------------------------------
MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")
KERNELS = ("load_tile", "store_tile", "attn_bwd_preprocess", "dkdv_inner", "_attn_bwd_dkdv", "_dq_inner", "_attn_bwd_dq")


def _strip(text):
    lines = [line.rstrip() for line in text.split("\n") if line.strip() not in MARKERS]
    return "\n".join(lines).strip("\n")


def _notebook_functions(path):
    """Every ``@triton.jit`` function defined in the notebook's code cells, by name."""
    cells = json.loads(path.read_text())["cells"]
    found = {}
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        lines = _strip("".join(cell["source"])).split("\n")
        for i, line in enumerate(lines):
            match = re.match(r"def (\w+)\(", lines[i + 1]) if line == "@triton.jit" and i + 1 < len(lines) else None
            if not match:
                continue
            body = lines[i:i + 2]
            for rest in lines[i + 2:]:  # the body: indented lines, blank lines, the signature's ")"
                if rest and not rest.startswith((" ", "\t", ")")):
                    break
                body.append(rest)
            found[match.group(1)] = "\n".join(body).strip("\n")
    return found


def test_notebook_kernels_are_the_package_kernels():
    path = ROOT / "solutions" / "07_backward.ipynb"
    assert path.exists(), "solutions/07_backward.ipynb is missing"
    in_notebook = _notebook_functions(path)
    for name in KERNELS:
        assert name in in_notebook, f"{name} is not defined in the notebook"
        package = _strip(inspect.getsource(getattr(bw, name).fn))
        assert in_notebook[name] == package, f"{name} differs between the notebook and course_utils/kernels/backward.py"
