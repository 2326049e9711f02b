"""check_flaw_hunt (lesson 05b): findings that show every flaw pass; findings that show nothing are told why.

The full solution list is graded by the notebook itself (nbval runs its check
cell); here a list written differently must pass too, and each planted
mistake must get its own message. Bad findings come first in their lists:
the check stops at the first one, so those tests run no more kernels than needed.
"""

import course_utils  # noqa: F401  (before triton)

import pytest
import torch

from course_utils.grading import GradingError, check_flaw_hunt
from course_utils.grading.part2_debug import FLAWS, _kernel_source, int32_overflow

DEVICE = course_utils.DEVICE


def _inputs(B=1, Hq=4, Hkv=2, N=40, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, N, D, generator=g).to(DEVICE, dtype) for h in (Hq, Hkv, Hkv)]


def test_findings_written_differently_pass():
    q, k, v = _inputs(dtype=torch.float16, N=33)
    q2, k2, v2 = _inputs(B=2, Hq=2, Hkv=1, N=24, D=32, seed=1)
    wide = torch.randn(1, 2, 24, 64, device=DEVICE)
    q_sliced = wide[..., :32]  # q cut out of a wider tensor: its rows are 64 apart, o's 32
    k1, v1 = k2[:1], v2[:1]
    v_t = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    findings = [
        dict(line="    _flash_attention_forward_gqa_kernel[grid](", why="", inputs=dict(q=q, k=k, v=v)),
        dict(line="tl.dot(p_ij.to(tl.bfloat16), v_block)", why="", inputs=dict(q=q, k=k, v=v)),  # float16 fails too
        # One line, two flaws: the bases (shown by the input) and the epsilon (found by reading).
        dict(line="m_to_store = m_i + tl.log(l_i + 1e-6)", why="", inputs=dict(q=q2, k=k2, v=v2)),
        dict(line="o = torch.empty_like(q)", why="", inputs=dict(q=q_sliced, k=k1, v=v1)),
        dict(line="row_offsets[:, None] * v_stride_s + tl.arange(0, HEAD_DIM)[None, :]", why="",
             inputs=dict(q=q, k=k, v=v_t)),
        dict(line="for start_n in range(0, q_block_idx * BLOCK_M, BLOCK_N):", why="",
             inputs=dict(q=q, k=k, v=v, block_m=32, block_n=64)),
        dict(line="def flash_attention_forward(q, k, v, is_causal=True):", why="",
             inputs=dict(q=q2, k=k2, v=v2, is_causal=False)),
        dict(line="+ q_head_idx * q_stride_h", why="heads: 31 * 2**28", shape=(1, 32, 8, 2**21, 128)),
        dict(line="# we need to load blocks of shape (HEAD_DIM, BLOCK_M) which will then be multiplied", why=""),
    ]
    assert check_flaw_hunt(findings)


def test_missing_flaws_are_counted_by_kind_not_named():
    findings = [dict(line="l_i_safe = l_i[:, None] + 1e-6", why=""),
                dict(line="# shape (BLOCK_N, HEAD_DIM)", why="")]
    with pytest.raises(GradingError) as info:
        check_flaw_hunt(findings)
    msg = str(info.value)
    assert "shown 2 of the 10 flaws" in msg
    assert "7 that a failing input shows, 1 shown by arithmetic on a shape, 0 found only by reading" in msg
    assert "is_causal" not in msg  # the flaws still to find are not given away


def test_dense_q_does_not_show_the_output_strides_flaw():
    q, k, v = _inputs()
    with pytest.raises(GradingError) as info:
        check_flaw_hunt([dict(line="o_ptrs = (", why="", inputs=dict(q=q, k=k, v=v))])
    assert "gives the right o and lse" in str(info.value)
    assert "needs a q that is not dense" in str(info.value)


def test_default_blocks_do_not_show_the_block_size_flaw():
    q, k, v = _inputs()
    with pytest.raises(GradingError, match="block_n larger than block_m"):
        check_flaw_hunt([dict(line="diag_start = q_block_idx * BLOCK_M", why="", inputs=dict(q=q, k=k, v=v))])


def test_is_causal_true_does_not_show_the_ignored_flag():
    q, k, v = _inputs()
    with pytest.raises(GradingError, match="pass is_causal=False"):
        check_flaw_hunt([dict(line="def flash_attention_forward(q, k, v, is_causal=True):", why="",
                              inputs=dict(q=q, k=k, v=v))])


def test_a_shape_that_fits_int32_is_not_an_overflow():
    with pytest.raises(GradingError, match="stays below 2\\*\\*31 - 1"):
        check_flaw_hunt([dict(line="batch_idx = batch_head_idx // N_Q_HEADS", why="", shape=(16, 32, 8, 32768, 128))])


def test_lines_must_come_from_the_file_and_from_a_flaw():
    with pytest.raises(GradingError, match="is not in the classmate's file"):
        check_flaw_hunt([dict(line="acc = acc / l_i[:, None]", why="")])
    with pytest.raises(GradingError, match="not where one of the planted flaws is"):
        check_flaw_hunt([dict(line="q_block_idx = tl.program_id(axis=0)", why="")])


def test_inputs_outside_the_contract_are_refused_with_the_reason():
    q, k, v = _inputs(D=24)
    with pytest.raises(GradingError, match="power of two"):
        check_flaw_hunt([dict(line="o_ptrs = (", why="", inputs=dict(q=q, k=k, v=v))])
    if DEVICE == "cpu" or getattr(DEVICE, "type", DEVICE) == "cpu":
        qb, kb, vb = _inputs(dtype=torch.bfloat16)
        with pytest.raises(GradingError, match="bfloat16 is computed wrongly by the interpreter"):
            check_flaw_hunt([dict(line="tl.dot(p_ij.to(tl.bfloat16), v_block)", why="", inputs=dict(q=qb, k=kb, v=vb))])


def test_every_fix_applies_to_the_classmate_s_file_and_the_arithmetic_is_exact():
    # Each variant's source is built (every patch found); keeping a flaw leaves its text in place.
    fixed = _kernel_source(frozenset())
    assert "tl.bfloat16" not in fixed and "1e-6" not in fixed and ".to(tl.int64)" in fixed
    for flaw in FLAWS:
        _kernel_source(frozenset({flaw.key}))
    assert "p_ij.to(tl.bfloat16)" in _kernel_source(frozenset({"p_cast"}))
    # 16 * 2**27 = 2**31: one past int32's largest value; 15 * 2**27 fits.
    assert int32_overflow((17, 32, 8, 32768, 128)).startswith("batch_idx * q_stride_b = 16 * 134217728")
    assert int32_overflow((16, 32, 8, 32768, 128)) is None
    assert int32_overflow((1, 32, 8, 2**21, 128)).startswith("q_head_idx * q_stride_h")


def test_a_finding_that_names_the_whole_file_is_refused_not_credited():
    # Attacked (issue 21): the whole exhibit as one finding's line "named" every flaw, and passed.
    from course_utils.grading.part2_debug import EXHIBIT

    whole = EXHIBIT.read_text()
    with pytest.raises(GradingError, match=r"line= holds \d+ lines: a finding points at one place"):
        check_flaw_hunt([dict(line=whole, why="everything")])
    # A statement over a few lines is still one place.
    with pytest.raises(GradingError, match="is not where|shows none of the flaws|needs a failing input|stays below"):
        check_flaw_hunt([dict(line="batch_idx = batch_head_idx // N_Q_HEADS\nq_head_idx = batch_head_idx % N_Q_HEADS",
                              why="", shape=(16, 32, 8, 32768, 128))])


def test_a_list_naming_every_line_of_the_file_one_by_one_is_refused():
    # One finding per line of the exhibit "names" every flaw's line too: the first that shows no flaw fails it.
    from course_utils.grading.part2_debug import EXHIBIT

    every = [dict(line=ln.strip(), why="maybe") for ln in EXHIBIT.read_text().splitlines() if ln.strip()]
    with pytest.raises(GradingError, match="check_flaw_hunt failed on case finding"):
        check_flaw_hunt(every)


@pytest.mark.parametrize("findings", [[], [dict(line="", why="")], [dict(line="+ q_head_idx * q_stride_h", why="",
                                                                          shape=())]],
                         ids=["no findings", "an empty line", "an empty shape"])
def test_empty_findings_get_a_message_not_a_crash(findings):
    with pytest.raises(GradingError, match="check_flaw_hunt"):
        check_flaw_hunt(findings)


@pytest.mark.parametrize("finding", [
    dict(line=12, why="a line number instead of the code"),
    dict(line="+ q_head_idx * q_stride_h", why="", shape=(1, 32, "eight", 2**21, 128)),
    dict(line="+ q_head_idx * q_stride_h", why="", shape="big"),
    dict(line="o = torch.empty_like(q)", why="", inputs=[1, 2, 3]),
], ids=["line number", "shape with text", "shape a string", "inputs a list"])
def test_findings_of_the_wrong_shape_get_a_message_not_a_crash(finding):
    with pytest.raises(GradingError, match="check_flaw_hunt failed on case finding 1"):
        check_flaw_hunt([finding])


# --------------------------------------------------------------------------- #
# The int32 overflow is credited on the line whose offset overflows, not on any line of the flaw
# --------------------------------------------------------------------------- #
SEQ_ONLY = (1, 1, 1, 2**25, 128)  # one head of 2**32 elements: only q_offsets * q_stride_s overflows
BATCH_ONLY = (17, 32, 8, 32768, 128)  # the notebook's shape: only batch_idx * q_stride_b overflows
Q_HEAD_ONLY = (1, 32, 1, 2**21, 128)  # 31 * 2**28 overflows; kv head 0 is the only kv head


def test_int32_overflows_lists_each_overflowing_product():
    from course_utils.grading.part2_debug import int32_overflows

    assert list(int32_overflows(SEQ_ONLY)) == ["seq"]
    assert list(int32_overflows(BATCH_ONLY)) == ["batch_q"]
    assert list(int32_overflows(Q_HEAD_ONLY)) == ["q_head"]
    assert list(int32_overflows((1, 32, 16, 2**21, 128))) == ["q_head", "kv_head"]  # 15 * 2**28 too
    assert int32_overflows((16, 32, 8, 32768, 128)) == {}
    assert int32_overflow(SEQ_ONLY).startswith("q_offsets * q_stride_s = 33554431 * 128")


@pytest.mark.parametrize("line, shape, overflowing", [
    ("batch_idx = batch_head_idx // N_Q_HEADS", SEQ_ONLY, "q_offsets * q_stride_s"),
    ("+ batch_idx * q_stride_b", SEQ_ONLY, "q_offsets * q_stride_s"),
    ("+ q_head_idx * q_stride_h", BATCH_ONLY, "batch_idx * q_stride_b"),
    ("K_ptr + batch_idx * k_stride_b + kv_head_idx * k_stride_h", BATCH_ONLY, "batch_idx * q_stride_b"),
    ("kv_head_idx = q_head_idx // group_size", Q_HEAD_ONLY, "q_head_idx * q_stride_h"),
], ids=["batch line, sequence overflows", "batch offset, sequence overflows", "head offset, batch overflows",
        "k base, only q's batch overflows", "kv head, only the q head overflows"])
def test_an_overflow_on_another_line_is_not_credited_here(line, shape, overflowing):
    # Was credited (any overflow counted on every line of the flaw), e.g. a sequence overflow on the batch line.
    with pytest.raises(GradingError) as info:
        check_flaw_hunt([dict(line=line, why="int32", shape=shape)])
    msg = str(info.value)
    assert "shows none of the flaws on its line" in msg
    assert f"an int32 product does overflow, {overflowing}" in msg and "not computed on this line" in msg


@pytest.mark.parametrize("line, shape", [
    ("q_offsets[:, None] * q_stride_s + tl.arange(0, HEAD_DIM)[None, :]", SEQ_ONLY),
    ("q_offsets = q_block_idx * BLOCK_M + tl.arange(0, BLOCK_M)", SEQ_ONLY),
    ("row_offsets[None, :] * k_stride_s + tl.arange(0, HEAD_DIM)[:, None]", SEQ_ONLY),
    ("q_head_idx = batch_head_idx % N_Q_HEADS", Q_HEAD_ONLY),
    ("K_ptr + batch_idx * k_stride_b + kv_head_idx * k_stride_h", (1, 32, 16, 2**21, 128)),
    ("batch_idx = batch_head_idx // N_Q_HEADS", BATCH_ONLY),
], ids=["q sequence offset", "q_offsets", "k sequence offset", "q head index", "k base, kv head", "batch index"])
def test_an_overflow_is_credited_on_the_line_it_happens_on(line, shape):
    with pytest.raises(GradingError) as info:  # the one finding counts; the other nine are still to find
        check_flaw_hunt([dict(line=line, why="int32", shape=shape)])
    msg = str(info.value)
    assert "you have shown 1 of the 10 flaws" in msg and "computed in int32 and overflow" in msg


# --------------------------------------------------------------------------- #
# The missing lse: every line of the wrapper where lse should be (allocated, passed, returned)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("line", [
    "return o", "    return o", "o = torch.empty_like(q)", "_flash_attention_forward_gqa_kernel[grid](",
    "v.stride(2),", "n_kv_heads,", "m_stride_s,", "M_ptr, # this is acutally L",
])
def test_the_missing_lse_is_credited_on_each_place_it_is_left_out(line):
    q, k, v = _inputs(N=24)
    with pytest.raises(GradingError) as info:
        check_flaw_hunt([dict(line=line, why="lse is never allocated, passed or returned", inputs=dict(q=q, k=k, v=v))])
    msg = str(info.value)
    assert "you have shown 1 of the 10 flaws" in msg and "logsumexp buffer" in msg


def test_a_head_dim_of_128_in_float32_is_a_fair_input():
    # The classmate's own 128 x 64 blocks at D = 128 in fp32: the shape the GPU refused (out of shared memory
    # at Triton's default 3 stages, before the grader launched its copies with num_stages=1).
    q, k, v = _inputs(Hq=2, Hkv=1, N=20, D=128)
    with pytest.raises(GradingError, match="you have shown 1 of the 10 flaws"):
        check_flaw_hunt([dict(line="return o", why="no lse", inputs=dict(q=q, k=k, v=v))])


def test_a_gpu_out_of_shared_memory_is_named_as_the_hardware_s_limit(monkeypatch):
    from course_utils.grading import part2_debug

    class OutOfResources(Exception):  # what triton.runtime.errors raises at a launch that does not fit
        pass

    def variant(keep=()):
        def forward(q, k, v, is_causal=True, block_m=128, block_n=64):
            raise OutOfResources("out of resource: shared memory, Required: 262144, Hardware limit: 232448.")
        return forward

    monkeypatch.setattr(part2_debug, "classmate_variant", variant)
    q, k, v = _inputs(N=24)
    with pytest.raises(GradingError) as info:
        # In this process (isolate=False): on a GPU the check would run in the worker, without the patch.
        check_flaw_hunt([dict(line="return o", why="", inputs=dict(q=q, k=k, v=v, block_m=128, block_n=128))],
                        isolate=False)
    msg = str(info.value)
    assert "cannot launch these tiles on this GPU" in msg and "not one of the flaws" in msg
    assert "block_m=128 x block_n=128 tiles of head dim 16 in float32" in msg
    assert "outside what the contract promises" not in msg


def test_the_tolerances_cover_every_dtype_the_inputs_may_have():
    from course_utils.grading.part2_debug import _TOL

    assert {("cpu", "float32"), ("cpu", "float16"),
            ("cuda", "float32"), ("cuda", "float16"), ("cuda", "bfloat16")} <= set(_TOL)
    assert _TOL[("cpu", "float32")] == (5e-3, 5e-3) and _TOL[("cpu", "float16")] == (2e-2, 2e-2)  # as before


_COMPILE_SCRIPT = r"""
import json
import torch
from triton.runtime.jit import JITFunction
from course_utils.kernels.targets import compile_launch
from course_utils.grading.part2_debug import classmate_variant

launches = []
JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
q, k = torch.zeros(1, 2, 256, 128), torch.zeros(1, 1, 256, 128)
classmate_variant(())(q, k, k, block_m=128, block_n=128)   # fp32, D = 128, the largest tiles a finding may ask
kernel, args, kwargs = launches[0]
ours = compile_launch(kernel, args, kwargs, 90, "grader", registers=False)
print(json.dumps([kwargs.get("num_stages"), ours.shared_bytes, ours.fits]))
"""


def test_the_grader_s_copies_fit_an_h200_with_the_largest_tiles_in_float32():
    # Compiled for sm_90 here (Triton's compiler, not the interpreter; no GPU needed, stops before ptxas).
    # Measured so once, at Triton's default 3 stages: 448 KiB for these tiles, 256 KiB for the classmate's
    # 128 x 64 (the H200 refused those fp32 D=128 inputs); at 1 stage 192 and 128 KiB. (The 3-stage compile
    # takes ~30 s on two cores, so it is not repeated here.)
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    stages, shared, fits = json.loads(out.stdout.strip().splitlines()[-1])
    assert stages == 1
    assert fits and 0 < shared <= 227 * 1024, shared
