"""A hang says where each rank is: at the timeout, each rank's own line, how many collectives it
entered, and which rank never reached the collective the others wait in.

The functions are defined as a notebook cell defines them (see `cell` in tests/programs), so
the report's lines are the cell's. Times are printed, not asserted (a loaded 2-core machine).
"""

from __future__ import annotations

import time

import pytest

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import LaunchTimeoutError

from ..conftest import worker_pids
from ..programs import cell

pytestmark = pytest.mark.usefixtures("no_workers_left")

TIMEOUT = 4


def _hang(fn, world_size=2) -> LaunchTimeoutError:
    gst.launch(lambda rank, ws: rank, world_size)  # warm workers: the timeout is the job's
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        gst.launch(fn, world_size=world_size, timeout=TIMEOUT)
    print(f"\ntimeout {TIMEOUT} s, error after {time.monotonic() - start:.2f} s\n"
          f"{info.value.report}")
    assert worker_pids() == []
    return info.value


def test_a_rank_that_skips_a_collective():
    ns = cell("""
        import time
        import torch
        import torch.distributed as dist

        def train(rank, world_size):
            t = torch.ones(1)
            dist.all_reduce(t)
            dist.all_reduce(t)
            if rank == 0:
                dist.all_reduce(t)          # the bug: only rank 0 makes the 3rd call
            time.sleep(100)
    """)
    error = _hang(ns["train"])
    report = error.report
    assert ("rank 0 is waiting in dist.all_reduce, its 3rd collective, at "
            'File "/tmp/ipykernel_test/') in report
    assert "line 11, in train (`dist.all_reduce(t)          # the bug" in report
    assert "line 12, in train (`time.sleep(100)`), after 2 collectives" in report
    assert ("rank 1 never reached the collective rank 0 is waiting in (dist.all_reduce, its "
            "3rd).") in report
    assert all(f"  {line}" in str(error) for line in report.splitlines())
    assert error.unfinished == [0, 1]


def test_ranks_that_call_different_collectives():
    ns = cell("""
        import torch
        import torch.distributed as dist

        def train(rank, world_size):
            t = torch.ones(1)
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
    """)
    report = _hang(ns["train"]).report
    assert "rank 0 is waiting in dist.all_reduce, its 1st collective" in report
    assert "rank 1 is waiting in dist.broadcast, its 1st collective" in report
    assert ("The ranks wait in different collectives: rank 0 in dist.all_reduce (its 1st); "
            "rank 1 in dist.broadcast (its 1st).") in report


def test_uneven_numbers_of_steps():
    ns = cell("""
        import torch
        import torch.distributed as dist

        def train(rank, world_size):
            batches = 3 if rank == 0 else 2     # uneven data without drop_last
            for step in range(batches):
                grad = torch.ones(1)
                dist.all_reduce(grad)
            return batches
    """)
    error = _hang(ns["train"])
    assert error.unfinished == [0]
    assert "rank 0 is waiting in dist.all_reduce, its 3rd collective" in error.report
    assert "rank 1 returned, after 2 collectives" in error.report
    assert ("rank 1 never reached the collective rank 0 is waiting in (dist.all_reduce, its "
            "3rd).") in error.report
    assert "rank 0 had not finished (rank 1 returned)" in str(error)


def test_a_monitored_barrier_is_left_to_name_the_missing_rank_itself():
    """Rank 1 returned and rank 0 waits in dist.monitored_barrier: the launcher does not stop
    it early (as it stops an all_reduce that can never end), since the barrier ends at its own
    timeout with torch's error, which names the rank that did not arrive (notebook 04)."""
    ns = cell("""
        from datetime import timedelta

        import torch.distributed as dist

        def train(rank, world_size):
            if rank == 0:
                dist.monitored_barrier(timeout=timedelta(seconds=4))
            return rank
    """)
    with pytest.raises(gst.RankFailedError) as info:
        gst.launch(ns["train"], world_size=2, timeout=30)
    assert info.value.rank == 0
    assert "Rank 1 failed to pass monitoredBarrier in 4000 ms" in str(info.value)


def test_a_rank_busy_in_native_code_cannot_say_where_it_is():
    ns = cell("""
        import torch
        import torch.distributed as dist

        def train(rank, world_size):
            if rank == 1:
                sum(range(10**12))      # a loop in C that never lets go of Python's GIL
            dist.all_reduce(torch.ones(1))
    """)
    report = _hang(ns["train"]).report
    assert "rank 0 is waiting in dist.all_reduce, its 1st collective" in report
    assert "rank 1: its stack could not be read within 1 s: it is busy in native" in report
    assert "rank 1 has not reached the collective rank 0 is waiting in" in report


def test_a_rendezvous_nobody_hosts_is_named_with_its_port():
    """The friction: a rank destroyed the group and re-initialized on a port nobody hosts."""
    import socket

    with socket.socket() as s:  # a port that is free now, and that no rank will host
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ns = cell(f"""
        import torch.distributed as dist

        def train(rank, world_size):
            dist.destroy_process_group()
            if rank == 1:
                dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}",
                                        rank=rank, world_size=world_size)
    """)
    error = _hang(ns["train"])
    assert error.unfinished == [1]
    assert (f"rank 1 is waiting in dist.init_process_group (its rendezvous at "
            f"tcp://127.0.0.1:{port})") in error.report
    assert "rank 1 never finished init_process_group: no process answers" in error.report
