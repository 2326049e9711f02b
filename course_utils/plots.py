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
    "plot_ring_step",
    "plot_tile_work",
    "ring_timeline",
    "plot_ring_timeline",
    "attention_heatmap",
    "measure_peak_memory",
    "plot_memory",
    "tile_states",
    "plot_tiles",
    "plot_online_softmax",
    "window_tile_states",
    "plot_window_tiles",
    "COLUMN_STATES",
    "dkdv_column_states",
    "plot_dkdv_column",
    "document_tile_states",
    "plot_document_tiles",
    "SKIPPED",
    "FULL",
    "DIAGONAL",
    "plot_program_tiles",
    "plot_gqa_groups",
    "backward_owners",
    "plot_backward_passes",
    "tile_addresses",
    "plot_tile_addresses",
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
def _mask_tile_states(mask, block_m, block_n, past_end_partial=False):
    """Each tile's state read off a boolean ``[N, N]`` mask: ``SKIPPED`` when no query of its block sees any of its
    keys, ``FULL`` when every query sees every key (no mask work), ``DIAGONAL`` (= partial) otherwise; with
    ``past_end_partial`` a tile running past N is partial too (a kernel masks its empty slots)."""
    n = mask.shape[1]
    states = np.empty((math.ceil(mask.shape[0] / block_m), math.ceil(n / block_n)), dtype=int)
    for bi in range(states.shape[0]):
        for bj in range(states.shape[1]):
            tile = mask[bi * block_m:(bi + 1) * block_m, bj * block_n:(bj + 1) * block_n]
            whole = (bj + 1) * block_n <= n or not past_end_partial
            states[bi, bj] = FULL if tile.all() and whole else DIAGONAL if tile.any() else SKIPPED
    return states


def _draw_mask_tiles(states, mask, block_m, block_n, ax=None) -> tuple:
    """Lessons 08 and 12's tile maps: skipped tiles grey, full light blue, partial dark blue, the visible pairs of
    ``mask`` on top in orange, and the legend; returns ``(ax, {state: count})`` for the caller's title."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    n = mask.shape[1]
    colours = {FULL: "#9ecae1", DIAGONAL: "#2171b5", SKIPPED: "#e8e8e8"}
    ax = _axes(ax, (5.6, 4.6))
    for bi in range(states.shape[0]):
        for bj in range(states.shape[1]):
            x, y = bj * block_n, bi * block_m
            w, h = min(block_n, n - x), min(block_m, n - y)
            ax.add_patch(Rectangle((x, y), w, h, facecolor=colours[states[bi, bj]], edgecolor="white", lw=1.0))
    ax.imshow(np.ma.masked_where(~mask, mask), cmap=ListedColormap(["#f16913"]), alpha=0.55,
              extent=(0, n, n, 0), interpolation="nearest", zorder=2)
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"key j (block_n = {block_n})")
    ax.set_ylabel(f"query i (block_m = {block_m})")
    handles = [Patch(color=colours[FULL], label="full (no mask)"), Patch(color=colours[DIAGONAL], label="partial (mask)"),
               Patch(color=colours[SKIPPED], label="skipped"), Patch(color="#f16913", alpha=0.55, label="visible pair")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return ax, {state: int((states == state).sum()) for state in (FULL, DIAGONAL, SKIPPED)}


def window_tile_states(n, block_m, block_n, window_size=None, sink_size=0):
    """Each tile's state under the window/sink mask: ``SKIPPED``, ``FULL`` or ``DIAGONAL`` (= partial).

    Read off the mask itself (:func:`course_utils.references.window_mask`):
    a tile is skipped when no query of its block sees any of its keys, full
    when every query sees every key (no mask work), partial otherwise.
    """
    return _mask_tile_states(ref.window_mask(n, n, window_size, sink_size), block_m, block_n)


def plot_window_tiles(n, block_m, block_n, window_size=None, sink_size=0, *, ax=None):
    """The tiles of a causal launch with a sliding window and sinks, over the mask.

    Skipped tiles grey, full tiles light blue, partial tiles (the mask runs
    through them) dark blue; the visible (query, key) pairs are drawn on
    top in orange. The title counts the tiles and the visible share.
    """
    mask = ref.window_mask(n, n, window_size, sink_size)
    ax, counts = _draw_mask_tiles(window_tile_states(n, block_m, block_n, window_size, sink_size), mask, block_m,
                                  block_n, ax)
    ax.set_title(f"window {window_size}, {sink_size} sinks: {counts[FULL]} full, {counts[DIAGONAL]} partial, "
                 f"{counts[SKIPPED]} skipped tiles\n{mask.sum() / (n * (n + 1) / 2):.0%} of the causal pairs visible",
                 fontsize=9)
    return ax

# -- packed documents (lesson 12) ---------------------------------------------------
def _document_mask(cu_seqlens, causal):
    n = int(np.asarray(cu_seqlens).reshape(-1)[-1])
    mask = ref.document_mask(cu_seqlens, n)
    return mask & ref.causal_mask(n, n) if causal else mask


def document_tile_states(cu_seqlens, block_m, block_n, causal=True):
    """Each tile's state under the document mask of packed documents: ``SKIPPED``, ``FULL`` or ``DIAGONAL``.

    ``cu_seqlens`` ``[S + 1]`` are the documents' boundaries, ``0 = cu[0] < ... < cu[S] = N``
    (:func:`course_utils.references.document_mask`); with ``causal`` the causal mask applies too.
    Read off the mask itself, as :func:`window_tile_states` does, except that a tile running past
    N is partial (a kernel masks its empty slots), as lesson 12's ``check_doc_tile_bounds`` says.
    """
    return _mask_tile_states(_document_mask(cu_seqlens, causal), block_m, block_n, past_end_partial=True)


def plot_document_tiles(cu_seqlens, block_m, block_n, causal=True, *, ax=None):
    """The tiles of a launch over packed documents, over the document mask.

    Skipped tiles grey, full tiles light blue, partial tiles dark blue, the
    visible (query, key) pairs in orange and the documents' boundaries as
    thin lines; the title counts the tiles and compares the visible pairs
    with one unpacked (plain causal or full) sequence of the same length.
    """
    cu = [int(x) for x in np.asarray(cu_seqlens).reshape(-1)]
    n = cu[-1]
    mask = _document_mask(cu, causal)
    ax, counts = _draw_mask_tiles(document_tile_states(cu, block_m, block_n, causal), mask, block_m, block_n, ax)
    for b in cu[1:-1]:
        ax.axvline(b, color="0.35", lw=0.6, zorder=3)
        ax.axhline(b, color="0.35", lw=0.6, zorder=3)
    unpacked = n * (n + 1) / 2 if causal else n * n
    ax.set_title(f"{len(cu) - 1} documents, {'causal' if causal else 'not causal'}: {counts[FULL]} full, "
                 f"{counts[DIAGONAL]} partial, {counts[SKIPPED]} skipped tiles\n"
                 f"{mask.sum() / unpacked:.0%} of the pairs of one {'causal ' if causal else ''}sequence "
                 f"of {n} tokens are visible", fontsize=9)
    return ax


# The dK/dV program's view (lesson 08): one key block, the query blocks down its column.
COLUMN_STATES = ("skipped", "diagonal", "full", "far edge", "sinks only")
_COLUMN_COLOURS = {"skipped": "#e8e8e8", "diagonal": "#2171b5", "full": "#9ecae1", "far edge": "#6a51a3",
                   "sinks only": "#d94801"}


def dkdv_column_states(n, block_m, block_n, window_size=None, sink_size=0, start_n=0):
    """What the dK/dV program of the key block at ``start_n`` does with each query block, read off the mask.

    Returns one name of :data:`COLUMN_STATES` per query block ``[b * block_m, (b + 1) * block_m)``:
    ``"skipped"`` (no row sees any of the keys ``[start_n, start_n + block_n)``), ``"diagonal"`` (on the
    diagonal: masked), ``"full"`` (every row sees every key: no mask), ``"far edge"`` (masked: some
    pairs are hidden, some seen inside the window) or ``"sinks only"`` (masked: the rows see some keys,
    and only because they are sinks, beyond the window).
    """
    mask = ref.window_mask(n, n, window_size, sink_size)
    keys = np.arange(start_n, min(start_n + block_n, n))
    w = n if window_size is None else window_size
    states = []
    for first in range(0, n, block_m):
        rows = np.arange(first, min(first + block_m, n))
        tile = mask[np.ix_(rows, keys)]
        in_window = tile & (rows[:, None] - keys[None, :] < w)
        if not tile.any():
            states.append("skipped")
        elif first < start_n + block_n:
            states.append("diagonal")
        elif tile.all():
            states.append("full")
        elif in_window.any():
            states.append("far edge")
        else:
            states.append("sinks only")
    return states


def plot_dkdv_column(n, block_m, block_n, window_size=None, sink_size=0, start_n=0, *, axes=None):
    """One dK/dV program walking down its key block: the query blocks it visits, and how.

    Left, the whole mask (visible pairs faint orange) with the key block's column cut into query
    blocks coloured by :func:`dkdv_column_states` (diagonal, full, far edge, sinks only, skipped) and an
    arrow down the blocks the program visits. Right, that column widened: the same colours, with the
    visible pairs in black on top. The title counts the blocks. Returns the two axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    states = dkdv_column_states(n, block_m, block_n, window_size, sink_size, start_n)
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(8.2, 4.6), layout="constrained", width_ratios=[3, 1.3])
    left, right = axes
    mask = ref.window_mask(n, n, window_size, sink_size)
    width = min(block_n, n - start_n)
    left.imshow(np.ma.masked_where(~mask, mask), cmap=ListedColormap(["#f16913"]), alpha=0.25,
                extent=(0, n, n, 0), interpolation="nearest", zorder=1)
    for ax, x0, w in ((left, start_n, width), (right, 0, width)):
        for b, state in enumerate(states):
            first = b * block_m
            ax.add_patch(Rectangle((x0, first), w, min(block_m, n - first), facecolor=_COLUMN_COLOURS[state],
                                   edgecolor="white", lw=1.0, zorder=2))
    column = mask[:, start_n:start_n + width]
    right.imshow(np.ma.masked_where(~column, column), cmap=ListedColormap(["black"]), alpha=0.35,
                 extent=(0, width, n, 0), interpolation="nearest", aspect="auto", zorder=3)
    visited = [b for b, state in enumerate(states) if state != "skipped"]
    if visited:
        x = min(start_n + width + max(n / 40, 2), n - 1)
        left.annotate("", xy=(x, min((visited[-1] + 1) * block_m, n)), xytext=(x, visited[0] * block_m),
                      arrowprops=dict(arrowstyle="->", lw=1.5), zorder=4)
    left.set_xlim(0, n)
    left.set_ylim(n, 0)
    left.set_aspect("equal")
    left.set_xlabel("key j")
    left.set_ylabel(f"query i (block_m = {block_m})")
    right.set_xlim(0, width)
    right.set_ylim(n, 0)
    right.set_xticks([0, width - 1], [str(start_n), str(start_n + width - 1)])
    right.set_xlabel(f"keys {start_n}..{start_n + width - 1}")
    counts = {s: states.count(s) for s in COLUMN_STATES}
    left.set_title(f"dK/dV program of key block {start_n // block_n} (start_n = {start_n}): window {window_size}, "
                   f"{sink_size} sinks\n" + ", ".join(f"{counts[s]} {s}" for s in COLUMN_STATES[1:])
                   + f" query blocks; {counts['skipped']} skipped", fontsize=9)
    handles = [Patch(color=_COLUMN_COLOURS[s], label=s + (" (no mask)" if s == "full" else "" if s == "skipped"
                                                          else " (mask)"))
               for s in COLUMN_STATES[1:] + COLUMN_STATES[:1]]
    handles.append(Patch(color="black", alpha=0.35, label="visible pair"))
    right.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.04, 1.0), fontsize=8, frameon=False)
    return axes


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


# -- who owns what (lessons 04, 05, 07) -----------------------------------------------
def plot_program_tiles(n, block_m, block_n, causal=True, *, n_heads=2, ax=None):
    """Which program owns which tiles in the forward kernel (lesson 04).

    One program per query block and (batch, head), however the grid spells it
    (lesson 04: ``(pid_m, head, batch)``; lesson 05: ``(pid_m, batch x head)``):
    it owns query block ``pid_m`` of one head, loops over the key blocks of its
    row, and is the only one to write those rows of ``o``. Drawn for
    ``n_heads`` heads side by side; each program's tiles get its own colour,
    skipped tiles (causal) stay grey.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    states = tile_states(n, n, block_m, block_n, causal)
    n_blocks = states.shape[0]
    ax = _axes(ax, (4.2 * n_heads, 4.0))
    cmap = plt.get_cmap("tab20")
    gap = n * 0.08
    for h in range(n_heads):
        x0 = h * (n + gap)
        for bi in range(n_blocks):
            colour = cmap((h * n_blocks + bi) % 20)
            for bj in range(states.shape[1]):
                x, y = bj * block_n, bi * block_m
                w, hgt = min(block_n, n - x), min(block_m, n - y)
                skipped = states[bi, bj] == SKIPPED
                ax.add_patch(Rectangle((x0 + x, y), w, hgt, facecolor="#e8e8e8" if skipped else colour,
                                       edgecolor="white", lw=1.2, hatch="//" if states[bi, bj] == DIAGONAL else None))
            ax.text(x0 - gap * 0.15, bi * block_m + min(block_m, n - bi * block_m) / 2, f"({bi}, {h})",
                    ha="right", va="center", fontsize=7)
        ax.text(x0 + n / 2, -n * 0.04, f"head {h}: Q K^T, keys across", ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-gap * 1.6, n_heads * (n + gap))
    ax.set_ylim(n, -n * 0.12)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"one program per (query block, head), labelled (query block, head); block_m = {block_m}, "
                 f"block_n = {block_n}" + (", hatched = masked, grey = skipped" if causal else ""), fontsize=9)
    return ax


def plot_gqa_groups(n_q_heads, n_kv_heads, *, ax=None):
    """The query-head -> kv-head map of grouped-query attention (lesson 05).

    Query head ``q_head`` reads kv head ``q_head // group_size`` with
    ``group_size = n_q_heads // n_kv_heads``: consecutive query heads share one
    K/V head. Drawn as two rows of boxes joined by lines, one colour per group.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if n_q_heads % n_kv_heads:
        raise ValueError("n_q_heads must be a multiple of n_kv_heads")
    group_size = n_q_heads // n_kv_heads
    cmap = plt.get_cmap("tab10")
    ax = _axes(ax, (max(5.0, 0.55 * n_q_heads), 2.6))
    kv_width = n_q_heads / n_kv_heads
    for kv in range(n_kv_heads):
        x = kv * kv_width + 0.1
        ax.add_patch(Rectangle((x, 0), kv_width - 0.2, 0.8, facecolor=cmap(kv % 10), alpha=0.85))
        ax.text(x + (kv_width - 0.2) / 2, 0.4, f"kv_head {kv}", ha="center", va="center", fontsize=8, color="white")
    for h in range(n_q_heads):
        kv = h // group_size
        ax.add_patch(Rectangle((h + 0.1, 2.0), 0.8, 0.8, facecolor=cmap(kv % 10), alpha=0.55))
        ax.text(h + 0.5, 2.4, str(h), ha="center", va="center", fontsize=8)
        ax.plot([h + 0.5, kv * kv_width + kv_width / 2], [2.0, 0.8], color=cmap(kv % 10), lw=1)
    ax.text(-0.2, 2.4, "q_head", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6, n_q_heads + 0.2)
    ax.set_ylim(-0.2, 3.2)
    ax.axis("off")
    ax.set_title(f"{n_q_heads} query heads, {n_kv_heads} kv heads: group_size = {group_size}, "
                 f"kv_head = q_head // {group_size}", fontsize=9)
    return ax


def backward_owners(n, block_m, block_n, causal=True):
    """Which program of each backward pass visits each tile (lesson 07).

    Returns ``(dkdv, dq)``, int arrays over the tile grid: in the dK/dV pass
    the program of key block ``j`` visits every computed tile of column ``j``
    (it owns ``dk, dv`` of those keys); in the dQ pass the program of query
    block ``i`` visits every computed tile of row ``i`` (it owns ``dq`` of
    those queries). Skipped tiles hold -1.
    """
    states = tile_states(n, n, block_m, block_n, causal)
    rows, cols = np.indices(states.shape)
    dkdv = np.where(states == SKIPPED, -1, cols)
    dq = np.where(states == SKIPPED, -1, rows)
    return dkdv, dq


def plot_backward_passes(n=256, block_m=64, block_n=64, causal=True, *, axes=None):
    """The two passes of the course's backward side by side (lesson 07).

    Left, the dK/dV pass: one program per key block walks *down* its column of
    tiles and accumulates ``dk, dv`` in registers (arrows down). Right, the dQ
    pass: one program per query block walks *across* its row and accumulates
    ``dq``. Each output is written by one program: no atomics. Both passes
    recompute ``P`` (and ``dP``) for every tile they visit.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    dkdv, dq = backward_owners(n, block_m, block_n, causal)
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(9.5, 4.4), layout="constrained")
    cmap = plt.get_cmap("tab10")
    for ax, owner, title, down in ((axes[0], dkdv, "dK/dV pass: one program per key block,\nloops over query blocks, writes dk, dv", True),
                                   (axes[1], dq, "dQ pass: one program per query block,\nloops over key blocks, writes dq", False)):
        for bi in range(owner.shape[0]):
            for bj in range(owner.shape[1]):
                who = owner[bi, bj]
                ax.add_patch(Rectangle((bj * block_n, bi * block_m), block_n, block_m, edgecolor="white", lw=1.5,
                                       facecolor="#e8e8e8" if who < 0 else cmap(who % 10), alpha=0.75))
        for p in range(owner.shape[1] if down else owner.shape[0]):
            cells = np.nonzero(owner[:, p] >= 0)[0] if down else np.nonzero(owner[p, :] >= 0)[0]
            if len(cells) == 0:
                continue
            if down:
                x = p * block_n + block_n / 2
                ax.annotate("", xy=(x, (cells[-1] + 0.85) * block_m), xytext=(x, (cells[0] + 0.15) * block_m),
                            arrowprops=dict(arrowstyle="->", lw=1.5))
            else:
                y = p * block_m + block_m / 2
                ax.annotate("", xy=((cells[-1] + 0.85) * block_n, y), xytext=((cells[0] + 0.15) * block_n, y),
                            arrowprops=dict(arrowstyle="->", lw=1.5))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal")
        ax.set_xlabel("keys")
        ax.set_ylabel("queries")
        ax.set_title(title, fontsize=9)
    return axes


# -- 2-D pointer arithmetic (lesson 03) ------------------------------------------------
def tile_addresses(row0, col0, block_rows, block_cols, row_stride, n_rows, n_cols):
    """The offsets a 2-D tile load reads, and its mask: what ``ptr + offs`` means.

    ``offs = rows[:, None] * row_stride + cols[None, :]`` with
    ``rows = row0 + arange(block_rows)``, ``cols = col0 + arange(block_cols)``;
    ``mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]``. Returns
    ``(offs, mask)``, both ``[block_rows, block_cols]``.
    """
    rows = row0 + np.arange(block_rows)
    cols = col0 + np.arange(block_cols)
    offs = rows[:, None] * row_stride + cols[None, :]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return offs, mask


def plot_tile_addresses(row0, col0, block_rows, block_cols, row_stride, n_rows, n_cols, *, ax=None):
    """Memory as the flat line of addresses it is, wrapped every ``row_stride``, with one tile's loads marked.

    Each cell is one element's address (its offset from ``ptr``). Cells of the
    ``n_rows x n_cols`` matrix are white, padding between rows (when
    ``row_stride > n_cols``) grey; the tile's loaded addresses are blue with
    their offset written in, and lanes the mask switches off are listed in the
    title (they would read past a row or past the end).
    """
    from matplotlib.patches import Rectangle

    offs, mask = tile_addresses(row0, col0, block_rows, block_cols, row_stride, n_rows, n_cols)
    ax = _axes(ax, (0.42 * row_stride + 1.0, 0.42 * n_rows + 1.0))
    for r in range(n_rows):
        for c in range(row_stride):
            inside = c < n_cols
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor="white" if inside else "#d9d9d9", edgecolor="#999999", lw=0.6))
    for (i, j), off in np.ndenumerate(offs):
        if mask[i, j]:
            r, c = divmod(int(off), row_stride)
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor="#6baed6", edgecolor="#08519c", lw=1.2))
            ax.text(c + 0.5, r + 0.5, str(int(off)), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, row_stride)
    ax.set_ylim(n_rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(row_stride) + 0.5, [str(c) for c in range(row_stride)], fontsize=7)
    ax.set_yticks(np.arange(n_rows) + 0.5, [f"{r} (offset {r * row_stride})" for r in range(n_rows)], fontsize=7)
    ax.set_xlabel("column (grey: padding between rows, never part of the matrix)")
    off_lanes = int((~mask).sum())
    ax.set_title(f"tile rows {row0}..{row0 + block_rows - 1}, cols {col0}..{col0 + block_cols - 1}: "
                 f"offs = rows[:, None] * {row_stride} + cols[None, :]"
                 + (f"; {off_lanes} lanes masked off" if off_lanes else ""), fontsize=9)
    return ax


# -- ring attention (lesson 10) ----------------------------------------------------
_RANK_COLOURS = ("#2171b5", "#e6550d", "#31a354", "#756bb1", "#d6616b", "#8c6d31", "#636363", "#17becf")


def plot_ring_step(world_size, step, layout="zigzag", causal=True, *, axes=None):
    """Ring attention at one step: who holds which K/V block, and which chunk pairs are done.

    Left: the ranks on a ring, each with the query chunks it keeps and the
    K/V block it holds at ``step`` (rank ``r`` holds rank ``(r - step) %
    world_size``'s), arrows showing where the blocks go next. Right: the
    chunk-level attention matrix (query chunk x key chunk), each computed
    pair coloured by the rank that computes it, bright at this step, faded
    for earlier steps, empty for later ones; a triangle marks a diagonal
    pair (masked inside), grey a pair the causal mask skips entirely.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Polygon, Rectangle

    from . import distributed as ring

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 4.4), layout="constrained")
    left, right = axes
    w = world_size
    angles = np.pi / 2 - 2 * np.pi * np.arange(w) / w
    xy = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    for r in range(w):
        src = (r - step) % w
        colour = _RANK_COLOURS[r % len(_RANK_COLOURS)]
        left.add_patch(plt.Circle(xy[r], 0.2, color=colour, alpha=0.9))
        left.text(*xy[r], f"{r}", ha="center", va="center", color="white", fontsize=12, weight="bold")
        label = f"Q: chunks {ring.chunk_ids(r, w, layout)}\nholds K/V of rank {src}"
        left.text(*(xy[r] * np.array([2.05, 1.6])), label, ha="center", va="center", fontsize=8)
        nxt = xy[(r + 1) % w]
        left.add_patch(FancyArrowPatch(xy[r] * 0.95 + (nxt - xy[r]) * 0.22, xy[r] * 0.95 + (nxt - xy[r]) * 0.78,
                                       arrowstyle="-|>", mutation_scale=12, color="0.5",
                                       connectionstyle="arc3,rad=-0.25"))
    left.set_xlim(-3.1, 3.1)
    left.set_ylim(-2.0, 2.0)
    left.set_aspect("equal")
    left.axis("off")
    left.set_title(f"step {step}: K/V blocks move one rank on (arrows)", fontsize=10)

    n = ring.n_chunks(w, layout)
    for r in range(w):
        for s in range(w):
            src = (r - s) % w
            for qc in ring.chunk_ids(r, w, layout):
                for kc in ring.chunk_ids(src, w, layout):
                    kind = ring.block_relation(qc, kc, causal)
                    if kind == ring.SKIP:
                        right.add_patch(Rectangle((kc, qc), 1, 1, facecolor="#e0e0e0", edgecolor="white"))
                        continue
                    if s > step:
                        right.add_patch(Rectangle((kc, qc), 1, 1, facecolor="white", edgecolor="0.85"))
                        continue
                    alpha = 0.95 if s == step else 0.3
                    colour = _RANK_COLOURS[r % len(_RANK_COLOURS)]
                    if kind == ring.DIAGONAL:
                        right.add_patch(Polygon([(kc, qc), (kc, qc + 1), (kc + 1, qc + 1)], facecolor=colour,
                                                alpha=alpha, edgecolor="white"))
                    else:
                        right.add_patch(Rectangle((kc, qc), 1, 1, facecolor=colour, alpha=alpha, edgecolor="white"))
    right.set_xlim(0, n)
    right.set_ylim(n, 0)
    right.set_aspect("equal")
    right.set_xticks(np.arange(n) + 0.5, [str(i) for i in range(n)])
    right.set_yticks(np.arange(n) + 0.5, [str(i) for i in range(n)])
    right.set_xlabel("key chunk")
    right.set_ylabel("query chunk")
    right.set_title(f"{layout} layout, causal={causal}: pairs done by step {step}\n"
                    "(colour = computing rank; grey = skipped)", fontsize=10)
    return axes


def plot_tile_work(n, world_size, block, *, ax=None):
    """Tiles of causal attention each rank computes: contiguous shards vs zigzag, side by side bars."""
    from . import distributed as ring

    ax = _axes(ax, (6.0, 3.4))
    ranks = np.arange(world_size)
    for offset, layout, colour in ((-0.2, "contiguous", "#bdbdbd"), (0.2, "zigzag", "#2171b5")):
        work = ring.tile_work(n, world_size, layout, block)
        ax.bar(ranks + offset, work, width=0.4, color=colour,
               label=f"{layout}: slowest rank {work.max() / work.mean():.2f}x the mean")
    ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylabel(f"{block}x{block} tiles computed")
    ax.set_title(f"causal attention, N = {n}, {world_size} ranks", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return ax


def ring_timeline(world_size, compute_s, transfer_s, overlap=True):
    """The bars of one ring forward: ``[(rank, lane, step, start_s, end_s)]``, ``lane`` "compute" or "send".

    Every step computes for ``compute_s``; every step but the last also sends its K/V block on, for
    ``transfer_s``. Overlapped, the send of step ``s`` starts with its compute and step ``s + 1`` starts
    when both are done (``max`` of the two); in sequence, the send waits for the compute (their sum).
    The zigzag layout gives every rank the same work, so the ranks' bars coincide.
    """
    bars, start = [], 0.0
    for step in range(world_size):
        last = step == world_size - 1
        send_start = start if overlap else start + compute_s
        for rank in range(world_size):
            bars.append((rank, "compute", step, start, start + compute_s))
            if not last:
                bars.append((rank, "send", step, send_start, send_start + transfer_s))
        start = (start + max(compute_s, transfer_s)) if overlap else send_start + transfer_s
    return bars


def plot_ring_timeline(world_size, compute_s, transfer_s, *, overlap=True, ax=None, title=None):
    """Per-step compute (blue) and K/V transfer (orange) bars of each rank, overlapped or in sequence.

    Two lanes per rank; time in microseconds. The title gives the total time and the share of it
    during which the GPU computes (what the ring's speed-up depends on).
    """
    ax = _axes(ax, (6.0, 0.55 * 2 * world_size + 1.2))
    bars = ring_timeline(world_size, compute_s, transfer_s, overlap)
    colours = {"compute": "#2171b5", "send": "#fd8d3c"}
    for rank, lane, step, t0, t1 in bars:
        y = 2 * rank + (0 if lane == "compute" else 1)
        ax.barh(y, (t1 - t0) * 1e6, left=t0 * 1e6, height=0.8, color=colours[lane], edgecolor="white")
        if (t1 - t0) * 1e6 > 0.04 * max(b[4] for b in bars) * 1e6:
            ax.text((t0 + t1) / 2 * 1e6, y, str(step), ha="center", va="center", fontsize=7, color="white")
    total = max(b[4] for b in bars)
    ax.set_yticks(range(2 * world_size), [f"rank {r} {lane}" for r in range(world_size) for lane in ("compute", "send")],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (µs); the number in a bar is its ring step")
    busy = world_size * compute_s / total
    head = title + "\n" if title else ""
    ax.set_title(f"{head}{'overlapped' if overlap else 'in sequence'}: {total * 1e6:,.0f} µs, "
                 f"computing {100 * busy:.0f}% of the time", fontsize=9)
    return ax
