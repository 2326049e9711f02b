"""Lesson 11's hand-specialised Hopper forward (course_utils.kernels.hopper_ws, Gluon).

Gluon has no interpreter, so on a CPU (CI) the kernel is compiled for sm_90 by Triton's compiler and what it
became is checked: 12 warps in three partitions (two consumers running every ``wgmma``, one loader issuing
every TMA copy), registers moved by ``setmaxnreg`` (240 to each consumer, 24 to the loader), no spills, and
shared memory inside the H200's. On a Hopper GPU every variant is checked against the float64 reference.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from course_utils import references
from course_utils.kernels import hopper_ws, targets

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

CASES = [(True, 128, "serial", False, 2), (False, 128, "serial", False, 2), (True, 64, "serial", False, 2),
         (True, 128, "pipelined", False, 2), (True, 128, "serial", False, 3), (True, 128, "pingpong", False, 2),
         (False, 128, "serial", True, 2), (True, 128, "pingpong", True, 2), (True, 128, "overlap", False, 2),
         (False, 64, "overlap", True, 3), (True, 128, "overlap_pingpong", True, 2)]  # causal, D, loop, fma, buffers
# the FP8 entry (attention_fp8: e4m3 tiles, V transposed, the scales): causal, D, loop, buffers
FP8_CASES = [(True, 128, "serial", 2), (False, 128, "pingpong", 3), (True, 128, "overlap", 4), (False, 64, "serial", 2),
             (True, 128, "overlap_pingpong", 2)]
# lesson 08's window (causal): D, loop, window_size, sink_size, FP8
WINDOW_CASES = [(128, "serial", 1024, 4, False), (128, "pingpong", 256, 0, False), (64, "serial", 4096, 4, False),
                (128, "serial", 1024, 4, True)]
# the persistent grid: causal, D, loop, window_size, sink_size, fma[, heads_together]
PERSISTENT_CASES = [(True, 128, "serial", None, 0, False), (False, 128, "pingpong", None, 0, False),
                    (True, 128, "serial", 1024, 4, False), (True, 128, "pingpong", 256, 0, False),
                    (True, 128, "serial", 1024, 4, True), (False, 128, "serial", None, 0, True, 4)]
# FP8 (attention_fp8's tiles) on the persistent grid: causal, D, loop, window_size, sink_size, buffers[, heads_together]
PERSISTENT_FP8_CASES = [(True, 128, "serial", None, 0, 3), (False, 128, "pingpong", None, 0, 2),
                        (True, 128, "serial", 1024, 4, 2), (True, 128, "serial", None, 0, 2, 4)]
# FP8's wide tiles (attention_fp8(block_n=256), the serial loop): causal, D, buffers
WIDE_CASES = [(False, 128, 2), (True, 128, 2), (False, 128, 3), (True, 64, 2)]

SCRIPT = r"""
import json, sys, torch
from course_utils.kernels import hopper_ws, targets
cases, fp8_cases, window_cases, persistent_cases, persistent_fp8_cases, wide_cases = json.loads(sys.argv[1])
launches_of = []
for causal, d, loop, fma, buffers in cases:
    q = torch.empty(1, 32, 1024, d, dtype=torch.bfloat16)
    k = torch.empty(1, 8, 1024, d, dtype=torch.bfloat16)
    launches_of.append(((q, k, k, causal, 0.1, buffers, loop, fma), f"{causal} {d} {loop} {fma} {buffers}"))
for causal, d, loop, buffers in fp8_cases:
    q8 = torch.empty(1, 32, 1024, d, dtype=torch.float8_e4m3fn)
    k8 = torch.empty(1, 8, 1024, d, dtype=torch.float8_e4m3fn)
    vt8 = torch.empty(1, 8, d, 1024, dtype=torch.float8_e4m3fn)
    scales = (torch.ones(1, 32, 8), torch.ones(1, 8, 8), torch.ones(1, 8, 8))
    launches_of.append(((q8, k8, vt8, causal, 0.1, buffers, loop, True, scales, 128),
                        f"fp8 {causal} {d} {loop} {buffers}"))
for causal, d, buffers in wide_cases:
    q8 = torch.empty(1, 32, 1024, d, dtype=torch.float8_e4m3fn)
    k8 = torch.empty(1, 8, 1024, d, dtype=torch.float8_e4m3fn)
    vt8 = torch.empty(1, 8, d, 1024, dtype=torch.float8_e4m3fn)
    scales = (torch.ones(1, 32, 8), torch.ones(1, 8, 8), torch.ones(1, 8, 8))
    launches_of.append(((q8, k8, vt8, causal, 0.1, buffers, "serial", True, scales, 128, None, 0, 256),
                        f"fp8 wide {causal} {d} {buffers}"))
for d, loop, window, sinks, fp8 in window_cases:
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q, k = torch.empty(1, 32, 1024, d, dtype=dtype), torch.empty(1, 8, 1024, d, dtype=dtype)
    v = torch.empty(1, 8, d, 1024, dtype=dtype) if fp8 else k
    scales = (torch.ones(1, 32, 8), torch.ones(1, 8, 8), torch.ones(1, 8, 8)) if fp8 else None
    launches_of.append(((q, k, v, True, 0.1, 2, loop, fp8, scales, 128, window, sinks),
                        f"window {d} {loop} {window} {sinks} {fp8}"))
out = []
for causal, d, loop, window, sinks, fma, *heads in persistent_cases:
    q, k = torch.empty(1, 32, 1024, d, dtype=torch.bfloat16), torch.empty(1, 8, 1024, d, dtype=torch.bfloat16)
    with targets._captured_launches() as launches:
        hopper_ws._launch_persistent(q, k, k, causal, 0.1, 2, loop, fma, 132, window_size=window, sink_size=sinks,
                                     heads_together=heads[0] if heads else None)
    (kernel, args, kwargs), = launches
    case = (f"persistent {causal} {d} {loop}" + ("" if window is None else f" window {window} {sinks}")
            + (" fma" if fma else "") + (f" heads {heads[0]}" if heads else ""))
    out.append(vars(targets.compile_launch(kernel, args, kwargs, 90, case, warnings=True)))
for causal, d, loop, window, sinks, buffers, *heads in persistent_fp8_cases:
    q8 = torch.empty(1, 32, 1024, d, dtype=torch.float8_e4m3fn)
    k8 = torch.empty(1, 8, 1024, d, dtype=torch.float8_e4m3fn)
    vt8 = torch.empty(1, 8, d, 1024, dtype=torch.float8_e4m3fn)
    scales = (torch.ones(1, 32, 8), torch.ones(1, 8, 8), torch.ones(1, 8, 8))
    with targets._captured_launches() as launches:
        hopper_ws._launch_persistent(q8, k8, vt8, causal, 0.1, buffers, loop, True, 132, window_size=window,
                                     sink_size=sinks, scales=scales, heads_together=heads[0] if heads else None)
    (kernel, args, kwargs), = launches
    case = (f"fp8 persistent {causal} {d} {loop} {buffers}" + ("" if window is None else f" window {window} {sinks}")
            + (f" heads {heads[0]}" if heads else ""))
    out.append(vars(targets.compile_launch(kernel, args, kwargs, 90, case, warnings=True)))
for args, case in launches_of:
    with targets._captured_launches() as launches:
        hopper_ws._launch(*args)
    (kernel, args, kwargs), = launches
    out.append(vars(targets.compile_launch(kernel, args, kwargs, 90, case, warnings=True)))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    # Triton's compiler (not the interpreter), no GPU in sight: the machine code for sm_90
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([CASES, FP8_CASES, WINDOW_CASES, PERSISTENT_CASES,
                                                                      PERSISTENT_FP8_CASES, WIDE_CASES])],
                         capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_it_compiles_to_a_loader_and_two_consumers(compiled):
    assert len(compiled) == len(CASES) + len(FP8_CASES) + len(WINDOW_CASES) + len(PERSISTENT_CASES) + len(
        PERSISTENT_FP8_CASES) + len(WIDE_CASES)
    for r in compiled:
        assert r["num_warps"] == 12, r  # 4 + 4 + the loader's warp, in warpgroups
        names = [p[0] for p in r["partitions"]]
        assert len(names) == 3, r
        consumers = [p for p in r["partitions"] if p[1] > 0]
        loaders = [p for p in r["partitions"] if p[2] > 0]
        assert len(consumers) == 2 and all(p[2] == 0 for p in consumers), r  # no copies in a consumer
        assert len(loaders) == 1 and loaders[0][1] == 0, r  # no products in the loader
        assert consumers[0][1] == consumers[1][1], r  # both consumers run the same products


def test_registers_move_to_the_consumers_without_spills(compiled):
    """No spills, but in FP8's wide causal tiles: their diagonal tile (once a program) holds a 64 x 256 score tile, its
    mask and both halves' scales at once, and ptxas spills at D = 128: 160 bytes with triton 3.6 (the GPU machines'),
    all of it in that tile's code, and 240 with 3.8."""
    for r in compiled:
        moves = {tuple(m) for m in r["setmaxnreg"]}
        assert ("inc", str(hopper_ws.CONSUMER_REGS)) in moves and ("dec", str(hopper_ws.LOADER_REGS)) in moves, r
        if r["case"] == "fp8 wide True 128 2":
            assert 0 < r["spill_bytes"] <= 256, r
        else:
            assert r["spill_bytes"] == 0, r
        assert r["registers"] <= hopper_ws.MAXNREG, r


def test_no_loop_makes_ptxas_serialise_its_wgmma(compiled):
    """ptxas serialises every wgmma of a kernel when code writes a register that a running wgmma still reads
    (warning C7513) or when the registers run short (C7511). FA3's overlap did the first with Triton 3.6 (the
    GPU machines') until the wait kept the previous P alive (``_overlap_step``): 192 warpgroup fences instead of
    24, and no overlap left; Triton 3.8's compiler does not make that mistake, so this check bites with 3.6.
    Every loop must compile without either, but the pipelined one: with two score tiles live it runs short of
    registers (C7511 with both versions), one reason it measured slower."""
    assert len(compiled) == len(CASES) + len(FP8_CASES) + len(WINDOW_CASES) + len(PERSISTENT_CASES) + len(
        PERSISTENT_FP8_CASES) + len(WIDE_CASES)
    for r in compiled:
        if r["case"] == "True 128 pipelined False 2":
            assert len(r["ptxas_warnings"]) == 1 and "(C7511)" in r["ptxas_warnings"][0], r["ptxas_warnings"]
        else:
            assert not r["ptxas_warnings"], (r["case"], r["ptxas_warnings"])


def test_fp8_s_wide_tiles_multiply_256_keys_at_a_time_in_twice_the_shared_memory(compiled):
    """attention_fp8(block_n=256): Q Kᵀ over 256 keys per wgmma (N = 256), P V still D wide, every K and V slot twice
    an FP8 one of 128 keys (three slots fit)."""
    by_case = {r["case"]: r for r in compiled}
    for causal, d, buffers in WIDE_CASES:
        r = by_case[f"fp8 wide {causal} {d} {buffers}"]
        assert set(r["wgmma"]) == {"m64n256k32.f32.e4m3.e4m3", f"m64n{d}k32.f32.e4m3.e4m3"}, r["wgmma"]
    narrow, wide = by_case["fp8 True 128 serial 2"]["shared_bytes"], by_case["fp8 wide True 128 2"]["shared_bytes"]
    assert wide - narrow == pytest.approx(2 * 2 * 128 * 128, abs=512), (narrow, wide)  # two slots of K and V, twice


def test_shared_memory_fits_the_h200(compiled):
    limit = targets.TARGETS[90][1]
    for r in compiled:
        assert 0 < r["shared_bytes"] <= limit, r
    by_case = {r["case"]: r["shared_bytes"] for r in compiled}
    # a third K/V slot costs one more 128 x 128 bf16 tile of K and one of V, and its three 8-byte barriers
    extra = by_case["True 128 serial False 3"] - by_case["True 128 serial False 2"]
    assert 2 * 128 * 128 * 2 <= extra <= 2 * 128 * 128 * 2 + 64, extra


def test_the_fp8_entry_multiplies_e4m3_tiles_of_half_the_memory(compiled):
    """Both products on FP8 wgmma (K = 32 per instruction), nothing in 16 bits; an e4m3 tile is half a bf16 one."""
    by_case = {r["case"]: r for r in compiled}
    for causal, d, loop, buffers in FP8_CASES:
        r = by_case[f"fp8 {causal} {d} {loop} {buffers}"]
        # Q K^T (N = 128 keys) and P V (N = D), e4m3 x e4m3 into float32
        assert set(r["wgmma"]) == {"m64n128k32.f32.e4m3.e4m3", f"m64n{d}k32.f32.e4m3.e4m3"}, r["wgmma"]
    for r in compiled:
        if not r["case"].startswith("fp8") and not r["case"].endswith("True"):
            assert all(w.endswith(("bf16.bf16", "f16.f16")) for w in r["wgmma"]) and r["wgmma"], r
    bf16, fp8 = by_case["True 128 serial False 2"]["shared_bytes"], by_case["fp8 True 128 serial 2"]["shared_bytes"]
    assert 0 < 2 * fp8 - bf16 <= 512, (bf16, fp8)  # the tiles halve; only the barriers' bytes stay
    # the persistent grid's FP8 tiles: the same products, and two Q buffers of e4m3 beside three K/V slots
    for causal, d, loop, window, sinks, buffers, *heads in PERSISTENT_FP8_CASES:
        window_case = "" if window is None else f" window {window} {sinks}"
        heads_case = f" heads {heads[0]}" if heads else ""
        r = by_case[f"fp8 persistent {causal} {d} {loop} {buffers}{window_case}{heads_case}"]
        assert set(r["wgmma"]) == {"m64n128k32.f32.e4m3.e4m3", f"m64n{d}k32.f32.e4m3.e4m3"}, r["wgmma"]
    bf16 = by_case["persistent True 128 serial"]["shared_bytes"]  # 2 slots: 4 Q halves + 4 K/V tiles of bf16
    fp8_3 = by_case["fp8 persistent True 128 serial 3"]["shared_bytes"]  # 3 slots: 4 Q halves + 6 tiles of e4m3
    assert fp8_3 - bf16 // 2 == pytest.approx(2 * 128 * 128, abs=512), (bf16, fp8_3)  # one more K and V slot in e4m3


@pytest.mark.parametrize("shapes,dtype,message", [
    (((1, 4, 256, 128), (1, 2, 256, 128)), torch.float32, "bf16 or fp16"),
    (((1, 4, 256, 96), (1, 2, 256, 96)), torch.bfloat16, "head dim 96"),
    (((1, 4, 200, 128), (1, 2, 200, 128)), torch.bfloat16, "multiple of 128"),
    (((1, 4, 256, 128), (1, 3, 256, 128)), torch.bfloat16, "multiple of H_kv"),
    (((1, 4, 256, 128), (1, 2, 128, 128)), torch.bfloat16, "multiple of H_kv"),
])
def test_unsupported_inputs_are_refused_in_one_sentence(shapes, dtype, message):
    q = torch.zeros(shapes[0], dtype=dtype)
    k = torch.zeros(shapes[1], dtype=dtype)
    with pytest.raises(ValueError, match=message):
        hopper_ws.attention(q, k, k)


def test_more_query_blocks_than_a_grid_holds_are_refused_in_one_sentence():
    """A program per tile puts its query blocks on the grid's second extent (hopper_ws._grid_tile), which holds
    65535: N up to 65535 blocks of 128 is taken (the check is the inputs'), one block more is refused, and the public
    entry's route asks the same question (unsupported_reason)."""
    n = hopper_ws.MAX_GRID_BLOCKS * hopper_ws.BLOCK_M
    q, k = (torch.empty(1, h, n + hopper_ws.BLOCK_M, 128, dtype=torch.bfloat16, device="meta") for h in (4, 2))
    with pytest.raises(ValueError, match=f"N <= {n}"):
        hopper_ws.attention(q, k, k)
    assert f"N <= {n}" in hopper_ws.unsupported_reason(q, k, k)
    hopper_ws._validate_inputs(q[:, :, :n], k[:, :, :n], k[:, :, :n])  # the largest N the grids hold


@pytest.mark.skipif(HOPPER, reason="on a Hopper GPU the kernel runs (the GPU tests below)")
def test_without_a_hopper_gpu_it_says_why():
    q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Hopper GPU"):
        hopper_ws.attention(q, k, k)


@pytest.mark.parametrize("options,message", [(dict(loop="pingpongpong"), "loop must be one of"),
                                             (dict(num_buffers=4), "num_buffers must be 2 or 3"),
                                             (dict(window_size=256), "needs causal=True"),
                                             (dict(causal=True, window_size=0), "positive integer"),
                                             (dict(causal=True, window_size=256, sink_size=-1), "non-negative"),
                                             (dict(causal=True, sink_size=4), "needs a window_size"),
                                             (dict(causal=True, window_size=256, loop="overlap"),
                                              "a window runs with loop in"),
                                             (dict(persistent=True, loop="overlap"), "persistent grid runs loop"),
                                             (dict(persistent=True, num_buffers=3), "take 2 buffers")])
def test_unknown_options_are_refused_on_every_machine(options, message):
    q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        hopper_ws.attention(q, k, k, **options)


def _fp8_inputs(b=1, hq=4, hkv=2, n=256, d=128, block_size=128, device="cpu"):
    from course_utils.kernels import quantize_fp8
    g = torch.Generator(device=device).manual_seed(n + d + hq)
    q, k, v = (torch.randn(b, h, n, d, device=device, generator=g) for h in (hq, hkv, hkv))
    (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(t, block_size) for t in (q, k, v))
    return q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs


@pytest.mark.parametrize("change,message", [
    (lambda a: (a[0].float(), *a[1:]), "float8_e4m3fn"),
    (lambda a: (a[0], a[1], a[1], *a[3:]), "vt8 \\[B, H_kv, D, N\\]"),  # V not transposed
    (lambda a: (*a[:3], a[3][:, :, :1], *a[4:]), "q_scale must be float32 \\[1, 4, 2\\]"),  # one scale per tensor
    (lambda a: (*a[:4], None, a[5]), "k_scale must be"),  # a forgotten scale
])
def test_the_fp8_entry_refuses_inputs_not_made_by_quantize_fp8(change, message):
    with pytest.raises(ValueError, match=message):
        hopper_ws.attention_fp8(*change(_fp8_inputs()))


@pytest.mark.parametrize("options,message", [(dict(block_size=64), "block_size must be a power of two of at least 128"),
                                             (dict(num_buffers=5), "num_buffers must be 2, 3 or 4 with FP8"),
                                             (dict(loop="pipelined"), "bf16/fp16 only"),
                                             (dict(persistent=True, loop="overlap"), "persistent grid runs loop"),
                                             (dict(block_n=192), "block_n must be 128 or 256"),
                                             (dict(block_n=256, loop="pingpong"), "serial loop only"),
                                             (dict(block_n=256, persistent=True), "serial loop only"),
                                             (dict(block_n=256, num_buffers=4), "three K/V slots at most"),
                                             (dict(block_n=256, n=384), "N a multiple of 256")])
def test_the_fp8_entrys_options_are_checked(options, message):
    q8, k8, vt8, qs, ks, vs = _fp8_inputs(n=options.pop("n", 256))
    if "block_size" in options:
        qs, ks, vs = (s.repeat_interleave(2, -1) for s in (qs, ks, vs))  # as quantize_fp8(.., 64) would shape them
    with pytest.raises(ValueError, match=message):
        hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, **options)


def _reference(q, k, v, causal, **window):
    o, lse = references.attention_lse(*(t.double().cpu().numpy() for t in (q, k, v)), causal=causal, **window)
    return torch.from_numpy(o).float().cuda(), torch.from_numpy(lse).float().cuda()


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above stand in on a CPU")
@pytest.mark.parametrize("b,hq,hkv,n,d,causal,dtype,loop,fma,buffers", [
    (1, 4, 2, 256, 128, True, torch.bfloat16, "serial", False, 2),
    (2, 8, 2, 1024, 128, False, torch.bfloat16, "serial", False, 2),
    (1, 32, 8, 2048, 128, True, torch.bfloat16, "serial", False, 2),
    (1, 4, 4, 512, 64, True, torch.bfloat16, "serial", False, 2),  # MHA, D = 64
    (1, 4, 1, 384, 128, False, torch.float16, "serial", False, 3),  # MQA, fp16, three slots
    (1, 8, 2, 1024, 128, True, torch.bfloat16, "pipelined", False, 2),
    (1, 8, 2, 128, 128, True, torch.bfloat16, "pipelined", False, 2),  # one tile: the epilogue alone
    (1, 8, 2, 1152, 128, True, torch.bfloat16, "pingpong", False, 2),  # an odd tile count: turns end unmatched
    (2, 8, 2, 1024, 128, False, torch.bfloat16, "pingpong", True, 3),
    (1, 8, 2, 1024, 64, True, torch.float16, "serial", True, 2),
    (1, 8, 2, 1152, 128, True, torch.bfloat16, "overlap", False, 2),  # tiles 1 to 9: the prologue alone at 1
    (2, 8, 2, 640, 64, False, torch.bfloat16, "overlap", True, 3),
    (1, 8, 2, 1152, 128, True, torch.bfloat16, "overlap_pingpong", True, 2),
    (2, 8, 2, 1024, 128, False, torch.float16, "overlap_pingpong", False, 3),
])
def test_matches_the_float64_reference_on_a_hopper_gpu(b, hq, hkv, n, d, causal, dtype, loop, fma, buffers):
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    o, lse = hopper_ws.attention(q, k, v, causal, loop=loop, fma=fma, num_buffers=buffers)
    ro, rl = _reference(q, k, v, causal)
    rel = (torch.linalg.vector_norm(o.float() - ro) / torch.linalg.vector_norm(ro)).item()
    assert o.dtype == dtype and rel < 1e-2, f"relative error of o: {rel:.2e}"
    assert (lse - rl).abs().max().item() < 1e-2


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above stand in on a CPU")
@pytest.mark.parametrize("b,hq,hkv,n,d,causal,loop,buffers,block_size,block_n", [
    (1, 4, 2, 256, 128, True, "serial", 2, 128, 128),
    (2, 8, 2, 1024, 128, False, "serial", 3, 128, 128),
    (1, 32, 8, 2048, 128, True, "pingpong", 2, 256, 128),  # two key tiles to a scale block
    (1, 8, 2, 1152, 128, True, "overlap", 4, 128, 128),  # tiles 1 to 9: the prologue alone at 1
    (1, 4, 4, 640, 64, False, "overlap", 2, 128, 128),  # MHA, D = 64
    (1, 4, 1, 384, 64, True, "serial", 3, 128, 128),  # MQA
    (1, 8, 2, 1152, 128, True, "overlap_pingpong", 2, 128, 128),
    (1, 8, 2, 1280, 128, True, "serial", 2, 128, 256),  # FA3's wide FP8 tiles: 5 of 256 keys, two scale blocks each
    (2, 8, 2, 1024, 128, False, "serial", 3, 128, 256),
    (1, 32, 8, 2048, 128, True, "serial", 2, 256, 256),  # a scale block to a wide tile
    (1, 4, 1, 768, 64, True, "serial", 2, 128, 256),  # MQA, D = 64
])
def test_the_fp8_entry_matches_the_courses_fp8_kernel_on_a_hopper_gpu(b, hq, hkv, n, d, causal, loop, buffers,
                                                                      block_size, block_n):
    """Against lesson 11's Triton FP8 kernel on the same e4m3 inputs (the same arithmetic: P as 256 p in e4m3),
    and against float64 attention over the dequantised inputs (the error FP8's P and accumulation add)."""
    from course_utils.bench.fp8 import rel_rms
    from course_utils.kernels import fp8

    q8, k8, vt8, qs, ks, vs = _fp8_inputs(b, hq, hkv, n, d, block_size, "cuda")
    o, lse = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, block_size=block_size, loop=loop,
                                     num_buffers=buffers, block_n=block_n)
    lesson = fp8.launch_fp8_hopper(q8, k8, vt8, qs, ks, vs, causal, block_size, torch.bfloat16)
    deq = (fp8.dequantize_fp8(x, s, block_size) for x, s in ((q8, qs), (k8, ks), (vt8.transpose(2, 3), vs)))
    ro, rl = _reference(*deq, causal)
    assert o.dtype == torch.bfloat16 and o.shape == q8.shape
    torch.testing.assert_close(o.float(), lesson.float(), atol=3e-2, rtol=3e-2)
    assert rel_rms(o, ro) < 0.05, rel_rms(o, ro)
    assert (lse - rl).abs().max().item() < 2e-2


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above and tests/test_gluon_cpu.py's model stand in on a CPU")
@pytest.mark.parametrize("b,hq,hkv,n,d,causal,loop,buffers,block_size,window,sinks", [
    (2, 8, 2, 1024, 128, True, "serial", 3, 128, None, 0),
    (1, 32, 8, 2048, 128, False, "pingpong", 2, 256, None, 0),  # two key tiles to a scale block
    (1, 4, 4, 640, 64, True, "serial", 2, 128, None, 0),  # MHA, D = 64
    (1, 8, 2, 1152, 128, True, "serial", 2, 128, 200, 4),  # lesson 08's window and sinks
])
def test_the_fp8_persistent_grid_matches_the_fp8_entry_on_a_hopper_gpu(b, hq, hkv, n, d, causal, loop, buffers,
                                                                       block_size, window, sinks):
    """attention_fp8(persistent=True): the same arithmetic as one program per tile, so the same o to bf16's
    rounding, and right against float64 attention over the dequantised inputs."""
    from course_utils.bench.fp8 import rel_rms
    from course_utils.kernels import fp8

    q8, k8, vt8, qs, ks, vs = _fp8_inputs(b, hq, hkv, n, d, block_size, "cuda")
    mask = dict(window_size=window, sink_size=sinks)
    o, lse = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, block_size=block_size, loop=loop,
                                     num_buffers=buffers, persistent=True, **mask)
    want_o, want_lse = hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, block_size=block_size, loop=loop,
                                               **mask)
    torch.testing.assert_close(o, want_o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    deq = (fp8.dequantize_fp8(x, s, block_size) for x, s in ((q8, qs), (k8, ks), (vt8.transpose(2, 3), vs)))
    ro, rl = _reference(*deq, causal, **({} if window is None else mask))
    assert rel_rms(o, ro) < 0.05, rel_rms(o, ro)
    assert (lse - rl).abs().max().item() < 2e-2


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above and tests/test_gluon_cpu.py's model stand in on a CPU")
@pytest.mark.parametrize("persistent", [False, True])  # a program per tile walks as its grid's shape says
@pytest.mark.parametrize("fp8_tiles,causal,window", [
    (False, True, None), (False, False, None), (True, True, None), (True, False, None), (False, True, 300)])
def test_either_grid_walked_a_kv_head_at_a_time_matches_its_default_walk_on_a_hopper_gpu(fp8_tiles, causal, window,
                                                                                          persistent):
    """heads_together=kv_head_order(...): the same work tiles in another order, so the same o (to bf16's rounding)
    and lse as the grid's default walk, and right against float64 attention."""
    from course_utils.bench.fp8 import rel_rms
    from course_utils.kernels import fp8

    heads = hopper_ws.kv_head_order(8, 4)
    mask = dict(window_size=window, sink_size=0 if window is None else 4)
    if fp8_tiles:
        q8, k8, vt8, qs, ks, vs = _fp8_inputs(2, 8, 2, 1024, 128, 128, "cuda")
        entry, args, options = hopper_ws.attention_fp8, (q8, k8, vt8, qs, ks, vs, causal), dict(persistent=persistent)
        inputs = [fp8.dequantize_fp8(x, s) for x, s in ((q8, qs), (k8, ks), (vt8.transpose(2, 3), vs))]
    else:
        g = torch.Generator(device="cuda").manual_seed(heads)
        inputs = [torch.randn(2, h, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2)]
        entry, args, options = hopper_ws.attention, (*inputs, causal), dict(persistent=persistent, fma=True)
    o, lse = entry(*args, **options, **mask, heads_together=heads)
    want_o, want_lse = entry(*args, **options, **mask)
    torch.testing.assert_close(o, want_o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    ro, rl = _reference(*inputs, causal, **({} if window is None else mask))
    assert rel_rms(o, ro) < (0.05 if fp8_tiles else 1e-2), rel_rms(o, ro)
    assert (lse - rl).abs().max().item() < 2e-2


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above and tests/test_gluon_cpu.py's model stand in on a CPU")
@pytest.mark.parametrize("fma", [False, True])  # the softmax's scale in one FMA (dispatch.GLUON_FMA)
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("b,hq,hkv,n,d,window,sinks,loop", [
    (1, 8, 2, 1024, 128, 256, 0, "serial"),
    (1, 8, 2, 1152, 128, 200, 4, "serial"),  # a window that is no multiple of the tile
    (2, 4, 4, 768, 64, 128, 130, "pingpong"),  # two sink tiles
    (1, 8, 2, 512, 128, 1000, 0, "serial"),  # wider than most rows' past
])
def test_the_window_matches_the_float64_reference_on_a_hopper_gpu(b, hq, hkv, n, d, window, sinks, loop, persistent,
                                                                  fma):
    """One program per query block, or the persistent grid walking the blocks' windows in turn."""
    g = torch.Generator(device="cuda").manual_seed(n + window)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    o, lse = hopper_ws.attention(q, k, v, True, window_size=window, sink_size=sinks, loop=loop, persistent=persistent,
                                 fma=fma)
    ro, rl = _reference(q, k, v, True, window_size=window, sink_size=sinks)
    rel = (torch.linalg.vector_norm(o.float() - ro) / torch.linalg.vector_norm(ro)).item()
    assert rel < 1e-2, f"relative error of o: {rel:.2e}"
    assert (lse - rl).abs().max().item() < 1e-2


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; the compile "
                                       "tests above stand in on a CPU")
@pytest.mark.parametrize("fma", [False, True])
@pytest.mark.parametrize("b,hq,hkv,n,d,causal,loop", [
    (2, 8, 2, 1024, 128, True, "serial"), (1, 32, 8, 2048, 128, False, "pingpong"), (1, 4, 4, 384, 64, True, "serial"),
    (2, 8, 2, 1024, 128, False, "serial")])  # the route's launch without the causal mask (GLUON_NONCAUSAL_PERSISTENT)
def test_the_persistent_grid_matches_the_float64_reference_on_a_hopper_gpu(b, hq, hkv, n, d, causal, loop, fma):
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    o, lse = hopper_ws.attention(q, k, v, causal, loop=loop, persistent=True, fma=fma)
    ro, rl = _reference(q, k, v, causal)
    rel = (torch.linalg.vector_norm(o.float() - ro) / torch.linalg.vector_norm(ro)).item()
    assert rel < 1e-2, f"relative error of o: {rel:.2e}"
    assert (lse - rl).abs().max().item() < 1e-2


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; "
                                       "tests/test_gluon_cpu.py checks the route in the model on a CPU")
@pytest.mark.parametrize("causal,h_kv,window,sinks", [(True, 2, None, 0), (False, 8, None, 0), (True, 2, 512, 0),
                                                     (True, 2, 384, 4)])
def test_the_gluon_route_of_kernels_flash_attention_on_a_hopper_gpu(monkeypatch, causal, h_kv, window, sinks):
    """dispatch.GLUON_MIN_N set (and GLUON_WINDOW_MIN_N and GLUON_MIN_WINDOW, for lesson 08's window and sinks):
    kernels.flash_attention_with_lse runs hopper_ws.attention (the same o and lse bit for bit; a window on the
    persistent grid), right against float64, and its gradients through autograd too (whichever backward applies)."""
    from course_utils.kernels import dispatch, flash_attention, flash_attention_with_lse

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 8, 1536, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v, do = (torch.randn(1, h, 1536, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (h_kv, h_kv, 8))
    monkeypatch.setattr(dispatch, "GLUON_MIN_N", 1024)
    monkeypatch.setattr(dispatch, "GLUON_WINDOW_MIN_N", 1024)
    monkeypatch.setattr(dispatch, "GLUON_MIN_WINDOW", 384)
    mask = dict(window_size=window, sink_size=sinks)
    o, lse = flash_attention_with_lse(q, k, v, causal, **mask)
    want_o, want_lse = hopper_ws.attention(q, k, v, causal, **mask, persistent=dispatch.gluon_persistent(causal, window),
                                           fma=dispatch.GLUON_FMA)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    arrays = [t.double().cpu().numpy() for t in (q, k, v)]
    ref = torch.from_numpy(references.attention(*arrays, causal=causal, **mask))
    assert (torch.linalg.vector_norm(o.double().cpu() - ref) / torch.linalg.vector_norm(ref)).item() < 1e-2
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal, **mask).backward(do)
    want = references.attention_backward(*arrays, do.double().cpu().numpy(), causal=causal, **mask)
    for name, leaf, w in zip(("dq", "dk", "dv"), leaves, want):
        w = torch.from_numpy(w)
        rel = (torch.linalg.vector_norm(leaf.grad.double().cpu() - w) / torch.linalg.vector_norm(w)).item()
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (H100/H200): Gluon has no interpreter; "
                                       "tests/test_gluon_cpu.py checks the route in the model on a CPU")
@pytest.mark.parametrize("causal", [True, False])
def test_the_gluon_fp8_route_of_flash_attention_fp8_on_a_hopper_gpu(monkeypatch, causal):
    """fp8.GLUON_MIN_N set: flash_attention_fp8 runs hopper_ws.attention_fp8 (its o bit for bit, bf16), as accurate
    as exact math on the quantised inputs allows."""
    from course_utils.kernels import flash_attention_fp8, fp8, quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    monkeypatch.setattr(fp8, "GLUON_MIN_N", 1024)
    o = flash_attention_fp8(q, k, v, causal)
    (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(t) for t in (q, k, v))
    want = hopper_ws.attention_fp8(q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs, causal)[0]
    assert o.dtype == torch.bfloat16 and torch.equal(o, want)
    exact = [fp8.dequantize_fp8(t, s).double().cpu().numpy() for t, s in ((q8, qs), (k8, ks), (v8, vs))]
    ref = torch.from_numpy(references.attention(*exact, causal=causal))
    assert (torch.linalg.vector_norm(o.double().cpu() - ref) / torch.linalg.vector_norm(ref)).item() < 5e-2
