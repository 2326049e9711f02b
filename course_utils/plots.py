"""Matplotlib pictures for the lessons, one job per function.

Each ``plot_*`` function draws into the ``ax`` (or axes) it is given, or
into a new figure, and returns the axes, so a lesson can combine them or
just let Jupyter show the figure. ``measure_peak_memory`` and
``tile_states`` compute what the pictures show; they draw nothing.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np

from . import references as ref

__all__ = [
    "attention_heatmap",
    "measure_peak_memory",
    "plot_memory",
    "tile_states",
    "plot_tiles",
    "plot_online_softmax",
    "window_tile_states",
    "plot_window_tiles",
    "SKIPPED",
    "FULL",
    "DIAGONAL",
]


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


# -- attention weights -------------------------------------------------------------
def attention_heatmap(weights, *, causal=False, row=None, ax=None, title=None):
    """Heatmap of an ``[Nq, Nk]`` attention-weight matrix (rows sum to 1).

    With ``causal``, the masked cells (key ``j`` after query ``i``, top-left
    aligned as in :mod:`course_utils.references`) are hatched so the mask is
    visible even where a weight is merely small. ``row`` outlines one query row.
    """
    from matplotlib.patches import Rectangle

    weights = np.asarray(weights, dtype=float)
    n_q, n_k = weights.shape
    ax = _axes(ax, (4.2, 3.6))
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=max(float(weights.max()), 1e-12),
                      aspect="auto", interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, label="weight")
    if causal:
        hidden = ~ref.causal_mask(n_q, n_k)
        for i, j in zip(*np.nonzero(hidden)):
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="0.85", edgecolor="0.6", hatch="///", lw=0))
    if row is not None:
        ax.add_patch(Rectangle((-0.5, row - 0.5), n_k, 1, fill=False, edgecolor="red", lw=2))
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax.set_title(title or ("causal attention weights" if causal else "attention weights"))
    return ax


# -- memory --------------------------------------------------------------------
def measure_peak_memory(fn, ns, d=64, *, seed=0):
    """Peak bytes NumPy allocates while ``fn(q, k, v)`` runs, for each ``N`` in ``ns``.

    Measured with :mod:`tracemalloc` (NumPy reports its array buffers to it)
    on float64 inputs of shape ``[N, d]``; the inputs themselves are
    allocated before the measurement starts, so only ``fn``'s own arrays
    (score matrix, weights, output, temporaries) count.
    """
    rng = np.random.default_rng(seed)
    peaks = []
    for n in ns:
        q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
        tracemalloc.start()
        try:
            fn(q, k, v)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        peaks.append(peak)
    return np.array(peaks)


def plot_memory(ns, measured, d=64, *, ax=None):
    """Log-log plot of measured peak memory against ``N``, with ``N^2`` and ``N`` guides.

    ``measured`` maps a label to an array of bytes (one per ``N``), e.g.
    from :func:`measure_peak_memory`. The guides are the size of one float64
    ``N x N`` score matrix and of ``q, k, v, o`` together (``4 N d`` floats,
    the memory attention cannot avoid): the first grows like ``N^2``, the
    second like ``N``.
    """
    from matplotlib.ticker import NullFormatter

    ns = np.asarray(ns, dtype=float)
    ax = _axes(ax, (5.5, 3.8))
    for label, values in measured.items():
        ax.loglog(ns, np.asarray(values, dtype=float) / 2**20, "o-", label=f"{label} (measured)")
    ax.loglog(ns, ns**2 * 8 / 2**20, "k--", lw=1, label="one N x N float64 matrix  ~ N^2")
    ax.loglog(ns, 4 * ns * d * 8 / 2**20, "k:", lw=1, label=f"q, k, v, o (d={d})  ~ N")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(int(n)) for n in ns])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("MiB")
    ax.set_title("memory of attention vs sequence length")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return ax


# -- tiles -----------------------------------------------------------------------
SKIPPED, FULL, DIAGONAL = 0, 1, 2


def tile_states(n_q, n_k, block_m, block_n, causal=False):
    """What tiled attention does with each ``(query block, key block)`` tile.

    Returns an int array ``[ceil(n_q/block_m), ceil(n_k/block_n)]`` holding
    ``FULL`` (computed, no mask needed), ``DIAGONAL`` (computed, crosses the
    diagonal so it needs the mask) or ``SKIPPED`` (every score masked, never
    loaded). The rules are those of :func:`course_utils.references.tiled_attention`.
    """
    states = np.empty((math.ceil(n_q / block_m), math.ceil(n_k / block_n)), dtype=int)
    for bi in range(states.shape[0]):
        q_start, q_end = bi * block_m, min((bi + 1) * block_m, n_q)
        for bj in range(states.shape[1]):
            k_start, k_end = bj * block_n, min((bj + 1) * block_n, n_k)
            if not causal:
                states[bi, bj] = FULL
            elif k_start >= q_end:  # the first key is after the last query
                states[bi, bj] = SKIPPED
            elif k_end - 1 > q_start:  # some key is after some query
                states[bi, bj] = DIAGONAL
            else:
                states[bi, bj] = FULL
    return states


def plot_tiles(n_q, n_k, block_m, block_n, causal=False, *, ax=None):
    """The grid of tiles tiled attention visits, drawn over the ``Nq x Nk`` score matrix.

    Computed tiles are blue (darker where the causal mask is needed), skipped
    tiles grey; the title counts them. Partial tiles at the edges are drawn
    at their true size.
    """
    from matplotlib.patches import Patch, Rectangle

    states = tile_states(n_q, n_k, block_m, block_n, causal)
    colours = {FULL: "#6baed6", DIAGONAL: "#2171b5", SKIPPED: "#e0e0e0"}
    ax = _axes(ax, (5.4, 4.0 * n_q / max(n_k, 1) + 0.6))
    for bi in range(states.shape[0]):
        for bj in range(states.shape[1]):
            x, y = bj * block_n, bi * block_m
            w, h = min(block_n, n_k - x), min(block_m, n_q - y)
            ax.add_patch(Rectangle((x, y), w, h, facecolor=colours[states[bi, bj]], edgecolor="white", lw=1.5))
    if causal:  # the mask's edge: row i sees the keys left of x = i + 1
        rows = np.arange(min(n_q, n_k))
        xs = np.repeat(rows + 1, 2)
        ys = np.stack([rows, rows + 1], axis=1).reshape(-1)
        ax.plot(xs, ys, color="crimson", lw=1.2, label="mask edge")
    ax.set_xlim(0, n_k)
    ax.set_ylim(n_q, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"keys (block_n = {block_n})")
    ax.set_ylabel(f"queries (block_m = {block_m})")
    counts = {s: int((states == s).sum()) for s in (FULL, DIAGONAL, SKIPPED)}
    ax.set_title(f"{counts[FULL] + counts[DIAGONAL]} tiles computed, {counts[SKIPPED]} skipped", fontsize=10)
    handles = [Patch(color=colours[FULL], label="computed")]
    if causal:
        handles += [Patch(color=colours[DIAGONAL], label="computed + mask"), Patch(color=colours[SKIPPED], label="skipped")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return ax


# -- sliding window and sinks (lesson 08) -----------------------------------------
def window_tile_states(n, block_m, block_n, window_size=None, sink_size=0):
    """Each tile's state under the window/sink mask: ``SKIPPED``, ``FULL`` or ``DIAGONAL`` (= partial).

    Read off the mask itself (:func:`course_utils.references.window_mask`):
    a tile is skipped when no query of its block sees any of its keys, full
    when every query sees every key (no mask work), partial otherwise.
    """
    mask = ref.window_mask(n, n, window_size, sink_size)
    states = np.empty((math.ceil(n / block_m), math.ceil(n / block_n)), dtype=int)
    for bi in range(states.shape[0]):
        for bj in range(states.shape[1]):
            tile = mask[bi * block_m:(bi + 1) * block_m, bj * block_n:(bj + 1) * block_n]
            states[bi, bj] = FULL if tile.all() else DIAGONAL if tile.any() else SKIPPED
    return states


def plot_window_tiles(n, block_m, block_n, window_size=None, sink_size=0, *, ax=None):
    """The tiles of a causal launch with a sliding window and sinks, over the mask.

    Skipped tiles grey, full tiles light blue, partial tiles (the mask runs
    through them) dark blue; the visible (query, key) pairs are drawn on
    top in orange. The title counts the tiles and the visible share.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    states = window_tile_states(n, block_m, block_n, window_size, sink_size)
    colours = {FULL: "#9ecae1", DIAGONAL: "#2171b5", SKIPPED: "#e8e8e8"}
    ax = _axes(ax, (5.6, 4.6))
    for bi in range(states.shape[0]):
        for bj in range(states.shape[1]):
            x, y = bj * block_n, bi * block_m
            w, h = min(block_n, n - x), min(block_m, n - y)
            ax.add_patch(Rectangle((x, y), w, h, facecolor=colours[states[bi, bj]], edgecolor="white", lw=1.0))
    mask = ref.window_mask(n, n, window_size, sink_size)
    ax.imshow(np.ma.masked_where(~mask, mask), cmap=ListedColormap(["#f16913"]), alpha=0.55,
              extent=(0, n, n, 0), interpolation="nearest", zorder=2)
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"key j (block_n = {block_n})")
    ax.set_ylabel(f"query i (block_m = {block_m})")
    counts = {s: int((states == s).sum()) for s in (FULL, DIAGONAL, SKIPPED)}
    ax.set_title(f"window {window_size}, {sink_size} sinks: {counts[FULL]} full, {counts[DIAGONAL]} partial, "
                 f"{counts[SKIPPED]} skipped tiles\n{mask.sum() / (n * (n + 1) / 2):.0%} of the causal pairs visible",
                 fontsize=9)
    handles = [Patch(color=colours[FULL], label="full (no mask)"), Patch(color=colours[DIAGONAL], label="partial (mask)"),
               Patch(color=colours[SKIPPED], label="skipped"), Patch(color="#f16913", alpha=0.55, label="visible pair")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return ax


# -- online softmax --------------------------------------------------------------
def plot_online_softmax(x, block_size, step=None, *, axes=None):
    """The online softmax's running max ``m`` and running sum ``l`` block by block.

    Top: the values of one row ``x`` with the blocks read so far (up to
    ``step`` blocks; all when None) in colour and the running max as a line.
    Bottom: ``m`` and ``l`` after each block; ``l`` drops when a new max
    arrives, because the old terms are rescaled by ``exp(m_old - m_new)``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = np.asarray(x, dtype=float).reshape(-1)
    states = ref.online_softmax_states(x, block_size)
    n_blocks = len(states)
    step = n_blocks if step is None else max(1, min(int(step), n_blocks))
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(6.5, 4.6), layout="constrained")
    top, bottom = axes
    seen = step * block_size
    idx = np.arange(x.size)
    top.bar(idx[:seen], x[:seen], color=["#2171b5" if (i // block_size) % 2 == 0 else "#6baed6" for i in idx[:seen]])
    top.bar(idx[seen:], x[seen:], color="#e0e0e0")
    for b in range(1, n_blocks):
        top.axvline(b * block_size - 0.5, color="0.7", lw=0.8)
    running_max = [states[min(i // block_size, step - 1)][0] for i in idx[:seen]]
    top.step(idx[:seen], running_max, where="mid", color="crimson", label="running max m")
    top.set_title(f"after block {step} of {n_blocks} (block_size = {block_size})", fontsize=10)
    top.set_xlabel("position in the row")
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.legend(fontsize=8, loc="lower right")

    blocks = np.arange(1, step + 1)
    m = [s[0] for s in states[:step]]
    l = [s[1] for s in states[:step]]
    bottom.plot(blocks, m, "o-", color="crimson", label="m (running max)")
    bottom.set_xlim(0.5, n_blocks + 0.5)
    bottom.set_xlabel("blocks read")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("m")
    twin = bottom.twinx()
    twin.plot(blocks, l, "s--", color="#2171b5", label="l (running sum)")
    twin.set_ylabel("l")
    lines = bottom.get_lines() + twin.get_lines()
    bottom.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
    return axes
