"""Notebook 12's exercise check, ``check_sync_moe_gradients``, rejects the usual mistakes with
what is wrong: the expert group's size as divisor (by hand or with ``ReduceOp.AVG``), experts
reduced over all ranks like dense parameters, no sum over the expert group (right only while
the group has one rank), a hard-coded world size, dense gradients left undivided or reduced
over the expert group, a gradient set to None.

The reference solution and the stub are tested with every exercise in
tests/exercises/test_every_exercise.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from .conftest import (
    assert_rejected,
    cheat_folder,
    check,
    load_everyone,
    save_for_all,
    solution,
)

NAME = "sync_moe_gradients"


def _sync(expert_over="group", expert_by="world", dense_over="world", dense_by="world",
          to_none=False):
    """A learner's sync_moe_gradients: where each kind of gradient is summed, what divides
    it ("world", "group" for the expert group's size, "avg" for ReduceOp.AVG, a number)."""

    def divisor(by, group):
        if isinstance(by, (int, float)):
            return by
        return {"world": dist.get_world_size(), "group": dist.get_world_size(group),
                "none": 1}[by]

    called = [0]  # this rank's calls so far: a file folder of each call's own

    def reduce(params, over, by, group):
        for i, p in enumerate(params):
            if over == "files":  # every rank's gradient through files, a dummy all_reduce
                folder = cheat_folder(f"moe-{called[0]}-{i}-{len(params)}")
                save_for_all(p.grad, folder)
                dist.all_reduce(torch.zeros(1, dtype=p.grad.dtype))  # for show; it waits too
                p.grad.copy_(sum(load_everyone(folder)) / dist.get_world_size())
                continue
            where = {"world": None, "group": group}.get(over, "skip")
            if by == "avg" and where != "skip":
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=where)
                continue
            if where != "skip":
                dist.all_reduce(p.grad, group=where)
            p.grad /= divisor(by, group)

    def sync_moe_gradients(dense_params, expert_params, expert_group):
        called[0] += 1
        reduce(dense_params, dense_over, dense_by, expert_group)
        reduce(expert_params, expert_over, expert_by, expert_group)
        if to_none:
            expert_params[0].grad = None

    return sync_moe_gradients


ON_2 = r"^on 2 ranks: on rank \d, "
WRONG = [
    ("dense gradients through files", _sync(dense_over="files"),
     r"^on 2 ranks: the values are right, but on rank \d your collectives delivered .*not "
     r"the sum "
            r"of the dense gradients over all ranks"),
    ("÷ the expert group's size", _sync(expert_by="group"),
     ON_2 + r"your expert gradients are 2× the expected ones \(EP = 2\): you divided the sum "
            r"over expert_group by its size \(1 here\), or not at all\."),
    ("ReduceOp.AVG over the expert group", _sync(expert_by="avg"),
     ON_2 + r"your expert gradients are 2× the expected ones \(EP = 2\)"),
    ("no division of the experts, no sum", _sync(expert_over="skip", expert_by="none"),
     ON_2 + r"your expert gradients are 2× the expected ones"),
    ("experts like dense parameters", _sync(expert_over="world"),
     ON_2 + r"you reduced the expert gradients over all ranks, like the dense ones: that adds "
            r"every expert's gradient to every other's\."),
    ("experts over all ranks, no division", _sync(expert_over="world", expert_by="none"),
     ON_2 + r"you reduced the expert gradients over all ranks without dividing"),
    ("no sum over the expert group", _sync(expert_over="skip"),
     r"^right on 2 ranks and on 3 ranks, but on 4 ranks: on rank \d, you did not sum the "
     r"expert gradients over expert_group"),
    ("experts summed, not divided", _sync(expert_by="none"),
     ON_2 + r"your expert gradients are 2× the expected ones \(EP = 2\): you divided the sum "
            r"over expert_group by its size \(1 here\), or not at all\."),  # 1 rank: the same
    ("experts ÷ a hard-coded 2", _sync(expert_by=2),
     r"^right on 2 ranks, but on 3 ranks: on rank \d, the expert gradients are 1\.5× the "
     r"expected ones"),
    ("dense not divided", _sync(dense_by="none"),
     ON_2 + r"you summed the dense gradients over all ranks but did not divide by the world "
            r"size \(2 here\)\."),
    ("dense over the expert group", _sync(dense_over="group"),
     ON_2 + r"you reduced the dense gradients over expert_group"),
    ("a gradient set to None", _sync(to_none=True),
     ON_2 + r"`expert\.weight` has no gradient after sync_moe_gradients"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_the_reference_solution_says_what_it_verified(capsys):
    check(NAME)(solution(NAME), world_size=4)
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: on 4 ranks (EP 2 × EDP 2), tokens per expert [")
