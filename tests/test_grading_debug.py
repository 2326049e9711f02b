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


@pytest.mark.parametrize("finding", [
    dict(line=12, why="a line number instead of the code"),
    dict(line="+ q_head_idx * q_stride_h", why="", shape=(1, 32, "eight", 2**21, 128)),
    dict(line="+ q_head_idx * q_stride_h", why="", shape="big"),
    dict(line="o = torch.empty_like(q)", why="", inputs=[1, 2, 3]),
], ids=["line number", "shape with text", "shape a string", "inputs a list"])
def test_findings_of_the_wrong_shape_get_a_message_not_a_crash(finding):
    with pytest.raises(GradingError, match="check_flaw_hunt failed on case finding 1"):
        check_flaw_hunt([finding])
