"""The call to ``gst.launch``, checked before any process starts: every bad argument gets a
message that names it, the value received and what to do.

Also what this machine can start: a rank is a whole Python process with torch imported, so a
``world_size`` beyond the memory or the file-descriptor limit is refused with the largest that
fits, before the machine swaps or a start fails half-way with "Too many open files".

    >>> check_call(lambda rank, world_size: 0, 2, (), "mpi", 10.0, None, None, None)
    Traceback (most recent call last):
    ValueError: unknown backend 'mpi': use one of auto, gloo, nccl ('auto' picks nccl ...

Part of ``gst.launch`` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import errno
import inspect
import math
import os
import sys
from collections.abc import Iterable

from .._wording import require_int

#: What to do when this process has too few file descriptors for the ranks (said once).
DESCRIPTOR_ADVICE = "raise the limit with `ulimit -n` before starting Jupyter"

BACKENDS = ("auto", "gloo", "nccl")
MAX_TIMEOUT = 1e9  # seconds (31 years): past it, datetime.timedelta overflows


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


# What one rank costs, to refuse a world_size the machine cannot start (see max_world_size).
RANK_MEMORY_BYTES = 300 * 2**20  # private memory of an idle rank (Python + torch), measured
RANK_FILE_DESCRIPTORS = 8  # held open in the notebook per rank: pipes, sockets, store links


def max_world_size() -> tuple[int, str]:
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
                       f"process and its limit is {soft} ({DESCRIPTOR_ADVICE})"))
    return min(limits, default=(sys.maxsize, ""))


def _open_descriptors() -> int:
    for folder in ("/proc/self/fd", "/dev/fd"):  # Linux, macOS
        try:
            return len(os.listdir(folder))
        except OSError as e:
            if e.errno == errno.EMFILE:  # none left even to list them: all are taken
                return sys.maxsize // 2
            continue
    return 64


THREADS_PER_CORE = 64  # the most OMP_NUM_THREADS a rank is given per core of this machine


def check_omp_num_threads(value: str) -> None:
    """Refuse an ``OMP_NUM_THREADS`` that each rank would take as its thread count but cannot
    use: digits that are not ASCII (``'²'``), or more threads than the machine could run (a
    20-digit value). Anything else that is not a number is ignored, as torch ignores it.

        >>> check_omp_num_threads("4"), check_omp_num_threads("not a number")
        (None, None)
        >>> check_omp_num_threads("²")
        Traceback (most recent call last):
        ValueError: OMP_NUM_THREADS='²' in this process's environment is not a number of ...
    """
    value = value.strip()
    if not value.isdigit():
        return
    limit = THREADS_PER_CORE * cpu_count()
    if value.isascii() and 0 <= int(value) <= limit:
        return
    raise ValueError(
        f"OMP_NUM_THREADS={value[:30]!r} in this process's environment is not a number of "
        f"threads a rank can use (gst.launch gives it to each rank as its thread count). Set "
        f"it to a whole number from 1 to {limit} in the digits 0-9, such as "
        f"os.environ['OMP_NUM_THREADS'] = '1', or remove it (del os.environ['OMP_NUM_THREADS']: "
        "each rank then gets CPU cores // world_size), or pass num_threads=.")


def check_call(fn, world_size, args, backend, timeout, num_threads, show_ranks, master_port):
    _check_working_directory()
    require_int(world_size, "world_size", what="the number of ranks", hint="Try world_size=2.")
    limit, why = max_world_size()
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
                f"{2 + len(args)} positional arguments ({e}). "
                + _how_to_launch(name, sig, len(args))
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
                    hint="Leave num_threads=None for OMP_NUM_THREADS if set, else CPU cores // "
                         "world_size.")
    else:
        check_omp_num_threads(os.environ.get("OMP_NUM_THREADS", ""))
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
        raise ValueError(f"master_port must be an int port number in 1..65535, or 0 or None "
                         f"(launch picks a free port), got {master_port!r}.")


def ranks_to_show(show_ranks) -> tuple | None:
    """``show_ranks`` read once: a generator or a range work, a single rank gets a hint."""
    if show_ranks is None:
        return None
    if isinstance(show_ranks, (str, bytes)) or not isinstance(show_ranks, Iterable):
        raise TypeError(f"show_ranks must be a list of ranks, got {type(show_ranks).__name__} "
                        f"{show_ranks!r}. For one rank write show_ranks=[{show_ranks!r}].")
    return tuple(show_ranks)


def _how_to_launch(name: str, sig: inspect.Signature, n_args: int) -> str:
    """What to write instead: a lambda for an entry point that takes only its own arguments
    (a torchrun-style ``main()``; Accelerate's ``training_function(config, args)``, which
    ``notebook_launcher(fn, args=...)`` calls without a rank), else the signature launch wants."""
    define = f"Define it as `def {name}(rank, world_size{', ...' if n_args else ''}):`"
    if _takes_no_arguments(sig) and not n_args:
        return (f"{define}, or, for a torchrun-style entry point that reads RANK and "
                f"WORLD_SIZE itself, launch `lambda rank, world_size: {name}()`.")
    try:
        sig.bind(*range(n_args))
    except TypeError:
        return f"{define}."
    params = [p.name for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:n_args]
    names = ", ".join(params) if len(params) == n_args else ", ".join(
        f"arg{i}" for i in range(n_args))
    return (f"It takes the args themselves, as accelerate's notebook_launcher(fn, args=...) "
            f"calls it: launch it the same way with `gst.launch(lambda rank, world_size: "
            f"{name}({names}), world_size=...)` where {names} are the values you passed in "
            f"args (the ranks read RANK and WORLD_SIZE from the environment, as under "
            f"torchrun). Or {define[0].lower()}{define[1:]}.")


def _takes_no_arguments(sig: inspect.Signature) -> bool:
    return all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.KEYWORD_ONLY)
               for p in sig.parameters.values())


def _check_working_directory() -> None:
    """The ranks start in this process's working directory: it must still exist."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise FileNotFoundError(
            "this process's working directory was removed (or moved), and the ranks start in "
            "it. Change to a folder that exists, such as os.chdir(os.path.expanduser('~')) or "
            "the notebook's own folder, then launch again.") from None
