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

import functools
import linecache
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterable

from .._wording import plural, ranks
from .protocol import Frame, StackReport

STACK_SECONDS = 1.0  # how long the launcher waits for the ranks' stacks at a timeout

MAX_FRAMES = 40  # a report keeps the rank's innermost own frames, at most this many


def _not_own_folders() -> tuple[str, ...]:
    """Folders whose files are not the rank's own code: Python's, installed packages' (torch,
    wherever it was installed from: a venv, a .pth file, PYTHONPATH), this package's."""
    import importlib.util
    import site

    folders = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    folders |= set(getattr(site, "getsitepackages", list)())
    folders |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")}
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        folders.add(os.path.dirname(os.path.dirname(spec.origin)))
    folders.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package
    return tuple(os.path.join(os.path.realpath(p), "") for p in folders if p)


_NOT_OWN = _not_own_folders()
_OWN_GROUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "own_group.py")


@functools.lru_cache(maxsize=4096)
def _own(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    return not os.path.realpath(filename).startswith(_NOT_OWN)


def stack_report(job_id: int, thread_id: int, collectives: int | None) -> StackReport:
    """Worker side: where the thread ``thread_id`` (the one running ``fn``) is now.

    Linear in the stack's depth (a deep recursion is read as fast as it is walked), and it
    reads source lines only for the frames it keeps.
    """
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return StackReport(job_id, (), "", collectives)
    stack = list(traceback.walk_stack(frame))  # (frame, line), innermost first
    own_at = [i for i, (f, _) in enumerate(stack) if _own(f.f_code.co_filename)]
    own = tuple(_frame(*stack[i]) for i in reversed(own_at[:MAX_FRAMES]))  # outermost first
    below = stack[:own_at[0]] if own_at else stack  # what the rank's own code called
    waiting_in, peers, inside = _blocked_in([f for f, _ in reversed(below)])
    return StackReport(job_id, own, waiting_in, collectives, peers, inside=inside)


def _frame(f, lineno: int) -> Frame:
    filename = f.f_code.co_filename
    return Frame(filename, lineno or 0, f.f_code.co_name,
                 linecache.getline(filename, lineno or 0, f.f_globals).strip())


_C10D = "torch/distributed/distributed_c10d.py"  # where every collective is defined
# torch.distributed's decorators: their frames name no call of the rank's.
_WRAPPERS = ("wrapper", "<lambda>", "inner_func", "inner", "_wrapper", "wrapped")


def _blocked_in(frames: list) -> tuple[str, tuple[int, ...] | None, str]:
    """The collective (or send/recv) the rank waits in among ``frames`` (outermost first), the
    ranks it waits for, and else the torch.distributed call it is inside.

    Only the calls :data:`~gradsync_tutorial.detect.COUNTED_FUNCTIONS` names, of
    ``distributed_c10d`` (not a method of the same name elsewhere), wait for peers;
    a rank inside any other function of torch.distributed (``new_group`` with
    ``use_local_synchronization=True``, ``dcp.save(..., no_dist=True)``) is busy, not waiting
    (third value). ``fn``'s own ``init_process_group`` runs through :mod:`.own_group`, which
    may wait in a barrier or a store of its own: the rank is waiting in it then.
    """
    from gradsync_tutorial.detect import COUNTED_FUNCTIONS

    inside = ""
    for f in frames:
        name = f.f_code.co_name
        if name == "init_process_group" and os.path.abspath(f.f_code.co_filename) == _OWN_GROUP:
            return f"dist.init_process_group{_rendezvous(f.f_locals)}", None, ""
        path = f.f_code.co_filename.replace(os.sep, "/")
        if "torch/distributed/" in path and name not in _WRAPPERS:
            if name == "init_process_group":
                return f"dist.init_process_group{_rendezvous(f.f_locals)}", None, ""
            if name in COUNTED_FUNCTIONS and path.endswith(_C10D):  # not dcp's own all_reduce
                return f"dist.{name}", _peers(name, f.f_locals), ""
            inside = inside or f"dist.{name}"
    return "", None, inside


def _peers(name: str, local_vars: dict) -> tuple[int, ...] | None:
    """The ranks a torch.distributed call waits for: its group's, or its send/recv peer.

    ``monitored_barrier``: a rank waits for the group's rank 0, its coordinator, which itself
    waits for everyone until the barrier's own timeout, then names the missing ranks (None:
    that wait ends by itself).
    """
    try:
        import torch.distributed as dist

        if name in ("send", "isend", "recv", "irecv"):
            peer = local_vars.get("dst" if "send" in name else "src")
            return None if peer is None else (int(peer),)
        group = local_vars.get("group")
        if group is None or group is dist.GroupMember.WORLD:
            members = tuple(range(dist.get_world_size()))
        else:
            members = tuple(dist.get_process_group_ranks(group))
        if name == "monitored_barrier":
            return None if dist.get_rank() == members[0] else members[:1]
        return members
    except Exception:  # noqa: BLE001 - a group torch no longer knows: say nothing
        return None


def failed_report(job_id: int, collectives: int | None, error: BaseException) -> StackReport:
    """What a rank answers when its stack could not be read (the report itself raised)."""
    return StackReport(job_id, (), "", collectives,
                       error=f"{type(error).__name__}: {error}"[:500])


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
        if report.error:
            lines.append(f"rank {rank}: its stack could not be read ({report.error})")
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
            busy = f" in {report.inside} (no collective)," if report.inside else ""
            lines.append(f"rank {rank} is{busy} at {place}, after "
                         f"{_collectives(report.collectives)}")
            behind[rank] = report.collectives
    return "\n".join(lines + _diagnosis(waiting, behind, init_waits, finished))


# Waits that end by themselves: a rendezvous (reported as such). (A monitored barrier's
# coordinator, which ends at its own timeout, reports no peers: see _peers.)
SELF_ENDING = ("dist.init_process_group",)


def waits_for_a_returned_rank(reports: dict[int, StackReport],
                              finished: Iterable[int]) -> bool:
    """Is a rank waiting in a collective (or a recv) that a rank which returned is part of?

    Then it can never finish: the returned rank makes no more calls in this job. A rank that
    returned after its part of that very collective has sent all it had to send, so the rank
    still in it finishes at once; one found there again later is waiting for good. Only real
    collectives and send/recv count (``peers`` is None otherwise); in ``dist.monitored_barrier``
    only a rank whose coordinator returned (the coordinator itself ends at the barrier's own
    timeout, with torch's error naming the ranks that did not arrive).
    """
    finished = set(finished)
    return any(report.waiting_in
               and not report.waiting_in.startswith(SELF_ENDING)
               and report.peers is not None and finished & set(report.peers)
               for report in reports.values())


#: The advice for the usual hang: a rank never reached the collective the others wait in.
HANG_HINT = (
    "The usual causes are a branch that not every rank takes (for example `if rank == 0:`), "
    "and ranks that run different numbers of steps (uneven data without drop_last). Every rank "
    "must make the same collective calls in the same order."
)
#: The advice when a rank still running may only be slow.
SLOW_HINT = "If the work is only slow, pass a larger timeout=."
_P2P = ("dist.send", "dist.recv", "dist.isend", "dist.irecv", "dist.batch_isend_irecv")


def _diagnosis(waiting: dict[int, tuple[str, int | None]], behind: dict[int, int | None],
               init_waits: Iterable[int], returned: Iterable[int]) -> list[str]:
    """What the ranks' places say went wrong, then the one piece of advice that fits it.

    Each idea is said once: a message built from this adds no advice of its own.
    """
    out = []
    init_waits, returned = list(init_waits), set(returned)
    if init_waits:
        out.append(f"{ranks(init_waits)} never finished init_process_group: no process answers "
                   "at that rendezvous address, or not every rank joined it (each rank must "
                   "call init_process_group with the same address and world_size).")
    if not waiting:
        if not init_waits:  # own code, a library's collective, or native code
            out.append("No rank was found in a collective call. A rank may wait in one that a "
                       "library makes for it (DDP's forward broadcasts buffers), or in its own "
                       "code: a lock, a queue, a loop that never ends.")
            out += [HANG_HINT] * bool(returned) + [SLOW_HINT]
        return out
    calls = set(waiting.values())
    if len(calls) > 1:
        each = "; ".join(f"rank {r} in {name}" + (f" (its {_ordinal(n)})" if n else "")
                         for r, (name, n) in waiting.items())
        return out + [f"The ranks wait in different collectives: {each}. Every rank must make "
                      "the same collective calls in the same order."]
    (name, n), = calls
    target = f"{name}, its {_ordinal(n)}" if n else name
    waiters, verb = ranks(waiting), "is" if len(waiting) == 1 else "are"
    missing = [r for r, count in behind.items() if count is None or n is None or count < n]
    for rank in missing:
        reached = "has not reached" if behind[rank] is None else "never reached"
        out.append(f"rank {rank} {reached} the collective {waiters} {verb} waiting in ({target}).")
    past = [r for r in behind if r not in missing]
    for rank in past:  # its part of that very collective done: the calls did not match
        out.append(f"rank {rank} had already made its part of the collective {waiters} {verb} "
                   f"waiting in ({target}): their calls did not match.")
    slow = [SLOW_HINT] if set(missing) - returned or not behind else []
    if name in _P2P:
        return out + ["A send or a recv ends only when the rank it names (dst= or src=) makes "
                      "the matching call: a recv for each send, in the same order."] + slow
    if missing:
        return out + [HANG_HINT] + slow
    if past:
        return out + ["Every rank must pass a collective tensors of the same shape and dtype, "
                      "and make the same calls in the same order."]
    return out + [f"Every rank is waiting in {target}: check that they pass tensors of the same "
                  "shape and dtype, and the same group."] + slow
