"""Checks for lesson 06 (measuring performance): counting FLOPs, the roofline.

The exercises are small formulas, so the checks grade them on many fixed
and random cases at once and recognise the usual slips: a causal count not
halved, one matmul counted instead of two, a missing batch or head factor,
the roofline's ``min`` written as ``max``, GB/s not turned into TFLOP/s; and,
for the programs that fit on one SM, a forgotten reservation, rounding or
limit, checked first on the compile statistics recorded on the H200; and,
applied to the learner's own lesson-05 kernel, a launch that lets two programs
share an SM (4 warps, 2 stages where 3 do not fit), read from the launch
itself: 8 warps kept, 3 stages that overflow, float32 or padded head dims
left out of the shared-memory count.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..environment import current
from . import proof
from .core import Diagnosis, Forbidden, Run, require_callable

__all__ = ["grade_attention_flops", "grade_roofline", "grade_programs_per_sm", "grade_two_per_sm", "H200",
           "RECORDED_COMPILES", "BOUNDARY_CASES", "MEASURED_TWO_PER_SM", "lesson05_shared_kib", "two_per_sm_fit"]


def _number(run: Run, out, case: str) -> float:
    """The learner's scalar answer as a float, or one plain sentence."""
    if out is None:
        raise run.fail("your function returned None: did you forget a `return`?", case)
    if isinstance(out, bool) or not isinstance(out, (numbers.Real, np.floating, np.integer)):
        raise run.fail(f"your function returned a {type(out).__name__}; return a number.", case)
    return float(out)


def _flops(b, h, n, d, causal):
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def grade_attention_flops(fn, *, seed=None):
    """Grade ``fn(batch, n_heads, n, head_dim, causal) -> FLOPs`` of one attention forward.

    ``4 * batch * n_heads * n**2 * head_dim``, halved when causal. Fixed
    cases, then fresh random ones (batch 1-16, heads 1-64, N up to 32k,
    head dims 16-256).
    """
    __tracebackhide__ = True
    run = Run("check_attention_flops", seed)
    cases = [(4, 32, 4096, 128, True), (1, 8, 1000, 64, False), (3, 5, 7, 16, False), (2, 1, 64, 16, True)]
    for _ in range(12):
        cases.append((int(run.rng.integers(1, 17)), int(run.rng.integers(1, 65)), int(run.rng.integers(1, 32769)),
                      int(run.rng.choice([16, 32, 64, 80, 96, 128, 256])), bool(run.rng.integers(0, 2))))
    got, want, names = [], [], []
    for b, h, n, d, causal in cases:
        case = f"batch={b}, n_heads={h}, n={n}, head_dim={d}, causal={causal}"
        got.append(_number(run, run.call(fn, b, h, n, d, causal, case=case), case))
        want.append(_flops(b, h, n, d, causal))
        names.append(case)
    got, want = np.array(got), np.array(want)
    causal = np.array([c[4] for c in cases])
    b = np.array([c[0] for c in cases], dtype=float)
    h = np.array([c[1] for c in cases], dtype=float)
    n = np.array([c[2] for c in cases], dtype=float)
    d = np.array([c[3] for c in cases], dtype=float)
    diagnoses = [
        Diagnosis("the causal count is not halved: with the mask only the lower triangle of S is useful work, "
                  "and the convention counts exactly half.", expected=want * np.where(causal, 2, 1)),
        Diagnosis("this is half the count: either only one matmul is counted (there are two, S = Q K^T and "
                  "O = P V) or a multiply-add is counted as one FLOP (it is two): 4 * B * H * N^2 * D.",
                  expected=want / 2),
        Diagnosis("the batch size is missing.", expected=want / b),
        Diagnosis("the number of heads is missing.", expected=want / h),
        Diagnosis("the causal count is the exact lower triangle, N(N+1)/2 per row block; the convention "
                  "(and the benchmark's) is exactly half of N^2.",
                  expected=np.where(causal, 4.0 * b * h * d * n * (n + 1) / 2, want)),
        Diagnosis("the head dim enters squared or not at all: it is D (the length of the dot products).",
                  expected=want / d),
    ]
    bad = ~np.isclose(got, want, rtol=1e-9, atol=0)
    first = int(np.argmax(bad)) if bad.any() else 0
    run.compare(got, want, case=names[first] if bad.any() else "all", what="the FLOP count", atol=0, rtol=1e-9,
                diagnoses=diagnoses, axes=("case",))
    return run.passed()


def grade_roofline(fn, *, seed=None):
    """Grade ``fn(intensity, peak_tflops, bandwidth_gbps) -> TFLOP/s``, the roofline.

    ``min(peak_tflops, intensity * bandwidth_gbps / 1000)``: a kernel doing
    ``intensity`` FLOPs per byte moved cannot beat the bandwidth times that,
    nor the peak. Fixed cases on both sides of the ridge, then random ones.
    """
    __tracebackhide__ = True
    run = Run("check_roofline", seed)
    # The last one is so memory-bound that even a GB/s-for-TB/s slip stays below the peak.
    cases = [(10.0, 800.0, 4000.0), (1000.0, 800.0, 4000.0), (200.0, 800.0, 4000.0), (0.5, 65.0, 300.0), (0.01, 800.0, 4000.0)]
    for _ in range(12):
        peak = float(run.rng.uniform(10, 1000))
        bw = float(run.rng.uniform(100, 5000))
        ridge = peak * 1000 / bw
        cases.append((float(ridge * run.rng.choice([0.01, 0.3, 0.9, 1.5, 10.0])), peak, bw))
    got, want = [], []
    for intensity, peak, bw in cases:
        case = f"intensity={intensity:.4g} FLOP/byte, peak={peak:.4g} TFLOP/s, bandwidth={bw:.4g} GB/s"
        got.append(_number(run, run.call(fn, intensity, peak, bw, case=case), case))
        want.append(min(peak, intensity * bw / 1000))
    got, want = np.array(got), np.array(want)
    i, p, bw = (np.array([c[k] for c in cases]) for k in range(3))
    diagnoses = [
        Diagnosis("this is max(...): the roofline is the LOWER of the two limits, min(peak, intensity x bandwidth).",
                  expected=np.maximum(p, i * bw / 1000)),
        Diagnosis("the units: intensity (FLOP/byte) x bandwidth (GB/s) is GFLOP/s; divide by 1000 for TFLOP/s.",
                  expected=np.minimum(p, i * bw)),
        Diagnosis("the peak caps nothing here: memory-bound kernels are below the slope, compute-bound ones at "
                  "the peak; use min(peak, intensity x bandwidth).", expected=i * bw / 1000),
        Diagnosis("this always returns the peak: below the ridge point the bandwidth is the limit.", expected=p),
    ]
    run.compare(got, want, case="the roofline cases", what="the attainable TFLOP/s", atol=1e-9, rtol=1e-9,
                diagnoses=diagnoses, axes=("case",))
    return run.passed()


# --------------------------------------------------------------------------- #
# How many programs fit on one SM
# --------------------------------------------------------------------------- #
# An H200 (sm_90) SM, from NVIDIA's CUDA programming guide (compute capability 9.0).
H200 = dict(
    registers=65536,  # 32-bit registers per SM
    register_granularity=8,  # registers per thread are allocated in multiples of 8 (256 per warp)
    max_registers_per_thread=255,
    shared_kib=228,  # shared memory per SM
    max_shared_kib_per_program=227,
    reserved_kib_per_program=1,  # the system reserves 1 KiB of shared memory per resident program
    max_warps=64,  # resident warps per SM (2048 threads)
    max_programs=32,  # resident thread blocks per SM
)

# Compile statistics of the fast kernel recorded on the H200 by benchmarks/tune_fast.py
# (results/tune_fast.json, N = 4096): (configuration, registers per thread, num_warps, shared KiB).
RECORDED_COMPILES = (
    ("128x128 w8 s2 kv-grouped", 190, 8, 161),
    ("128x128 w8 s3 kv-grouped", 190, 8, 225),
    ("128x128 w8 s3", 219, 8, 225),
    ("128x64 w8 s2 kv-grouped", 146, 8, 96),
    ("256x64 w8 s2 kv-grouped", 255, 8, 128),
    ("128x64 w4 s2 kv-grouped", 255, 4, 96),
    ("128x64 w4 s3 kv-grouped", 255, 4, 129),
    ("128x32 w4 s3 kv-grouped", 225, 4, 80),
    ("64x64 w4 s2 kv-grouped", 139, 4, 81),
    ("64x64 w4 s3 kv-grouped", 139, 4, 113),
    ("128x128 w8 s2+pipe kv-grouped", 255, 8, 192),
    ("128x64 w8 s3+pipe kv-grouped", 157, 8, 144),
    ("64x64 w4 s2+pipe kv-grouped", 168, 4, 96),
)


RESOURCES = ("registers", "shared", "warps", "programs")


def _fit(limit, cost, strict=False):
    """How many programs of ``cost`` fit in ``limit``: n x cost <= limit (``strict``: the mistake n x cost < limit)."""
    n = limit // cost
    return n - 1 if strict and n * cost == limit else n


def programs_per_sm(registers_per_thread, num_warps, shared_kib, *, reserve=True, round_registers=True,
                    warp_limit=True, program_limit=True, strict=(), refuse_at=(), combine=min):
    """The H200's occupancy rule. The switches make the known mistakes, for the diagnoses:
    ``reserve``, ``round_registers``, ``warp_limit``, ``program_limit`` (the 32-program cap),
    ``combine`` (max for min); ``strict``: the resources of :data:`RESOURCES` counted with ``<``
    where the rule has ``<=`` (an exact fit refused); ``refuse_at``: "registers" / "shared" whose
    launch limit (255 / 227 KiB) is itself refused (``>=`` for ``>``)."""
    regs = int(registers_per_thread)
    if regs > H200["max_registers_per_thread"] or shared_kib > H200["max_shared_kib_per_program"]:
        return 0
    if ("registers" in refuse_at and regs == H200["max_registers_per_thread"]) or (
            "shared" in refuse_at and shared_kib == H200["max_shared_kib_per_program"]):
        return 0
    g = H200["register_granularity"]
    if round_registers:
        regs = -(-regs // g) * g
    by_regs = _fit(H200["registers"], regs * 32 * num_warps, "registers" in strict)
    by_smem = _fit(H200["shared_kib"], shared_kib + (H200["reserved_kib_per_program"] if reserve else 0),
                   "shared" in strict)
    limits = [by_regs, by_smem]
    if program_limit:
        limits.append(_fit(H200["max_programs"], 1, "programs" in strict))
    if warp_limit:
        limits.append(_fit(H200["max_warps"], num_warps, "warps" in strict))
    return int(combine(limits[:2])) if combine is max else int(min(limits))


ONE_BYTE_KIB = 1 / 1024  # exact in binary: 113 KiB + one byte is 113.0009765625
# Each boundary of the rule, on both sides (fresh random cases reach them only 1-5% of the time):
# (registers_per_thread, num_warps, shared_kib, what).
BOUNDARY_CASES = (
    (16, 1, 1, "a tiny 1-warp program: 64 would fit by warps, the 32-program limit binds"),
    (16, 2, 1, "32 programs of 2 warps: the 64 warps and the 32 programs exactly full"),
    (16, 16, 1, "4 programs of 16 warps fill the 64 warps exactly"),
    (128, 2, 1, "8 programs of 64 threads x 128 registers fill the 65,536 registers exactly"),
    (129, 2, 1, "one register per thread more (rounded up to 136): 7 programs"),
    (64, 2, 56, "4 programs of 56 + 1 KiB fill the 228 KiB exactly"),
    (64, 2, 113, "2 programs of 113 + 1 KiB fill the 228 KiB exactly"),
    (64, 2, 113 + ONE_BYTE_KIB, "113 KiB and one byte (the compiler counts bytes): 2 no longer fit"),
    (64, 4, 227, "227 KiB, the most one program may ask: it launches, alone"),
    (64, 4, 227 + ONE_BYTE_KIB, "227 KiB and one byte: it cannot launch"),
    (256, 1, 1, "256 registers per thread, one more than a thread may have"),
)


def grade_programs_per_sm(fn, *, seed=None):
    """Grade ``fn(registers_per_thread, num_warps, shared_kib) -> programs per SM`` on an H200.

    The fewest of: the register file (65,536 registers; registers per thread
    rounded up to a multiple of 8, 32 threads per warp), shared memory (228
    KiB, plus 1 KiB reserved per program), 64 warps and 32 programs; 0 when
    one program alone asks for more than 255 registers per thread or 227 KiB.
    First the compile statistics recorded on the H200, then each limit exactly
    reached and just passed, then random ones.
    """
    __tracebackhide__ = True
    run = Run("check_programs_per_sm", seed)
    cases = [(r, w, s, name + " (recorded on the H200)") for name, r, w, s in RECORDED_COMPILES]
    cases += [(16, 8, 1, "a tiny program"), (85, 1, 4, "registers just past a multiple of 8"),
              (64, 2, 114, "half of the shared memory"), (255, 4, 228, "more shared memory than one program may use"),
              (300, 1, 16, "more registers than a thread may have")]
    cases += list(BOUNDARY_CASES)
    for _ in range(14):
        r = int(run.rng.integers(16, 256))
        w = int(run.rng.choice([1, 2, 4, 8, 16]))
        s = int(run.rng.integers(1, 228))
        cases.append((r, w, s, "random"))
    got, names = [], []
    for r, w, s, what in cases:
        case = f"registers_per_thread={r}, num_warps={w}, shared_kib={s} ({what})"
        with proof.answer_keys_forbidden(programs_per_sm):  # the grader's own rule, in the module lesson 06 imports
            answer = run.call(fn, r, w, s, case=case)
        out = _number(run, answer, case)
        got.append(out)
        names.append(case)
    got = np.array(got)
    args = [(r, w, s) for r, w, s, _ in cases]

    def rule(**kw):
        return np.array([programs_per_sm(*a, **kw) for a in args], dtype=float)

    want = rule()
    diagnoses = [
        Diagnosis("this is the most programs any one resource allows: the SM holds only as many as the "
                  "scarcest resource lets in, so take the min of the limits.", expected=rule(combine=max)),
        Diagnosis("the 1 KiB of shared memory the system reserves for every resident program is missing: "
                  "228 // (shared_kib + 1).", expected=rule(reserve=False)),
        Diagnosis("registers are allocated per thread in multiples of 8: round registers_per_thread up to a "
                  "multiple of 8 before multiplying by the threads (32 x num_warps).",
                  expected=rule(round_registers=False)),
        Diagnosis("the resident-warp limit is missing: an SM holds at most 64 warps, so small programs "
                  "stop at 64 // num_warps.", expected=rule(warp_limit=False)),
        Diagnosis("registers were counted per warp, not per thread: a program holds "
                  "registers_per_thread x 32 x num_warps of the 65,536.",
                  expected=np.array([min(65536 // (-(-r // 8) * 8 * w), 228 // (s + 1), 64 // w, 32)
                                     if r <= 255 and s <= 227 else 0 for r, w, s in args], dtype=float)),
        Diagnosis("a program that needs more than 227 KiB of shared memory (or 255 registers per thread) "
                  "cannot launch at all: return 0 for it.",
                  when=lambda a: bool(np.any(a[np.array([r > 255 or s > 227 for r, _, s in args])] != 0))),
        Diagnosis("the limit of 32 resident programs (thread blocks) per SM is missing: whatever registers, "
                  "shared memory and warps allow, an SM holds at most 32, so a tiny 1-warp program stops at 32, "
                  "not 64.", expected=rule(program_limit=False)),
        Diagnosis("every limit was counted with < where it is <=: n programs fit when n x (what one needs) <= "
                  "what the SM has, so an exact fit counts (2 x (113 + 1) KiB = 228 KiB: 2 programs; "
                  "4 x 16 warps = 64: 4 programs; 32 programs: 32).", expected=rule(strict=RESOURCES)),
        Diagnosis("shared memory that fits exactly was refused (< where it is <=): n programs fit when "
                  "n x (shared_kib + 1) <= 228, so 113 KiB gives 2 programs (2 x 114 = 228), 56 KiB gives 4.",
                  expected=rule(strict=("shared",))),
        Diagnosis("registers that fill the register file exactly were refused (< where it is <=): 8 programs "
                  "of 2 warps x 32 threads x 128 registers = 65,536 all fit.", expected=rule(strict=("registers",))),
        Diagnosis("warps that fill the SM exactly were refused (< where it is <=): 4 programs of 16 warps = "
                  "64 warps all fit.", expected=rule(strict=("warps",))),
        Diagnosis("the 32nd program was refused (< where it is <=): an SM holds up to 32 programs, 32 included.",
                  expected=rule(strict=("programs",))),
        Diagnosis("227 KiB itself was refused: a program may use up to 227 KiB of shared memory, 227 included "
                  "(> 227 cannot launch, not >= 227).", expected=rule(refuse_at=("shared",))),
        Diagnosis("255 registers per thread itself was refused: a thread may have up to 255, 255 included "
                  "(> 255 cannot launch, not >= 255).", expected=rule(refuse_at=("registers",))),
    ]
    bad = got != want
    first = int(np.argmax(bad)) if bad.any() else 0
    run.compare(got, want, case=names[first] if bad.any() else "all", what="programs per SM", atol=0, rtol=0,
                diagnoses=diagnoses, axes=("case",))
    return run.passed()


# --------------------------------------------------------------------------- #
# Two programs per SM, applied to the learner's lesson-05 kernel
# --------------------------------------------------------------------------- #
# Triton's defaults when a launch names no num_warps / num_stages (the CUDA backend).
TRITON_DEFAULT_WARPS, TRITON_DEFAULT_STAGES = 4, 3
# The measured configuration (results/forward_bench.json's course_grid, 16-bit, D = 128).
MEASURED_TWO_PER_SM = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2)


def lesson05_shared_kib(block_m, block_n, head_dim_pad, num_stages, element_bytes):
    """Shared memory of one lesson-05 program, as lesson 06's section 5 models it: the Q tile plus
    ``num_stages`` K and V tiles in flight (``(BLOCK_M + 2 x num_stages x BLOCK_N) x HEAD_DIM_PAD``
    elements). It matches the fast kernel's compiles recorded on the H200 to 1 KiB (96 KiB for
    128 x 64 x 2 stages at D = 128 in bf16, 129 for 3 stages, 113 for 64 x 64 x 3)."""
    return (block_m * head_dim_pad + 2 * num_stages * block_n * head_dim_pad) * element_bytes / 1024


def two_per_sm_fit(block_m, block_n, head_dim_pad, num_stages, element_bytes, num_warps=4):
    """Programs per H200 SM of that launch, registers counted at the 255-per-thread cap (the
    worst case a compile can reach: the fast kernel's 128 x 64 tile on 4 warps did, recorded)."""
    return programs_per_sm(H200["max_registers_per_thread"], num_warps,
                           lesson05_shared_kib(block_m, block_n, head_dim_pad, num_stages, element_bytes))


MSG_TWO_NO_OPTIONS = (
    "your launch names no {missing}: the check reads num_warps and num_stages from the launch of your "
    "kernel (`kernel[grid](..., num_warps=4, num_stages=2)`), and Triton's defaults ({warps} warps, {stages} "
    "stages on CUDA) are not a choice you made. Pass both, from your two_per_sm_options."
)
MSG_TWO_NO_TILES = (
    "your kernel's launch has no BLOCK_M / BLOCK_N constexpr: the check reads the tile sizes of lesson "
    "05's kernel by those names (`_flash_attention_forward_gqa_kernel(..., BLOCK_M: tl.constexpr, "
    "BLOCK_N: tl.constexpr)`). Launch lesson 05's kernel, with its parameter names."
)
MSG_TWO_EIGHT_WARPS = (
    "the launch still uses 8 warps (lesson 05's launch for 16-bit inputs at D = 128): 8 warps are 256 "
    "threads, and at up to 255 registers per thread (rounded to 256) one program can take all 65,536 "
    "registers of the SM, so a second one is not guaranteed room (the fast kernel's 128 x 64 tile on 8 "
    "warps compiled to 146 registers per thread on the H200: 152 x 256 = 38,912 registers, one program "
    "per SM). Two 4-warp programs fit even at the cap: 2 x 128 x 256 = 65,536. Use num_warps=4."
)
MSG_TWO_WARPS = (
    "the launch uses num_warps={warps}: use 4. On Hopper a warpgroup of 4 warps issues each wgmma "
    "(tl.dot becomes wgmma only for a multiple of 4 warps), and two 4-warp programs fit in the register "
    "file even at 255 registers per thread (2 x 128 threads x 256 = 65,536)."
)
MSG_TWO_ONE_STAGE = (
    "the launch uses num_stages={stages}: with one stage no K/V tile is loaded while the current one is "
    "used, which throws away the pipelining that hides the loads. Keep 2 (or 3 where two programs still "
    "fit): here {fits} stages fit two programs."
)
MSG_TWO_THREE_STAGES = (
    "3 stages of {bm} x {bn} tiles at HEAD_DIM_PAD = {d} in {dtype} need about {kib:.0f} KiB of shared "
    "memory per program (section 5's model; the fast kernel's compile recorded 129 KiB for 128 x 64 at "
    "D = 128 in bf16), so 228 KiB hold one program, not two. With 2 stages it is {kib2:.0f} KiB: two fit "
    "(2 x ({kib2:.0f} + 1) <= 228). Use num_stages=2 here."
)
MSG_TWO_FP32 = (
    "these are float32 inputs: 4 bytes per element, twice a 16-bit tile, so {bm} x {bn} tiles with "
    "{stages} stages at HEAD_DIM_PAD = {d} need about {kib:.0f} KiB per program: one per SM. Choose the "
    "tiles by the dtype's size too (e.g. lesson 05's float32 tiles, 64 x 32 with 2 stages: {kib_small:.0f} "
    "KiB, two fit)."
)
MSG_TWO_PADDED = (
    "the tiles are HEAD_DIM_PAD = {d} columns wide, not D = {head_dim}: lesson 05's kernel pads the head "
    "dim to the next power of two (tl.arange needs one). Counted with D the launch fits two programs; with "
    "the padded {d} it needs about {kib:.0f} KiB per program, so 228 KiB hold one. Use "
    "triton.next_power_of_2(head_dim) in the model."
)
MSG_TWO_TOO_BIG = (
    "{bm} x {bn} tiles with {stages} stages at HEAD_DIM_PAD = {d} in {dtype} need about {kib:.0f} KiB of "
    "shared memory per program (section 5's model), plus 1 KiB reserved: 228 KiB hold {fit}. Two programs "
    "need at most 113 KiB each: choose smaller tiles or fewer stages (at least 2)."
)
MSG_TWO_SMALL_GPU = (
    "this check grades launch options for an H200 (228 KiB of shared memory per SM), and this GPU ({gpu}, "
    "sm_{sm}) gives one program at most 64 KiB: the 96 KiB of the two-programs launch cannot start here. Grade "
    "it in Triton's interpreter instead, which runs any tile size: check_on_cpu(check_two_per_sm, "
    "flash_attention_two_per_sm)."
)



def _launch_options(kernel, args, kwargs) -> dict:
    """num_warps, num_stages (None when not given) and the BLOCK_M / BLOCK_N of one launch."""
    try:
        values = dict(zip(list(kernel.arg_names), args))
    except Exception:  # noqa: BLE001  (a kernel of an unexpected kind: read the keywords only)
        values = {}
    values.update(kwargs)
    return {name: values.get(name) for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}


def _two_per_sm_problem(opts: dict, head_dim: int, dtype) -> str | None:
    """What is wrong with one launch's options for inputs of ``head_dim`` and torch ``dtype``, or None."""
    missing = [name for name in ("num_warps", "num_stages") if opts.get(name) is None]
    if missing:
        return MSG_TWO_NO_OPTIONS.format(missing=" and ".join(missing), warps=TRITON_DEFAULT_WARPS,
                                         stages=TRITON_DEFAULT_STAGES)
    bm, bn = opts.get("BLOCK_M"), opts.get("BLOCK_N")
    if not isinstance(bm, int) or not isinstance(bn, int):
        return MSG_TWO_NO_TILES
    warps, stages = int(opts["num_warps"]), int(opts["num_stages"])
    if warps == 8:
        return MSG_TWO_EIGHT_WARPS
    if warps != 4:
        return MSG_TWO_WARPS.format(warps=warps)
    d = 1 << max(0, int(head_dim) - 1).bit_length()  # triton.next_power_of_2
    elt = dtype.itemsize
    dname = str(dtype).replace("torch.", "")
    if stages < 2:
        fits = max((s for s in (2, 3) if two_per_sm_fit(bm, bn, d, s, elt) >= 2), default=2)
        return MSG_TWO_ONE_STAGE.format(stages=stages, fits=fits)
    fit = two_per_sm_fit(bm, bn, d, stages, elt)
    if fit >= 2:
        return None
    kib = lesson05_shared_kib(bm, bn, d, stages, elt)
    if d != head_dim and two_per_sm_fit(bm, bn, head_dim, stages, elt) >= 2:
        return MSG_TWO_PADDED.format(d=d, head_dim=head_dim, kib=kib)
    if elt == 4 and two_per_sm_fit(bm, bn, d, stages, 2) >= 2:
        return MSG_TWO_FP32.format(bm=bm, bn=bn, stages=stages, d=d, kib=kib,
                                   kib_small=lesson05_shared_kib(64, 32, d, 2, 4))
    if stages == 3 and two_per_sm_fit(bm, bn, d, 2, elt) >= 2:
        return MSG_TWO_THREE_STAGES.format(bm=bm, bn=bn, d=d, dtype=dname, kib=kib,
                                           kib2=lesson05_shared_kib(bm, bn, d, 2, elt))
    return MSG_TWO_TOO_BIG.format(bm=bm, bn=bn, stages=stages, d=d, dtype=dname, kib=kib,
                                  fit="none" if fit == 0 else "one")


def _two_per_sm_cases(rng, device: str):
    from .part2_triton import _Case, _describe

    gpu = device == "cuda"
    half = "bfloat16" if gpu and current().bf16_ok else "float16"
    cases = [
        _Case("", 1, 4, 2, 150, 128, "float16", "contiguous", True),  # the measured case: 128 x 64, 2 stages
        _Case("", 1, 2, 1, 100, 80, "float16", "padded", True),  # D = 80 pads to 128
        _Case("", 1, 2, 2, 130, 128, "float32", "contiguous", True),  # float32 tiles take twice the bytes
        _Case("", 2, 4, 1, 70, 64, "float16", "transposed", True),  # D = 64: lesson 05's 3 stages fit two
        _Case("", 1, 4, 2, 150, 128, "float16", "contiguous", True, same_shape_as=0),
    ]
    if gpu:
        cases += [_Case("", 2, 8, 2, 1000, 128, half, "padded", True),
                  _Case("", 1, 4, 4, 777, 64, "float16", "transposed", True)]
    dtypes = ["float16", "float32"] + (["bfloat16"] if gpu and current().bf16_ok else [])
    hkv = int(rng.integers(1, 3))
    n = int(rng.integers(17, 1200 if gpu else 161))
    cases.append(_Case("", 1, hkv * int(rng.choice([1, 2])), hkv, n, int(rng.choice([32, 64, 96, 128])),
                       str(rng.choice(dtypes)), str(rng.choice(["contiguous", "padded", "dstride"])), True))
    for i, c in enumerate(cases):
        c.desc = _describe(c, f"fixed {i + 1}" if i < len(cases) - 1 else "random 1", True)
    return cases


def grade_two_per_sm(fn, *, seed=None):
    """Grade ``fn(q, k, v) -> (o, lse)``: lesson 05's kernel launched so that two programs share an SM.

    Causal GQA attention as in lesson 05 (``q`` ``[B, Hq, N, D]``, ``k, v``
    ``[B, Hkv, N, D]``; ``o`` like ``q``, ``lse`` float32 ``[B, Hq, N]``,
    natural log), computed by the learner's own kernel, and every launch of it
    made with ``num_warps=4``, ``num_stages`` of 2 or more, and tiles whose
    shared memory (lesson 06's model, the head dim padded to a power of two)
    lets two programs fit on one H200 SM: for 16-bit inputs at D = 128, the
    measured 128 x 64 tiles with 2 stages. float16 and float32 (bfloat16 on a
    GPU), D = 64, 80 (padded to 128) and 128, against the float64 reference.
    """
    __tracebackhide__ = True
    import torch

    from .part2_triton import _run_case

    require_callable(fn, "check_two_per_sm", "your launcher")
    run = Run("check_two_per_sm", seed, time_limit_s=60.0)
    env = current()
    device = env.device
    if device == "cuda" and env.capability is not None and env.capability < (8, 0):
        raise run.fail(MSG_TWO_SMALL_GPU.format(gpu=env.gpu_name, sm=f"{env.capability[0]}{env.capability[1]}"),
                       "all")
    for c in _two_per_sm_cases(run.rng, device):
        def judge_launch(name, kernel, args, kwargs, tensors, c=c, dtype=getattr(torch, c.dtype)):
            # Judged before the kernel runs: a launch that asks for more shared memory than a program may
            # have would fail on a GPU with OutOfResources instead of this message.
            opts = _launch_options(kernel, args, kwargs)
            problem = _two_per_sm_problem(opts, c.D, dtype)
            if problem:
                shown = ", ".join(f"{key}={value}" for key, value in opts.items() if value is not None)
                raise Forbidden(f"your kernel `{name}` was launched with {shown or 'no options'}: {problem}")

        # lesson 05's check of one case (inputs, proof of work, o and lse against float64), these options added
        _run_case(run, fn, c, True, judge_launch=judge_launch)
    return run.passed()
