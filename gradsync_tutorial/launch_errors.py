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

import linecache
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._processes import _JobState

__all__ = ["HANG_HINT", "LaunchError", "LaunchTimeoutError", "RankFailedError"]

HANG_HINT = (
    "The usual cause is a collective that not every rank called: a rank skipped it (for "
    "example inside `if rank == 0:`), or the ranks ran different numbers of steps (uneven "
    "data without drop_last). Every rank must make the same collective calls in the same "
    "order. If the work is only slow, pass a larger timeout=."
)


class LaunchError(RuntimeError):
    """A launch failed. ``failures`` maps each failed rank to what happened to it."""

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = failures or {}


class RankFailedError(LaunchError):
    """A rank raised an exception, or its process died before returning.

    ``rank`` is the rank that failed first; ``exc_type`` and ``traceback`` are its exception's
    type name and the worker's formatted traceback (empty for a dead process).
    """

    def __init__(self, message, failures, rank, exc_type="", traceback=""):
        super().__init__(message, failures)
        self.rank, self.exc_type, self.traceback = rank, exc_type, traceback


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The launch ran past its ``timeout``; ``unfinished`` lists the ranks still running."""

    def __init__(self, message, unfinished: list[int]):
        super().__init__(message, {r: "did not finish" for r in unfinished})
        self.unfinished = unfinished


def _timeout_error(state: _JobState, world_size: int, timeout: float, startup: float,
                   started: bool) -> LaunchTimeoutError:
    unfinished = [r for r in range(world_size) if r not in state.results]
    finished = [r for r in range(world_size) if r in state.results]
    if not started:
        return LaunchTimeoutError(
            f"the {world_size} worker processes did not start within {startup:g} s (each one "
            "imports torch, which a busy machine or an antivirus can slow down a lot). Start-up "
            "gets max(timeout, STARTUP_SECONDS): pass a larger timeout= to wait longer.",
            unfinished,
        )
    done = f" ({_ranks(finished)} returned)" if finished else ""
    return LaunchTimeoutError(
        f"launch timed out after {timeout:g} s: {_ranks(unfinished)} had not finished{done}. "
        f"All ranks were stopped. {HANG_HINT}",
        unfinished,
    )


def _failure(state: _JobState, first: int, sources: dict[str, str]) -> RankFailedError:
    """The error to raise; its ``__cause__`` is the rank's own exception when it unpickles."""
    # Lead with the rank that failed first: ranks failing just after it often fail *because*
    # of it (their peer's socket closed under a collective), and those get a note saying so.
    others = ""
    for rank in state.order:
        if rank != first:
            note = " (a consequence: a peer went away)" if _collateral(state, rank) else ""
            others += f"\n  {state.failures[rank]}{note}"
    others = f"\nOther ranks failed after it:{others}" if others else ""
    if first in state.errors:
        exc_type, text, tb, pickled = state.errors[first]
        tb = _with_source_lines(tb, sources)
        message = (f"rank {first} raised {exc_type}: {text}\nAll ranks were stopped.{others}"
                   f"\n\nTraceback from rank {first}:\n{tb}")
        error = RankFailedError(message, dict(state.failures), first, exc_type, tb)
        cause = None
        if pickled is not None:
            try:
                import cloudpickle

                cause = cloudpickle.loads(pickled)
            except Exception:  # noqa: BLE001 - the message already has everything
                cause = None
        error.__cause__ = cause
        return error
    when = "" if state.sent else " while starting up, before running fn (its output is above)"
    tail = "".join(f"\n  {line}" for line in state.stderr_tail[first])
    tail = f"\nIts last lines on stderr:{tail}" if tail else ""
    message = f"{state.failures[first]}{when}.\nAll ranks were stopped.{others}{tail}"
    return RankFailedError(message, dict(state.failures), first)


def _root_cause(state: _JobState) -> int:
    """The rank to blame: the first to fail other than by losing a peer, else the first."""
    return next((r for r in state.order if not _collateral(state, r)), state.order[0])


def _collateral(state: _JobState, rank: int) -> bool:
    """Did this rank fail on a connection its peer closed (gloo's and nccl's wording)?"""
    text = state.failures[rank].lower()
    return any(w in text for w in ("connection reset", "connection closed", "broken pipe",
                                   "remote process exited", "peer", "read error"))


def _source_files(fn, args: Sequence[Any] = ()) -> dict[str, str]:
    """Map function name -> source file for ``fn``, the functions it uses and those in ``args``.

    cloudpickle renames the code it ships ``<dynamic-code>``; with this map the launcher
    puts the notebook cell's file name and source line back into a worker's traceback.
    """
    files: dict[str, str] = {}
    seen: set[int] = set()

    def visit(obj, depth=0):
        code = getattr(obj, "__code__", None)
        if code is None or id(code) in seen or depth > 3:
            return
        seen.add(id(code))
        stack = [code]
        while stack:
            c = stack.pop()
            files.setdefault(c.co_name, c.co_filename)
            stack.extend(k for k in c.co_consts if hasattr(k, "co_filename"))
        for name in code.co_names:
            visit(getattr(obj, "__globals__", {}).get(name), depth + 1)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                visit(cell.cell_contents, depth + 1)
            except ValueError:  # empty cell
                pass

    visit(fn)
    for arg in args:  # functions passed in args (an averaging function, say)
        visit(arg)
    return files


def _with_source_lines(tb: str, sources: dict[str, str]) -> str:
    def fix(match):
        line, name = int(match.group(1)), match.group(2)
        path = sources.get(name)
        if path is None:
            return match.group(0)
        text = linecache.getline(path, line).strip()
        return f"{_file_label(path)}, line {line}, in {name}" + (f"\n    {text}" if text else "")

    return re.sub(r'File "<dynamic-code>", line (\d+), in (\S+)', fix, tb)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


def _file_label(path: str) -> str:
    """``Cell In[3]`` for a notebook cell, as IPython names it (its file is a temporary path of
    the kernel's), else ``File "path"``."""
    try:
        from IPython import get_ipython

        label = get_ipython().compile.format_code_name(path)
    except Exception:  # noqa: BLE001 - no IPython, or not a cell: the plain form
        label = None
    return f"{label[0]} {label[1]}" if label else f'File "{path}"'
