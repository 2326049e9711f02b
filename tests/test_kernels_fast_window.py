"""Lesson 08's window and sinks on the fast kernel (course_utils.kernels.fast_window), on the CPU.

The kernel runs here in Triton's interpreter at fixed launches (``fast_window.launch``), host TMA
descriptors included, against the course's float64 references; the dispatch's routing is checked
with the machine test faked. ``test_gpu_fast_window.py`` runs the same kernel compiled on a Hopper GPU.
"""

import course_utils  # noqa: F401  (before triton: switches the interpreter on)
import numpy as np
import pytest
import torch

from course_utils import references
from course_utils.kernels import fast_window, forward

from conftest import DEVICE, ON_GPU


def _inputs(b, hq, hkv, n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv, hkv)]


def _reference(q, k, v, window_size, sink_size):
    arrays = (t.detach().double().cpu().numpy() for t in (q, k, v))
    return references.attention_lse(*arrays, causal=True, window_size=window_size, sink_size=sink_size)


CASES = [
    # b, hq, hkv, n, d, window_size, sink_size, dtype, launch options
    (1, 4, 2, 256, 32, 64, 0, torch.float32, dict(block_m=64, block_n=32)),  # GQA, TMA
    (1, 4, 2, 256, 32, 48, 4, torch.float32, dict(block_m=64, block_n=32)),  # sinks in a partial tile
    (2, 2, 1, 192, 64, 100, 40, torch.float32, dict(block_m=64, block_n=32, use_tma=False)),  # MQA, pointers
    (1, 2, 2, 256, 32, 16, 3, torch.float32, dict(block_m=64, block_n=16)),  # a window smaller than a tile
    (1, 2, 1, 128, 32, 1000, 5, torch.float32, dict(block_m=64, block_n=64)),  # a window longer than N
    (1, 2, 1, 256, 32, 1, 0, torch.float32, dict(block_m=32, block_n=32)),  # each query sees only itself
    (1, 4, 1, 256, 64, 96, 70, torch.float16, dict(block_m=128, block_n=64)),  # the Hopper tiles, fp16
    (1, 6, 2, 256, 32, 128, 0, torch.float32, dict(block_m=64, block_n=32, order=0)),  # lesson 05's grid order
]


@pytest.mark.parametrize("b, hq, hkv, n, d, window_size, sink_size, dtype, opts", CASES)
def test_launch_matches_the_float64_reference(b, hq, hkv, n, d, window_size, sink_size, dtype, opts):
    q, k, v = _inputs(b, hq, hkv, n, d, dtype, seed=n + window_size)
    o, lse = fast_window.launch(q, k, v, window_size=window_size, sink_size=sink_size, **opts)
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32
    ro, rl = _reference(q, k, v, window_size, sink_size)
    atol = 1e-2 if ON_GPU else (1e-5 if dtype == torch.float32 else 2e-3)
    np.testing.assert_allclose(o.double().cpu().numpy(), ro, atol=atol, rtol=0)
    np.testing.assert_allclose(lse.double().cpu().numpy(), rl, atol=max(atol, 1e-4), rtol=0)


def test_it_agrees_with_lesson_08s_kernel():
    """The same phases and mask as the lesson's window kernel: the same numbers, to fp32 rounding."""
    q, k, v = _inputs(1, 4, 2, 256, 32, seed=5)
    o, lse = fast_window.launch(q, k, v, window_size=80, sink_size=8, block_m=64, block_n=32)
    ro, rl = forward.flash_attention_window_forward(q, k, v, window_size=80, sink_size=8, block_m=64, block_n=32)
    torch.testing.assert_close(o, ro, atol=1e-5 if not ON_GPU else 1e-2, rtol=0)
    torch.testing.assert_close(lse, rl, atol=1e-5 if not ON_GPU else 1e-2, rtol=0)


def test_launch_rejects_ragged_tiles():
    q, k, v = _inputs(1, 2, 1, 192, 32)
    with pytest.raises(ValueError, match="multiple of BLOCK_M=128"):
        fast_window.launch(q, k, v, window_size=64, block_m=128, block_n=64)
    with pytest.raises(ValueError, match="BLOCK_M of BLOCK_N"):
        fast_window.launch(q[:, :, :128], k[:, :, :128], v[:, :, :128], window_size=64, block_m=32, block_n=64)


@pytest.mark.parametrize("n, block_m", [(4096, 128), (192, 64), (8256, 64)])
def test_hopper_config_tiles_divide_n(n, block_m):
    cfg = fast_window.hopper_config(1024, 128, n)
    assert cfg["block_m"] == block_m and n % cfg["block_m"] == 0 and n % cfg["block_n"] == 0
    assert cfg["block_m"] % cfg["block_n"] == 0


def test_the_dispatch_routes_windows_to_the_fast_kernel_where_it_is_supported(monkeypatch):
    """kernels.dispatch decides once: the fast window kernel where the fast kernel runs, else lesson 08's."""
    import course_utils.kernels as kernels

    q, k, v = _inputs(1, 2, 1, 64, 16)
    sentinel = (torch.zeros_like(q), torch.zeros(1, 2, 64, device=DEVICE))
    calls = []
    monkeypatch.setattr(kernels.fast, "is_supported", lambda *a: True)
    monkeypatch.setattr(fast_window, "attention_forward_window", lambda *a, **kw: calls.append(kw) or sentinel)
    assert kernels.flash_attention_with_lse(q, k, v, True, window_size=16, sink_size=2) is sentinel
    assert calls == [dict(window_size=16, sink_size=2)]
    monkeypatch.setattr(kernels.fast, "is_supported", lambda *a: False)
    o, lse = kernels.flash_attention_with_lse(q, k, v, True, window_size=16, sink_size=2)
    ro, rl = _reference(q, k, v, 16, 2)
    np.testing.assert_allclose(o.double().cpu().numpy(), ro, atol=1e-2 if ON_GPU else 1e-5, rtol=0)
    assert len(calls) == 1
