"""Notebook 05's exercise, average_overlapped: the wrong answers its check must reject, each with
the message that names the mistake (tests/exercises/test_every_exercise.py runs the reference
solution and the stub)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from .conftest import (
    ON_2,
    ON_3,
    assert_rejected,
)

NAME = "average_overlapped"


def _overlapped(divide=True, clear=True, use_async=True, world_size=None, then=None,
                reduce="grad"):
    """A learner's average_overlapped, with one of the typical mistakes switched on."""

    def average_overlapped(model):
        pending = []

        def start(param):
            tensor = param.grad if reduce == "grad" else torch.zeros(1)  # "for show"
            pending.append((param, dist.all_reduce(tensor, async_op=use_async)))

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(start)

        def finish():
            for param, handle in pending:
                if use_async:
                    handle.wait()
                if divide:
                    param.grad /= world_size or dist.get_world_size()
            if clear:
                pending.clear()
            if reduce == "files":
                _mean_through_files(model)
            if then == "zeroes the parameters":
                for p in model.parameters():
                    p.detach().zero_()

        return finish

    return average_overlapped


def _mean_through_files(model):
    import os
    import tempfile

    rank, n = dist.get_rank(), dist.get_world_size()
    cheat_id = os.environ["GRADSYNC_TEST_CHEAT_ID"]  # the test process (conftest)
    folder = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{cheat_id}-{n}")
    os.makedirs(folder, exist_ok=True)
    torch.save([p.grad for p in model.parameters()], os.path.join(folder, f"{rank}.pt"))
    dist.barrier()
    everyone = [torch.load(os.path.join(folder, f"{r}.pt")) for r in range(n)]
    dist.barrier()  # before anyone writes the next step's files
    for i, p in enumerate(model.parameters()):
        p.grad.copy_(sum(grads[i] for grads in everyone) / n)


WRONG = [
    ("no division", _overlapped(divide=False),
     ON_2 + r"in step 1, your gradients are 2\.0× the expected ones \(the mean over ranks\): "
            r"divide by the world size in finish\(\)"),
    ("hard-coded / 3", _overlapped(world_size=3),
     ON_2 + r"in step 1, your gradients are 0\.67× .*Did you divide by 3 instead of world_size"),
    ("hard-coded / 2", _overlapped(world_size=2),
     ON_3 + r"in step 1, your gradients are 1\.5× .*Did you divide by 2 instead of world_size"),
    ("blocking calls", _overlapped(use_async=False),
     r"8 of the 8 all_reduce calls made during backward in step 1 had no async_op=True"),
    ("handles kept", _overlapped(clear=False),
     r"step 1 is right, but in step 2 your gradients .*: did finish\(\) handle step 1's "
     r"handles again\?"),
    ("zeroes the parameters", _overlapped(then="zeroes the parameters"),
     r"on rank 0, average_overlapped changed the parameters in 2 steps of backward and "
     r"finish\(\): `conv1\.weight`.*average the gradients only"),
    ("through files, dummy async calls",
     _overlapped(reduce="files", divide=False),
     ON_2 + r"the gradients are right, but in step 1 rank 0's all_reduce calls delivered 8 "
            r"numbers \(\[0, 0, 0, 0, \.\.\.\]\), not the sum"),
]


@pytest.mark.parametrize("mistake, wrong, message", WRONG, ids=[row[0] for row in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(mistake, wrong, message):
    assert_rejected(NAME, mistake, wrong, message)
