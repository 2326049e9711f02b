"""A separate Python process that runs checks, so a learner's kernel cannot break the notebook.

On a GPU a bad memory access inside a kernel (a ``tl.store`` far past the end
of a tensor) leaves the process's CUDA context unusable: every CUDA call after
it fails, and the only way out is to restart the notebook. A kernel that loops
forever cannot be interrupted at all. CUDA does not survive ``fork``, so the
CPU's trick (:func:`.sandbox.isolated` forks a child) is not available there.

Instead, the first Triton check of a notebook starts one worker process
(:func:`main`) with a fresh CUDA context of its
own, and every later check is sent to it:

- the learner's launcher and kernels travel **by value**: functions defined in
  the notebook are pickled with `cloudpickle`_, and each ``@triton.jit`` kernel
  is rebuilt in the worker from its source (Triton compiles from source, which
  a notebook cell does not have on disk, so we hand it over);
- the worker runs the check and answers with the outcome (and what the
  learner's code printed);
- if the check faulted CUDA, the worker exits after answering, and the next
  check starts a fresh one; if it runs past the time limit, it is killed.

The notebook's own process never touches the faulting context, so a correct
kernel checked right after a faulting one passes.

.. _cloudpickle: https://github.com/cloudpipe/cloudpickle
"""

from __future__ import annotations

import contextlib
import io
import itertools
import linecache
import os
import subprocess
import sys
import traceback
import types
from multiprocessing.connection import Connection

__all__ = ["Worker", "WorkerCrashed", "WorkerTimeout", "dumps", "CUDA_FAULT_WORDS"]

# Words in an exception that mean the CUDA context is now unusable.
CUDA_FAULT_WORDS = (
    "illegal memory access",
    "illegal address",
    "address space",
    "misaligned address",
    "unspecified launch failure",
    "device-side assert",
    "AcceleratorError",
    "CUDA error",
)
_MAX_PRINTED = 20_000  # characters of the learner's printing sent back


class WorkerCrashed(RuntimeError):
    """The worker process died while running a check (``returncode`` says how)."""

    def __init__(self, returncode):
        super().__init__(f"the grading worker died (exit code {returncode})")
        self.returncode = returncode


class WorkerTimeout(RuntimeError):
    """The check ran past its time limit; the worker was killed."""


# ---------------------------------------------------------------------------
# Pickling: functions by value, Triton kernels by source
# ---------------------------------------------------------------------------


def _import_attr(module: str, qualname: str):
    import importlib

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _found_on_path(module_name: str) -> bool:
    """Whether a fresh Python with this ``sys.path`` would import ``module_name`` from the same file.

    Not so for a notebook (``__main__``), nor for a module loaded from a file
    outside ``sys.path`` (``importlib.util.spec_from_file_location``).
    """
    if module_name in (None, "__main__", "__mp_main__"):
        return False
    top_name = module_name.split(".")[0]
    top = sys.modules.get(top_name)
    file = getattr(top, "__file__", None)
    if top is None:
        return False
    if file is None:  # built-in, frozen or namespace package
        return True
    # Ask the import system's finders (sys.path, and e.g. an editable install's finder),
    # as a fresh process would, whether they find this very file.
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(top_name, None)
        except Exception:
            continue
        if spec is not None and spec.origin and os.path.abspath(spec.origin) == os.path.abspath(file):
            return True
    return False


def _modules_only_here():
    """Loaded modules that another process could not import by name: they travel by value."""
    return [m for name, m in list(sys.modules.items())
            if m is not None and "." not in name and not name.startswith("__") and getattr(m, "__name__", None) == name
            and getattr(m, "__file__", None) and not _found_on_path(name)]


def _by_reference(obj):
    """``(module, qualname)`` when ``obj`` can be imported by name in another process."""
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not _found_on_path(module) or not name or "<locals>" in name:
        return None
    try:
        return (module, name) if _import_attr(module, name) is obj else None
    except Exception:
        return None


def _import_wrapped(module: str, qualname: str):
    return _import_attr(module, qualname).__wrapped__


def _wrapped_reference(fn):
    """``(module, qualname)`` of a decorated function whose ``__wrapped__`` is ``fn``."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None)
    if not _found_on_path(module) or not name or "<locals>" in name:
        return None
    try:
        return (module, name) if getattr(_import_attr(module, name), "__wrapped__", None) is fn else None
    except Exception:
        return None


_copies = itertools.count()


def _rebuild_kernel(fn, lines, start, options, filename=None):
    """The worker's side of a pickled ``@triton.jit`` kernel.

    Triton reads a kernel's source with :mod:`inspect`, from the file its code
    object names. cloudpickle renames every code object it sends by value
    ``<dynamic-code>``, so the kernels of different cells and modules would
    share one file name and overwrite each other's lines; and a kernel defined
    in a notebook cell has no file on disk. So the kernel gets back its own
    file name (a copy's name where the file on disk differs) and its source is
    registered in :mod:`linecache` under it, at its line, as Jupyter does.
    """
    filename = filename or fn.__code__.co_filename
    end = start - 1 + len(lines)
    if os.path.exists(filename):
        on_disk = linecache.getlines(filename)
        if on_disk[start - 1 : end] == list(lines):
            fn.__code__ = fn.__code__.replace(co_filename=filename)
            return _jit(fn, options)
        filename = f"<{filename}, as sent to the grading worker #{next(_copies)}>"
    cached = linecache.cache.get(filename)
    have = list(cached[2]) if cached else []
    have.extend("\n" for _ in range(end + 1 - len(have)))  # and a blank line after the kernel
    have[start - 1 : end] = lines
    linecache.cache[filename] = (sum(map(len, have)), None, have, filename)
    fn.__code__ = fn.__code__.replace(co_filename=filename)
    return _jit(fn, options)


def _jit(fn, options):
    import triton

    return triton.jit(fn, **options)


def _reduce_kernel(kernel):
    import inspect

    ref = _by_reference(kernel)
    if ref is not None:
        return _import_attr, ref
    fn = kernel.fn
    lines, start = inspect.getsourcelines(fn)
    options = {}
    for key in ("do_not_specialize", "noinline", "debug"):
        value = getattr(kernel, key, None)
        if value:
            options[key] = list(value) if key == "do_not_specialize" else value
    # do_not_specialize holds indices once parsed; triton.jit accepts indices.
    return _rebuild_kernel, (fn, lines, start, options, fn.__code__.co_filename)


def _kernel_classes():
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:  # pragma: no cover
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    return tuple(classes)


def dumps(obj) -> bytes:
    """Pickle ``obj`` for the worker: notebook functions by value, kernels by source.

    Raises when something in it cannot travel (an open file, a generator, a
    lock...): the caller then runs the check in its own process instead.
    """
    import cloudpickle

    kernels = _kernel_classes()

    class _Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            if kernels and isinstance(obj, kernels):
                return _reduce_kernel(obj)
            if isinstance(obj, types.FunctionType):
                ref = _wrapped_reference(obj)
                if ref is not None:  # a check under its decorator: import it there
                    return _import_wrapped, ref
            return super().reducer_override(obj)

    local = _modules_only_here()
    for module in local:
        cloudpickle.register_pickle_by_value(module)
    try:
        buf = io.BytesIO()
        _Pickler(buf, protocol=5).dump(obj)
        return buf.getvalue()
    finally:
        for module in local:
            cloudpickle.unregister_pickle_by_value(module)


# ---------------------------------------------------------------------------
# The parent's side
# ---------------------------------------------------------------------------


from ..grade_harness import GUARD_VAR, WORKER_ENTRY as _ENTRY  # noqa: E402  (stdlib only)


class Worker:
    """One grading process, started on demand and reused.

    ``device="cuda"``: a worker with its own CUDA context. ``device="cpu"``:
    a worker with the GPU hidden (``CUDA_VISIBLE_DEVICES=""``) and Triton's
    interpreter on, for running a check's kernels on the CPU.
    """

    def __init__(self, device: str, start_timeout_s: float = 180.0):
        self.device = device
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env["PYTHONUNBUFFERED"] = "1"
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ENTRY, str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        if not self._recv.poll(start_timeout_s):
            self.kill()
            raise WorkerTimeout(f"the grading worker did not start within {start_timeout_s:g} s")
        try:
            hello = self._recv.recv()
        except EOFError:
            self.proc.wait()
            raise WorkerCrashed(self.proc.returncode) from None
        self.info = hello

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, payload: bytes, timeout_s: float):
        """Send one pickled ``(check, fn, kwargs)``; return ``(kind, value, printed, cuda_broken)``."""
        try:
            self._send.send_bytes(payload)
        except (BrokenPipeError, OSError):
            self.proc.wait()
            raise WorkerCrashed(self.proc.returncode) from None
        if not self._recv.poll(timeout_s):
            self.kill()
            raise WorkerTimeout(f"no answer within {timeout_s:g} s")
        try:
            outcome = self._recv.recv()
        except EOFError:
            self.proc.wait()
            raise WorkerCrashed(self.proc.returncode) from None
        if outcome[3]:  # CUDA is broken there: the worker exits; let it
            self.proc.wait(timeout=30)
        return outcome

    def kill(self):
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(timeout=30)
        for conn in (self._send, self._recv):
            with contextlib.suppress(Exception):
                conn.close()


# ---------------------------------------------------------------------------
# The worker's side
# ---------------------------------------------------------------------------


def _cuda_broken() -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception:
        return True
    return False


def _serve(conn_in: Connection, conn_out: Connection) -> None:
    import cloudpickle

    import course_utils  # first: decides CPU/interpreter or GPU for this process
    from .core import GradingError
    from .sandbox import _learner_traceback

    conn_out.send({"pid": os.getpid(), "device": course_utils.DEVICE})
    while True:
        try:
            payload = conn_in.recv_bytes()
        except EOFError:  # the notebook went away
            return
        printed = io.StringIO()
        try:
            check, fn, kwargs = cloudpickle.loads(payload)
        except BaseException:
            outcome = ("unpicklable", traceback.format_exc(limit=3))
        else:
            try:
                with contextlib.redirect_stdout(printed):
                    outcome = ("passed", check(fn, **kwargs))
            except GradingError as exc:
                outcome = ("failed", str(exc))
            except BaseException as exc:  # the learner's error: its traceback as text
                outcome = ("error", _learner_traceback(exc))
        broken = _cuda_broken()
        try:
            conn_out.send((*outcome, printed.getvalue()[-_MAX_PRINTED:], broken))
        except Exception:  # an answer that does not pickle: say so in words
            conn_out.send(("error", f"the check's result could not be sent back: {outcome[1]!r:.500}", "", broken))
        if broken:
            return


def main(argv=None) -> int:
    """Serve checks over the two pipe descriptors given as arguments."""
    argv = sys.argv[1:] if argv is None else argv
    guard = os.environ.get(GUARD_VAR)
    if guard:  # started from a notebook that the batch grader runs: the same guard here, first
        import json

        from .. import grade_harness

        grade_harness.prologue(json.loads(guard))
    conn_in = Connection(int(argv[0]), writable=False)
    conn_out = Connection(int(argv[1]), readable=False)
    _serve(conn_in, conn_out)
    return 0

