"""Run a training function defined in a notebook cell on N ranks: ``launch(fn, world_size)``.

    >>> import gradsync_tutorial as gst
    >>> def hello(rank, world_size):
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([rank + 1.0])
    ...     dist.all_reduce(t)            # every rank receives the sum over all ranks
    ...     return t.item()
    >>> gst.launch(hello, world_size=2)
    [3.0, 3.0]

Introduced in ``notebooks/00_launching_workers.ipynb``.

How it works, and why not torch's own launchers
-----------------------------------------------
* ``torch.multiprocessing.spawn`` / ``start_processes(start_method="spawn")`` pickle ``fn`` *by
  name*, and a function defined in a notebook has no importable name (``Can't get attribute 'fn'
  on <module '__main__'>``). The ``fork`` start method (what Accelerate's ``notebook_launcher``
  uses) breaks once CUDA is initialized in the kernel, does not exist on Windows, is unsafe on
  macOS and is no longer the default from Python 3.14.
* ``torch.distributed.elastic``'s process contexts redirect worker output to log *files*; under
  pytest/nbval nothing copies them into the cell, and a rank's error reaches the notebook as a
  path to a file.

So this module starts **fresh interpreters** itself with :mod:`subprocess` and pipes
(``python -m gradsync_tutorial.launcher.worker``), sends them ``fn`` serialized *by value* with
``cloudpickle``, and reads every line they print back into the calling cell, tagged
``[rank r]``. What torch does well it keeps: the workers get torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and
initialize the process group through torch's own ``env://`` rendezvous, against a
:class:`torch.distributed.TCPStore` that the launcher hosts, exactly as the torchrun agent does
(``TORCHELASTIC_USE_AGENT_STORE``). The store binds a port the OS picks, so two notebooks never
collide and nothing can take the port between choosing and binding it.

Starting Python and importing torch costs ~2 s a rank, so after a successful launch the workers
stay alive, idle, for the next launch in the same kernel (``reuse_workers=True``): a repeat
launch starts in well under 0.3 s and is still CUDA-safe, since nothing is ever forked. Idle
workers exit with the kernel (they watch their socket to it) or on :func:`shutdown_workers`.
After any failure -- an exception, a dead rank, a timeout, an interrupt -- every worker is
stopped (SIGTERM, then SIGKILL after a grace period) before the error is raised, together with
every process it started, even one in a session of its own; an interrupt while the workers
start, or while a failure is reported, stops them too. The rendezvous store listens on
127.0.0.1 only, and a ``master_port`` is usable again as soon as the launch that used it ended.

What a reused worker puts back before each job
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A job on a warm worker starts as it would in a fresh interpreter, as far as global state that
training code commonly changes goes: the environment (the notebook's, plus torchrun's
variables), the working directory, ``sys.path``, ``sys.stdout``/``sys.stderr``; torch's grad
mode (on), default dtype (float32) and default device, deterministic algorithms and anomaly
detection (off), cudnn flags, print options and thread count; fresh random seeds for torch,
``random`` and numpy (as a new process gets: seed inside ``fn`` for reproducible runs); the
warnings filters (and which warnings were already shown); signal handlers; the recursion limit;
and any function of ``builtins``, ``torch``, ``torch.distributed`` or ``torch.nn.functional``
that a job replaced (monkeypatched). Not reset: modules already imported (call
:func:`shutdown_workers` after editing one), other modules' globals, threads a job left
running, CUDA state. ``reuse_workers=False`` gives every launch fresh interpreters.

Platforms
~~~~~~~~~
Written for Linux, macOS and Windows, run here on Linux only (see the README). Each rank starts
in a process group of its own (a new session on POSIX, ``CREATE_NEW_PROCESS_GROUP`` on
Windows). Stopping reads the rank's process tree first (``/proc`` on Linux, ``ps`` on macOS)
and signals all of it; Windows has no such signals, and ``taskkill /T /F`` stops the tree. On
Linux a rank also dies with the notebook's process even when stuck in C code
(``PR_SET_PDEATHSIG``), and so does every process it forks from Python; elsewhere the socket
to the notebook is the lifeline, which a rank stuck in C code holding the GIL cannot read.
A process that a rank started and that detached itself completely (a daemon that
double-forked) is out of reach everywhere.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import io
import linecache
import math
import os
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._wording import require_int
from ..device import backend_for
from . import hang_report as _where
from .errors import (
    HANG_HINT,
    Failure,
    LaunchError,
    LaunchTimeoutError,
    RankFailedError,
    _rank_failed_error,
    _timeout_error,
)
from .errors import _file_label as _cell_label
from .pool import _Deadline, _JobState, _Workers
from .protocol import PRIVATE_ENV, Job, StackRequest, Teardown

__all__ = [
    "HANG_HINT",
    "Failure",
    "LaunchError",
    "LaunchTimeoutError",
    "RankFailedError",
    "launch",
    "shutdown_workers",
]

BACKENDS = ("auto", "gloo", "nccl")
# Start-up is not part of a launch's timeout: a fresh worker imports torch (2 s here, far more on
# a laptop with an antivirus). It gets max(timeout, STARTUP_SECONDS) of its own.
STARTUP_SECONDS = 60.0
MAX_TIMEOUT = 1e9  # seconds (31 years): past it, datetime.timedelta overflows
# After fn returned everywhere: the ranks' process-group teardown gets this long of its own.
TEARDOWN_SECONDS = 30.0
# The ranks' output is printed until their end-of-job marks, as long as it keeps coming.
OUTPUT_IDLE_SECONDS = 5.0


# --------------------------------------------------------------------------------------------
# Checking the call before any process starts
# --------------------------------------------------------------------------------------------


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


# What one rank costs, to refuse a world_size the machine cannot start (see _max_world_size).
RANK_MEMORY_BYTES = 300 * 2**20  # private memory of an idle rank (Python + torch), measured
RANK_FILE_DESCRIPTORS = 8  # held open in the notebook per rank: pipes, sockets, store links


def _max_world_size() -> tuple[int, str]:
    """The most ranks this machine can start at once, and what limits it.

    Each rank is a whole Python process with torch imported (about 0.3 GB of its own memory)
    and holds about 8 file descriptors open in the notebook's process. More ranks than cores
    is fine (they share the cores); more ranks than memory or descriptors is not: the machine
    swaps, or the start fails half-way with "Too many open files".
    """
    limits = []
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf
        memory = None
    if memory:
        limits.append((max(1, memory // RANK_MEMORY_BYTES),
                       f"each rank is a Python process with torch (~0.3 GB of memory) and this "
                       f"machine has {memory / 2**30:.0f} GB"))
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # Windows
        soft = resource = None
    if soft is not None and soft != getattr(resource, "RLIM_INFINITY", -1):
        spare = soft - _open_descriptors() - 32  # a margin for the notebook itself
        limits.append((max(1, spare // RANK_FILE_DESCRIPTORS),
                       f"each rank holds ~{RANK_FILE_DESCRIPTORS} file descriptors open in this "
                       f"process and its limit is {soft} (raise it with `ulimit -n` before "
                       "starting Jupyter)"))
    return min(limits, default=(sys.maxsize, ""))


def _open_descriptors() -> int:
    for folder in ("/proc/self/fd", "/dev/fd"):  # Linux, macOS
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 64


def _check_call(fn, world_size, args, backend, timeout, num_threads, show_ranks, master_port):
    require_int(world_size, "world_size", what="the number of ranks", hint="Try world_size=2.")
    limit, why = _max_world_size()
    if world_size > limit:
        raise ValueError(f"world_size={world_size} is more ranks than this machine can start: "
                         f"{why}. Use world_size={limit} or fewer.")
    if not callable(fn):
        raise TypeError(f"fn must be a function taking (rank, world_size, *args), "
                        f"got {type(fn).__name__} {fn!r}.")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments for fn, got "
                        f"{type(args).__name__}. For one argument write args=({args!r},).")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: let them run
        sig = None
    if sig is not None:
        try:
            sig.bind(0, world_size, *args)
        except TypeError as e:
            name = getattr(fn, "__name__", repr(fn))
            raise TypeError(
                f"launch calls fn(rank, world_size, *args), but {name}{sig} cannot take "
                f"{2 + len(args)} positional arguments ({e}). Define it as "
                f"`def {name}(rank, world_size{', ...' if args else ''}):`"
                + (f", or, for a torchrun-style entry point that reads RANK and WORLD_SIZE "
                   f"itself, launch `lambda rank, world_size: {name}()`."
                   if _takes_no_arguments(sig) and not args else ".")
            ) from None
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)} "
                         "('auto' picks nccl when there is a GPU per rank, else gloo).")
    if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
            or not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT):
        raise ValueError(f"timeout must be a positive number of seconds (finite), got "
                         f"{timeout!r}. For a long run pass a generous bound, such as "
                         f"timeout=24 * 3600 (at most {MAX_TIMEOUT:.0e}).")
    if num_threads is not None:
        require_int(num_threads, "num_threads", what="torch threads per rank",
                    hint="Leave num_threads=None for CPU cores // world_size.")
    if show_ranks is not None:
        bad = [r for r in show_ranks
               if isinstance(r, bool) or not isinstance(r, int) or r not in range(world_size)]
        if bad:
            raise ValueError(f"show_ranks={list(show_ranks)} names ranks {bad} outside "
                             f"0..{world_size - 1}: pass a list of ranks, such as "
                             f"show_ranks=[0].")
    if master_port is not None and (isinstance(master_port, bool)
                                    or not isinstance(master_port, int)
                                    or not 0 <= master_port <= 65535):
        raise ValueError(f"master_port must be an int port number in 1..65535, or None (launch "
                         f"picks a free port), got {master_port!r}.")


def _ranks_to_show(show_ranks) -> tuple | None:
    """``show_ranks`` read once: a generator or a range work, a single rank gets a hint."""
    if show_ranks is None:
        return None
    if isinstance(show_ranks, (str, bytes)) or not isinstance(show_ranks, Iterable):
        raise TypeError(f"show_ranks must be a list of ranks, got {type(show_ranks).__name__} "
                        f"{show_ranks!r}. For one rank write show_ranks=[{show_ranks!r}].")
    return tuple(show_ranks)


def _rendezvous_store(port: int | None, timeout: float):
    """The store every rank's ``env://`` rendezvous connects to, listening on 127.0.0.1 only.

    torch's ``TCPStore`` listens on every interface; here the launcher binds the socket itself
    to the loopback address and hands it over (``master_listen_fd``), so nothing outside this
    machine can reach it. ``SO_REUSEADDR`` (what torch's own server sets) lets a port whose last
    connections are still in TIME-WAIT -- the launch before this one -- be bound again at once.
    Windows: its ``SO_REUSEADDR`` would let another program take a bound port, and torch's
    ``master_listen_fd`` expects a POSIX descriptor, so there the store binds its port itself.
    """
    import torch.distributed as dist

    kwargs = dict(is_master=True, wait_for_workers=False, timeout=_timedelta(timeout))
    if os.name != "posix":
        return _store_or_port_error(lambda: dist.TCPStore("127.0.0.1", port or 0, **kwargs),
                                    port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port or 0))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise _port_error(port, e) from None
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on and closes it
    return _store_or_port_error(
        lambda: dist.TCPStore("127.0.0.1", bound, master_listen_fd=fd, **kwargs), port)


def _store_or_port_error(make, port):
    try:
        return make()
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError is a RuntimeError
        if port is None:
            raise
        raise _port_error(port, e) from None


def _port_error(port, e: Exception) -> OSError:
    why = getattr(e, "strerror", None) or str(e)
    return OSError(f"master_port={port} is not free ({why}). Leave master_port=None and "
                   "launch picks a free port.")


def _takes_no_arguments(sig: inspect.Signature) -> bool:
    return all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.KEYWORD_ONLY)
               for p in sig.parameters.values())


def _serialize(fn, args) -> tuple[bytes, dict[str, list[str]]]:
    """``fn`` and ``args`` by value, and the source lines of notebook cells they come from."""
    pickler_class = _pickler_class()
    buffer = io.BytesIO()
    pickler = pickler_class(buffer)
    try:
        pickler.dump((fn, tuple(args)))
    except Exception as e:
        raise TypeError(
            f"could not send fn and args to the workers: {type(e).__name__}: {e}. Everything "
            "fn uses is copied to each rank, so it must be serializable: pass tensors, numbers "
            "and plain containers, and create objects such as open files, locks, data loaders "
            "or process groups inside fn."
        ) from e
    # A notebook cell is no file on disk: send its lines, so that a rank's tracebacks and
    # warnings quote them.
    sources = {name: linecache.getlines(name) for name in pickler.filenames
               if not os.path.exists(name) and linecache.getlines(name)}
    return buffer.getvalue(), sources


def _pickler_class():
    import cloudpickle

    reduce_code = cloudpickle.Pickler.dispatch_table[types.CodeType]

    class KeepFileNames(cloudpickle.Pickler):
        """cloudpickle, except that code keeps its file name (not ``<dynamic-code>``), so a
        rank's tracebacks and warnings from a notebook cell's functions and classes point to
        the cell."""

        def __init__(self, file):
            super().__init__(file)
            self.filenames: set[str] = set()

        def reducer_override(self, obj):
            if isinstance(obj, types.CodeType):
                self.filenames.add(obj.co_filename)
                make, fields = reduce_code(obj)
                return make, tuple(obj.co_filename if isinstance(f, str) and
                                   f == "<dynamic-code>" else f for f in fields)
            return super().reducer_override(obj)

    return KeepFileNames


# --------------------------------------------------------------------------------------------
# The idle pool, kept between launches
# --------------------------------------------------------------------------------------------

_pool_lock = threading.Lock()
_idle: _Workers | None = None


def _pool_key(world_size: int) -> tuple:
    return (world_size, sys.executable, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _take_workers(world_size: int, reuse: bool) -> _Workers:
    """Return the idle pool if it fits, else freshly started processes."""
    global _idle
    with _pool_lock:
        pool, _idle = _idle, None
    if pool is not None:
        if reuse and pool.key == _pool_key(world_size) and pool.alive():
            return pool
        pool.stop_despite_interrupts()
    return _Workers(world_size, _pool_key(world_size))


def _give_back(workers: _Workers, reuse: bool) -> None:
    global _idle
    if reuse:
        with _pool_lock:
            if _idle is None:
                _idle = workers
                return
    workers.stop_despite_interrupts()


def shutdown_workers() -> None:
    """Stop the idle workers kept for the next launch (they also stop with the kernel).

    Call it after editing a module that your training function imports, so that the next
    launch starts fresh interpreters that import the new code.

        >>> import gradsync_tutorial as gst
        >>> gst.shutdown_workers()
    """
    global _idle
    with _pool_lock:
        pool, _idle = _idle, None
    if pool is not None:
        pool.stop_despite_interrupts()


atexit.register(shutdown_workers)


# --------------------------------------------------------------------------------------------
# launch()
# --------------------------------------------------------------------------------------------


def launch(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    *,
    backend: str = "auto",
    timeout: float = 300.0,
    num_threads: int | None = None,
    show_ranks: Iterable[int] | None = None,
    reuse_workers: bool = True,
    master_port: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    Each rank is a fresh Python process with torchrun's environment (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and the default
    process group already initialized, so the body of ``fn`` runs unchanged under torchrun.
    Every line a rank prints appears in the calling cell as ``[rank r] ...``.

    Args:
        fn: the function each rank runs. It may be defined in a notebook cell, be a lambda or
            a closure: it is sent to the workers by value (cloudpickle).
        world_size: how many ranks (processes) to start; at most what the machine's memory
            (~0.3 GB a rank) and file-descriptor limit allow, else a ValueError says how many.
        args: extra positional arguments, copied to every rank.
        backend: ``"auto"`` (nccl with one GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``.
            With a GPU per rank, each rank's current device is ``cuda:LOCAL_RANK``.
        timeout: seconds ``fn`` may run, counted from the moment every rank is ready. Past it
            every rank is stopped and :class:`LaunchTimeoutError` names the ranks that had not
            finished. Start-up (fresh workers import torch) has a limit of its own,
            ``max(timeout, STARTUP_SECONDS)``, so a short timeout also works on cold workers.
            It judges the ranks' results, not their output: a rank that returned in time is
            not late because the notebook is still printing what it wrote.
        num_threads: ``torch.set_num_threads`` in each rank; default: CPU cores // world_size,
            at least 1, so that the ranks do not oversubscribe a laptop.
        show_ranks: print only these ranks' output, a list such as ``[0]`` (default: all).
        reuse_workers: keep the processes for the next launch in this kernel (fast restarts).
        master_port: the rendezvous port (on 127.0.0.1); default ``None``: a free port
            picked by the OS.

    Returns:
        The ranks' return values, ordered by rank. Tensors in them arrive on the CPU.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message) or died.
        LaunchTimeoutError: ``timeout`` passed first (typically a rank skipped a collective).
        KeyboardInterrupt: re-raised after every rank has been stopped.

    Example:
        >>> import gradsync_tutorial as gst
        >>> gst.launch(lambda rank, world_size: rank * 10, world_size=2)
        [0, 10]
    """
    # IPython and pytest hide frames that set this: an error cell then shows the rank's
    # traceback (in the message) under the reader's own line, without the launcher's insides.
    __tracebackhide__ = True
    show_ranks = _ranks_to_show(show_ranks)  # read once: it may be a generator
    _check_call(fn, world_size, args, backend, timeout, num_threads, show_ranks, master_port)
    backend, device = backend_for(backend, world_size)  # the one device rule (device.py)
    payload, sources = _serialize(fn, args)
    num_threads = num_threads or max(1, _cpu_count() // world_size)

    # The rendezvous store, hosted here as torchrun's agent hosts it; port 0: the OS picks one.
    store = _rendezvous_store(master_port, timeout)
    try:
        workers = _take_workers(world_size, reuse_workers)
    except BaseException:  # they could not all start (and were stopped): release the port
        del store
        raise
    workers.show = set(range(world_size) if show_ranks is None else show_ranks)
    workers.job_id += 1
    state = _JobState(workers.job_id)
    startup = max(timeout, STARTUP_SECONDS)
    try:
        workers.pump(state, time.monotonic() + startup, lambda: all(workers.conns))
        deadline = time.monotonic() + timeout  # the job's own time starts now
        for rank in range(world_size):
            env = _job_env(rank, world_size, store.port, num_threads)
            workers.send(rank, Job(
                state.job_id, payload, env, os.getcwd(), list(sys.path), backend, device,
                num_threads, collective_timeout=timeout + 30,  # our timeout reports it first
                sources=sources,
            ))
        state.sent = True
        workers.pump(state, deadline, lambda: len(state.results) == world_size)
        if not state.failures:
            # Every rank returned in time; printing what they wrote takes what it takes.
            workers.drain_output(state, range(world_size), OUTPUT_IDLE_SECONDS)
            for rank in range(world_size):
                workers.send(rank, Teardown(state.job_id))
            workers.pump(state, time.monotonic() + max(timeout, TEARDOWN_SECONDS),
                         lambda: len(state.ready) == world_size)
        if state.failures:  # in the job or its teardown. Stop every rank while the store is
            # up: a rank still joining the rendezvous would print torch's C++ "closed" dump
            error = _stop_after_failure(workers, state)
    except _Deadline:
        where = _where_each_rank_is(workers, state) if state.sent else ""
        workers.stop()
        workers.drain(state, lambda: True, 0)
        raise _shown_from_caller(_timeout_error(state, world_size, timeout, startup,
                                                all(workers.conns), where)) from None
    except BaseException:  # KeyboardInterrupt (the kernel's stop button) included
        workers.stop_despite_interrupts()
        raise
    finally:
        del store  # closes the port

    if state.failures:
        # from: the rank's exception, when it could be rebuilt
        raise _shown_from_caller(error) from error.__cause__
    _give_back(workers, reuse_workers)
    results, error = _rebuild_results(state, world_size)
    if error is not None:
        raise _shown_from_caller(error) from None
    return results


def _stop_after_failure(workers: _Workers, state: _JobState) -> RankFailedError:
    """A rank failed: let the others report, stop them all, return the error to raise."""
    world_size = workers.world_size
    # Give the other ranks a moment to report errors of their own (an error raised on every
    # rank), then stop them all, and show what the failed ranks printed.
    try:
        workers.drain(state, lambda: len(state.failures) == world_size, 0.05, note_exits=True)
        if all(f.lost_peer for f in state.failures.values()):
            # A rank lost its peer under a collective: the peer that went away is the story,
            # and its exit can be noticed a moment after the survivor's report. Wait for it.
            workers.drain(state, lambda: not all(f.lost_peer for f in state.failures.values())
                          or len(state.failures) == world_size, 2.0, note_exits=True)
        workers.drain(state, lambda: state.output_complete(state.failures), 0.5)
    finally:  # the stop button pressed while the failure is being reported included
        workers.stop_despite_interrupts()
    workers.drain(state, lambda: state.output_complete(range(world_size)), 1.0)
    for rank, failure in state.failures.items():
        failure.stderr_tail = tuple(state.stderr_tail[rank])
    return _rank_failed_error(list(state.failures.values()), state.sent)


def _where_each_rank_is(workers: _Workers, state: _JobState) -> str:
    """At a timeout, before stopping the ranks: ask each for its stack, say who waits for whom."""
    unfinished = [r for r in range(workers.world_size) if r not in state.results]
    for rank in unfinished:
        workers.send(rank, StackRequest(state.job_id))
    workers.drain(state, lambda: all(r in state.stacks or r in state.results
                                     for r in unfinished), _where.STACK_SECONDS)
    finished = {r: state.collectives.get(r) for r in state.results}
    return _where.describe(workers.world_size, state.stacks, finished, _cell_label)


def _rebuild_results(state: _JobState, world_size: int) -> tuple[list, RankFailedError | None]:
    """The ranks' return values, or the error naming the rank whose value cannot be rebuilt."""
    import cloudpickle

    results = []
    for rank in range(world_size):
        try:
            results.append(cloudpickle.loads(state.results[rank]))
        except Exception as e:  # noqa: BLE001 - a class only the worker could import, say
            failure = Failure(rank, "result", exc_type=type(e).__name__, message=str(e))
            return [], _rank_failed_error([failure], started=True)
    return results, None


def _shown_from_caller(error: LaunchError) -> LaunchError:
    """``error``, set to show in IPython from the caller's line, without the launcher's frames.

    IPython hides the frames that set ``__tracebackhide__`` except the last one, the line that
    raised: ``launcher.py: raise error ...`` under the reader's cell. An exception that has a
    ``_render_traceback_`` is shown by it instead (IPython's hook; ipyparallel's remote errors
    use it), so give this one a traceback without any hidden frame. pytest honours
    ``__tracebackhide__`` itself, and plain Python shows the whole traceback.
    """
    error._render_traceback_ = functools.partial(_render_from_caller, error)
    return error


def _render_from_caller(error: BaseException) -> list[str]:
    """IPython's own rendering of ``error``, its ``__tracebackhide__`` frames left out."""
    from IPython import get_ipython

    kept = []
    tb = error.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_locals.get("__tracebackhide__"):
            kept.append(tb)
        tb = tb.tb_next
    shown = None
    for tb in reversed(kept):
        shown = types.TracebackType(shown, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    return get_ipython().InteractiveTB.structured_traceback(type(error), error, shown,
                                                            tb_offset=0)


def _job_env(rank: int, world_size: int, port: int, num_threads: int) -> dict[str, str]:
    """The notebook's environment (``GRADSYNC_DATA`` and every other variable of the user's),
    without the launcher's own control variables, plus torchrun's."""
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    return dict(env, **_torchrun_env(rank, world_size, port, num_threads))


def _torchrun_env(rank: int, world_size: int, port: int, num_threads: int) -> dict[str, str]:
    """The variables torchrun sets for a single-node job (see ``torchrun --help``)."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": str(num_threads),
    }


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
