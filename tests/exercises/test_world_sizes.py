"""The second world size of every check: drawn once per process from 3 to 5, so that an answer
tuned to the sizes it saw pass (a table {2: ..., 3: ...}) fails most sessions; fixed by
GRADSYNC_CHECK_WORLD_SIZE to run a failure again; named in every verdict."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed, common

from ..conftest import REPO
from .conftest import solution


def average_by_table(model):
    """Right at the sizes it was tuned to: it looks the divisor up instead of asking."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= {2: 2, 3: 3}.get(dist.get_world_size(), 3)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def test_an_answer_tuned_to_2_and_3_ranks_fails_when_4_is_drawn(monkeypatch, capsys):
    exercises.check_average_gradients_flat(average_by_table)  # 2 and 3 ranks: it passes
    assert capsys.readouterr().out.startswith("✓ correct: on 2 and 3 ranks, ")
    monkeypatch.setenv(common.SIZE_VARIABLE, "4")
    with pytest.raises(ExerciseFailed) as info:
        exercises.check_average_gradients_flat(average_by_table)
    message = str(info.value)
    assert message.startswith("right on 2 ranks, but on 4 ranks: ")
    # How to run it again: the size, the variable, the argument.
    assert message.endswith("(4 ranks was set by GRADSYNC_CHECK_WORLD_SIZE. To check at 4 ranks "
                            "again: GRADSYNC_CHECK_WORLD_SIZE=4 in the environment, or "
                            "world_size=(2, 4) in the check's call.)")


def test_the_variable_sets_the_second_size_of_every_check(monkeypatch, capsys):
    monkeypatch.setenv(common.SIZE_VARIABLE, "4")
    assert common.second_size() == 4
    exercises.check_gather_ranks(solution("gather_ranks"))
    assert capsys.readouterr().out.startswith("✓ correct: on 2 and 4 ranks, every rank returned "
                                              "[0, 1] and [0, 1, 2, 3]")
    monkeypatch.delenv(common.SIZE_VARIABLE)
    assert common.second_size() == common.WORLD_SIZES[1]  # the one drawn for this process


@pytest.mark.parametrize("value", ["two", "2", "1", "-4", "4.5", "3 ranks"])
def test_a_wrong_value_says_what_is_expected_before_any_rank_starts(monkeypatch, value):
    monkeypatch.setenv(common.SIZE_VARIABLE, value)
    with pytest.raises(ValueError) as info:
        exercises.check_gather_ranks(solution("gather_ranks"))
    assert str(info.value) == (
        f"GRADSYNC_CHECK_WORLD_SIZE={value!r}: it must be a whole number of ranks >= 3, the "
        "second size every exercise check runs at (2 ranks always run first); for example "
        "GRADSYNC_CHECK_WORLD_SIZE=4. Unset it to have the size drawn from 3 to 5.")


def test_the_size_is_drawn_once_per_process_from_3_to_5():
    assert common.WORLD_SIZES[0] == 2 and common.WORLD_SIZES[1] in range(3, 6)
    # Drawn at import; the variable set before the import is the size drawn.
    code = ("from gradsync_tutorial.exercises import common; "
            "print(common.WORLD_SIZES, common.second_size())")
    env = dict(os.environ, PYTHONPATH=str(REPO), **{common.SIZE_VARIABLE: "5"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "(2, 5) 5"
