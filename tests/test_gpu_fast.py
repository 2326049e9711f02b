"""The fast kernel on a Hopper GPU: autotuned, every configuration, odd shapes.

These tests need an NVIDIA GPU of compute capability 9.x (H100/H200) and are
*skipped* everywhere else, CI included: there the interpreter tests of
``test_kernels_fast.py`` stand in for them. Run them on the GPU machine with

    python -m pytest tests/test_gpu_fast.py

Each output is compared with a float32 PyTorch reference (K/V repeated to the
query heads), so GQA's head map, the causal mask and every launch order are
checked on the real compiler, not only in the interpreter.
"""

import math

import pytest
import torch

from course_utils.kernels import fast, flash_attention, flash_attention_with_lse

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200); see test_kernels_fast.py for the CPU tests")


def _inputs(b, hq, hkv, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv)]


def _reference(q, k, v, causal, sm_scale=None):
    """float32 ``(o, lse)`` with K/V repeated to every query head."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ vf, torch.logsumexp(s, -1)


def _assert_close(o, lse, ref):
    ro, rl = ref
    rel = (torch.linalg.vector_norm(o.float() - ro) / torch.linalg.vector_norm(ro)).item()
    assert rel < 1e-2, f"relative error of o: {rel:.2e}"
    assert (lse - rl).abs().max().item() < 1e-2


SHAPES = [
    # b, hq, hkv, n, d, causal, dtype
    (2, 8, 1, 192, 128, True, torch.bfloat16),  # N a multiple of 64 only; MQA with 8 query heads
    (1, 4, 4, 320, 64, False, torch.float16),  # MHA, D = 64
    (3, 6, 2, 1024, 128, True, torch.float16),
    (1, 32, 8, 2048, 128, True, torch.bfloat16),  # the benchmark's heads
    (2, 4, 2, 512, 64, False, torch.bfloat16),
]


@pytest.mark.parametrize("b, hq, hkv, n, d, causal, dtype", SHAPES)
def test_autotuned_kernel_matches_the_reference(b, hq, hkv, n, d, causal, dtype):
    q, k, v = _inputs(b, hq, hkv, n, d, dtype, seed=n + hq)
    assert fast.is_supported(q, k, v)
    o, lse = fast.attention_forward_fast(q, k, v, causal=causal)
    _assert_close(o, lse, _reference(q, k, v, causal))
    assert fast._TUNE_STATE["error"] is None
    assert fast.best_config(causal) is not None


def test_sm_scale_is_used():
    q, k, v = _inputs(1, 4, 2, 256, 128, torch.bfloat16, seed=3)
    o, lse = fast.attention_forward_fast(q, k, v, causal=True, sm_scale=0.3)
    _assert_close(o, lse, _reference(q, k, v, True, sm_scale=0.3))


SPACE = [c for c in fast.WS_SPACE + fast.CONFIG_SPACE]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("config", SPACE, ids=[str(c) for c in SPACE])
def test_every_configuration_of_the_search_space(config, d):
    bm, bn, w, s, order, ws = config
    if not fast.config_ok(bm, bn, w, 512, d, True, ws):
        pytest.skip("pruned for this head dim: the autotuner never runs it")
    q, k, v = _inputs(2, 8, 2, 512, d, torch.bfloat16, seed=bm + bn + w + s)
    for causal in (True, False):
        o, lse = fast.launch(q, k, v, causal, block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                             order=order, warp_specialize=ws)
        _assert_close(o, lse, _reference(q, k, v, causal))


def test_public_functions_and_gradients_through_the_fast_forward():
    q, k, v = _inputs(1, 8, 2, 512, 128, torch.bfloat16, seed=11)
    o, lse = flash_attention_with_lse(q, k, v, causal=True)
    _assert_close(o, lse, _reference(q, k, v, True))
    qg, kg, vg = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_o, _ = _reference(qg, kg, vg, True)
    do = torch.randn_like(ref_o)
    ref_o.backward(do)
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    flash_attention(qb, kb, vb, causal=True).backward(do.to(q.dtype))
    for got, want in ((qb.grad, qg.grad), (kb.grad, kg.grad), (vb.grad, vg.grad)):
        rel = (torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want)).item()
        assert rel < 2e-2, f"relative gradient error {rel:.2e}"
