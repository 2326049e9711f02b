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
import dataclasses
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

__all__ = ["isolated", "check_on_cpu", "is_cuda_fault", "count_launches", "nan_padded", "KernelError", "Work",
           "references_forbidden", "crash_hint"]


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
    hint = crash_hint(name)
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
def crash_hint(signal_name: str) -> str:
    """What a crash of the grading process by ``signal_name`` usually means (for :func:`_crash_message`).

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


def _kernel_classes():
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - every supported Triton has it
        pass
    return classes


@contextlib.contextmanager
def _patched_launches(on_launch):
    """Route every Triton launch through ``on_launch(kernel, args, kwargs, launch)``.

    ``kernel`` is the ``JITFunction``/``InterpretedFunction`` (autotuned and
    heuristic kernels end in one of them), ``launch()`` runs it. Warm-ups
    (compilation only) go straight through.
    """
    originals = {cls: cls.__dict__["run"] for cls in _kernel_classes()}

    def make(original):
        def run(self, *args, grid, warmup, **kwargs):
            if warmup:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            return on_launch(self, args, kwargs,
                             lambda: original(self, *args, grid=grid, warmup=warmup, **kwargs))

        return run

    for cls, original in originals.items():
        cls.run = make(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def _kernel_name(kernel) -> str:
    return getattr(getattr(kernel, "fn", None), "__name__", None) or getattr(kernel, "__name__", "?")


def _is_course_kernel(kernel) -> bool:
    """A kernel defined in ``course_utils`` (not by the learner)."""
    module = getattr(getattr(kernel, "fn", None), "__module__", "") or ""
    return module == "course_utils" or module.startswith("course_utils.")


@contextlib.contextmanager
def count_launches():
    """Record the names of the Triton kernels launched inside the block.

    Yields a list that fills with kernel names. Works for compiled kernels
    (``JITFunction``), the interpreter (``InterpretedFunction``) and
    autotuned kernels (which launch through one of the two). For what each
    launch wrote, and whether the answer came from it, see :class:`Work`.
    """
    launched: list[str] = []

    def on_launch(kernel, args, kwargs, launch):
        launched.append(_kernel_name(kernel))
        try:
            return launch()
        except RuntimeError as exc:
            _explain_no_driver(exc)
            raise

    with _patched_launches(on_launch):
        yield launched


# -----------------------------------------------------------------------------
# Proof of work: which kernel wrote the tensors an answer returns
# -----------------------------------------------------------------------------
MSG_TRITON_TOO_EARLY = (
    "Triton found no GPU driver (\"0 active drivers\"): Triton was imported before "
    "`import course_utils`, so it did not see TRITON_INTERPRET=1 and looked for a GPU. Restart the "
    "kernel (Kernel -> Restart) and run the notebook from the top: `import course_utils` must be the "
    "first import, before torch and triton."
)


def _explain_no_driver(exc: BaseException) -> None:
    """Add the restart advice to Triton's bare "0 active drivers" error (in place)."""
    if "active drivers" in str(exc) and not any(MSG_TRITON_TOO_EARLY in n for n in getattr(exc, "__notes__", ())):
        exc.add_note(MSG_TRITON_TOO_EARLY)


_MATMUL_OPS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv", "addmv", "linear",
               "_scaled_mm", "einsum", "tensordot", "_addmm_activation"}
_EXP_OPS = {"exp", "exp_", "exp2", "exp2_", "expm1", "expm1_", "special_exp2"}


def _a_matrix(out) -> bool:
    """Whether a product's result is a matrix (both of its last two dims > 1), like scores or p @ v."""
    shape = getattr(out, "shape", ())
    return len(shape) >= 2 and shape[-1] > 1 and shape[-2] > 1


def _forbidden_name(op: str) -> str | None:
    """What a learner wrote to get aten operator ``op``, if it computes the answer another way."""
    if "attention" in op or "scaled_dot_product" in op or "_fused_sdp" in op:
        return "attention (torch.nn.functional.scaled_dot_product_attention or similar)"
    if "softmax" in op:
        return "a softmax (torch.softmax, F.softmax, Tensor.softmax or log_softmax)"
    if "logsumexp" in op:
        return "a logsumexp (torch.logsumexp)"
    if op in _MATMUL_OPS:
        return "a matrix product (@, torch.matmul, torch.einsum, torch.bmm)"
    if op in _EXP_OPS:
        return "an exponential (torch.exp / torch.exp2)"
    return None


# Operators that only allocate or fill memory: what they produce was computed by nobody.
_ALLOC_OPS = {
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "zeros", "zeros_like",
    "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "fill", "fill_", "zero_",
    "scalar_tensor", "arange", "lift_fresh", "lift_fresh_copy", "resize_",
}
_SCALAR_NUMEL = 1  # tensors this small are scalars (a scale, a count), not data


def _tensors_in(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)
    elif hasattr(value, "base") and isinstance(getattr(value, "base"), torch.Tensor):  # a TensorDescriptor
        yield value.base


def _storage_key(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, fake)
        return None


@dataclasses.dataclass
class Launch:
    """One Triton launch: the kernel's name, whether it is one of the course's, its tensor storages."""

    name: str
    course: bool
    storages: set


def _dispatch_mode_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Watch(TorchDispatchMode):
        """Sees every torch operator (below autograd) while the learner's function runs."""

        def __init__(self, work):
            super().__init__()
            self.work = work

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not self.work._busy:
                self.work._saw_op(func, args, kwargs, out)
            return out

    return _Watch


class Work:
    """Proof that the learner's own Triton kernels produced the answer.

    Used around the learner's call::

        with sandbox.Work(inputs=(q, k, v)) as work:
            out = run.call(fn, q, k, v, case=case)
        problem = work.problem(o=out)   # None, or one plain sentence

    While active it records every Triton launch with the storages of its tensor
    arguments, and watches every torch operator (a ``TorchDispatchMode``, so
    ``torch.softmax``, ``F.scaled_dot_product_attention``, ``@``, ``Tensor.exp``
    and autograd's own math are all seen, on the CPU and on a GPU). It keeps,
    for each storage, who wrote it last: one of the learner's kernels, one of
    ``course_utils``'s, a torch operator, or an allocation. Copies, views and
    dtype conversions keep what they copy; any other torch operator makes its
    result "computed by torch". A kernel argument counts as written by the
    kernel unless torch had computed it before the launch and the launch left
    it unchanged (a kernel that does nothing with it). The graded inputs keep
    being inputs whatever kernel received them.

    :meth:`problem` then says what is wrong, in order: a forbidden torch
    operator ran (attention, softmax, logsumexp, matrix products, exp), a
    course kernel ran (unless ``course_kernels_ok``), no kernel of the
    learner's ran, or a graded tensor was not last written by one of the
    learner's kernels during this call (a memoised answer fails here too).
    """

    def __init__(self, *, inputs=(), course_kernels_ok: bool = False, watch_torch: bool = True):
        self.course_kernels_ok = course_kernels_ok
        self.watch_torch = watch_torch
        self.launches: list[Launch] = []
        self.detected: list[tuple[str, str]] = []  # (what, aten operator)
        self.writer: dict[int, tuple[str, str]] = {}  # storage -> (kind, name)
        self._busy = False
        self._inputs = [t for t in inputs if t is not None]
        for t in self._inputs:
            key = _storage_key(t)
            if key is not None:
                self.writer[key] = ("input", "")

    # -- recording ------------------------------------------------------------
    def _kind_of(self, t) -> tuple[str, str] | None:
        key = _storage_key(t)
        return None if key is None else self.writer.get(key)

    def _saw_op(self, func, args, kwargs, out):
        schema = func._schema
        op = schema.name.split("::")[-1]
        if self.watch_torch:
            what = _forbidden_name(op)
            if what is not None and op in _MATMUL_OPS and not _a_matrix(out):
                what = None  # a row-wise dot product (e.g. delta = sum(o * do) by einsum), not a score matrix
            if what is not None:
                self.detected.append((what, f"aten.{op}"))
        written, read = [], []
        for i, a in enumerate(schema.arguments):
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write:
                written += list(_tensors_in(value))
                if op.endswith("_") and op not in ("copy_",) and "out" not in schema.overload_name:
                    read += list(_tensors_in(value))  # x.mul_(2) reads x too
            else:
                read += list(_tensors_in(value))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for r, o in zip(schema.returns, outs):
            if r.alias_info is None:  # a fresh tensor, not a view of an argument
                written += list(_tensors_in(o))
        if not written:
            return
        if op in _ALLOC_OPS:
            origin = ("alloc", op)
        else:
            kinds = [self._kind_of(t) for t in read if t.numel() > _SCALAR_NUMEL]
            if kinds and all(k is not None and k[0] in ("learner", "course") for k in kinds):
                origin = next((k for k in kinds if k[0] == "course"), kinds[0])  # a copy keeps its origin
            else:
                origin = ("torch", op)
        for t in written:
            key = _storage_key(t)
            if key is not None and self.writer.get(key, ("",))[0] != "input":
                self.writer[key] = origin

    def _on_launch(self, kernel, args, kwargs, launch):
        import torch

        name, course = _kernel_name(kernel), _is_course_kernel(kernel)
        tensors = list(_tensors_in(list(args) + list(kwargs.values())))
        self._busy = True  # the interpreter's own copies are not the learner's torch code
        try:
            before = {}
            for t in tensors:
                key = _storage_key(t)
                if key is not None and key not in before and self.writer.get(key, ("",))[0] == "torch":
                    storage = t.untyped_storage()
                    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                    before[key] = (raw, raw.clone())
            try:
                result = launch()
            except RuntimeError as exc:
                _explain_no_driver(exc)
                raise
            keys = set()
            for t in tensors:
                key = _storage_key(t)
                if key is None or key in keys:
                    continue
                keys.add(key)
                if self.writer.get(key, ("",))[0] == "input":
                    continue
                if key in before and torch.equal(before[key][0], before[key][1]):
                    continue  # computed by torch, and the kernel left it as it was
                self.writer[key] = ("course" if course else "learner", name)
            self.launches.append(Launch(name, course, keys))
            return result
        finally:
            self._busy = False

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_patched_launches(self._on_launch))
        self._stack.enter_context(references_forbidden())
        self._stack.enter_context(self._leaving_torch())
        self._stack.enter_context(_dispatch_mode_class()(self))
        return self

    @contextlib.contextmanager
    def _leaving_torch(self):
        """Note ``Tensor.numpy()`` / ``.tolist()`` by the learner: the answer computed outside torch and Triton."""
        import torch

        names = ("numpy", "tolist")
        saved = {name: torch.Tensor.__dict__.get(name) for name in names}  # None: inherited from TensorBase
        work = self

        def make(name, original):
            def method(self, *args, **kwargs):
                if not work._busy and self.numel() > _SCALAR_NUMEL:
                    work.detected.append(("", f"Tensor.{name}"))
                return original(self, *args, **kwargs)
            return method

        for name in names:
            setattr(torch.Tensor, name, make(name, getattr(torch.Tensor, name)))
        try:
            yield
        finally:
            for name, original in saved.items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)

    def __exit__(self, *exc):
        self._stack.close()
        return False

    # -- the verdict -----------------------------------------------------------
    @property
    def learner_launches(self) -> list[Launch]:
        return [launch for launch in self.launches if not launch.course]

    def problem(self, no_kernel: str | None = None, **graded) -> str | None:
        """One plain sentence if the graded tensors were not produced by the learner's kernels.

        ``no_kernel`` replaces the sentence for "no kernel of yours ran".
        """
        if self.detected:
            what, op = self.detected[0]
            if op.startswith("Tensor."):
                return (
                    f"while your function ran, the data left torch ({op}()): computing the answer in NumPy "
                    "or Python and copying it with a kernel does not count. Compute it inside your "
                    "@triton.jit kernel."
                )
            return (
                f"while your function ran, torch computed {what} ({op}). The answer must come from "
                "your own @triton.jit kernel: compute it inside the kernel (tl.dot, tl.exp, tl.max, "
                "tl.sum), and use torch only to allocate the outputs and pass strides."
            )
        course = [launch.name for launch in self.launches if launch.course]
        if course and not self.course_kernels_ok:
            return (
                f"your function ran course_utils's own kernel `{course[0]}` (through "
                "course_utils.kernels): the check grades your kernel, so launch the one you wrote."
            )
        if not any(not launch.course or self.course_kernels_ok for launch in self.launches):
            return no_kernel or (
                "no Triton kernel of yours ran: your function must compute the answer by launching your "
                "@triton.jit kernel (`kernel[grid](...)`), not with torch code or course_utils's kernels."
            )
        import torch

        for name, t in graded.items():
            if not isinstance(t, torch.Tensor):
                continue
            origin = self._kind_of(t)
            kind, op = origin if origin is not None else (None, "")
            if kind == "learner" or (kind == "course" and self.course_kernels_ok):
                continue
            if kind == "torch":
                why = f"it was computed by torch (aten.{op}) after or instead of your kernel"
            elif kind == "alloc":
                why = f"it was allocated (aten.{op}) but none of your kernels was given it to write"
            elif kind == "course":
                why = f"course_utils's kernel `{op}` wrote it"
            elif kind == "input":
                why = "it is one of the inputs"
            else:
                why = ("it was not written by any kernel during this call (a result kept from an earlier "
                       "call, or made before it)")
            return (
                f"{name} was not written by your Triton kernel: {why}. Allocate {name} in your "
                f"function, pass it to your @triton.jit kernel and `tl.store` the result into it."
            )
        return None


def snapshot(**tensors) -> dict:
    """Copies of the learner's inputs, to compare with after the call (:func:`changed_input`)."""
    return {name: t.detach().clone() for name, t in tensors.items()}


def changed_input(before: dict, **tensors) -> str | None:
    """A sentence naming the first input the learner's function modified in place, if any."""
    import torch

    for name, t in tensors.items():
        old = before[name]
        same = torch.equal(t.detach(), old) or bool(
            torch.equal(torch.isnan(t.detach()), torch.isnan(old))
            and torch.equal(torch.nan_to_num(t.detach()), torch.nan_to_num(old)))
        if not same:
            return (
                f"your function changed its input `{name}` in place (e.g. `{name} *= ...`, `{name}.mul_(...)`, "
                f"or a kernel storing into `{name}`): the caller's tensor must stay as it was. Work on a "
                "new tensor, or fold the change into the kernel (e.g. scale the scores, not the keys)."
            )
    return None


# -----------------------------------------------------------------------------
# The references (NumPy): off limits while the learner's function runs
# -----------------------------------------------------------------------------
_TRAPPED_REFERENCES = (
    "softmax", "attention_lse", "attention", "online_softmax", "online_softmax_states", "tiled_attention",
    "attention_backward", "tiled_attention_backward",
)


def _reference_called(code):
    from .core import Forbidden

    raise Forbidden(
        f"your function called course_utils.references.{code.co_name}: the references are what the "
        "check compares with, so they cannot be the answer. Write the computation yourself."
    )


def _trap(*args, **kwargs):
    return __import__("course_utils.grading.sandbox", fromlist=["_reference_called"])._reference_called(
        __import__("sys")._getframe().f_code)


@contextlib.contextmanager
def references_forbidden(names=_TRAPPED_REFERENCES):
    """While active, calling a :mod:`course_utils.references` function raises :class:`.core.Forbidden`.

    The functions' code is swapped (not the module's attributes), so a name the
    learner imported earlier (``from course_utils.references import attention``)
    is caught too. The exception is a ``BaseException``: ``except Exception``
    in the learner's code does not hide it.
    """
    from .. import references

    saved = {}
    for name in names:
        fn = getattr(references, name, None)
        if fn is None or not hasattr(fn, "__code__") or fn.__code__.co_freevars:
            continue
        saved[fn] = fn.__code__
        fn.__code__ = _trap.__code__.replace(co_name=name)
    try:
        yield
    finally:
        for fn, code in saved.items():
            fn.__code__ = code


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
