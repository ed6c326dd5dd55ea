"""Notebook 13's exercise, average_pseudo_gradient: the check rejects the usual wrong answers
with the message that names the mistake (the reference solution and the stub are tested by
tests/exercises/test_every_exercise.py, which finds every exercise by itself).

Each wrong answer is what a learner writes: a division by the world size while a replica is
healing, the pseudo-gradient's other sign (torchft#233), a healing replica that sends its own
weights, no division, a hard-coded count, the mean weights instead of start minus them, and a
`start` changed in place.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial.exercises import ExerciseFailed

from .conftest import cheat_folder, check, load_everyone, save_for_all, solution


def _pseudo(mistake=None):
    """A learner's average_pseudo_gradient, with one mistake switched on."""

    called = [0]  # this rank's calls so far: a file folder of each call's own

    def average_pseudo_gradient(model, start, participating):
        called[0] += 1
        count = torch.tensor([float(participating)], dtype=torch.float64)
        dist.all_reduce(count)
        if mistake == "hard-coded world_size - 1":
            count = torch.tensor([float(dist.get_world_size() - 1)], dtype=torch.float64)
        if mistake == "someone heals taken as world_size - 1":  # whether any heals, not how many
            anyone = torch.tensor([float(not participating)], dtype=torch.float64)
            dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
            count = torch.tensor([dist.get_world_size() - anyone.item()], dtype=torch.float64)
        out = []
        for s, p in zip(start, model.parameters(), strict=True):
            if mistake == "start changed in place":
                pseudo = s.sub_(p.detach()) if participating else torch.zeros_like(s)
            elif mistake == "mean weights":
                pseudo = p.detach().clone() if participating else torch.zeros_like(s)
            elif mistake == "healing sends its own":
                pseudo = s - p.detach()
            else:
                pseudo = s - p.detach() if participating else torch.zeros_like(s)
            if mistake == "wrong sign":
                pseudo = -pseudo
            if mistake == "through files":  # every rank's pseudo-gradient in a file
                folder = cheat_folder(f"pseudo-{called[0]}-{len(out)}")
                save_for_all(pseudo, folder)
                dist.all_reduce(torch.zeros(1, dtype=torch.float64))  # for show; it waits too
                pseudo = sum(load_everyone(folder))
            else:
                dist.all_reduce(pseudo)
            if mistake == "divided by the world size":
                pseudo = pseudo / dist.get_world_size()
            elif mistake != "no division":
                pseudo = pseudo / count
            out.append(pseudo)
        return out

    return average_pseudo_gradient


WRONG = {
    "divided by the world size": r"in round 2 \(rank 1 is healing\).*you divided by the world "
                                 r"size \(2\), but 1 replica is healing",
    "wrong sign": r"in round 1 .*the sign is wrong: the pseudo-gradient is start - weights",
    "healing sends its own": r"in round 2 .*the healing replica sent its own pseudo-gradient",
    "no division": r"in round 1 .*you did not divide",
    "hard-coded world_size - 1": r"in round 1 .*(you did not divide|× the participants' mean)",
    "mean weights": r"you returned the participants' mean weights",
    "start changed in place": r"changed `start`",
    "through files": r"^on 2 ranks: in round 1 \(every replica takes part\), the values are "
                     r"right, but on rank 0 your collectives delivered",
}


@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake):
    with pytest.raises(ExerciseFailed, match=WRONG[mistake]):
        check("average_pseudo_gradient")(_pseudo(mistake))


def test_a_world_size_division_passes_while_every_replica_takes_part_and_fails_when_one_heals():
    """The trap the exercise is about: right in round 1, wrong in round 2, at 3 ranks too."""
    with pytest.raises(ExerciseFailed, match=r"^on 3 ranks: in round 2 .*world size \(3\)"):
        check("average_pseudo_gradient")(_pseudo("divided by the world size"), world_size=3)


def test_the_right_answer_passes_at_4_ranks(capsys):
    check("average_pseudo_gradient")(solution("average_pseudo_gradient"), world_size=4)
    assert capsys.readouterr().out.startswith("✓ correct: on 4 ranks, every rank returned")


def test_someone_heals_taken_as_world_size_minus_1_fails_when_two_heal():
    """At 2 ranks one heals in rounds 2 and 3: N - 1 is right there. At 3, two heal in round 3."""
    with pytest.raises(ExerciseFailed, match=r"^on 3 ranks: in round 3 \(ranks 0 and 2 are "
                                             r"healing\)"):
        check("average_pseudo_gradient")(_pseudo("someone heals taken as world_size - 1"),
                                         world_size=3)
