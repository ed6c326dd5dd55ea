"""What a warm worker puts back before each job, and what retires it: the one list.

A worker runs many jobs; each must start as it would in a fresh interpreter, as far as global
state that training code commonly changes goes. Before every job (:func:`start_job`) a worker
puts back:

* the environment (exactly the notebook's, plus torchrun's variables), ``sys.argv``, the
  working directory, ``sys.path``, ``sys.stdout`` and ``sys.stderr`` (swapped or closed);
* torch's grad mode (on), default dtype (float32) and default device, deterministic algorithms
  and anomaly detection (off), print options and thread count;
* float32 precision, in both of torch's APIs (``set_float32_matmul_precision`` and
  ``allow_tf32``, and every ``fp32_precision``); the cudnn flags: benchmark off; deterministic
  kernels on and TF32 off, so that GPU runs repeat bit for bit (the one difference from a fresh
  interpreter);
* fresh random seeds for torch, ``random`` and numpy, as a new process gets (seed inside
  ``fn`` for reproducible runs);
* the warnings filters (and which warnings were already shown), signal handlers, a pending
  ``signal.alarm`` (cancelled), the recursion limit, the logging configuration (the root's and
  every logger's level and handlers, a library's included: ``basicConfig`` inside ``fn``
  works every time; ``logging.captureWarnings``);
* file descriptors 1 and 2 (a job's ``os.close(1)``);
* the process's settings that its children inherit: the umask, the soft and hard resource
  limits (a job's lowered open-file limit), the CPU affinity and the niceness. One that
  cannot be raised back (an unprivileged process's lowered hard limit or raised niceness)
  retires the worker (:func:`retire_reasons`);
* the ``atexit`` handlers the job's own code registered (``atexit.register(log.close)``): run
  when the job ends, after its threads, the last registered first, as an interpreter's exit
  runs them (:func:`run_exit_handlers`), then forgotten, so they neither pile up nor run
  again;
* any function of :data:`_PATCHABLE`'s modules (``builtins``, ``torch``, ``torch.autograd``,
  ``torch.nn.init``, ``torch.nn.functional``...), any attribute of the classes in ``torch``,
  ``torch.nn``, ``torch.optim`` and ``torch.distributed``, that a job replaced
  (``torch.Tensor.__add__`` monkeypatched), and the global module and optimizer hooks
  (``register_module_forward_hook``);
* a module of the user's own that ``fn`` is pickled from, edited since (and
  ``importlib.reload``-ed in the notebook): imported again, so the ranks run the new code.

What cannot be put back is a library's process-wide state. A job that imported one of
:data:`STATEFUL_LIBRARIES`, or a module of the user's own from inside ``fn`` (never a file
under site-packages or the standard library), retires its workers (:func:`retiring_imports`);
so does a call of ``torch.set_num_interop_threads``, which a process can make only once
(:func:`retire_reasons`), and a daemon thread of ``fn``'s own left running (the worker's
``_daemons_left``: under torchrun it would end with the rank). The launch says so in one
line, and the next launch starts fresh interpreters, as every torchrun does. Not reset
otherwise: other modules' globals, CUDA state. ``gst.launch(..., reuse_workers=False)`` gives
every launch fresh interpreters.

Used by :mod:`gradsync_tutorial.launcher.worker` only, inside a worker process:

    >>> from gradsync_tutorial.launcher import fresh_state
    >>> "accelerate" in fresh_state.STATEFUL_LIBRARIES
    True
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import random
import signal
import sys
import traceback
import types
import warnings

from gradsync_tutorial.launcher.protocol import Job

# -- what a fresh interpreter has, put back before every job ----------------------------------


def start_job(job: Job) -> None:
    """Put back what a fresh interpreter has, then give this job its environment, working
    directory, ``sys.path`` and thread count (call :func:`remember` once before)."""
    import torch

    _put_back_globals()
    _forget_edited_modules()
    _once_called.clear()
    _exit_handlers.clear()
    put_back_descriptors()
    put_back_process_settings()
    # Undo a previous job's swap (or close) of the streams.
    sys.stdout, sys.stderr = original_stream("stdout"), original_stream("stderr")
    os.environ.clear()  # exactly the notebook's environment, plus torchrun's variables
    os.environ.update(job.env, PYTHONUNBUFFERED="1")
    if job.cwd and os.path.isdir(job.cwd):
        os.chdir(job.cwd)
    sys.path[:] = job.sys_path + [p for p in _fresh["sys.path"] if p not in job.sys_path]
    torch.set_num_threads(job.num_threads)


# Modules whose functions notebooks (and tests) monkeypatch; a rebound function is put back.
_PATCHABLE = ("builtins", "torch", "torch.distributed", "torch.nn.functional", "torch.autograd",
              "torch.nn.init", "torch.nn.utils", "torch.nn.modules.module", "torch.optim.optimizer",
              "torch.utils.checkpoint", "torch.amp", "torch.cuda", "torch.linalg", "torch.random")
# Modules whose ``_global_*`` hooks a job may register (register_module_forward_hook, an
# optimizer's register_optimizer_step_pre_hook): emptied as a fresh interpreter has them.
_HOOK_MODULES = ("torch.nn.modules.module", "torch.optim.optimizer")
_fresh: dict = {}


def remember() -> None:
    """Called once, before the first job: the state :func:`start_job` puts back."""
    import importlib
    import logging

    import torch

    for name in _PATCHABLE:
        importlib.import_module(name)
    _course_precision()
    _watch_once_per_process()  # before the snapshot: the watcher is what jobs find
    _watch_exit_handlers()
    put_back_descriptors()  # the first call copies them
    _fresh["process"] = _process_settings()
    _fresh["sys.path"] = list(sys.path)
    _fresh["sys.argv"] = list(sys.argv)
    _fresh["classes"] = {cls: dict(vars(cls)) for cls in _patchable_classes()}
    _fresh["warnings"] = list(warnings.filters)
    _fresh["recursionlimit"] = sys.getrecursionlimit()
    _fresh["signals"] = {s: signal.getsignal(s) for s in signal.valid_signals()
                         if signal.getsignal(s) is not None}
    _fresh["functions"] = {
        name: {k: v for k, v in vars(sys.modules[name]).items() if callable(v)}
        for name in _PATCHABLE
    }
    _fresh["hooks"] = {name: {k: (dict(v) if isinstance(v, dict) else v)
                              for k, v in vars(sys.modules[name]).items()
                              if k.startswith("_global_")} for name in _HOOK_MODULES}
    _fresh["matmul precision"] = torch.get_float32_matmul_precision()
    _fresh["fp32_precision"] = [(holder, holder.fp32_precision) for holder in _fp32_holders()]
    _fresh["modules"] = set(sys.modules)
    _fresh["showwarning"] = warnings.showwarning
    _fresh["logging"] = (logging.root.manager.disable, {
        logger: (logger.level, list(logger.handlers), logger.propagate, logger.disabled)
        for logger in [logging.root, *logging.root.manager.loggerDict.values()]
        if isinstance(logger, logging.Logger)})


def _put_back_globals() -> None:
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
    _put_back_precision()
    # Fresh random state, as a new interpreter gets (fn seeds it itself for reproducibility).
    # Not torch.seed(): on a machine without CUDA it queues a call for each accelerator type
    # (with its stack) that runs only if one is ever initialized, every job.
    torch.default_generator.seed()
    if torch.cuda.is_initialized():
        torch.cuda.seed_all()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    warnings.filters[:] = _fresh["warnings"]
    if hasattr(warnings, "_filters_mutated"):
        warnings._filters_mutated()  # forget which warnings were already shown once
    sys.setrecursionlimit(_fresh["recursionlimit"])
    cancel_alarms()
    for sig, handler in _fresh["signals"].items():
        if signal.getsignal(sig) is not handler:
            try:
                signal.signal(sig, handler)
            except (OSError, ValueError, TypeError):
                pass
    _put_back_functions()
    sys.argv = list(_fresh["sys.argv"])  # a job's argparse setup (sys.argv = [...]) is forgotten
    _restore_classes(_fresh["classes"])
    _put_back_logging()


def _course_precision() -> None:
    """cudnn's flags as the course runs: not a fresh interpreter's (False, True), so that GPU
    runs repeat bit for bit, in float32, as the notebooks' checks need (the scripts set the
    same; CPUs ignore both). Set once, before :func:`remember` reads them."""
    import torch

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = True, False
    torch.backends.cuda.matmul.allow_tf32 = False


def _fp32_holders() -> list:
    """torch's objects with an ``fp32_precision`` (the API that replaces ``allow_tf32``),
    each backend before its operators: setting a backend's sets its operators'."""
    import torch

    backends = torch.backends
    holders = [backends, backends.cuda.matmul, backends.cudnn, backends.cudnn.conv,
               backends.cudnn.rnn, backends.mkldnn, backends.mkldnn.matmul,
               backends.mkldnn.conv, backends.mkldnn.rnn]
    return [h for h in holders if hasattr(h, "fp32_precision")]  # (torch >= 2.9)


def _put_back_precision() -> None:
    """Float32 precision as :func:`remember` found it, in both of torch's APIs.

    torch keeps the old flags (``set_float32_matmul_precision``, ``allow_tf32``) and the new
    ``fp32_precision`` apart, and its getters raise ("a mix of the legacy and new APIs") when
    they disagree: so each is put back, the old first, then every ``fp32_precision``."""
    import torch

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.set_float32_matmul_precision(_fresh["matmul precision"])
    torch.backends.cudnn.allow_tf32 = False  # the old flag: its getter reads no new one
    for holder, precision in _fresh["fp32_precision"]:
        if holder.fp32_precision != precision:
            holder.fp32_precision = precision


def _put_back_functions() -> None:
    """Functions a job rebound in :data:`_PATCHABLE`'s modules, and the global hooks it
    registered in :data:`_HOOK_MODULES`' (emptied in place: their handles hold the dicts)."""
    for name, functions in _fresh["functions"].items():
        namespace = vars(sys.modules[name])
        with contextlib.suppress(Exception):  # (a replaced value whose == raises: it changed)
            if functions.items() <= namespace.items():  # in C: nothing was rebound (~0.1 ms)
                continue
        for attr, original in functions.items():
            if namespace.get(attr) is not original:
                namespace[attr] = original
    for name, hooks in _fresh["hooks"].items():
        namespace = vars(sys.modules[name])
        for attr, fresh in hooks.items():
            current = namespace.get(attr)
            if isinstance(fresh, dict) and isinstance(current, dict):
                if current != fresh:
                    current.clear()
                    current.update(fresh)
            elif current is not fresh:
                namespace[attr] = fresh


def _put_back_logging() -> None:
    """The logging configuration a job set (``basicConfig``, a logger's level or handlers,
    ``captureWarnings``): loggers as they were, and those a job created as ``getLogger``
    makes them (a library's too, ``numpy``'s, unless the library was imported since)."""
    import logging

    if warnings.showwarning is not _fresh["showwarning"]:  # logging.captureWarnings(True)
        logging.captureWarnings(False)
        warnings.showwarning = _fresh["showwarning"]
    disable, loggers = _fresh["logging"]
    if logging.root.manager.disable != disable:  # (each call clears every logger's cache)
        logging.disable(disable)
    for logger in [logging.root, *logging.root.manager.loggerDict.values()]:
        if not isinstance(logger, logging.Logger):
            continue
        if logger not in loggers and _made_at_a_librarys_import(logger.name):
            continue  # torch._dynamo's, made as a job imported it: its own, not made again
        level, handlers, propagate, disabled = loggers.get(
            logger, (logging.NOTSET, [], True, False))
        if logger.handlers != handlers:
            logger.handlers[:] = handlers
        if logger.level != level:
            logger.setLevel(level)  # (clears the loggers' cached levels)
        logger.propagate, logger.disabled = propagate, disabled


def _made_at_a_librarys_import(name: str) -> bool:
    """Is ``name`` the logger of a library module imported since the worker started, or of a
    child of one (torch's ``torch._dynamo.guards.__guards``)? Such a logger was made, and may
    be configured, by the library's import, which will not run again: it is left as it is. A
    logger of a module imported before (``torch.nn.parallel``) was made by whoever asked."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(prefix := ".".join(parts[:i]))
        if module is not None:
            return prefix not in _fresh["modules"] and not users_own(module)
    return False


def cancel_alarms() -> None:
    """Cancel a pending ``signal.alarm`` or interval timer of a job: it would kill the next
    job, or the worker while it waits for one (SIGALRM ends a process)."""
    if hasattr(signal, "alarm"):
        signal.alarm(0)
    for timer in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF"):
        if hasattr(signal, timer):
            signal.setitimer(getattr(signal, timer), 0)


# The classes whose attributes jobs monkeypatch (torch.Tensor.__add__, nn.Module.__call__,
# nn.Linear.forward, an optimizer's step): every class in these modules' namespaces.
_CLASS_MODULES = ("torch", "torch.nn", "torch.nn.functional", "torch.optim", "torch.distributed")
# Where a job's *new* attributes are removed too (elsewhere torch itself may add some lazily).
_CLOSED_CLASSES = ("Tensor", "Module", "Parameter")


def _patchable_classes() -> list[type]:
    import torch.nn  # noqa: F401
    import torch.optim  # noqa: F401

    found = {}
    with warnings.catch_warnings():  # torch.distributed.reduce_op warns when looked at
        warnings.simplefilter("ignore")
        for name in _CLASS_MODULES:
            for value in list(vars(sys.modules[name]).values()):
                if isinstance(value, type) and str(vars(value).get("__module__", "")
                                                   ).startswith("torch"):
                    found[id(value)] = value
    return list(found.values())


def _restore_classes(fresh: dict[type, dict]) -> None:
    """Put back every attribute a job replaced or deleted on torch's classes.

    Comparing each class's dict with its copy runs in C and matches identical values by
    identity first: about 0.2 ms for the ~360 classes, when nothing changed."""
    for cls, attributes in fresh.items():
        current = vars(cls)
        try:
            if current == attributes:
                continue
        except Exception:  # noqa: BLE001 - a replaced value whose == raises: it changed
            pass
        for k, v in attributes.items():
            if current.get(k, _MISSING) is not v:
                setattr(cls, k, v)
        if cls.__name__ in _CLOSED_CLASSES:
            for k in [k for k in current if k not in attributes]:
                delattr(cls, k)


_MISSING = object()


# -- libraries with process-wide state: a job that imported one retires its workers -----------

# Libraries that keep a process-wide state a later job would inherit (Accelerate's
# AcceleratorState and PartialState, Lightning's and DeepSpeed's launch state, ...): after a job
# that imported one, its workers are retired, as if each launch were a new torchrun.
STATEFUL_LIBRARIES = ("accelerate", "lightning", "lightning_fabric", "pytorch_lightning",
                      "deepspeed", "transformers", "colossalai", "horovod", "ray", "mpi4py",
                      "datasets")  # datasets: disable_caching(), disable_progress_bars()


def retiring_imports(before: set[str]) -> tuple[str, ...]:
    """What this job loaded that a fresh interpreter would not have: a library of
    :data:`STATEFUL_LIBRARIES`, or a module of the user's own that ``fn`` imported while it ran
    (not from an installed distribution, the standard library or the course's package: a file
    next to the notebook, perhaps edited since, perhaps holding a singleton).

    Modules loaded to unpickle ``fn`` itself (the file a test defines it in) are not counted
    (a stateful library among them retires the workers too, told by :func:`retire_reasons`);
    nor are other installed libraries (tqdm, pandas...): a warm start is worth more there, and
    ``gst.shutdown_workers()`` starts afresh. ``before``: ``sys.modules``' names before fn ran.
    """
    found = {name for name in STATEFUL_LIBRARIES if name in sys.modules} - set(_stateful_for_fn)
    if len(sys.modules) != len(before):
        new = {name.partition(".")[0] for name in list(sys.modules) if name not in before}
        found |= {m for m in new if m not in sys.stdlib_module_names and m != "gradsync_tutorial"
                  and _from_a_file(m) and m not in _distributions()}
    return tuple(sorted(found))


def _from_a_file(name: str) -> bool:
    """A module of its own on disk, outside the installed and the standard libraries: not
    ``__main__``, nor a module a compiled extension makes for itself (Cython's
    ``_cython_3_2_4``, pandas' ``_cyutility``), which belongs to whoever imported it."""
    module = sys.modules.get(name)
    files = [getattr(module, "__file__", None), *(getattr(module, "__path__", None) or ())]
    files = [f for f in files if isinstance(f, str)]
    return not name.startswith("__") and bool(files) and not any(
        installed_or_standard(f) for f in files)


@functools.lru_cache(maxsize=1)
def _distributions() -> dict:
    """Top-level module -> the installed distributions that provide it (read once, lazily)."""
    from importlib.metadata import packages_distributions

    return packages_distributions()


# -- what no reset undoes: reasons to retire the worker ----------------------------------------

_once_called: list[str] = []  # this job's calls of torch's once-per-process setters


def _watch_once_per_process() -> None:
    """Note a call of ``torch.set_num_interop_threads``: a process may call it once, so a
    worker where a job called it cannot run the next job that does (see :func:`retire_reasons`).
    Installed once, at start-up."""
    import torch

    original = torch.set_num_interop_threads

    @functools.wraps(original)
    def set_num_interop_threads(num: int) -> None:
        _once_called.append("torch.set_num_interop_threads")
        return original(num)

    torch.set_num_interop_threads = set_num_interop_threads


# -- the process's settings that its children inherit ------------------------------------------


def _resource_limits() -> dict[str, tuple[int, int]]:
    """Every resource limit this platform has, by name (``RLIMIT_NOFILE``...); {} without."""
    try:
        import resource
    except ImportError:  # Windows
        return {}
    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            with contextlib.suppress(OSError, ValueError):
                limits[name] = resource.getrlimit(getattr(resource, name))
    return limits


def _process_settings() -> dict:
    """The umask, resource limits, CPU affinity and niceness, as they are now."""
    umask = os.umask(0o022)
    os.umask(umask)  # reading the umask sets it: put it back
    settings = {"umask": umask, "limits": _resource_limits()}
    if hasattr(os, "sched_getaffinity"):
        settings["affinity"] = os.sched_getaffinity(0)
    if hasattr(os, "getpriority"):
        settings["niceness"] = os.getpriority(os.PRIO_PROCESS, 0)
    return settings


def put_back_process_settings() -> None:
    """Put back the umask, limits, affinity and niceness :func:`remember` found (those a
    job changed); what cannot be put back is left, and :func:`retire_reasons` says it."""
    fresh = _fresh["process"]
    os.umask(fresh["umask"])
    if fresh["limits"]:
        import resource

        for name, limit in fresh["limits"].items():
            if resource.getrlimit(getattr(resource, name)) != limit:
                with contextlib.suppress(OSError, ValueError):  # a lowered hard limit
                    resource.setrlimit(getattr(resource, name), limit)
    if "affinity" in fresh and os.sched_getaffinity(0) != fresh["affinity"]:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, fresh["affinity"])
    if "niceness" in fresh and os.getpriority(os.PRIO_PROCESS, 0) != fresh["niceness"]:
        with contextlib.suppress(OSError):  # an unprivileged process cannot lower it
            os.setpriority(os.PRIO_PROCESS, 0, fresh["niceness"])


def _settings_left() -> list[str]:
    """The settings of :func:`_process_settings` that this job changed and that cannot be put
    back, in words; a try, so the next job (or nothing) finds them as they were."""
    put_back_process_settings()
    now, fresh = _process_settings(), _fresh["process"]
    left = [f"lowered {name}" for name, limit in fresh["limits"].items()
            if now["limits"].get(name) != limit]
    if now.get("niceness") != fresh.get("niceness"):
        left.append("raised its niceness")
    if now.get("affinity") != fresh.get("affinity"):
        left.append("narrowed its CPU affinity")
    return left


def retire_reasons() -> tuple[str, ...]:
    """Why this worker cannot run another job as a fresh interpreter would, in words for the
    launch's note ("fn called torch.set_num_interop_threads, which ..."); () if it can."""
    reasons = []
    left = _settings_left()
    if left:
        reasons.append(f"fn {' and '.join(left)}, which this process cannot undo")
    if _once_called:
        reasons.append("fn called torch.set_num_interop_threads, which a process can call only "
                       "once")
    if _stateful_for_fn:
        # Not "fn imported": fn's module (or an argument's) did, as the worker unpickled them.
        reasons.append(f"loading fn's module (or its arguments) imported "
                       f"{', '.join(_stateful_for_fn)}, which may keep process-wide state")
    return tuple(reasons)


# -- the job's atexit handlers, run when it ends ------------------------------------------------

_exit_handlers: list[tuple] = []  # (function, args, kwargs) the job's own code registered


def _watch_exit_handlers() -> None:
    """Note each ``atexit`` handler that the user's code registers (a library's, such as
    ``weakref.finalize``'s, stays for the process). Installed once, at start-up."""
    import atexit

    register, unregister = atexit.register, atexit.unregister

    @functools.wraps(register)
    def register_noted(func, *args, **kwargs):
        if not installed_or_standard(os.path.abspath(sys._getframe(1).f_code.co_filename)):
            _exit_handlers.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    @functools.wraps(unregister)
    def unregister_noted(func):
        _exit_handlers[:] = [h for h in _exit_handlers if h[0] != func]
        return unregister(func)

    atexit.register, atexit.unregister = register_noted, unregister_noted


def run_exit_handlers() -> None:
    """The job ended (after its threads): run the ``atexit`` handlers its code registered, the
    last registered first, as an interpreter's exit does (one that raises is shown, and the
    others still run), and forget them."""
    import atexit

    unregister = getattr(atexit.unregister, "__wrapped__", atexit.unregister)
    while _exit_handlers:
        func, args, kwargs = _exit_handlers.pop()
        unregister(func)  # from the process's list: run once, here
        try:
            func(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - shown as Python shows it at exit
            print(f"Exception ignored in atexit callback {func!r}:", file=sys.stderr)
            traceback.print_exc()


# -- the user's own modules, as edited since -----------------------------------------------------

_loaded_for_fn: dict[str, tuple[str, int, int]] = {}  # module -> its file, mtime, size
_stateful_for_fn: list[str] = []  # this job's STATEFUL_LIBRARIES imported to unpickle fn


def note_loaded_for_fn(before: set[str]) -> None:
    """Remember the files of the user's own modules that unpickling ``fn`` imported (``fn``
    lives in a module next to the notebook, pickled by its name), and the stateful libraries
    it imported (they retire the workers, see :func:`retire_reasons`). ``before``:
    sys.modules' names before."""
    _stateful_for_fn[:] = [n for n in STATEFUL_LIBRARIES if n in sys.modules and n not in before]
    for name in [n for n in list(sys.modules) if n not in before]:
        path = getattr(sys.modules[name], "__file__", None)
        if path and not installed_or_standard(path):
            with contextlib.suppress(OSError):
                stat = os.stat(path)
                _loaded_for_fn[name] = (path, stat.st_mtime_ns, stat.st_size)


def _forget_edited_modules() -> None:
    """A module of the user's own whose file changed since a job imported it (edited, and
    ``importlib.reload``-ed in the notebook) is imported again, as a fresh process would."""
    for name, (path, mtime, size) in list(_loaded_for_fn.items()):
        try:
            stat = os.stat(path)
            unchanged = (stat.st_mtime_ns, stat.st_size) == (mtime, size)
        except OSError:
            unchanged = False
        if not unchanged:
            del _loaded_for_fn[name]
            sys.modules.pop(name, None)


def users_own(module: types.ModuleType) -> bool:
    """Is ``module`` a file of the user's own (not of an installed or the standard library)?"""
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and not installed_or_standard(path)


def installed_or_standard(path: str) -> bool:
    """Is ``path`` a file of an installed library or of the standard library (never a module
    of the user's own, whatever its name: pandas' compiled ``_cyutility`` is one)?"""
    folders = {os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep}
    if any(folder in path for folder in folders):
        return True
    return any(path.startswith(root + os.sep) for root in _standard_roots())


@functools.lru_cache(maxsize=1)
def _standard_roots() -> tuple[str, ...]:
    """The standard library's folders, and the installed libraries' (read once)."""
    import site
    import sysconfig

    roots = {sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    with contextlib.suppress(AttributeError):  # (a virtual environment's old site.py)
        roots.update(site.getsitepackages())
    return tuple(sorted(os.path.abspath(r) for r in roots if r))


# -- the standard streams --------------------------------------------------------------------

_descriptors: dict[int, int] = {}  # 1 and 2 -> a copy of each, made at start-up


def put_back_descriptors() -> None:
    """File descriptors 1 and 2 as at start-up (the pipes to the launcher), after a job
    closed one (``os.close(1)``) or pointed it elsewhere (``os.dup2``): a fresh process has
    them, and the launcher reads each job's end mark there."""
    for fd in (1, 2):
        if fd not in _descriptors:
            with contextlib.suppress(OSError):
                _descriptors[fd] = os.dup(fd)  # not inherited by programs a job starts
            continue
        try:
            saved = os.fstat(_descriptors[fd])
        except OSError:  # a job closed the copy too (os.closerange): nothing to put back
            del _descriptors[fd]
            continue
        try:
            now = os.fstat(fd)
            same = (now.st_dev, now.st_ino) == (saved.st_dev, saved.st_ino)
        except OSError:  # closed
            same = False
        if not same:
            with contextlib.suppress(OSError):
                os.dup2(_descriptors[fd], fd)


def original_stream(name: str) -> io.TextIOBase | None:
    """``sys.__stdout__`` (or ``__stderr__``), opened again if a job closed it; None if its
    file descriptor itself is gone."""
    stream = getattr(sys, f"__{name}__")
    if stream is not None and not stream.closed:
        return stream
    fd = 1 if name == "stdout" else 2
    try:
        os.fstat(fd)
    except OSError:
        return None
    stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                              errors="backslashreplace", line_buffering=True,
                              write_through=True)
    setattr(sys, f"__{name}__", stream)
    return stream
