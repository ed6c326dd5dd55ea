"""What a failed launch tells you: the errors :func:`gradsync_tutorial.launch` raises.

Every failure names a rank and says what to do: a rank that raised (its traceback, with the
notebook cell's source lines put back), a rank whose process died (its signal or exit code, and
its last lines on stderr), or a hang (the ranks that had not finished, and the usual cause).

    >>> import gradsync_tutorial as gst
    >>> issubclass(gst.RankFailedError, gst.LaunchError)
    True
    >>> issubclass(gst.LaunchTimeoutError, TimeoutError)  # except TimeoutError catches it
    True
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .._wording import ranks as _ranks
from ..device import gpu_count
from .hang_report import HANG_HINT, SLOW_HINT

__all__ = ["HANG_HINT", "Failure", "LaunchError", "LaunchTimeoutError", "RankFailedError"]


#: How a rank failed: see :class:`Failure`.
FailureKind = Literal["raised", "exited", "killed", "result", "timeout"]


@dataclass
class Failure:
    """What happened to one rank: a record, formatted only when an error is raised.

    ``kind`` is ``"raised"`` (``fn`` raised ``exc_type``; ``message`` and ``traceback`` are
    its text), ``"exited"`` (the process ended with ``exit_code`` before returning),
    ``"killed"`` (the process was killed by ``signal``), ``"result"`` (``fn`` returned, but its
    value could not be rebuilt in the notebook: ``exc_type`` and ``message`` say why), or
    ``"timeout"`` (still running at the launch's timeout). ``lost_peer``: the rank failed
    inside torch.distributed because a peer's connection closed -- usually a *consequence* of
    another rank's failure. ``stderr_tail``: the rank's last lines on stderr.

        >>> from gradsync_tutorial.launcher.errors import Failure
        >>> str(Failure(1, "exited", exit_code=3))
        'rank 1 exited with code 3 before returning a result'
    """

    rank: int
    kind: FailureKind
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exit_code: int | None = None
    signal: str | None = None
    stderr_tail: tuple[str, ...] = ()
    lost_peer: bool = False
    during_startup: bool = False
    exception: bytes | None = field(default=None, repr=False)  # cloudpickled, if rebuildable

    def summary(self) -> str:
        """One line (or a few): who failed and how; C++ frame dumps folded away."""
        if self.kind == "raised" and self.exc_type == "SystemExit":
            return (f"rank {self.rank} called sys.exit({self.message}): exit code "
                    f"{self.exit_code}, which counts as a failure (as under torchrun; "
                    "sys.exit() or sys.exit(0) counts as success)")
        if self.kind == "raised":
            return f"rank {self.rank} raised {self.exc_type}: {_fold_cpp_frames(self.message)}"
        if self.kind == "killed":
            why = (" (SIGKILL usually means the machine ran out of memory and the kernel's OOM "
                   "killer stopped it)" if self.signal == "SIGKILL" else "")
            return f"rank {self.rank} was killed by {self.signal} before returning a result{why}"
        if self.kind == "result":
            return (f"rank {self.rank}'s return value could not be rebuilt in the notebook: "
                    f"{self.exc_type}: {self.message}. Return values are unpickled here, so "
                    "every class in them must be importable here: return tensors, numbers, "
                    "strings, lists or dicts (model.state_dict() for a model), or make the "
                    "module that defines the class importable from the notebook too")
        if self.kind == "exited":
            return f"rank {self.rank} exited with code {self.exit_code} before returning a result"
        return f"rank {self.rank} did not finish"

    __str__ = summary


def exit_failure(rank: int, returncode: int, started: bool) -> Failure:
    """The record for a rank whose process ended without a result (``returncode`` < 0: signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return Failure(rank, "killed", signal=name, during_startup=not started)
    return Failure(rank, "exited", exit_code=returncode, during_startup=not started)


class LaunchError(RuntimeError):
    """A launch failed. ``failures`` maps each failed rank to its :class:`Failure` record."""

    def __init__(self, message: str, failures: dict[int, Failure] | None = None):
        super().__init__(message)
        self.failures = failures or {}


class RankFailedError(LaunchError):
    """A rank raised an exception, or its process died before returning.

    ``rank`` is the rank blamed (the first to fail other than as a consequence); ``failure``
    is its :class:`Failure` record; ``exc_type`` and ``traceback`` are its exception's type
    name and formatted traceback (empty for a dead process); ``exception`` is that exception,
    rebuilt in the notebook (None if it cannot be, or for a dead process). It is not chained as
    ``__cause__``: its traceback is in the message already, and a chained copy showed it twice.
    """

    def __init__(self, message: str, failures: dict[int, Failure], rank: int,
                 exception: BaseException | None = None):
        super().__init__(message, failures)
        self.rank = rank
        self.exception = exception

    @property
    def failure(self) -> Failure:
        return self.failures[self.rank]

    @property
    def exc_type(self) -> str:
        return self.failure.exc_type

    @property
    def traceback(self) -> str:
        return self.failure.traceback


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The launch ran past its ``timeout``; ``unfinished`` lists the ranks still running.

    ``report`` says where each unfinished rank was, when their stacks could be read.
    """

    def __init__(self, message: str, unfinished: list[int], report: str = ""):
        super().__init__(message, {r: Failure(r, "timeout") for r in unfinished})
        self.unfinished = unfinished
        self.report = report


def timeout_error(world_size: int, finished: Iterable[int], timeout: float, startup: float,
                  started: bool, report: str = "", early: float | None = None
                  ) -> LaunchTimeoutError:
    """The error for a launch past its time: the ranks that had not finished, where each rank
    was and the advice that fits (``report``, from
    :mod:`~gradsync_tutorial.launcher.hang_report`), else the usual cause: each idea once.

    ``started``: every worker had started (else the start-up took longer than ``startup``).

        >>> print(timeout_error(2, finished=[1], timeout=5, startup=60, started=True))
        launch timed out after 5 s: rank 0 had not finished (rank 1 returned). All ranks ...
        The usual causes are a branch that not every rank takes ...
    """
    finished = sorted(set(finished))
    unfinished = [r for r in range(world_size) if r not in finished]
    if not started:
        return LaunchTimeoutError(
            f"the {world_size} worker processes did not start within {startup:g} s (each one "
            "imports torch, which a busy machine or an antivirus can slow down a lot). Start-up "
            "gets max(timeout, STARTUP_SECONDS): pass a larger timeout= to wait longer.",
            unfinished,
        )
    done = f" ({_ranks(finished)} returned)" if finished else ""
    # The report ends with its own advice, fitted to where the ranks were.
    where = f"\nWhere each rank was:\n{_indent(report)}" if report else f"\n{HANG_HINT} {SLOW_HINT}"
    if early is not None:  # a rank that returned leaves another waiting: it can never finish
        return LaunchTimeoutError(
            f"launch stopped after {early:.1f} s, before its timeout ({timeout:g} s): "
            f"{_ranks(unfinished)} had not finished{done}, and never will. All ranks were "
            f"stopped.{where}",
            unfinished, report,
        )
    return LaunchTimeoutError(
        f"launch timed out after {timeout:g} s: {_ranks(unfinished)} had not finished{done}. "
        f"All ranks were stopped.{where}",
        unfinished, report,
    )


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _blame(failures: Sequence[Failure]) -> Failure:
    """The rank to blame: the first to fail other than by losing a peer, else the first.

    ``failures`` in the order they were noticed. Decided from the records' fields only.
    """
    return next((f for f in failures if not f.lost_peer), failures[0])


def rank_failed_error(failures: Sequence[Failure], started: bool) -> RankFailedError:
    """The error to raise, formatted once from the records (``failures`` in order noticed).

    Its ``exception`` is the blamed rank's own exception when the notebook can rebuild it.
    """
    first = _blame(failures)
    # Lead with the blamed rank: ranks failing just after it often fail *because* of it
    # (their peer's socket closed under a collective), and those get a note saying so.
    others = "".join(
        f"\n  {f.summary()}" + (" (a consequence: a peer went away)" if f.lost_peer else "")
        for f in failures if f is not first
    )
    others = f"\nOther ranks failed after it:{others}" if others else ""
    by_rank = {f.rank: f for f in failures}
    if first.kind == "raised":
        hint = _hint(first)
        message = (f"{first.summary()}\nAll ranks were stopped.{others}{hint}"
                   f"\n\nTraceback from rank {first.rank}:\n{first.traceback}")
        return RankFailedError(message, by_rank, first.rank, _rebuild(first.exception))
    if first.kind == "result":  # every rank finished; nothing to stop
        return RankFailedError(f"{first.summary()}.", by_rank, first.rank)
    when = "" if started else " while starting up, before running fn (its output is above)"
    tail = "".join(f"\n  {line}" for line in first.stderr_tail)
    tail = f"\nIts last lines on stderr:{tail}" if tail else ""
    message = f"{first.summary()}{when}.\nAll ranks were stopped.{others}{tail}"
    return RankFailedError(message, by_rank, first.rank)


# What to do about errors a learner meets when bringing code from elsewhere: (pattern found in
# "ExcType: message", what to add). The first that matches is added.
_HINTS = (
    (r"restart (your|the) (runtime|kernel|session|python|interpreter)",
     "\nIn gst.launch the runtime to restart is each rank's worker process, not this notebook's "
     "kernel: gst.shutdown_workers() stops the workers kept for the next launch, and "
     "gst.launch(..., reuse_workers=False) gives every launch fresh ones. (A library's state "
     "set earlier in this same launch needs the code changed: create it once per rank.)"),
    (r"^EOFError: EOF when reading a line",
     "\nThe ranks have no standard input (under torchrun too, they share one terminal): "
     "input() in a rank cannot be answered. Ask in the notebook before launching, and pass "
     "the answer to the ranks with args=(value,)."),
    (r"Too many open files|\bEMFILE\b",
     "\nThe rank ran out of file descriptors: it may hold open as many as `ulimit -n` allows. "
     "Close what fn opens (`with open(...)`), or raise the limit before starting Jupyter "
     "(`ulimit -n 4096`); a resource.setrlimit in fn lowers it for that rank."),
    (r"PREMUL_SUM with Gloo",
     "\ngloo has no ReduceOp.PREMUL_SUM (nccl has it). FSDP2 sends it when a gradient divide "
     "factor is set (set_gradient_divide_factor, torchtitan's gradient_divide_factor): on gloo, "
     "also call set_force_sum_reduction_for_comms(True) on every FSDPModule, so that FSDP2 sums "
     "and divides by the factor itself (notebook 08). Code of your own: all_reduce with "
     "ReduceOp.SUM, then multiply by the factor."),
    (r"device_id parameter must be an accelerator",
     "\ntorch refuses device_id=torch.device('cpu') under torchrun too: pass device_id only "
     "with a GPU per rank (device_id=gst.local_device() when it is a CUDA device), or leave "
     "it out."),
)


def _hint(failure: Failure) -> str:
    """What to do about a few errors a learner meets when bringing code from elsewhere."""
    text = f"{failure.exc_type}: {failure.message}"
    for pattern, hint in _HINTS:
        if re.search(pattern, text, re.IGNORECASE):
            return hint
    if re.search(r"cuda|nccl|nvidia", text, re.IGNORECASE) and not gpu_count():
        return ("\nThis code expects a GPU (CUDA/NCCL) and this machine has none: put "
                "tensors and models on gst.local_device() (cuda:LOCAL_RANK with a "
                "GPU per rank, else the CPU) instead of .cuda() or f'cuda:{rank}', and use "
                "backend 'auto' (nccl with GPUs, gloo without), so the same code runs on both.")
    return ""


def _rebuild(pickled: bytes | None) -> BaseException | None:
    if pickled is None:
        return None
    try:
        import cloudpickle

        return cloudpickle.loads(pickled)
    except Exception:  # noqa: BLE001 - the message already has everything
        return None


_CPP_FRAME = re.compile(r"^\s*(frame #\d+:|Exception raised from |<omitting python frames>)")


def _fold_cpp_frames(text: str) -> str:
    """Replace a C++ stack dump (``frame #0: ...`` lines) by a one-line note."""
    lines = text.splitlines()
    kept = [line for line in lines if not _CPP_FRAME.match(line)]
    folded = len(lines) - len(kept)
    if not folded:
        return text
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept) + f" [{folded} lines of C++ stack folded]"
