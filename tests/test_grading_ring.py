"""check_ring_simulation and check_ring_attention: planted mistakes get their diagnosis.

NumPy: a ring simulation written the way lesson 10 teaches it, with one
mistake switched on at a time (written here, independently of the grader's
own re-enactment in ``part6_ring.simulate``); correct answers written
differently (a global position mask per rank, np.logaddexp in the merge)
must pass.

Distributed: a correct forward and one that fails on one rank run in real
processes (spawn, gloo, interpreter); the diagnoses of the distributed check
are tested on what mistaken forwards return, fed to its grading step.
"""

import math

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_utils import distributed as ring
from course_utils import references as ref
from course_utils.grading import GradingError, check_ring_attention, check_ring_simulation
from course_utils.grading import part6_ring as p6
from course_utils.kernels import flash_attention_with_lse


# -----------------------------------------------------------------------------
# NumPy
# -----------------------------------------------------------------------------
def learner_simulation(q_shards, k_shards, v_shards, causal=False, layout="zigzag", *, mistake=None,
                       merge_dtype=np.float64):
    """The lesson's loop: per rank, per step, per pair of chunks; one planted mistake at most.

    ``merge_dtype`` float32 re-enacts a merge done in float32 (as in torch on a GPU or the CPU).
    """
    world = len(q_shards)

    def chunks_of(rank):
        if layout == "contiguous":
            return [rank]
        if mistake == "zigzag_strided":
            return [rank, rank + world]
        if mistake == "zigzag_off_by_one":
            return [rank, 2 * world - 2 - rank]
        return [rank, 2 * world - 1 - rank]

    def merge(o, lse, o_b, lse_b):
        if mistake == "no_shift":
            with np.errstate(all="ignore"):  # inf / inf: what the learner would see
                w, w_b = np.exp(lse.astype(merge_dtype)), np.exp(lse_b.astype(merge_dtype))
                return (o * w[..., None] + o_b * w_b[..., None]) / (w + w_b)[..., None], np.log(w + w_b)
        m = np.maximum(lse, lse_b)
        w, w_b = np.exp(lse - m), np.exp(lse_b - m)
        return (o * w[..., None] + o_b * w_b[..., None]) / (w + w_b)[..., None], m + np.log(w + w_b)

    per = len(chunks_of(0))
    o_shards, lse_shards = [], []
    for rank in range(world):
        q_parts = np.split(q_shards[rank], per, axis=-2)
        o, lse = [None] * per, [None] * per
        for step in range(world):
            src = (rank - step) % world
            k_parts, v_parts = np.split(k_shards[src], per, axis=-2), np.split(v_shards[src], per, axis=-2)
            for i, qc in enumerate(chunks_of(rank)):
                for j, kc in enumerate(chunks_of(src)):
                    diagonal = causal and kc == qc
                    if mistake == "rank_rule" and causal and src != rank:
                        if src > rank:
                            continue
                        diagonal = False
                    elif mistake == "rank_rule" and causal:
                        if j > i:
                            continue
                        diagonal = i == j
                    elif causal and kc > qc:
                        if mistake == "later_full":
                            pass  # attends to the future
                        elif mistake == "later_diagonal":
                            diagonal = True
                        else:
                            continue
                    if mistake == "later_diagonal" and causal:
                        diagonal = True
                    o_b, lse_b = ref.attention_lse(q_parts[i], k_parts[j], v_parts[j], causal=diagonal)
                    o[i], lse[i] = (o_b, lse_b) if o[i] is None else merge(o[i], lse[i], o_b, lse_b)
        o_shards.append(np.concatenate(o, axis=-2))
        lse_shards.append(np.concatenate(lse, axis=-1))
    return o_shards, lse_shards


def masked_per_rank(q_shards, k_shards, v_shards, causal=False, layout="zigzag"):
    """Correct, written differently: each rank's rows against ALL keys with a global position mask."""
    world = len(q_shards)
    n_local = q_shards[0].shape[-2]
    positions = [ring.shard_sequence(np.arange(n_local * world), r, world, layout, dim=0) for r in range(world)]
    o_shards, lse_shards = [], []
    for rank in range(world):
        lse_parts, o_parts = [], []
        for src in range(world):  # the blocks one by one, merged with logaddexp
            k, v = ref.repeat_kv_heads(q_shards[rank], k_shards[src], v_shards[src])
            s = q_shards[rank] @ np.swapaxes(k, -1, -2) / math.sqrt(q_shards[rank].shape[-1])
            if causal:
                s = np.where(positions[src][None, :] <= positions[rank][:, None], s, -np.inf)
            with np.errstate(all="ignore"):
                m = np.max(s, axis=-1, keepdims=True)
                m = np.where(np.isfinite(m), m, 0.0)
                p = np.exp(s - m)
                lse_b = (m + np.log(p.sum(-1, keepdims=True)))[..., 0]
                o_b = (p @ v) / p.sum(-1, keepdims=True)
            o_parts.append(np.nan_to_num(o_b))
            lse_parts.append(lse_b)
        lse = np.logaddexp.reduce(np.stack(lse_parts), axis=0)
        o = sum(np.exp(l - lse)[..., None] * o for o, l in zip(o_parts, lse_parts))
        o_shards.append(o)
        lse_shards.append(lse)
    return o_shards, lse_shards


@pytest.mark.parametrize("fn", [learner_simulation, masked_per_rank], ids=["lesson loop", "global mask"])
def test_correct_simulations_pass(fn):
    assert check_ring_simulation(fn)
    assert check_ring_simulation(fn, seed=7)


# The planted mistakes of the ring, and the message each must get (simulation and distributed check).
RING_MISTAKES = [
    ("no_shift", p6.MSG_NO_SHIFT_RING),
    ("later_full", p6.MSG_LATER_NOT_SKIPPED),
    ("later_diagonal", p6.MSG_LATER_MASKED),
    ("rank_rule", p6.MSG_RANK_RULE),
    ("zigzag_strided", p6.MSG_ZIGZAG_OFF),
    ("zigzag_off_by_one", p6.MSG_ZIGZAG_OFF),
]


@pytest.mark.parametrize("mistake, message", RING_MISTAKES)
def test_planted_simulation_mistakes_are_diagnosed(mistake, message):
    def fn(q, k, v, causal=False, layout="zigzag"):
        return learner_simulation(q, k, v, causal, layout, mistake=mistake)

    with pytest.raises(GradingError) as info:
        check_ring_simulation(fn, seed=3)
    assert f"Likely cause: {message}" in str(info.value)


def test_simulation_answers_of_the_wrong_form_are_named():
    with pytest.raises(GradingError, match="pair"):
        check_ring_simulation(lambda q, k, v, causal=False, layout="zigzag": None)
    with pytest.raises(GradingError, match="one array per rank"):
        check_ring_simulation(lambda q, k, v, causal=False, layout="zigzag": (q[:1], k[:1]))


# -----------------------------------------------------------------------------
# Distributed
# -----------------------------------------------------------------------------
def ring_forward(q, k, v, causal=False, *, layout="zigzag", group=None):
    """A learner's correct forward (module level, so spawned processes can import it)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = ring.chunk_ids(rank, world, layout)
    c = q.shape[2] // len(chunks)
    acc = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:3], -math.inf)
    kv = torch.stack([k, v])
    for step in range(world):
        if step + 1 < world:
            nxt = torch.empty_like(kv)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % world, group),
                                               dist.P2POp(dist.irecv, nxt, (rank - 1) % world, group)])
        src = (rank - step) % world
        for i, qc in enumerate(chunks):
            for j, kc in enumerate(ring.chunk_ids(src, world, layout)):
                if causal and kc > qc:
                    continue
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                o_b, lse_b = flash_attention_with_lse(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                                      causal=causal and kc == qc)
                new = torch.logaddexp(lse[:, :, qs], lse_b)
                acc[:, :, qs] = (acc[:, :, qs] * torch.exp(lse[:, :, qs] - new)[..., None]
                                 + o_b.float() * torch.exp(lse_b - new)[..., None])
                lse[:, :, qs] = new
        if step + 1 < world:
            for request in requests:
                request.wait()
            kv = nxt
    return acc.to(q.dtype), lse


def fails_on_rank_one(q, k, v, causal=False, *, layout="zigzag", group=None):
    if dist.get_rank(group) == 1:
        raise ValueError("planted failure on rank 1")
    return ring_forward(q, k, v, causal, layout=layout, group=group)


@pytest.mark.cpu_processes("gloo processes on the CPU run the kernels in Triton's interpreter")
def test_correct_distributed_forward_passes_in_real_processes():
    assert check_ring_attention(ring_forward)


@pytest.mark.cpu_processes("gloo processes on the CPU run the kernels in Triton's interpreter")
def test_an_error_on_one_rank_is_reported_without_hanging():
    with pytest.raises(GradingError) as info:
        check_ring_attention(fails_on_rank_one, timeout_s=120)
    assert "rank 1 raised" in str(info.value) and "planted failure on rank 1" in str(info.value)


def dies_on_rank_one(q, k, v, causal=False, *, layout="zigzag", group=None):
    if dist.get_rank(group) == 1:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)  # as a far out-of-bounds access in the interpreter would
    return ring_forward(q, k, v, causal, layout=layout, group=group)


@pytest.mark.cpu_processes("gloo processes on the CPU run the kernels in Triton's interpreter")
def test_a_rank_that_dies_is_a_crash_with_a_message_not_an_escaped_exception():
    from course_utils.grading.core import Crashed

    with pytest.raises(Crashed, match=r"crashed the grading process \(SIGSEGV\).*mask=") as info:
        check_ring_attention(dies_on_rank_one, timeout_s=120)
    assert info.value.status == "crashed"


def test_ring_checks_refuse_what_is_not_a_function_with_a_grading_error():
    for check in (check_ring_attention, check_ring_simulation):
        with pytest.raises(GradingError, match="expects a function"):
            check(3)


def _records(seed, cases, mistake, world=2):
    """What each rank would return with a planted mistake: (o, lse) shards from the NumPy learner."""
    per_rank = [[] for _ in range(world)]
    for index, case in enumerate(cases):
        q, k, v, do = p6._dist_inputs(seed, index, case)
        layout, causal = case[1], case[2]
        shards = [[ring.shard_sequence(t, r, world, layout, dim=2) for r in range(world)] for t in (q, k, v)]
        with np.errstate(all="ignore"):
            o, lse = learner_simulation(*shards, causal, layout, mistake=mistake, merge_dtype=np.float32)
        grads = [[ring.shard_sequence(g, r, world, layout, dim=2) for r in range(world)]
                 for g in ref.attention_backward(q, k, v, do, causal=causal)]
        for r in range(world):
            per_rank[r].append(dict(o=o[r].astype(np.float32).astype(np.float64),
                                    lse=lse[r].astype(np.float32).astype(np.float64),
                                    launches=1, grads=[g[r] for g in grads]))
    return per_rank


@pytest.mark.parametrize("mistake, message", RING_MISTAKES)
def test_distributed_diagnoses(mistake, message):
    run = p6.Run("check_ring_attention", seed=11)
    cases = p6._dist_cases(run.rng)
    records = _records(run.seed, cases, mistake)  # no_shift: float32 overflows on the large-score case
    with pytest.raises(GradingError) as info:
        p6._grade_distributed(run, cases, run.seed, records, 2)
    assert f"Likely cause: {message}" in str(info.value)


def test_distributed_grading_passes_right_records_and_needs_a_kernel():
    run = p6.Run("check_ring_attention", seed=5)
    cases = p6._dist_cases(run.rng)
    records = _records(run.seed, cases, None)
    assert p6._grade_distributed(run, cases, run.seed, records, 2)
    for r in records:
        r[0]["launches"] = 0
    with pytest.raises(GradingError, match="no Triton kernel ran"):
        p6._grade_distributed(p6.Run("check_ring_attention", seed=5), cases, 5, records, 2)
