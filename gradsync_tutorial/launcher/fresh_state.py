"""What a warm worker puts back before each job, and what retires it: the one list.

A worker runs many jobs; each must start as it would in a fresh interpreter, as far as global
state that training code commonly changes goes. Before every job (:func:`start_job`) a worker
puts back:

* the environment (exactly the notebook's, plus torchrun's variables), ``sys.argv``, the
  working directory, ``sys.path``, ``sys.stdout`` and ``sys.stderr`` (swapped or closed);
* torch's grad mode (on), default dtype (float32) and default device, deterministic algorithms
  and anomaly detection (off), print options and thread count;
* the cudnn flags: benchmark off; deterministic kernels on and TF32 off, so that GPU runs
  repeat bit for bit (the one difference from a fresh interpreter);
* fresh random seeds for torch, ``random`` and numpy, as a new process gets (seed inside
  ``fn`` for reproducible runs);
* the warnings filters (and which warnings were already shown), signal handlers, the
  recursion limit;
* any function of ``builtins``, ``torch``, ``torch.distributed`` or ``torch.nn.functional``,
  and any attribute of the classes in ``torch``, ``torch.nn``, ``torch.optim`` and
  ``torch.distributed``, that a job replaced (``torch.Tensor.__add__`` monkeypatched).

What cannot be put back is a library's process-wide state. A job that imported one of
:data:`STATEFUL_LIBRARIES`, or a module of the user's own from inside ``fn``, retires its
workers (:func:`retiring_imports`): the launch says so in one line, and the next launch starts
fresh interpreters, as every torchrun does. Not reset otherwise: other modules' globals, CUDA
state. ``gst.launch(..., reuse_workers=False)`` gives every launch fresh interpreters.

Used by :mod:`gradsync_tutorial.launcher.worker` only, inside a worker process:

    >>> from gradsync_tutorial.launcher import fresh_state
    >>> "accelerate" in fresh_state.STATEFUL_LIBRARIES
    True
"""

from __future__ import annotations

import functools
import io
import os
import random
import signal
import sys
import warnings

from gradsync_tutorial.launcher.protocol import Job

# -- what a fresh interpreter has, put back before every job ----------------------------------


def start_job(job: Job) -> None:
    """Put back what a fresh interpreter has, then give this job its environment, working
    directory, ``sys.path`` and thread count (call :func:`remember` once before)."""
    import torch

    _put_back_globals()
    # Undo a previous job's swap (or close) of the streams.
    sys.stdout, sys.stderr = original_stream("stdout"), original_stream("stderr")
    os.environ.clear()  # exactly the notebook's environment, plus torchrun's variables
    os.environ.update(job.env, PYTHONUNBUFFERED="1")
    if job.cwd and os.path.isdir(job.cwd):
        os.chdir(job.cwd)
    sys.path[:] = job.sys_path + [p for p in _fresh["sys.path"] if p not in job.sys_path]
    torch.set_num_threads(job.num_threads)


# Modules whose functions notebooks (and tests) monkeypatch; a rebound function is put back.
_PATCHABLE = ("builtins", "torch", "torch.distributed", "torch.nn.functional")
_fresh: dict = {}


def remember() -> None:
    """Called once, before the first job: the state :func:`start_job` puts back."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401

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
    torch.backends.cudnn.benchmark = False
    # Not a fresh interpreter's (False, True): GPU runs that repeat bit for bit, in float32, as
    # the notebooks' checks need (the scripts set the same; CPUs ignore both).
    torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = True, False
    torch.backends.cuda.matmul.allow_tf32 = False
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
    sys.argv = list(_fresh["sys.argv"])  # a job's argparse setup (sys.argv = [...]) is forgotten
    _restore_classes(_fresh["classes"])


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
                      "deepspeed", "transformers", "colossalai", "horovod", "ray", "mpi4py")


def retiring_imports(before: set[str]) -> tuple[str, ...]:
    """What this job loaded that a fresh interpreter would not have: a library of
    :data:`STATEFUL_LIBRARIES`, or a module of the user's own that ``fn`` imported while it ran
    (not from an installed distribution, the standard library or the course's package: a file
    next to the notebook, perhaps edited since, perhaps holding a singleton).

    Modules loaded to unpickle ``fn`` itself (the file a test defines it in) are not counted;
    nor are other installed libraries (tqdm, pandas...): a warm start is worth more there, and
    ``gst.shutdown_workers()`` starts afresh. ``before``: ``sys.modules``' names before fn ran.
    """
    found = {name for name in STATEFUL_LIBRARIES if name in sys.modules}
    if len(sys.modules) != len(before):
        new = {name.partition(".")[0] for name in list(sys.modules) if name not in before}
        found |= {m for m in new if m not in sys.stdlib_module_names and m != "gradsync_tutorial"
                  and _from_a_file(m) and m not in _distributions()}
    return tuple(sorted(found))


def _from_a_file(name: str) -> bool:
    """A module of its own on disk: not ``__main__``, nor a module a compiled extension makes
    for itself (Cython's ``_cython_3_2_4``), which belongs to whoever imported it."""
    module = sys.modules.get(name)
    return not name.startswith("__") and bool(
        getattr(module, "__file__", None) or getattr(module, "__path__", None))


@functools.lru_cache(maxsize=1)
def _distributions() -> dict:
    """Top-level module -> the installed distributions that provide it (read once, lazily)."""
    from importlib.metadata import packages_distributions

    return packages_distributions()


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
