"""The inputs a check hands to the learner, and what it checks about them afterwards.

- :func:`nan_padded`: a tensor living inside a NaN-filled buffer, so reading past
  a row or past the sequence shows up as NaN in the output;
- :func:`snapshot` / :func:`changed_input`: copies of the inputs before the call,
  and a sentence naming the first input the learner's function edited in place;
- :data:`LAYOUTS` and :func:`laid_out` (with :func:`guarded_contiguous`,
  :func:`dstrided`): the layouts of the Triton checks' q, k, v;
  :func:`nan_padded_leaf`: a NaN-padded view that gradients flow through;
  :func:`shift_scores`: rows whose scores all sit far from 0 (:data:`SHIFTS`);
- :func:`tensor_like`: a plain sentence for a result that is not the tensor expected;
- :class:`Watched` (:func:`watch`, :func:`watching`, :func:`tile_log`,
  :func:`plain`): NumPy inputs that note how the learner's code reads them,
  so that a check sees a whole row reduced at once, or a product larger than a tile.
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np

__all__ = [
    "nan_padded", "snapshot", "changed_input",
    "LAYOUTS", "guarded_contiguous", "dstrided", "laid_out", "nan_padded_leaf", "SHIFT_ALPHA", "SHIFTS",
    "shift_scores", "tensor_like", "Watched", "plain", "watch", "tile_log", "watching",
]


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


# =============================================================================
# The Triton checks' layouts: where each tensor sits in NaN-filled memory
# =============================================================================
LAYOUTS = {
    "contiguous": "contiguous",
    "padded": "rows and heads spaced apart (NaN between them)",
    "transposed": "a [B, N, H, D] buffer viewed as [B, H, N, D]",
    "dstride": "head dim not contiguous (stride(-1) != 1)",
    "qbcast": "q shared across the batch (q.stride(0) == 0)",
}


def guarded_contiguous(t, after: int = 4096):
    """A contiguous copy of ``t`` followed by ``after`` NaN in memory (reads past its end read NaN)."""
    import torch

    n = t.numel()
    buf = torch.full((n + after,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[:n].view(t.shape)
    view.copy_(t)
    return view


def dstrided(t, pad):
    """``t`` viewed from a NaN-filled ``[B, H, D, N + pad]`` buffer: the head dim has stride N + pad."""
    import torch

    B, H, N, D = t.shape
    buf = torch.full((B, H, D, N + pad), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[..., :N].transpose(-1, -2)
    view.copy_(t)
    return view


def laid_out(t, layout, rng):
    """``t`` (``[B, H, N, D]``) in one of the single-tensor :data:`LAYOUTS` (``"qbcast"`` is the caller's)."""
    if layout == "contiguous":
        return guarded_contiguous(t)
    if layout == "padded":
        return nan_padded(t, cols=int(rng.integers(1, 9)))
    if layout == "transposed":
        return nan_padded(t, transpose_heads=True)
    if layout == "dstride":
        return dstrided(t, int(rng.integers(1, 9)))
    raise ValueError(layout)


def nan_padded_leaf(t, transpose_heads=False):
    """A NaN-padded, non-contiguous view of ``t`` through which gradients flow.

    The NaN buffer becomes the leaf that requires grad; the learner gets a
    strided view of it, so reading past a row or past the sequence reads NaN,
    and the gradient with respect to the view is what their backward returned.
    """
    padded = nan_padded(t, transpose_heads=transpose_heads)
    base = padded._base.detach().requires_grad_(True)
    return base.as_strided(padded.size(), padded.stride(), padded.storage_offset())


SHIFT_ALPHA = 16.0
# Row i's scores sit near SHIFTS[i % 5]. The kernels compute scores in float32, where exp
# overflows above 88.7 and underflows below -103.9, so +-150 is beyond both; larger shifts
# would only add float32 rounding (about |s| * 6e-8) to a correct kernel's scores.
SHIFTS = (-150.0, 0.0, 150.0, -60.0, 60.0)


def shift_scores(q, k):
    """Shift every score of query row i to about ``SHIFTS[i % 5]`` (in place, float64 NumPy ``[..., N, D]``).

    s_ij = q_i0 * SHIFT_ALPHA / sqrt(D) + O(1): every key of row i is shifted
    alike. q's first column is rounded to integers, so the references can use
    the values after rounding to the test dtype.
    """
    n, d = q.shape[-2:]
    k[..., 0] = SHIFT_ALPHA
    q[..., 0] = np.round(np.resize(np.array(SHIFTS) * math.sqrt(d) / SHIFT_ALPHA, n))


def tensor_like(run, out, name, shape, dtype, device, case, hint=""):
    """Fail ``run`` with a plain sentence if a result is not the tensor expected (None, type, shape, dtype, device)."""
    import torch

    if out is None:
        raise run.fail(f"{name} is None: did you forget a `return`?", case)
    if not isinstance(out, torch.Tensor):
        raise run.fail(f"{name} is a {type(out).__name__}; return a torch tensor.{hint}", case)
    if tuple(out.shape) != tuple(shape):
        raise run.fail(f"{name} has shape {tuple(out.shape)}, expected {tuple(shape)}.{hint}", case)
    if out.dtype != dtype:
        raise run.fail(f"{name} has dtype {out.dtype}, expected {dtype}.{hint}", case)
    if out.device != device:
        raise run.fail(f"{name} is on {out.device}; the inputs are on {device}.", case)


# =============================================================================
# The NumPy checks' inputs: arrays that note how the learner's code reads them
# =============================================================================
_ROW_REDUCTIONS = (np.maximum, np.fmax, np.add, np.logaddexp, np.logaddexp2)
# NumPy functions that look at a whole row at once without a ufunc reduction (np.sort(x)[..., -1] is a max).
_ROW_FUNCTIONS = {np.sort, np.argsort, np.partition, np.argpartition, np.median, np.quantile, np.percentile,
                  np.nanmax, np.nanmin, np.nansum, np.cumsum, np.nancumsum, np.ptp}
_PRODUCT_FUNCTIONS = {np.dot, np.inner, np.tensordot, np.einsum, np.vdot, np.outer, np.kron}
_CONVERSIONS = ("array", "asarray", "asanyarray", "ascontiguousarray", "asfortranarray", "copy")


def plain(a):
    """``a`` as a plain ndarray if it is :class:`Watched` (the same memory), else ``a`` itself."""
    return np.ndarray.view(a, np.ndarray) if isinstance(a, Watched) else a


class Watched(np.ndarray):
    """The learner's inputs: ordinary arrays that note how the whole problem is read.

    Each carries a shared log and a set of tags (which inputs it was computed
    from: "q", "k", "x", ...). Slices, views, copies and element-wise results
    keep watching (``np.array``, ``np.asarray``, ``np.copy`` and
    ``.view(np.ndarray)`` included, while the log is active); reductions hand
    back plain arrays. The log's hooks decide what counts:

    - ``row``: for the online softmax, a max, sum, logaddexp, cumulative sum,
      sort or partition along an axis as long as the row (``log["n"]``) is
      recorded with a copy of what was reduced; a reduction of the very
      values the function returns (a self-check such as
      ``assert np.allclose(out.sum(-1), 1)``) is forgiven afterwards;
    - ``tiles``: for the tiled exercises, a product of something computed
      from ``q`` alone with something computed from ``k`` alone (or ``do``
      with ``v``) bigger than one ``block_m x block_n`` tile is recorded.
    """

    def __array_finalize__(self, obj):
        self._log = getattr(obj, "_log", None)
        self._tags = getattr(obj, "_tags", frozenset())

    def view(self, *args, **kwargs):
        result = np.ndarray.view(self, *args, **kwargs)
        if (self._log is not None and self._log["active"] and isinstance(result, np.ndarray)
                and not isinstance(result, Watched)):
            result = _rewatch(result, self)
        return result

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        watched = [i for i in inputs if isinstance(i, Watched) and i._log is not None]
        log = watched[0]._log if watched else None
        bare = [plain(i) for i in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(plain(o) for o in kwargs["out"])
        if log is not None and log["active"]:
            if method in ("reduce", "accumulate") and ufunc in _ROW_REDUCTIONS:
                _note_row(log, bare[0], kwargs.get("axis", 0))
        result = getattr(ufunc, method)(*bare, **kwargs)
        if (log is not None and log["active"] and method == "__call__" and ufunc is np.matmul
                and len(inputs) == 2 and isinstance(result, np.ndarray)):
            _note_product(log, inputs[0], inputs[1], shape=result.shape if result.ndim >= 2 else None,
                          size=result.size)
        if method == "__call__" and log is not None and isinstance(result, np.ndarray):
            tags = frozenset().union(*(i._tags for i in watched if i.size > 1))
            result = result.view(Watched)
            result._log, result._tags = log, tags
        return result

    def __array_function__(self, func, types, args, kwargs):
        watched = [a for a in args if isinstance(a, Watched) and a._log is not None]
        log = watched[0]._log if watched else None
        if log is not None and log["active"]:
            if func in _ROW_FUNCTIONS and args:
                default = -1 if func in (np.sort, np.argsort, np.partition, np.argpartition) else None
                axis = kwargs.get("axis", args[2] if func in (np.partition, np.argpartition) and len(args) > 2
                                  else args[1] if len(args) > 1 and func not in (np.partition, np.argpartition,
                                                                                  np.quantile, np.percentile)
                                  else default)
                _note_row(log, plain(args[0]), axis if isinstance(axis, (int, np.integer, tuple, type(None))) else default)
        result = super().__array_function__(func, types, args, kwargs)
        if log is not None and log["active"] and func in _PRODUCT_FUNCTIONS:
            operands = [a for a in args if isinstance(a, np.ndarray)]
            if len(operands) >= 2:
                _note_product(log, operands[0], operands[1], shape=None, size=np.size(result))
        if func is np.copy and log is not None and isinstance(result, np.ndarray) and not isinstance(result, Watched):
            result = _rewatch(result, watched[0])
        return result


def _rewatch(result, like):
    out = np.ndarray.view(result, type(like))  # a subclass of Watched (part6_ring's shards) stays itself
    out._log, out._tags = like._log, like._tags
    return out


def _note_row(log, arr, axis):
    hook = log.get("row")
    if hook is None:
        return
    arr = np.asarray(arr)
    axes = range(arr.ndim) if axis is None else np.atleast_1d(axis)
    if any(arr.ndim and arr.shape[int(a)] == log["n"] for a in axes):
        hook(arr)


def _note_product(log, a, b, shape=None, size=None):
    hook = log.get("tiles")
    if hook is None:
        return
    ta = a._tags if isinstance(a, Watched) else frozenset()
    tb = b._tags if isinstance(b, Watched) else frozenset()
    hook(ta, tb, shape, size)


@contextlib.contextmanager
def _conversions_keep_watching():
    """``np.array(x)``, ``np.asarray(x)``, ``np.copy(x)`` ... of a watched array stay watched (during the call)."""
    saved = {name: getattr(np, name) for name in _CONVERSIONS}

    def make(original):
        @functools.wraps(original)
        def convert(a, *args, **kwargs):
            result = original(a, *args, **kwargs)
            if (isinstance(a, Watched) and a._log is not None and a._log["active"]
                    and isinstance(result, np.ndarray) and not isinstance(result, Watched)):
                result = _rewatch(result, a)
            return result
        return convert

    for name, original in saved.items():
        setattr(np, name, make(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(np, name, original)


def watch(arrays: dict, log: dict) -> dict:
    """Copies of ``arrays`` as :class:`Watched`, tagged with their names, writing to ``log``."""
    out = {}
    for name, a in arrays.items():
        w = np.array(a, copy=True).view(Watched)
        w._log, w._tags = log, frozenset([name])
        out[name] = w
    return out


def tile_log(batch_count: int, block_m: int, block_n: int, message: str) -> dict:
    """A log whose hook records the first score product larger than one block_m x block_n tile.

    The score products are q x k (S, or S^T in a backward) and do x v (dP):
    the operands computed from those inputs alone, whatever the code.
    ``log["untiled"]`` is then ``message`` (:data:`.mistakes.MSG_NOT_TILED`)
    with the product, its shape and the tile filled in.
    """
    # "spec": what another process needs to keep the same log (the batch grader's learner process).
    log = {"active": False, "untiled": None, "spec": ("tile", int(batch_count), int(block_m), int(block_n), message)}
    pairs = {("q", "k"): "the scores q @ k^T", ("do", "v"): "dP = do @ v^T"}

    def tiles(ta, tb, shape, size):
        if log["untiled"] is not None:
            return
        for (x, y), what in pairs.items():
            if (ta, tb) == ({x}, {y}):
                limit = (block_m, block_n)
            elif (ta, tb) == ({y}, {x}):
                limit = (block_n, block_m)
            else:
                continue
            if shape is not None:
                bad = shape[-2] > limit[0] or shape[-1] > limit[1]
            else:
                bad = size > batch_count * block_m * block_n
            if bad:
                log["untiled"] = message.format(what=what, shape=tuple(shape) if shape is not None
                                                else f"(… {size} elements)", bm=block_m, bn=block_n)

    log["tiles"] = tiles
    return log


def row_log(n: int) -> dict:
    """A log for :data:`Watched` inputs that records every reduction along a whole row of length ``n``
    (``log["reduced"]``: copies of what was reduced; lesson 02's online softmax)."""
    log = {"n": int(n), "active": False, "whole_row": False, "reduced": [], "spec": ("rows", int(n))}
    log["row"] = log["reduced"].append
    return log


def log_from_spec(spec) -> dict:
    """A fresh log of the same kind as the one ``spec`` (its ``log["spec"]``) came from: another process keeps
    the same watch around the learner's call (:mod:`course_utils.grade_checks`)."""
    return tile_log(*spec[1:]) if spec[0] == "tile" else row_log(spec[1])


def seen_in(log):
    """What ``log`` recorded, as data: the first untiled product's sentence, or the arrays reduced whole."""
    return log["untiled"] if log["spec"][0] == "tile" else [np.asarray(a) for a in log["reduced"]]


def add_seen(log, seen) -> None:
    """Add to ``log`` what a log of the same spec recorded elsewhere (:func:`seen_in`)."""
    if log["spec"][0] == "tile":
        if seen and log["untiled"] is None:
            log["untiled"] = str(seen)
    else:
        log["reduced"].extend(a for a in seen or () if isinstance(a, np.ndarray))


@contextlib.contextmanager
def watching(log):
    """Turn ``log`` on for the learner's call.

    The caller keeps the references off limits around it:
    ``with proof.references_forbidden(), inputs.watching(log): ...``.
    """
    log["active"] = True
    try:
        with _conversions_keep_watching():
            yield
    finally:
        log["active"] = False


def tensor_out(run, out, name, shape, case):
    """``out`` (one of the learner's returned tensors) as float64 NumPy, or a failure that says what is off.

    A value that is not a torch tensor, or one of the wrong shape, fails case ``case`` with one sentence.
    """
    import torch

    if not isinstance(out, torch.Tensor):
        raise run.fail(f"{name} is a {type(out).__name__}; return torch tensors (o, lse).", case)
    if tuple(out.shape) != tuple(shape):
        raise run.fail(f"{name} has shape {tuple(out.shape)}, expected {tuple(shape)}.", case)
    return out.detach().double().cpu().numpy()
