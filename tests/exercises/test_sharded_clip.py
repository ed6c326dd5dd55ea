"""Notebook 08's exercise, average_and_clip_shard (shards of 12 numbers on 2 ranks, of 10 on 3): the
wrong answers its check must reject, each with the message that names the mistake
(tests/exercises/test_every_exercise.py runs the reference solution and the stub)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises

from .conftest import (
    ON_2,
    ON_3,
    assert_rejected,
    cheat_folder,
    load_everyone,
    save_for_all,
)

NAME = "average_and_clip_shard"
# torch 2.13 renamed reduce_scatter_tensor reduce_scatter_single: the same function.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _shard(divide="world_size", op="SUM", norm="global", clip=True, collective="reduce_scatter",
           whole=False, size=None):
    """A learner's average_and_clip_shard, with one mistake switched on (divide: "two" or
    "three", a hard-coded world size; size: a hard-coded shard size)."""

    def average_and_clip_shard(flat_grad, max_norm):
        n, rank = dist.get_world_size(), dist.get_rank()
        piece = size or len(flat_grad) // n
        if divide == "flat_grad in place":  # the right numbers, but the caller's gradient too
            flat_grad /= n
        if collective == "all_reduce":  # notebook 02's way, then this rank's slice
            summed = flat_grad.clone()
            dist.all_reduce(summed)
            shard = summed[rank * piece : (rank + 1) * piece].clone()
        elif collective == "reversed list":  # the shards listed in the wrong order
            shard = torch.empty(piece)
            dist.reduce_scatter(shard, list(reversed(flat_grad.split(piece))))
        elif collective == "none":
            shard = flat_grad[rank * piece : (rank + 1) * piece].clone()
        elif collective == "files":  # every rank's gradient in a file, a dummy reduce-scatter
            folder = cheat_folder("shard")
            save_for_all(flat_grad, folder)
            shard = torch.zeros(piece)
            _reduce_scatter(shard, torch.zeros_like(flat_grad))  # for show; it waits too
            shard = sum(load_everyone(folder))[rank * piece : (rank + 1) * piece]
        else:
            shard = torch.empty(piece)
            _reduce_scatter(shard, flat_grad, op=getattr(dist.ReduceOp, op))
        if divide in ("world_size", "two", "three"):
            shard /= {"two": 2, "three": 3}.get(divide, n)
        squares = (shard**2).sum()
        total = _shard_norm(norm, shard, squares, flat_grad)
        if clip == "the squared norm compared":  # the square against max_norm, uncapped
            if float(total) ** 2 > max_norm:
                shard = shard * (max_norm / (float(total) + 1e-6))
        elif clip:
            shard = shard * min(1.0, max_norm / (float(total) + 1e-6))
        return torch.cat([shard] * n) if whole else shard

    return average_and_clip_shard


def _shard_norm(norm, shard, squares, flat_grad):
    """The norm an average_and_clip_shard clips by: the whole mean gradient's ("global"), or
    one of the mistakes."""
    if norm == "global":
        dist.all_reduce(squares)
        return squares.sqrt()
    if norm == "shard":  # this rank's shard alone
        return squares.sqrt()
    if norm == "sum of norms":
        total = squares.sqrt()
        dist.all_reduce(total)
        return total
    if norm == "before averaging":  # this rank's own gradient, before the reduce-scatter
        dist.all_reduce(squares)
        return flat_grad.norm()
    if norm == "vector":  # right, but the all_reduce carries every square
        each = shard**2
        dist.all_reduce(each)
        return each.sum().sqrt()
    folder = cheat_folder("norm")  # "files": the squares in files, a dummy all_reduce
    save_for_all(squares, folder)
    dist.all_reduce(torch.zeros(1))  # for show; it also waits for every file
    return sum(load_everyone(folder)).sqrt()


WRONG = [
    ("no division", _shard(divide=None),
     ON_2 + r"on rank 0 of 2, without clipping, your shard is 2\.0× the mean: it is the sum that "
            r"the reduce-scatter returns\. Divide it by the world size"),
    ("ReduceOp.AVG, then divided", _shard(op="AVG"),
     r"your shard is 0\.5× the mean: op=ReduceOp\.AVG already divides by the world size; do "
     r"not divide again"),
    ("hard-coded / 2", _shard(divide="two"),
     ON_3 + r"on rank 0 of 3, without clipping, your shard is 1\.5× the mean.*Did you divide by "
            r"2 instead of world_size, dist\.get_world_size\(\) \(3 here\)\?"),
    ("hard-coded / 3", _shard(divide="three"),
     ON_2 + r"on rank 0 of 2, without clipping, your shard is 0\.67× the mean.*Did you divide "
            r"by 3 instead of world_size"),
    ("hard-coded shard of 12", _shard(size=12),
     ON_3 + r"on rank 0, the reduce-scatter refused your tensors \(outputShape\[0\] \* "
            r"worldSize == inputShape\[0\] \(36 vs\. 30\)\): with 3 ranks and a flat gradient "
            r"of 30 numbers, each shard has 10"),
    ("clipped by its own shard's norm", _shard(norm="shard"),
     ON_2 + r"on rank 0 of 2, with max_norm .*, you clipped with the norm of your own shard, "
            r".*× the whole gradient's norm .*: each rank clips by its own factor\. All-reduce "
            r"the squared norm of your shard"),
    ("the squared norm compared with max_norm", _shard(clip="the squared norm compared"),
     ON_2 + r"on rank 0 of 2, with max_norm .*, above the gradient's norm .*, your shard "
            r"changed \(×2\): clip only when the norm itself"),
    ("not clipped", _shard(clip=False),
     r"your shard was not clipped, although the gradient's norm is"),
    ("the sum of the norms", _shard(norm="sum of norms"),
     r"you clipped with the sum of the shards' norms"),
    ("the norm before averaging", _shard(norm="before averaging"),
     r"you clipped with the norm of this rank's gradient before averaging"),
    ("every square all-reduced", _shard(norm="vector"),
     ON_2 + r"the values are right, but your all_reduce carried 12 numbers: the norm needs one "
            r"per rank"),
    ("all_reduce of the whole gradient",
     _shard(collective="all_reduce"),
     r"made no reduce-scatter \(all_reduce of the whole gradient \(24 numbers\): every rank "
     r"then holds every shard, as in notebook 02\)"),
    ("no collective", _shard(collective="none", norm="shard"),
     r"made no collective call, so no rank knows the others' gradients"),
    ("no reduce-scatter", _shard(collective="none"),
     r"made no reduce-scatter \(only all_reduce of 1 number \(\[.*\]\)\)\. The exercise is a "
     r"sharded step"),
    ("the shards in reverse", _shard(collective="reversed list"),
     r"on rank 0 of 2, without clipping, you returned shard 1 of the mean"),
    ("returns the whole gradient", _shard(whole=True),
     r"on rank 0, average_and_clip_shard returned 24 numbers, the whole gradient: return this "
     r"rank's shard only, 12 numbers"),
    ("divides flat_grad in place",
     _shard(divide="flat_grad in place"),
     ON_2 + r"on rank 0, average_and_clip_shard changed the flat gradient it was given \(max "
            r"abs difference .*\): return the shard, and leave the flat gradient"),
    ("through files, a dummy reduce-scatter",
     _shard(collective="files"),
     ON_2 + r"the values are right, but on rank 0 the reduce-scatter's output and input held 36 "
            r"numbers \(\[0, 0, 0, 0, \.\.\.\]\) afterwards, not the sum over the ranks of shard "
            r"0"),
    ("the norm through files, a dummy all_reduce",
     _shard(norm="files"),
     ON_2 + r"the values are right, but on rank 0 \(with no clipping\) your all_reduce of 1 "
            r"number \(\[0\]\) is not the squared norm of the mean gradient"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_the_sharded_check_accepts_avg_alone(capsys):
    exercises.check_average_and_clip_shard(_shard(op="AVG", divide=None), world_size=3)
    assert capsys.readouterr().out.startswith(
        "✓ correct: on 3 ranks (shards of 10 numbers), with and without clipping, one "
        "reduce-scatter delivered every rank the mean of its shard over the ranks, and one "
        "all_reduce of one number the squared norm")
