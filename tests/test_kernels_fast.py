"""The fast forward kernel (course_utils.kernels.fast) on the CPU.

What can run here: the pure-Python parts (config pruning, ``is_supported``,
the fallback routing) and the kernel itself in Triton's interpreter with a
fixed configuration (``fast.launch``), host TMA descriptors included. The
autotuned path needs a GPU; its numbers are in results/.
"""

import math

import course_utils  # noqa: F401  (before triton: switches the interpreter on)
import numpy as np
import pytest
import torch
import triton

from course_utils import references
from course_utils.kernels import fast, forward

from conftest import DEVICE, ON_GPU, tolerance, skip_if_specialised_on_gpu


def _inputs(b, hq, hkv, n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv, hkv)]


def _np(t):
    return t.detach().double().cpu().numpy()


def _ref(q, k, v, causal, scale=None):
    return references.attention_lse(_np(q), _np(k), _np(v), causal=causal, scale=scale)


def _assert_close(o, lse, ref, atol_o):
    """``atol_o`` is the interpreter's tolerance; on a GPU fp32 dots are tf32."""
    ro, rl = ref
    if ON_GPU:
        atol_o = max(atol_o, tolerance(o.dtype))
    np.testing.assert_allclose(_np(o), ro, atol=atol_o, rtol=0)
    # tf32 scores are off by about 1e-3 of their size, and so is lse (large in some tests)
    np.testing.assert_allclose(_np(lse), rl, atol=1e-2 if ON_GPU else 1e-4, rtol=2e-3 if ON_GPU else 0)


# ----------------------------------------------------------------------------
# Configuration pruning
# ----------------------------------------------------------------------------
def test_config_ok_needs_tiles_that_divide_n():
    assert fast.config_ok(128, 64, 4, 1024, 128, causal=True)
    assert not fast.config_ok(128, 64, 4, 192, 128, causal=True)  # 192 % 128
    assert fast.config_ok(64, 64, 4, 192, 128, causal=True)


def test_config_ok_causal_needs_block_m_multiple_of_block_n():
    assert not fast.config_ok(64, 128, 8, 1024, 64, causal=True)
    assert fast.config_ok(64, 128, 8, 1024, 64, causal=False) is False  # 8 warps on < 128x128
    assert fast.config_ok(128, 128, 8, 1024, 64, causal=True)


def test_config_ok_register_and_warp_rules():
    # 128x128 scores + 128x128 accumulator on 4 warps would spill at D=128, not at D=64.
    assert not fast.config_ok(128, 128, 4, 1024, 128, causal=False)
    assert fast.config_ok(128, 128, 4, 1024, 64, causal=False)
    # 8 warps only for tiles of at least 128x128.
    assert not fast.config_ok(128, 64, 8, 1024, 128, causal=False)
    assert fast.config_ok(128, 128, 8, 1024, 128, causal=False)


def test_prune_configs_uses_named_args_and_never_returns_nothing():
    configs = fast.make_configs()
    kept = fast.prune_configs(configs, {"N_CTX": 1024}, HEAD_DIM=128, CAUSAL=True)
    shapes = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept}
    assert (128, 128, 4) not in shapes and (128, 64, 4) in shapes and (128, 128, 8) in shapes
    only_64 = fast.prune_configs(configs, {"N_CTX": 64, "HEAD_DIM": 64, "CAUSAL": False})
    assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in only_64} == {(64, 64)}
    # Nothing fits N = 32: the smallest tile is returned rather than an empty list.
    fallback = fast.prune_configs(configs, {"N_CTX": 32, "HEAD_DIM": 64, "CAUSAL": False})
    assert len(fallback) == 1 and fallback[0].kwargs["BLOCK_M"] == 64


def test_every_config_sets_its_descriptor_block_shapes():
    q, k, v = _inputs(1, 2, 1, 128, 64)
    o = torch.empty_like(q)
    descs = fast._descriptors(q, k, v, o, 16, 16)
    cfg = fast.make_configs()[2]
    nargs = dict(zip(("desc_q", "desc_k", "desc_v", "desc_o"), descs), HEAD_DIM=64, **cfg.kwargs)
    cfg.pre_hook(nargs)
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    assert descs[0].block_shape == [bm, 64] and descs[3].block_shape == [bm, 64]
    assert descs[1].block_shape == [bn, 64] and descs[2].block_shape == [bn, 64]


# ----------------------------------------------------------------------------
# is_supported / fallback routing
# ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape_q, shape_kv, dtype, words",
    [
        ((1, 4, 128, 64), (1, 4, 128, 64), torch.float32, "dtype"),
        ((1, 4, 128, 32), (1, 4, 128, 32), torch.float16, "head dim"),
        ((1, 4, 100, 64), (1, 4, 100, 64), torch.float16, "multiple of 64"),
        ((1, 4, 128, 64), (1, 3, 128, 64), torch.float16, "multiple of the kv heads"),
        ((1, 4, 128, 64), (1, 4, 256, 64), torch.float16, "[B, H_kv, N, D]"),
        ((4, 128, 64), (4, 128, 64), torch.float16, "[B, H, N, D]"),
    ],
)
def test_unsupported_reason_names_the_problem(shape_q, shape_kv, dtype, words):
    q = torch.zeros(shape_q, dtype=dtype, device=DEVICE)
    k = torch.zeros(shape_kv, dtype=dtype, device=DEVICE)
    reason = fast.unsupported_reason(q, k, k)
    assert reason is not None and words in reason
    assert fast.is_supported(q, k, k) is False


def test_good_shapes_are_refused_only_for_the_machine_here():
    q, k, v = _inputs(1, 4, 2, 128, 64, torch.float16)
    reason = fast.unsupported_reason(q, k, v)
    if course_utils.ENV.capability is not None and course_utils.ENV.capability >= (9, 0):
        assert reason is None and fast.is_supported(q, k, v)  # Hopper: the shape is the fast kernel's
    else:
        assert reason is not None and ("interpreter" in reason or "CUDA" in reason or "Hopper" in reason or "sm_90" in reason), reason
        assert fast.is_supported(q, k, v) is False
    assert fast.is_supported("q", k, v) is False  # never raises


def test_unsupported_inputs_fall_back_to_the_lesson_05_kernel(monkeypatch):
    q, k, v = _inputs(1, 4, 2, 128, 32)
    calls = []
    real = forward.flash_attention_gqa_forward

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "flash_attention_gqa_forward", spy)
    o, lse = fast.attention_forward_fast(q, k, v, causal=True)
    assert calls == [{"causal": True}]
    _assert_close(o, lse, _ref(q, k, v, True), 1e-5)


def test_fallback_honours_sm_scale():
    q, k, v = _inputs(1, 2, 1, 64, 32, seed=3)
    o, lse = fast.attention_forward_fast(q, k, v, causal=False, sm_scale=0.37)
    _assert_close(o, lse, _ref(q, k, v, False, scale=0.37), 1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_tries_warp_specialisation_then_plain_autotune_then_a_safe_config(monkeypatch, causal):
    q, k, v = _inputs(1, 2, 1, 128, 64)
    monkeypatch.setattr(fast, "is_supported", lambda *a: True)
    monkeypatch.setitem(fast._WS_STATE, "enabled", {True: True, False: True})
    monkeypatch.setitem(fast._WS_STATE, "error", {})
    monkeypatch.setitem(fast._TUNE_STATE, "error", None)
    tried = []

    def fake_tuned(kernel, *args):
        tried.append("ws" if kernel is fast._tuned_kernel_ws else "plain")
        raise RuntimeError("not on this compiler")

    launched = []
    monkeypatch.setattr(fast, "_launch_tuned", fake_tuned)
    monkeypatch.setattr(fast, "launch", lambda *a, **kw: launched.append(kw) or ("o", "lse"))
    assert fast.attention_forward_fast(q, k, v, causal=causal) == ("o", "lse")
    assert tried == ["ws", "plain"]
    # Only this mask's flag is switched off, with the reason kept.
    assert fast._WS_STATE["enabled"] == {causal: False, not causal: True}
    assert "RuntimeError" in fast._WS_STATE["error"][causal]
    assert launched and launched[0]["block_m"] == fast.SAFE_CONFIG["block_m"]
    assert "autotuning failed" in fast.best_config(causal)
    tried.clear()
    fast.attention_forward_fast(q, k, v, causal=causal)
    assert tried == ["plain"]  # warp specialisation is not retried


def test_ws_configs_only_with_eight_warps():
    assert not fast.config_ok(128, 64, 4, 1024, 128, causal=False, warp_specialize=True)
    assert fast.config_ok(128, 128, 8, 1024, 128, causal=False, warp_specialize=True)
    assert all(w == 8 for _, _, w, _, _, ws in fast.WS_SPACE if ws)
    configs = fast.make_configs(fast.WS_SPACE + fast.CONFIG_SPACE)
    kept = fast.prune_configs(configs, {"N_CTX": 1024, "HEAD_DIM": 128, "CAUSAL": True})
    assert all(c.num_warps == 8 for c in kept if c.kwargs["WARP_SPECIALIZE"])
    assert {c.kwargs["ORDER"] for c in kept} == {fast.ORDER_M_MAJOR, fast.ORDER_KV_GROUPED}


# ----------------------------------------------------------------------------
# The kernel itself, in the interpreter (fixed configurations)
# ----------------------------------------------------------------------------
CASES = [
    # b, hq, hkv, n, d, causal, dtype, launch options
    (1, 2, 1, 128, 64, True, torch.float32, dict(use_tma=True)),
    (1, 2, 1, 128, 64, False, torch.float32, dict(use_tma=True)),
    (2, 4, 2, 128, 32, True, torch.float32, dict(use_tma=False)),
    (1, 4, 1, 128, 64, True, torch.float16, dict(use_tma=True, order=fast.ORDER_M_MAJOR)),
    (1, 2, 2, 128, 64, True, torch.float32, dict(use_tma=False, two_phase=False, exp2=False)),
    (1, 2, 1, 128, 64, False, torch.float16, dict(use_tma=False, exp2=False)),
    # the query heads of one kv head next to each other in the grid
    (2, 4, 2, 128, 32, True, torch.float32, dict(use_tma=True, order=fast.ORDER_KV_GROUPED)),
    (1, 6, 2, 128, 32, False, torch.float16, dict(use_tma=False, order=fast.ORDER_KV_GROUPED)),
    # QK^T software-pipelined by hand: the loop's prologue/epilogue, with TMA and pointers
    (1, 2, 1, 128, 64, True, torch.float32, dict(use_tma=True, pipeline_qk=True)),
    (1, 4, 2, 128, 32, False, torch.float32, dict(use_tma=False, pipeline_qk=True)),
    (1, 4, 1, 128, 64, True, torch.float16, dict(use_tma=False, pipeline_qk=True, order=fast.ORDER_M_MAJOR)),
    # one warpgroup, warp-specialised (a producer and two 64-row consumers on Hopper): the output stored by
    # pointers beside the TMA loads, and causal in one loop with every block masked
    # (16-bit: Triton does not specialise a loop of tf32 products, see test_a_warp_specialised_launch_...)
    (1, 4, 2, 128, 64, True, torch.float16, dict(use_tma=True, warp_specialize=True, num_warps=4, two_phase=False)),
    (1, 4, 2, 128, 32, False, torch.float16, dict(use_tma=True, warp_specialize=True, num_warps=4)),
]


@pytest.mark.parametrize("b, hq, hkv, n, d, causal, dtype, opts", CASES)
def test_launch_matches_the_reference(b, hq, hkv, n, d, causal, dtype, opts):
    skip_if_specialised_on_gpu(opts.get("warp_specialize"), opts.get("num_warps", 4))
    q, k, v = _inputs(b, hq, hkv, n, d, dtype, seed=hq + n)
    o, lse = fast.launch(q, k, v, causal, block_m=64, block_n=32, **opts)
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32
    _assert_close(o, lse, _ref(q, k, v, causal), 1e-5 if dtype == torch.float32 else 2e-3)


PERSISTENT = [
    # b, hq, hkv, n, d, causal, dtype, options: fewer programs than tiles, so each walks several
    (1, 4, 2, 256, 32, False, torch.float16, dict(warp_specialize=True, n_programs=3)),
    (2, 4, 1, 256, 64, True, torch.float16, dict(warp_specialize=True, two_phase=False, n_programs=5)),
    (1, 2, 2, 256, 32, True, torch.float32, dict(warp_specialize=False, n_programs=4)),  # two phases
    (1, 6, 2, 128, 32, False, torch.float32, dict(warp_specialize=False, order=0, n_programs=100)),  # > tiles
]


@pytest.mark.parametrize("b, hq, hkv, n, d, causal, dtype, opts", PERSISTENT)
def test_the_persistent_launch_matches_the_reference(b, hq, hkv, n, d, causal, dtype, opts):
    """persistent=True: n_programs programs walk the grid's tiles (fast.launch_persistent); warp_specialize
    specialises that tile loop (FlashAttention-3's layout on Hopper), causal then in one masked key loop."""
    skip_if_specialised_on_gpu(opts["warp_specialize"])
    q, k, v = _inputs(b, hq, hkv, n, d, dtype, seed=hq + n + 1)
    o, lse = fast.launch(q, k, v, causal, block_m=64, block_n=32, num_warps=4, persistent=True, **opts)
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32
    _assert_close(o, lse, _ref(q, k, v, causal), 1e-5 if dtype == torch.float32 else 2e-3)


def test_a_persistent_launch_refuses_what_it_does_not_run():
    q, k, v = _inputs(1, 2, 1, 128, 32, torch.float16, seed=7)
    with pytest.raises(ValueError, match="two_phase=False"):
        fast.launch(q, k, v, True, block_m=64, block_n=32, persistent=True, warp_specialize=True)
    with pytest.raises(ValueError, match="TMA loads and exp2 only"):
        fast.launch(q, k, v, False, block_m=64, block_n=32, persistent=True, use_tma=False)
    with pytest.raises(ValueError, match="16-bit inputs"):
        fast.launch_persistent(q.float(), k.float(), v.float(), False, block_m=64, block_n=32)


def test_a_warp_specialised_one_warpgroup_causal_launch_needs_one_loop():
    q, k, v = _inputs(1, 2, 1, 128, 32, torch.float16, seed=5)
    with pytest.raises(ValueError, match="two_phase=False"):
        fast.launch(q, k, v, True, block_m=64, block_n=32, num_warps=4, warp_specialize=True)
    if not ON_GPU:  # on a GPU the specialised launch is refused (it deadlocks there)
        fast.launch(q, k, v, False, block_m=64, block_n=32, num_warps=4, warp_specialize=True)  # one loop


def test_a_warp_specialised_launch_needs_16_bit_inputs_and_tma_on_every_machine():
    """Compiled for sm_90 with triton 3.6, the specialised loop stops the compiler with float32 inputs (tf32
    products) and with pointer loads: refused here too, in one sentence, not only on a GPU."""
    from course_utils.kernels import fast_window

    q, k, v = _inputs(1, 2, 1, 128, 32, torch.float32, seed=6)
    with pytest.raises(ValueError, match="16-bit inputs and TMA loads"):
        fast.launch(q, k, v, False, block_m=64, block_n=32, num_warps=4, warp_specialize=True)
    with pytest.raises(ValueError, match="16-bit inputs and TMA loads"):
        fast_window.launch(q, k, v, window_size=32, block_m=64, block_n=32, warp_specialize=True)
    h = [t.half() for t in (q, k, v)]
    with pytest.raises(ValueError, match="use_tma=False"):
        fast.launch(*h, False, block_m=64, block_n=32, num_warps=4, warp_specialize=True, use_tma=False)
    with pytest.raises(ValueError, match="use_tma=False"):
        fast_window.launch(*h, window_size=32, block_m=64, block_n=32, warp_specialize=True, use_tma=False)
    fast.launch(q, k, v, False, block_m=64, block_n=32, num_warps=8, warp_specialize=True)  # 8 warps: not split


def test_exp2_poly_coefficients_meet_their_stated_bound():
    """fast.EXP2_POLY: the cubic for 2**f on [-1/2, 1/2], relative error at most 7.5e-5 (float64)."""
    f = np.linspace(-0.5, 0.5, 100_001)
    rel = np.abs(np.polyval(fast.EXP2_POLY, f) / np.exp2(f) - 1)
    assert 5e-5 < rel.max() < 7.6e-5


def test_exp2_poly_kernel_matches_exp2_from_underflow_to_256():
    """fast._exp2_poly (the FMA units' exp2): rounding to the nearest integer by adding 1.5 * 2**23, the
    cubic, and 2**j added into the exponent bits; at or below -126 it gives (almost) 0, as exp2 does."""
    import triton
    import triton.language as tl

    @triton.jit
    def apply(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, fast._exp2_poly(tl.load(X + offs)))

    x = torch.cat([torch.linspace(-140.0, 8.0, 4093), torch.tensor([float("-inf"), -0.5, 0.5])]).to(DEVICE)
    y = torch.empty_like(x)
    apply[(1,)](x, y, N=x.numel())
    x, y = _np(x), _np(y)
    normal = x >= -120
    np.testing.assert_allclose(y[normal], np.exp2(x[normal]), rtol=8e-5, atol=0)
    assert np.all(y[~normal] <= 2.0 ** -119) and np.all(y >= 0)


@pytest.mark.parametrize("causal", [True, False])
def test_half_the_exponentials_on_the_fma_units_stay_accurate(causal):
    """launch(exp_poly=True): the columns of each score tile alternate between exp2 and _exp2_poly
    (measured slower on the H200, kept as an option); its 7.5e-5 relative error is far below bf16's."""
    q, k, v = _inputs(1, 4, 2, 128, 64, seed=11)
    o, lse = fast.launch(q, k, v, causal, block_m=64, block_n=32, exp_poly=True)
    ref = _ref(q, k, v, causal)
    _assert_close(o, lse, ref, 3e-4)
    exact, _ = fast.launch(q, k, v, causal, block_m=64, block_n=32)
    assert not torch.equal(o, exact)  # the polynomial really ran
    with pytest.raises(ValueError, match="needs exp2=True"):
        fast.launch(q, k, v, causal, block_m=64, block_n=32, exp_poly=True, exp2=False)


def test_pipelined_loop_with_one_block_per_phase():
    # BLOCK_M == BLOCK_N: query block 1's unmasked phase is a single key block,
    # so the pipelined loop runs its prologue and epilogue but no iteration.
    q, k, v = _inputs(1, 2, 1, 64, 32, seed=3)
    o, lse = fast.launch(q, k, v, True, block_m=32, block_n=32, use_tma=False, pipeline_qk=True)
    _assert_close(o, lse, _ref(q, k, v, True), 1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_lazy_rescale_is_exact_when_the_max_keeps_growing(causal):
    # Keys scaled up along the sequence: later blocks have much larger scores,
    # so the running max grows by more than 8 (log2) and the rescale branch runs.
    q, k, v = _inputs(1, 2, 1, 128, 64, seed=5)
    k = k * torch.linspace(0.1, 6.0, 128, device=DEVICE)[None, None, :, None]
    o, lse = fast.launch(q, k, v, causal, block_m=64, block_n=32, lazy_rescale=True)
    _assert_close(o, lse, _ref(q, k, v, causal), 1e-5)
    assert float(lse.max()) > 8.0  # the scores really were large


def test_launch_uses_sm_scale():
    q, k, v = _inputs(1, 2, 1, 64, 32, seed=7)
    o, lse = fast.launch(q, k, v, True, sm_scale=0.2, block_m=32, block_n=16, use_tma=False)
    _assert_close(o, lse, _ref(q, k, v, True, scale=0.2), 1e-5)


def test_launch_rejects_ragged_tiles():
    q, k, v = _inputs(1, 2, 1, 96, 32)
    with pytest.raises(ValueError, match="multiple"):
        fast.launch(q, k, v, False, block_m=64, block_n=32)
    q, k, v = _inputs(1, 2, 1, 128, 32)
    with pytest.raises(ValueError, match="multiple"):
        fast.launch(q, k, v, True, block_m=32, block_n=64)  # causal: BLOCK_M % BLOCK_N


def test_lse_is_natural_log():
    q, k, v = _inputs(1, 1, 1, 64, 32, seed=11)
    _, lse = fast.launch(q, k, v, False, block_m=32, block_n=32, use_tma=False)
    s = (q[0, 0].double() @ k[0, 0].double().T) / math.sqrt(32)
    np.testing.assert_allclose(_np(lse[0, 0]), _np(torch.logsumexp(s, -1)), atol=1e-2 if ON_GPU else 1e-5)


def test_public_functions_route_to_the_fast_kernel_where_supported(monkeypatch):
    """kernels.dispatch is the one dispatch point: fast kernel if supported (asked once), else lesson 05's."""
    import course_utils.kernels as kernels

    q = torch.randn(1, 2, 64, 16, device=DEVICE)
    k = v = torch.randn(1, 1, 64, 16, device=DEVICE)
    calls = []
    sentinel = (torch.zeros_like(q), torch.zeros(1, 2, 64, device=DEVICE))
    monkeypatch.setattr(kernels.fast, "is_supported", lambda *a: True)
    monkeypatch.setattr(kernels.fast, "attention_forward_tuned", lambda *a, **kw: calls.append(kw) or sentinel)
    assert kernels.flash_attention_with_lse(q, k, v, causal=True) is sentinel
    assert calls == [{"causal": True}]
    monkeypatch.setattr(kernels.fast, "is_supported", lambda *a: False)
    o, lse = kernels.flash_attention_with_lse(q, k, v, causal=True)
    assert len(calls) == 1 and lse.shape == (1, 2, 64) and torch.isfinite(o).all()


@pytest.mark.parametrize("grad", [False, True])
def test_a_call_is_validated_once_and_the_fast_path_decided_once(monkeypatch, grad):
    """flash_attention: one validate(), one is_supported(), whether or not autograd is involved."""
    import course_utils.kernels as kernels

    q = torch.randn(1, 2, 64, 16, device=DEVICE, requires_grad=grad)
    k = v = torch.randn(1, 1, 64, 16, device=DEVICE)
    asked, checked = [], []
    real_validate = forward.validate
    monkeypatch.setattr(kernels.fast, "is_supported", lambda *a: asked.append(1) or False)
    monkeypatch.setattr(forward, "validate", lambda *a: checked.append(1) or real_validate(*a))
    o = kernels.flash_attention(q, k, v, causal=True)
    assert (o.grad_fn is not None) == grad
    assert asked == [1] and checked == [1]
    with pytest.raises(ValueError, match="head dim"):  # and the one check still refuses bad input
        kernels.flash_attention(q[..., :8], k[..., :8], v[..., :8], causal=True)
