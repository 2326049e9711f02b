"""What the benchmark measures: the cases, the providers' names, the FLOP count, the inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS_DIR = ROOT / "results"
STEM = "forward_bench"

PROVIDERS = ("naive", "compiled", "sdpa_flash", "sdpa_cudnn", "course", "fast")
# Lesson 11's forwards, timed on request (--providers ...,course_fp8,gluon_bf16,gluon_fp8): `bench fp8`'s providers of
# the same names (its make_forward: the FP8 ones on inputs quantised outside the timing), checked at its tolerances.
LESSON11_PROVIDERS = ("course_fp8", "gluon_bf16", "gluon_fp8")
ALL_PROVIDERS = PROVIDERS + LESSON11_PROVIDERS
LABELS = {
    "naive": "naive PyTorch",
    "compiled": "torch.compile (naive)",
    "sdpa_flash": "SDPA flash",
    "sdpa_cudnn": "SDPA cuDNN",
    "course": "course (05)",
    "fast": "fast",
    "course_fp8": "FP8 (11)",
    "gluon_bf16": "Gluon bf16 (11)",
    "gluon_fp8": "Gluon FP8 (11)",
}
# (numerator, denominator) pairs shown as ratio columns.
RATIOS = (("fast", "sdpa_flash"), ("fast", "sdpa_cudnn"), ("course", "sdpa_flash"))
# shown only where a run timed the provider (so a sweep without them reads as before)
LESSON11_RATIOS = tuple((p, "sdpa_cudnn") for p in LESSON11_PROVIDERS)
DEFAULT_NS = (1024, 2048, 4096, 8192, 16384)
QUICK_NS = (1024, 4096)
TOLERANCE = 2e-2  # relative error (norm) allowed against the float32 reference
NO_GPU_MESSAGE = (
    "No CUDA GPU here, so there is nothing to time: the recorded results are in "
    "results/forward_bench.md (run this on a GPU machine to measure your own)."
)
CSV_FIELDS = (
    "case", "provider", "dtype", "causal", "batch", "n_q_heads", "n_kv_heads", "n", "head_dim",
    "ms", "tflops", "peak_mib", "status", "rel_err", "note",
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of the sweep (everything but N)."""

    name: str
    dtype: str = "bf16"
    causal: bool = True
    n_q_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    tokens: int = 16384  # batch * N, fixed so every N does the same number of query rows
    ns: tuple = DEFAULT_NS

    def batch(self, n: int) -> int:
        return max(1, self.tokens // n)

    def title(self) -> str:
        heads = f"{self.n_q_heads}/{self.n_kv_heads} heads" if self.n_q_heads != self.n_kv_heads else f"{self.n_q_heads} heads (MHA)"
        return f"{self.dtype}, {'causal' if self.causal else 'non-causal'}, {heads}, D={self.head_dim}, {self.tokens} tokens"


STANDARD_SUITE = (
    Case("main"),
    Case("noncausal", causal=False),
    Case("d64_causal", n_kv_heads=32, head_dim=64),
    Case("d64_noncausal", causal=False, n_kv_heads=32, head_dim=64),
    Case("fp16", dtype="fp16"),
)


def attention_flops(batch: int, n_heads: int, n: int, head_dim: int, causal: bool) -> float:
    """Floating-point operations of one attention forward pass.

    Two matrix products per head, ``Q K^T`` and ``P V``, each ``2 * N * N * D``
    (a multiply and an add per term): ``4 * B * H * N^2 * D``. With a causal
    mask only the lower triangle is needed, so half of that is counted (the
    convention FlashAttention's papers and PyTorch's benchmarks use). The
    exponentials are not counted: they run on other units.
    """
    flops = 4.0 * batch * n_heads * n * n * head_dim
    return flops / 2 if causal else flops


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def make_inputs(case: Case, n: int, seed: int = 0):
    """Fresh random ``q, k, v`` for ``case`` at sequence length ``n`` (never zeros)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case.dtype]
    g = torch.Generator(device="cuda").manual_seed(seed + n)
    b = case.batch(n)
    shape_q = (b, case.n_q_heads, n, case.head_dim)
    shape_kv = (b, case.n_kv_heads, n, case.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=g)
    return q, k, v
