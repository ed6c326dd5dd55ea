"""Draw images/allreduce.png, the diagram of notebook 02 and the README.

    python tools/draw_allreduce.py   # make images runs every tools/draw_*.py

Two ranks, each with its own replica and its own gradient; all_reduce(SUM) gives every rank
the sum; dividing by the world size gives every rank the mean.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "images" / "allreduce.png"
COLORS = ["#1f77b4", "#ff7f0e"]
STAGES = [  # (title, text for rank 0, text for rank 1)
    ("each rank: its own\nreplica, its own batch", "grad = g0", "grad = g1"),
    ("all_reduce(grad, SUM)\nevery rank receives the sum", "grad = g0 + g1", "grad = g0 + g1"),
    ("grad /= world_size\nevery rank holds the mean", "grad = (g0 + g1) / 2",
     "grad = (g0 + g1) / 2"),
]


def box(ax, x, y, text, color):
    ax.add_patch(FancyBboxPatch((x - 1.35, y - 0.35), 2.7, 0.7, boxstyle="round,pad=0.05",
                                facecolor=color, alpha=0.18, edgecolor=color, linewidth=2))
    ax.text(x, y, text, ha="center", va="center", fontsize=11, family="monospace")


def main() -> None:
    fig, ax = plt.subplots(figsize=(10, 3.6))
    xs, ys = [1.5, 5.0, 8.5], [2.0, 0.6]
    for x, (title, *texts) in zip(xs, STAGES, strict=True):
        ax.text(x, 3.05, title, ha="center", va="center", fontsize=11, weight="bold")
        for rank, (y, text) in enumerate(zip(ys, texts, strict=True)):
            box(ax, x, y, text, COLORS[rank])
    for rank, y in enumerate(ys):
        ax.text(-0.25, y, f"rank {rank}", ha="right", va="center", fontsize=11,
                color=COLORS[rank], weight="bold")
        ax.add_patch(FancyArrowPatch((6.4, y), (7.1, y), arrowstyle="-|>", mutation_scale=15))
    # all_reduce: each rank's gradient goes to both ranks.
    for y_from in ys:
        for y_to in ys:
            ax.add_patch(FancyArrowPatch((2.9, y_from), (3.6, y_to), arrowstyle="-|>",
                                         mutation_scale=15, color="0.35"))
    ax.set_xlim(-1.3, 10.0)
    ax.set_ylim(0.0, 3.5)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(OUT, dpi=120)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
