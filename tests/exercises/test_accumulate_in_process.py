"""Notebook 01's check runs ``accumulate_gradients`` in the notebook's own process: what it must do
about code that could only work elsewhere. A function that never returns is stopped, with a
message, in the main thread (a kernel's) and in another one; a torch.distributed call is told why
there is no process group here, not torch's bare "not initialized".
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch.distributed as dist
import torch.nn.functional as F

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import ExerciseFailed


def endless(model, images, labels, micro_batches):
    while True:  # the mistake: a loop with no end
        pass


def asleep(model, images, labels, micro_batches):
    time.sleep(3600)  # a wait that ends nowhere near the limit


def averaged(model, images, labels, micro_batches):
    total = 0.0
    for x, y in zip(images.chunk(micro_batches), labels.chunk(micro_batches), strict=True):
        loss = F.nll_loss(model(x), y) / micro_batches
        loss.backward()
        total += loss.item()
    for p in model.parameters():  # notebook 02's averaging, out of place in notebook 01
        dist.all_reduce(p.grad)
    return total


def _stopped(fn) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(ExerciseFailed) as info:
        exercises.check_accumulate_gradients(fn, timeout=1)
    return str(info.value), time.monotonic() - start


@pytest.mark.parametrize("fn", [endless, asleep], ids=["endless loop", "sleep"])
def test_a_function_that_never_returns_is_stopped_at_the_time_limit(fn):
    handler = signal.getsignal(signal.SIGALRM)
    message, took = _stopped(fn)
    assert "did not return within 1 s (with micro_batches=3): does a loop never end?" in message
    assert took < 10, took
    assert signal.getsignal(signal.SIGALRM) is handler  # put back, no alarm left
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_time_limit_holds_in_a_thread_too():
    said = []
    thread = threading.Thread(target=lambda: said.append(_stopped(endless)))
    thread.start()
    thread.join(30)
    assert said and "did not return within 1 s" in said[0][0]


def test_a_collective_is_told_why_there_is_no_process_group_here():
    assert not dist.is_initialized()
    with pytest.raises(ExerciseFailed) as info:
        exercises.check_accumulate_gradients(averaged)
    message = str(info.value)
    assert "called torch.distributed, but this check runs it in the notebook's own process" in (
        message)
    assert "Accumulating gradients needs no collective" in message
    assert "has not been initialized" not in message
