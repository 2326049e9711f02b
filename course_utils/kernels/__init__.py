"""The course's Triton kernels: one copy of each, importable and documented.

Public API (torch tensors ``[B, H, N, D]``)::

    o = flash_attention(q, k, v, causal=False, *, window_size=None, sink_size=0)
    o, lse = flash_attention_with_lse(q, k, v, causal=False, *, window_size=None, sink_size=0)

``q`` is ``[B, Hq, N, D]``, ``k`` and ``v`` are ``[B, Hkv, N, D]`` with
``Hq`` a multiple of ``Hkv`` (MHA, GQA and MQA), any strides, fp16, bf16 (on
a GPU) or fp32, head dims 16 to 256. ``lse`` is float32 ``[B, Hq, N]``: the
natural-log logsumexp of each query row's scaled scores. Bad input raises a
``ValueError`` of one sentence.

Decoding over a KV cache (lesson 09; :mod:`.decode`, split-KV with a paged
variant)::

    o = decode_attention(q, k_cache, v_cache, cache_seqlens, *, num_splits=None, block_table=None)

Sliding window and sinks (lesson 08), with ``causal=True``: key ``j`` is
visible from query ``i`` iff ``j <= i and (i - j < window_size or j <
sink_size)``. Such calls run lesson 08's kernels
(:func:`.forward.flash_attention_window_forward` and the window kernels of
:mod:`.backward`) on every machine: the Hopper-tuned :mod:`.fast` kernel
serves plain attention only.

Modules: :mod:`.backward` holds the backward kernels and the autograd
wiring (lesson 07), :mod:`.fast` holds the Hopper-tuned forward kernel (lesson 06),
:mod:`.forward` holds the lesson kernels (04's
``flash_attention_kernel``, 05's ``_flash_attention_forward_gqa_kernel``)
and their launchers. Both public functions go through :func:`_forward`, the
one place that picks which forward kernel runs.
"""

from __future__ import annotations

import torch

from . import fast, forward
from . import decode
from .decode import decode_attention
from .forward import (flash_attention_forward, flash_attention_gqa_forward, flash_attention_window_forward,
                      validate, validate_window)

__all__ = [
    "flash_attention",
    "flash_attention_with_lse",
    "flash_attention_forward",
    "flash_attention_gqa_forward",
    "flash_attention_window_forward",
    "validate",
    "validate_window",
    "forward",
    "decode_attention",
    "decode",
]


def _forward(q, k, v, causal: bool, window_size=None, sink_size=0):
    """The dispatch point: run a forward kernel and return ``(o, lse)``.

    With a window (lesson 08), the window kernel of :mod:`.forward` on every
    machine. Otherwise, on a Hopper GPU, for the shapes it covers (bf16/fp16,
    D of 64 or 128, N a multiple of 64), the autotuned kernel of :mod:`.fast`
    (lesson 06); for everything else, and in the interpreter, the course's
    GQA kernel from lesson 05, which handles MHA, GQA and MQA, causal or not.
    """
    if window_size is not None:
        return flash_attention_window_forward(q, k, v, window_size=window_size, sink_size=sink_size)
    if fast.is_supported(q, k, v):
        return fast.attention_forward_fast(q, k, v, causal=causal)
    return flash_attention_gqa_forward(q, k, v, causal=causal)


def flash_attention(q, k, v, causal: bool = False, *, window_size=None, sink_size=0):
    """Attention ``softmax(q k^T / sqrt(D)) v`` per head, by Triton kernels.

    ``q``: ``[B, Hq, N, D]``; ``k, v``: ``[B, Hkv, N, D]`` (``Hq`` a multiple
    of ``Hkv``). ``causal`` hides from each query the keys after it;
    ``window_size`` (with ``causal``) also the keys ``window_size`` or more
    positions back, except the first ``sink_size`` keys. Returns
    ``o`` with ``q``'s shape and dtype. Differentiable: when an input requires
    grad, the backward pass runs the Triton kernels of :mod:`.backward`
    (lesson 07), which rebuild the softmax from the saved ``lse``.
    """
    validate(q, k, v)
    validate_window(causal, window_size, sink_size)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        from .backward import FlashAttentionFunction

        return FlashAttentionFunction.apply(q, k, v, bool(causal), window_size, sink_size)
    return _forward(q, k, v, bool(causal), window_size, sink_size)[0]


def flash_attention_with_lse(q, k, v, causal: bool = False, *, window_size=None, sink_size=0):
    """Like :func:`flash_attention`, also returning ``lse`` (float32 ``[B, Hq, N]``).

    ``lse[b, h, i] = log(sum_j exp(s_ij))`` with ``s = q k^T / sqrt(D)``
    (masked keys excluded): the statistic the backward pass uses to rebuild
    the softmax ``p_ij = exp(s_ij - lse_i)`` without storing it.
    """
    validate(q, k, v)
    validate_window(causal, window_size, sink_size)
    return _forward(q, k, v, bool(causal), window_size, sink_size)
