"""Compile the lesson kernels for a GPU you do not have, and check that they fit it.

Colab's free T4 (sm_75) has 64 KiB of shared memory per block and no bf16; an
A100 (sm_80) has 163 KiB; every NVIDIA GPU gives a thread at most 255
registers. A kernel whose tiles are too big for a chip fails there with
"out of resource: shared memory" at its first launch. Triton can compile for
a target you name, so we can find that out on a laptop:

    TRITON_INTERPRET=0 python -m course_utils.kernels.targets          # sm_75 and sm_80
    TRITON_INTERPRET=0 python -m course_utils.kernels.targets --sm 75

Each lesson kernel is compiled with the configuration its launcher would
choose on that GPU (the same launcher code, with the launch itself captured
instead of run) and with the facts Triton's launcher specialises on (pointers
16-byte aligned, integers equal to 1 or divisible by 16), so that the binary
is the one the GPU would build; its shared memory, registers and spills are
read from it (``cuobjdump --dump-resource-usage``, which ships with Triton).
With the Triton version the GPU runs, the figures are the GPU's: the
backward kernels of :mod:`.fast_backward` compiled here with triton 3.6 gave
the shared memory the H200 reported and spills within 6 values per thread
of it (``results/tune_backward.json``). ``TRITON_INTERPRET=0`` must be set
before anything imports Triton, since the interpreter would replace the
compiler.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import torch

from .chips import MAX_REGISTERS, TARGETS  # noqa: F401  (targets.TARGETS: the table, read here and by tests)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What one kernel needs from a chip, read from its compiled binary."""

    kernel: str
    case: str
    sm: int
    shared_bytes: int
    registers: int
    spill_bytes: int
    num_warps: int
    num_stages: int
    setmaxnreg: tuple = ()  # ("inc" | "dec", registers) of each setmaxnreg in the PTX (warp-specialised kernels)
    # (name, warpgroup matrix products, TMA copies into shared memory) of each partition of a warp-specialised
    # kernel's TTGIR ("default", "partition0", ...); () when the kernel is not specialised
    partitions: tuple = ()
    # the distinct wgmma instructions of the PTX, shape and types ("m64n128k32.f32.e4m3.e4m3"); () when none
    wgmma: tuple = ()
    # ptxas's performance warnings (compile_launch(..., warnings=True)), e.g. every wgmma serialised (C7513)
    ptxas_warnings: tuple = ()

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= TARGETS[self.sm][1] and self.registers <= MAX_REGISTERS

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "DOES NOT FIT"
        regs = f", {self.registers:3d} registers, {self.spill_bytes} bytes spilled" if self.registers >= 0 else ""
        return (f"sm_{self.sm} {self.kernel:<30} {self.case:<26} warps {self.num_warps} stages {self.num_stages}: "
                f"shared {self.shared_bytes / 1024:5.1f} KiB of {TARGETS[self.sm][1] // 1024}{regs} -> {verdict}")


@contextlib.contextmanager
def _captured_launches(launch: bool = False):
    """Record ``(kernel, args, kwargs)`` of each Triton launch in the block instead of running it.

    ``launch=True`` (a GPU): run each launch too, and record ``(kernel, args, kwargs, grid, compiled)``
    (``benchmarks/host_overhead.py --launches`` replays them).
    """
    from triton.runtime.jit import JITFunction

    launches = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not launch:
            launches.append((self, args, kwargs))
            return None
        compiled = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        launches.append((self, args, dict(kwargs), grid, compiled))
        return compiled

    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = original


@contextlib.contextmanager
def _as_if_on_a_gpu(sm: int):
    """Let the launchers pick their configurations for GPU ``sm_<sm>``, given CPU tensors (nothing runs)."""
    from . import backward, forward

    saved = forward._interpreted, forward._capability, backward._capability, os.environ.get("TRITON_INTERPRET")
    forward._interpreted = lambda device: False
    forward._capability = backward._capability = lambda device: (sm // 10, sm % 10)
    os.environ["TRITON_INTERPRET"] = "1"  # validate()'s "CPU tensors need the interpreter" guard
    try:
        yield
    finally:
        forward._interpreted, forward._capability, backward._capability = saved[:3]
        if saved[3] is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved[3]


_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "i32", torch.int64: "i64"}  # integers: lesson 12's cu_seqlens and the tile tables from it


def _specialised_source(kernel, args, kwargs, target):
    """``(ASTSource, options)`` of one captured launch, as ``JITFunction.run`` would build them on ``target``.

    Triton's launcher specialises each argument before it compiles:
    pointers known to be 16-byte aligned and integers divisible by 16 (or
    equal to 1) let it vectorise loads and pipeline them through shared
    memory. A compile without those facts is another kernel (the dK/dV
    kernel of :mod:`.fast_backward` needed half the shared memory of the
    GPU's build). So the launcher's own binder is run here, with the
    target's backend. Triton versions without it (the binder is internal)
    get the unspecialised source of :func:`_signature`.
    """
    from triton.compiler import ASTSource, make_backend

    try:
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(target)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        kw = dict(kwargs)
        kw.setdefault("debug", False)
        bound, specialization, options = binder(*args, **kw)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another Triton's internals
        signature, constexprs = _signature(kernel, args, kwargs)
        options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
        return ASTSource(kernel, signature, constexprs), options
    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel (hopper_ws.py): its own source kind
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    return ASTSource(kernel, signature, constexprs, attrs), {k: v for k, v in vars(options).items() if v is not None}


def _signature(kernel, args, kwargs):
    """Triton's signature and constexprs for one captured launch, without its specialisation."""
    import triton.language as tl

    try:  # host TMA descriptors (lesson 06's fast kernels): typed by their dtype and box
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover
        TensorDescriptor = ()
    values = dict(zip(kernel.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k in kernel.arg_names})
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, TensorDescriptor):
            box = ",".join(str(size) for size in value.block_shape)
            signature[param.name] = f"tensordesc<{_TYPES[value.base.dtype]}[{box}]>"
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif isinstance(value, tl.dtype) or value is None:  # None: an unused argument (a pointer launch's descriptors)
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            raise TypeError(f"{kernel.__name__}: argument {param.name} of type {type(value).__name__}")
    return signature, constexprs


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """``(registers, shared bytes, spill bytes)`` of a cubin, by cuobjdump.

    Spilled registers live in each thread's stack frame (``STACK``: what the
    driver reports as the kernel's local memory, Triton's ``n_spills`` times
    4); ``LOCAL`` counts only local arrays the source declares, which a Triton
    kernel has none of.
    """
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    reg = int(re.search(r"REG:(\d+)", text).group(1))
    shared = int(re.search(r"SHARED:(\d+)", text).group(1))
    stack = int(re.search(r"STACK:(\d+)", text).group(1))
    local = int(re.search(r"LOCAL:(\d+)", text).group(1))
    return reg, shared, stack + local


def ptxas_warnings(ptx: str, sm: int) -> tuple[str, ...]:
    """The performance warnings ``ptxas`` prints for ``ptx`` (its ``-v`` log, e.g. C7513: "wgmma.mma_async
    instructions are serialized ..."), from the ptxas that ships with Triton.

    Triton's own compile keeps that log only when asked, and a kernel served from Triton's cache never runs ptxas
    at all, so this runs it again on the PTX (about half a second for a warp-specialised kernel).
    """
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    arch = f"sm_{sm}a" if sm == 90 else f"sm_{sm}"
    with tempfile.TemporaryDirectory() as folder:
        src = os.path.join(folder, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([tool, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(folder, "kernel.cubin")],
                             capture_output=True, text=True, check=True).stderr
    return tuple(line.split("ptxas info    : ", 1)[-1] for line in log.splitlines() if "Performance Loss" in line)


class _StopBeforeMachineCode(Exception):
    def __init__(self, metadata):
        self.metadata = metadata


@contextlib.contextmanager
def _without_ptxas():
    """Stop Triton's pipeline after the PTX: ptxas is what takes tens of seconds."""
    from triton.backends.nvidia.compiler import CUDABackend

    original = CUDABackend.make_cubin

    def stop(self, src, metadata, *args, **kwargs):
        raise _StopBeforeMachineCode(metadata)

    CUDABackend.make_cubin = stop
    try:
        yield
    finally:
        CUDABackend.make_cubin = original


def compile_binary(kernel, args, kwargs, sm: int):
    """Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``) of one captured launch, for
    ``sm_<sm>``, specialised as the GPU's launcher would (what :func:`compile_launch` reads)."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", sm, 32)
    source, options = _specialised_source(kernel, args, kwargs, target)
    return triton.compile(source, target=target, options=options)


def compile_launch(kernel, args, kwargs, sm: int, case: str, *, registers: bool = True,
                   warnings: bool = False) -> Compiled:
    """Compile one captured launch for ``sm_<sm>`` and read what it needs.

    Shared memory is known once Triton has laid out its tiles (before PTX);
    registers and spills only after ``ptxas`` made machine code, which takes
    tens of seconds per kernel: ``registers=False`` skips it (reported as -1).
    ``warnings``: also run :func:`ptxas_warnings` on the PTX.
    """
    if not registers:
        try:
            with _without_ptxas():
                compiled = compile_binary(kernel, args, kwargs, sm)  # from Triton's cache
        except _StopBeforeMachineCode as stopped:
            meta = stopped.metadata
            return Compiled(kernel.__name__, case, sm, int(meta["shared"]), -1, -1,
                            meta["num_warps"], meta["num_stages"])
    else:
        compiled = compile_binary(kernel, args, kwargs, sm)
    n_regs, static_shared, spills = _resource_usage(compiled.asm["cubin"])
    # Triton's dynamic shared memory (tiles, pipeline buffers) is in its metadata.
    shared = max(int(compiled.metadata.shared), static_shared)
    setmaxnreg = tuple(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"]))
    wgmma = tuple(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.([a-z0-9.]+)", compiled.asm["ptx"]))))
    return Compiled(kernel.__name__, case, sm, shared, n_regs, spills,
                    compiled.metadata.num_warps, compiled.metadata.num_stages, setmaxnreg,
                    ws_partitions(compiled.asm.get("ttgir", "")), wgmma,
                    ptxas_warnings(compiled.asm["ptx"], sm) if warnings else ())


def ws_partitions(ttgir: str) -> tuple:
    """``(name, warpgroup products, TMA loads)`` of each partition of a ``ttg.warp_specialize`` in ``ttgir``.

    A partition runs from its header (``default {``, ``partitionN(``) to the next one; the last one to the end
    of the text (what follows the region holds neither operation in the course's kernels).
    """
    heads = list(re.finditer(r"^\s*(default) \{|^\s*(partition\d+)\(", ttgir, flags=re.M))
    out = []
    for i, m in enumerate(heads):
        body = ttgir[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(ttgir)]
        out.append((m.group(1) or m.group(2), len(re.findall(r"ttng\.warp_group_dot ", body)),
                    len(re.findall(r"ttng\.async_tma_copy_global_to_local ", body))))
    return tuple(out)


def lesson_launches(sm: int, head_dim: int, causal: bool = True, dtype: torch.dtype | None = None):
    """The launches the lesson launchers make on a GPU of compute capability ``sm``.

    Yields ``(kernel, args, kwargs, case)``: kernel A (lesson 04), kernel B
    (lesson 05), the three backward kernels (lesson 07), the window kernels
    (lesson 08, with the package's split of the sink keys) and lesson 12's
    kernels (packed documents, soft-cap, ALiBi, sink logits), in fp16 below
    sm_80 (no bf16 there) and bf16 from sm_80 on, for a GQA problem.
    """
    from . import backward, forward

    dtype = dtype or (torch.float16 if sm < 80 else torch.bfloat16)
    B, hq, hkv, n = 1, 4, 2, 256
    q = torch.zeros(B, hq, n, head_dim, dtype=dtype)
    k = torch.zeros(B, hkv, n, head_dim, dtype=dtype)
    case = f"{str(dtype).replace('torch.', '')} D={head_dim} causal={causal}"
    with _as_if_on_a_gpu(sm), _captured_launches() as launches:
        forward.flash_attention_forward(q, q, q, causal)
        forward.flash_attention_gqa_forward(q, k, k, causal)
        backward.attention_backward(q, k, k, q, torch.zeros(B, hq, n), q, causal)
        # lesson 08: the window and sinks (forward, dK/dV with the sinks' far queries split off, dQ)
        forward.flash_attention_window_forward(q, k, k, window_size=64, sink_size=4)
        backward.attention_backward(q, k, k, q, torch.zeros(B, hq, n), q, True, window_size=64, sink_size=4)
        # lesson 12: packed documents with every score modification (forward, dK/dV, dQ)
        mods = dict(cu_seqlens=torch.tensor([0, 100, 130, n], dtype=torch.int32), softcap=30.0,
                    alibi_slopes=torch.full((hq,), 0.5), sink_logits=torch.zeros(hq))
        forward.flash_attention_mods_forward(q, k, k, True, **mods)
        backward.attention_backward(q, k, k, q, torch.zeros(B, hq, n), q, True, **mods)
    for kernel, args, kwargs in launches:
        yield kernel, args, kwargs, case


def check_targets(sms=(75, 80), head_dims=(64, 128), *, registers: bool = True, dtype=None) -> list[Compiled]:
    """Compile every lesson kernel for each target and head dim (in ``dtype``, else the chip's 16-bit one)."""
    results = []
    for sm in sms:
        for d in head_dims:
            for kernel, args, kwargs, case in lesson_launches(sm, d, dtype=dtype):
                results.append(compile_launch(kernel, args, kwargs, sm, case, registers=registers))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sm", type=int, nargs="*", default=[75, 80], choices=sorted(TARGETS))
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--no-registers", action="store_true", help="skip ptxas (fast: shared memory only)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("Triton's interpreter is on: run with TRITON_INTERPRET=0 to compile for a GPU.")
        return 2
    results = check_targets(args.sm, args.head_dims, registers=not args.no_registers)
    for r in results:
        print(r)
    bad = [r for r in results if not r.fits]
    print(f"{len(results) - len(bad)} of {len(results)} kernels fit their target.")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
