"""Notebook 04's exercise, global_mean_loss: the wrong answers its check must reject, each with the
message that names the mistake (tests/exercises/test_every_exercise.py runs the reference solution
and the stub)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed

from .conftest import (
    ON_2,
    assert_rejected,
    solution,
)

NAME = "global_mean_loss"


def _mean_loss(mistake=None):
    """A learner's global_mean_loss, with one of the typical mistakes switched on."""

    def global_mean_loss(losses):
        losses = losses.detach()
        if mistake in ("mean of means", "no division"):
            mean = losses.mean()
            dist.all_reduce(mean)
            return (mean / (dist.get_world_size() if mistake == "mean of means" else 1)).item()
        if mistake == "local":
            return losses.mean().item()
        if mistake == "through files, one dummy all_reduce":
            import os
            import tempfile

            cheat_id = os.environ["GRADSYNC_TEST_CHEAT_ID"]  # the test process (conftest)
            folder = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{cheat_id}")
            os.makedirs(folder, exist_ok=True)
            rank, n = dist.get_rank(), dist.get_world_size()
            torch.save(losses, os.path.join(folder, f"{n}-{rank}.pt"))
            dist.all_reduce(torch.zeros(1))  # for show; it also waits for every file
            return torch.cat([torch.load(os.path.join(folder, f"{n}-{r}.pt"))
                              for r in range(n)]).mean().item()
        loss_sum = losses.sum()
        dist.all_reduce(loss_sum)
        if mistake == "own count":
            return (loss_sum / len(losses)).item()
        if mistake == "by world size":
            return (loss_sum / dist.get_world_size()).item()
        if mistake == "hard-coded count":
            return (loss_sum / 100).item()
        count = torch.tensor(float(len(losses)))
        dist.all_reduce(count)  # a second call: right, with a note
        return loss_sum / count if mistake == "tensor" else (loss_sum / count).item()

    return global_mean_loss


WRONG = [
    ("mean of means", _mean_loss("mean of means"),
     ON_2 + r"every rank returned .*; the mean over all \d+ samples is .* Yours is the mean of "
            r"the ranks' means .*\(rank 0: \d+, rank 1: \d+\).*mean-of-means"),
    ("no division", _mean_loss("no division"),
     r"Yours is the sum of the ranks' means: all_reduce\(SUM\) adds them up"),
    ("local", _mean_loss("local"),
     r"every rank returned its own mean \(rank 0: .*, rank 1: .*; collectives called: none\)"),
    ("own count", _mean_loss("own count"),
     r"each divided the global sum of the losses by its own count"),
    ("by world size", _mean_loss("by world size"),
     r"Yours is the sum of all losses divided by the world size; divide by the number of "
     r"samples, \d+ in all"),
    ("hard-coded count", _mean_loss("hard-coded count"),
     ON_2 + r"every rank returned .*; the mean over all \d+ samples is .* Yours is the sum of all "
            r"losses divided by 100: the ranks hold \d+ samples in all"),
    ("returns a tensor", _mean_loss("tensor"),
     r"rank 0 returned a tensor, tensor\(.*return a float \(`\.item\(\)`\)"),
    ("through files, one dummy all_reduce",
     _mean_loss("through files, one dummy all_reduce"),
     ON_2 + r"every rank returned the right mean, but rank 0's collectives delivered all_reduce "
            r"of 1 number \(\[0\]\): not the sum of the losses and the count"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_global_mean_loss_two_calls_pass_with_a_note(capsys):
    assert exercises.check_global_mean_loss(_mean_loss()) is None  # two calls: right, a note
    out = capsys.readouterr().out
    assert out.startswith("note: you called all_reduce 2 times; one call on torch.stack")
    assert "✓ correct: on 2 ranks, with rank 0: " in out


def test_global_mean_loss_changed_losses_are_caught():
    def in_place(losses):
        losses.detach().mul_(2)  # detach() shares the memory: the caller's losses change
        return solution("global_mean_loss")(losses) / 2

    with pytest.raises(ExerciseFailed, match=r"on rank 0, in_place changed the `losses` tensor"):
        exercises.check_global_mean_loss(in_place)
