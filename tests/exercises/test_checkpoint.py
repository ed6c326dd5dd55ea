"""Notebook 06's exercise, save_checkpoint: the wrong answers its check must reject, each with the
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

NAME = "save_checkpoint"


def _save(leave_out=(), every_rank=False, barrier=True, prefixed=False, objects=False,
          epoch=lambda epochs_done: epochs_done, writer=0, then=None):
    """A learner's save_checkpoint, with one of the typical mistakes switched on."""

    def save_checkpoint(path, model, optimizer, epochs_done):
        checkpoint = {
            "model": (model if prefixed else model.module).state_dict(),
            "optimizer": optimizer if objects else optimizer.state_dict(),
            "epoch": epoch(epochs_done),  # any key: the check finds the pieces by what they are
            "rng_state": {"cpu": torch.get_rng_state()},
        }
        for key in leave_out:
            del checkpoint[key]
        if every_rank or dist.get_rank() == writer:
            torch.save(checkpoint, path)
        if barrier:
            dist.barrier()
        if then == "zeroes the parameters":
            for p in model.parameters():
                p.detach().zero_()

    return save_checkpoint


def _forgot_to_save(path, model, optimizer, epochs_done):
    dist.barrier()


WRONG = [
    ("no optimizer", _save(leave_out=["optimizer"]),
     ON_2 + r"your checkpoint has no optimizer state: SGD's momentum buffers .*\(2 steps after "
            r"a resume from your file end up .* away from the straight run's parameters\)"),
    ("no RNG", _save(leave_out=["rng_state"]),
     r"your checkpoint has no RNG state .* dropout draws random numbers.*torch\.get_rng_state"),
    ("no epoch", _save(leave_out=["epoch"]),
     ON_2 + r"your checkpoint does not record epochs_done \(the check passed 7; the epoch to "
            r"start from, 8, would do too\)"),
    ("hard-coded epoch 3", _save(epoch=lambda epochs_done: 3),
     r"your checkpoint does not record epochs_done"),
    ("hard-coded epoch 7", _save(epoch=lambda epochs_done: 7),
     ON_3 + r"your checkpoint does not record epochs_done \(the check passed 11"),
    ("no model", _save(leave_out=["model"]),
     r"your checkpoint has no model state dict"),
    ("every rank writes", _save(every_rank=True),
     ON_2 + r"ranks 0, 1 all wrote the file.*Save on rank 0 only"),
    ("rank 1 writes", _save(writer=1), ON_2 + r"rank 1 wrote the file"),
    ("no barrier", _save(barrier=False),
     ON_2 + r"rank 1 returned from save_checkpoint before the file existed.*dist\.barrier\(\)"),
    ("DDP's prefix", _save(prefixed=True),
     r"your model state dict's names start with 'module\.'"),
    ("objects", _save(objects=True),
     ON_2 + r"torch\.load\(path, weights_only=True\) cannot read your file: it holds a "
            r"torch\.optim\.sgd\.SGD object\. Save state dicts.*not the model or optimizer "
            r"objects"),
    ("zeroes the parameters", _save(then="zeroes the parameters"),
     ON_2 + r"on rank 0, save_checkpoint changed `conv1\.weight`.*a save must leave the run"),
    ("nothing written", _forgot_to_save,
     r"no file at `path` after _forgot_to_save \(collectives called: barrier once\)"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)


def test_save_checkpoint_says_where_the_file_holds_each_piece(capsys):
    # "epoch", the epoch to start from (epochs_done + 1), resumes right, as epochs done does;
    # the sentence names the keys the file has, not the solution's.
    exercises.check_save_checkpoint(_save(epoch=lambda epochs_done: epochs_done + 1))
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: on 2 and 3 ranks, your file holds the model (at "
                          "['model']), the optimizer with its momentum (at ['optimizer']), the "
                          "RNG state (at ['rng_state']['cpu']) and the epoch count (at "
                          "['epoch'])")
    assert "epochs_done" not in out
