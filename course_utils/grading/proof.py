"""Proof of work: the learner's own Triton kernels produced the answer, and nothing else did.

- :func:`count_launches` records every Triton kernel launched while it is active;
- :class:`Work` records, for each tensor storage, who wrote it last (one of the
  learner's kernels, one of the course's, a torch operator, an allocation), and
  sees every torch operator the learner's function runs, so :meth:`Work.problem`
  can say in one sentence why an answer is not the learner's own;
- :func:`references_forbidden` makes :mod:`course_utils.references` refuse to
  answer while the learner's function runs.
"""

from __future__ import annotations

import contextlib
import dataclasses

from ..transport import kernel_classes
from .core import Forbidden

__all__ = ["count_launches", "watching_learner_launches", "Work", "Launch", "references_forbidden", "answer_keys_forbidden", "active_traps", "trapped",
           "MSG_TRITON_TOO_EARLY"]


@contextlib.contextmanager
def _patched_launches(on_launch):
    """Route every Triton launch through ``on_launch(kernel, args, kwargs, launch)``.

    ``kernel`` is the ``JITFunction``/``InterpretedFunction`` (autotuned and
    heuristic kernels end in one of them), ``launch()`` runs it. Warm-ups
    (compilation only) go straight through.
    """
    originals = {cls: cls.__dict__["run"] for cls in kernel_classes()}

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


@contextlib.contextmanager
def watching_learner_launches(before_launch):
    """Call ``before_launch(name, kernel, args, kwargs, tensors)`` before each launch of a kernel not the course's.

    ``tensors``: the launch's tensor arguments (a ``TensorDescriptor``'s base too). What it raises
    stops the launch (a :class:`.core.Forbidden` reaches the check). For checks that judge how the
    learner launched (tile sizes, the layout of the tensors a kernel got).
    """
    def on_launch(kernel, args, kwargs, launch):
        if not _is_course_kernel(kernel):
            before_launch(_kernel_name(kernel), kernel, args, kwargs, list(_tensors_in(list(args) + list(kwargs.values()))))
        return launch()

    with _patched_launches(on_launch):
        yield


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

        @classmethod
        def _should_skip_dynamo(cls):
            # Read by TorchDispatchMode.__init_subclass__ (torch >= 2.6): by default torch wraps a mode's
            # dispatch in torch._dynamo.disable, and the first call then imports torch._dynamo (1.5-1.8 s in
            # each forked check and each spawned ring rank). The watch never runs under torch.compile.
            return False

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
                # Outside the torch watch: Triton's interpreter runs many torch operators per program,
                # which the watch would ignore anyway (_busy) but still see one by one (4x slower launches).
                from torch.utils._python_dispatch import _disable_current_modes

                with _disable_current_modes():
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



# -----------------------------------------------------------------------------
# The references (NumPy): off limits while the learner's function runs
# -----------------------------------------------------------------------------
_TRAPPED_REFERENCES = (
    "softmax", "attention_lse", "attention", "online_softmax", "online_softmax_states", "tiled_attention",
    "attention_backward", "tiled_attention_backward", "decode_partials", "merge_partials", "decode_attention",
)


def _forbidden_called(code):
    # ``code.co_name`` is the trapped function's qualified name (see _swapped).
    if code.co_name.startswith("course_utils.references."):
        raise Forbidden(
            f"your function called {code.co_name}: the references are what the "
            "check compares with, so they cannot be the answer. Write the computation yourself."
        )
    raise Forbidden(
        f"your function called {code.co_name}: it is the course's own answer to this exercise, so it cannot "
        "be the answer. Write it yourself."
    )


def _trap(*args, **kwargs):
    return __import__("course_utils.grading.proof", fromlist=["_forbidden_called"])._forbidden_called(
        __import__("sys")._getframe().f_code)


@contextlib.contextmanager
def _swapped(functions):
    """While active, each of ``functions`` raises :class:`.core.Forbidden` when called.

    The functions' code is swapped (not a module's attributes), so a name the
    learner imported earlier (``from course_utils.references import attention``)
    is caught too. The exception is a ``BaseException``: ``except Exception``
    in the learner's code does not hide it.
    """
    saved = {}
    names = []
    for fn in functions:
        if not hasattr(fn, "__code__") and hasattr(getattr(fn, "fn", None), "__code__"):
            fn = fn.fn  # a @gluon.jit / @triton.jit function: its Python (what gluon_cpu runs) refuses
        if fn is None or not hasattr(fn, "__code__") or fn.__code__.co_freevars:
            continue
        saved[fn] = fn.__code__
        names.append(f"{fn.__module__}.{fn.__name__}")
        fn.__code__ = _trap.__code__.replace(co_name=names[-1])
    _ACTIVE_TRAPS.extend(names)
    try:
        yield
    finally:
        for fn, code in saved.items():
            fn.__code__ = code
        for name in names:
            _ACTIVE_TRAPS.remove(name)


#: The qualified names of the functions a check has made refuse to answer right now (:func:`_swapped`): where the
#: learner's function runs in another process (the batch grader, :mod:`course_utils.grade_checks`), the same
#: functions are made to refuse there while it is called.
_ACTIVE_TRAPS: list = []


def active_traps() -> tuple:
    """The qualified names of the course functions that refuse to answer at this moment."""
    return tuple(_ACTIVE_TRAPS)


def trapped(names):
    """A context in which each of ``names`` (qualified names of course functions) refuses to answer."""
    import importlib

    functions = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            functions.append(getattr(importlib.import_module(module), attr, None))
        except ImportError:
            continue
    return _swapped(functions)


def references_forbidden(names=_TRAPPED_REFERENCES):
    """While active, calling a :mod:`course_utils.references` function raises :class:`.core.Forbidden`."""
    from .. import references

    return _swapped([getattr(references, name, None) for name in names])


def answer_keys_forbidden(*functions):
    """While active, calling one of ``functions`` (the course's own answer to the exercise) raises ``Forbidden``.

    For helpers a lesson shows beside an exercise (lesson 08 imports ``window_tile_bounds`` two cells
    before asking for it).
    """
    return _swapped(functions)
