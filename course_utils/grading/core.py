"""What every check shares: a graded run, comparisons, diagnoses, time limits.

A check (``check_softmax``, ``check_flash_gqa``, ...) is written as::

    def check_softmax(fn, *, seed=None):
        run = Run("check_softmax", seed)
        for case in ...:                       # fixed cases, then fresh random ones
            out = run.call(fn, x, axis=-1, case=case)
            got = run.array(out, expected_shape=x.shape, case=case)
            run.compare(got, expected, case=case, what="softmax",
                        diagnoses=[Diagnosis("...", expected=wrong_answer)])
        return run.passed()

- the learner's own exceptions propagate with their own traceback, plus a
  note naming the case; a wrong type, shape or dtype gets one plain sentence;
- a hang is stopped by a time limit (``SIGALRM`` in the main thread);
- a wrong value raises :class:`GradingError` (an ``AssertionError``) that names
  the case, the seed to reproduce it, the largest error and where it is, and
  the first :class:`Diagnosis` whose mistake the answer matches.

Fresh random cases use a new seed on every call, so a hard-coded answer
cannot pass; ``seed=`` replays a failing call exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import signal
import sys
import threading
from typing import Any, Callable, Iterable

import numpy as np

__all__ = [
    "GradingError",
    "TimedOut",
    "Crashed",
    "TimeLimitExceeded",
    "Forbidden",
    "require_callable",
    "Passed",
    "Diagnosis",
    "Run",
    "time_limit",
]


class GradingError(AssertionError):
    """A check found a wrong answer. The message says where, how wrong, and why.

    ``status`` is what the batch grader records (see :mod:`.outcome`): ``"failed"`` here,
    ``"timed_out"`` for :class:`TimedOut`, ``"crashed"`` for :class:`Crashed`.
    """

    status = "failed"


class TimedOut(GradingError):
    """The learner's code ran past its time limit and was stopped (status ``"timed_out"``)."""

    status = "timed_out"


class Crashed(GradingError):
    """The learner's code killed the process that ran it (status ``"crashed"``)."""

    status = "crashed"


class TimeLimitExceeded(BaseException):
    """The learner's function ran past its time limit.

    A ``BaseException``, like ``KeyboardInterrupt``: a learner's
    ``try: ... except Exception: continue`` cannot swallow it (that would make
    the check run forever), and Triton's interpreter, which wraps every
    ``Exception`` raised inside a kernel in its own error, lets it through.
    :meth:`Run.call` turns it into a :class:`GradingError`.
    """


class Forbidden(BaseException):
    """The learner's code took a shortcut a check does not allow (e.g. called a reference).

    Raised from inside the learner's call, so it is a ``BaseException`` that
    ``except Exception`` does not catch; :meth:`Run.call` turns it into a
    :class:`GradingError` whose message is this exception's.
    """


def require_callable(fn, exercise: str, what: str = "your function") -> None:
    """One plain sentence when ``fn`` is not something a check can call.

    Catches the two usual slips: passing something that is not a function
    (the result of calling it, a string, ...) and, for the Triton checks,
    passing the ``@triton.jit`` kernel itself instead of the Python launcher
    that allocates the output, picks a grid and launches the kernel.
    """
    __tracebackhide__ = True
    # A @triton.jit kernel (compiled or interpreted) or an autotuned/heuristic one; none exists before Triton is
    # imported, and a NumPy lesson's checks do not import it.
    jit = sys.modules.get("triton.runtime.jit")
    is_kernel = jit is not None and isinstance(fn, jit.KernelInterface)
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "")
    if is_kernel:
        raise GradingError(
            f"{exercise} expects {what} (the Python launcher that allocates the output, picks a grid "
            f"and runs `kernel[grid](...)`), but got the @triton.jit kernel `{name}` itself: pass your launcher."
        )
    if not callable(fn):
        raise GradingError(
            f"{exercise} expects a function, but got a {type(fn).__name__}: pass the function itself "
            f"(`{exercise}(my_function)`, without calling it)."
        )


@dataclasses.dataclass(frozen=True)
class Passed:
    """What a check returns on success: Jupyter shows it as one short line."""

    exercise: str
    cases: int
    seed: int
    max_error: float

    def __repr__(self) -> str:
        return (
            f"\u2705 {self.exercise}: passed {self.cases} cases "
            f"(largest error {self.max_error:.2g}; seed {self.seed})"
        )

    def __bool__(self) -> bool:
        return True


@dataclasses.dataclass
class Diagnosis:
    """A known mistake and how to recognise it in an answer.

    ``expected`` is what the mistaken code would return (an array, or a
    zero-argument callable computing it, evaluated only when needed); the
    answer matches when it is close to that. ``when`` is a predicate on the
    answer for mistakes that have no single wrong output (e.g. overflow).
    """

    message: str
    expected: Any = None
    when: Callable[[np.ndarray], bool] | None = None
    atol: float | None = None
    rtol: float | None = None

    def matches(self, actual: np.ndarray, atol: float, rtol: float) -> bool:
        if self.when is not None:
            with np.errstate(all="ignore"):
                return bool(self.when(actual))
        wrong = self.expected() if callable(self.expected) else self.expected
        if wrong is None:
            return False
        wrong = np.asarray(wrong, dtype=np.float64)
        if wrong.shape != actual.shape:
            return False
        a = atol if self.atol is None else self.atol
        r = rtol if self.rtol is None else self.rtol
        return bool(np.allclose(actual, wrong, atol=a, rtol=r, equal_nan=False))

    def distance(self, actual: np.ndarray, atol: float, rtol: float) -> float | None:
        """How far the answer is from this mistake's output, in tolerances (None: no single output)."""
        if self.when is not None:
            return None
        if self.expected is None:  # a subclass that re-enacts the mistake records it when it matches
            return getattr(self, "matched_distance", None)
        wrong = self.expected() if callable(self.expected) else self.expected
        return distance_to(actual, wrong, atol if self.atol is None else self.atol,
                         rtol if self.rtol is None else self.rtol)


def distance_to(actual, wrong, atol, rtol) -> float | None:
    """The largest ``|actual - wrong| / (atol + rtol * |wrong|)``, or None where it has no meaning."""
    if wrong is None:
        return None
    wrong = np.asarray(wrong, dtype=np.float64)
    if wrong.shape != actual.shape:
        return None
    with np.errstate(all="ignore"):
        d = np.abs(actual - wrong) / (atol + rtol * np.abs(wrong))
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else 0.0


def pick_diagnosis(diagnoses, actual, atol, rtol):
    """The diagnosis to name for this answer, or None.

    The first that matches, in the order given; but where it models a single
    wrong output, a later diagnosis that also matches and models an output
    closer to the answer wins. With a GPU's looser tolerances (tf32) two
    mistakes can both be within reach of an answer: the nearer one is named.
    """
    first = None
    for diagnosis in diagnoses:
        if not diagnosis.matches(actual, atol, rtol):
            continue
        if first is None:
            first = diagnosis
            best = diagnosis.distance(actual, atol, rtol)
            if best is None:
                return first
            continue
        d = diagnosis.distance(actual, atol, rtol)
        if d is not None and d < best:
            first, best = diagnosis, d
    return first


def time_limit_message(seconds: float, what: str) -> str:
    return (
        f"Your function ran for more than {seconds:g} s on {what} and was stopped: probably a loop "
        "that never ends (an index that never advances, a `while` whose condition stays true, a "
        "`range` whose step is 0), or a problem much larger than intended."
    )


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Stop the body with a :class:`TimeLimitExceeded` after ``seconds``.

    Uses ``SIGALRM``, so it only acts in the main thread on Unix (where
    Jupyter runs cells); elsewhere the body runs without a limit.
    """
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds is None:
        yield
        return

    def _on_alarm(signum, frame):
        raise TimeLimitExceeded(time_limit_message(seconds, what))

    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _time_limit_inside(exc: BaseException) -> TimeLimitExceeded | None:
    """The time limit hidden in ``exc``'s chain of causes, if any (Triton wraps errors)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (TimeLimitExceeded, Forbidden)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    return type(value).__name__


def _signature_mismatch(fn, args, kwargs) -> str | None:
    """One sentence when ``fn`` cannot take these arguments (its parameters, and how the check calls it)."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an object without a signature: just call it
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        given = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
        name = getattr(fn, "__name__", "your function")
        return (f"your function cannot take the arguments the check passes ({exc}): `{name}{signature}` is called "
                f"with {len(given)} argument{'s' if len(given) != 1 else ''} ({', '.join(given)}). Give it the "
                "signature the exercise asks for.")
    return None


def _fmt_index(idx: tuple[int, ...], axes: tuple[str, ...] | None) -> str:
    if axes and len(axes) == len(idx):
        return "[" + ", ".join(f"{a}={i}" for a, i in zip(axes, idx)) + "]"
    return "[" + ", ".join(str(i) for i in idx) + "]"


#: What runs around each call of the learner's function (:meth:`Run.call`): each entry, called before it,
#: returns ``finish()``, called after it, which returns a sentence that fails the call, or None. Empty in a
#: notebook; the batch grader adds :func:`course_utils.guard.learner_call_guard` where a verdict is computed in
#: the learner's process, so that what the function replaces in the modules the checks trust is put back.
LEARNER_CALL_GUARDS: list = []


class Run:
    """One call of a check: its seed, its cases and the largest error seen."""

    def __init__(self, exercise: str, seed: int | None = None, time_limit_s: float = 10.0):
        self.exercise = exercise
        self.seed = secrets.randbelow(2**31) if seed is None else int(seed)
        self.rng = np.random.default_rng(self.seed)
        self.time_limit_s = time_limit_s
        self.cases = 0
        self.max_error = 0.0

    # -- describing cases -------------------------------------------------
    def where(self, case: str) -> str:
        """A case's name plus how to reproduce it."""
        return f"case {case!s} (reproduce with `{self.exercise}(fn, seed={self.seed})`)"

    # -- calling the learner ----------------------------------------------
    def call(self, fn: Callable, *args, case: str, **kwargs):
        """Call the learner's ``fn`` under a time limit.

        Their exceptions keep their own traceback and gain a note naming the
        case; ``__tracebackhide__`` keeps the grader's frames out of
        IPython's and pytest's tracebacks.
        """
        __tracebackhide__ = True
        self.cases += 1
        mismatch = _signature_mismatch(fn, args, kwargs)
        if mismatch is not None:
            raise self.fail(mismatch, case)
        try:
            with time_limit(self.time_limit_s, self.where(case)):
                finish = [guard() for guard in LEARNER_CALL_GUARDS]
                try:
                    return fn(*args, **kwargs)
                except GradingError:
                    raise
                except Exception as exc:  # the learner's own error: show it as theirs
                    timeout = _time_limit_inside(exc)
                    if timeout is not None:  # wrapped by Triton's interpreter: unwrap it
                        raise timeout from None
                    exc.add_note(f"[{self.exercise}] raised by your function on {self.where(case)}")
                    raise
                finally:
                    problems = [p for p in (done() for done in finish) if p]
                    if problems:
                        raise Forbidden(problems[0])
        except TimeLimitExceeded as exc:
            raise TimedOut(f"{self.exercise} failed on {self.where(case)}:\n{exc}") from None
        except Forbidden as exc:
            raise GradingError(f"{self.exercise} failed on {self.where(case)}:\n{exc}") from None

    # -- checking what came back ------------------------------------------
    def fail(self, message: str, case: str) -> GradingError:
        """A :class:`GradingError` for ``case`` (raise it)."""
        return GradingError(f"{self.exercise} failed on {self.where(case)}:\n{message}")

    def array(self, out, *, expected_shape, case: str, name: str = "your function's result") -> np.ndarray:
        """Check the type and shape of a NumPy answer and return it as float64."""
        __tracebackhide__ = True
        if out is None:
            raise self.fail(f"{name} is None: did you forget a `return`?", case)
        if hasattr(out, "detach") and hasattr(out, "cpu"):  # a torch tensor
            out = out.detach().cpu().float().numpy()
        if not isinstance(out, np.ndarray):
            raise self.fail(f"{name} is a {type(out).__name__}; return a NumPy array.", case)
        if not np.issubdtype(out.dtype, np.floating):
            raise self.fail(f"{name} has dtype {out.dtype}; it should be a floating-point array.", case)
        if tuple(out.shape) != tuple(expected_shape):
            raise self.fail(
                f"{name} has shape {tuple(out.shape)}, expected {tuple(expected_shape)}.", case
            )
        return out.astype(np.float64)

    def compare(
        self,
        actual: np.ndarray,
        expected: np.ndarray,
        *,
        case: str,
        what: str,
        atol: float,
        rtol: float,
        diagnoses: Iterable[Diagnosis] = (),
        axes: tuple[str, ...] | None = None,
        extra_tol: np.ndarray | float = 0.0,
    ) -> float:
        """Compare ``actual`` with the float64 ``expected``; explain a mismatch.

        Each element's tolerance is ``atol + rtol * |expected| + extra_tol`` (``extra_tol``, an array of
        ``expected``'s shape or a number: what a right answer's own roundings may add where ``expected`` is a sum of
        large terms that cancel). Returns the largest absolute error. On a mismatch raises a
        :class:`GradingError` naming the largest error, its index (with axis
        names from ``axes``), how many elements are off, and the first
        diagnosis that matches.
        """
        __tracebackhide__ = True
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        with np.errstate(all="ignore"):
            err = np.abs(actual - expected)
            tol = atol + rtol * np.abs(expected) + extra_tol
        bad_nan = ~np.isfinite(actual) & np.isfinite(expected)
        bad = (err > tol) | bad_nan
        if not bad.any():
            worst = float(np.nanmax(err)) if err.size else 0.0
            self.max_error = max(self.max_error, worst)
            return worst
        if bad_nan.any():
            idx = tuple(int(i) for i in np.argwhere(bad_nan)[0])
            head = (
                f"{what} holds {int(bad_nan.sum())} non-finite values (NaN or inf) out of {bad.size}; "
                f"the first is at {_fmt_index(idx, axes)} (got {actual[idx]}, expected {expected[idx]:.6g})."
            )
        else:
            excess = np.where(bad, err - tol, -np.inf)
            idx = tuple(int(i) for i in np.unravel_index(np.argmax(excess), err.shape))
            head = (
                f"{what} is wrong in {int(bad.sum())} of {bad.size} elements. Largest error "
                f"{float(np.max(np.where(bad, err, 0))):.3g}; at {_fmt_index(idx, axes)} got "
                f"{actual[idx]:.6g}, expected {expected[idx]:.6g} (tolerance {tol[idx]:.2g})."
            )
        diagnosis = pick_diagnosis(diagnoses, actual, atol, rtol)
        if diagnosis is not None:
            head += f"\nLikely cause: {diagnosis.message}"
        raise self.fail(head, case)

    def passed(self) -> Passed:
        """The success value every check returns."""
        return Passed(self.exercise, self.cases, self.seed, self.max_error)
