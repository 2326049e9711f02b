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
    python -m course_utils.build --force    # overwrite notebooks that hold outputs
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
    src = (
        "# In Colab, install the course package first (elsewhere this cell does nothing).\n"
        "import sys\n"
        "if \"google.colab\" in sys.modules:\n"
        f"    %pip install -q \"course_utils @ git+{repository_url()}\""
    )
    cell = nbformat.v4.new_code_cell(src)
    cell.metadata["tags"] = [INSTALL_TAG]
    return cell


# -- turning one cell into its student version --------------------------------
def _jit_ranges(source: str) -> list[tuple[int, int]]:
    """1-based line ranges of the ``@triton.jit`` functions in ``source``."""
    try:
        tree = ast.parse(_strip_magics(source))
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


def _strip_magics(source: str) -> str:
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
    for index, cell in enumerate(cells):
        if cell.cell_type == "code":
            cell.source = student_source(cell.source, f"{name}, cell {index}")
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
    nb.cells = [_badge_cell(name), _install_cell()] + cells
    for i, cell in enumerate(nb.cells):  # stable ids, so rebuilding changes nothing
        cell.id = f"cell-{i:03d}"
    nb.metadata.pop("widgets", None)
    return nb


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
        if current is not None and not force and _has_outputs(nbformat.reads(current, as_version=4)):
            problems.append(f"{dest.name}: holds outputs, probably someone's work; not overwritten (use --force)")
            continue
        dest.write_text(wanted)
    if check:
        for extra in sorted(set(p.name for p in notebooks.glob("*.ipynb")) - expected_names):
            problems.append(f"{extra}: has no source in solutions/")
    return problems


def execute(paths: list[Path], timeout_s: int = 600) -> None:
    """Run solution notebooks in place with nbclient, so they hold outputs."""
    from nbclient import NotebookClient

    for path in paths:
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(nb, path)
        print(f"executed {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify notebooks/ instead of writing it")
    parser.add_argument("--force", action="store_true", help="overwrite student notebooks that hold outputs")
    parser.add_argument("--solutions", type=Path, default=SOLUTIONS)
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS)
    parser.add_argument("--execute", nargs="*", type=Path, metavar="NOTEBOOK",
                        help="first run these solution notebooks in place (none named: all)")
    args = parser.parse_args(argv)
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
