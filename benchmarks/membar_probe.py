"""Where Triton's compiler puts a warpgroup barrier between mbarrier operations, for sm_90, without a GPU.

Lesson 11's Gluon consumers hold two ``bar.sync`` a K/V tile (``results/NOTES.md``: one before the wait for K,
one before the single-thread arrive that releases the slot). Neither is in the kernel's source: Triton's shared
memory barrier pass (membar) inserts them while lowering. This probe compiles one small Gluon kernel per pattern of
the consumer's loop, a loop of ``n`` steps over mbarriers in shared memory, and counts the ``bar.sync`` in the
loop's body (the PTX from the loop's label to the branch back to it):

- ``wait``: one ``mbarrier.wait`` a step (on a ring of two, as the K and V waits);
- ``arrive``: one ``mbarrier.arrive`` a step (as the slot release);
- ``wait_then_wait``: two waits a step on two allocations (the K wait, then the V wait);
- ``wait_then_arrive``: a wait, then an arrive on another allocation (the V wait, then the release).

``python benchmarks/membar_probe.py [--out results/membar_probe.json]`` records the counts under the Triton
version that made them (the course's GPUs run 3.6; run it with that wheel first on ``PYTHONPATH`` for theirs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATTERNS = ("wait", "arrive", "wait_then_wait", "wait_then_arrive")


def _kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    @gluon.jit
    def ring(x_ptr, n, PATTERN: gl.constexpr):
        a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(a.index(i), count=1)
            mbarrier.init(b.index(i), count=1)
        acc = 0
        for j in range(n):
            if PATTERN == "wait" or PATTERN == "wait_then_wait" or PATTERN == "wait_then_arrive":
                mbarrier.wait(a.index(j % 2), (j // 2) & 1)
            acc += j
            if PATTERN == "wait_then_wait":
                mbarrier.wait(b.index(j % 2), (j // 2) & 1)
            if PATTERN == "arrive":
                mbarrier.arrive(a.index(j % 2), count=1)
            if PATTERN == "wait_then_arrive":
                mbarrier.arrive(b.index(j % 2), count=1)
        gl.store(x_ptr, acc)

    return ring


def loop_barriers(ptx: str) -> int:
    """``bar.sync`` in the body of the PTX's one loop: from the first label that a later branch jumps back to, to
    that branch."""
    for label in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        back = re.search(r"bra(\.uni)?\s+" + re.escape(label.group(1)) + ";", ptx[label.end():])
        if back is not None:
            return ptx[label.end():label.end() + back.start()].count("bar.sync")
    raise ValueError("no loop (a label with a branch back to it) in the PTX")


def probe(patterns=PATTERNS) -> dict:
    """``{pattern: bar.sync in the loop body}`` with the installed Triton, for sm_90 and 4 warps."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _kernel()
    counts = {}
    for pattern in patterns:
        source = GluonASTSource(kernel, {"x_ptr": "*i32", "n": "i32", "PATTERN": "constexpr"}, {(2, ): pattern})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        counts[pattern] = loop_barriers(compiled.asm["ptx"])
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="a JSON file to add this Triton version's counts to")
    args = parser.parse_args(argv)
    import triton

    counts = probe()
    print(f"triton {triton.__version__}, sm_90, bar.sync in the loop body: {counts}")
    if args.out:
        recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
        recorded[triton.__version__] = counts
        args.out.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    # the compiler, not the interpreter (set here, not at import: tests/test_tune_scripts.py imports this module)
    os.environ.setdefault("TRITON_INTERPRET", "0")
    main()
