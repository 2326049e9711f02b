"""The course's Triton kernels: one copy of each, importable and documented.

Public API (torch tensors ``[B, H, N, D]``)::

    o = flash_attention(q, k, v, causal=False, *, window_size=None, sink_size=0,
                        cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None)
    o, lse = flash_attention_with_lse(q, k, v, causal=False, *, window_size=None, sink_size=0,
                                      cu_seqlens=None, softcap=None, alibi_slopes=None, sink_logits=None)

``q`` is ``[B, Hq, N, D]``, ``k`` and ``v`` are ``[B, Hkv, N, D]`` with
``Hq`` a multiple of ``Hkv`` (MHA, GQA and MQA), any strides, fp16, bf16 (on
a GPU) or fp32, head dims 16 to 256. ``lse`` is float32 ``[B, Hq, N]``: the
natural-log logsumexp of each query row's scaled scores. Bad input raises a
``ValueError`` of one sentence.

Decoding over a KV cache (lesson 09; :mod:`.decode`, split-KV with a paged
variant; on a Hopper GPU, caches of 64k keys or more are cut into equal shares
per program instead, :mod:`.fast_decode`)::

    o = decode_attention(q, k_cache, v_cache, cache_seqlens, *, num_splits=None, block_table=None)

FP8 (e4m3) forward (lesson 11; :mod:`.fp8`, one scale per 128-token block of each head)::

    x8, scale = quantize_fp8(x, block_size=128)
    o = flash_attention_fp8(q, k, v, causal=False, *, q_scale=None, k_scale=None, v_scale=None, block_size=128)

Sliding window and sinks (lesson 08), with ``causal=True``: key ``j`` is
visible from query ``i`` iff ``j <= i and (i - j < window_size or j <
sink_size)``. A window of at least ``N`` keys hides nothing more than the
causal mask (:func:`.dispatch.window_in_effect`): such a call is plain causal
attention and runs its kernels. Other windows run lesson 08's kernels
(:func:`.forward.flash_attention_window_forward` and the window kernels of
:mod:`.backward`), except the forward on a Hopper GPU for the shapes the
:mod:`.fast` kernel takes: there :mod:`.fast_window` runs lesson 08's phases
on lesson 06's machinery.

Packed documents and score modifications (lesson 12), in any combination with
each other, ``causal`` and the window: ``cu_seqlens`` (int32 ``[S + 1]`` on
the inputs' device, ``0 = cu[0] < ... < cu[S] = N``, B == 1) makes key ``j``
visible from query ``i`` only within one document; ``softcap = c`` (a float >
0) turns each score ``s`` into ``c * tanh(s / c)``; ``alibi_slopes`` (float32
``[Hq]``) then subtracts ``m_h * |i - j|``; ``sink_logits`` (float32 ``[Hq]``,
differentiable) join each row's denominator with no value: ``lse_i =
log(exp(z_h) + sum_j exp(s_ij))``. Positions are the packed sequence's, so
lesson 08's ``sink_size`` sink keys are its first keys (the first document's).
Such calls run kernel D
(:func:`.forward.flash_attention_mods_forward`, and the ``_mods`` kernels of
:mod:`.backward`) on every machine; each query block visits only the tiles its
documents, causality and window leave visible, and masks only partial ones.

Modules: :mod:`.backward` holds the backward kernels and the autograd
wiring (lesson 07), :mod:`.fast` holds the Hopper-tuned forward kernel (lesson 06),
:mod:`.forward` holds the lesson kernels (04's
``flash_attention_kernel``, 05's ``_flash_attention_forward_gqa_kernel``)
and their launchers. :mod:`.dispatch` is the one place that validates a call
and picks which forward kernel runs; both public functions and
:class:`.backward.FlashAttentionFunction` go through it (imports point
downward only: no submodule imports this package face).
"""

from __future__ import annotations

import torch

from . import decode, dispatch, fast, fast_backward, fast_decode, forward, fp8
from .backward import FlashAttentionFunction
from .fast_decode import decode_attention
from .dispatch import check_call, launch_forward, window_in_effect
from .fp8 import flash_attention_fp8, quantize_fp8
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
    "quantize_fp8",
    "flash_attention_fp8",
    "fp8",
]


def flash_attention(q, k, v, causal: bool = False, *, window_size=None, sink_size=0, cu_seqlens=None, softcap=None,
                    alibi_slopes=None, sink_logits=None):
    """Attention ``softmax(q k^T / sqrt(D)) v`` per head, by Triton kernels.

    ``q``: ``[B, Hq, N, D]``; ``k, v``: ``[B, Hkv, N, D]`` (``Hq`` a multiple
    of ``Hkv``). ``causal`` hides from each query the keys after it;
    ``window_size`` (with ``causal``) also the keys ``window_size`` or more
    positions back, except the first ``sink_size`` keys. Lesson 12:
    ``cu_seqlens`` (int32 ``[S + 1]``, B == 1) keeps packed documents apart,
    ``softcap`` caps the scores at ``c * tanh(s / c)``, ``alibi_slopes``
    (float32 ``[Hq]``) subtracts ``m_h * |i - j|``, ``sink_logits`` (float32
    ``[Hq]``) adds ``exp(z_h)`` to each row's denominator. Returns
    ``o`` with ``q``'s shape and dtype. Differentiable in ``q, k, v`` and
    ``sink_logits``: when one requires grad, the backward pass runs the Triton
    kernels of :mod:`.backward` (lesson 07), which rebuild the softmax from the
    saved ``lse`` (or :mod:`.fast_backward`'s, where
    ``fast_backward.AUTOGRAD_CONFIG`` is set and applies).
    """
    mods = dict(cu_seqlens=cu_seqlens, softcap=softcap, alibi_slopes=alibi_slopes, sink_logits=sink_logits)
    check_call(q, k, v, causal, window_size, sink_size, **mods)
    window_size, sink_size = window_in_effect(q, window_size, sink_size)  # a window of N or more: plain causal
    inputs = (q, k, v) if sink_logits is None else (q, k, v, sink_logits)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        # lesson 07's autograd function, or the fast backward's where one is configured (fast_backward.AUTOGRAD_CONFIG:
        # the Gluon backward by default) and applies to this call (a Hopper GPU): decided here, so elsewhere grad_fn
        # is lesson 07's
        config = fast_backward.autograd_config(q, k, v, causal, window_size, sink_size, **mods)
        # validated=True: the autograd function's forward does not check the call again (nor, with the fast
        # backward, resolve its configuration again: it is passed)
        args = (q, k, v, bool(causal), window_size, sink_size, True, cu_seqlens, softcap, alibi_slopes, sink_logits)
        if config is None:
            return FlashAttentionFunction.apply(*args)
        return fast_backward.FastBackwardFunction.apply(*args, config)
    return launch_forward(q, k, v, bool(causal), window_size, sink_size, **mods)[0]


def flash_attention_with_lse(q, k, v, causal: bool = False, *, window_size=None, sink_size=0, cu_seqlens=None,
                             softcap=None, alibi_slopes=None, sink_logits=None):
    """Like :func:`flash_attention`, also returning ``lse`` (float32 ``[B, Hq, N]``).

    ``lse[b, h, i] = log(sum_j exp(s_ij))`` with ``s = q k^T / sqrt(D)``
    (masked keys excluded, modified scores with lesson 12's keywords, and
    ``exp(z_h)`` inside the sum with ``sink_logits``): the statistic the
    backward pass uses to rebuild the softmax ``p_ij = exp(s_ij - lse_i)``
    without storing it. Not differentiable.
    """
    mods = dict(cu_seqlens=cu_seqlens, softcap=softcap, alibi_slopes=alibi_slopes, sink_logits=sink_logits)
    check_call(q, k, v, causal, window_size, sink_size, **mods)
    window_size, sink_size = window_in_effect(q, window_size, sink_size)  # a window of N or more: plain causal
    return launch_forward(q, k, v, bool(causal), window_size, sink_size, **mods)
