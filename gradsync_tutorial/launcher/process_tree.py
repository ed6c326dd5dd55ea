"""Stopping a rank and every process below it, on each platform.

A rank starts in a process group of its own (a new session on POSIX, a new process group on
Windows), so that Jupyter's stop button, an interrupt for the notebook's group, does not reach it:
the launcher stops it, in order. Stopping reads the rank's process tree first (``/proc`` on
Linux, ``ps`` on macOS and the BSDs), because a child that started a session of its own is out
of reach of the rank's group, and once the rank is gone its children are no longer below it;
then it signals the rank's group and every process of the tree. Windows has no such signals:
``taskkill /T /F`` stops the tree. Each branch is tested with the platform monkeypatched.

    >>> import subprocess, sys
    >>> proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
    ...                         **popen_kwargs())
    >>> tree(proc)                          # no child processes
    set()
    >>> stop_trees([proc]); proc.poll() is not None
    True

Part of ``gst.launch`` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

GRACE_SECONDS = 1.0  # between SIGTERM and SIGKILL when stopping ranks


def stop_trees(procs: Sequence[subprocess.Popen], grace: float = GRACE_SECONDS) -> None:
    """Stop each process and everything it started: SIGTERM, ``grace`` seconds, SIGKILL.

    Each tree is read *before* signalling it: a child that started a session of its own is
    out of reach of the rank's process group, and once the rank is gone its children are no
    longer below it. Returns once every process in ``procs`` has ended.
    """
    trees = {proc.pid: tree(proc) for proc in procs}
    for proc in procs:
        signal_tree(proc, trees[proc.pid], signal.SIGTERM)
    end = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        pids = trees[proc.pid] | tree(proc)  # and whatever it started meanwhile
        signal_tree(proc, pids, getattr(signal, "SIGKILL", signal.SIGTERM))
        proc.wait()


def popen_kwargs() -> dict[str, Any]:
    """Start a rank in a process group of its own, so that an interrupt for the notebook's
    group (Jupyter's stop button) does not reach it: the launcher stops it, in order."""
    if os.name == "posix":
        return {"start_new_session": True}
    return {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0x200)}


def tree(proc: subprocess.Popen) -> set[int]:
    """The pids of every live process below ``proc`` (POSIX; Windows: taskkill finds them)."""
    if os.name != "posix" or proc.poll() is not None:
        return set()
    children: dict[int, list[int]] = collections.defaultdict(list)
    try:
        table = process_table()
    except OSError:  # no file descriptor left to read /proc with: the group and pid still work
        table = []
    for pid, ppid in table:
        children[ppid].append(pid)
    found: set[int] = set()
    todo = [proc.pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _stat_fields(pid: int | str) -> list[bytes]:
    """The fields of ``/proc/PID/stat`` after the command: state, parent pid, ... (Linux)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        # "pid (command) state ppid ...": the command may contain spaces and ")".
        return f.read().rsplit(b")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie waiting to be reaped (Linux).

    >>> import os
    >>> alive(os.getpid())
    True
    """
    try:
        return _stat_fields(pid)[0] != b"Z"
    except (OSError, IndexError):
        return False


def process_table() -> list[tuple[int, int]]:
    """(pid, parent pid) of every process: from ``/proc`` on Linux, from ``ps`` elsewhere."""
    if sys.platform.startswith("linux"):
        table = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    table.append((int(entry), int(_stat_fields(entry)[1])))
                except OSError:  # it ended meanwhile
                    continue
        return table
    try:  # macOS and the BSDs have no /proc
        out = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [(int(a), int(b)) for a, b in (line.split() for line in out.splitlines()
                                          if len(line.split()) == 2)]


def signal_tree(proc: subprocess.Popen, pids: set[int], sig: int) -> None:
    """Signal the worker, its process group, and the processes ``pids`` below it."""
    if os.name != "posix":
        if proc.poll() is None:
            # No signals to send on Windows: taskkill stops the worker and its descendants.
            try:
                subprocess.run(["taskkill", "/F", "/T", "/PID", str(proc.pid)],
                               capture_output=True, timeout=30)
            except (OSError, subprocess.SubprocessError):
                pass
            try:
                proc.kill()
            except OSError:
                pass
        return
    try:
        os.killpg(proc.pid, sig)  # the rank's own group: its data-loader workers, say
    except OSError:  # ProcessLookupError: already gone; PermissionError: a zombie group
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


# -- a rank's lifelines: it never outlives the launcher ------------------------------------

_reaper_pipe: int | None = None  # the write end the reaper watches, held for this worker's life
# The reaper: a shell that waits for end of file on its stdin, then kills its process group.
REAPER = ("sh", "-c", "read _; kill -KILL 0")


def start_reaper() -> None:
    """POSIX: start a tiny process that kills this worker's process group once it is gone.

    A rank's ``subprocess.Popen`` children stay in the rank's process group, but no
    parent-death signal reaches them (Popen runs no at-fork hook): when the notebook is killed
    and this worker dies with it, they would run on. The reaper (``sh``, a few hundred kB, in
    the same group) reads a pipe only this process holds open; at end of file -- this worker
    died, however -- it kills the whole group, itself included. Children that left the group (a
    session of their own) are out of its reach; the launcher stops those when it can.
    """
    global _reaper_pipe
    if os.name != "posix":
        return
    import subprocess

    read_end, write_end = os.pipe()
    try:
        subprocess.Popen(REAPER, stdin=read_end, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    except OSError:  # no sh: the launcher's own stopping still reaches the group
        os.close(write_end)
        return
    finally:
        os.close(read_end)
    _reaper_pipe = write_end
    if hasattr(os, "register_at_fork"):  # a fork of this worker must not keep the reaper waiting
        os.register_at_fork(after_in_child=lambda: os.close(write_end))


def die_with_parent(parent: int | None = None) -> None:
    """Linux: be killed when the process that started this one dies (prctl PR_SET_PDEATHSIG).

    A worker calls it for itself at start-up, and registers it for every process it forks
    from Python (``multiprocessing`` with fork, ``os.fork``), so those never outlive the rank.
    Other platforms have no such signal: there the socket to the launcher is the lifeline.
    Linux sends it when the *thread* that started the worker ends: so the launcher starts its
    processes from one long-lived thread (:mod:`.spawner`), and a launch from a thread that
    then exits leaves the templates and the idle workers running.

    ``parent`` is the pid that started this process, where known. A parent that died before
    this call sends no signal: the process then kills itself as the signal would have.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1  # noqa: N806 - <linux/prctl.h>
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no libc to load (a static or unusual build)
        return
    if parent is not None and os.getppid() != parent:  # reparented: the parent is gone
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent_and_forks(parent: int | None = None) -> None:
    """:func:`die_with_parent` for this process, and for every process it forks from Python."""
    die_with_parent(parent)
    if hasattr(os, "register_at_fork"):
        forking = [os.getpid()]
        os.register_at_fork(before=lambda: forking.__setitem__(0, os.getpid()),
                            after_in_child=lambda: die_with_parent(forking[0]))
