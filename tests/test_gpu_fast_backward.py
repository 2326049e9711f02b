"""The fast backward on a Hopper GPU: every configuration in ``fast_backward.CONFIGS``, both modes.

These tests need an NVIDIA GPU of compute capability 9.x (H100/H200) and are
*skipped* everywhere else, CI included: there ``test_kernels_fast_backward.py``
runs the same kernel in the interpreter. Run them on the GPU machine with

    python -m pytest tests/test_gpu_fast_backward.py

Gradients are compared with the course's float64 reference
(``course_utils.references.attention_backward``), so the compiled kernel's
tiles, masks and GQA sums are checked on the real compiler.
"""

import pytest
import torch
import triton

from conftest import skip_if_specialised_on_gpu

from course_utils import references
from course_utils.kernels import fast_backward as fb
from course_utils.kernels import flash_attention, flash_attention_with_lse
from course_utils.kernels.backward import attention_backward

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200); see test_kernels_fast_backward.py")


def _inputs(b, hq, hkv, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(q.shape, device="cuda", dtype=dtype, generator=g)


def _float64_grads(q, k, v, do, causal):
    """The course's float64 reference gradients (``references.attention_backward``), as tensors."""
    arrays = (t.detach().double().cpu().numpy() for t in (q, k, v, do))
    return tuple(torch.from_numpy(g) for g in references.attention_backward(*arrays, causal=causal))


def _assert_close(got, ref):
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        rel = (torch.linalg.vector_norm(a.double().cpu() - r) / torch.linalg.vector_norm(r)).item()
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"


SHAPES = [
    # b, hq, hkv, n, d, causal, dtype
    (1, 32, 8, 1024, 128, True, torch.bfloat16),  # the benchmark's heads
    (2, 4, 4, 512, 64, False, torch.float16),  # MHA, D = 64
    (1, 8, 1, 256, 128, False, torch.bfloat16),  # MQA
    (2, 6, 2, 384, 128, True, torch.float16),
]


@pytest.mark.parametrize("config", fb.CONFIGS, ids=lambda c: c.short().replace(" ", "_"))
@pytest.mark.parametrize("b, hq, hkv, n, d, causal, dtype", SHAPES)
def test_every_configuration_matches_float64(config, b, hq, hkv, n, d, causal, dtype):
    q, k, v, do = _inputs(b, hq, hkv, n, d, dtype, seed=n + hq)
    if not fb.supports(q, k, v, config):
        pytest.skip(fb.unsupported_reason(q, k, v, config))
    o, lse = flash_attention_with_lse(q, k, v, causal=causal)
    got = fb.attention_backward_fast(q, k, v, o, lse, do, causal, config=config)
    assert all(g.dtype == dtype for g in got)
    _assert_close(got, _float64_grads(q, k, v, do, causal))


def _tuning_script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLAT = [fb.FastBackwardConfig(*c) for c in _tuning_script("tune_backward").FLAT]


@pytest.mark.parametrize("config", FLAT, ids=lambda c: c.short().replace(" ", "_"))
@pytest.mark.parametrize("b, hq, hkv, n, d, causal, dtype", SHAPES)
def test_every_flat_configuration_matches_float64_and_specialises(config, b, hq, hkv, n, d, causal, dtype):
    """The flat mode's launches that tune_backward.py --flat times: float64 math's gradients, and a warp-specialised
    one-warpgroup launch compiled into a producer and two consumer warpgroups (12 warps)."""
    skip_if_specialised_on_gpu(config.warp_specialize, config.num_warps)
    q, k, v, do = _inputs(b, hq, hkv, n, d, dtype, seed=n + hq + 1)
    if not fb.supports(q, k, v, config):
        pytest.skip(fb.unsupported_reason(q, k, v, config))
    o, lse = flash_attention_with_lse(q, k, v, causal=causal)
    stats = {}
    got = fb.attention_backward_fast(q, k, v, o, lse, do, causal, config=config, stats=stats)
    assert all(g.dtype == dtype for g in got)
    _assert_close(got, _float64_grads(q, k, v, do, causal))
    if config.warp_specialize and config.num_warps == 4:
        assert stats["warps"] == 12, stats
        if config.flat_dq:  # the dQ loop specialises too
            assert stats["dq"]["warps"] == 12, stats


FLAT_WINDOW = [fb.FastBackwardConfig(*c) for c in _tuning_script("tune_window").FLAT_BACKWARD_CANDIDATES]


@pytest.mark.parametrize("config", FLAT_WINDOW, ids=lambda c: c.short().replace(" ", "_"))
@pytest.mark.parametrize("window_size", [100, 256, 1000])
def test_the_flat_mode_with_a_window_matches_float64(config, window_size):
    """tune_window.py --backward's flat launches: lesson 08's window, no sinks, GQA 8/2, D = 128."""
    skip_if_specialised_on_gpu(config.warp_specialize, config.num_warps)
    q, k, v, do = _inputs(1, 8, 2, 1024, 128, torch.bfloat16, seed=window_size)
    o, lse = flash_attention_with_lse(q, k, v, True, window_size=window_size)
    got = fb.attention_backward_fast(q, k, v, o, lse, do, True, config=config, window_size=window_size)
    arrays = (t.detach().double().cpu().numpy() for t in (q, k, v, do))
    ref = tuple(torch.from_numpy(g) for g in references.attention_backward(*arrays, causal=True, window_size=window_size))
    _assert_close(got, ref)


def test_autograd_stays_on_lesson_07_kernels_and_is_deterministic():
    q, k, v, do = _inputs(1, 32, 8, 2048, 128, torch.bfloat16, seed=3)
    runs = []
    for _ in range(2):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        flash_attention(qq, kk, vv, causal=True).backward(do)
        runs.append((qq.grad, kk.grad, vv.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "the default backward must give the same bits every run"
    o, lse = flash_attention_with_lse(q, k, v, causal=True)
    lesson = attention_backward(q, k, v, o, lse, do, True)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], lesson)), "autograd runs lesson 07's kernels"
    _assert_close(runs[0], _float64_grads(q, k, v, do, True))
