"""check_quantize_fp8, check_persistent_schedule, check_fp8_forward: planted mistakes get their diagnosis.

The planted FP8 kernels are the course's own (course_utils/kernels/fp8.py) with
exactly one edit each: the test copies fp8.py's source, replaces one line
(which must occur exactly once, so a change to fp8.py that would make a mutant
meaningless fails loudly), writes it to a temporary module and imports it
(the checks refuse course_utils's own kernels). Correct answers written
differently (P kept in float32 or bf16, the interpreter's plain fp8 cast, V
made K-major another way, another block quantisation) must pass.
"""

import heapq
import inspect

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import pytest
import torch

from course_utils.grading import GradingError, check_fp8_forward, check_persistent_schedule, check_quantize_fp8
from course_utils.grading import part7_hopper as p7
from course_utils.kernels import fp8
from conftest import module_from_source

_made: dict = {}


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8_variants")
    source = inspect.getsource(fp8)

    def make(name, *edits):
        """fp8.py with each ``(old, new)`` edit applied, as a module outside course_utils."""
        if name in _made:
            return _made[name]
        src = source
        for old, new in edits:
            assert src.count(old) == 1, f"{name}: {old!r} occurs {src.count(old)} times in fp8.py"
            src = src.replace(old, new)
        _made[name] = module_from_source(folder / f"fp8_variant_{name}.py", src)
        return _made[name]

    return make


def _fails(check, fn, message, **kw):
    """``check(fn)`` fails, naming ``message`` as the likely cause (or in its message)."""
    with pytest.raises(GradingError) as info:
        check(fn, **kw)
    text = str(info.value)
    fixed = message.split("{")[0][:60]
    assert fixed in text, text
    return text


# -- check_quantize_fp8 -------------------------------------------------------------
def _blocks(x, block_size):
    b, h, n, d = x.shape
    nb = -(-n // block_size)
    xp = torch.zeros(b, h, nb * block_size, d, dtype=torch.float32, device=x.device)
    xp[:, :, :n] = x
    return xp.view(b, h, nb, block_size, d), n


def _quant_inverse(x, block_size):  # written differently: multiply by 448 / amax, slice at the end
    blocks, n = _blocks(x, block_size)
    amax = blocks.abs().amax((3, 4))
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    x8 = (blocks * (448 / torch.where(amax > 0, amax, 448 * torch.ones_like(amax)))[..., None, None])
    x8 = x8.clamp(-448, 448).to(torch.float8_e4m3fn)
    return x8.flatten(2, 3)[:, :, :n], scale


def _quant_loop(x, block_size):  # a Python loop over the blocks
    b, h, n, d = x.shape
    nb = -(-n // block_size)
    x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((b, h, nb), dtype=torch.float32, device=x.device)
    for j in range(nb):
        part = x[:, :, j * block_size:(j + 1) * block_size]
        s = part.abs().amax(dim=(2, 3)).clamp_min(1e-30) / 448
        scale[:, :, j] = s
        x8[:, :, j * block_size:(j + 1) * block_size] = (part / s[..., None, None]).to(torch.float8_e4m3fn)
    return x8, scale


@pytest.mark.parametrize("fn", [_quant_inverse, _quant_loop], ids=["inverse", "loop"])
def test_quantize_correct_variants_pass(fn):
    assert check_quantize_fp8(fn)


def _per_tensor(x, block_size):
    blocks, n = _blocks(x, block_size)
    s = blocks.abs().amax() / 448
    scale = torch.full(blocks.shape[:3], float(s), dtype=torch.float32, device=x.device)
    return (x / s).to(torch.float8_e4m3fn), scale


def _per_tensor_scalar(x, block_size):
    s = x.abs().amax() / 448
    return (x / s).to(torch.float8_e4m3fn), s.reshape(1).float()


def _per_head(x, block_size):
    blocks, n = _blocks(x, block_size)
    s = blocks.abs().amax((2, 3, 4)) / 448
    scale = s[..., None].expand(blocks.shape[:3]).contiguous()
    return (x / s[..., None, None]).to(torch.float8_e4m3fn), scale


def _no_scale(x, block_size):
    blocks, _ = _blocks(x, block_size)
    return x.to(torch.float8_e4m3fn), torch.ones(blocks.shape[:3], dtype=torch.float32, device=x.device)


def _not_divided(x, block_size):
    _, scale = fp8.quantize_fp8(x, block_size)
    return x.clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _multiplied(x, block_size):
    _, scale = fp8.quantize_fp8(x, block_size)
    rows = scale.repeat_interleave(block_size, dim=2)[:, :, :x.shape[2], None]
    return (x * rows).to(torch.float8_e4m3fn), scale


def _inverse_scale(x, block_size):
    x8, scale = fp8.quantize_fp8(x, block_size)
    return x8, 1.0 / scale


def _zero_nan(x, block_size):
    blocks, n = _blocks(x, block_size)
    scale = blocks.abs().amax((3, 4)) / 448
    rows = scale.repeat_interleave(block_size, dim=2)[:, :, :n, None]
    return (x / rows).to(torch.float8_e4m3fn), scale


def _tail_over_full_block(x, block_size):  # the last block's amax over the last block_size rows
    x8, scale = fp8.quantize_fp8(x, block_size)
    n = x.shape[2]
    if n % block_size and n > block_size:
        scale = scale.clone()
        scale[:, :, -1] = x[:, :, n - block_size:].abs().amax((2, 3)) / 448
    return x8, scale


@pytest.mark.parametrize("fn, message", [
    (_per_tensor, p7.MSG_PER_TENSOR),
    (_per_tensor_scalar, p7.MSG_PER_TENSOR),
    (_per_head, p7.MSG_PER_HEAD),
    (_no_scale, p7.MSG_NO_SCALE),
    (_not_divided, p7.MSG_NOT_DIVIDED),
    (_multiplied, p7.MSG_MULTIPLIED),
    (_inverse_scale, p7.MSG_INVERSE),
    (_zero_nan, p7.MSG_ZERO_BLOCK),
    (_tail_over_full_block, p7.MSG_TAIL_BLOCK),
], ids=["per-tensor", "per-tensor-scalar", "per-head", "no-scale", "not-divided", "multiplied", "inverse",
        "zero-block", "tail-block"])
def test_quantize_mistakes_are_diagnosed(fn, message):
    # fp8.quantize_fp8 is refused inside the check: the planted mistakes that use it run on a copy
    _fails(check_quantize_fp8, _unguarded(fn), message)


def _unguarded(fn):
    """``fn`` with fp8.quantize_fp8 replaced by a copy the check does not refuse (the mistake is the point)."""
    copy = type(fp8.quantize_fp8)(fp8.quantize_fp8.__code__, fp8.quantize_fp8.__globals__, "quantize_copy")

    def run(x, block_size):
        saved = fp8.quantize_fp8
        fp8.quantize_fp8 = copy
        try:
            return fn(x, block_size)
        finally:
            fp8.quantize_fp8 = saved

    return run


def test_quantize_refuses_the_course_answer():
    _fails(check_quantize_fp8, lambda x, bs: fp8.quantize_fp8(x, bs), "the course's own answer")


# -- check_persistent_schedule ------------------------------------------------------
def _lpt(tiles, costs, n):
    heap = [(0.0, p) for p in range(n)]
    out = [[] for _ in range(n)]
    for i in sorted(range(len(tiles)), key=lambda i: -costs[i]):
        load, p = heapq.heappop(heap)
        out[p].append(tiles[i])
        heapq.heappush(heap, (load + costs[i], p))
    return out


def _lpt_lists(tiles, costs, n):  # tiles as lists, programs as tuples: written differently
    return tuple([list(t) for t in program] for program in _lpt(tiles, costs, n))


def test_schedule_correct_variants_pass():
    assert check_persistent_schedule(_lpt)
    assert check_persistent_schedule(_lpt_lists)


def test_schedule_borrowing_the_course_s_lpt_is_refused():
    from course_utils.kernels import fp8

    with pytest.raises(GradingError, match=r"fp8\.lpt_schedule: it is the course's own answer"):
        check_persistent_schedule(lambda tiles, costs, n: fp8.lpt_schedule(tiles, costs, n))


def test_lpt_passes_where_it_is_above_the_fixed_factor():
    # The H200 run's seed: LPT's own makespan there is 1.19x the lower bound (> MAKESPAN_FACTOR).
    assert check_persistent_schedule(_lpt, seed=1168228237)


def _dropped(tiles, costs, n):
    out = _lpt(tiles, costs, n)
    out[0] = out[0][1:]
    return out


def _repeated(tiles, costs, n):
    out = _lpt(tiles, costs, n)
    out[-1] = out[-1] + [tiles[0]]
    return out


def _round_robin(tiles, costs, n):
    return [tiles[i::n] for i in range(n)]


def _chunks(tiles, costs, n):
    per = -(-len(tiles) // n)
    return [tiles[i * per:(i + 1) * per] for i in range(n)]


@pytest.mark.parametrize("fn, message", [
    (_dropped, "tiles are in no program"),
    (_repeated, "is scheduled twice"),
    (_round_robin, p7.MSG_ROUND_ROBIN),
    (_chunks, p7.MSG_CHUNKS),
    (lambda tiles, costs, n: _lpt(tiles, costs, n)[:-1], "return exactly n_programs"),
    (lambda tiles, costs, n: [[tiles.index(t) for t in p] for p in _lpt(tiles, costs, n)], "not their indices"),
], ids=["dropped", "repeated", "round-robin", "chunks", "too-few-programs", "indices"])
def test_schedule_mistakes_are_diagnosed(fn, message):
    _fails(check_persistent_schedule, fn, message)


def test_schedule_bound_admits_lpt_and_rejects_one_program():
    tiles = [(m, 0) for m in range(8)]
    costs = [float(m + 1) for m in range(8)]
    assert p7.lower_bound(costs, 3) == 12.0
    _fails(check_persistent_schedule, lambda t, c, n: [list(t)] + [[] for _ in range(n - 1)], "unbalanced")


# -- check_fp8_forward ----------------------------------------------------------------
def _fwd(module, vt=lambda v8: v8.transpose(2, 3).contiguous(), causal=None):
    def fn(q8, k8, v8, q_scale, k_scale, v_scale, causal_=False, block_size=128):
        return module.launch_fp8(q8, k8, vt(v8), q_scale, k_scale, v_scale,
                                 causal_ if causal is None else causal, block_size,
                                 torch.float32 if q8.device.type == "cpu" else torch.bfloat16)

    def launcher(q8, k8, v8, q_scale, k_scale, v_scale, causal=False, block_size=128):
        return fn(q8, k8, v8, q_scale, k_scale, v_scale, causal, block_size)

    return launcher


P8 = "p8 = to_e4m3(p * P_SCALE, INTERPRETED)  # p in [0, 1] -> [0, P_SCALE], exact for p = 1"
PV = "tl.dot(p8, tl.trans(vt))"
CORRECT = {
    "course": [],
    "p-float32": [(P8, "p8 = p * P_SCALE"), (PV, "tl.dot(p8, tl.trans(vt).to(tl.float32))")],
    "p-bf16": [(P8, "p8 = (p * P_SCALE).to(tl.bfloat16)"), (PV, "tl.dot(p8, tl.trans(vt).to(tl.bfloat16))")],
    "plain-cast": [(P8, "p8 = (p * P_SCALE).to(tl.float8e4nv)")],
}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.gpu("Triton's interpreter computes bf16 wrongly")) if "bf16" in name
    else name for name in CORRECT])
def test_fp8_forward_correct_variants_pass(variant, name):
    assert check_fp8_forward(_fwd(variant(name, *CORRECT[name])))


def test_fp8_forward_k_major_written_differently_passes(variant):
    module = variant("course")
    assert check_fp8_forward(_fwd(module, vt=lambda v8: v8.mT.clone(memory_format=torch.contiguous_format)))


def test_fp8_forward_that_edits_its_scales_in_place_is_refused(variant):
    right = _fwd(variant("course"))

    def rescales(q8, k8, v8, q_scale, k_scale, v_scale, causal=False, block_size=128):
        o = right(q8, k8, v8, q_scale, k_scale, v_scale, causal, block_size)
        k_scale.mul_(2.0)  # e.g. sm_scale folded into the caller's k_scale
        return o

    with pytest.raises(GradingError, match="changed its input `k_scale` in place"):
        check_fp8_forward(rescales)


QS_LOAD = "mask=m_ok, other=1.0) * (sm_scale * 1.4426950408889634)"
MISTAKES = {
    "no-q-scale": ([(QS_LOAD, "mask=m_ok, other=1.0) * 0.0 + (sm_scale * 1.4426950408889634)")], p7.MSG_NO_Q_SCALE),
    "no-k-scale": ([("(q_scale[:, None] * k_scale)", "(q_scale[:, None])")], p7.MSG_NO_K_SCALE),
    "no-v-scale": ([("* (v_scale / P_SCALE)", "* (1.0 / P_SCALE)")], p7.MSG_NO_V_SCALE),
    "p-scale-kept": ([("* (v_scale / P_SCALE)", "* v_scale")], p7.MSG_P_SCALE),
    "no-sm-scale": ([(QS_LOAD, "mask=m_ok, other=1.0) * 1.4426950408889634")], p7.MSG_NO_SM_SCALE),
    # The K tile's scale indexed per tile, not per scale block: the last head reads past the scales (NaN).
    "k-scale-per-tile": ([("tl.load(ks_base + (start_n // SCALE_BLOCK) * stride_ksn)",
                           "tl.load(ks_base + (start_n // BLOCK_N) * stride_ksn)")], p7.MSG_FP8_NAN),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_fp8_forward_mistakes_are_diagnosed(variant, name):
    edits, message = MISTAKES[name]
    _fails(check_fp8_forward, _fwd(variant(name, *edits)), message)


@pytest.mark.gpu("the interpreter reads e4m3fn's NaN (0x7F) as 480, so the NaN padding of the head dim shows only "
                 "on a GPU")
def test_fp8_forward_head_dim_unmasked_is_diagnosed(variant):
    edits = [("mask=n_ok[None, :] & d_ok[:, None], other=0.0,", "mask=n_ok[None, :], other=0.0,")]
    _fails(check_fp8_forward, _fwd(variant("k-head-dim-unmasked", *edits)), p7.MSG_FP8_NAN)


def test_fp8_forward_v_not_transposed_is_diagnosed(variant):
    # A transposed *view*: the values are right, but V's keys are not contiguous (not K-major).
    text = _fails(check_fp8_forward, _fwd(variant("course"), vt=lambda v8: v8.transpose(2, 3)),
                  p7.MSG_V_ROW_MAJOR)
    assert "output is right" in text


def test_fp8_forward_no_causal_mask_is_diagnosed(variant):
    _fails(check_fp8_forward, _fwd(variant("course"), causal=False), p7.MSG_NO_CAUSAL_FP8)


def test_fp8_forward_refuses_the_course_kernel():
    _fails(check_fp8_forward, _fwd(fp8), "course_utils's own kernel")
