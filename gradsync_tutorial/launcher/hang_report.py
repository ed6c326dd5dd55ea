"""Where each rank is when a launch times out, and which rank the others wait for.

The most common bug in distributed code is a collective that not every rank calls. At the
timeout, before stopping the ranks, the launcher asks each unfinished rank for a
:class:`~gradsync_tutorial.launcher.protocol.StackReport`: its own frames (the notebook's code, not
torch's or the launcher's), the ``torch.distributed`` call it is blocked in, and how many
collectives it had entered (counted by :class:`gradsync_tutorial.detect.CollectiveCounter`).
:func:`describe` turns the reports into the paragraph a :class:`LaunchTimeoutError` shows::

    rank 0 is waiting in dist.all_reduce, its 3rd collective, at Cell In[4], line 6, in train
    rank 1 is at Cell In[4], line 9, in train (`time.sleep(100)`), after 2 collectives
    rank 1 never reached the collective rank 0 is waiting in (dist.all_reduce, its 3rd).

A rank busy in native code that holds Python's GIL cannot answer; the report says so.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from collections.abc import Iterable

from .._wording import plural, ranks
from .protocol import Frame, StackReport

STACK_SECONDS = 1.0  # how long the launcher waits for the ranks' stacks at a timeout

# Files that are not the rank's own code: Python's, installed packages' (torch), this package's.
_NOT_OWN = tuple(
    os.path.join(os.path.realpath(p), "")
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # the whole package
)


def _own(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    return not os.path.realpath(filename).startswith(_NOT_OWN)


def stack_report(job_id: int, thread_id: int, collectives: int | None) -> StackReport:
    """Worker side: where the thread ``thread_id`` (the one running ``fn``) is now."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return StackReport(job_id, (), "", collectives)
    frames = list(traceback.walk_stack(frame))[::-1]  # outermost first
    summary = traceback.StackSummary.extract(((f, n) for f, n in frames), lookup_lines=True)
    own_at = [i for i, fs in enumerate(summary) if _own(fs.filename)]
    own = tuple(Frame(fs.filename, fs.lineno or 0, fs.name, (fs.line or "").strip())
                for i, fs in enumerate(summary) if i in own_at)
    waiting_in = ""
    below = range(own_at[-1] + 1 if own_at else 0, len(frames))
    for i in below:
        f = frames[i][0]
        path = f.f_code.co_filename.replace(os.sep, "/")
        if "torch/distributed/" in path and f.f_code.co_name not in ("wrapper", "<lambda>"):
            waiting_in = f"dist.{f.f_code.co_name}"
            if f.f_code.co_name == "init_process_group":
                waiting_in += _rendezvous(f.f_locals)
            break
    return StackReport(job_id, own, waiting_in, collectives)


def _rendezvous(local_vars: dict) -> str:
    """`` (its rendezvous at tcp://host:port)`` for a rank stuck in init_process_group."""
    method, store = local_vars.get("init_method"), local_vars.get("store")
    if store is not None and method is None:
        return " (its rendezvous through a store it was given)"
    if method in (None, "env://"):
        method = (f"env:// MASTER_ADDR={os.environ.get('MASTER_ADDR')} "
                  f"MASTER_PORT={os.environ.get('MASTER_PORT')}")
    return f" (its rendezvous at {method})"


# -- launcher side ------------------------------------------------------------------------------


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _collectives(n: int | None) -> str:
    return "an unknown number of collectives" if n is None else plural(n, "collective")


def _place(frame: Frame, label) -> str:
    line = f" (`{frame.line}`)" if frame.line else ""
    return f"{label(frame.filename)}, line {frame.lineno}, in {frame.name}{line}"


def describe(world_size: int, reports: dict[int, StackReport], finished: dict[int, int | None],
             label=lambda path: f'File "{path}"') -> str:
    """Launcher side: one line per rank, then which rank the others wait for.

    ``reports``: the unfinished ranks that answered; ``finished``: rank -> its number of
    collectives, for the ranks that returned. ``label`` names a file (``Cell In[3]``).
    """
    lines, waiting, behind = [], {}, {}
    init_waits = []
    for rank in range(world_size):
        if rank in finished:
            lines.append(f"rank {rank} returned, after {_collectives(finished[rank])}")
            behind[rank] = finished[rank]
            continue
        report = reports.get(rank)
        if report is None:
            lines.append(f"rank {rank}: its stack could not be read within {STACK_SECONDS:g} s: "
                         "it is busy in native (C/C++) code that holds Python's GIL, or stuck "
                         "there")
            behind[rank] = None
            continue
        where = f", at {_place(report.frames[-1], label)}" if report.frames else ""
        if report.waiting_in.startswith("dist.init_process_group"):
            lines.append(f"rank {rank} is waiting in {report.waiting_in}{where}")
            init_waits.append(rank)
        elif report.waiting_in:
            n = report.collectives
            nth = f", its {_ordinal(n)} collective" if n else ""
            lines.append(f"rank {rank} is waiting in {report.waiting_in}{nth}{where}")
            waiting[rank] = (report.waiting_in, n)
        else:
            place = _place(report.frames[-1], label) if report.frames else "code of its own"
            lines.append(f"rank {rank} is at {place}, after {_collectives(report.collectives)}")
            behind[rank] = report.collectives
    return "\n".join(lines + _diagnosis(waiting, behind, init_waits))


def _diagnosis(waiting: dict[int, tuple[str, int | None]], behind: dict[int, int | None],
               init_waits: Iterable[int]) -> list[str]:
    out = []
    init_waits = list(init_waits)
    if init_waits:
        out.append(f"{ranks(init_waits)} never finished init_process_group: no process answers "
                   "at that rendezvous address, or not every rank joined it (each rank must "
                   "call init_process_group with the same address and world_size).")
    if not waiting:
        return out
    calls = set(waiting.values())
    if len(calls) > 1:
        each = "; ".join(f"rank {r} in {name}" + (f" (its {_ordinal(n)})" if n else "")
                         for r, (name, n) in waiting.items())
        out.append(f"The ranks wait in different collectives: {each}. Every rank must make the "
                   "same collective calls in the same order.")
        return out
    (name, n), = calls
    target = f"{name}, its {_ordinal(n)}" if n else name
    waiters = ranks(waiting)
    for rank, count in behind.items():
        if count is None or n is None or count < n:
            verb = "has not reached" if count is None else "never reached"
            out.append(f"rank {rank} {verb} the collective {waiters} "
                       f"{'is' if len(waiting) == 1 else 'are'} waiting in ({target}).")
    if not behind:
        out.append(f"Every rank is waiting in {target}: check that they pass tensors of the same "
                   "shape and dtype; if the work is only slow, pass a larger timeout=.")
    return out
