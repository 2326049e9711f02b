"""Checks for lesson 10: ring (context-parallel) attention.

- :func:`check_ring_simulation` grades a NumPy simulation of the ring
  ``fn(q_shards, k_shards, v_shards, causal=False, layout="zigzag") ->
  (o_shards, lse_shards)``: lists with one ``[..., N/world, d]`` array per
  rank, cut by :func:`course_utils.distributed.shard_sequence`. Compared
  rank by rank with float64 attention over the whole sequence, sharded the
  same way.
- :func:`check_ring_attention` grades one rank's forward
  ``fn(q, k, v, causal=False, *, layout="zigzag", group=None) -> (o, lse)``,
  run on 3 processes with ``torch.distributed`` (gloo, Triton's interpreter
  on the CPU; with 2, rank + 1 and rank - 1 would be one rank and a ring
  turning the wrong way would pass): the output and lse against float64
  attention, proof that a Triton kernel ran (the course's
  ``flash_attention_with_lse`` is allowed, torch's attention and the course's
  ring forward are not) and that the K/V travelled by point-to-point messages
  only (no all-gather, broadcast or all-reduce), and the gradients obtained
  when the course's ring backward
  (:func:`course_utils.distributed.ring_attention_backward`) runs from what
  ``fn`` returned.
- :func:`check_overlap_shard_length` grades a formula
  ``fn(flops_per_s, bytes_per_s, n_q_heads, n_kv_heads, head_dim, dtype_bytes, causal) -> int``:
  the shortest shard (tokens per rank) at which one ring step's attention takes longer than
  sending the next K/V shard, so that the transfer hides behind the compute. Pure Python, no processes.

A wrong answer is explained by the first known mistake it reproduces, each
re-enacted in float64 by :func:`simulate` on the same inputs: a merge
without the max shift (overflows on large scores), blocks from later ranks
not skipped (or masked like a diagonal block), a rank-by-rank causal rule in
the zigzag layout, a zigzag chunk mapping that is off, and K/V that travel
round the ring the opposite way to the causal plan (3 ranks or more).
The simulation must be a ring too: no attention against more keys than one
shard, no concatenation of several ranks' K or V shards.
"""

from __future__ import annotations

import contextlib
import numbers
import signal
import types

import numpy as np

from .. import references as ref
from . import inputs, proof
from .core import Crashed, Diagnosis, Forbidden, GradingError, Run, TimedOut, require_callable
from .outcome import crash_message
from .mistakes import MSG_NO_SHIFT_RING
from .mistakes import MSG_NO_TRITON_RING
# course_utils.distributed (torch) is imported where it is used (see .exercises).

__all__ = ["grade_ring_simulation", "grade_ring_attention", "grade_overlap_shard_length", "simulate"]

ATOL, RTOL = 1e-8, 1e-6  # NumPy answers (float64)
TORCH_TOL = {"float32": (2e-4, 2e-4), "float16": (2e-2, 2e-2)}  # interpreter, fp32 tl.dot exact

MSG_LATER_NOT_SKIPPED = (
    "with causal=True, blocks of keys that come AFTER the queries (from later chunks of the sequence) "
    "were attended to: a query chunk must skip every key chunk with a larger global index."
)
MSG_LATER_MASKED = (
    "the causal mask was applied to every block as if it were on the diagonal: only a query chunk "
    "against the SAME chunk needs the triangular mask; earlier key chunks are seen in full and later "
    "ones skipped."
)
MSG_RANK_RULE = (
    "the causal treatment was decided by comparing ranks (earlier rank: full, later rank: skip), which "
    "is only right for the contiguous layout. In the zigzag layout each rank holds an early AND a late "
    "chunk: decide full / diagonal / skip for each pair of chunks from their global chunk indices "
    "(the same outputs come from a zigzag mapping that gives rank r chunks 2r and 2r+1)."
)
MSG_ZIGZAG_OFF = (
    "the zigzag chunk mapping is off: with world_size ranks the sequence has 2*world_size chunks and "
    "rank r holds chunks r and 2*world_size - 1 - r (first and last for rank 0). The causal decisions "
    "used other chunk indices."
)

MSG_WRONG_DIRECTION = (
    "the K/V blocks and the causal plan go round the ring in opposite directions: at step s a rank held "
    "the block of rank (rank + s) % world_size but decided full / diagonal / skip for rank "
    "(rank - s) % world_size's (or the reverse), so blocks met the wrong queries: the K/V were sent to "
    "rank - 1 and received from rank + 1 while src = (rank - step) % world_size, or sent the right way "
    "while src = (rank + step) % world_size. (With 2 ranks rank + 1 and rank - 1 are the same rank, "
    "which hides it.) Send to (rank + 1) % world_size, receive from (rank - 1) % world_size, and at step s "
    "use src = (rank - s) % world_size."
)
MSG_NO_RING_STEPS = (
    "{what}: that is no ring. In ring attention each rank only ever holds one K/V shard at a time "
    "({n} rows here): its own at step 0, then at step s the shard of rank (rank - s) % world_size, passed "
    "on from rank - 1. Loop over the world_size steps, compute your queries' attention against the shard "
    "held at that step (references.attention_lse on its chunks is fine) and merge the partial results "
    "by their lse."
)
MSG_NOT_A_RING = (
    "your function called {what} on rank {rank}: the exercise is a ring, in which the K/V shards "
    "travel from rank to rank by point-to-point messages only (dist.P2POp(dist.isend / dist.irecv, "
    "...) and dist.batch_isend_irecv, or dist.send / dist.recv): each rank sends its block to rank + 1 "
    "and receives the next from rank - 1, and never holds more than two blocks. Gathering every "
    "block (all_gather), broadcasting or reducing them is another algorithm, which needs all of K/V "
    "on every GPU."
)
MSG_NOT_IMPLEMENTED_RING = (
    "your function still raises NotImplementedError on rank {rank} ({where}): a `# YOUR CODE HERE` "
    "block of the stub is not filled in yet. Replace each `raise NotImplementedError()` with your code: "
    "the running (acc, lse) before the loop, whose K/V the rank holds at each step, the causal plan of "
    "each pair of chunks, and merge_."
)
MSG_TORCH_ATTENTION_RING = (
    "while your function ran on rank {rank}, torch computed {what} ({op}). Compute each block's attention "
    "with a Triton kernel (flash_attention_with_lse, or your own), and use torch only for the merge "
    "(torch.logaddexp, torch.exp) and the messages."
)


# -----------------------------------------------------------------------------
# The ring in float64, right and with each known mistake
# -----------------------------------------------------------------------------
def _merge(o, lse, o_b, lse_b, shift=True):
    if o is None:
        return o_b, lse_b
    with np.errstate(all="ignore"):
        if shift:
            m = np.maximum(lse, lse_b)
            w, w_b = np.exp(lse - m), np.exp(lse_b - m)
            total = w + w_b
            return (o * w[..., None] + o_b * w_b[..., None]) / total[..., None], m + np.log(total)
        w, w_b = np.exp(lse), np.exp(lse_b)
        total = w + w_b
        return (o * w[..., None] + o_b * w_b[..., None]) / total[..., None], np.log(total)


def simulate(q_shards, k_shards, v_shards, causal=False, layout="zigzag", mistake=None):
    """The ring in float64: ``(o_shards, lse_shards)``; ``mistake`` re-enacts a known error.

    ``mistake``: None (right), ``"no_shift"``, ``"later_full"``,
    ``"later_diagonal"``, ``"rank_rule"``, ``"zigzag_pairs"`` (rank r holds
    chunks 2r, 2r+1), ``"zigzag_strided"`` (r and r + world) or
    ``"zigzag_off_by_one"`` (r and 2*world - 2 - r), ``"wrong_direction"`` (at step s rank r holds
    the K/V of rank (r + s) % world, received from r + 1, while its causal plan is the one for rank
    (r - s) % world: the blocks meet the wrong queries; with 2 ranks the two are the same rank).
    """
    from .. import distributed as ring
    world = len(q_shards)
    per = ring.n_chunks(world, layout) // world

    def chunks(r):
        if layout == "zigzag" and mistake == "zigzag_pairs":
            return [2 * r, 2 * r + 1]
        if layout == "zigzag" and mistake == "zigzag_strided":
            return [r, r + world]
        if layout == "zigzag" and mistake == "zigzag_off_by_one":
            return [r, 2 * world - 2 - r]
        return ring.chunk_ids(r, world, layout)

    def relation(r, src, i, j):
        qc, kc = chunks(r)[i], chunks(src)[j]
        if mistake == "rank_rule" and causal:
            if src != r:
                return "full" if src < r else "skip"
            qc, kc = i, j  # its own shard: positions in the shard
        kind = ring.block_relation(qc, kc, causal)
        if kind == "skip" and mistake == "later_full":
            return "full"
        if kind in ("skip", "full") and mistake == "later_diagonal" and causal:
            return "diagonal"
        return kind

    o_shards, lse_shards = [], []
    for r in range(world):
        q_parts = np.split(np.asarray(q_shards[r], dtype=np.float64), per, axis=-2)
        o, lse = [None] * per, [None] * per
        for step in range(world):
            src = (r - step) % world
            held = (r + step) % world if mistake == "wrong_direction" else src
            k_parts = np.split(np.asarray(k_shards[held], dtype=np.float64), per, axis=-2)
            v_parts = np.split(np.asarray(v_shards[held], dtype=np.float64), per, axis=-2)
            for i in range(per):
                for j in range(per):
                    kind = relation(r, src, i, j)
                    if kind == "skip":
                        continue
                    o_b, lse_b = ref.attention_lse(q_parts[i], k_parts[j], v_parts[j], causal=kind == "diagonal")
                    o[i], lse[i] = _merge(o[i], lse[i], o_b, lse_b, shift=mistake != "no_shift")
        for i in range(per):
            if o[i] is None:  # a (wrong) plan that never computed these rows
                o[i] = np.zeros(q_parts[i].shape[:-1] + (v_shards[0].shape[-1],))
                lse[i] = np.full(q_parts[i].shape[:-1], -np.inf)
        o_shards.append(np.concatenate(o, axis=-2))
        lse_shards.append(np.concatenate(lse, axis=-1))
    return o_shards, lse_shards


_MISTAKES = (
    ("later_full", MSG_LATER_NOT_SKIPPED),
    ("later_diagonal", MSG_LATER_MASKED),
    ("rank_rule", MSG_RANK_RULE),
    ("zigzag_strided", MSG_ZIGZAG_OFF),
    ("zigzag_off_by_one", MSG_ZIGZAG_OFF),
    ("wrong_direction", MSG_WRONG_DIRECTION),
)


def _diagnoses(shards, causal, layout, which, unshard=False, atol=None, rtol=None):
    """Diagnoses for output ``which`` (0: o, 1: lse); ``unshard`` for answers compared as a whole sequence."""
    from .. import distributed as ring

    def variant(mistake):
        def compute():
            out = simulate(*shards, causal=causal, layout=layout, mistake=mistake)[which]
            if unshard:
                return ring.unshard_sequence(out, len(out), layout, dim=-1 if which else -2)
            return np.stack(out)

        return compute

    found = [Diagnosis(MSG_NO_SHIFT_RING, when=lambda a: not np.all(np.isfinite(a)))]
    for mistake, message in _MISTAKES:
        if not causal and mistake != "no_shift":
            continue
        if layout == "contiguous" and mistake.startswith(("zigzag", "rank_rule")):
            continue
        if mistake == "wrong_direction" and len(shards[0]) < 3:  # with 2 ranks, rank + 1 is rank - 1
            continue
        found.append(Diagnosis(message, expected=variant(mistake), atol=atol, rtol=rtol))
    return found


# -----------------------------------------------------------------------------
# The NumPy simulation
# -----------------------------------------------------------------------------
def _sim_cases(rng):
    """(name, world, layout, causal, batch, n_q_heads, n_kv_heads, N, d, magnitude)."""
    from .. import distributed as ring
    cases = [
        ("fixed: contiguous, 2 ranks, not causal, N=16, d=8", 2, "contiguous", False, (), 0, 0, 16, 8, 1.0),
        ("fixed: contiguous, 4 ranks, causal, 2 heads, N=32, d=8", 4, "contiguous", True, (), 2, 2, 32, 8, 1.0),
        ("fixed: zigzag, 2 ranks, causal, GQA 4 q heads / 2 kv heads, N=24, d=8", 2, "zigzag", True, (), 4, 2, 24, 8, 1.0),
        ("fixed: zigzag, 3 ranks, causal, batch 2, N=36, d=4", 3, "zigzag", True, (2,), 0, 0, 36, 4, 1.0),
        ("fixed: zigzag, 2 ranks, not causal, N=16, d=8", 2, "zigzag", False, (), 0, 0, 16, 8, 1.0),
        ("fixed: zigzag, 2 ranks, causal, LARGE scores (lse near 1000), N=16, d=8", 2, "zigzag", True, (), 0, 0, 16, 8, 25.0),
    ]
    for index in range(3):
        world = int(rng.integers(2, 5))
        layout = str(rng.choice(ring.LAYOUTS))
        causal = bool(rng.random() < 0.7)
        n_kv = int(rng.integers(1, 3))
        n_q = n_kv * int(rng.integers(1, 3))
        n = ring.n_chunks(world, layout) * int(rng.integers(1, 5))
        d = int(rng.choice([4, 8, 16]))
        cases.append((f"random #{index + 1}: {layout}, {world} ranks, causal={causal}, {n_q} q heads / {n_kv} kv "
                      f"heads, N={n}, d={d}", world, layout, causal, (), n_q, n_kv, n, d, 1.0))
    return cases


def _draw(rng, batch, n_q_heads, n_kv_heads, n, d, magnitude):
    q_shape = batch + ((n_q_heads,) if n_q_heads else ()) + (n, d)
    k_shape = batch + ((n_kv_heads,) if n_kv_heads else ()) + (n, d)
    return (magnitude * rng.standard_normal(q_shape), magnitude * rng.standard_normal(k_shape),
            rng.standard_normal(k_shape))


def _as_list(run, out, world, name, case):
    if not isinstance(out, (list, tuple)) or len(out) != world:
        raise run.fail(f"{name} must be a list with one array per rank ({world}); got "
                       f"{type(out).__name__}{'' if not hasattr(out, '__len__') else f' of length {len(out)}'}.", case)
    return out


# What the simulation may not do: see the whole sequence's K/V at once.
class _Shard(inputs.Watched):
    """The shards handed to the simulation, and everything computed from them.

    Slices, copies, element-wise results, what NumPy's functions return (``np.where``, ``np.split``,
    ...) and ``np.asarray`` of them stay ``_Shard``, so every ``np.concatenate`` of them passes through
    :func:`_note_join` (``np.vstack``, ``np.block``, ``np.append`` and the course's
    ``unshard_sequence`` call it too), which refuses K (or V) rows of two or more ranks' shards
    joined along the sequence: the whole sequence's keys in one array is what a ring never has.
    """

    def view(self, *args, **kwargs):
        return _as_shard(super().view(*args, **kwargs))

    def __array_ufunc__(self, ufunc, method, *args, **kwargs):
        return _as_shard(super().__array_ufunc__(ufunc, method, *args, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        log = self._log
        if log is not None and log["active"] and func is np.concatenate and args:
            arrays = args[0] if isinstance(args[0], (list, tuple)) else ()
            _note_join(log, arrays, kwargs.get("axis", args[1] if len(args) > 1 else 0))
        return _kept(super().__array_function__(func, types, args, kwargs), log)


def _kept(result, log):
    """``result`` as :class:`_Shard` (lists and tuples of arrays too): NumPy hands some back plain."""
    if isinstance(result, (list, tuple)):
        return type(result)(_kept(r, log) for r in result)
    if log is not None and type(result) in (np.ndarray, inputs.Watched):
        out = np.ndarray.view(result, _Shard)
        out._log, out._tags = log, getattr(result, "_tags", frozenset())
        return out
    return result


def _as_shard(x):
    if type(x) is inputs.Watched:
        out = np.ndarray.view(x, _Shard)
        out._log, out._tags = x._log, x._tags
        return out
    return x


def _ranks_holding(a, shards) -> set:
    """The ranks whose shard (``[..., n, d]``) holds ``a``'s rows, a block of consecutive rows, unchanged."""
    a = inputs.plain(a)
    found = set()
    if not isinstance(a, np.ndarray) or a.ndim < 2 or a.shape[-2] == 0:
        return found
    m = a.shape[-2]
    for rank, shard in enumerate(shards):
        if shard.shape[:-2] != a.shape[:-2] or shard.shape[-1] != a.shape[-1] or m > shard.shape[-2]:
            continue
        if any(np.array_equal(shard[..., i:i + m, :], a) for i in range(shard.shape[-2] - m + 1)):
            found.add(rank)
    return found


def _note_join(log, arrays, axis):
    """Refuse a concatenation along the sequence axis of K (or V) rows from two or more ranks' shards."""
    arrays = [a for a in arrays if isinstance(a, np.ndarray) and a.ndim >= 2]
    if len(arrays) < 2 or axis is None or any(axis % a.ndim != a.ndim - 2 for a in arrays):
        return
    for name in ("K", "V"):
        ranks = set()
        for a in arrays:
            ranks |= _ranks_holding(a, log[name])
        if len(ranks) >= 2:
            listed = ", ".join(str(r) for r in sorted(ranks))
            raise Forbidden(MSG_NO_RING_STEPS.format(
                what=f"your function joined the {name} shards of ranks {listed} into one array along the "
                     "sequence (np.concatenate, np.vstack, ...)", n=log["n_local"]))


_LIMITED: dict = {}  # qualified name -> (the original function, the log)


def _limited_call(name, args, kwargs):
    original, log = _LIMITED[name]
    k = args[1] if len(args) > 1 else kwargs.get("k")
    n_keys = np.shape(k)[-2] if np.ndim(k) >= 2 else 0
    if log["active"] and n_keys > log["n_local"]:
        raise Forbidden(MSG_NO_RING_STEPS.format(
            what=f"your function called {name.rsplit('.', 1)[-1]} with {n_keys} keys, more than one rank's "
                 f"shard", n=log["n_local"]))
    return original(*args, **kwargs)


def _limited_trampoline(*args, **kwargs):
    return __import__("course_utils.grading.part6_ring", fromlist=["_limited_call"])._limited_call(
        __import__("sys")._getframe().f_code.co_name, args, kwargs)


@contextlib.contextmanager
def _one_shard_of_keys(log):
    """While active, :mod:`course_utils.references`' attention refuses more keys than ``log["n_local"]``.

    The functions' code is swapped (as :func:`.proof.answer_keys_forbidden` does), so a name the
    learner imported earlier is watched too; the originals answer every call that fits one shard.
    """
    saved = {}
    for fn in (ref.attention_lse, ref.attention):
        name = f"{fn.__module__}.{fn.__name__}"
        original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        original.__kwdefaults__ = fn.__kwdefaults__
        _LIMITED[name] = (original, log)
        saved[fn] = fn.__code__
        fn.__code__ = _limited_trampoline.__code__.replace(co_name=name)
    try:
        yield
    finally:
        for fn, code in saved.items():
            fn.__code__ = code


def _watched_shards(shards, log):
    """``[q, k, v]`` lists of :class:`_Shard` copies; ``log["K"]``, ``log["V"]``: plain copies to recognise."""
    log["K"], log["V"] = ([np.array(a, copy=True) for a in per_rank] for per_rank in shards[1:])
    out = []
    for kind, per_rank in zip("qkv", shards):
        copies = []
        for a in per_rank:
            w = np.array(a, copy=True).view(_Shard)
            w._log, w._tags = log, frozenset([kind])
            copies.append(w)
        out.append(copies)
    return out


def grade_ring_simulation(fn, *, seed=None):
    """Grade ``fn(q_shards, k_shards, v_shards, causal=False, layout="zigzag") -> (o_shards, lse_shards)``.

    ``q_shards[r]`` is rank ``r``'s ``[..., N/world, d]`` shard of ``q``
    (:func:`course_utils.distributed.shard_sequence` with ``layout``; more
    query heads than kv heads means GQA). ``o_shards[r]`` and
    ``lse_shards[r]`` must be rank ``r``'s shard of the attention output and
    of its logsumexp. Fixed and fresh random cases, 2 to 4 ranks, both
    layouts, causal or not, and one case whose scores are in the hundreds.
    A ring it must be: each rank only ever holds one K/V shard at a time, so
    ``references.attention_lse`` (and ``attention``) refuse more keys than one
    shard, and joining several ranks' K (or V) shards along the sequence
    (``np.concatenate``) is refused, and so is the grader's own :func:`simulate`.
    """
    __tracebackhide__ = True
    from .. import distributed as ring
    require_callable(fn, "check_ring_simulation")
    run = Run("check_ring_simulation", seed)
    for name, world, layout, causal, batch, n_q, n_kv, n, d, magnitude in _sim_cases(run.rng):
        q, k, v = _draw(run.rng, batch, n_q, n_kv, n, d, magnitude)
        shards = [[ring.shard_sequence(t, r, world, layout, dim=-2) for r in range(world)] for t in (q, k, v)]
        log = {"active": False, "n_local": n // world}
        given = _watched_shards(shards, log)
        with (_one_shard_of_keys(log), inputs.watching(log),
              proof.answer_keys_forbidden(simulate)):  # the grader's own ring is the course's answer
            out = run.call(fn, *given, causal=causal, layout=layout, case=name)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise run.fail("return a pair (o_shards, lse_shards): two lists with one array per rank.", name)
        o_list = [inputs.plain(a) for a in _as_list(run, out[0], world, "o_shards", name)]
        lse_list = [inputs.plain(a) for a in _as_list(run, out[1], world, "lse_shards", name)]
        o_right, lse_right = ref.attention_lse(q, k, v, causal=causal)
        o_want = np.stack([ring.shard_sequence(o_right, r, world, layout, dim=-2) for r in range(world)])
        lse_want = np.stack([ring.shard_sequence(lse_right, r, world, layout, dim=-1) for r in range(world)])
        o_got = np.stack([run.array(o_list[r], expected_shape=o_want.shape[1:], case=name, name=f"o_shards[{r}]")
                          for r in range(world)])
        lse_got = np.stack([run.array(lse_list[r], expected_shape=lse_want.shape[1:], case=name,
                                      name=f"lse_shards[{r}]") for r in range(world)])
        axes = ("rank",) + tuple(f"b{i}" for i in range(len(batch))) + (("head",) if n_q else ()) + ("i",)
        run.compare(o_got, o_want, case=name, what="o (rank by rank)", atol=ATOL, rtol=RTOL,
                    axes=axes + ("d",), diagnoses=_diagnoses(shards, causal, layout, 0))
        run.compare(lse_got, lse_want, case=name, what="lse (rank by rank)", atol=ATOL, rtol=RTOL,
                    axes=axes, diagnoses=_diagnoses(shards, causal, layout, 1))
    return run.passed()


# -----------------------------------------------------------------------------
# The distributed version (3 processes, gloo, Triton's interpreter)
# -----------------------------------------------------------------------------
WORLD_SIZE = 3  # ranks of check_ring_attention: with 2, rank + 1 and rank - 1 are the same rank


def _dist_cases(rng, world=WORLD_SIZE):
    """(name, layout, causal, n_q_heads, n_kv_heads, N, D, dtype name, magnitude).

    Every N is an even number of rows per chunk for ``world`` ranks (so the same cases also shard
    for 2 ranks, as the tests do).
    """
    from .. import distributed as ring
    n_zigzag, n_contiguous = ring.n_chunks(world, "zigzag") * 8, ring.n_chunks(world, "contiguous") * 12
    cases = [
        (f"fixed: zigzag, causal, GQA 4 q heads / 2 kv heads, N={n_zigzag}, D=16", "zigzag", True, 4, 2, n_zigzag,
         16, "float32", 1.0),
        (f"fixed: contiguous, causal, LARGE scores (lse above 100), N={n_contiguous}, D=16", "contiguous", True, 2, 1,
         n_contiguous, 16, "float32", 8.0),
    ]
    layout = str(rng.choice(ring.LAYOUTS))
    causal = bool(rng.random() < 0.5)
    n_kv = int(rng.integers(1, 3))
    n_q = n_kv * int(rng.integers(1, 3))
    n = ring.n_chunks(world, layout) * 2 * int(rng.integers(2, 6))
    cases.append((f"random: {layout}, causal={causal}, {n_q} q heads / {n_kv} kv heads, N={n}, D=16", layout,
                  causal, n_q, n_kv, n, 16, "float32", 1.0))
    return cases


# Collectives of torch.distributed that are not a ring's point-to-point messages, by their c10d
# operator (what a TorchDispatchMode sees, whatever function the learner called).
_P2P_OPS = {"send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_"}
_COLLECTIVE_NAMES = {
    "allgather": "an all-gather (torch.distributed.all_gather / all_gather_into_tensor)",
    "all_gather": "an all-gather (torch.distributed.all_gather / all_gather_into_tensor)",
    "broadcast": "a broadcast (torch.distributed.broadcast)",
    "allreduce": "an all-reduce (torch.distributed.all_reduce)",
    "all_reduce": "an all-reduce (torch.distributed.all_reduce)",
    "reduce_scatter": "a reduce-scatter (torch.distributed.reduce_scatter)",
    "alltoall": "an all-to-all (torch.distributed.all_to_all)",
    "all_to_all": "an all-to-all (torch.distributed.all_to_all)",
    "gather": "a gather (torch.distributed.gather)",
    "scatter": "a scatter (torch.distributed.scatter)",
    "reduce": "a reduce (torch.distributed.reduce)",
}


def _collective_name(op: str) -> str:
    bare = op.strip("_")
    for key, name in _COLLECTIVE_NAMES.items():
        if bare.startswith(key) or bare.startswith("_" + key):
            return f"{name}, c10d.{op}"
    return f"the collective c10d.{op}"


def _ring_work_class():
    from . import proof

    class RingWork(proof.Work):
        """:class:`.proof.Work` for one rank's ring: the course's kernels allowed (the lesson computes each
        block with ``flash_attention_with_lse``), torch's exp and logsumexp allowed (the merge); torch's
        attention and products of matrices (scores computed in torch) noted in ``torch_attention``, and
        every collective that is not point-to-point in ``collectives``."""

        def __init__(self, inputs=()):
            super().__init__(inputs=inputs, course_kernels_ok=True)
            self.collectives: list[str] = []

        def _saw_op(self, func, args, kwargs, out):
            if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
                op = func._schema.name.split("::")[-1]
                if op not in _P2P_OPS:
                    self.collectives.append(_collective_name(op))
                return  # messages: nothing computed
            super()._saw_op(func, args, kwargs, out)

        @property
        def torch_attention(self):
            return [(what, op) for what, op in self.detected
                    if what.startswith(("attention", "a matrix product"))]

    return RingWork


def _dist_inputs(seed, index, case):
    _, layout, causal, n_q, n_kv, n, d, dtype_name, magnitude = case
    rng = np.random.default_rng([seed, index])
    q, k = (magnitude * rng.standard_normal((1, h, n, d)) for h in (n_q, n_kv))
    v, do = (rng.standard_normal((1, h, n, d)) for h in (n_kv, n_q))
    import torch

    # Round to the case's dtype and use the ROUNDED values in the references.
    return [torch.from_numpy(t).to(getattr(torch, dtype_name)).double().numpy() for t in (q, k, v, do)]


def ring_check_worker(rank, world, fn, seed, cases):
    """Runs on every rank: the learner's forward, then the course's backward from its (o, lse)."""
    from .. import distributed as ring
    import traceback

    import torch

    from .core import Forbidden

    fn = ring._unwrap(fn)
    work_class = _ring_work_class()
    # The course's own answer: its ring forward (and what calls it).
    answer_keys = (ring.ring_attention_forward, ring.ring_attention, ring.RingAttentionFunction.forward)
    results = []
    for index, case in enumerate(cases):
        name, layout, causal = case[0], case[1], case[2]
        dtype = getattr(torch, case[7])
        q, k, v, do = (torch.from_numpy(ring.shard_sequence(t, rank, world, layout, dim=-2)).to(dtype)
                       for t in _dist_inputs(seed, index, case))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        # Strided views inside NaN-filled buffers: reading past a shard's rows shows up as NaN.
        padded = [inputs.nan_padded(t, transpose_heads=(i == 1)) for i, t in enumerate((q, k, v))]
        record = {}
        work = work_class(inputs=padded)
        try:
            try:
                with work, proof.answer_keys_forbidden(*answer_keys):
                    with torch.no_grad():
                        out = fn(*padded, causal, layout=layout, group=None)
            finally:  # noted even when the function then failed: the collective is the first thing to say
                record["collectives"] = work.collectives
                record["torch_attention"] = work.torch_attention
            if work.collectives or work.torch_attention:
                pass  # refused (see _grade_distributed): no backward from it
            elif not isinstance(out, (tuple, list)) or len(out) != 2:
                record["error"] = f"your function returned {type(out).__name__}; return the pair (o, lse)."
            else:
                o, lse = out
                record["o"] = o.detach().double().numpy()
                record["lse"] = lse.detach().double().numpy()
                record["launches"] = len(work.launches)
                o2 = ring.RingAttentionFunction.apply(*leaves, causal, layout, None, fn)
                o2.backward(do)
                record["grads"] = [t.grad.double().numpy() for t in leaves]
        except Forbidden as exc:  # the course's own ring forward, or a reference: one sentence
            record["forbidden"] = str(exc)
        except NotImplementedError as exc:  # the stub, not filled in yet: say so, not a traceback
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            record["not_implemented"] = f"in {frame.name}, line {frame.lineno}"
        except Exception as exc:  # noqa: BLE001  (the learner's error, shown with its traceback)
            record["error"] = "".join(traceback.format_exception(exc))
        results.append(record)
        if "error" in record or "forbidden" in record or "not_implemented" in record or record.get("collectives") or record.get("torch_attention"):
            break  # refused, or failed: stop here (a rank waiting on this one sees the connection close)
    return results


def _grade_distributed(run, cases, seed, per_rank, world):
    """Compare what the ranks returned with float64 attention; raise a GradingError on a mistake."""
    __tracebackhide__ = True
    from .. import distributed as ring
    for index, case in enumerate(cases):
        name, layout, causal = case[0], case[1], case[2]
        atol, rtol = TORCH_TOL[case[7]]
        records = [r[index] if index < len(r) else {"error": "(stopped after another rank's error)"} for r in per_rank]
        run.cases += 1
        errors = [(rank, r["error"]) for rank, r in enumerate(records) if "error" in r]
        # A rank whose partner failed sees a broken connection: show the first real error.
        errors.sort(key=lambda e: (e[1].startswith("(stopped"), "Connection closed" in e[1] or "gloo" in e[1]))
        forbidden = [r["forbidden"] for r in records if "forbidden" in r]
        if forbidden:
            raise run.fail(forbidden[0], name)
        for rank, record in enumerate(records):  # an untouched stub: before the broken connections it leaves
            if "not_implemented" in record:
                raise run.fail(MSG_NOT_IMPLEMENTED_RING.format(rank=rank, where=record["not_implemented"]), name)
        # Before the errors: a rank that stopped here leaves the others a broken connection.
        for rank, record in enumerate(records):  # no all-gather, broadcast, ...: a ring
            if record.get("collectives"):
                raise run.fail(MSG_NOT_A_RING.format(what=record["collectives"][0], rank=rank), name)
        for rank, record in enumerate(records):
            if record.get("torch_attention"):
                what, op = record["torch_attention"][0]
                raise run.fail(MSG_TORCH_ATTENTION_RING.format(rank=rank, what=what, op=op), name)
        if errors:
            rank, text = errors[0]
            raise run.fail(f"rank {rank} raised an error in your function:\n{text}", name)
        q, k, v, do = _dist_inputs(seed, index, case)
        o_right, lse_right = ref.attention_lse(q, k, v, causal=causal)
        for rank, record in enumerate(records):
            for label, got, right in (("o", record["o"], o_right), ("lse", record["lse"], lse_right)):
                want = ring.shard_sequence(right, rank, world, layout, dim=2)
                if tuple(got.shape) != tuple(want.shape):
                    raise run.fail(f"rank {rank}'s {label} has shape {tuple(got.shape)}, expected "
                                   f"{tuple(want.shape)} (its shard).", name)
        shards = [[ring.shard_sequence(t, r, world, layout, dim=2) for r in range(world)] for t in (q, k, v)]
        o = ring.unshard_sequence([r["o"] for r in records], world, layout, dim=2)
        lse = ring.unshard_sequence([r["lse"] for r in records], world, layout, dim=2)
        axes = ("b", "q_head", "i")
        run.compare(o, o_right, case=name, what="o (the whole sequence, unsharded)", atol=atol, rtol=rtol,
                    axes=axes + ("d",), diagnoses=_diagnoses(shards, causal, layout, 0, unshard=True))
        run.compare(lse, lse_right, case=name, what="lse (the whole sequence, unsharded)", atol=atol, rtol=rtol,
                    axes=axes, diagnoses=_diagnoses(shards, causal, layout, 1, unshard=True))
        if not all(record["launches"] for record in records):
            raise run.fail(MSG_NO_TRITON_RING, name)
        # The float64 backward from the o and lse the course's ring backward was given (yours, already checked
        # within the forward's tolerance): every P = exp(s - lse) moves with an lse that tolerance allows, and
        # with large scores that alone once sent one dq element of 1152 past twice the forward's tolerance (CI,
        # 2026-12-05: 4.2e-4 against 4e-4 for a correct ring). Against this, the gradients test the ring
        # backward's run on your outputs, not your forward's rounding a second time.
        grads_right = ref.tiled_attention_backward(q, k, v, o, lse, do, q.shape[2], k.shape[2], causal=causal)
        for which, label in ((2, "dv"), (1, "dk"), (0, "dq")):
            got = ring.unshard_sequence([r["grads"][which] for r in records], world, layout, dim=2)
            # Twice the forward's tolerance: the gradients sum more rounded products (seen on the H200's
            # image, triton 3.6: dq off by 2.4e-4 against 2.3e-4 in the large-scores case).
            run.compare(got, grads_right[which], case=name, what=f"{label} (the course's ring backward run from "
                        "your o and lse)", atol=2 * atol, rtol=2 * rtol,
                        axes=("b", "kv_head" if which else "q_head", "i", "d"))
    return run.passed()


def grade_ring_attention(fn, *, seed=None, world_size=WORLD_SIZE, timeout_s=180.0):
    """Grade one rank's ring forward ``fn(q, k, v, causal=False, *, layout="zigzag", group=None) -> (o, lse)``.

    Starts ``world_size`` processes (spawn, gloo, Triton's interpreter on the
    CPU, one thread each), which call ``fn`` with their shards (non-contiguous
    views inside NaN-filled buffers) of fixed and
    fresh random cases (both layouts, causal or not, GQA, one case with large
    scores). ``o`` (the input dtype) and ``lse`` (float32 ``[B, Hq, N/world]``)
    are compared with float64 attention; a Triton kernel must have run
    (``flash_attention_with_lse`` is fine; torch's attention, the course's
    ring forward and collectives other than point-to-point messages are
    refused); then
    the course's ring backward runs from ``fn``'s ``(o, lse)`` and the
    gradients are compared too. ``fn`` may be defined in the notebook: it
    travels to the processes as source, with the notebook functions it calls.
    """
    __tracebackhide__ = True
    from .. import distributed as ring
    require_callable(fn, "check_ring_attention")
    from ..environment import interpreter_problem

    if interpreter_problem():  # its gloo processes run the kernels in Triton's interpreter
        raise GradingError("check_ring_attention cannot grade on this machine: its CPU processes run "
                           "Triton's interpreter, and " + interpreter_problem())
    from torch.multiprocessing import ProcessExitedException

    run = Run("check_ring_attention", seed, time_limit_s=None)
    cases = _dist_cases(run.rng, world_size)
    try:
        per_rank = ring.run_distributed(ring_check_worker, world_size, args=(ring.portable(fn), run.seed, cases),
                                        device="cpu", timeout_s=timeout_s)
    except TimeoutError as exc:
        raise TimedOut(f"check_ring_attention: {exc} Look for a send without a matching receive (every rank "
                       "must post the same exchanges in the same order) or a loop that never ends.") from None
    except ProcessExitedException as exc:  # a rank died (a segfault, os._exit, the system killing it)
        code = -signal.Signals[exc.signal_name].value if exc.signal_name else exc.exit_code
        raise Crashed(crash_message("check_ring_attention", code)) from None
    return _grade_distributed(run, cases, run.seed, per_rank, world_size)


# -----------------------------------------------------------------------------
# When does the transfer hide behind the compute? (a formula, no processes)
# -----------------------------------------------------------------------------
MSG_OVERLAP_FLOAT = (
    "you returned the crossover as a float (the length where compute and transfer take exactly as long). "
    "Return a whole number of tokens: the smallest integer shard length n whose compute takes LONGER than "
    "its transfer, math.floor(x) + 1 for the crossover x (math.ceil(x) is the same unless x is a whole number)."
)
MSG_OVERLAP_ROUNDED_DOWN = (
    "the crossover x was rounded down (int(x), math.floor(x) or round(x)): at floor(x) tokens the transfer "
    "still takes at least as long as the compute. Return the first length past the crossover, "
    "math.floor(x) + 1."
)
MSG_OVERLAP_NO_V = (
    "the transfer counts K only: each step sends K AND V of the shard, 2 * shard * n_kv_heads * head_dim * "
    "dtype_bytes bytes (the ring stacks them into one message)."
)
MSG_OVERLAP_Q_HEADS = (
    "the heads are wrong on one side: K and V have n_kv_heads heads (the bytes), while the compute runs for "
    "every one of the n_q_heads query heads (the FLOPs). Counting n_q_heads for the K/V bytes, or one head on "
    "both sides, drops the factor group_size = n_q_heads / n_kv_heads that GQA gains."
)
MSG_OVERLAP_ONE_MATMUL = (
    "the compute is half the convention's: a block is two matrix products (S = Q K^T and O = P V), each "
    "2 * shard^2 * head_dim FLOPs per query head (a multiply-add is two FLOPs): 4 * shard^2 * head_dim * n_q_heads."
)
MSG_OVERLAP_NO_FOUR = (
    "the factor 4 is missing from the FLOPs: shard^2 * head_dim * n_q_heads counts one multiply per score "
    "and product; the convention is 4 * shard^2 * head_dim * n_q_heads (two products, two FLOPs per multiply-add)."
)
MSG_OVERLAP_CAUSAL = (
    "with causal=True the compute is not halved: in the zigzag layout every ring step computes half a "
    "block pair (step 0 the triangle of its own shard, every later step two of its four chunk pairs), "
    "2 * shard^2 * head_dim * n_q_heads FLOPs."
)
MSG_OVERLAP_CAUSAL_NOT_CAUSAL = (
    "the compute was halved although causal=False: without the mask a step computes the whole "
    "shard x shard block, 4 * shard^2 * head_dim * n_q_heads FLOPs."
)
MSG_OVERLAP_DTYPE = "the bytes per element are missing: the transfer is 2 * shard * n_kv_heads * head_dim * dtype_bytes bytes."
MSG_OVERLAP_HEAD_DIM = (
    "head_dim is on one side only: both the FLOPs (4 * shard^2 * head_dim * n_q_heads) and the bytes "
    "(2 * shard * n_kv_heads * head_dim * dtype_bytes) grow with it, so it cancels from the crossover."
)
MSG_OVERLAP_INVERTED = (
    "this is the crossover with the rates swapped or the ratio upside down: compute time = FLOPs / flops_per_s, "
    "transfer time = bytes / bytes_per_s; solve compute(n) > transfer(n) for n."
)


def overlap_crossover(flops_per_s, bytes_per_s, n_q_heads, n_kv_heads, head_dim, dtype_bytes, causal):
    """The shard length x (tokens, a float) where one step's compute time equals its transfer time.

    Compute: ``4 * n**2 * head_dim * n_q_heads`` FLOPs, halved when causal (zigzag: every step is half a
    block pair), at ``flops_per_s``; transfer: ``2 * n * n_kv_heads * head_dim * dtype_bytes`` bytes at
    ``bytes_per_s``. Compute grows like n², the transfer like n: compute is longer exactly when n > x.
    """
    flops_per_n2 = 4.0 * head_dim * n_q_heads / (2 if causal else 1)
    bytes_per_n = 2.0 * n_kv_heads * head_dim * dtype_bytes
    return bytes_per_n * flops_per_s / (flops_per_n2 * bytes_per_s)


def _overlap_cases(rng):
    """(flops_per_s, bytes_per_s, n_q_heads, n_kv_heads, head_dim, dtype_bytes, causal), crossovers off integers."""
    fixed = [
        (536e12, 450e9, 32, 8, 128, 2, True),  # the fast kernel's rate over NVLink's published 450 GB/s
        (536e12, 450e9, 32, 8, 128, 2, False),
        (61.3e12, 47e9, 16, 16, 64, 4, False),  # MHA, float32
        (312e12, 23e9, 64, 1, 128, 2, True),  # MQA over a slow link
        (990e12, 397e9, 40, 8, 256, 1, True),  # fp8
    ]
    cases = list(fixed)
    while len(cases) < len(fixed) + 12:
        n_kv = int(rng.choice([1, 2, 4, 8]))
        case = (float(rng.uniform(50e12, 1000e12)), float(rng.uniform(20e9, 900e9)), n_kv * int(rng.choice([1, 2, 4, 8])),
                n_kv, int(rng.choice([64, 128, 256])), int(rng.choice([1, 2, 4])), bool(len(cases) % 2))
        x = overlap_crossover(*case)
        # Off whole numbers (where > and >= differ), and long enough that the mistakes' answers stay apart.
        if x >= 16 and abs(x - round(x)) > 1e-6 * x:
            cases.append(case)
    return cases


def _shard_length(run, out, case):
    """The learner's answer as a float (a number, not a bool), or one plain sentence."""
    if out is None:
        raise run.fail("your function returned None: did you forget a `return`?", case)
    if isinstance(out, bool) or not isinstance(out, (numbers.Real, np.floating, np.integer)):
        raise run.fail(f"your function returned a {type(out).__name__}; return the shard length, an int.", case)
    return float(out)


def grade_overlap_shard_length(fn, *, seed=None):
    """Grade ``fn(flops_per_s, bytes_per_s, n_q_heads, n_kv_heads, head_dim, dtype_bytes, causal) -> int``.

    The smallest shard length ``n`` (tokens per rank, an integer) at which one ring step's attention takes
    LONGER than sending the next K/V shard: ``4 * n**2 * head_dim * n_q_heads`` FLOPs (halved when
    causal: in the zigzag layout every step computes half a block pair) at ``flops_per_s``, against
    ``2 * n * n_kv_heads * head_dim * dtype_bytes`` bytes (K and V) at ``bytes_per_s``. With x the
    crossover where both take as long, that is ``math.floor(x) + 1``; ``math.ceil(x)`` is accepted too
    (the cases keep x off whole numbers, where the two differ). An int, a NumPy integer or a float with a
    whole value passes; a fractional float does not. Fixed cases (GQA, MHA, MQA; causal or not; bf16,
    float32, fp8) and twelve fresh random ones. The grader's own formula (:func:`overlap_crossover`)
    is refused while ``fn`` runs.
    """
    __tracebackhide__ = True
    require_callable(fn, "check_overlap_shard_length")
    run = Run("check_overlap_shard_length", seed)
    cases = _overlap_cases(run.rng)
    got, names = [], []
    with proof.answer_keys_forbidden(overlap_crossover):  # the grader's own formula is the answer
        for c in cases:
            case = (f"flops_per_s={c[0]:.4g}, bytes_per_s={c[1]:.4g}, n_q_heads={c[2]}, n_kv_heads={c[3]}, "
                    f"head_dim={c[4]}, dtype_bytes={c[5]}, causal={c[6]}")
            got.append(_shard_length(run, run.call(fn, *c, case=case), case))
            names.append(case)
    got = np.array(got)
    hq, hkv, d, b, causal = (np.array([c[i] for c in cases], dtype=float) for i in range(2, 7))
    x = np.array([overlap_crossover(*c) for c in cases])
    want = np.floor(x) + 1

    def formula(message, factor):  # a mistaken formula's crossover, however it was rounded (within 1 token)
        return Diagnosis(message, expected=x * factor, atol=1.0 + 1e-9, rtol=1e-9)

    def whole(a):
        return bool(np.all(np.isfinite(a)) and np.all(a == np.round(a)))

    diagnoses = [
        Diagnosis(MSG_OVERLAP_FLOAT, when=lambda a: not whole(a) and bool(np.all((a >= x * (1 - 1e-6)) & (a <= want)))),
        Diagnosis(MSG_OVERLAP_ROUNDED_DOWN, when=lambda a: whole(a) and bool(np.all((a == want) | (a == want - 1)))),
        formula(MSG_OVERLAP_NO_V, 0.5),
        formula(MSG_OVERLAP_Q_HEADS, hq / hkv),
        formula(MSG_OVERLAP_ONE_MATMUL, 2.0),
        formula(MSG_OVERLAP_NO_FOUR, 4.0),
        formula(MSG_OVERLAP_CAUSAL, np.where(causal == 1, 0.5, 1.0)),
        formula(MSG_OVERLAP_CAUSAL_NOT_CAUSAL, np.where(causal == 1, 1.0, 2.0)),
        formula(MSG_OVERLAP_DTYPE, 1 / b),
        formula(MSG_OVERLAP_HEAD_DIM, 1 / d),
        formula(MSG_OVERLAP_HEAD_DIM, d),
        formula(MSG_OVERLAP_INVERTED, 1 / x**2),
    ]
    bad = got != want
    run.compare(got, want, case=names[int(np.argmax(bad))] if bad.any() else "all", what="the shard length "
                "(tokens per rank) of each case", atol=0, rtol=0, diagnoses=diagnoses, axes=("case",))
    return run.passed()
