"""The package's layout: imports run downward, and the exercises are declared in one table.

Read from the source with ``ast`` (nothing is imported to find the imports), so a
move that makes a module reach back up fails here, before it becomes a circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "course_utils"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


_MODULES = {_module_name(p) for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The course_utils modules ``path`` imports (absolute names; ``from x import y`` gives x and x.y)."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # also imports under a top-level if/try (e.g. a guarded import)
        nodes = [n for stmt in tree.body for n in ast.walk(stmt)
                 if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from . import x` imports the submodule x; `from .m import y` imports m.
            subs = {f"{module}.{a.name}" for a in node.names} & _MODULES
            found |= subs
            if len(subs) < len(node.names):
                found.add(module)
    return found & _MODULES


def _files(under: str = "") -> list[Path]:
    return sorted((PACKAGE / under).rglob("*.py"))


def test_graders_do_not_import_the_batch_grader():
    for path in _files("grading"):
        bad = _imports(path, top_level_only=False) & {"course_utils.grade_harness", "course_utils.grade",
                                                   "course_utils.grade_checks"}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_distributed_does_not_import_the_graders():
    for path in _files("distributed"):
        bad = {m for m in _imports(path, top_level_only=False) if m.startswith("course_utils.grading")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_backward_kernels_do_not_call_back_up_to_the_package_face():
    # Submodules (course_utils.kernels.forward) are fine; the package's own __init__ is not.
    path = PACKAGE / "kernels" / "backward.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            face = (node.level == 1 and node.module is None) or node.module == "course_utils.kernels" or (
                node.level == 2 and node.module is None and any(a.name == "kernels" for a in node.names))
            assert not face, f"kernels/backward.py line {node.lineno} imports the package face course_utils.kernels"
        elif isinstance(node, ast.Import):
            assert all(a.name != "course_utils.kernels" for a in node.names), f"line {node.lineno}"


def test_the_guard_is_stdlib_only():
    # It runs in the learner's kernel before course_utils is imported.
    tree = ast.parse((PACKAGE / "guard.py").read_text())
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or "."] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names or top == "__future__", f"guard.py imports {name}"


def test_imports_have_no_circle():
    # Function-level imports count too: a lazy import that reaches back up is still a circle.
    graph = {_module_name(p): _imports(p, top_level_only=False) for p in _files()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module):
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                circle = path[path.index(dep):] + [dep]
                pytest.fail("import circle: " + " -> ".join(circle))
            if state.get(dep) is None:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module)


# -- the exercises ----------------------------------------------------------------
def test_every_public_check_comes_from_the_table():
    import course_utils.grading as grading
    from course_utils.grading import EXERCISES

    names = [e.name for e in EXERCISES]
    assert len(names) == len(set(names))
    public = {n for n in dir(grading) if n.startswith("check_")}
    assert public == set(names) | {"check_on_cpu"}
    for exercise in EXERCISES:
        assert getattr(grading, exercise.name) is exercise.check
        assert exercise.check.exercise is exercise and exercise.check.__name__ == exercise.name
        assert (exercise.timeout_s is not None) == exercise.isolated


def test_no_check_is_declared_outside_the_table():
    for path in _files("grading"):
        if path.name == "exercises.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert not node.name.startswith("check_") or node.name == "check_on_cpu", (
                    f"{path.relative_to(ROOT)}:{node.lineno} defines {node.name}: declare it in grading/exercises.py")
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assert not target.id.startswith("check_"), f"{path.relative_to(ROOT)}:{node.lineno}"


def test_the_solutions_grade_every_exercise_with_its_declared_points():
    from course_utils.build import _after_solution, grader_checks
    from course_utils.grading import EXERCISES

    seen = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and _after_solution(nb.cells, index):
                for name in grader_checks(cell.source):
                    seen.setdefault(name, []).append((path.stem, cell.metadata.get("course", {}).get("points")))
    for exercise in EXERCISES:
        cells = seen.get(exercise.name, [])
        assert any(lesson == exercise.lesson for lesson, _ in cells), f"{exercise.name}: no grader cell in {exercise.lesson}"
        for lesson, points in cells:
            assert points == exercise.points, f"{exercise.name} in {lesson}: {points} points, the table says {exercise.points}"


def test_a_check_on_cpu_call_is_not_an_exercise():
    from course_utils.build import grader_checks
    from course_utils.grade import check_calls

    source = "check_on_cpu(check_flash_gqa, my_function)\ncheck_flash_gqa(my_function)\nassert True"
    assert grader_checks(source) == ["check_flash_gqa"]
    assert [c.func.id for c in check_calls(source)] == ["check_flash_gqa"]
    assert check_calls("check_on_cpu(check_flash_gqa, f)") is None


def test_a_public_check_keeps_its_signature_and_refuses_unknown_arguments():
    import inspect

    from course_utils.grading import GradingError, check_flash_forward, check_softmax

    params = inspect.signature(check_flash_forward).parameters
    assert list(params) == ["fn", "seed", "isolate", "timeout_s"] and params["timeout_s"].default == 240.0
    assert list(inspect.signature(check_softmax).parameters) == ["fn", "seed", "time_limit_s"]
    with pytest.raises(TypeError):
        check_softmax(lambda x: x, colour="red")
    with pytest.raises(GradingError, match="check_flash_forward expects a function"):
        check_flash_forward(3)  # refused before any process starts
