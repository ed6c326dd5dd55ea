"""Ranks forked from a template that imported torch once (Linux): as fresh as ``python -m``.

What a reader could tell apart is checked here: the rank's session, streams, ``__main__`` and
CUDA state; settings torch reads at import (a template serves only its own environment); a
template that dies or cannot start (the launch still works); and the switch back to
``python -m`` for every rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import pool, template

from ..conftest import wait_dead, worker_pids

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="templates are Linux only"),
    pytest.mark.usefixtures("no_workers_left"),
]


def _parent_command(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _how_started(rank, world_size):
    import torch

    return {
        "parent": _parent_command(os.getppid()),
        "parent_pid": os.getppid(),
        "command": _parent_command(os.getpid()),
        "own_session": os.getsid(0) == os.getpid(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "main": sys.modules["__main__"].__file__,
        "argv0": sys.argv[0],
        "cuda_initialized": torch.cuda.is_initialized(),
    }


def test_a_rank_is_a_fork_of_the_template_in_a_session_of_its_own():
    gst.shutdown_workers()
    for seen in gst.launch(_how_started, world_size=2):
        assert template.TEMPLATE_MODULE in seen["parent"]
        assert seen["own_session"]  # as Popen(start_new_session=True) gave it
        assert seen["stdin"] == os.devnull
        assert seen["main"].endswith(os.path.join("launcher", "worker.py"))  # as python -m runs it
        assert seen["argv0"] == seen["main"]
        assert not seen["cuda_initialized"]


def _parents(world_size: int) -> list[int]:
    return [s["parent_pid"] for s in gst.launch(_how_started, world_size=world_size)]


def test_each_rank_is_forked_by_its_own_template_for_its_environment(monkeypatch):
    gst.shutdown_workers()
    first = _parents(2)
    again = _parents(3)  # another size: a fresh pool (shutdown_workers() ends the templates)
    assert len(set(first)) == 2  # a template per rank
    assert again[:2] == first  # fresh workers, and no second import of torch for ranks 0 and 1
    gst.shutdown_workers()
    monkeypatch.setenv("GRADSYNC_TEST_OTHER_ENVIRONMENT", "1")
    assert not set(_parents(2)) & set(again)  # another environment: other templates


def _parent_and_run_name(rank, world_size):
    return os.getppid(), os.environ.get("RUN_NAME_OF_THIS_TEST", "unset")


def test_a_variable_torch_does_not_read_at_import_keeps_the_templates(monkeypatch):
    """A run name set in the notebook reaches the ranks, and costs no new import of torch."""
    gst.shutdown_workers()
    monkeypatch.delenv("RUN_NAME_OF_THIS_TEST", raising=False)
    first = gst.launch(_parent_and_run_name, world_size=2, reuse_workers=False)
    monkeypatch.setenv("RUN_NAME_OF_THIS_TEST", "second")
    second = gst.launch(_parent_and_run_name, world_size=2, reuse_workers=False)
    assert [p for p, _ in second] == [p for p, _ in first]  # the same templates forked them
    assert [name for _, name in second] == ["second"] * 2


def _hash_of_a_string(rank, world_size):
    return hash("gradsync")


@pytest.mark.skipif("PYTHONHASHSEED" in os.environ, reason="a fixed seed is the same everywhere")
def test_each_rank_draws_its_own_string_hash_seed_as_under_torchrun():
    """A set of strings iterates in another order on each rank; code relying on one order must
    fail in the notebook as it would under torchrun, not pass because the ranks are forks."""
    gst.shutdown_workers()
    hashes = gst.launch(_hash_of_a_string, world_size=3)
    assert len(set(hashes)) == 3


def _debug_level(rank, world_size):
    import torch.distributed as dist

    return str(dist.get_debug_level())


def _draws(rank, world_size):
    import random

    import numpy

    return random.random(), float(numpy.random.rand())


def test_a_fresh_worker_draws_other_random_numbers_than_the_last_fork_of_its_template():
    """Python reseeds ``random`` in a fork, and numpy seeds its own when first imported, which
    the template has not done: as in a fresh interpreter, not the same draws every launch."""
    gst.shutdown_workers()
    first = gst.launch(_draws, world_size=2, reuse_workers=False)
    second = gst.launch(_draws, world_size=2, reuse_workers=False)
    for a, b in zip(first, second, strict=True):
        assert a[0] != b[0] and a[1] != b[1]


def test_a_setting_torch_reads_at_import_reaches_the_ranks(monkeypatch):
    """TORCH_DISTRIBUTED_DEBUG is read when torch.distributed is imported: in the template."""
    gst.shutdown_workers()
    assert gst.launch(_debug_level, world_size=2) == ["DebugLevel.OFF"] * 2
    gst.shutdown_workers()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert gst.launch(_debug_level, world_size=2) == ["DebugLevel.DETAIL"] * 2


def test_ranks_die_with_a_killed_template_and_the_next_launch_starts_a_new_one():
    gst.shutdown_workers()
    parents = _parents(2)  # the workers stay idle afterwards
    ranks = worker_pids()
    assert len(ranks) == 2
    for parent in parents:
        os.kill(parent, signal.SIGKILL)
    assert wait_dead([*parents, *ranks]) == []  # the ranks: their parent-death signal
    assert not set(_parents(2)) & set(parents)


def test_a_template_that_cannot_start_leaves_the_launch_to_python_m(monkeypatch):
    gst.shutdown_workers()
    monkeypatch.setattr(template, "TEMPLATE_MODULE", "gradsync_tutorial.no_such_module")
    monkeypatch.setenv("GRADSYNC_TEST_BROKEN_TEMPLATE", str(time.monotonic()))  # not a kept one
    for seen in gst.launch(_how_started, world_size=2):
        assert seen["parent_pid"] == os.getpid()  # started with python -m, by this process
        assert seen["own_session"]


def test_fresh_interpreters_on_request(monkeypatch):
    """GRADSYNC_FRESH_INTERPRETERS=1 sets this switch at import: every rank is a python -m."""
    gst.shutdown_workers()
    monkeypatch.setattr(pool, "FORK_FROM_TEMPLATE", False)
    for seen in gst.launch(_how_started, world_size=2):
        assert seen["parent_pid"] == os.getpid()
        assert "-m gradsync_tutorial.launcher.worker" in seen["command"]


def test_the_switch_is_read_from_the_environment():
    import subprocess

    code = "from gradsync_tutorial.launcher import pool; print(pool.FORK_FROM_TEMPLATE)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, GRADSYNC_FRESH_INTERPRETERS="1")).stdout
    assert out.strip() == "False"


def test_templates_outlive_the_thread_that_started_them():
    """Their parent-death signal follows the thread that started them: a launch from a thread
    that then ends must not take the templates, nor the ranks they forked, with it."""
    import threading

    from gradsync_tutorial.launcher.process_tree import alive

    gst.shutdown_workers()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_parents(2)))
    thread.start()
    thread.join()
    time.sleep(1.0)  # a parent-death signal would have arrived by now
    assert all(alive(pid) for pid in seen[0]), "a template died with the thread"
    assert _parents(2) == seen[0]  # the same templates, and their idle ranks, serve on


def _template_pids() -> list[int]:
    """This process's live templates (``python -m TEMPLATE_MODULE`` children)."""
    from gradsync_tutorial.launcher.process_tree import alive, process_table

    me = os.getpid()
    return [pid for pid, ppid in process_table() if ppid == me and alive(pid)
            and template.TEMPLATE_MODULE in _parent_command(pid)]


def test_shutdown_workers_stops_the_templates_too_and_a_fresh_pool_imports_again():
    """A user calls it to free memory or to start afresh: nothing of the launch stays."""
    gst.shutdown_workers()
    parents = _parents(2)
    assert sorted(_template_pids()) == sorted(parents)
    gst.shutdown_workers()
    assert wait_dead(parents) == []
    assert _template_pids() == []
    assert not set(_parents(2)) & set(parents)  # fresh templates: torch imported again


def test_shutdown_workers_can_keep_the_templates_so_the_next_pool_is_forked_at_once():
    """keep_templates=True: no worker left, and the next launch's ranks come from the same
    templates (no new import of torch)."""
    parents = _parents(2)
    gst.shutdown_workers(keep_templates=True)
    assert worker_pids() == []
    assert _parents(2) == parents


def test_a_failure_keeps_the_templates_so_the_next_pool_is_forked_at_once():
    gst.shutdown_workers()
    parents = _parents(2)

    def fails(rank, world_size):
        raise ValueError("on purpose")

    with pytest.raises(gst.RankFailedError):
        gst.launch(fails, world_size=2)
    assert _parents(2) == parents
