"""Notebook 15's exercise, one_process_loss: the losses that make verify_gradients wrong, each
rejected with verify_gradients's own verdict and what it means
(tests/exercises/test_every_exercise.py runs the reference solution and the stub)."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from .conftest import ON_2, assert_rejected

NAME = "one_process_loss"


def _sum(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")


def _padding_counted(model, batch):
    x, y = batch
    per_token = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
    return per_token.mean()  # padding's 0 losses counted in the mean


def _mean_of_line_means(model, batch):
    x, y = batch
    per_token = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # (lines, pos)
    valid = (y != -100).sum(dim=1).clamp(min=1)
    return (per_token.sum(dim=1) / valid).mean()


def _a_float(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def _raises(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)  # (lines, positions, vocabulary): the wrong shape


WRONG = [
    ("a sum", _sum,
     ON_2 + r"with your loss, verify_gradients rejects the right step: WRONG: .*factor.*Yours "
            r"differs by a constant factor: a sum instead of a mean"),
    ("padding counted", _padding_counted,
     ON_2 + r"with your loss, verify_gradients rejects the right step: WRONG: .*padding "
            r"counted as tokens\?"),
    ("a mean of the lines' means", _mean_of_line_means,
     ON_2 + r"with your loss, verify_gradients rejects the right step: WRONG: .*Yours weighs "
            r"the tokens otherwise, for example a mean of the lines' means"),
    ("returns a float", _a_float,
     ON_2 + r"verify_gradients could not use your loss: .*loss_fn must return one number as a "
            r"tensor"),
    ("raises", _raises, r"one_process_loss raised an error on rank \d"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_loss_is_rejected_with_verify_gradients_verdict(mistake, wrong, message):
    wrong.__name__ = NAME
    assert_rejected(NAME, mistake, wrong, message)
