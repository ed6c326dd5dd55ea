"""Every exercise check passes its reference solution, leaves a stub alone ("not attempted
yet") and checks the call itself: the function, its arguments, the sizes asked for; an error
shows the learner's line and a hang gets the launcher's own message. Each exercise's wrong
answers are in its own file beside this one (tests/exercises/test_<module>.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import EXERCISES, ExerciseFailed, common

from ..conftest import REPO
from .conftest import SOLUTIONS, check, solution


def test_every_exercise_has_a_solution_and_a_notebook_that_calls_its_check():
    for name, exercise in EXERCISES.items():
        assert (SOLUTIONS / exercise.solution).is_file(), exercise.solution
        notebook = (REPO / "notebooks" / exercise.notebook).read_text()
        assert f"def {name}(" in notebook  # the stub
        assert f"gst.exercises.{exercise.check.__name__}({name})" in notebook
        assert exercise.check is getattr(exercises, exercise.check.__name__)


def sizes_said(name: str, n: int) -> tuple[str, ...]:
    """What each check's "✓ correct" sentence says it ran at: every size it uses by default
    (``n``: the second world size, drawn for this process)."""
    return {"accumulate_gradients": ("3 micro-batches of 8", "5 micro-batches of 4"),
            "global_mean_loss": ("on 2 ranks, with rank 0: ", f"; on {n} ranks, with rank 0: "),
            "token_mean_backward": ("on 2 ranks × 4 micro-batches",
                                    f"on {n} ranks × 3 micro-batches"),
            "seq_mean_backward": ("on 2 ranks × 3 micro-batches",
                                  f"on {n} ranks × 2 micro-batches"),
            "sync_moe_gradients": ("on 2 and 3 ranks (EP 2 and 3 × EDP 1), on 4 ranks",),
            # a bf16 division by 4 is exact: where 4 is drawn, the check adds 3 ranks
            "average_gradients_in_fp32": ("on 2, 3 and 4 ranks" if n == 4
                                          else f"on 2 and {n} ranks",),
            }.get(name, (f"on 2 and {n} ranks",))


@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_reference_solution_passes_at_every_size(name, capsys, monkeypatch):
    monkeypatch.delenv(common.SIZE_VARIABLE)  # the size drawn for this process: 3, 4 or 5
    assert check(name)(solution(name)) is None
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: ")
    for size in sizes_said(name, common.WORLD_SIZES[1]):
        assert size in out


@pytest.mark.parametrize("name", list(EXERCISES))
def test_a_stub_is_not_attempted_and_does_not_fail(name, capsys):
    def stub(*args):
        raise NotImplementedError("replace this line with your code")

    stub.__name__ = name
    assert check(name)(stub) is None
    out = capsys.readouterr().out
    assert out.startswith(f"... not attempted yet: {name} still raises NotImplementedError")
    assert f"%load solutions/{EXERCISES[name].solution}" in out


def test_not_a_function_or_the_wrong_arguments_or_sizes():
    with pytest.raises(ExerciseFailed, match=r"pass your function itself.*got list"):
        exercises.check_gather_ranks([0, 1])  # the result of gather_ranks(...), not the function

    def average_gradients_flat(model, world_size):
        pass

    with pytest.raises(ExerciseFailed, match=r"average_gradients_flat\(model, world_size\) cannot"
                                             r" be called as average_gradients_flat\(model\)"):
        exercises.check_average_gradients_flat(average_gradients_flat)
    for sizes in (1, (2, 1), ()):
        with pytest.raises(ValueError, match="world_size must be an int"):
            exercises.check_broadcast_parameters(solution("broadcast_parameters"),
                                                 world_size=sizes)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 2"):
        exercises.check_accumulate_gradients(solution("accumulate_gradients"), micro_batches=1)


def test_one_size_on_request(capsys):
    exercises.check_gather_ranks(solution("gather_ranks"), world_size=4)  # notebook 00's advice
    assert capsys.readouterr().out.startswith("✓ correct: on 4 ranks, every rank returned "
                                              "[0, 1, 2, 3]")


def test_an_error_shows_the_learner_s_line():
    def passes_an_int(rank, world_size):
        everyone = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(everyone, rank)  # not a tensor
        return everyone

    with pytest.raises(ExerciseFailed) as info:
        exercises.check_gather_ranks(passes_an_int)
    message = str(info.value)
    assert message.startswith("passes_an_int raised an error on rank ")
    assert "dist.all_gather(everyone, rank)" in message  # the traceback shows the line


@pytest.mark.parametrize("name, hangs", [
    ("gather_ranks", lambda rank, world_size: (
        dist.all_gather([torch.zeros(1) for _ in range(world_size)], torch.zeros(1))
        if rank == 0 else None) or list(range(world_size))),
    ("global_mean_loss", lambda losses: (  # "only rank 0 logs", so only rank 0 reduces
        dist.all_reduce(losses.detach().sum()) if dist.get_rank() == 0 else None) or 1.0),
])
def test_a_hang_gets_the_launcher_s_own_message_with_where_each_rank_was(name, hangs):
    from gradsync_tutorial import launcher

    with pytest.raises(ExerciseFailed) as info:  # at 2 ranks only: warm-first would otherwise
        check(name)(hangs, world_size=2, timeout=5)  # start where the last test launched
    message = str(info.value)
    # The launcher stops it early (rank 1 returned while rank 0 waits), or at 5 s.
    assert message.startswith("<lambda> hangs on 2 ranks: launch ")
    assert "rank 0 had not finished (rank 1 returned)" in message
    assert "All ranks were stopped." in message
    assert "\nWhere each rank was:\n" in message
    assert message.endswith(launcher.HANG_HINT)
