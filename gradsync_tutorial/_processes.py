"""The worker processes behind :func:`gradsync_tutorial.launch`, seen from the launcher.

:class:`_Workers` starts ``world_size`` fresh interpreters (``python -m
gradsync_tutorial._worker``) and accepts their token-authenticated connections. It forwards
every line they print into the calling cell as ``[rank r] ...``, collects their messages into a
:class:`_JobState`, and stops them (their whole process group: SIGTERM, then SIGKILL). The
launcher waits for everything through one loop, :meth:`_Workers.pump`, so output keeps flowing
while it waits.
"""

from __future__ import annotations

import collections
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

from ._messages import Finished, Raised, Ready, StackReport
from ._worker import END_MARK
from .launch_errors import Failure, _with_cell_labels

GRACE_SECONDS = 1.0  # between SIGTERM and SIGKILL when stopping ranks
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
        self.events: queue.Queue = queue.Queue()
        self.conns: list[Connection | None] = [None] * world_size
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.tokens = [secrets.token_bytes(TOKEN_BYTES) for _ in range(world_size)]
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.setblocking(False)
        self.job_id = 0
        self.show: set[int] = set(range(world_size))
        host, port = self.server.getsockname()[:2]
        env = dict(os.environ, PYTHONUNBUFFERED="1", GRADSYNC_CONTROL=f"{host}:{port}")
        for rank in range(world_size):
            env["GRADSYNC_TOKEN"] = self.tokens[rank].hex()
            kwargs: dict[str, Any] = {}
            if os.name == "posix":
                kwargs["start_new_session"] = True  # own process group: we stop it whole
            else:
                kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
            proc = subprocess.Popen(
                [sys.executable, "-m", "gradsync_tutorial._worker"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env, **kwargs,
            )
            self.procs.append(proc)
            for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                self._thread(self._read_lines, rank, name, pipe)

    def _thread(self, target, *args):
        t = threading.Thread(target=target, args=args, daemon=True, name="gradsync-reader")
        t.start()
        self.threads.append(t)

    def _read_lines(self, rank, stream, pipe):
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            text = text.rsplit("\r", 1)[-1]  # a progress bar redrawn with \r: its last state
            if text.startswith(END_MARK):
                self.events.put(("mark", rank, stream, int(text.split()[-1])))
            else:
                self.events.put(("line", rank, stream, text))
        self.events.put(("eof", rank, stream, None))

    def _read_messages(self, rank, conn):
        try:
            while True:
                self.events.put(("msg", rank, None, conn.recv()))
        except (EOFError, OSError):
            self.events.put(("closed", rank, None, None))

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
        """Print a worker's line, or record a message, an end mark or an EOF (wait <= 10 ms)."""
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
        elif kind == "msg":
            state.on_message(rank, value)

    def send(self, rank: int, message: object) -> None:
        try:
            self.conns[rank].send(message)
        except OSError:
            pass  # it died: the pump sees the exit and reports it

    def stop(self) -> None:
        """Stop every worker (SIGTERM to its process group, SIGKILL after a grace period)."""
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        end = time.monotonic() + GRACE_SECONDS
        for proc in self.procs:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            _signal_group(proc, getattr(signal, "SIGKILL", signal.SIGTERM))
            proc.wait()
        self.close()

    def close(self) -> None:
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.server.close()
        for t in self.threads:
            t.join(timeout=1)
        for proc in self.procs:
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the worker and anything it started (its data-loader workers, say)."""
    if proc.poll() is not None and os.name != "posix":
        return
    try:
        if os.name == "posix":
            os.killpg(proc.pid, sig)
        elif sig == signal.SIGTERM:
            proc.terminate()
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError, OSError):
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
        self.stacks: dict[int, StackReport] = {}
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
