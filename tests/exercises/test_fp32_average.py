"""Notebook 09's exercise, average_gradients_in_fp32 (a bf16 model): the wrong answers its check
must reject, each with the message that names the mistake (tests/exercises/test_every_exercise.py
runs the reference solution and the stub)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed, common

from .conftest import (
    ON_2,
    ON_3,
    assert_rejected,
    cheat_folder,
    load_everyone,
    save_for_all,
)

NAME = "average_gradients_in_fp32"


def _fp32(divide=True, world_size=None, copy_back=True, bf16_division=False, dummy=None,
          then=None, divide_first=False, bf16_division_after=False):
    """A learner's average_gradients_in_fp32, with one of the typical mistakes switched on
    (dummy: the gradients through files, next to a dummy all_reduce of that many zeros)."""

    def average_gradients_in_fp32(model):
        grads = [p.grad for p in model.parameters()]
        n = world_size or dist.get_world_size()
        if then == "turns the model float32":  # "reduce in fp32": the parameters too
            model.float()
            grads = [p.grad for p in model.parameters()]
        if bf16_division:  # divide each bf16 gradient first: rounded in bf16, then summed
            buffer = torch.cat([(g / n).float().flatten() for g in grads])
        elif divide_first:  # what DDP does: each float32 gradient / N, then the sum (right)
            buffer = torch.cat([g.float().flatten() / n for g in grads])
        else:
            buffer = torch.cat([g.float().flatten() for g in grads])
        if dummy:
            folder = cheat_folder(f"fp32-{dummy}")
            save_for_all(buffer, folder)
            dist.all_reduce(torch.zeros(dummy))  # a float32 all_reduce, as a barrier
            buffer = sum(load_everyone(folder))
        else:
            dist.all_reduce(buffer)
        if divide and not (bf16_division or divide_first or bf16_division_after):
            buffer /= n
        if copy_back:
            for g, piece in zip(grads, buffer.split([g.numel() for g in grads]), strict=True):
                g.copy_(piece.view_as(g))
                if bf16_division_after:  # the float32 sum rounded to bf16, then divided in bf16
                    g /= n
        if then == "steps the optimizer":
            torch.optim.SGD(model.parameters(), lr=0.1).step()

    return average_gradients_in_fp32


def _fp32_in_bf16(model):
    """Notebook 02's loop on a bf16 model: the sum in bf16 (right numbers on 2 ranks)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


WRONG = [
    ("the sum in bf16", _fp32_in_bf16,
     ON_2 + r"your all_reduce carried bfloat16, not float32: the sum was computed in bfloat16"),
    ("no division", _fp32(divide=False),
     ON_2 + r"your gradients are 2\.0× the mean: all_reduce\(SUM\) gives the sum; divide it by "
            r"the world size"),
    ("hard-coded / 2", _fp32(world_size=2),
     ON_3 + r"your gradients are 1\.5× the mean over ranks.*Did you divide by 2 instead of the "
            r"world size \(3 here\)"),
    ("hard-coded / 3", _fp32(world_size=3),
     ON_2 + r"your gradients are 0\.67× the mean over ranks.*Did you divide by 3 instead of the "
            r"world size \(2 here\)"),
    ("a division in bf16", _fp32(bf16_division=True),
     ON_3 + r"[\d,]+ of your 21,840 numbers are not the float32 mean rounded once to bf16"),
    ("a reduced copy", _fp32(copy_back=False),
     ON_2 + r"the gradients did not change: every rank still holds its own"),
    ("turns the model float32",
     _fp32(then="turns the model float32"),
     ON_2 + r"on rank 0, average_gradients_in_fp32 turned the parameters float32: leave the "
            r"model as it is"),
    ("steps the optimizer", _fp32(then="steps the optimizer"),
     ON_2 + r"on rank 0, average_gradients_in_fp32 changed the parameters: `conv1\.weight`.*"
            r"leave the model as it is"),
    ("through files, a dummy all_reduce of one number",
     _fp32(dummy=1),
     ON_2 + r"the gradients are right, but on rank 0 your all_reduce calls delivered 1 number "
            r"\(\[0\]\), not the sum of the ranks' 21,840 gradient numbers"),
    ("through files, a dummy all_reduce of 21,840 zeros",
     _fp32(dummy=21840),
     ON_2 + r"the gradients are right, but on rank 0 your all_reduce calls delivered 21,840 "
            r"numbers \(\[0, 0, 0, 0, \.\.\.\]\), not the sum"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_the_fp32_check_says_what_it_verified(capsys):
    exercises.check_average_gradients_in_fp32(_fp32(), world_size=3)
    assert capsys.readouterr().out.startswith(
        "✓ correct: on 3 ranks, your all_reduce carried float32 (1 call, 21,840 numbers) and "
        "delivered the sum of the ranks' bf16 gradients; every rank's bf16 gradients are the "
        "mean rounded once")


def test_float32_gradients_divided_before_the_sum_are_right_at_every_size(capsys):
    """DDP's order: each float32 gradient divided by N, then summed. float32 rounds twice, and
    tips a few means that lie at a bf16 tie: still the mean rounded once."""
    exercises.check_average_gradients_in_fp32(_fp32(divide_first=True), world_size=5)
    assert capsys.readouterr().out.startswith("✓ correct: on 5 ranks")  # 67 numbers failed


def test_a_bf16_division_after_the_sum_is_caught_where_4_ranks_were_drawn(monkeypatch):
    """Dividing the bf16 sum by 2 or 4 is exact: where the drawn size is 4, 3 ranks run too."""
    monkeypatch.setenv(common.SIZE_VARIABLE, "4")
    with pytest.raises(ExerciseFailed, match=r"on 3 ranks: [\d,]+ of your 21,840 numbers are "
                       r"not the float32 mean rounded once"):
        exercises.check_average_gradients_in_fp32(_fp32(bf16_division_after=True))
