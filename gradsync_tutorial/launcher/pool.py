"""The pool: the worker processes of a launch, seen from the launcher, and what it knows of a job.

:class:`Workers` starts ``world_size`` fresh worker processes (:func:`start_worker`: on Linux
forks of the template that imported torch, :mod:`.template`; elsewhere ``python -m
gradsync_tutorial.launcher.worker``) and accepts their token-authenticated connections. It
forwards every line they print into the calling cell as ``[rank r] ...``, records their messages
in a :class:`JobState` (results, and failure records formatted only when an error is raised),
and stops them, each rank with every process below it (:mod:`.process_tree`). The launcher
drives a job through a few steps -- :meth:`~Workers.new_job`,
:meth:`~Workers.wait_until_started`, :meth:`~Workers.run`, :meth:`~Workers.tear_down`, and on a
failure :meth:`~Workers.stop_after_failure` or :meth:`~Workers.where_each_rank_is` -- and each
step waits through one loop, :meth:`Workers.pump`, so output keeps flowing while it waits;
results are judged apart from output, so a rank that printed a lot is not taken for a rank still
running. The state sits beside the pump that feeds it: split into a module of its own, every
step of a launch went back and forth between the two.

Nothing here ever blocks on a pipe: a rank's child can inherit the rank's stdout and keep it
open after the rank is gone, so each reader thread owns its pipe and closes it at end of file,
and stopping only waits a bounded time for the readers.

Part of ``gst.launch`` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import collections
import errno
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection

from . import hang_report, spawner, template
from .cells import file_label, with_cell_labels
from .errors import Failure, RankFailedError, exit_failure, rank_failed_error
from .preflight import DESCRIPTOR_ADVICE
from .process_tree import popen_kwargs, stop_trees
from .protocol import (
    CONTROL_ENV,
    END_MARK,
    END_MARK_ENV,
    PARENT_ENV,
    TOKEN_ENV,
    WORKER_MODULE,
    Finished,
    Job,
    Raised,
    Ready,
    StackReport,
    StackRequest,
    Teardown,
)

READER_JOIN_SECONDS = 2.0  # how long stopping waits for the output readers, all together
TOKEN_BYTES = 16


class JobState:
    """What the launcher knows about one job: results, failure records, end marks seen.

        >>> state = JobState(job_id=1)
        >>> state.on_message(1, Raised(1, "ValueError", "bad", "Traceback ...", None))
        >>> state.failures[1].summary()
        'rank 1 raised ValueError: bad'
    """

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
        # Libraries the job imported that may keep process-wide state: retire these workers.
        self.imported: set[str] = set()
        self.retire: set[str] = set()  # what else the job did that no reset undoes
        self.notes: dict[str, list[int]] = {}  # a note about a rank's result -> its ranks

    @property
    def retiring(self) -> bool:
        """Must these workers be retired after the job (not given back to the idle pool)?"""
        return bool(self.imported or self.retire)

    def fail(self, failure: Failure) -> None:
        if failure.rank not in self.failures:
            self.failures[failure.rank] = failure

    def on_message(self, rank: int, message: object) -> None:
        if getattr(message, "job_id", None) != self.job_id:
            return  # a late message from an earlier job
        if isinstance(message, Finished):
            self.results[rank] = message.result
            self.collectives[rank] = message.collectives
            self.imported.update(message.imported)
            self.retire.update(message.retire)
            for note in message.notes:
                self.notes.setdefault(note, []).append(rank)
        elif isinstance(message, Raised):
            self.fail(Failure(
                rank, "raised", exc_type=message.exc_type, message=message.message,
                traceback=with_cell_labels(message.traceback), exit_code=message.exit_code,
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

    def rebuilt_results(self, world_size: int) -> tuple[list, RankFailedError | None]:
        """The ranks' return values in rank order, or the error naming the rank whose value
        cannot be rebuilt here (a class only the worker could import, say)."""
        import cloudpickle

        results = []
        for rank in range(world_size):
            try:
                results.append(cloudpickle.loads(self.results[rank]))
            except Exception as e:  # noqa: BLE001 - a class only the worker could import, say
                failure = Failure(rank, "result", exc_type=type(e).__name__, message=str(e))
                return [], rank_failed_error([failure], started=True)
        return results, None


class Deadline(Exception):
    """A step's deadline passed (the launch timed out, or the workers did not start)."""


class WaitsForAReturnedRank(Exception):
    """A rank waits in a collective that a rank which returned is part of: it never ends."""


# After the first rank returns while others run on: how long until their stacks are first read,
# and the longest between two readings (the interval doubles from the first).
RETURNED_CHECK_SECONDS = 1.0
RETURNED_CHECK_MAX_SECONDS = 8.0
MAX_LINE_CHARS = 2_000  # of a stderr line kept for a failure's "last lines on stderr"


class _ReturnedRankWatch:
    """Tells, as soon as it is certain, that a rank which returned leaves another waiting.

    torchrun ends such a job in seconds (the returned rank's process exits and its peer's
    collective fails); a warm worker stays alive, so here the others' stacks are read: a rank
    found twice in a row in the same collective, of a group that a returned rank is part of,
    will never finish (:func:`~gradsync_tutorial.launcher.hang_report.waits_for_a_returned_rank`).
    """

    def __init__(self, workers: Workers, state: JobState):
        self.workers, self.state = workers, state
        self.next_at: float | None = None
        self.interval = RETURNED_CHECK_SECONDS
        self.previous: dict = {}
        self.certain = False

    def __call__(self) -> bool:
        state = self.state
        if not state.results or len(state.results) == self.workers.world_size:
            return False
        now = time.monotonic()
        if self.next_at is None:
            self.next_at = now + self.interval
        if now < self.next_at:
            return False
        unfinished = [r for r in range(self.workers.world_size) if r not in state.results]
        for rank in unfinished:
            state.stacks.pop(rank, None)
            self.workers.send(rank, StackRequest(state.job_id))
        self.workers.drain(state, lambda: state.failures or all(
            r in state.stacks or r in state.results for r in unfinished), hang_report.STACK_SECONDS)
        reports = {r: state.stacks[r] for r in unfinished
                   if r in state.stacks and r not in state.results}
        stuck = {r: (report.waiting_in, report.collectives) for r, report in reports.items()
                 if hang_report.waits_for_a_returned_rank({r: report}, state.results)}
        self.certain = bool(stuck) and all(self.previous.get(r) == where
                                           for r, where in stuck.items())
        self.previous = stuck
        # Found waiting once: look again soon to be sure; else less and less often.
        self.interval = min(self.interval * 2, RETURNED_CHECK_MAX_SECONDS)
        self.next_at = time.monotonic() + (RETURNED_CHECK_SECONDS if stuck else self.interval)
        return self.certain


def require_spare_descriptors(n: int, world_size: int) -> None:
    """Fail now, not after a wait, unless ``n`` more descriptors can be opened here: with
    :func:`out_of_descriptors`' advice for a launch of ``world_size`` ranks."""
    taken: list[int] = []
    try:
        taken.append(os.open(os.devnull, os.O_RDONLY))
        for _ in range(n - 1):
            taken.append(os.dup(taken[0]))  # (a dup is cheaper than an open)
    except OSError as e:
        if e.errno == errno.EMFILE:
            raise out_of_descriptors(world_size, e) from e
        raise
    finally:
        for fd in taken:
            os.close(fd)


def out_of_descriptors(world_size: int, error: OSError) -> OSError:
    """The error of a start that ran out of file descriptors, in this process, with the hint."""
    return OSError(error.errno, f"could not start {world_size} worker processes: this process "
                   "ran out of file descriptors (each rank holds several open). Use a smaller "
                   f"world_size, or {DESCRIPTOR_ADVICE}.")


#: Linux: fork each rank from a template that has imported torch (:mod:`.template`).
FORK_FROM_TEMPLATE = (sys.platform.startswith("linux")
                      and os.environ.get("GRADSYNC_FRESH_INTERPRETERS") != "1")


def start_worker(env: dict[str, str], rank: int):
    """Rank ``rank``'s worker process, with environment ``env``: forked from its template for
    this environment (Linux), else, or if the template cannot start, a fresh ``python -m``."""
    if FORK_FROM_TEMPLATE:
        try:
            return template.fork(env, os.getcwd(), rank)
        except template.TemplateGone:
            pass  # a fresh interpreter shows what went wrong, if it goes wrong again
    return spawner.start(lambda: subprocess.Popen(
        [sys.executable, "-m", WORKER_MODULE], stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **popen_kwargs()))


class Workers:
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
            try:
                self._start_all()
            except OSError as e:
                if e.errno == errno.EMFILE:
                    raise out_of_descriptors(world_size, e) from e
                raise
            # The descriptors the start-up needs next (each rank's connection back, its link
            # to the store), taken now: without them the first rank to connect back, after
            # its seconds of importing torch, would find none.
            require_spare_descriptors(2 * world_size, world_size)
        except BaseException:  # an interrupt between two starts, or too many open files
            self.stop_despite_interrupts()  # never leave the ranks already started running
            raise

    def _start_all(self) -> None:
        host, port = self.server.getsockname()[:2]
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   **{CONTROL_ENV: f"{host}:{port}", PARENT_ENV: str(os.getpid())})
        if FORK_FROM_TEMPLATE:
            template.start(env, os.getcwd(), range(self.world_size))
        for rank in range(self.world_size):
            env[TOKEN_ENV] = self.tokens[rank].hex()
            env[END_MARK_ENV] = self.marks[rank]
            proc = start_worker(dict(env), rank)
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
                # Wake the pump, which waits on the output queue: without it a result waited
                # up to 10 ms to be seen, twice a launch (the repeat launch's time doubled).
                self.events.put(("wake", rank, None, None))
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
            except OSError as e:  # EMFILE: what was spare at the start was taken since
                if e.errno == errno.EMFILE:
                    raise out_of_descriptors(self.world_size, e) from e
                raise
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

    # -- one job, step by step: what the launcher calls ----------------------------------------

    def new_job(self, show: Iterable[int] | None) -> JobState:
        """Number a new job on these workers; print only the ranks ``show`` (None: all)."""
        self.job_id += 1
        self.show = set(range(self.world_size) if show is None else show)
        return JobState(self.job_id)

    def wait_until_started(self, state: JobState, deadline: float) -> None:
        """Forward start-up output until every worker has connected back."""
        self.pump(state, deadline, lambda: all(self.conns))

    def run(self, state: JobState, jobs: Sequence[Job], deadline: float) -> None:
        """Send each rank its job; wait until every rank returned, one failed, or ``deadline``
        (:class:`Deadline`), or a rank is found waiting for good on one that returned
        (:class:`WaitsForAReturnedRank`). A rank that died while starting is a failure
        already: no job is sent (the launcher reports it as it reports a rank killed mid-job)."""
        if state.failures:
            return
        for rank, job in enumerate(jobs):
            self.send(rank, job)
        state.sent = True
        watch = _ReturnedRankWatch(self, state)
        self.pump(state, deadline, lambda: len(state.results) == self.world_size or watch())
        if watch.certain and not state.failures and len(state.results) < self.world_size:
            raise WaitsForAReturnedRank

    def tear_down(self, state: JobState, output_idle: float, seconds: float,
                  destroy_groups: bool = True) -> None:
        """Every rank returned: print the rest of their output (however long that takes), then
        destroy their process groups (``seconds``), leaving them ready for the next job."""
        self.drain_output(state, range(self.world_size), output_idle)
        if not destroy_groups:
            return
        for rank in range(self.world_size):
            self.send(rank, Teardown(state.job_id))
        self.pump(state, time.monotonic() + seconds, lambda: len(state.ready) == self.world_size)

    def stop_after_failure(self, state: JobState) -> RankFailedError:
        """A rank failed: let the others report, stop them all, return the error to raise."""
        world_size = self.world_size
        # Give the other ranks a moment to report errors of their own (an error raised on every
        # rank), then stop them all, and show what the failed ranks printed.
        try:
            self.drain(state, lambda: len(state.failures) == world_size, 0.05, note_exits=True)
            if all(f.lost_peer for f in state.failures.values()):
                # A rank lost its peer under a collective: the peer that went away is the story,
                # and its exit can be noticed a moment after the survivor's report. Wait for it.
                self.drain(state, lambda: not all(f.lost_peer for f in state.failures.values())
                           or len(state.failures) == world_size, 2.0, note_exits=True)
            self.drain(state, lambda: state.output_complete(state.failures), 0.5)
        finally:  # the stop button pressed while the failure is being reported included
            self.stop_despite_interrupts()
        self.drain(state, lambda: state.output_complete(range(world_size)), 1.0)
        for rank, failure in state.failures.items():
            failure.stderr_tail = tuple(state.stderr_tail[rank])
        return rank_failed_error(list(state.failures.values()), state.sent)

    def where_each_rank_is(self, state: JobState) -> str:
        """At a timeout, before stopping the ranks: ask each for its stack, say who waits for
        whom (:mod:`~gradsync_tutorial.launcher.hang_report`)."""
        unfinished = [r for r in range(self.world_size) if r not in state.results]
        for rank in unfinished:
            self.send(rank, StackRequest(state.job_id))
        self.drain(state, lambda: all(r in state.stacks or r in state.results
                                      for r in unfinished), hang_report.STACK_SECONDS)
        finished = {r: state.collectives.get(r) for r in state.results}
        return hang_report.describe(self.world_size, state.stacks, finished, file_label)

    # -- the pump: everything a step waits for goes through here -------------------------------

    def pump(self, state: JobState, deadline: float, done: Callable[[], bool]) -> None:
        """Forward output and collect messages until ``done()``, a failure, or the deadline."""
        while not done():
            if not all(self.conns):
                self._accept()
            self._handle_next_event(state)
            self._note_exits(state)
            if state.failures:
                return
            if time.monotonic() > deadline:
                raise Deadline

    def drain(self, state: JobState, until: Callable[[], bool], seconds: float,
              note_exits: bool = False) -> None:
        """Keep forwarding output for up to ``seconds`` until ``until()``; never raises.

        ``note_exits``: also record ranks whose process ended (only before we stop them).
        """
        end = time.monotonic() + seconds
        while not until() and time.monotonic() < end:
            self._handle_next_event(state)
            if note_exits:
                self._note_exits(state)

    def _note_exits(self, state: JobState) -> None:
        """A rank whose process ended without reporting a result or an error has failed."""
        for rank, proc in enumerate(self.procs):
            if rank not in state.results and rank not in state.failures:
                returncode = proc.poll()
                if returncode is not None:
                    state.fail(exit_failure(rank, returncode, state.sent))

    def _handle_next_event(self, state: JobState) -> None:
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
                state.stderr_tail[rank].append(value[:MAX_LINE_CHARS])
            if rank in self.show:
                print(f"[rank {rank}] {value}", file=getattr(sys, stream), flush=True)
        elif kind == "mark":
            state.marks.add((rank, stream, value))
        elif kind == "eof":
            state.eofs.add((rank, stream))

    def drain_output(self, state: JobState, ranks: Iterable[int], idle_seconds: float) -> None:
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
        conn = self.conns[rank]
        if conn is None:  # it died before connecting back: the pump sees the exit
            return
        try:
            conn.send(message)
        except OSError:
            pass  # it died: the pump sees the exit and reports it

    def stop(self) -> None:
        """Stop every worker and everything it started; never blocks on a pipe."""
        stop_trees(self.procs)
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
