"""How a check ended: the one place that runs a check and classifies its outcome.

Every way of running a check (in the notebook's process, in a forked child on
the CPU, in the grading worker on a GPU, in the batch grader) ends in one of:

- **passed**: the check returned a :class:`~.core.Passed`;
- **failed**: it raised a :class:`~.core.GradingError` (a wrong answer, with a
  message that teaches); the error's ``status`` says more: ``"failed"``,
  ``"timed_out"`` (:class:`TimedOut`: the learner's code ran past its limit) or
  ``"crashed"`` (:class:`Crashed`: the learner's code killed the process);
- **error**: the learner's code raised something else (its traceback is kept,
  without the grader's frames).

:func:`run_check` turns a call into a plain, picklable ``(kind, value,
status)`` triple where the check ran, and :func:`raise_outcome` turns that
triple back into the return value or the exception where the verdict is
wanted. The batch grader reads ``status`` from the exception, never from its
message. :data:`FATAL_GPU_ERRORS` is the one list of the errors after which a
CUDA context cannot be used again.
"""

from __future__ import annotations

import os
import signal
import traceback

from .core import Crashed, GradingError, TimedOut

__all__ = ["KernelError", "TimedOut", "Crashed", "FATAL_GPU_ERRORS", "run_check", "raise_outcome", "status_of",
           "is_cuda_fault", "crash_hint", "crash_message", "hang_message", "cuda_fault_message",
           "learner_traceback"]


class KernelError(RuntimeError):
    """The learner's code raised inside the isolated grading process."""


_BY_STATUS = {cls.status: cls for cls in (GradingError, TimedOut, Crashed)}

# Words in an error after which the CUDA context is unusable (every later CUDA call fails).
FATAL_GPU_ERRORS = (
    "illegal memory access",
    "illegal address",
    "address space",
    "misaligned address",
    "unspecified launch failure",
    "device-side assert",
    "an illegal instruction",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "AcceleratorError",
    "CUDA error",
)

_GRADING_DIR = os.path.dirname(os.path.abspath(__file__))


def learner_traceback(exc: BaseException) -> str:
    """The exception's traceback without the grader's own frames."""
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list(
        [fs for fs in te.stack if not fs.filename.startswith(_GRADING_DIR)]
    )
    return "".join(te.format())


def status_of(exc: BaseException) -> str:
    """``"failed"``, ``"timed_out"`` or ``"crashed"`` for a :class:`GradingError`; ``"error"`` for anything else."""
    return getattr(exc, "status", "failed") if isinstance(exc, GradingError) else "error"


def run_check(check, fn, kwargs) -> tuple:
    """Run ``check(fn, **kwargs)``; return ``(kind, value, status)``, picklable.

    ``("passed", Passed, "passed")``, ``("failed", message, status)`` or
    ``("error", learner's traceback as text, "error")``.
    """
    import numpy as np

    try:
        # Triton's interpreter computes masked-off lanes too (exp2 of -inf rows, NaN padding): NumPy's
        # floating-point warnings about them are noise in a learner's notebook, never a verdict.
        with np.errstate(all="ignore"):
            return ("passed", check(fn, **kwargs), "passed")
    except GradingError as exc:
        return ("failed", str(exc), status_of(exc))
    except BaseException as exc:  # the learner's error: its traceback as text
        return ("error", learner_traceback(exc), "error")


def raise_outcome(name: str, outcome: tuple):
    """The check's return value for a ``"passed"`` outcome; raise the matching exception otherwise."""
    kind, value, status = outcome
    if kind == "passed":
        return value
    if kind == "failed":
        raise _BY_STATUS.get(status, GradingError)(value)
    raise KernelError(
        f"{name}: your code raised an error (it ran in a separate process; "
        f"its traceback follows).\n\n{value}"
    )


def is_cuda_fault(text: str) -> bool:
    """Whether an error's text says the GPU faulted (the CUDA context is then lost)."""
    return any(word in text for word in FATAL_GPU_ERRORS)


def crash_hint(signal_name: str) -> str:
    """What a crash of the grading process by ``signal_name`` usually means (for :func:`crash_message`).

    SIGABRT is included: an out-of-bounds ``tl.store`` in the interpreter can
    corrupt the heap, and the allocator then aborts the process.
    """
    if signal_name in ("SIGSEGV", "SIGBUS", "SIGABRT"):
        return (
            " In Triton's CPU interpreter that almost always means an out-of-bounds "
            "`tl.load` or `tl.store`: every pointer whose offsets can pass the end of "
            "a tensor (the last, partial block of a sequence; a head index past the "
            "last head) needs a `mask=`, and loads need `other=`."
            + (" (SIGABRT: a store past the end corrupted memory the allocator then checked.)"
               if signal_name == "SIGABRT" else "")
        )
    if signal_name == "SIGKILL":
        return " The system killed it, usually for using too much memory."
    return ""


def crash_message(exercise: str, exitcode: int) -> str:
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
    hint = crash_hint(name)
    return (
        f"{exercise}: your code crashed the grading process ({name}).{hint} "
        "Your notebook is fine: the check ran in a separate process."
    )


def hang_message(exercise: str, timeout_s: float) -> str:
    return (
        f"{exercise}: the check did not finish within {timeout_s:g} s and was "
        "stopped. Look for a loop that never ends, or a grid launching far more "
        "programs than intended (in the interpreter each program runs one after another)."
    )


def cuda_fault_message(exercise: str, error: str, *, in_process: bool) -> str:
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
