"""Checks for lesson 11: Hopper's own machinery and FP8.

- :func:`check_quantize_fp8` grades ``fn(x, block_size) -> (x8, scale)``:
  block quantisation to e4m3, one float32 scale per ``block_size`` tokens of
  each head (torch code; no kernel).
- :func:`check_persistent_schedule` grades ``fn(tiles, costs, n_programs) ->
  schedule``: the order of a persistent kernel, each program's list of
  (query block, head) tiles, checked by a load model (every tile exactly once,
  the longest program's load within :data:`MAKESPAN_FACTOR` of a lower bound).
- :func:`check_fp8_forward` grades ``fn(q8, k8, v8, q_scale, k_scale,
  v_scale, causal=False, block_size=128) -> o``: the FP8 attention forward by
  the learner's Triton kernel (scales folded into the score scale, P
  quantised, V handed to the kernel K-major).
- :func:`check_tma_transpose` grades ``fn(v) -> vt``: V made K-major by the
  learner's kernel, its tiles moved through tensor descriptors (TMA).
- :func:`check_gluon_loader` grades ``fn``, a ``@gluon.jit`` loader partition of
  ``kernels.hopper_ws``'s forward (the TMA ring of K/V slots and its mbarriers),
  run in the course's kernel by ``kernels.gluon_cpu``'s model on the CPU (Gluon has
  no interpreter), its operations checked against the ring's protocol.

The FP8 forward is compared with exact float64 attention on the *dequantised*
inputs (``x8 * scale``): what the kernel can at best compute. Quantising P to
e4m3 costs about 2% relative RMS error on top, keeping P in bf16/fp32 costs
nothing; both pass (:data:`REL_RMS_LIMIT` per (batch, head)). A known mistake
is recognised by computing, in NumPy, what the mistaken kernel would output
(a forgotten scale, sm_scale missing, the P scale not undone, no causal mask)
and finding the answer within the same limit of it.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from .. import references as ref
from ..environment import current
from . import inputs, proof
from .core import Diagnosis, GradingError, Run, require_callable
from .mistakes import MSG_NO_KERNEL_ATTENTION

__all__ = ["grade_quantize_fp8", "grade_persistent_schedule", "grade_fp8_forward", "grade_tma_transpose",
           "grade_gluon_loader", "MAKESPAN_FACTOR", "REL_RMS_LIMIT"]

E4M3_MAX = 448.0
#: check_persistent_schedule: the longest program's load may be at most this times the lower bound.
MAKESPAN_FACTOR = 1.15
#: check_fp8_forward: the largest relative RMS error of o per (batch, head) against exact math on the
#: dequantised inputs. P in e4m3 gives about 0.02, P in fp32 about 1e-7 (in the interpreter), Triton's
#: unrepaired interpreter cast float32 -> e4m3 (which loses the carry into the exponent; course_utils.environment
#: repairs it, see course_utils.kernels.fp8.to_e4m3) 0.07-0.15; a forgotten scale gives 0.5 or (much) more.
REL_RMS_LIMIT = 0.12

# =============================================================================
# check_quantize_fp8
# =============================================================================
MSG_PER_TENSOR = (
    "one scale for the whole tensor: every block got the same scale (the tensor's amax / 448). The exercise "
    "asks for one scale per block of block_size tokens of each head, so that a block of small values uses "
    "e4m3's whole range instead of sinking into its subnormals next to a block of outliers."
)
MSG_PER_HEAD = (
    "one scale per head: the blocks of one (batch, head) share a scale (the head's amax / 448). Take the amax "
    "of each block of block_size tokens separately: scale[b, h, j] = amax(|x[b, h, j*bs:(j+1)*bs, :]|) / 448."
)
MSG_NO_SCALE = (
    "the scales are all 1: x was cast to e4m3 as it is. Divide each block by its scale amax / 448 first, so "
    "that its largest value lands on 448; unscaled, values above 448 saturate and small ones lose their bits."
)
MSG_NOT_DIVIDED = (
    "the scales are right but x8 is x cast without dividing by them: x8 = (x / scale).to(torch.float8_e4m3fn), "
    "with each block's scale broadcast over its rows (x ~ x8 * scale)."
)
MSG_MULTIPLIED = (
    "x8 looks like x multiplied by the scale instead of divided by it: x8 = x / scale, so that x ~ x8 * scale."
)
MSG_INVERSE = (
    "the scales are 448 / amax, the inverse of what is asked: return scale = amax / 448, the number x8 is "
    "multiplied by to get x back (x ~ x8.float() * scale)."
)
MSG_ZERO_BLOCK = (
    "a block of zeros broke it: its amax is 0, so amax / 448 = 0 and 0 / 0 = NaN. Give such a block a "
    "positive scale (1, say): its x8 is 0 whatever the scale."
)
MSG_TAIL_BLOCK = (
    "only the last block, which holds fewer than block_size tokens (N is not a multiple of block_size), is "
    "wrong: take its amax over the tokens it has (pad with zeros, or slice), and keep cdiv(N, block_size) blocks."
)


def _quant_cases(rng):
    """(description, x as float64 [B, H, N, D], block_size, layout)."""
    cases = []
    x = rng.standard_normal((1, 2, 256, 16))
    cases.append(("standard normal, N a multiple of block_size", x, 128, "contiguous"))
    x = rng.standard_normal((2, 2, 100, 32))
    x[..., 32:64, :] *= 1e-3  # a block of tiny values: one scale per tensor ruins it
    x[..., 64:, :] *= 500.0  # and one above e4m3's range
    cases.append(("blocks of very different sizes (1e-3, 1, 500), N = 100 (a partial last block)", x, 32, "padded"))
    x = rng.standard_normal((1, 3, 80, 16)) * 3.0
    x[:, 1, 16:32] = 0.0  # a block of zeros
    cases.append(("a block of zeros, block_size 16", x, 16, "transposed"))
    x = rng.standard_normal((1, 2, 200, 64))
    big = rng.random(x.shape) < 0.001
    x[big] *= 100.0  # 0.1% large entries, as in FA3's accuracy test
    cases.append(("0.1% large entries (x100), N = 200, block_size 64", x, 64, "padded"))
    for i in range(2):  # fresh shapes and sizes every call
        b, h = int(rng.integers(1, 3)), int(rng.integers(1, 4))
        n, d = int(rng.integers(17, 300)), int(rng.choice([16, 32, 64]))
        bs = int(rng.choice([16, 32, 64, 128]))
        x = rng.standard_normal((b, h, n, d)) * np.exp(rng.uniform(-6, 6, (b, h, 1, 1)))
        cases.append((f"random {i + 1}: B={b}, H={h}, N={n}, D={d}, block_size {bs}", x, bs,
                      str(rng.choice(["contiguous", "padded", "transposed"]))))
    return cases


def _amax_scales(x, bs):
    b, h, n, d = x.shape
    nb = -(-n // bs)
    padded = np.zeros((b, h, nb * bs, d))
    padded[:, :, :n] = x
    amax = np.abs(padded.reshape(b, h, nb, bs, d)).max(axis=(3, 4))
    return np.where(amax > 0, amax / E4M3_MAX, 1.0), amax


def _rows(scale, bs, n):
    return np.repeat(scale, bs, axis=2)[:, :, :n, None]


def _to_e4m3(a):
    import torch

    return torch.from_numpy(np.clip(a, -E4M3_MAX, E4M3_MAX)).to(torch.float8_e4m3fn).double().numpy()


def grade_quantize_fp8(fn, *, seed=None):
    """Grade ``fn(x, block_size) -> (x8, scale)``: block quantisation of ``x [B, H, N, D]`` to e4m3.

    ``x8`` is ``torch.float8_e4m3fn`` with x's shape; ``scale`` float32 ``[B,
    H, cdiv(N, block_size)]``: ``amax / 448`` of each block of ``block_size``
    tokens of each head (positive and finite; a block of zeros gets any
    positive scale), with ``x ~ x8.float() * scale`` broadcast over each
    block's rows to within e4m3's rounding. Cases: blocks of very different
    sizes, a partial last block, a block of zeros, 0.1% outliers, strided
    layouts, fresh random ones.
    """
    import torch

    __tracebackhide__ = True
    require_callable(fn, "check_quantize_fp8")
    from ..kernels import fp8

    run = Run("check_quantize_fp8", seed, time_limit_s=30.0)
    device = current().device
    for desc, x64, bs, layout in _quant_cases(run.rng):
        case = f"{desc}, shape {tuple(x64.shape)}, {inputs.LAYOUTS[layout]}"
        b, h, n, d = x64.shape
        nb = -(-n // bs)
        x = inputs.laid_out(torch.tensor(x64, dtype=torch.float32, device=device), layout, run.rng)
        x64 = x.double().cpu().numpy()  # the values after rounding to float32
        before = inputs.snapshot(x=x)
        with proof.answer_keys_forbidden(fp8.quantize_fp8):
            out = run.call(fn, x, bs, case=case)
        changed = inputs.changed_input(before, x=x)
        if changed:
            raise run.fail(changed, case)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise run.fail(f"your function returned {type(out).__name__ if out is not None else 'None'}; "
                           "return the pair (x8, scale).", case)
        x8, scale = out
        if isinstance(scale, torch.Tensor) and tuple(scale.shape) != (b, h, nb):
            if scale.numel() == 1:
                raise run.fail(f"scale has shape {tuple(scale.shape)}: {MSG_PER_TENSOR}", case)
            if tuple(scale.shape) in ((b, h), (b, h, 1)):
                raise run.fail(f"scale has shape {tuple(scale.shape)}: {MSG_PER_HEAD}", case)
            if tuple(scale.shape) == (b, h, n):
                raise run.fail(f"scale has shape {tuple(scale.shape)}, one per token: keep one per block of "
                               f"{bs} tokens, [B, H, cdiv(N, block_size)] = {(b, h, nb)}.", case)
        inputs.tensor_like(run, x8, "x8", (b, h, n, d), torch.float8_e4m3fn, x.device, case)
        inputs.tensor_like(run, scale, "scale", (b, h, nb), torch.float32, x.device, case,
                           hint=" One float32 scale per block of block_size tokens of each head.")
        got_scale = scale.double().cpu().numpy()
        got_x8 = x8.double().cpu().numpy()
        want_scale, amax = _amax_scales(x64, bs)
        real = amax > 0
        zero_blocks = ~real
        if zero_blocks.any() and not (np.isfinite(got_scale[zero_blocks]).all() and (got_scale[zero_blocks] > 0).all()):
            raise run.fail(MSG_ZERO_BLOCK, case)
        if not (np.isfinite(got_scale).all() and (got_scale > 0).all()):
            raise run.fail("scale holds values that are not positive and finite: every block's scale must be "
                           "> 0 (amax / 448; 1 for a block of zeros).", case)
        if not np.isfinite(got_x8).all():
            raise run.fail("x8 holds NaN: e4m3fn has no infinity, so a value above 448 after scaling becomes "
                           "NaN unless clamped; divide by amax / 448 (and clamp to [-448, 448]).", case)
        if nb > 1:
            per_tensor = np.full_like(want_scale, amax.max() / E4M3_MAX)
            per_head = np.broadcast_to(amax.max(axis=2, keepdims=True) / E4M3_MAX, want_scale.shape)
        else:
            per_tensor = per_head = None
        scale_diagnoses = [
            Diagnosis(MSG_NO_SCALE, expected=np.ones_like(want_scale)),
            Diagnosis(MSG_INVERSE, expected=np.where(real, 1.0 / want_scale, got_scale), rtol=1e-3),
        ]
        if per_tensor is not None and h * b > 1:
            scale_diagnoses.append(Diagnosis(MSG_PER_TENSOR, expected=per_tensor))
        if per_head is not None:
            scale_diagnoses.append(Diagnosis(MSG_PER_HEAD, expected=per_head))
        if n % bs:
            scale_diagnoses.append(Diagnosis(MSG_TAIL_BLOCK, when=lambda a: bool(
                np.allclose(a[..., :-1], want_scale[..., :-1], rtol=1e-5)
                and not np.allclose(a[..., -1], want_scale[..., -1], rtol=1e-5))))
        # Only the blocks holding a nonzero value: a block of zeros may have any positive scale.
        run.compare(np.where(real, got_scale, want_scale), want_scale, case=case,
                    what="scale (amax / 448 of each block)", atol=0.0, rtol=1e-5,
                    diagnoses=scale_diagnoses, axes=("batch", "head", "block"))
        # x8 * scale must give x back to within e4m3's rounding: half a step, 2**-4 of |x| for normal
        # numbers, and half the subnormals' step (2**-10 * scale) below them.
        rows = _rows(got_scale, bs, n)
        back = got_x8 * rows
        rows_want = _rows(want_scale, bs, n)
        x8_diagnoses = [
            Diagnosis(MSG_NOT_DIVIDED, expected=lambda: _to_e4m3(x64) * rows_want, rtol=0.07,
                      atol=float(rows_want.max()) * 2e-3),
            Diagnosis(MSG_MULTIPLIED, expected=lambda: _to_e4m3(x64 * rows_want) * rows_want, rtol=0.07,
                      atol=float(rows_want.max()) * 2e-3),
        ]
        tol = 2.0 ** -4 * np.abs(x64) + rows * 2.0 ** -10 * 1.001
        bad = np.abs(back - x64) > tol
        if bad.any():
            run.compare(back, x64, case=case, what="x8 * scale (x rebuilt from its e4m3 values)",
                        atol=float((rows * 2.0 ** -10).min()), rtol=2.0 ** -4, diagnoses=x8_diagnoses,
                        axes=("batch", "head", "row", "col"))
        run.max_error = max(run.max_error, float(np.max(np.abs(back - x64) / (np.abs(x64) + rows[..., 0:1] * 2e-3))))
    return run.passed()


# =============================================================================
# check_persistent_schedule
# =============================================================================
MSG_ROUND_ROBIN = (
    "this is the tile list dealt out in order (tile i to program i % n_programs): with a causal mask the "
    "tiles of the last query blocks cost many times the first ones', so some programs get several long "
    "tiles. Hand out the longest tiles first, each to the program with the least load so far."
)
MSG_CHUNKS = (
    "this is the tile list cut into contiguous chunks, one per program: the chunks holding the last query "
    "blocks are the heaviest. Balance by cost, not by count: longest tiles first, each to the least-loaded "
    "program."
)


def _sched_cases(rng):
    """(description, tiles, costs, n_programs)."""
    cases = []

    def causal(n_m, heads, overhead=0.0):
        tiles = [(m, hd) for hd in range(heads) for m in range(n_m)]
        return tiles, [float(m + 1) + overhead for m, _ in tiles]

    tiles, costs = causal(16, 32)
    cases.append(("causal, 16 query blocks x 32 heads on 132 programs (an H200's SMs)", tiles, costs, 132))
    tiles, costs = causal(32, 16, 0.5)
    cases.append(("causal, 32 query blocks x 16 heads, a fixed cost of 0.5 per tile, 132 programs",
                  tiles, costs, 132))
    tiles, costs = causal(8, 3)
    cases.append(("causal, 8 query blocks x 3 heads on 5 programs", tiles, costs, 5))
    tiles = [(m, hd) for hd in range(32) for m in range(8)]
    cases.append(("not causal: 8 query blocks x 32 heads, all the same cost, 132 programs", tiles,
                  [1.0] * len(tiles), 132))
    tiles, costs = causal(4, 2)
    cases.append(("more programs (12) than tiles (8)", tiles, costs, 12))
    for i in range(2):
        n_m, heads, n_p = int(rng.integers(4, 40)), int(rng.integers(1, 24)), int(rng.integers(2, 140))
        tiles, costs = causal(n_m, heads, float(rng.uniform(0, 2)))
        costs = [c * float(rng.uniform(0.8, 1.25)) for c in costs]  # measured costs are never exact
        cases.append((f"random {i + 1}: {n_m} query blocks x {heads} heads, noisy causal costs, {n_p} programs",
                      tiles, costs, n_p))
    return cases


def lower_bound(costs, n_programs) -> float:
    """A lower bound on any schedule's makespan: the largest tile, the average load, and the two
    smallest of the ``n_programs + 1`` largest tiles (two of them must share a program)."""
    c = sorted(costs, reverse=True)
    bound = max(c[0] if c else 0.0, sum(c) / n_programs)
    if len(c) > n_programs:
        bound = max(bound, c[n_programs - 1] + c[n_programs])
    return bound


def grade_persistent_schedule(fn, *, seed=None):
    """Grade ``fn(tiles, costs, n_programs) -> schedule``: a persistent kernel's balanced order.

    ``tiles`` is a list of ``(query_block, head)`` tuples, ``costs`` their
    costs (causal: a later query block visits more K/V blocks), ``n_programs``
    the programs of the persistent grid (one per SM). Return a list of
    ``n_programs`` lists, program ``p``'s tiles in the order it runs them.
    Every tile must appear exactly once, and the largest program load at most
    ``MAKESPAN_FACTOR`` (1.15) times a lower bound (the largest tile, the
    average load, and the two smallest of the ``n_programs + 1`` largest tiles),
    or at most 2% above longest-processing-time-first's on the same case.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_persistent_schedule")
    from ..kernels import fp8

    run = Run("check_persistent_schedule", seed, time_limit_s=10.0)
    for desc, tiles, costs, n_p in _sched_cases(run.rng):
        with proof.answer_keys_forbidden(fp8.lpt_schedule):
            out = run.call(fn, list(tiles), list(costs), n_p, case=desc)
        if out is None:
            raise run.fail("your function returned None: did you forget a `return`?", desc)
        try:
            programs = [list(p) for p in out]
        except TypeError:
            raise run.fail(f"your function returned a {type(out).__name__}; return a list of n_programs lists "
                           "of tiles.", desc) from None
        if len(programs) != n_p:
            raise run.fail(f"your schedule has {len(programs)} programs; return exactly n_programs = {n_p} lists "
                           "(a program with nothing to do gets an empty list).", desc)
        known = set(tiles)
        seen = {}
        for p, program in enumerate(programs):
            for t in program:
                key = tuple(t) if isinstance(t, (list, tuple)) else t
                if key not in known:
                    hint = (" Return the tiles themselves ((query_block, head) tuples), not their indices."
                            if isinstance(key, (int, np.integer)) else "")
                    raise run.fail(f"program {p} holds {t!r}, which is not one of the tiles.{hint}", desc)
                if key in seen:
                    raise run.fail(f"tile {key} is scheduled twice (programs {seen[key]} and {p}): every tile "
                                   "must run exactly once, or its output is computed twice (and with "
                                   "atomics, added twice).", desc)
                seen[key] = p
        missing = [t for t in tiles if t not in seen]
        if missing:
            raise run.fail(f"{len(missing)} of {len(tiles)} tiles are in no program, e.g. {missing[0]}: their "
                           "query rows would never be computed. Every tile must be in exactly one program.", desc)
        cost_of = dict(zip(tiles, costs))
        loads = np.array([sum(cost_of[tuple(t) if isinstance(t, list) else t] for t in program)
                          for program in programs])
        bound = lower_bound(costs, n_p)
        # LPT is within 4/3 of the optimum, not always within MAKESPAN_FACTOR of this bound: a schedule
        # as balanced as the course's own LPT on this case (2% for other tie-breaks) always passes.
        lpt = fp8.lpt_schedule(list(tiles), list(costs), n_p)
        allowed = max(MAKESPAN_FACTOR * bound, max(sum(cost_of[t] for t in program) for program in lpt) * 1.02)
        ratio = float(loads.max() / bound)
        run.max_error = max(run.max_error, ratio - 1.0)
        if loads.max() > allowed:
            rr = [tiles[i::n_p] for i in range(n_p)]
            per = -(-len(tiles) // n_p)
            chunks = [tiles[i * per:(i + 1) * per] for i in range(n_p)]
            message = (f"the schedule is unbalanced: program {int(loads.argmax())} carries a load of "
                       f"{loads.max():.4g}, {ratio:.2f}x the lower bound {bound:.4g} (allowed: "
                       f"{allowed / bound:.2f}x); the lightest carries {loads.min():.4g}.")
            if programs == rr:
                message += f"\nLikely cause: {MSG_ROUND_ROBIN}"
            elif programs == chunks:
                message += f"\nLikely cause: {MSG_CHUNKS}"
            else:
                message += (" Hand out the longest tiles first, each to the program with the least load so far "
                            "(longest processing time first).")
            raise run.fail(message, desc)
    return run.passed()


# =============================================================================
# check_fp8_forward
# =============================================================================
MSG_NO_Q_SCALE = ("q's scale is missing from the scores: fold each query row's q_scale into the score scale "
                  "(s = dot(q8, k8) * q_scale * k_scale * sm_scale * log2(e)).")
MSG_NO_K_SCALE = ("k's scale is missing from the scores: multiply the scores of each K tile by that tile's "
                  "k_scale (one per block_size keys), with q's scale and sm_scale.")
MSG_NO_QK_SCALE = ("the scores miss both q's and k's scales: dot(q8, k8) multiplies the e4m3 numbers, which are "
                   "x / scale; multiply the scores by q_scale * k_scale (and sm_scale * log2(e)).")
MSG_NO_V_SCALE = ("v's scale is missing: dot(p, v8) sums e4m3 numbers that are v / v_scale; multiply each tile's "
                  "product by its v_scale before adding it to the accumulator.")
MSG_P_SCALE = ("o is {c:.4g} times the right answer: the fixed scale P was multiplied by before quantising "
               "(p8 = p * P_SCALE) was not undone. Divide the P V product by P_SCALE (fold it into v_scale).")
MSG_NO_SM_SCALE = ("the scores are not scaled by 1/sqrt(D): with the scales folded in, the score scale is "
                   "q_scale * k_scale * sm_scale * log2(e) (for exp2).")
MSG_NO_CAUSAL_FP8 = ("the causal mask is missing: with causal=True query i must not see keys j > i (mask the "
                     "diagonal blocks, and stop the loop at the query block's end).")
MSG_FP8_NAN = ("o holds NaN although the inputs have none: a load reads past the end of the data (the check "
               "surrounds every tensor with NaN, and e4m3fn has a NaN too), or a row divides by l_i = 0. Mask "
               "the loads of the last, partial blocks (offs < N) and the padded head-dim columns (offs_d < D).")
MSG_V_ROW_MAJOR = (
    "the output is right, but V reached your kernel as it came, with its head dim contiguous (stride "
    "{stride} along the keys): Hopper's FP8 wgmma reads both operands of P V K-major, i.e. with the keys "
    "contiguous. Hand the kernel V transposed, e.g. vt8 = v8.transpose(2, 3).contiguous() ([B, Hkv, D, N]), "
    "and load its [D, BLOCK_N] tiles (tl.trans gives the [BLOCK_N, D] operand)."
)
MSG_V_NOT_FP8 = (
    "the output is right, but no float8_e4m3fn tensor holding V reached your kernel: the point of the "
    "exercise is the P V product in FP8. Pass V as e4m3, K-major (vt8 = v8.transpose(2, 3).contiguous())."
)
MSG_Q_NOT_FP8 = (
    "the output is right, but q and k did not both reach your kernel as float8_e4m3fn tensors: the Q K^T "
    "product must take the e4m3 tiles, with the scales folded into the score scale (no dequantised copy)."
)


@dataclasses.dataclass
class _AttentionCase:
    """A case's shape: ``B`` batches of ``Hq`` query heads over ``Hkv`` kv heads, ``N`` tokens, head dim ``D``."""
    desc: str
    B: int
    Hq: int
    Hkv: int
    N: int
    D: int
    causal: bool


@dataclasses.dataclass
class _F8Case(_AttentionCase):
    block_size: int
    layout: str
    outliers: bool = False


def _fp8_cases(rng, device):
    cases = [
        _F8Case("", 1, 2, 2, 64, 32, False, 32, "contiguous"),
        _F8Case("", 1, 4, 2, 160, 48, True, 64, "padded"),  # D = 48: padded to 64 inside, masked
        _F8Case("", 2, 2, 1, 100, 16, True, 32, "transposed"),
        _F8Case("", 1, 2, 1, 200, 128, False, 128, "padded", outliers=True),
        _F8Case("", 1, 2, 2, 64, 32, False, 32, "contiguous"),
    ]
    if device == "cuda":
        cases.append(_F8Case("", 2, 8, 2, 1000, 128, True, 128, "padded", outliers=True))
        # D = 64 with 128-token scale blocks: a GPU launch's K/V tiles (64 keys at D <= 64) are smaller than a
        # scale block here, so a kernel that indexes the scales per tile, not per block, is caught on a GPU too
        # (at D = 128 the course's tiles are 128 keys, one scale block each, and that mistake changes nothing).
        cases.append(_F8Case("", 1, 4, 4, 777, 64, False, 128, "transposed"))
    for _ in range(2):
        hkv = int(rng.integers(1, 3))
        hq = hkv * int(rng.choice([1, 2, 4]))
        n = int(rng.integers(17, 1200 if device == "cuda" else 161))
        cases.append(_F8Case("", 1, hq, hkv, n, int(rng.choice([16, 32, 64, 128])), bool(rng.integers(2)),
                             int(rng.choice([32, 64, 128])), str(rng.choice(["contiguous", "padded", "transposed"]))))
    fixed = 5 if device != "cuda" else 7
    for i, c in enumerate(cases):
        kind = "MHA" if c.Hq == c.Hkv else "MQA" if c.Hkv == 1 else f"GQA, group_size {c.Hq // c.Hkv}"
        name = f"fixed {i + 1}" if i < fixed else f"random {i - fixed + 1}"
        again = ", fixed 1's shape again with new values" if i == 4 else ""
        c.desc = (f"{name}: B={c.B}, Hq={c.Hq}, Hkv={c.Hkv} ({kind}), N={c.N}, D={c.D}, "
                  f"{'causal' if c.causal else 'not causal'}, block_size {c.block_size}, "
                  f"{inputs.LAYOUTS[c.layout]}{', 0.1% large entries' if c.outliers else ''}{again}")
    return cases


def _rel_rms_per_head(a, b):
    """sqrt(mean((a - b)^2) / mean(b^2)) over each (batch, head)'s [N, D]."""
    with np.errstate(all="ignore"):
        num = np.mean((a - b) ** 2, axis=(2, 3))
        den = np.mean(b ** 2, axis=(2, 3))
        return np.sqrt(num / np.maximum(den, 1e-30))


def _near(got, model) -> bool:
    return bool(np.all(np.isfinite(got)) and np.all(_rel_rms_per_head(got, model) <= REL_RMS_LIMIT))


class _Model(Diagnosis):
    """A mistake recognised by its output: the answer is within the check's limit of ``model()``.

    Its distance is the largest relative RMS error to that output, so where two mistakes both come close
    (a forgotten k scale and forgotten q and k scales both make the softmax nearly one-hot) the nearer
    one is named (:func:`.core.pick_diagnosis`).
    """

    def __init__(self, message, model):
        super().__init__(message)
        self.model = model
        self._out = None

    def _output(self):
        if self._out is None:
            self._out = self.model()
        return self._out

    def matches(self, actual, atol, rtol):
        return _near(actual, self._output())

    def distance(self, actual, atol, rtol):
        return float(np.max(_rel_rms_per_head(actual, self._output())))


def _kernel_arguments(record):
    """Record the tensor arguments of every Triton launch of the learner's (not the course's) kernels."""
    return proof.watching_learner_launches(lambda name, kernel, args, kwargs, tensors: record.extend(tensors))


def _layout_problem(record, q8, k8, v8) -> str | None:
    """Why the e4m3 tensors did not reach the learner's kernel as asked (V K-major), or None."""
    import torch

    b, hkv, n, d = v8.shape
    fp8 = [t for t in record if t.dtype == torch.float8_e4m3fn and t.dim() == 4]

    def holds(t, x):
        return t.shape == x.shape and torch.equal(t.float().cpu(), x.float().cpu())

    if not any(holds(t, q8) for t in fp8) or not any(holds(t, k8) for t in fp8):
        return MSG_Q_NOT_FP8
    v_like = []
    for t in fp8:
        if tuple(t.shape) == (b, hkv, d, n) and holds(t.transpose(2, 3), v8):
            v_like.append(t.stride(3))
        elif tuple(t.shape) == (b, hkv, n, d) and holds(t, v8):
            v_like.append(t.stride(2))
    if not v_like:
        return MSG_V_NOT_FP8
    if 1 not in v_like or n == 1:
        return None if n == 1 else MSG_V_ROW_MAJOR.format(stride=v_like[0])
    return None


def _fp8_diagnoses(c, q8, k8, v8, qs, ks, vs, got):
    bs = c.block_size

    def deq(x8, s):
        return x8 * _rows(s, bs, c.N)

    qd, kd, vd = deq(q8, qs), deq(k8, ks), deq(v8, vs)

    def att(q, k, v, scale=None, causal=c.causal):
        return ref.attention(q, k, v, causal=causal, scale=scale)

    expected = att(qd, kd, vd)
    models = [
        (MSG_NO_K_SCALE, lambda: att(qd, k8, vd)),
        (MSG_NO_Q_SCALE, lambda: att(q8, kd, vd)),
        (MSG_NO_QK_SCALE, lambda: att(q8, k8, vd)),
        (MSG_NO_V_SCALE, lambda: att(qd, kd, v8)),
        (MSG_NO_SM_SCALE, lambda: att(qd, kd, vd, scale=1.0)),
    ]
    if c.causal:
        models.append((MSG_NO_CAUSAL_FP8, lambda: att(qd, kd, vd, causal=False)))
    out = [_Model(msg, model) for msg, model in models]

    def scaled(a):
        with np.errstate(all="ignore"):
            cst = float(np.sum(got * expected) / max(np.sum(expected ** 2), 1e-30))
        return abs(cst - 1.0) > 0.5 and _near(got, cst * expected), cst

    def p_scale(a):
        ok, cst = scaled(a)
        if ok:
            p_scale.message = MSG_P_SCALE.format(c=cst)
        return ok

    diag = Diagnosis(MSG_P_SCALE, when=p_scale)
    out.append(diag)
    out.append(Diagnosis(MSG_FP8_NAN, when=lambda a: not np.all(np.isfinite(got))))
    return expected, out, diag, p_scale


def _run_fp8_case(run, fn, c: _F8Case):
    import torch

    from ..kernels import fp8

    device = current().device
    shape_q, shape_kv = (c.B, c.Hq, c.N, c.D), (c.B, c.Hkv, c.N, c.D)
    raw = [run.rng.standard_normal(s) for s in (shape_q, shape_kv, shape_kv)]
    if c.outliers:
        for x in raw:
            x[run.rng.random(x.shape) < 0.001] *= 100.0
    quantised = [fp8.quantize_fp8(torch.tensor(x, dtype=torch.float32, device=device), c.block_size) for x in raw]
    (q8, qs), (k8, ks), (v8, vs) = quantised
    q8, k8, v8 = (inputs.laid_out(t, c.layout, run.rng) for t in (q8, k8, v8))
    qs, ks, vs = (inputs.guarded_contiguous(t) for t in (qs, ks, vs))  # NaN after the last scale
    before = inputs.snapshot(q8=q8, k8=k8, v8=v8, q_scale=qs, k_scale=ks, v_scale=vs)
    record = []
    with proof.Work(inputs=(q8, k8, v8, qs, ks, vs)) as work, _kernel_arguments(record):
        o = run.call(fn, q8, k8, v8, qs, ks, vs, causal=c.causal, block_size=c.block_size, case=c.desc)
    if o is None:
        raise run.fail("your function returned None: did you forget a `return`? Return o.", c.desc)
    if not isinstance(o, torch.Tensor):
        raise run.fail(f"your function returned a {type(o).__name__}; return o, a torch tensor.", c.desc)
    problem = work.problem(no_kernel=MSG_NO_KERNEL_ATTENTION, o=o)
    if problem:
        raise run.fail(problem, c.desc)
    changed = inputs.changed_input(before, q8=q8, k8=k8, v8=v8, q_scale=qs, k_scale=ks, v_scale=vs)
    if changed:
        raise run.fail(changed, c.desc)
    if tuple(o.shape) != shape_q:
        raise run.fail(f"o has shape {tuple(o.shape)}, expected q's {shape_q}.", c.desc)
    if o.dtype not in (torch.float32, torch.bfloat16, torch.float16) or o.device != q8.device:
        raise run.fail(f"o is {o.dtype} on {o.device}: return it in float32 (the CPU) or bfloat16 (a GPU), on "
                       f"the inputs' device ({q8.device}).", c.desc)
    got = o.detach().float().cpu().double().numpy()
    as64 = [t.detach().float().cpu().double().numpy() for t in (q8, k8, v8, qs, ks, vs)]
    expected, diagnoses, p_diag, p_scale = _fp8_diagnoses(c, *as64, got)
    errors = _rel_rms_per_head(got, expected)
    if not np.all(np.isfinite(got)):
        errors = np.where(np.all(np.isfinite(got), axis=(2, 3)), errors, np.inf)
    if np.any(errors > REL_RMS_LIMIT):
        from .core import pick_diagnosis

        diagnosis = pick_diagnosis(diagnoses, got, 0.0, 0.0)
        worst = np.unravel_index(np.argmax(errors), errors.shape)
        message = (f"o is wrong: its relative RMS error against exact attention on the dequantised inputs "
                   f"(x8 * scale) is {errors[worst]:.3g} for batch {worst[0]}, head {worst[1]} (allowed: "
                   f"{REL_RMS_LIMIT}; P in e4m3 costs about 0.02, P in bf16 less).")
        if diagnosis is not None:
            text = getattr(p_scale, "message", diagnosis.message) if diagnosis is p_diag else diagnosis.message
            message += f"\nLikely cause: {text}"
        raise run.fail(message, c.desc)
    run.max_error = max(run.max_error, float(errors.max()))
    layout = _layout_problem(record, q8, k8, v8)
    if layout:
        raise run.fail(layout, c.desc)


def grade_fp8_forward(fn, *, seed=None):
    """Grade ``fn(q8, k8, v8, q_scale, k_scale, v_scale, causal=False, block_size=128) -> o``: FP8 attention.

    ``q8 [B, Hq, N, D]``, ``k8, v8 [B, Hkv, N, D]`` are ``float8_e4m3fn``
    (any strides, in NaN-filled memory) and ``*_scale`` their float32 scales
    ``[B, H, cdiv(N, block_size)]`` as ``quantize_fp8`` makes them. ``o`` is
    float32 (CPU) or bf16 (GPU), q's shape, from your Triton kernel, whose
    arguments must include q8 and k8 in e4m3 and V in e4m3 **K-major** (keys
    contiguous, e.g. ``v8.transpose(2, 3).contiguous()``). Compared with exact
    float64 attention on the dequantised inputs: relative RMS error at most
    ``REL_RMS_LIMIT`` (0.12) per (batch, head); P in e4m3 or in bf16 both pass.
    Isolated on the CPU; ``seed`` replays a call.
    """
    run = Run("check_fp8_forward", seed, time_limit_s=60.0)
    for c in _fp8_cases(run.rng, current().device):
        _run_fp8_case(run, fn, c)
    return run.passed()



# =============================================================================
# check_tma_transpose
# =============================================================================
MSG_NO_DESCRIPTOR = (
    "your kernel moved the tile with pointer loads and stores: this exercise is the tensor-descriptor version. "
    "Describe v and vt with `tl.make_tensor_descriptor(base, shape=[...], strides=[...], block_shape=[...])` "
    "inside the kernel (or pass `TensorDescriptor.from_tensor(...)` from the launcher) and use `desc.load` / "
    "`desc.store`: the copy engine then moves the whole box, and the edges need no mask."
)
MSG_TMA_NOT_TRANSPOSED = (
    "vt holds v's rows, not its columns: the tile was stored as it was loaded. Transpose it (`tl.trans(tile)`) "
    "and store it into a descriptor of vt, shape [D, R], block [D, BLOCK_R], at [0, row]."
)
MSG_TMA_TILE_COORDS = (
    "the descriptor's coordinates were given in tiles (`[pid, 0]`), not in elements: `desc.load([row, 0])` "
    "takes the first row of the box, so program pid starts at row = pid * BLOCK_R (and stores at [0, row] of "
    "vt). A box must also start on a 16-byte boundary, which a tile index rarely is."
)
MSG_TMA_ALLOCATOR = (
    "a device descriptor (`tl.make_tensor_descriptor`) needs scratch memory for the descriptor itself: call "
    "`triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=...))` "
    "in your launcher before the launch (Triton's interpreter needs none, a GPU does)."
)


def _uses_descriptors(launches) -> bool:
    """Whether one of the learner's launched kernels builds a device descriptor or got a host one."""
    import inspect

    for kernel, args, kwargs in launches:
        for value in list(args) + list(kwargs.values()):
            if type(value).__name__ in ("TensorDescriptor", "TensorDescriptorLike"):
                return True
        fn = getattr(kernel, "fn", kernel)
        try:
            source = getattr(kernel, "src", None) or inspect.getsource(fn)
        except (OSError, TypeError):
            source = ""
        if "make_tensor_descriptor" in source:
            return True
    return False


MSG_NO_KERNEL_TMA = (
    "no Triton kernel ran: your function must transpose v by launching your @triton.jit kernel "
    "(`kernel[grid](...)`), not with torch (`v.T.contiguous()`)."
)


def _written_by_tile_indices(r, block_r) -> int:
    """How many leading columns of vt a kernel that loads at [pid, 0] and stores at [0, pid] writes.

    Program pid moves rows pid .. pid + block_r - 1 into columns pid .. pid + block_r - 1: each column it
    writes is right, but the last program ends at column n_programs - 1 + block_r, short of R."""
    return min(r, -(-r // block_r) - 1 + block_r)


def grade_tma_transpose(fn, *, seed=None):
    """Grade ``fn(v) -> vt``: ``v`` ``[R, D]`` transposed into a new contiguous ``[D, R]`` by a Triton kernel
    whose tiles travel through tensor descriptors (TMA on Hopper).

    ``R`` a multiple of 16 (a descriptor's strides must be 16-byte multiples), not always of the tile's rows;
    ``D`` in 16-128; float32 on the CPU, the lesson's 16-bit type on a GPU. The transpose must be exact,
    written by your own kernel during the call, through a descriptor (built in the kernel with
    ``tl.make_tensor_descriptor``, or a host ``TensorDescriptor``), and ``v`` left as it was. On a GPU older
    than Hopper (no TMA) the check runs in Triton's interpreter on the CPU.
    """
    import torch

    __tracebackhide__ = True
    require_callable(fn, "check_tma_transpose", "your launcher")
    env = current()
    if env.device == "cuda" and env.capability is not None and env.capability < (9, 0):
        from .isolation import in_cpu_interpreter

        return in_cpu_interpreter("check_tma_transpose", grade_tma_transpose, fn, {"seed": seed}, 240.0)
    run = Run("check_tma_transpose", seed, time_limit_s=30.0)
    dtype = torch.float32 if env.device == "cpu" else env.dtype
    shapes = [(64, 16), (80, 32), (144, 64), (16, 128), (208, 64)]
    shapes.append((16 * int(run.rng.integers(1, 20)), int(run.rng.choice([16, 32, 64, 128]))))
    for r, d in shapes:
        values = torch.from_numpy(run.rng.standard_normal((r, d))).to(dtype)
        v = values.to(env.device)
        case = f"v [{r}, {d}], {str(dtype).replace('torch.', '')}"
        before = inputs.snapshot(v=v)
        launches = []
        try:
            with proof.Work(inputs=(v,)) as work, proof.watching_learner_launches(
                    lambda name, kernel, args, kwargs, tensors: launches.append((kernel, args, kwargs))):
                out = run.call(fn, v, case=case)
        except Exception as exc:  # noqa: BLE001 - two mistakes have a sentence of their own
            if "allocator" in str(exc).lower():
                raise run.fail(MSG_TMA_ALLOCATOR, case) from None
            if "16-byte aligned" in str(exc):
                raise run.fail(MSG_TMA_TILE_COORDS, case) from None
            raise
        if not work.launches:
            raise run.fail(MSG_NO_KERNEL_TMA, case)
        changed = inputs.changed_input(before, v=v)
        if changed:
            raise run.fail(changed, case)
        if not isinstance(out, torch.Tensor):
            raise run.fail(f"your function returned a {type(out).__name__}; return vt, a torch tensor.", case)
        if tuple(out.shape) != (d, r):
            raise run.fail(f"vt has shape {tuple(out.shape)}, expected {(d, r)} (v is [{r}, {d}]).", case)
        got = out.detach().cpu().double().numpy()
        want = values.double().numpy().T
        plain = values.double().numpy()
        block_r = next((int(kw.get("BLOCK_R", 0) or 0) for _, _, kw in launches if kw.get("BLOCK_R")), 0)
        diagnoses = [Diagnosis(MSG_TMA_NOT_TRANSPOSED, expected=lambda p=plain: p.reshape(d, r))]
        written = _written_by_tile_indices(r, block_r) if block_r else r
        if written < r:
            diagnoses.append(Diagnosis(MSG_TMA_TILE_COORDS, when=lambda a, w=written, t=want: bool(
                np.array_equal(a[:, :w], t[:, :w]) and not np.array_equal(a[:, w:], t[:, w:]))))
        run.compare(got, want, case=case, what="vt", atol=0, rtol=0, diagnoses=diagnoses, axes=("d", "r"))
        problem = work.problem(no_kernel=MSG_NO_DESCRIPTOR, vt=out)
        if problem:
            raise run.fail(problem, case)
        if not _uses_descriptors(launches):
            raise run.fail(MSG_NO_DESCRIPTOR, case)
    return run.passed()


# =============================================================================
# check_gluon_loader
# =============================================================================
#: The loader's place in ``hopper_ws.attn_fwd_ws``'s ``gl.warp_specialize`` list (two consumers, then it).
_LOADER_PARTITION = 2
#: The signature the kernel calls the loader with (``hopper_ws._load_partition``'s).
LOADER_SIGNATURE = ("q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, N, "
                    "window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N, CAUSAL, V_T, WINDOW")
#: check_gluon_loader: o's relative RMS error per (batch, head) and lse's absolute error against float64 (the
#: model multiplies bf16 tiles in float32 and rounds P to bf16: about 2e-3 and 1e-6).
GLUON_REL_RMS_LIMIT, GLUON_LSE_LIMIT = 1e-2, 1e-4

MSG_GLUON_NOT_GLUON = (
    "check_gluon_loader expects your loader, a `@gluon.jit` function (the kernel calls it as one of its "
    "partitions), but got {what}: put `@gluon.jit` on the line above `def load_partition(...)` and pass the "
    "function itself."
)
MSG_GLUON_SIGNATURE = (
    "your loader takes {got} arguments; the kernel calls it with the 20 of hopper_ws._load_partition: "
    "({signature}). Keep the scaffold's signature."
)
MSG_GLUON_BORROWED = (
    "your loader is, or calls, `course_utils.kernels.hopper_ws._load_partition`: it is the course's own answer to "
    "this exercise, so it cannot be the answer. Write the ring loop yourself."
)
MSG_GLUON_NOT_CALLED = (
    "the kernel ran {got} loader partitions for {want} programs through your function: the check could not run "
    "your loader in the kernel's place."
)
MSG_GLUON_NOTHING = (
    "your loader issued no K or V copy, so the consumers wait on k_bars[0] for tile 0 for ever. Write the ring "
    "loop: for each step j in range(n_tiles), the slot idx = j % NB and its phase (j // NB) & 1, the wait for the "
    "slot's release, then mbarrier.expect and the TMA copy of K onto k_bars.index(idx) and of V onto "
    "v_bars.index(idx)."
)
MSG_GLUON_PARITY = (
    "your loader waits on {barrier} with parity {got} before step {j} (slot {idx}), which needs parity {want}. "
    "A fresh mbarrier counts as having completed the phase *before* phase 0, of parity 1: on the first pass over "
    "the ring (j < NB) the wait for a free slot must use `phase ^ 1` = 1, which returns at once, and on later "
    "passes `phase ^ 1` waits for the consumers' release of the slot's previous tile. Waiting with `phase` "
    "itself waits for a release of a tile that was never loaded: the loader stops, the consumers wait for its "
    "copy, and every partition waits (the model's Deadlock)."
)
MSG_GLUON_SLOT = (
    "step {j}'s {what} went to slot {got}, but the consumers read step j from slot j % NB = {want} (NB = {nb}, "
    "the ring's size: `k_smem.type.shape[0]`, not a fixed number). The slot index, its empty barrier, its "
    "k_bars / v_bars and the slot written must all be `j % NB`: step {j} was left in a slot the consumers do "
    "not read (they wait for it for ever) or written over one they still read."
)
MSG_GLUON_NO_WAIT = (
    "your loader copied step {j} into slot {idx} without waiting first on empty_bars[{idx}]: the consumers may "
    "still be reading step {prev} in that slot, and the copy overwrites it under them (a race: wrong or NaN "
    "results, or the model's RaceError). Before the expects and copies of every step, wait for the slot's "
    "release: mbarrier.wait(empty_bars.index(idx), phase ^ 1)."
)
MSG_GLUON_RACE = (
    "a copy landed in a slot the consumers were still reading ({how}): the loader must not refill a slot before "
    "both consumers have released it. Wait on the slot's own empty barrier, empty_bars.index(j % NB), with "
    "parity `((j // NB) & 1) ^ 1`, before its expects and copies."
)
MSG_GLUON_BARRIER = (
    "your loader's copy of step {j}'s {what} into {dest} completes on {got}, but the consumers wait for it on "
    "{want}. Each copy signals its own slot's barrier: K on k_bars.index(idx), V on v_bars.index(idx). On another "
    "barrier it lands bytes that barrier's expect did not announce (the model's ExpectError) and leaves the "
    "right one waiting (Deadlock)."
)
MSG_GLUON_EXPECT_MISSING = (
    "your loader's copy into {dest} completes on {barrier}, but no mbarrier.expect on {barrier} announced its "
    "bytes first. A barrier's phase completes when its arrival and the bytes it expects have landed: before each "
    "copy call mbarrier.expect({barrier_code}, {desc}.block_type.nbytes). Without it the copy lands bytes nobody "
    "announced (the model's ExpectError), or the phase completes before the tile is there."
)
MSG_GLUON_EXPECT_BYTES = (
    "your loader announced {got} bytes on {barrier} for a copy of {want} bytes into {dest}: expect the copy's own "
    "size, {desc}.block_type.nbytes (one [{rows}, D] box). Fewer bytes than land is the model's ExpectError; "
    "more never land, and the phase never completes (Deadlock)."
)
MSG_GLUON_KV_ROW = (
    "step {j}'s {what} tile of program {program} was copied from row {got} of the 2-D view [B * H_kv * N, D], "
    "but its kv head's key tile {kv_tile} starts at row {want}: add `kv_row` (from program_coords: the kv head's first "
    "row) to `kv_tile * BLOCK_N`. Without it every head reads batch 0's first kv head."
)
MSG_GLUON_WINDOW_TILE = (
    "under the window, step {j} of program {program} must load key tile {kv_tile} (`window_kv_tile(j, lo, ns)`: the "
    "sink tiles first, then the window's from lo), but its {what} was copied from row {got} (tile {got_tile}); "
    "the row is kv_row + kv_tile * BLOCK_N = {want}."
)
MSG_GLUON_COORDS = (
    "step {j}'s {what} tile of program {program} was copied from [{got}], expected [{want}] (kv_row + kv_tile * "
    "BLOCK_N, 0): the box's coordinates are elements of the 2-D view, row first."
)
MSG_GLUON_Q = (
    "Q's half {half} of program {program} was copied from [{got}] onto {barrier} into {dest}, expected [{want}] "
    "onto q_bars[{half}] into q_smem[{half}] (the scaffold's two copies: keep them as given)."
)
MSG_GLUON_COUNT = (
    "program {program} issued {got} {what} copies for its {want} steps: one K and one V copy per step j in "
    "range(n_tiles) (n_tiles from program_coords, or from window_plan under a window)."
)
MSG_GLUON_DEADLOCK = (
    "the kernel deadlocked in the model: {waits}. A wait that never completes: the loader's wait for a free "
    "slot needs parity `phase ^ 1` (a fresh barrier counts as completed for the phase before 0), and each "
    "consumer waits for step j on k_bars / v_bars[j % NB] until the bytes expected there have landed."
)
MSG_GLUON_WRONG = (
    "o is wrong (no NaN): relative RMS error {err:.3g} for batch {b}, head {h} (allowed: {limit}). The tiles "
    "the consumers read were not the ones they expect: check the copies' coordinates (kv_row + kv_tile * "
    "BLOCK_N) and, under a window, the step's tile from window_kv_tile(j, lo, ns)."
)


@dataclasses.dataclass
class _GluonCase(_AttentionCase):
    num_buffers: int
    window_size: int | None = None
    sink_size: int = 0


def _gluon_cases(rng):
    """Every case covers a ring of more steps than slots, so that a slot is refilled (its empty wait matters)."""
    cases = [
        _GluonCase("GQA (group 2), causal, N = 384, 2 buffers", 1, 2, 1, 384, 64, True, 2),
        _GluonCase("MHA, not causal, N = 512, 3 buffers", 1, 2, 2, 512, 64, False, 3),
        _GluonCase("batch 2, GQA (group 2), causal, N = 384, D = 128, 3 buffers", 2, 4, 2, 384, 128, True, 3),
        _GluonCase("MQA (group 3), causal window 200 with 4 sinks, N = 768, 2 buffers", 1, 3, 1, 768, 64, True, 2,
                   200, 4),
    ]
    group = int(rng.choice([1, 2, 4]))
    hkv, b = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    n, causal, nb = 128 * int(rng.integers(3, 5)), bool(rng.integers(0, 2)), int(rng.choice([2, 3]))
    cases.append(_GluonCase(f"random: B={b}, Hq={hkv * group}, Hkv={hkv}, N={n}, {'causal' if causal else 'not causal'}"
                            f", {nb} buffers", b, hkv * group, hkv, n, 64, causal, nb))
    return cases


def _is_course_loader(obj) -> bool:
    fn = getattr(obj, "fn", obj)
    return (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) == (
        "course_utils.kernels.hopper_ws", "_load_partition")


def _calls_course_loader(jit_fn) -> bool:
    """Whether ``jit_fn`` or a Gluon function it calls by name (the learner's own, at any depth) is the course's
    loader (the copy the learner's process imported counts too).

    Why a scan besides the answer key: in a notebook, ``proof.answer_keys_forbidden`` makes the key refuse when the
    model runs it; in batch grading the learner's loader may reach the copy of ``hopper_ws`` its own notebook
    imported, and the batch grader's guard watches a Triton or Gluon function's launches (``.run``), which the CPU
    model never makes: it runs the function's Python."""
    seen, todo = set(), [jit_fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if _is_course_loader(f):
            return True
        fn = getattr(f, "fn", None)
        if fn is None or str(getattr(fn, "__module__", "")).startswith("course_utils."):
            continue
        codes = [fn.__code__] + [c for c in fn.__code__.co_consts if hasattr(c, "co_names")]
        for name in {n for code in codes for n in code.co_names}:
            value = fn.__globals__.get(name)
            if type(value).__name__ == "GluonJITFunction":
                todo.append(value)
    return False


def _loader_plans(c, hopper_ws):
    """{(program's query block index, (batch, head)): (q_row, kv_row, the key tile of each step)} of a case."""
    plans = {}
    window = c.window_size is not None
    bm, bn = hopper_ws.BLOCK_M, hopper_ws.BLOCK_N
    for pid_m in range(c.N // bm):
        for pid_hz in range(c.B * c.Hq):
            start_m = c.N // bm - 1 - pid_m
            q_row, kv_row, n_tiles = hopper_ws._block_rows.fn(start_m, pid_hz, c.N, c.Hq, c.Hq // c.Hkv, bm, c.causal)
            tiles = list(range(n_tiles))
            if window:
                lo, ns, n_tiles = hopper_ws.window_plan.fn(start_m, c.window_size, c.sink_size, bm, bn)
                tiles = [hopper_ws.window_kv_tile.fn(j, lo, ns) for j in range(n_tiles)]
            plans[(pid_m, pid_hz)] = (q_row, kv_row, tiles)
    return plans


def _slot(name):
    """``"k_smem[2]"`` -> ``("k_smem", 2)``."""
    base, _, rest = name.partition("[")
    return base, int(rest.rstrip("]")) if rest else -1


def _loader_deviation(c, events, plans, finished, bm, bn):
    """The first step where the learner's loader left the ring's protocol, as a message (None: none seen).

    Walks each program's loader operations in the order the loader issued them (the model's trace): the wait
    for a free slot (slot and parity), each copy's slot, barrier, announced bytes and coordinates, the wait
    before every refill, and (``finished``) the number of copies."""
    nb = c.num_buffers
    by_program = {}
    for e in events:
        if e.partition == _LOADER_PARTITION:
            # the kernel's grid is (1, N / BLOCK_M, B * H), one row at a time (hopper_ws._grid_tile): a program's
            # (query block index, (batch, head)) is its second and third index
            by_program.setdefault(e.program[1:], []).append(e)
    q_bytes, kv_bytes = bm // 2 * c.D * 2, bn * c.D * 2
    for program, (q_row, kv_row, tiles) in plans.items():
        n_tiles = len(tiles)
        where = f"({program[0]}, {program[1]})"
        count = {"K": 0, "V": 0}
        announced = collections.Counter()
        waited, filled = {}, {}
        for e in by_program.get(program, []):
            if e.op == "wait" and e.barrier.startswith("empty_bars["):
                j = min(count.values())
                if j < n_tiles:
                    idx = _slot(e.barrier)[1]
                    if idx != j % nb:
                        return MSG_GLUON_SLOT.format(j=j, what="wait for a free slot", got=idx, want=j % nb, nb=nb)
                    want = ((j // nb) & 1) ^ 1
                    if e.value != want:
                        return MSG_GLUON_PARITY.format(barrier=e.barrier, got=e.value, j=j, idx=idx, want=want)
                    waited[idx] = e.value
                continue
            if e.op == "expect":
                announced[e.barrier] += e.value
                base, idx = _slot(e.barrier)
                what = {"k_bars": "K", "v_bars": "V"}.get(base)
                j = count.get(what, -1)
                # a step's first expect into a refilled slot already needs the release: the model may stop
                # (more arrivals than the barrier's count) before the copy that follows it
                if what and j < n_tiles and idx == j % nb and filled.get(idx) != j and j >= nb \
                        and idx not in waited:
                    return MSG_GLUON_NO_WAIT.format(j=j, idx=idx, prev=j - nb)
                continue
            if e.op != "copy":
                continue
            base, idx = _slot(e.destination)
            if base == "q_smem":
                want = (q_row + idx * (bm // 2), 0)
                if tuple(e.coords) != want or e.barrier != f"q_bars[{idx}]":
                    return MSG_GLUON_Q.format(half=idx, program=where, got=", ".join(map(str, e.coords)),
                                              barrier=e.barrier, dest=e.destination, want=f"{want[0]}, 0")
                nbytes, desc = q_bytes, "q_desc"
            elif base in ("k_smem", "v_smem"):
                what = "K" if base == "k_smem" else "V"
                j = count[what]
                count[what] += 1
                if j >= n_tiles:
                    return MSG_GLUON_COUNT.format(program=where, got=f"more than {n_tiles}", what=what,
                                                  want=n_tiles)
                if idx != j % nb:
                    return MSG_GLUON_SLOT.format(j=j, what=f"{what} copy", got=idx, want=j % nb, nb=nb)
                bar = f"{what.lower()}_bars[{idx}]"
                if e.barrier != bar:
                    return MSG_GLUON_BARRIER.format(j=j, what=what, dest=e.destination, got=e.barrier, want=bar)
                if filled.get(idx) != j:  # the step's first copy into the slot: the slot must have been released
                    if j >= nb and idx not in waited:
                        return MSG_GLUON_NO_WAIT.format(j=j, idx=idx, prev=j - nb)
                    waited.pop(idx, None)
                    filled[idx] = j
                kv_tile = tiles[j]
                want = (kv_row + kv_tile * bn, 0)
                if tuple(e.coords) != want:
                    row = e.coords[0]
                    fields = dict(j=j, what=what, program=where, got=row, want=want[0], kv_tile=kv_tile)
                    if e.coords[1] == 0 and row == kv_tile * bn and kv_row:
                        return MSG_GLUON_KV_ROW.format(**fields)
                    if c.window_size is not None and e.coords[1] == 0 and (row - kv_row) % bn == 0:
                        return MSG_GLUON_WINDOW_TILE.format(**fields, got_tile=(row - kv_row) // bn)
                    return MSG_GLUON_COORDS.format(j=j, what=what, program=where,
                                                   got=", ".join(map(str, e.coords)), want=f"{want[0]}, 0")
                nbytes, desc = kv_bytes, f"{what.lower()}_desc"
            else:
                continue
            code = f"{e.barrier.split('[')[0]}.index({_slot(e.barrier)[1]})"
            if announced[e.barrier] == 0:
                return MSG_GLUON_EXPECT_MISSING.format(dest=e.destination, barrier=e.barrier, barrier_code=code,
                                                       desc=desc)
            if announced[e.barrier] != nbytes:
                return MSG_GLUON_EXPECT_BYTES.format(got=announced[e.barrier], barrier=e.barrier, want=nbytes,
                                                     dest=e.destination, desc=desc, rows=nbytes // (2 * c.D))
            announced[e.barrier] = 0
        if finished:
            for what in ("K", "V"):
                if count[what] != n_tiles:
                    return MSG_GLUON_COUNT.format(program=where, got=count[what], what=what, want=n_tiles)
    return None


def _gluon_case_inputs(c, rng):
    import torch

    shapes = ((c.B, c.Hq, c.N, c.D), (c.B, c.Hkv, c.N, c.D), (c.B, c.Hkv, c.N, c.D))
    return [torch.from_numpy(rng.standard_normal(s)).to(torch.bfloat16) for s in shapes]


def _run_gluon_case(run, fn, c, seed):
    from ..kernels import gluon_cpu, hopper_ws

    q, k, v = _gluon_case_inputs(c, run.rng)
    case = f"{c.desc} (the model's landing order: seed {seed})"
    plans = _loader_plans(c, hopper_ws)
    events = []

    def launch(q, k, v):
        return hopper_ws.attention(q, k, v, c.causal, window_size=c.window_size, sink_size=c.sink_size,
                                   num_buffers=c.num_buffers)

    def explain(first):
        deviation = _loader_deviation(c, events, plans, False, hopper_ws.BLOCK_M, hopper_ws.BLOCK_N)
        if not any(e.partition == _LOADER_PARTITION and e.op == "copy" and not e.destination.startswith("q_smem")
                   for e in events):
            deviation = deviation or MSG_GLUON_NOTHING
        return first + (f"\nLikely cause: {deviation}" if deviation else "")

    with gluon_cpu.running(seed=seed, replace={hopper_ws._load_partition: fn}, trace=events) as model, \
            proof.answer_keys_forbidden(hopper_ws._load_partition):
        try:
            o, lse = run.call(launch, q, k, v, case=case)
        except gluon_cpu.Deadlock as exc:
            waits = "; ".join(f"{'the loader' if i == _LOADER_PARTITION else f'consumer {i}'} waits on {name} for "
                              f"parity {p} ({done} phases completed)" for i, name, p, done in exc.waits)
            raise run.fail(explain(MSG_GLUON_DEADLOCK.format(waits=waits or str(exc))), case) from None
        except gluon_cpu.RaceError as exc:
            raise run.fail(explain(MSG_GLUON_RACE.format(how=f"the model's RaceError: {exc}")), case) from None
        except gluon_cpu.ExpectError as exc:
            raise run.fail(explain(f"the model stopped: {exc}."), case) from None
        except RuntimeError as exc:  # the model's other protocol errors; anything else is the learner's own
            if not any(s in str(exc) for s in ("copies still in flight", "more arrivals than", "before mbarrier.init")):
                raise
            raise run.fail(explain(f"the model stopped: {exc}."), case) from None
    calls, programs = model.calls["_load_partition"], len(plans)
    if calls != programs:
        raise run.fail(MSG_GLUON_NOT_CALLED.format(got=calls, want=programs), case)
    deviation = _loader_deviation(c, events, plans, True, hopper_ws.BLOCK_M, hopper_ws.BLOCK_N)
    if deviation:
        raise run.fail(deviation, case)
    got = o.double().numpy()
    want, want_lse = ref.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=c.causal,
                                       window_size=c.window_size, sink_size=c.sink_size)
    if not np.all(np.isfinite(got)):
        raise run.fail(MSG_GLUON_RACE.format(how="NaN in o: a product read a slot before its copy landed, or "
                                                 "after a refill began"), case)
    errors = _rel_rms_per_head(got, want)
    if np.any(errors > GLUON_REL_RMS_LIMIT):
        b, h = np.unravel_index(np.argmax(errors), errors.shape)
        raise run.fail(MSG_GLUON_WRONG.format(err=errors[b, h], b=b, h=h, limit=GLUON_REL_RMS_LIMIT), case)
    lse_error = float(np.max(np.abs(lse.double().numpy() - want_lse)))
    if lse_error > GLUON_LSE_LIMIT:
        raise run.fail(f"lse is off by {lse_error:.3g} (allowed {GLUON_LSE_LIMIT}) while o is right: the "
                       "consumers' softmax saw other tiles than the reference.", case)
    run.max_error = max(run.max_error, float(errors.max()))


def grade_gluon_loader(fn, *, seed=None):
    """Grade ``fn``, a ``@gluon.jit`` loader partition for ``hopper_ws``'s hand warp-specialised forward.

    ``fn`` takes ``hopper_ws._load_partition``'s 20 arguments (``q_desc, k_desc, v_desc, q_smem, k_smem,
    v_smem, q_bars, k_bars, v_bars, empty_bars, N, window_size, sink_size, H, GROUP, BLOCK_M, BLOCK_N, CAUSAL,
    V_T, WINDOW``) and copies Q's two halves, then each step's K and V tile into slot ``j % NB`` of the ring,
    after waiting on the slot's empty barrier with parity ``((j // NB) & 1) ^ 1``, each copy announced by
    ``mbarrier.expect`` of its bytes on the slot's ``k_bars`` / ``v_bars``.

    Gluon has no interpreter, so the check runs the course's whole kernel (its consumers unchanged, your
    function in the loader's place) in :mod:`course_utils.kernels.gluon_cpu`'s model of a Hopper SM, on the CPU
    on every machine (a GPU machine too): threads for the partitions, mbarrier phases, TMA copies landing at
    random moments (each case under two landing orders), shared memory NaN until a copy lands. bf16 inputs:
    GQA/MQA/MHA, causal or not, batch 2, D 64 and 128, 2 and 3 buffers, lesson 08's window with sinks, and a
    random shape. ``o`` is compared with float64 attention (relative RMS error per head at most 1e-2, ``lse``
    within 1e-4), and the loader's own operations with the ring's protocol: a deadlock, a race, a copy on the
    wrong barrier or without its expect, wrong coordinates are each named.
    """
    __tracebackhide__ = True
    if type(fn).__name__ != "GluonJITFunction":
        if hasattr(getattr(fn, "fn", None), "__code__"):
            what = f"the @triton.jit function `{fn.fn.__name__}` (Triton's language, not Gluon's)"
        else:
            require_callable(fn, "check_gluon_loader", "your loader")  # not a function at all: that sentence
            what = f"the plain Python function `{getattr(fn, '__name__', fn)}`"
        raise GradingError(f"check_gluon_loader failed:\n{MSG_GLUON_NOT_GLUON.format(what=what)}")
    if _is_course_loader(fn) or _calls_course_loader(fn):
        raise GradingError(f"check_gluon_loader failed:\n{MSG_GLUON_BORROWED}")
    import inspect

    params = list(inspect.signature(fn.fn).parameters.values())
    if len(params) != 20 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        raise GradingError("check_gluon_loader failed:\n" + MSG_GLUON_SIGNATURE.format(
            got=len(params), signature=LOADER_SIGNATURE))
    run = Run("check_gluon_loader", seed, time_limit_s=60.0)
    for c in _gluon_cases(run.rng):
        for _ in range(2):  # two landing orders of the copies
            _run_gluon_case(run, fn, c, int(run.rng.integers(2**31)))
    return run.passed()
