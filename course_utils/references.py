"""Float64 reference implementations the graders compare with.

Everything here is plain NumPy in float64 and written to be read: the graders
compare learners' answers with these functions, and the lessons teach the same
algorithms. The module is split into sections by course part; later parts
append their own sections (torch-facing helpers, the backward pass) below the
existing ones.

Conventions shared by every section:

- attention inputs are ``q`` of shape ``[..., Nq, d]`` and ``k``, ``v`` of
  shape ``[..., Nk, d]``; the leading axes are batch axes, and axis ``-3``
  (when present) is the head axis;
- ``sm_scale`` defaults to ``1 / sqrt(d)``;
- ``causal=True`` masks **top-left aligned**: query ``i`` sees keys
  ``j <= i``. This is what ``torch.nn.functional.scaled_dot_product_attention``
  does with ``is_causal=True`` (it builds ``ones(Nq, Nk).tril(0)``).
  FlashAttention >= 2.1 aligns the mask bottom-right instead when
  ``Nq != Nk`` (query ``i`` sees ``j <= i + Nk - Nq``); the two agree when
  ``Nq == Nk``. With top-left alignment every query sees at least key 0, so
  no row is ever fully masked;
- ``lse`` is the natural-log logsumexp of each query row's scaled (and
  masked) scores: ``lse[i] = log(sum_j exp(sm_scale * q[i] . k[j]))``;
- grouped-query attention (GQA): when ``q`` has more heads on axis ``-3``
  than ``k`` and ``v``, each kv head serves ``group_size = n_q_heads //
  n_kv_heads`` consecutive query heads, i.e. ``kv_head = q_head //
  group_size`` (the convention of torch's ``enable_gqa=True``);
- score modifications (lesson 12), in this order: ``s_ij = scale * q_i . k_j``;
  ``softcap = c``: ``s_ij <- c * tanh(s_ij / c)``; ``alibi_slopes`` (one
  slope ``m_h`` per query head): ``s_ij <- s_ij - m_h * |i - j|``. Key ``j``
  is visible from query ``i`` iff they lie in one segment of ``cu_seqlens``
  (:func:`document_mask`), AND ``j <= i`` if causal, AND the window/sink
  rule if ``window_size`` is given. ``sink_logits`` (one ``z_h`` per query
  head) join each row's denominator but have no value:
  ``lse_i = log(exp(z_h) + sum_visible exp(s_ij))``, ``p_ij = exp(s_ij -
  lse_i)``, ``o_i = sum_j p_ij v_j``. Positions ``i, j`` are those of the
  packed sequence, so the ``sink_size`` sink keys of lesson 08 are the first
  keys of the packed sequence (they serve the first document only).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    # Part 1: attention and the online softmax (NumPy)
    "softmax",
    "causal_mask",
    "window_mask",
    "repeat_kv_heads",
    "attention",
    "attention_lse",
    "document_mask",
    "online_softmax",
    "online_softmax_states",
    "tiled_attention",
]


# =============================================================================
# Part 1: attention and the online softmax (NumPy)
# =============================================================================


def softmax(x, axis=-1):
    """Numerically stable softmax of ``x`` along ``axis``, in float64.

    Subtracting each row's maximum first does not change the result
    (``softmax(x) == softmax(x - c)`` for any constant ``c`` per row) but
    makes the largest exponent ``exp(0) = 1``, so ``exp`` cannot overflow.
    A row that is entirely ``-inf`` has no softmax and comes out as NaN.
    """
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def causal_mask(n_q: int, n_k: int) -> np.ndarray:
    """Boolean ``[n_q, n_k]`` array, True where query ``i`` may see key ``j``.

    Top-left aligned: ``j <= i`` (see the module docstring for why, and how
    it differs from FlashAttention's bottom-right alignment when
    ``n_q != n_k``).
    """
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None]


def window_mask(n_q: int, n_k: int, window_size=None, sink_size: int = 0) -> np.ndarray:
    """Boolean ``[n_q, n_k]`` array for causal attention with a sliding window and sinks (lesson 08).

    Query ``i`` may see key ``j`` iff ``j <= i and (i - j < window_size or
    j < sink_size)``: the last ``window_size`` keys up to and including
    itself, plus the first ``sink_size`` keys of the sequence (never one
    after the query). ``window_size=None`` is no window (plain
    :func:`causal_mask`); ``sink_size=0`` is no sinks.
    """
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    if window_size is None:
        return j <= i
    return (j <= i) & ((i - j < window_size) | (j < sink_size))


def document_mask(cu_seqlens, n: int) -> np.ndarray:
    """Boolean ``[n, n]`` array, True where positions ``i`` and ``j`` lie in one document (lesson 12).

    ``cu_seqlens`` ``[S + 1]`` are the documents' boundaries in the packed
    sequence, ``0 = cu[0] < cu[1] < ... < cu[S] = n``: document ``s`` holds
    positions ``cu[s]`` to ``cu[s + 1] - 1`` (FlashAttention's varlen
    convention). The mask is block-diagonal, one block per document.
    """
    cu = np.asarray(cu_seqlens).reshape(-1)
    if cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be integers [S + 1] with S >= 1, not {cu.dtype} of shape {cu.shape}.")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 (the first document's start), not {cu[0]}.")
    if cu[-1] != n:
        raise ValueError(f"cu_seqlens must end at N = {n} (the packed length), not {cu[-1]}.")
    if np.any(np.diff(cu) <= 0):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty document), but it is {cu.tolist()}.")
    seg = np.searchsorted(cu, np.arange(n), side="right") - 1  # the document of each position
    return seg[:, None] == seg[None, :]


def _score_mask(n_q, n_k, causal, window_size, sink_size, cu_seqlens=None):
    """The boolean mask attention applies, or None; a window without causal is refused."""
    if window_size is None and not sink_size:
        mask = causal_mask(n_q, n_k) if causal else None
    elif not causal:
        raise ValueError("window_size and sink_size need causal=True: a sliding window here looks back only.")
    elif window_size is None:
        raise ValueError("sink_size needs a window_size: without a window every earlier key is visible already.")
    else:
        mask = window_mask(n_q, n_k, window_size, sink_size)
    if cu_seqlens is not None:
        if n_q != n_k:
            raise ValueError(f"cu_seqlens needs as many queries as keys, but there are {n_q} and {n_k}.")
        docs = document_mask(cu_seqlens, n_q)
        mask = docs if mask is None else mask & docs
    return mask


def _per_head(x, q, name):
    """``x`` [Hq] (one number per query head) shaped to broadcast against ``[..., Hq, Nq, Nk]``."""
    x = np.asarray(x, dtype=np.float64)
    if q.ndim < 3 or x.shape != (q.shape[-3],):
        heads = q.shape[-3] if q.ndim >= 3 else "no"
        raise ValueError(f"{name} must have one value per query head, shape ({heads},), not {x.shape}.")
    return x[:, None, None]


def _modified_scores(q, k, sm_scale, causal, window_size, sink_size, cu_seqlens, softcap, alibi_slopes):
    """``(s, t)``: the masked, modified scores ``[..., Nq, Nk]`` and ``tanh`` of the soft-cap (or None)."""
    s = sm_scale * (q @ np.swapaxes(k, -1, -2))
    t = None
    if softcap is not None:
        softcap = float(softcap)
        if not softcap > 0:
            raise ValueError(f"softcap must be a number above 0, not {softcap}.")
        t = np.tanh(s / softcap)
        s = softcap * t
    if alibi_slopes is not None:
        distance = np.abs(np.arange(q.shape[-2])[:, None] - np.arange(k.shape[-2])[None, :])
        s = s - _per_head(alibi_slopes, q, "alibi_slopes") * distance
    mask = _score_mask(q.shape[-2], k.shape[-2], causal, window_size, sink_size, cu_seqlens)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return s, t


def _softmax_stats(s, q, sink_logits):
    """``(m, l)`` per row ``[..., Nq, 1]``: the max and the sum ``exp(z - m) + sum_j exp(s_j - m)``."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    if sink_logits is None:
        return m, np.sum(np.exp(s - m), axis=-1, keepdims=True)
    z = np.broadcast_to(_per_head(sink_logits, q, "sink_logits")[..., 0:1], m.shape)
    m = np.maximum(m, z)  # the sink is a score like any other here: no row is ever empty
    return m, np.sum(np.exp(s - m), axis=-1, keepdims=True) + np.exp(z - m)


def repeat_kv_heads(q, k, v):
    """``k`` and ``v`` with their heads repeated to match ``q``'s (for GQA).

    If ``q`` has ``n_q_heads`` on axis ``-3`` and ``k``, ``v`` have
    ``n_kv_heads`` there, each kv head is repeated ``group_size = n_q_heads
    // n_kv_heads`` times in place, so query head ``h`` meets kv head
    ``h // group_size``. Equal head counts (or no head axis) return ``k`` and
    ``v`` unchanged.
    """
    if q.ndim < 3 or k.ndim < 3:
        return k, v
    n_q_heads, n_kv_heads = q.shape[-3], k.shape[-3]
    if n_q_heads == n_kv_heads:
        return k, v
    if n_kv_heads == 0 or n_q_heads % n_kv_heads:
        raise ValueError(
            f"{n_q_heads} query heads cannot be shared evenly among {n_kv_heads} kv heads"
        )
    group_size = n_q_heads // n_kv_heads
    return np.repeat(k, group_size, axis=-3), np.repeat(v, group_size, axis=-3)


def attention_lse(q, k, v, causal=False, scale=None, *, window_size=None, sink_size=0,
                  cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None):
    """Scaled dot-product attention and the logsumexp of each query row.

    ``q [..., Nq, d]``, ``k``/``v [..., Nk, d]`` (``v`` may have its own last
    size). Returns ``(o, lse)`` with ``o [..., Nq, d_v]`` and ``lse [..., Nq]``,
    ``lse`` being the natural-log logsumexp of the row's scaled, masked
    scores. ``scale`` defaults to ``1/sqrt(d)``; ``causal`` is top-left
    aligned; fewer kv heads than query heads means GQA (module docstring).
    ``window_size`` and ``sink_size`` (with ``causal=True``) apply
    :func:`window_mask` instead of the causal mask.

    Lesson 12's keywords (module docstring for the exact order):
    ``cu_seqlens`` (documents packed into one sequence, :func:`document_mask`;
    ``Nq == Nk``, the same documents for every batch element), ``softcap``
    (a float > 0), ``alibi_slopes`` and ``sink_logits`` (``[Hq]`` each; then
    ``lse`` includes ``exp(z_h)``, and a row that sees no key has ``o = 0``,
    ``lse = z_h``).
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    k, v = repeat_kv_heads(q, k, v)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s, _ = _modified_scores(q, k, sm_scale, causal, window_size, sink_size, cu_seqlens, softcap, alibi_slopes)
    m, l = _softmax_stats(s, q, sink_logits)
    p = np.exp(s - m)
    o = (p / l) @ v
    lse = (m + np.log(l))[..., 0]
    return o, lse


def attention(q, k, v, causal=False, scale=None, *, window_size=None, sink_size=0,
              cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None):
    """Scaled dot-product attention ``softmax(scale * q k^T) v``: the output only.

    Same arguments and conventions as :func:`attention_lse`.
    """
    return attention_lse(q, k, v, causal=causal, scale=scale, window_size=window_size, sink_size=sink_size,
                         cu_seqlens=cu_seqlens, softcap=softcap, alibi_slopes=alibi_slopes,
                         sink_logits=sink_logits)[0]


def online_softmax(x, block_size: int):
    """Softmax over the last axis, reading ``x`` block by block (the online softmax).

    One streaming pass keeps, per row, the running maximum ``m`` and the
    running sum ``l = sum exp(x_seen - m)``. When a block raises the maximum
    from ``m_old`` to ``m_new``, every term already in ``l`` was computed
    against ``m_old``; multiplying ``l`` by ``exp(m_old - m_new)`` re-bases
    them all at once. A final element-wise pass normalises. The last block
    may be shorter than ``block_size``.
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    m = np.full(x.shape[:-1], -np.inf)  # running max: nothing seen yet
    l = np.zeros(x.shape[:-1])  # running sum of exp(x_seen - m)
    for start in range(0, n, block_size):
        block = x[..., start : start + block_size]  # the tail block may be short
        m_new = np.maximum(m, np.max(block, axis=-1))
        # exp(-inf - m_new) = 0 on the first block, so l starts cleanly at 0.
        l = l * np.exp(m - m_new) + np.sum(np.exp(block - m_new[..., None]), axis=-1)
        m = m_new
    return np.exp(x - m[..., None]) / l[..., None]


def online_softmax_states(x, block_size: int) -> list[tuple[float, float]]:
    """The running ``(m, l)`` of :func:`online_softmax` after each block of a 1-D row.

    For pictures and widgets that step through the algorithm.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    m, l = -np.inf, 0.0
    states = []
    for start in range(0, x.size, block_size):
        block = x[start : start + block_size]
        m_new = max(m, float(block.max()))
        l = l * math.exp(m - m_new) + float(np.exp(block - m_new).sum())
        m = m_new
        states.append((m, l))
    return states


def tiled_attention(q, k, v, block_m: int, block_n: int, causal=False):
    """Attention computed tile by tile, as FlashAttention's forward pass does.

    Queries are processed ``block_m`` rows at a time; for each query block
    the keys and values stream past ``block_n`` rows at a time, and the
    online softmax's running max ``m_i``, running sum ``l_i`` and unnormalised
    output ``acc`` are rescaled by ``alpha = exp(m_old - m_new)`` whenever the
    max grows. The ``Nq x Nk`` score matrix never exists: only one
    ``block_m x block_n`` tile at a time. With ``causal``, key blocks that
    start after a query block's last row are skipped entirely (every score
    there is masked), and only tiles crossing the diagonal need the mask.

    Returns ``(o, lse)`` like :func:`attention_lse`; ``sm_scale = 1/sqrt(d)``.
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    k, v = repeat_kv_heads(q, k, v)
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    sm_scale = 1.0 / math.sqrt(d)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    o = np.empty(batch + (n_q, v.shape[-1]))
    lse = np.empty(batch + (n_q,))
    for q_start in range(0, n_q, block_m):
        q_end = min(q_start + block_m, n_q)
        q_blk = q[..., q_start:q_end, :]
        rows = q_end - q_start
        m_i = np.full(batch + (rows,), -np.inf)
        l_i = np.zeros(batch + (rows,))
        acc = np.zeros(batch + (rows, v.shape[-1]))
        # Causal: no query in this block sees a key at or beyond q_end.
        kv_stop = min(n_k, q_end) if causal else n_k
        for k_start in range(0, kv_stop, block_n):
            k_end = min(k_start + block_n, n_k)
            s = sm_scale * (q_blk @ np.swapaxes(k[..., k_start:k_end, :], -1, -2))
            if causal and k_end - 1 > q_start:  # the tile crosses the diagonal
                allowed = np.arange(k_start, k_end)[None, :] <= np.arange(q_start, q_end)[:, None]
                s = np.where(allowed, s, -np.inf)
            # Every row saw key 0 in the first tile, so m_i is finite from then on
            # and a row that is fully masked in a later tile just adds exp(-inf) = 0.
            m_new = np.maximum(m_i, np.max(s, axis=-1))
            alpha = np.exp(m_i - m_new)  # how much the old terms shrink
            p = np.exp(s - m_new[..., None])
            l_i = l_i * alpha + np.sum(p, axis=-1)
            acc = acc * alpha[..., None] + p @ v[..., k_start:k_end, :]
            m_i = m_new
        o[..., q_start:q_end, :] = acc / l_i[..., None]
        lse[..., q_start:q_end] = m_i + np.log(l_i)
    return o, lse


# =============================================================================
# Part 4: the backward pass (NumPy)
# =============================================================================
# Gradients of attention for lesson 07 and its graders
# (course_utils/grading/part4_backward.py). Same conventions as above; with
# GQA a kv head's gradient is the SUM of the contributions of every query
# head in its group: the forward copies each kv head to group_size query
# heads, and the chain rule through a copy adds the copies' gradients.

__all__ += ["attention_backward", "tiled_attention_backward", "sum_kv_groups"]


def _group_size_of(q, k) -> int:
    """Query heads per kv head (1 without a head axis or without GQA)."""
    if q.ndim < 3 or k.ndim < 3 or q.shape[-3] == k.shape[-3]:
        return 1
    n_q_heads, n_kv_heads = q.shape[-3], k.shape[-3]
    if n_kv_heads == 0 or n_q_heads % n_kv_heads:
        raise ValueError(
            f"{n_q_heads} query heads cannot be shared evenly among {n_kv_heads} kv heads"
        )
    return n_q_heads // n_kv_heads


def _check_backward_shapes(q, k, v, do):
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim or do.ndim != q.ndim:
        raise ValueError(
            f"q, k, v and do must be [..., N, d] arrays of one rank; got shapes "
            f"{q.shape}, {k.shape}, {v.shape}, {do.shape}"
        )
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"q and k need the same head dim, k and v the same [..., N]; got {q.shape}, {k.shape}, {v.shape}"
        )
    if do.shape != q.shape[:-1] + v.shape[-1:]:
        raise ValueError(f"do must have shape {q.shape[:-1] + v.shape[-1:]}, got {do.shape}")
    return _group_size_of(q, k)


def sum_kv_groups(dx, group_size: int):
    """Sum per-query-head gradients ``[..., Hq, N, d]`` onto their kv heads ``[..., Hq // group_size, N, d]``.

    The adjoint of :func:`repeat_kv_heads`: query heads ``g * group_size`` to
    ``(g + 1) * group_size - 1`` all read kv head ``g``, so kv head ``g``'s
    gradient adds up theirs.
    """
    dx = np.asarray(dx, dtype=np.float64)
    if group_size == 1:
        return dx
    shape = dx.shape[:-3] + (dx.shape[-3] // group_size, group_size) + dx.shape[-2:]
    return dx.reshape(shape).sum(axis=-3)


def attention_backward(q, k, v, do, causal=False, scale=None, *, window_size=None, sink_size=0,
                       cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None):
    """Gradients ``(dq, dk, dv)`` of ``o = attention(q, k, v)`` for an upstream ``do``.

    The textbook chain rule, with the whole score matrix in memory (fine at
    the sizes a reference is used for)::

        S = scale * Q K^T,  P = softmax(S),  O = P V
        dV = P^T dO,        dP = dO V^T
        dS = P * (dP - D),  D = rowsum(dO * O)   (equal to rowsum(P * dP))
        dQ = scale * dS K,  dK = scale * dS^T Q

    ``D`` comes from the softmax's Jacobian: ``dS_ij = P_ij (dP_ij - sum_k
    P_ik dP_ik)``, and ``sum_k P_ik dP_ik = dO_i . (sum_k P_ik V_k) = dO_i . O_i``.
    With GQA, dK and dV are summed over each group's query heads.
    ``window_size``/``sink_size`` mask as in :func:`attention_lse`.

    Lesson 12's keywords as in :func:`attention_lse`. ``P = exp(S - lse)``
    with the sink inside ``lse``; ``D`` is still ``rowsum(dO * O)`` (the sink
    has no value, so its ``dP`` is 0). The soft-cap multiplies ``dS`` by its
    derivative ``1 - tanh(S / c)^2`` before ``dQ``/``dK``; ALiBi's bias has no
    gradient (it depends on positions only). With ``sink_logits`` the return
    value is ``(dq, dk, dv, d_sink_logits)``, ``d_sink_logits [Hq]`` =
    ``sum over batch and queries of -exp(z_h - lse_i) * D_i``; without it,
    ``(dq, dk, dv)`` as always.
    """
    q, k, v, do = (np.asarray(t, dtype=np.float64) for t in (q, k, v, do))
    group_size = _check_backward_shapes(q, k, v, do)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    k_rep, v_rep = repeat_kv_heads(q, k, v)
    s, t = _modified_scores(q, k_rep, sm_scale, causal, window_size, sink_size, cu_seqlens, softcap, alibi_slopes)
    m, l = _softmax_stats(s, q, sink_logits)
    lse = m + np.log(l)
    p = np.exp(s - lse)
    o = p @ v_rep
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v_rep, -1, -2)
    delta = np.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)  # d(c * tanh(x / c)) / dx
    dq = sm_scale * (ds @ k_rep)
    dk = sm_scale * (np.swapaxes(ds, -1, -2) @ q)
    grads = (dq, sum_kv_groups(dk, group_size), sum_kv_groups(dv, group_size))
    if sink_logits is None:
        return grads
    z = _per_head(sink_logits, q, "sink_logits")[..., 0:1]
    d_sink = -np.exp(z - lse) * delta  # [..., Hq, Nq, 1]: each row's share
    d_sink = d_sink.reshape(-1, q.shape[-3], q.shape[-2]).sum(axis=(0, 2))
    return grads + (d_sink,)


def tiled_attention_backward(q, k, v, o, lse, do, block_m: int, block_n: int, causal=False, scale=None):
    """The FlashAttention-2 backward pass, tile by tile, in readable NumPy.

    No ``Nq x Nk`` array ever exists. First ``D = rowsum(dO * O)``, one number
    per query row. Then, for each block of ``block_n`` keys, that block's dK
    and dV stay local (in a GPU kernel: in registers) while every block of
    ``block_m`` queries streams past; the probabilities are recomputed from
    Q, K and the saved natural-log ``lse``: ``P = exp(scale * Q K^T - lse)``,
    which is already normalised. dQ is accumulated across key blocks (the
    Triton version gives dQ a kernel of its own, so that no two programs add
    into the same rows). With ``causal``, query blocks that end before the
    key block starts are skipped, and tiles crossing the diagonal are masked.

    ``o`` and ``lse`` (shape ``q.shape[:-1]``) are what the forward saved.
    """
    q, k, v, o, lse, do = (np.asarray(t, dtype=np.float64) for t in (q, k, v, o, lse, do))
    group_size = _check_backward_shapes(q, k, v, do)
    if lse.shape != q.shape[:-1] or o.shape != do.shape:
        raise ValueError(f"lse must have shape {q.shape[:-1]} and o shape {do.shape}; got {lse.shape}, {o.shape}")
    block_m, block_n = int(block_m), int(block_n)
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block sizes must be positive, got block_m={block_m}, block_n={block_n}")
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    k, v = repeat_kv_heads(q, k, v)
    n_q, n_k = q.shape[-2], k.shape[-2]
    delta = np.sum(do * o, axis=-1)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for k_start in range(0, n_k, block_n):
        k_end = min(k_start + block_n, n_k)
        k_blk, v_blk = k[..., k_start:k_end, :], v[..., k_start:k_end, :]
        dk_blk, dv_blk = np.zeros_like(k_blk), np.zeros_like(v_blk)
        # Causal: a query block whose last row is before k_start sees none of these keys.
        q_first = (k_start // block_m) * block_m if causal else 0
        for q_start in range(q_first, n_q, block_m):
            q_end = min(q_start + block_m, n_q)
            q_blk, do_blk = q[..., q_start:q_end, :], do[..., q_start:q_end, :]
            p = np.exp(sm_scale * (q_blk @ np.swapaxes(k_blk, -1, -2)) - lse[..., q_start:q_end, None])
            if causal:
                p = np.where(np.arange(k_start, k_end)[None, :] <= np.arange(q_start, q_end)[:, None], p, 0.0)
            dv_blk += np.swapaxes(p, -1, -2) @ do_blk
            dp = do_blk @ np.swapaxes(v_blk, -1, -2)
            ds = p * (dp - delta[..., q_start:q_end, None])
            dq[..., q_start:q_end, :] += sm_scale * (ds @ k_blk)
            dk_blk += sm_scale * (np.swapaxes(ds, -1, -2) @ q_blk)
        dk[..., k_start:k_end, :] = dk_blk
        dv[..., k_start:k_end, :] = dv_blk
    return dq, sum_kv_groups(dk, group_size), sum_kv_groups(dv, group_size)


# =============================================================================
# Part 5: decoding with a KV cache (lesson 09)
# =============================================================================
# ``q`` is ``[B, Hq, T, d]``: T new tokens per sequence. ``k``, ``v`` are the
# caches ``[B, Hkv, N_max, d]``; ``cache_seqlens[b]`` counts the valid tokens
# of sequence b, the new ones included, so new token t sits at position
# ``cache_seqlens[b] - T + t`` and sees the keys j <= that position (the
# bottom-right alignment of the causal mask). Entries past a sequence's
# length are never read (they may be NaN). Split s of a sequence of length L
# covers the keys ``[s * chunk, min((s + 1) * chunk, L))``, ``chunk =
# ceil(L / num_splits)``; a row that sees no key of its split has lse = -inf
# and o = 0.

__all__ += ["decode_attention", "decode_partials", "merge_partials", "gather_pages"]


def _decode_range(q, k, v, seq_len: int, lo: int, hi: int, scale=None):
    """``(o, lse)`` of one sequence's new queries ``[..., T, d]`` over its keys ``[lo, hi)``."""
    t = q.shape[-2]
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    k, v = repeat_kv_heads(q, k[..., lo:hi, :], v[..., lo:hi, :])
    pos = seq_len - t + np.arange(t)
    keep = np.arange(lo, hi)[None, :] <= pos[:, None]
    s = np.where(keep, sm_scale * (q @ np.swapaxes(k, -1, -2)), -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    l = np.sum(p, axis=-1, keepdims=True)
    o = np.where(l > 0, (p @ v) / np.where(l > 0, l, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    return o, lse


def decode_partials(q, k, v, cache_seqlens, num_splits: int, scale=None):
    """The partial results of split-KV decoding: ``o_parts [B, Hq, T, S, d]``, ``lse_parts [B, Hq, T, S]``.

    Each partial is normalised by its own sum (``o_s = sum_j p_j v_j / sum_j
    p_j`` over the split's visible keys) and ``lse_s`` is its natural-log
    logsumexp; ``merge_partials`` of them is :func:`decode_attention`.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Hq, T, d = q.shape
    o_parts = np.zeros((B, Hq, T, num_splits, v.shape[-1]))
    lse_parts = np.full((B, Hq, T, num_splits), -np.inf)
    for b in range(B):
        L = int(cache_seqlens[b])
        chunk = -(-L // num_splits)
        for s in range(num_splits):
            lo, hi = min(s * chunk, L), min((s + 1) * chunk, L)
            o_parts[b, :, :, s], lse_parts[b, :, :, s] = _decode_range(q[b], k[b], v[b], L, lo, hi, scale)
    return o_parts, lse_parts


def merge_partials(o_parts, lse_parts):
    """Merge partial attention results by their logsumexp: ``(o [..., d], lse [...])``.

    ``o_parts [..., S, d]`` are the partial outputs (each normalised by its own
    sum) and ``lse_parts [..., S]`` their logsumexps. The whole row's lse is
    ``m + log(sum_s exp(lse_s - m))`` with ``m = max_s lse_s`` (the shift keeps
    every exponent <= 0), and ``o = sum_s exp(lse_s - lse) o_s``: each part
    weighted by its share of the row's total sum. Parts with ``lse = -inf``
    (no key) weigh nothing.
    """
    o_parts = np.asarray(o_parts, dtype=np.float64)
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    m = np.max(lse_parts, axis=-1, keepdims=True)
    w = np.exp(lse_parts - m)
    total = np.sum(w, axis=-1, keepdims=True)
    lse = (m + np.log(total))[..., 0]
    o = np.sum((w / total)[..., None] * o_parts, axis=-2)
    return o, lse


def gather_pages(cache, block_table, n_tokens: int):
    """A paged cache ``[num_pages, H, page_size, d]`` as a contiguous ``[B, H, n_tokens, d]``.

    Page ``block_table[b, p]`` holds tokens ``p * page_size .. (p + 1) *
    page_size - 1`` of sequence b (vLLM's layout).
    """
    cache = np.asarray(cache)
    block_table = np.asarray(block_table)
    page_size = cache.shape[2]
    n_pages = -(-n_tokens // page_size)
    pages = cache[block_table[:, :n_pages]]  # [B, n_pages, H, page_size, d]
    B, _, H, _, d = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(B, H, n_pages * page_size, d)[:, :, :n_tokens]


def decode_attention(q, k, v, cache_seqlens, block_table=None, scale=None):
    """Decoding attention over a KV cache, float64: ``(o [B, Hq, T, d], lse [B, Hq, T])``.

    ``k``/``v`` are ``[B, Hkv, N_max, d]``, or paged ``[num_pages, Hkv,
    page_size, d]`` with ``block_table [B, max_pages]``.
    """
    if block_table is not None:
        n = int(np.max(np.asarray(cache_seqlens)))
        k, v = gather_pages(k, block_table, n), gather_pages(v, block_table, n)
    o, lse = decode_partials(q, k, v, cache_seqlens, 1, scale)
    return o[:, :, :, 0], lse[..., 0]
