"""The course's GPU benchmark: attention forward, side by side, measured honestly.

``python -m course_utils.bench`` runs the standard sweep and writes, into
``results/`` (or ``--out DIR``), ``forward_bench.csv``, ``forward_bench.json``,
``forward_bench.md`` (the tables) and ``forward_bench.png`` (the plot).

Providers, all on the same inputs in one run:

- ``naive``: PyTorch attention that materialises the ``[N, N]`` score matrix
  (an out-of-memory error is reported as ``OOM``, not a crash);
- ``compiled``: the same ``naive_attention`` through ``torch.compile`` (what a
  user would try before writing a kernel);
- ``sdpa_flash`` and ``sdpa_cudnn``: ``torch.nn.functional.scaled_dot_product_attention``
  pinned to its FlashAttention-2 and cuDNN backends (``enable_gqa=True``);
- ``course``: the lesson-05 kernel as taught (``kernels.forward.flash_attention_gqa_forward``);
- ``fast``: the course's fastest kernel (``kernels.fast.attention_forward_fast``).

How we measure (lesson 06 explains why):

- every output is checked against a float32 reference on a slice (batch 0,
  the first and last query heads, the first and last 64 query rows, against
  all keys) *before* it is timed; a wrong provider is reported, not timed;
- time is the median of ``triton.testing.do_bench`` (it warms up, flushes
  the L2 cache between runs and times with CUDA events);
- ``TFLOP/s = 4 * B * Hq * N^2 * D / time``, halved when causal (half the
  score matrix is never computed), the same count for every provider;
- peak memory is what one call allocates on top of its inputs (output included).

The standard sweep: 16k tokens per batch (``B = tokens / N``), ``N`` from 1k
to 16k, for the course's main configuration (bf16, causal, 32 query heads
sharing 8 K/V heads, D = 128) and the others the course reports (non-causal,
D = 64 multi-head causal and non-causal, fp16). ``--ladder`` also times the
tuning steps of lesson 06 one at a time. Without a GPU the command says so in
one sentence and exits 0; ``--replot DIR`` re-renders tables and plot from a
saved ``forward_bench.json`` (no GPU needed).

The package, one job per module:

- ``cases``: the sweep's cases, the providers' names, the FLOP count, the inputs;
- ``providers``: the attention implementations side by side;
- ``measure``: check each output against a reference, then time it (lessons 08 and 12's benches too); the
  machine's ceilings;
- ``ladder``: lesson 06's tuning ladder;
- ``training``: forward + backward (``--training``);
- ``report``: CSV/JSON/markdown writing and reading the recorded results back; the FlexAttention ratios;
- ``plots``: the PNG;
- ``cli``: the command line (``python -m course_utils.bench``).
"""

from __future__ import annotations

import dataclasses  # noqa: F401  (lesson 06 uses bench.dataclasses.asdict)

from .cases import (  # noqa: F401
    ALL_PROVIDERS, CSV_FIELDS, DEFAULT_NS, LABELS, LESSON11_PROVIDERS, NO_GPU_MESSAGE, PROVIDERS, QUICK_NS, RATIOS,
    RESULTS_DIR, ROOT,
    STANDARD_SUITE, STEM, TOLERANCE, Case, attention_flops, gpu_available, make_inputs, tflops,
)
from .providers import _sdpa_backend, compiled_attention, make_provider, naive_attention  # noqa: F401
from .measure import (  # noqa: F401
    check_output, format_row, is_oom, measure, measure_ceilings, peak_memory_mib, reference_slice, run_case,
)
from .ladder import (  # noqa: F401
    COURSE_LAUNCH_GRID, LADDER_NS, _course_with, course_with_options, _ladder_steps, _tuned_or_fixed, tuning_ladder,
)
from .report import (  # noqa: F401
    _cell, environment_info, write_sweep, ladder_markdown, load_results, markdown_tables, ratio_table, read_csv,
    recorded_results_path, write_csv, write_results,
)
from .plots import plot_results  # noqa: F401
from .training import (  # noqa: F401
    BACKWARD_FLOP_FACTOR, TRAIN_LABELS, TRAIN_PROVIDERS, TRAIN_STEM, make_training_step, run_training_case,
    training_flops, training_markdown,
)
from .cli import _parse, cases_from_args, main  # noqa: F401
