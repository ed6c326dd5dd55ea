"""A rank that dies before it connects back: named, stopped with the others, and the next launch
works (finding 1 of the launcher's adversarial pass).

A rank can die while it starts: the out-of-memory killer's SIGKILL, the stop button during a
cold start, a template gone with the thread that started it. Each ends as a rank killed
mid-job does: an error that names the rank and its signal, no process left, and a next launch
that starts.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import RankFailedError, pool

from ..conftest import worker_pids

pytestmark = pytest.mark.usefixtures("no_workers_left")
posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")


def _ok(rank, world_size):
    return rank


class _KilledAtStart:
    """The launcher's start of one worker, the worker SIGKILLed at once (rank ``victim``)."""

    def __init__(self, monkeypatch, victim: int):
        self.real, self.victim = pool.start_worker, victim
        monkeypatch.setattr(pool, "start_worker", self)

    def __call__(self, env, rank):
        proc = self.real(env, rank)
        if rank == self.victim:
            os.kill(proc.pid, signal.SIGKILL)  # as the OOM killer does, before it connects
        return proc


@posix_only
def test_a_rank_killed_while_starting_is_named_and_the_next_launch_works(monkeypatch):
    gst.shutdown_workers()
    _KilledAtStart(monkeypatch, victim=1)
    with pytest.raises(RankFailedError) as caught:
        gst.launch(_ok, world_size=2)
    assert caught.value.rank == 1
    assert str(caught.value).startswith(
        "rank 1 was killed by SIGKILL before returning a result")
    assert "while starting up" in str(caught.value)
    assert worker_pids() == []
    monkeypatch.undo()
    assert gst.launch(_ok, world_size=2) == [0, 1]


def test_a_message_to_a_rank_that_never_connected_is_dropped():
    """The pump reports the dead rank; a send to it must not crash the launcher first."""
    workers = pool.Workers.__new__(pool.Workers)
    workers.conns = [None]
    workers.send(0, "anything")  # no AttributeError


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="templates")


@linux_only
def test_stop_pressed_between_a_fork_request_and_its_reply_leaves_nothing(monkeypatch):
    """The stop button while the launcher waits for a template's reply: the rank forked
    meanwhile is stopped when its pid arrives, and is never handed to the next launch."""
    from gradsync_tutorial.launcher import template

    gst.shutdown_workers()
    real = template.Template._next_pid
    pressed = []

    def interrupted(self):
        if not pressed:
            pressed.append(True)
            raise KeyboardInterrupt  # the request is sent; its reply not yet read
        return real(self)

    monkeypatch.setattr(template.Template, "_next_pid", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gst.launch(_ok, world_size=2)
    monkeypatch.undo()
    assert gst.launch(_ok, world_size=2) == [0, 1]
    gst.shutdown_workers()
    assert worker_pids() == []


@posix_only
def test_stop_pressed_during_a_cold_start_then_the_next_launch_works(monkeypatch):
    gst.shutdown_workers()
    real = pool.Workers.wait_until_started

    def interrupted(self, state, deadline):
        raise KeyboardInterrupt  # the stop button while the ranks import torch

    monkeypatch.setattr(pool.Workers, "wait_until_started", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gst.launch(_ok, world_size=2)
    assert worker_pids() == []
    monkeypatch.setattr(pool.Workers, "wait_until_started", real)
    assert gst.launch(_ok, world_size=2) == [0, 1]


@linux_only
def test_a_rank_whose_template_died_while_it_started_is_named(monkeypatch):
    """The rank dies with its template (its parent-death signal): named, not a crash."""
    gst.shutdown_workers()
    real = pool.start_worker

    def template_killed(env, rank):
        proc = real(env, rank)
        if rank == 1:
            os.kill(proc.template.proc.pid, signal.SIGKILL)
        return proc

    monkeypatch.setattr(pool, "start_worker", template_killed)
    with pytest.raises(RankFailedError) as caught:
        gst.launch(_ok, world_size=2)
    assert caught.value.rank == 1
    assert "rank 1 was killed by SIGKILL" in str(caught.value)
    assert worker_pids() == []
    monkeypatch.undo()
    assert gst.launch(_ok, world_size=2) == [0, 1]


@linux_only
def test_a_worker_whose_parent_died_before_its_lifeline_was_set_stops_itself():
    """The parent-death signal is lost when the parent dies before the child sets it (a template
    killed just after a fork): the worker sees it was reparented and kills itself instead."""
    import subprocess

    from gradsync_tutorial.launcher.protocol import PARENT_ENV, WORKER_MODULE

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is not this worker's parent, as after a reparenting
    env = dict(os.environ, **{PARENT_ENV: str(gone.pid)})
    worker = subprocess.run([sys.executable, "-m", WORKER_MODULE], env=env, timeout=60,
                            capture_output=True, text=True,
                            start_new_session=True)  # as a rank: its reaper stops its group
    assert worker.returncode == -signal.SIGKILL, worker.stderr


@linux_only
def test_a_process_a_worker_forks_after_the_worker_died_stops_itself():
    """The same lifeline for a process the rank forks (``os.fork``, multiprocessing)."""
    import subprocess

    code = (
        "import os, signal, sys, time\n"
        "from gradsync_tutorial.launcher.process_tree import die_with_parent_and_forks\n"
        "r, w = os.pipe()\n"
        "def wait_for_the_parent_to_end():  # registered first, so it runs first in the child\n"
        "    os.close(w); os.read(r, 1)\n"
        "os.register_at_fork(after_in_child=wait_for_the_parent_to_end)\n"
        "die_with_parent_and_forks()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.write(1, b'child alive\\n'); os._exit(0)\n"
        "print(pid, flush=True); os._exit(0)  # the parent dies before the child goes on\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "child alive" not in proc.stdout
