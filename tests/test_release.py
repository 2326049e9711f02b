"""The release for an LMS (python -m course_utils.release) and the notebooks' Colab install cell.

- the install helper (course_utils/colab_install.py), in a simulated Colab: a fake
  ``google.colab`` module, wheels in temporary folders, a fake pip;
- the release folder, its zip and its wheel;
- the released wheel installed into a fresh venv, lesson 01 run under nbval from
  the released folder with that venv's Python.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import nbformat
import pytest

from course_utils import build, colab_install, release

ROOT = Path(__file__).resolve().parent.parent
REPO = "https://example.org/course"


# -- the install helper, in a simulated Colab ------------------------------------------
@pytest.fixture
def colab(monkeypatch):
    """A Colab runtime without course_utils: a fake google.colab module; pip and the probe recorded."""
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(colab_install, "_installed", lambda: False)
    calls = types.SimpleNamespace(pip=[], probed=[])

    def pip(*args):
        calls.pip.append(args)

    def reachable(url):
        calls.probed.append(url)
        return calls.reachable

    calls.reachable = False
    calls.install = lambda dirs: colab_install.install(REPO, search_dirs=[str(d) for d in dirs], pip=pip, reachable=reachable)
    return calls


def _wheel(folder: Path, version="0.1.0") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"course_utils-{version}-py3-none-any.whl"
    path.write_bytes(b"")
    return path


def test_colab_installs_the_wheel_beside_the_notebook(colab, tmp_path):
    content, drive = tmp_path / "content", tmp_path / "drive" / "MyDrive"
    wheel = _wheel(content)
    drive.mkdir(parents=True)
    assert colab.install([content, drive]) == ("wheel", str(wheel))
    (args,) = colab.pip
    assert args[0] == str(wheel)
    # Colab's torch and triton are named at their installed versions: pip keeps them.
    import importlib.metadata

    assert f"torch=={importlib.metadata.version('torch')}" in args[1:]
    assert not colab.probed  # a wheel wins over the repository


def test_colab_installs_a_wheel_found_in_a_mounted_drive_folder(colab, tmp_path):
    content, drive = tmp_path / "content", tmp_path / "drive" / "MyDrive"
    content.mkdir()
    wheel = _wheel(drive / "flash-attention")  # one folder below MyDrive
    assert colab.install([content, drive]) == ("wheel", str(wheel))
    assert colab.pip[0][0] == str(wheel)


def test_the_newest_wheel_wins(colab, tmp_path):
    content, drive = tmp_path / "content", tmp_path / "drive" / "MyDrive"
    _wheel(content, "0.9.0")
    newest = _wheel(drive, "0.10.0")
    assert colab.install([content, drive]) == ("wheel", str(newest))


def test_colab_without_a_wheel_installs_from_a_reachable_repository(colab, tmp_path):
    colab.reachable = True
    assert colab.install([tmp_path]) == ("git", REPO)
    assert colab.probed == [REPO]
    assert colab.pip[0][0] == f"course_utils @ git+{REPO}"


def test_colab_with_neither_says_what_to_upload_and_installs_nothing(colab, tmp_path, capsys):
    what, sentence = colab.install([tmp_path])
    assert what == "missing" and not colab.pip
    out = capsys.readouterr().out.strip()
    assert out == sentence and out.count(". ") == 0 and out.endswith(".")  # one sentence
    assert "course_utils-" in out and ".whl" in out and "file panel" in out and REPO in out


def test_outside_colab_with_course_utils_importable_does_nothing(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    _wheel(tmp_path)
    called = []
    what = colab_install.install(REPO, search_dirs=[str(tmp_path)], pip=lambda *a: called.append(a),
                                 reachable=lambda url: called.append(url))
    assert what == ("installed", None) and not called


def test_outside_colab_without_course_utils_only_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(colab_install, "_installed", lambda: False)
    _wheel(tmp_path)
    called = []
    what, sentence = colab_install.install(REPO, search_dirs=[str(tmp_path)], pip=lambda *a: called.append(a))
    assert what == "missing" and "pip install course_utils-" in sentence and not called


def test_an_address_that_does_not_answer_is_unreachable():
    with socket.socket() as s:  # a free local port, closed again: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert colab_install._reachable(f"http://127.0.0.1:{port}/", timeout=2) is False
    assert time.monotonic() - start < 3


def test_the_install_helper_is_stdlib_only():
    # It runs in the install cell, before course_utils (or anything but Python) is there.
    import ast

    for node in ast.walk(ast.parse((ROOT / "course_utils" / "colab_install.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module.split(".")[0] in sys.stdlib_module_names, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] in sys.stdlib_module_names, alias.name


def test_every_install_cell_carries_the_helper_and_runs_in_a_private_namespace(capsys):
    helper = (ROOT / "course_utils" / "colab_install.py").read_text().strip("\n")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cell = nbformat.read(path, as_version=4).cells[1]
        assert build.INSTALL_TAG in cell.metadata["tags"], path.name
        assert helper in cell.source and repr(build.repository_url()) in cell.source, path.name
    namespace = {}
    exec(cell.source, namespace)  # here course_utils is importable: the cell only says so
    assert set(namespace) == {"__builtins__"}  # nothing left in the learner's namespace
    assert capsys.readouterr().out == "course_utils is installed: nothing to do.\n"


# -- the release ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("release") / "class-release"
    assert release.main([str(out)]) == 0
    return out


def test_release_writes_the_folder_the_zip_the_wheel_and_the_readme(released):
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    (wheel,) = released.glob("course_utils-*-py3-none-any.whl")
    assert sorted(p.name for p in released.iterdir()) == sorted(notebooks + [wheel.name, "README.md"])
    for name in notebooks:
        assert (released / name).read_bytes() == (ROOT / "notebooks" / name).read_bytes()
    readme = (released / "README.md").read_text()
    assert wheel.name in readme and "file panel" in readme and f"pip install {wheel.name}" in readme
    archive = released.with_name("class-release.zip")
    with zipfile.ZipFile(archive) as z:
        assert sorted(z.namelist()) == sorted(f"class-release/{n}" for n in notebooks + [wheel.name, "README.md"])
    with zipfile.ZipFile(wheel) as z:
        inside = set(z.namelist())
    for data in ("course_utils/data/forward_bench.json", "course_utils/exhibits/causal_forward_kernel.py",
                 "course_utils/colab_install.py", "course_utils/grading/exercises.py"):
        assert data in inside


def test_release_replaces_an_old_release_but_refuses_a_foreign_folder(released, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(released, old)
    release._prepare(old)
    assert old.is_dir() and not any(old.iterdir())
    (old / "notes.txt").write_text("mine")
    assert release.main([str(old)]) == 1
    assert "notes.txt" in capsys.readouterr().err and (old / "notes.txt").read_text() == "mine"


def test_the_released_wheel_runs_lesson_01_from_the_released_folder_in_a_fresh_venv(released, tmp_path):
    """A fresh venv, the released wheel alone, lesson 01 under nbval with that venv's Python.

    torch, triton, nbval and the rest come from this environment, so nothing is
    downloaded: ``--system-site-packages`` gives the base interpreter's packages,
    and when this interpreter is itself a venv (``make test``'s .venv) a .pth file
    adds its site-packages (whose own .pth files, the editable install of course_utils
    among them, are not run). The wheel is installed before that, with ``--no-index``.
    """
    import site

    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    (wheel,) = released.glob("course_utils-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, env=env)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, env=env).stdout.strip()
    # PYTHONPATH's folders too (the GPU machine brings nbval and ipykernel there), but not one that
    # holds a course_utils (the repository itself): course_utils must come from the wheel.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).is_dir() and not (Path(p) / "course_utils").exists()]
    Path(purelib, "_course_test_env.pth").write_text("\n".join(site.getsitepackages() + extra) + "\n")

    def nbval(folder, notebook, *flags):
        return subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
                               *flags, notebook], cwd=folder, env=env, capture_output=True, text=True, timeout=300)

    where = subprocess.run([str(python), "-c", "import course_utils; print(course_utils.__file__)"], cwd=released,
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(purelib), where

    # The student notebook, as released: every cell before the first exercise runs (the install
    # cell, the imports); the first error is the stub's NotImplementedError, as in test_student_notebooks.py.
    run = nbval(released, "01_naive_attention.ipynb", "-x")
    out = run.stdout + run.stderr
    summary = re.search(r"(\d+) failed, (\d+) passed", out)
    assert run.returncode == 1 and summary and summary.group(1) == "1", out[-3000:]
    assert int(summary.group(2)) >= 2 and "NotImplementedError" in out, out[-3000:]

    # The same lesson answered (solutions/01 with the released folder's files): it passes to the end,
    # with course_utils imported from the venv (the last cell checks where from, in the kernel).
    answered = tmp_path / "answered"
    shutil.copytree(released, answered)
    nb = nbformat.read(ROOT / "solutions" / "01_naive_attention.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import course_utils\nassert course_utils.__file__.startswith({purelib!r}), course_utils.__file__"))
    nbformat.write(nb, answered / "01_naive_attention.ipynb")
    run = nbval(answered, "01_naive_attention.ipynb")
    out = run.stdout + run.stderr
    assert run.returncode == 0 and re.search(r"\d+ passed", out) and "failed" not in out, out[-3000:]
    assert time.monotonic() - start < 120
