"""One check per exercise: ``check_<exercise>(fn)`` grades the learner's ``fn``.

Every check compares ``fn`` with float64 references (:mod:`course_utils.references`)
on fixed cases and on fresh random cases each call, returns a
:class:`~course_utils.grading.core.Passed` line on success, and raises a
:class:`~course_utils.grading.core.GradingError` (an ``AssertionError``)
that names the case, the seed, the largest error and a likely cause.
The shared machinery is in :mod:`.core` (runs, comparisons, diagnoses,
time limits), :mod:`.outcome` (how a check ended), :mod:`.isolation` and
:mod:`.worker` (the separate process), :mod:`.proof` (the learner's kernel did the
work) and :mod:`.inputs` (NaN-padded inputs, in-place edits).
"""

from . import exercises
from .core import Diagnosis, GradingError, Passed
from .exercises import EXERCISES, Exercise
from .isolation import check_on_cpu

# The public checks, one per exercise, made from the table in .exercises.
globals().update({exercise.name: exercise.check for exercise in EXERCISES})

__all__ = ["EXERCISES", "Exercise", "GradingError", "Passed", "Diagnosis", "check_on_cpu"] + [
    exercise.name for exercise in EXERCISES]
