"""Checks for lesson 03, Triton basics: a fused row softmax in Triton.

:func:`check_triton_softmax` grades ``fn(x)``, which must return the softmax
of each row of a 2-D torch tensor, computed by a Triton kernel. The cases are
built to expose the usual first-kernel mistakes one at a time:

- a Triton kernel must run (``torch.softmax`` inside ``fn`` is turned down);
- widths that are not a power of two (1 to 300 columns) leave a masked tail
  in the last block; the inputs live inside NaN-filled buffers, so a load
  without ``mask=`` reads NaN, which then shows in the output;
- rows that are not contiguous with each other (row stride > number of
  columns, NaN between the rows), so a kernel that steps from row to row by
  ``n_cols`` instead of the row stride reads NaN or the wrong numbers;
- rows around +-1000, where ``exp`` without the max subtracted overflows;
- the output the learner allocates (``torch.empty_like(x)``, ``torch.empty``,
  ``torch.zeros_like``, ``torch.zeros`` with ``x``'s shape) is followed by a
  guard zone, so a ``tl.store`` without ``mask=`` that writes past the end of
  the last row is caught, not left to corrupt a neighbouring tensor;
- float32 and float16 everywhere, bfloat16 too on a GPU (the interpreter's
  bf16 is unreliable, so it is not used on the CPU).

Each diagnosis is recognised by simulating the mistaken kernel in NumPy (or,
for mistakes that produce NaN, by a predicate on where the NaN are). The
check runs in a forked process on the CPU (:mod:`.isolation`), so a
kernel that segfaults in the interpreter does not take the notebook down.
"""

from __future__ import annotations

import math

import numpy as np

from .. import references as ref
from ..environment import current
from . import inputs, proof
from .core import Diagnosis, Run, require_callable
from .mistakes import MSG_NO_KERNEL_SOFTMAX
from .mistakes import MSG_ROW_STRIDE_SOFTMAX

__all__ = ["grade_triton_softmax"]

# Tolerances per dtype: (atol, rtol). The kernel computes in float32; these
# leave room for the GPU's approximate exp, for rounding the output to the
# input's dtype, and for `exp2(x * log2(e))` written before the max is
# subtracted (at |x| = 1000 the product's rounding alone is a 6e-5 relative
# error), and stay well below the errors the diagnoses describe.
_TOLERANCES = {
    "float32": (1e-6, 1e-4),
    "float16": (1e-3, 5e-3),
    "bfloat16": (4e-3, 1.6e-2),
}

# A row counts as "large" (where an unstable softmax breaks) beyond this.
_LARGE = 80.0

# One plain sentence per diagnosis; the tests look for these texts.
MSG_MISSING_MASK = (
    "the output holds NaN although the input has none: a `tl.load` reads past the end of "
    "the row (the columns from n_cols up to BLOCK). Here the memory after each row is filled "
    "with NaN; in real memory it is garbage from a neighbouring tensor. Load with "
    "`mask=cols < n_cols` (and store with the same mask)."
)
MSG_STORE_PAST_END = (
    "your kernel wrote past the end of the output: a `tl.store` without `mask=cols < n_cols` "
    "writes all BLOCK lanes of each row, and the last row's extra lanes land in the memory after "
    "the tensor. The grader put a guard zone there and found it changed; in a real program it "
    "is another tensor, silently corrupted (or a crash). Store with the same mask as the load."
)
MSG_OUT_ROW_STRIDE = (
    "the output rows were written with the input's row stride: y's rows are y.stride(0) apart, "
    "x's rows x.stride(0) apart, and here they differ (x is a view of a wider tensor), so row r "
    "landed at r * x.stride(0) in y, past the end of y for the last rows. Pass y.stride(0) to the "
    "kernel and store at y_ptr + row * y_row_stride + cols."
)
MSG_OTHER_ZERO = (
    "the masked load fills the padding lanes with `other=0`, so each of the {k} padding "
    "lanes adds exp(0 - max) to the denominator and every value is too small by the same "
    "factor (your rows sum to {total:.4g}, not 1). Use `other=-float('inf')`: exp(-inf) = 0."
)
MSG_BLOCK_TOO_SMALL = (
    "only the first {block} columns of each row were used (BLOCK = {block} < n_cols = {n}): a fixed "
    "BLOCK does not cover wide rows. Use BLOCK = triton.next_power_of_2(n_cols) (one program reads its "
    "whole row), or loop over the row in chunks of BLOCK."
)
MSG_UNSTABLE = (
    "rows with large values came out as NaN/inf (or not summing to 1) while small rows are "
    "right: exp(x) overflows above 88 in float32 (and 0/0 happens when every exp(x) "
    "underflows). Subtract the row maximum first: softmax(x) == softmax(x - max(x))."
)


def _tolerance(dtype) -> tuple[float, float]:
    return _TOLERANCES[str(dtype).replace("torch.", "")]


def _make_input(rng, n_rows, n_cols, dtype, device, *, strided, scale=1.0, offsets=None):
    """A ``[n_rows, n_cols]`` tensor inside a NaN-filled buffer.

    ``strided``: rows are ``n_cols + pad`` apart with NaN in the gap (and
    NaN rows after the last row), via :func:`.inputs.nan_padded`. Otherwise
    the rows are packed (contiguous) and NaN follows the last row, so reading
    past the end of the last row still reads NaN rather than stray memory.
    """
    import torch

    values = rng.standard_normal((n_rows, n_cols)) * scale
    if offsets is not None:
        values = values + np.asarray(offsets, dtype=np.float64)[:, None]
    t = torch.tensor(values, dtype=dtype, device=device)
    if strided:
        pad = int(rng.integers(1, 9))
        return inputs.nan_padded(t[None, None], cols=pad)[0, 0]
    # 4096 NaN after the end covers any unmasked read of one block.
    buf = torch.full((n_rows * n_cols + 4096,), float("nan"), dtype=dtype, device=device)
    x = buf[: n_rows * n_cols].view(n_rows, n_cols)
    x.copy_(t)
    return x


def _flat_buffer(x) -> np.ndarray:
    """The first ``rows * cols`` elements of the memory under ``x``, as float64 (NaN included).

    That is what a kernel stepping ``row * n_cols`` reads.
    """
    n_rows, n_cols = x.shape
    return x.as_strided((n_rows * n_cols,), (1,)).detach().cpu().double().numpy()


def _softmax_nan(rows: np.ndarray) -> np.ndarray:
    """Row softmax in float64 where a row holding NaN comes out all NaN (as a kernel's would)."""
    with np.errstate(all="ignore"):
        out = ref.softmax(np.where(np.isnan(rows), 0.0, rows), axis=-1)
    out[np.isnan(rows).any(axis=-1)] = np.nan
    return out


class _OtherZero(Diagnosis):
    """``other=0``: the answer is ``e^x / (sum e^x + k)`` for some padding count ``k``.

    With ``k`` padding lanes holding 0, the row max is ``m' = max(m, 0)`` and
    the sum gains ``k * exp(-m')``; whatever the shift, the result is
    ``softmax(x) * S / (S + k)`` with ``S = sum(exp(x))``. ``k`` depends on
    the learner's block size, so every ``k = ceil(n/B)*B - n`` for a power of
    two ``B`` is tried. The message reports the ``k`` found.
    """

    def __init__(self, x64: np.ndarray, expected: np.ndarray):
        super().__init__(MSG_OTHER_ZERO)
        self.x64, self.expected_rows = x64, expected

    def matches(self, actual, atol, rtol):
        n = self.x64.shape[-1]
        with np.errstate(all="ignore"):
            return self._matches(actual, atol, rtol, n)

    def _matches(self, actual, atol, rtol, n):
        log_s = np.log(np.sum(np.exp(self.x64 - self.x64.max(-1, keepdims=True)), -1)) + self.x64.max(-1)
        pads = sorted({math.ceil(n / b) * b - n for b in (2**j for j in range(15))} - {0})
        for k in pads:
            factor = 1.0 / (1.0 + k * np.exp(-log_s))
            wrong = self.expected_rows * factor[:, None]
            if np.allclose(actual, wrong, atol=atol, rtol=rtol):
                self.message = MSG_OTHER_ZERO.format(k=k, total=float(np.sum(actual[0])))
                return True
        return False


def _diagnoses(x, x64, expected, atol, rtol):
    """The known mistakes, each recognised by what it would output on ``x``."""
    n_rows, n_cols = x64.shape

    def row_stride_mistake(actual):
        # Row r read from flat[r * n_cols : (r + 1) * n_cols] of the real memory.
        if x.stride(0) == n_cols:
            return False
        flat = _flat_buffer(x)
        wrong = _softmax_nan(np.stack([flat[r * n_cols : (r + 1) * n_cols] for r in range(n_rows)]))
        return bool(np.allclose(actual, wrong, atol=atol, rtol=rtol, equal_nan=True))

    def missing_mask(actual):
        return bool((~np.isfinite(actual)).any())

    def unstable(actual):
        large = np.abs(x64.max(-1)) > _LARGE
        with np.errstate(all="ignore"):
            bad = ~np.isfinite(actual).all(-1) | (np.abs(actual.sum(-1) - 1) > 0.01)
        small_ok = np.allclose(actual[~large], expected[~large], atol=atol, rtol=rtol)
        return bool(large.any() and bad.any() and not (bad & ~large).any() and small_ok)

    def block_too_small(actual):
        for block in (2**j for j in range(4, 14)):
            if block >= n_cols:
                break
            part = ref.softmax(x64[:, :block], axis=-1)
            if np.allclose(actual[:, :block], part, atol=atol, rtol=rtol):
                return MSG_BLOCK_TOO_SMALL.format(block=block, n=n_cols)
        return None

    class _BlockTooSmall(Diagnosis):
        def matches(self, actual, atol_, rtol_):
            found = block_too_small(actual)
            if found:
                self.message = found
            return bool(found)

    return [
        _BlockTooSmall(""),
        Diagnosis(MSG_ROW_STRIDE_SOFTMAX, when=row_stride_mistake),
        Diagnosis(MSG_UNSTABLE, when=unstable),
        Diagnosis(MSG_MISSING_MASK, when=missing_mask),
        _OtherZero(x64, expected),
    ]


def _cases(rng, device):
    """(description, n_rows, n_cols, dtype, strided, scale, offsets) for one run.

    Order matters: a mistake is reported on the first case that exposes it,
    so simple cases come first and each later group adds one difficulty.
    """
    import torch

    f32, f16 = torch.float32, torch.float16
    big = [0.0, 1000.0, -1000.0, 200.0, -200.0, 90.0]
    cases = [
        ("4 rows x 64 columns", 4, 64, f32, False, 1.0, None),
        ("5 rows x 100 columns (a tail: 100 is not a power of two)", 5, 100, f32, False, 1.0, None),
    ]
    for rows, cols in [(3, 1), (5, 3), (7, 17), (6, 100), (4, 129), (3, 300)]:
        cases.append((f"{rows} rows x {cols} columns, rows not contiguous", rows, cols, f32, True, 1.0, None))
    cases += [
        ("6 rows x 64 columns around 0, +-1000, +-200 and 90", 6, 64, f32, False, 1.0, big),
        ("6 rows x 37 columns around 0, +-1000, +-200 and 90, rows not contiguous", 6, 37, f32, True, 1.0, big),
        ("4 rows x 256 columns, float16", 4, 256, f16, False, 1.0, None),
        ("5 rows x 100 columns, float16, rows not contiguous", 5, 100, f16, True, 1.0, None),
        ("6 rows x 48 columns, float16, around 0, +-1000, +-200 and 90", 6, 48, f16, True, 1.0, big),
        (f"2 rows x {_WIDE} columns (wider than any block you could fix in advance), rows not contiguous",
         2, _WIDE, f32, True, 1.0, None),
        ("4 rows x 64 columns again, new values", 4, 64, f32, False, 1.0, None),
    ]
    if device == "cuda" and current().bf16_ok:
        bf16 = torch.bfloat16
        cases += [
            ("5 rows x 100 columns, bfloat16, rows not contiguous", 5, 100, bf16, True, 1.0, None),
            ("6 rows x 48 columns, bfloat16, around 0, +-1000, +-200 and 90", 6, 48, bf16, True, 1.0, big),
        ]
    dtypes = [f32, f16] + ([torch.bfloat16] if device == "cuda" and current().bf16_ok else [])
    for i in range(4):  # fresh random cases: new shapes and values on every call
        rows, cols = int(rng.integers(1, 13)), int(rng.integers(1, 301))
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        strided = bool(rng.integers(2))
        scale = float(rng.choice([1.0, 5.0]))
        offsets = rng.uniform(-500, 500, rows) if i % 2 else None
        name = str(dtype).replace("torch.", "")
        cases.append((f"random {i + 1}: {rows} rows x {cols} columns, {name}, "
                      f"{'rows not contiguous' if strided else 'contiguous'}", rows, cols, dtype, strided, scale, offsets))
    return cases


_WIDE = 5000  # columns of the wide case: more than a hard-coded BLOCK of 4096 holds

_GUARD = 4096  # elements after each guarded output: more than any block can overrun
_GUARD_VALUE = -7777.0


class _GuardedOutputs:
    """While the learner's function runs, outputs it allocates with ``x``'s shape get a guard zone.

    ``torch.empty_like``, ``torch.zeros_like``, ``torch.empty`` and
    ``torch.zeros`` are replaced, for calls asking for ``x``'s shape, by a
    view of the start of a longer buffer whose tail holds a known value.
    Every other call goes to torch unchanged. :meth:`overrun` says whether a
    tail changed.
    """

    _NAMES = ("empty_like", "zeros_like", "empty", "zeros")
    _METHODS = ("new_empty", "new_zeros")

    def __init__(self, x):
        self.shape = tuple(x.shape)
        self.zones = []

    def _allocate(self, shape, dtype, device, zero):
        n = math.prod(shape)
        buf = self._torch["empty"](n + _GUARD, dtype=dtype, device=device)
        if zero:
            buf[:n] = 0.0
        buf[n:] = _GUARD_VALUE
        self.zones.append((buf, n, buf[n:].clone()))
        return buf[:n].view(shape)

    def _like(self, name, zero):
        def allocate_like(t, *args, **kwargs):
            if args or set(kwargs) - {"dtype", "device"} or tuple(t.shape) != self.shape:
                return self._torch[name](t, *args, **kwargs)
            return self._allocate(self.shape, kwargs.get("dtype") or t.dtype, kwargs.get("device") or t.device, zero)
        return allocate_like

    def _new(self, name, zero):
        import torch

        def allocate(*size, **kwargs):
            shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            if shape != self.shape or set(kwargs) - {"dtype", "device"}:
                return self._torch[name](*size, **kwargs)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            return self._allocate(self.shape, dtype, kwargs.get("device") or "cpu", zero)
        return allocate

    def _method(self, name, zero):
        import torch

        def allocate(t, *size, **kwargs):
            shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            if shape != self.shape or set(kwargs) - {"dtype", "device"}:
                return self._methods[name](t, *size, **kwargs)
            return self._allocate(self.shape, kwargs.get("dtype") or t.dtype, kwargs.get("device") or t.device, zero)
        return allocate

    def __enter__(self):
        import torch

        self._torch = {name: getattr(torch, name) for name in self._NAMES}
        self._methods = {name: getattr(torch.Tensor, name) for name in self._METHODS}
        torch.empty_like, torch.zeros_like = self._like("empty_like", False), self._like("zeros_like", True)
        torch.empty, torch.zeros = self._new("empty", False), self._new("zeros", True)
        torch.Tensor.new_empty, torch.Tensor.new_zeros = self._method("new_empty", False), self._method("new_zeros", True)
        return self

    def __exit__(self, *exc):
        import torch

        for name, fn in self._torch.items():
            setattr(torch, name, fn)
        for name, fn in self._methods.items():
            setattr(torch.Tensor, name, fn)
        return False

    def overrun(self) -> bool:
        import torch

        return any(not torch.equal(buf[n:], before) for buf, n, before in self.zones)


def _rows_at_input_stride(guard, x, x64, tolerance) -> bool:
    """Whether the guarded output's memory holds the softmax rows at x's row stride (not y's)."""
    n_rows, n_cols = x64.shape
    stride = x.stride(0)
    if stride == n_cols:
        return False
    expected = ref.softmax(x64, axis=-1)
    atol, rtol = tolerance
    for buf, n, _ in guard.zones:
        flat = buf.detach().cpu().double().numpy()
        if (n_rows - 1) * stride + n_cols > flat.size:
            continue
        rows = np.stack([flat[r * stride: r * stride + n_cols] for r in range(n_rows)])
        if np.allclose(rows, expected, atol=atol, rtol=rtol):
            return True
    return False


def _check_result(run, out, x, case):
    """A plain sentence for a result that is not a tensor like ``x``."""
    import torch

    if out is None:
        raise run.fail("your function returned None: did you forget `return y`?", case)
    if not isinstance(out, torch.Tensor):
        raise run.fail(f"your function returned a {type(out).__name__}; return a torch tensor.", case)
    if tuple(out.shape) != tuple(x.shape):
        raise run.fail(
            f"your function returned a tensor of shape {tuple(out.shape)}; the softmax of each row "
            f"has the input's shape {tuple(x.shape)}.", case)
    if out.dtype != x.dtype:
        raise run.fail(
            f"your function returned {out.dtype} for a {x.dtype} input; return the input's dtype "
            "(allocate the output with torch.empty_like(x) and compute in float32 inside the kernel).",
            case)
    if out.device != x.device:
        raise run.fail(f"your function returned a tensor on {out.device}; the input was on {x.device}.", case)


def grade_triton_softmax(fn, *, seed=None):
    """Grade ``fn(x)``: the softmax of each row of the 2-D tensor ``x``, by a Triton kernel.

    ``fn`` must launch a ``@triton.jit`` kernel and return a tensor of ``x``'s
    shape and dtype. It is called on 19 inputs (21 on a GPU): 1 to 300 columns and one of 5000, 1 to
    12 rows, rows packed or spaced apart (row stride > columns), values up to
    +-1000, float32 and float16 (and bfloat16 on a GPU). On the CPU it runs in
    a separate process, so a crash of the interpreter cannot kill the notebook;
    ``timeout_s`` bounds the whole check, and each call of ``fn`` has 20 s.
    ``seed`` replays the random cases of an earlier call.
    """
    import torch

    run = Run("check_triton_softmax", seed, time_limit_s=20.0)
    device = current().device
    for desc, rows, cols, dtype, strided, scale, offsets in _cases(run.rng, device):
        x = _make_input(run.rng, rows, cols, dtype, device, strided=strided, scale=scale, offsets=offsets)
        x64 = x.detach().cpu().double().numpy()  # the values the kernel sees, after rounding to dtype
        before = inputs.snapshot(x=x)
        with proof.Work(inputs=(x,)) as work, _GuardedOutputs(x) as guard:
            out = run.call(fn, x, case=desc)
        if out is None:
            raise run.fail("your function returned None: did you forget `return y`?", desc)
        if not isinstance(out, torch.Tensor):  # a slip (e.g. `.numpy()` at the end): say that first
            _check_result(run, out, x, desc)
        problem = work.problem(no_kernel=MSG_NO_KERNEL_SOFTMAX, y=out)
        if problem:
            raise run.fail(problem, desc)
        changed = inputs.changed_input(before, x=x)
        if changed:
            raise run.fail(changed, desc)
        if guard.overrun():
            if _rows_at_input_stride(guard, x, x64, _tolerance(dtype)):
                raise run.fail(MSG_OUT_ROW_STRIDE, desc)
            raise run.fail(MSG_STORE_PAST_END, desc)
        _check_result(run, out, x, desc)
        got = out.detach().cpu().double().numpy()
        expected = ref.softmax(x64, axis=-1)
        atol, rtol = _tolerance(dtype)
        run.compare(got, expected, case=desc, what="the softmax", atol=atol, rtol=rtol,
                    diagnoses=_diagnoses(x, x64, expected, atol, rtol), axes=("row", "col"))
    return run.passed()


