"""course_utils.kernels.launch.BoundLauncher with a stand-in kernel (no GPU needed): Triton's ``kernel[grid]`` the
first time a key is seen, the compiled kernel's own launcher after that; never bound for a ``None`` key, a kernel
that gave back no compiled kernel (the interpreter), a call that leaves parameters out, or while something has
replaced ``JITFunction.run`` to watch launches (the graders). tests/test_hopper_ws_bwd.py checks the real
launches on a Hopper GPU."""

import pytest

from course_utils.grading.proof import count_launches
from course_utils.kernels import launch


class Compiled:
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)

    def launch_metadata(self, grid, stream, *args):
        return None


class Kernel:
    """``kernel[grid](*args, **options)`` as Triton's: records the launch, returns the compiled kernel (or None)."""
    arg_names = ["x", "n", "BLOCK"]

    def __init__(self, compiled):
        self.compiled, self.launches = compiled, []

    def __getitem__(self, grid):
        return lambda *args, **options: (self.launches.append((grid, args, options)), self.compiled)[1]


class Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(launch, "driver", type("Drivers", (), {"active": Driver()}))
    compiled = Compiled()
    return compiled, Kernel(compiled)


def test_a_key_is_launched_by_triton_once_then_by_the_compiled_launcher(stand_in):
    compiled, kernel = stand_in
    bound = launch.BoundLauncher(kernel)
    for x in ("a", "b", "c"):
        assert bound(("bf16", 64), (4, 2), (x, 64, 128), num_warps=4) is compiled
    assert kernel.launches == [((4, 2), ("a", 64, 128), {"num_warps": 4})]
    hooks = (launch.knobs.runtime.launch_enter_hook, launch.knobs.runtime.launch_exit_hook)
    assert compiled.runs == [(4, 2, 1, 1234, "function", "packed", None, *hooks, x, 64, 128) for x in "bc"]
    bound(("bf16", 128), (8,), ("d", 128, 128), num_warps=4)  # another key: Triton's launch again
    assert len(kernel.launches) == 2 and len(compiled.runs) == 2 and len(bound.compiled) == 2


@pytest.mark.parametrize("why", ["no key", "no compiled kernel", "parameters left out"])
def test_a_launch_is_never_bound_without_a_key_a_compiled_kernel_or_every_parameter(stand_in, why):
    compiled, kernel = stand_in
    key, args = (None if why == "no key" else "key"), ("x", 64) if why == "parameters left out" else ("x", 64, 128)
    if why == "no compiled kernel":
        kernel.compiled = None
    bound = launch.BoundLauncher(kernel)
    for _ in range(3):
        bound(key, (1,), args)
    assert len(kernel.launches) == 3 and compiled.runs == [] and bound.compiled == {}


def test_while_launches_are_watched_every_call_goes_through_triton(stand_in):
    compiled, kernel = stand_in
    bound = launch.BoundLauncher(kernel)
    bound("key", (1,), ("x", 64, 128))  # bound now
    with count_launches():  # the graders' hook replaces JITFunction.run: a bound launch would slip past it
        bound("key", (1,), ("y", 64, 128))
    assert [args for _, args, _ in kernel.launches] == [("x", 64, 128), ("y", 64, 128)] and compiled.runs == []
    bound("key", (1,), ("z", 64, 128))  # the hook gone: bound again
    assert compiled.runs[-1][-3:] == ("z", 64, 128)


def test_aligned_reads_each_address():
    class T:
        def __init__(self, address):
            self.address = address

        def data_ptr(self):
            return self.address

    assert launch.aligned(T(512), T(16)) and not launch.aligned(T(512), T(8)) and launch.aligned()
