"""The worker processes behind :func:`gradsync_tutorial.launch`, seen from the launcher.

:class:`_Workers` starts ``world_size`` fresh interpreters (``python -m
gradsync_tutorial.launcher.worker``) and accepts their token-authenticated connections. It forwards
every line they print into the calling cell as ``[rank r] ...``, collects their messages into a
:class:`_JobState`, and stops them: each rank with every process below it, even one that left
its process group or session (SIGTERM, then SIGKILL). The launcher waits for everything through
one loop, :meth:`_Workers.pump`, so output keeps flowing while it waits; results are judged
apart from output, so a rank that printed a lot is not taken for a rank still running.

Nothing here ever blocks on a pipe: a rank's child can inherit the rank's stdout and keep it
open after the rank is gone, so each reader thread owns its pipe and closes it at end of file,
and stopping only waits a bounded time for the readers.

Platforms: POSIX (Linux, macOS) stops a rank's process tree with signals, read from ``/proc``
on Linux and from ``ps`` elsewhere; Windows has no signals and no process groups to signal,
so ``taskkill /T /F`` stops the tree. Each branch is a small function below, tested with the
platform monkeypatched.
"""

from __future__ import annotations

import collections
import errno
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any

from .errors import Failure, _with_cell_labels
from .protocol import WORKER_MODULE, Finished, Raised, Ready, StackReport
from .worker import END_MARK

GRACE_SECONDS = 1.0  # between SIGTERM and SIGKILL when stopping ranks
READER_JOIN_SECONDS = 2.0  # how long stopping waits for the output readers, all together
TOKEN_BYTES = 16


def _exit_failure(rank: int, returncode: int, started: bool) -> Failure:
    """The record for a rank whose process ended without a result (``returncode`` < 0: signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return Failure(rank, "killed", signal=name, during_startup=not started)
    return Failure(rank, "exited", exit_code=returncode, during_startup=not started)


class _Workers:
    """``world_size`` worker processes, their pipes, and the event queue the launcher pumps."""

    def __init__(self, world_size: int, key: tuple):
        self.world_size = world_size
        self.key = key  # what the idle pool matches a later launch against
        self.events: queue.Queue = queue.Queue()  # output: lines, end marks, end of file
        self.messages: queue.Queue = queue.Queue()  # what the ranks send: results, errors...
        self.conns: list[Connection | None] = [None] * world_size
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.tokens = [secrets.token_bytes(TOKEN_BYTES) for _ in range(world_size)]
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.setblocking(False)
        self.job_id = 0
        self.show: set[int] = set(range(world_size))
        # Each rank's end-of-job mark carries a secret of its own, so that a line a rank prints
        # can never pass for one (nor break the reader by looking like one).
        self.marks = [f"{END_MARK} {secrets.token_hex(8)}" for _ in range(world_size)]
        try:
            self._start_all()
        except BaseException as e:  # an interrupt between two starts, or too many open files
            self.stop_despite_interrupts()  # never leave the ranks already started running
            if isinstance(e, OSError) and e.errno == errno.EMFILE:
                raise OSError(e.errno, f"could not start {world_size} worker processes: this "
                              "process ran out of file descriptors (each rank holds several "
                              "open). Use a smaller world_size, or raise the limit "
                              "(`ulimit -n`) before starting Jupyter.") from e
            raise

    def _start_all(self) -> None:
        host, port = self.server.getsockname()[:2]
        env = dict(os.environ, PYTHONUNBUFFERED="1", GRADSYNC_CONTROL=f"{host}:{port}")
        for rank in range(self.world_size):
            env["GRADSYNC_TOKEN"] = self.tokens[rank].hex()
            env["GRADSYNC_END_MARK"] = self.marks[rank]
            proc = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env, **_popen_kwargs(),
            )
            self.procs.append(proc)
            for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                self._thread(self._read_lines, rank, name, pipe)

    def _thread(self, target, *args):
        t = threading.Thread(target=target, args=args, daemon=True, name="gradsync-reader")
        t.start()
        self.threads.append(t)

    def _read_lines(self, rank, stream, pipe):
        """Forward one pipe's lines until end of file; this thread owns the pipe and closes it."""
        mark = self.marks[rank]
        try:
            for raw in iter(pipe.readline, b""):
                text = raw.decode("utf-8", "replace").rstrip("\r\n")
                before, found, job = text.partition(mark)
                if found:  # text printed without a newline comes just before the mark
                    if before:
                        self.events.put(("line", rank, stream, _last_redraw(before)))
                    try:
                        self.events.put(("mark", rank, stream, int(job)))
                    except ValueError:  # cannot happen unless the secret leaked: show it
                        self.events.put(("line", rank, stream, _last_redraw(text)))
                else:
                    self.events.put(("line", rank, stream, _last_redraw(text)))
        except (OSError, ValueError):  # the pipe was closed under us: nothing more to read
            pass
        finally:
            self.events.put(("eof", rank, stream, None))
            pipe.close()

    def _read_messages(self, rank, conn):
        """Forward one rank's messages until its socket closes; this thread owns ``conn``."""
        try:
            while True:
                self.messages.put(("msg", rank, None, conn.recv()))
        except (EOFError, OSError):
            self.messages.put(("closed", rank, None, None))
        finally:
            conn.close()

    def _accept(self):
        """Take any worker that has connected back; check its token to learn its rank."""
        while True:
            try:
                sock, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.settimeout(5)
            try:
                token = b""
                while len(token) < TOKEN_BYTES:
                    chunk = sock.recv(TOKEN_BYTES - len(token))
                    if not chunk:
                        break
                    token += chunk
            except OSError:
                token = b""
            if token not in self.tokens or self.conns[self.tokens.index(token)] is not None:
                sock.close()  # not one of ours
                continue
            rank = self.tokens.index(token)
            sock.settimeout(None)
            self.conns[rank] = Connection(sock.detach())
            self._thread(self._read_messages, rank, self.conns[rank])

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    # -- the pump: everything the launcher waits for goes through here -------------------------

    def pump(self, state: _JobState, deadline: float, done: Callable[[], bool]) -> None:
        """Forward output and collect messages until ``done()``, a failure, or the deadline."""
        while not done():
            if not all(self.conns):
                self._accept()
            self._handle_next_event(state)
            self._note_exits(state)
            if state.failures:
                return
            if time.monotonic() > deadline:
                raise _Deadline

    def drain(self, state: _JobState, until: Callable[[], bool], seconds: float,
              note_exits: bool = False) -> None:
        """Keep forwarding output for up to ``seconds`` until ``until()``; never raises.

        ``note_exits``: also record ranks whose process ended (only before we stop them).
        """
        end = time.monotonic() + seconds
        while not until() and time.monotonic() < end:
            self._handle_next_event(state)
            if note_exits:
                self._note_exits(state)

    def _note_exits(self, state: _JobState) -> None:
        """A rank whose process ended without reporting a result or an error has failed."""
        for rank, proc in enumerate(self.procs):
            if rank not in state.results and rank not in state.failures:
                returncode = proc.poll()
                if returncode is not None:
                    state.fail(_exit_failure(rank, returncode, state.sent))

    def _handle_next_event(self, state: _JobState) -> None:
        """Record every message that arrived, then print one line (or note a mark or an EOF).

        Messages come first and on a queue of their own: a rank that printed a million lines
        and then returned has finished, however long the notebook takes to show those lines.
        Waits at most 10 ms.
        """
        while True:
            try:
                kind, rank, _, value = self.messages.get_nowait()
            except queue.Empty:
                break
            if kind == "msg":
                state.on_message(rank, value)
        try:
            kind, rank, stream, value = self.events.get(timeout=0.01)
        except queue.Empty:
            return
        if kind == "line":
            if stream == "stderr":
                state.stderr_tail[rank].append(value)
            if rank in self.show:
                print(f"[rank {rank}] {value}", file=getattr(sys, stream), flush=True)
        elif kind == "mark":
            state.marks.add((rank, stream, value))
        elif kind == "eof":
            state.eofs.add((rank, stream))

    def drain_output(self, state: _JobState, ranks: Iterable[int], idle_seconds: float) -> None:
        """Print the ranks' output up to their end-of-job marks, however long that takes.

        Gives up only when no output at all arrived for ``idle_seconds`` (a mark that never
        comes: the rank closed its stdout, say).
        """
        ranks = list(ranks)
        last = time.monotonic()
        while not state.output_complete(ranks):
            before = self.events.qsize()
            self._handle_next_event(state)
            if before or self.events.qsize():
                last = time.monotonic()
            elif time.monotonic() - last > idle_seconds:
                return

    def send(self, rank: int, message: object) -> None:
        try:
            self.conns[rank].send(message)
        except OSError:
            pass  # it died: the pump sees the exit and reports it

    def stop(self) -> None:
        """Stop every worker and everything it started; never blocks on a pipe.

        Each rank's process tree is read *before* signalling it: a child that started a session
        of its own is out of reach of the rank's process group, and once the rank is gone its
        children are no longer below it.
        """
        trees = {proc.pid: _tree(proc) for proc in self.procs}
        for proc in self.procs:
            _signal_tree(proc, trees[proc.pid], signal.SIGTERM)
        end = time.monotonic() + GRACE_SECONDS
        for proc in self.procs:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            pids = trees[proc.pid] | _tree(proc)  # and whatever it started meanwhile
            _signal_tree(proc, pids, getattr(signal, "SIGKILL", signal.SIGTERM))
            proc.wait()
        self.close()

    def stop_despite_interrupts(self) -> None:
        """:meth:`stop`, even if the user presses the stop button again meanwhile."""
        while True:
            try:
                self.stop()
                return
            except KeyboardInterrupt:
                continue

    def close(self) -> None:
        """Release the sockets; wait a bounded time for the reader threads.

        The readers close their own pipes at end of file. One that is still blocked after
        the ranks are gone reads a pipe held by a process that escaped its rank (one that
        double-forked away): it is a daemon thread, and it ends when that process ends.
        """
        self.server.close()  # the connections are closed by their reader threads
        end = time.monotonic() + READER_JOIN_SECONDS
        for t in self.threads:
            t.join(timeout=max(0.0, end - time.monotonic()))


def _last_redraw(text: str) -> str:
    """A progress bar redrawn with ``\\r``: keep its last state."""
    return text.rsplit("\r", 1)[-1]


# -- platforms: the only functions here that look at the operating system --------------------


def _popen_kwargs() -> dict[str, Any]:
    """Start a rank in a process group of its own, so that an interrupt for the notebook's
    group (Jupyter's stop button) does not reach it: the launcher stops it, in order."""
    if os.name == "posix":
        return {"start_new_session": True}
    return {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0x200)}


def _tree(proc: subprocess.Popen) -> set[int]:
    """The pids of every live process below ``proc`` (POSIX; Windows: taskkill finds them)."""
    if os.name != "posix" or proc.poll() is not None:
        return set()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, ppid in _process_table():
        children[ppid].append(pid)
    found: set[int] = set()
    todo = [proc.pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _process_table() -> list[tuple[int, int]]:
    """(pid, parent pid) of every process: from ``/proc`` on Linux, from ``ps`` elsewhere."""
    if sys.platform.startswith("linux"):
        table = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        stat = f.read()
                except OSError:  # it ended meanwhile
                    continue
                # "pid (command) state ppid ...": the command may contain spaces and ")".
                table.append((int(entry), int(stat.rsplit(b")", 1)[1].split()[1])))
        return table
    try:  # macOS and the BSDs have no /proc
        out = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [(int(a), int(b)) for a, b in (line.split() for line in out.splitlines()
                                          if len(line.split()) == 2)]


def _signal_tree(proc: subprocess.Popen, pids: set[int], sig: int) -> None:
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


class _Deadline(Exception):
    pass


class _JobState:
    """What the launcher knows about one job: results, failure records, end marks seen."""

    def __init__(self, job_id: int):
        self.job_id = job_id
        self.results: dict[int, bytes] = {}
        self.failures: dict[int, Failure] = {}  # in the order they were noticed
        self.ready: set[int] = set()
        self.stacks: dict[int, StackReport] = {}  # where each rank was, asked at a timeout
        self.collectives: dict[int, int | None] = {}  # how many collectives a finished rank made
        self.marks: set = set()
        self.eofs: set = set()
        self.sent = False  # has the job been sent (the ranks are past start-up)?
        self.stderr_tail = collections.defaultdict(lambda: collections.deque(maxlen=12))

    def fail(self, failure: Failure) -> None:
        if failure.rank not in self.failures:
            self.failures[failure.rank] = failure

    def on_message(self, rank: int, message: object) -> None:
        if getattr(message, "job_id", None) != self.job_id:
            return  # a late message from an earlier job
        if isinstance(message, Finished):
            self.results[rank] = message.result
            self.collectives[rank] = message.collectives
        elif isinstance(message, Raised):
            self.fail(Failure(
                rank, "raised", exc_type=message.exc_type, message=message.message,
                traceback=_with_cell_labels(message.traceback), exit_code=message.exit_code,
                lost_peer=message.lost_peer, exception=message.exception,
            ))
        elif isinstance(message, Ready):
            self.ready.add(rank)
        elif isinstance(message, StackReport):
            self.stacks[rank] = message

    def output_complete(self, ranks: Iterable[int]) -> bool:
        return all(
            (r, s, self.job_id) in self.marks or (r, s) in self.eofs
            for r in ranks for s in ("stdout", "stderr")
        )
