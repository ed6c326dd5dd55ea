"""Notebook 02's exercise, average_gradients_flat: the wrong answers its check must reject, each
with the message that names the mistake (tests/exercises/test_every_exercise.py runs the reference
solution and the stub)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as imported_all_reduce

from gradsync_tutorial import exercises

from .conftest import (
    ON_2,
    ON_3,
    assert_rejected,
)

NAME = "average_gradients_flat"


def _flat(divide=True, copy_back=True, divide_on=None, world_size=None, put_back="view_as",
          then=None):
    """A learner's average_gradients_flat, with one of the typical mistakes switched on."""

    def average_gradients_flat(model):
        grads = [p.grad for p in model.parameters()]
        buffer = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(buffer)
        if divide and (divide_on is None or dist.get_rank() in divide_on):
            buffer /= world_size or dist.get_world_size()
        if copy_back:
            pieces = buffer.split([g.numel() for g in grads])
            for p, g, piece in zip(model.parameters(), grads, pieces, strict=True):
                if put_back == "view_as":
                    g.copy_(piece.view_as(g))
                elif put_back == "copy_":
                    g.copy_(piece)  # (150,) into (6, 1, 5, 5)
                elif put_back == "assign":
                    p.grad = piece
                else:  # .data =: no error, a gradient of the wrong shape
                    p.grad.data = piece
        if then == "zeroes the parameters":
            for p in model.parameters():
                p.detach().zero_()

    return average_gradients_flat


def _flat_other(mistake):
    def average_gradients_flat(model):
        if mistake in ("per parameter", "per parameter, imported all_reduce"):
            for p in model.parameters():  # notebook 02's loop: right values, 8 calls
                (dist.all_reduce if mistake == "per parameter" else imported_all_reduce)(p.grad)
                p.grad /= dist.get_world_size()
            return
        # Through files: each rank saves its gradients, one all_reduce "for show" (of one
        # number, or of a zero tensor of the right size), then the mean from the files.
        import os
        import tempfile

        rank, n = dist.get_rank(), dist.get_world_size()
        cheat_id = os.environ["GRADSYNC_TEST_CHEAT_ID"]  # the test process (conftest)
        folder = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{cheat_id}-{n}")
        os.makedirs(folder, exist_ok=True)
        torch.save([p.grad for p in model.parameters()], os.path.join(folder, f"{rank}.pt"))
        size = 1 if mistake.endswith("one number") else sum(p.numel() for p in model.parameters())
        dist.all_reduce(torch.zeros(size))
        everyone = [torch.load(os.path.join(folder, f"{r}.pt")) for r in range(n)]
        dist.barrier()
        for i, p in enumerate(model.parameters()):
            p.grad.copy_(sum(grads[i] for grads in everyone) / n)

    return average_gradients_flat


WRONG = [
    ("per parameter", _flat_other("per parameter"),
     ON_2 + r"the gradients are right, but you called all_reduce 8 times; one call is enough"),
    ("per parameter, imported all_reduce",
     _flat_other("per parameter, imported all_reduce"), r"called all_reduce 8 times"),
    ("no division", _flat(divide=False),
     ON_2 + r"your gradients are 2\.0× the expected ones \(the mean over ranks\): did you "
            r"divide by the world size\?"),
    ("hard-coded / 3", _flat(world_size=3),
     ON_2 + r"your gradients are 0\.67× the expected ones .*Did you divide by 3 instead of "
            r"world_size"),
    ("hard-coded / 2", _flat(world_size=2),
     ON_3 + r"your gradients are 1\.5× the expected ones .*Did you divide by 2 instead of "
            r"world_size"),
    ("a reduced copy", _flat(copy_back=False),
     r"the gradients did not change: every rank still holds its own\. You reduced a copy"),
    ("divided on rank 0 only", _flat(divide_on=(0,)),
     r"rank 1's gradients differ from rank 0's in `conv1\.weight` \(max abs difference .*; 8 "
     r"of 8 tensors differ\)"),
    (".data = a flat piece", _flat(put_back="data"),
     r"differ from the mean over ranks in `conv1\.weight` \(a different shape; 4 of 8 tensors "
     r"differ\).*piece\.view_as\(p\.grad\)"),
    ("through files, one dummy all_reduce of one number",
     _flat_other("through files, one dummy all_reduce of one number"),
     ON_2 + r"the gradients are right, but on rank 0 the all_reduce delivered 1 number "
            r"\(\[0\]\), not the sum of the ranks' 21,840 gradient numbers"),
    ("through files, one dummy all_reduce of 21,840 zeros",
     _flat_other("through files, one dummy all_reduce of 21,840 zeros"),
     r"the all_reduce delivered 21,840 numbers \(\[0, 0, 0, 0, \.\.\.\]\), not the sum"),
    ("zeroes the parameters", _flat(then="zeroes the parameters"),
     ON_2 + r"on rank 0, average_gradients_flat changed the parameters: `conv1\.weight`.*"
            r"leave the weights alone"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_the_flat_check_accepts_avg(capsys):
    def averaged_by_gloo(model):  # ReduceOp.AVG: the mean in one call (gloo has it here)
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))

    exercises.check_average_gradients_flat(averaged_by_gloo)
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: on 2 and 3 ranks, one all_reduce carried all 21,840 "
                          "numbers of the 8 gradients")
