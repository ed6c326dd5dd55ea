"""Shared test helpers: the course's notebooks and snippets (found, not listed); the launcher's
worker processes, so tests can prove none is left."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gradsync_tutorial.launcher.protocol import WORKER_MODULE
from gradsync_tutorial.launcher.template import TEMPLATE_MODULE
from gradsync_tutorial.notebooks import paths

REPO = Path(__file__).resolve().parent.parent
#: The course's notebooks, their sources and the snippets, in course order: found, not listed.
NOTEBOOKS = paths("ipynb")
SOURCES = paths("source")
SNIPPETS = paths("snippet")


@functools.cache
def tool(name: str):
    """``tools/NAME.py``, a maintainer's script (not a package), loaded as a module."""
    from gradsync_tutorial.notebooks import load_tool

    return load_tool(name, REPO)


def worker_pids() -> list[int]:
    """PIDs of live worker processes started by this process: ``python -m WORKER_MODULE``,
    or (Linux) forked by one of its templates (``python -m TEMPLATE_MODULE``).

    Read from /proc on Linux; elsewhere (macOS, Windows: the public CI) through psutil.
    """
    if not Path("/proc/self/stat").exists():
        import psutil

        return [p.pid for p in psutil.Process().children()
                if p.status() != psutil.STATUS_ZOMBIE
                and WORKER_MODULE in " ".join(p.cmdline())]
    table = []  # (pid, parent, command line) of each live process
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            table.append((int(proc.name), ppid, cmdline))
    me = os.getpid()
    templates = {pid for pid, ppid, cmd in table if ppid == me and TEMPLATE_MODULE.encode() in cmd}
    return [pid for pid, ppid, cmd in table
            if (ppid == me and WORKER_MODULE.encode() in cmd) or ppid in templates]


def pid_alive(pid: int) -> bool:
    if not Path("/proc/self/stat").exists():  # macOS, Windows
        import psutil

        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_kernel_like(code: str, count: int = 2, seconds: float = 60.0):
    """Start ``code`` as a kernel would run it (a process in a session of its own), which
    prints ``pid N [N ...]`` lines from its ranks; return it once ``count`` pids are read."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids: list[int] = []
    deadline = time.monotonic() + seconds
    while len(pids) < count and time.monotonic() < deadline:
        words = proc.stdout.readline().split()
        if "pid" in words:
            pids += [int(w) for w in words[words.index("pid") + 1:]]
    assert len(pids) == count, f"expected {count} pids, read {pids}"
    return proc, pids


def wait_dead(pids, seconds: float = 15.0) -> list[int]:
    """Wait until every pid has ended; return those still alive (a generous bound, not a
    timing: it only tells "ended" from "still running a 60-second sleep")."""
    deadline = time.monotonic() + seconds
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


@pytest.fixture
def no_workers_left():
    """After the test: no worker of this process is alive, idle pool included.

    Idle workers that an earlier test file kept are stopped first: they are not this test's.
    The templates stay (they are no workers): the next test's pool is forked at once, not
    started by importing torch again (a test that needs fresh templates stops them itself).
    """
    import gradsync_tutorial as gst

    gst.shutdown_workers(keep_templates=True)
    yield
    gst.shutdown_workers(keep_templates=True)
    assert worker_pids() == []
