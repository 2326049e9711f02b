"""Where the course is running, and the defaults that follow from it.

Triton kernels need an NVIDIA GPU, except under Triton's *interpreter*, which
runs them on CPU tensors with NumPy. The interpreter is switched on by the
environment variable ``TRITON_INTERPRET=1``, and Triton reads it once, when it
is first imported. Set later, kernels fail with the misleading messages
"Cannot call @triton.jit'd outside of the scope of a kernel" or
"0 active drivers". That is why every notebook starts with
``import course_utils``: :func:`configure` runs on that import, before
anything else imports Triton.

On a GPU older than Ampere (compute capability below 8.0, such as Colab's
T4, sm_75) Triton does not promise to run: its README has required 8.0+
since triton-lang/triton#5066, which also turned its tensor-core ``tl.dot``
off below sm_80 (an FMA fallback instead), and its maintainers call sm_75
unsupported (triton-lang/triton#10918). There :func:`configure` first runs a
16x16 ``tl.dot`` kernel in a separate Python (:func:`_probe_tl_dot`; this
process must not import Triton before the interpreter is decided). Its
verdict is cached (:func:`_probe_cache_path`). If it fails, the course runs
in the interpreter on the CPU, as on a machine without a GPU; if it runs, the
GPU is kept, with smaller default sizes. Either way one sentence says so
(on stderr, and in the doctor's report). On sm_80+ nothing is probed.

``python -m course_utils`` (the *doctor*) prints :func:`report`.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import warnings

INTERPRET_VAR = "TRITON_INTERPRET"
# Set once the old-GPU sentence has been printed, so that child processes (grading workers,
# which import course_utils again) do not print it again.
_NOTE_SAID_VAR = "COURSE_UTILS_GPU_NOTE_SAID"
PROBE_TIMEOUT_S = 120  # compiling the probe's tiny kernel takes a few seconds


@dataclasses.dataclass(frozen=True)
class Environment:
    """What this machine can do, and the defaults the notebooks use on it."""

    device: str  # "cuda" or "cpu"
    interpreter: bool  # Triton kernels run in the interpreter (on the CPU)
    gpu_name: str | None
    capability: tuple[int, int] | None
    triton_imported_too_early: bool
    # On a GPU below sm_80: the sentence saying what the tl.dot probe found (None elsewhere).
    gpu_note: str | None = None

    @property
    def tensor_cores(self) -> bool:
        """Triton's ``tl.dot`` uses tensor cores: on a GPU of sm_80+ only (below, an FMA fallback)."""
        return self.device == "cuda" and self.capability is not None and self.capability >= (8, 0)

    @property
    def bf16_ok(self) -> bool:
        """bf16 needs sm_80 (Ampere) on a GPU; the interpreter computes it wrong."""
        return self.capability is not None and self.capability >= (8, 0)

    @property
    def dtype(self):
        """The default dtype for attention inputs on this machine.

        bf16 on Ampere/Hopper; fp16 on older GPUs such as Colab's T4 (sm_75);
        fp32 on the CPU, where the interpreter's bf16 is silently wrong and
        fp32 ``tl.dot`` is exact.
        """
        import torch

        if self.device == "cpu":
            return torch.float32
        return torch.bfloat16 if self.bf16_ok else torch.float16

    @property
    def seq_len(self) -> int:
        """A sequence length that keeps a notebook cell to seconds.

        The interpreter costs about 4 ms per program per K/V block, so on the
        CPU we stay at N <= 256. A GPU below sm_80 (a T4) runs ``tl.dot``
        without tensor cores, so it gets 256: between the CPU's 128 and the
        1024 of an Ampere/Hopper GPU.
        """
        if self.device != "cuda":
            return 128
        return 1024 if self.tensor_cores else 256


_ENV: Environment | None = None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# What an NVIDIA driver puts on a Linux machine (its device files, /dev/nvidiactl and one per GPU, also in a
# container with GPUs passed through; /dev/dxg is WSL 2's GPU). Where none is there, CUDA cannot start, so torch
# need not be imported to ask.
_NVIDIA_DRIVER_PATHS = ("/dev/nvidia*", "/dev/dxg", "/proc/driver/nvidia")


def _no_nvidia_driver() -> bool:
    """True where CUDA surely cannot run: Linux without the driver's files, or macOS.

    Importing torch takes about a second; without this, every ``import course_utils``
    paid it to learn that there is no GPU, and the NumPy lessons' grading runs four
    processes per notebook (the grader's worker, the kernel, the checks and the
    learner's process) that need nothing else of torch. Elsewhere (Windows), torch
    is asked.
    """
    if sys.platform == "darwin":
        return True
    return sys.platform.startswith("linux") and not any(glob.glob(p) for p in _NVIDIA_DRIVER_PATHS)


def _cuda_available() -> bool:
    if _no_nvidia_driver() or not _torch_importable():
        return False
    import torch

    return torch.cuda.is_available()


def _capability() -> tuple[int, int] | None:
    """The CUDA GPU's compute capability, or None without one (no torch, a CPU-only torch, no device)."""
    if not _cuda_available():
        return None
    import torch

    return tuple(torch.cuda.get_device_capability())


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


# Run by _probe_tl_dot in a fresh Python (from a file), with the interpreter off: compile and run one 16x16
# tl.dot on the GPU and compare it with torch. Prints "ok", or why not (exit status not 0).
_PROBE_CODE = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
if not torch.cuda.is_available():
    print("no GPU: torch.cuda.is_available() is False here")
    sys.exit(2)
import triton
import triton.language as tl

@triton.jit
def _dot16(a, b, c, N: tl.constexpr):
    i = tl.arange(0, N)
    tile = i[:, None] * N + i[None, :]
    tl.store(c + tile, tl.dot(tl.load(a + tile), tl.load(b + tile)))

a, b = (torch.randn(16, 16, device="cuda", dtype=torch.float16) for _ in range(2))
c = torch.empty(16, 16, device="cuda", dtype=torch.float32)
_dot16[(1,)](a, b, c, N=16)
torch.cuda.synchronize()
err = (c - a.float() @ b.float()).abs().max().item()
if not err < 1e-2:
    print(f"tl.dot computed a wrong product (max error {err:.3g})")
    sys.exit(3)
print("ok")
"""


def _last_line(text: str, limit: int = 160) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _probe_tl_dot() -> tuple[bool, str]:
    """Compile and run a 16x16 ``tl.dot`` on the GPU in a fresh Python: (it ran right, what happened).

    A subprocess, because this process must not import Triton before
    :func:`configure` has decided on the interpreter. Limited to
    :data:`PROBE_TIMEOUT_S` seconds. Without a GPU it answers ``(False, "no GPU...")``.
    """
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != INTERPRET_VAR}
    try:
        # A file, not `python -c`: @triton.jit reads its function's source from the file.
        with tempfile.TemporaryDirectory(prefix="course_utils_probe_") as folder:
            script = pathlib.Path(folder) / "tl_dot_probe.py"
            script.write_text(_PROBE_CODE)
            out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                 env=env, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"the test kernel did not finish in {PROBE_TIMEOUT_S} s"
    except OSError as exc:
        return False, f"could not start Python for the test kernel: {exc}"
    if out.returncode == 0 and out.stdout.strip().endswith("ok"):
        return True, "ok"
    detail = _last_line(out.stdout) if out.returncode in (2, 3) else _last_line(out.stderr)
    return False, detail or f"the test kernel's Python exited with status {out.returncode}"


def _probe_cache_path() -> pathlib.Path:
    """``$XDG_CACHE_HOME/course_utils/gpu_probe.json`` (``~/.cache/...`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "course_utils" / "gpu_probe.json"


def _probe_key(name: str, cap: tuple[int, int]) -> str:
    return f"{name} | sm_{cap[0]}{cap[1]} | triton {_version('triton')} | torch {_version('torch')}"


def _tl_dot_verdict(name: str, cap: tuple[int, int]) -> tuple[bool, str]:
    """:func:`_probe_tl_dot`'s answer for this GPU, capability, triton and torch, cached on disk.

    Delete the cache file to probe again; a cache that cannot be read or
    written only means probing again next time.
    """
    path, key = _probe_cache_path(), _probe_key(name, cap)
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("ok"), bool):
        return hit["ok"], str(hit.get("detail", ""))
    ok, detail = _probe_tl_dot()
    cache[key] = {"ok": ok, "detail": detail}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
    return ok, detail


OLD_GPU_NOTE = (
    "course_utils: {name} has compute capability {major}.{minor}, and Triton needs 8.0+ for `tl.dot` "
    "(Triton PR #5066, issue #10918): a test kernel failed here ({detail}), so the lessons run in "
    "Triton's interpreter on the CPU instead."
)
NO_TENSOR_CORES_NOTE = (
    "course_utils: {name} has compute capability {major}.{minor}, below the 8.0 that Triton's "
    "tensor-core `tl.dot` needs (Triton PR #5066), so `tl.dot` runs without tensor cores here "
    "(an FMA fallback, much slower than on an Ampere or Hopper GPU) and the lessons use smaller sizes "
    "(default N {seq_len})."
)


AUTOTUNE_NOTE = (
    "course_utils: Triton's CPU interpreter cannot time kernels, so each @triton.autotune runs the "
    "first of its configs here (for `{name}`: {config}); on a GPU every config is tried."
)


def _patch_autotuner(autotuner) -> None:
    """Make ``autotuner.Autotuner`` keep only its first config (and say so once per process)."""
    cls = autotuner.Autotuner
    if getattr(cls, "_course_first_config", False):
        return
    original = cls.prune_configs

    def prune_configs(self, kwargs, *args, **more):
        configs = original(self, kwargs, *args, **more)
        if len(configs) > 1:
            if not cls._course_autotune_said:
                cls._course_autotune_said = True
                name = getattr(getattr(self, "base_fn", None), "__name__", None) or "your kernel"
                print(AUTOTUNE_NOTE.format(name=name, config=configs[0]))
            configs = configs[:1]
        return configs

    cls.prune_configs = prune_configs
    cls._course_first_config = True
    cls._course_autotune_said = False


def _patch_interpreter_index(interpreter) -> None:
    """Let triton < 3.8's interpreter run ``range`` loops with run-time bounds under numpy >= 2.4.

    Its ``tl.tensor.__index__`` is ``int(data)`` on an array of shape ``(1,)``,
    which numpy 2.4 refuses ("only 0-dimensional arrays can be converted");
    triton 3.8 squeezes the array first. This does the same on older Tritons.
    """
    original = interpreter._patch_lang_tensor
    if getattr(original, "_course_index_fix", False):
        return

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._course_index_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


def _patch_interpreter_fp8_cast(interpreter) -> None:
    """Round float32/float16 -> e4m3 (``x.to(tl.float8e4nv)``) in Triton's interpreter as a GPU does.

    The interpreter's ``_convert_float`` ORs the carry of a mantissa that rounds up into the exponent instead
    of adding it, so 126.24 becomes 64, not 128 (upstream: triton-lang/triton#8322, PRs #9808 and #11897,
    open). A kernel that writes the plain cast was then wrong on the CPU only: lesson 11's P in e4m3 drew a
    relative error of 0.07-0.15 there and 0.02 on a GPU. Here the cast is torch's (round to nearest even)
    after a clamp to e4m3's +-448 (the GPU's ``cvt.rn.satfinite``); other conversions are the interpreter's
    own. Applied only where the interpreter's cast is found wrong.
    """
    import numpy as np

    original = interpreter._convert_float
    if getattr(original, "_course_fp8_fix", False):
        return
    broken = []  # decided at the first conversion: triton.language is half-imported when this module is

    def _is_broken(tl) -> bool:
        if not broken:
            probe = np.array([126.2386, 1.97], dtype=np.float32)  # 128 and 2 in e4m3: 0x77, 0x40
            got = np.asarray(original(probe, tl.float32, tl.float8e4nv, None)).view(np.uint8)
            broken.append(not np.array_equal(got, np.array([0x77, 0x40], dtype=np.uint8)))
        return broken[0]

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        tl = interpreter.tl
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16) \
                and rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ and input.dtype in (np.float32, np.float16) \
                and _is_broken(tl):
            import torch

            x = np.clip(input.astype(np.float32), -448.0, 448.0)  # NaN stays NaN
            x8 = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float8_e4m3fn)
            return x8.view(torch.uint8).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    _convert_float._course_fp8_fix = True
    interpreter._convert_float = _convert_float


class _PatchOnImport:
    """Patches a Triton module when it is imported (``import course_utils`` imports no triton)."""

    def __init__(self, name, patch):
        self.NAME, self.patches = name, [patch]

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module, patches = spec.loader.exec_module, self.patches

        def exec_and_patch(module):
            exec_module(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch_when_imported(name, patch) -> None:
    """Apply ``patch(module)`` now if ``name`` is imported, else when it is (each patch once)."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _PatchOnImport) and f.NAME == name), None)
    if finder is None:
        sys.meta_path.insert(0, _PatchOnImport(name, patch))
    elif patch not in finder.patches:
        finder.patches.append(patch)


def _autotune_first_config_in_interpreter() -> None:
    """Let multi-config ``@triton.autotune`` run in the interpreter: the first config, said once.

    Without this, an autotuner with several configs tries to time them and
    fails with Triton's "0 active drivers" (the interpreter has no driver to
    time with), which reads like the import-order problem but is not.
    """
    _patch_when_imported("triton.runtime.autotuner", _patch_autotuner)
    if _interpreter_index_broken():
        _patch_when_imported("triton.runtime.interpreter", _patch_interpreter_index)
    _patch_when_imported("triton.runtime.interpreter", _patch_interpreter_fp8_cast)


NO_DRIVER_NOTE = (
    "course_utils: Triton was imported before `import course_utils`, so it did not see "
    "TRITON_INTERPRET=1 and looked for a GPU (\"0 active drivers\"). Restart the kernel "
    "(Kernel -> Restart) and run the notebook from the top, with `import course_utils` first."
)


def _explain_missing_driver_at_launch() -> None:
    """Triton was imported too early: add the restart advice to its bare "0 active drivers" error."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.__dict__["run"]
    if getattr(original, "_course_note", False):
        return

    def run(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as exc:
            if "active drivers" in str(exc):
                exc.add_note(NO_DRIVER_NOTE)
            raise

    run._course_note = True
    JITFunction.run = run


def configure() -> Environment:
    """Decide CPU or GPU and switch the Triton interpreter on when needed.

    Runs once, on ``import course_utils``. Without a GPU it sets
    ``TRITON_INTERPRET=1``, which only works if Triton is not imported yet;
    if it was, it warns in one sentence and says how to recover. On a GPU
    below sm_80 it first asks :func:`_tl_dot_verdict` whether ``tl.dot``
    runs there: if not, it goes on as without a GPU; if so, it keeps the GPU
    (``seq_len`` 256); either way it prints one sentence (``gpu_note``).
    """
    global _ENV
    if _ENV is not None:
        return _ENV
    triton_was_imported = "triton" in sys.modules
    cap = _capability()
    has_gpu = cap is not None
    name = _gpu_name() if has_gpu else None
    note = None
    if has_gpu and cap < (8, 0):  # below Ampere: does Triton's tl.dot compile and run here?
        ok, detail = _tl_dot_verdict(name, cap)
        fields = dict(name=name, major=cap[0], minor=cap[1], detail=detail)
        if ok:
            note = NO_TENSOR_CORES_NOTE.format(seq_len=Environment("cuda", False, name, cap, False).seq_len, **fields)
        else:  # as on a machine without a GPU
            note = OLD_GPU_NOTE.format(**fields)
            has_gpu, name, cap = False, None, None
        if os.environ.get(_NOTE_SAID_VAR) != "1":
            print(note, file=sys.stderr)
            os.environ[_NOTE_SAID_VAR] = "1"
    too_early = False
    if not has_gpu and os.environ.get(INTERPRET_VAR) != "0":  # "0": asked for the compiler (targets.py)
        if os.environ.get(INTERPRET_VAR) != "1":
            if triton_was_imported:
                too_early = True
                warnings.warn(
                    "Triton was imported before course_utils, so its CPU interpreter "
                    "could not be switched on: restart the kernel and run "
                    "`import course_utils` before `import triton`.",
                    stacklevel=3,
                )
            else:
                os.environ[INTERPRET_VAR] = "1"
    interpreter = os.environ.get(INTERPRET_VAR) == "1" and not too_early
    if interpreter:
        _autotune_first_config_in_interpreter()
    if too_early:
        _explain_missing_driver_at_launch()
    _ENV = Environment(
        device="cuda" if has_gpu else "cpu",
        interpreter=interpreter,
        gpu_name=name,
        capability=cap,
        triton_imported_too_early=too_early,
        gpu_note=note,
    )
    return _ENV


def current() -> Environment:
    """The environment found by :func:`configure` (configuring it if needed)."""
    return configure()


def _interpreter_index_broken() -> bool:
    """triton < 3.8 with numpy >= 2.4: the interpreter's run-time-bounded ``range`` loops fail unpatched."""
    triton_v, numpy_v = _version("triton"), _version("numpy")
    if not (triton_v and numpy_v):
        return False
    t = tuple(int(x) for x in re.findall(r"\d+", triton_v)[:2])
    n = tuple(int(x) for x in re.findall(r"\d+", numpy_v)[:2])
    return t < (3, 8) and n >= (2, 4)


def interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run the course's kernels with these versions, or None.

    triton < 3.8 with numpy >= 2.4 breaks the interpreter's ``range`` loops with
    run-time bounds; ``import course_utils`` repairs that (see
    :func:`_patch_interpreter_index`) wherever the interpreter is on, so this only
    reports it when that Triton's interpreter has no place for the repair. It
    matters on a GPU machine too, where some lessons start CPU processes that use
    the interpreter (lesson 10's gloo ring, ``check_on_cpu``).
    """
    if not _interpreter_index_broken():
        return None
    spec = importlib.util.find_spec("triton")
    source = pathlib.Path(spec.origin).parent / "runtime" / "interpreter.py" if spec and spec.origin else None
    if source is not None and source.exists() and "def _patch_lang_tensor(" in source.read_text():
        return None
    return (f"triton {_version('triton')}'s interpreter with numpy {_version('numpy')} breaks `range` "
            "loops with run-time bounds: install triton>=3.8 or numpy<2.4.")


def known_problems(env: Environment | None = None) -> list[str]:
    """Combinations of versions and settings known to break the course."""
    env = env or current()
    problems = []
    if not _torch_importable():
        problems.append(
            "PyTorch is not installed (or does not import): run `make setup` in the course "
            "folder, or `pip install -e .` (without a GPU, `make setup TORCH_CPU=1` takes "
            "PyTorch's small CPU build)."
        )
    triton_v = _version("triton")
    numpy_v = _version("numpy")
    if env.triton_imported_too_early:
        problems.append(
            "Triton was imported before course_utils: the interpreter is off and "
            "kernels will fail with 'Cannot call @triton.jit'd outside of the scope "
            "of a kernel' or '0 active drivers'. Restart the kernel and import "
            "course_utils first."
        )
    if triton_v is None and platform.system() != "Linux":
        problems.append(
            f"Triton has no wheels for {platform.system()}: use Colab or WSL "
            "(see the README's support matrix)."
        )
    elif triton_v is None:
        problems.append("Triton is not installed: `pip install -e .` installs it.")
    if env.interpreter and interpreter_problem():
        problems.append(interpreter_problem())
    unused = _unused_gpu_problem(env)
    if unused:
        problems.append(unused)
    if env.device == "cuda" and not env.bf16_ok:
        problems.append(
            f"{env.gpu_name} (sm_{env.capability[0]}{env.capability[1]}) has no bf16: "
            "the course uses fp16 here."
        )
    return problems


def _unused_gpu_problem(env: Environment) -> str | None:
    """Why the course runs on the CPU of a machine with an NVIDIA driver, when that is not meant.

    Not meant: torch is its CPU build (installed with ``TORCH_CPU=1``, or from PyTorch's CPU index), or
    its CUDA build sees no GPU although ``CUDA_VISIBLE_DEVICES`` does not hide them (a driver too old for
    that build, or one that does not work). Meant: an old GPU sent to the interpreter (``gpu_note``), or
    GPUs hidden with ``CUDA_VISIBLE_DEVICES=""``.
    """
    if env.device != "cpu" or env.gpu_note or _no_nvidia_driver() or not _torch_importable():
        return None
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return None
    import torch

    if torch.version.cuda is None:
        return (f"This machine has an NVIDIA driver, but PyTorch {torch.__version__} is a CPU build, so the course "
                "runs in Triton's interpreter on the CPU: install PyTorch's CUDA build (on Linux, `pip install "
                "torch` from PyPI; not `make setup TORCH_CPU=1`) to use the GPU.")
    return (f"This machine has an NVIDIA driver and PyTorch's CUDA {torch.version.cuda} build, but "
            "torch.cuda.is_available() is False, so the course runs in Triton's interpreter on the CPU: "
            f"`nvidia-smi` says whether the driver works and whether it supports CUDA {torch.version.cuda}.")


def report(env: Environment | None = None) -> str:
    """A short, plain description of this machine for the doctor."""
    env = env or current()
    lines = ["FlashAttention course - environment check"]
    lines.append(f"  python        {platform.python_version()} ({platform.system()})")
    has_torch = _torch_importable()
    for pkg in ("torch", "triton", "numpy", "matplotlib", "ipywidgets"):
        version = _version(pkg) if pkg != "torch" or has_torch else None
        lines.append(f"  {pkg:<13} {version or 'not installed'}")
    if env.device == "cuda":
        major, minor = env.capability
        lines.append(f"  GPU           {env.gpu_name} (compute capability {major}.{minor})")
        lines.append(f"  tl.dot        {'tensor cores' if env.tensor_cores else 'without tensor cores (FMA fallback)'}")
    elif env.gpu_note:
        lines.append("  GPU           not used: Triton kernels run in the interpreter on the CPU (see the note)")
    else:
        lines.append("  GPU           none: Triton kernels run in the interpreter on the CPU")
    lines.append(f"  interpreter   {'on' if env.interpreter else 'off'} ({INTERPRET_VAR}={os.environ.get(INTERPRET_VAR, '')!r})")
    if has_torch:
        lines.append(f"  default dtype {str(env.dtype).replace('torch.', '')}")
    lines.append(f"  default N     {env.seq_len}")
    if env.gpu_note:
        lines.append(f"Note: {env.gpu_note.removeprefix('course_utils: ')}")
    problems = known_problems(env)
    if problems:
        lines.append("Problems:")
        lines.extend(f"  - {p}" for p in problems)
    else:
        lines.append("No known problems.")
    return "\n".join(lines)


def main() -> int:
    """Entry point of ``python -m course_utils`` and ``course-doctor``."""
    print(report())
    return 1 if current().triton_imported_too_early or not _torch_importable() else 0
