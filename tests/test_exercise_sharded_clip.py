"""Notebook 08's exercise check, ``check_average_and_clip_shard``, catches what learners write.

The reference solution and the stub are covered by tests/test_exercises.py, as for every
exercise. Here, the wrong answers: each one must be caught with the message that names its
mistake. Most show on 2 ranks (``world_sizes=(2,)`` keeps the tests short); a hard-coded world
size shows on 3 only, which is why the check runs on both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _shard(divide="world_size", op="SUM", norm="global", clip=True, collective="reduce_scatter",
           whole=False):
    """A learner's average_and_clip_shard, with one mistake switched on."""

    def average_and_clip_shard(flat_grad, max_norm):
        n, rank = dist.get_world_size(), dist.get_rank()
        size = len(flat_grad) // n
        if collective == "all_reduce":  # notebook 02's way, then this rank's slice
            summed = flat_grad.clone()
            dist.all_reduce(summed)
            shard = summed[rank * size : (rank + 1) * size].clone()
        elif collective == "reversed list":  # the shards listed in the wrong order
            shard = torch.empty(size)
            dist.reduce_scatter(shard, list(reversed(flat_grad.split(size))))
        elif collective == "none":
            shard = flat_grad[rank * size : (rank + 1) * size].clone()
        else:
            shard = torch.empty(size)
            reduce_scatter(shard, flat_grad, op=getattr(dist.ReduceOp, op))
        if divide == "world_size":
            shard /= n
        elif divide == "two":  # "there are 2 ranks": the course's examples use 2
            shard /= 2
        squares = (shard**2).sum()
        if norm == "global":
            dist.all_reduce(squares)
            total = squares.sqrt()
        elif norm == "shard":  # this rank's shard alone
            total = squares.sqrt()
        elif norm == "sum of norms":
            total = squares.sqrt()
            dist.all_reduce(total)
        elif norm == "before averaging":  # this rank's own gradient, before the reduce-scatter
            dist.all_reduce(squares)
            total = flat_grad.norm()
        elif norm == "vector":  # right, but the all_reduce carries every square
            each = shard**2
            dist.all_reduce(each)
            total = each.sum().sqrt()  # the sum over ranks of every square: right
        if clip:
            shard = shard * min(1.0, max_norm / (float(total) + 1e-6))
        return torch.cat([shard] * n) if whole else shard

    return average_and_clip_shard


@pytest.mark.parametrize("mistake, message", [
    (dict(divide=None), r"on rank 0 of 2, without clipping, your shard is 2\.0× the mean: it is "
                        r"the sum that the reduce-scatter returns\. Divide it by the world size"),
    (dict(op="AVG"), r"your shard is 0\.5× the mean: op=ReduceOp\.AVG already divides by the "
                     r"world size; do not divide again"),
    (dict(norm="shard"), r"on rank 0 of 2, with max_norm .*, you clipped with the norm of your "
                         r"own shard, .*× the whole gradient's norm .*: each rank clips by its "
                         r"own factor\. All-reduce the squared norm of your shard"),
    (dict(clip=False), r"your shard was not clipped, although the gradient's norm is"),
    (dict(norm="sum of norms"), r"you clipped with the sum of the shards' norms"),
    (dict(norm="before averaging"), r"you clipped with the norm of this rank's gradient before "
                                    r"averaging"),
    (dict(norm="vector"), r"the values are right, but your all_reduce carried 12 numbers: the "
                          r"norm needs one per rank"),
    (dict(collective="all_reduce"), r"made no reduce-scatter \(all_reduce of the whole gradient "
                                    r"\(24 numbers\): every rank then holds every shard, as in "
                                    r"notebook 02\)"),
    (dict(collective="none", norm="shard"), r"made no collective call, so no rank knows the "
                                            r"others' gradients"),
    (dict(collective="none"), r"made no reduce-scatter \(only all_reduce of 1 number\)\. The "
                              r"exercise is a sharded step"),
    (dict(collective="reversed list"), r"on rank 0 of 2, without clipping, you returned shard 1 "
                                       r"of the mean"),
    (dict(whole=True), r"on rank 0, average_and_clip_shard returned 24 numbers, the whole "
                       r"gradient: return this rank's shard only, 12 numbers"),
])
def test_wrong_answers_on_two_ranks(mistake, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_average_and_clip_shard(_shard(**mistake), world_sizes=(2,))


def test_a_hard_coded_world_size_passes_on_2_ranks_and_is_caught_on_3(capsys):
    exercises.check_average_and_clip_shard(_shard(divide="two"), world_sizes=(2,))
    assert capsys.readouterr().out.startswith("✓ correct: on 2 ranks")
    with pytest.raises(ExerciseFailed, match=r"on rank 0 of 3, without clipping, your shard is "
                                             r"1\.5× the mean.*Did you divide by 2 instead of "
                                             r"world_size, dist\.get_world_size\(\) \(3 "
                                             r"here\)\?"):
        exercises.check_average_and_clip_shard(_shard(divide="two"))  # 2, then 3 ranks


def test_reduce_op_avg_alone_is_right(capsys):
    exercises.check_average_and_clip_shard(_shard(op="AVG", divide=None), world_sizes=(3,))
    assert capsys.readouterr().out.startswith("✓ correct: on 3 ranks, one reduce-scatter")
