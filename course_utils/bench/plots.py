"""The benchmark's picture: TFLOP/s against N for every case, and peak memory."""

from __future__ import annotations

import math
from pathlib import Path

from .cases import ALL_PROVIDERS, LABELS, Case


def plot_results(rows: list[dict], path: Path, cases: list[dict] | None = None) -> None:
    """TFLOP/s against N for every case, and the main case's peak memory, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    case_names = list(dict.fromkeys(r["case"] for r in rows))
    panels = len(case_names) + 1
    cols = 3 if panels > 2 else panels
    nrows = math.ceil(panels / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    titles = {c["name"]: c for c in (cases or [])}
    styles = {"naive": ":", "compiled": "-.", "sdpa_flash": "--", "sdpa_cudnn": "--", "course": "-", "fast": "-",
              "course_fp8": "-", "gluon_bf16": "-.", "gluon_fp8": "-."}
    for ax, name in zip(axes.flat, case_names):
        for p in ALL_PROVIDERS:
            pts = [(r["n"], r["tflops"]) for r in rows if r["case"] == name and r["provider"] == p and r["tflops"]]
            if pts:
                ax.plot(*zip(*pts), styles[p], marker="o", label=LABELS[p], lw=2.2 if p == "fast" else 1.4)
        c = titles.get(name)
        ax.set_title(Case(**{**c, "ns": tuple(c["ns"])}).title() if c else name, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    ax = axes.flat[len(case_names)]
    main = case_names[0]
    for p in ALL_PROVIDERS:
        pts = [(r["n"], r["peak_mib"]) for r in rows if r["case"] == main and r["provider"] == p and r["peak_mib"]]
        if pts:
            ax.plot(*zip(*pts), styles[p], marker="o", label=LABELS[p])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{main}: peak memory per call", fontsize=9)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("MiB")
    ax.grid(alpha=0.3)
    for extra in list(axes.flat)[panels:]:
        extra.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
