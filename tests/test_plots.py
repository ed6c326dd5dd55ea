"""Per-rank loss curves: the right lines, styles and labels."""

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradsync_tutorial.plots import plot_loss_curves


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def lines_of(fig):
    return fig.axes[0].get_lines()


def test_one_line_per_rank_and_a_dashed_baseline():
    histories = [[2.3, 1.5, 1.0, 0.8], [2.2, 1.6, 1.1, 0.7], [2.4, 1.4, 0.9, 0.9]]
    fig = plot_loss_curves(histories, baseline=[2.3, 1.5, 1.0, 0.8], title="3 ranks")
    assert isinstance(fig, Figure)
    lines = lines_of(fig)
    assert len(lines) == 4  # three ranks + one baseline

    ranks = [line for line in lines if line.get_label().startswith("rank")]
    assert [line.get_label() for line in ranks] == ["rank 0", "rank 1", "rank 2"]
    assert all(line.get_linestyle() == "-" for line in ranks)
    assert len({line.get_color() for line in ranks}) == 3  # one colour per rank
    np.testing.assert_allclose(ranks[1].get_ydata(), histories[1])
    np.testing.assert_allclose(ranks[1].get_xdata(), [0, 1, 2, 3])

    (base,) = [line for line in lines if line.get_label() == "single process"]
    assert base.get_linestyle() == "--"
    assert base.get_color() == "black"

    ax = fig.axes[0]
    assert ax.get_title() == "3 ranks"
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "training loss"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == ["rank 0", "rank 1", "rank 2", "single process"]


def test_dict_inputs_tensors_and_several_baselines():
    histories = {0: torch.tensor([1.0, 0.5]), 1: [torch.tensor(0.9), torch.tensor(0.4)]}
    baselines = {"1 process": [1.0, 0.45], "1 process, batch 128": np.array([1.1, 0.6])}
    fig = plot_loss_curves(histories, baseline=baselines, xlabel="epoch", ylabel="loss")
    lines = lines_of(fig)
    assert len(lines) == 4
    dashed = [line for line in lines if line.get_linestyle() == "--"]
    assert [line.get_label() for line in dashed] == list(baselines)
    assert [line.get_color() for line in dashed] == ["black", "dimgray"]
    solid = [line for line in lines if line.get_linestyle() == "-"]
    assert [line.get_label() for line in solid] == ["rank 0", "rank 1"]
    np.testing.assert_allclose(solid[1].get_ydata(), [0.9, 0.4])
    assert fig.axes[0].get_xlabel() == "epoch" and fig.axes[0].get_ylabel() == "loss"


def test_custom_labels_no_baseline_and_existing_axes():
    fig, (left, right) = plt.subplots(1, 2)
    out = plot_loss_curves([[1, 2], [3, 4]], labels=["GPU 0", "GPU 1"], ax=right)
    assert out is fig
    assert left.get_lines() == []
    assert [line.get_label() for line in right.get_lines()] == ["GPU 0", "GPU 1"]
    with pytest.raises(ValueError, match="1 labels for 2 loss histories"):
        plot_loss_curves([[1], [2]], labels=["only one"])


def test_baseline_alone():
    fig = plot_loss_curves([], baseline=[2.3, 1.5, 1.0], title="Single-device baseline")
    (line,) = lines_of(fig)
    assert line.get_label() == "single process" and line.get_linestyle() == "--"


def test_dict_keys_are_labels_and_int_keys_are_ranks():
    from gradsync_tutorial.plots import plot_loss_curves

    fig = plot_loss_curves({"correct": [2.0, 1.0], 3: [2.0, 1.5]})
    assert [line.get_label() for line in fig.axes[0].lines] == ["correct", "rank 3"]
