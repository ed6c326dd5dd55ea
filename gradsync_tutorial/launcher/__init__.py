"""The launcher: run a function defined in a notebook cell on N ranks (``gst.launch``).

Introduced in ``notebooks/00_launching_workers.ipynb``. The notebooks meet it as
``gst.launch``, ``gst.shutdown_workers`` and the errors ``gst.LaunchError``,
``gst.RankFailedError`` and ``gst.LaunchTimeoutError``; everything else in this folder is
machinery that a lesson never opens:

* ``run``: :func:`launch`, the story of one launch from the call to the results, and the idle
  workers kept between launches (:func:`shutdown_workers`);
* ``preflight``: the call checked before any process starts;
* ``cells``: functions from notebook cells, sent with their lines and named ``Cell In[n]``;
* ``pool``: the worker processes seen from the launcher (output, messages, the steps of a job)
  and what it knows of a job (results, failure records);
* ``process_tree``: stopping a rank and every process below it, per platform;
* ``template``: (Linux) one process per environment that imports torch once and forks the ranks;
* ``worker``: the worker's own side, ``python -m gradsync_tutorial.launcher.worker``;
* ``protocol``: what the two sides say to each other, and the names they share;
* ``errors``: the failure records' wording and the errors raised from them;
* ``hang_report``: where each rank was when a launch timed out;
* ``own_group``: ``fn``'s own ``init_process_group``, inside a launch.

Imports go one way, from ``run`` down to ``protocol``; nothing here imports ``run``, and only
``worker`` (with ``hang_report`` and ``own_group``, which it uses) runs in the ranks, after
``template`` forked them.

Names are resolved on first use (as in the package itself), so that the worker, which imports
this folder too, loads only what it needs.

    >>> from gradsync_tutorial.launcher import launch
    >>> launch(lambda rank, world_size: rank, world_size=2)
    [0, 1]
"""

from __future__ import annotations

import importlib

# name -> module of this folder that defines it
_EXPORTS = {
    "launch": "run",
    "shutdown_workers": "run",
    "LaunchError": "errors",
    "RankFailedError": "errors",
    "LaunchTimeoutError": "errors",
    "Failure": "errors",
    "HANG_HINT": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
