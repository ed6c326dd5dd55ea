"""The worker side of :func:`gradsync_tutorial.launch`: one fresh interpreter per rank.

Started by the launcher as ``python -m gradsync_tutorial.launcher.worker``, never by hand. It

1. imports torch (the slow part, ~2 s) while the notebook is still busy,
2. connects back to the launcher over a loopback socket and proves itself with a token,
3. then serves jobs until the launcher closes the socket: for each job it sets the torchrun
   environment (RANK, WORLD_SIZE, ...), initializes the default process group, calls
   ``fn(rank, world_size, *args)``, and sends back the result or the error with its traceback.

The socket is also the lifeline: if the launcher goes away (kernel restarted, killed, crashed),
the read returns EOF and this process exits at once, so no worker ever outlives its notebook.
On Linux a parent-death signal backs it up (a rank stuck in C code that holds the GIL cannot
read its socket), and every process the rank forks from Python gets one too.

A warm worker runs many jobs, so before each one it puts back what a fresh interpreter has
(:func:`_reset_globals`; the list is in the launcher's docstring).
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import queue
import random
import re
import signal
import socket
import sys
import threading
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import Connection

from gradsync_tutorial.launcher import hang_report as _where
from gradsync_tutorial.launcher import own_group as _own_group
from gradsync_tutorial.launcher.protocol import (
    CONTROL_ENV,
    END_MARK,
    END_MARK_ENV,
    TOKEN_ENV,
    Finished,
    Job,
    Raised,
    Ready,
    StackRequest,
    Teardown,
)

_mark = END_MARK  # this worker's own: END_MARK and its secret, read at start-up


def _dumps_result(obj) -> bytes:
    """Pickle ``obj`` for the notebook, every tensor in it moved to the CPU and detached.

    Tensors are swapped while pickling, wherever they are (in a dict, a ``Counter``, a
    ``defaultdict``, a dataclass, an object of the user's own class): no container is rebuilt,
    so each comes back as it was, with its type, its default factory, its counts. A DTensor
    (FSDP2) comes back as this rank's shard, a plain tensor, with a note saying so.
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
            return super().reducer_override(o)

    buffer = io.BytesIO()
    _CPUPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    if shards:
        print(f"fn returned {len(shards)} DTensor(s) (FSDP2's sharded tensors, e.g. a "
              f"{shards[0]}): the notebook receives this rank's shard of each, a plain tensor "
              "(DTensor.to_local()). For whole tensors return t.full_tensor(), on every rank "
              "(it is an all-gather): {k: v.full_tensor() for k, v in model.state_dict().items()}.",
              file=sys.stderr)
    return buffer.getvalue()


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

    The marks go to the original streams, in case ``fn`` replaced ``sys.stdout``.
    """
    for stream, original in ((sys.stdout, sys.__stdout__), (sys.stderr, sys.__stderr__)):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream fn closed or broke
            pass
        # Its own line even after text printed without a newline (the launcher splits it off).
        original.write(f"{_mark} {job_id}\n")
        original.flush()


def _run_job(job: Job, channel: _Channel | None = None) -> Finished | Raised:
    """Run one job; return the message for the launcher. Never raises."""
    import cloudpickle
    import torch

    from gradsync_tutorial.detect import CollectiveCounter

    counter = CollectiveCounter()
    try:
        _reset_globals()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # undo a previous job's swap
        os.environ.clear()  # exactly the notebook's environment, plus torchrun's variables
        os.environ.update(job.env, PYTHONUNBUFFERED="1")
        if job.cwd and os.path.isdir(job.cwd):
            os.chdir(job.cwd)
        sys.path[:] = job.sys_path + [p for p in _fresh["sys.path"] if p not in job.sys_path]
        for filename, lines in job.sources.items():  # notebook cells: tracebacks show the line
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        torch.set_num_threads(job.num_threads)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if job.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # init_method="env://": read MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, exactly as under
        # torchrun. The store it connects to is hosted by the launcher (the "agent" store).
        _own_group.original()(job.backend, timeout=timedelta(seconds=job.collective_timeout))
        # fn may call init_process_group itself, as torchrun scripts do: see _own_group.
        # Before unpickling fn, so that its `from torch.distributed import init_process_group`
        # finds this one too.
        _own_group.install(rank, world_size, os.environ["MASTER_ADDR"],
                           int(os.environ["MASTER_PORT"]))
        fn, args = cloudpickle.loads(job.payload)
        # Count the collectives fn enters: a hang report says how far each rank got.
        counter = CollectiveCounter(fn, *args, keep_arguments=False)
        with counter:
            if channel is not None:
                channel.counter = counter
            result = fn(rank, world_size, *args)
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
        return Finished(job.job_id, _dumps_result(result), counter.total)
    except Exception as exc:  # noqa: BLE001
        return _raised(job.job_id,
            TypeError(f"the return value of fn ({type(result).__name__}) could not be "
                      f"serialized back to the notebook: {exc}. Return tensors, numbers, "
                      "lists or dicts of them (for a model, return model.state_dict())."),
        )


# -- what a fresh interpreter has, put back before every job ----------------------------------

# Modules whose functions notebooks (and tests) monkeypatch; a rebound function is put back.
_PATCHABLE = ("builtins", "torch", "torch.distributed", "torch.nn.functional")
_fresh: dict = {}


def _remember_fresh_state() -> None:
    """Called once, before the first job: the state :func:`_reset_globals` puts back."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401

    _fresh["sys.path"] = list(sys.path)
    _fresh["warnings"] = list(warnings.filters)
    _fresh["recursionlimit"] = sys.getrecursionlimit()
    _fresh["signals"] = {s: signal.getsignal(s) for s in signal.valid_signals()
                         if signal.getsignal(s) is not None}
    _fresh["functions"] = {
        name: {k: v for k, v in vars(sys.modules[name]).items() if callable(v)}
        for name in _PATCHABLE
    }


def _reset_globals() -> None:
    """Undo what a previous job may have changed in this process's global state."""
    import torch

    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    if hasattr(torch, "set_default_device"):
        torch.set_default_device(None)
    if torch.are_deterministic_algorithms_enabled():  # the call itself costs seconds at first
        torch.use_deterministic_algorithms(False)
    torch.autograd.set_detect_anomaly(False)
    torch.set_printoptions(profile="default")
    torch.backends.cudnn.benchmark = False
    # Not a fresh interpreter's (False, True): GPU runs that repeat bit for bit, in float32, as
    # the notebooks' checks need (the scripts set the same; CPUs ignore both).
    torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = True, False
    torch.backends.cuda.matmul.allow_tf32 = False
    # Fresh random state, as a new interpreter gets (fn seeds it itself for reproducibility).
    torch.seed()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    warnings.filters[:] = _fresh["warnings"]
    if hasattr(warnings, "_filters_mutated"):
        warnings._filters_mutated()  # forget which warnings were already shown once
    sys.setrecursionlimit(_fresh["recursionlimit"])
    for sig, handler in _fresh["signals"].items():
        if signal.getsignal(sig) is not handler:
            try:
                signal.signal(sig, handler)
            except (OSError, ValueError, TypeError):
                pass
    for name, functions in _fresh["functions"].items():
        namespace = vars(sys.modules[name])
        for attr, original in functions.items():
            if namespace.get(attr) is not original:
                namespace[attr] = original


def _die_with_parent() -> None:
    """Linux: be killed when the process that started this one dies (prctl PR_SET_PDEATHSIG).

    The worker calls it for itself at start-up, and registers it for every process it forks
    from Python (``multiprocessing`` with fork, ``os.fork``), so those never outlive the rank.
    Other platforms have no such signal: there the socket to the launcher is the lifeline.
    Linux sends it when the *thread* that started the worker ends: launch from a thread that
    then exits, and the idle workers go with it (the next launch sees it and starts fresh).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1  # noqa: N806 - <linux/prctl.h>
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no libc to load (a static or unusual build)
        pass


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


# What gloo and nccl say when the other end of a connection went away.
_LOST_PEER = re.compile(
    r"connection (reset|closed) by peer|broken pipe|remote process exited|read error|"
    r"connection refused|socket timeout|connection was likely closed|failed to recv",
    re.IGNORECASE,
)


def _lost_peer(exc: BaseException, text: str) -> bool:
    """Did torch.distributed raise this because a peer's connection closed?

    Decided from the exception's class and where it was raised, not from its type's name:
    a RuntimeError (gloo's and nccl's DistBackendError is one) raised inside torch.distributed
    whose message describes a closed connection.
    """
    if not isinstance(exc, RuntimeError) or not _LOST_PEER.search(text):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return any(f"torch{os.sep}distributed{os.sep}" in f.filename for f in frames)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as e:  # noqa: BLE001 - a user's __str__ that raises
        return f"<its __str__ raised {type(e).__name__}: {_safe_repr(e)}>"


def _safe_repr(obj: object) -> str:
    try:
        return str(obj)
    except Exception:  # noqa: BLE001
        return "?"


def _plumbing(frame: traceback.FrameSummary) -> bool:
    """The launcher's wrappers around torch.distributed calls: not part of the reader's story."""
    path = os.path.abspath(frame.filename)
    return path == _OWN_GROUP or (path == _DETECT and frame.name == "counted")


_OWN_GROUP = os.path.abspath(_own_group.__file__)
_DETECT = os.path.join(os.path.dirname(os.path.dirname(_OWN_GROUP)), "detect.py")


def _hide_plumbing(shown: traceback.TracebackException, depth: int = 0) -> None:
    shown.stack = traceback.StackSummary.from_list(
        [f for f in shown.stack if not _plumbing(f)])
    for chained in (shown.__cause__, shown.__context__):
        if chained is not None and depth < 10:
            _hide_plumbing(chained, depth + 1)


def _raised(job_id: int, exc: BaseException) -> Raised:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _run_job.__code__ and tb.tb_next is not None:
        tb = tb.tb_next  # start the traceback at the user's code, not at this module
    try:
        shown = traceback.TracebackException(type(exc), exc, tb)
        _hide_plumbing(shown)
        text_tb = "".join(shown.format())
    except Exception:  # noqa: BLE001 - a broken exception must not crash the worker
        text_tb = "".join(traceback.format_tb(tb)) + f"{type(exc).__qualname__}\n"
    text = _safe_str(exc)
    exit_code = None
    if isinstance(exc, SystemExit):  # sys.exit(3) exits 3; sys.exit("why") prints and exits 1
        exit_code = exc.code if isinstance(exc.code, int) else 1
        text = repr(exc.code) if isinstance(exc.code, str) else text
    try:
        import cloudpickle

        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)  # only send what the notebook can rebuild
    except Exception:  # noqa: BLE001 - the text alone is enough to report it
        pickled = None
    return Raised(job_id, type(exc).__qualname__, text, text_tb, pickled,
                  lost_peer=_lost_peer(exc, text), exit_code=exit_code)


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

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)


def main() -> None:
    global _mark
    _die_with_parent()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_die_with_parent)
    _mark = os.environ.pop(END_MARK_ENV, END_MARK)
    import torch  # noqa: F401 - preload: by the time the first job arrives this is done
    import torch.distributed  # noqa: F401

    _remember_fresh_state()
    channel = _Channel(_connect())
    inbox: queue.Queue = queue.Queue()

    def read_forever() -> None:
        try:
            while True:
                message = channel.conn.recv()
                if isinstance(message, StackRequest):  # answered here: the job thread is busy
                    counter = channel.counter
                    channel.send(_where.stack_report(
                        message.job_id, channel.job_thread,
                        None if counter is None else counter.total))
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
            _end_of_job(message.job_id)
            channel.send(reply)
        elif isinstance(message, Teardown):
            import torch.distributed as dist

            if dist.is_initialized():  # fn may have destroyed it itself, torchrun-style
                dist.destroy_process_group()
            channel.send(Ready(message.job_id))


if __name__ == "__main__":
    main()
