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
