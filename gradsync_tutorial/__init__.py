"""gradsync_tutorial: the plumbing behind the notebooks, so that they can show the lesson.

Every notebook imports it the same way::

    import gradsync_tutorial as gst
    gst.launch(train, world_size=2)

One module per idea of the course, each introduced in a notebook:

* ``launcher`` (a folder): ``launch``, run a notebook function on N ranks (notebook 00);
* ``device``: ``local_device`` and the one "a GPU per rank, else the CPU" rule (notebook 01);
* ``data`` (Fashion-MNIST as in-memory tensors), ``model`` (the course's CNN);
* ``checks`` (are the replicas equal?), ``plots`` (per-rank loss curves), ``notebooks`` (a
  previous notebook's function, and the diff between two);
* ``detect`` (notebook 04's bug detectors), ``averaging`` (notebook 05's averaging variants);
* ``exercises`` (the exercises' self-checks); ``doctor`` (is this machine ready?).

Submodules are imported on first use, so that a rank started by ``gst.launch`` (``python -m
gradsync_tutorial.launcher.worker``) does not pay for matplotlib, and a torchrun script that
imports ``local_device`` loads no launcher.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it; resolved lazily by __getattr__ below.
_EXPORTS = {
    "launch": "launcher",
    "shutdown_workers": "launcher",
    "local_device": "device",
    "LaunchError": "launcher",
    "RankFailedError": "launcher",
    "LaunchTimeoutError": "launcher",
}
_SUBMODULES = ("launcher", "device", "data", "model", "checks", "plots", "detect", "averaging",
               "exercises", "notebooks")

__all__ = sorted(set(_EXPORTS) | set(_SUBMODULES))


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(module, name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
