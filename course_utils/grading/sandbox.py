"""Running a learner's Triton code safely, and proving that it ran.

Two things the Triton checks need that the NumPy ones do not:

- **isolation**: in the CPU interpreter an out-of-bounds access far enough
  away segfaults the whole Python process, which in Jupyter means the
  learner's kernel dies and their work with it. :func:`isolated` runs a check
  in a forked child process and turns a crash, a hang or an error there into
  a readable message here. On a GPU we run in-process (CUDA does not survive
  a fork), where a bad access is a CUDA error rather than a segfault.
- **proof of a kernel launch**: :func:`count_launches` records every Triton
  kernel launched while it is active, so a check can reject an answer that
  calls ``torch.nn.functional.scaled_dot_product_attention`` instead.
- **guarded inputs**: :func:`nan_padded` places a tensor inside a larger
  buffer filled with NaN, so a kernel that reads past the end of a row or of
  the sequence reads NaN, which then shows up in its output.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing
import os
import signal
import sys
import traceback
from typing import Callable

from ..environment import current
from . import worker
from .core import GradingError

__all__ = ["isolated", "check_on_cpu", "is_cuda_fault", "count_launches", "nan_padded", "KernelError"]


class KernelError(RuntimeError):
    """The learner's code raised inside the isolated grading process."""


_GRADING_DIR = os.path.dirname(os.path.abspath(__file__))


def _learner_traceback(exc: BaseException) -> str:
    """The exception's traceback without the grader's own frames."""
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list(
        [fs for fs in te.stack if not fs.filename.startswith(_GRADING_DIR)]
    )
    return "".join(te.format())


def _child(conn, check, fn, kwargs):
    # A crash here is reported by the parent in words; Python's own fatal-error
    # dump of the child (when faulthandler is on, as under pytest) is noise.
    faulthandler.disable()
    # A parent that already ran a multi-threaded torch op (any op on more than
    # ~32k elements) leaves OpenMP's thread pool unusable in a forked child:
    # the child's next such op would wait forever for threads that were not
    # copied. One thread avoids OpenMP altogether; the checks' tensors are small.
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    try:
        outcome = ("passed", check(fn, **kwargs))
    except GradingError as exc:
        outcome = ("failed", str(exc))
    except BaseException as exc:  # the learner's error: send its traceback as text
        outcome = ("error", _learner_traceback(exc))
    try:
        conn.send(outcome)
    finally:
        conn.close()
        os._exit(0)


def _crash_message(exercise: str, exitcode: int) -> str:
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
    hint = ""
    if name in ("SIGSEGV", "SIGBUS", "SIGABRT"):
        hint = (
            " In Triton's CPU interpreter that almost always means an out-of-bounds "
            "`tl.load` or `tl.store`: every pointer whose offsets can pass the end of "
            "a tensor (the last, partial block of a sequence; a head index past the "
            "last head) needs a `mask=`, and loads need `other=`."
        )
    elif name == "SIGKILL":
        hint = " The system killed it, usually for using too much memory."
    return (
        f"{exercise}: your code crashed the grading process ({name}).{hint} "
        "Your notebook is fine: the check ran in a separate process."
    )


def _hang_message(exercise: str, timeout_s: float) -> str:
    return (
        f"{exercise}: the check did not finish within {timeout_s:g} s and was "
        "stopped. Look for a loop that never ends, or a grid launching far more "
        "programs than intended (in the interpreter each program runs one after another)."
    )


def is_cuda_fault(text: str) -> bool:
    """Whether an error's text says the GPU faulted (the CUDA context is then lost)."""
    return any(word in text for word in worker.CUDA_FAULT_WORDS)


def _cuda_fault_message(exercise: str, error: str, *, in_process: bool) -> str:
    last = next((line.strip() for line in reversed(error.strip().splitlines()) if line.strip()), error)
    where = (
        "This notebook's GPU state is now lost: restart the kernel (Kernel > Restart) "
        "and run the cells again."
        if in_process
        else "Your notebook is fine: the check ran in a separate process."
    )
    return (
        f"{exercise}: your kernel made the GPU fault ({last}). Likely cause: a `tl.load` "
        "or `tl.store` outside its tensor: every pointer whose offsets can pass the end "
        "of a tensor (the last, partial block; a head index past the last head) needs a "
        f"`mask=`, and loads need `other=`. {where} To see where it happens, run the same "
        f"check on the CPU, in Triton's interpreter: `course_utils.grading.check_on_cpu({exercise}, "
        "your_function)`."
    )


_WORKERS: dict[str, "worker.Worker"] = {}
_TOLD_IN_PROCESS = False


def _get_worker(device: str) -> "worker.Worker":
    w = _WORKERS.get(device)
    if w is None or not w.alive():
        w = _WORKERS[device] = worker.Worker(device)
    return w


def _tell_in_process_once(name: str, why: str) -> None:
    global _TOLD_IN_PROCESS
    if _TOLD_IN_PROCESS:
        return
    _TOLD_IN_PROCESS = True
    print(
        f"Note: {name} runs your code in this notebook's own process, because {why}. "
        "If your kernel faults on the GPU, the notebook must then be restarted, and a "
        "kernel that never ends cannot be stopped. (Said once.)",
        file=sys.stderr,
    )


def _run_in_worker(device: str, name: str, check, fn, kwargs, timeout_s: float):
    """Run ``check(fn, **kwargs)`` in a worker process on ``device``; see :mod:`.worker`."""
    payload = worker.dumps((check, fn, kwargs))  # raises if fn cannot travel
    w = _get_worker(device)
    try:
        kind, value, printed, cuda_broken = w.run(payload, timeout_s)
    except worker.WorkerTimeout:
        _WORKERS.pop(device, None)
        raise GradingError(_hang_message(name, timeout_s)) from None
    except worker.WorkerCrashed as exc:
        _WORKERS.pop(device, None)
        raise GradingError(_crash_message(name, exc.returncode or -signal.SIGSEGV)) from None
    if printed:
        sys.stdout.write(printed)
    if cuda_broken:
        _WORKERS.pop(device, None)
    if kind == "unpicklable":
        raise _CannotMove(value)
    if kind == "passed":
        return value
    if cuda_broken or (kind == "error" and is_cuda_fault(value)):
        raise GradingError(_cuda_fault_message(name, value, in_process=False))
    if kind == "failed":
        raise GradingError(value)
    raise KernelError(
        f"{name}: your code raised an error (it ran in a separate process; "
        f"its traceback follows).\n\n{value}"
    )


class _CannotMove(Exception):
    """The learner's function could not be rebuilt in the worker process."""


def _run_in_process(name: str, check, fn, kwargs):
    try:
        return check(fn, **kwargs)
    except GradingError:
        raise
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        if current().device == "cuda" and is_cuda_fault(text):
            raise GradingError(_cuda_fault_message(name, text, in_process=True)) from exc
        raise


def isolated(check: Callable) -> Callable:
    """Run ``check(fn, **kwargs)`` in a separate process, so the notebook survives.

    On the CPU: a forked child (a segfaulting interpreter kernel kills the
    child, not the notebook). On a GPU: a spawned worker process with its own
    CUDA context (:mod:`.worker`), started once and reused, so a kernel that
    faults CUDA or never ends is reported and the notebook's GPU stays usable.
    If the learner's function cannot be moved to that process, the check runs
    here and says so once.

    Messages name the check by its public name (``_check_x`` -> ``check_x``).
    The wrapped check takes ``isolate=None`` (auto: on), ``False`` (run
    in-process), ``"fork"``, ``"worker"``, and ``timeout_s``, the limit for
    the whole check.
    """

    @functools.wraps(check)
    def wrapper(fn, *, isolate: bool | str | None = None, timeout_s: float = 120.0, **kwargs):
        __tracebackhide__ = True
        name = check.__name__.lstrip("_")
        device = current().device
        if isolate is None or isolate is True:
            isolate = "fork" if device == "cpu" and hasattr(os, "fork") else "worker"
        if isolate is False:
            return _run_in_process(name, check, fn, kwargs)
        if isolate == "worker":
            try:
                return _run_in_worker(device, name, check, fn, kwargs, timeout_s)
            except _CannotMove as exc:
                _tell_in_process_once(name, f"your function could not be rebuilt in a separate process ({str(exc).strip().splitlines()[-1]})")
            except (worker.WorkerTimeout, worker.WorkerCrashed) as exc:  # the worker did not start
                _tell_in_process_once(name, f"the grading process could not start ({exc})")
            except GradingError:
                raise
            except Exception as exc:  # fn does not pickle
                if isinstance(exc, KernelError):
                    raise
                _tell_in_process_once(name, f"your function cannot be sent to a separate process ({type(exc).__name__}: {exc})")
            return _run_in_process(name, check, fn, kwargs)
        ctx = multiprocessing.get_context("fork")
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(sender, check, fn, kwargs), daemon=True)
        proc.start()
        sender.close()
        outcome = None
        if receiver.poll(timeout_s):
            try:
                outcome = receiver.recv()
            except EOFError:  # the child died before it could answer
                outcome = None
        else:
            proc.kill()
            proc.join()
            raise GradingError(_hang_message(name, timeout_s))
        proc.join(timeout=10)
        if outcome is None:
            raise GradingError(_crash_message(name, proc.exitcode or -signal.SIGSEGV))
        kind, value = outcome
        if kind == "passed":
            return value
        if kind == "failed":
            raise GradingError(value)
        raise KernelError(
            f"{name}: your code raised an error (it ran in a separate process; "
            f"its traceback follows).\n\n{value}"
        )

    wrapper.__wrapped__ = check
    return wrapper


def check_on_cpu(check: Callable, fn: Callable, **kwargs):
    """Run a Triton check with the kernels in Triton's interpreter on the CPU.

    On a GPU a bad memory access only says "illegal memory access"; in the
    interpreter the same kernel runs on CPU tensors, one program after
    another, so you can ``print`` inside it and an out-of-bounds access
    crashes with a message instead. The check runs in a separate process with
    the GPU hidden; your notebook's GPU is not touched. (Slower: keep to the
    check's small cases.)
    """
    name = getattr(check, "__name__", "check").lstrip("_")
    timeout_s = kwargs.pop("timeout_s", 600.0)
    kwargs["isolate"] = False  # in-process there: that process is the sandbox
    return _run_in_worker("cpu", name, check, fn, kwargs, timeout_s)


@contextlib.contextmanager
def count_launches():
    """Record the names of the Triton kernels launched inside the block.

    Yields a list that fills with kernel names. Works for compiled kernels
    (``JITFunction``), the interpreter (``InterpretedFunction``) and
    autotuned kernels (which launch through one of the two).
    """
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - every supported Triton has it
        pass
    launched: list[str] = []
    originals = {cls: cls.run for cls in classes}

    def make(original):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup:
                launched.append(getattr(self.fn, "__name__", "?"))
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        return run

    for cls, original in originals.items():
        cls.run = make(original)
    try:
        yield launched
    finally:
        for cls, original in originals.items():
            cls.run = original


def nan_padded(t, rows: int = 128, cols: int = 8, *, transpose_heads: bool = False):
    """A copy of ``t`` (``[B, H, N, D]``) living inside a NaN-filled buffer.

    The buffer has ``rows`` extra rows after each head's sequence (128, the
    largest block the course uses, so a whole unmasked tail block reads NaN)
    and ``cols`` extra columns after each row's ``D`` values. The view is not
    contiguous, and anything read past the last row or column is NaN, which
    then shows in the output. With ``transpose_heads`` the buffer is laid out
    ``[B, N, H, D]`` and viewed as ``[B, H, N, D]``, so the strides are not in
    the usual order either.
    """
    import torch

    B, H, N, D = t.shape
    nan = float("nan")
    if transpose_heads:
        buf = torch.full((B, N + rows, H, D + cols), nan, dtype=t.dtype, device=t.device)
        view = buf[:, :N, :, :D].permute(0, 2, 1, 3)
    else:
        buf = torch.full((B, H, N + rows, D + cols), nan, dtype=t.dtype, device=t.device)
        view = buf[:, :, :N, :D]
    view.copy_(t)
    return view
