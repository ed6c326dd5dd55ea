"""Notebook 07's exercise check, ``check_token_mean_backward``, catches what learners write.

The reference solution and the stub are covered by tests/test_exercises.py, as for every
exercise. Here, the wrong answers: the per-micro-batch mean (the 2024 gradient accumulation
bug), a local-count denominator, a forgotten × N, and the rest, each caught with the message that
names its mistake.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed


def _token_mean(mean="global", times=None, no_sync=True, count=None, log="global",
                zero_inside=False, sum_gradients=False):
    """A learner's token_mean_backward, with one of the typical mistakes switched on (times: a
    hard-coded world size to multiply by; count: "padding" or "micro-batch")."""

    def token_mean_backward(model, micro_batches):
        def valid(targets):
            return torch.tensor(targets.numel()) if count == "padding" else (targets != -100).sum()

        local = sum(valid(targets) for _, targets in micro_batches)
        total_count = local.clone()
        dist.all_reduce(total_count)
        world_size = dist.get_world_size() if times is None else times
        total = torch.zeros((), dtype=torch.float64)
        for k, (inputs, targets) in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            if zero_inside:
                model.zero_grad()
            with contextlib.nullcontext() if last or not no_sync else model.no_sync():
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                                       reduction="sum")
                if mean == "per micro-batch":
                    scaled = loss / valid(targets) / len(micro_batches)  # the 2024 bug
                elif mean == "local":
                    scaled = loss / local
                elif count == "micro-batch":  # each micro-batch's count over the ranks
                    piece = valid(targets).clone()
                    dist.all_reduce(piece)
                    scaled = loss / piece
                else:
                    scaled = loss / total_count
                (scaled * world_size).backward()
            total += loss.detach()
        if sum_gradients:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        if log == "own":
            return (total / local).item()
        if log == "tensor":
            return total / total_count
        dist.all_reduce(total)
        return (total / total_count).item()

    return token_mean_backward


@pytest.mark.parametrize("mistake, message", [
    (dict(mean="per micro-batch"), r"^on 2 ranks × 4 micro-batches: your gradient is not the mean "
                                   r"over all \d+ valid tokens: this is the 2024 accumulation "
                                   r"bug: each micro-batch's own mean"),
    (dict(mean="per micro-batch", times=1), r"2024 accumulation bug.*And multiply by the world "
                                            r"size: DDP divides the summed gradients by it\."),
    (dict(mean="local"), r"this is each rank's own mean \(its loss sum / its own count\), which "
                         r"DDP then averages over the ranks: all_reduce the count"),
    (dict(mean="local", times=1), r"each rank's own mean.*And multiply by the world size"),
    (dict(times=1), r"you forgot the × N: DDP divides the summed gradients by the world size "
                    r"\(2 here\)"),
    # Hard-coded 2, the notebook's world size: right on 2 ranks, caught on 3.
    (dict(times=2), r"^right on 2 ranks × 4 micro-batches, but on 3 ranks × 3 micro-batches: "
                    r"your gradients are 0\.67× the expected ones.*Did you multiply by 2 instead "
                    r"of the world size \(3 here\)\?"),
    (dict(count="padding"), r"you counted every position, padding included \(targets\.numel\(\)\)"),
    (dict(count="micro-batch"), r"you divided each micro-batch by the count of that micro-batch "
                                r"over the ranks"),
    (dict(zero_inside=True), r"only the last micro-batch's gradient is left: do not zero the "
                             r"gradients"),
    (dict(sum_gradients=True), r"you multiplied by the world size and also summed the gradients "
                               r"yourself: DDP already averages them"),
    (dict(no_sync=False), r"DDP all-reduced the gradients in 4 backward passes: run every "
                          r"micro-batch but the last inside `with model\.no_sync\(\):`"),
    (dict(log="own"), r"token_mean_backward returned .* on rank 0; the mean loss over all \d+ "
                      r"valid tokens is .*Yours is this rank's own mean"),
    (dict(log="tensor"), r"token_mean_backward returned Tensor tensor\(.* on rank 0: return the "
                         r"mean loss as a float"),
])
def test_token_mean_backward_wrong_answers(mistake, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_token_mean_backward(_token_mean(**mistake))


def test_token_mean_backward_count_exchanged_through_files_is_caught(tmp_path):
    def counts_through_files(model, micro_batches):  # the loss all-reduced, the count not
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local = sum(int((y != -100).sum()) for _, y in micro_batches)
        (tmp_path / f"c{world_size}-{rank}").write_text(str(local))
        dist.barrier()
        count = sum(int((tmp_path / f"c{world_size}-{r}").read_text()) for r in range(world_size))
        total = torch.zeros((), dtype=torch.float64)
        for k, (x, y) in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
                (loss / count * world_size).backward()
            total += loss.detach()
        dist.all_reduce(total)
        return (total / count).item()

    with pytest.raises(ExerciseFailed, match=r"on 2 ranks × 4 micro-batches: rank 0's collectives "
                                             r"delivered \[[\d.]+\] \(.*barrier once.*\), never "
                                             r"the count of valid tokens of all the ranks \(\d+\)"):
        exercises.check_token_mean_backward(counts_through_files)


def test_token_mean_backward_what_it_must_leave_alone():
    right = _token_mean()

    def steps_too(model, micro_batches):  # the optimizer's job, done here
        loss = right(model, micro_batches)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        return loss

    with pytest.raises(ExerciseFailed, match=r"on rank 0, steps_too changed the parameter "
                                             r"`0\.weight`: compute the gradients only"):
        exercises.check_token_mean_backward(steps_too)

    def masks_in_place(model, micro_batches):
        for _, y in micro_batches:
            y[y == -100] = -100  # a no-op...
            y[:, 0] = y[:, 0]  # ...and another
        for x, _ in micro_batches:
            x.clamp_(max=5)  # changes the inputs
        return right(model, micro_batches)

    with pytest.raises(ExerciseFailed, match=r"masks_in_place changed the micro-batches it was "
                                             r"given"):
        exercises.check_token_mean_backward(masks_in_place)


def test_token_mean_backward_checks_two_configurations(capsys):
    exercises.check_token_mean_backward(_token_mean())
    out = capsys.readouterr().out
    assert re.search(r"✓ correct: the gradient and the loss are those of one process on every "
                     r"valid token, on 2 ranks × 4 micro-batches \((\d+) valid tokens, loss .*; "
                     r"collectives: all_reduce 2 times, ddp_bucket_allreduce once, delivering the "
                     r"count \1\) and on 3 ranks × 3 micro-batches", out), out
    exercises.check_token_mean_backward(_token_mean(), world_size=3)  # one size, as asked
    out = capsys.readouterr().out
    assert "on 3 ranks × 3 micro-batches" in out and "2 ranks" not in out
