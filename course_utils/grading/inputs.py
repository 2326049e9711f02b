"""The inputs a Triton check hands to the learner, and what it checks about them afterwards.

- :func:`nan_padded`: a tensor living inside a NaN-filled buffer, so reading past
  a row or past the sequence shows up as NaN in the output;
- :func:`snapshot` / :func:`changed_input`: copies of the inputs before the call,
  and a sentence naming the first input the learner's function edited in place.
"""

from __future__ import annotations

__all__ = ["nan_padded", "snapshot", "changed_input"]


def snapshot(**tensors) -> dict:
    """Copies of the learner's inputs, to compare with after the call (:func:`changed_input`)."""
    return {name: t.detach().clone() for name, t in tensors.items()}


def changed_input(before: dict, **tensors) -> str | None:
    """A sentence naming the first input the learner's function modified in place, if any."""
    import torch

    for name, t in tensors.items():
        old = before[name]
        same = torch.equal(t.detach(), old) or bool(
            torch.equal(torch.isnan(t.detach()), torch.isnan(old))
            and torch.equal(torch.nan_to_num(t.detach()), torch.nan_to_num(old)))
        if not same:
            return (
                f"your function changed its input `{name}` in place (e.g. `{name} *= ...`, `{name}.mul_(...)`, "
                f"or a kernel storing into `{name}`): the caller's tensor must stay as it was. Work on a "
                "new tensor, or fold the change into the kernel (e.g. scale the scores, not the keys)."
            )
    return None



def nan_padded(t, rows: int = 128, cols: int = 8, *, transpose_heads: bool = False):
    """A copy of ``t`` (``[B, H, N, D]``) living inside a NaN-filled buffer.

    The buffer has ``rows`` extra rows after each head's sequence (128, the
    largest block the course uses, so a whole unmasked tail block reads NaN)
    and ``cols`` extra columns after each row's ``D`` values. The view is not
    contiguous, and anything read past the last row or column is NaN, which
    then shows in the output. With ``transpose_heads`` the buffer is laid out
    ``[B, N, H, D]`` and viewed as ``[B, H, N, D]``, so the strides are not in
    the usual order either.
    """
    import torch

    B, H, N, D = t.shape
    nan = float("nan")
    if transpose_heads:
        buf = torch.full((B, N + rows, H, D + cols), nan, dtype=t.dtype, device=t.device)
        view = buf[:, :N, :, :D].permute(0, 2, 1, 3)
    else:
        buf = torch.full((B, H, N + rows, D + cols), nan, dtype=t.dtype, device=t.device)
        view = buf[:, :, :N, :D]
    view.copy_(t)
    return view
