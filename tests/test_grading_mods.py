"""Lesson 12's checks: planted mistakes get their diagnosis, correct variants pass.

The tile bounds and the backward's new terms: learner-style Python / NumPy functions, each with
one mistake (the backward's are the lesson's own scaffold with one edit). The forward kernel: the
lesson's exercise cells (``solutions/12_packed_sequences_and_score_mods.ipynb``: ``_tanh``,
``_mods_fwd_kernel``, the launcher) are written to a module with one edit each and graded, so
every planted kernel is the lesson's kernel with exactly one realistic bug. The forward checks run
in this process (``part8_mods.grade_mods_forward``; the isolated public check is run once).
"""

import math
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import nbformat
import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  (proof.Work's first dispatch mode imports it)
import triton

from course_utils import build
from course_utils import references
from course_utils.grading import GradingError, check_doc_tile_bounds, check_mods_backward, check_mods_forward
from course_utils.grading import part8_mods as p8
from conftest import module_from_source

NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions" / "12_packed_sequences_and_score_mods.ipynb"
HEADER = ("import course_utils\nimport math\nimport numpy as np\nimport torch\nimport triton\n"
          "import triton.language as tl\nfrom course_utils import references\n"
          "from course_utils.kernels.forward import block_config\n\n")


def _fails(check, fn, message, **kwargs):
    """``check(fn)`` fails, naming ``message`` as the likely cause."""
    with pytest.raises(GradingError) as info:
        check(fn, **kwargs)
    text = str(info.value)
    assert "Likely cause: " in text and message[1:70] in text.split("Likely cause: ", 1)[1], text
    return text


def _cell(*names) -> str:
    """The solution cells defining ``names``, markers removed (the lesson's official code)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    out = []
    for name in names:
        found = [c.source for c in nb.cells if c.cell_type == "code" and f"def {name}(" in c.source]
        assert len(found) == 1, f"expected one cell defining {name}"
        out.append("\n".join(ln for ln in found[0].split("\n")
                             if ln.strip() not in (build.BEGIN_SOLUTION, build.END_SOLUTION)))
    return "\n\n\n".join(out) + "\n"


# -----------------------------------------------------------------------------
# check_doc_tile_bounds
# -----------------------------------------------------------------------------
def _namespace(src):
    ns = {"math": math, "np": np, "references": references}
    exec(compile(src, "<lesson 12>", "exec"), ns)
    return ns


def lesson_bounds():
    return _namespace(_cell("doc_tile_bounds"))["doc_tile_bounds"]


def bounds_from_the_mask(cu_seqlens, block_m, block_n, start_m, causal):
    # Correct and written differently: read the tiles off the mask itself, numpy ints, a tuple.
    n = cu_seqlens[-1]
    keep = references.document_mask(cu_seqlens, n)
    if causal:
        keep &= references.causal_mask(n, n)
    rows = keep[start_m * block_m:min((start_m + 1) * block_m, n)]
    seen = np.flatnonzero(rows.any(axis=0))
    lo, hi = seen[0] // block_n * block_n, -(-(seen[-1] + 1) // block_n) * block_n  # kv_hi rounded up: same tiles
    partial = tuple(np.int64(t) for t in range(lo, hi, block_n) if not rows[:, t:t + block_n].all() or t + block_n > n)
    return np.int64(lo), np.int64(hi), partial


@pytest.mark.parametrize("fn", [lesson_bounds(), bounds_from_the_mask])
def test_bounds_correct_variants_pass(fn):
    assert check_doc_tile_bounds(fn)


def _planted_bounds(mistake):
    right = lesson_bounds()

    def fn(cu_seqlens, block_m, block_n, start_m, causal):
        lo, hi, partial = right(cu_seqlens, block_m, block_n, start_m, causal)
        n = cu_seqlens[-1]
        q_first, q_end = start_m * block_m, min((start_m + 1) * block_m, n)
        doc = lambda i: max(d for d in range(len(cu_seqlens) - 1) if cu_seqlens[d] <= i)  # noqa: E731
        if mistake == "lo_block":
            lo = q_first // block_n * block_n
        elif mistake == "lo_last_row":
            lo = cu_seqlens[doc(q_end - 1)] // block_n * block_n
        elif mistake == "hi_always_doc":
            hi = cu_seqlens[doc(q_end - 1) + 1]
        elif mistake == "hi_always_diagonal":
            hi = q_end
        elif mistake == "hi_whole":
            hi = n
        elif mistake == "unaligned":
            lo = cu_seqlens[doc(q_first)]
        if mistake in ("lo_block", "lo_last_row", "hi_always_doc", "hi_always_diagonal", "hi_whole"):
            partial = [t for t in range(lo, hi, block_n) if t in partial or t not in range(*right(
                cu_seqlens, block_m, block_n, start_m, causal)[:2], block_n)]
        if mistake == "diagonal_only":  # lesson 05's rule: only the tiles the diagonal crosses
            partial = [t for t in range(lo, hi, block_n) if causal and min(t + block_n, n) - 1 > q_first]
        elif mistake == "all_partial":
            partial = list(range(lo, hi, block_n))
        elif mistake == "outside":
            partial = list(partial) + [hi + block_n]
        return lo, hi, partial
    return fn


@pytest.mark.parametrize("mistake,message", [
    ("lo_block", p8.MSG_LO_BLOCK),
    ("lo_last_row", p8.MSG_LO_LAST_ROW),
    ("hi_always_doc", p8.MSG_HI_FUTURE),
    ("hi_always_diagonal", p8.MSG_HI_NOT_CAUSAL),
    ("hi_whole", p8.MSG_HI_WHOLE),
    ("diagonal_only", p8.MSG_BOUNDARY_FULL),
    ("all_partial", p8.MSG_ALL_PARTIAL),
])
def test_bounds_mistakes_are_diagnosed(mistake, message):
    _fails(check_doc_tile_bounds, _planted_bounds(mistake), message)


def test_bounds_direct_mistakes_get_their_sentence():
    with pytest.raises(GradingError, match="not a multiple of block_n"):
        check_doc_tile_bounds(_planted_bounds("unaligned"))
    with pytest.raises(GradingError, match="does not visit"):
        check_doc_tile_bounds(_planted_bounds("outside"))
    with pytest.raises(GradingError, match="two Python ints"):
        check_doc_tile_bounds(lambda *a: (0, 0))
    with pytest.raises(GradingError, match="expects a function"):
        check_doc_tile_bounds(3)


def test_partial_rows_ignored_model_differs_from_the_right_answer():
    # A model that can never differ from the right answer would be a diagnosis that cannot fire.
    cu = [0, 37, 40, 100, 150]
    wrong = [p8._bounds_variant(cu, 32, 32, m, False, "partial_rows_ignored")[2] for m in range(5)]
    right = [p8._bounds_variant(cu, 32, 32, m, False)[2] for m in range(5)]
    assert wrong != right
    for m in range(5):  # and the right variant is what the mask says, tile by tile
        lo, hi, partial = p8._bounds_variant(cu, 32, 32, m, True)
        np.testing.assert_array_equal(p8._classes_of(lo, hi, set(partial), 150, 32), p8.tile_classes(cu, 32, 32, m, True))


# -----------------------------------------------------------------------------
# check_mods_forward: the lesson's kernel with one edit
# -----------------------------------------------------------------------------
KERNEL_SRC = HEADER + _cell("_tanh", "_mods_fwd_kernel", "flash_attention_mods")
_made = {}


def planted_kernel(tmp_path_factory, name, *edits):
    """The lesson's kernel cells with each ``(old, new)`` edit applied (old must occur), loaded as a module."""
    if name not in _made:
        src = KERNEL_SRC
        for old, new in edits:
            assert old in src, f"{name}: {old!r} is not in the lesson's kernel"
            src = src.replace(old, new)
        _made[name] = module_from_source(tmp_path_factory.mktemp("planted") / f"planted_mods_{name}.py", src)
    return _made[name]


SOFTCAP = "            s = softcap * _tanh(s / softcap)\n"
ALIBI = "            s = s - slope * tl.abs(offs_m[:, None] - offs_n[None, :]).to(tl.float32)\n"
DOC_KEEP = "keep = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])"
MASKED = '        s = tl.where(keep, s, float("-inf"))\n'
SINK_Z = "z = tl.load(SINKS + q_head).to(tl.float32) * LOG2E"

FORWARD_MISTAKES = {
    "no_document_mask": (p8.MSG_DOC_LEAK, [(DOC_KEEP, "keep = offs_n[None, :] < N")]),
    "document_upper_edge_only": (p8.MSG_DOC_LEAK, [(DOC_KEEP, "keep = offs_n[None, :] < row_hi[:, None]")]),
    "softcap_after_mask": (p8.MSG_SOFTCAP_AFTER_MASK, [
        ("        if HAS_SOFTCAP:\n" + SOFTCAP, ""),
        (MASKED, MASKED + "        if HAS_SOFTCAP:\n" + SOFTCAP.replace("            ", "            ", 1))]),
    "no_softcap": (p8.MSG_NO_SOFTCAP, [(SOFTCAP, "            s = s\n")]),
    "softcap_not_rescaled": (p8.MSG_SOFTCAP_FORM, [(SOFTCAP, "            s = _tanh(s / softcap)\n")]),
    "alibi_added": (p8.MSG_ALIBI_SIGN, [(ALIBI, ALIBI.replace("s = s - slope", "s = s + slope"))]),
    "alibi_signed_distance": (p8.MSG_ALIBI_DISTANCE, [(ALIBI, ALIBI.replace(
        "tl.abs(offs_m[:, None] - offs_n[None, :])", "(offs_m[:, None] - offs_n[None, :])"))]),
    "alibi_scaled": (p8.MSG_ALIBI_SCALED, [(ALIBI, ALIBI.replace("slope * tl.abs", "slope * sm_scale * tl.abs"))]),
    "alibi_kv_head_slope": (p8.MSG_ALIBI_HEAD, [("tl.load(SLOPES + q_head)", "tl.load(SLOPES + kv_head)")]),
    "alibi_inside_softcap": (p8.MSG_ALIBI_INSIDE_CAP, [
        ("        if HAS_SOFTCAP:\n" + SOFTCAP + "        if HAS_ALIBI:\n" + ALIBI,
         "        if HAS_ALIBI:\n" + ALIBI + "        if HAS_SOFTCAP:\n" + SOFTCAP)]),
    "no_sink": (p8.MSG_SINK_MISSING, [("    if HAS_SINKS:\n        z =", "    if False:\n        z =")]),
    "sink_in_numerator": (p8.MSG_SINK_NUMERATOR, [
        ("        acc = acc * alpha[:, None]\n        m_i = m_new\n",
         "        acc = acc * alpha[:, None] + tl.exp2(z - m_new)[:, None]\n        m_i = m_new\n")]),
    "sink_base_e": (p8.MSG_SINK_BASE, [(SINK_Z, "z = tl.load(SINKS + q_head).to(tl.float32)")]),
    "sink_scaled": (p8.MSG_SINK_SCALED, [(SINK_Z, SINK_Z + " * sm_scale")]),
    "sink_not_in_lse": (p8.MSG_SINK_NOT_IN_LSE, [
        ("    if HAS_SINKS:\n        z =", "    m_k = m_i\n    l_k = l_i\n    if HAS_SINKS:\n        z ="),
        ("    lse = (m_i + tl.log2(l_i)) / LOG2E", "    lse = (m_k + tl.log2(tl.where(m_ok, l_k, 1.0))) / LOG2E")]),
}


def _launcher(module, **blocks):
    if not blocks:
        return module.flash_attention_mods

    def fn(q, k, v, **kwargs):
        original = module.block_config
        module.block_config = lambda *a, **k: dict(blocks)
        try:
            return module.flash_attention_mods(q, k, v, **kwargs)
        finally:
            module.block_config = original
    return fn


@pytest.mark.parametrize("name", list(FORWARD_MISTAKES))
def test_forward_mistakes_are_diagnosed(tmp_path_factory, name):
    message, edits = FORWARD_MISTAKES[name]
    module = planted_kernel(tmp_path_factory, name, *edits)
    _fails(p8.grade_mods_forward, _launcher(module), message)


def test_document_leak_diagnosed_with_other_blocks(tmp_path_factory):
    message, edits = FORWARD_MISTAKES["no_document_mask"]
    module = planted_kernel(tmp_path_factory, "no_document_mask", *edits)
    _fails(p8.grade_mods_forward, _launcher(module, BLOCK_M=32, BLOCK_N=16), message)


def test_forward_lesson_kernel_passes_isolated(tmp_path_factory):
    # The lesson's own kernel, through the public (isolated) check.
    assert check_mods_forward(planted_kernel(tmp_path_factory, "unchanged").flash_attention_mods)


def test_forward_that_edits_an_input_in_place_is_refused(tmp_path_factory):
    right = planted_kernel(tmp_path_factory, "unchanged").flash_attention_mods

    def edits_v(q, k, v, *args, **kwargs):
        o = right(q, k, v, *args, **kwargs)
        v.mul_(0.5)
        return o

    with pytest.raises(GradingError, match="changed its input `v` in place"):
        check_mods_forward(edits_v)


# Correct and written differently, in one kernel (each passing run costs seconds in the interpreter):
# the sink put in before the loop (m_i = z, l_i = 1; the loop then rescales it like any tile), tanh
# from exp, and 32 x 32 tiles instead of the interpreter's 64 x 32.
FORWARD_VARIANT = [
    ('    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)\n    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)\n',
     '    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)\n    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)\n'
     '    if HAS_SINKS:\n        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(SINKS + q_head).to(tl.float32) * 1.4426950408889634\n        l_i = l_i + 1.0\n'),
    ("    if HAS_SINKS:\n        z =", "    if False:\n        z ="),
    ("    return 2.0 * tl.sigmoid(2.0 * x) - 1.0", "    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)"),
]


def test_forward_correct_variant_passes(tmp_path_factory):
    module = planted_kernel(tmp_path_factory, "written_differently", *FORWARD_VARIANT)
    assert p8.grade_mods_forward(_launcher(module, BLOCK_M=32, BLOCK_N=32))


def test_forward_torch_is_not_a_triton_kernel():
    def torch_attention(q, k, v, *, cu_seqlens, causal, softcap, alibi_slopes, sink_logits):
        n = q.shape[2]
        doc = torch.searchsorted(cu_seqlens.long(), torch.arange(n, device=q.device), right=True) - 1
        kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1).double() for t in (k, v))
        s = (q.double() @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
        keep = doc[:, None] == doc[None, :]
        if causal:
            keep &= torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
        return (torch.softmax(s, -1) @ vv).to(q.dtype), torch.logsumexp(s, -1).float()

    with pytest.raises(GradingError, match="no Triton kernel ran|torch computed"):
        p8.grade_mods_forward(torch_attention)

    def behind_a_dummy_kernel(q, k, v, **kwargs):  # a kernel runs, torch does the work
        o, lse = torch_attention(q, k, v, **kwargs)
        out, out_lse = torch.empty_like(o), torch.empty_like(lse)
        _noop_store[(1,)](out)
        return out.copy_(o), out_lse.copy_(lse)

    with pytest.raises(GradingError, match="torch computed|not written by your"):
        p8.grade_mods_forward(behind_a_dummy_kernel)


@triton.jit
def _noop_store(o_ptr):
    pass


def test_forward_models_agree_with_the_references():
    # The right model (used for the diagnoses) is the float64 reference, on every fixed case.
    for c in p8._forward_cases(np.random.default_rng(0), "cpu"):
        rng = np.random.default_rng(1)
        q, k, v = (rng.standard_normal((h, c.N, c.D)) for h in (c.n_q_heads, c.n_kv_heads, c.n_kv_heads))
        o, lse = p8._forward_variant(q, k, v, c.cu, c.causal, c.softcap, c.slopes, c.sinks)
        want_o, want_lse = p8._right_forward(c, q[None], k[None], v[None])
        np.testing.assert_allclose(o, want_o[0], atol=1e-12)
        np.testing.assert_allclose(lse, want_lse[0], atol=1e-12)


# -----------------------------------------------------------------------------
# check_mods_backward: the lesson's scaffold with one edit
# -----------------------------------------------------------------------------
BACKWARD_SRC = _cell("mods_backward")
DERIVATIVE = "        ds = ds * (1.0 - t ** 2)\n"
DSINK = "        dsink = -np.sum(np.exp(sink_logits[:, None] - lse) * delta, axis=-1)\n"


def planted_backward(*edits):
    src = BACKWARD_SRC
    for old, new in edits:
        assert old in src, f"{old!r} is not in the lesson's mods_backward"
        src = src.replace(old, new)
    return _namespace(src)["mods_backward"]


BACKWARD_MISTAKES = {
    "no_softcap_derivative": (p8.MSG_SOFTCAP_NO_DERIVATIVE, [(DERIVATIVE, "        ds = ds\n")]),
    "derivative_of_capped_score": (p8.MSG_SOFTCAP_DERIVATIVE_FORM, [(DERIVATIVE, "        ds = ds * (1.0 - s ** 2)\n")]),
    "derivative_linear": (p8.MSG_SOFTCAP_DERIVATIVE_FORM, [(DERIVATIVE, "        ds = ds * (1.0 - t)\n")]),
    "dsink_sign": (p8.MSG_DSINK_SIGN, [(DSINK, DSINK.replace("dsink = -np.sum", "dsink = np.sum"))]),
    "dsink_no_delta": (p8.MSG_DSINK_NO_DELTA, [(DSINK, DSINK.replace(" * delta", ""))]),
    "dsink_unnormalised": (p8.MSG_DSINK_UNNORMALISED, [(DSINK, DSINK.replace(
        "np.exp(sink_logits[:, None] - lse)", "np.exp(sink_logits[:, None]) * np.ones_like(lse)"))]),
}


@pytest.mark.parametrize("name", list(BACKWARD_MISTAKES))
def test_backward_mistakes_are_diagnosed(name):
    message, edits = BACKWARD_MISTAKES[name]
    _fails(check_mods_backward, planted_backward(*edits), message)


def test_backward_wrong_shapes_and_types_get_a_sentence():
    with pytest.raises(GradingError, match="one number per head"):
        check_mods_backward(planted_backward((DSINK, DSINK.replace(", axis=-1)", ")"))))
    with pytest.raises(GradingError, match="four values"):
        check_mods_backward(lambda *a, **k: (None, None, None))
    with pytest.raises(GradingError, match="dsink is None"):
        check_mods_backward(planted_backward((DSINK, "        dsink = None\n")))

    def in_place(q, k, v, o, lse, do, **kwargs):
        lse *= 2
        return planted_backward()(q, k, v, o, lse, do, **kwargs)

    with pytest.raises(GradingError, match="changed its input lse"):
        check_mods_backward(in_place)


BACKWARD_VARIANTS = {
    "lesson": [],
    # exp(z - lse_i) is the share the keys leave: 1 - sum_j p_ij.
    "dsink_from_p": [(DSINK, "        dsink = -np.sum((1.0 - p.sum(axis=-1)) * delta, axis=-1)\n")],
    # 1 - tanh^2 = 1 / cosh^2, from the raw score.
    "derivative_from_cosh": [(DERIVATIVE, "        ds = ds / np.cosh(np.arctanh(t)) ** 2\n")],
}


@pytest.mark.parametrize("name", list(BACKWARD_VARIANTS))
def test_backward_correct_variants_pass(name):
    assert check_mods_backward(planted_backward(*BACKWARD_VARIANTS[name]))


def test_backward_references_are_forbidden_inside():
    def calls_reference(q, k, v, o, lse, do, *, cu_seqlens, causal, softcap, alibi_slopes, sink_logits):
        grads = references.attention_backward(q[None], k[None], v[None], do[None], causal=causal,
                                              cu_seqlens=cu_seqlens, softcap=softcap, alibi_slopes=alibi_slopes,
                                              sink_logits=sink_logits)
        return tuple(g[0] for g in grads[:3]) + ((grads[3] if sink_logits is not None else None),)

    with pytest.raises(GradingError, match="reference"):
        check_mods_backward(calls_reference)


# -----------------------------------------------------------------------------
# The lesson's picture says what the check says
# -----------------------------------------------------------------------------
def test_the_widgets_tiles_are_the_checks_tiles():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_utils import plots, widgets

    for cu, bm, bn, causal in ([0, 37, 40, 100, 150, 256], 32, 32, True), ([0, 5, 133], 16, 32, False):
        states = plots.document_tile_states(cu, bm, bn, causal)
        for m in range(states.shape[0]):
            np.testing.assert_array_equal(states[m], p8.tile_classes(cu, bm, bn, m, causal))
    assert (plots.SKIPPED, plots.FULL, plots.DIAGONAL) == (0, 1, 2)  # the check's 0 skipped, 1 full, 2 partial
    ax = plots.plot_document_tiles([0, 37, 40, 100, 150, 256], 32, 32, True)
    assert "5 documents" in ax.get_title() and "3 full, 16 partial, 45 skipped" in ax.get_title()
    plt.close(ax.figure)
    assert widgets.parse_lengths("37, 3, 60") == [0, 37, 40, 100]
    with pytest.raises(ValueError, match=">= 1"):
        widgets.parse_lengths("4, 0, 3")
    assert widgets.document_explorer(lengths=(10, 20), block_m=16, block_n=16).children


def test_the_packages_tile_bounds_agree_with_the_checks_and_are_refused():
    from course_utils.kernels import forward

    for cu, bm, bn, causal in (([0, 37, 40, 100, 150], 32, 32, True), ([0, 90, 97, 256, 260], 32, 64, False),
                               ([0, 1, 2, 3, 70, 71, 200], 64, 16, False)):
        for m in range(-(-cu[-1] // bm)):
            _, (lo, full_lo, full_hi, hi) = forward.mods_tile_bounds(m, bm, bn, cu[-1], cu, causal)
            partial = {t for t in range(lo, hi, bn) if not full_lo <= t < full_hi}
            np.testing.assert_array_equal(p8._classes_of(lo, hi, partial, cu[-1], bn), p8.tile_classes(cu, bm, bn, m, causal))

    def answer_key(cu_seqlens, block_m, block_n, start_m, causal):
        _, (lo, full_lo, full_hi, hi) = forward.mods_tile_bounds(start_m, block_m, block_n, cu_seqlens[-1], cu_seqlens,
                                                                 causal)
        return lo, hi, [t for t in range(lo, hi, block_n) if not full_lo <= t < full_hi]

    with pytest.raises(GradingError, match="mods_tile_bounds"):
        check_doc_tile_bounds(answer_key)


def test_forward_the_packages_kernel_is_refused():
    from course_utils.kernels import flash_attention_with_lse

    def course(q, k, v, *, cu_seqlens, causal, softcap, alibi_slopes, sink_logits):
        return flash_attention_with_lse(q, k, v, causal, cu_seqlens=cu_seqlens, softcap=softcap,
                                        alibi_slopes=alibi_slopes, sink_logits=sink_logits)

    with pytest.raises(GradingError, match="course_utils's own kernel"):
        p8.grade_mods_forward(course)


def test_backward_an_answer_kept_from_an_earlier_call_fails():
    right = planted_backward()
    seen = {}

    def memoised(q, k, v, o, lse, do, **kwargs):  # right the first time a shape comes, then replays it
        key = (q.shape, tuple(kwargs["cu_seqlens"]), kwargs["causal"])
        if key not in seen:
            seen[key] = right(q, k, v, o, lse, do, **kwargs)
        return seen[key]

    with pytest.raises(GradingError, match="again with new values"):
        check_mods_backward(memoised)
