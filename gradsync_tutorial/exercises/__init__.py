"""Exercises with self-checks: run your function against the reference, learn what is wrong.

Each notebook ends with an exercise: you write one function in a cell, then pass it to its
check. The check runs it the way the course runs code, on 2 ranks with ``gst.launch`` (gloo, on
the CPU, whatever the machine), on a small model and small random data, next to the reference
computation, so it takes a second or two:

    >>> import gradsync_tutorial as gst
    >>> def average_gradients_flat(model):
    ...     raise NotImplementedError  # the stub: the check says "not attempted yet"
    >>> gst.exercises.check_average_gradients_flat(average_gradients_flat)  # doctest: +SKIP
    ... not attempted yet: average_gradients_flat still raises NotImplementedError. ...

Every ``check_<name>(fn)`` answers in one of three ways (it returns None: a notebook cell
shows the status line only):

* **correct**: it prints ``✓ correct: ...`` (what was verified);
* **wrong**: it raises :class:`ExerciseFailed`, an ``AssertionError`` whose message says
  precisely what is wrong and what to try, e.g. "your gradients are 2.0× the expected ones: did
  you divide by the world size?", so the notebook cell fails loudly;
* **not attempted**: your function still raises ``NotImplementedError`` (the notebook's stub
  does): it prints ``... not attempted yet``, without failing. So a
  notebook runs top to bottom before you start the exercise (CI runs them that way).

To see how a check counts your collective calls ("you called all_reduce 8 times; one call is
enough"): while your function runs, the ``torch.distributed`` collectives are replaced by
counting wrappers, in ``torch.distributed`` and in your function's globals (so
``from torch.distributed import all_reduce`` is counted too).

The exercises (see :data:`EXERCISES`), with reference solutions in ``notebooks/solutions/``:

=====================================  ===============================================  ========
check                                  your function                                    notebook
=====================================  ===============================================  ========
:func:`check_gather_ranks`             ``gather_ranks(rank, world_size) -> list``       00
:func:`check_accumulate_gradients`     ``accumulate_gradients(model, images, labels,    01
                                       micro_batches) -> float``
:func:`check_average_gradients_flat`   ``average_gradients_flat(model)``                02
:func:`check_broadcast_parameters`     ``broadcast_parameters(model)``                  03
:func:`check_global_mean_loss`         ``global_mean_loss(losses) -> float``            04
:func:`check_average_overlapped`       ``average_overlapped(model) -> finish``          05
:func:`check_save_checkpoint`          ``save_checkpoint(path, model, optimizer,        06
                                       epochs_done)``
=====================================  ===============================================  ========

Each check lives in a module of its own, named after the idea it checks (``gather_ranks``,
``accumulate``, ``flat_average``, ``broadcast``, ``mean_loss``, ``overlap``, ``checkpoint``);
the plumbing they share (launching, counting collectives, comparing tensors) is in ``_common``.

Introduced in ``notebooks/00_launching_workers.ipynb`` (its exercise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._common import CHECK_TIMEOUT as CHECK_TIMEOUT
from ._common import ExerciseFailed
from .accumulate import check_accumulate_gradients
from .broadcast import check_broadcast_parameters
from .checkpoint import check_save_checkpoint
from .flat_average import check_average_gradients_flat
from .gather_ranks import check_gather_ranks
from .mean_loss import check_global_mean_loss
from .overlap import check_average_overlapped

__all__ = [
    "EXERCISES",
    "Exercise",
    "ExerciseFailed",
    "check_accumulate_gradients",
    "check_average_gradients_flat",
    "check_average_overlapped",
    "check_broadcast_parameters",
    "check_gather_ranks",
    "check_global_mean_loss",
    "check_save_checkpoint",
]


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function you write, its check, its notebook, its solution file."""

    function: str  # the name of the function you write
    check: Callable[..., bool]
    notebook: str  # the notebook whose "## Exercise" section sets it
    solution: str  # the reference solution, in notebooks/solutions/


#: Every exercise, by the name of the function you write.
EXERCISES: dict[str, Exercise] = {
    e.function: e
    for e in (
        Exercise("gather_ranks", check_gather_ranks, "00_launching_workers.ipynb",
                 "00_gather_ranks.py"),
        Exercise("accumulate_gradients", check_accumulate_gradients,
                 "01_single_device_baseline.ipynb", "01_accumulate_gradients.py"),
        Exercise("average_gradients_flat", check_average_gradients_flat,
                 "02_manual_allreduce_averaging.ipynb", "02_average_gradients_flat.py"),
        Exercise("broadcast_parameters", check_broadcast_parameters,
                 "03_distributed_data_parallel.ipynb", "03_broadcast_parameters.py"),
        Exercise("global_mean_loss", check_global_mean_loss, "04_pitfalls.ipynb",
                 "04_global_mean_loss.py"),
        Exercise("average_overlapped", check_average_overlapped, "05_performance.ipynb",
                 "05_average_overlapped.py"),
        Exercise("save_checkpoint", check_save_checkpoint,
                 "06_from_notebook_to_torchrun.ipynb", "06_save_checkpoint.py"),
    )
}

# So that doctest.testmod(gradsync_tutorial.exercises) runs the checks' examples too: they live
# in the exercises' modules.
__test__ = {e.check.__name__: e.check for e in EXERCISES.values()}
