"""Launching a compiled kernel again without Triton's binder: host time on every training step.

``kernel[grid](*args)`` does the same work on every call before the compiled kernel's launcher runs: it
specialises each argument (a pointer's alignment, an integer equal to 1 or divisible by 16, a descriptor's box
and layout), builds the compile cache's key from that, and checks the kernel's globals. For lesson 11's Gluon
backward kernels that is 30 µs a launch against 12 µs for the launcher alone, on an H100 (``kernel_grid_us`` and
``compiled_run_us`` in results/host_step_h100.json); in a short training step, which the host paces, it is time
the GPU waits.

:class:`BoundLauncher` does Triton's work once per *call key* and, for the next call with the same key, calls the
compiled kernel's launcher directly. The key is the caller's: everything Triton would specialise on must be in it
(the dtypes, every integer and boolean argument, whether each raw pointer is 16-byte aligned, the shapes behind
each TMA descriptor); floats and tensors' addresses need not be (the launcher reads them on every call); the
current device is added to it here. Where no compiled kernel comes back (Triton's interpreter; :mod:`.gluon_cpu`'s
model), every call goes through ``kernel[grid]``.
"""

from __future__ import annotations

from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# Triton's own launch path, as imported (course_utils is imported before any check replaces it)
_JIT_RUN = JITFunction.run


class BoundLauncher:
    """``launcher(key, grid, args, **options)``: ``kernel[grid](*args, **options)``, the first time a ``key`` is
    seen on the current device; then the compiled kernel's own launcher with ``args``.

    ``args``: every parameter of the kernel, in its signature's order, positionally (constexprs included, as
    Triton's launcher takes them); ``options``: the launch options (``num_warps``, ``maxnreg``...), which a key
    stands for too. A call whose ``args`` do not name every parameter is never bound, nor one whose key is
    ``None`` (what a caller passes for CPU tensors). While anything watches launches by replacing
    ``JITFunction.run`` (the graders' proof of work and launch counts, :mod:`.targets`' capture), every call goes
    through ``kernel[grid]``, so that it sees them all.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}

    def __call__(self, key, grid, args, **options):
        if key is None or JITFunction.run is not _JIT_RUN:
            return self.kernel[grid](*args, **options)
        device = driver.active.get_current_device()
        compiled = self.compiled.get((device, key))
        if compiled is None:
            compiled = self.kernel[grid](*args, **options)
            if _bindable(compiled) and len(args) == len(self.kernel.arg_names):
                self.compiled[(device, key)] = compiled
            return compiled
        grid = tuple(grid) + (1,) * (3 - len(grid))
        stream = driver.active.get_current_stream(device)
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *args), knobs.runtime.launch_enter_hook,
                     knobs.runtime.launch_exit_hook, *args)
        return compiled


def _bindable(compiled) -> bool:
    """A compiled kernel with its launcher loaded (``kernel[grid]`` returns one on a GPU)."""
    return all(getattr(compiled, name, None) is not None for name in ("run", "function", "packed_metadata"))


def aligned(*tensors) -> bool:
    """Whether every tensor's address is a multiple of 16 bytes (Triton specialises a pointer on it)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)
