"""Where the course is running, and the defaults that follow from it.

Triton kernels need an NVIDIA GPU, except under Triton's *interpreter*, which
runs them on CPU tensors with NumPy. The interpreter is switched on by the
environment variable ``TRITON_INTERPRET=1``, and Triton reads it once, when it
is first imported. Set later, kernels fail with the misleading messages
"Cannot call @triton.jit'd outside of the scope of a kernel" or
"0 active drivers". That is why every notebook starts with
``import course_utils``: :func:`configure` runs on that import, before
anything else imports Triton.

``python -m course_utils`` (the *doctor*) prints :func:`report`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import re
import sys
import warnings

INTERPRET_VAR = "TRITON_INTERPRET"


@dataclasses.dataclass(frozen=True)
class Environment:
    """What this machine can do, and the defaults the notebooks use on it."""

    device: str  # "cuda" or "cpu"
    interpreter: bool  # Triton kernels run in the interpreter (on the CPU)
    gpu_name: str | None
    capability: tuple[int, int] | None
    triton_imported_too_early: bool

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
        CPU we stay at N <= 256.
        """
        return 1024 if self.device == "cuda" else 128


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


def _cuda_available() -> bool:
    if not _torch_importable():
        return False
    import torch

    return torch.cuda.is_available()


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


class _PatchOnImport:
    """Patches a Triton module when it is imported (``import course_utils`` imports no triton)."""

    def __init__(self, name, patch):
        self.NAME, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch_when_imported(name, patch) -> None:
    """Apply ``patch(module)`` now if ``name`` is imported, else when it is."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, _PatchOnImport) and f.NAME == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(name, patch))


def _autotune_first_config_in_interpreter() -> None:
    """Let multi-config ``@triton.autotune`` run in the interpreter: the first config, said once.

    Without this, an autotuner with several configs tries to time them and
    fails with Triton's "0 active drivers" (the interpreter has no driver to
    time with), which reads like the import-order problem but is not.
    """
    _patch_when_imported("triton.runtime.autotuner", _patch_autotuner)
    if _interpreter_index_broken():
        _patch_when_imported("triton.runtime.interpreter", _patch_interpreter_index)


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
    if it was, it warns in one sentence and says how to recover.
    """
    global _ENV
    if _ENV is not None:
        return _ENV
    triton_was_imported = "triton" in sys.modules
    has_gpu = _cuda_available()
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
    name = cap = None
    if has_gpu:
        import torch

        name = torch.cuda.get_device_name()
        cap = tuple(torch.cuda.get_device_capability())
    _ENV = Environment(
        device="cuda" if has_gpu else "cpu",
        interpreter=interpreter,
        gpu_name=name,
        capability=cap,
        triton_imported_too_early=too_early,
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
    if env.device == "cuda" and not env.bf16_ok:
        problems.append(
            f"{env.gpu_name} (sm_{env.capability[0]}{env.capability[1]}) has no bf16: "
            "the course uses fp16 here."
        )
    return problems


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
    else:
        lines.append("  GPU           none: Triton kernels run in the interpreter on the CPU")
    lines.append(f"  interpreter   {'on' if env.interpreter else 'off'} ({INTERPRET_VAR}={os.environ.get(INTERPRET_VAR, '')!r})")
    if has_torch:
        lines.append(f"  default dtype {str(env.dtype).replace('torch.', '')}")
    lines.append(f"  default N     {env.seq_len}")
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
