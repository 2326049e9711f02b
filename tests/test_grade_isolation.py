"""Hand-ins isolated by the operating system (course_utils.os_sandbox), attacked by a hostile class.

Each hostile learner below tries one way past the in-process write guard that
only the operating system can stop (ctypes, sqlite3, reading the course's or a
classmate's files, a process that outlives the kernel), or replaces what the
checks compute their verdict with (numpy's comparisons, json's writer, an
IPython hook that rewrites the results after the last cell). The class is graded in
one run with an honest classmate: the honest one gets full points, every
attack gets 0 points or nothing at all, nothing is written outside the
hand-ins' folders, and every report file is there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_utils import grade, os_sandbox
from test_grade import SOFTMAX_NO_MAX, _tree_digest, _write, learner_notebook

ROOT = Path(__file__).resolve().parent.parent
STEM = "01_naive_attention"
MARK = "COURSE_TEST_OUTLIVES_" + str(os.getpid())

# The course's machines (CI, the GPU machine) are Linux with user namespaces: there the sandbox must work.
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces")


def test_the_sandbox_works_on_this_machine():
    assert os_sandbox.unavailable() is None


def _probe_cell(base: Path, root: Path) -> str:
    """A cell that kills its own kernel (-> crashed rows) if it can see or reach anything it should not."""
    return f"""
import ctypes, os, socket
seen = []
for path in ({str(ROOT / 'solutions')!r}, {str(ROOT / 'tests')!r}, {str(root)!r}, {str(base / 'gradebook')!r},
             {str(base / 'instructor_file.txt')!r}, os.path.expanduser('~root/.ssh')):
    if os.path.exists(path):
        seen.append(path)
pids = [p for p in os.listdir('/proc') if p.isdigit()]
for p in pids:
    try:
        if b'course_utils.grade' in open(f'/proc/{{p}}/cmdline', 'rb').read():
            seen.append('the grader in /proc')
    except OSError:
        pass
libc = ctypes.CDLL(None, use_errno=True)
try:  # the write guard refuses the C function first; the sandbox would stop it too
    if libc.open({str(ROOT / 'course_utils' / 'probe_planted.py')!r}.encode(), os.O_WRONLY | os.O_CREAT, 0o644) >= 0:
        seen.append('wrote into course_utils with ctypes')
except PermissionError:
    pass
# Past the write guard: a program started through _posixsubprocess raises no audit event, so only the
# operating system's sandbox stands between it and the course's files.
import sys
from multiprocessing.util import spawnv_passfds
code = "open({str(ROOT / 'course_utils' / 'probe_spawned.py')!r}, 'w').write('x')"
os.waitpid(spawnv_passfds(os.fsencode(sys.executable), [sys.executable, '-c', code], ()), 0)
try:
    socket.create_connection(('1.1.1.1', 53), timeout=2).close()
    seen.append('the network')
except OSError:
    pass
if seen:
    print('ISOLATION BROKEN:', seen)
    os._exit(1)
PROBE_DONE = True  # pat's softmax needs it: the probe ran to its end
"""


PATCH_NUMPY = """import numpy as np
np.allclose = lambda *a, **k: True
np.testing.assert_allclose = lambda *a, **k: None
np.abs = lambda x, *a, **k: np.zeros_like(np.asarray(x, dtype=float))
np.absolute = np.abs
np.isclose = lambda a, b, *args, **kw: np.ones(np.broadcast(np.asarray(a), np.asarray(b)).shape, dtype=bool)
np.isfinite = lambda x, *a, **k: np.ones(np.shape(x), dtype=bool)
np.nanmax._implementation.__code__ = (lambda a, axis=None, out=None, keepdims=0, initial=0, where=0: 0.0).__code__
"""
PATCH_JSON = """import json
def _win(o):
    if isinstance(o, dict):
        return {k: ('passed' if v in ('failed', 'error') else _win(v)) for k, v in o.items()}
    return [_win(v) for v in o] if isinstance(o, list) else o
_dump, _dumps = json.dump, json.dumps
json.dump = lambda obj, fp, *a, **k: _dump(_win(obj), fp, *a, **k)
json.dumps = lambda obj, *a, **k: _dumps(_win(obj), *a, **k)
"""
REWRITE_HOOK = """import re
def _rewrite(*_):
    found = re.search(r'"result_file": "([^"]+)"', get_ipython().user_ns['In'][-1])
    if found:
        try:
            text = open(found.group(1)).read()
            open(found.group(1), 'w').write(text.replace('"failed"', '"passed"'))
        except OSError:
            pass
get_ipython().events.register('post_run_cell', _rewrite)
"""
# Answers that show a cell ran to its end: pat's softmax needs the probe's last line; wes's is wrong (0 points)
# only once every one of its writes has been tried.
PROBE_THEN_SOFTMAX = """def softmax(x, axis=-1):
    assert PROBE_DONE
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)"""
WRONG_IF_DONE = """def softmax(x, axis=-1):
    try:
        done = WES_DONE
    except NameError:
        done = False
    e = np.exp(x) if done else np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)"""
TAMPER_NOTE = "the checks ran in a fresh process and did not use your notebook's copies"
# Attacks on the verdict from inside the learner's own function, while a check calls it: they reach the process
# that runs the function, never the one that decides the verdict (course_utils.grade_checks).
PATCH_WHEN_CALLED = "def softmax(x, axis=-1):\n" + "".join("    " + line + "\n" for line in (
    PATCH_NUMPY.replace("import numpy as np\n", "import numpy as np\n") + PATCH_JSON).splitlines()) + \
    "    e = np.exp(x)\n    return e / e.sum(axis=axis, keepdims=True)"
REACH_INTO_CHECK = """import sys
def softmax(x, axis=-1):
    e = np.exp(x)
    out = e / e.sum(axis=axis, keepdims=True)
    frame = sys._getframe(1)
    while frame is not None:  # the check's own frame holds what it compares with: make it ours
        for name in ("expected", "want", "reference"):
            found = frame.f_locals.get(name)
            if isinstance(found, np.ndarray) and found.shape == out.shape:
                found[...] = out
        frame = frame.f_back
    return out"""
THREAD_PATCHING = """import threading, time
def _keep_patching():
    while True:
        np.allclose = lambda *a, **k: True
        np.abs = lambda x, *a, **k: np.zeros_like(np.asarray(x, dtype=float))
        time.sleep(0.001)
threading.Thread(target=_keep_patching, daemon=True).start()
"""
INPUT_TRANSFORMER = """def _fake_results(lines):
    if any('__course_grader' in line for line in lines):
        return ['import glob, json, os\n',
                'for p in glob.glob(os.path.join(os.path.dirname(os.getcwd()), "r-*", "*")):\n',
                '    open(p, "w").write(json.dumps({"results": [], "token": None}))\n'] + lines
    return lines
get_ipython().input_transformers_post.append(_fake_results)
"""
READ_THE_CHECKS = """import os
def softmax(x, axis=-1):
    e = np.exp(x)
    try:  # the checks process is this one's parent: its memory must be out of reach
        with open(f"/proc/{os.getppid()}/mem", "rb"):
            pass
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            f.read()
        return e / e.sum(axis=axis, keepdims=True)
    except OSError:
        return e / e.sum(keepdims=True)"""


def _build(base: Path) -> tuple[Path, list[Path]]:
    root = base / "submissions"
    (base / "instructor_file.txt").write_text("keep me")
    planted = [base / "planted_ctypes.txt", base / "planted.db", ROOT / "course_utils" / "planted_by_learner.py",
               ROOT / "solutions" / "planted.txt", ROOT / "course_utils" / "probe_spawned.py",
               ROOT / "course_utils" / "probe_planted.py", base / "planted_fopen.txt", base / "planted_spawned.txt"]
    _write(root, "amy", STEM, learner_notebook(STEM))  # honest
    _write(root, "pat", STEM, learner_notebook(STEM, {"softmax": PROBE_THEN_SOFTMAX},
                                               extra=[_probe_cell(base, root)]))  # honest, and probes
    # Copies the official answer from solutions/ and a classmate's hand-in.
    _write(root, "rex", STEM, learner_notebook(STEM, {
        "softmax": f"""import json
def softmax(x, axis=-1):
    nb = json.load(open({str(ROOT / 'solutions' / (STEM + '.ipynb'))!r}))
    src = next(''.join(c['source']) for c in nb['cells'] if 'def softmax' in ''.join(c['source']))
    ns = {{'np': np}}
    exec(src, ns)
    return ns['softmax'](x, axis=axis)""",
        "naive_attention": f"""import json
def naive_attention(q, k, v, causal=False):
    nb = json.load(open({str(root / 'amy' / (STEM + '.ipynb'))!r}))
    src = next(''.join(c['source']) for c in nb['cells'] if 'def naive_attention' in ''.join(c['source']))
    ns = {{'np': np}}
    exec(src, ns)
    return ns['naive_attention'](q, k, v, causal=causal)"""}))
    # Writes outside its folder past the write guard (ctypes, sqlite3), and into course_utils / solutions.
    # Each attempt in its own try, so that one refused does not hide the next: ctypes open and fopen (the write
    # guard refuses them), sqlite3, and a program started past the guard (_posixsubprocess) writing each path.
    writes = "\n".join(
        f"try:\n    libc.open({str(p)!r}.encode(), os.O_WRONLY | os.O_CREAT, 0o644)\nexcept PermissionError:\n    pass\n"
        f"try:\n    libc.fopen({str(p)!r}.encode(), b'w')\nexcept PermissionError:\n    pass\n"
        f"os.waitpid(spawnv_passfds(os.fsencode(sys.executable), [sys.executable, '-c', \"open({str(p)!r}, 'w')\"], ()), 0)"
        for p in planted if p.suffix != ".db")
    _write(root, "wes", STEM, learner_notebook(STEM, {"softmax": WRONG_IF_DONE}, extra=[
        f"import ctypes, os, sqlite3, sys\nfrom multiprocessing.util import spawnv_passfds\n"
        f"libc = ctypes.CDLL(None, use_errno=True)\n"
        f"try:\n    sqlite3.connect({str(planted[1])!r}).execute('create table t (x)')\nexcept Exception:\n    pass\n"
        f"{writes}\nWES_DONE = True"]))
    # Wrong answers behind replaced verdict tools: numpy's comparisons, json's writer, an IPython hook that
    # rewrites the results file after the last cell (whose path it reads from that cell's source).
    _write(root, "nina", STEM, learner_notebook(STEM, {"softmax": SOFTMAX_NO_MAX}, extra=[PATCH_NUMPY, PATCH_JSON]))
    _write(root, "ivy", STEM, learner_notebook(STEM, {"softmax": SOFTMAX_NO_MAX}, extra=[REWRITE_HOOK]))
    # Attacks from inside the graded function (it runs while the check runs) and from what the notebook leaves
    # running: numpy and json replaced when called, the check's own frame edited, a thread that keeps patching,
    # an input transformer that rewrites the last cell, reading the checks process's memory.
    _write(root, "pia", STEM, learner_notebook(STEM, {"softmax": PATCH_WHEN_CALLED}))
    _write(root, "gus", STEM, learner_notebook(STEM, {"softmax": REACH_INTO_CHECK}))
    _write(root, "thea", STEM, learner_notebook(STEM, {"softmax": SOFTMAX_NO_MAX}, extra=[THREAD_PATCHING]))
    _write(root, "tom", STEM, learner_notebook(STEM, {"softmax": SOFTMAX_NO_MAX}, extra=[INPUT_TRANSFORMER]))
    _write(root, "lea", STEM, learner_notebook(STEM, {"softmax": READ_THE_CHECKS}))
    # A hand-in whose metadata is of the wrong types (a dict where a cell id belongs, points that are a list):
    # it is refused by itself; the grader goes on with the class.
    import json as _json

    nb = _json.loads(nbformat_text(learner_notebook(STEM)))
    nb["cells"][1]["id"] = {"not": "a string"}
    nb["cells"][1].setdefault("metadata", {})["course"] = {"points": [1, 2]}
    nb["metadata"]["kernelspec"] = {"name": ["python3"]}
    (root / "meta").mkdir(parents=True)
    (root / "meta" / f"{STEM}.ipynb").write_text(_json.dumps(nb))
    # The answer is what it was at its grader cell: otto breaks his right softmax after it (full points),
    # olga mends her wrong one after it (0 points).
    _write(root, "otto", STEM, _after_grader_cell(learner_notebook(STEM), "check_softmax",
                                                 "softmax.__code__ = (lambda x, axis=-1: x).__code__\nnp.exp = None"))
    _write(root, "olga", STEM, _after_grader_cell(learner_notebook(STEM, {"softmax": SOFTMAX_NO_MAX}), "check_softmax",
                                                 "def _right(x, axis=-1):\n    e = np.exp(x - x.max(axis=axis, keepdims=True))\n"
                                                 "    return e / e.sum(axis=axis, keepdims=True)\n"
                                                 "softmax.__code__ = _right.__code__"))
    # Leaves a process behind: a new session that sleeps long after the notebook ended.
    _write(root, "finn", STEM, learner_notebook(STEM, extra=[
        f"import os, time\nos.environ[{MARK!r}] = '1'\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n    os._exit(0)"]))
    return root, planted


def nbformat_text(nb) -> str:
    import nbformat

    return nbformat.writes(nb)


def _after_grader_cell(nb, check: str, source: str):
    """``nb`` with a cell of ``source`` right after the grader cell that calls ``check``."""
    import nbformat

    at = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and f"{check}(" in c.source)
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(source))
    return nb


def _processes_with_mark() -> list[int]:
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if MARK.encode() in Path(f"/proc/{p}/environ").read_bytes():
                found.append(int(p))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def hostile_class(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    root, planted = _build(base)
    out = base / "gradebook"
    before = _tree_digest(root)
    proc = subprocess.run([sys.executable, "-m", "course_utils.grade", str(root), "--out", str(out), "--jobs", "2",
                           "--timeout", "60"], cwd=base, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["learner"], r["exercise"]): r for r in grade.load_rows(out, grade.discover()) if r["notebook"] == STEM}
    yield {"base": base, "root": root, "out": out, "rows": rows, "planted": planted, "before": before}
    for p in planted:  # if a test failed because one was written, do not leave it in the repository
        if p.exists() and p.parent.name in ("course_utils", "solutions"):
            p.unlink()


def _points(rows, learner):
    return sum(r["points"] for (who, _), r in rows.items() if who == learner)


def test_honest_learners_get_full_points_beside_the_hostile_ones(hostile_class):
    rows = hostile_class["rows"]
    for learner in ("amy", "pat", "finn"):
        assert [r["status"] for (who, _), r in sorted(rows.items()) if who == learner] == ["passed", "passed"], learner
    assert _points(rows, "amy") == 3


def test_what_the_graded_function_does_while_called_cannot_reach_the_verdict(hostile_class):
    rows = hostile_class["rows"]
    # pia: numpy's comparisons and json replaced by the function itself; gus: the check's reference overwritten
    # from its frame (both were full points while the checks ran in the learner's process); lea: the checks
    # process's memory read (refused: it is not dumpable).
    for learner in ("pia", "gus", "lea"):
        row = rows[(learner, "check_softmax")]
        assert row["points"] == 0 and row["status"] == "failed", (learner, row)
        if learner != "lea":  # lea's fallback is a different wrong softmax
            assert "np.exp overflowed" in row["full_message"], (learner, row["full_message"])


def test_a_hand_in_with_metadata_of_the_wrong_types_is_refused_alone(hostile_class):
    rows = hostile_class["rows"]
    meta = [r for (who, _), r in rows.items() if who == "meta"]
    assert meta and all(r["status"] == "invalid" and r["points"] == 0 for r in meta), meta
    assert "not a readable notebook" in meta[0]["message"], meta[0]


def test_the_graded_answer_is_the_one_at_its_grader_cell(hostile_class):
    rows = hostile_class["rows"]
    assert rows[("otto", "check_softmax")]["status"] == "passed", rows[("otto", "check_softmax")]
    olga = rows[("olga", "check_softmax")]
    assert olga["points"] == 0 and "np.exp overflowed" in olga["full_message"], olga


def test_what_the_notebook_leaves_running_is_gone_before_the_checks(hostile_class):
    rows = hostile_class["rows"]
    for learner in ("thea", "tom"):  # a thread that keeps patching numpy; an input transformer on the last cell
        row = rows[(learner, "check_softmax")]
        assert row["points"] == 0 and row["status"] == "failed", (learner, row)
        assert "np.exp overflowed" in row["full_message"], (learner, row["full_message"])


def test_replaced_numpy_json_and_hooks_never_reach_the_checks(hostile_class):
    rows = hostile_class["rows"]
    for learner, named in (("nina", "numpy.allclose"), ("nina", "json.dump"), ("ivy", "an IPython post_run_cell hook")):
        row = rows[(learner, "check_softmax")]
        assert row["points"] == 0 and row["status"] == "failed", (learner, row)
        assert "np.exp overflowed" in row["full_message"], (learner, row["full_message"])  # the real verdict
        assert TAMPER_NOTE in row["full_message"] and named in row["full_message"], (learner, row["full_message"])
    assert "nanmax (its code)" in rows[("nina", "check_softmax")]["full_message"]  # a function's __code__ too
    for learner in ("amy", "pat", "rex", "wes", "finn"):  # nothing of theirs was put back
        assert all(TAMPER_NOTE not in r["full_message"] for (who, _), r in rows.items() if who == learner), learner


def test_the_official_answers_and_a_classmates_hand_in_cannot_be_read(hostile_class):
    rows = hostile_class["rows"]
    for exercise in ("check_softmax", "check_naive_attention"):
        row = rows[("rex", exercise)]
        assert row["points"] == 0 and row["status"] == "error", row
        assert "FileNotFoundError" in row["message"], row["message"]


def test_nothing_is_written_outside_the_hand_ins_folder_even_past_the_write_guard(hostile_class):
    rows = hostile_class["rows"]
    assert [p for p in hostile_class["planted"] if p.exists()] == []
    assert _points(rows, "wes") == 0 and rows[("wes", "check_softmax")]["status"] == "failed"
    assert _tree_digest(hostile_class["root"]) == hostile_class["before"]
    assert (hostile_class["base"] / "instructor_file.txt").read_text() == "keep me"


def test_no_process_of_a_hand_in_outlives_it(hostile_class):
    deadline = time.monotonic() + 10  # the namespace's processes are killed as its kernel shuts down
    while _processes_with_mark() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with_mark() == []


def test_every_report_is_written_and_the_summary_says_how_hand_ins_were_isolated(hostile_class):
    out = hostile_class["out"]
    for name in ("gradebook.csv", "gradebook.json", "summary.md", "summary.png"):
        assert (out / name).is_file(), name
    assert sorted(p.stem for p in (out / "feedback").glob("*.md")) == sorted(
        ["amy", "finn", "ivy", "nina", "pat", "rex", "wes", "pia", "gus", "thea", "tom", "lea", "otto", "olga", "meta"])
    summary = (out / "summary.md").read_text()
    assert "## Isolation" in summary and "own Linux namespaces" in summary


def test_without_namespaces_the_grader_warns_and_the_summary_says_hand_ins_ran_unisolated(tmp_path, monkeypatch,
                                                                                            capsys):
    reason = "the `unshare` program (util-linux) is not installed"
    monkeypatch.setattr(os_sandbox, "unavailable", lambda: reason)
    root = tmp_path / "submissions"
    _write(root, "amy", STEM, learner_notebook(STEM))
    rows = grade.grade([root], tmp_path / "gradebook", jobs=1, timeout=60, progress=False)
    assert [r["status"] for r in rows if r["notebook"] == STEM] == ["passed", "passed"]  # graded all the same
    sentence = grade.isolation_sentence(reason)
    assert sentence.startswith("Hand-ins ran WITHOUT operating-system isolation because the `unshare` program")
    assert f"warning: {sentence}" in capsys.readouterr().err
    assert sentence in (tmp_path / "gradebook" / "summary.md").read_text()


def test_the_sandbox_shows_the_system_read_only_and_hides_the_repository(tmp_path):
    writable = tmp_path / "w"
    writable.mkdir()
    code = (f"import os\nprint(sorted(os.listdir({str(ROOT)!r})))\n"
            "for p in ('/usr/planted', " + repr(str(ROOT / "course_utils" / "planted")) + ", "
            + repr(str(writable / "ok")) + "):\n"
            "    try:\n        open(p, 'w').close(); print('wrote', p)\n"
            "    except OSError as e:\n        print('refused', p, e.strerror)\n"
            "print('uid', os.getuid(), 'pid', os.getpid())\n"
            # an existing module of the course the checks import: neither appended to nor replaced
            "for how in ('a', 'r+'):\n"
            "    try:\n        open(" + repr(str(ROOT / "course_utils" / "references.py")) + ", how).write('x = 1')\n"
            "        print('changed references.py')\n"
            "    except OSError as e:\n        print('refused references.py', e.strerror)\n"
            "try:\n    os.replace(" + repr(str(writable / "ok")) + ", "
            + repr(str(ROOT / "course_utils" / "references.py")) + ")\n    print('replaced references.py')\n"
            "except OSError as e:\n    print('refused the rename', e.strerror)")
    argv = os_sandbox.command([sys.executable, "-c", code], writable=[writable], work_dir=str(tmp_path))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "solutions" not in lines[0] and "tests" not in lines[0] and "course_utils" in lines[0]
    assert lines[1] == "refused /usr/planted Read-only file system"
    assert lines[2].startswith("refused") and "Read-only file system" in lines[2]
    assert lines[3] == f"wrote {writable / 'ok'}"
    assert lines[4] == f"uid {os_sandbox.SANDBOX_UID} pid 2"
    assert lines[5:7] == ["refused references.py Read-only file system"] * 2, lines
    assert lines[7].startswith("refused the rename"), lines
