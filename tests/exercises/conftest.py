"""What the exercises' tests share: the reference solutions, the checks, the assertion that a
wrong answer is rejected with its message, and the temporary files of the answers that cheat.

The wrong answers (each exercise's table WRONG, one file per exercise) are what learners write
-- no division, notebook 02's loop instead of one call, a reduced copy never copied back,
``[t] * world_size``, a broadcast into a clone -- and answers that guess instead of computing: a
hard-coded world size (2 or 3) or number of micro-batches (3 or 4), a piece size, a list of ranks
built without the others' numbers, data exchanged through files next to a dummy collective, an
answer that also changes what it must leave alone. Each must be rejected with the message that
names the mistake.

The checks launch real ranks (gloo) at 2 and then 3 ranks here: the second size, drawn from 3 to
5 per process in a notebook, is fixed at 3 for these tests (GRADSYNC_CHECK_WORLD_SIZE), since
their messages name it; tests/exercises/test_world_sizes.py tests the drawing. The launcher keeps
the idle workers of the last two sizes, so a check after the first starts no process.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradsync_tutorial.exercises import EXERCISES, ExerciseFailed, common

from ..conftest import REPO

SOLUTIONS = REPO / "notebooks" / "solutions"
#: How a check's message starts when the answer is wrong at 2 ranks, or right there but not at 3.
ON_2, ON_3 = r"^on 2 ranks: ", r"^right on 2 ranks, but on 3 ranks: "


@pytest.fixture(autouse=True)
def _second_size_3(monkeypatch):
    """Every check here runs 2 and 3 ranks (the messages the tests expect name 3), unless a
    test sets GRADSYNC_CHECK_WORLD_SIZE itself, or deletes it to use the drawn size."""
    monkeypatch.setenv(common.SIZE_VARIABLE, "3")


# The wrong answers that exchange data through files name them after this test process, which
# the ranks read from their environment (each rank's parent is its own template, not this).
os.environ.setdefault("GRADSYNC_TEST_CHEAT_ID", str(os.getpid()))


@pytest.fixture(autouse=True, scope="module")
def _no_files_left():
    """The wrong answers that exchange data through files write them under the temporary
    folder, named after this test process (GRADSYNC_TEST_CHEAT_ID): remove them afterwards."""
    yield
    for path in Path(tempfile.gettempdir()).glob(
            f"gradsync-cheat-{os.environ['GRADSYNC_TEST_CHEAT_ID']}*"):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def solution(name: str):
    """The reference function, read from notebooks/solutions/ (not imported by name)."""
    return runpy.run_path(str(SOLUTIONS / EXERCISES[name].solution))[name]


def check(name: str):
    return EXERCISES[name].check


def assert_rejected(name: str, mistake: str, wrong, message: str) -> None:
    """``wrong``, a learner's ``name``, fails its check with a message that matches ``message``."""
    with pytest.raises(ExerciseFailed) as info:
        check(name)(wrong)
    assert re.search(message, str(info.value)), f"{mistake}: {info.value}"


def cheat_folder(tag):
    """A folder for the answers that exchange data through files: named after the test process
    (GRADSYNC_TEST_CHEAT_ID), the answer and the world size, removed by _no_files_left."""
    import os
    import tempfile

    name = f"gradsync-cheat-{os.environ['GRADSYNC_TEST_CHEAT_ID']}-{tag}-{dist.get_world_size()}"
    folder = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(folder, exist_ok=True)
    return folder


def save_for_all(value, folder):
    """Save this rank's ``value`` in ``folder`` (whole, even while another rank reads)."""
    import os

    path = os.path.join(folder, f"{dist.get_rank()}.pt")
    torch.save(value, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_everyone(folder):
    import os

    return [torch.load(os.path.join(folder, f"{r}.pt")) for r in range(dist.get_world_size())]
