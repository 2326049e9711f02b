"""What every test file shares: where tensors live, and which machine a test belongs to.

The suite runs on a machine without a GPU (Triton's interpreter, CI) and on a
machine with one (kernels compiled for it): ``make test`` on both. A test that
only makes sense on one of them says so with a marker and a reason:

- ``@pytest.mark.interpreter("why")``: needs Triton's CPU interpreter (for
  example a kernel that segfaults the interpreter, or the interpreter switch
  itself). Skipped, with its reason, where kernels run compiled on a GPU.
- ``@pytest.mark.cpu_processes("why")``: starts CPU processes running Triton's
  interpreter; skipped, with the reason, where that interpreter is broken
  (triton < 3.8 with numpy >= 2.4, as on the course's H200 image).
- ``@pytest.mark.gpu("why")``: needs a CUDA GPU. Skipped, with its reason,
  where there is none. (``tests/test_gpu_fast.py`` further needs Hopper.)

Everything else runs on both, with tensors on :data:`DEVICE`.
"""

import importlib.util
import os
import sys
from pathlib import Path

import course_utils  # first: switches Triton's interpreter on when there is no GPU
import pytest

DEVICE = course_utils.DEVICE
ON_GPU = DEVICE == "cuda"
INTERPRETER_PROBLEM = course_utils.environment.interpreter_problem()


# Measured on the H200 (results/ws_smoke_h200.txt): the one-warpgroup warp-specialised kernels compile with Triton 3.6
# and then deadlock, so the kernels refuse such a launch on a GPU (fast.refuse_specialised_on_gpu). A test that would
# run one skips there with this reason; the interpreter still checks its arithmetic on the CPU.
SPECIALISED_DEADLOCK = ("one-warpgroup warp-specialised kernels deadlock on the H200 with Triton 3.6 "
                        "(results/ws_smoke_h200.txt): refused on a GPU, checked in the interpreter")


def skip_if_specialised_on_gpu(warp_specialize, num_warps=4):
    """Skip, on a GPU, a test that would launch a one-warpgroup warp-specialised kernel (see SPECIALISED_DEADLOCK)."""
    if ON_GPU and warp_specialize and num_warps == 4:
        pytest.skip(SPECIALISED_DEADLOCK)


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter(reason): needs Triton's CPU interpreter")
    config.addinivalue_line("markers", "cpu_processes(reason): starts CPU processes that run Triton's interpreter")
    config.addinivalue_line("markers", "gpu(reason): needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, wrong_machine, where in (
            ("interpreter", ON_GPU, "on a GPU machine (kernels compile for the GPU)"),
            ("gpu", not ON_GPU, "without a GPU"),
        ):
            marker = item.get_closest_marker(name)
            if marker is not None and wrong_machine:
                reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
                item.add_marker(pytest.mark.skip(reason=f"not run {where}: {reason}"))
        # On a GPU machine whose triton/numpy pair breaks the interpreter (H200: triton 3.6,
        # numpy 2.5), tests that start CPU interpreter processes cannot run: say why.
        if item.get_closest_marker("cpu_processes") is not None and INTERPRETER_PROBLEM:
            item.add_marker(pytest.mark.skip(reason=f"not run here: {INTERPRETER_PROBLEM}"))


@pytest.fixture(autouse=True)
def _interpreter_switch_left_as_found():
    """Fail the test that changes ``TRITON_INTERPRET`` and leaves it changed.

    ``@triton.jit`` reads the variable when it decorates, so a leaked ``"1"`` on a GPU machine turns
    every kernel defined later in the same process into an interpreted one, and a test far away
    fails with "Cannot call @triton.jit'd outside of the scope of a kernel". (Autouse fixtures are
    set up first, so this runs after ``monkeypatch`` has restored what it recorded.)
    """
    before = os.environ.get("TRITON_INTERPRET")
    yield
    after = os.environ.get("TRITON_INTERPRET")
    assert after == before, f"this test left TRITON_INTERPRET={after!r} (it was {before!r})"


@pytest.fixture
def device():
    """The device the course's kernels run on here: ``"cuda"`` or ``"cpu"``."""
    return DEVICE


def tolerance(dtype) -> float:
    """An absolute and relative tolerance for a kernel's result in ``dtype`` here.

    fp32 ``tl.dot`` is exact in the interpreter but tf32 (10-bit mantissa) on a
    GPU; fp16/bf16 inputs are rounded on both.
    """
    import torch

    if dtype == torch.float64:
        return 1e-9
    if dtype == torch.float32:
        return 1e-2 if ON_GPU else 2e-5
    return 3e-2 if dtype == torch.bfloat16 else 1e-2


def learner_copy(module, name):
    """``module``'s source loaded as a module outside course_utils: a learner's own kernels.

    The checks refuse course_utils's kernels (the answer must come from the
    learner's), so the course's correct kernels stand in for a learner's
    through a copy.
    """
    return module_from_source(Path(module.__file__), name=name)


def module_from_source(path, src=None, name=None):
    """``src`` (if given) written to ``path``, imported as a module (named after the file), in ``sys.modules``.

    Planted variants of the course's kernels go through a real file: Triton reads
    a ``@triton.jit`` function's source with :mod:`inspect`.
    """
    path = Path(path)
    if src is not None:
        path.write_text(src)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def function_span(src: str, name: str) -> tuple[int, int]:
    """Where top-level function ``name`` starts and ends in ``src`` (up to the next top-level item)."""
    start = src.index(f"\ndef {name}(") + 1
    ends = [i for i in (src.find("\n@triton.jit", start), src.find("\ndef ", start), src.find("\n# ---", start))
            if i != -1]
    return start, min(ends) if ends else len(src)


# -- a do-nothing kernel for proof-of-work tests --------------------------------------------------
def _make_copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        """Copies a contiguous tensor: "a kernel ran, and it wrote the result" without computing anything."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return _copy_kernel


_copy_kernel = _make_copy_kernel()


def copied_by_a_kernel(t):
    """``t`` copied into a fresh tensor by :data:`_copy_kernel` (its last writer: a kernel of "the learner's")."""
    import torch
    import triton

    src = t.contiguous()
    out = torch.empty_like(src)
    _copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, out, src.numel(), BLOCK=1024)
    return out


def every_gluon_backward_launch(q, k, v, do, causal):
    """Run every launch ``hopper_ws_bwd.attention_backward`` takes (its search space: dK/dV's query rows per tile,
    the tiles in flight, either dQ kernel, the Gluon dQ's keys per tile) on these inputs and check each launch's
    gradients against float64 math; a launch whose tiles do not fit Hopper's shared memory must be refused in one
    sentence before anything compiles (the Gluon dQ with 3 buffers of 128 keys at D = 128, the only one).
    Returns ``(ran, refused)``, the launches as keyword dicts. The caller provides the machine: a Hopper GPU, or
    the CPU inside ``gluon_cpu.running()``."""
    import itertools

    import torch

    from course_utils import references
    from course_utils.kernels import flash_attention_with_lse, hopper_ws_bwd

    o, lse = flash_attention_with_lse(q, k, v, causal)
    want = [torch.from_numpy(r).float().to(q.device) for r in references.attention_backward(
        *(t.double().cpu().numpy() for t in (q, k, v, do)), causal=causal)]
    ran, refused = [], []
    for block_m, buffers, dq_kernel, dq_block_n in itertools.product(
            hopper_ws_bwd.BLOCK_MS, (2, 3), hopper_ws_bwd.DQ_KERNELS, hopper_ws_bwd.DQ_BLOCK_NS):
        launch = dict(block_m=block_m, num_buffers=buffers, dq_kernel=dq_kernel, dq_block_n=dq_block_n)
        try:
            grads = hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, causal, **launch)
        except ValueError as exc:
            assert "shared memory" in str(exc) and dq_kernel == "gluon", (launch, str(exc))
            assert buffers == 3 and dq_block_n == 128 and q.shape[-1] == 128, launch
            refused.append(launch)
            continue
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
            assert got.dtype == q.dtype and got.shape == ref.shape, (launch, name)
            rel = (torch.linalg.vector_norm(got.float() - ref) / torch.linalg.vector_norm(ref)).item()
            assert rel < 2e-2, f"{launch}: {name} relative error {rel:.2e}"
        ran.append(launch)
    return ran, refused


REPO = Path(__file__).resolve().parent.parent


def markdown_text(lesson: str) -> str:
    """Every markdown cell of a solution notebook (``lesson``: its file name without ``.ipynb``), whitespace runs
    as single spaces: where the tests look for the figures a lesson quotes."""
    import nbformat

    nb = nbformat.read(REPO / "solutions" / f"{lesson}.ipynb", as_version=4)
    return " ".join(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown")


def readme_text() -> str:
    """The README, whitespace runs as single spaces."""
    return " ".join((REPO / "README.md").read_text().split())


def speed_text() -> str:
    """results/SPEED.md (the measured speed run by run, beyond the README's latest), whitespace runs as single spaces."""
    return " ".join((REPO / "results" / "SPEED.md").read_text().split())


def assert_quoted(text: str, quotes) -> None:
    """Each of ``quotes`` appears in ``text`` word for word (the failure names the missing one)."""
    for quote in quotes:
        assert quote in text, quote


def window_points(runs, mode: str) -> dict:
    """Over the recorded window grids ``runs`` (results/ names): (W, S, N) -> the course / FlexAttention ratio of each
    run, in run order, for ``mode`` ("forward" or "training")."""
    from course_utils import results

    points = {}
    for name in runs:
        for q in results.load(name)["ratios"]:
            if q["mode"] == mode:
                points.setdefault((q["window_size"], q["sink_size"], q["n"]), []).append(q["course_over_flex"])
    return points


def decode_points(runs) -> dict:
    """Over the recorded decode grids ``runs``: (B, context) -> each run's summary row, in run order."""
    from course_utils import results

    points = {}
    for name in runs:
        for s in results.load(name)["summary"]:
            points.setdefault((s["batch"], s["context"]), []).append(s)
    return points


def training_ratios(runs, mine: str, other: str = "sdpa_cudnn", n=lambda n: True) -> list[float]:
    """Over the recorded training-bench runs ``runs`` (results/ names): ``other``'s time over ``mine``'s (``mine``'s
    speed relative to ``other``) at every N matching ``n``, one value per run and N."""
    from course_utils import results

    values = []
    for name in runs:
        by = {(r["n"], r["provider"]): r for r in results.load(name)["rows"]}
        values += [by[(m, other)]["ms"] / by[(m, mine)]["ms"] for m, p in by if p == mine and n(m)]
    return values


def record_calls(monkeypatch, *targets) -> list:
    """Wrap each ``(module, name)`` function so that a call appends ``name`` to the returned list, then runs it: which
    functions a step called, in order (the autograd engine's thread included)."""
    calls = []
    for module, name in targets:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    return calls

