"""The batch grader (python -m course_utils.grade) on a synthetic class.

The class is built here from ``solutions/`` (official answers) and
``notebooks/`` (stubs): correct answers, stubs, planted mistakes and hostile
submissions, graded end to end on the two NumPy lessons (01, 02) with
``--jobs 2``; the exact gradebook rows are asserted. To keep CI cheap the
synthetic notebooks keep only the import, exercise and grader cells of a
lesson (a learner may hand in such a notebook too).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_utils import STUB_LINE, build, grade
from course_utils.grading.part1_numpy import MSG_NO_SCALE_NUMPY, MSG_OVERFLOW

ROOT = Path(__file__).resolve().parent.parent
STEMS = ("01_naive_attention", "02_online_softmax")

SOFTMAX_NO_MAX = "def softmax(x, axis=-1):\n    e = np.exp(x)\n    return e / np.sum(e, axis=axis, keepdims=True)"
NAIVE_UNSCALED = """def naive_attention(q, k, v, causal=False):
    s = q @ np.swapaxes(k, -1, -2)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return w / w.sum(axis=-1, keepdims=True) @ v"""


# -- building learners' notebooks ------------------------------------------------------
def _official_answers(stem: str) -> dict[str, str]:
    """{function name: its solution cell without the markers}."""
    nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
    found = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and build.BEGIN_SOLUTION in cell.source:
            src = "\n".join(ln for ln in cell.source.split("\n") if ln.strip() not in (build.BEGIN_SOLUTION, build.END_SOLUTION))
            for name in build.defined_names(src):
                found[name] = src
    return found


def learner_notebook(stem, answers=None, *, extra=(), graders=None, fake_outputs=False):
    """The student notebook of ``stem`` as a learner hands it in.

    ``answers`` maps an exercise's function name to "solution" (default), "stub"
    or the learner's own source; ``extra`` cells go just before the first
    exercise; ``graders`` replaces the grader cells' sources; ``fake_outputs``
    writes "passed" outputs into the grader cells.
    """
    nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    official = _official_answers(stem)
    answers = answers or {}
    cells, extra_done = [], False
    for cell in nb.cells:
        if cell.cell_type != "code":
            cells.append(cell)
            continue
        names = build.defined_names(cell.source)
        checks = build.grader_checks(cell.source)
        if STUB_LINE in cell.source:
            if not extra_done:
                cells += [nbformat.v4.new_code_cell(src) for src in extra]
                extra_done = True
            (name,) = names
            choice = answers.get(name, "solution")
            if choice == "solution":
                cell.source = official[name]
            elif choice != "stub":
                cell.source = choice
            cells.append(cell)
        elif checks:
            if graders is not None:
                cell.source = graders
            if fake_outputs:
                cell.execution_count = 1
                cell.outputs = [nbformat.v4.new_output("stream", text=f"\u2705 {checks[0]}: passed 12 cases\n")]
            cells.append(cell)
        elif "import" in cell.source:  # the install and import cells; the demonstrations are left out
            cells.append(cell)
    nb.cells = cells
    return nb


def _write(root: Path, learner: str, stem: str, nb) -> None:
    (root / learner).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, root / learner / f"{stem}.ipynb")


def _tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        h.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def build_class(base: Path) -> tuple[Path, Path]:
    """Write the synthetic class under ``base``; return its root and the instructor's file beside it."""
    root = base / "submissions"
    sentinel = base / "instructor_file.txt"
    sentinel.write_text("keep me")
    n1, n2 = STEMS
    _write(root, "alice", n1, learner_notebook(n1))
    _write(root, "alice", n2, learner_notebook(n2))
    _write(root, "bob", n1, learner_notebook(n1, {"softmax": "stub", "naive_attention": "stub"}))
    _write(root, "bob", n2, learner_notebook(n2, {"online_softmax": "stub", "tiled_attention": "stub"}))
    _write(root, "carol", n1, learner_notebook(n1, {"softmax": SOFTMAX_NO_MAX, "naive_attention": NAIVE_UNSCALED}))
    _write(root, "carol", n2, learner_notebook(n2, {  # as a GPU fault reads; the next check gets a fresh kernel
        "online_softmax": "def online_softmax(x, block_size):\n"
                          "    raise RuntimeError('CUDA error: an illegal memory access was encountered')"}))
    # Redefines the checks, monkeypatches course_utils.grading, edits the grader cells and stores "passed" outputs.
    _write(root, "dave", n1, learner_notebook(
        n1, {"softmax": SOFTMAX_NO_MAX, "naive_attention": "stub"},
        extra=["def check_softmax(fn, **kwargs):\n    print('\u2705 check_softmax: passed')\n    return True\n"
               "check_naive_attention = check_softmax",
               "import course_utils.grading as g, course_utils.grading.core as core, course_utils.grading.part1_numpy as p1\n"
               "core.Run.compare = lambda self, *args, **kwargs: 0.0\n"
               "p1.check_softmax = g.check_softmax = lambda fn, **kw: core.Passed('check_softmax', 1, 0, 0.0)\n"
               "p1.check_naive_attention = g.check_naive_attention = lambda fn, **kw: core.Passed('x', 1, 0, 0.0)"],
        graders="print('\u2705 passed')", fake_outputs=True))
    # Returns the course's own answers.
    _write(root, "gina", n1, learner_notebook(n1, {
        "softmax": "from course_utils import references\ndef softmax(x, axis=-1):\n    return references.softmax(x, axis=axis)",
        "naive_attention": "from course_utils.references import attention as _attention\n"
                           "def naive_attention(q, k, v, causal=False):\n    return _attention(q, k, v, causal=causal)"}))
    _write(root, "gina", n2, learner_notebook(n2, {  # takes all the memory it can
        "online_softmax": "def online_softmax(x, block_size):\n    hog = []\n    while True:\n"
                          "        hog.append(np.empty(1 << 27))"}))
    _write(root, "hank", n1, learner_notebook(n1, extra=["import sys\nsys.exit(3)"]))
    _write(root, "hank", n2, learner_notebook(n2, extra=["import time\nwhile True:\n    time.sleep(0.05)"]))
    _write(root, "ivan", n1, learner_notebook(n1, extra=["import os\nos._exit(1)"]))
    _write(root, "ivan", n2, learner_notebook(n2, {  # segfaults inside a check; the other check is still graded
        "online_softmax": "import ctypes\ndef online_softmax(x, block_size):\n    return ctypes.string_at(0)"}))
    _write(root, "judy", n1, learner_notebook(n1, extra=[f"print('x' * {6 * 2**20})"]))
    (root / "judy" / f"{n2}.ipynb").write_text('{"cells": [{"cell_type": "code", "source": "import course_utils"')
    _write(root, "kim", n1, learner_notebook(n1, extra=[
        "import os, shutil\nrefused = []\n"
        f"for attempt in (lambda: os.remove({str(sentinel)!r}), lambda: open({str(base / 'planted.txt')!r}, 'w'),\n"
        f"                lambda: shutil.rmtree({str(root)!r}), lambda: os.system('true')):\n"
        "    try:\n        attempt()\n    except PermissionError:\n        refused.append(True)\n"
        "assert len(refused) == 4, refused"]))
    return root, sentinel


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    base = tmp_path_factory.mktemp("class")
    root, sentinel = build_class(base)
    out = base / "gradebook"
    before = _tree_digest(root)
    proc = subprocess.run(
        [sys.executable, "-m", "course_utils.grade", str(root), "--out", str(out), "--jobs", "2", "--timeout", "40", "--memory", "3"],
        cwd=base, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"base": base, "root": root, "out": out, "proc": proc, "sentinel": sentinel, "before": before}


def _overflow():
    return grade.first_line("Likely cause: " + MSG_OVERFLOW)


PASSED = r"\u2705 {}: passed \d+ cases .*"
NOT_ATTEMPTED = r"{}: not attempted \(your function still raises NotImplementedError\)"


def _expected_rows():
    n1, n2 = STEMS
    S, N, O, T = "check_softmax", "check_naive_attention", "check_online_softmax", "check_tiled_attention"
    P = {S: 1, N: 2, O: 2, T: 3}

    def rows(learner, stem, *entries):
        checks = (S, N) if stem == n1 else (O, T)
        return [(learner, stem, c, status, re.escape(msg) if not isinstance(msg, re.Pattern) else msg.pattern)
                for c, (status, msg) in zip(checks, entries)]

    def passed(c):
        return ("passed", re.compile(PASSED.format(c)))

    def na(c):
        return ("not_attempted", re.compile(NOT_ATTEMPTED.format(c)))

    def missing(stem):
        return ("missing", f"{stem}.ipynb was not handed in")

    overflow = ("failed", _overflow())
    no_scale = ("failed", grade.first_line("Likely cause: " + MSG_NO_SCALE_NUMPY))
    sys_exit = ("invalid", "the notebook calls sys.exit() in a cell; a handed-in notebook must run from top to bottom")
    timeout = ("timeout", re.compile(r"the notebook did not finish within 40 s \(stopped in the cell starting `import time`\).*"))
    died = ("crashed", re.compile(r"the kernel died in the cell starting `import os` .*"))
    printed = ("invalid", "the notebook printed more than 5 MB; outputs that large are not graded: remove the prints")
    malformed = ("invalid", re.compile(r"not a readable notebook \(.*\)"))
    expected = (
        rows("alice", n1, passed(S), passed(N)) + rows("alice", n2, passed(O), passed(T))
        + rows("bob", n1, na(S), na(N)) + rows("bob", n2, na(O), na(T))
        + rows("carol", n1, overflow, no_scale) + rows("carol", n2, ("error", "RuntimeError: CUDA error: an illegal memory access was encountered"), passed(T))
        + rows("dave", n1, overflow, na(N)) + rows("dave", n2, missing(n2), missing(n2))
        + rows("gina", n1,
               ("failed", re.compile(r"check_softmax: your code called `course_utils\.references\.softmax`, the course's own answer.*")),
               ("failed", re.compile(r"check_naive_attention: your code called `course_utils\.references\.attention`.*")))
        + rows("gina", n2, ("error", re.compile(r"MemoryError: Unable to allocate 1\.00 GiB .*")), passed(T))
        + rows("hank", n1, sys_exit, sys_exit) + rows("hank", n2, timeout, timeout)
        + rows("ivan", n1, died, died)
        + rows("ivan", n2, ("crashed", re.compile(r"check_online_softmax: the kernel died while this check ran your code.*")), passed(T))
        + rows("judy", n1, printed, printed) + rows("judy", n2, malformed, malformed)
        + rows("kim", n1, passed(S), passed(N)) + rows("kim", n2, missing(n2), missing(n2))
    )
    return expected, P


def test_the_class_gets_exactly_the_expected_gradebook(graded_class):
    out = graded_class["out"]
    with open(out / "gradebook.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["learner", "notebook", "exercise", "points", "max_points", "status", "message", "seconds"]
        rows = [r for r in reader if r["notebook"] in STEMS]
    expected, points = _expected_rows()
    got = [(r["learner"], r["notebook"], r["exercise"], r["status"]) for r in rows]
    assert got == [e[:4] for e in expected]
    for row, (*_, pattern) in zip(rows, expected):
        assert re.fullmatch(pattern, row["message"]), (row["learner"], row["exercise"], row["message"])
        assert row["max_points"] == str(points[row["exercise"]])
        assert row["points"] == (str(points[row["exercise"]]) if row["status"] == "passed" else "0")
        assert float(row["seconds"]) >= 0
    # Every other notebook of the course is "missing" for every learner (they were handed a folder).
    with open(out / "gradebook.csv", newline="") as f:
        others = [r for r in csv.DictReader(f) if r["notebook"] not in STEMS]
    assert others and {r["status"] for r in others} == {"missing"}


def test_each_verdict_is_computed_where_the_table_of_exercises_says(graded_class):
    # 01's and 02's checks are judged in the checks process, which never loads the learner's code (02's watch
    # how the learner's code reads its inputs: that log is kept in the learner's process and sent back). A kernel
    # exercise judged in the learner's process: tests/test_grade_checks.py.
    from course_utils.grading import exercises

    rows = json.loads((graded_class["out"] / "gradebook.json").read_text())["rows"]
    judged = [r for r in rows if r["notebook"] in STEMS and r["verdict"]]
    assert {r["notebook"] for r in judged} == set(STEMS)
    for row in judged:
        where = "grader" if exercises.by_name(row["exercise"]).verdict_outside else "learner process"
        assert row["verdict"] == [where], row
    assert {r["verdict"][0] for r in judged} == {"grader"}


def test_the_readme_counts_the_verdicts_as_the_table_declares_them():
    from course_utils.grading import exercises

    outside = sum(e.verdict_outside for e in exercises.EXERCISES)
    text = (ROOT / "README.md").read_text()
    assert f"For {outside} of the {len(exercises.EXERCISES)} exercises" in text
    assert f"For the other {len(exercises.EXERCISES) - outside} " in text


def test_nothing_outside_the_gradebook_was_touched(graded_class):
    assert graded_class["sentinel"].read_text() == "keep me"
    assert not (graded_class["base"] / "planted.txt").exists()
    assert _tree_digest(graded_class["root"]) == graded_class["before"]


def test_json_summary_feedback_and_total(graded_class):
    out = graded_class["out"]
    data = json.loads((out / "gradebook.json").read_text())
    by_key = {(r["learner"], r["notebook"], r["exercise"]): r for r in data["rows"]}
    alice = by_key[("alice", STEMS[0], "check_softmax")]
    assert alice["seeds"] and all(isinstance(s, int) for s in alice["seeds"])
    assert f"seed {alice['seeds'][0]})" in alice["full_message"]  # the seed that reproduces the check
    carol = by_key[("carol", STEMS[0], "check_softmax")]
    assert "Likely cause:" in carol["full_message"] and "reproduce with `check_softmax(fn, seed=" in carol["full_message"]
    summary = (out / "summary.md").read_text()
    # carol and dave overflow in softmax: 2 of the 9 learners.
    assert f"- `check_softmax` ({STEMS[0]}): 2 of 9 learners: {_overflow()}" in summary
    assert f"| {STEMS[0]} | check_softmax | 2 of 9 | 22% |" in summary  # alice and kim
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    feedback = sorted(p.name for p in (out / "feedback").glob("*.md"))
    assert feedback == [f"{n}.md" for n in ("alice", "bob", "carol", "dave", "gina", "hank", "ivan", "judy", "kim")]
    alice_total = sum(r["max_points"] for r in data["rows"] if r["learner"] == "alice")
    assert f"Points: 8 of {grade._num(alice_total)}." in (out / "feedback" / "alice.md").read_text()
    assert "check_softmax: passed" in (out / "feedback" / "alice.md").read_text()
    last = graded_class["proc"].stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"graded 16 notebooks of 9 learners in \d+ s \(0 already graded\); 9 of \d+ exercises passed, .*", last), last


# -- unit tests: no kernel is started ---------------------------------------------------
def test_discover_reads_exercises_and_points_from_solutions():
    course = {c.stem: c for c in grade.discover()}
    assert "00_setup" not in course  # it only demonstrates checks
    assert [(e.name, e.points) for e in course["01_naive_attention"].exercises] == [("check_softmax", 1), ("check_naive_attention", 2)]
    assert "flash_attention_with_lse" in course["07_backward"].allowed  # a helper lesson 07 gives learners


def test_points_are_declared_in_solutions_and_shown_to_learners(tmp_path):
    sol = tmp_path / "solutions"
    sol.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"),
                nbformat.v4.new_code_cell("check_softmax(f)"), nbformat.v4.new_code_cell("check_naive_attention(f)"),
                nbformat.v4.new_code_cell("check_naive_attention(functools.partial(f))"),
                nbformat.v4.new_code_cell("check_unknown(f)")]  # not in grading/exercises.py: not an exercise
    nb.cells[2].metadata["course"] = {"points": 5}
    nbformat.write(nb, sol / "01_x.ipynb")
    assert build.add_points(sol) == ["01_x.ipynb"]
    text = (sol / "01_x.ipynb").read_text()
    assert build.add_points(sol) == [] and (sol / "01_x.ipynb").read_text() == text  # idempotent
    # A check called by two grader cells is one exercise worth both cells' points.
    exercises = grade.discover(sol)[0].exercises
    assert [(e.name, e.points, len(e.calls)) for e in exercises] == [("check_softmax", 1, 1),
                                                                      ("check_naive_attention", 7, 2)]
    assert exercises[1].calls[1].args == ["functools.partial(f)"]
    build.build(sol, tmp_path / "notebooks")
    student = nbformat.read(tmp_path / "notebooks" / "01_x.ipynb", as_version=4)
    assert student.cells[3].source == "# Graded: 1 point.\ncheck_softmax(f)"
    assert student.cells[4].source.startswith("# Graded: 5 points.")
    assert student.cells[4].metadata["nbgrader"]["points"] == 5 and student.cells[4].metadata["nbgrader"]["locked"]
    assert student.cells[5].source.startswith("# Graded: 2 points.")  # the table's points for a new grader cell
    assert student.cells[6].source == "check_unknown(f)"  # no exercise, no points
    # The course's own student notebooks show the points too.
    course = nbformat.read(ROOT / "notebooks" / "01_naive_attention.ipynb", as_version=4)
    assert any(c.source == "# Graded: 2 points.\ncheck_naive_attention(naive_attention)" for c in course.cells)


def test_summary_counts_pass_rates_and_diagnoses():
    def row(learner, status, message, exercise="check_online_softmax"):
        return {"learner": learner, "notebook": "02_online_softmax", "exercise": exercise, "status": status,
                "points": 2 if status == "passed" else 0, "max_points": 2, "message": grade.first_line(message),
                "full_message": message}

    cause = "check_online_softmax failed on case x:\nwrong in 3 of 4\nLikely cause: the running sum is not rescaled."
    rows = [row("a", "passed", "ok"), row("b", "failed", cause), row("c", "failed", cause),
            row("d", "failed", "check_online_softmax failed on case y:\nwrong"), row("e", "missing", "not handed in")]
    per = grade.summarize(rows)[("02_online_softmax", "check_online_softmax")]
    assert per["learners"] == 5 and per["statuses"]["passed"] == 1 and per["statuses"]["failed"] == 3
    assert per["pass_rate"] == pytest.approx(0.2)
    assert per["top_causes"][0] == ("the running sum is not rescaled.", 2)
    assert rows[1]["message"] == "the running sum is not rescaled."


def test_resume_skips_what_is_graded_and_force_grades_again(tmp_path):
    root, out = tmp_path / "class", tmp_path / "gb"
    (root / "ann").mkdir(parents=True)
    (root / "ben").mkdir()
    course, _ = _tiny_course(tmp_path)
    sol = course.path.parent
    broken = root / "ann" / "01_x.ipynb"
    broken.write_text("{not json")  # invalid: graded without starting a kernel
    rows = grade.grade([root], out, jobs=1, progress=False, solutions=sol)
    assert [(r["learner"], r["status"]) for r in rows] == [("ann", "invalid"), ("ben", "missing")]
    state = out / ".state" / "ann" / "01_x.json"
    stamp = state.stat().st_mtime_ns
    again = grade.grade([root], out, jobs=1, progress=False, solutions=sol)
    assert state.stat().st_mtime_ns == stamp and again == rows  # nothing graded again
    broken.write_text("{still not json")  # handed in again: graded again
    grade.grade([root], out, jobs=1, progress=False, solutions=sol)
    assert state.stat().st_mtime_ns != stamp
    stamp = state.stat().st_mtime_ns
    grade.grade([root], out, jobs=1, progress=False, force=True, solutions=sol)
    assert state.stat().st_mtime_ns != stamp


def test_first_line_prefers_the_likely_cause():
    assert grade.first_line("check_x failed on case a:\nwrong\nLikely cause: no max.") == "no max."
    assert grade.first_line("\nValueError: bad\nmore") == "ValueError: bad"


def test_build_refuses_to_overwrite_answers(tmp_path):
    sol = tmp_path / "solutions"
    sol.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lesson"),
                nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION")]
    nbformat.write(nb, sol / "01_x.ipynb")
    out = tmp_path / "notebooks"
    assert build.build(sol, out) == []
    work = nbformat.read(out / "01_x.ipynb", as_version=4)
    work.cells[3].source = "def f():\n    return 41"  # an answer, saved without outputs
    nbformat.write(work, out / "01_x.ipynb")
    nb.cells[0].source = "# Lesson, revised"
    nbformat.write(nb, sol / "01_x.ipynb")
    problems = build.build(sol, out)
    assert len(problems) == 1 and "exercise cells (f) differ from the stubs" in problems[0] and "my-work/" in problems[0]
    assert "return 41" in (out / "01_x.ipynb").read_text()
    assert build.build(sol, out, force=True) == []
    assert "return 41" not in (out / "01_x.ipynb").read_text()
    assert build.build(sol, out) == []  # stubs untouched: rebuilt freely


def _tiny_course(tmp_path):
    sol = tmp_path / "solutions"
    sol.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import course_utils"),
                nbformat.v4.new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION"),
                nbformat.v4.new_code_cell("check_softmax(f)\n### BEGIN HIDDEN TESTS\nassert f(2) == 2\n### END HIDDEN TESTS"),
                nbformat.v4.new_code_cell("print('after')")]
    nbformat.write(nb, sol / "01_x.ipynb")
    build.build(sol, tmp_path / "notebooks")
    (course,) = grade.discover(sol)
    return course, nbformat.read(tmp_path / "notebooks" / "01_x.ipynb", as_version=4)


CFG = {"token_a": "a" * 16, "token_b": "b" * 32, "result_file": "/r", "borrow_file": "/b", "answers_file": "/a",
       "write_roots": ["/w"],
       "hidden_dirs": [], "allowed_programs": [], "data_limit_bytes": None}


def test_graded_notebook_puts_the_official_grader_cell_with_its_hidden_tests_in_place(tmp_path):
    course, student = _tiny_course(tmp_path)
    assert "assert f(2) == 2" not in json.dumps(student)  # learners never see the hidden test
    student.cells[4].source = "print('\u2705 passed')"  # the learner edited the grader cell
    student.cells[4].outputs = [nbformat.v4.new_output("stream", text="\u2705 passed")]
    nb = grade.graded_notebook(student, course, CFG)
    sources = [c.source for c in nb.cells]
    assert nb.cells[0].id == "grader-prologue" and nb.cells[-1].id == "grader-final"
    collect = next(i for i, c in enumerate(nb.cells) if c.id == "grader-cell-004")
    assert "def f(x)" in sources[collect - 1] and "print('after')" in sources[collect + 1]
    assert "assert f(2) == 2" in sources[collect] and "passed')" not in sources[collect]
    assert all(not c.outputs for c in nb.cells)
    assert "'token_b': '" + "b" * 32 in sources[-1] and "b" * 32 not in "".join(sources[:-1])


def test_graded_notebook_restores_a_deleted_grader_cell_after_its_exercise(tmp_path):
    course, student = _tiny_course(tmp_path)
    del student.cells[4]
    student.cells.append(nbformat.v4.new_code_cell("check_naive_attention(f)  # the learner's own call"))
    nb = grade.graded_notebook(student, course, CFG)
    ids = [c.id for c in nb.cells]
    assert ids.index("grader-cell-004") == ids.index("cell-003") + 1
    assert nb.cells[-2].source.startswith("# (a check call of the learner")


def test_trips_refuse_the_course_answers_to_learner_code_but_not_to_course_code(tmp_path):
    import types

    from course_utils import grade_harness

    module = types.ModuleType("course_utils.kernels.fake")
    exec("def _inner(x):\n    return x + 1\n"
         "def helper(x):\n    return _inner(x)\n"  # a helper the lesson gives (allowed), built on a course function
         "def answer(x):\n    return _inner(x) * 2\n", vars(module))
    for fn in (module._inner, module.helper, module.answer):
        fn.__module__ = module.__name__
    record = tmp_path / "borrowed.txt"
    trips = grade_harness._Trips({module.__name__: module}, {"helper"}, str(record))
    assert module.answer(1) == 4  # inactive: everything answers
    trips.active = True
    assert module.helper(1) == 2  # the allowed helper may call the course's code
    with pytest.raises(PermissionError, match=re.escape("called `course_utils.kernels.fake.answer`")):
        module.answer(1)
    with pytest.raises(PermissionError, match="_inner"):
        (lambda x: module._inner(x))(1)  # wrapped in the learner's own function: still refused
    assert record.read_text().split() == ["course_utils.kernels.fake.answer", "course_utils.kernels.fake._inner"]
    trips.active = False
    for obj, attr, value in reversed(trips.restore):
        setattr(obj, attr, value)
    assert module.answer(1) == 4


def test_a_graded_notebook_may_start_the_course_worker_which_keeps_the_guard(tmp_path):
    # On a GPU every Triton check runs in the course's worker process (course_utils.grading.worker).
    # Under the batch grader's guard that one program may start (any other is refused), and the
    # worker holds the same guard: learner code run there cannot write outside the notebook's folder.
    home = Path.home()
    cfg = {"token_a": "t", "write_roots": [str(tmp_path), str(home / ".triton"), str(home / ".cache")],
           "hidden_dirs": [], "allowed_programs": [], "data_limit_bytes": None}
    outside = tmp_path.parent / f"outside-{tmp_path.name}.txt"
    script = f"""
import subprocess, sys
sys.path.insert(0, {str(ROOT)!r})
ns = {{"__name__": "harness"}}
exec(open({str(ROOT / "course_utils" / "guard.py")!r}).read(), ns)
exec(open({str(ROOT / "course_utils" / "grade_harness.py")!r}).read(), ns)
ns["prologue"]({cfg!r})
try:
    subprocess.run([sys.executable, "-c", "print(1)"])
    print("OTHER PROGRAM RAN")
except PermissionError:
    print("other program refused")
from course_utils import transport
from course_utils.grading import worker

def write_outside(fn):
    open({str(outside)!r}, "w").write("x")

w = worker.Worker("cpu")
(kind, value, status), printed, broken = w.run(transport.dumps((write_outside, None, {{}})), timeout_s=120)
print("worker:", kind, "refused" if "does not let a notebook write" in value else value[-300:])
w.kill()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "other program refused" in done.stdout, done.stdout + done.stderr
    assert "worker: error refused" in done.stdout, done.stdout + done.stderr
    assert not outside.exists()


def test_an_allowed_compiler_may_start_the_way_triton_starts_ptxas(tmp_path):
    # Triton runs ptxas with subprocess.run(..., close_fds=False), which Python starts with posix_spawn:
    # an allowed program must start that way too (on a GPU no kernel compiles otherwise), and a program
    # not allowed is refused however it is started.
    import shutil

    true, false = shutil.which("true"), shutil.which("false")
    cfg = {"token_a": "t", "write_roots": [str(tmp_path)], "hidden_dirs": [], "allowed_programs": ["true"],
           "data_limit_bytes": None}
    script = f"""
import os, subprocess, sys
ns = {{"__name__": "harness"}}
exec(open({str(ROOT / "course_utils" / "guard.py")!r}).read(), ns)
ns["install"]({cfg!r})
spawned = []
sys.addaudithook(lambda event, args: spawned.append(event) if event == "os.posix_spawn" else None)
print("allowed:", subprocess.run([{true!r}], close_fds=False, stderr=open(os.devnull, "w")).returncode,
      "via posix_spawn" if spawned else "via fork")
for start in (lambda: subprocess.run([{false!r}], close_fds=False),
              lambda: os.posix_spawn({false!r}, [{false!r}], dict(os.environ))):
    try:
        start()
        print("OTHER PROGRAM RAN")
    except PermissionError as exc:
        print("refused:", exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "allowed: 0 via posix_spawn" in done.stdout, done.stdout + done.stderr
    assert done.stdout.count("refused: the grader does not let a notebook run the program 'false'") == 2, done.stdout
    assert "OTHER PROGRAM RAN" not in done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the ring's rank processes and the sandbox are Linux's")
def test_a_ring_hand_in_is_graded_end_to_end_with_its_ranks(tmp_path):
    # Lesson 10 end to end under the batch grader: the ring's learner code runs in rank processes that the
    # learner's process starts. ann hands in the lesson's own answer, whose ring_forward calls the course's
    # flash_attention_with_lse as the lesson says (it used to be refused there as borrowed: the notebook's copy
    # of course_utils travelled to the ranks by value); bob's ring_forward is the course's ring forward.
    root = tmp_path / "class"
    nb = nbformat.read(ROOT / "solutions" / "10_ring_attention.ipynb", as_version=4)
    for who in ("ann", "bob"):
        (root / who).mkdir(parents=True)
        if who == "bob":
            cell = next(c for c in nb.cells if c.cell_type == "code" and "def ring_forward" in c.source)
            cell.source = cell.source[:cell.source.index("def ring_forward")] + (
                "def ring_forward(q, k, v, causal=False, *, layout='zigzag', group=None):\n"
                "    return ring.ring_attention_forward(q, k, v, causal, layout=layout, group=group)\n")
        nbformat.write(nb, root / who / "10_ring_attention.ipynb")
    rows = grade.grade([root], tmp_path / "gradebook", jobs=1, progress=False)
    got = {(r["learner"], r["exercise"]): r for r in rows if r["notebook"] == "10_ring_attention"}
    for exercise in ("check_ring_simulation", "check_ring_attention", "check_overlap_shard_length"):
        assert got["ann", exercise]["status"] == "passed", got["ann", exercise]
    bob = got["bob", "check_ring_attention"]
    assert bob["status"] == "failed" and bob["points"] == 0, bob
    assert "ring_attention_forward: it is the course's own answer" in bob.get("full_message", bob["message"]), bob
    assert got["bob", "check_ring_simulation"]["status"] == "passed"


# -- the instructor's loop: regrading when the grader changes, LMS export, similar hand-ins ------------
def test_a_changed_grader_grades_the_class_again_and_the_summary_names_its_version(tmp_path):
    root, out = tmp_path / "class", tmp_path / "gb"
    (root / "ann").mkdir(parents=True)
    course, _ = _tiny_course(tmp_path)
    sol = course.path.parent
    (root / "ann" / "01_x.ipynb").write_text("{not json")  # graded without starting a kernel
    version = grade.grader_version(sol)
    rows = grade.grade([root], out, jobs=1, progress=False, solutions=sol)
    assert rows[0]["grader"] == version
    assert f"`{version}`" in (out / "summary.md").read_text()
    state = out / ".state" / "ann" / "01_x.json"
    stamp = state.stat().st_mtime_ns
    grade.grade([root], out, jobs=1, progress=False, solutions=sol)
    assert state.stat().st_mtime_ns == stamp  # nothing changed: nothing graded again
    nb = nbformat.read(course.path, as_version=4)
    nb.cells[2].source += "\nassert f(3) == 3"  # the instructor edits a hidden test
    nbformat.write(nb, course.path)
    assert grade.grader_version(sol) != version
    rows = grade.grade([root], out, jobs=1, progress=False, solutions=sol)
    assert state.stat().st_mtime_ns != stamp and rows[0]["grader"] == grade.grader_version(sol)
    # the package counts too: a copy of course_utils with one file changed has another version
    package = tmp_path / "pkg"
    (package / "grading").mkdir(parents=True)
    (package / "grading" / "core.py").write_text("x = 1\n")
    before = grade.grader_version(sol, package)
    (package / "grading" / "core.py").write_text("x = 2\n")
    assert grade.grader_version(sol, package) != before


def test_canvas_export_has_canvas_columns_points_possible_and_keeps_learners_missing_from_the_roster(tmp_path):
    from course_utils import lms_export

    def row(learner, notebook, exercise, points, max_points):
        return {"learner": learner, "notebook": notebook, "exercise": exercise, "points": points, "max_points": max_points}

    rows = [row("ann", "01_a", "check_x", 1, 1), row("ann", "01_a", "check_y", 0, 2), row("ann", "02_b", "check_z", 3, 3),
            row("zed", "01_a", "check_x", 1, 1), row("zed", "01_a", "check_y", 2, 2), row("zed", "02_b", "check_z", 0, 3)]
    roster_csv = tmp_path / "roster.csv"
    roster_csv.write_text("folder,Student,ID,SIS User ID,SIS Login ID,Section\n"
                          "ann,\"Lee, Ann\",101,S1,ann@u,Sec A\nbo,\"Chen, Bo\",102,S2,bo@u,Sec B\n")
    roster = lms_export.read_roster(roster_csv)
    missing = lms_export.write_canvas(rows, roster, tmp_path / "canvas.csv", ["01_a", "02_b"])
    assert missing == ["zed"]
    table = list(csv.reader(open(tmp_path / "canvas.csv", newline="")))
    assert table[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "01_a", "02_b"]
    assert table[1] == ["Points Possible", "", "", "", "", "3", "3"]
    assert table[2] == ["Lee, Ann", "101", "S1", "ann@u", "Sec A", "1", "3"]
    assert table[3] == ["Chen, Bo", "102", "S2", "bo@u", "Sec B", "", ""]  # in the roster, nothing handed in
    assert table[4] == ["zed", "", "", "", "", "3", "0"]  # graded, not in the roster: kept
    bad = tmp_path / "bad.csv"
    bad.write_text("name,ID\nann,1\n")
    with pytest.raises(ValueError, match="needs a `folder` column"):
        lms_export.read_roster(bad)


def test_the_grader_writes_canvas_csv_with_a_roster_and_lists_who_is_missing(tmp_path):
    root, out = tmp_path / "class", tmp_path / "gb"
    for name in ("ann", "ben"):
        (root / name).mkdir(parents=True)
    course, _ = _tiny_course(tmp_path)
    (root / "ann" / "01_x.ipynb").write_text("{not json")
    roster = tmp_path / "roster.csv"
    roster.write_text("folder,Student,ID,SIS User ID,SIS Login ID,Section\nann,Ann,1,,,\n")
    grade.grade([root], out, jobs=1, progress=False, solutions=course.path.parent, roster=roster)
    table = list(csv.reader(open(out / "canvas.csv", newline="")))
    assert [r[0] for r in table] == ["Student", "Points Possible", "Ann", "ben"]
    assert "missing from the roster (in canvas.csv with empty identities): ben" in (out / "summary.md").read_text()


SOFTMAX_A = '''def softmax(x, axis=-1):
    """Stable softmax."""
    m = np.max(x, axis=axis, keepdims=True)  # shift by the max
    e = np.exp(x - m)
    total = np.sum(e, axis=axis, keepdims=True)
    return e / total
'''
SOFTMAX_RENAMED = '''def softmax(scores, axis=-1):
    biggest = np.max(scores, axis=axis, keepdims=True)

    expd = np.exp(scores - biggest)   # my own comment
    s = np.sum(expd, axis=axis, keepdims=True)
    return expd / s
'''
SOFTMAX_OTHER = '''def softmax(x, axis=-1):
    x = np.moveaxis(x, axis, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        w = np.exp(row - row.max())
        out[idx] = w / w.sum()
    return np.moveaxis(out, -1, axis)
'''


def test_similar_hand_ins_are_found_after_renaming_and_comments_and_never_change_a_grade(tmp_path):
    from course_utils import similarity

    assert similarity.tokens(SOFTMAX_A) == similarity.tokens(SOFTMAX_RENAMED)  # names, comments, blank lines, docstring
    stub = "def softmax(x, axis=-1):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    cells = {"ann": SOFTMAX_A, "ben": SOFTMAX_RENAMED, "cat": SOFTMAX_OTHER, "dan": stub, "eve": stub,
             "fay": "def softmax(x, axis=-1):\n    return x\n", "gus": "def softmax(x, axis=-1):\n    return x\n"}
    pairs = similarity.similar_pairs(cells, stub)
    assert [(a, b) for a, b, _ in pairs] == [("ann", "ben")]  # stubs and too-short cells are not compared
    lines = similarity.report({("01_naive_attention", "softmax"): (stub, cells)}, tmp_path)
    assert any("ann and ben, 100% alike" in line for line in lines)
    (page,) = (tmp_path / "similar").glob("*.html")
    assert "biggest" in page.read_text() and "shift by the max" in page.read_text()
    assert similarity.report({("01_naive_attention", "softmax"): (stub, {"cat": SOFTMAX_OTHER, "ann": SOFTMAX_A})},
                             tmp_path / "none")[-1] == "No pair above the threshold."


def test_the_grader_reports_similar_hand_ins_in_the_summary(tmp_path):
    root, out = tmp_path / "class", tmp_path / "gb"
    course, student = _tiny_course(tmp_path)
    body = "def f(x):\n" + "".join(f"    y{i} = x + {i} * (x - 1) * (x + 2)\n" for i in range(6)) + "    return x\n"
    renamed = body.replace("y", "z")
    for name, code in (("ann", body), ("ben", renamed)):
        nb = nbformat.read(tmp_path / "notebooks" / "01_x.ipynb", as_version=4)
        (cell,) = [c for c in nb.cells if STUB_LINE in c.source]
        cell.source = code
        _write(root, name, "01_x", nb)
    grade.grade([root], out, jobs=1, progress=False, solutions=course.path.parent, timeout=120)
    summary = (out / "summary.md").read_text()
    assert "## Similar hand-ins" in summary and "ann and ben, 100% alike" in summary, summary
    assert list((out / "similar").glob("01_x__f__ann__ben.html"))


def test_a_failure_of_the_grader_itself_is_a_grader_error_row_and_every_report_is_still_written(tmp_path, monkeypatch):
    root, out = tmp_path / "class", tmp_path / "gb"
    for name in ("ann", "ben"):
        (root / name).mkdir(parents=True)
        (root / name / "01_x.ipynb").write_text("{not json")
    course, _ = _tiny_course(tmp_path)
    real = grade.rows_for

    def rows_for(learner, *args, **kwargs):
        if learner == "ann":
            raise TypeError("unhashable type: 'dict'")  # as a hostile hand-in's metadata once made it
        return real(learner, *args, **kwargs)

    monkeypatch.setattr(grade, "rows_for", rows_for)
    rows = grade.grade([root], out, jobs=2, progress=False, solutions=course.path.parent)
    assert [(r["learner"], r["status"]) for r in rows] == [("ann", "grader_error"), ("ben", "invalid")]
    assert "unhashable type" in rows[0]["message"] and rows[0]["points"] == 0
    assert (out / "feedback" / "ann.md").exists() and (out / "feedback" / "ben.md").exists()
    assert "grader_error" in (out / "summary.md").read_text() and (out / "gradebook.csv").exists()
    monkeypatch.setattr(grade, "rows_for", real)  # fixed grader: ann is graded again (her stored row is no grade)
    rows = grade.grade([root], out, jobs=1, progress=False, solutions=course.path.parent)
    assert [(r["learner"], r["status"]) for r in rows] == [("ann", "invalid"), ("ben", "invalid")]


def test_a_relative_submissions_path_is_graded_like_an_absolute_one(tmp_path, monkeypatch):
    # Each notebook is graded from a temporary working directory: a relative path once made every row "crashed".
    (tmp_path / "class" / "ann").mkdir(parents=True)
    (tmp_path / "class" / "ann" / "01_x.ipynb").write_text("{not json")
    course, _ = _tiny_course(tmp_path)
    monkeypatch.chdir(tmp_path)
    rows = grade.grade([Path("class")], Path("gb"), jobs=1, progress=False, solutions=course.path.parent)
    assert [(r["learner"], r["status"]) for r in rows] == [("ann", "invalid")]


def test_a_helper_the_lesson_allows_is_refused_while_the_exercise_it_answers_is_graded(tmp_path):
    # Lesson 08 gives window_tile_bounds to its later cells, and it is check_window_tile_bounds's answer.
    import types

    from course_utils import grade_harness
    from course_utils.grading.exercises import by_name

    assert by_name("check_window_tile_bounds").answer_keys == ("course_utils.kernels.forward.window_tile_bounds",)
    module = types.ModuleType("course_utils.kernels.fake")
    exec("def helper(x):\n    return x + 1\n", vars(module))
    module.helper.__module__ = module.__name__
    record = tmp_path / "borrowed.txt"
    trips = grade_harness._Trips({module.__name__: module}, {"helper"}, str(record),
                                 answer_keys={"course_utils.kernels.fake.helper"})
    trips.active = True
    assert module.helper(1) == 2  # another exercise's check: the lesson's helper answers
    trips.now = {"course_utils.kernels.fake.helper"}
    with pytest.raises(PermissionError, match=re.escape("called `course_utils.kernels.fake.helper`")):
        (lambda x: module.helper(x))(1)
    trips.active = False
    for obj, attr, value in reversed(trips.restore):
        setattr(obj, attr, value)
    assert module.helper(1) == 2
    (course,) = [c for c in grade.discover() if c.stem == "08_sliding_window_and_sinks"]
    calls = [c for e in course.exercises for c in e.calls if c.check == "check_window_tile_bounds"]
    assert calls and all(c.answer_keys == ["course_utils.kernels.forward.window_tile_bounds"] for c in calls)


def test_what_an_exercise_declares_allowed_answers_only_while_its_check_runs(tmp_path):
    # Lesson 09's launcher calls decode.decode_config; lesson 10's simulation computes its blocks with
    # references.attention_lse: the batch grader lets those through for those exercises only.
    import types

    from course_utils import grade_harness
    from course_utils.grading.exercises import by_name

    assert "course_utils.kernels.decode.decode_config" in by_name("check_decode_split").allowed
    assert by_name("check_ring_simulation").allowed == ("course_utils.references.attention_lse",)
    module = types.ModuleType("course_utils.references")
    exec("def attention_lse(x):\n    return x + 1\n", vars(module))
    module.attention_lse.__module__ = module.__name__
    record = tmp_path / "borrowed.txt"
    trips = grade_harness._Trips({module.__name__: module}, set(), str(record))
    trips.active = True
    trips.allowed_now = set(by_name("check_ring_simulation").allowed)
    assert (lambda x: module.attention_lse(x))(1) == 2  # the learner's code, for the exercise that allows it
    trips.allowed_now = set(by_name("check_naive_attention").allowed)
    with pytest.raises(PermissionError, match=re.escape("called `course_utils.references.attention_lse`")):
        (lambda x: module.attention_lse(x))(1)
    trips.active = False
    for obj, attr, value in reversed(trips.restore):
        setattr(obj, attr, value)
    (course,) = [c for c in grade.discover() if c.stem == "10_ring_attention"]
    calls = [c for e in course.exercises for c in e.calls if c.check == "check_ring_simulation"]
    assert calls and all(c.allowed == ["course_utils.references.attention_lse"] for c in calls)
