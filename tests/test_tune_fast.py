"""benchmarks/tune_fast.py on the CPU: every configuration it times is a valid,
correct launch of the fast kernel (checked here in Triton's interpreter), and
without a GPU it explains itself and exits cleanly."""

import importlib.util
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)
import numpy as np
import pytest
import torch

from course_utils import bench, references
from course_utils.kernels import fast

from conftest import DEVICE, ON_GPU, skip_if_specialised_on_gpu

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "tune_fast.py"


def _load():
    spec = importlib.util.spec_from_file_location("tune_fast", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tune_fast = _load()
ALL = [(c, None) for c in tune_fast.CANDIDATES] + tune_fast.VARIANTS


def test_labels_are_unique():
    labels = [tune_fast.label(c, extra) for c, extra in ALL]
    assert len(labels) == len(set(labels))


def test_the_shipped_search_space_is_among_the_candidates():
    # Every configuration the autotuner may pick for the script's case
    # (D = 128, causal) is one the script times.
    timed = {c[:6] for c in tune_fast.CANDIDATES}
    usable = {c for c in map(tuple, fast.CONFIG_SPACE + fast.WS_SPACE)
              if fast.config_ok(c[0], c[1], c[2], 4096, 128, True, c[5])}
    assert usable and usable - timed == set()


@pytest.mark.parametrize("candidate, extra", ALL, ids=[tune_fast.label(c, e) for c, e in ALL])
def test_every_candidate_is_a_correct_launch(candidate, extra):
    # N = 256 is a multiple of every tile; two query heads share one kv head.
    g = torch.Generator().manual_seed(7)
    split = candidate[5] and candidate[2] == 4  # a one-warpgroup specialised launch takes 16-bit inputs only
    skip_if_specialised_on_gpu(candidate[5], candidate[2])
    dtype = torch.float16 if split else torch.float32
    q, k, v = (torch.randn(1, h, 256, 16, generator=g).to(DEVICE, dtype) for h in (2, 1, 1))
    o, lse = fast.launch(q, k, v, True, **tune_fast.launch_options(candidate, extra))
    ro, rl = references.attention_lse(*(t.double().cpu().numpy() for t in (q, k, v)), causal=True)
    tol = 1e-2 if ON_GPU else (2e-3 if split else 1e-5)  # fp32 dots are tf32 on a GPU
    if (extra or {}).get("exp_poly"):  # half the p's from the cubic: 7.5e-5 relative each (fast.EXP2_POLY)
        tol = max(tol, 2e-4)
    np.testing.assert_allclose(o.double().cpu().numpy(), ro, atol=tol, rtol=0)
    np.testing.assert_allclose(lse.double().cpu().numpy(), rl, atol=max(tol, 1e-4), rtol=0)


@pytest.mark.interpreter("checks what the script does on a machine without a GPU")
def test_without_a_gpu_it_explains_and_exits_cleanly(capsys):
    assert not bench.gpu_available()
    assert tune_fast.main(["--ns", "256"]) == 0
    assert "No CUDA GPU" in capsys.readouterr().out
