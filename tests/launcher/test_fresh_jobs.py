"""One job's state does not reach the next, and the course's launches stay warm.

The rule (docs/launcher.md, "What each rank is given, and what each launch forgets"): a warm
worker puts back what a fresh interpreter has
(``sys.argv``, torch's classes and functions a job patched, ...); a job that imported a library
from outside the standard library, torch and the course's own package retires its workers, since
such a library may keep process-wide state (Accelerate's ``AcceleratorState``): the next launch
starts fresh interpreters, and the launch says so in one line.
"""

from __future__ import annotations

import pytest

import gradsync_tutorial as gst

pytestmark = pytest.mark.usefixtures("no_workers_left")


def pids(rank, world_size):
    import os

    return os.getpid()


def test_sys_argv_set_by_a_job_does_not_reach_the_next():
    gst.shutdown_workers()
    fresh = gst.launch(lambda rank, world_size: list(__import__("sys").argv), world_size=2)

    def parse_args(rank, world_size):
        import sys

        sys.argv = ["train.py", "--lr", "0.1"]  # what a cell does before calling main()
        return sys.argv

    gst.launch(parse_args, world_size=2)
    assert gst.launch(lambda rank, world_size: list(__import__("sys").argv), 2) == fresh


def test_a_patched_tensor_operator_does_not_reach_the_next_job():
    def patch(rank, world_size):
        import torch

        torch.Tensor.__add__ = lambda a, b: torch.sub(a, b)  # a job's monkeypatch
        torch.nn.Module.extra_hook = "leaked"
        return (torch.ones(1) + torch.ones(1)).item()

    def add(rank, world_size):
        import torch

        return (torch.ones(1) + torch.ones(1)).item(), hasattr(torch.nn.Module, "extra_hook")

    first = gst.launch(pids, world_size=2)
    assert gst.launch(patch, world_size=2) == [0.0, 0.0]
    assert gst.launch(add, world_size=2) == [(2.0, False), (2.0, False)]
    assert gst.launch(pids, world_size=2) == first  # put back, not restarted: still warm


def test_a_job_that_imports_a_stateful_library_retires_its_workers(capsys):
    def configure(precision):
        def fn(rank, world_size):
            from tests.programs import stateful_library

            return stateful_library.configure(precision)
        return fn

    before = gst.launch(pids, world_size=2)
    assert gst.launch(configure("no"), world_size=2) == ["no", "no"]
    note = capsys.readouterr().err
    assert "tests" in note and "fresh" in note and len(note.strip().splitlines()) == 1
    # Fresh interpreters, as the next launch of a script under torchrun would get.
    assert gst.launch(configure("bf16"), world_size=2) == ["bf16", "bf16"]
    assert not set(gst.launch(pids, world_size=2)) & set(before)


def test_restart_your_runtime_says_what_restarts_a_rank():
    def twice(rank, world_size):
        from tests.programs import stateful_library

        stateful_library.configure("no")
        stateful_library.configure("bf16")  # refused: "restart your runtime"

    with pytest.raises(gst.RankFailedError) as caught:
        gst.launch(twice, world_size=2)
    assert "gst.shutdown_workers()" in str(caught.value)
    assert "reuse_workers=False" in str(caught.value)


def test_the_course_s_own_launches_keep_their_warm_workers():
    def course_job(rank, world_size):
        import os

        import torch
        import torch.nn.functional as F  # noqa: N812
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

        import gradsync_tutorial as gst

        model = DDP(gst.model.Net())
        F.relu(model(torch.randn(4, 1, 28, 28))).sum().backward()
        gst.detect.count_collectives  # noqa: B018 - the course's detectors
        return os.getpid()

    first = gst.launch(course_job, world_size=2)
    assert gst.launch(course_job, world_size=2) == first


def _settings(rank, world_size):
    import os
    import resource

    umask = os.umask(0o022)
    os.umask(umask)
    return (umask, resource.getrlimit(resource.RLIMIT_NOFILE), sorted(os.sched_getaffinity(0)),
            os.getpriority(os.PRIO_PROCESS, 0))


def _change_settings(rank, world_size):
    import os
    import resource

    os.umask(0o077)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))  # "Too many open files" next
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    os.nice(5)
    return os.getpid()


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux only")
def test_a_job_s_umask_limits_affinity_and_niceness_do_not_reach_the_next():
    fresh = gst.launch(_settings, 2)
    gst.launch(_change_settings, 2)
    assert gst.launch(_settings, 2) == fresh  # put back, or the workers were retired


def test_a_removed_working_directory_is_named_before_any_process_starts(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(FileNotFoundError, match="working directory was removed.*os.chdir"):
        gst.launch(pids, 2)
