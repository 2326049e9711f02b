"""check_gluon_loader (lesson 11, exercise 5): the loader partition of the hand warp-specialised Gluon forward.

The learner's loader runs in the course's kernel (``kernels.hopper_ws``) in ``kernels.gluon_cpu``'s model on the
CPU. Each planted mistake is lesson 11's own solution cell with one edit (which must occur exactly once, so a
change to the lesson that would make a mutant meaningless fails loudly), written to a file (``@gluon.jit`` reads
its function's source) and imported; each must be refused with its own message. Correct loaders written
differently must pass. Also here: the model's two hooks the check rests on (``running(replace=..., trace=...)``),
and the batch grader grading the exercise end to end.
"""

import inspect
import re
from pathlib import Path

import course_utils  # noqa: F401  (before triton)

import nbformat
import pytest
import torch

from conftest import module_from_source
from course_utils import build, references
from course_utils.grading import GradingError, check_gluon_loader, proof
from course_utils.grading import part7_hopper as p7
from course_utils.grading.core import Forbidden
from course_utils.kernels import gluon_cpu, hopper_ws

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "solutions" / "11_hopper_and_fp8.ipynb"


def _lesson_cells():
    """The lesson's import cell of the exercise and its solution cell, the markers dropped."""
    cells = nbformat.read(LESSON, as_version=4).cells
    index = next(i for i, c in enumerate(cells) if c.cell_type == "code" and "def load_partition(" in c.source)
    solution = "\n".join(ln for ln in cells[index].source.split("\n")
                         if ln.strip() not in (build.BEGIN_SOLUTION, build.END_SOLUTION))
    return cells[index - 1].source, solution


IMPORTS, SOLUTION = _lesson_cells()
_made: dict = {}


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gluon_loaders")

    def make(name, *edits, extra=""):
        """The lesson's solution with each ``(old, new)`` edit applied (and ``extra`` code before it)."""
        if name not in _made:
            src = SOLUTION
            for old, new in edits:
                assert src.count(old) == 1, f"{name}: {old!r} occurs {src.count(old)} times in the solution"
                src = src.replace(old, new)
            module = module_from_source(folder / f"loader_{name}.py", f"{IMPORTS}\n\n{extra}\n\n{src}\n")
            _made[name] = module.load_partition
        return _made[name]

    return make


def _phrase(message):
    """The longest fixed part of a message template (its placeholders filled differently each time)."""
    return max(re.split(r"\{[^}]*\}", message), key=len)[:80]


def _fails(fn, message, **kw):
    """check_gluon_loader(fn) fails, and its message holds ``message``'s longest fixed part."""
    with pytest.raises(GradingError) as info:
        check_gluon_loader(fn, isolate=False, **kw)
    text = str(info.value)
    assert _phrase(message) in text, text
    return text


# -- correct loaders pass -------------------------------------------------------------------------------------
def test_the_lessons_solution_passes_in_a_separate_process(loader):
    passed = check_gluon_loader(loader("solution"))  # isolated as in a notebook (a forked child on the CPU)
    assert passed and passed.cases == 10 and passed.max_error < 5e-3


# the solution's expects and copies of one step, as the lesson writes them (the variants below rewrite them)
_KV_COPIES = """        mbarrier.expect(k_bars.index(idx), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + kv_tile * BLOCK_N, 0], k_bars.index(idx),
                                        k_smem.index(idx))
        mbarrier.expect(v_bars.index(idx), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + kv_tile * BLOCK_N, 0], v_bars.index(idx),
                                        v_smem.index(idx))"""
VARIANTS = {
    "phase kept in a variable, toggled after the ring's last slot": (
        ("        phase = (j // NB) & 1\n", ""),
        ("    for j in range(n_tiles):\n", "    phase = 0\n    for j in range(n_tiles):\n"),
        ("                                        v_smem.index(idx))",
         "                                        v_smem.index(idx))\n        if idx == NB - 1:\n            phase ^= 1")),
    "V before K, the wait only where a slot is refilled": (
        ("        mbarrier.wait(empty_bars.index(idx), phase ^ 1)",
         "        if j >= NB:\n            mbarrier.wait(empty_bars.index(idx), phase ^ 1)"),
        (_KV_COPIES,
         """        row = kv_row + kv_tile * BLOCK_N
        mbarrier.expect(v_bars.index(idx), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, 0], v_bars.index(idx), v_smem.index(idx))
        mbarrier.expect(k_bars.index(idx), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, 0], k_bars.index(idx), k_smem.index(idx))""")),
    "a helper for each tile's expect and copy": (
        (_KV_COPIES,
         """        _tile_in(k_desc, k_bars, k_smem, idx, kv_row + kv_tile * BLOCK_N)
        _tile_in(v_desc, v_bars, v_smem, idx, kv_row + kv_tile * BLOCK_N)"""), ),
}
HELPER = '''@gluon.jit
def _tile_in(desc, bars, smem, idx, row):
    mbarrier.expect(bars.index(idx), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, 0], bars.index(idx), smem.index(idx))'''


@pytest.mark.parametrize("name", list(VARIANTS))
def test_correct_loaders_written_differently_pass(loader, name):
    fn = loader(re.sub(r"\W+", "_", name), *VARIANTS[name], extra=HELPER)
    assert check_gluon_loader(fn, isolate=False)


# -- planted mistakes: each refused with its own message ------------------------------------------------------
_WAIT = "        mbarrier.wait(empty_bars.index(idx), phase ^ 1)  # a fresh barrier has completed the phase before 0\n"
_K_COPY = "[kv_row + kv_tile * BLOCK_N, 0], k_bars.index(idx),"
MISTAKES = {
    "phase for phase ^ 1": ((("phase ^ 1)", "phase)"), ), p7.MSG_GLUON_PARITY, "deadlocked"),
    "no wait for the empty slot": (((_WAIT, ""), ), p7.MSG_GLUON_NO_WAIT, None),
    "slot j % 2 with 3 buffers": ((("idx = j % NB", "idx = j % 2"), ), p7.MSG_GLUON_SLOT, "3 buffers"),
    "K copied onto the V barrier": (((_K_COPY, "[kv_row + kv_tile * BLOCK_N, 0], v_bars.index(idx),"), ),
                                    p7.MSG_GLUON_BARRIER, "completes on v_bars["),
    "no kv_row": (((_K_COPY, "[kv_tile * BLOCK_N, 0], k_bars.index(idx),"), ), p7.MSG_GLUON_KV_ROW, None),
    "no expect for V": ((("        mbarrier.expect(v_bars.index(idx), v_desc.block_type.nbytes)\n", ""), ),
                        p7.MSG_GLUON_EXPECT_MISSING, "into v_smem["),
    "K's expect of Q's bytes": ((("mbarrier.expect(k_bars.index(idx), k_desc", "mbarrier.expect(k_bars.index(idx), q_desc"), ),
                                p7.MSG_GLUON_EXPECT_BYTES, None),
    "step j's tile under the window": ((("            kv_tile = window_kv_tile(j, lo, ns)", "            kv_tile = j"), ),
                                       p7.MSG_GLUON_WINDOW_TILE, "window 200"),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_planted_mistake_is_refused_with_its_message(loader, name):
    edits, message, also = MISTAKES[name]
    text = _fails(loader(re.sub(r"\W+", "_", name), *edits), message)
    if also:
        assert also in text, text
    others = [m for m in (p7.MSG_GLUON_PARITY, p7.MSG_GLUON_NO_WAIT, p7.MSG_GLUON_SLOT, p7.MSG_GLUON_BARRIER,
                          p7.MSG_GLUON_KV_ROW, p7.MSG_GLUON_EXPECT_MISSING, p7.MSG_GLUON_EXPECT_BYTES,
                          p7.MSG_GLUON_WINDOW_TILE, p7.MSG_GLUON_NOTHING) if m is not message]
    assert not any(_phrase(m) in text for m in others), text  # its own message, no other


def test_a_race_the_landing_order_hid_is_still_named(loader):
    """Without the empty wait a refill can land after the consumers are done with the slot: o is then right, and
    only the loader's recorded operations show the race. The check names it whatever the landing order."""
    fn = loader("no_wait_for_the_empty_slot", (_WAIT, ""))
    for seed in (1, 2, 3):
        _fails(fn, p7.MSG_GLUON_NO_WAIT, seed=seed)


def test_a_missing_wait_is_named_when_the_model_stops_at_the_refills_expect():
    """Without the empty wait the model can stop at the refill's first ``expect`` (more arrivals than the
    barrier's count in one phase), before any copy of that step: the trace then ends at that expect, and the
    walker must name the missing wait there (it once named nothing: a random failure of the planted mistake)."""
    c = p7._GluonCase("one program", 1, 1, 1, 128, 64, False, 2)
    plans = {(0, 0): (0, 0, [0, 1, 2])}
    bm, bn, kv_bytes = 128, 128, 128 * 64 * 2
    loader = p7._LOADER_PARTITION

    def event(op, barrier, value=None, destination=None, coords=None):
        return gluon_cpu.Event((0, 0, 0), loader, op, barrier, value, destination, coords)

    events = []
    for half in range(2):
        events += [event("expect", f"q_bars[{half}]", 64 * 64 * 2),
                   event("copy", f"q_bars[{half}]", destination=f"q_smem[{half}]", coords=(half * 64, 0))]
    for j in range(2):
        events.append(event("wait", f"empty_bars[{j}]", 1))
        for what in "kv":
            events += [event("expect", f"{what}_bars[{j}]", kv_bytes),
                       event("copy", f"{what}_bars[{j}]", destination=f"{what}_smem[{j}]", coords=(j * bn, 0))]
    assert p7._loader_deviation(c, events, plans, False, bm, bn) is None  # two steps by the protocol
    events.append(event("expect", "k_bars[0]", kv_bytes))  # step 2 refills slot 0 without waiting
    message = p7._loader_deviation(c, events, plans, False, bm, bn)
    assert message == p7.MSG_GLUON_NO_WAIT.format(j=2, idx=0, prev=0)
    events.insert(-1, event("wait", "empty_bars[0]", 0))  # with the wait, the same trace is by the protocol
    assert p7._loader_deviation(c, events, plans, False, bm, bn) is None


def test_a_loader_that_issues_nothing_and_an_unfilled_stub(loader):
    start = SOLUTION.index("    for j in range(n_tiles):")
    nothing = module_from_source(Path(_made_dir(loader)) / "loader_nothing.py",
                                 f"{IMPORTS}\n\n{SOLUTION[:start]}    pass\n")
    text = _fails(nothing.load_partition, p7.MSG_GLUON_NOTHING)
    assert "waits on k_bars[0]" in text, text  # the deadlock says which wait never completes
    stub = module_from_source(Path(_made_dir(loader)) / "loader_stub.py",
                              f"{IMPORTS}\n\n{SOLUTION[:start]}    raise NotImplementedError()\n")
    with pytest.raises(NotImplementedError):  # the batch grader's "not attempted"
        check_gluon_loader(stub.load_partition, isolate=False)


def _made_dir(loader):
    return Path(inspect.getsourcefile(loader("solution").fn)).parent


# -- borrowed answers and bad calls ---------------------------------------------------------------------------
def test_the_courses_loader_is_refused_as_borrowed_passed_or_called(loader):
    _fails(hopper_ws._load_partition, p7.MSG_GLUON_BORROWED)
    wrapper = module_from_source(_made_dir(loader) / "loader_wrapper.py", f'''{IMPORTS}
from course_utils.kernels.hopper_ws import _load_partition


@gluon.jit
def load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, N,
                   window_size, sink_size, H: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, V_T: gl.constexpr, WINDOW: gl.constexpr):
    _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, N,
                    window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N, CAUSAL, V_T, WINDOW)
''')
    _fails(wrapper.load_partition, p7.MSG_GLUON_BORROWED)


def test_the_answer_key_refuses_to_run_while_the_check_runs():
    """``proof.answer_keys_forbidden`` takes a Gluon function: its Python, which the model runs, refuses."""
    code = hopper_ws._load_partition.fn.__code__
    with proof.answer_keys_forbidden(hopper_ws._load_partition):
        with pytest.raises(Forbidden, match="course's own answer"):
            hopper_ws._load_partition.fn(*range(20))
    assert hopper_ws._load_partition.fn.__code__ is code


def test_bad_calls_get_one_sentence(loader):
    _fails(3, "check_gluon_loader expects a function")
    _fails(loader("solution").fn, p7.MSG_GLUON_NOT_GLUON)  # the plain Python function: no @gluon.jit
    import triton

    text = _fails(triton.jit(loader("solution").fn), p7.MSG_GLUON_NOT_GLUON)
    assert "@triton.jit function `load_partition`" in text, text
    short = module_from_source(_made_dir(loader) / "loader_short.py", f'''{IMPORTS}


@gluon.jit
def load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem):
    pass
''')
    _fails(short.load_partition, p7.MSG_GLUON_SIGNATURE)


# -- the model's hooks ----------------------------------------------------------------------------------------
def test_the_model_runs_a_replacement_counts_its_calls_and_changes_no_module(loader):
    q, k, v = (torch.randn(1, h, 384, 64).bfloat16() for h in (2, 1, 1))
    events = []
    with gluon_cpu.running(seed=3, replace={hopper_ws._load_partition: loader("solution")}, trace=events) as model:
        o, _ = hopper_ws.attention(q, k, v, causal=True)
    assert model.calls == {"_load_partition": 6}  # 3 query blocks x 2 heads, one loader each
    assert hopper_ws.attn_fwd_ws.fn.__globals__["_load_partition"] is hopper_ws._load_partition
    copies = [e for e in events if e.op == "copy" and e.partition == p7._LOADER_PARTITION]
    assert {e.destination for e in copies} == {"q_smem[0]", "q_smem[1]", "k_smem[0]", "k_smem[1]", "v_smem[0]",
                                               "v_smem[1]"}
    assert all(e.barrier == e.destination.replace("smem", "bars") for e in copies)
    want = references.attention(*(t.double().numpy() for t in (q, k, v)), causal=True)
    assert float(abs(o.double().numpy() - want).max()) < 0.05
    with gluon_cpu.running(seed=3) as model:  # no replacement: the course's loader, nothing counted
        hopper_ws.attention(q, k, v, causal=True)
    assert not model.calls


def test_the_models_deadlock_names_the_waits(loader):
    fn = loader("phase_for_phase_1", ("phase ^ 1)", "phase)"))
    q, k, v = (torch.randn(1, h, 256, 64).bfloat16() for h in (1, 1, 1))
    with pytest.raises(gluon_cpu.Deadlock) as info:
        with gluon_cpu.running(replace={hopper_ws._load_partition: fn}):
            hopper_ws.attention(q, k, v)
    assert (2, "empty_bars[0]", 0, 0) in info.value.waits, info.value.waits
    assert "partition 2 waits on empty_bars[0] for parity 0" in str(info.value)


# -- the batch grader ---------------------------------------------------------------------------------------
def test_the_batch_grader_grades_the_exercise(tmp_path):
    """A hand-in with the lesson's loader gets the point; one with ``phase`` for ``phase ^ 1`` gets 0 and the
    message (the hand-ins keep the lesson's import cells and this exercise, as a learner may hand in)."""
    from course_utils import grade

    nb = nbformat.read(LESSON, as_version=4)
    keep = [c for c in nb.cells[:3] if c.cell_type == "code"]
    index = next(i for i, c in enumerate(nb.cells) if "def load_partition(" in c.source)
    exercise = nb.cells[index - 1:index + 2]
    root = tmp_path / "class"
    for who, edit in (("ann", None), ("bob", ("phase ^ 1)", "phase)"))):
        hand_in = nbformat.v4.new_notebook(metadata=nb.metadata)
        hand_in.cells = [nbformat.from_dict(dict(c)) for c in keep + exercise]
        for cell in hand_in.cells:
            cell.outputs, cell.execution_count = [], None
        if edit:
            assert hand_in.cells[-2].source.count(edit[0]) == 1
            hand_in.cells[-2].source = hand_in.cells[-2].source.replace(*edit)
        (root / who).mkdir(parents=True)
        nbformat.write(hand_in, root / who / "11_hopper_and_fp8.ipynb")
    rows = grade.grade([root], tmp_path / "gradebook", jobs=2, progress=False)
    got = {r["learner"]: r for r in rows if r["exercise"] == "check_gluon_loader"}
    assert got["ann"]["status"] == "passed" and got["ann"]["points"] == 1, got["ann"]
    bob = got["bob"]
    assert bob["status"] == "failed" and bob["points"] == 0, bob
    assert p7.MSG_GLUON_PARITY.split("{")[0] in bob.get("full_message", bob["message"]), bob


def test_a_gluon_loader_travels_to_another_process_as_a_gluon_function(loader):
    """On a GPU the check runs in the grading worker, and the batch grader ships answers by value: the loader
    must arrive as a @gluon.jit function (rebuilt from its source), which the model can run."""
    import cloudpickle

    from course_utils import transport

    fn = cloudpickle.loads(transport.dumps(loader("solution")))
    assert type(fn).__name__ == "GluonJITFunction" and fn is not loader("solution")
    q, k, v = (torch.randn(1, h, 256, 64).bfloat16() for h in (2, 1, 1))
    with gluon_cpu.running(replace={hopper_ws._load_partition: fn}) as model:
        o, _ = hopper_ws.attention(q, k, v, causal=True)
    assert model.calls == {"_load_partition": 4}
    want = references.attention(*(t.double().numpy() for t in (q, k, v)), causal=True)
    assert float(abs(o.double().numpy() - want).max()) < 0.05
