"""Grade a whole class's handed-in notebooks into a gradebook.

Usage::

    python -m course_utils.grade SUBMISSIONS... [--out DIR] [--jobs N] [--timeout S] [--force] [--memory GB]

SUBMISSIONS are folders laid out as ``<root>/<learner>/<notebook>.ipynb`` (the
names of ``notebooks/``), or single ``.ipynb`` files (the learner is the
file's folder name). DIR (default ``gradebook/``) receives ``gradebook.csv``,
``gradebook.json``, ``summary.md``, ``summary.png`` and ``feedback/<learner>.md``.

How a notebook is graded (nothing it claims is trusted):

- the exercises are the ``check_*`` calls of the grader cells of
  ``solutions/*.ipynb``; points come from each grader cell's
  ``metadata["course"]["points"]`` (default 1);
- the handed-in notebook is copied into a temporary folder, its outputs are
  dropped, its grader cells are replaced by the official ones (with the
  hidden tests of ``solutions/``), and it runs in a fresh kernel (nbclient),
  in its own process, with that folder as working directory and a guard
  that refuses writes outside it (:mod:`course_utils.guard`, run by :mod:`course_utils.grade_harness`);
- the grader cells copy the learner's answers out by value and the last cell
  writes them to a file; the kernel is then shut down, and the official checks
  run in fresh processes of the same sandbox (:mod:`course_utils.grade_checks`):
  where an exercise allows it, the verdict is computed in a process the learner's
  code never runs in; the results come back on that process's standard output.

A re-run skips (learner, notebook) pairs already graded from the same file;
``--force`` grades everything again.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
HARNESS = Path(__file__).with_name("grade_harness.py")
GUARD = Path(__file__).with_name("guard.py")

STATUSES = ("passed", "failed", "error", "timeout", "crashed", "not_attempted", "missing", "invalid", "grader_error")
COLUMNS = ("learner", "notebook", "exercise", "points", "max_points", "status", "message", "seconds")
MAX_NOTEBOOK_BYTES = 50 * 2**20  # a handed-in file larger than this is not read
MAX_OUTPUT_BYTES = 5 * 2**20  # a notebook that prints more than this is stopped
# Programs the kernel may start (Triton compiles with them on a GPU).
# The operating-system sandbox's limits per hand-in (course_utils.os_sandbox).
SANDBOX_NPROC = 4096  # processes and threads of the grader's user (RLIMIT_NPROC counts them all)
SANDBOX_FILE_BYTES = 2 * 2**30  # the largest file a hand-in may write
SANDBOX_TMP_BYTES = 2**30  # its private /tmp (memory); /dev/shm gets half
SANDBOX_CPU_PER_WALL = 2.0  # CPU seconds per wall second per core before RLIMIT_CPU stops it
ALLOWED_PROGRAMS = ("ldconfig", "gcc", "cc", "clang", "g++", "c++", "ptxas", "nvcc", "cuobjdump", "nvdisasm",
                    "nvidia-smi", "uname", "lscpu", "which", "ld", "as")


# -- the course's exercises, read from solutions/ ---------------------------------------
@dataclasses.dataclass
class Call:
    index: int  # position among the notebook's check calls
    check: str
    args: list[str]
    kwargs: dict[str, str]
    cell_id: str
    answer_keys: list[str] = dataclasses.field(default_factory=list)  # refused while this check runs
    allowed: list[str] = dataclasses.field(default_factory=list)  # course functions this answer may call


@dataclasses.dataclass
class Exercise:
    notebook: str
    name: str  # the check's name
    points: float
    calls: list[Call]


@dataclasses.dataclass
class CourseNotebook:
    stem: str
    path: Path
    exercises: list[Exercise]
    grader_cells: list[dict]  # {"id", "after_id", "calls", "hidden", "source"}
    allowed: list[str]  # helpers from course_utils.kernels the lesson gives learners
    checks: list[str] = dataclasses.field(default_factory=list)  # every exercise's check (the table's names)
    exercise_cells: list[dict] = dataclasses.field(default_factory=list)  # {"id", "label", "stub"}: learners' code


def check_calls(source: str, checks=None) -> list[ast.Call] | None:
    """The calls of a grader cell to the exercises' checks, or None if the cell is not one.

    A grader cell is a code cell whose top-level statements include at least one
    bare call to an exercise's check (:mod:`course_utils.grading.exercises`, or the
    names ``checks``); its other statements are hidden tests.
    """
    from course_utils.build import exercise_calls  # absolute: the grading worker runs this file as a script

    return exercise_calls(source, checks)


def _hidden_source(source: str) -> str:
    """The cell's code minus its check calls, with hidden-test markers removed."""
    from .build import BEGIN_HIDDEN, END_HIDDEN, exercise_names, is_exercise_call, strip_magics

    lines = [ln for ln in source.split("\n") if ln.strip() not in (BEGIN_HIDDEN, END_HIDDEN)]
    tree = ast.parse(strip_magics("\n".join(lines)))
    checks = exercise_names()
    keep = [ast.get_source_segment("\n".join(lines), node) for node in tree.body if not is_exercise_call(node, checks)]
    return "\n".join(s for s in keep if s)


def points_of(cell) -> float:
    value = cell.get("metadata", {}).get("course", {}).get("points", 1)
    return float(value)


def discover(solutions: Path = SOLUTIONS) -> list[CourseNotebook]:
    """Every graded notebook of the course and its exercises, in order."""
    from . import STUB_LINE
    from .build import BEGIN_SOLUTION, student_notebook
    from .build import defined_names
    from .grading.exercises import EXERCISES, by_name

    found = []
    for path in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        student = student_notebook(nb, path.name)  # the cell ids learners have
        exercises: dict[str, Exercise] = {}
        graders = []
        seen_solution = False
        index = 0
        allowed = set()
        for position, cell in enumerate(student.cells):
            source_cell = _source_cell(nb, cell)
            if cell.cell_type != "code":
                continue
            source = source_cell.source if source_cell is not None else cell.source
            allowed |= _kernel_helpers(source)
            if BEGIN_SOLUTION in source:
                seen_solution = True
            calls = check_calls(source) if seen_solution else None
            if not calls:
                continue
            cell_calls = []
            for node in calls:
                name = node.func.id
                call = Call(index, name, [ast.get_source_segment(source, a) for a in node.args],
                            {k.arg: ast.get_source_segment(source, k.value) for k in node.keywords if k.arg}, cell.id,
                            list(by_name(name).answer_keys), list(by_name(name).allowed))
                index += 1
                cell_calls.append(call)
                if name not in exercises:
                    exercises[name] = Exercise(path.stem, name, 0.0, [])
                if name not in {c.check for c in cell_calls[:-1]}:  # a check's points: the sum over its grader cells
                    exercises[name].points += points_of(source_cell or cell)
                exercises[name].calls.append(call)
            graders.append({
                "id": cell.id,
                "after_id": student.cells[position - 1].id if position else None,
                "calls": cell_calls,
                "hidden": _hidden_source(source),
            })
        if exercises:
            cells = [{"id": c.id, "label": ", ".join(sorted(defined_names(c.source))) or c.id, "stub": c.source}
                     for c in student.cells if c.cell_type == "code" and STUB_LINE in c.source]
            found.append(CourseNotebook(path.stem, path, list(exercises.values()), graders, sorted(allowed),
                                        [e.name for e in EXERCISES], cells))
    return found


def _source_cell(solution_nb, student_cell):
    # student_notebook() keeps the solution's cells in order after two build-owned cells.
    from .build import BADGE_TAG, INSTALL_TAG

    cells = [c for c in solution_nb.cells if not set(c.metadata.get("tags", [])) & {BADGE_TAG, INSTALL_TAG}]
    i = int(student_cell.id.split("-")[1]) - 2
    return cells[i] if 0 <= i < len(cells) else None


def _kernel_helpers(source: str) -> set[str]:
    """Names a cell imports from course_utils.kernels (the helpers a lesson gives)."""
    from .build import strip_magics

    try:
        tree = ast.parse(strip_magics(source))
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_utils.kernels"):
            names |= {a.name for a in node.names}
    return names


# -- the notebook that actually runs -------------------------------------------------
def _code(source: str, cell_id: str):
    cell = nbformat.v4.new_code_cell(source)
    cell.id = cell_id
    return cell


def _injected(function: str, cfg: dict, *, user_ns: bool = False) -> str:
    harness = HARNESS.read_text()
    guard = GUARD.read_text()  # stdlib only: the harness's prologue calls its install()
    args = "globals(), " if user_ns else ""
    return (
        "# Added by the course's grader.\n"
        f"__course_grader = {{'__name__': '__course_grader__'}}\n"
        f"exec(compile({guard!r}, '<course-guard>', 'exec'), __course_grader)\n"
        f"exec(compile({harness!r}, '<course-grader>', 'exec'), __course_grader)\n"
        f"__course_grader[{function!r}]({args}{cfg!r})\n"
        "del __course_grader"
    )


def graded_notebook(submitted, course: CourseNotebook, cfg: dict) -> nbformat.NotebookNode:
    """The notebook to execute: the learner's cells, official grader cells (which collect the answers), the last cell
    (which writes them out for :mod:`course_utils.grade_checks`)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    cells = []
    for i, cell in enumerate(submitted.cells):
        if cell.get("cell_type") != "code":
            continue
        cells.append(_code(cell.get("source", "") if isinstance(cell.get("source"), str) else "".join(cell.get("source")),
                           str(cell.get("id") or f"learner-{i}")))
    by_id = {c.id: i for i, c in enumerate(cells)}
    replaced = set()
    for grader in course.grader_cells:
        collect = _code(_injected("collect", {"token_a": cfg["token_a"], "cell": grader["id"], "hidden": grader["hidden"],
                                              "calls": [dataclasses.asdict(c) for c in grader["calls"]]}, user_ns=True),
                        "grader-" + grader["id"])
        names = {c.check for c in grader["calls"]}
        target = by_id.get(grader["id"])
        if target is None:  # the learner's copy lost the cell's id: find the same check call
            target = next((i for i, c in enumerate(cells) if i not in replaced
                           and {n.func.id for n in (check_calls(c.source, course.checks) or [])} == names), None)
        if target is not None:
            cells[target] = collect
            replaced.add(target)
        else:
            after = by_id.get(grader["after_id"])
            position = after + 1 if after is not None else len(cells)
            cells.insert(position, collect)
            by_id = {c.id: i for i, c in enumerate(cells)}
            replaced = {i + (i >= position) for i in replaced} | {position}
    for i, cell in enumerate(cells):  # the learner's own grader-like cells would only cost time
        if i not in replaced and not cell.id.startswith("grader-") and check_calls(cell.source, course.checks):
            cell.source = "# (a check call of the learner: the grader runs the official checks at the end)"
    prologue = _code(_injected("prologue", {k: cfg[k] for k in ("token_a", "write_roots", "hidden_dirs",
                                                                "allowed_programs", "data_limit_bytes",
                                                                "uses_torch") if k in cfg}), "grader-prologue")
    final = _code(_injected("export", {"token_a": cfg["token_a"], "token_b": cfg["token_b"],
                                       "answers_file": cfg["answers_file"]}), "grader-final")
    nb.cells = [prologue] + cells + [final]
    return nb


# -- the worker: one (learner, notebook), in its own process ------------------------------
def _client_class():
    from course_utils.build import notebook_client_class

    class CappedClient(notebook_client_class()):
        """Drops outputs past a byte budget and stops the run when it is exceeded."""

        output_bytes = 0
        too_much = False
        lost_message = False  # the kernel was idle at the time limit: a message got lost, not the learner's fault

        async def _async_handle_timeout(self, timeout, cell=None):
            # A kernel busy with a cell answers nothing on its shell channel until the cell ends;
            # one that answers at once was not running anything.
            import queue

            from nbclient.util import ensure_async

            try:
                msg_id = self.kc.kernel_info()
                give_up = time.monotonic() + 10
                while time.monotonic() < give_up and not self.lost_message:
                    try:
                        msg = await ensure_async(self.kc.shell_channel.get_msg(timeout=1))
                    except queue.Empty:
                        continue
                    self.lost_message = msg.get("parent_header", {}).get("msg_id") == msg_id
            except Exception:  # noqa: BLE001 - a probe only
                pass
            return await super()._async_handle_timeout(timeout, cell)

        def output(self, outs, msg, display_id, cell_index):
            size = len(json.dumps(msg.get("content", {}), default=str))
            self.output_bytes += size
            if self.output_bytes > MAX_OUTPUT_BYTES:
                self.too_much = True
                return None
            return super().output(outs, msg, display_id, cell_index)

    return CappedClient


def run_notebook(task: dict) -> dict:
    """Grade one handed-in notebook; return {"calls": {index: entry}, "notebook_status": ...}."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    course = _course_from_task(task)
    path = task["submission"]
    deadline = time.monotonic() + task["timeout"]
    out = {"calls": {}, "problem": None, "problem_status": None}
    if os.path.getsize(path) > MAX_NOTEBOOK_BYTES:
        return _problem(out, "invalid", f"the file is larger than {MAX_NOTEBOOK_BYTES // 2**20} MB; not graded")
    try:
        submitted = nbformat.read(path, as_version=4)
        nbformat.validate(submitted)
    except Exception as exc:  # noqa: BLE001 - any unreadable file
        return _problem(out, "invalid", f"not a readable notebook ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    base = Path(tempfile.mkdtemp(prefix="course-grade-"))
    try:
        work = base / "work"
        private = base / ("r-" + secrets.token_hex(8))
        for d in (work, private, work / "tmp", work / "ipython", work / "mpl"):
            d.mkdir(parents=True)
        shutil.copy(path, work / Path(path).name)
        home = Path.home()
        cfg = {
            "token_a": secrets.token_hex(8),
            "token_b": secrets.token_hex(16),
            "result_file": str(private / "result.json"),
            "borrow_file": str(private / "borrowed.txt"),
            "write_roots": [str(work), str(private), str(home / ".triton"), str(home / ".cache")],
            "hidden_dirs": [str(base), str(private)],
            "allowed_programs": list(ALLOWED_PROGRAMS) + [os.path.basename(os.environ[v].split()[0])
                                                          for v in ("CC", "CXX") if os.environ.get(v, "").strip()],
            "data_limit_bytes": task.get("data_limit_bytes"),
            # The harness keeps torch's functions too (grade_harness.TORCH_MODULES) where the lesson imports it.
            "uses_torch": "import torch" in Path(course.path).read_text(),
        }
        sandboxed = bool(task.get("sandbox"))  # the grader probed the machine once (os_sandbox.unavailable)
        env = {"TMPDIR": str(work / "tmp"), "IPYTHONDIR": str(work / "ipython"), "MPLCONFIGDIR": str(work / "mpl"),
               "MPLBACKEND": "Agg", "PYTHONPATH": _pythonpath()}
        if sandboxed:  # the home folder does not exist in the sandbox: caches in the working copy
            env.update({"HOME": str(work), "TRITON_CACHE_DIR": str(work / ".triton"),
                        "XDG_CACHE_HOME": str(work / ".cache")})
        cfg["answers_file"] = str(private / "answers.pkl")
        retried_lost = False
        while True:
            nb = graded_notebook(submitted, course, cfg)
            client = _client_class()(
                nb, kernel_name="python3", allow_errors=True, record_timing=False,
                timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
                resources={"metadata": {"path": str(work)}},
                **({"km": _sandboxed_kernel_manager(base, [work, private], task)} if sandboxed else {}),
            )
            client.owns_km = True  # nbclient shuts down (kills) only a kernel it owns
            current = {"cell": None}
            client.on_cell_execute = lambda cell, cell_index: current.__setitem__("cell", cell_index)
            env_backup = dict(os.environ)
            os.environ.update(env)
            died = timed_out = False
            try:
                client.execute()
            except CellTimeoutError:
                timed_out = True
            except DeadKernelError:
                died = True
            except Exception as exc:  # noqa: BLE001 - nbclient's other failures: the kernel is gone
                died = "died" in str(exc).lower() or "dead" in str(exc).lower()
                timed_out = not died
            finally:
                os.environ.clear()
                os.environ.update(env_backup)
            if client.too_much:
                return _problem(out, "invalid", f"the notebook printed more than {MAX_OUTPUT_BYTES // 2**20} MB; "
                                                "outputs that large are not graded: remove the prints")
            exits = [c for c in nb.cells if any(o.get("ename") == "SystemExit" for o in c.get("outputs", []))
                     and not c.id.startswith("grader-")]
            if exits:
                return _problem(out, "invalid", "the notebook calls sys.exit() in a cell; a handed-in notebook must run "
                                                "from top to bottom")
            if timed_out and client.lost_message and not retried_lost:
                retried_lost = True  # once, with a fresh time budget
                deadline = time.monotonic() + task["timeout"]
                continue
            if timed_out or time.monotonic() >= deadline:
                where = _where(nb, {}, course, current['cell'])
                return _problem(out, "timeout", f"the notebook did not finish within {task['timeout']:g} s "
                                                f"(stopped {where}); look for a loop that never ends")
            if died:
                where = _where(nb, {}, course, current['cell'])
                return _problem(out, "crashed", f"the kernel died {where} (a segfault, out of memory, or os._exit); "
                                                "the checks after it could not run")
            break
        # The kernel is gone: the checks run in fresh processes of their own (course_utils.grade_checks).
        record, finished = run_checks(course, cfg, task, base, work, private, env, sandboxed,
                                      max(1.0, deadline - time.monotonic()))
        for entry in record.get("results", []):
            out["calls"][entry["index"]] = entry
        if record.get("setup_error"):
            return _problem(out, "error", "the grader could not import course_utils: " + record["setup_error"])
        hidden = record.get("hidden", {})
        for cell_id, message in hidden.items():  # a failing hidden test fails the exercises of its cell
            for grader in course.grader_cells:
                if grader["id"] == cell_id:
                    for c in grader["calls"]:
                        entry = out["calls"].get(c.index)
                        if entry is None or entry["status"] == "passed":
                            out["calls"][c.index] = {"index": c.index, "check": c.check, "status": "failed",
                                                     "message": f"{c.check}: a hidden test failed: {message}",
                                                     "seed": None, "seconds": 0.0}
        if not record.get("token") == cfg["token_b"]:
            return _problem(out, "error", "the grading cell did not run (the notebook stopped before the end)")
        if not finished:
            running = record.get("running")
            where = f" (stopped in {_check_of(course, running)})" if running is not None else ""
            return _problem(out, "timeout", f"the checks did not finish within the notebook's {task['timeout']:g} s"
                                            f"{where}; look for a loop that never ends")
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_checks(course: CourseNotebook, cfg: dict, task: dict, base: Path, work: Path, private: Path, env: dict,
               sandboxed: bool, timeout: float) -> tuple[dict, bool]:
    """Run :mod:`course_utils.grade_checks` on the answers the notebook wrote; (its record, whether it finished)."""
    from course_utils import grade_checks, os_sandbox

    calls = sorted((dataclasses.asdict(c) for ex in course.exercises for c in ex.calls), key=lambda c: c["index"])
    checks_cfg = {k: cfg[k] for k in ("token_a", "token_b", "write_roots", "hidden_dirs", "allowed_programs",
                                      "data_limit_bytes", "uses_torch", "answers_file", "borrow_file") if k in cfg}
    checks_cfg.update({"root": str(ROOT), "calls": calls, "allowed": course.allowed, "skip": [],
                       "result_file": cfg["result_file"], "learner_result": str(private / "learner-result.json"),
                       "learner_log": str(work / "tmp" / "learner-process.log"), "cwd": str(work),
                       "deadline": time.time() + timeout})
    path = private / "checks.json"
    path.write_text(json.dumps(checks_cfg))
    argv = [sys.executable, "-m", "course_utils.grade_checks", "checks", str(path)]
    if sandboxed:
        plan_dir = base / "sandbox-checks"
        plan_dir.mkdir(exist_ok=True)
        argv = os_sandbox.command(argv, writable=[str(work), str(private)], hidden=task.get("hidden_paths", ()),
                                  work_dir=str(plan_dir), limits=sandbox_limits(task["timeout"]))
    finished = True
    proc = subprocess.Popen(argv, cwd=str(work), env=dict(os.environ, **env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        finished = False
        os.killpg(proc.pid, signal.SIGKILL)  # the checks process and the learner's, sandboxed or not
        stdout, stderr = proc.communicate()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # nothing of the learner's process may outlive it
    except OSError:
        pass
    record = {}
    mark = grade_checks.RECORD_MARK.encode()
    for line in (stdout or b"").splitlines():
        if line.startswith(mark):
            try:
                record = json.loads(line[len(mark):])
            except ValueError:
                continue
    if not record:
        tail = (stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        record = {"token": cfg["token_b"], "results": [],
                  "setup_error": f"the checks process ended without a result ({tail[0][:300]})"}
    return record, finished


def sandbox_limits(timeout: float) -> dict:
    """The operating-system limits of one hand-in (:mod:`course_utils.os_sandbox`)."""
    return {"nproc": SANDBOX_NPROC, "fsize_bytes": SANDBOX_FILE_BYTES, "tmp_bytes": SANDBOX_TMP_BYTES,
            "cpu_s": int(SANDBOX_CPU_PER_WALL * (os.cpu_count() or 1) * timeout) + 60}


def _sandboxed_kernel_manager(base: Path, writable, task):
    """A Jupyter kernel manager whose kernel starts inside :mod:`course_utils.os_sandbox` (IPC sockets, no network)."""
    from jupyter_client.manager import AsyncKernelManager  # nbclient awaits its kernel manager

    from course_utils import os_sandbox

    conn = base / "conn"
    conn.mkdir(exist_ok=True)
    plan_dir = base / "sandbox"
    plan_dir.mkdir(exist_ok=True)
    folders = [str(p) for p in writable] + [str(conn)]
    limits = sandbox_limits(task["timeout"])

    class SandboxedKernelManager(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            return os_sandbox.command(super().format_kernel_cmd(extra_arguments), writable=folders,
                                      hidden=task.get("hidden_paths", ()), work_dir=str(plan_dir), limits=limits)

    return SandboxedKernelManager(kernel_name="python3", transport="ipc", connection_file=str(conn / "kernel.json"))


def _pythonpath() -> str:
    parts = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def _check_of(course, index):
    return next(c.check for ex in course.exercises for c in ex.calls if c.index == index)


def _where(nb, record, course, cell_index) -> str:
    if record.get("running") is not None:
        return f"while {_check_of(course, record['running'])} ran your code"
    if cell_index is None:
        return "before its first cell"
    cell = nb.cells[cell_index]
    if cell.id == "grader-final":
        return "in the grading cell"
    if cell.id.startswith("grader-"):
        return "in a grader cell"
    first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")
    return f"in the cell starting `{first[:60]}`"


def _problem(out, status, message):
    out["problem_status"], out["problem"] = status, message
    return out


def _course_from_task(task) -> CourseNotebook:
    data = task["course"]
    exercises = [Exercise(e["notebook"], e["name"], e["points"], [Call(**c) for c in e["calls"]]) for e in data["exercises"]]
    calls = {c.index: c for e in exercises for c in e.calls}
    graders = [dict(g, calls=[calls[c["index"]] for c in g["calls"]]) for g in data["grader_cells"]]
    return CourseNotebook(data["stem"], Path(data["path"]), exercises, graders, data["allowed"], data["checks"])


def _worker_main(task_file: str) -> int:
    task = json.loads(Path(task_file).read_text())
    result = run_notebook(task)
    tmp = task["output"] + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    os.replace(tmp, task["output"])
    return 0


# -- rows --------------------------------------------------------------------------------
def first_line(message: str) -> str:
    """The "Likely cause" of a check's message when there is one, else its first line."""
    for line in message.splitlines():
        if line.strip().startswith("Likely cause:"):
            return line.strip()[len("Likely cause:"):].strip()
    for line in message.splitlines():
        if line.strip():
            return line.strip()
    return ""


def rows_for(learner: str, course: CourseNotebook, result: dict | None, seconds: float) -> list[dict]:
    """One row per exercise of ``course`` for this learner, from a worker's result (None: missing)."""
    rows = []
    for ex in course.exercises:
        entries = [] if result is None else [result["calls"].get(c.index) or result["calls"].get(str(c.index)) for c in ex.calls]
        if result is None:
            status, message, seeds, secs = "missing", f"{course.stem}.ipynb was not handed in", [], 0.0
        elif result.get("problem_status") == "invalid":  # the whole notebook is not graded
            status, message, seeds, secs = "invalid", result["problem"], [], 0.0
        elif all(e is not None for e in entries) and entries:
            bad = next((e for e in entries if e["status"] != "passed"), None)
            status = bad["status"] if bad else "passed"
            message = (bad or entries[0])["message"]
            seeds = [e.get("seed") for e in entries]
            secs = sum(e.get("seconds", 0.0) for e in entries)
        else:
            done = next((e for e in entries if e is not None and e["status"] != "passed"), None)
            if done is not None:
                status, message = done["status"], done["message"]
            else:
                status = result.get("problem_status") or "error"
                message = result.get("problem") or "the check did not run"
            seeds = [e.get("seed") for e in entries if e is not None]
            secs = sum(e.get("seconds", 0.0) for e in entries if e is not None)
        rows.append({
            "learner": learner, "notebook": course.stem, "exercise": ex.name,
            "points": ex.points if status == "passed" else 0, "max_points": ex.points,
            "status": status, "message": first_line(message), "seconds": round(float(secs), 2),
            "full_message": message, "seeds": seeds, "notebook_seconds": round(seconds, 2),
            # where each call's verdict was computed: "grader" (a process the learner's code never ran in) or
            # "learner process" (course_utils.grade_checks); empty where no check ran
            "verdict": sorted({e.get("verdict") for e in entries if e is not None and e.get("verdict")}),
        })
    return rows


# -- submissions -------------------------------------------------------------------------
def collect_submissions(paths: list[Path], course: list[CourseNotebook]) -> dict[str, dict[str, Path | None]]:
    """{learner: {notebook stem: file or None}} from root folders and single files."""
    stems = [c.stem for c in course]
    learners: dict[str, dict[str, Path | None]] = {}
    for path in paths:
        if path.is_file() and path.suffix == ".ipynb":
            learners.setdefault(path.parent.resolve().name, {})[path.stem] = path
        elif path.is_dir():
            for folder in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                entry = learners.setdefault(folder.name, {})
                for stem in stems:
                    file = folder / f"{stem}.ipynb"
                    entry[stem] = file if file.exists() else entry.get(stem)
        else:
            raise SystemExit(f"error: {path} is neither a folder of learners nor a .ipynb file")
    return learners


def grader_version(solutions: Path = SOLUTIONS, package: Path = Path(__file__).resolve().parent) -> str:
    """A short hash of what grades: the ``course_utils`` package's files and the solution notebooks.

    A stored grade is reused only when both the hand-in and this version are unchanged, so
    a fixed check or an edited hidden test grades the class again.
    """
    h = hashlib.sha256()
    files = [p for p in sorted(package.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
             and p.suffix not in (".pyc", ".pyo")]
    files += sorted(Path(solutions).glob("*.ipynb"))
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _digest(path: Path | None) -> str:
    if path is None:
        return "missing"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _course_dict(c: CourseNotebook) -> dict:
    return {"stem": c.stem, "path": str(c.path), "allowed": c.allowed, "checks": c.checks,
            "exercises": [dataclasses.asdict(e) for e in c.exercises],
            "grader_cells": [dict(g, calls=[dataclasses.asdict(x) for x in g["calls"]]) for g in c.grader_cells]}


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def grade_one(learner: str, course: CourseNotebook, path: Path | None, state_dir: Path, timeout: float,
              data_limit: int | None, version: str = "", sandbox: bool = False, hidden=()) -> list[dict]:
    """Grade one (learner, notebook) in a worker process; store and return its rows.

    Never raises: an exception in the grader's own code becomes a ``grader_error`` row for each of
    this notebook's exercises, so one hand-in can never stop the others (nor the reports).
    """
    try:
        return _grade_one(learner, course, path, state_dir, timeout, data_limit, version, sandbox, hidden)
    except Exception as exc:  # noqa: BLE001 - the grader's bug, not the learner's
        message = (f"the grader itself failed on this notebook ({type(exc).__name__}: {str(exc)[:300]}); "
                   "this is not your fault: your instructor will grade it again")
        rows = [{"learner": learner, "notebook": course.stem, "exercise": ex.name, "points": 0, "max_points": ex.points,
                 "status": "grader_error", "message": message, "seconds": 0.0, "full_message": message, "seeds": [],
                 "notebook_seconds": 0.0, "grader": version} for ex in course.exercises]
        try:
            _store(state_dir, learner, course, {"learner": learner, "notebook": course.stem, "digest": "grader_error",
                                                "grader": version, "rows": rows})
        except Exception:  # noqa: BLE001 - the rows are still returned
            pass
        return rows


def _store(state_dir: Path, learner: str, course: CourseNotebook, record: dict) -> None:
    target = state_dir / _safe(learner) / f"{course.stem}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(target.with_suffix(".tmp"), target)


def _grade_one(learner, course, path, state_dir, timeout, data_limit, version, sandbox=False, hidden=()) -> list[dict]:
    start = time.monotonic()
    result = None
    if path is not None:
        with tempfile.TemporaryDirectory(prefix="course-grade-task-") as tmp:
            task = {"course": _course_dict(course), "submission": str(path), "timeout": timeout,
                    "output": str(Path(tmp) / "result.json"), "data_limit_bytes": data_limit, "sandbox": sandbox,
                    "hidden_paths": [str(p) for p in hidden]}
            task_file = Path(tmp) / "task.json"
            task_file.write_text(json.dumps(task))
            # The worker runs this file as a script: importing the course_utils package would import torch.
            boot = f"import runpy, sys; sys.argv = ['grade', '--worker', {str(task_file)!r}]; runpy.run_path({__file__!r}, run_name='__main__')"
            proc = subprocess.Popen([sys.executable, "-c", boot],
                                    cwd=tmp, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    env=dict(os.environ, PYTHONPATH=_pythonpath()))
            try:
                _, err = proc.communicate(timeout=2 * timeout + 60)  # a worker may run a notebook twice (a lost message)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, err = proc.communicate()
            try:
                result = json.loads(Path(task["output"]).read_text())
            except (OSError, ValueError):
                tail = (err or b"").decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
                result = {"calls": {}, "problem_status": "crashed",
                          "problem": f"the grading process died ({tail[0][:200]})"}
    rows = rows_for(learner, course, result, time.monotonic() - start)
    for row in rows:
        row["grader"] = version
    _store(state_dir, learner, course,
           {"learner": learner, "notebook": course.stem, "digest": _digest(path), "grader": version, "rows": rows})
    return rows


# -- reports -----------------------------------------------------------------------------
def load_rows(out: Path, course: list[CourseNotebook]) -> list[dict]:
    """Every stored row, in learner / course order."""
    order = {(c.stem, e.name): (i, j) for i, c in enumerate(course) for j, e in enumerate(c.exercises)}
    rows = []
    for file in sorted((out / ".state").glob("*/*.json")):
        rows += json.loads(file.read_text())["rows"]
    return sorted(rows, key=lambda r: (r["learner"], order.get((r["notebook"], r["exercise"]), (99, 99))))


def write_csv(rows, path: Path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (_num(row[k]) if k in ("points", "max_points") else row[k]) for k in COLUMNS})


def _num(x):
    return int(x) if float(x).is_integer() else x


def summarize(rows) -> dict:
    """Per exercise: learners, passes, the status counts and the most frequent diagnoses."""
    per: dict[tuple[str, str], dict] = {}
    for row in rows:
        s = per.setdefault((row["notebook"], row["exercise"]), {"learners": 0, "statuses": {k: 0 for k in STATUSES},
                                                                  "causes": {}})
        s["learners"] += 1
        s["statuses"][row["status"]] += 1
        if row["status"] == "failed":
            cause = first_line(row.get("full_message", row["message"]))
            s["causes"][cause] = s["causes"].get(cause, 0) + 1
    for s in per.values():
        s["pass_rate"] = s["statuses"]["passed"] / s["learners"] if s["learners"] else 0.0
        s["top_causes"] = sorted(s["causes"].items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    return per


def write_summary(rows, out: Path, extra=()) -> None:
    per = summarize(rows)
    learners = sorted({r["learner"] for r in rows})
    totals = {name: (sum(r["points"] for r in rows if r["learner"] == name),
                     sum(r["max_points"] for r in rows if r["learner"] == name)) for name in learners}
    lines = ["# Class summary", "", f"{len(learners)} learners, {len(per)} exercises.", "",
             "| notebook | exercise | passed | pass rate | " + " | ".join(STATUSES[1:]) + " |",
             "|---|---|---:|---:|" + "---:|" * (len(STATUSES) - 1)]
    for (nb, ex), s in per.items():
        counts = " | ".join(str(s["statuses"][k]) for k in STATUSES[1:])
        lines.append(f"| {nb} | {ex} | {s['statuses']['passed']} of {s['learners']} | {s['pass_rate']:.0%} | {counts} |")
    lines += ["", "## What to teach again", ""]
    any_cause = False
    for (nb, ex), s in sorted(per.items(), key=lambda kv: kv[1]["pass_rate"]):
        for cause, n in s["top_causes"]:
            any_cause = True
            lines.append(f"- `{ex}` ({nb}): {n} of {s['learners']} learners: {cause}")
    if not any_cause:
        lines.append("No check failed.")
    lines += ["", "## Points", "", "| learner | points | of |", "|---|---:|---:|"]
    lines += [f"| {name} | {_num(p)} | {_num(m)} |" for name, (p, m) in totals.items()]
    versions: dict[str, set] = {}
    for r in rows:
        versions.setdefault(r.get("grader") or "unknown (graded before versions were kept)", set()).add(r["learner"])
    lines += ["", "## Grader versions", "",
              "Each row was graded by the grader whose version is the hash of `course_utils` and `solutions/` "
              "then (a changed grader grades again).", "", "| grader version | rows | learners |", "|---|---:|---|"]
    lines += [f"| `{v}` | {sum(1 for r in rows if (r.get('grader') or 'unknown (graded before versions were kept)') == v)} "
              f"| {', '.join(sorted(who))} |" for v, who in sorted(versions.items())]
    lines += [""] + list(extra)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    _plot(per, out / "summary.png")


def _plot(per, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{nb[:2]} {ex}" for nb, ex in per]
    colors = {"passed": "tab:green", "failed": "tab:red", "error": "tab:orange", "timeout": "tab:purple",
              "crashed": "black", "not_attempted": "lightgray", "missing": "white", "invalid": "tab:brown",
              "grader_error": "tab:pink"}
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(per) + 1.5), layout="constrained")
    left = [0.0] * len(per)
    for status in STATUSES:
        widths = [s["statuses"][status] / s["learners"] if s["learners"] else 0 for s in per.values()]
        ax.barh(labels, widths, left=left, color=colors[status], edgecolor="gray", linewidth=0.5, label=status)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of learners")
    ax.set_title("Status per exercise")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=4, fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_feedback(rows, out: Path) -> None:
    folder = out / "feedback"
    folder.mkdir(exist_ok=True)
    for learner in sorted({r["learner"] for r in rows}):
        mine = [r for r in rows if r["learner"] == learner]
        got, total = sum(r["points"] for r in mine), sum(r["max_points"] for r in mine)
        lines = [f"# Feedback for {learner}", "", f"Points: {_num(got)} of {_num(total)}.", ""]
        for r in mine:
            lines += [f"## {r['notebook']}: `{r['exercise']}`: {r['status']} ({_num(r['points'])} of {_num(r['max_points'])} points)", ""]
            if r["status"] != "passed" or r.get("full_message"):
                lines += ["```", r.get("full_message") or r["message"], "```", ""]
            if any(r.get("seeds") or []):
                lines += [f"Seeds that reproduce it: {', '.join(str(s) for s in r['seeds'] if s is not None)}", ""]
        (folder / f"{_safe(learner)}.md").write_text("\n".join(lines))


def learners_cells(course: list[CourseNotebook], submissions: dict) -> dict:
    """``{(notebook, exercise cell label): (stub, {learner: their code})}`` from the hand-ins, for the similarity report.

    A learner's cell is the one with the exercise cell's id, else the one defining the same names;
    a hand-in that cannot be read is left out (it is graded ``invalid`` anyway).
    """
    from .build import defined_names

    found = {}
    for c in course:
        for cell in c.exercise_cells:
            found[(c.stem, cell["label"])] = (cell["stub"], {})
        for learner, files in submissions.items():
            path = files.get(c.stem)
            if path is None:
                continue
            try:
                if os.path.getsize(path) > MAX_NOTEBOOK_BYTES:
                    continue
                nb = nbformat.read(path, as_version=4)
                code = [(str(x.get("id")), x.get("source") if isinstance(x.get("source"), str) else "".join(x.get("source") or []))
                        for x in nb.cells if x.get("cell_type") == "code"]
            except Exception:  # noqa: BLE001 - an unreadable hand-in
                continue
            for cell in c.exercise_cells:
                names = set(cell["label"].split(", "))
                source = next((src for cid, src in code if cid == cell["id"]), None)
                if source is None:
                    source = next((src for _, src in code if names and defined_names(src) == names), None)
                if source is not None:
                    found[(c.stem, cell["label"])][1][learner] = source
    return found


def isolation_sentence(refused: str | None) -> str:
    """How this run isolated the hand-ins, in one sentence for the instructor (``refused``: why namespaces could not)."""
    if refused is None:
        return ("Each hand-in ran in its own Linux namespaces (user, mount, pid, network: course_utils.os_sandbox): "
                "it saw the system read-only, its own working copy, a private /tmp and no network; solutions/, the other "
                "hand-ins and the gradebook did not exist for it, and every process it started ended with it.")
    return (f"Hand-ins ran WITHOUT operating-system isolation because {refused}: only the in-process write guard "
            "(course_utils.guard) stood between them and this machine's files; grade untrusted hand-ins on Linux "
            "with user namespaces enabled.")


def verdict_sentence() -> str:
    """Where the checks computed their verdicts, in one sentence (from the exercise table)."""
    from course_utils.grading import exercises

    inside = [e.name for e in exercises.EXERCISES if not e.verdict_outside]
    return (f"{len(exercises.EXERCISES) - len(inside)} of {len(exercises.EXERCISES)} exercises were judged in a process "
            "the learner's code never ran in (their functions ran in another process; only data came back); the "
            f"other {len(inside)} ({', '.join(inside)}) were judged in the learner's sandboxed process, because their "
            "proof of work watches the learner's code as it runs.")


def write_reports(out: Path, course: list[CourseNotebook], *, roster: Path | None = None,
                  submissions: dict | None = None, isolation: str | None = None) -> list[dict]:
    """Write gradebook.csv/.json, summary.md/.png, feedback/, and with a roster canvas.csv; return the rows.

    ``submissions`` (``{learner: {notebook: path}}``): the hand-ins, for the similarity report.
    """
    from . import lms_export, similarity

    rows = load_rows(out, course)
    write_csv(rows, out / "gradebook.csv")
    (out / "gradebook.json").write_text(json.dumps({"columns": list(COLUMNS), "rows": rows}, indent=1))
    extra = []
    if roster is not None:
        missing = lms_export.write_canvas(rows, lms_export.read_roster(roster), out / "canvas.csv",
                                          [c.stem for c in course])
        extra += ["## Canvas export", "", f"`canvas.csv`: Canvas's gradebook import format, from `{roster}`.", ""]
        extra.append("Graded learners missing from the roster (in canvas.csv with empty identities): "
                     + ", ".join(missing) if missing else "Every graded learner is in the roster.")
        extra.append("")
    if submissions:
        extra += similarity.report(learners_cells(course, submissions), out) + [""]
    if isolation:
        extra += ["## Isolation", "", isolation, "", verdict_sentence(), ""]
    write_summary(rows, out, extra)
    write_feedback(rows, out)
    return rows


# -- the command ---------------------------------------------------------------------------
def default_memory_limit(jobs: int) -> int | None:
    """Bytes of memory each notebook may allocate: the machine's memory shared by ``jobs``.

    None on a machine with an NVIDIA GPU, where a limit on the address space
    could stop CUDA (a learner who takes all the memory there gets ``crashed``).
    """
    if shutil.which("nvidia-smi"):
        return None
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(2 * 2**30, total // max(1, jobs))


def grade(submissions: list[Path], out: Path, *, jobs: int | None = None, timeout: float = 300.0, force: bool = False,
          solutions: Path = SOLUTIONS, progress: bool = True, data_limit: int | None = None,
          roster: Path | None = None) -> list[dict]:
    """Grade ``submissions`` into ``out``; return every row of the gradebook.

    ``data_limit``: bytes each notebook's kernel may allocate (default :func:`default_memory_limit`).
    ``roster``: a CSV mapping learners' folders to LMS identities; then ``out/canvas.csv`` is written
    (:mod:`course_utils.lms_export`).
    """
    course = discover(solutions)
    version = grader_version(solutions)
    # Absolute: each notebook is graded from a temporary working directory.
    learners = collect_submissions([Path(p).resolve() for p in submissions], course)
    out.mkdir(parents=True, exist_ok=True)
    state = out / ".state"
    tasks = []
    for learner, files in learners.items():
        for c in course:
            if c.stem not in files:
                continue  # a single file handed in: only its notebook is graded
            path = files[c.stem]
            stored = state / _safe(learner) / f"{c.stem}.json"
            if not force and stored.exists():
                try:
                    kept = json.loads(stored.read_text())
                    if kept.get("digest") == _digest(path) and kept.get("grader") == version:
                        continue  # the same hand-in, graded by the same grader
                except ValueError:
                    pass
            tasks.append((learner, c, path))
    from tqdm import tqdm

    from . import os_sandbox

    refused = os_sandbox.unavailable()
    sandboxed = refused is None
    if refused:
        print(f"warning: {isolation_sentence(refused)}", file=sys.stderr)
    jobs = jobs or os.cpu_count() or 1
    data_limit = data_limit if data_limit is not None else default_memory_limit(jobs)
    left = {name: sum(1 for t in tasks if t[0] == name) for name in learners}
    bar = tqdm(total=sum(1 for n in left.values() if n), unit="learner", desc="grading", disable=not progress)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        # What a hand-in must never see, even inside a folder the sandbox shows (a venv beside the class):
        hidden = [Path(solutions).resolve(), out.resolve()] + [Path(p).resolve() for p in submissions]
        futures = {pool.submit(grade_one, learner, c, path, state, timeout, data_limit, version, sandboxed,
                               hidden): learner
                   for learner, c, path in tasks}
        for future in as_completed(futures):
            learner = futures[future]
            future.result()  # grade_one never raises: the grader's own failures are grader_error rows
            left[learner] -= 1
            if left[learner] == 0:
                bar.update(1)
    bar.close()
    rows = write_reports(out, course, roster=roster, submissions=learners, isolation=isolation_sentence(refused))
    ran = sum(1 for t in tasks if t[2] is not None)
    handed_in = sum(1 for files in learners.values() for c in course if files.get(c.stem) is not None)
    got = sum(r["points"] for r in rows)
    total = sum(r["max_points"] for r in rows)
    passed = sum(r["status"] == "passed" for r in rows)
    print(f"graded {ran} notebooks of {len(learners)} learners in {time.monotonic() - started:.0f} s "
          f"({handed_in - ran} already graded); {passed} of {len(rows)} exercises passed, "
          f"{_num(got)} of {_num(total)} points; wrote {out}/")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker_main(argv[1])
    parser = argparse.ArgumentParser(prog="python -m course_utils.grade", description=__doc__.split("\n\n")[0])
    parser.add_argument("submissions", nargs="+", type=Path, metavar="SUBMISSIONS",
                        help="folders <root>/<learner>/<notebook>.ipynb, or single .ipynb files")
    parser.add_argument("--out", type=Path, default=Path("gradebook"), metavar="DIR", help="where to write (default gradebook/)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N", help="notebooks graded side by side (default: the cores)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per notebook (default 300)")
    parser.add_argument("--force", action="store_true", help="grade again what is already graded")
    parser.add_argument("--memory", type=float, default=None, metavar="GB",
                        help="memory each notebook may allocate (default: the machine's memory / jobs; none on a GPU machine)")
    parser.add_argument("--roster", type=Path, default=None, metavar="CSV",
                        help="learners' folders -> LMS identities (columns folder, Student, ID, SIS User ID, SIS Login "
                             "ID, Section): also write DIR/canvas.csv for Canvas's gradebook import")
    parser.add_argument("--solutions", type=Path, default=SOLUTIONS,
                        help="the course's solution notebooks (default: solutions/ of the course's repository)")
    args = parser.parse_args(argv)
    if not list(args.solutions.glob("*.ipynb")):
        parser.error(f"no solution notebooks in {args.solutions}: run the grader from the course's repository "
                     "(pip install -e .) or pass --solutions")
    if args.roster is not None:
        from .lms_export import read_roster

        try:
            read_roster(args.roster)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    grade(args.submissions, args.out, jobs=args.jobs, timeout=args.timeout, force=args.force, solutions=args.solutions,
          data_limit=int(args.memory * 2**30) if args.memory else None, roster=args.roster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
