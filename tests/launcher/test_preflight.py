"""gradsync_tutorial.launcher.preflight: bad input gets a message that says what to do, before
any process starts (and fast: nothing is started to find out).
"""

from __future__ import annotations

import math
import os
import threading
import time

import pytest

import gradsync_tutorial as gst

from ..conftest import worker_pids

pytestmark = pytest.mark.usefixtures("no_workers_left")


def _ok(rank, world_size):
    return rank


def _needs_three(rank, world_size, a, b, c):
    return rank


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size must be a positive int"),
        ({"world_size": 1.5}, ValueError, "world_size must be a positive int"),
        ({"world_size": True}, ValueError, "world_size must be a positive int"),
        ({"fn": 42}, TypeError, "fn must be a function taking"),
        ({"fn": lambda: 0}, TypeError, r"launch calls fn\(rank, world_size, \*args\)"),
        ({"fn": _needs_three, "args": (1,)}, TypeError, "cannot take 3 positional"),
        ({"args": 5}, TypeError, r"args=\(5,\)"),
        ({"fn": lambda r, w, lock: 0, "args": (threading.Lock(),)}, TypeError,
         "could not send fn and args"),
        ({"backend": "mpi"}, ValueError, "unknown backend 'mpi'"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"timeout": -5}, ValueError, r"positive number of seconds \(finite\)"),
        ({"timeout": math.nan}, ValueError, r"positive number of seconds \(finite\)"),
        ({"timeout": math.inf}, ValueError, "timeout=24 \\* 3600"),
        ({"num_threads": 0}, ValueError, "num_threads must be a positive int"),
        ({"show_ranks": [2]}, ValueError, r"outside 0..1"),
        ({"show_ranks": ["0"]}, ValueError, r"names ranks \['0'\]"),
        ({"show_ranks": 1}, TypeError, r"show_ranks must be a list of ranks.*show_ranks=\[1\]"),
        ({"show_ranks": "0"}, TypeError, "show_ranks must be a list of ranks"),
        ({"master_port": 70000}, ValueError,
         r"master_port must be an int port number in 1..65535, or 0 or None \(launch picks"),
        ({"master_port": -1}, ValueError, "master_port must be an int"),
        ({"master_port": "29500"}, ValueError, "master_port must be an int"),
        ({"master_port": 29500.0}, ValueError, "master_port must be an int"),
    ],
)
def test_bad_input_fails_fast_before_any_process_starts(kwargs, error, match):
    call = {"fn": _ok, "world_size": 2} | kwargs
    start = time.monotonic()
    with pytest.raises(error, match=match):
        gst.launch(call.pop("fn"), **call)
    assert time.monotonic() - start < 1.0
    assert worker_pids() == []


def test_master_port_0_is_accepted_and_picks_a_free_port_as_none_does():
    """The message says 0 is accepted: it is, and it means what None means."""
    ports = gst.launch(lambda rank, world_size: int(os.environ["MASTER_PORT"]), 2, master_port=0)
    assert ports[0] == ports[1] > 0


@pytest.mark.parametrize("value", ["²", "1" * 20])
def test_an_omp_num_threads_no_rank_can_use_is_refused_saying_what_to_set(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS=.*Set it to a whole number from 1 to"):
        gst.launch(_ok, world_size=2)
    assert time.monotonic() - start < 1.0
    assert worker_pids() == []
