"""Ring (context-parallel) attention over ``torch.distributed`` (lesson 10).

A sequence too long for one GPU is cut into ``world_size`` shards, one per
process (rank). Each rank keeps its queries and passes its keys and values
around a ring: at step ``s`` rank ``r`` holds the K/V shard of rank
``(r - s) % world_size``, computes attention of its queries against it with
the course's Triton kernels (which also return the logsumexp ``lse``), and
merges that partial output into its running one by the logsumexp rule, the
online softmax once more, now across devices. While the kernel works on one
block, the next block is already on its way (``batch_isend_irecv``).

Public API (torch tensors ``[B, H, N_local, D]``, called on EVERY rank)::

    shard = shard_sequence(x, rank, world_size, layout="zigzag", dim=2)
    x = unshard_sequence(shards, world_size=None, layout="zigzag", dim=2)
    o = ring_attention(q, k, v, causal=False, *, layout="zigzag", group=None)
    o, lse = ring_attention_forward(q, k, v, causal=False, *, layout="zigzag", group=None)

Layouts: the sequence is cut into chunks. ``"contiguous"``: ``world_size``
chunks, rank ``r`` holds chunk ``r``. ``"zigzag"``: ``2 * world_size``
chunks, rank ``r`` holds chunks ``r`` and ``2 * world_size - 1 - r`` (one
early, one late), so that with a causal mask every rank has the same amount
of work (see :func:`tile_work`).

Launching: :func:`run_distributed` starts ``nproc`` processes with
``torch.multiprocessing`` (spawn), gloo on the CPU (Triton's interpreter),
NCCL on GPUs, and returns what each rank's function returned.
``python -m course_utils.distributed --nproc 2`` runs a demo that checks
against single-process attention; ``--bench`` times it on GPUs.

Every process started here gets ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1``
(:data:`SAFE_ENV`): no NVLink multicast, no symmetric memory.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import socket
import sys
import tempfile
import time

import numpy as np
import torch

__all__ = [
    "LAYOUTS",
    "SAFE_ENV",
    "chunk_ids",
    "n_chunks",
    "shard_sequence",
    "unshard_sequence",
    "block_relation",
    "step_plan",
    "tile_work",
    "ring_attention",
    "ring_attention_forward",
    "ring_attention_backward",
    "timeline_ms",
    "RingAttentionFunction",
    "merge_partials_",
    "run_distributed",
    "portable",
    "apply_safe_env",
    "demo_case",
    "demo_cases",
    "demo_errors",
]

LAYOUTS = ("zigzag", "contiguous")

# Set in os.environ before any process is started and before any
# torch.distributed initialisation: NVLink multicast (NVLS) and symmetric
# memory stay off on every machine this runs on.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Message tags: K/V blocks and dK/dV accumulators travel between the same two
# ranks at the same time; gloo matches messages by tag (NCCL by order).
_TAG_KV = 11
_TAG_DKV = 12


def apply_safe_env() -> None:
    """Put :data:`SAFE_ENV` into ``os.environ`` (inherited by every child process)."""
    os.environ.update(SAFE_ENV)


apply_safe_env()


# -----------------------------------------------------------------------------
# Layouts: which chunks of the sequence each rank holds
# -----------------------------------------------------------------------------
def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}.")


def n_chunks(world_size: int, layout: str = "zigzag") -> int:
    """How many equal chunks the sequence is cut into: ``2*world_size`` (zigzag) or ``world_size``."""
    _check_layout(layout)
    return 2 * world_size if layout == "zigzag" else world_size


def chunk_ids(rank: int, world_size: int, layout: str = "zigzag") -> list[int]:
    """The global chunk indices rank ``rank`` holds, in the order it stores them.

    ``"zigzag"``: ``[rank, 2*world_size - 1 - rank]``; ``"contiguous"``: ``[rank]``.
    """
    _check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size}).")
    if layout == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    return [rank]


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _narrow(x, dim, start, length):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, start + length)
    return x[tuple(index)]


def _cat(parts, dim):
    if _is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=dim)
    return np.concatenate(parts, axis=dim)


def shard_sequence(x, rank: int, world_size: int, layout: str = "zigzag", dim: int = 2):
    """Rank ``rank``'s shard of ``x`` along ``dim`` (a torch tensor or a NumPy array).

    The sequence (length ``N``, a multiple of :func:`n_chunks`) is cut into
    equal chunks; the shard is the concatenation of the chunks
    :func:`chunk_ids` gives this rank, a new tensor of length ``N / world_size``.
    ``dim=2`` is the N of torch's ``[B, H, N, D]``; use ``dim=-2`` for NumPy's
    ``[..., N, d]``.
    """
    dim = dim % x.ndim
    n, count = x.shape[dim], n_chunks(world_size, layout)
    if n % count:
        raise ValueError(f"the sequence length {n} must be a multiple of {count} for {world_size} ranks "
                         f"with the {layout} layout.")
    c = n // count
    return _cat([_narrow(x, dim, i * c, c) for i in chunk_ids(rank, world_size, layout)], dim)


def unshard_sequence(shards, world_size: int | None = None, layout: str = "zigzag", dim: int = 2):
    """Put the per-rank shards back in sequence order: the inverse of :func:`shard_sequence`.

    ``shards``: the list ``[shard of rank 0, shard of rank 1, ...]`` (torch
    tensors or NumPy arrays); ``world_size`` defaults to ``len(shards)``.
    Returns the whole sequence along ``dim``.
    """
    shards = list(shards)
    world_size = len(shards) if world_size is None else world_size
    if world_size != len(shards):
        raise ValueError(f"got {len(shards)} shards for world_size {world_size}.")
    dim = dim % shards[0].ndim
    per_rank = n_chunks(world_size, layout) // world_size
    n_local = shards[0].shape[dim]
    if n_local % per_rank:
        raise ValueError(f"a shard's length {n_local} is not a multiple of its {per_rank} chunks.")
    c = n_local // per_rank
    chunks = [None] * n_chunks(world_size, layout)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] != n_local:
            raise ValueError(f"shard {rank} has length {shard.shape[dim]}, shard 0 has {n_local}.")
        for j, chunk in enumerate(chunk_ids(rank, world_size, layout)):
            chunks[chunk] = _narrow(shard, dim, j * c, c)
    return _cat(chunks, dim)


# -----------------------------------------------------------------------------
# Which blocks a rank computes, and how (causal)
# -----------------------------------------------------------------------------
FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


def block_relation(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How queries of chunk ``q_chunk`` see keys of chunk ``k_chunk`` (global chunk indices).

    ``"full"``: every key is visible (not causal, or the keys come earlier);
    ``"diagonal"``: the same chunk, so the causal mask applies inside it;
    ``"skip"``: every key is in the queries' future (causal), nothing to compute.
    """
    if not causal or k_chunk < q_chunk:
        return FULL
    return DIAGONAL if k_chunk == q_chunk else SKIP


def step_plan(rank: int, src: int, world_size: int, layout: str, causal: bool) -> list[tuple[int | None, int | None, str]]:
    """The kernel calls rank ``rank`` makes when it holds rank ``src``'s K/V.

    A list of ``(i, j, kind)``: local query chunk ``i`` against local key
    chunk ``j`` of the held block, ``kind`` "full" or "diagonal"; ``i = j =
    None`` means the whole shard against the whole block in one call (not
    causal, or ``src == rank``: a rank's own chunks are in increasing order,
    so the causal mask on its whole shard is the right one). Skipped pairs
    are left out.
    """
    if not causal:
        return [(None, None, FULL)]
    if src == rank:
        return [(None, None, DIAGONAL)]
    plan = []
    for i, q_chunk in enumerate(chunk_ids(rank, world_size, layout)):
        for j, k_chunk in enumerate(chunk_ids(src, world_size, layout)):
            kind = block_relation(q_chunk, k_chunk, causal)
            if kind != SKIP:
                plan.append((i, j, kind))
    return plan


def _coalesce(plan):
    """Join two "full" pairs that share a query chunk (or a key chunk) into one call.

    The backward kernels take different query and key lengths, so in the
    zigzag layout "all our queries against the block's first chunk" or "our
    late chunk against the whole block" is one launch instead of two.
    """
    if len(plan) != 2 or any(kind != FULL for _, _, kind in plan):
        return plan
    (i0, j0, _), (i1, j1, _) = plan
    if j0 == j1 and {i0, i1} == {0, 1}:
        return [(None, j0, FULL)]
    if i0 == i1 and {j0, j1} == {0, 1}:
        return [(i0, None, FULL)]
    return plan


def tile_work(n: int, world_size: int, layout: str, block: int, causal: bool = True) -> np.ndarray:
    """Tiles of ``block x block`` each rank computes over the whole ring: ``[world_size]`` floats.

    A diagonal tile counts as half a tile (half of it is masked). With the
    contiguous layout and a causal mask the last rank does ``2*world_size - 1``
    times the first rank's work; zigzag makes the counts equal.
    """
    if n % (n_chunks(world_size, layout) * block):
        raise ValueError(f"n={n} must be a multiple of {n_chunks(world_size, layout)} chunks of {block}.")
    c = n // n_chunks(world_size, layout) // block  # tiles per chunk side
    work = np.zeros(world_size)
    for rank in range(world_size):
        for src in range(world_size):
            for q_chunk in chunk_ids(rank, world_size, layout):
                for k_chunk in chunk_ids(src, world_size, layout):
                    kind = block_relation(q_chunk, k_chunk, causal)
                    if kind == FULL:
                        work[rank] += c * c
                    elif kind == DIAGONAL:
                        work[rank] += c * (c + 1) / 2
    return work


# -----------------------------------------------------------------------------
# The ring: forward, backward, autograd
# -----------------------------------------------------------------------------
def _sel(t, dim_slice):
    """``t[:, :, dim_slice]``: a view of rows along N."""
    return t if dim_slice is None else t[:, :, dim_slice]


def _chunk_slice(index, chunk_len):
    return None if index is None else slice(index * chunk_len, (index + 1) * chunk_len)


def merge_partials_(acc, lse, o_b, lse_b) -> None:
    """Merge one block's ``(o_b, lse_b)`` into the running ``(acc, lse)``, in place.

    ``acc`` float32 ``[..., n, D]`` and ``lse`` float32 ``[..., n]``: the output
    and logsumexp over the keys seen so far (``lse = -inf`` where none yet);
    ``o_b``, ``lse_b``: the same over one more block of keys. The new lse is
    ``logaddexp(lse, lse_b)`` (which subtracts the max before exponentiating);
    each output is weighted by ``exp(its lse - new lse)`` <= 1.
    """
    import torch

    new = torch.logaddexp(lse, lse_b)
    acc.mul_(torch.exp(lse - new).unsqueeze(-1))
    acc.add_(o_b.float() * torch.exp(lse_b - new).unsqueeze(-1))
    lse.copy_(new)


def _merge(acc, lse, o_b, lse_b) -> None:
    """The ring's merge: on a GPU one Triton kernel (:func:`course_utils.kernels.merge.merge_partials`),
    elsewhere :func:`merge_partials_`.

    Measured on the H200 (``--blocks``' ``course_fused_merge`` provider; results/GPU_VALIDATION.md, the
    eleventh session), the one-kernel merge made a rank's forward 2-5% faster than the torch merge's chain
    of kernels.
    """
    if acc.is_cuda:
        from ..kernels.merge import merge_partials

        merge_partials(acc, lse, o_b, lse_b)
    else:
        merge_partials_(acc, lse, o_b, lse_b)


def _ring_info(group):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if group is None:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
    else:
        nxt = dist.get_global_rank(group, (rank + 1) % world)
        prv = dist.get_global_rank(group, (rank - 1) % world)
    return world, rank, nxt, prv


def _exchange(send, recv, nxt, prv, group, tag):
    """Post ``send -> next rank`` and ``previous rank -> recv``; return the requests."""
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return dist.batch_isend_irecv(ops)


def _validate_shards(q, k, v, world, layout):
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d torch tensor [B, H, N_local, D].")
    per_rank = n_chunks(world, layout) // world
    if q.shape[2] != k.shape[2] or q.shape[2] % per_rank:
        raise ValueError(f"q, k and v must be this rank's shards of one length, a multiple of {per_rank} "
                         f"(the {layout} layout's chunks per rank); got {q.shape[2]} and {k.shape[2]}.")


def _mark(device):
    """A point in time on ``device``'s stream: a recorded CUDA event on a GPU, ``perf_counter()`` on the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def timeline_ms(timeline) -> list[dict]:
    """A ring pass's ``timeline`` (as :func:`ring_attention_forward` fills it) in milliseconds.

    One dict per step: ``start_ms`` (from the pass's first step), ``compute_ms``
    (the step's kernels and merges) and ``exposed_wait_ms`` (how long the rank
    then still waited for the step's transfers: 0 when the exchange hid behind
    the compute). Synchronises the GPU first.
    """
    if timeline and isinstance(timeline[0]["start"], torch.cuda.Event):
        torch.cuda.synchronize()
    first = timeline[0]["start"] if timeline else None
    return [dict(step=s["step"], start_ms=_elapsed_ms(first, s["start"]),
                 compute_ms=_elapsed_ms(s["start"], s["computed"]), exposed_wait_ms=_elapsed_ms(s["computed"], s["arrived"]))
            for s in timeline]


def ring_attention_forward(q, k, v, causal=False, *, layout="zigzag", group=None, timeline=None):
    """One rank's part of ring attention's forward: ``(o, lse)`` for its query shard.

    ``q [B, Hq, n, D]``, ``k``/``v [B, Hkv, n, D]``: this rank's shards
    (:func:`shard_sequence` with ``layout``). K/V travel round the ring as one
    ``[2, B, Hkv, n, D]`` buffer; the transfer of the next block is posted
    before the kernels run on the current one. Each block goes through
    :func:`course_utils.kernels.flash_attention_with_lse` and is merged by
    :func:`_merge` (:func:`merge_partials_`'s rule; one Triton kernel on a GPU). ``o`` has q's dtype; ``lse`` is float32 ``[B, Hq, n]``.
    ``timeline``: a list to append each step's marks to (its start, the end of
    its compute, the arrival of its transfers), read by :func:`timeline_ms`.
    """
    import torch

    from ..kernels import flash_attention_with_lse

    _check_layout(layout)
    world, rank, nxt, prv = _ring_info(group)
    _validate_shards(q, k, v, world, layout)
    chunk_len = q.shape[2] // (n_chunks(world, layout) // world)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    for step in range(world):
        requests = []
        if step + 1 < world:  # the next block is on its way while we compute
            kv_next = torch.empty_like(kv)
            requests = _exchange(kv, kv_next, nxt, prv, group, _TAG_KV)
        src = (rank - step) % world
        mark = timeline is not None and dict(step=step, start=_mark(q.device))
        for i, j, kind in step_plan(rank, src, world, layout, causal):
            qs, ks = _chunk_slice(i, chunk_len), _chunk_slice(j, chunk_len)
            o_b, lse_b = flash_attention_with_lse(_sel(q, qs), _sel(kv[0], ks), _sel(kv[1], ks),
                                                  causal=(kind == DIAGONAL))
            if step == 0 and qs is None:  # the first block of every row: nothing to merge with yet
                acc.copy_(o_b)
                lse.copy_(lse_b)
            else:
                _merge(_sel(acc, qs), _sel(lse, qs), o_b, lse_b)
        if mark:
            mark["computed"] = _mark(q.device)
        for request in requests:
            request.wait()
        if mark:
            mark["arrived"] = _mark(q.device)
            timeline.append(mark)
        if requests:
            kv = kv_next
    return acc.to(q.dtype), lse


def ring_attention_backward(do, q, k, v, o, lse, causal=False, *, layout="zigzag", group=None, timeline=None):
    """One rank's part of ring attention's backward: ``(dq, dk, dv)`` for its shards.

    K/V circulate as in the forward; alongside, a float32 ``[2, B, Hkv, n, D]``
    accumulator of dK/dV travels one step behind: at each step a rank adds
    its contribution to the block it holds and passes the sum on, so after
    ``world_size`` passes every block's gradient is home. Each block pair goes
    through :func:`course_utils.kernels.backward.attention_backward` with the
    rank's final ``o`` and ``lse`` (the softmax over ALL keys), which is what
    makes the per-block gradients add up to the exact ones. ``timeline`` as in
    :func:`ring_attention_forward` (a step's transfers: the earlier ranks' dK/dV
    sum and the next K/V block; one more entry, step ``world_size``, for the
    last hop that brings each block's gradient home).
    """
    import torch

    from ..kernels.backward import attention_backward

    world, rank, nxt, prv = _ring_info(group)
    chunk_len = q.shape[2] // (n_chunks(world, layout) // world)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    dkv_requests, dkv_in = [], None
    for step in range(world):
        kv_requests = []
        if step + 1 < world:
            kv_next = torch.empty_like(kv)
            kv_requests = _exchange(kv, kv_next, nxt, prv, group, _TAG_KV)
        src = (rank - step) % world
        mark = timeline is not None and dict(step=step, start=_mark(q.device))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for i, j, kind in _coalesce(step_plan(rank, src, world, layout, causal)):
            qs, ks = _chunk_slice(i, chunk_len), _chunk_slice(j, chunk_len)
            dq_b, dk_b, dv_b = attention_backward(_sel(q, qs), _sel(kv[0], ks), _sel(kv[1], ks), _sel(o, qs),
                                                  _sel(lse, qs), _sel(do, qs), causal=(kind == DIAGONAL))
            _sel(dq, qs).add_(dq_b)
            _sel(dkv[0], ks).add_(dk_b)
            _sel(dkv[1], ks).add_(dv_b)
        if mark:
            mark["computed"] = _mark(q.device)
        for request in dkv_requests:  # the earlier ranks' sum for this block
            request.wait()
        if dkv_in is not None:
            dkv += dkv_in
        if world == 1:  # no ring: the block is our own
            dkv_in = dkv
        else:
            dkv_in = torch.empty_like(dkv)
            dkv_requests = _exchange(dkv, dkv_in, nxt, prv, group, _TAG_DKV)
        for request in kv_requests:
            request.wait()
        if mark:
            mark["arrived"] = _mark(q.device)
            timeline.append(mark)
        if kv_requests:
            kv = kv_next
    mark = timeline is not None and dict(step=world, start=_mark(q.device))
    if mark:
        mark["computed"] = mark["start"]  # nothing left to compute: the last hop is all exposed
    for request in dkv_requests:  # our own block's gradient, summed over every rank
        request.wait()
    if mark:
        mark["arrived"] = _mark(q.device)
        timeline.append(mark)
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention behind ``torch.autograd``: saves ``q, k, v, o, lse`` (all local).

    ``apply(q, k, v, causal, layout, group, forward_impl)``: ``forward_impl``
    (default :func:`ring_attention_forward`) computes ``(o, lse)``; the
    backward is :func:`ring_attention_backward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False, layout="zigzag", group=None, forward_impl=None):
        impl = forward_impl or ring_attention_forward
        o, lse = impl(q, k, v, causal, layout=layout, group=group)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.layout, ctx.group = bool(causal), layout, group
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(do.contiguous(), q, k, v, o, lse, ctx.causal,
                                             layout=ctx.layout, group=ctx.group)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, causal=False, *, layout="zigzag", group=None):
    """Attention over a sequence sharded across the ranks of ``group``: this rank's ``o``.

    Call it on every rank of an initialised process group with that rank's
    shards (``[B, Hq, N/world, D]`` queries, ``[B, Hkv, N/world, D]`` keys and
    values, cut by :func:`shard_sequence` with the same ``layout``; GQA
    allowed). Returns this rank's shard of ``softmax(q k^T / sqrt(D)) v``.
    Differentiable: the backward circulates K/V and dK/dV round the ring.
    """
    import torch

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return RingAttentionFunction.apply(q, k, v, bool(causal), layout, group, None)
    return ring_attention_forward(q, k, v, bool(causal), layout=layout, group=group)[0]


# -----------------------------------------------------------------------------
# Starting processes
# -----------------------------------------------------------------------------
class _Shipped:
    """A function that a spawned process cannot import by name (defined in a notebook), pickled by value.

    The same mechanism as the grading worker's (:func:`course_utils.transport.dumps`):
    notebook functions travel by value with cloudpickle, ``@triton.jit`` kernels as source.
    """

    def __init__(self, fn):
        from ..transport import dumps

        self.name = getattr(fn, "__name__", "your function")
        # The course's functions it calls arrive as the ranks' own (pristine) ones, not as the copies the
        # notebook imported: under the batch grader those carry its trampolines, which refuse course code
        # calling course code once their globals are copied (a correct ring was refused).
        self.payload = dumps(fn, course_by_name=True)

    def build(self):
        import cloudpickle

        return cloudpickle.loads(self.payload)


def portable(fn):
    """``fn`` itself if a spawned process can import it, else a :class:`_Shipped` copy of it."""
    from ..transport import by_reference

    if fn is None or not callable(fn) or by_reference(fn) is not None:
        return fn
    return _Shipped(fn)


def _unwrap(fn):
    return fn.build() if isinstance(fn, _Shipped) else fn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _child_environment(device: str):
    """Environment variables the spawned children inherit (restored afterwards)."""
    extra = dict(SAFE_ENV)
    if device == "cpu":
        extra["TRITON_INTERPRET"] = "1"  # read once, when the child imports triton
        extra["CUDA_VISIBLE_DEVICES"] = ""  # so course_utils.DEVICE is "cpu" in the child
        extra["OMP_NUM_THREADS"] = "1"
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        apply_safe_env()


def _worker(rank, world_size, device, port, out_dir, fn, args, timeout_s=None):
    """The entry point of every spawned process (importable, so spawn can find it).

    Under the batch grader (:mod:`course_utils.guard`'s settings in the environment) each rank installs
    the same write guard as the process that started it, before it rebuilds the learner's function.
    """
    from ..guard import install_from_environment

    install_from_environment()
    apply_safe_env()
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import course_utils  # noqa: F401  (before triton: switches the interpreter on without a GPU)
    import torch
    import torch.distributed as dist

    if device == "cpu":
        import warnings

        torch.set_num_threads(1)
        # The interpreter computes exp2 of masked-out scores before the mask zeroes them:
        # NumPy's overflow warnings there are noise, not errors.
        warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning)
        backend = "gloo"
    else:
        torch.cuda.set_device(rank)
        backend = "nccl"
    kwargs = {}
    if timeout_s:
        import datetime

        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if device != "cpu":
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, **kwargs)
    try:
        result = _unwrap(fn)(rank, world_size, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, nproc: int = 2, args=(), *, device: str = "cpu", timeout_s: float | None = None):
    """Run ``fn(rank, world_size, *args)`` in ``nproc`` new processes; return their results.

    ``device="cpu"``: gloo, tensors on the CPU, Triton in its interpreter
    (``TRITON_INTERPRET=1`` and one thread per process); ``device="cuda"``:
    NCCL, one GPU per rank. The process group is initialised before ``fn``
    runs and destroyed after. ``fn`` must be importable (defined in a module),
    or defined in a notebook (then it travels as source, see
    :class:`_Shipped`). Results must be picklable; a failure in any
    process raises here with its traceback. ``timeout_s`` bounds the whole
    run (the processes are stopped and ``TimeoutError`` raised) and each
    communication (the process group's timeout).
    """
    import torch.multiprocessing as mp

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}.")
    if device == "cpu":
        from ..environment import interpreter_problem

        if interpreter_problem():  # the CPU processes run the kernels in the interpreter
            raise RuntimeError("the CPU processes cannot run Triton's interpreter here: " + interpreter_problem())
    apply_safe_env()
    with tempfile.TemporaryDirectory(prefix="ring_") as out_dir, _child_environment(device):
        context = mp.start_processes(
            _worker, args=(nproc, device, _free_port(), out_dir, portable(fn), tuple(args), timeout_s),
            nprocs=nproc, join=False, start_method="spawn")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not context.join(timeout=0.5):
            if deadline is not None and time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join()
                raise TimeoutError(f"the {nproc} processes did not finish within {timeout_s:g} s and were stopped.")
        results = []
        for rank in range(nproc):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


# -----------------------------------------------------------------------------
# The demo: ring attention against single-process attention
# -----------------------------------------------------------------------------
def demo_case(rank, world_size, n=128, d=32, n_q_heads=4, n_kv_heads=2, causal=True, layout="zigzag",
              seed=0, dtype_name="float32", group=None):
    """Run on every rank: ring attention forward and backward on this rank's shards.

    Every rank draws the same full ``q, k, v, do`` from ``seed`` (rounded to
    ``dtype_name``), keeps its shards, and returns NumPy float64 copies of
    ``o, dq, dk, dv`` for its shard (:func:`demo_errors` unshards and
    compares). ``rank``/``world_size`` are the ones within ``group``.
    """
    import torch

    import course_utils

    device = course_utils.DEVICE
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn((1, h, n, d), generator=g).to(dtype) for h in (n_q_heads, n_kv_heads, n_kv_heads, n_q_heads)]
    q, k, v, do = (shard_sequence(t, rank, world_size, layout).to(device) for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = ring_attention(q, k, v, causal, layout=layout, group=group)
    o.backward(do)
    return [t.detach().double().cpu().numpy() for t in (o, q.grad, k.grad, v.grad)]


def demo_cases(rank, world_size, cases):
    """:func:`demo_case` for each dict of keyword arguments in ``cases``, in one process group (spawning is slow)."""
    return [demo_case(rank, world_size, **case) for case in cases]


def demo_errors(results, world_size, n=128, d=32, n_q_heads=4, n_kv_heads=2, causal=True, layout="zigzag", seed=0,
                dtype_name="float32"):
    """Largest absolute errors of the ring's ``o, dq, dk, dv`` against float64 single-process attention.

    ``results``: what :func:`demo_case` returned on each rank, in rank order;
    the other arguments: the case's (the same inputs are drawn again here).
    """
    import torch

    from .. import references as ref

    g = torch.Generator().manual_seed(seed)
    full = [torch.randn((1, h, n, d), generator=g) for h in (n_q_heads, n_kv_heads, n_kv_heads, n_q_heads)]
    q, k, v, do = (t.to(getattr(torch, dtype_name)).double().numpy() for t in full)
    want = [ref.attention(q, k, v, causal=causal), *ref.attention_backward(q, k, v, do, causal=causal)]
    errors = {}
    for index, name in enumerate(("o", "dq", "dk", "dv")):
        got = unshard_sequence([r[index] for r in results], world_size, layout)
        errors[name] = float(np.max(np.abs(got - want[index])))
    return errors
