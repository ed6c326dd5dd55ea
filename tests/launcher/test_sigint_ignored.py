"""The launcher's interrupt tests, and an interrupt itself, however the process started.

A shell starts background jobs (``nohup make test > log &``, a CI script) with SIGINT *ignored*,
every child inherits that, and Python then installs no KeyboardInterrupt handler. Three cases:

* the suite's own interrupt tests set the SIGINT disposition they need (they passed from a
  terminal and failed in the background): run here in a pytest started with SIGINT ignored;
* a Jupyter kernel started with SIGINT ignored: ipykernel sets Python's handler while a cell
  runs, so the stop button still raises KeyboardInterrupt in ``gst.launch``, and every rank stops;
* a plain script started with SIGINT ignored: SIGINT stays ignored (its owner asked for that),
  so ``gst.launch`` runs on and returns its results; the ranks, in sessions of their own, never
  see the signal either. SIGTERM or closing the script stops it and them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ..conftest import REPO, pid_alive, worker_pids

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signal dispositions")

# The suite's tests that send an interrupt (tests/launcher/test_launch.py).
INTERRUPT_TESTS = [  # one of each kind ([process] sets its disposition as [process group] does)
    "test_keyboard_interrupt_stops_every_rank",
    "test_sigint_to_kernel_stops_ranks[process group]",
]


def _ignore_sigint() -> None:  # in the child, before it starts: what `cmd &` does
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def test_interrupt_tests_pass_when_pytest_starts_with_sigint_ignored():
    launch_tests = Path(__file__).with_name("test_launch.py").relative_to(REPO)
    ids = [f"{launch_tests.as_posix()}::{name}" for name in INTERRUPT_TESTS]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids], cwd=REPO,
        env=_child_env(), preexec_fn=_ignore_sigint, capture_output=True, text=True,
        timeout=600,
    )
    assert run.returncode == 0 and f"{len(ids)} passed" in run.stdout, run.stdout[-3000:]


SCRIPT_IGNORING_SIGINT = """
    import os, signal, sys, time
    import gradsync_tutorial as gst

    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # inherited, as under nohup

    def fn(rank, world_size):
        print("pid", os.getpid(), flush=True)
        time.sleep(4)
        return rank

    print("results", gst.launch(fn, world_size=2, reuse_workers=False), flush=True)
"""


def test_script_started_with_sigint_ignored_runs_on_through_sigint():
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT_IGNORING_SIGINT)],
                            cwd=REPO, env=_child_env(), preexec_fn=_ignore_sigint,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pids = []
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.startswith("[rank") and " pid " in line:
                pids.append(int(line.split()[-1]))
        os.killpg(proc.pid, signal.SIGINT)  # the script's whole group, as a terminal's Ctrl-C
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert "results [0, 1]" in out
    assert not any(map(pid_alive, pids))


HANG_CELL = """
import os, time
import gradsync_tutorial as gst

def fn(rank, world_size):
    print("pid", os.getpid(), flush=True)
    time.sleep(120)

gst.launch(fn, world_size=2)
"""


def test_kernel_started_with_sigint_ignored_still_stops_its_ranks_on_interrupt():
    """A real ipykernel, started with SIGINT ignored, interrupted as Jupyter's stop button does."""
    jupyter_client = pytest.importorskip("jupyter_client")
    idle = set(worker_pids())  # this process's own idle workers, from tests run before
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel inherits it
    try:
        km = jupyter_client.KernelManager(kernel_name="python3")
        km.start_kernel(cwd=str(REPO), env=_child_env(), extra_arguments=[
            "--HistoryManager.hist_file=:memory:"])
    finally:
        signal.signal(signal.SIGINT, before)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        msg_id = kc.execute(HANG_CELL)
        pids, deadline = [], time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline:
            msg = kc.get_iopub_msg(timeout=120)
            text = msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""
            pids += [int(line.split()[-1]) for line in text.splitlines() if " pid " in line]
        assert len(pids) == 2
        start = time.monotonic()
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - start < 30
        deadline = time.monotonic() + 10
        while any(map(pid_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(pid_alive, pids)), "ranks outlived the interrupt"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert set(worker_pids()) <= idle
