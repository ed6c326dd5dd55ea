"""Notebook 00's exercise, gather_ranks: the wrong answers its check must reject, each with the
message that names the mistake (tests/exercises/test_every_exercise.py runs the reference solution
and the stub)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises

from .conftest import (
    ON_2,
    ON_3,
    assert_rejected,
)

NAME = "gather_ranks"


def _gather(mistake):
    def gather_ranks(rank, world_size):
        if mistake == "computed locally":
            return list(range(world_size))
        if mistake == "barrier, then a guess":
            dist.barrier()
            return list(range(world_size))
        if mistake in ("one dummy all_reduce, then a guess", "ranks counted with all_reduce"):
            t = torch.ones(1)
            dist.all_reduce(t)  # every rank sends 1: the sum is the number of ranks
            return list(range(world_size if mistake[0] == "o" else int(t.item())))
        if mistake == "own rank summed, then a guess":
            dist.all_reduce(torch.tensor([float(rank)]))
            return list(range(world_size))
        if mistake == "through files, one dummy all_reduce":
            import os
            import tempfile

            cheat_id = os.environ["GRADSYNC_TEST_CHEAT_ID"]  # the test process (conftest)
            folder = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{cheat_id}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, str(rank)), "w") as f:
                f.write(str(rank))
            dist.all_reduce(torch.zeros(1))  # for show; it also waits for every file
            return sorted(int(open(os.path.join(folder, n)).read()) for n in os.listdir(folder)
                          if int(n) < world_size)
        if mistake.startswith("rank 0's list broadcast"):
            # Rank 0 builds the list alone; the others fill their buffer with their own rank,
            # so that each "sends" its number; a dummy all_gather after it, for show.
            t = (torch.arange(world_size) if rank == 0 else torch.full((world_size,), rank)).float()
            dist.broadcast(t, src=0)
            if mistake.endswith("then an all_gather"):
                dist.all_gather([torch.zeros(1) for _ in range(world_size)],
                                torch.tensor([float(rank)]))
            return [int(x) for x in t.tolist()]
        n = {"hard-coded 2 ranks": 2, "hard-coded 3 ranks": 3}.get(mistake, world_size)
        everyone = ([torch.zeros(1)] * n if mistake == "one tensor repeated" else
                    [torch.zeros(1) for _ in range(n)])
        dist.all_gather(everyone, torch.tensor([float(rank)]))
        return everyone if mistake == "returns tensors" else [int(t.item()) for t in everyone]

    return gather_ranks


WRONG = [
    ("computed locally", _gather("computed locally"),
     ON_2 + r"gather_ranks made no collective call that moves data \(collectives called: "
            r"none\).*dist\.all_gather"),
    ("barrier, then a guess", _gather("barrier, then a guess"),
     r"made no collective call that moves data \(collectives called: barrier once\)"),
    ("one dummy all_reduce, then a guess",
     _gather("one dummy all_reduce, then a guess"),
     ON_2 + r"every rank sent the same numbers through its collectives \(1 number \(\[1\]\)\), "
            r"so no rank learned anything from the others"),
    ("ranks counted with all_reduce", _gather("ranks counted with all_reduce"),
     ON_2 + r"every rank sent the same numbers"),
    ("own rank summed, then a guess", _gather("own rank summed, then a guess"),
     ON_2 + r"rank 0 returned the right list, but its collectives delivered all_reduce of 1 "
            r"number \(\[1\]\): not every rank's number"),
    ("through files, one dummy all_reduce",
     _gather("through files, one dummy all_reduce"), ON_2 + r"every rank sent the same numbers"),
    ("one tensor repeated", _gather("one tensor repeated"),
     ON_2 + r"the list you passed to all_gather holds the same tensor 2 times \(rank 0 "
            r"returned \[1, 1\]\): `\[t\] \* 2` repeats"),
    ("returns tensors", _gather("returns tensors"),
     r"rank 0 returned a list of tensors.*t\.item\(\)"),
    # Right at 2 ranks: there rank 0's list is [0, 1], numbers a buffer may hold anyway.
    ("rank 0's list broadcast", _gather("rank 0's list broadcast"),
     ON_3 + r"rank 0 sent other ranks' numbers \(3 numbers \(\[0, 1, 2\]\)\) in its first "
            r"collective, broadcast, before it had received any: it built the list alone"),
    ("rank 0's list broadcast, then an all_gather",
     _gather("rank 0's list broadcast, then an all_gather"), ON_3 + r"rank 0 sent other ranks'"),
    ("hard-coded 3 ranks", _gather("hard-coded 3 ranks"),
     r"^gather_ranks raised an error on rank \d \(of 2\)"),
    ("hard-coded 2 ranks", _gather("hard-coded 2 ranks"),
     r"^gather_ranks raised an error on rank \d \(of 3\)"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_gather_ranks_floats_are_fine(capsys):
    def floats(rank, world_size):  # [0.0, 1.0] == [0, 1]: accepted
        everyone = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(everyone, torch.tensor([float(rank)]))
        return torch.cat(everyone).tolist()

    assert exercises.check_gather_ranks(floats) is None
    assert "✓ correct" in capsys.readouterr().out
