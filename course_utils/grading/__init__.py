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

from .core import Diagnosis, GradingError, Passed
from .part1_numpy import check_softmax, check_naive_attention, check_online_softmax, check_tiled_attention
from .part2_basics import check_triton_softmax
from .part2_tiles import check_tile_copy
from .part2_triton import check_kv_head, check_flash_forward, check_flash_gqa
from .part2_debug import check_flaw_hunt
from .part3_performance import check_attention_flops, check_programs_per_sm, check_roofline
from .part4_backward import check_tiled_backward, check_flash_backward
from .isolation import check_on_cpu
from .part5_decode import check_merge_partials, check_decode_split, check_decode_combine
from .part5_window import check_window_tile_bounds, check_window_forward, check_window_backward
from .part6_ring import check_ring_simulation, check_ring_attention

__all__ = [
    "GradingError",
    "Passed",
    "Diagnosis",
    "check_softmax",
    "check_naive_attention",
    "check_online_softmax",
    "check_tiled_attention",
    "check_triton_softmax",
    "check_tile_copy",
    "check_kv_head",
    "check_flash_forward",
    "check_flash_gqa",
    "check_flaw_hunt",
    "check_attention_flops",
    "check_roofline",
    "check_programs_per_sm",
    "check_tiled_backward",
    "check_flash_backward",
    "check_on_cpu",
    "check_merge_partials",
    "check_decode_split",
    "check_decode_combine",
    "check_window_tile_bounds",
    "check_window_forward",
    "check_window_backward",
    "check_ring_simulation",
    "check_ring_attention",
]
