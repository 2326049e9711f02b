"""The order of V's keys that lesson 11's Gluon FP8 forward reads: one table, below both modules that use it.

Hopper's FP8 ``wgmma`` takes ``P V``'s A operand from registers four 8-bit keys at a time, and the scores come out
of ``Q Kᵀ`` two keys at a time in another order: of each 32 keys a thread holds ``2t, 2t+1, 8+2t, 9+2t`` (and the
same 16 on), where the operand wants ``4t ... 4t+3``. ``hopper_ws`` hands P over without moving it, as if key
``h*16 + g*8 + t*2 + e`` were key ``h*16 + t*4 + g*2 + e``; the sum ``P V`` stays the same when V's keys are
relabelled alike, so V's K-major copy holds at position ``k`` key :data:`V_KEY_ORDER` ``[k]`` (of its 32).
``fp8.transpose_keys(v8, p_order=True)`` makes that copy in its one pass over V; :func:`keys_in_p_order` reorders
a plain copy. Imports torch only.
"""

from __future__ import annotations

import torch

#: Position ``k`` of each 32 keys holds key ``V_KEY_ORDER[k]`` of those 32 (``h*16 + g*8 + t*2 + e`` at
#: ``k = h*16 + t*4 + g*2 + e``).
V_KEY_ORDER = tuple((k // 16) * 16 + (k // 2) % 2 * 8 + (k // 4) % 4 * 2 + k % 2 for k in range(32))


def keys_in_p_order(vt8: torch.Tensor) -> torch.Tensor:
    """The K-major ``vt8`` ``[B, H, D, N]`` with the keys of each 32 in :data:`V_KEY_ORDER`'s order (one copy);
    ``N`` not a multiple of 32 raises ``ValueError``."""
    b, h, d, n = vt8.shape
    if n % 32:
        raise ValueError(f"the keys are reordered 32 at a time: N = {n} is not a multiple of 32")
    order = torch.tensor(V_KEY_ORDER, device=vt8.device)
    return vt8.reshape(b, h, d, n // 32, 32).index_select(4, order).reshape(b, h, d, n)
