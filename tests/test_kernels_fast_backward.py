"""The fast backward (course_utils.kernels.fast_backward) on the CPU, and on a GPU the same way.

In Triton's interpreter the kernel runs with small tiles, both modes, TMA
loads included (TMA's reduce-add, the atomic mode's ``use_tma``, is not in
the interpreter: ``test_gpu_fast_backward.py`` checks it on a Hopper GPU).
Gradients are compared with the course's float64 references.
"""

import course_utils  # noqa: F401  (before triton: switches the interpreter on)
import pytest
import torch

from course_utils import references
from course_utils.kernels import fast_backward as fb

from conftest import DEVICE, ON_GPU, skip_if_specialised_on_gpu

FP16 = torch.float16


def _inputs(b, hq, hkv, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(DEVICE, FP16) for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(q.shape, generator=g).to(DEVICE, FP16)


def _saved(q, k, v, do, causal, window_size=None):
    """What the forward saves (``o`` in the inputs' dtype, ``lse`` in fp32) and the float64 gradients,
    from the course's references."""
    arrays = [t.detach().double().cpu().numpy() for t in (q, k, v)]
    o, lse = references.attention_lse(*arrays, causal=causal, window_size=window_size)
    grads = references.attention_backward(*arrays, do.detach().double().cpu().numpy(), causal=causal,
                                          window_size=window_size)
    return (torch.from_numpy(o).to(DEVICE, q.dtype), torch.from_numpy(lse).to(DEVICE, torch.float32),
            [torch.from_numpy(g) for g in grads])


def _assert_close(got, ref, tol=5e-3):
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        assert a.shape == r.shape and a.dtype == FP16, name
        rel = (torch.linalg.vector_norm(a.double().cpu() - r) / torch.linalg.vector_norm(r)).item()
        assert rel < tol, f"{name}: relative error {rel:.2e}"


SMALL = [
    fb.FastBackwardConfig("fused", 32, 64, 64, 32, 4, 1),
    fb.FastBackwardConfig("fused", 16, 64, 64, 16, 4, 1, True),
    fb.FastBackwardConfig("atomic", 32, 64, 64, 32, 4, 1),
    fb.FastBackwardConfig("atomic", 16, 32, 32, 16, 4, 1, True),
    # the flat mode: dK/dV over one loop of (query head, query block), warp-specialised or not; lesson 07's dQ
    fb.FastBackwardConfig("flat", 32, 64, 64, 32, 4, 1, True, True),
    fb.FastBackwardConfig("flat", 16, 64, 64, 16, 4, 2, True, False),
    # and with dQ by the flat mode's own TMA kernel (lse and delta through descriptors), specialised or not
    fb.FastBackwardConfig("flat", 32, 64, 64, 32, 4, 1, True, True, True),
    fb.FastBackwardConfig("flat", 16, 64, 32, 16, 4, 2, True, False, True),
]


@pytest.mark.parametrize("config", SMALL, ids=lambda c: c.short().replace(" ", "_"))
@pytest.mark.parametrize("b, hq, hkv, n, d, causal", [
    (1, 4, 2, 128, 64, True),  # GQA, two query heads per kv head
    (2, 2, 2, 64, 64, False),  # MHA
    (1, 3, 1, 192, 128, True),  # MQA, D = 128, three diagonal blocks
])
def test_both_modes_match_float64(config, b, hq, hkv, n, d, causal):
    skip_if_specialised_on_gpu(config.warp_specialize, config.num_warps)
    if config.mode == "atomic" and config.use_tma and not ON_GPU:
        pytest.skip("TMA's reduce-add is not in the interpreter: test_gpu_fast_backward.py checks it")
    q, k, v, do = _inputs(b, hq, hkv, n, d, seed=n + hq)
    o, lse, ref = _saved(q, k, v, do, causal)
    _assert_close(fb.attention_backward_fast(q, k, v, o, lse, do, causal, config=config), ref)


@pytest.mark.parametrize("config", [SMALL[0], SMALL[4]], ids=lambda c: c.short().replace(" ", "_"))
def test_delta_passed_in_or_computed_give_the_same_gradients(config):
    skip_if_specialised_on_gpu(config.warp_specialize, config.num_warps)
    """Computed, delta is lesson 07's step 1 (one kernel); passed in, the same numbers give the same bits, and
    delta by torch (summed in another order) gives the same gradients to fp32's rounding."""
    from course_utils.kernels.backward import launch_preprocess

    q, k, v, do = _inputs(1, 2, 1, 128, 64, seed=4)
    o, lse, ref = _saved(q, k, v, do, True)
    delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    launch_preprocess(o, do, delta, 64)
    a = fb.attention_backward_fast(q, k, v, o, lse, do, True, config=config)
    c = fb.attention_backward_fast(q, k, v, o, lse, do, True, config=config, delta=delta)
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    torch_delta = fb.attention_backward_fast(q, k, v, o, lse, do, True, config=config,
                                             delta=(o.float() * do.float()).sum(-1))
    for x, y in zip(a, torch_delta):
        torch.testing.assert_close(x, y, rtol=2e-3, atol=2e-3)
    _assert_close(a, ref)


@pytest.mark.parametrize("config", SMALL[4:], ids=lambda c: c.short().replace(" ", "_"))
@pytest.mark.parametrize("window_size", [16, 48, 64, 200])
def test_the_flat_mode_takes_lesson_08s_window(config, window_size):
    skip_if_specialised_on_gpu(config.warp_specialize, config.num_warps)
    """Key j visible from query i iff 0 <= i - j < W: windows inside one tile, across tiles, a tile wide, past N/2."""
    q, k, v, do = _inputs(1, 4, 2, 256, 64, seed=window_size)
    o, lse, ref = _saved(q, k, v, do, True, window_size)
    _assert_close(fb.attention_backward_fast(q, k, v, o, lse, do, True, config=config, window_size=window_size), ref)


def test_a_window_is_refused_where_it_does_not_run():
    q, k, v, do = _inputs(1, 2, 1, 128, 64, seed=2)
    o, lse, _ = _saved(q, k, v, do, True)
    with pytest.raises(ValueError, match="in the flat and gluon modes, with causal=True"):
        fb.attention_backward_fast(q, k, v, o, lse, do, True, config=SMALL[0], window_size=32)
    with pytest.raises(ValueError, match="in the flat and gluon modes, with causal=True"):
        fb.attention_backward_fast(q, k, v, o, lse, do, False, config=SMALL[4], window_size=32)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            fb.attention_backward_fast(q, k, v, o, lse, do, True, config=SMALL[4], window_size=bad)
    with pytest.raises(ValueError, match="sinks run in the gluon mode only, with a window"):
        fb.attention_backward_fast(q, k, v, o, lse, do, True, config=SMALL[4], window_size=32, sink_size=4)


@pytest.mark.parametrize("change, words", [
    (dict(dtype=torch.float32), "float16 or bfloat16"),
    (dict(d=96), "head dim 96"),
    (dict(n_k=64), "self-attention"),
    (dict(n=96), "not a multiple of 128"),
])
def test_what_it_does_not_take_is_said_in_one_sentence(change, words):
    n, d = change.get("n", 128), change.get("d", 64)
    dtype = change.get("dtype", FP16)
    q = torch.zeros(1, 2, n, d, dtype=dtype)
    k = torch.zeros(1, 1, change.get("n_k", n), d, dtype=dtype)
    assert words in fb.unsupported_reason(q, k, k)
    assert not fb.supports(q, k, k)
    with pytest.raises(ValueError, match=words):
        fb.attention_backward_fast(q, k, k, q, torch.zeros(1, 2, n), q)


def test_a_configuration_that_cannot_work_is_refused():
    with pytest.raises(ValueError, match="block_m2 == block_n1"):
        fb.FastBackwardConfig("fused", 32, 64, 128, 32)
    with pytest.raises(ValueError, match="mode must be one of"):
        fb.FastBackwardConfig("sometimes")
    with pytest.raises(ValueError, match="powers of two"):
        fb.FastBackwardConfig("atomic", 48, 96, 96, 48)
    with pytest.raises(ValueError, match="needs use_tma=True"):
        fb.FastBackwardConfig("flat", 32, 128, 128, 32, 4, 2)
    with pytest.raises(ValueError, match="warp_specialize is the flat mode's"):
        fb.FastBackwardConfig("fused", 64, 128, 128, 64, 8, 3, False, True)
    with pytest.raises(ValueError, match="flat_dq is the flat mode's"):
        fb.FastBackwardConfig("atomic", 64, 128, 128, 64, 8, 3, True, False, True)
    assert fb.default_config("flat") == fb.FLAT_DEFAULT and not fb.FLAT_DEFAULT.warp_specialize  # they deadlock
    assert fb.default_config().mode == "fused" and fb.default_config("atomic").mode == "atomic"
    assert fb.default_config() in fb.CONFIGS and fb.default_config("atomic") in fb.CONFIGS


@pytest.mark.parametrize("config", [SMALL[0], SMALL[1], SMALL[2], SMALL[4]], ids=lambda c: c.short().replace(" ", "_"))
def test_any_strides_give_the_contiguous_answer(config):
    skip_if_specialised_on_gpu(config.warp_specialize, config.num_warps)
    """q, k, v and dO laid out [B, N, H, D] (as many models keep them) and viewed as [B, H, N, D]."""
    q, k, v, do = _inputs(1, 4, 2, 128, 64, seed=11)
    o, lse, ref = _saved(q, k, v, do, True)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do)]
    assert not strided[0].is_contiguous()
    got = fb.attention_backward_fast(strided[0], strided[1], strided[2], o, lse, strided[3], True, config=config)
    _assert_close(got, ref)
    want = fb.attention_backward_fast(q, k, v, o, lse, do, True, config=config)
    if config.mode == "fused" or not ON_GPU:  # on a GPU the atomic mode's dQ differs in its last bits run to run
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_autograd_runs_the_configured_fast_backward_where_it_applies(monkeypatch):
    """kernels.flash_attention's autograd: lesson 07's pair by default (AUTOGRAD_CONFIG None); with a configuration
    set, the fast backward for the calls it takes (float64's gradients) and lesson 07's pair for the others
    (sinks, lesson 12's keywords, a window outside the flat mode)."""
    skip_if_specialised_on_gpu(SMALL[6].warp_specialize, SMALL[6].num_warps)
    from course_utils.kernels import backward, flash_attention

    calls = []
    real = fb.attention_backward_fast
    monkeypatch.setattr(fb, "attention_backward_fast", lambda *a, **kw: calls.append(kw["config"]) or real(*a, **kw))
    q, k, v, do = _inputs(1, 4, 2, 128, 64, seed=9)

    def grads(**kw):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, True, **kw).backward(do)
        return [t.grad for t in leaves]

    assert fb.AUTOGRAD_CONFIG == fb.GLUON_DEFAULT  # the default: lesson 11's Gluon backward, a Hopper GPU's only
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", None)  # none configured: lesson 07's pair everywhere
    _assert_close(grads(), _saved(q, k, v, do, True)[2])
    assert calls == []
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", SMALL[6])  # flat, dQ by the flat kernel too
    _assert_close(grads(), _saved(q, k, v, do, True)[2])
    _assert_close(grads(window_size=48), _saved(q, k, v, do, True, 48)[2])
    assert calls == [SMALL[6], SMALL[6]]
    pair = []
    monkeypatch.setattr(backward, "attention_backward",
                        lambda *a, _real=backward.attention_backward, **kw: pair.append(1) or _real(*a, **kw))
    grads(window_size=48, sink_size=4)
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", SMALL[0])  # fused: no window
    grads(window_size=48)
    assert calls == [SMALL[6], SMALL[6]] and len(pair) == 2
    assert fb.autograd_config(q, k, v, True, softcap=30.0) is None and fb.autograd_config(q, k, v, True) == SMALL[0]


def test_the_gluon_mode_takes_what_hopper_ws_bwd_launches():
    """The gluon mode (lesson 11's Gluon backward) maps onto the config's fields; what its layout fixes, and the
    options hopper_ws_bwd refuses, are refused at the call (unsupported_reason, attention_backward_fast's
    ValueError) in one sentence, as are inputs off a Hopper GPU."""
    from course_utils.kernels import gluon_cpu

    assert fb.default_config("gluon") == fb.GLUON_DEFAULT and fb.AUTOGRAD_CONFIG == fb.GLUON_DEFAULT
    assert fb.GLUON_DEFAULT.short() == "gluon dkdv 64x128 dq 128x64 w4 s2 tma"
    assert fb.FastBackwardConfig("gluon", 32, 128, 128, 128, 4, 3, True).short() == "gluon dkdv 32x128 dq 128x128 w4 s3 tma"
    q = torch.zeros(1, 4, 256, 64, dtype=torch.float16)
    k = torch.zeros(1, 2, 256, 64, dtype=torch.float16)
    lse = torch.zeros(1, 4, 256)
    assert fb.unsupported_reason(q, k, k, fb.GLUON_DEFAULT).startswith("the hand-specialised kernel runs on a Hopper GPU")
    with pytest.raises(ValueError, match="runs on a Hopper GPU"):
        fb.attention_backward_fast(q, k, k, q, lse, q, True, config=fb.GLUON_DEFAULT)
    with gluon_cpu.running():  # a model of a Hopper GPU: the inputs pass, the config's fields are what is refused
        assert fb.unsupported_reason(q, k, k, fb.GLUON_DEFAULT) is None
        for fields, message in (((64, 64, 128, 64, 4, 2, True), "block_n1=64"),
                                ((64, 128, 128, 64, 8, 2, True), "num_warps=8"),
                                ((64, 128, 128, 64, 4, 2, False), "use_tma=False"),
                                ((64, 128, 128, 64, 4, 4, True), "num_buffers must be 2 or 3"),
                                ((16, 128, 128, 64, 4, 2, True), "block_m must be one of"),
                                ((64, 128, 128, 32, 4, 2, True), "dq_block_n must be one of")):
            cfg = fb.FastBackwardConfig("gluon", *fields)
            assert message in fb.unsupported_reason(q, k, k, cfg) and not fb.supports(q, k, k, cfg)
            with pytest.raises(ValueError, match=message):
                fb.attention_backward_fast(q, k, k, q, lse, q, True, config=cfg)
        with pytest.raises(ValueError, match="a window runs in the flat and gluon modes, with causal"):
            fb.attention_backward_fast(q, k, k, q, lse, q, False, config=fb.GLUON_DEFAULT, window_size=64)


def test_the_package_does_not_import_gluon_until_a_gluon_route_is_taken():
    """Gluon is Triton's newer language: importing course_utils.kernels (every lesson does) must not import lesson 11's
    Gluon kernels, so that a Triton whose Gluon differs still runs lessons 01-10."""
    import subprocess
    import sys

    code = ("import sys, course_utils.kernels; from course_utils.kernels import fast_backward, fp8, dispatch; "
            "print(sorted(m for m in sys.modules if m.startswith('course_utils.kernels.hopper_ws')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(not __import__("course_utils").ENV.interpreter,
                    reason="runs the course's kernels on CPU tensors, which only Triton's interpreter does")
def test_the_gluon_routes_switched_on_load_no_gluon_where_they_cannot_run():
    """With all three Gluon routes on (the forward's and FP8's GLUON_MIN_N, the backward's AUTOGRAD_CONFIG), a call
    on a machine without a Hopper GPU (here the CPU, outside gluon_cpu's model) takes the Triton kernels, gives
    what it gives with the routes off, bit for bit, and never imports lesson 11's Gluon modules: a laptop or a T4
    with a Triton whose Gluon differs runs every lesson with the switches on."""
    import subprocess
    import sys

    code = """
import sys, torch
from course_utils import kernels
from course_utils.kernels import dispatch, fast_backward, fp8

def run():
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 2, 128, 128, generator=g).half() for _ in range(2))
    k, v = (torch.randn(1, 1, 128, 128, generator=g).half() for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = kernels.flash_attention(q, k, v, True)
    o.backward(do)
    o8 = kernels.flash_attention_fp8(q.detach().float(), k.detach().float(), v.detach().float(), True)
    return [o.detach(), q.grad, k.grad, v.grad, o8]

dispatch.GLUON_MIN_N, fp8.GLUON_MIN_N, fast_backward.AUTOGRAD_CONFIG = None, None, None
off = run()
dispatch.GLUON_MIN_N, fp8.GLUON_MIN_N = 128, 128
fast_backward.AUTOGRAD_CONFIG = fast_backward.GLUON_DEFAULT
on = run()
print(all(torch.equal(a, b) for a, b in zip(off, on)))
print(sorted(m for m in sys.modules if m.startswith('course_utils.kernels.hopper_ws')))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["True", "[]"], out
