"""The attention implementations the benchmark puts side by side."""

from __future__ import annotations

import math

from .cases import LESSON11_PROVIDERS


def naive_attention(q, k, v, causal: bool, sm_scale: float):
    """Attention the textbook way: the whole ``[B, H, N, N]`` score matrix in memory."""
    import torch

    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2))
    s.mul_(sm_scale)
    if causal:
        n = q.shape[-2]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        s.masked_fill_(future, float("-inf"))
    p = torch.softmax(s, dim=-1)
    del s
    return torch.matmul(p, v)


def compiled_attention(backend: str = "inductor"):
    """``naive_attention`` through ``torch.compile``: what a user would try before writing a kernel.

    Inductor fuses the scale, mask and softmax and may pattern-match the whole
    thing to SDPA; whatever it does, this is the baseline a hand-written
    kernel has to beat to be worth its code. Dynamo's caches are reset first:
    every shape of the sweep compiles once, outside the timed region (the
    first call compiles), and the sweep has more shapes than Dynamo's
    recompilation limit.
    """
    import torch

    torch._dynamo.reset()
    return torch.compile(naive_attention, dynamic=False, backend=backend)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def make_provider(name: str, q, k, v, causal: bool):
    """A zero-argument callable running provider ``name`` on these inputs, and a note.

    Returns ``(fn, note)``; ``fn()`` returns the output ``o`` (or ``(o, lse)``).
    Raises ``RuntimeError`` if the provider cannot run these inputs here.
    """
    import torch
    import torch.nn.functional as F

    sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if name == "naive":
        return (lambda: naive_attention(q, k, v, causal, sm_scale)), ""
    if name == "compiled":
        fn = compiled_attention()
        return (lambda: fn(q, k, v, causal, sm_scale)), "torch.compile of naive_attention (default mode, static shapes)"
    if name in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(name)
        gqa = k.shape[1] != q.shape[1]

        def run(kk, vv, enable_gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=enable_gqa)

        try:
            run(k, v, gqa)
            return (lambda: run(k, v, gqa)), ""
        except RuntimeError:
            if not gqa:
                raise
        # This backend refuses GQA here: give it K/V expanded to every query
        # head (outside the timed region) and say so.
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        run(ke, ve, False)
        return (lambda: run(ke, ve, False)), "K/V expanded (backend has no GQA)"
    if name == "course":
        from ..kernels import forward

        return (lambda: forward.flash_attention_gqa_forward(q, k, v, causal=causal)), ""
    if name in LESSON11_PROVIDERS:  # bench fp8's providers, one copy
        from .fp8 import make_forward

        note = "e4m3 inputs, quantised per 128-token block outside the timing" if name.endswith("fp8") else ""
        return make_forward(name, q, k, v, causal), note
    if name == "fast":
        from ..kernels import fast

        reason = fast.unsupported_reason(q, k, v)
        note = f"fell back to the course kernel: {reason}" if reason else ""
        return (lambda: fast.attention_forward_fast(q, k, v, causal=causal)), note
    raise ValueError(f"unknown provider {name!r}")


_FLEX = {}


def flex_compiled():
    """``torch.compile(flex_attention)`` with static shapes, once a process, for lessons 08 and 12's benches; dynamo's
    cache made large enough for every case of their grids (one compilation per shape and mask)."""
    if "fn" not in _FLEX:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 1024)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]
