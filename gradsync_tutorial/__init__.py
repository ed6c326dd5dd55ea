"""gradsync_tutorial: the plumbing behind the notebooks, so that they can show the lesson.

Every notebook imports it the same way::

    import gradsync_tutorial as gst
    gst.launch(train, world_size=2)

One module per idea of the course, each introduced in a notebook that its docstring names
(``data``, ``model``, ``checks``, ``plots``, ``notebooks``, ``detect``, ``averaging``, ...;
CONTRIBUTING.md's "Repository layout" lists them all). Two are the course's machinery rather
than a lesson: ``launcher`` (a folder), behind ``gst.launch``, which runs a notebook function
on N ranks (notebook 00), and ``device``, behind ``gst.local_device``, the one "a GPU per
rank, else the CPU" rule. ``exercises`` holds the exercises' self-checks, ``doctor`` checks a
machine.

Every module is ``gst.<name>``, imported on first use, so that a rank started by ``gst.launch``
(``gradsync_tutorial.launcher.worker``) does not pay for matplotlib, and a torchrun
script that imports ``local_device`` loads no launcher.
"""

from __future__ import annotations

import importlib
import pkgutil

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
# Every module and folder of the package is gst.<name>, found rather than listed: a new lesson
# module needs no line here.
_SUBMODULES = tuple(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))

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
