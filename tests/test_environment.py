"""Environment handling: the interpreter switch, defaults and the doctor."""

import importlib.util
import os
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


def test_the_interpreters_cast_to_e4m3_rounds_as_a_gpu_does():
    """x.to(tl.float8e4nv) in the interpreter: nearest even with the carry into the exponent (126.24 -> 128, which
    Triton's own interpreter makes 64), ties to even, saturation at 448, subnormals; from float32 and float16."""
    out = _python(
        "import course_utils, torch, triton, triton.language as tl\n"
        "@triton.jit\n"
        "def cast(X, Z, N: tl.constexpr):\n"
        "    offs = tl.arange(0, N)\n"
        "    tl.store(Z + offs, tl.load(X + offs).to(tl.float8e4nv))\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.tensor([126.2386, 31.6051, 1.97, -126.3, 1.0625, 1.1875, 500.0, 0.0029296875, 1e-4, 0.0])\n"
        "x = torch.cat([x, torch.randn(1014, generator=g) * 40, torch.rand(1024, generator=g) * 256])\n"
        "for t in (x, x.half()):\n"
        "    z = torch.empty(2048, dtype=torch.float8_e4m3fn); cast[(1,)](t, z, N=2048)\n"
        "    want = t.float().clamp(-448, 448).to(torch.float8_e4m3fn)\n"
        "    print((z.view(torch.uint8) != want.view(torch.uint8)).sum().item(), z[:8].float().tolist())"
    )
    assert out.returncode == 0, out.stderr
    for line in out.stdout.strip().splitlines():
        wrong, first = line.split(" ", 1)
        assert wrong == "0", line
        assert first == "[128.0, 32.0, 2.0, -128.0, 1.0, 1.25, 448.0, 0.00390625]", line


def test_the_e4m3_repair_wraps_only_a_broken_cast_and_only_once():
    import triton.runtime.interpreter as interpreter

    calls = []

    def right(input, input_dtype, output_dtype, rounding_mode):  # a fixed interpreter: 126.24 -> 128, 1.97 -> 2
        calls.append(output_dtype)
        return np.array([0x77, 0x40], np.uint8)

    fake = types.SimpleNamespace(_convert_float=right, tl=interpreter.tl, _ir=interpreter._ir)
    environment._patch_interpreter_fp8_cast(fake)
    environment._patch_interpreter_fp8_cast(fake)  # twice is once
    assert fake._convert_float._course_fp8_fix
    x = np.array([3.0, 5.0], dtype=np.float32)
    got = fake._convert_float(x, interpreter.tl.float32, interpreter.tl.float8e4nv, None)
    # the probe found the cast right, so the interpreter's own function answered (the probe, then the call)
    assert len(calls) == 2 and list(got) == [0x77, 0x40]


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


# A GPU below sm_80 (Colab's T4): configure() probes tl.dot once, in a subprocess, and caches the verdict.
# These run configure() in this process with the GPU, the probe and the versions mocked; monkeypatch
# restores _ENV, TRITON_INTERPRET and sys.modules afterwards, and nothing here imports triton.


@pytest.fixture
def old_gpu(monkeypatch, tmp_path):
    """configure() on a mocked GPU: returns (run, probe calls); ``run(cap, ok)`` configures afresh."""
    calls = []
    state = {"ok": False, "detail": "PassManager::run failed"}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("TRITON_INTERPRET", environment._NOTE_SAID_VAR):
        # setenv first, so that teardown restores the variable even where it was unset (a GPU machine):
        # delenv of an unset variable records nothing, and configure() below sets TRITON_INTERPRET=1,
        # which would leak into the tests after these (kernels decorated later would be interpreted).
        monkeypatch.setenv(name, os.environ.get(name, ""))
        monkeypatch.delenv(name)
    monkeypatch.delitem(sys.modules, "triton", raising=False)  # as in a fresh notebook: triton not imported yet
    monkeypatch.setattr(environment, "_gpu_name", lambda: "Tesla T4")

    def probe():
        calls.append(1)
        return state["ok"], state["detail"] if not state["ok"] else "ok"

    monkeypatch.setattr(environment, "_probe_tl_dot", probe)

    def run(cap, ok=False, note_said=False):
        state["ok"] = ok
        monkeypatch.setattr(environment, "_capability", lambda: cap)
        monkeypatch.setattr(environment, "_ENV", None)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        if not note_said:
            monkeypatch.delenv(environment._NOTE_SAID_VAR, raising=False)
        return environment.configure()

    return run, calls


def test_old_gpu_where_tl_dot_fails_runs_in_the_interpreter_with_one_sentence(old_gpu, capsys):
    run, calls = old_gpu
    env = run((7, 5), ok=False)
    assert calls == [1]
    assert (env.device, env.interpreter, env.gpu_name, env.capability) == ("cpu", True, None, None)
    assert __import__("os").environ["TRITON_INTERPRET"] == "1"
    assert str(env.dtype) == "torch.float32" and env.seq_len == _env().seq_len
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count("course_utils:") == 1
    for words in ("Tesla T4", "compute capability 7.5", "8.0+", "#5066", "#10918", "interpreter on the CPU"):
        assert words in err
    assert env.gpu_note and env.gpu_note in err
    report = environment.report(env)
    assert env.gpu_note.removeprefix("course_utils: ") in report and "not used" in report
    # A child process (a grading worker) that imports course_utils again does not repeat the sentence.
    run((7, 5), ok=False, note_said=True)
    assert capsys.readouterr().err == ""


def test_old_gpu_where_tl_dot_runs_keeps_the_gpu_without_tensor_cores_and_smaller_sizes(old_gpu, capsys):
    run, calls = old_gpu
    env = run((7, 5), ok=True)
    assert calls == [1]
    assert (env.device, env.interpreter, env.gpu_name, env.capability) == ("cuda", False, "Tesla T4", (7, 5))
    assert "TRITON_INTERPRET" not in __import__("os").environ
    assert not env.tensor_cores and str(env.dtype) == "torch.float16"
    assert _env().seq_len <= env.seq_len < _env(device="cuda", capability=(9, 0)).seq_len
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without tensor cores" in err and "FMA" in err and "Tesla T4" in err
    report = environment.report(env)
    assert env.gpu_note.removeprefix("course_utils: ") in report
    assert "without tensor cores (FMA fallback)" in report


@pytest.mark.parametrize("cap", [(8, 0), (9, 0)])
def test_ampere_and_hopper_are_never_probed(old_gpu, capsys, cap):
    run, calls = old_gpu
    env = run(cap, ok=False)
    assert calls == []
    assert (env.device, env.interpreter, env.gpu_note, env.tensor_cores, env.seq_len) == ("cuda", False, None, True, 1024)
    assert capsys.readouterr().err == ""
    assert "Note:" not in environment.report(env)


def test_no_gpu_is_never_probed(old_gpu, capsys):
    run, calls = old_gpu
    env = run(None)
    assert calls == [] and (env.device, env.interpreter, env.gpu_note) == ("cpu", True, None)
    assert capsys.readouterr().err == ""


def test_the_probe_verdict_is_cached_per_gpu_and_versions(old_gpu, monkeypatch, tmp_path):
    run, calls = old_gpu
    versions = {"triton": "3.8.0", "torch": "2.13.0"}
    monkeypatch.setattr(environment, "_version", lambda name: versions.get(name, "1.0"))
    assert run((7, 5), ok=False).device == "cpu" and calls == [1]
    cache = tmp_path / "cache" / "course_utils" / "gpu_probe.json"
    assert environment._probe_cache_path() == cache and cache.exists()
    # Same GPU, capability and versions: the cached verdict, even where the probe would now say otherwise.
    assert run((7, 5), ok=True).device == "cpu" and calls == [1]
    versions["triton"] = "3.9.0"  # another Triton: probe again
    assert run((7, 5), ok=True).device == "cuda" and calls == [1, 1]
    assert run((7, 0), ok=True).device == "cuda" and calls == [1, 1, 1]  # another capability (a V100)
    assert len(__import__("json").loads(cache.read_text())) == 3


def test_a_cache_that_cannot_be_written_only_means_probing_again(old_gpu, monkeypatch, tmp_path):
    run, calls = old_gpu
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails
    assert run((7, 5), ok=True).device == "cuda"
    assert run((7, 5), ok=True).device == "cuda"
    assert calls == [1, 1]


def test_the_cache_defaults_to_dot_cache_without_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert environment._probe_cache_path() == tmp_path / ".cache" / "course_utils" / "gpu_probe.json"


def test_the_real_probe_without_a_gpu_says_so_quickly(monkeypatch):
    # The real subprocess: on this machine (or with CUDA hidden) it finds no GPU and stops before Triton.
    import time

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    start = time.monotonic()
    ok, detail = environment._probe_tl_dot()
    assert not ok and "no GPU" in detail, detail
    assert time.monotonic() - start < 60


def test_the_probe_kernel_is_valid_triton_in_the_interpreter(monkeypatch):
    # The real _probe_tl_dot with its own script, changed to CPU tensors in the interpreter (fp32: the
    # interpreter's fp16 products round): a broken probe would send every T4 to the CPU.
    code = environment._PROBE_CODE
    for old, new in [('os.environ.pop("TRITON_INTERPRET", None)', 'os.environ["TRITON_INTERPRET"] = "1"'),
                     ("if not torch.cuda.is_available():", "if False:"),
                     ('device="cuda"', 'device="cpu"'), ("torch.float16", "torch.float32"),
                     ("torch.cuda.synchronize()", "pass")]:
        assert old in code, old
        code = code.replace(old, new)
    # The compiler (not the interpreter) reads a @triton.jit function's source: the script must be a file.
    code = "__file__  # a NameError under `python -c`\n" + code
    monkeypatch.setattr(environment, "_PROBE_CODE", code)
    assert environment._probe_tl_dot() == (True, "ok")


@pytest.mark.parametrize("platform, present, expected", [
    ("linux", (), True), ("linux", ("/dev/nvidiactl", "/dev/nvidia0"), False), ("linux", ("/dev/nvidia1",), False),
    ("linux", ("/proc/driver/nvidia",), False), ("linux", ("/dev/dxg",), False), ("linux", ("/dev/null",), True),
    ("darwin", (), True), ("win32", (), False)])
def test_cuda_is_ruled_out_without_torch_only_where_no_nvidia_driver_can_be(monkeypatch, platform, present, expected):
    import fnmatch

    monkeypatch.setattr(environment.sys, "platform", platform)
    monkeypatch.setattr(environment.glob, "glob", lambda pattern: fnmatch.filter(present, pattern))
    assert environment._no_nvidia_driver() is expected
    if expected:  # ruled out before torch is asked
        monkeypatch.setattr(environment, "_torch_importable", lambda: pytest.fail("torch was asked"))
        assert environment._cuda_available() is False


def test_the_driver_rule_agrees_with_torch_here():
    import torch

    assert not (environment._no_nvidia_driver() and torch.cuda.is_available())


def test_the_numpy_lessons_checks_run_where_torch_cannot_be_imported():
    # The grader runs a NumPy lesson in four processes (its worker, the kernel, the checks, the learner's):
    # none needs torch or Triton, which cost about a second each to import.
    out = _python(
        "import sys\nsys.modules['torch'] = None  # any import of torch fails\n"
        "import numpy as np, course_utils, course_utils.grade_checks, course_utils.grade_harness\n"
        "from course_utils.grading import EXERCISES, part1_numpy\n"
        "def softmax(x, axis=-1):\n    e = np.exp(x - x.max(axis=axis, keepdims=True))\n"
        "    return e / e.sum(axis=axis, keepdims=True)\n"
        "print(part1_numpy.grade_softmax(softmax).cases > 0, len(EXERCISES) > 20, 'triton' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]


@pytest.mark.parametrize("cuda, visible, env_kw, expected", [
    (None, None, {}, "is a CPU build"),
    ("12.8", None, {}, "torch.cuda.is_available() is False"),
    ("12.8", "", {}, None),  # GPUs hidden on purpose
    (None, None, dict(gpu_note="a T4 whose tl.dot failed"), None),  # an old GPU sent to the interpreter
    (None, None, dict(device="cuda", interpreter=False, gpu_name="H200", capability=(9, 0)), None),
])
def test_the_doctor_says_why_a_machine_with_an_nvidia_driver_runs_on_the_cpu(monkeypatch, cuda, visible, env_kw,
                                                                             expected):
    import torch

    monkeypatch.setattr(environment, "_no_nvidia_driver", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    found = [p for p in environment.known_problems(_env(**env_kw)) if "NVIDIA driver" in p]
    assert [expected in p for p in found] == ([True] if expected else [])


def test_without_an_nvidia_driver_the_doctor_asks_torch_nothing(monkeypatch):
    monkeypatch.setattr(environment, "_no_nvidia_driver", lambda: True)
    assert not [p for p in environment.known_problems(_env()) if "NVIDIA driver" in p]
