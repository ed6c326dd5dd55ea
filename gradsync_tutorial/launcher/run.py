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

So the launcher starts **fresh processes** itself, never copies of the kernel, with pipes for
their output: on Linux forks of a *template* that imported torch and nothing of the notebook
(:mod:`.template`), elsewhere ``python -m gradsync_tutorial.launcher.worker``. It sends them
``fn`` serialized *by value* with ``cloudpickle``, and reads every line they print back into the
calling cell, tagged ``[rank r]``. What torch does well it keeps: the workers get the
environment torchrun's agent gives (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``...: :func:`_torchrun_env`), so libraries that detect torchrun detect it,
and initialize the process group through torch's own ``env://`` rendezvous, against a
:class:`torch.distributed.TCPStore` that the launcher hosts, exactly as the torchrun agent does
(``TORCHELASTIC_USE_AGENT_STORE``). The store binds a port the OS picks, so two notebooks never
collide and nothing can take the port between choosing and binding it.

Starting Python and importing torch costs ~2 s a process, so the template pays it once per
environment, and after a successful launch the workers stay alive, idle, for the next launch
in the same kernel (``reuse_workers=True``): a repeat launch starts in well under 0.3 s. Both
are CUDA-safe: the kernel is never forked, and the template never initializes CUDA. The
workers of the last ``IDLE_POOLS`` (2) sizes launched are kept, so that an exercise check, which
runs at 2 and then 3 ranks, starts no process the second time. Idle workers exit with the
kernel (they watch their socket to it) or on :func:`shutdown_workers`. After any failure -- an
exception, a dead rank, a timeout, an interrupt -- every worker is stopped, idle ones included
(SIGTERM, then SIGKILL after a grace period) before the error is raised, together with
every process it started, even one in a session of its own; an interrupt while the workers
start, or while a failure is reported, stops them too. The rendezvous store listens on
127.0.0.1 only, and a ``master_port`` is usable again as soon as the launch that used it ended.

What a reused worker puts back before each job
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A job on a warm worker starts as it would in a fresh interpreter: the list of what is put back,
and of what retires a worker instead, is :mod:`gradsync_tutorial.launcher.fresh_state`'s
docstring. Threads a job left running (a background save) are waited for before the rank
returns, as a process waits for them before it exits (a thread pool's idle threads excepted).

Platforms
~~~~~~~~~
Written for Linux, macOS and Windows, run here on Linux only (see the README). Each rank starts
in a process group of its own (a new session on POSIX, ``CREATE_NEW_PROCESS_GROUP`` on
Windows). Stopping reads the rank's process tree first (``/proc`` on Linux, ``ps`` on macOS)
and signals all of it; Windows has no such signals, and ``taskkill /T /F`` stops the tree. On
Linux a rank also dies with the notebook's process even when stuck in C code
(``PR_SET_PDEATHSIG``: the launcher starts its processes from one long-lived thread,
:mod:`.spawner`, since the signal follows the thread that started a process), and so does
every process it forks from Python; elsewhere the socket
to the notebook is the lifeline, which a rank stuck in C code holding the GIL cannot read. On
POSIX a small reaper forked by each worker kills the rank's process group once the rank is gone,
however it went: the programs a rank started with ``subprocess``, which no parent-death signal
reaches, go with it.
A process that a rank started and that detached itself completely (a daemon that
double-forked) is out of reach everywhere.
"""

from __future__ import annotations

import atexit
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..device import backend_for
from . import pool, template
from .cells import serialize, shown_from_caller
from .errors import timeout_error
from .preflight import check_call, cpu_count, ranks_to_show
from .protocol import PRIVATE_ENV, Job

__all__ = ["launch", "shutdown_workers"]

# Start-up is not part of a launch's timeout: a fresh worker imports torch (2 s here, far more on
# a laptop with an antivirus). It gets max(timeout, STARTUP_SECONDS) of its own.
STARTUP_SECONDS = 60.0
# After fn returned everywhere: the ranks' process-group teardown gets this long of its own.
TEARDOWN_SECONDS = 30.0
# torch's own waits (the store's, a collective's) outlast the launch's timeout by this much,
# so that the launcher's report, which names the ranks, comes first.
RENDEZVOUS_MARGIN_SECONDS = 30.0
# The ranks' output is printed until their end-of-job marks, as long as it keeps coming.
OUTPUT_IDLE_SECONDS = 5.0


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
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``...) and the default
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
        num_threads: ``torch.set_num_threads`` in each rank; default: this process's
            ``OMP_NUM_THREADS`` when it is set, as torchrun leaves it, else CPU cores //
            world_size, at least 1, so that the ranks do not oversubscribe a laptop.
        show_ranks: print only these ranks' output, a list such as ``[0]`` (default: all).
        reuse_workers: keep the processes for the next launch in this kernel (fast restarts).
        master_port: the rendezvous port (on 127.0.0.1); default ``None``: a free port
            picked by the OS.

    Returns:
        The ranks' return values, ordered by rank. Tensors in them arrive on the CPU.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message) or died.
        LaunchTimeoutError: ``timeout`` passed first (typically a rank skipped a collective),
            or, sooner, a rank waits in a collective that a rank which returned never called.
        KeyboardInterrupt: re-raised after every rank has been stopped.

    Example:
        >>> import gradsync_tutorial as gst
        >>> gst.launch(lambda rank, world_size: rank * 10, world_size=2)
        [0, 10]
    """
    # IPython and pytest hide frames that set this: an error cell then shows the rank's
    # traceback (in the message) under the reader's own line, without the launcher's insides.
    __tracebackhide__ = True
    show_ranks = ranks_to_show(show_ranks)  # read once: it may be a generator
    check_call(fn, world_size, args, backend, timeout, num_threads, show_ranks, master_port)
    backend, device = backend_for(backend, world_size)  # the one device rule (device.py)
    payload, sources = serialize(fn, args)
    num_threads = num_threads or _omp_num_threads() or max(1, cpu_count() // world_size)

    # The rendezvous store, hosted here as torchrun's agent hosts it; port 0: the OS picks one.
    store = _rendezvous_store(master_port, timeout + RENDEZVOUS_MARGIN_SECONDS, world_size)
    run_id = uuid.uuid4().hex  # TORCHELASTIC_RUN_ID: one per launch, as one per torchrun
    try:
        workers = _take_workers(world_size, reuse_workers)
    except BaseException:  # they could not all start (and were stopped): release the port
        del store
        _stop_idle_pools()  # a failure leaves no worker behind, the idle ones included
        raise
    state = workers.new_job(show_ranks)
    startup = max(timeout, STARTUP_SECONDS)
    ended_well = False
    try:
        workers.wait_until_started(state, time.monotonic() + startup)
        deadline = time.monotonic() + timeout  # the job's own time starts now
        workers.run(state, [Job(
            state.job_id, payload, _job_env(rank, world_size, store.port, num_threads, run_id),
            os.getcwd(), list(sys.path), backend, device, num_threads,
            collective_timeout=timeout + RENDEZVOUS_MARGIN_SECONDS,  # ours reports it first
            sources=sources,
        ) for rank in range(world_size)], deadline)
        if not state.failures:
            # Every rank returned in time; printing what they wrote takes what it takes. A job
            # that imported a library with process-wide state needs no teardown: its workers
            # are retired.
            workers.tear_down(state, OUTPUT_IDLE_SECONDS, max(timeout, TEARDOWN_SECONDS),
                              destroy_groups=not state.retiring)
            if state.retiring and not state.failures:
                workers.stop_despite_interrupts()  # while the store is up, as on a failure
        if state.failures:  # in the job or its teardown. Stop every rank while the store is
            # up: a rank still joining the rendezvous would print torch's C++ "closed" dump
            error = workers.stop_after_failure(state)
        ended_well = not state.failures
    except (pool.Deadline, pool.WaitsForAReturnedRank) as e:
        early = (time.monotonic() - deadline + timeout  # seconds since the job started
                 if isinstance(e, pool.WaitsForAReturnedRank) else None)
        report = workers.where_each_rank_is(state) if state.sent else ""
        workers.stop()
        raise shown_from_caller(timeout_error(world_size, state.results, timeout, startup,
                                              state.sent, report, early)) from None
    except BaseException:  # KeyboardInterrupt (the kernel's stop button) included
        workers.stop_despite_interrupts()
        raise
    finally:
        del store  # closes the port
        if not ended_well:  # a failure leaves no worker behind, the idle ones included
            _stop_idle_pools()

    if state.failures:
        # from None: the rank's traceback is in the message (error.exception is its exception)
        raise shown_from_caller(error) from None
    return _ended_well(state, workers, world_size, reuse_workers)


def _ended_well(state, workers, world_size: int, reuse_workers: bool) -> list[Any]:
    """Every rank returned: say the job's notes, keep or retire the workers, and give back
    the results (a result that cannot be rebuilt here is raised as the rank's error)."""
    __tracebackhide__ = True
    for note, ranks in state.notes.items():  # once, whichever ranks it is about
        who = ("every rank" if len(ranks) == world_size
               else "rank " + ", ".join(map(str, sorted(ranks))))
        print(f"gst.launch ({who}): {note}", file=sys.stderr, flush=True)
    if state.retiring:
        _say_retired(state.imported, reuse_workers, state.retire)
    else:
        _give_back(workers, reuse_workers)
    results, error = state.rebuilt_results(world_size)
    if error is not None:
        raise shown_from_caller(error) from None
    return results


def _say_retired(imported: set[str], reuse: bool, reasons: Iterable[str] = ()) -> None:
    """A job imported libraries that may keep process-wide state (or did what no reset undoes,
    ``reasons``): say, in one line, that its workers were retired (the next launch starts fresh
    ones, as torchrun starts every run)."""
    if not reuse:
        return
    why = sorted(reasons)
    if imported:
        names = ", ".join(sorted(imported)[:4]) + (", ..." if len(imported) > 4 else "")
        why.insert(0, f"fn imported {names}, which may keep process-wide state (such as "
                   "Accelerate's AcceleratorState)")
    print(f"gst.launch: {'; '.join(why)}, so these workers were retired: the next launch "
          "starts fresh ones (a few seconds). reuse_workers=False says so up front.",
          file=sys.stderr, flush=True)


# -- the idle pool, kept between launches ------------------------------------------------------

IDLE_POOLS = 2  # sizes whose idle workers are kept: an exercise check's 2 and its drawn 3 to 5
_pool_lock = threading.Lock()
_idle: dict[tuple, pool.Workers] = {}  # by pool key, the least recently launched first


def _pool_key(world_size: int) -> tuple:
    return (world_size, sys.executable, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _take_workers(world_size: int, reuse: bool) -> pool.Workers:
    """Return the idle pool of this size if there is one, else freshly started processes
    (``reuse=False``: every idle pool is stopped first)."""
    key = _pool_key(world_size)
    if not reuse:
        _stop_idle_pools()
    with _pool_lock:
        idle = _idle.pop(key, None)
    if idle is not None:
        if idle.alive():
            return idle
        idle.stop_despite_interrupts()
    return pool.Workers(world_size, key)


def _give_back(workers: pool.Workers, reuse: bool) -> None:
    """Keep ``workers`` idle for the next launch (``reuse``), else stop them; beyond
    ``IDLE_POOLS`` sizes, the least recently launched pool is stopped."""
    stop = [workers]
    if reuse:
        with _pool_lock:
            if workers.key not in _idle:  # (a concurrent launch of this size gave one back)
                _idle[workers.key] = workers
                stop = [_idle.pop(next(iter(_idle))) for _ in range(len(_idle) - IDLE_POOLS)]
    for extra in stop:
        extra.stop_despite_interrupts()


def shutdown_workers(keep_templates: bool = False) -> None:
    """Stop every process the launcher keeps: the idle workers kept for the next launch and,
    on Linux, the templates that fork them (all of them also stop with the kernel).

    Call it to free their memory, or after editing a module that your training function
    imports, so that the next launch starts fresh interpreters that import the new code (and
    torch again: a few seconds). ``keep_templates=True`` stops the workers only: the next
    launch forks fresh ones at once from the templates, whose torch was imported before (a
    test suite that wants no worker left between its tests, say).

        >>> import gradsync_tutorial as gst
        >>> gst.shutdown_workers()
    """
    _stop_idle_pools()
    if not keep_templates:
        template.stop_all()


def _stop_idle_pools() -> None:
    """Stop the idle workers (after a failure, or for ``reuse_workers=False``); the templates
    stay, so that the next pool is forked at once."""
    with _pool_lock:
        idle = list(_idle.values())
        _idle.clear()
    for workers in idle:
        workers.stop_despite_interrupts()


atexit.register(shutdown_workers)


def _rendezvous_store(port: int | None, timeout: float, world_size: int):
    """The store every rank's ``env://`` rendezvous connects to, listening on 127.0.0.1 only.

    Its waits last ``timeout``, past the launch's own, which the launcher reports first. Out of
    file descriptors for ``world_size`` ranks, its client would retry that long: told at once.

    torch's ``TCPStore`` listens on every interface; here the launcher binds the socket itself
    to the loopback address and hands it over (``master_listen_fd``), so nothing outside this
    machine can reach it. ``SO_REUSEADDR`` (what torch's own server sets) lets a port whose last
    connections are still in TIME-WAIT -- the launch before this one -- be bound again at once.
    Windows: its ``SO_REUSEADDR`` would let another program take a bound port, and torch's
    ``master_listen_fd`` expects a POSIX descriptor, so there the store binds its port itself.
    """
    import torch.distributed as dist

    pool.require_spare_descriptors(8 + 2 * world_size, world_size)
    kwargs = dict(is_master=True, wait_for_workers=False, timeout=_timedelta(timeout))
    if os.name != "posix":
        return _store_or_port_error(lambda: dist.TCPStore("127.0.0.1", port or 0, **kwargs),
                                    port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Connections the store accepts inherit this: closed, they reset at once instead of
        # holding the port in TIME-WAIT (a rank frees its group, and the store client in it,
        # after telling the launcher it is ready, so the store may close first).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
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


def _omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` of this process when it is a positive whole number (torchrun keeps
    a value it finds set; so does launch), else None."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _job_env(rank: int, world_size: int, port: int, num_threads: int,
             run_id: str) -> dict[str, str]:
    """The notebook's environment (``GRADSYNC_DATA`` and every other variable of the user's),
    without the launcher's own control variables, plus torchrun's."""
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    return dict(env, **_torchrun_env(rank, world_size, port, num_threads, run_id))


def _torchrun_env(rank: int, world_size: int, port: int, num_threads: int,
                  run_id: str) -> dict[str, str]:
    """What torchrun's agent gives each worker of a single-node job: torch's
    ``LocalElasticAgent._start_workers`` (torch 2.14), one node, no restarts.

    ``TORCHELASTIC_RUN_ID`` is what ``torch.distributed.is_torchelastic_launched()`` reads, and
    so what Lightning (``TorchElasticEnvironment``: it then checks devices * nodes against
    WORLD_SIZE) and other libraries detect torchrun by. Left out: ``TORCHELASTIC_ERROR_FILE``
    (torchrun's agent reads a failed rank's error from that file; here it comes back over the
    launcher's socket) and the agent's own ``TORCHELASTIC_SIGNALS_TO_HANDLE``. ``MASTER_ADDR``
    is 127.0.0.1, where the store listens; ``OMP_NUM_THREADS`` is ``num_threads``.
    """
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "OMP_NUM_THREADS": str(num_threads),
    }


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
