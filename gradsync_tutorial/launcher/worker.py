"""The worker side of :func:`gradsync_tutorial.launch`: one fresh interpreter per rank.

Started by the launcher, never by hand: as ``python -m gradsync_tutorial.launcher.worker``, or
on Linux run as ``__main__`` in a fork of a template that has imported torch
(:mod:`.template`). It

1. imports torch (the slow part, ~2 s; done already in a fork) while the notebook is still busy,
2. connects back to the launcher over a loopback socket and proves itself with a token,
3. then serves jobs until the launcher closes the socket: for each job it sets the torchrun
   environment (RANK, WORLD_SIZE, ...), initializes the default process group, calls
   ``fn(rank, world_size, *args)``, and sends back the result or the error with its traceback.

The socket is also the lifeline: if the launcher goes away (kernel restarted, killed, crashed),
the read returns EOF and this process exits at once, so no worker ever outlives its notebook.
On Linux a parent-death signal backs it up (a rank stuck in C code that holds the GIL cannot
read its socket), and every process the rank forks from Python gets one too.

A warm worker runs many jobs, so before each one it puts back what a fresh interpreter has
(:mod:`gradsync_tutorial.launcher.fresh_state`, where the list is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import linecache
import os
import pickle
import queue
import socket
import sys
import threading
import types
from datetime import timedelta
from multiprocessing.connection import Connection

from gradsync_tutorial.launcher import cells as _cells
from gradsync_tutorial.launcher import fresh_state as _fresh_state
from gradsync_tutorial.launcher import hang_report as _where
from gradsync_tutorial.launcher import own_group as _own_group
from gradsync_tutorial.launcher import process_tree as _lifelines
from gradsync_tutorial.launcher import rank_failure as _rank_failure
from gradsync_tutorial.launcher.protocol import (
    CONTROL_ENV,
    END_MARK,
    END_MARK_ENV,
    PARENT_ENV,
    TOKEN_ENV,
    Finished,
    Job,
    Raised,
    Ready,
    StackRequest,
    Teardown,
)

_mark = END_MARK  # this worker's own: END_MARK and its secret, read at start-up


def _dumps_result(obj) -> tuple[bytes, tuple[str, ...]]:
    """Pickle ``obj`` for the notebook, every tensor in it moved to the CPU and detached.

    Tensors are swapped while pickling, wherever they are (in a dict, a ``Counter``, a
    ``defaultdict``, a dataclass, an object of the user's own class): no container is rebuilt,
    so each comes back as it was, with its type, its default factory, its counts. A DTensor
    (FSDP2, tensor parallel) comes back as this rank's local tensor, a plain one; the notes
    returned say so, for the launcher to print once whichever ranks returned DTensors.
    """
    import cloudpickle
    import torch

    shards: list[str] = []  # the DTensors sent as this rank's shard (see _local_shard)

    class _CPUPickler(cloudpickle.Pickler):
        def reducer_override(self, o):
            if isinstance(o, torch.Tensor):
                cpu = _local_shard(o, shards).detach().cpu()
                if isinstance(o, torch.nn.Parameter):  # stays a Parameter, as it was
                    cpu = torch.nn.Parameter(cpu, requires_grad=o.requires_grad)
                return cpu.__reduce_ex__(self.proto)
            return _cells.by_reference(o) or super().reducer_override(o)

    buffer = io.BytesIO()
    _CPUPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue(), (_dtensor_note(shards),) if shards else ()


# What to_local() gives of a DTensor, by the kind of its placements.
LOCAL_PART = {"Shard": "a shard (Shard)", "Replicate": "a whole copy (Replicate)",
              "Partial": "one rank's term of a sum not yet taken (Partial: add the ranks' "
                         "tensors, or call full_tensor())"}


def _dtensor_note(shards: list[str]) -> str:
    """What the launcher tells the notebook about the DTensors a rank returned (no rank in it,
    so that the ranks' notes can be told once).

    >>> print(_dtensor_note(["DTensor of shape (4,) placed (Partial(sum),)"])[:60])
    fn returned 1 DTensor(s), e.g. a DTensor of shape (4,) place
    """
    kinds = [part for kind, part in LOCAL_PART.items() if any(kind in s for s in shards)]
    return (f"fn returned {len(shards)} DTensor(s), e.g. a {shards[0]}. The notebook "
            "receives each rank's local tensor of each, a plain tensor (DTensor.to_local()): "
            f"{', '.join(kinds) or 'its local part'}. For whole tensors return "
            "t.full_tensor(), on every rank (it is a collective): "
            "{k: v.full_tensor() for k, v in model.state_dict().items()}.")


def _local_shard(tensor, shards: list[str]):
    """A DTensor names its device mesh and process group, which the notebook does not have:
    send this rank's shard of it instead, a plain tensor. Records what it replaced."""
    module = sys.modules.get("torch.distributed.tensor") or sys.modules.get(
        "torch.distributed._tensor")  # (torch < 2.5); not imported: fn made no DTensor
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None or not isinstance(tensor, dtensor):
        return tensor
    shards.append(f"DTensor of shape {tuple(tensor.shape)} placed {tensor.placements}")
    return tensor.to_local()


def _end_of_job(job_id: int) -> None:
    """Flush both streams and mark the end of this job's output on each.

    The marks go to the original streams, in case ``fn`` replaced ``sys.stdout``; one that
    ``fn`` closed is opened again on its file descriptor (which ``close()`` leaves open), and a
    descriptor ``fn`` closed or redirected is put back first.
    """
    _fresh_state.cancel_alarms()  # a job's alarm must not end the worker while it waits
    _fresh_state.put_back_descriptors()
    for name in ("stdout", "stderr"):
        try:
            getattr(sys, name).flush()
        except Exception:  # noqa: BLE001 - a stream fn closed or broke
            pass
        original = _fresh_state.original_stream(name)
        if original is None:  # fn closed the descriptor itself: the launcher sees its EOF
            continue
        # Its own line even after text printed without a newline (the launcher splits it off).
        try:
            original.write(f"{_mark} {job_id}\n")
            original.flush()
        except (OSError, ValueError):
            pass



def _join_group(job: Job) -> None:
    """This rank's process group, as torchrun's ranks make theirs (and on its GPU under nccl)."""
    import torch

    bound = {}
    if job.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if job.backend == "nccl":  # as the course's scripts do: barrier() knows its GPU
            bound = {"device_id": torch.device("cuda", int(os.environ["LOCAL_RANK"]))}
    # init_method="env://": read MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, exactly as under
    # torchrun. The store it connects to is hosted by the launcher (the "agent" store).
    _own_group.original()(job.backend, timeout=timedelta(seconds=job.collective_timeout), **bound)


def _run_job(job: Job, channel: _Channel | None = None) -> Finished | Raised:
    """Run one job; return the message for the launcher. Never raises."""
    import cloudpickle

    from gradsync_tutorial.detect import CollectiveCounter

    counter = CollectiveCounter()
    before = set(sys.modules)
    # The Thread objects, not their idents: a thread that ends during the job frees its
    # ident, and the next thread fn starts often gets it again.
    threads_before = set(threading.enumerate())
    try:
        _fresh_state.start_job(job)  # the environment, sys.path, torch's modes... as fresh
        for filename, lines in job.sources.items():  # notebook cells: tracebacks show the line
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _join_group(job)
        # fn may call init_process_group itself, as torchrun scripts do: see _own_group.
        # Before unpickling fn, so that its `from torch.distributed import init_process_group`
        # finds this one too.
        _own_group.install(rank, world_size, os.environ["MASTER_ADDR"],
                           int(os.environ["MASTER_PORT"]))
        before = set(sys.modules)
        fn, args = cloudpickle.loads(job.payload)
        _fresh_state.note_loaded_for_fn(before)
        # Count the collectives fn enters: a hang report says how far each rank got.
        counter = CollectiveCounter(fn, *args, keep_arguments=False)
        before = set(sys.modules)
        with counter, _no_launcher_inside(), _unshown_logs(rank, job.notebook_log_level):
            if channel is not None:
                channel.counter = counter
            result = fn(rank, world_size, *args)
        _wait_for_threads(threads_before, channel)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return _raised(job.job_id, exc)
        # sys.exit() / sys.exit(0) ends a torchrun process successfully: the same here.
        print(f"fn called sys.exit({'' if exc.code is None else 0}): counted as success, as "
              "torchrun counts exit code 0; this rank's result is None.", file=sys.stderr)
        result = None
    except BaseException as exc:  # noqa: BLE001 - the launcher re-raises it in the notebook
        return _raised(job.job_id, exc)
    try:
        result = _unwrap_ddp(result)
        pickled, notes = _dumps_result(result)
        return Finished(job.job_id, pickled, counter.total,
                        _fresh_state.retiring_imports(before),
                        _fresh_state.retire_reasons() + _daemons_left(threads_before), notes)
    except Exception as exc:  # noqa: BLE001
        return _raised(job.job_id,
            TypeError(f"the return value of fn ({type(result).__name__}) could not be "
                      f"serialized back to the notebook: {exc}. Return tensors, numbers, "
                      "lists or dicts of them (for a model, return model.state_dict())."),
        )


def _wait_for_threads(before: set, channel: _Channel | None) -> None:
    """Wait for the threads ``fn`` left running, as a process waits for them before it exits.

    Under torchrun a background save (``dcp.async_save``, a thread of the user's) finishes
    before the rank's process ends; here the worker outlives the job, so it waits as Python's
    exit does: for every non-daemon thread the job started, except a thread pool's idle thread
    (at exit Python would shut its pool down). Past the launch's timeout the hang report names
    the thread it waits for, and where that thread is (see :func:`_answer`).
    """
    me = threading.current_thread()
    while True:
        running = [t for t in threading.enumerate() if t not in before and t is not me
                   and not t.daemon and t.is_alive() and not _idle_pool_thread(t)]
        if not running:
            break
        if channel is not None:
            channel.waiting_for = running[0]
        running[0].join(0.02)  # again: the pool's own threads may be idle by now
    if channel is not None:
        channel.waiting_for = None


def _daemons_left(before: set) -> tuple[str, ...]:
    """A daemon thread ``fn`` left running, as a retire reason: under torchrun it ends with the
    rank's process; here it would run on, and print into later cells."""
    left = sorted(t.name for t in threading.enumerate() if t not in before and t.daemon
                  and t.is_alive() and not _a_library_s_thread(t))
    if not left:
        return ()
    names = ", ".join(repr(n) for n in left[:3]) + (", ..." if len(left) > 3 else "")
    return (f"fn left daemon thread{'s' if len(left) > 1 else ''} {names} running, which "
            "only the process's end stops",)


def _a_library_s_thread(thread: threading.Thread) -> bool:
    """Does ``thread`` run an installed library's code (tqdm's monitor, say), not fn's own?"""
    run = type(thread).run
    code = getattr(getattr(thread, "_target", None) if run is threading.Thread.run else run,
                   "__code__", None)
    path = os.path.abspath(code.co_filename) if code is not None else ""
    return bool(path) and (_fresh_state.installed_or_standard(path)
                           or path.startswith(os.path.dirname(_fresh_state.__file__)))


def _idle_pool_thread(thread: threading.Thread) -> bool:
    """A ``ThreadPoolExecutor`` thread waiting for work that is not there."""
    from concurrent.futures import thread as pool_threads

    if getattr(thread, "_target", None) is not pool_threads._worker:
        return False
    frame = sys._current_frames().get(thread.ident)  # innermost: it waits in C, no frame
    work_queue = (getattr(thread, "_args", ()) or (None, None))[1]
    return (frame is not None and frame.f_code is pool_threads._worker.__code__
            and work_queue is not None and work_queue.empty())




LAUNCHER_INSIDE = (
    "a launcher inside a rank: this rank called torch.multiprocessing.{name} (what mp.spawn, "
    "Lightning's ddp_notebook and ddp_spawn strategies and Accelerate's notebook_launcher use "
    "to start ranks), but gst.launch has already started the ranks, and ranks started inside "
    "a rank wait for peers that never come. Let gst.launch start them: with Lightning Fabric, "
    'pass strategy="ddp" (fabric.launch(fn) then runs fn in each rank); with mp.spawn or '
    "notebook_launcher, gst.launch the function they would start. For helper processes of "
    "this rank's own, use multiprocessing itself."
)


@contextlib.contextmanager
def _no_launcher_inside():
    """While ``fn`` runs: torch.multiprocessing's launchers refuse, saying why (see
    :data:`LAUNCHER_INSIDE`). Under torchrun the same code fails too, with a gloo error."""
    import torch.multiprocessing
    import torch.multiprocessing.spawn as spawn_module

    originals = [(m, n, getattr(m, n)) for m in (torch.multiprocessing, spawn_module)
                 for n in ("start_processes", "spawn") if hasattr(m, n)]

    def refuse(name):
        def launcher(*args, **kwargs):
            __tracebackhide__ = True
            raise RuntimeError(LAUNCHER_INSIDE.format(name=name))
        return launcher

    for module, name, _ in originals:
        setattr(module, name, refuse(name))
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


UNSHOWN_LOGS = (
    "fn logged {count} record(s) below WARNING that no handler showed (logger {first!r} first): "
    "a logging.basicConfig in a notebook cell configures the notebook, not the ranks (each is a "
    "process of its own, as under torchrun). Call logging.basicConfig(...) inside fn to see them."
)


@contextlib.contextmanager
def _unshown_logs(rank: int, notebook_level: int):
    """While ``fn`` runs: count the records of ``fn``'s own loggers that this rank's logging
    drops because it was never configured (the root's fresh WARNING level) though the
    notebook's would show them (``notebook_level``, INFO after a cell's basicConfig), and say
    why on rank 0, once. Quiet otherwise."""
    import logging

    if notebook_level >= logging.root.level:
        yield
        return
    enabled_for = logging.Logger.isEnabledFor
    fresh_level = logging.root.level  # WARNING: logging.info() alone adds a handler, not a level
    dropped: list[str] = []

    def is_enabled_for(self, level):
        enabled = enabled_for(self, level)
        if (not enabled and notebook_level <= level and logging.root.level == fresh_level
                and self.getEffectiveLevel() == fresh_level and _users_logger(self.name)):
            dropped.append(self.name)
        return enabled

    logging.Logger.isEnabledFor = is_enabled_for
    try:
        yield
    finally:
        logging.Logger.isEnabledFor = enabled_for
        if dropped and rank == 0:
            print(UNSHOWN_LOGS.format(count=len(dropped), first=dropped[0]), file=sys.stderr)


def _users_logger(name: str) -> bool:
    """A logger of the user's code (the root, a cell's ``__main__``, a module of their own),
    not a library's (torch logs at INFO that no one is meant to see)."""
    top = name.partition(".")[0]
    module = sys.modules.get(top)
    return name in ("root", "__main__") or module is None or _fresh_state.users_own(module)


def _pickle_notebook_objects_by_value() -> None:
    """Let ``multiprocessing`` send classes and functions defined in a notebook cell.

    A DataLoader with ``num_workers > 0`` and the ``spawn`` or ``forkserver`` start method (the
    default on macOS and Windows) pickles its Dataset *by name*, and a class defined in a cell
    has none here (``Can't pickle <class '__main__.MyDataset'>``). multiprocessing's pickler
    sends such a class or function by value (cloudpickle) instead, as the launcher sent it.
    """
    from multiprocessing.reduction import ForkingPickler

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)) and not _importable(obj):
            import cloudpickle

            return cloudpickle.loads, (_cells.dumps(obj),)
        return NotImplemented

    ForkingPickler.reducer_override = reducer_override


def _importable(obj) -> bool:
    """Can pickle find ``obj`` by its module and qualified name?"""
    target = sys.modules.get(getattr(obj, "__module__", None) or "")
    for part in getattr(obj, "__qualname__", "<locals>").split("."):
        target = getattr(target, part, None) if part != "<locals>" else None
        if target is None:
            return False
    return target is obj


def _unwrap_ddp(result):
    """A DistributedDataParallel model cannot be rebuilt where there is no process group (the
    notebook): send the model it wraps, and say so."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(result, DistributedDataParallel):
        return result
    print("fn returned a DistributedDataParallel model: the notebook receives the model it "
          "wraps (its .module). Return model.module.state_dict() to say so yourself.",
          file=sys.stderr)
    return result.module


def _raised(job_id: int, exc: BaseException) -> Raised:
    return _rank_failure.raised(job_id, exc, runner=_run_job.__code__)


def _connect() -> Connection:
    host, port = os.environ.pop(CONTROL_ENV).rsplit(":", 1)
    token = bytes.fromhex(os.environ.pop(TOKEN_ENV))
    sock = socket.create_connection((host, int(port)))
    sock.sendall(token)
    return Connection(sock.detach())


class _Channel:
    """The connection to the launcher, shared by the job's thread and the control thread."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()
        self.counter = None  # the job's CollectiveCounter while fn runs
        self.job_thread = threading.get_ident()
        self.waiting_for: threading.Thread | None = None  # a thread fn left running

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)


def main() -> None:
    global _mark
    _lifelines.start_reaper()  # first: before threads and torch
    parent = os.environ.pop(PARENT_ENV, "")
    _lifelines.die_with_parent_and_forks(int(parent) if parent.isdigit() else None)
    _mark = os.environ.pop(END_MARK_ENV, END_MARK)
    import torch  # noqa: F401 - preload: by the time the first job arrives this is done
    import torch.distributed  # noqa: F401

    _pickle_notebook_objects_by_value()
    _fresh_state.remember()
    channel = _Channel(_connect())
    inbox: queue.Queue = queue.Queue()

    def read_forever() -> None:
        try:
            while True:
                message = channel.conn.recv()
                if isinstance(message, StackRequest):  # answered here: the job thread is busy
                    _answer(channel, message)
                else:
                    inbox.put(message)
        except (EOFError, OSError):
            # The launcher closed the socket or died: never outlive it.
            os._exit(0)

    threading.Thread(target=read_forever, name="gradsync-control", daemon=True).start()

    while True:
        message = inbox.get()
        if isinstance(message, Job):
            reply = _run_job(message, channel)
            _fresh_state.run_exit_handlers()  # as the interpreter's exit would, after threads
            _end_of_job(message.job_id)
            channel.send(reply)
        elif isinstance(message, Teardown):
            _tear_down()
            channel.send(Ready(message.job_id))


def _answer(channel: _Channel, request: StackRequest) -> None:
    """Say where the job's thread is; if that fails, say why (never let this thread die: it
    is the one that notices the launcher going away)."""
    counter = channel.counter
    collectives = None if counter is None else counter.total
    left = channel.waiting_for
    try:
        report = _where.stack_report(request.job_id, channel.job_thread if left is None
                                     else left.ident, collectives)
        if left is not None and not report.waiting_in:
            report = dataclasses.replace(report, inside=(
                f"thread {left.name!r}, which fn left running: the rank waits for it as a "
                "process waits for its threads before it exits"))
    except Exception as e:  # noqa: BLE001 - a report that cannot be built is still an answer
        report = _where.failed_report(request.job_id, collectives, e)
    try:
        channel.send(report)
    except (OSError, ValueError, pickle.PicklingError):
        pass  # the launcher went away: read_forever sees it; or an unsendable frame: no answer


def _tear_down() -> None:
    """Destroy the job's process group (fn may have destroyed it itself, torchrun-style).

    Freeing a gloo group waits about 20 ms for its threads (torch 2.14): the last reference is
    dropped on a thread of its own, after the launcher has been told the rank is ready.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    group = [dist.distributed_c10d._get_default_group()]
    dist.destroy_process_group()
    threading.Thread(target=group.clear, name="gradsync-free-group", daemon=True).start()


if __name__ == "__main__":
    main()
