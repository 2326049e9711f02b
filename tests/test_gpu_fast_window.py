"""The fast window kernel (course_utils.kernels.fast_window) compiled on a Hopper GPU.

Skipped everywhere else, CI included: there ``test_kernels_fast_window.py`` runs the same kernel in
Triton's interpreter. Outputs, lse and gradients are compared with the course's float64 references.
"""

import pytest
import torch
import triton

from conftest import skip_if_specialised_on_gpu

from course_utils import references
from course_utils.grading import proof
from course_utils.kernels import fast_window, flash_attention, flash_attention_with_lse

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200); see test_kernels_fast_window.py")


def _inputs(b, hq, hkv, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv)]


def _np(t):
    return t.detach().double().cpu().numpy()


def _assert_close(o, lse, q, k, v, window_size, sink_size):
    ro, rl = (torch.from_numpy(a).float().cuda() for a in references.attention_lse(
        _np(q), _np(k), _np(v), causal=True, window_size=window_size, sink_size=sink_size))
    rel = (torch.linalg.vector_norm(o.float() - ro) / torch.linalg.vector_norm(ro)).item()
    assert rel < 1e-2, f"relative error of o: {rel:.2e}"
    assert (lse - rl).abs().max().item() < 1e-2


SHAPES = [
    # b, hq, hkv, n, d, window_size, sink_size, dtype
    (1, 32, 8, 1024, 128, 256, 0, torch.bfloat16),  # the benchmark's heads
    (1, 32, 8, 1024, 128, 300, 4, torch.bfloat16),
    (2, 8, 2, 768, 128, 1024, 4, torch.bfloat16),  # a window longer than N
    (1, 8, 1, 192, 128, 64, 70, torch.float16),  # N not a multiple of 128: 64-row tiles; MQA
    (2, 4, 4, 512, 64, 100, 0, torch.bfloat16),  # MHA, D = 64
    (1, 4, 2, 512, 64, 8, 3, torch.float16),  # a window smaller than a tile
    (1, 2, 1, 6144, 128, 4096, 4, torch.bfloat16),  # long enough for TMA loads (the others are short calls)
]


@pytest.mark.parametrize("b, hq, hkv, n, d, window_size, sink_size, dtype", SHAPES)
def test_the_shipped_launch_matches_the_reference(b, hq, hkv, n, d, window_size, sink_size, dtype):
    q, k, v = _inputs(b, hq, hkv, n, d, dtype, seed=n + window_size)
    assert fast_window.is_supported(q, k, v)
    assert fast_window.is_short_call(q, window_size, sink_size) == (n < 6144)
    o, lse = fast_window.attention_forward_window(q, k, v, window_size=window_size, sink_size=sink_size)
    _assert_close(o, lse, q, k, v, window_size, sink_size)


@pytest.mark.skipif(not triton.__version__.startswith("3.6"),
                    reason="compiled into the producer/consumer form with triton 3.6; triton 3.8 refuses it")
@pytest.mark.parametrize("launch", [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2)], ids=str)
@pytest.mark.parametrize("window_size, sink_size", [(256, 0), (1000, 0), (256, 4), (1000, 130)])
def test_the_warp_specialised_window_launch_is_fa3s_shape_and_correct(launch, window_size, sink_size):
    """tune_window.py --fast's warp-specialised launches, without and with sinks (then the sink tiles and the band
    in one loop): the reference's output."""
    skip_if_specialised_on_gpu(True)
    bm, bn, w, s = launch
    q, k, v = _inputs(1, 8, 2, 2048, 128, torch.bfloat16, seed=window_size + bn + sink_size)
    o, lse = fast_window.launch(q, k, v, window_size=window_size, sink_size=sink_size, block_m=bm, block_n=bn,
                                num_warps=w, num_stages=s, warp_specialize=True)
    _assert_close(o, lse, q, k, v, window_size, sink_size)


LAUNCHES = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3),
            (64, 32, 4, 3), (128, 32, 4, 2)]


@pytest.mark.parametrize("launch", LAUNCHES, ids=str)
def test_every_launch_the_tuning_script_times_is_correct(launch):
    bm, bn, w, s = launch
    q, k, v = _inputs(1, 8, 2, 512, 128, torch.bfloat16, seed=bm + bn + w + s)
    for window_size, sink_size in ((200, 0), (96, 4)):
        o, lse = fast_window.launch(q, k, v, window_size=window_size, sink_size=sink_size, block_m=bm, block_n=bn,
                                    num_warps=w, num_stages=s)
        _assert_close(o, lse, q, k, v, window_size, sink_size)


def test_flash_attention_runs_it_and_its_gradients_are_right():
    q, k, v = _inputs(1, 8, 2, 512, 128, torch.bfloat16, seed=7)
    with proof.count_launches() as launched:
        o, lse = flash_attention_with_lse(q, k, v, True, window_size=160, sink_size=4)
    assert "_attn_fwd_fast_window_kernel" in launched, launched
    _assert_close(o, lse, q, k, v, 160, 4)
    do = torch.randn_like(q)
    expected = [torch.from_numpy(g).float().cuda() for g in references.attention_backward(
        _np(q), _np(k), _np(v), _np(do), causal=True, window_size=160, sink_size=4)]
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    flash_attention(qb, kb, vb, causal=True, window_size=160, sink_size=4).backward(do)
    for got, want in zip((qb.grad, kb.grad, vb.grad), expected):
        rel = (torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want)).item()
        assert rel < 2e-2, f"relative gradient error {rel:.2e}"


def test_the_bound_launches_are_triton_s_launches():
    """The window forward bound once per key (launch.BoundLauncher) gives, bit for bit, the output and lse of the
    same launch through ``kernel[grid]`` (what runs while the graders count launches, which then see it), for a
    short call (pointer loads), a call with TMA descriptors and sinks, and the first again."""
    q, k, v = _inputs(1, 8, 2, 6144, 128, torch.bfloat16, seed=11)
    short = [t[:, :, :1024] for t in (q, k, v)]
    for args, window_size, sink_size in ((short, 256, 0), ((q, k, v), 4096, 4), (short, 256, 0)):
        with proof.count_launches() as launched:
            want = fast_window.attention_forward_window(*args, window_size=window_size, sink_size=sink_size)
        assert launched == ["_attn_fwd_fast_window_kernel"], launched
        for _ in range(2):  # the first call binds the key where no earlier test did; the second runs bound
            got = fast_window.attention_forward_window(*args, window_size=window_size, sink_size=sink_size)
            for name, a, b in zip(("o", "lse"), got, want):
                assert torch.equal(a, b), f"{name} (window_size={window_size}, sink_size={sink_size})"
    assert len(fast_window._WINDOW.compiled) >= 2
