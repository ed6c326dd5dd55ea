"""Notebook 10's exercise, gradient_plan: the wrong answers its check must reject, each with the
message that names the mistake (tests/exercises/test_every_exercise.py runs the reference
solution and the stub)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gradsync_tutorial.exercises import ExerciseFailed

from .conftest import check, solution

NAME = "gradient_plan"


def _plan(mistake):
    def gradient_plan(replicas, shards, tp, tokens):
        factor, op, divisor = replicas * shards, dist.ReduceOp.SUM, tokens * tp
        if mistake == "average where a sum is needed":
            op = dist.ReduceOp.AVG
        elif mistake == "factor = shard size":
            factor = shards
        elif mistake == "local mean under sequence parallel":
            divisor = tokens
        elif mistake == "hard-coded factor 4":
            factor = 4
        elif mistake == "global count and factor 1":  # right: the same total division
            factor, divisor = 1, replicas * shards * tokens * tp
        elif mistake == "MAX":
            op = dist.ReduceOp.MAX
        elif mistake == "op as a string":
            op = "sum"
        elif mistake == "two things":
            return factor, op
        return factor, op, divisor

    return gradient_plan


WRONG = {
    "average where a sum is needed": r"0\.5× one process's on 2 tp ranks: an average where a "
                                     r"sum is needed.*ReduceOp\.SUM",
    "factor = shard size": r"your divide factor is the shard size, 2: .*2× \(the replicas\)",
    "local mean under sequence parallel": r"your loss is a mean over this rank's \d+ tokens: .*"
                                          r"then 2× one process's \(the tp ranks\)",
    "hard-coded factor 4": r"divide_factor × loss_divisor is \d+, not the global count",
    "MAX": r"ReduceOp\.MAX did not give one process's gradients",
    "op as a string": r"returned 'sum' as its replicated_op: return a dist\.ReduceOp",
    "two things": r"return three things",
}


@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_wrong_plan_is_rejected_with_its_factor(mistake):
    with pytest.raises(ExerciseFailed, match=WRONG[mistake]):
        check(NAME)(_plan(mistake), world_size=2)


def test_the_same_total_division_another_way_passes(capsys):
    check(NAME)(_plan("global count and factor 1"), world_size=(2, 3))
    assert capsys.readouterr().out.startswith("✓ correct: on 2 and 3 ranks")


def test_the_reference_is_right_on_4_ranks(capsys):
    check(NAME)(solution(NAME), world_size=4)
    assert "ratio 1.0" in capsys.readouterr().out
