"""Running a check where the learner's code cannot take the notebook down with it.

In the CPU interpreter an out-of-bounds access far enough away segfaults the
whole Python process, which in Jupyter means the learner's kernel dies and their
work with it; on a GPU a bad access leaves the process's CUDA context unusable,
and CUDA does not survive a fork. :func:`isolated` therefore runs a check in a
forked child on the CPU, and in the grading worker process (:mod:`.worker`) on a
GPU, and turns a crash, a hang or an error there into a readable message here.
How the outcome is classified is :mod:`.outcome`'s job, the same on every path.
"""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing
import os
import signal
import sys
from typing import Callable

from ..environment import current
from ..transport import dumps
from . import worker
from .core import Crashed, GradingError, TimedOut
from .outcome import KernelError, crash_message, cuda_fault_message, hang_message, is_cuda_fault, raise_outcome, run_check

__all__ = ["run_isolated", "isolated", "check_on_cpu"]


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
    outcome = run_check(check, fn, kwargs)
    try:
        conn.send(outcome)
    finally:
        conn.close()
        os._exit(0)


def _run_in_fork(name: str, check, fn, kwargs, timeout_s: float):
    """Run ``check(fn, **kwargs)`` in a forked child (the CPU's isolation)."""
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
        raise TimedOut(hang_message(name, timeout_s))
    proc.join(timeout=10)
    if outcome is None:
        raise Crashed(crash_message(name, proc.exitcode or -signal.SIGSEGV))
    return raise_outcome(name, outcome)


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


class _CannotMove(Exception):
    """The learner's function could not be rebuilt in the worker process."""


def _run_in_worker(device: str, name: str, check, fn, kwargs, timeout_s: float):
    """Run ``check(fn, **kwargs)`` in a worker process on ``device``; see :mod:`.worker`."""
    payload = dumps((check, fn, kwargs))  # raises if fn cannot travel
    w = _get_worker(device)
    try:
        outcome, printed, cuda_broken = w.run(payload, timeout_s)
    except worker.WorkerTimeout:
        _WORKERS.pop(device, None)
        raise TimedOut(hang_message(name, timeout_s)) from None
    except worker.WorkerCrashed as exc:
        _WORKERS.pop(device, None)
        raise Crashed(crash_message(name, exc.returncode or -signal.SIGSEGV)) from None
    if printed:
        sys.stdout.write(printed)
    if cuda_broken:
        _WORKERS.pop(device, None)
    kind, value, _ = outcome
    if kind == "unpicklable":
        raise _CannotMove(value)
    if kind != "passed" and (cuda_broken or (kind == "error" and is_cuda_fault(value))):
        raise GradingError(cuda_fault_message(name, value, in_process=False))
    return raise_outcome(name, outcome)


def _run_in_process(name: str, check, fn, kwargs):
    try:
        return check(fn, **kwargs)
    except GradingError:
        raise
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        if current().device == "cuda" and is_cuda_fault(text):
            raise GradingError(cuda_fault_message(name, text, in_process=True)) from exc
        raise


def run_isolated(name: str, check: Callable, fn, kwargs: dict, *, isolate: bool | str | None = None,
                 timeout_s: float = 120.0):
    """Run ``check(fn, **kwargs)`` in a separate process, so the notebook survives; name it ``name``.

    On the CPU: a forked child (a segfaulting interpreter kernel kills the
    child, not the notebook). On a GPU: a spawned worker process with its own
    CUDA context (:mod:`.worker`), started once and reused, so a kernel that
    faults CUDA or never ends is reported and the notebook's GPU stays usable.
    If the learner's function cannot be moved to that process, the check runs
    here and says so once.

    ``isolate``: None or True (auto: on), False (run in-process), ``"fork"``,
    ``"worker"``; ``timeout_s``: the limit for the whole check.
    """
    __tracebackhide__ = True
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
    return _run_in_fork(name, check, fn, kwargs, timeout_s)


def isolated(check: Callable) -> Callable:
    """``check`` wrapped by :func:`run_isolated`, named by its public name (``_check_x`` -> ``check_x``).

    The wrapped check takes ``isolate=`` and ``timeout_s=`` besides the check's own arguments.
    """

    @functools.wraps(check)
    def wrapper(fn, *, isolate: bool | str | None = None, timeout_s: float = 120.0, **kwargs):
        __tracebackhide__ = True
        return run_isolated(check.__name__.lstrip("_"), check, fn, kwargs, isolate=isolate, timeout_s=timeout_s)

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
    return in_cpu_interpreter(name, check, fn, kwargs, timeout_s)


def in_cpu_interpreter(name: str, check: Callable, fn, kwargs: dict, timeout_s: float = 600.0):
    """``check(fn, **kwargs)`` in the CPU worker (Triton's interpreter, the GPU hidden): its result or its error."""
    return _run_in_worker("cpu", name, check, fn, kwargs, timeout_s)
