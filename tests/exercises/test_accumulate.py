"""Notebook 01's exercise, accumulate_gradients (one process): the wrong answers its check must
reject, each with the message that names the mistake (tests/exercises/test_every_exercise.py runs
the reference solution and the stub)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradsync_tutorial import exercises

from .conftest import (
    assert_rejected,
)

NAME = "accumulate_gradients"


def _accumulate(divide=True, zero_inside=False, whole_batch=False, returns="float",
                pieces=None, divisor=None, piece_size=None, steps=False):
    """A learner's accumulate_gradients, with one of the typical mistakes switched on (pieces,
    divisor, piece_size: hard-coded numbers of micro-batches to split into, to divide by, or
    images per piece)."""

    def accumulate_gradients(model, images, labels, micro_batches):
        k = 1 if whole_batch else pieces or micro_batches
        xs, ys = ((images.split(piece_size), labels.split(piece_size)) if piece_size else
                  (images.chunk(k), labels.chunk(k)))
        total, last, raw = 0.0, None, 0.0
        for x, y in zip(xs, ys, strict=True):
            if zero_inside:
                model.zero_grad()
            loss = F.nll_loss(model(x), y)
            raw += loss.item()
            if divide:
                loss = loss / (divisor or (len(xs) if piece_size else micro_batches))
            loss.backward()
            total, last = total + loss.item(), loss
        if steps:
            torch.optim.SGD(model.parameters(), lr=0.1).step()  # the caller's job
        return {"float": total, "tensor": last, "last": last.item() * micro_batches,
                "sum": raw}[returns]

    return accumulate_gradients


WRONG = [
    ("no division", _accumulate(divide=False),
     r"^with micro_batches=3 \(a batch of 24\): your gradients are 3\.0× the expected ones "
     r"\(the gradient of the whole batch's mean loss\): did you divide each micro-batch's loss "
     r"by micro_batches\?"),
    ("zero_grad inside the loop", _accumulate(zero_inside=True),
     r"your gradient is the last micro-batch's only \(times 0\.333\).*zero_grad\(\).*inside"),
    ("zero_grad inside, no division",
     _accumulate(zero_inside=True, divide=False), r"the last micro-batch's only \(times 1\)"),
    ("the whole batch at once", _accumulate(whole_batch=True),
     r"your model saw 24 samples in one forward pass: split the batch of 24 into 3 "
     r"micro-batches of 8"),
    ("hard-coded 4 (the notebook's)", _accumulate(pieces=4, divisor=4),
     r"your model ran 4 forward passes \(of 6, 6, 6, 6 samples\); with micro_batches=3, run "
     r"one per micro-batch: 3 of 8"),
    ("hard-coded 3", _accumulate(pieces=3, divisor=3),
     r"^right with micro_batches=3 \(a batch of 24\), but with micro_batches=5 \(a batch of "
     r"20\): your model ran 3 forward passes \(of 7, 7, 6 samples\)"),
    ("hard-coded pieces of 8", _accumulate(piece_size=8),
     r"^right with micro_batches=3 .*, but with micro_batches=5 \(a batch of 20\): your model "
     r"ran 3 forward passes \(of 8, 8, 4 samples\); with micro_batches=5, run one per "
     r"micro-batch: 5 of 4"),
    ("divided by 4", _accumulate(divisor=4),
     r"your gradients are 0\.75× the expected ones.*Did you divide by 4 instead of "
     r"micro_batches \(3 here\)\?"),
    ("steps the optimizer", _accumulate(steps=True),
     r"accumulate_gradients changed the parameters: `conv1\.weight`.*the caller steps the "
     r"optimizer"),
    ("returns a tensor", _accumulate(returns="tensor"),
     r"returned a tensor.*return a float \(`loss\.item\(\)`\)"),
    ("returns the last loss", _accumulate(returns="last"),
     r"returned the loss .*; the whole batch's mean loss is .*It is the last micro-batch's"),
    ("returns the sum of the losses", _accumulate(returns="sum"),
     r"It is the sum of the 3 micro-batch losses: divide by micro_batches"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_the_accumulate_check_leaves_the_random_state_alone(capsys):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert exercises.check_accumulate_gradients(_accumulate(), micro_batches=2) is None
    assert torch.equal(torch.rand(3), expected)
    assert "2 micro-batches of 8" in capsys.readouterr().out
