"""Checks for part 4: the FlashAttention-2 backward pass.

- :func:`check_tiled_backward` grades a NumPy tiled backward
  ``fn(q, k, v, o, lse, do, causal=False) -> (dq, dk, dv)``;
- :func:`check_flash_backward` grades a differentiable Triton attention
  ``fn(q, k, v, causal=False) -> o`` (torch ``[B, H, N, D]``, GQA): it runs
  ``o.backward(do)`` with a random ``do`` and compares ``o``, ``dq``, ``dk``
  and ``dv`` with float64 references. It runs in a separate process on the
  CPU (:mod:`~course_utils.grading.isolation`), feeds NaN-padded,
  non-contiguous inputs, and requires that Triton kernels ran during the
  forward AND during the backward: plain ``torch.autograd`` through a math
  implementation does not pass.

Both compare ``dv`` first, then ``dk``, then ``dq``, the order in which the
chain rule produces them, so the first wrong gradient names the first wrong
step. A wrong answer is explained by the first :class:`Diagnosis` whose
mistake it reproduces: each mistake is re-enacted in float64 on the same
inputs by :func:`_variant_grads` (wrong ``D`` term, a missing ``sm_scale`` in
dQ or dK, a GQA group that is not summed, no causal mask in the backward,
``lse`` used in the wrong base) and the answer matches when it is much closer
to that than to the right gradients.
"""

from __future__ import annotations

import math

import numpy as np

from .. import references as ref
from ..environment import current
from . import inputs, proof
from .core import Diagnosis, Run, require_callable
from .mistakes import MSG_NOT_TILED
from .mistakes import MSG_NO_CAUSAL_BACKWARD
from .mistakes import MSG_NO_TRITON_BACKWARD_FLASH
from .mistakes import MSG_NOT_DIFFERENTIABLE_FLASH

__all__ = ["grade_tiled_backward", "grade_flash_backward"]

LOG2E = 1.4426950408889634

# NumPy answers are float64 like the references.
ATOL = 1e-6
RTOL = 1e-5
# Triton answers: fp32 tl.dot is exact in the interpreter but tf32 on a GPU
# (about 2e-3 relative error measured on an H200); fp16 and bf16 round P and
# dS before the matrix products. Every diagnosed mistake is far larger.
TOLERANCE = {"float32": (3e-3, 3e-3), "float16": (2e-2, 2e-2), "bfloat16": (6e-2, 6e-2)}
TOLERANCE_GPU_FP32 = (1e-2, 1e-2)

# One plain sentence (or two) per diagnosis; the tests look for these texts.
MSG_DELTA = (
    "the D term is wrong: dS = P * (dP - D) needs D = rowsum(dO * O), the dot product of each "
    "row of dO with the same row of the forward's output O (not rowsum(dO), not rowsum(dO * V), "
    "and not left out)."
)
MSG_DQ_SCALE = "dQ is missing the softmax scale: dQ = sm_scale * (dS @ K), because S = sm_scale * Q K^T."
MSG_DK_SCALE = "dK is missing the softmax scale: dK = sm_scale * (dS^T @ Q), because S = sm_scale * Q K^T."
MSG_GQA = (
    "a GQA group was not reduced: each kv head's dK and dV hold the contribution of only one of "
    "its query heads (e.g. dK of kv head 0 only holds query head 0's contribution). Sum over all "
    "group_size query heads that share the kv head (q_head // group_size == kv_head)."
)
MSG_GQA_NO_G = (
    "the query heads of a GQA group were not stepped through: each kv head's dK and dV are group_size "
    "times the contribution of its first query head, so the loop over the group reads the same head "
    "every time. The query heads of kv head kv_head are q_head = kv_head * group_size + g for "
    "g = 0 .. group_size - 1 (did you leave out the `+ g`?)."
)
MSG_DQ_TAIL_UNMASKED = (
    "dq holds inf/NaN on rows whose scores are all far below 0, while dk and dv are finite: in the dq "
    "loop the keys past the end of the sequence (the last, partial K/V block) are not masked. They load "
    "as 0, score 0, and P = exp(0 - lse) overflows when lse is very negative. Zero P for offs_n >= N "
    "(tl.where(offs_n[None, :] < N_K, p, 0.0)) in the dq loop too."
)
MSG_DIAGONAL_UNMASKED = (
    "the tiles that cross the diagonal are not masked: skipping the tiles entirely above the "
    "diagonal is not enough; inside a diagonal tile, zero P where key j > query i."
)
MSG_LSE_BASE = (
    "lse is used in the wrong base when P is recomputed: lse is a natural log, so "
    "P = exp(S - lse) = exp2(S * log2(e) - lse * log2(e)). With exp2, multiply BOTH the scaled "
    "scores and lse by log2(e)."
)
MSG_NO_TRITON_FORWARD = (
    "no Triton kernel ran during the forward pass: compute o with your Triton kernels "
    "(e.g. flash_attention_with_lse), not with torch operations."
)


# -----------------------------------------------------------------------------
# What the mistaken code would output
# -----------------------------------------------------------------------------
def _variant_grads(q, k, v, do, causal, mistake=None):
    """``(dq, dk, dv)`` in float64, with one known mistake switched on (or none).

    The probabilities are recomputed from the saved natural-log ``lse`` like a
    FlashAttention backward does, so mistakes in that step (mask, base) have
    the effect they have in a kernel.
    """
    q, k, v, do = (np.asarray(t, dtype=np.float64) for t in (q, k, v, do))
    group_size = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
    o, lse = ref.attention_lse(q, k, v, causal=causal)
    k_rep, v_rep = ref.repeat_kv_heads(q, k, v)
    s = sm_scale * (q @ np.swapaxes(k_rep, -1, -2))
    if mistake == "lse_base2":  # exp2 with log2(e) folded into the scores only
        p = np.exp2(s * LOG2E - lse[..., None])
    elif mistake == "lse_scores_base_e":  # exp2 with log2(e) folded into lse only
        p = np.exp2(s - lse[..., None] * LOG2E)
    else:
        p = np.exp(s - lse[..., None])
    if causal and mistake is not None and mistake.startswith("diagonal_unmasked"):
        # Tiles wholly above the diagonal skipped, the ones crossing it left unmasked.
        block_m, block_n = (int(x) for x in mistake.split("_")[-2:])
        rows = np.arange(q.shape[-2])[:, None] // block_m * block_m + block_m - 1
        visited = np.arange(k.shape[-2])[None, :] // block_n * block_n <= rows
        if visited.all():  # no tile is skipped: the same as no mask at all, diagnosed as that
            return None
        p = np.where(visited, p, 0.0)
    elif causal and mistake != "no_causal_mask":
        p = np.where(ref.causal_mask(q.shape[-2], k.shape[-2]), p, 0.0)
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v_rep, -1, -2)
    if mistake == "delta_rowsum_do":
        delta = do.sum(axis=-1, keepdims=True)
    elif mistake == "delta_rowsum_do_v":
        if v_rep.shape != do.shape:
            return None
        delta = (do * v_rep).sum(axis=-1, keepdims=True)
    elif mistake == "delta_missing":
        delta = 0.0
    else:
        delta = (do * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = (1.0 if mistake == "dq_no_scale" else sm_scale) * (ds @ k_rep)
    dk = (1.0 if mistake == "dk_no_scale" else sm_scale) * (np.swapaxes(ds, -1, -2) @ q)
    if mistake == "gqa_no_g":  # every g reads the group's first query head
        if group_size == 1:
            return None
        shape = dk.shape[:-3] + (dk.shape[-3] // group_size, group_size) + dk.shape[-2:]
        return dq, group_size * dk.reshape(shape)[..., 0, :, :], group_size * dv.reshape(shape)[..., 0, :, :]
    if mistake in ("gqa_first", "gqa_last"):
        if group_size == 1:
            return None
        pick = 0 if mistake == "gqa_first" else group_size - 1
        shape = dk.shape[:-3] + (dk.shape[-3] // group_size, group_size) + dk.shape[-2:]
        return dq, dk.reshape(shape)[..., pick, :, :], dv.reshape(shape)[..., pick, :, :]
    return dq, ref.sum_kv_groups(dk, group_size), ref.sum_kv_groups(dv, group_size)


# Tile shapes tried when looking for unmasked diagonal tiles (block_m, block_n).
_TILES = [(bm, bn) for bm in (4, 8, 16, 32, 64, 128) for bn in (4, 8, 16, 32, 64, 128)]


def _closer_to(wrong, right, rtol):
    """A Diagnosis predicate: the answer reproduces ``wrong`` rather than ``right``.

    Relative Frobenius distances, so the test does not depend on where the
    errors fall: the answer must be within ``rtol`` of the mistaken output and
    at least 4 times closer to it than to the right one.
    """

    def when(actual):
        w = wrong()
        if w is None or w.shape != actual.shape or not np.all(np.isfinite(actual)) or not np.all(np.isfinite(w)):
            return False
        to_wrong = np.linalg.norm(actual - w)
        to_right = np.linalg.norm(actual - right)
        scale = max(np.linalg.norm(w), 1e-30)
        return bool(to_wrong <= rtol * scale and 4.0 * to_wrong < to_right)

    return when


def _diagnoses(q, k, v, do, causal, right, which, rtol):
    """Diagnoses for gradient ``which`` (0: dq, 1: dk, 2: dv), most specific first."""
    cache = {}

    def variant(mistake):
        def compute():
            if mistake not in cache:
                cache[mistake] = _variant_grads(q, k, v, do, causal, mistake)
            out = cache[mistake]
            return None if out is None else out[which]

        return compute

    mistakes = {
        0: [("dq_no_scale", MSG_DQ_SCALE)],
        1: [("dk_no_scale", MSG_DK_SCALE), ("gqa_no_g", MSG_GQA_NO_G), ("gqa_first", MSG_GQA), ("gqa_last", MSG_GQA)],
        2: [("gqa_no_g", MSG_GQA_NO_G), ("gqa_first", MSG_GQA), ("gqa_last", MSG_GQA)],
    }[which]
    if which in (0, 1):
        mistakes += [("delta_rowsum_do", MSG_DELTA), ("delta_rowsum_do_v", MSG_DELTA), ("delta_missing", MSG_DELTA)]
    if causal:
        mistakes.append(("no_causal_mask", MSG_NO_CAUSAL_BACKWARD))
        mistakes += [(f"diagonal_unmasked_{bm}_{bn}", MSG_DIAGONAL_UNMASKED) for bm, bn in _TILES]
    mistakes += [("lse_base2", MSG_LSE_BASE), ("lse_scores_base_e", MSG_LSE_BASE)]
    return [Diagnosis(message, when=_closer_to(variant(m), right, max(rtol, 1e-4))) for m, message in mistakes]


def _tail_diagnosis(which, grads, shifted):
    """dq non-finite on the shifted case while dk, dv are finite: the dq loop's key tail is unmasked."""
    if which != 0 or not shifted:
        return []
    dk_dv_finite = all(bool(g.detach().isfinite().all()) for g in grads[1:])
    return [Diagnosis(MSG_DQ_TAIL_UNMASKED, when=lambda a: dk_dv_finite and not np.isfinite(a).all())]


def _as_triple(run, out, case):
    __tracebackhide__ = True
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise run.fail(
            f"your function returned {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
            + "; return the three gradients as a tuple (dq, dk, dv).",
            case,
        )
    return out


# -----------------------------------------------------------------------------
# check_tiled_backward (NumPy)
# -----------------------------------------------------------------------------
def _tiled_cases(rng):
    """(name, batch shape, Nq, Nk, d, causal): fixed ones first, then fresh random ones."""
    cases = [
        ("fixed: one head, N=8, d=4", (), 8, 8, 4, False),
        ("fixed: causal, 2 heads, N=13, d=8", (2,), 13, 13, 8, True),
        ("fixed: batch 2 x 3 heads, N=40, d=16", (2, 3), 40, 40, 16, False),
        ("fixed: causal, Nq=24 < Nk=37, d=8", (2,), 24, 37, 8, True),
        ("fixed: causal, one head, N=150, d=8 (longer than any tile)", (), 150, 150, 8, True),
    ]
    for i in range(3):
        n_q = int(rng.integers(5, 70))
        n_k = n_q if rng.random() < 0.7 else int(rng.integers(5, 70))
        batch = tuple(int(x) for x in rng.integers(1, 4, size=int(rng.integers(0, 3))))
        d = int(rng.choice([4, 8, 16, 32]))
        causal = bool(rng.random() < 0.5)
        cases.append((f"random #{i + 1}: batch {batch}, Nq={n_q}, Nk={n_k}, d={d}, causal={causal}", batch, n_q, n_k, d, causal))
    return cases


def _learner_blocks(fn) -> tuple[int, int]:
    """The tile the learner's function uses: its ``block_m``/``block_n`` defaults, else at most 128."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    sizes = []
    for name in ("block_m", "block_n"):
        default = params[name].default if name in params else None
        sizes.append(default if isinstance(default, int) and default > 0 else 128)
    return sizes[0], sizes[1]


def grade_tiled_backward(fn, *, seed=None):
    """Grade ``fn(q, k, v, o, lse, do, causal=False) -> (dq, dk, dv)`` (NumPy, float64).

    ``q [..., Nq, d]``, ``k``/``v [..., Nk, d]``, ``o``/``do [..., Nq, d]``
    and the natural-log ``lse [..., Nq]`` that the forward saved. Fixed
    cases, then fresh random ones (N not a multiple of anything, batch axes,
    ``Nq != Nk``, causal or not). The computation must be tiled: a score product
    (q with k, do with v) larger than one tile fails, the tile being the
    function's ``block_m``/``block_n`` defaults, or 128 x 128 without them;
    calling :mod:`course_utils.references` fails too.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_tiled_backward")
    run = Run("check_tiled_backward", seed)
    for name, batch, n_q, n_k, d, causal in _tiled_cases(run.rng):
        q = run.rng.standard_normal(batch + (n_q, d))
        k = run.rng.standard_normal(batch + (n_k, d))
        v = run.rng.standard_normal(batch + (n_k, d))
        do = run.rng.standard_normal(batch + (n_q, d))
        o, lse = ref.attention_lse(q, k, v, causal=causal)
        right = ref.attention_backward(q, k, v, do, causal=causal)
        # Watched copies: in-place edits cannot touch ours, and a product bigger than a tile is seen.
        bm, bn = _learner_blocks(fn)
        log = inputs.tile_log(math.prod(np.broadcast_shapes(q.shape[:-2], k.shape[:-2])), bm, bn, MSG_NOT_TILED)
        args = inputs.watch({"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}, log)
        with proof.references_forbidden(), inputs.watching(log):
            out = run.call(fn, *args.values(), causal=causal, case=name)
        if out is None:
            raise run.fail("your function returned None: did you forget a `return`? Return (dq, dk, dv).", name)
        out = [inputs.plain(a) for a in _as_triple(run, out, name)]
        for which, label, shape in ((2, "dv", v.shape), (1, "dk", k.shape), (0, "dq", q.shape)):
            got = run.array(out[which], expected_shape=shape, case=name, name=f"{label} (item {which} of your tuple)")
            run.compare(got, right[which], case=name, what=label, atol=ATOL, rtol=RTOL,
                        diagnoses=_diagnoses(q, k, v, do, causal, right[which], which, 1e-4))
        if log["untiled"]:
            raise run.fail(log["untiled"], name)
    return run.passed()


# -----------------------------------------------------------------------------
# check_flash_backward (Triton, through torch.autograd)
# -----------------------------------------------------------------------------
def _flash_cases(rng, device):
    """(name, B, n_q_heads, n_kv_heads, N, D, causal, dtype name, shifted scores)."""
    # Scores near +-150 need exact products: float32 in the interpreter, the GPU's half precision
    # there (float32 would use tf32, whose rounding of q and k shows at that size).
    big = "float32" if device == "cpu" else ("bfloat16" if current().bf16_ok else "float16")
    cases = [
        ("fixed: MHA, 2 heads, N=64, D=16", 1, 2, 2, 64, 16, False, "float32", False),
        ("fixed: causal GQA 4 q heads / 2 kv heads, N=80, D=32", 1, 4, 2, 80, 32, True, "float32", False),
        ("fixed: causal MQA 3 q heads / 1 kv head, N=37, D=16, fp16", 2, 3, 1, 37, 16, True, "float16", False),
        (f"fixed: GQA 2 q heads / 1 kv head, N=150, D=64, {big}, not causal, rows whose scores are all near "
         "-150, -60, 0, +60 or +150", 1, 2, 1, 150, 64, False, big, True),
        ("fixed: MHA, 1 head, N=140, D=128, not causal", 1, 1, 1, 140, 128, False, "float32", False),
        ("fixed: MHA, 2 heads, N=64, D=16 again, new values", 1, 2, 2, 64, 16, False, "float32", False),
    ]
    for i in range(2):
        n_kv = int(rng.integers(1, 3))
        group = int(rng.integers(1, 4))
        n = int(rng.integers(17, 97))
        if n % 16 == 0:
            n += 1  # never a multiple of the block sizes
        d = int(rng.choice([16, 32]))
        causal = bool(rng.random() < 0.6)
        dtype = "float16" if rng.random() < 0.4 else "float32"
        cases.append((f"random #{i + 1}: {n_kv * group} q heads / {n_kv} kv heads, N={n}, D={d}, causal={causal}, {dtype}",
                      1, n_kv * group, n_kv, n, d, causal, dtype, False))
    if device == "cuda" and current().bf16_ok:
        cases.append(("fixed: causal GQA, N=200, D=64, bf16", 2, 4, 2, 200, 64, True, "bfloat16", False))
    return cases


def _group_sum_roundoff(q64, k64, v64, do64, causal, roundoff: float) -> dict:
    """``{1: dk's, 2: dv's}`` extra tolerance for GQA/MQA (empty for MHA): a right answer may store each query head's
    dK and dV in the input dtype and then add the group's heads up (flash-attn 2's GQA backward does), and each of
    those stores may move a head's part by ``roundoff`` (the dtype's unit roundoff, ``torch.finfo(dtype).eps / 2``)
    of it. Where the parts are large and cancel, that is more than a tolerance relative to their sum allows, so
    each element may differ by the roundoff of the sum of its parts' magnitudes (float64, from the reference's
    backward with each kv head repeated for its group)."""
    group = q64.shape[1] // k64.shape[1]
    if group == 1:
        return {}
    _, dk_rep, dv_rep = ref.attention_backward(q64, *ref.repeat_kv_heads(q64, k64, v64), do64, causal=causal)
    shape = (k64.shape[0], k64.shape[1], group) + k64.shape[2:]
    return {which: roundoff * np.abs(parts).reshape(shape).sum(axis=2)
            for which, parts in ((1, dk_rep), (2, dv_rep))}


def grade_flash_backward(fn, *, seed=None):
    """Grade ``fn(q, k, v, causal=False) -> o``, differentiable, with Triton in both passes.

    ``q [B, Hq, N, D]``, ``k``/``v [B, Hkv, N, D]`` (``Hq`` a multiple of
    ``Hkv``: MHA, GQA and MQA). For each case the check calls ``fn``, then
    ``torch.autograd.grad(o, (q, k, v), do)`` with a random ``do``, and
    compares ``o``, ``dv``, ``dk``, ``dq`` with float64 references. Inputs
    are NaN-padded views with unusual strides; N is never a multiple of 16;
    fp32 and fp16 on the CPU (plus bf16 on a GPU that has it); causal or not;
    fresh random cases on every call. On the CPU it runs in a separate
    process (``isolate=``, ``timeout_s=`` as for every Triton check).
    """
    __tracebackhide__ = True
    import torch

    require_callable(fn, "check_flash_backward")
    env = current()
    run = Run("check_flash_backward", seed, time_limit_s=30.0)
    for name, B, n_q_heads, n_kv_heads, N, D, causal, dtype_name, shifted in _flash_cases(run.rng, env.device):
        dtype = getattr(torch, dtype_name)
        atol, rtol = TOLERANCE_GPU_FP32 if (dtype_name == "float32" and env.device == "cuda") else TOLERANCE[dtype_name]
        # Draw in float64, round to the test dtype, and use the ROUNDED values
        # in the references: only the kernel's own arithmetic is graded.
        raw = [run.rng.standard_normal((B, h, N, D)) for h in (n_q_heads, n_kv_heads, n_kv_heads, n_q_heads)]
        if shifted:  # row i's scores near inputs.SHIFTS[i % 5] (beyond float32's exp range: +-150)
            inputs.shift_scores(raw[0], raw[1])
        q64, k64, v64, do64 = (torch.from_numpy(a).to(dtype).double().numpy() for a in raw)
        q, k, v = (inputs.nan_padded_leaf(torch.from_numpy(a).to(dtype).to(env.device), transpose_heads=(i == 1))
                   for i, a in enumerate((q64, k64, v64)))
        do = inputs.nan_padded(torch.from_numpy(do64).to(dtype).to(env.device), transpose_heads=True)

        before = inputs.snapshot(q=q, k=k, v=v, do=do)
        # The forward may use the course's forward kernel (lesson 07 does); the backward must be the learner's.
        with proof.Work(inputs=(q, k, v, do), course_kernels_ok=True) as forward_work:
            o = run.call(fn, q, k, v, causal=causal, case=name)
        if o is None:
            raise run.fail("your function returned None: did you forget a `return`? Return o "
                           "(YourFunction.apply(q, k, v, causal)).", name)
        if not isinstance(o, torch.Tensor):
            raise run.fail(f"your function returned a {type(o).__name__}; return the output tensor o.", name)
        problem = forward_work.problem(no_kernel=MSG_NO_TRITON_FORWARD, o=o)
        if problem:
            raise run.fail(problem, name)
        o_right, _ = ref.attention_lse(q64, k64, v64, causal=causal)
        got_o = run.array(o, expected_shape=o_right.shape, case=name, name="o")
        run.compare(got_o, o_right, case=name, what="the forward output o", atol=atol, rtol=rtol,
                    axes=("b", "q_head", "i", "d"))
        if o.grad_fn is None:
            raise run.fail(MSG_NOT_DIFFERENTIABLE_FLASH, name)

        with proof.Work(inputs=(q, k, v, do, o)) as backward_work:
            grads = run.call(torch.autograd.grad, o, (q, k, v), do, allow_unused=True, case=name + " (backward)")
        run.cases -= 1  # the forward and the backward of one case count once
        for which, label in ((0, "dq"), (1, "dk"), (2, "dv")):
            if grads[which] is None:
                raise run.fail(f"{label} is None: your backward must return a gradient for {label[1:]} "
                               "(in the order of forward's inputs).", name)
        problem = backward_work.problem(no_kernel=MSG_NO_TRITON_BACKWARD_FLASH, dq=grads[0], dk=grads[1], dv=grads[2])
        if problem:
            raise run.fail(problem + " (in the backward pass: the gradients must come from your backward "
                           "kernels, not from torch or course_utils.kernels)", name)
        changed = inputs.changed_input(before, q=q, k=k, v=v, do=do)
        if changed:
            raise run.fail(changed, name)
        right = ref.attention_backward(q64, k64, v64, do64, causal=causal)
        extra = _group_sum_roundoff(q64, k64, v64, do64, causal, torch.finfo(dtype).eps / 2)
        for which, label, shape in ((2, "dv", v.shape), (1, "dk", k.shape), (0, "dq", q.shape)):
            got = run.array(grads[which], expected_shape=tuple(shape), case=name, name=label)
            run.compare(got, right[which], case=name, what=label, atol=atol, rtol=rtol, extra_tol=extra.get(which, 0.0),
                        axes=("b", "kv_head" if which else "q_head", "i" if which == 0 else "j", "d"),
                        diagnoses=_tail_diagnosis(which, grads, shifted) + _diagnoses(q64, k64, v64, do64, causal, right[which], which, rtol))
    return run.passed()

