"""Per-rank loss curves, with the single-process run dashed behind them for comparison.

    >>> from gradsync_tutorial.plots import plot_loss_curves
    >>> fig = plot_loss_curves([[2.3, 1.9, 1.2], [2.2, 1.8, 1.1]], baseline=[2.3, 1.8, 1.2])
    >>> [line.get_label() for line in fig.axes[0].lines]
    ['single process', 'rank 0', 'rank 1']

Each rank sees a different shard of the data, so its own loss curve wiggles differently even
when the replicas stay equal; what must match the single-process run is the *trend* (and, with
averaged gradients and the same global batch, the parameters themselves: see ``checks``).

Introduced in ``notebooks/01_single_device_baseline.ipynb`` (the baseline alone); the ranks'
curves join it from ``notebooks/02_manual_allreduce_averaging.ipynb`` on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

# pyplot picks the backend: Jupyter's inline one in a notebook, and without a screen (a server,
# CI) it falls back to Agg, which draws into memory. Nothing here calls plt.show().
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["plot_loss_curves"]

# Shades for the baseline curves: black for the first, greys for any others.
BASELINE_COLORS = ("black", "dimgray", "darkgray", "silver")

# One loss curve: a list of floats, a 1-D tensor or array, a list of 0-d tensors...
Series = Iterable[float]


def _floats(values: Series) -> list[float]:
    return [float(v) for v in values]  # also takes tensors and arrays, element by element


def plot_loss_curves(
    histories: Sequence[Series] | Mapping[int, Series],
    *,
    baseline: Series | Mapping[str, Series] | None = None,
    title: str | None = None,
    xlabel: str = "step",
    ylabel: str = "training loss",
    labels: Sequence[str] | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Draw one loss curve per rank (and optional dashed baselines); return the figure.

    Args:
        histories: the losses of each rank, ``histories[r][step]`` (what ``gst.launch``
            returns when each rank returns its list of losses), or a dict ``{rank: losses}``.
        baseline: a reference run drawn dashed in black, labelled ``"single process"``; or a
            dict ``{label: losses}`` for several (black, then greys).
        title, xlabel, ylabel: the axes' texts.
        labels: legend labels for the ranks (default ``"rank 0"``, ``"rank 1"``, ...).
        ax: draw into these axes instead of a new figure (for side-by-side panels).

    Returns:
        The :class:`~matplotlib.figure.Figure`. In Jupyter a new figure is shown when the cell
        ends; write ``fig = plot_loss_curves(...)`` (or end the line with ``;``) so that it is
        not shown a second time as the cell's value. Outside Jupyter, ``fig.savefig(...)``.

    Example:
        >>> from gradsync_tutorial.plots import plot_loss_curves
        >>> losses = [[2.3, 1.7, 1.1], [2.2, 1.6, 1.2]]   # two ranks, three steps
        >>> fig = plot_loss_curves(losses, baseline={"1 process": [2.3, 1.6, 1.1]},
        ...                        title="2 ranks vs 1 process")
        >>> len(fig.axes[0].lines)
        3

    Introduced in ``notebooks/01_single_device_baseline.ipynb`` (the baseline alone); the
    ranks' curves join it from ``notebooks/02_manual_allreduce_averaging.ipynb`` on.
    """
    labels, curves = _labelled_curves(histories, labels)
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained") if ax is None else (ax.figure, ax)
    if baseline is not None:  # first, so that the ranks' curves are drawn on top of them
        refs = baseline if isinstance(baseline, Mapping) else {"single process": baseline}
        for i, (label, values) in enumerate(refs.items()):
            ys = _floats(values)
            ax.plot(range(len(ys)), ys, linestyle="--", linewidth=2,
                    color=BASELINE_COLORS[i % len(BASELINE_COLORS)], label=label)
    for i, (label, values) in enumerate(zip(labels, curves, strict=True)):
        ys = _floats(values)
        ax.plot(range(len(ys)), ys, color=f"C{i % 10}", linewidth=1.2, alpha=0.9, label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title or "")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def _labelled_curves(
    histories: Sequence[Series] | Mapping[int, Series], labels: Sequence[str] | None
) -> tuple[list[str], list[Series]]:
    """The legend labels (``"rank 0"``, ... unless given) and the curves, in the same order."""
    if isinstance(histories, Mapping):
        ranks, curves = list(histories.keys()), list(histories.values())
    else:
        curves = list(histories)
        ranks = list(range(len(curves)))
    if labels is None:
        return [f"rank {r}" if isinstance(r, int) else str(r) for r in ranks], curves
    if len(labels) != len(curves):
        raise ValueError(f"got {len(labels)} labels for {len(curves)} loss histories.")
    return list(labels), curves
