"""Loss curve PNG from metrics.jsonl (rank 0, end of run)."""
from __future__ import annotations

from pathlib import Path

from .tracking import read_metrics


def plot_loss(metrics_path: Path, png_path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    rows = read_metrics(metrics_path)  # a non-finite loss as NaN: a gap in the line
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker="o", ms=3, label="train")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="s", ms=4, label="held-out")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean token CE)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path
