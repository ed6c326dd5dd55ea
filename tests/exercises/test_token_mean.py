"""Notebook 07's exercise, token_mean_backward (2 ranks × 4 micro-batches, then 3 × 3): the wrong
answers its check must reject, each with the message that names the mistake
(tests/exercises/test_every_exercise.py runs the reference solution and the stub)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradsync_tutorial import exercises

from .conftest import (
    assert_rejected,
    cheat_folder,
    load_everyone,
    save_for_all,
)

NAME = "token_mean_backward"
TM_2, TM_3 = (r"^on 2 ranks × 4 micro-batches: ",
              r"^right on 2 ranks × 4 micro-batches, but on 3 ranks × 3 micro-batches: ")


def _token_mean(mean="global", times=None, no_sync=True, count=None, log="global",
                zero_inside=False, sum_gradients=False, count_through_files=False):
    """A learner's token_mean_backward, with one of the typical mistakes switched on (times: a
    hard-coded world size to multiply by; count: "padding" or "micro-batch")."""

    def token_mean_backward(model, micro_batches):
        def valid(targets):
            return torch.tensor(targets.numel()) if count == "padding" else (targets != -100).sum()

        local = sum(valid(targets) for _, targets in micro_batches)
        total_count = local.clone()
        if count_through_files:  # each rank's count in a file, a barrier "to wait for them"
            folder = cheat_folder("token-count")
            save_for_all(local, folder)
            dist.barrier()
            total_count = sum(load_everyone(folder))
        else:
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


def _token_mean_then(then):
    """The right token_mean_backward, which also changes what it must leave alone."""
    right = _token_mean()

    def token_mean_backward(model, micro_batches):
        if then == "changes the inputs":
            for x, y in micro_batches:
                y[y == -100] = -100  # a no-op (the same numbers: not a change)...
                x.clamp_(max=5)  # ...and a change
        loss = right(model, micro_batches)
        if then == "steps the optimizer":  # the caller's job, done here
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        return loss

    return token_mean_backward


WRONG = [
    ("the mean per micro-batch", _token_mean(mean="per micro-batch"),
     TM_2 + r"your gradient is not the mean over all \d+ valid tokens: this is the 2024 "
            r"accumulation bug: each micro-batch's own mean"),
    ("the mean per micro-batch, no × N",
     _token_mean(mean="per micro-batch", times=1),
     r"2024 accumulation bug.*And multiply by the world size: DDP divides the summed "
     r"gradients by it\."),
    ("a rank's own count", _token_mean(mean="local"),
     r"this is each rank's own mean \(its loss sum / its own count\), which DDP then averages "
     r"over the ranks: all_reduce the count"),
    ("a rank's own count, no × N", _token_mean(mean="local", times=1),
     r"each rank's own mean.*And multiply by the world size"),
    ("no × N", _token_mean(times=1),
     r"you forgot the × N: DDP divides the summed gradients by the world size \(2 here\)"),
    ("hard-coded × 2", _token_mean(times=2),
     TM_3 + r"your gradients are 0\.67× the expected ones.*Did you multiply by 2 instead of the "
            r"world size \(3 here\)\? Use dist\.get_world_size\(\): it is not always 2\."),
    ("hard-coded × 3", _token_mean(times=3),
     TM_2 + r"your gradients are 1\.5× the expected ones.*Did you multiply by 3 instead of the "
            r"world size \(2 here\)\? Use dist\.get_world_size\(\): it is not always 3\."),
    ("padding counted", _token_mean(count="padding"),
     r"you counted every position, padding included \(targets\.numel\(\)\)"),
    ("a count per micro-batch", _token_mean(count="micro-batch"),
     r"you divided each micro-batch by the count of that micro-batch over the ranks"),
    ("zero_grad inside the loop", _token_mean(zero_inside=True),
     r"only the last micro-batch's gradient is left: do not zero the gradients"),
    ("gradients summed again", _token_mean(sum_gradients=True),
     r"you multiplied by the world size and also summed the gradients yourself: DDP already "
     r"averages them"),
    ("no no_sync", _token_mean(no_sync=False),
     r"DDP all-reduced the gradients in 4 backward passes: run every micro-batch but the last "
     r"inside `with model\.no_sync\(\):`"),
    ("logs its own mean", _token_mean(log="own"),
     r"token_mean_backward returned .* on rank 0; the mean loss over all \d+ valid tokens is "
     r".*Yours is this rank's own mean"),
    ("returns a tensor", _token_mean(log="tensor"),
     r"token_mean_backward returned Tensor tensor\(.* on rank 0: return the mean loss as a "
     r"float"),
    ("the count through files, a barrier",
     _token_mean(count_through_files=True),
     TM_2 + r"rank 0's collectives delivered barrier, all_reduce of 1 number \(\[[\d.]+\]\): "
            r"never the count of valid tokens of all the ranks \(\d+\), nor every rank's count"),
    ("steps the optimizer", _token_mean_then("steps the optimizer"),
     TM_2 + r"on rank 0, token_mean_backward changed the parameters: `0\.weight` .*: compute "
            r"the gradients only; the caller's optimizer takes the step"),
    ("changes the inputs", _token_mean_then("changes the inputs"),
     TM_2 + r"on rank 0, token_mean_backward changed the micro-batches it was given: "
            r"`inputs\[0\]` .*: leave the inputs and targets as they are"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_token_mean_backward_says_what_it_verified_at_each_configuration(capsys):
    exercises.check_token_mean_backward(_token_mean())
    out = capsys.readouterr().out
    assert re.search(r"✓ correct: the gradient and the loss are those of one process on every "
                     r"valid token, on 2 ranks × 4 micro-batches \((\d+) valid tokens, loss .*; "
                     r"collectives: all_reduce 2 times, ddp_bucket_allreduce once, delivering the "
                     r"count \1\) and on 3 ranks × 3 micro-batches .*; the parameters and the "
                     r"micro-batches are untouched\.", out), out
    exercises.check_token_mean_backward(_token_mean(), world_size=3)  # one size, as asked
    out = capsys.readouterr().out
    assert "on 3 ranks × 3 micro-batches" in out and "2 ranks" not in out
