"""Notebook 08's check, ``average_and_clip_shard(flat_grad, max_norm)``: a wrong answer is told
its own cause, not the cause of another mistake that gives a number of the same kind.

A factor that is not a division (an uncapped clip factor scales the shard up) is not told to
divide by the world size; a collective that sends one number per rank is not told it sent more.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed

# torch 2.13 renamed reduce_scatter_tensor reduce_scatter_single: the same function.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _mean_shard(flat_grad):
    shard = torch.empty(len(flat_grad) // dist.get_world_size())
    reduce_scatter(shard, flat_grad)
    return shard / dist.get_world_size()


def uncapped(flat_grad, max_norm):
    shard = _mean_shard(flat_grad)
    squares = (shard**2).sum()
    dist.all_reduce(squares)
    return shard * (max_norm / (squares.sqrt() + 1e-6))  # the mistake: no min(1, ...)


def gathered_norm(flat_grad, max_norm):
    shard = _mean_shard(flat_grad)
    everyone = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, (shard**2).sum())  # one number per rank: right, but not the sum
    norm = torch.stack(everyone).sum().sqrt()
    return shard * torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def test_an_uncapped_clip_factor_is_told_to_cap_it_not_to_divide():
    with pytest.raises(ExerciseFailed) as info:
        exercises.check_average_and_clip_shard(uncapped, world_size=2)
    message = str(info.value)
    assert "Cap the factor at 1" in message, message
    assert "world size" not in message and "Did you divide" not in message, message


def test_an_all_gather_of_one_number_is_told_it_sent_one_not_several():
    with pytest.raises(ExerciseFailed) as info:
        exercises.check_average_and_clip_shard(gathered_norm, world_size=3)
    message = str(info.value)
    assert "of one number per rank delivered 3 squared norms" in message, message
    assert "carried" not in message, message
