"""Check for lesson 03's 2-D tile copy: 2-D pointer arithmetic, strides and masks.

:func:`check_tile_copy` grades ``fn(x)``, which must return a contiguous copy
of the 2-D tensor ``x`` made by a Triton kernel that loads and stores 2-D tiles
(``rows[:, None] * stride_r + cols[None, :] * stride_c``). The inputs are laid
out four ways, in this order, so each mistake shows on the first layout that
can see it:

- contiguous (row stride = columns, column stride 1);
- rows spaced apart (a slice of a wider tensor: row stride > columns);
- every other column (column stride 2);
- transposed (a ``.T`` view: row stride 1, column stride = rows).

The memory around and between the elements holds a sentinel value, so a load
that reads outside the matrix (a missing mask, a wrong stride) shows as a
sentinel in the output. Each known mistake is recognised by reading the
same memory with the mistaken strides (``torch.as_strided``).

The copy must be the learner's own kernel's work (:class:`.proof.Work`): the
tensor returned must have been written by their kernel during the call, so
returning ``x`` itself, or ``x.clone()`` / ``x.contiguous()`` behind a kernel
launch, fails; so does editing ``x`` in place (:func:`.inputs.changed_input`,
checked at once). The copy's values are compared (and a wrong copy diagnosed)
before its origin is checked, so a mistake gets its own message whoever made it.
"""

from __future__ import annotations

import numpy as np

from ..environment import current
from . import inputs, proof
from .core import Diagnosis, Run
from .mistakes import MSG_NO_KERNEL_TILE_COPY
from .mistakes import MSG_ROW_STRIDE_TILE_COPY

__all__ = ["grade_tile_copy"]

SENTINEL = -7777.0

MSG_COL_STRIDE = ("the columns were located with `+ cols`, as if they were adjacent; here they are "
                  "x.stride(1) apart: use `cols[None, :] * stride_c`.")
MSG_SWAPPED = ("rows and columns are swapped in the offsets: `rows[:, None] * stride_r + cols[None, :] * stride_c` "
               "(the row index times the row stride).")
MSG_SENTINEL = (f"the output holds {SENTINEL:g}, the value the grader put in the memory around and between the "
                "matrix's elements: a load read outside the matrix. Mask it with "
                "`(rows[:, None] < n_rows) & (cols[None, :] < n_cols)` (and store with the same mask), and "
                "check the strides.")
MSG_TRANSPOSED = ("the copy is transposed: the output must have x's shape, [n_rows, n_cols], with "
                  "y[i, j] = x[i, j].")


def _layout(t, kind, device):
    """``t`` ([R, C]) copied into sentinel-filled memory with the given layout; returns the view."""
    import torch

    r, c = t.shape
    fill = dict(dtype=t.dtype, device=device)
    if kind == "contiguous":
        buf = torch.full((r * c + 64,), SENTINEL, **fill)
        view = buf[: r * c].view(r, c)
    elif kind == "rows spaced apart":
        buf = torch.full((r + 1, c + 5), SENTINEL, **fill)
        view = buf[:r, :c]
    elif kind == "every other column":
        buf = torch.full((r + 1, 2 * c + 3), SENTINEL, **fill)
        view = buf[:r, : 2 * c : 2]
    elif kind == "transposed":
        buf = torch.full((c + 1, r + 3), SENTINEL, **fill)
        view = buf[:c, :r].T
    else:
        raise ValueError(kind)
    view.copy_(t)
    return view


def _read(x, strides):
    """What a kernel reading x's memory with ``strides`` would copy (None if it leaves the memory)."""
    import torch

    try:
        return torch.as_strided(x, x.shape, strides).detach().cpu().double().numpy()
    except RuntimeError:
        return None


def grade_tile_copy(fn, *, seed=None):
    """Grade ``fn(x) -> a copy of the 2-D tensor x`` made by a Triton kernel with 2-D tiles.

    Shapes from 1 x 1 to 33 x 130 and a random one (none a multiple of a
    power-of-two block), float32 and float16, laid out contiguous, with rows spaced apart,
    every other column, and transposed, in memory filled with a sentinel value.
    The copy must be exact, written by your own kernel during the call (not x
    itself, not a torch copy), and x must be left as it was.
    """
    import torch

    __tracebackhide__ = True
    run = Run("check_tile_copy", seed)
    env = current()
    shapes = [(1, 1), (5, 7), (33, 65), (3, 130)]
    shapes += [(int(run.rng.integers(1, 70)), int(run.rng.integers(1, 100)))]
    dtypes = [torch.float32, torch.float16]
    layouts = ("contiguous", "rows spaced apart", "every other column", "transposed")
    for layout in layouts:
        for i, (r, c) in enumerate(shapes):
            dtype = dtypes[i % 2]
            values = torch.from_numpy(run.rng.standard_normal((r, c))).to(dtype)
            x = _layout(values.to(env.device), layout, env.device)
            case = f"{r} x {c}, {str(dtype).replace('torch.', '')}, {layout} (strides {tuple(x.stride())})"
            before = inputs.snapshot(x=x)
            with proof.Work(inputs=(x,)) as work:
                out = run.call(fn, x, case=case)
            if not work.launches:
                raise run.fail(MSG_NO_KERNEL_TILE_COPY, case)
            changed = inputs.changed_input(before, x=x)
            if changed:
                raise run.fail(changed, case)
            if out is None or not hasattr(out, "shape"):
                raise run.fail("your function must return the copy (a torch tensor).", case)
            if tuple(out.shape) != (r, c):
                msg = MSG_TRANSPOSED if tuple(out.shape) == (c, r) else f"the copy has shape {tuple(out.shape)}, expected {(r, c)}."
                raise run.fail(msg, case)
            if out.dtype != dtype:
                raise run.fail(f"the copy has dtype {out.dtype}, expected {dtype}: allocate it like x.", case)
            got = out.detach().cpu().double().numpy()
            want = values.double().numpy()
            sr, sc = x.stride()
            diagnoses = [
                Diagnosis(MSG_ROW_STRIDE_TILE_COPY, expected=lambda x=x, sc=sc, c=c: _read(x, (c * sc, sc))),
                Diagnosis(MSG_COL_STRIDE, expected=lambda x=x, sr=sr: _read(x, (sr, 1))),
                Diagnosis(MSG_SWAPPED, expected=lambda x=x, sr=sr, sc=sc: _read(x, (sc, sr))),
                Diagnosis(MSG_SENTINEL, when=lambda a: bool(np.any(a == SENTINEL))),
            ]
            run.compare(got, want, case=case, what="the copy", atol=0, rtol=0, diagnoses=diagnoses,
                        axes=("row", "col"))
            # Right values: were they copied by the learner's kernel? (After the comparison, so that a
            # wrong copy gets its diagnosis whoever made it.)
            problem = work.problem(no_kernel=MSG_NO_KERNEL_TILE_COPY, y=out)
            if problem:
                raise run.fail(problem, case)
    return run.passed()
