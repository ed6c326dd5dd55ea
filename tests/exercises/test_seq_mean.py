"""Notebook 14's exercise, seq_mean_backward (2 ranks × 3 micro-batches, then 3 × 2): the wrong
answers its check must reject, each with the message that names the mistake: the bugs notebook
14 reproduces, a guessed world size and a guessed micro-batch count
(tests/exercises/test_every_exercise.py runs the reference solution and the stub)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial import exercises, rollouts

from .conftest import assert_rejected, cheat_folder, load_everyone, save_for_all

NAME = "seq_mean_backward"
SM_2, SM_3 = (r"^on 2 ranks × 3 micro-batches: ",
              r"^right on 2 ranks × 3 micro-batches, but on 3 ranks × 2 micro-batches: ")


def _seq_mean(mean="sequence", count="global", times=None, then=1, no_sync=True,
              zero_inside=False, sum_gradients=False):
    """A learner's seq_mean_backward, with one of the typical mistakes switched on. `count`:
    "global", "local", "per micro-batch", "files" or a guessed number of micro-batches; `times`:
    a hard-coded world size to multiply by; `then`: what the loss is divided by at the end."""

    def seq_mean_backward(model, micro_batches):
        local = torch.tensor(float(sum(len(b["mask"]) for b in micro_batches)))
        completions = local.clone()
        if count == "files":  # each rank's count in a file, a barrier "to wait for them"
            folder = cheat_folder("completions")
            save_for_all(local, folder)
            dist.barrier()
            completions = sum(load_everyone(folder))
        elif isinstance(count, int):  # at most 4 per micro-batch × a guessed number of them
            completions = torch.tensor(float(4 * count))  # more than any rank holds: wrong
            dist.all_reduce(completions)
        elif count != "local":
            dist.all_reduce(completions)
        n = dist.get_world_size() if times is None else times
        for k, b in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            if zero_inside:
                model.zero_grad()
            with contextlib.nullcontext() if last or not no_sync else model.no_sync():
                per_token, mask = rollouts.per_token_loss(model, b), b["mask"]
                if mean == "token":
                    tokens = sum(x["mask"].sum() for x in micro_batches)
                    dist.all_reduce(tokens)
                    loss = (per_token * mask).sum() / tokens * n
                else:
                    means = (per_token * mask).sum(1) / mask.sum(1)
                    if count == "per micro-batch":  # TRL's grpo: its own mean, / K
                        loss = means.mean() / len(micro_batches)
                    else:
                        loss = means.sum() / completions * n
                (loss / then).backward()
        if sum_gradients:
            for p in model.parameters():
                dist.all_reduce(p.grad)

    return seq_mean_backward


def _seq_mean_then(then):
    """The right seq_mean_backward, which also changes what it must leave alone."""
    right = _seq_mean()

    def seq_mean_backward(model, micro_batches):
        if then == "changes the advantages":
            micro_batches[0]["advantages"].mul_(2)
        right(model, micro_batches)
        if then == "steps the optimizer":  # the caller's job, done here
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad

    return seq_mean_backward


class _Verl5798:
    """verl#5798: the denominator global_batch_size * dp_size, and no × dp_size."""

    def __call__(self, model, micro_batches):
        completions = torch.tensor(float(sum(len(b["mask"]) for b in micro_batches)))
        dist.all_reduce(completions)
        for k, b in enumerate(micro_batches):
            with contextlib.nullcontext() if k == len(micro_batches) - 1 else model.no_sync():
                per_token, mask = rollouts.per_token_loss(model, b), b["mask"]
                means = (per_token * mask).sum(1) / mask.sum(1)
                (means.sum() / (completions * dist.get_world_size())).backward()


WRONG = [
    ("each micro-batch's own mean / K (TRL's grpo)", _seq_mean(count="per micro-batch"),
     SM_2 + r"your gradient is not the mean over all \d+ completions of their token means: each "
            r"micro-batch's own mean over its completions, divided by the number of "
            r"micro-batches \(TRL's grpo\): right only when every micro-batch holds as many "
            r"completions"),
    ("divided by K again (ms-swift#10117)", _seq_mean(then=3),
     SM_2 + r".*: you divided by the micro-batches a second time.*ms-swift#10117"),
    ("the denominator × dp_size (verl#5798)", _Verl5798(),
     SM_2 + r".*: your denominator is the step's completions × the world size.*verl#5798"),
    ("no × N", _seq_mean(times=1),
     r"you forgot the × N: DDP divides the summed gradients by the world size \(2 here\)"),
    ("a rank's own count", _seq_mean(count="local"),
     r"each rank's own mean, times N: count the completions of all the micro-batches first"),
    ("the token-level mean", _seq_mean(mean="token"),
     r"this is the token-level mean \(every completion token weighs the same\), not the "
     r"sequence-level mean"),
    ("hard-coded × 2", _seq_mean(times=2),
     SM_3 + r".*: yours are 0\.67× the expected gradients.*Did you multiply by 2 instead of the "
            r"world size \(3 here\)\?"),
    ("a guessed micro-batch count", _seq_mean(count=3),  # told as a factor (which one varies)
     SM_2 + r"your gradient is not the mean over all \d+ completions of their token means: "),
    ("zero_grad inside the loop", _seq_mean(zero_inside=True),
     r"only the last micro-batch's gradient is left: do not zero the gradients"),
    ("gradients summed again", _seq_mean(sum_gradients=True),
     r"you multiplied by the world size and also summed the gradients yourself"),
    ("no no_sync", _seq_mean(no_sync=False),
     r"DDP all-reduced the gradients in 3 backward passes: run every micro-batch but the last "
     r"inside `with model\.no_sync\(\):`"),
    ("the count through files, a barrier", _seq_mean(count="files"),
     SM_2 + r"rank 0's collectives delivered barrier.*never the step's count of completions "
            r"\(\d+\), nor every rank's count"),
    ("steps the optimizer", _seq_mean_then("steps the optimizer"),
     SM_2 + r"on rank 0, seq_mean_backward changed the parameters: `0\.weight` .*: compute the "
            r"gradients only"),
    ("changes the advantages", _seq_mean_then("changes the advantages"),
     SM_2 + r"on rank 0, seq_mean_backward changed the micro-batches it was given: "
            r"`advantages\[0\]`"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_seq_mean_backward_says_what_it_verified_at_each_configuration(capsys):
    exercises.check_seq_mean_backward(_seq_mean())
    out = capsys.readouterr().out
    assert re.search(r"✓ correct: the gradient is that of one process on every completion, on 2 "
                     r"ranks × 3 micro-batches \((\d+) completions, \d to \d per micro-batch; "
                     r"collectives: all_reduce once, ddp_bucket_allreduce once, delivering the "
                     r"count \1\) and on 3 ranks × 2 micro-batches .*; the parameters and the "
                     r"micro-batches are untouched\.", out), out
