"""Environment handling: the interpreter switch, defaults and the doctor."""

import importlib.util
import subprocess
import sys
import types

import numpy as np
import pytest

from course_utils import environment
from course_utils.environment import Environment


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python that sees no GPU (as on a laptop), on either machine."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_turns_the_interpreter_on_before_triton_without_a_gpu():
    out = _python(
        "import os, sys, course_utils\n"
        "assert 'triton' not in sys.modules\n"
        "print(course_utils.ENV.device, os.environ.get('TRITON_INTERPRET'), course_utils.ENV.interpreter)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "1", "True"]


def test_a_triton_kernel_runs_on_cpu_tensors_after_import():
    out = _python(
        "import course_utils, torch, triton, triton.language as tl\n"
        "@triton.jit\n"
        "def double(x, N: tl.constexpr):\n"
        "    offs = tl.arange(0, N)\n"
        "    tl.store(x + offs, tl.load(x + offs) * 2)\n"
        "t = torch.arange(8.0); double[(1,)](t, N=8); print(t.sum().item())"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "56.0"


def test_triton_imported_first_gets_one_sentence_and_the_doctor_flags_it():
    out = _python("import triton, course_utils\nprint(course_utils.ENV.triton_imported_too_early)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert "restart the kernel" in out.stderr
    doctor = _python("import triton, sys\nfrom course_utils.environment import main\nsys.exit(main())")
    assert doctor.returncode == 1
    assert "import course_utils first" in doctor.stdout


def test_doctor_without_torch_says_how_to_install_it():
    # sys.modules["torch"] = None makes `import torch` fail, as in a Python without it.
    out = _python("import sys; sys.modules['torch'] = None\nfrom course_utils.environment import main\nsys.exit(main())")
    assert "Traceback" not in out.stderr, out.stderr
    assert "torch         not installed" in out.stdout and "pip install" in out.stdout
    assert out.returncode == 1


def test_doctor_command_reports_versions_and_interpreter():
    out = subprocess.run([sys.executable, "-m", "course_utils"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for word in ("torch", "triton", "numpy", "interpreter", "default dtype"):
        assert word in out.stdout


def _env(**kw):
    base = dict(device="cpu", interpreter=True, gpu_name=None, capability=None, triton_imported_too_early=False)
    base.update(kw)
    return Environment(**base)


@pytest.mark.parametrize(
    "kw, dtype",
    [
        ({}, "float32"),
        (dict(device="cuda", interpreter=False, gpu_name="Tesla T4", capability=(7, 5)), "float16"),
        (dict(device="cuda", interpreter=False, gpu_name="A100", capability=(8, 0)), "bfloat16"),
        (dict(device="cuda", interpreter=False, gpu_name="H200", capability=(9, 0)), "bfloat16"),
    ],
)
def test_default_dtype_per_machine(kw, dtype):
    assert str(_env(**kw).dtype) == f"torch.{dtype}"


def test_cpu_sizes_stay_small_for_the_interpreter():
    assert _env().seq_len <= 256
    assert _env(device="cuda", capability=(9, 0)).seq_len >= 1024


def test_known_bad_triton_numpy_combination_is_repaired_or_reported(monkeypatch, tmp_path):
    versions = {"triton": "3.6.0", "numpy": "2.4.1"}
    monkeypatch.setattr(environment, "_version", lambda name: versions.get(name, "1.0"))
    # The installed Triton's interpreter has the function the repair wraps: nothing to report.
    assert not any("range" in p for p in environment.known_problems(_env()))
    # An interpreter without it cannot be repaired: reported, with the versions.
    fake = tmp_path / "triton"
    (fake / "runtime").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "runtime" / "interpreter.py").write_text("# no _patch_lang_tensor here\n")
    spec = importlib.util.spec_from_file_location("triton", fake / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "triton" else None)
    problems = environment.known_problems(_env())
    assert any("range" in p and "3.6.0" in p for p in problems)
    versions["triton"] = "3.8.0"
    assert not any("range" in p for p in environment.known_problems(_env()))


def test_interpreter_index_repair_turns_a_one_element_array_into_an_int():
    # triton 3.6's interpreter: `__index__` is int(data) on an array of shape (1,), refused by numpy >= 2.4.
    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    class Tensor:
        pass

    def original(tensor, scope):
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    interpreter = types.SimpleNamespace(_patch_lang_tensor=original)
    environment._patch_interpreter_index(interpreter)
    environment._patch_interpreter_index(interpreter)  # twice is once
    interpreter._patch_lang_tensor(Tensor, Scope())
    t = Tensor()
    t.handle = types.SimpleNamespace(data=np.array([7], dtype=np.int32))
    assert list(range(t)) == list(range(7))


    t4 = _env(device="cuda", interpreter=False, gpu_name="Tesla T4", capability=(7, 5))
    assert any("no bf16" in p for p in environment.known_problems(t4))
