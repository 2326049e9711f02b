"""The machinery every check shares: runs, comparisons, time limits, isolation."""

import os
import time

import numpy as np
import pytest
import torch

import course_utils  # noqa: F401  (configures the interpreter before triton)
import triton
import triton.language as tl

from course_utils.grading import outcome
from course_utils.grading.core import Crashed, Diagnosis, GradingError, Run, TimedOut
from course_utils.grading.inputs import nan_padded
from course_utils.grading.isolation import check_on_cpu, isolated
from course_utils.grading.outcome import KernelError
from course_utils.grading.proof import count_launches

from conftest import DEVICE, ON_GPU, _copy_kernel  # one dummy kernel for every test file


def test_compare_names_case_seed_index_and_diagnosis():
    run = Run("check_demo", seed=7)
    expected = np.arange(6.0).reshape(2, 3)
    wrong = expected.copy()
    wrong[1, 2] += 1.0
    with pytest.raises(GradingError) as err:
        run.compare(
            wrong, expected, case="'tiny'", what="the output", atol=1e-6, rtol=0,
            axes=("row", "col"),
            diagnoses=[Diagnosis("not this one", expected=expected * 3), Diagnosis("the last element is off", expected=wrong)],
        )
    msg = str(err.value)
    assert "check_demo(fn, seed=7)" in msg and "'tiny'" in msg
    assert "[row=1, col=2]" in msg and "got 6, expected 5" in msg
    assert "Likely cause: the last element is off" in msg and "not this one" not in msg


def test_compare_reports_nan_and_passes_close_answers():
    run = Run("check_demo", seed=1)
    expected = np.ones(4)
    assert run.compare(expected + 1e-9, expected, case="c", what="x", atol=1e-6, rtol=0) < 1e-8
    bad = expected.copy()
    bad[2] = np.nan
    with pytest.raises(GradingError, match=r"non-finite.*\[2\]"):
        run.compare(bad, expected, case="c", what="x", atol=1e-6, rtol=0)


def test_array_rejects_wrong_type_shape_dtype_with_one_sentence():
    run = Run("check_demo", seed=1)
    with pytest.raises(GradingError, match="is a list; return a NumPy array"):
        run.array([1.0], expected_shape=(1,), case="c")
    with pytest.raises(GradingError, match=r"has shape \(2,\), expected \(3,\)"):
        run.array(np.zeros(2), expected_shape=(3,), case="c")
    with pytest.raises(GradingError, match="dtype int64"):
        run.array(np.zeros(3, dtype=np.int64), expected_shape=(3,), case="c")
    with pytest.raises(GradingError, match="forget a `return`"):
        run.array(None, expected_shape=(3,), case="c")


def test_learner_exception_keeps_its_type_and_gains_a_note():
    run = Run("check_demo", seed=3)

    def learner(x):
        return x / undefined_name  # noqa: F821

    with pytest.raises(NameError) as err:
        run.call(learner, 1.0, case="'one'")
    assert any("check_demo(fn, seed=3)" in note for note in err.value.__notes__)


def test_a_hang_is_stopped_by_the_time_limit():
    run = Run("check_demo", seed=1, time_limit_s=0.5)
    start = time.monotonic()
    with pytest.raises(GradingError, match="more than 0.5 s"):
        run.call(lambda: time.sleep(30), case="c")
    assert time.monotonic() - start < 5


def test_fresh_seed_each_call_and_passed_line():
    seeds = {Run("check_demo").seed for _ in range(5)}
    assert len(seeds) > 1
    run = Run("check_demo", seed=11)
    run.call(lambda: None, case="c")
    assert repr(run.passed()).startswith("\u2705 check_demo: passed 1 cases")


# -- the sandbox ---------------------------------------------------------------


@triton.jit
def _wild_kernel(src, dst, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs * 1_000_000_000))


def _triton_copy(x):
    out = torch.empty_like(x)
    _copy_kernel[(triton.cdiv(x.numel(), 32),)](x, out, x.numel(), BLOCK=32)
    return out


def _wild_copy(x):
    out = torch.empty_like(x)
    _wild_kernel[(1,)](x, out, BLOCK=32)
    return out


def _broken_copy(x):
    raise ValueError("my own bug")


@isolated
def _check_copy(fn, *, seed=None):
    run = Run("_check_copy", seed)
    x = torch.randn(100, device=DEVICE)
    with count_launches() as launched:
        out = run.call(fn, x, case="n=100")
    if not launched:
        raise run.fail("No Triton kernel ran.", "n=100")
    run.compare(run.array(out, expected_shape=(100,), case="n=100"), x.cpu().numpy(), case="n=100", what="copy", atol=0, rtol=0)
    return run.passed()


def test_isolated_check_passes_and_counts_the_launch():
    assert _check_copy(_triton_copy)


def test_isolated_check_rejects_an_answer_without_triton():
    with pytest.raises(GradingError, match="No Triton kernel ran"):
        _check_copy(lambda x: x.clone())


def test_faulting_kernel_is_reported_and_this_process_survives():
    # CPU: the interpreter segfaults the forked child. GPU: the kernel faults
    # CUDA in the worker process, whose context is lost, not ours.
    expected = r"made the GPU fault.*mask=.*Your notebook is fine" if ON_GPU else r"crashed the grading process \(SIG(SEGV|BUS)\).*mask="
    with pytest.raises(GradingError, match=expected):
        _check_copy(_wild_copy)
    assert _check_copy(_triton_copy)  # a correct kernel right after it passes
    assert torch.ones(3, device=DEVICE).sum().item() == 3  # and this process's device works


def test_a_check_runs_in_a_worker_process_on_either_machine():
    # The GPU's path (a spawned worker, the kernels sent by value) also runs on the CPU.
    assert _check_copy(_triton_copy, isolate="worker")
    with pytest.raises(GradingError, match="No Triton kernel ran"):
        _check_copy(lambda x: x.clone(), isolate="worker")
    with pytest.raises(KernelError, match="my own bug"):
        _check_copy(_broken_copy, isolate="worker")


def test_check_on_cpu_runs_the_kernel_in_the_interpreter():
    assert check_on_cpu(_check_copy, _triton_copy)
    with pytest.raises(GradingError, match=r"crashed the grading process \(SIG(SEGV|BUS|ABRT)\)"):
        check_on_cpu(_check_copy, _wild_copy)


def test_learner_error_in_the_child_shows_their_traceback_without_grader_frames():
    with pytest.raises(KernelError) as err:
        _check_copy(_broken_copy)
    text = str(err.value)
    assert "my own bug" in text and "_broken_copy" in text
    assert not any(f"grading/{name}.py" in text for name in ("isolation", "outcome", "worker", "core"))


@pytest.mark.parametrize("isolate", [None, "worker"])
def test_isolated_hang_is_stopped(isolate):
    if isolate == "worker":
        _check_copy(_triton_copy, isolate="worker")  # the worker is started and warm
    start = time.monotonic()
    with pytest.raises(GradingError, match="did not finish within 2 s"):
        _check_copy(lambda x: time.sleep(60), timeout_s=2, isolate=isolate)
    assert time.monotonic() - start < 15


# -- the outcome protocol: the status travels on the exception, not in its words ----------
@isolated
def _check_slow(fn, *, seed=None):
    run = Run("_check_slow", seed, time_limit_s=1)
    run.call(fn, case="one call")
    return run.passed()


def _loop_forever():
    while True:
        pass


@pytest.mark.parametrize("isolate", [False, None, "worker"])
def test_a_time_limit_keeps_its_status_across_the_process_boundary(isolate):
    with pytest.raises(TimedOut, match="ran for more than 1 s") as err:
        _check_slow(_loop_forever, isolate=isolate)
    assert outcome.status_of(err.value) == "timed_out"


@pytest.mark.parametrize("isolate", [None, "worker"])
def test_a_stopped_check_and_a_crash_carry_their_status(isolate):
    with pytest.raises(TimedOut) as err:
        _check_copy(lambda x: time.sleep(60), timeout_s=2, isolate=isolate)
    assert outcome.status_of(err.value) == "timed_out"
    with pytest.raises(Crashed, match="crashed the grading process") as err:
        _check_copy(lambda x: os._exit(3), isolate=isolate)
    assert outcome.status_of(err.value) == "crashed" and "exit code 3" in str(err.value)


def test_the_status_is_not_read_from_the_message():
    # A wrong answer whose message happens to hold a crash's words is still a plain failure.
    words = "your code crashed the grading process; it did not finish within 1 s; it ran for more than 2 s"
    kind, value, status = outcome.run_check(lambda fn: (_ for _ in ()).throw(GradingError(words)), None, {})
    assert (kind, status) == ("failed", "failed")
    with pytest.raises(GradingError) as err:
        outcome.raise_outcome("check_x", (kind, value, status))
    assert type(err.value) is GradingError and outcome.status_of(err.value) == "failed"
    assert outcome.status_of(ValueError("x")) == "error"
    assert outcome.run_check(lambda fn: 1 / 0, None, {})[::2] == ("error", "error")


def test_count_launches_names_kernels_and_restores_run():
    kernel_class = type(_copy_kernel)  # InterpretedFunction or JITFunction
    before = kernel_class.run
    with count_launches() as launched:
        _triton_copy(torch.zeros(10, device=DEVICE))
    assert launched == ["_copy_kernel"]
    assert kernel_class.run is before


def test_nan_padded_views_hold_the_data_and_nan_around_it():
    t = torch.randn(2, 3, 5, 4, device=DEVICE)
    for transpose in (False, True):
        v = nan_padded(t, transpose_heads=transpose)
        assert torch.equal(v, t) and not v.is_contiguous()
        storage = v.as_strided((v.untyped_storage().nbytes() // 4,), (1,), 0)
        assert torch.isnan(storage).sum() == storage.numel() - t.numel()


# -- proof of work: which kernel wrote the answer ------------------------------------
from course_utils.grading import inputs, proof  # noqa: E402
from course_utils.grading.core import require_callable  # noqa: E402


@triton.jit
def _noop_kernel(x, n):
    pass


@triton.jit
def _spin_kernel(x, n):
    i = 0
    while i < n:  # mistake: i never advances
        i = i * 1


def _watched(fn, x):
    from course_utils.grading.core import Forbidden

    try:
        with proof.Work(inputs=(x,)) as work:
            out = fn(x)
    except Forbidden as exc:  # Run.call turns this into a GradingError in a check
        return str(exc)
    return work.problem(o=out)


def test_work_accepts_an_answer_written_by_the_learners_kernel_even_converted():
    x = torch.randn(100, device=DEVICE)
    assert _watched(_triton_copy, x) is None
    assert _watched(lambda x: _triton_copy(x).to(torch.float16).reshape(10, 10).t(), x) is None
    assert _watched(lambda x: _triton_copy(x) * 0.5, x) is None  # a scale applied to the kernel's output
    # torch's row-wise dot products (no score matrix) are allowed alongside
    assert _watched(lambda x: (torch.einsum("nd,nd->n", x.view(10, 10), x.view(10, 10)), _triton_copy(x))[1], x) is None


@pytest.mark.parametrize("fn, text", [
    (lambda x: (_noop_kernel[(1,)](x, 1), torch.softmax(x, -1))[1], "torch computed a softmax"),
    (lambda x: (_noop_kernel[(1,)](x, 1), (x[:, None] @ x[None, :]).sum(0))[1], "torch computed a matrix product"),
    (lambda x: (_noop_kernel[(1,)](x, 1), x.exp())[1], "torch computed an exponential"),
    (lambda x: _triton_copy(x) * x, r"computed by torch \(aten.mul\)"),
    (lambda x: (lambda o: (o, _noop_kernel[(1,)](o, 1))[0])(x * 2), r"computed by torch \(aten.mul\)"),
    (lambda x: (lambda o: (_noop_kernel[(1,)](x, 1), o)[1])(torch.empty_like(x)), "allocated .*none of your kernels"),
    (lambda x: (_noop_kernel[(1,)](x, 1), x)[1], "it is one of the inputs"),
    (lambda x: x.clone(), "no Triton kernel of yours ran"),
    (lambda x: (lambda o: (_copy_kernel[(4,)](torch.from_numpy(__import__("numpy").exp(x.cpu().numpy())).to(x.device), o, 100, BLOCK=32),
                           o)[1])(torch.empty_like(x)), r"the data left torch \(Tensor.numpy\(\)\)"),
    (lambda x: (lambda o: (_copy_kernel[(4,)](torch.tensor(
        __import__("course_utils").references.softmax(__import__("numpy").zeros(100)), device=x.device), o, 100, BLOCK=32), o)[1])(
        torch.empty_like(x)), "called course_utils.references.softmax"),
], ids=["softmax", "matmul", "exp", "torch-after", "noop-on-torch-result", "never-written", "input", "no-kernel",
        "numpy-then-copy-kernel", "reference-then-copy-kernel"])
def test_work_names_what_produced_a_borrowed_answer(fn, text):
    problem = _watched(fn, torch.randn(100, device=DEVICE))
    assert problem is not None and __import__("re").search(text, problem), problem


def test_work_refuses_course_kernels_and_a_result_from_an_earlier_call():
    from course_utils.kernels import flash_attention

    q = torch.randn(1, 1, 20, 16, device=DEVICE)
    with proof.Work(inputs=(q,)) as work:
        o = flash_attention(q, q, q)
    assert "course_utils's own kernel" in work.problem(o=o)
    kept = _triton_copy(torch.randn(10, device=DEVICE))
    x = torch.randn(10, device=DEVICE)
    with proof.Work(inputs=(x,)) as work:
        _triton_copy(x)
        out = kept
    assert "not written by any kernel during this call" in work.problem(o=out)


@pytest.mark.interpreter("a compiled GPU kernel cannot be interrupted in-process; on a GPU the worker process is killed instead (tests/test_sandbox.py)")
def test_a_kernel_stopped_by_the_time_limit_is_named_as_a_hang_not_an_interpreter_error():
    run = Run("check_demo", seed=1, time_limit_s=1.0)
    with pytest.raises(GradingError) as err:
        run.call(lambda: _spin_kernel[(1,)](torch.zeros(1), 5), case="c")
    text = str(err.value)
    assert "ran for more than 1 s" in text and "probably a loop that never ends" in text
    assert "InterpreterError" not in text and err.value.__cause__ is None


def test_zero_active_drivers_points_to_the_restart():
    work = proof.Work()

    def launch():
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    with pytest.raises(RuntimeError) as err:
        work._on_launch(_copy_kernel, (), {}, launch)
    assert any("Restart the kernel" in note and "import course_utils" in note for note in err.value.__notes__)


def test_inputs_changed_in_place_are_named():
    q, k = torch.randn(3, 4), torch.randn(3, 4)
    before = inputs.snapshot(q=q, k=k)
    assert inputs.changed_input(before, q=q, k=k) is None
    k.mul_(0.5)
    assert "changed its input `k` in place" in inputs.changed_input(before, q=q, k=k)


def test_wrong_usage_gets_one_plain_sentence():
    with pytest.raises(GradingError, match="got the @triton.jit kernel `_copy_kernel` itself: pass your launcher"):
        require_callable(_copy_kernel, "check_triton_softmax", "your launcher")
    with pytest.raises(GradingError, match="check_softmax expects a function, but got a int"):
        require_callable(3, "check_softmax")


def test_crash_hint_covers_sigabrt():
    assert "mask=" in outcome.crash_hint("SIGABRT") and "mask=" in outcome.crash_hint("SIGSEGV")
    assert outcome.crash_hint("SIGTERM") == ""


@triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})], key=["n"])
@triton.jit
def _autotuned_copy(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def test_multi_config_autotune_runs_its_first_config_in_the_interpreter(capsys):
    from triton.runtime.autotuner import Autotuner

    x = torch.randn(100, device=course_utils.DEVICE)
    y = torch.empty_like(x)
    if course_utils.ENV.interpreter:
        Autotuner._course_autotune_said = False
    _autotuned_copy[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, y, 100)
    assert torch.equal(x, y)
    if course_utils.ENV.interpreter:
        assert "runs the first of its configs here (for `_autotuned_copy`" in capsys.readouterr().out


@pytest.mark.skipif(course_utils.ENV.device == "cuda", reason="with a GPU there is a driver")
def test_triton_imported_first_points_to_the_restart_at_the_first_launch(tmp_path):
    import subprocess
    import sys

    code = (
        "import triton, triton.language as tl, torch, course_utils\n"
        "@triton.jit\n"
        "def k(x):\n"
        "    pass\n"
        "k[(1,)](torch.zeros(1))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "early.py"  # @triton.jit needs a file
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "active drivers" in out.stderr
    assert "Restart the kernel" in out.stderr and "import course_utils` first" in out.stderr


def test_the_nearest_modelled_mistake_is_named_when_two_are_within_reach():
    # With a GPU's looser (tf32) tolerances two mistakes' outputs can both be close enough to an
    # answer: the one nearer to it is named, whatever the order; a predicate diagnosis that comes
    # first still wins (it models no single output to measure).
    from course_utils.grading.core import Diagnosis, pick_diagnosis

    right = np.zeros(4)
    first = Diagnosis("first", expected=np.full(4, 0.9))
    second = Diagnosis("second", expected=np.full(4, 1.0))
    answer = np.full(4, 1.01)
    assert pick_diagnosis([first, second], answer, atol=0.2, rtol=0.0) is second
    assert pick_diagnosis([second, first], answer, atol=0.2, rtol=0.0) is second
    assert pick_diagnosis([first, second], np.full(4, 0.88), atol=0.2, rtol=0.0) is first
    assert pick_diagnosis([first, second], right, atol=0.2, rtol=0.0) is None
    rule = Diagnosis("rule", when=lambda a: True)
    assert pick_diagnosis([rule, second], answer, atol=0.2, rtol=0.0) is rule


def test_a_function_with_the_wrong_signature_gets_a_message_not_a_crash():
    from course_utils.grading import check_naive_attention, check_softmax

    def softmax(x):  # no axis
        return x

    with pytest.raises(GradingError, match=r"cannot take the arguments the check passes .*`softmax\(x\)` is called with"):
        check_softmax(softmax)
    with pytest.raises(GradingError, match=r"`_two_args_attention\(q, k\)` is called with .*ndarray of shape"):
        check_naive_attention(_two_args_attention)
    run = Run("check_x", 0)
    assert run.call(lambda *a, **k: 1, 1, 2, case="c", z=3) == 1  # *args/**kwargs take anything
    assert run.call(max, 1, 2, case="c") == 2  # a builtin without a signature is simply called


def _two_args_attention(q, k):
    return q


@pytest.mark.parametrize("check_name", ["check_flash_forward", "check_flash_gqa", "check_decode_split",
                                        "check_window_forward", "check_fp8_forward", "check_ring_simulation"])
def test_a_triton_or_ring_answer_with_the_wrong_signature_gets_the_same_message(check_name):
    # The isolated checks run the learner's function in another process: the sentence must come back from there.
    from course_utils import grading

    def launcher(q):  # one argument: every one of these checks passes more
        return q

    with pytest.raises(GradingError, match=r"cannot take the arguments the check passes .*`launcher\(q\)` is called with"):
        getattr(grading, check_name)(launcher)
