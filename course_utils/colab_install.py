"""Install course_utils in Colab: the code of every student notebook's first code cell.

Stdlib only: the cell runs before course_utils can be imported, so the build
(``course_utils.build``) copies this file's text into the cell, which runs it
in a private namespace and calls ``install(<repository address>)``. It decides:

1. course_utils is already importable (local JupyterLab, or this runtime
   installed it before): nothing to do;
2. not in Colab: say how to install it (``pip install course_utils-*.whl``);
3. in Colab, a ``course_utils-*.whl`` beside the notebook (uploaded through
   Colab's file panel), in /content or in a mounted Drive folder (or one
   folder below): pip-install it, the newest version winning;
4. in Colab, the repository address answers: pip-install from git;
5. otherwise one sentence: which file to upload, and where.

Dependencies: pyproject.toml asks for torch/triton with lower bounds only, so
pip keeps Colab's builds; to make sure no dependency pulls a different torch
or triton, the install also names the installed versions (``torch==X``), which
pip sees as already satisfied. Small missing dependencies (if any) come from PyPI.
"""
import glob
import importlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import urllib.request

SEARCH_DIRS = (".", "/content", "/content/drive/MyDrive")
WHEEL = "course_utils-*.whl"
UPLOAD = ("upload course_utils-<version>-py3-none-any.whl from your class's release zip through Colab's file "
          "panel (the folder icon on the left), or put it in your Google Drive and mount Drive there, "
          "then run this cell again")


def _installed():
    return importlib.util.find_spec("course_utils") is not None


def _pip(*args):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def _reachable(url, timeout=5):
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except Exception:  # no network, a 404 (a private or placeholder address), a timeout
        return False


def _version(path):
    # course_utils-0.1.0-py3-none-any.whl -> (0, 1, 0); then the newest file
    return tuple(int(n) for n in re.findall(r"\d+", os.path.basename(path).split("-")[1])), os.path.getmtime(path)


def find_wheel(search_dirs=SEARCH_DIRS):
    """The newest ``course_utils-*.whl`` in ``search_dirs`` or one folder below them (None if none)."""
    found = {os.path.realpath(p) for d in search_dirs for pattern in (WHEEL, os.path.join("*", WHEEL))
             for p in glob.glob(os.path.join(d, pattern))}
    return max(found, key=_version, default=None)


def _keep():
    # the torch and triton already here, as requirements pip finds satisfied
    keep = []
    for name in ("torch", "triton"):
        try:
            keep.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return keep


def install(repository, search_dirs=SEARCH_DIRS, pip=_pip, reachable=_reachable):
    """Install course_utils as described above; print one sentence and return ``(what, detail)``.

    ``what`` is "installed" (nothing to do), "wheel" (detail: its path), "git" (the
    address) or "missing" (the sentence).
    """
    if _installed():
        print("course_utils is installed: nothing to do.")
        return "installed", None
    if "google.colab" not in sys.modules:
        sentence = ("course_utils is not installed in this Python: run `pip install course_utils-<version>-py3-none-any.whl` "
                    "(from your class's release) or `make lab` in the course repository, then restart the kernel.")
        print(sentence)
        return "missing", sentence
    wheel = find_wheel(search_dirs)
    if wheel:
        print(f"Installing {wheel} ...")
        pip(wheel, *_keep())
        importlib.invalidate_caches()
        return "wheel", wheel
    if repository and reachable(repository):
        print(f"Installing course_utils from {repository} ...")
        pip(f"course_utils @ git+{repository}", *_keep())
        importlib.invalidate_caches()
        return "git", repository
    sentence = f"course_utils is not installed and {repository or 'the course repository'} cannot be reached: {UPLOAD}."
    print(sentence)
    return "missing", sentence
