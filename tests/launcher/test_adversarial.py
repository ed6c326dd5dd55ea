"""The classes of fault an adversarial pass found, each with its test.

Every test ends with no worker left (the ``no_workers_left`` fixture); the ones that kill a
kernel-like script check the processes the ranks started too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import gradsync_tutorial as gst

from ..conftest import REPO, pid_alive, start_kernel_like, wait_dead, worker_pids

pytestmark = pytest.mark.usefixtures("no_workers_left")
posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX signals and sessions")


def _script(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)


@posix_only
def test_a_rank_s_subprocesses_die_with_a_killed_kernel():
    proc, children = start_kernel_like("""
        import os, subprocess, time
        import gradsync_tutorial as gst

        def fn(rank, world_size):
            child = subprocess.Popen(["sleep", "600"])  # a rank's own helper program
            print("pid", child.pid, flush=True)
            time.sleep(600)

        gst.launch(fn, world_size=2)
    """, seconds=120)
    proc.kill()  # SIGKILL: no cleanup code runs in the kernel at all
    proc.wait()
    try:
        assert wait_dead(children) == [], "a rank's subprocess outlived the killed kernel"
    finally:
        for pid in children:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


@posix_only
def test_stopping_works_when_the_notebook_ran_out_of_file_descriptors():
    proc = _script("""
        import os, resource
        import gradsync_tutorial as gst

        print("pids", *gst.launch(lambda rank, world_size: os.getpid(), world_size=2),
              flush=True)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4,
                                                    resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        hog = []
        try:
            while True:
                hog.append(open(os.devnull))
        except OSError as e:
            print("exhausted", e.errno, flush=True)
        gst.shutdown_workers()  # must stop them, with no descriptor left to read /proc
        print("stopped", flush=True)
    """)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
        proc.wait()
    pids = [int(p) for p in out.split("pids", 1)[1].split("\n", 1)[0].split()]
    assert "exhausted" in out and "stopped" in out, err[-3000:]
    assert wait_dead(pids) == [], "workers survived shutdown_workers() without file descriptors"


def test_a_deep_stack_is_reported_where_it_is():
    def fn(rank, world_size):
        import sys
        import time

        import torch
        import torch.distributed as dist

        sys.setrecursionlimit(20000)

        def deep(n):
            if n:
                return deep(n - 1)
            if rank == 0:
                dist.all_reduce(torch.ones(1))
            else:
                time.sleep(600)

        deep(6000)

    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=10)
    report = caught.value.report
    assert "rank 0 is waiting in dist.all_reduce" in report
    assert "time.sleep(600)" in report
    assert "native" not in report


def test_a_hang_report_that_fails_is_said_and_leaves_no_traceback_in_the_cell(capfd):
    def fn(rank, world_size):
        import time

        from gradsync_tutorial.launcher import hang_report

        def broken(*args, **kwargs):
            raise RuntimeError("the report broke")

        hang_report.stack_report = broken  # the worker builds its report with this
        time.sleep(600)

    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=5)
    assert "the report broke" in caught.value.report
    assert "Traceback" not in capfd.readouterr().err


def test_a_job_that_closes_its_stdout_still_returns_and_the_next_job_runs():
    def closes(rank, world_size):
        import sys

        print("before closing", flush=True)
        sys.stdout.close()
        return rank

    assert gst.launch(closes, world_size=2, timeout=60) == [0, 1]
    assert gst.launch(lambda rank, world_size: print("hello") or rank, world_size=2) == [0, 1]


def test_a_huge_exception_message_is_cut_to_a_readable_length():
    def fn(rank, world_size):
        raise ValueError("x" * 10_000_000)

    with pytest.raises(gst.RankFailedError) as caught:
        gst.launch(fn, world_size=2)
    message = str(caught.value)
    assert len(message) < 100_000
    assert "characters cut" in message
    assert message.startswith("rank ") and "raised ValueError: xxx" in message


def test_a_tiny_timeout_is_a_launch_timeout_not_a_store_error(capfd):
    gst.launch(lambda rank, world_size: rank, world_size=2)  # warm: the job itself times out
    with pytest.raises(gst.LaunchTimeoutError, match="timed out after 1e-06 s"):
        gst.launch(lambda rank, world_size: rank, world_size=2, timeout=1e-6)
    err = capfd.readouterr().err
    assert "frame #" not in err and "DistNetworkError" not in err


def test_input_in_a_rank_says_ranks_have_no_standard_input():
    with pytest.raises(gst.RankFailedError) as caught:
        gst.launch(lambda rank, world_size: input("batch size? "), world_size=2)
    assert "no standard input" in str(caught.value)
    assert "args=" in str(caught.value)


def test_a_rank_blocked_in_its_own_init_process_group_is_reported_there():
    def fn(rank, world_size):
        import time

        import torch.distributed as dist

        if rank == 0:
            dist.init_process_group("cpu:gloo")  # another backend: it rejoins, rank 1 never does
        else:
            time.sleep(600)

    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=10)
    report = caught.value.report
    assert "rank 0 is waiting in dist.init_process_group" in report
    assert "dist.barrier" not in report


def test_control_thread_answers_while_fn_is_deep_in_python():
    """The stack is read by the worker's control thread; many stack requests in a row all get
    an answer (the report is linear in the stack's depth)."""
    def fn(rank, world_size):
        import sys
        import time

        sys.setrecursionlimit(20000)

        def deep(n):
            return deep(n - 1) if n else time.sleep(600)

        deep(8000)

    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=8)
    assert caught.value.report.count("time.sleep(600)") == 2
    assert worker_pids() == []
