"""Run the course's Gluon kernels on the CPU: their own Python, with a model of Hopper's machinery (lesson 11).

Gluon has no interpreter, so the hand-specialised kernels (:mod:`.hopper_ws`, :mod:`.hopper_ws_bwd`) could only be
compiled on a CPU, never run. This module runs them: it takes a ``@gluon.jit`` function's Python (``.fn``) and
executes it with the names it uses bound to small models instead of Triton's builders:

* **partitions** (``gl.warp_specialize``): one Python thread each, for every program of the grid in turn;
* **mbarriers**: a count of arrivals per phase and, with ``expect``, of bytes still to land; ``wait(bar,
  parity)`` returns once the phase of that parity has completed, tested on the phase bit alone as the hardware
  does (so a wait two phases behind deadlocks or passes early, as it would on a GPU);
* **TMA copies**: queued, and landed at random later moments, in random order, by whichever thread waits
  (a ``seed`` picks the order), each landing counted on its barrier;
* **tensors**: torch tensors on the CPU, in the kernel's dtypes (bf16, fp16 and e4m3 rounded as torch rounds
  them); an issued ``warpgroup_mma`` reads its shared-memory operands only when a ``warpgroup_mma_wait``
  completes it (the latest moment the hardware may), multiplying in float32; ``warpgroup_mma_wait(n)`` completes
  every product the warpgroup issued but the ``n`` newest, in issue order, and a product it should return that is
  still in flight, or a TMA copy issued into a slot such a product reads, raises :class:`RaceError`; layouts are
  ignored.

What it checks is what the kernels' GPU tests check: the outputs against float64 references, in every
interleaving the seed produces, with a deadlock (every thread waiting, no copy in flight) raised as
:class:`Deadlock` (naming the barrier each partition waits on), and a copy landing bytes its barrier was not
told of (``mbarrier.expect``) as :class:`ExpectError`. Shared memory is named after the variable the kernel
assigns it to (``k_bars[1]``, ``v_smem[0]``), in those errors and in a trace. What it cannot check: speed,
registers, layouts, and anything about how the compiler lowers the code (``tests/test_hopper_ws*.py``
compile it for sm_90 for those).

    with gluon_cpu.running(seed=0):
        o, lse = hopper_ws.attention(q, k, v, causal=True)   # CPU tensors: the kernel's Python runs

Two hooks serve lesson 11's graded exercise (``check_gluon_loader``): ``running(replace={course_fn: fn})`` runs
the learner's ``@gluon.jit`` function wherever the kernel calls the course's (and counts those calls), and
``running(trace=events)`` records every partition's barrier operations and TMA copies (:class:`Event`) in the
order each thread issues them.
"""

from __future__ import annotations

import collections
import contextlib
import linecache
import random
import re
import sys
import threading
import time
import types

import torch

from . import forward  # its remembered capability: every Gluon route asks, on every call

__all__ = ["running", "active", "can_run", "host_module", "HOST_MODULES", "Deadlock", "RaceError", "ExpectError", "Event",
           "run_kernel"]

_ACTIVE = []  # one entry per `running` block in force
#: The modules whose host code builds Gluon descriptors and layouts (each adds its name when imported:
#: this module imports none of them).
HOST_MODULES = []


def host_module(name: str) -> None:
    """Register module ``name`` (a kernel module's ``__name__``) as one :func:`running` adapts by default."""
    if name not in HOST_MODULES:
        HOST_MODULES.append(name)


def active() -> bool:
    """Whether Gluon launches run on the CPU now (inside :func:`running`): the kernels' entries then take CPU
    tensors."""
    return bool(_ACTIVE)


def can_run(t: torch.Tensor) -> bool:
    """Whether a Gluon kernel can take tensor ``t`` here: on a Hopper GPU, or on the CPU inside :func:`running`.
    It imports no Gluon, so the routes of the course's public entries ask it before they import lesson 11's
    kernels (a CPU, a T4 or an A100 never loads them)."""
    if t.device.type == "cuda":
        return forward._capability(t.device)[0] == 9
    return t.device.type == "cpu" and active()


class Deadlock(RuntimeError):
    """Every partition waits on a barrier and no copy is in flight.

    ``waits``: ``(partition, barrier name, parity, phases completed)`` of each waiting partition (empty where a
    partition failed or did not finish instead)."""

    def __init__(self, message, waits=()):
        super().__init__(message)
        self.waits = list(waits)


class RaceError(RuntimeError):
    """A TMA copy was issued into shared memory that an issued, not yet completed ``wgmma`` reads."""


class ExpectError(RuntimeError):
    """A TMA copy landed more bytes on its barrier than an ``mbarrier.expect`` had announced for the phase.

    ``barrier`` and ``destination``: the names of the barrier and of the slot the copy wrote."""

    def __init__(self, message, barrier="", destination=""):
        super().__init__(message)
        self.barrier, self.destination = barrier, destination


#: One operation of a partition, recorded by ``running(trace=...)``: ``op`` is ``"wait"`` (``value``: the
#: parity), ``"expect"`` (``value``: bytes), ``"arrive"`` (``value``: the count) or ``"copy"`` (``value``: bytes,
#: ``destination`` the slot's name, ``coords`` the box's first element); ``program`` the grid index,
#: ``partition`` the index in ``gl.warp_specialize``'s list (None outside one).
Event = collections.namedtuple("Event", "program partition op barrier value destination coords")


def _name_of_allocation(frame, number) -> str:
    """The variable the kernel's line assigns an allocation to (``k_bars = gl.allocate_shared_memory(...)``)."""
    for lineno in range(frame.f_lineno, max(frame.f_lineno - 3, 0), -1):
        found = re.match(r"\s*(\w+)\s*=\s*gl\.allocate_shared_memory\b",
                         linecache.getline(frame.f_code.co_filename, lineno))
        if found:
            return found.group(1)
    return f"shared memory #{number}"


def _record(op, barrier, value, destination=None, coords=None):
    trace = _CURRENT.get("trace")
    if trace is not None:
        trace.append(Event(_STATE.program, _STATE.partition, op, barrier, value, destination, coords))


# -----------------------------------------------------------------------------
# dtypes, layouts, tensors, pointers
# -----------------------------------------------------------------------------
class _DType:
    def __init__(self, name, torch_dtype):
        self.name, self.torch = name, torch_dtype

    def is_fp8(self) -> bool:
        return self.torch == torch.float8_e4m3fn

    @property
    def primitive_bitwidth(self) -> int:
        return torch.finfo(self.torch).bits if self.torch.is_floating_point else torch.iinfo(self.torch).bits

    @property
    def element_ty(self):  # a pointer's element type: the model's pointers carry their element dtype
        return self

    def __repr__(self):
        return self.name


_DTYPES = {name: _DType(name, t) for name, t in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                                   ("float16", torch.float16), ("float8e4nv", torch.float8_e4m3fn),
                                                   ("int64", torch.int64), ("int32", torch.int32))}
_OF_TORCH = {d.torch: d for d in _DTYPES.values()}


class _Layout:
    """Any Gluon layout: the model keeps none."""

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def get_default_for(cls, *args, **kwargs):
        return cls()


def _data(x):
    return x.data if isinstance(x, _Tensor) else x


class _Type:
    def __init__(self, shape):
        self.shape = list(shape)
        self.layout = None  # layouts are ignored


class _Tensor:
    """A Gluon tensor: a torch tensor on the CPU with the operators the kernels use."""

    __slots__ = ("data", )

    def __init__(self, data):
        self.data = data

    @property
    def dtype(self):
        return _OF_TORCH[self.data.dtype]

    @property
    def type(self):
        return _Type(self.data.shape)

    @property
    def shape(self):
        return list(self.data.shape)

    def to(self, dtype):
        dtype = dtype.torch if isinstance(dtype, _DType) else dtype
        if dtype == torch.float8_e4m3fn:  # the GPU's cvt.rn.satfinite: nearest even, clamped to +-448
            return _Tensor(self.data.float().clamp(-448.0, 448.0).to(dtype))
        return _Tensor(self.data.to(dtype))

    def __getitem__(self, index):
        return _Tensor(self.data[index])

    def _binary(self, other, op):
        a, b = self.data, _data(other)
        if a.dtype == torch.float8_e4m3fn or (isinstance(b, torch.Tensor) and b.dtype == torch.float8_e4m3fn):
            raise TypeError("arithmetic on e4m3 values: convert them first, as Gluon requires")
        return _Tensor(op(a, b))

    def __add__(self, o): return self._binary(o, lambda a, b: a + b)  # noqa: E704
    def __radd__(self, o): return self._binary(o, lambda a, b: b + a)  # noqa: E704
    def __sub__(self, o): return self._binary(o, lambda a, b: a - b)  # noqa: E704
    def __rsub__(self, o): return self._binary(o, lambda a, b: b - a)  # noqa: E704
    def __mul__(self, o): return self._binary(o, lambda a, b: a * b)  # noqa: E704
    def __rmul__(self, o): return self._binary(o, lambda a, b: b * a)  # noqa: E704
    def __truediv__(self, o): return self._binary(o, lambda a, b: a / b)  # noqa: E704
    def __rtruediv__(self, o): return self._binary(o, lambda a, b: b / a)  # noqa: E704
    def __floordiv__(self, o): return self._binary(o, lambda a, b: a // b)  # noqa: E704
    def __mod__(self, o): return self._binary(o, lambda a, b: a % b)  # noqa: E704
    def __ge__(self, o): return self._binary(o, lambda a, b: a >= b)  # noqa: E704
    def __gt__(self, o): return self._binary(o, lambda a, b: a > b)  # noqa: E704
    def __le__(self, o): return self._binary(o, lambda a, b: a <= b)  # noqa: E704
    def __lt__(self, o): return self._binary(o, lambda a, b: a < b)  # noqa: E704
    def __and__(self, o): return self._binary(o, lambda a, b: a & b)  # noqa: E704
    def __or__(self, o): return self._binary(o, lambda a, b: a | b)  # noqa: E704
    def __eq__(self, o): return self._binary(o, lambda a, b: a == b)  # noqa: E704
    def __ne__(self, o): return self._binary(o, lambda a, b: a != b)  # noqa: E704
    def __neg__(self): return _Tensor(-self.data)  # noqa: E704
    __hash__ = None


class _Pointer:
    """A pointer into a flat CPU tensor, plus offsets (an int or a tensor of them)."""

    def __init__(self, flat, offset=0):
        self.flat, self.offset = flat, offset

    @property
    def dtype(self):
        return _OF_TORCH[self.flat.dtype]

    def __add__(self, other):
        return _Pointer(self.flat, self.offset + _data(other))

    __radd__ = __add__


def _as_index(offset):
    if isinstance(offset, torch.Tensor):
        return offset.long()
    return torch.tensor(int(offset))


# -----------------------------------------------------------------------------
# shared memory, barriers, the machine
# -----------------------------------------------------------------------------
class _Machine:
    """One program's partitions: their threads, its barriers and its copies in flight."""

    def __init__(self, rng: random.Random, linger: float = 0.0):
        self.rng, self.linger = rng, linger
        self.cond = threading.Condition()
        self.copies = []  # (barrier, destination view, source tensor, nbytes)
        self.threads = 0
        self.waiters = {}  # thread -> (barrier, parity) it waits on
        self.reading = {}  # shared-memory slot -> issued wgmmas not yet completed that read it
        self.issued = {}  # thread -> its issued, not yet completed wgmmas, oldest first
        self.partition = {}  # thread -> its index in gl.warp_specialize's list
        self.allocations = 0
        self.error = None

    def land_one(self) -> bool:
        """Land a random copy in flight (the caller holds ``cond``)."""
        if not self.copies:
            return False
        bar, view, source, nbytes = self.copies.pop(self.rng.randrange(len(self.copies)))
        view.write(source)
        bar.transferred(nbytes, view)
        self.cond.notify_all()
        return True

    def maybe_land(self):
        with self.cond:
            while self.copies and self.rng.random() < 0.5:
                self.land_one()


class _Barrier:
    def __init__(self, machine, name="an mbarrier"):
        self.machine, self.name = machine, name
        self.count = self.pending = None
        self.tx = 0
        self.completed = 0  # phases completed; the current phase's parity is completed & 1

    def init(self, count):
        self.count = self.pending = count

    def _check_phase(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count
            self.machine.cond.notify_all()

    def arrive(self, count=1):
        _record("arrive", self.name, count)
        with self.machine.cond:
            if self.count is None:
                raise RuntimeError("an mbarrier was used before mbarrier.init")
            self.pending -= count
            if self.pending < 0:
                raise RuntimeError("more arrivals than the mbarrier's count in one phase")
            self._check_phase()
        if self.machine.linger:  # give the other partitions the moment this arrival opened
            time.sleep(self.machine.linger)

    def expect(self, nbytes):
        _record("expect", self.name, nbytes)
        with self.machine.cond:
            self.tx += nbytes
            self.pending -= 1
            if self.pending < 0:
                raise RuntimeError("more arrivals than the mbarrier's count in one phase")
            self._check_phase()

    def transferred(self, nbytes, view=None):  # under cond
        self.tx -= nbytes
        if self.tx < 0:
            into = getattr(view, "name", "shared memory")
            error = ExpectError(f"a copy into {into} landed more bytes than its barrier expected ({self.name}: "
                                f"{nbytes} bytes landed, {self.tx + nbytes} announced by mbarrier.expect)",
                                self.name, into)
            self.machine.error = self.machine.error or error
            self.machine.cond.notify_all()
            raise error
        self._check_phase()

    def done(self, parity) -> bool:
        """Whether the phase of this parity has completed: the current phase's parity is the other one."""
        return (self.completed & 1) != (parity & 1)

    def wait(self, parity):
        m = self.machine
        parity = int(parity)
        _record("wait", self.name, parity)
        m.maybe_land()
        me = threading.get_ident()
        with m.cond:
            while not self.done(parity):
                if m.error is not None:
                    raise m.error
                m.waiters[me] = (self, parity)
                try:
                    # a deadlock: every live partition waits, none of their phases has completed, nothing in flight
                    if len(m.waiters) >= m.threads and not m.copies \
                            and not any(bar.done(p) for bar, p in m.waiters.values()):
                        waits = sorted((m.partition.get(t, -1), bar.name, p, bar.completed)
                                       for t, (bar, p) in m.waiters.items())
                        said = "; ".join(f"partition {i} waits on {name} for parity {p} ({done} phases completed)"
                                         for i, name, p, done in waits)
                        m.error = Deadlock(f"every partition waits on a barrier and no copy is in flight: {said}",
                                           waits)
                        m.cond.notify_all()
                        raise m.error
                    if m.copies and m.rng.random() < 0.7:
                        m.land_one()
                    else:
                        m.cond.wait(timeout=0.05)
                finally:
                    m.waiters.pop(me, None)


class _SmemView:
    """A slot (or the whole buffer) of shared memory, possibly viewed transposed."""

    def __init__(self, storage, index, transposed=False, name="shared memory"):
        self.storage, self.index_, self.transposed, self.name = storage, index, transposed, name

    @property
    def dtype(self):
        return _OF_TORCH[self.storage.dtype]

    @property
    def type(self):
        shape = list(self.storage[self.index_].shape)
        return _Type(shape[::-1] if self.transposed else shape)

    def permute(self, order):
        assert tuple(order) == (1, 0)
        return _SmemView(self.storage, self.index_, not self.transposed, self.name)

    def key(self):
        return id(self.storage), self.index_

    def read(self):
        t = self.storage[self.index_]
        return t.t() if self.transposed else t

    def write(self, source):
        self.storage[self.index_] = source.to(self.storage.dtype)

    def index(self, i):
        return _SmemView(self.storage[self.index_], int(i), name=f"{self.name}[{int(i)}]")


class _Smem:
    def __init__(self, machine, dtype, shape, name="shared memory"):
        self.name = name
        if dtype is _DTYPES["int64"] or (isinstance(dtype, _DType) and dtype.name == "int64"):
            self.barriers = [_Barrier(machine, f"{name}[{i}]") for i in range(shape[0])]
            self.storage = None
        else:
            self.barriers = None
            # NaN until a copy lands: a product that reads a slot too early poisons the output
            self.storage = torch.full(list(shape), float("nan"), dtype=dtype.torch)

    @property
    def dtype(self):
        return _OF_TORCH[self.storage.dtype]

    @property
    def type(self):
        return _Type(self.storage.shape)

    def index(self, i):
        if self.barriers is not None:
            return self.barriers[int(i)]
        return _SmemView(self.storage, int(i), name=f"{self.name}[{int(i)}]")


# -----------------------------------------------------------------------------
# the names a kernel uses
# -----------------------------------------------------------------------------
class _State(threading.local):
    machine = None
    partition = None
    program = (0, 0, 0)
    grid = (1, 1, 1)


_STATE = _State()
_CURRENT = {}  # the launch's machine, shared by its threads (thread-local state is per thread)


def _machine():
    return _CURRENT["machine"]


def _allocate(dtype, shape, layout=None):
    machine = _machine()
    machine.allocations += 1
    return _Smem(machine, dtype, shape, _name_of_allocation(sys._getframe(1), machine.allocations))


def _gl_namespace():
    gl = types.SimpleNamespace(**_DTYPES)
    gl.constexpr = object
    for name in ("NVMMADistributedLayout", "SliceLayout", "DotOperandLayout", "NVMMASharedLayout",
                 "BlockedLayout", "SwizzledSharedLayout"):
        setattr(gl, name, _Layout)
    gl.program_id = lambda axis: _STATE.program[axis]
    gl.num_programs = lambda axis: _STATE.grid[axis]
    gl.static_range = range
    gl.zeros = lambda shape, dtype, layout=None: _Tensor(torch.zeros(list(shape), dtype=dtype.torch))
    gl.full = lambda shape, value, dtype, layout=None: _Tensor(torch.full(list(shape), value, dtype=dtype.torch))
    gl.arange = lambda start, end, layout=None: _Tensor(torch.arange(start, end, dtype=torch.int32))
    gl.to_tensor = lambda x: _Tensor(torch.tensor(x, dtype=torch.float32))
    gl.convert_layout = lambda x, layout, assert_trivial=False: x
    gl.reshape = lambda x, shape: _Tensor(x.data.reshape(list(shape)))
    gl.permute = lambda x, order: _Tensor(x.data.permute(tuple(order)))
    gl.split = lambda x: tuple(_Tensor(t) for t in x.data.unbind(-1))
    gl.join = lambda a, b: _Tensor(torch.stack([_data(a), _data(b)], dim=-1))
    gl.where = lambda c, a, b: _Tensor(torch.where(_data(c), _data(a), _data(b)))
    gl.maximum = lambda a, b: _Tensor(torch.maximum(_data(a), torch.as_tensor(_data(b))))
    gl.max = lambda x, axis: _Tensor(x.data.max(dim=axis).values)
    gl.sum = lambda x, axis: _Tensor(x.data.sum(dim=axis))
    gl.exp2 = lambda x: _Tensor(torch.exp2(x.data))
    gl.log2 = lambda x: _Tensor(torch.log2(x.data))
    gl.fma = lambda a, b, c: _Tensor(_data(a) * _data(b) + _data(c))

    def load(ptr):
        if isinstance(ptr.offset, int):
            return _Tensor(ptr.flat[ptr.offset].clone())
        return _Tensor(ptr.flat[_as_index(ptr.offset)])

    def store(ptr, value):
        ptr.flat[_as_index(ptr.offset)] = _data(value).to(ptr.flat.dtype)

    gl.load, gl.store = load, store
    gl.allocate_shared_memory = _allocate
    gl.warp_specialize = _warp_specialize
    return gl


def _mbarrier_namespace():
    mb = types.SimpleNamespace()
    mb.MBarrierLayout = _Layout
    mb.init = lambda bar, count: bar.init(count)
    mb.expect = lambda bar, nbytes: bar.expect(int(nbytes))
    mb.arrive = lambda bar, count=1: bar.arrive(count)
    mb.wait = lambda bar, phase: bar.wait(int(_data(phase)) if isinstance(phase, _Tensor) else int(phase))
    return mb


def _copy(desc, coords, bar, view):
    rows, cols = desc.block_shape
    r, c = (int(_data(x)) for x in coords)
    source = desc.base[r:r + rows, c:c + cols].clone()
    m = _machine()
    _record("copy", bar.name, source.numel() * source.element_size(), view.name, (r, c))
    with m.cond:
        if m.reading.get(view.key(), 0):
            m.error = RaceError("a TMA copy was issued into a slot that a wgmma issued earlier may still be reading: "
                                "release a slot only after the warpgroup_mma_wait that completes its products")
            m.cond.notify_all()
            raise m.error
        m.copies.append((bar, view, source, source.numel() * source.element_size()))
    m.maybe_land()


def _tma_namespace():
    return types.SimpleNamespace(async_copy_global_to_shared=_copy)


class _Pending:
    """An issued ``warpgroup_mma``: its shared-memory operands are read when a ``warpgroup_mma_wait`` completes it
    (the latest moment the hardware may read them), and until then no copy may be issued into them."""

    def __init__(self, a, b, acc, use_acc):
        self.a, self.b, self.acc, self.use_acc = a, b, acc, use_acc
        self.machine = _machine()
        self.views = [x for x in (a, b) if isinstance(x, _SmemView)]
        self.issued = self.machine.issued.setdefault(threading.get_ident(), [])  # this warpgroup's, in order
        self.issued.append(self)
        with self.machine.cond:
            for view in self.views:
                self.machine.reading[view.key()] = self.machine.reading.get(view.key(), 0) + 1
        self.result = None

    def complete(self):
        if self.result is None:
            if any(p is self for p in self.issued):
                self.issued.remove(self)
            acc = _complete(self.acc)
            a = self.a.read() if isinstance(self.a, _SmemView) else self.a.data
            out = a.float() @ self.b.read().float()
            self.result = _Tensor(out + acc.data if self.use_acc else out)
            with self.machine.cond:
                for view in self.views:
                    self.machine.reading[view.key()] -= 1
        return self.result


def _complete(x):
    return x.complete() if isinstance(x, _Pending) else x


def _warpgroup_mma(a, b, acc, *, use_acc=True, is_async=False, **_):
    pending = _Pending(a, b, acc, use_acc)
    return pending if is_async else pending.complete()


def _warpgroup_mma_wait(num_outstanding=0, deps=None):
    """Complete every product this warpgroup issued but the ``num_outstanding`` newest, in issue order, as the
    hardware does; a product in ``deps`` still in flight after that is the kernel's mistake."""
    issued = _machine().issued.setdefault(threading.get_ident(), [])
    n = int(_data(num_outstanding))
    for pending in list(issued[:max(len(issued) - n, 0)]):
        pending.complete()
    if any(isinstance(d, _Pending) and d.result is None for d in deps):
        raise RaceError(f"warpgroup_mma_wait(num_outstanding={n}) leaves the {n} newest products in flight, and one "
                        "it should return is among them: wait for fewer, or issue that product first")
    done = [_complete(d) for d in deps]
    return done[0] if len(done) == 1 else tuple(done)


class _Descriptor:
    """``TensorDescriptor.from_tensor``: the 2-D tensor and the box."""

    def __init__(self, base, block_shape, layout=None):
        self.base, self.block_shape = base, list(block_shape)
        self.layout = layout

    @classmethod
    def from_tensor(cls, tensor, block_shape, layout=None):
        return cls(tensor, block_shape, layout)

    @property
    def dtype(self):
        return _OF_TORCH[self.base.dtype]

    @property
    def block_type(self):
        rows, cols = self.block_shape
        return types.SimpleNamespace(nbytes=rows * cols * self.base.element_size(), shape=[rows, cols])


# -----------------------------------------------------------------------------
# converting a kernel, running a launch
# -----------------------------------------------------------------------------
_NAMES = None


def _names():
    global _NAMES
    if _NAMES is None:
        _NAMES = dict(gl=_gl_namespace(), mbarrier=_mbarrier_namespace(), tma=_tma_namespace(),
                      warpgroup_mma=_warpgroup_mma, warpgroup_mma_wait=_warpgroup_mma_wait)
    return _NAMES


def _is_gluon(obj) -> bool:
    return type(obj).__name__ == "GluonJITFunction"


def _convert(jit_fn, memo, replace=None, calls=None):
    """The Python function behind ``jit_fn`` with its names bound to the model (and its Gluon callees converted).

    ``replace`` (``{id(course function): replacement}``): a callee found there runs as its replacement, whose own
    calls are converted as they are (never replaced: a replacement that calls the function it replaces calls the
    course's); each call of a replacement is counted in ``calls`` under the replaced function's name."""
    if id(jit_fn) in memo:  # by identity: hashing a JITFunction walks its dependencies
        return memo[id(jit_fn)]
    if replace and id(jit_fn) in replace:
        inner = _convert(replace[id(jit_fn)], {})
        name = jit_fn.fn.__name__

        def replaced(*args, **kwargs):
            with _CALLS_LOCK:
                calls[name] += 1
            return inner(*args, **kwargs)

        memo[id(jit_fn)] = replaced
        return replaced
    if not _is_gluon(jit_fn):
        raise TypeError(f"{getattr(jit_fn, '__name__', jit_fn)!r} is not a @gluon.jit function: the model runs "
                        "Gluon functions only")
    fn = jit_fn.fn
    scope = dict(fn.__globals__)
    memo[id(jit_fn)] = converted = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    scope.update(_names())
    for name in fn.__code__.co_names:
        value = scope.get(name)
        if _is_gluon(value):
            scope[name] = _convert(value, memo, replace, calls)
    return converted


_CALLS_LOCK = threading.Lock()


def _warp_specialize(partitions, warps, regs):
    """Each partition in a thread of its own; the first (the default partition) too."""
    machine = _machine()
    program, grid = _STATE.program, _STATE.grid
    machine.threads = len(partitions)
    errors = []

    def run(index, fn, args):
        _STATE.program, _STATE.grid, _STATE.partition = program, grid, index
        with machine.cond:
            machine.partition[threading.get_ident()] = index
        try:
            with torch.no_grad():  # grad mode is per thread; a kernel's stores are never recorded
                fn(*args)
            with machine.cond:  # a partition that has ended waits for nothing
                machine.threads -= 1
                machine.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the launching thread)
            errors.append(exc)
            with machine.cond:
                if machine.error is None:
                    machine.error = exc if isinstance(exc, Deadlock) else Deadlock(f"a partition failed: {exc!r}")
                machine.cond.notify_all()

    threads = [threading.Thread(target=run, args=(i, ) + tuple(p), daemon=True) for i, p in enumerate(partitions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        if t.is_alive():
            raise Deadlock("a partition did not finish in 120 s")
    real = [e for e in errors if not isinstance(e, Deadlock)]
    if real:
        raise real[0]
    if errors:
        raise errors[0]
    if machine.copies:
        raise RuntimeError("the kernel ended with TMA copies still in flight")


def run_kernel(jit_fn, grid, args, seed=0, linger=0.0, *, replace=None, trace=None, calls=None):
    """Run ``jit_fn``'s Python over ``grid`` with the model (programs one after another, each a new machine).

    ``replace``, ``trace``, ``calls``: as :func:`running`'s (``calls`` a ``Counter`` the replacements' calls are
    added to)."""
    replace = {id(course): new for course, new in (replace or {}).items()}
    fn = _convert(jit_fn, {}, replace, calls if calls is not None else collections.Counter())
    _CURRENT["trace"] = trace
    rng = random.Random(seed)
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    _STATE.grid = grid
    args = [_wrap(a) for a in args]
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                _CURRENT["machine"] = _Machine(rng, linger)
                _STATE.program = (x, y, z)
                with torch.no_grad():
                    fn(*args)


def _wrap(a):
    if isinstance(a, torch.Tensor):
        return _Pointer(a.view(-1))
    return a


@contextlib.contextmanager
def running(seed: int = 0, host_modules=None, linger: float = 0.0, *, replace=None, trace=None):
    """Within the block, Gluon launches run their Python on the CPU with the model (other launches as usual).

    Yields an object whose ``calls`` (a ``Counter``) counts, by the replaced function's name, the calls the
    launched kernels made to each replacement of ``replace``.

    ``host_modules`` (besides those named in :data:`HOST_MODULES`): the modules whose host code builds
    descriptors and layouts; their ``TensorDescriptor`` and ``gl`` are the model's within the block. ``seed``
    orders the copies' landings (the threads' own interleaving varies from run to run as well). ``linger``
    (seconds): each arriving thread pauses that long after its arrival, so that the partition it released
    acts first; a slot released before the products that read it have completed is then caught
    (:class:`RaceError`) rather than left to the threads' timing.

    ``replace`` (``{course @gluon.jit function: replacement @gluon.jit function}``): wherever a launched kernel
    calls the course function (by name, at any depth), the replacement runs instead, with the same arguments; the
    replacement's own calls are not replaced. Nothing is changed in the modules: the model binds the names of the
    kernel's copy it runs. ``trace`` (a list): every partition's barrier operations and TMA copies are appended
    to it as :class:`Event`, in the order each thread issues them."""
    from triton.runtime.jit import JITFunction

    registered = [sys.modules[name] for name in HOST_MODULES if name in sys.modules]
    host_modules = [m for m in dict.fromkeys(list(host_modules or ()) + registered)  # given and registered ones
                    if hasattr(m, "TensorDescriptor")]  # that build descriptors themselves
    original = JITFunction.run
    saved = [(m, m.TensorDescriptor, m.gl) for m in host_modules]
    host_gl = types.SimpleNamespace(**vars(_names()["gl"]))

    def run(self, *args, grid, warmup, **kwargs):
        if not _is_gluon(self):
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        run_kernel(self, grid(kwargs) if callable(grid) else grid, args, seed=seed, linger=linger, replace=replace,
                   trace=trace, calls=session.calls)
        return None

    session = types.SimpleNamespace(calls=collections.Counter())

    JITFunction.run = run
    for m, _, _ in saved:
        m.TensorDescriptor = _Descriptor
        m.gl = host_gl  # the host code's layouts and dtypes (the kernels' own names are bound in _convert)
    _ACTIVE.append(seed)
    try:
        yield session
    finally:
        _CURRENT.pop("trace", None)
        _ACTIVE.pop()
        JITFunction.run = original
        for m, descriptor, gl in saved:
            m.TensorDescriptor, m.gl = descriptor, gl
