"""Notebook 03's exercise, broadcast_parameters: the wrong answers its check must reject, each with
the message that names the mistake (tests/exercises/test_every_exercise.py runs the reference
solution and the stub)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync_tutorial import exercises

from .conftest import (
    ON_2,
    assert_rejected,
)

NAME = "broadcast_parameters"


def _broadcast(mistake):
    def broadcast_parameters(model):
        params = list(model.named_parameters())
        if mistake == "recomputed locally":  # rank 0's weights were Net() under the seed?
            torch.manual_seed(1234)
            for module in (model.conv1, model.conv2, model.fc1, model.fc2):
                module.reset_parameters()
            return
        if mistake == "through files, one dummy broadcast":
            import os
            import tempfile

            cheat_id = os.environ["GRADSYNC_TEST_CHEAT_ID"]  # the test process (conftest)
            path = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{cheat_id}.pt")
            if dist.get_rank() == 0:
                torch.save(model.state_dict(), path)
            dist.broadcast(torch.zeros(1), src=0)  # for show; it also waits for the file
            model.load_state_dict(torch.load(path))
            dist.barrier()
            return
        for name, p in params:
            if mistake == "weights only" and not name.endswith("weight"):
                continue
            if mistake == "averaged":
                dist.all_reduce(p.detach())
                p.detach().div_(dist.get_world_size())
            elif mistake == "frozen":
                p.requires_grad_(False)  # "no autograd during the broadcast", never undone
                dist.broadcast(p, src=0)
            else:
                dist.broadcast(p.detach().clone() if mistake == "into a copy" else p.detach(),
                               src=1 if mistake == "from rank 1" else 0)
        if mistake == "rank 0 zeroes its own" and dist.get_rank() == 0:
            for _, p in params:
                p.detach().zero_()

    return broadcast_parameters


WRONG = [
    ("into a copy", _broadcast("into a copy"),
     ON_2 + r"rank 1's parameters did not change, although you called broadcast 8 times: you "
            r"broadcast into a copy"),
    ("weights only", _broadcast("weights only"),
     r"rank 1's parameters differ from rank 0's in `conv1\.bias` \(max abs difference .*; 4 "
     r"of 8 tensors differ\): did you broadcast every parameter\?"),
    ("averaged", _broadcast("averaged"),
     r"the replicas agree, but on the average of the ranks' weights, not on rank 0's"),
    ("from rank 1", _broadcast("from rank 1"),
     r"every rank holds rank 1's weights: broadcast from rank 0, src=0"),
    ("frozen", _broadcast("frozen"),
     r"on rank 0, `conv1\.weight` is no longer a trainable parameter"),
    ("recomputed locally", _broadcast("recomputed locally"),
     r"broadcast_parameters made no collective call, so the other ranks cannot have received "
     r"rank 0's weights"),
    ("rank 0 zeroes its own", _broadcast("rank 0 zeroes its own"),
     r"rank 0's own parameters changed, in `conv1\.weight`"),
    ("through files, one dummy broadcast",
     _broadcast("through files, one dummy broadcast"),
     ON_2 + r"rank 1 holds rank 0's weights, but its collectives delivered 1 number \(\[0\]\), "
            r"not rank 0's 21,840 numbers: they reached it another way"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_broadcast_parameters_replacing_the_parameters_passes_with_a_note(capsys):
    def replaces(model):
        for module in (model.conv1, model.conv2, model.fc1, model.fc2):
            for name in ("weight", "bias"):
                t = getattr(module, name).detach().clone()
                dist.broadcast(t, src=0)
                setattr(module, name, nn.Parameter(t))

    assert exercises.check_broadcast_parameters(replaces) is None
    out = capsys.readouterr().out
    assert out.startswith("note: replaces replaced the model's parameter objects")
    assert "✓ correct" in out and "bit for bit" in out
