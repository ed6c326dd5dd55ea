"""Notebook 11's exercise, ``pipeline_gradient(stage, batches, n_microbatches)``: the wrong answers
its check must reject, each with the message that names the mistake.

The reference solution and the stub are tested by ``tests/exercises/test_every_exercise.py``
(it finds every exercise); here: a double division, a missing one, the default scaling across steps
(torchtitan#1733), a division per step only, zeroing between the steps, an optimizer step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import ScheduleGPipe

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed
from gradsync_tutorial.exercises.pipeline_gradient import coefficients

from .conftest import cheat_folder, check


def _step(schedule, stage, x, y):
    """One schedule step, as each stage takes it: the first feeds x, the last the targets."""
    if stage.is_first:
        schedule.step(x)
    elif stage.is_last:
        schedule.step(target=y)
    else:
        schedule.step()


def _pipeline(loss="sum / all", scale_grads=False, then_divide=1, zero_between=False,
              steps_optimizer=False):
    """A learner's pipeline_gradient with one mistake switched on (loss: "mean", "mean / n",
    "sum / all" (the count of all the batches), "sum / all, twice"; then_divide: .grad /= it)."""

    def pipeline_gradient(stage, batches, n_microbatches):
        count = sum(y.numel() for _, y in batches)
        divisor = {"mean": 1, "mean / n": n_microbatches}.get(loss)

        def loss_fn(output, target):
            if divisor is not None:
                return F.mse_loss(output, target) / divisor
            return F.mse_loss(output, target, reduction="sum") / count

        schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        for x, y in batches:
            if zero_between:
                stage.submod.zero_grad()
            _step(schedule, stage, x, y)
        with torch.no_grad():
            for p in stage.submod.parameters():
                p.grad /= then_divide
                if steps_optimizer:
                    p -= 0.1 * p.grad

    return pipeline_gradient


WRONG = [
    ("the default across steps, a mean loss", _pipeline(loss="mean", scale_grads=True),
     r"on 2 ranks: on rank 0 \(stage 0\), the gradient is not the mean over all the batches: "
     r"each earlier batch's gradient is divided by 4 once more per later step \(coefficients "
     r"0\.25, 1\): scale_grads=True \(the default\) divides everything in \.grad by "
     r"n_microbatches at the end of every step\(\), .*\(torchtitan#1733\)\. Accumulating"),
    ("a count loss with the default: divided twice and across steps",
     _pipeline(scale_grads=True),
     r"divided by 4 once more per later step .* The last batch is divided twice, too: your "
     r"loss_fn already divides by the count"),
    ("divided twice, by hand", _pipeline(then_divide=4),
     r"your gradients are 0\.25× the expected ones: the gradient is divided twice"),
    ("no division: a mean loss, scale_grads=False", _pipeline(loss="mean"),
     r"your gradients are 8\.0× the expected ones: nothing divided it: a mean loss_fn with "
     r"scale_grads=False"),
    ("each step divided by its micro-batches only", _pipeline(loss="mean / n"),
     r"your gradients are 2\.0× the expected ones: each step is divided by its own "
     r"micro-batches only"),
    ("zeroed between the steps", _pipeline(zero_between=True),
     r"only the last batch's gradient is left: do not zero the gradients between the steps"),
    ("steps the optimizer", _pipeline(steps_optimizer=True),
     r"on 2 ranks: on rank 0, pipeline_gradient changed the parameters: .* leave the "
     r"parameters alone"),
]


@pytest.mark.parametrize(("mistake", "fn", "message"), WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_pipeline_gradient_is_rejected_saying_why(mistake, fn, message):
    fn.__name__ = "pipeline_gradient"
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_pipeline_gradient(fn)


def test_a_hard_coded_number_of_micro_batches_fails_at_3_ranks():
    def pipeline_gradient(stage, batches, n_microbatches):
        schedule = ScheduleGPipe(stage, n_microbatches, scale_grads=False,
                                 loss_fn=lambda o, t: F.mse_loss(o, t) / (4 * len(batches)))
        for x, y in batches:  # 4: the number of micro-batches on 2 ranks only
            _step(schedule, stage, x, y)

    with pytest.raises(ExerciseFailed, match=r"right on 2 ranks, but on 3 ranks: .* your "
                                             r"gradients are 0\.75× the expected ones"):
        check("pipeline_gradient")(pipeline_gradient)


def test_coefficients_name_each_steps_weight_or_none():
    g = torch.eye(4)[:3]
    assert [round(a, 6) for a in coefficients(g[0] / 9 + g[1] / 3 + g[2], g)] == [
        round(1 / 9, 6), round(1 / 3, 6), 1.0]
    assert coefficients(torch.ones(4), g) is None  # the fourth number is in no step's gradient


def test_a_hard_coded_number_of_steps_fails_at_4_ranks_too():
    """2 steps on 2 ranks: a loss divided by 2, not by len(batches), fails at 3 ranks (3 steps),
    and at 4 and 5 (N micro-batches × 3 steps; they ran 2 steps before)."""

    def pipeline_gradient(stage, batches, n_microbatches):
        schedule = ScheduleGPipe(stage, n_microbatches, scale_grads=False,
                                 loss_fn=lambda o, t: F.mse_loss(o, t) / (n_microbatches * 2))
        for x, y in batches:  # 2: the number of steps on 2 ranks
            _step(schedule, stage, x, y)

    with pytest.raises(ExerciseFailed, match=r"^on 4 ranks: "):  # 2 passes: not run
        check("pipeline_gradient")(pipeline_gradient, world_size=4)


def test_stages_that_swap_activations_through_files_are_caught():
    """The right gradients without a schedule: each stage's activations and gradients go
    through files, in turn, between barriers. Nothing crossed through torch.distributed."""
    def pipeline_gradient(stage, batches, n_microbatches):
        import os

        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        folder = cheat_folder(f"pipe-{len(batches)}-{n_microbatches}")
        x, y = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        path = lambda what, r: os.path.join(folder, f"{what}{r}.pt")  # noqa: E731
        taken = out = None
        for turn in range(world):  # forward, stage by stage
            if turn == rank:
                taken = x if stage.is_first else torch.load(path("act", rank - 1))
                taken.requires_grad_(not stage.is_first)
                out = stage.submod(taken)
                torch.save(out.detach(), path("act", rank))
            dist.barrier()
        for turn in reversed(range(world)):  # backward, last stage first
            if turn == rank:
                if stage.is_last:
                    F.mse_loss(out, y).backward()
                else:
                    out.backward(torch.load(path("grad", rank + 1)))
                if not stage.is_first:
                    torch.save(taken.grad, path("grad", rank))
            dist.barrier()

    with pytest.raises(ExerciseFailed, match=r"^on 2 ranks: the gradients are right, but on "
                                             r"rank 0 \(stage 0\) nothing went to or from"):
        check("pipeline_gradient")(pipeline_gradient)
