"""Interactive controls for the lessons, built from core ipywidgets only.

Only ``IntSlider``, ``Checkbox``, ``Text`` and ``interactive`` are used, which
exist unchanged in ipywidgets 7.7 and 8.x. Each function returns the widget; the
lesson displays it by leaving it as the cell's last expression. Without a
frontend (nbval, nbclient, a plain script) the widget is still built and its
function runs once with the initial values, so nothing fails headless.
Figures are shown with ``display`` and then closed, so moving a slider does
not pile up open figures. :func:`dkdv_column_explorer` and :func:`window_explorer` also
carry their first picture as a PNG in the widget's display data (ipywidgets 8): a
notebook stored by nbclient shows it where no widget can be drawn (GitHub, nbviewer).
"""

from __future__ import annotations

import numpy as np

from . import plots
from . import references as ref

__all__ = ["attention_explorer", "online_softmax_stepper", "window_explorer", "dkdv_column_explorer", "ring_stepper",
           "document_explorer", "parse_lengths"]


def _show(fig):
    import matplotlib.pyplot as plt
    from IPython.display import display

    display(fig)
    plt.close(fig)


def _png(fig) -> str:
    """``fig`` as a base64 PNG (for a display bundle), closed."""
    import base64
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _interactive_with_picture(picture_png, show, **controls):
    """``interactive(show, **controls)`` whose display data also holds ``picture_png`` (image/png).

    A live frontend draws the widget; a stored notebook opened without its widgets falls back
    to the picture (ipywidgets 8 displays widgets through ``_repr_mimebundle_``; 7.x ignores it).
    """
    from ipywidgets import interactive

    class _Explorer(interactive):  # shown as "interactive(...)", like the widgets above
        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs)
            if isinstance(data, dict):
                data["image/png"] = picture_png
            return data

    _Explorer.__name__ = _Explorer.__qualname__ = "interactive"
    return _Explorer(show, **controls)


def attention_explorer(q, k, *, row=0):
    """Pick a query row and switch the causal mask on and off; see its weights.

    ``q [Nq, d]`` and ``k [Nk, d]``. Left: the heatmap of all weights
    ``softmax(q k^T / sqrt(d))`` with the chosen row outlined; right: that
    row's weights as bars (they sum to 1; masked keys get exactly 0).
    """
    import matplotlib.pyplot as plt
    from ipywidgets import Checkbox, IntSlider, interactive

    q = np.asarray(q, dtype=float)
    k = np.asarray(k, dtype=float)
    n_q, n_k = q.shape[0], k.shape[0]
    scores = q @ k.T / np.sqrt(q.shape[-1])

    def show(row, causal):
        s = np.where(ref.causal_mask(n_q, n_k), scores, -np.inf) if causal else scores
        weights = ref.softmax(s, axis=-1)
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
        plots.attention_heatmap(weights, causal=causal, row=row, ax=left)
        right.bar(np.arange(n_k), weights[row], color="#2171b5")
        right.set_ylim(0, 1)
        right.set_xlabel("key j")
        right.set_title(f"query {row}: weights sum to {weights[row].sum():.3f}")
        _show(fig)

    return interactive(
        show,
        row=IntSlider(value=min(row, n_q - 1), min=0, max=n_q - 1, description="query row"),
        causal=Checkbox(value=False, description="causal mask"),
    )


def online_softmax_stepper(x, block_size):
    """Step through the online softmax of one row, one block at a time.

    The slider sets how many blocks have been read; the picture is
    :func:`course_utils.plots.plot_online_softmax` at that step.
    """
    from ipywidgets import IntSlider, interactive

    x = np.asarray(x, dtype=float).reshape(-1)
    n_blocks = -(-x.size // block_size)

    def show(step):
        axes = plots.plot_online_softmax(x, block_size, step)
        _show(axes[0].figure)

    return interactive(show, step=IntSlider(value=1, min=1, max=n_blocks, description="blocks read"))


def window_explorer(n=256, block_m=64, block_n=32, *, window_size=100, sink_size=4):
    """Pick a window and a number of sinks; see which tiles are skipped, partial or full.

    The picture is :func:`course_utils.plots.plot_window_tiles` for a causal
    sequence of ``n`` tokens cut into ``block_m x block_n`` tiles.
    """
    from ipywidgets import IntSlider, interactive

    def show(window_size, sink_size):
        ax = plots.plot_window_tiles(n, block_m, block_n, window_size, sink_size)
        _show(ax.figure)

    picture = _png(plots.plot_window_tiles(n, block_m, block_n, window_size, sink_size).figure)
    return _interactive_with_picture(
        picture, show,
        window_size=IntSlider(value=window_size, min=1, max=n, description="window W"),
        sink_size=IntSlider(value=sink_size, min=0, max=n // 2, description="sinks S"),
    )


def dkdv_column_explorer(n=256, block_m=16, block_n=32, *, window_size=64, sink_size=4, key_block=2):
    """Pick a key block, a window and a number of sinks; see the query blocks its dK/dV program walks.

    The picture is :func:`course_utils.plots.plot_dkdv_column`: which query blocks are on the
    diagonal (masked), full (no mask), at the window's far edge (masked) or reached only because
    the keys are sinks (masked), and which are skipped.
    """
    from ipywidgets import IntSlider

    def show(key_block, window_size, sink_size):
        axes = plots.plot_dkdv_column(n, block_m, block_n, window_size, sink_size, key_block * block_n)
        _show(axes[0].figure)

    n_key_blocks = -(-n // block_n)
    key_block = min(key_block, n_key_blocks - 1)
    picture = _png(plots.plot_dkdv_column(n, block_m, block_n, window_size, sink_size, key_block * block_n)[0].figure)
    return _interactive_with_picture(
        picture, show,
        key_block=IntSlider(value=key_block, min=0, max=n_key_blocks - 1,
                            description="key block"),
        window_size=IntSlider(value=window_size, min=1, max=n, description="window W"),
        sink_size=IntSlider(value=sink_size, min=0, max=n // 2, description="sinks S"),
    )


def ring_stepper(world_size=4, *, causal=True):
    """Step through ring attention: which K/V block each rank holds, and what it computes.

    The slider picks the step; the check boxes switch between the zigzag and
    the contiguous layout and the causal mask on and off. The picture is
    :func:`course_utils.plots.plot_ring_step`.
    """
    from ipywidgets import Checkbox, IntSlider, interactive

    def show(step, zigzag, causal):
        axes = plots.plot_ring_step(world_size, step, "zigzag" if zigzag else "contiguous", causal)
        _show(axes[0].figure)

    return interactive(
        show,
        step=IntSlider(value=0, min=0, max=world_size - 1, description="ring step"),
        zigzag=Checkbox(value=True, description="zigzag layout"),
        causal=Checkbox(value=causal, description="causal mask"),
    )


def parse_lengths(text: str) -> list[int]:
    """``"37, 3, 60"`` -> ``[0, 37, 40, 100]``: documents' lengths to ``cu_seqlens`` (ValueError if one is not >= 1)."""
    lengths = [int(x) for x in text.replace(";", ",").replace(" ", ",").split(",") if x.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError("give the documents' lengths as whole numbers >= 1, separated by commas (e.g. 37, 3, 60)")
    return [0] + np.cumsum(lengths).tolist()


def document_explorer(lengths=(37, 3, 60, 50, 106), block_m=32, block_n=32, *, causal=True):
    """Type the documents' lengths; see which tiles a packed launch skips, masks or computes whole.

    The picture is :func:`course_utils.plots.plot_document_tiles` for the
    documents packed one after another (``cu_seqlens`` from the lengths).
    """
    from ipywidgets import Checkbox, Text, interactive

    def show(lengths, causal):
        try:
            cu = parse_lengths(lengths)
        except ValueError as exc:
            print(exc)
            return
        ax = plots.plot_document_tiles(cu, block_m, block_n, causal)
        _show(ax.figure)

    return interactive(
        show,
        lengths=Text(value=", ".join(str(x) for x in lengths), description="lengths", continuous_update=False),
        causal=Checkbox(value=causal, description="causal mask"),
    )
