"""The course's exercises, declared once: the one table to touch when adding an exercise.

Each :class:`Exercise` names the public check (``check_flash_forward``), the
lesson that introduces it, the grading function that does the work (in the
lesson's ``part*.py`` module: it takes the learner's function and ``seed=``,
and returns a :class:`~.core.Passed` or raises a :class:`~.core.GradingError`),
whether it runs in a separate process (:mod:`.isolation`) and for how long,
and its points. The public ``check_*`` functions of :mod:`course_utils.grading`
are made from this table (:func:`make_check`), and everything that needs the
list of exercises reads it from here: the batch grader (:mod:`course_utils.grade`),
the points of the build (``python -m course_utils.build --points``),
``benchmarks/grading_speed.py`` and the tests.

Adding an exercise: write ``grade_<name>(fn, *, seed=None)`` in the lesson's
``part*.py`` module, add one row below, and put ``check_<name>(...)`` in a grader
cell of the lesson's solution notebook.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

# Every part is imported here, so no part imports course_utils.kernels (torch and Triton) at its top: the
# functions that need a kernel module import it, and the NumPy lessons' checks and learner processes start
# without torch (see environment._no_nvidia_driver; tests/test_environment.py checks it).
from . import (part1_numpy, part2_basics, part2_debug, part2_tiles, part2_triton, part3_performance, part4_backward,
               part5_decode, part5_window, part6_ring, part7_hopper, part8_mods)
from .core import require_callable
from .isolation import run_isolated

__all__ = ["Exercise", "EXERCISES", "VERDICT_IN_LEARNER_PROCESS", "by_name", "make_check"]


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One exercise: its public check, where it is taught, how it is graded, what it is worth."""

    name: str  # the public check's name, ``check_<exercise>``
    lesson: str  # the solution notebook that introduces it (its stem)
    function: Callable  # the grading function: ``function(fn, *, seed=None, ...) -> Passed``
    isolated: bool  # run in a separate process (a crash or a hang cannot take the notebook down)
    timeout_s: float | None  # the whole check's time limit when isolated (None: not isolated)
    points: float  # the grader cell's points (``python -m course_utils.build --points``)
    callable_as: str | None = None  # checked callable before isolating ("your launcher"), if at all
    # The course's own answer to this exercise where the lesson shows it to learners (so the batch
    # grader allows it elsewhere): refused while this check runs, in the notebook and in batch grading.
    answer_keys: tuple[str, ...] = ()
    # Course functions the lesson gives learners to call in this answer (qualified names): the batch
    # grader refuses every other call into course_utils.references / course_utils.kernels while the
    # check runs, these it lets through.
    allowed: tuple[str, ...] = ()

    @property
    def verdict_outside(self) -> bool:
        """Whether the batch grader computes this check's verdict in a process the learner's code never runs in.

        There (:mod:`course_utils.grade_checks`) the learner's function runs in its own process and only data
        comes back: its results for the inputs the check chose. The exercises of :data:`VERDICT_IN_LEARNER_PROCESS`
        prove the work by watching what the learner's code does while it runs (the Triton kernels it launches, the
        torch operators it calls, the ring's ranks), which only the process that runs it can see.
        """
        return self.name not in VERDICT_IN_LEARNER_PROCESS

    @property
    def check(self) -> Callable:
        """The public ``check_*`` function (made once)."""
        return _CHECKS[self.name]


# Lesson 09's launcher picks its tiles and splits with these (the learner writes the kernels).
_DECODE_HELPERS = ("course_utils.kernels.decode.decode_config", "course_utils.kernels.decode.pick_num_splits")

EXERCISES: tuple[Exercise, ...] = (
    # name, lesson, grading function, isolated, timeout_s, points[, checked callable as]
    Exercise("check_softmax", "01_naive_attention", part1_numpy.grade_softmax, False, None, 1),
    Exercise("check_naive_attention", "01_naive_attention", part1_numpy.grade_naive_attention, False, None, 2),
    Exercise("check_online_softmax", "02_online_softmax", part1_numpy.grade_online_softmax, False, None, 2),
    Exercise("check_tiled_attention", "02_online_softmax", part1_numpy.grade_tiled_attention, False, None, 3),
    Exercise("check_triton_softmax", "03_triton_basics", part2_basics.grade_triton_softmax, True, 60.0, 2,
             "your launcher"),
    Exercise("check_tile_copy", "03_triton_basics", part2_tiles.grade_tile_copy, True, 120.0, 1),
    Exercise("check_flash_forward", "04_flash_attention_forward", part2_triton.grade_flash_forward, True, 240.0, 3,
             "your launcher"),
    Exercise("check_kv_head", "05_causal_gqa", part2_triton.grade_kv_head, False, None, 1),
    Exercise("check_flash_gqa", "05_causal_gqa", part2_triton.grade_flash_gqa, True, 240.0, 3, "your launcher"),
    Exercise("check_flaw_hunt", "05b_debug_gqa_kernel", part2_debug.grade_flaw_hunt, True, 120.0, 1),
    Exercise("check_attention_flops", "06_performance", part3_performance.grade_attention_flops, False, None, 1),
    Exercise("check_roofline", "06_performance", part3_performance.grade_roofline, False, None, 1),
    Exercise("check_programs_per_sm", "06_performance", part3_performance.grade_programs_per_sm, False, None, 1),
    Exercise("check_two_per_sm", "06_performance", part3_performance.grade_two_per_sm, True, 180.0, 2,
             "your launcher"),
    Exercise("check_tiled_backward", "07_backward", part4_backward.grade_tiled_backward, False, None, 3),
    Exercise("check_flash_backward", "07_backward", part4_backward.grade_flash_backward, True, 120.0, 4),
    Exercise("check_window_tile_bounds", "08_sliding_window_and_sinks", part5_window.grade_window_tile_bounds,
             False, None, 1, answer_keys=("course_utils.kernels.forward.window_tile_bounds",)),
    Exercise("check_dkdv_bounds", "08_sliding_window_and_sinks", part5_window.grade_dkdv_bounds, False, None, 1),
    Exercise("check_window_forward", "08_sliding_window_and_sinks", part5_window.grade_window_forward,
             True, 120.0, 1),
    Exercise("check_window_backward", "08_sliding_window_and_sinks", part5_window.grade_window_backward,
             True, 120.0, 1),
    Exercise("check_sink_split", "08_sliding_window_and_sinks", part5_window.grade_sink_split, True, 180.0, 1),
    Exercise("check_merge_partials", "09_decoding", part5_decode.grade_merge_partials, False, None, 1),
    Exercise("check_decode_split", "09_decoding", part5_decode.grade_decode_split, True, 240.0, 1,
             allowed=_DECODE_HELPERS),
    Exercise("check_decode_combine", "09_decoding", part5_decode.grade_decode_combine, True, 180.0, 1,
             allowed=_DECODE_HELPERS),
    Exercise("check_choose_num_splits", "09_decoding", part5_decode.grade_choose_num_splits, False, None, 1,
             answer_keys=("course_utils.kernels.decode.pick_num_splits",
                          "course_utils.kernels.decode.model_num_splits",
                          "course_utils.kernels.decode.split_busy_fraction")),  # lesson 09 shows them
    # The ring checks start their own processes (one per rank): not isolated again.
    Exercise("check_ring_simulation", "10_ring_attention", part6_ring.grade_ring_simulation, False, None, 1,
             allowed=("course_utils.references.attention_lse",)),  # the lesson computes each block with it
    Exercise("check_ring_attention", "10_ring_attention", part6_ring.grade_ring_attention, False, None, 1),
    Exercise("check_overlap_shard_length", "10_ring_attention", part6_ring.grade_overlap_shard_length, False, None,
             1),
    Exercise("check_quantize_fp8", "11_hopper_and_fp8", part7_hopper.grade_quantize_fp8, False, None, 1,
             answer_keys=("course_utils.kernels.fp8.quantize_fp8",)),
    Exercise("check_persistent_schedule", "11_hopper_and_fp8", part7_hopper.grade_persistent_schedule,
             False, None, 1, answer_keys=("course_utils.kernels.fp8.lpt_schedule",)),
    Exercise("check_fp8_forward", "11_hopper_and_fp8", part7_hopper.grade_fp8_forward, True, 240.0, 2,
             "your launcher", allowed=("course_utils.kernels.fp8.fp8_config",)),  # the lesson's launcher
    Exercise("check_tma_transpose", "11_hopper_and_fp8", part7_hopper.grade_tma_transpose, True, 120.0, 1,
             "your launcher"),
    # Gluon has no interpreter: the learner's loader runs in the course's kernel in gluon_cpu's model, on the CPU.
    Exercise("check_gluon_loader", "11_hopper_and_fp8", part7_hopper.grade_gluon_loader, True, 120.0, 1,
             answer_keys=("course_utils.kernels.hopper_ws._load_partition",)),
    Exercise("check_doc_tile_bounds", "12_packed_sequences_and_score_mods", part8_mods.grade_doc_tile_bounds,
             False, None, 1, answer_keys=("course_utils.kernels.forward.mods_tile_bounds",)),
    Exercise("check_mods_forward", "12_packed_sequences_and_score_mods", part8_mods.grade_mods_forward,
             True, 120.0, 2, "your launcher"),
    Exercise("check_mods_backward", "12_packed_sequences_and_score_mods", part8_mods.grade_mods_backward,
             False, None, 1, allowed=("course_utils.references.document_mask",)),  # the lesson's scaffold uses it
)


#: Exercises whose proof of work watches the learner's code as it runs, so that the batch grader computes their
#: verdict in the learner's (sandboxed) process: why, for each.
VERDICT_IN_LEARNER_PROCESS: dict[str, str] = {
    name: "proof of work watches the learner's Triton launches and torch operators in the process that runs them"
    for name in ("check_triton_softmax", "check_tile_copy", "check_flash_forward", "check_flash_gqa", "check_two_per_sm",
                 "check_flash_backward", "check_window_forward", "check_window_backward", "check_sink_split",
                 "check_decode_split", "check_decode_combine", "check_fp8_forward", "check_tma_transpose",
                 "check_mods_forward")
}
# (Lessons 02 and 07 hand over arrays that log how the learner's code reads them: the learner's process keeps
# the same log around each call and sends what it saw back, so those are judged outside.)
VERDICT_IN_LEARNER_PROCESS["check_ring_simulation"] = ("the shards the check hands over record which keys each step "
                                                       "reads, in the process that runs the learner's function")
VERDICT_IN_LEARNER_PROCESS["check_ring_attention"] = "the learner's code runs in the ring's own rank processes"
VERDICT_IN_LEARNER_PROCESS["check_gluon_loader"] = ("the learner's loader runs as a partition thread of the course's "
                                                    "kernel in gluon_cpu's model, in the process that runs it")


def by_name(name: str) -> Exercise | None:
    """The exercise whose public check is ``name`` (None if ``name`` is not an exercise)."""
    return _BY_NAME.get(name)


def make_check(exercise: Exercise) -> Callable:
    """The public check of ``exercise``: its grading function, isolated if declared so.

    Its signature is the grading function's, plus ``isolate=None`` and
    ``timeout_s=`` for an isolated exercise; its docstring is the grading
    function's. Unknown arguments raise ``TypeError`` as for any function.
    """
    function = exercise.function
    own = inspect.signature(function)
    params = list(own.parameters.values())
    if exercise.isolated:
        params += [inspect.Parameter("isolate", inspect.Parameter.KEYWORD_ONLY, default=None),
                   inspect.Parameter("timeout_s", inspect.Parameter.KEYWORD_ONLY, default=exercise.timeout_s)]
    signature = own.replace(parameters=params)

    @functools.wraps(function)
    def check(*args, **kwargs):
        __tracebackhide__ = True
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        fn = arguments.pop(params[0].name)
        if exercise.callable_as:
            require_callable(fn, exercise.name, exercise.callable_as)
        if not exercise.isolated:
            return function(fn, **arguments)
        isolate, timeout_s = arguments.pop("isolate"), arguments.pop("timeout_s")
        return run_isolated(exercise.name, function, fn, arguments, isolate=isolate, timeout_s=timeout_s)

    del check.__wrapped__  # its own signature, not the grading function's
    check.__signature__ = signature
    check.__name__ = check.__qualname__ = exercise.name
    check.__module__ = __name__
    check.exercise = exercise
    return check


_BY_NAME = {exercise.name: exercise for exercise in EXERCISES}
_CHECKS = {exercise.name: make_check(exercise) for exercise in EXERCISES}
globals().update(_CHECKS)  # course_utils.grading.exercises.check_x: importable by name in another process
__all__ += list(_CHECKS)
