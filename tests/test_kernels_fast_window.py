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

from conftest import DEVICE, ON_GPU, skip_if_specialised_on_gpu


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


# The one-loop form (warp_specialize): 16-bit inputs and TMA loads, as fast._validate_warp_specialize asks;
# each case compiled for sm_90 with triton 3.6 into a producer and two consumers (12 warps).
ONE_LOOP_CASES = [
    (1, 4, 2, 512, 64, 100, 4, torch.float16, dict(block_m=128, block_n=64)),  # sinks in a partial tile
    (1, 2, 1, 512, 64, 200, 70, torch.float16, dict(block_m=128, block_n=64)),  # sinks over two tiles
    (1, 2, 2, 512, 32, 16, 3, torch.float16, dict(block_m=128, block_n=32)),  # a window smaller than a tile
    (1, 2, 1, 256, 64, 1000, 5, torch.float16, dict(block_m=128, block_n=64)),  # a window longer than N
    (2, 4, 1, 256, 64, 96, 0, torch.float16, dict(block_m=64, block_n=32)),  # no sinks, MQA, smaller tiles
]


@pytest.mark.parametrize("b, hq, hkv, n, d, window_size, sink_size, dtype, opts", ONE_LOOP_CASES)
def test_the_one_loop_launch_matches_the_float64_reference(b, hq, hkv, n, d, window_size, sink_size, dtype, opts):
    """warp_specialize=True: the sink tiles and the band in one loop, every tile masked (the form Triton 3.6
    specialises; the interpreter runs the same loop unspecialised)."""
    skip_if_specialised_on_gpu(True)
    q, k, v = _inputs(b, hq, hkv, n, d, dtype, seed=n + window_size + 1)
    o, lse = fast_window.launch(q, k, v, window_size=window_size, sink_size=sink_size, warp_specialize=True, **opts)
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


@pytest.mark.parametrize("window_size, block_n", [(64, 32), (256, 32), (257, 64), (4096, 64)])
@pytest.mark.parametrize("n", [192, 4096, 8256])
def test_hopper_config_tiles_divide_every_n_the_fast_kernel_takes(n, window_size, block_n):
    """N is a multiple of 64 (fast.SEQ_MULTIPLE); 32 keys per tile up to W = 256 (results/tune_window_fast.json)."""
    cfg = fast_window.hopper_config(window_size, 128, n)
    assert cfg["block_n"] == block_n and n % cfg["block_m"] == 0 and n % cfg["block_n"] == 0
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


@pytest.mark.parametrize("b, hq, n, d, window_size, sink_size, short", [
    (1, 32, 4096, 128, 256, 0, True),  # the window grid's launch-bound point: 17 GFLOP
    (1, 32, 4096, 128, 256, 4, True),
    (1, 32, 8192, 128, 256, 0, False),  # twice the rows
    (1, 32, 4096, 128, 1024, 0, False),  # four times the window
    (4, 32, 4096, 128, 256, 0, False),  # four times the batch
    (1, 32, 4096, 64, 256, 0, True),  # half the head dim
    (1, 8, 65536, 128, 100_000, 0, False),  # a window longer than N counts N keys: plain causal work
    (1, 8, 2048, 128, 100_000, 0, True),
])
def test_short_calls_are_the_ones_under_the_flop_bound(b, hq, n, d, window_size, sink_size, short):
    q = torch.empty(b, hq, n, d, device="meta")
    assert fast_window.is_short_call(q, window_size, sink_size) is short


def test_a_short_call_launches_with_pointer_loads_and_a_long_one_with_tma(monkeypatch):
    """attention_forward_window passes launch use_tma = not is_short_call, with hopper_config's tiles."""
    calls = []
    monkeypatch.setattr(fast_window, "launch", lambda q, k, v, **kw: calls.append(kw))
    for n in (4096, 8192):
        q = torch.empty(1, 32, n, 128, device="meta")
        k = torch.empty(1, 8, n, 128, device="meta")
        fast_window.attention_forward_window(q, k, k, window_size=256, sink_size=4)
    assert [c["use_tma"] for c in calls] == [False, True]
    assert all(c["window_size"] == 256 and c["sink_size"] == 4 and c["block_n"] == 32 for c in calls)


HOPPER_SCRIPT = r"""
import json
import torch
from course_utils.kernels import targets, fast_window

out = []
# the window grid's heads (GQA 32/8): every window at N = 8k, and the short calls of W = 256 at N = 4k
for w, n in [(256, 8192), (1024, 8192), (4096, 8192), (256, 4096)]:
    for s in (0, 4):
        q = torch.zeros(1, 32, n, 128, dtype=torch.bfloat16)
        k = torch.zeros(1, 8, n, 128, dtype=torch.bfloat16)
        with targets._captured_launches() as launches:
            fast_window.attention_forward_window(q, k, k, window_size=w, sink_size=s)
        (kernel, args, kwargs), = launches
        c = targets.compile_launch(kernel, args, kwargs, 90, f"W={w} S={s} N={n}", registers=True)
        named = {**dict(zip(kernel.arg_names, args)), **kwargs}  # the launch passes its arguments in order
        out.append(dict(w=w, s=s, n=n, kernel=c.kernel, fits=c.fits, spill=c.spill_bytes, shared=c.shared_bytes,
                        registers=c.registers, tiles=[named["BLOCK_M"], named["BLOCK_N"]],
                        tma=named["USE_TMA"]))
print(json.dumps(out))
"""


def test_the_shipped_hopper_launches_compile_for_sm_90_two_programs_per_sm_without_spills():
    """Compiled here for an H100/H200 (ptxas, no GPU; TMA descriptors in the signature, or pointers in a
    short call): each launch hopper_config picks fits twice into an SM's 228 KiB and 64K registers, and
    spills nothing."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", HOPPER_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    launches = json.loads(out.stdout.strip().splitlines()[-1])
    assert {(c["w"], c["s"], c["n"]) for c in launches} == {
        (w, s, n) for w, n in [(256, 8192), (1024, 8192), (4096, 8192), (256, 4096)] for s in (0, 4)}
    for c in launches:
        assert c["kernel"] == "_attn_fwd_fast_window_kernel" and c["fits"] and c["spill"] == 0, c
        assert c["tma"] == (c["n"] == 8192), c  # W = 256 at N = 4k is a short call: pointer loads
        assert 2 * (c["shared"] + 1024) <= 228 * 1024 and 2 * 128 * c["registers"] <= 64 * 1024, c
        assert c["tiles"] == ([64, 32] if c["w"] <= 256 else [64, 64]), c
