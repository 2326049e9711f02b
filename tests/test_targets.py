"""The lesson kernels fit the GPUs learners have: compiled for a T4 (sm_75) and an A100 (sm_80) here.

Colab's free T4 has 64 KiB of shared memory per block; a configuration that
needs more fails there at its first launch with "out of resource". Triton
compiles for a target we name, without the GPU, so CI checks each lesson
kernel's default configuration for those chips (up to Triton's PTX:
shared memory is known by then; ptxas, which would also give registers,
takes tens of seconds per kernel and runs in the command line tool).
D = 128 is the largest head dim of the course, so the one that must fit.
"""

import json
import os
import subprocess
import sys

import pytest

from course_utils.kernels import targets

SCRIPT = r"""
import json, sys
from course_utils.kernels import targets
import torch
out = [vars(r) | {"fits": r.fits} for r in targets.check_targets(sms=(75, 80), head_dims=(128,), registers=False)]
# fp32 (the checks' fp32 cases on a GPU): found on the H200, 257 KiB before the fix
out += [vars(r) | {"fits": r.fits} for r in targets.check_targets(sms=(90,), head_dims=(128,), registers=False, dtype=torch.float32)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    # A fresh Python with Triton's compiler (not the interpreter) and no GPU in sight.
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_lesson_kernel_is_compiled_for_both_targets(compiled):
    names = {"flash_attention_kernel", "_flash_attention_forward_gqa_kernel",
             "attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq",
             "_flash_attention_forward_window_kernel", "_attn_bwd_dkdv_window", "_attn_bwd_dkdv_sinks",
             "_add_sink_partials", "attn_bwd_dq_window",
             "_flash_attention_forward_mods_kernel", "_attn_bwd_dkdv_mods", "_attn_bwd_dq_mods"}  # lesson 12
    for sm in (75, 80):
        assert {r["kernel"] for r in compiled if r["sm"] == sm} == names


@pytest.mark.parametrize("sm", [75, 80, 90])
def test_each_kernel_fits_the_chips_shared_memory(compiled, sm):
    limit = targets.TARGETS[sm][1]
    for r in (r for r in compiled if r["sm"] == sm):
        # the two kernels without a matrix product need no shared memory
        assert 0 < r["shared_bytes"] <= limit or r["kernel"] in ("attn_bwd_preprocess", "_add_sink_partials"), r
        assert r["fits"], f"{r['kernel']} needs {r['shared_bytes']} bytes of shared memory on sm_{sm} (limit {limit})"


def test_a_t4_gets_fp16_and_no_multi_stage_pipeline(compiled):
    t4 = [r for r in compiled if r["sm"] == 75]
    assert all("float16" in r["case"] for r in t4)
    assert all(r["num_stages"] == 1 for r in t4 if r["kernel"] != "attn_bwd_preprocess")


def test_the_tool_refuses_to_run_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "course_utils.kernels.targets"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "TRITON_INTERPRET=0" in out.stdout


# -- an sm_90 compile here is the H200's own: the same specialisation, the spills counted --------------
# Three launches whose compiled kernels the H200 reported (triton 3.6): two of lesson 06's fast forward
# (results/tune_fast.json) and the atomic one-pass backward (results/tune_backward.json). Before the
# compile ran Triton's own binder (pointers 16-byte aligned, integers divisible by 16), the backward came
# out with half the GPU's shared memory; before the stack frame was read, every spill read as 0.
DEVICE_SCRIPT = r"""
import json, torch, triton
from course_utils.kernels import targets, fast, fast_backward as fb
q = torch.zeros(1, 32, 4096, 128, dtype=torch.bfloat16)
k = torch.zeros(1, 8, 4096, 128, dtype=torch.bfloat16)
with targets._captured_launches() as launches:
    fast.launch(q, k, k, True, block_m=128, block_n=64, num_warps=4, num_stages=2)
    fast.launch(q, k, k, True, block_m=64, block_n=64, num_warps=4, num_stages=3)
    fb.attention_backward_fast(q, k, k, q, torch.zeros(1, 32, 4096), q, True,
                               config=fb.FastBackwardConfig("atomic", 64, 128, 128, 64, 8, 3))
names = ["128x64 w4 s2 kv-grouped", "64x64 w4 s3 kv-grouped", "atomic dkdv 64x128 w8 s3"]
out = {"triton": triton.__version__}
launches = [l for l in launches if l[0].__name__ != "attn_bwd_preprocess"]  # the backward's delta, first
for name, (kernel, args, kwargs) in zip(names, launches):
    c = targets.compile_launch(kernel, args, kwargs, 90, name, registers=True)
    out[name] = dict(registers=c.registers, spills=c.spill_bytes // 4, shared=c.shared_bytes)
print(json.dumps(out))
"""


def _recorded_on_the_h200():
    """``{launch: (registers, spills, shared bytes or KiB)}`` and the triton version, from results/."""
    import re
    from pathlib import Path

    results = Path(__file__).resolve().parent.parent / "results"
    fast = json.loads((results / "tune_fast.json").read_text())
    bwd = json.loads((results / "tune_backward.json").read_text())
    assert fast["env"]["triton"] == bwd["runs"][0]["info"]["triton"]
    want = {}
    for row in fast["rows"]:
        if row["n"] == 4096 and row["name"] in ("128x64 w4 s2 kv-grouped", "64x64 w4 s3 kv-grouped"):
            regs, spills, kib = map(int, re.fullmatch(r"regs (\d+), spills (\d+), smem (\d+) KiB", row["info"]).groups())
            want[row["name"]] = dict(registers=regs, spills=spills, shared_kib=kib)
    row = next(r for r in bwd["runs"][0]["rows"] if r["name"] == "atomic dkdv 64x128 w8 s3" and r["n"] == 16384)
    want[row["name"]] = dict(registers=row["registers"], spills=row["spills"], shared=row["shared"])
    return want, fast["env"]["triton"]


def test_an_sm_90_compile_here_is_the_h200s_own():
    want, device_triton = _recorded_on_the_h200()
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", DEVICE_SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for name, w in want.items():
        g = got[name]
        # shared memory: the tiles and pipeline buffers the specialised kernel lays out
        if "shared" in w:
            assert g["shared"] == w["shared"], (name, g, w)
        else:
            assert round(g["shared"] / 1024) == w["shared_kib"], (name, g, w)
        assert (g["spills"] > 0) == (w["spills"] > 0), (name, g, w)  # spilled here iff it spilled there
        if got["triton"] == device_triton:  # the GPU's own compiler: its registers, and its spills within a few
            assert g["registers"] == w["registers"] and abs(g["spills"] - w["spills"]) <= 8, (name, g, w)


RECORD_SCRIPT = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("compile_sm90", sys.argv[1])
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
from course_utils.kernels import targets, fast
q = torch.zeros(1, 4, 512, 128, dtype=torch.bfloat16)
k = torch.zeros(1, 2, 512, 128, dtype=torch.bfloat16)
with targets._captured_launches() as launches:
    fast.launch(q, k, k, True, block_m=64, block_n=64, num_warps=4, num_stages=3)
kernel, args, kwargs = launches[0]
good = script._compiled(kernel, args, kwargs)
bad = script._compiled(kernel, args, dict(kwargs, BLOCK_N=128))  # causal needs BLOCK_M % BLOCK_N == 0
compiled = targets.compile_binary(kernel, args, kwargs, 90)
sass = script.sass_counts(compiled.asm["cubin"])
warnings = targets.ptxas_warnings(compiled.asm["ptx"], 90)
print(json.dumps(dict(good=good, bad=bad, sass=sass, warnings=warnings)))
"""


def test_the_sm_90_record_script_reads_a_compile_and_keeps_a_refusal():
    """benchmarks/compile_sm90.py (results/sm90_compiles.json): one record per launch; a refusal is a record too."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "compile_sm90.py"
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", RECORD_SCRIPT, str(script)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    good, bad = got["good"], got["bad"]
    assert good["kernel"] == "_attn_fwd_fast_kernel" and good["warps"] == 4 and 0 < good["registers"] <= 255
    assert good["spills"] == 0 and good["shared"] > 0 and good["setmaxnreg"] == []
    assert bad["kernel"] == "_attn_fwd_fast_kernel" and "error" in bad and "registers" not in bad
    # the machine code's warpgroup products (Q Kᵀ and P V of each masked and unmasked step) and their fences
    assert got["sass"]["products"] > 0 and got["sass"]["arrive"] > 0 and got["sass"]["depbar"] > 0, got["sass"]
    assert got["warnings"] == [], got["warnings"]


def test_the_partitions_of_a_warp_specialised_kernel_are_read_from_its_ttgir():
    """targets.ws_partitions: each partition's warpgroup products and TMA loads, in order; nothing for a plain kernel."""
    from course_utils.kernels import targets

    ttgir = """
    ttg.warp_specialize(%a) attributes {requestedRegisters = array<i32: 232, 232>}
    default {
      ttng.async_tma_copy_global_to_local %desc_q[%r, %c0] %1, %2, %true
      scf.for {
        ttng.async_tma_copy_global_to_local %desc_k[%k, %c0] %3, %4, %true
        ttng.async_tma_copy_global_to_local %desc_v[%k, %c0] %5, %6, %true
      }
    }
    partition0(%x: i32) num_warps(4) {
      %qk = ttng.warp_group_dot %q, %k, %cst
      %acc = ttng.warp_group_dot %p, %v, %acc0
    }
    partition1(%x: i32) num_warps(4) {
      %qk = ttng.warp_group_dot %q, %k, %cst
    }
    """
    assert targets.ws_partitions(ttgir) == (("default", 0, 3), ("partition0", 2, 0), ("partition1", 1, 0))
    assert targets.ws_partitions("tt.func @k() { %0 = ttng.warp_group_dot %a, %b, %c }") == ()
