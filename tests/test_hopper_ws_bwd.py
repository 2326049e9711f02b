"""The hand-specialised Gluon kernels of the backward (course_utils.kernels.hopper_ws_bwd): dK/dV and dQ.

On a CPU (CI) they are compiled for sm_90 and what they became is checked: three partitions (two consumers running
the products of each step, a loader issuing every TMA copy), registers moved by ``setmaxnreg``, shared memory
inside the H200's, and fewer spills than lesson 07's dK/dV kernel at its Hopper launch (none in dQ). On a Hopper
GPU the gradients are checked against float64 math.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from course_utils import references, results
from conftest import every_gluon_backward_launch, record_calls
from course_utils.kernels import hopper_ws_bwd, targets

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

CASES = [(True, 128, 64, 2), (False, 128, 64, 2), (True, 128, 32, 2), (False, 128, 32, 3), (True, 64, 64, 2),
         (False, 64, 64, 3)]  # dK/dV: causal, D, block_m, buffers
DQ_CASES = [(True, 128, 64, 2), (False, 128, 128, 2), (True, 128, 64, 3), (True, 64, 128, 3)]  # dQ: ..., dq_block_n, ..
# lesson 08's window (causal, two buffers): kernel, D, block_m or dq_block_n, window_size, sink_size
WINDOW_CASES = [("dkdv", 128, 64, 1024, 4), ("dkdv", 128, 32, 256, 0), ("dq", 128, 64, 1024, 4), ("dq", 64, 128, 256, 0)]
# the programs walked a few rows at a time (heads_together; causal, D = 128, two buffers): kernel, block, rows
WALK_CASES = [("dkdv", 64, 4), ("dq", 64, 16)]

SCRIPT = r"""
import json, sys, torch
from course_utils.kernels import hopper_ws_bwd, targets
cases, dq_cases, window_cases, walk_cases = json.loads(sys.argv[1])
out = []
for launch, kind, table in ((hopper_ws_bwd._launch_dkdv, "dkdv", cases), (hopper_ws_bwd._launch_dq, "dq", dq_cases)):
    for causal, d, block, buffers in table:
        q = torch.empty(1, 32, 1024, d, dtype=torch.bfloat16)
        k = torch.empty(1, 8, 1024, d, dtype=torch.bfloat16)
        lse = torch.empty(1, 32, 1024)
        with targets._captured_launches() as launches:
            launch(q, k, k, q, lse, lse, causal, 0.1, buffers, block)
        (kernel, args, kwargs), = launches
        out.append(vars(targets.compile_launch(kernel, args, kwargs, 90, f"{kind} {causal} {d} {block} {buffers}", warnings=True)))
for kind, d, block, window, sinks in window_cases:
    launch = hopper_ws_bwd._launch_dkdv if kind == "dkdv" else hopper_ws_bwd._launch_dq
    q, k = torch.empty(1, 32, 1024, d, dtype=torch.bfloat16), torch.empty(1, 8, 1024, d, dtype=torch.bfloat16)
    lse = torch.empty(1, 32, 1024)
    with targets._captured_launches() as launches:
        launch(q, k, k, q, lse, lse, True, 0.1, 2, block, window, sinks)
    (kernel, args, kwargs), = launches
    case = f"{kind} True {d} {block} 2 window {window} {sinks}"
    out.append(vars(targets.compile_launch(kernel, args, kwargs, 90, case, warnings=True)))
for kind, block, heads in walk_cases:
    launch = hopper_ws_bwd._launch_dkdv if kind == "dkdv" else hopper_ws_bwd._launch_dq
    q, k = torch.empty(1, 32, 1024, 128, dtype=torch.bfloat16), torch.empty(1, 8, 1024, 128, dtype=torch.bfloat16)
    lse = torch.empty(1, 32, 1024)
    with targets._captured_launches() as launches:
        launch(q, k, k, q, lse, lse, True, 0.1, 2, block, heads_together=heads)
    (kernel, args, kwargs), = launches
    out.append(vars(targets.compile_launch(kernel, args, kwargs, 90, f"{kind} True 128 {block} 2 heads {heads}",
                                           warnings=True)))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([CASES, DQ_CASES, WINDOW_CASES, WALK_CASES])],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["case"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}


def test_it_compiles_to_a_loader_and_two_consumers(compiled):
    assert len(compiled) == len(CASES) + len(DQ_CASES) + len(WINDOW_CASES) + len(WALK_CASES)
    for case, r in compiled.items():
        causal = case.split()[1] == "True"
        # dK/dV: Sᵀ, dPᵀ, dV, dK a step; dQ: S, dP, dQ a step, in two loops (unmasked, the diagonal's) if causal
        products = 4 if case.startswith("dkdv") else 3 * (2 if causal else 1)
        assert r["num_warps"] == 12, r
        consumers = [p for p in r["partitions"] if p[1] > 0]
        loaders = [p for p in r["partitions"] if p[2] > 0]
        assert len(r["partitions"]) == 3 and len(consumers) == 2, r
        assert all(p[1] == products and p[2] == 0 for p in consumers), r  # no copies in a consumer
        assert len(loaders) == 1 and loaders[0][1] == 0 and loaders[0][2] == 6, r  # 2 x 2 once, 2 a step
        moves = {tuple(m) for m in r["setmaxnreg"]}
        assert ("inc", str(hopper_ws_bwd.CONSUMER_REGS)) in moves and ("dec", str(hopper_ws_bwd.LOADER_REGS)) in moves


def test_the_products_are_64_rows_by_the_tile_and_by_the_head_dim(compiled):
    for kind, table in (("dkdv", CASES), ("dq", DQ_CASES)):
        for (causal, d, block, buffers) in table:
            r = compiled[f"{kind} {causal} {d} {block} {buffers}"]
            assert set(r["wgmma"]) == {f"m64n{block}k16.f32.bf16.bf16", f"m64n{d}k16.f32.bf16.bf16"}, r["wgmma"]
    for kind, d, block, window, sinks in WINDOW_CASES:
        r = compiled[f"{kind} True {d} {block} 2 window {window} {sinks}"]
        assert set(r["wgmma"]) == {f"m64n{block}k16.f32.bf16.bf16", f"m64n{d}k16.f32.bf16.bf16"}, r["wgmma"]


def test_shared_memory_fits_and_registers_spill_less_than_lesson_07s_kernel(compiled):
    limit = targets.TARGETS[90][1]
    pair = [r for r in results.load("sm90_compiles")["backward_pair"]
            if r["kernel"] == "_attn_bwd_dkdv" and r["config"] == [64, 128, 128, 32, 8, 3, 8, 3]]
    assert pair, "lesson 07's Hopper launch (64 x 128, 8 warps, 3 stages) is in results/sm90_compiles.json"
    for case, r in compiled.items():
        assert 0 < r["shared_bytes"] <= limit, r
        assert r["spill_bytes"] // 4 < pair[0]["spills"], r  # values per thread, as compile_sm90.py counts them
        # dQ, 32-query dK/dV tiles and D = 64: every value in a register
        if case.startswith("dq") or case.split()[3] == "32" or case.split()[2] == "64":
            assert r["spill_bytes"] == 0, r
    # each extra dK/dV slot holds one Q and one dO tile, each extra dQ slot one K and one V tile
    extra = compiled["dkdv False 128 32 3"]["shared_bytes"] - compiled["dkdv True 128 32 2"]["shared_bytes"]
    assert 2 * 32 * 128 * 2 <= extra <= 2 * 32 * 128 * 2 + 64, extra
    extra = compiled["dq True 128 64 3"]["shared_bytes"] - compiled["dq True 128 64 2"]["shared_bytes"]
    assert 2 * 64 * 128 * 2 <= extra <= 2 * 64 * 128 * 2 + 64, extra


def test_a_walk_of_a_few_rows_at_a_time_changes_only_which_block_a_program_takes(compiled):
    """heads_together: each kernel's products, registers and shared memory as with the default walk, and its spills
    but for dK/dV's 64-row tiles, which spill a little already: 48 bytes a thread walked, 40 not, with triton 3.6
    (the GPU machines'; 40 both with 3.8), the walk's division held in the consumers (results/NOTES.md)."""
    for kind, block, heads in WALK_CASES:
        walked, default = compiled[f"{kind} True 128 {block} 2 heads {heads}"], compiled[f"{kind} True 128 {block} 2"]
        for field in ("wgmma", "registers", "shared_bytes"):
            assert walked[field] == default[field], (kind, field, walked[field], default[field])
        extra = walked["spill_bytes"] - default["spill_bytes"]
        assert extra == 0 if kind == "dq" else 0 <= extra <= 8, (kind, walked["spill_bytes"], default["spill_bytes"])


def test_ptxas_keeps_every_wgmma_asynchronous(compiled):
    """No backward kernel writes a register that a running wgmma reads: ptxas would serialise them all (C7513)."""
    assert len(compiled) == len(CASES) + len(DQ_CASES) + len(WINDOW_CASES) + len(WALK_CASES)
    for case, r in compiled.items():
        assert not r["ptxas_warnings"], (case, r["ptxas_warnings"])


def test_the_dq_kernels_shared_memory_is_checked_before_it_is_compiled(compiled):
    """_validate_dq_shared's count of the tiles against what the compiler laid out, and its refusal."""
    for causal, d, block, buffers in DQ_CASES:
        tiles = 2 * (2 * hopper_ws_bwd.DQ_BLOCK_M * d + 2 * buffers * block * d)
        assert tiles <= compiled[f"dq {causal} {d} {block} {buffers}"]["shared_bytes"] <= tiles + 512  # and the barriers
    with pytest.raises(ValueError, match="take 2 buffers or 64-key tiles"):
        hopper_ws_bwd._validate_dq_shared(128, 3, 128)


def _inputs(b=1, hq=4, hkv=2, n=256, d=128, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator(device=device).manual_seed(n + d + hq)
    q, do = (torch.randn(b, hq, n, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("change,message", [
    (dict(dtype=torch.float32), "bf16 or fp16"),
    (dict(d=96), "head dim 96"),
    (dict(n=200), "multiple of 128"),
    (dict(hkv=3), "multiple of H_kv"),
])
def test_unsupported_inputs_are_refused_in_one_sentence(change, message):
    q, k, v, do = _inputs(**change)
    lse = torch.zeros(q.shape[:3])
    with pytest.raises(ValueError, match=message):
        hopper_ws_bwd.attention_backward(q, k, v, q, lse, do)


@pytest.mark.parametrize("options,message", [(dict(num_buffers=4), "num_buffers must be 2 or 3"),
                                             (dict(block_m=128), "block_m must be one of"),
                                             (dict(dq_kernel="atomic"), "dq_kernel must be one of"),
                                             (dict(dq_block_n=32), "dq_block_n must be one of"),
                                             (dict(num_buffers=3, dq_block_n=128), "more than Hopper's"),
                                             (dict(window_size=256), "needs causal=True"),
                                             (dict(causal=True, window_size=256, dq_kernel="lesson07"),
                                              "dq_kernel='gluon'")])
def test_unknown_options_are_refused_on_every_machine(options, message):
    q, k, v, do = _inputs()
    with pytest.raises(ValueError, match=message):
        hopper_ws_bwd.attention_backward(q, k, v, q, torch.zeros(q.shape[:3]), do, **options)


def test_a_wrong_lse_or_do_shape_is_refused():
    q, k, v, do = _inputs()
    with pytest.raises(ValueError, match="lse \\[B, H, N\\]"):
        hopper_ws_bwd.attention_backward(q, k, v, q, torch.zeros(1, 4, 128), do)


@pytest.mark.skipif(HOPPER, reason="on a Hopper GPU the kernel runs (the GPU tests below)")
def test_without_a_hopper_gpu_it_says_why():
    q, k, v, do = _inputs()
    with pytest.raises(ValueError, match="Hopper GPU"):
        hopper_ws_bwd.attention_backward(q, k, v, q, torch.zeros(q.shape[:3]), do)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above stand in on a CPU")
@pytest.mark.parametrize("b,hq,hkv,n,d,causal,dtype,block_m,buffers,dq_kernel,dq_block_n", [
    (1, 4, 2, 256, 128, True, torch.bfloat16, 64, 2, "gluon", 64),
    (2, 8, 2, 512, 128, False, torch.bfloat16, 64, 2, "gluon", 128),
    (1, 8, 2, 640, 128, True, torch.bfloat16, 32, 3, "gluon", 64),  # five key blocks: the diagonal's masks in each
    (1, 8, 2, 640, 128, True, torch.bfloat16, 64, 2, "lesson07", 64),
    (1, 4, 4, 384, 64, True, torch.float16, 64, 3, "gluon", 128),  # MHA, D = 64, fp16
    (1, 4, 1, 256, 64, False, torch.bfloat16, 32, 2, "gluon", 64),  # MQA
])
def test_the_gradients_match_float64_math_on_a_hopper_gpu(b, hq, hkv, n, d, causal, dtype, block_m, buffers,
                                                          dq_kernel, dq_block_n):
    from course_utils.kernels import flash_attention_with_lse

    q, k, v, do = _inputs(b, hq, hkv, n, d, dtype, "cuda")
    o, lse = flash_attention_with_lse(q, k, v, causal)
    dq, dk, dv = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, causal, block_m=block_m, num_buffers=buffers,
                                                  dq_kernel=dq_kernel, dq_block_n=dq_block_n)
    want = references.attention_backward(*(t.double().cpu().numpy() for t in (q, k, v, do)), causal=causal)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        ref = torch.from_numpy(ref).float().cuda()
        assert got.dtype == dtype and got.shape == ref.shape, name
        rel = (torch.linalg.vector_norm(got.float() - ref) / torch.linalg.vector_norm(ref)).item()
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; "
                                       "tests/test_gluon_cpu.py's model stands in on a CPU")
@pytest.mark.parametrize("causal,window,heads", [(True, None, 4), (False, None, 2), (True, 300, 4)])
def test_the_backward_walked_a_few_kv_heads_at_a_time_matches_its_default_walk_on_a_hopper_gpu(causal, window, heads):
    """attention_backward(heads_together=R): the same key and query blocks in another order, so the same gradients
    as the default walk (each program's sums in the same order), and float64 math's."""
    from course_utils.kernels import flash_attention_with_lse

    q, k, v, do = _inputs(2, 16, 4, 1024, 128, torch.bfloat16, "cuda")
    mask = dict(window_size=window, sink_size=0 if window is None else 4)
    o, lse = flash_attention_with_lse(q, k, v, causal, **mask)
    got = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, causal, heads_together=heads, **mask)
    want = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, causal, **mask)
    ref = references.attention_backward(*(t.double().cpu().numpy() for t in (q, k, v, do)), causal=causal, **mask)
    for name, a, b, r in zip(("dq", "dk", "dv"), got, want, ref):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2, msg=name)
        r = torch.from_numpy(r).float().cuda()
        assert (torch.linalg.vector_norm(a.float() - r) / torch.linalg.vector_norm(r)).item() < 2e-2, name


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above stand in on a CPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_every_launch_of_the_search_space_is_right_on_a_hopper_gpu(d, causal):
    """Like tests/test_gpu_fast.py for the forward: every launch hopper_ws_bwd.attention_backward takes (dK/dV's
    query rows per tile, the tiles in flight, either dQ kernel and the Gluon dQ's keys per tile) computes the
    gradients of float64 math, GQA, five key blocks so that the diagonal's masks meet the interior's; the launches
    whose tiles do not fit Hopper's shared memory are refused before anything compiles, in one sentence."""
    ran, refused = every_gluon_backward_launch(*_inputs(1, 4, 2, 640, d, torch.bfloat16, "cuda"), causal)
    assert len(ran) == (16 if d == 64 else 14) and len(refused) == 16 - len(ran)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above stand in on a CPU")
@pytest.mark.parametrize("n,d,window,sinks,block_m,dq_block_n", [
    (1024, 128, 256, 0, 64, 64), (1152, 128, 200, 4, 32, 128), (768, 64, 128, 130, 64, 64)])
def test_the_window_gradients_match_float64_math_on_a_hopper_gpu(n, d, window, sinks, block_m, dq_block_n):
    from course_utils.kernels import flash_attention_with_lse

    q, k, v, do = _inputs(1, 8, 2, n, d, torch.bfloat16, "cuda")
    o, lse = flash_attention_with_lse(q, k, v, True, window_size=window, sink_size=sinks)
    dq, dk, dv = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, True, window_size=window, sink_size=sinks,
                                                  block_m=block_m, dq_block_n=dq_block_n)
    want = references.attention_backward(*(t.double().cpu().numpy() for t in (q, k, v, do)), causal=True,
                                         window_size=window, sink_size=sinks)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        ref = torch.from_numpy(ref).float().cuda()
        rel = (torch.linalg.vector_norm(got.float() - ref) / torch.linalg.vector_norm(ref)).item()
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; "
                                       "tests/test_gluon_cpu.py checks the route in the model on a CPU")
@pytest.mark.parametrize("causal,window,sink", [(True, None, 0), (False, None, 0), (True, 256, 0), (True, 512, 4),
                                                (True, 200, 4)])
def test_the_gluon_mode_behind_kernels_flash_attention_on_a_hopper_gpu(monkeypatch, causal, window, sink):
    """fast_backward.GLUON_DEFAULT as AUTOGRAD_CONFIG: kernels.flash_attention's autograd runs hopper_ws_bwd's kernels
    (the same gradients bit for bit as calling them), right against float64; the step resolves its configuration
    once and the backward launches without checking the call again (host time). Sinks under a window of all N keys
    select nothing more: that call takes the route too; under a shorter window, where GLUON_SINKS is set."""
    from course_utils.kernels import fast_backward as fb
    from course_utils.kernels import flash_attention, flash_attention_with_lse

    q, k, v, do = _inputs(1, 8, 2, 512, 128, torch.bfloat16, "cuda")
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", fb.GLUON_DEFAULT)
    monkeypatch.setattr(fb, "GLUON_SINKS", True)
    assert fb.autograd_config(q, k, v, causal, window, sink) == fb.GLUON_DEFAULT
    calls = record_calls(monkeypatch, (fb, "autograd_config"), (hopper_ws_bwd, "attention_backward"),
                         (hopper_ws_bwd, "backward_validated"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal, window_size=window, sink_size=sink).backward(do)
    assert calls == ["autograd_config", "backward_validated"]
    o, lse = flash_attention_with_lse(q, k, v, causal, window_size=window, sink_size=sink)
    direct = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, causal, window_size=window, sink_size=sink)
    want = references.attention_backward(*(t.double().cpu().numpy() for t in (q, k, v, do)), causal=causal,
                                         window_size=window, sink_size=sink)
    for name, leaf, same, ref in zip(("dq", "dk", "dv"), leaves, direct, want):
        assert torch.equal(leaf.grad, same), name
        ref = torch.from_numpy(ref).float().cuda()
        rel = (torch.linalg.vector_norm(leaf.grad.float() - ref) / torch.linalg.vector_norm(ref)).item()
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; "
                                       "tests/test_gluon_cpu.py checks the walks' routes in the model on a CPU")
@pytest.mark.parametrize("causal", [True, False])
def test_the_walked_routes_behind_kernels_flash_attention_on_a_hopper_gpu(monkeypatch, causal):
    """dispatch.GLUON_WALK_KV_HEADS and fast_backward.GLUON_WALK_ROWS switched on (both off as shipped): the public
    forward without the causal mask runs the persistent grid a kv head at a time, and autograd's Gluon backward walks
    two kv rows at a time; each is the kernels' own result bit for bit, and right against float64."""
    from course_utils.kernels import dispatch, hopper_ws
    from course_utils.kernels import fast_backward as fb
    from course_utils.kernels import flash_attention, flash_attention_with_lse

    q, k, v, do = _inputs(2, 8, 2, 1024, 128, torch.bfloat16, "cuda")
    monkeypatch.setattr(dispatch, "GLUON_MIN_N", 1024)
    monkeypatch.setattr(dispatch, "GLUON_WALK_KV_HEADS", True)
    monkeypatch.setattr(fb, "AUTOGRAD_CONFIG", fb.GLUON_DEFAULT)
    monkeypatch.setattr(fb, "GLUON_WALK_ROWS", 2)
    heads = dispatch.gluon_heads_together(q, k, causal)
    assert heads == (None if causal else 4)  # causal: a program per tile, nothing to walk
    o, lse = flash_attention_with_lse(q, k, v, causal)
    want_o, want_lse = hopper_ws.attention(q, k, v, causal, persistent=not causal, fma=dispatch.GLUON_FMA,
                                           heads_together=heads)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal).backward(do)
    direct = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, causal, heads_together=2)
    want = references.attention_backward(*(t.double().cpu().numpy() for t in (q, k, v, do)), causal=causal)
    for name, leaf, same, ref in zip(("dq", "dk", "dv"), leaves, direct, want):
        assert torch.equal(leaf.grad, same), name
        ref = torch.from_numpy(ref).float().cuda()
        rel = (torch.linalg.vector_norm(leaf.grad.float() - ref) / torch.linalg.vector_norm(ref)).item()
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; "
                                       "tests/test_launch.py checks the launcher with a stand-in kernel on a CPU")
def test_the_bound_launches_are_triton_s_launches_on_a_hopper_gpu():
    """The backward's three launches bound once per key (launch.BoundLauncher) give, bit for bit, the gradients of
    the same launches through ``kernel[grid]`` (what runs while the graders count launches, which then see every
    one), for two keys in turn and the first again."""
    from course_utils.grading.proof import count_launches
    from course_utils.kernels import backward, flash_attention_with_lse

    q, k, v, do = _inputs(1, 8, 2, 512, 128, torch.bfloat16, "cuda")
    for window in (None, 256, None):
        o, lse = flash_attention_with_lse(q, k, v, True, window_size=window)
        with count_launches() as launched:
            want = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, True, window_size=window)
        assert launched == ["attn_bwd_preprocess", "attn_bwd_dkdv_ws", "attn_bwd_dq_ws"]
        for _ in range(2):  # the first call binds the key where no earlier test did; the second runs bound
            got = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, True, window_size=window)
            for name, a, b in zip(("dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), f"{name} (window_size={window})"
    for launcher in (backward._PREPROCESS, hopper_ws_bwd._DKDV, hopper_ws_bwd._DQ):
        assert len(launcher.compiled) >= (1 if launcher is backward._PREPROCESS else 2), launcher.kernel
