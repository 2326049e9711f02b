"""Hand out the course without a public repository: a folder and a zip for an LMS.

Usage::

    python -m course_utils.release OUT/      # or: make release RELEASE_DIR=OUT/

writes ``OUT/`` and, beside it, ``OUT.zip`` (the same files under a folder named
like ``OUT``):

- the student notebooks of ``notebooks/`` (which must be in sync with
  ``solutions/``: the build's check runs first; ``make notebooks`` fixes it);
- ``course_utils-<version>-py3-none-any.whl``, the course package with its data
  (``course_utils/data/``, ``course_utils/exhibits/``), built from a clean copy
  of the sources;
- ``README.md``: what a learner does with them (Colab: upload the wheel beside
  the notebook, the install cell finds it; locally: ``pip install`` it).

``OUT/`` may exist only if it is empty or holds a previous release: its old
notebooks, wheels and README are replaced, anything else makes the release stop.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import build

ROOT = build.ROOT
# What a release writes in OUT/ (and so what a new release may replace there).
RELEASED = ("*.ipynb", "course_utils-*.whl", "README.md")


class ReleaseError(Exception):
    """The release cannot be made (stale notebooks, a foreign OUT/, a failed wheel build)."""


def _prepare(out: Path) -> None:
    if out.exists():
        foreign = sorted(p.name for p in out.iterdir() if not any(p.is_file() and p.match(g) for g in RELEASED))
        if foreign:
            raise ReleaseError(f"{out} holds files a release does not write ({', '.join(foreign[:5])}); "
                               "choose an empty or new folder")
        for old in out.iterdir():
            old.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _setuptools_here() -> bool:
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77  # pyproject.toml's [build-system] requires


def build_wheel(out: Path) -> Path:
    """``course_utils-*.whl`` in ``out``, built from a copy of the package (no stale build/ files)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "course_utils", src / "course_utils",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy2(ROOT / name, src / name)
        # With setuptools here (>= 77), build offline; otherwise pip fetches it into an isolated build.
        isolation = ["--no-build-isolation"] if _setuptools_here() else []
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise ReleaseError(f"building the wheel failed ({' '.join(cmd)}):\n{done.stdout}{done.stderr}")
    wheels = sorted(out.glob("course_utils-*.whl"))
    if len(wheels) != 1:
        raise ReleaseError(f"expected one course_utils wheel in {out}, found {[w.name for w in wheels]}")
    return wheels[0]


def _check_wheel(wheel: Path) -> None:
    # Every module and every data file of the package must be in the wheel.
    with zipfile.ZipFile(wheel) as z:
        inside = set(z.namelist())
    package = ROOT / "course_utils"
    data = [package / "data", package / "exhibits"]
    wanted = {p.relative_to(ROOT).as_posix() for p in package.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
              and (p.suffix == ".py" or any(d in p.parents for d in data))}
    missing = sorted(wanted - inside)
    if missing:
        raise ReleaseError(f"{wheel.name} lacks {', '.join(missing[:5])}: add them to pyproject.toml's "
                           "[tool.setuptools.package-data]")


def readme(wheel: str, notebooks: list[str]) -> str:
    """The learner's README.md of a release."""
    lessons = "\n".join(f"- `{name}`" for name in notebooks)
    return f"""# FlashAttention from scratch: your course files

This folder holds the course's notebooks and `{wheel}`, the Python package
(`course_utils`) every notebook imports first: the checks, references, plots and data.

{lessons}

## In Google Colab (nothing to install on your computer)

1. Go to <https://colab.research.google.com>, *File → Upload notebook*, and pick a notebook
   of this folder. For the Triton lessons (03 on), choose *Runtime → Change runtime type → T4 GPU*.
2. Open the file panel (the folder icon on the left) and upload `{wheel}` there
   (drag it in). Colab forgets uploaded files when the runtime is deleted: upload it again then.
   Or keep this whole folder in your Google Drive, open the notebooks from there, and mount
   Drive in the file panel: the install cell also looks in `MyDrive` and one folder below it.
3. Run the notebook's first code cell ("Run this cell first"): it installs `{wheel}`. If it
   finds none it says what to upload. Then run the notebook from the top.

## On your own computer (Linux or macOS, Python 3.10 or newer)

```
python3 -m venv .venv && . .venv/bin/activate
pip install {wheel} jupyterlab
jupyter lab
```

Without an NVIDIA GPU, `pip install torch --index-url https://download.pytorch.org/whl/cpu`
first keeps the download small (the Triton lessons then run in Triton's interpreter on the CPU).
`python -m course_utils` reports what it found (GPU, versions).

## Handing in

Save your notebook (in Colab: *File → Download → Download .ipynb*) and hand it in under the same
file name (`01_naive_attention.ipynb`, ...) the way your class collects work.
"""


def release(out: Path) -> dict:
    """Write the release folder ``out`` and ``out``.zip; returns what it wrote."""
    out = Path(out).resolve()
    problems = build.build(check=True)
    if problems:
        raise ReleaseError("notebooks/ is not in sync with solutions/ (run `make notebooks` first):\n  "
                           + "\n  ".join(problems))
    _prepare(out)
    wheel = build_wheel(out)
    _check_wheel(wheel)
    notebooks = sorted(build.NOTEBOOKS.glob("*.ipynb"))
    for nb in notebooks:
        shutil.copy2(nb, out / nb.name)
    (out / "README.md").write_text(readme(wheel.name, [nb.name for nb in notebooks]))
    archive = out.with_name(out.name + ".zip")
    files = sorted(p for p in out.iterdir() if p.is_file())
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        for path in files:
            z.write(path, f"{out.name}/{path.name}")
    return {"folder": out, "zip": archive, "wheel": wheel, "notebooks": [out / nb.name for nb in notebooks]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.release", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the release folder to write (OUT.zip is written beside it)")
    args = parser.parse_args(argv)
    try:
        done = release(args.out)
    except ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    size = done["wheel"].stat().st_size / 1024
    print(f"wrote {done['folder']}/: {len(done['notebooks'])} notebooks, {done['wheel'].name} ({size:.0f} KiB), README.md")
    print(f"wrote {done['zip']}: hand it out through your LMS (README.md says what learners do)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
