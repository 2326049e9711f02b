"""Ring attention on 2 NVIDIA GPUs (NCCL) against the course's kernels on one GPU.

Skipped without 2 GPUs (CI included: there ``test_distributed.py`` runs the
ring on gloo processes in the interpreter). On the GPU machine:

    python -m pytest tests/test_gpu_ring.py

bf16, causal, 32 query heads / 8 kv heads, D = 128, N up to 128k: the ring's
o, dq, dk, dv against ``kernels.flash_attention`` on the whole sequence on
one GPU. Both sides round P and dS to bf16 in different places (the ring
also rounds each block's partial gradient to bf16 before summing it in
fp32), so they agree to bf16 precision, not bit for bit.
"""

import course_utils  # noqa: F401  (before triton)

import pytest
import torch

from course_utils import distributed as ring
from course_utils.distributed import bench

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
pytestmark = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 NVIDIA GPUs; see test_distributed.py for the CPU tests")


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_two_gpus_match_one_gpu(layout):
    ns = (4096, 32768, 131072) if layout == "zigzag" else (8192,)
    errors = ring.run_distributed(bench.gpu_check_worker, 2, args=(ns, layout), device="cuda", timeout_s=600)[0]
    for n in ns:
        assert max(errors[n].values()) < 2e-2, (n, errors[n])
