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
         (False, 64, "overlap", True, 3)]  # causal, D, loop, fma, buffers

SCRIPT = r"""
import json, sys, torch
from course_utils.kernels import hopper_ws, targets
out = []
for causal, d, loop, fma, buffers in json.loads(sys.argv[1]):
    q = torch.empty(1, 32, 1024, d, dtype=torch.bfloat16)
    k = torch.empty(1, 8, 1024, d, dtype=torch.bfloat16)
    with targets._captured_launches() as launches:
        hopper_ws._launch(q, k, k, causal, 0.1, buffers, loop, fma)
    (kernel, args, kwargs), = launches
    out.append(vars(targets.compile_launch(kernel, args, kwargs, 90, f"{causal} {d} {loop} {fma} {buffers}")))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    # Triton's compiler (not the interpreter), no GPU in sight: the machine code for sm_90
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_it_compiles_to_a_loader_and_two_consumers(compiled):
    assert len(compiled) == len(CASES)
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
    for r in compiled:
        moves = {tuple(m) for m in r["setmaxnreg"]}
        assert ("inc", str(hopper_ws.CONSUMER_REGS)) in moves and ("dec", str(hopper_ws.LOADER_REGS)) in moves, r
        assert r["spill_bytes"] == 0, r
        assert r["registers"] <= hopper_ws.MAXNREG, r


def test_shared_memory_fits_the_h200(compiled):
    limit = targets.TARGETS[90][1]
    for r in compiled:
        assert 0 < r["shared_bytes"] <= limit, r
    by_case = {r["case"]: r["shared_bytes"] for r in compiled}
    # a third K/V slot costs one more 128 x 128 bf16 tile of K and one of V, and its three 8-byte barriers
    extra = by_case["True 128 serial False 3"] - by_case["True 128 serial False 2"]
    assert 2 * 128 * 128 * 2 <= extra <= 2 * 128 * 128 * 2 + 64, extra


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


@pytest.mark.skipif(HOPPER, reason="on a Hopper GPU the kernel runs (the GPU tests below)")
def test_without_a_hopper_gpu_it_says_why():
    q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Hopper GPU"):
        hopper_ws.attention(q, k, k)


@pytest.mark.parametrize("options,message", [(dict(loop="pingpongpong"), "loop must be one of"),
                                             (dict(num_buffers=4), "num_buffers must be 2 or 3")])
def test_unknown_options_are_refused_on_every_machine(options, message):
    q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        hopper_ws.attention(q, k, k, **options)


def _reference(q, k, v, causal):
    o, lse = references.attention_lse(*(t.double().cpu().numpy() for t in (q, k, v)), causal=causal)
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
])
def test_matches_the_float64_reference_on_a_hopper_gpu(b, hq, hkv, n, d, causal, dtype, loop, fma, buffers):
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    o, lse = hopper_ws.attention(q, k, v, causal, loop=loop, fma=fma, num_buffers=buffers)
    ro, rl = _reference(q, k, v, causal)
    rel = (torch.linalg.vector_norm(o.float() - ro) / torch.linalg.vector_norm(ro)).item()
    assert o.dtype == dtype and rel < 1e-2, f"relative error of o: {rel:.2e}"
    assert (lse - rl).abs().max().item() < 1e-2
