"""The course's forward kernels (course_utils.kernels.forward) on the CPU interpreter.

Against the float64 references: fp32 and fp16, MHA/GQA/MQA, causal and not,
N not a multiple of the blocks, non-contiguous layouts, head dims that are not
powers of two. Bad input raises ValueError. And the one-copy rule: the kernels
the solution notebooks teach are this module's kernels, character for character.
"""

import ast
import inspect
import re
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import numpy as np
import pytest
import torch

from course_utils import references as ref
from course_utils.kernels import flash_attention, flash_attention_with_lse, forward

ROOT = Path(__file__).resolve().parent.parent
DEVICE = course_utils.ENV.device  # "cpu" (the interpreter) in CI; the tests also run on a GPU

# (atol, rtol) for o, atol for lse. fp32 tl.dot is exact in the interpreter, tf32 on a GPU.
TOL = {torch.float32: (1e-5, 1e-5, 1e-5) if DEVICE == "cpu" else (3e-3, 3e-3, 3e-3),
       torch.float16: (1e-2, 1e-2, 1e-3), torch.bfloat16: (3e-2, 3e-2, 1e-2)}


def _inputs(b, hq, hkv, n, d, dtype, layout="contiguous", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(DEVICE, dtype)
    if layout == "bnhd":  # [B, N, H, D] memory viewed as [B, H, N, D], as a projection would give
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert not q.is_contiguous()
    elif layout == "sliced":  # rows spaced apart and a head-dim stride of 2
        q, k, v = (torch.stack([t, t], dim=-1)[..., 0] for t in (q, k, v))  # same values, strided
        assert q.stride(-1) == 2
    return q, k, v


def _check(o, lse, q, k, v, causal):
    q64, k64, v64 = (t.double().cpu().numpy() for t in (q, k, v))
    want_o, want_lse = ref.attention_lse(q64, k64, v64, causal=causal)
    atol, rtol, lse_atol = TOL[q.dtype]
    assert o.shape == q.shape and o.dtype == q.dtype and o.device == q.device
    np.testing.assert_allclose(o.double().cpu().numpy(), want_o, atol=atol, rtol=rtol)
    if lse is not None:
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
        np.testing.assert_allclose(lse.double().cpu().numpy(), want_lse, atol=lse_atol, rtol=0)


CASES = [
    # b, hq, hkv, n, d, dtype, layout, causal
    (1, 2, 2, 64, 32, torch.float32, "contiguous", False),  # one block each way
    (2, 2, 2, 100, 64, torch.float32, "contiguous", True),  # tail block, batch
    (1, 4, 2, 77, 48, torch.float16, "bnhd", True),  # GQA, non-power-of-two D, transposed view
    (1, 4, 1, 130, 80, torch.float32, "sliced", False),  # MQA, D=80, head-dim stride 2
    (2, 8, 2, 33, 16, torch.float16, "contiguous", True),  # group 4, N just past a block
]


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype,layout,causal", CASES)
def test_gqa_kernel_matches_reference(b, hq, hkv, n, d, dtype, layout, causal):
    q, k, v = _inputs(b, hq, hkv, n, d, dtype, layout)
    o, lse = forward.flash_attention_gqa_forward(q, k, v, causal=causal)
    _check(o, lse, q, k, v, causal)


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype,layout,causal",
                         [c for c in CASES if c[1] == c[2]] + [(1, 2, 2, 90, 80, torch.float16, "bnhd", True)])
def test_mha_kernel_matches_reference(b, hq, hkv, n, d, dtype, layout, causal):
    q, k, v = _inputs(b, hq, hkv, n, d, dtype, layout)
    _check(forward.flash_attention_forward(q, k, v, causal=causal), None, q, k, v, causal)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 16), (128, 64)])
def test_other_block_sizes(block_m, block_n):
    q, k, v = _inputs(1, 2, 1, 70, 32, torch.float32, seed=1)
    o, lse = forward.flash_attention_gqa_forward(q, k, v, causal=True, block_m=block_m, block_n=block_n)
    _check(o, lse, q, k, v, True)
    o = forward.flash_attention_forward(q[:, :1], k, v, causal=False, block_m=block_m, block_n=block_n)
    _check(o, None, q[:, :1], k, v, False)


def test_public_api():
    q, k, v = _inputs(2, 4, 2, 50, 32, torch.float32, "bnhd", seed=2)
    o, lse = flash_attention_with_lse(q, k, v, causal=True)
    _check(o, lse, q, k, v, True)
    assert torch.equal(flash_attention(q, k, v, causal=True), o)
    _check(flash_attention(q, k, v), None, q, k, v, False)


def test_inputs_are_not_modified_and_output_is_fresh():
    q, k, v = _inputs(1, 2, 2, 40, 16, torch.float32)
    before = [t.clone() for t in (q, k, v)]
    o = flash_attention(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
    assert o.is_contiguous() and o.data_ptr() not in {t.data_ptr() for t in (q, k, v)}


def _bad(**changes):
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    v = torch.randn(1, 2, 8, 16)
    args = dict(q=q, k=k, v=v)
    args.update(changes)
    return args


@pytest.mark.parametrize("args,words", [
    (_bad(k=torch.randn(1, 3, 8, 16), v=torch.randn(1, 3, 8, 16)), "multiple of the number of key/value heads"),
    (_bad(q=torch.randn(1, 4, 8, 8)), "head dim"),
    (_bad(q=torch.randn(1, 4, 8, 512), k=torch.randn(1, 2, 8, 512), v=torch.randn(1, 2, 8, 512)), "between 16 and 256"),
    (_bad(q=torch.randn(4, 8, 16)), "4 dimensions"),
    (_bad(k=torch.randn(1, 2, 9, 16), v=torch.randn(1, 2, 9, 16)), "sequence length"),
    (_bad(k=torch.randn(2, 2, 8, 16), v=torch.randn(2, 2, 8, 16)), "batch size"),
    (_bad(v=torch.randn(1, 2, 8, 16, dtype=torch.float64)), "one dtype"),
    (_bad(q=torch.randn(1, 4, 8, 16, dtype=torch.float64), k=torch.randn(1, 2, 8, 16, dtype=torch.float64),
          v=torch.randn(1, 2, 8, 16, dtype=torch.float64)), "not supported"),
    (_bad(v=torch.randn(1, 1, 8, 16)), "same shape"),
    (_bad(q=np.zeros((1, 4, 8, 16))), "torch tensor"),
    (_bad(q=torch.randn(1, 4, 8, 16, device="meta")), "one device"),
])
def test_bad_input_gets_one_sentence(args, words):
    for fn in (flash_attention, flash_attention_with_lse, forward.flash_attention_gqa_forward):
        with pytest.raises(ValueError, match=re.escape(words)) as info:
            fn(**args)
        message = str(info.value)
        assert message.endswith(".") and "\n" not in message


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what a GPU machine has
    with pytest.raises(ValueError, match="interpreter is off"):
        forward.validate(*(torch.randn(1, 2, 8, 16) for _ in range(3)))


def test_gpus_before_sm80_are_known_to_lack_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert forward._gpu_without_bf16(torch.device("cuda")) == (7, 5)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert forward._gpu_without_bf16(torch.device("cuda")) is None
    assert forward._gpu_without_bf16(torch.device("cpu")) is None


def test_the_capability_is_asked_once_per_device_and_again_of_a_new_answerer(monkeypatch):
    """forward._capability remembers torch's answer per device index, keyed by the function asked too."""
    asked = []
    monkeypatch.setattr(forward, "_CAPABILITIES", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    assert [forward._capability(torch.device("cuda", 0)) for _ in range(3)] == [(9, 0)] * 3
    assert forward._capability(torch.device("cuda", 1)) == (9, 0)
    assert asked == [torch.device("cuda", 0), torch.device("cuda", 1)]
    forward._capability(torch.device("cuda"))  # no index: whichever device is current, never remembered
    forward._capability(torch.device("cuda"))
    assert len(asked) == 4
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4 now
    assert forward._capability(torch.device("cuda", 0)) == (7, 5)
    assert forward._capability(torch.device("cpu")) is None


def test_bf16_on_a_t4_is_refused_by_forward_and_backward(monkeypatch):
    from course_utils.kernels import backward

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    problem = forward.bf16_problem(torch.bfloat16, torch.device("cuda"))
    assert problem == "bfloat16 needs an sm_80 (Ampere) or newer GPU and this one is sm_75: use float16."
    assert forward.bf16_problem(torch.float16, torch.device("cuda")) is None
    assert backward.bf16_problem is forward.bf16_problem  # one rule for both launchers


def test_bf16_refused_by_the_interpreter_and_right_on_a_gpu():
    q, k, v = _inputs(1, 4, 2, 70, 64, torch.float32)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    if course_utils.ENV.interpreter:  # the interpreter computes bf16 wrongly: refuse it
        with pytest.raises(ValueError, match="interpreter"):
            flash_attention(q, k, v)
    else:
        o, lse = flash_attention_with_lse(q, k, v, causal=True)
        _check(o, lse, q, k, v, True)


def test_mha_kernel_refuses_gqa_and_bad_blocks():
    q, k, v = _inputs(1, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="multi-head only"):
        forward.flash_attention_forward(q, k, v)
    with pytest.raises(ValueError, match="multiple of block_n"):
        forward.flash_attention_gqa_forward(q, k, v, block_m=16, block_n=32)
    with pytest.raises(ValueError, match="power of two"):
        forward.flash_attention_gqa_forward(q, k, v, block_m=48, block_n=16)


def test_block_config_per_machine():
    cpu = forward.block_config(64, torch.float32, torch.device("cpu"))
    assert cpu == dict(BLOCK_M=64, BLOCK_N=32)  # no num_warps/num_stages: the interpreter ignores them
    for d in (16, 48, 64, 80, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cfg = forward.block_config(d, dtype, torch.device("cuda"))
            assert cfg["BLOCK_M"] % cfg["BLOCK_N"] == 0 and cfg["num_warps"] in (4, 8) and 2 <= cfg["num_stages"] <= 3
            # K and V tiles in flight plus the Q tile fit in an H100/H200's 228 KB of shared memory
            d_pad = 1 << (d - 1).bit_length()
            size = 4 if dtype == torch.float32 else 2
            smem = (cfg["BLOCK_M"] + 2 * cfg["num_stages"] * cfg["BLOCK_N"]) * d_pad * size
            assert smem <= 228 * 1024, (d, dtype, cfg, smem)
            # Colab's T4 (sm_75): one stage (no asynchronous copies), tiles within its 64 KiB
            t4 = forward.block_config(d, dtype, torch.device("cuda"), capability=(7, 5))
            assert t4["num_stages"] == 1 and (t4["BLOCK_M"] + 2 * t4["BLOCK_N"]) * d_pad * size <= 64 * 1024, (d, dtype, t4)


# -- one copy of each kernel ---------------------------------------------------
def _strip(text: str) -> str:
    """Drop the solution-marker lines and trailing whitespace."""
    from course_utils.build import MARKERS

    lines = [line.rstrip() for line in text.split("\n") if line.strip() not in MARKERS]
    return "\n".join(lines).strip("\n")


def _notebook_jit_functions(name: str) -> dict[str, str]:
    """Source of every ``@triton.jit`` function defined in a solution notebook, by name."""
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / name, as_version=4)
    found = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        lines = cell.source.split("\n")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                first = min(d.lineno for d in node.decorator_list)
                found[node.name] = "\n".join(lines[first - 1:node.end_lineno])
    return found


@pytest.mark.parametrize("notebook,kernels", [
    ("04_flash_attention_forward.ipynb", ["flash_attention_kernel"]),
    ("05_causal_gqa.ipynb", ["attn_fwd_inner", "_flash_attention_forward_gqa_kernel"]),
])
def test_notebook_kernels_are_the_module_kernels(notebook, kernels):
    taught = _notebook_jit_functions(notebook)
    assert set(kernels) <= set(taught), f"{notebook} does not define {set(kernels) - set(taught)}"
    for name in taught:  # every kernel a notebook defines must be the module's copy
        module_src = inspect.getsource(getattr(forward, name).fn)
        assert _strip(taught[name]) == _strip(module_src), f"{notebook}: {name} differs from forward.py"
    for name in kernels:  # and the learner's parts are marked
        assert "### BEGIN SOLUTION" in taught[name] or name == "attn_fwd_inner"


def test_strip_would_notice_a_difference():
    src = inspect.getsource(forward.flash_attention_kernel.fn)
    changed = src.replace("alpha = tl.exp(m_i - m_new)", "alpha = tl.exp(m_new - m_i)")
    assert changed != src and _strip(changed) != _strip(src)
    assert _strip(src + "   \n") == _strip(src)
