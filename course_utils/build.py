"""Generate the student notebooks in ``notebooks/`` from ``solutions/``.

``solutions/`` is the single source of the course. In its code cells:

- the lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` become
  ``# YOUR CODE HERE`` plus ``raise NotImplementedError()`` at the same
  indent. Inside a ``@triton.jit`` function, which cannot raise, they become
  the ``# YOUR CODE HERE`` comment alone; the notebook's launcher calls
  :func:`course_utils.require_implemented`, which raises until the learner
  replaces that line;
- ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` blocks are removed.

Student notebooks carry no outputs. Every notebook gets an "Open in Colab"
badge and a Colab install cell, made from the repository address in
``pyproject.toml`` (the one place it is written).

Usage::

    python -m course_utils.build            # write notebooks/
    python -m course_utils.build --check    # fail if notebooks/ is stale or leaks solutions
    python -m course_utils.build --force    # overwrite notebooks that hold work (outputs, answers)
    python -m course_utils.build --points   # give every grader cell of solutions/ its points (idempotent)

Points: each grader cell (a ``check_*(fn)`` call) of ``solutions/`` declares
its points once, in ``metadata["course"]["points"]`` (``--points`` fills in
the points of its exercise in ``course_utils.grading.exercises``, never changing a value already there; 1
when absent). The student notebook shows them as a first line ``# Graded: N
points`` of the grader cell and carries nbgrader metadata (grade ids, points,
locked grader cells), for instructors who use nbgrader.

The build never overwrites a student notebook that looks like someone's work:
one that holds outputs, or whose exercise cells differ from the stubs it
would write. Learners work in ``my-work/`` (``make lab`` copies it there).
"""

from __future__ import annotations

import argparse
import ast
import copy
import re
import sys
from pathlib import Path

import nbformat

from . import STUB_LINE

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
NOTEBOOKS = ROOT / "notebooks"

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
BEGIN_HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"
MARKERS = (BEGIN_SOLUTION, END_SOLUTION, BEGIN_HIDDEN, END_HIDDEN)

# Cells the build owns: it (re)writes them at the top of every notebook.
BADGE_TAG = "colab-badge"
INSTALL_TAG = "colab-install"


class BuildError(Exception):
    """A solution notebook cannot be turned into a student notebook."""


# -- the repository address, read from pyproject.toml -------------------------
def repository_url() -> str:
    """The repository address from ``[project.urls] Repository``."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["urls"]["Repository"].rstrip("/")


def colab_url(notebook_name: str) -> str:
    """The "Open in Colab" address of a student notebook."""
    path = repository_url().split("github.com/", 1)[1]
    return f"https://colab.research.google.com/github/{path}/blob/main/notebooks/{notebook_name}"


def _badge_cell(name: str):
    src = f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(name)})"
    cell = nbformat.v4.new_markdown_cell(src)
    cell.metadata["tags"] = [BADGE_TAG]
    return cell


def _install_cell():
    # course_utils/colab_install.py, verbatim, run in a private namespace (it cannot be imported:
    # course_utils is what it installs). The cell shows only its title: in Colab a form cell, in
    # JupyterLab a collapsed source.
    helper = Path(__file__).with_name("colab_install.py").read_text().strip("\n")
    if "'''" in helper or helper.endswith("\\"):
        raise BuildError("course_utils/colab_install.py cannot go into a r'''...''' string")
    src = (
        "# @title Run this cell first: it installs the course package in Colab (elsewhere it only checks)\n"
        "_course_install = {\"__name__\": \"course_install\"}\n"
        f"exec(r'''\n{helper}\n''', _course_install)\n"
        f"_course_install[\"install\"]({repository_url()!r})\n"
        "del _course_install"
    )
    cell = nbformat.v4.new_code_cell(src)
    cell.metadata["tags"] = [INSTALL_TAG]
    cell.metadata["cellView"] = "form"
    cell.metadata["jupyter"] = {"source_hidden": True}
    return cell


# -- turning one cell into its student version --------------------------------
def _jit_ranges(source: str) -> list[tuple[int, int]]:
    """1-based line ranges of the ``@triton.jit`` functions in ``source``."""
    try:
        tree = ast.parse(strip_magics(source))
    except SyntaxError:
        return []
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                name = ast.unparse(target)
                if name in ("triton.jit", "jit"):
                    ranges.append((node.lineno, node.end_lineno))
    return ranges


def strip_magics(source: str) -> str:
    # IPython magics (%pip, !ls) are not Python; blank them so ast can parse.
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))


def student_source(source: str, where: str) -> str:
    """The student version of one code cell's source.

    ``where`` names the notebook and cell in error messages.
    """
    lines = source.split("\n")
    jit = _jit_ranges(source)
    out: list[str] = []
    state = None  # None, "solution" or "hidden"
    start = 0
    for number, line in enumerate(lines, start=1):
        marker = line.strip()
        if marker in (BEGIN_SOLUTION, BEGIN_HIDDEN):
            if state is not None:
                raise BuildError(f"{where}: line {number}: '{marker}' inside an open block (from line {start}); markers cannot nest.")
            state = "solution" if marker == BEGIN_SOLUTION else "hidden"
            start = number
            if state == "solution":
                indent = line[: len(line) - len(line.lstrip())]
                out.append(indent + STUB_LINE)
                if not any(a <= number <= b for a, b in jit):
                    out.append(indent + "raise NotImplementedError()")
            continue
        if marker in (END_SOLUTION, END_HIDDEN):
            expected = END_SOLUTION if state == "solution" else END_HIDDEN
            if state is None or marker != expected:
                raise BuildError(f"{where}: line {number}: '{marker}' without a matching BEGIN.")
            state = None
            continue
        if state is None:
            out.append(line)
    if state is not None:
        raise BuildError(f"{where}: the block opened at line {start} is never closed.")
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def student_notebook(nb, name: str):
    """The student version of a whole (solution) notebook."""
    nb = copy.deepcopy(nb)
    cells = [c for c in nb.cells if not set(c.metadata.get("tags", [])) & {BADGE_TAG, INSTALL_TAG}]
    stem = name.rsplit(".", 1)[0]
    graded = [_after_solution(cells, i) for i in range(len(cells))]
    grade_ids: set[str] = set()
    for index, cell in enumerate(cells):
        if cell.cell_type == "code":
            original = cell.source
            cell.source = student_source(cell.source, f"{name}, cell {index}")
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
            checks = grader_checks(original) if graded[index] else []
            if checks:
                points = _num(cell.metadata.get("course", {}).get("points", 1))
                cell.source = f"# Graded: {points} point{'s' if points != 1 else ''}.\n" + cell.source
                grade_id = f"{stem}-{checks[0]}" + (f"-{index}" if f"{stem}-{checks[0]}" in grade_ids else "")
                grade_ids.add(grade_id)
                cell.metadata["nbgrader"] = {"grade": True, "solution": False, "locked": True, "points": points,
                                             "grade_id": grade_id, "schema_version": 3}
            elif BEGIN_SOLUTION in original:
                cell.metadata["nbgrader"] = {"grade": False, "solution": True, "locked": False,
                                             "grade_id": f"{stem}-answer-{index}", "schema_version": 3}
    nb.cells = [_badge_cell(name), _install_cell()] + cells
    for i, cell in enumerate(nb.cells):  # stable ids, so rebuilding changes nothing
        cell.id = f"cell-{i:03d}"
    nb.metadata.pop("widgets", None)
    return nb


def _num(x):
    return int(x) if float(x).is_integer() else x


def exercise_names() -> set[str]:
    """The public checks of the exercises (:data:`course_utils.grading.exercises.EXERCISES`)."""
    from course_utils.grading.exercises import EXERCISES

    return {exercise.name for exercise in EXERCISES}


def is_exercise_call(node: ast.stmt, checks) -> bool:
    """Whether a top-level statement is a bare call to one of ``checks`` (``check_flash_forward(fn)``).

    Other calls (``check_on_cpu``, hidden tests) are not exercises.
    """
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id in checks)


def exercise_calls(source: str, checks=None) -> list[ast.Call] | None:
    """A cell's top-level calls to the exercises' checks, or None if it makes none (or does not parse).

    ``checks``: the exercises' names (default :func:`exercise_names`; a process that should not
    import the graders passes them).
    """
    try:
        tree = ast.parse(strip_magics(source))
    except SyntaxError:
        return None
    checks = exercise_names() if checks is None else checks
    return [node.value for node in tree.body if is_exercise_call(node, checks)] or None


def grader_checks(source: str) -> list[str]:
    """Names of the exercises' checks a grader cell calls at top level ([] if not a grader cell)."""
    return [call.func.id for call in exercise_calls(source) or []]


def _after_solution(cells, index) -> bool:
    # Grader cells come after an exercise; a lesson without exercises (00) only demonstrates checks.
    return any(c.cell_type == "code" and BEGIN_SOLUTION in c.source for c in cells[:index])


def add_points(solutions: Path = SOLUTIONS) -> list[str]:
    """Give every grader cell of ``solutions/`` a ``metadata["course"]["points"]``; idempotent.

    Values already there are kept; a new grader cell gets its exercise's points from
    :data:`course_utils.grading.exercises.EXERCISES`.
    Returns the notebooks it changed (it rewrites only those).
    """
    from .grading.exercises import by_name

    changed = []
    for path in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        touched = False
        for index, cell in enumerate(nb.cells):
            checks = grader_checks(cell.source) if cell.cell_type == "code" and _after_solution(nb.cells, index) else []
            if checks and "points" not in cell.metadata.get("course", {}):
                cell.metadata.setdefault("course", {})["points"] = by_name(checks[0]).points
                touched = True
        if touched:
            nbformat.write(nb, path)
            changed.append(path.name)
    return changed


def defined_names(source: str) -> set[str]:
    """The functions and classes a cell defines at top level (empty if it does not parse)."""
    try:
        tree = ast.parse(strip_magics(source))
    except SyntaxError:
        return set()
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}


def _changed_exercises(current, wanted) -> list[str]:
    """Exercise cells of ``current`` that differ from the stubs of ``wanted`` (someone's answers)."""
    by_id = {c.get("id"): c for c in current.cells if c.cell_type == "code"}
    changed = []
    for cell in wanted.cells:
        if cell.cell_type != "code" or STUB_LINE not in cell.source:
            continue
        if any(c.cell_type == "code" and c.source == cell.source for c in current.cells):
            continue  # the stub is there, unchanged
        names = defined_names(cell.source)
        mine = by_id.get(cell.id)
        if mine is None or (names and not defined_names(mine.source) & names):  # cells moved: match by name
            mine = next((c for c in current.cells if c.cell_type == "code" and names and defined_names(c.source) & names), None)
        if mine is not None:
            changed.append(", ".join(sorted(names)) or cell.id)
    return changed


def _dump(nb) -> str:
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def _has_outputs(nb) -> bool:
    return any(c.cell_type == "code" and c.get("outputs") for c in nb.cells)


def leaks(nb) -> list[str]:
    """Ways a student notebook gives away solutions (markers, outputs)."""
    found = []
    for i, cell in enumerate(nb.cells):
        for marker in MARKERS:
            if marker in cell.source:
                found.append(f"cell {i} holds '{marker}'")
        if cell.cell_type == "code" and cell.get("outputs"):
            found.append(f"cell {i} holds outputs")
    return found


def build(solutions: Path = SOLUTIONS, notebooks: Path = NOTEBOOKS, *, check: bool = False, force: bool = False) -> list[str]:
    """Generate (or, with ``check``, verify) every student notebook.

    Returns a list of problems: in check mode, stale, missing, extra or
    leaking notebooks; otherwise the notebooks it refused to overwrite.
    """
    problems: list[str] = []
    sources = sorted(solutions.glob("*.ipynb"))
    if not sources:
        raise BuildError(f"no solution notebooks in {solutions}")
    notebooks.mkdir(exist_ok=True)
    expected_names = set()
    for src in sources:
        expected_names.add(src.name)
        wanted = _dump(student_notebook(nbformat.read(src, as_version=4), src.name))
        dest = notebooks / src.name
        current = dest.read_text() if dest.exists() else None
        if check:
            if current is None:
                problems.append(f"{dest.name}: missing; run `python -m course_utils.build`")
                continue
            problems += [f"{dest.name}: {leak}" for leak in leaks(nbformat.reads(current, as_version=4))]
            if current != wanted:
                problems.append(f"{dest.name}: stale (differs from solutions/{src.name}); run `python -m course_utils.build`")
            continue
        if current == wanted:
            continue
        if current is not None and not force:
            current_nb = nbformat.reads(current, as_version=4)
            if _has_outputs(current_nb):
                problems.append(f"{dest.name}: holds outputs, probably someone's work; not overwritten (use --force)")
                continue
            answered = _changed_exercises(current_nb, nbformat.reads(wanted, as_version=4))
            if answered:
                problems.append(
                    f"{dest.name}: its exercise cells ({'; '.join(answered)}) differ from the stubs, probably someone's "
                    "answers; not overwritten. Learners work in my-work/ (`make lab` copies the notebooks there); "
                    "use --force to overwrite"
                )
                continue
        dest.write_text(wanted)
    if check:
        for extra in sorted(set(p.name for p in notebooks.glob("*.ipynb")) - expected_names):
            problems.append(f"{extra}: has no source in solutions/")
    return problems


POLL_SLICE_S = 1.0


def sliced_wait(get_msg, slice_s: float = POLL_SLICE_S):
    """Wrap an async ``get_msg(timeout=...)`` so that it waits in slices of ``slice_s`` seconds.

    Same result and same total timeout (``queue.Empty`` when it runs out), but a
    message whose wake-up was lost is picked up at the next slice.
    """
    import queue
    import time

    async def wait(timeout=None, **kwargs):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = slice_s if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await get_msg(timeout=min(slice_s, left), **kwargs)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return wait


def notebook_client_class():
    """nbclient's ``NotebookClient``, waiting for each execute reply in slices of a second.

    nbclient waits for a cell's execute reply with one ``get_msg(timeout)``; after
    a cell that shows an ipywidget the wake-up for that reply is sometimes lost
    (nbclient issue #312, seen here with lesson 10's ring widget), and the reply
    is only read when the whole cell timeout runs out (300 s for a 1 s cell).
    Asking again every second finds it at once; the cell timeout is unchanged.
    """
    from nbclient import NotebookClient

    class SlicedWaitClient(NotebookClient):
        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            kc.shell_channel.get_msg = sliced_wait(kc.shell_channel.get_msg)
            return kc

    return SlicedWaitClient


def notebook_client(nb, **kwargs):
    """A :func:`notebook_client_class` client for ``nb`` (keyword arguments as nbclient's)."""
    return notebook_client_class()(nb, **kwargs)


def execute(paths: list[Path], timeout_s: int = 600) -> None:
    """Run solution notebooks in place with nbclient, so they hold outputs."""
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        notebook_client(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(nb, path)
        print(f"executed {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify notebooks/ instead of writing it")
    parser.add_argument("--force", action="store_true", help="overwrite student notebooks that hold work (outputs, answers)")
    parser.add_argument("--points", action="store_true",
                        help="first give each grader cell of solutions/ its points (metadata course.points; keeps existing values)")
    parser.add_argument("--solutions", type=Path, default=SOLUTIONS)
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS)
    parser.add_argument("--execute", nargs="*", type=Path, metavar="NOTEBOOK",
                        help="first run these solution notebooks in place (none named: all)")
    args = parser.parse_args(argv)
    if args.points:
        for name in add_points(args.solutions):
            print(f"points added to {args.solutions / name}")
    if args.execute is not None:
        execute(args.execute or sorted(args.solutions.glob("*.ipynb")))
    try:
        problems = build(args.solutions, args.notebooks, check=args.check, force=args.force)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print("notebooks/ is up to date" if args.check else f"wrote student notebooks to {args.notebooks}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
