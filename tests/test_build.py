"""The build tool: solution markers, stub generation, stale check, refusals."""

from pathlib import Path

import nbformat
import pytest

from course_utils import build
from course_utils.build import BuildError, STUB_LINE, student_source


def test_solution_block_becomes_stub_at_same_indent():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n"
    assert student_source(src, "nb") == f"def f(x):\n    {STUB_LINE}\n    raise NotImplementedError()"


def test_hidden_tests_are_removed():
    src = "check(f)\n### BEGIN HIDDEN TESTS\nassert f(1) == 2\n### END HIDDEN TESTS\nprint('ok')"
    out = student_source(src, "nb")
    assert "assert f(1)" not in out and "HIDDEN" not in out
    assert out == "check(f)\nprint('ok')"


def test_solution_inside_triton_jit_leaves_only_a_comment():
    src = (
        "import triton\n"
        "@triton.jit\n"
        "def kernel(x_ptr, N: tl.constexpr):\n"
        "    offs = tl.arange(0, N)\n"
        "    ### BEGIN SOLUTION\n"
        "    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * 2)\n"
        "    ### END SOLUTION\n"
        "\n"
        "def launch(x):\n"
        "    ### BEGIN SOLUTION\n"
        "    kernel[(1,)](x, N=8)\n"
        "    ### END SOLUTION\n"
    )
    out = student_source(src, "nb").split("\n")
    stub = out.index(f"    {STUB_LINE}")
    assert "raise" not in out[stub + 1]  # a jit function cannot raise
    assert out[-1] == "    raise NotImplementedError()"  # the launcher can
    assert not any("tl.store" in line for line in out)


@pytest.mark.parametrize(
    "src, words",
    [
        ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n### END SOLUTION\n", "without a matching BEGIN"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\nx\n### END SOLUTION\n### END SOLUTION", "cannot nest"),
        ("### BEGIN HIDDEN TESTS\nx\n### END SOLUTION\n", "without a matching BEGIN"),
    ],
)
def test_bad_markers_name_the_notebook_and_cell(src, words):
    with pytest.raises(BuildError) as err:
        student_source(src, "01_x.ipynb, cell 4")
    assert "01_x.ipynb, cell 4" in str(err.value) and words in str(err.value)


def _solution(tmp_path: Path) -> Path:
    sol = tmp_path / "solutions"
    sol.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Lesson"),
        nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION"),
    ]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="secret output")]
    nbformat.write(nb, sol / "01_x.ipynb")
    return sol


def test_build_writes_clean_notebooks_and_check_passes(tmp_path):
    sol = _solution(tmp_path)
    out = tmp_path / "notebooks"
    assert build.build(sol, out) == []
    nb = nbformat.read(out / "01_x.ipynb", as_version=4)
    text = (out / "01_x.ipynb").read_text()
    assert "return 42" not in text and "secret output" not in text
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    assert "colab.research.google.com" in nb.cells[0].source  # badge first
    assert "google.colab" in nb.cells[1].source  # then the Colab install cell
    assert build.build(sol, out, check=True) == []
    # Rebuilding changes nothing.
    before = text
    build.build(sol, out)
    assert (out / "01_x.ipynb").read_text() == before


def test_check_reports_stale_missing_extra_and_leaks(tmp_path):
    sol = _solution(tmp_path)
    out = tmp_path / "notebooks"
    assert any("missing" in p for p in build.build(sol, out, check=True))
    build.build(sol, out)
    (out / "99_orphan.ipynb").write_text((out / "01_x.ipynb").read_text())
    nb = nbformat.read(sol / "01_x.ipynb", as_version=4)
    nb.cells[1].source = nb.cells[1].source.replace("42", "43")  # inside the solution: no change
    nbformat.write(nb, sol / "01_x.ipynb")
    assert not any("stale" in p for p in build.build(sol, out, check=True))
    nb.cells[0].source = "# Lesson, revised"
    nbformat.write(nb, sol / "01_x.ipynb")
    problems = build.build(sol, out, check=True)
    assert any("01_x.ipynb: stale" in p for p in problems)
    assert any("99_orphan.ipynb" in p for p in problems)
    leaky = nbformat.read(out / "01_x.ipynb", as_version=4)
    leaky.cells[3].source = "### BEGIN SOLUTION\nreturn 42\n### END SOLUTION"
    nbformat.write(leaky, out / "01_x.ipynb")
    assert any("### BEGIN SOLUTION" in p for p in build.build(sol, out, check=True))


def test_refuses_to_overwrite_a_notebook_with_outputs_unless_forced(tmp_path):
    sol = _solution(tmp_path)
    out = tmp_path / "notebooks"
    build.build(sol, out)
    work = nbformat.read(out / "01_x.ipynb", as_version=4)
    work.cells[3].outputs = [nbformat.v4.new_output("stream", text="my work")]
    nbformat.write(work, out / "01_x.ipynb")
    nb = nbformat.read(sol / "01_x.ipynb", as_version=4)
    nb.cells[0].source = "# Lesson, revised"
    nbformat.write(nb, sol / "01_x.ipynb")
    problems = build.build(sol, out)
    assert problems and "not overwritten" in problems[0]
    assert "my work" in (out / "01_x.ipynb").read_text()
    assert build.build(sol, out, force=True) == []
    assert "my work" not in (out / "01_x.ipynb").read_text()


def test_cli_check_exit_codes(tmp_path, capsys):
    sol = _solution(tmp_path)
    out = tmp_path / "notebooks"
    assert build.main(["--solutions", str(sol), "--notebooks", str(out), "--check"]) == 1
    assert build.main(["--solutions", str(sol), "--notebooks", str(out)]) == 0
    assert build.main(["--solutions", str(sol), "--notebooks", str(out), "--check"]) == 0
    bad = nbformat.read(sol / "01_x.ipynb", as_version=4)
    bad.cells[1].source = "### BEGIN SOLUTION\nx = 1"
    nbformat.write(bad, sol / "01_x.ipynb")
    assert build.main(["--solutions", str(sol), "--notebooks", str(out)]) == 2
    assert "01_x.ipynb, cell 1" in capsys.readouterr().err


def test_repository_notebooks_are_in_sync_with_solutions():
    """CI's sync check: notebooks/ is exactly what the build makes from solutions/."""
    assert build.build(check=True) == []


def test_require_implemented_raises_for_stubbed_kernels():
    import course_utils

    class FakeKernel:
        __name__ = "fake_kernel"
        src = f"def fake_kernel(x):\n    {STUB_LINE}\n"

    with pytest.raises(NotImplementedError, match="fake_kernel"):
        course_utils.require_implemented(FakeKernel())
    FakeKernel.src = "def fake_kernel(x):\n    return\n"
    course_utils.require_implemented(FakeKernel())


def test_sliced_wait_finds_a_message_whose_wake_up_was_lost():
    # nbclient issue #312: a reply already queued, but the first wait only returns at its timeout.
    import asyncio
    import queue
    import time

    from course_utils.build import sliced_wait

    calls = []

    async def get_msg(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:  # the lost wake-up: sleeps through its whole timeout
            await asyncio.sleep(timeout)
            raise queue.Empty
        return {"msg": "reply"}

    start = time.monotonic()
    assert asyncio.run(sliced_wait(get_msg, slice_s=0.05)(timeout=300)) == {"msg": "reply"}
    assert time.monotonic() - start < 5 and calls[0] == 0.05

    async def never(timeout=None):
        await asyncio.sleep(timeout)
        raise queue.Empty

    with pytest.raises(queue.Empty):  # the total timeout still holds
        asyncio.run(sliced_wait(never, slice_s=0.05)(timeout=0.2))
