"""Data, and only data, between the batch grader's checks and the learner's process.

The batch grader computes a check's verdict in a process the learner's code
never runs in (:mod:`course_utils.grade_checks`): the learner's function runs in
its own process, and what comes back from there (its result, its arguments as
it left them, its exception) crosses as plain data. :func:`encode` turns a value
into builtins only (NumPy arrays and torch tensors become tagged bytes; any other
object a stand-in that keeps its type's name); :func:`decode` rebuilds it, and
:func:`loads` refuses any pickle that names something other than the builtin
containers, so bytes from the learner's side can never run code here.
"""

from __future__ import annotations

import io
import pickle
import sys

__all__ = ["encode", "decode", "dumps", "loads", "Opaque", "MAX_DEPTH"]

MAX_DEPTH = 64  # deeper nesting is not an answer any exercise asks for
_SAFE = {("builtins", name) for name in ("tuple", "list", "dict", "set", "frozenset", "bytes", "bytearray", "str",
                                          "int", "float", "complex", "bool", "slice", "NoneType")}


class Opaque:
    """What stands for an object that cannot cross as data: its type's name and its ``repr``."""

    type_name = "object"

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _opaque_class(name: str, module: str) -> type:
    cls = type(str(name)[:200] or "object", (Opaque,), {"__module__": str(module)[:200], "type_name": str(name)[:200]})
    return cls


def encode(value, _depth: int = 0):
    """``value`` as builtins: containers kept, arrays and tensors as tagged bytes, other objects as stand-ins."""
    if _depth > MAX_DEPTH:
        raise ValueError(f"a value nested more than {MAX_DEPTH} levels deep")
    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    if isinstance(value, tuple) and type(value) is tuple:
        return ("tuple", [encode(v, _depth + 1) for v in value])
    if isinstance(value, list) and type(value) is list:
        return ("list", [encode(v, _depth + 1) for v in value])
    if isinstance(value, dict) and type(value) is dict:
        return ("dict", [(encode(k, _depth + 1), encode(v, _depth + 1)) for k, v in value.items()])
    if type(value) in (set, frozenset):
        return (type(value).__name__, [encode(v, _depth + 1) for v in value])
    if isinstance(value, range):
        return ("range", value.start, value.stop, value.step)
    module = type(value).__module__ or ""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufc":  # a subclass as its data
        return ("ndarray", value.dtype.str, list(value.shape), np.ascontiguousarray(value).tobytes())
    if module == "numpy" or module.startswith("numpy."):
        import numpy as np

        if isinstance(value, np.generic) and value.dtype.kind in "biufc":
            return ("npscalar", value.dtype.str, value.tobytes())
        if isinstance(value, np.dtype):
            return ("npdtype", value.str)
    if module == "torch" or module.startswith("torch."):
        import torch

        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
            # Its storage, offset and strides as they are: a layout (expanded, sliced) can be what is graded.
            t = value.detach()
            storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            return ("tensor", str(t.dtype).removeprefix("torch."), list(t.shape), t.device.type,
                    bool(value.requires_grad), storage.cpu().numpy().tobytes(), list(t.stride()),
                    int(t.storage_offset()))
        if isinstance(value, torch.dtype):
            return ("torchdtype", str(value).removeprefix("torch."))
    try:
        text = repr(value)[:400]
    except Exception:  # noqa: BLE001 - a learner's __repr__ may raise
        text = f"<{type(value).__name__} object>"
    return ("opaque", type(value).__name__, module, text)


def decode(data, _depth: int = 0):
    """The value :func:`encode` described (a stand-in :class:`Opaque` subclass for an object that did not cross)."""
    if _depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if data is None or type(data) in (bool, int, float, complex, str, bytes):
        return data
    if not isinstance(data, tuple) or not data or not isinstance(data[0], str):
        raise ValueError(f"not encoded data: {type(data).__name__}")
    tag = data[0]
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(decode(v, _depth + 1) for v in data[1])
    if tag == "tuple":
        return tuple(decode(v, _depth + 1) for v in data[1])
    if tag == "list":
        return [decode(v, _depth + 1) for v in data[1]]
    if tag == "dict":
        return {decode(k, _depth + 1): decode(v, _depth + 1) for k, v in data[1]}
    if tag == "range":
        return range(int(data[1]), int(data[2]), int(data[3]))
    if tag in ("ndarray", "npscalar", "npdtype"):
        import numpy as np

        dtype = np.dtype(str(data[1]))
        if dtype.kind not in "biufc":
            raise ValueError(f"unexpected dtype {dtype}")
        if tag == "npdtype":
            return dtype
        if tag == "npscalar":
            return np.frombuffer(bytes(data[2]), dtype=dtype, count=1)[0]
        shape = tuple(int(n) for n in data[2])
        return np.frombuffer(bytes(data[3]), dtype=dtype).reshape(shape).copy()
    if tag in ("tensor", "torchdtype"):
        import torch

        dtype = getattr(torch, str(data[1]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unexpected torch dtype {data[1]!r}")
        if tag == "torchdtype":
            return dtype
        _, _, shape, device, requires_grad, raw, stride, offset = data
        shape, stride = [int(n) for n in shape], [int(n) for n in stride]
        raw = bytes(raw)
        base = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        base = base.to(str(device)).view(dtype)
        need = int(offset) + sum((n - 1) * st for n, st in zip(shape, stride)) + 1 if all(shape) else 0
        if need > base.numel() or min(stride, default=0) < 0:
            raise ValueError("a tensor whose strides reach past its storage")
        t = torch.as_strided(base, shape, stride, int(offset))
        return t.requires_grad_(bool(requires_grad)) if requires_grad and t.is_floating_point() else t
    if tag == "opaque":
        return _opaque_class(data[1], data[2])(str(data[3]))
    raise ValueError(f"unknown tag {tag!r}")


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _SAFE:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused: {module}.{name} (only builtin data crosses from the learner's side)")


def dumps(value) -> bytes:
    """:func:`encode` ``value`` and pickle it (builtins only)."""
    return pickle.dumps(encode(value), protocol=pickle.HIGHEST_PROTOCOL)


def loads(raw: bytes):
    """Unpickle with builtins only (anything else is refused, so no code can run) and :func:`decode`."""
    return decode(_BuiltinsOnly(io.BytesIO(raw)).load())
