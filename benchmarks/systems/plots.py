"""PNG figures for the sweeps (matplotlib, headless Agg backend)."""

from __future__ import annotations

import os


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:  # the one optional-looking dependency; say how to get it
        raise ImportError("the characterization plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def try_plot(plot_fn, result: dict, path: str, log=print) -> str | None:
    """Draws a figure, or says how to draw it later when matplotlib is missing (the JSON is what matters; on a
    GPU box without matplotlib, `python -m benchmarks.characterize plot --out DIR` redraws every figure elsewhere)."""
    try:
        return plot_fn(result, path)
    except ImportError as e:
        log(f"no figure {os.path.basename(path)}: {e}")
        return None


def line_panels(path: str, panels: list[dict], *, xlabel: str, ylabel: str, title: str, logx: bool = True,
                logy: bool = False, xbase: int = 2) -> str:
    """panels: [{'title': str, 'series': [{'label', 'x', 'y'}], 'marks': [{'x', 'label'}] (vertical lines),
    'hlines': [{'y', 'label'}]}], side by side."""
    plt = _pyplot()
    n = max(1, len(panels))
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for s in panel.get("series", []):
            ax.plot(s["x"], s["y"], marker="o", markersize=3, label=s["label"])
        for m in panel.get("marks", []):
            ax.axvline(m["x"], linestyle="--", linewidth=0.8, color="grey")
            ax.annotate(m["label"], (m["x"], 0.02), xycoords=("data", "axes fraction"), rotation=90, fontsize=7)
        for h in panel.get("hlines", []):
            ax.axhline(h["y"], linestyle=":", linewidth=0.8, color="black")
            ax.annotate(h["label"], (0.01, h["y"]), xycoords=("axes fraction", "data"), fontsize=7)
        if logx:
            ax.set_xscale("log", base=xbase)
        if logy:
            ax.set_yscale("log")
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if panel.get("series"):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def bars(path: str, labels: list[str], values: list[float], *, ylabel: str, title: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(labels), 4.0))
    positions = range(len(labels))
    ax.bar(positions, values, color="tab:blue")
    for x, v in zip(positions, values):
        ax.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(positions), labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
