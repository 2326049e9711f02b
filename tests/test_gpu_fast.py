"""The fast kernel on a Hopper GPU: autotuned, every configuration, odd shapes.

These tests need an NVIDIA GPU of compute capability 9.x (H100/H200) and are
*skipped* everywhere else, CI included: there the interpreter tests of
``test_kernels_fast.py`` stand in for them. Run them on the GPU machine with

    python -m pytest tests/test_gpu_fast.py

Each output is compared with the course's float64 NumPy references
(``course_utils.references``), so GQA's head map, the causal mask and every
launch order are checked on the real compiler, not only in the interpreter.
"""

import pytest
import torch
import triton

from conftest import skip_if_specialised_on_gpu

from course_utils import references
from course_utils.kernels import fast, flash_attention, flash_attention_with_lse

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200); see test_kernels_fast.py for the CPU tests")


def _inputs(b, hq, hkv, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv)]


def _np(t):
    return t.detach().double().cpu().numpy()


def _reference(q, k, v, causal, sm_scale=None):
    """The course's float64 reference ``(o, lse)``, as float32 tensors on the GPU."""
    o, lse = references.attention_lse(_np(q), _np(k), _np(v), causal=causal, scale=sm_scale)
    return (torch.from_numpy(o).float().cuda(), torch.from_numpy(lse).float().cuda())


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


SPACE = fast.WS_SPACE + fast.CONFIG_SPACE


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


@pytest.mark.skipif(not triton.__version__.startswith("3.6"),
                    reason="compiled into the producer/consumer form with triton 3.6; triton 3.8 refuses it")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_n", [64, 128])
def test_the_warp_specialised_one_warpgroup_launch_is_fa3s_shape_and_correct(causal, block_n):
    """``warp_specialize`` on 4 warps: a producer warpgroup and two 64-row consumers (12 warps in all)."""
    skip_if_specialised_on_gpu(True)
    q, k, v = _inputs(2, 8, 2, 1024, 128, torch.bfloat16, seed=block_n + causal)
    o, lse = fast.launch(q, k, v, causal, block_m=128, block_n=block_n, num_warps=4, num_stages=2,
                         warp_specialize=True, two_phase=False)
    assert fast.LAST_LAUNCH["compiled"].metadata.num_warps == 12
    _assert_close(o, lse, _reference(q, k, v, causal))


@pytest.mark.skipif(not triton.__version__.startswith("3.6"),
                    reason="compiled into the producer/consumer form with triton 3.6; triton 3.8 refuses it")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_n", [64, 128])
def test_the_persistent_warp_specialised_launch_is_fa3s_layout_and_correct(causal, block_n):
    """``persistent=True`` with ``warp_specialize``: one program per SM walks the tiles, its tile loop split into a
    producer and two consumers (12 warps); fewer programs than tiles, so each walks several."""
    skip_if_specialised_on_gpu(True)
    q, k, v = _inputs(2, 8, 2, 1024, 128, torch.bfloat16, seed=block_n + causal + 1)
    o, lse = fast.launch(q, k, v, causal, block_m=128, block_n=block_n, num_warps=4, num_stages=2,
                         warp_specialize=True, two_phase=False, persistent=True, n_programs=37)
    assert fast.LAST_LAUNCH["compiled"].metadata.num_warps == 12
    _assert_close(o, lse, _reference(q, k, v, causal))


def test_public_functions_and_gradients_through_the_fast_forward():
    q, k, v = _inputs(1, 8, 2, 512, 128, torch.bfloat16, seed=11)
    o, lse = flash_attention_with_lse(q, k, v, causal=True)
    _assert_close(o, lse, _reference(q, k, v, True))
    do = torch.randn_like(q)
    expected = [torch.from_numpy(g).float().cuda()
                for g in references.attention_backward(_np(q), _np(k), _np(v), _np(do), causal=True)]
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    flash_attention(qb, kb, vb, causal=True).backward(do)
    for got, want in zip((qb.grad, kb.grad, vb.grad), expected):
        rel = (torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want)).item()
        assert rel < 2e-2, f"relative gradient error {rel:.2e}"


def test_a_specialised_launch_is_refused_on_a_gpu():
    """The one-warpgroup warp-specialised kernels deadlock on the H200 with Triton 3.6 (results/ws_smoke_h200.txt):
    every launcher refuses them on a GPU, in one sentence, before anything is compiled or launched."""
    from course_utils.kernels import fast_backward as fb
    from course_utils.kernels import fast_window, fp8

    q, k, v = _inputs(1, 4, 2, 256, 128, torch.bfloat16, seed=3)
    calls = [lambda: fast.launch(q, k, v, False, num_warps=4, warp_specialize=True),
             lambda: fast.launch(q, k, v, False, num_warps=4, warp_specialize=True, persistent=True),
             lambda: fast_window.launch(q, k, v, window_size=64, warp_specialize=True)]
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    calls.append(lambda: fp8.launch_fp8_hopper(q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs, False, 128,
                                               torch.bfloat16, config=dict(BLOCK_M=128, WARP_SPECIALIZE=True)))
    cfg = fb.FastBackwardConfig("flat", 32, 128, 128, 32, 4, 2, True, True)
    calls.append(lambda: fb.attention_backward_fast(q, k, v, q, torch.zeros(1, 4, 256, device="cuda"), q, True,
                                                    config=cfg))
    for call in calls:
        with pytest.raises(ValueError, match="deadlock on the H200"):
            call()

