"""Lesson 05b ("debug a classmate's kernel"): the fix passes, each flaw put back fails.

The notebook has the learner hunt ten flaws in a classmate's causal GQA forward
kernel (``check_flaw_hunt``, tested in ``test_grading_debug.py``). Here the
notebook's own fixed kernel (the exercise cell of
``solutions/05b_debug_gqa_kernel.ipynb``) is graded by ``check_flash_gqa``,
and then each flaw that is code is put back into it, one at a time, by
replacing the fixed lines with the classmate's, and the result must be
rejected, or behave as the notebook says. (The tenth flaw is a comment: the
fixed cell's comments are checked instead.)

One flaw cannot be rejected by any check of the outputs: ``+ 1e-6`` in the
normaliser changes results by at most 1e-6 relative, far below tolerances that
must also hold on a GPU (tf32 ~ 1e-3). The notebook says so; here we test what
it claims instead: the check accepts that variant, and its outputs differ from
the fix by exactly the predicted factor, not by nothing.
"""

import functools
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import nbformat
import pytest
import torch

from conftest import DEVICE, module_from_source

from course_utils import references as ref
from course_utils.grading import GradingError
from course_utils.grading import check_flash_gqa
from course_utils.grading.part2_triton import MSG_D_STRIDE, MSG_LSE_MIXED_TRITON, MSG_O_STRIDES_CAUSE
from course_utils.grading.outcome import KernelError

NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions" / "05b_debug_gqa_kernel.ipynb"
HEADER = "import course_utils\nimport math\nimport torch\nimport triton\nimport triton.language as tl\n\n"


def _fixed_cell() -> str:
    """The exercise cell: the fixed kernel and wrapper, with solution markers."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    found = [c.source for c in nb.cells if c.cell_type == "code"
             and "def _flash_attention_forward_gqa_kernel(" in c.source and "### BEGIN SOLUTION" in c.source]
    assert len(found) == 1, "expected exactly one exercise cell with the fixed kernel"
    return found[0]


# Each flaw as (fixed text, the classmate's text) replacements in the exercise cell.
FLAWS = {
    "lse_buffer_missing": [  # the wrapper neither allocates nor passes lse, and returns o alone
        ("    lse = torch.empty((batch, n_q_heads, seq_len), device=q.device, dtype=torch.float32)\n", ""),
        ("q, k, v, o, lse,", "q, k, v, o,"),
        ("*o.stride(), *lse.stride(),", "*o.stride(),"),
        ("return o, lse", "return o"),
    ],
    "lse_mixed_bases": [
        ("lse = (m_i + tl.log2(l_i)) * 0.6931471805599453", "lse = m_i + tl.log(l_i)"),
    ],
    "epsilon": [
        ("tl.log2(l_i)", "tl.log2(l_i + 1e-6)"),
        ("acc = acc / l_i[:, None]", "acc = acc / (l_i[:, None] + 1e-6)"),
    ],
    "o_from_q_strides": [
        ("O_ptr + batch_idx * o_stride_b + q_head_idx * o_stride_h",
         "O_ptr + batch_idx * q_stride_b + q_head_idx * q_stride_h"),
        ("q_offsets[:, None] * o_stride_s + d_offsets[None, :] * o_stride_d",
         "q_offsets[:, None] * q_stride_s + d_offsets[None, :] * q_stride_d"),
    ],
    "p_cast_to_bf16": [
        ("p_ij.to(v_block.dtype)", "p_ij.to(tl.bfloat16)"),
    ],
    "head_dim_contiguous": [
        ("d_offsets[None, :] * q_stride_d", "d_offsets[None, :]"),
        ("d_offsets[:, None] * k_stride_d", "d_offsets[:, None]"),
        ("d_offsets[None, :] * v_stride_d", "d_offsets[None, :]"),
        ("d_offsets[None, :] * o_stride_d", "d_offsets[None, :]"),
    ],
    "block_m_multiple_of_block_n": [
        ("diag_start = (q_block_idx * BLOCK_M) // BLOCK_N * BLOCK_N", "diag_start = q_block_idx * BLOCK_M"),
    ],
    "is_causal_ignored": [
        ('    if not is_causal:\n        raise NotImplementedError("this kernel computes causal attention only")\n', ""),
    ],
    "int32_offsets": [
        ("batch_idx = (batch_head_idx // N_Q_HEADS).to(tl.int64)", "batch_idx = batch_head_idx // N_Q_HEADS"),
        ("q_head_idx = (batch_head_idx % N_Q_HEADS).to(tl.int64)", "q_head_idx = batch_head_idx % N_Q_HEADS"),
    ],
}


def _load(tmp_path, name, changes=()):
    """The exercise cell with ``changes`` applied, imported as a module (Triton needs a file)."""
    src = _fixed_cell()
    for old, new in changes:
        assert old in src, f"{name}: the fixed cell no longer contains {old!r}; update FLAWS"
        src = src.replace(old, new)
    return module_from_source(tmp_path / f"nb05b_{name}.py", HEADER + src)


def test_every_flaw_is_listed_once():
    # The notebook's ten flaws: nine in code, put back here, and the swapped comments.
    from course_utils.grading.part2_debug import FLAWS as HUNT

    assert len(FLAWS) == 9 and len(HUNT) == 10
    cell = _fixed_cell()
    assert "(HEAD_DIM, BLOCK_M)" not in cell and "k_block [HEAD_DIM, BLOCK_N]" in cell


def test_ignored_is_causal_is_refused_by_the_fix_and_silent_in_the_classmate_s_version(tmp_path):
    fixed = _load(tmp_path, "causal_fixed")
    flawed = _load(tmp_path, "causal_flawed", FLAWS["is_causal_ignored"])
    torch.manual_seed(1)
    q, k, v = (torch.randn(*shape, device=DEVICE) for shape in ((1, 2, 24, 16), (1, 1, 24, 16), (1, 1, 24, 16)))
    with pytest.raises(NotImplementedError, match="causal"):
        fixed.flash_attention_forward(q, k, v, is_causal=False)
    o, _ = flawed.flash_attention_forward(q, k, v, is_causal=False)
    args = (q.double().cpu().numpy(), k.double().cpu().numpy(), v.double().cpu().numpy())
    tol = 1e-2 if DEVICE == "cuda" else 1e-5  # tf32 dots on a GPU
    assert abs(o.double().cpu().numpy() - ref.attention(*args, causal=True)).max() < tol  # causal, silently
    assert abs(o.double().cpu().numpy() - ref.attention(*args, causal=False)).max() > 0.1


def test_int32_offsets_are_invisible_on_small_inputs_and_overflow_at_the_notebook_s_shape(tmp_path):
    # What the notebook claims: small inputs cannot show it; its shape overflows by arithmetic.
    from course_utils.grading.part2_debug import int32_overflow

    flawed = _load(tmp_path, "int32", FLAWS["int32_offsets"])
    torch.manual_seed(2)
    q, k, v = (torch.randn(*shape, device=DEVICE) for shape in ((2, 4, 24, 16), (2, 2, 24, 16), (2, 2, 24, 16)))
    o, _ = flawed.flash_attention_forward(q, k, v)
    o_ref = ref.attention(q.double().cpu().numpy(), k.double().cpu().numpy(), v.double().cpu().numpy(), causal=True)
    assert abs(o.double().cpu().numpy() - o_ref).max() < (1e-2 if DEVICE == "cuda" else 1e-5)
    assert "batch_idx * q_stride_b" in int32_overflow((17, 32, 8, 32768, 128))
    assert int32_overflow((16, 32, 8, 32768, 128)) is None


@pytest.mark.parametrize("blocks", [{}, {"block_m": 32, "block_n": 64}], ids=["default", "32x64"])
def test_fixed_kernel_passes(tmp_path, blocks):
    fixed = _load(tmp_path, "fixed")
    assert check_flash_gqa(functools.partial(fixed.flash_attention_forward, **blocks))


def test_missing_lse_buffer_is_rejected(tmp_path):
    mod = _load(tmp_path, "lse", FLAWS["lse_buffer_missing"])
    with pytest.raises((KernelError, TypeError), match="missing 4 required positional arguments"):
        check_flash_gqa(mod.flash_attention_forward)


def test_lse_in_mixed_bases_is_rejected(tmp_path):
    mod = _load(tmp_path, "mixed", FLAWS["lse_mixed_bases"])
    with pytest.raises(GradingError) as info:
        check_flash_gqa(mod.flash_attention_forward)
    assert "lse is wrong" in str(info.value) and MSG_LSE_MIXED_TRITON in str(info.value)


def test_output_with_q_strides_is_rejected(tmp_path):
    mod = _load(tmp_path, "ostrides", FLAWS["o_from_q_strides"])
    with pytest.raises(GradingError) as info:
        check_flash_gqa(mod.flash_attention_forward)
    # The cause, which both diagnoses name: the interpreter runs the grid in order (O written with q's
    # strides is seen as such), while on a GPU batch 0's programs may store last (then o looks like
    # "batch index ignored" too, and both are named).
    assert MSG_O_STRIDES_CAUSE in str(info.value)


def test_p_cast_to_bf16_is_rejected(tmp_path):
    mod = _load(tmp_path, "bf16", FLAWS["p_cast_to_bf16"])
    # float32 and float16 inputs: tl.dot(bf16, fp32) is refused (the interpreter, and the compiler).
    with pytest.raises(Exception, match="Both operands must be same dtype"):
        check_flash_gqa(mod.flash_attention_forward)


def test_contiguous_head_dim_assumption_is_rejected(tmp_path):
    mod = _load(tmp_path, "hdim", FLAWS["head_dim_contiguous"])
    with pytest.raises(GradingError) as info:
        check_flash_gqa(mod.flash_attention_forward)
    assert MSG_D_STRIDE in str(info.value)


def test_block_m_multiple_of_block_n_assumption_is_rejected(tmp_path):
    # Only visible when BLOCK_N > BLOCK_M: the notebook grades with block_m=32, block_n=64 too.
    mod = _load(tmp_path, "blocks", FLAWS["block_m_multiple_of_block_n"])
    with pytest.raises(GradingError, match="the output o is wrong"):
        check_flash_gqa(functools.partial(mod.flash_attention_forward, block_m=32, block_n=64))


@pytest.mark.interpreter("compares two kernels to 1e-6, which needs the interpreter's exact fp32 dots (tf32 on a GPU)")
def test_epsilon_is_invisible_to_the_check_but_really_there(tmp_path):
    """What the notebook claims about `+ 1e-6`: real, <= 1e-6 relative, accepted by the check."""
    fixed = _load(tmp_path, "fixed_eps_ref")
    eps = _load(tmp_path, "eps", FLAWS["epsilon"])
    torch.manual_seed(0)
    q = torch.randn(1, 4, 40, 16)
    k = torch.randn(1, 2, 40, 16)
    v = torch.randn(1, 2, 40, 16)
    o_fix, lse_fix = fixed.flash_attention_forward(q, k, v)
    o_eps, lse_eps = eps.flash_attention_forward(q, k, v)
    # Query 0 sees only key 0: l = 1 there, so o_eps = v[0] / (1 + 1e-6) exactly.
    assert torch.allclose(o_eps[0, :, 0] / o_fix[0, :, 0], torch.tensor(1 / (1 + 1e-6)), rtol=0, atol=2e-7)
    assert not torch.equal(o_eps, o_fix)
    # ... and nowhere more than 1e-6 relative (l >= 1 in every row), plus float32 rounding.
    big = o_fix.abs() > 1e-3
    assert ((o_eps - o_fix).abs()[big] / o_fix.abs()[big]).max() < 1.3e-6
    assert (lse_eps - lse_fix).abs().max() < 1.1e-6
    # The fixed kernel itself is right (so the comparison above is against a correct answer).
    o_ref, lse_ref = ref.attention_lse(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True)
    assert abs(o_fix.double().numpy() - o_ref).max() < 1e-5
    assert abs(lse_fix.double().numpy() - lse_ref).max() < 1e-5
    # So the check cannot tell it from the fix: the notebook says so rather than pretend.
    assert check_flash_gqa(eps.flash_attention_forward)


def test_student_version_raises_until_filled_in(tmp_path):
    # The generated student cell keeps the structure, loses the fixes, and says so when called.
    from course_utils.build import STUB_LINE, student_source

    src = student_source(_fixed_cell(), "05b exercise")
    assert src.count(STUB_LINE) == 9 and "diag_start = (" not in src and "tl.log2(l_i)" not in src
    module = module_from_source(tmp_path / "nb05b_student.py", HEADER + src)
    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(NotImplementedError, match="_flash_attention_forward_gqa_kernel"):
        module.flash_attention_forward(q, q[:, :1], q[:, :1])


# -- the student notebook reads well: explanations complete, demonstrations shown after the hunt (issue 22) --
def _student_cells():
    from course_utils.build import student_notebook

    return student_notebook(nbformat.read(NOTEBOOK, as_version=4), NOTEBOOK.name).cells


def test_no_folded_explanation_ends_on_nothing():
    # A paragraph ending in ':' announced a demonstration cell right after it, which the student
    # notebook used to strip; each explanation must read complete inside its fold.
    folded = [c.source for c in _student_cells() if c.cell_type == "markdown" and "<details>" in c.source]
    assert len(folded) == 10
    for k, text in enumerate(folded, start=1):
        assert f"<b>Flaw {k}</b>" in text
        for paragraph in text.split("</summary>", 1)[1].split("</details>")[0].split("\n\n"):
            assert not paragraph.rstrip().endswith(":"), f"Flaw {k}: {paragraph[-80:]!r}"
        assert "**Symptom.**" in text and "**Fix.**" in text, f"Flaw {k}"


def test_every_demonstration_reaches_the_student_after_the_graded_hunt():
    solution = nbformat.read(NOTEBOOK, as_version=4).cells
    assert not any("HIDDEN TESTS" in c.source or "runs in the solution notebook" in c.source for c in solution)
    cells = _student_cells()
    source = [c.source for c in cells]
    hunt = next(i for i, s in enumerate(source) if s.endswith("check_flaw_hunt(findings)"))
    last_fold = max(i for i, s in enumerate(source) if "<details>" in s)
    section = source.index(next(s for s in source if s.startswith("## The symptoms, shown")))
    exercise = source.index(next(s for s in source if s.startswith("## Exercise: the fixed kernel")))
    assert hunt < last_fold < section < exercise
    shown = {}
    for i in range(section + 1, exercise):
        if cells[i].cell_type == "markdown":
            title = cells[i].source.split(":", 1)[0]
            assert title.startswith("**Flaw ") and title.endswith(", shown"), cells[i].source
            flaw = int(title.split()[1].rstrip(","))
        else:
            shown.setdefault(flaw, []).append(cells[i].source)
    # Every flaw a cell can show (1 is the First contact cell, 10 is read), with the code the solution runs:
    assert sorted(shown) == list(range(2, 10))
    assert "classmate_with(FIX_CAST)" in "".join(shown[2]) and "launch(kernel_4, q, k_t, v)" in "".join(shown[6])
    # ... and each explanation points at its demonstration by that name.
    folded = [s for s in source if "<details>" in s]
    for k in shown:
        assert f"**Flaw {k}, shown**" in folded[k - 1], f"Flaw {k}'s explanation does not name its demonstration"


def test_the_demonstrations_ran_in_the_solution_and_show_what_the_explanations_say():
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    start = next(i for i, c in enumerate(cells) if c.source.startswith("## The symptoms, shown"))
    text = {}
    for c in cells[start:]:
        if c.cell_type == "markdown" and c.source.startswith("**Flaw "):
            flaw = int(c.source.split()[1].rstrip(","))
        elif c.cell_type == "code" and c.source.strip():
            out = "".join(o.get("text", "") for o in c.outputs)
            assert out, f"a demonstration of flaw {flaw} has no stored output"
            text[flaw] = text.get(flaw, "") + out
        if c.cell_type == "markdown" and c.source.startswith("## Exercise"):
            break
    assert "Both operands must be same dtype" in text[2]
    assert "batch 1 of o is NaN (never written): True" in text[5]
    assert "times `is_causal` appears in the wrapper: 1" in text[8]
    assert "-2,147,483,648" in text[9]
