"""What the launcher and a worker say to each other: one small class per message, and the
names both sides must agree on (the worker's module, its variables, the end-of-job mark).

The launcher (:mod:`gradsync_tutorial.launcher.pool`) and each worker
(:mod:`gradsync_tutorial.launcher.worker`) exchange these over a
:class:`multiprocessing.connection.Connection`, which pickles them. Both sides import this
module, so it imports nothing heavy (no torch).

    >>> from gradsync_tutorial.launcher.protocol import Finished
    >>> Finished(job_id=1, result=b"...").job_id
    1

Launcher -> worker: :class:`Job`, :class:`Teardown`, :class:`StackRequest`.
Worker -> launcher: :class:`Finished`, :class:`Raised`, :class:`Ready`, :class:`StackReport`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

#: What the launcher runs for each rank, ``python -m WORKER_MODULE`` (tests look for it too).
WORKER_MODULE = "gradsync_tutorial.launcher.worker"

# How a worker finds the launcher: the variables the launcher starts it with.
CONTROL_ENV = "GRADSYNC_CONTROL"  # host:port of the launcher's socket
TOKEN_ENV = "GRADSYNC_TOKEN"  # the secret the worker proves itself with, hex
END_MARK_ENV = "GRADSYNC_END_MARK"  # END_MARK with a secret of the worker's own appended
PARENT_ENV = "GRADSYNC_PARENT"  # the pid that started the worker: gone already, it stops
# The launcher's own variables for a worker (where to connect, its token): never passed on to
# a job. Every other variable of the notebook's environment reaches the ranks (GRADSYNC_DATA...).
PRIVATE_ENV = (CONTROL_ENV, TOKEN_ENV)

#: Written on stdout and stderr after each job, with the job's id, so the launcher knows it has
#: every line. Each worker's mark carries a secret (END_MARK_ENV), so no line fn prints can pass
#: for it.
END_MARK = "\x1egradsync-end-of-job"


@dataclass(frozen=True)
class JobMessage:
    """Every message names the job it belongs to: a late message from an earlier job (a rank
    that answered after a timeout, say) is recognised and dropped."""

    job_id: int


# -- launcher -> worker ------------------------------------------------------------------------


@dataclass(frozen=True)
class Job(JobMessage):
    """Run ``fn(rank, world_size, *args)`` once; ``payload`` is ``cloudpickle((fn, args))``."""

    payload: bytes
    env: dict[str, str]  # the notebook's environment plus torchrun's variables
    cwd: str
    sys_path: list[str]
    backend: str
    device: str
    num_threads: int
    collective_timeout: float
    sources: dict[str, list[str]] = field(default_factory=dict)  # cell file -> its lines
    # The level the notebook's logging shows (a cell's logging.basicConfig(level=logging.INFO)),
    # read where the Job is made, in the notebook: a rank whose own logging drops records the
    # notebook would show says why.
    notebook_log_level: int = field(default_factory=lambda: _shown_level(logging.getLogger()))


def _shown_level(root: logging.Logger) -> int:
    """The lowest level ``root`` shows: its own, when it has a handler; else WARNING's."""
    return root.level if root.handlers and root.level else logging.WARNING


class Teardown(JobMessage):
    """The job is over on every rank: destroy the process group, then say :class:`Ready`."""


class StackRequest(JobMessage):
    """Report where the job's main thread is (:class:`StackReport`): at a timeout, or while a
    rank that returned may leave another waiting in a collective."""


# -- worker -> launcher ------------------------------------------------------------------------


@dataclass(frozen=True)
class Finished(JobMessage):
    """``fn`` returned; ``result`` is its return value, cloudpickled."""

    result: bytes
    collectives: int | None = None  # how many collective calls fn made
    # What the job imported that a fresh interpreter would not have (a library that keeps
    # process-wide state, a module of the user's own): the launcher retires these workers.
    imported: tuple[str, ...] = ()
    # What the job did that no reset undoes, in words ("fn called torch.set_num_interop_threads,
    # which a process can call only once"): the launcher retires these workers too.
    retire: tuple[str, ...] = ()
    # What the notebook should be told about the result (a DTensor sent as its local tensor):
    # the launcher prints each note once, naming the ranks whose result it is about.
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Raised(JobMessage):
    """``fn`` raised (or its result could not be sent back).

    ``lost_peer``: the exception came out of torch.distributed because a peer's connection
    closed, so this rank most likely failed as a *consequence* of another rank's failure.
    ``exit_code``: set when ``fn`` called ``sys.exit(code)`` with a non-zero code.
    """

    exc_type: str
    message: str
    traceback: str
    exception: bytes | None  # the exception, cloudpickled, when the notebook can rebuild it
    lost_peer: bool = False
    exit_code: int | None = None


class Ready(JobMessage):
    """The worker tore the job's process group down and waits for the next job."""


@dataclass(frozen=True)
class Frame:
    """One frame of the rank's own code: file, line, function, and the source line."""

    filename: str
    lineno: int
    name: str
    line: str


@dataclass(frozen=True)
class StackReport(JobMessage):
    """Where a rank's job was when the launcher asked.

    ``frames``: the rank's own frames, outermost first (the launcher's and torch's left out).
    ``waiting_in``: the collective or send/recv it is blocked in below its own code (for
    example ``"dist.all_reduce"``), or ``""``. ``collectives``: how many collective calls it
    had entered so far, ``None`` if unknown. ``peers``: the ranks the call it waits in waits
    for (its group, or the peer of a send/recv), ``None`` if unknown or none. ``error``: why
    the stack could not be read, if it could not.
    """

    frames: tuple[Frame, ...]
    waiting_in: str
    collectives: int | None
    peers: tuple[int, ...] | None = None
    error: str = ""
    inside: str = ""  # the torch.distributed call it is busy in when it waits in no collective
