"""Notebook 09's exercise check, average_gradients_in_fp32: its reference solution passes (in
tests/test_exercises.py, with every exercise) and the typical wrong answers are caught, each
with the message that names the mistake.

The wrong answers: the sum in bf16 (the all_reduce carried bfloat16), no division, a
hard-coded world size (right on 2 ranks), a division in bf16 (right on 2 ranks, rounded twice
on 3), the mean never copied back, a model turned float32, and data exchanged through a file
with a dummy all_reduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed


def _fp32(model, divide=True, world_size=None, copy_back=True, bf16_division=False):
    """A learner's average_gradients_in_fp32, with one of the typical mistakes switched on."""
    grads = [p.grad for p in model.parameters()]
    n = world_size or dist.get_world_size()
    if bf16_division:  # divide each bf16 gradient first: rounded in bf16, then summed
        buffer = torch.cat([(g / n).float().flatten() for g in grads])
    else:
        buffer = torch.cat([g.float().flatten() for g in grads])
    dist.all_reduce(buffer)
    if divide and not bf16_division:
        buffer /= n
    if copy_back:
        for g, piece in zip(grads, buffer.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))


def test_the_sum_in_bf16_is_caught_by_what_the_all_reduce_carried():
    def in_bf16(model):  # notebook 02's loop on a bf16 model: right numbers on 2 ranks
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    with pytest.raises(ExerciseFailed, match=r"^on 2 ranks: your all_reduce carried bfloat16, "
                                             r"not float32: the sum was computed in bfloat16"):
        exercises.check_average_gradients_in_fp32(in_bf16)


@pytest.mark.parametrize("mistake, message", [
    (dict(divide=False), r"^on 2 ranks: your gradients are 2\.0× the mean: all_reduce\(SUM\) "
                         r"gives the sum; divide it by the world size"),
    (dict(world_size=2), r"^right on 2 ranks, but on 3 ranks: your gradients are 1\.5× the mean "
                         r"over ranks.*Did you divide by 2 instead of the world size \(3 here\)"),
    (dict(bf16_division=True), r"^right on 2 ranks, but on 3 ranks: [\d,]+ of your 21,840 numbers "
                               r"are not the float32 mean rounded once to bf16"),
    (dict(copy_back=False), r"^on 2 ranks: the gradients did not change: every rank still holds "
                            r"its own"),
])
def test_wrong_answers(mistake, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_average_gradients_in_fp32(lambda model: _fp32(model, **mistake))


def test_a_model_turned_float32_is_caught():
    def to_fp32(model):  # "reduce in fp32": the whole model, parameters included
        model.float()
        _fp32(model)

    with pytest.raises(ExerciseFailed, match=r"^on 2 ranks: on rank 0, the parameters turned "
                                             r"float32: leave the model as it is"):
        exercises.check_average_gradients_in_fp32(to_fp32)


def test_gradients_exchanged_through_a_file_are_caught(tmp_path):
    def through_a_file(model):  # every rank writes its gradients, reads the others'
        rank, n = dist.get_rank(), dist.get_world_size()
        grads = [p.grad for p in model.parameters()]
        torch.save([g.float() for g in grads], tmp_path / f"{n}-{rank}.pt")
        dist.all_reduce(torch.zeros(1))  # a float32 all_reduce, as a barrier
        everyone = [torch.load(tmp_path / f"{n}-{r}.pt") for r in range(n)]
        for i, g in enumerate(grads):
            g.copy_(sum(e[i] for e in everyone) / n)

    with pytest.raises(ExerciseFailed, match=r"^on 2 ranks: your all_reduce calls carried 1 "
                                             r"numbers, which are not the sum of the ranks' "
                                             r"21,840 gradients"):
        exercises.check_average_gradients_in_fp32(through_a_file)


def test_the_check_says_what_it_verified(capsys):
    exercises.check_average_gradients_in_fp32(lambda model: _fp32(model), world_size=3)
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: on 3 ranks, your all_reduce carried float32 (1 call, "
                          "21,840 numbers, the sum of the ranks' bf16 gradients)")
