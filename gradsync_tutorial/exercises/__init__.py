"""Exercises with self-checks: run your function against the reference, learn what is wrong.

Each notebook ends with an exercise: you write one function in a cell, then pass it to its
check. The check runs it the way the course runs code, with ``gst.launch`` (gloo, on the CPU,
whatever the machine) on 2 ranks and then on 3 to 5 (drawn once per session). It runs on a
small model and small random data, next to the reference computation, so it takes a few
seconds:

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

Why two sizes, and fresh random data each time: a check must not pass an answer that guesses
instead of computing. At one size, a hard-coded ``/ 3`` looks like ``/ world_size``; at two
sizes no fixed number is right twice. The second size is drawn once per Python process (a
kernel), from 3 to 5 ranks: an answer that looks the world size up in a table of the sizes it
saw pass ({2: ..., 3: ...}) fails most sessions. Each check's verdict names the sizes it ran.
To run a failing check again at its size, set the environment variable
``GRADSYNC_CHECK_WORLD_SIZE`` (``os.environ["GRADSYNC_CHECK_WORLD_SIZE"] = "4"``: read at every
check), or pass ``world_size=(2, 4)``. With the same seeded data every time, a rank could
compute locally what it should have received; and what the collectives carried is checked
too, so that numbers that reached a rank another way (a file) do not pass.

To see how a check counts your collective calls ("you called all_reduce 8 times; one call is
enough") and what they carried: while your function runs, a
:class:`gradsync_tutorial.exercises.evidence.Recorder` (a
:class:`gradsync_tutorial.detect.CollectiveCounter`) replaces the ``torch.distributed``
collectives by recording wrappers, in ``torch.distributed`` and in your function's globals (so
``from torch.distributed import all_reduce`` is counted too); each keeps the numbers the call
sent and delivered.

The exercises, one module each, named after the idea it checks, with reference solutions in
``notebooks/solutions/``: see :data:`EXERCISES` (listed below, with their modules).
Each module declares its exercise once, with :func:`~gradsync_tutorial.exercises.common.exercise`
on its check; this package imports every module here, so adding an exercise is adding its
module (the check), its solution and its test (and the exercise in its notebook). The plumbing
they share is :mod:`~gradsync_tutorial.exercises.common` (declaring, launching at each size,
diagnosing) and :mod:`~gradsync_tutorial.exercises.evidence` (what the collectives carried,
comparing tensors); the first one's docstring is the recipe for a new exercise.

Introduced in ``notebooks/00_launching_workers.ipynb`` (its exercise).
"""

from __future__ import annotations

import importlib
import pkgutil

from .common import CHECK_TIMEOUT as CHECK_TIMEOUT
from .common import EXERCISES, Exercise, ExerciseFailed

# Every module of this package but common and evidence (what the checks share) declares one
# exercise: importing it registers it in EXERCISES. Then each check is an attribute of the
# package (gst.exercises.check_gather_ranks), in the order of the notebooks.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f".{_module}", __name__)  # common, evidence: register nothing
_in_order = sorted(EXERCISES.items(), key=lambda item: item[1].notebook)
EXERCISES.clear()
EXERCISES.update(_in_order)
for _exercise in EXERCISES.values():
    globals()[_exercise.check.__name__] = _exercise.check

__all__ = ["EXERCISES", "Exercise", "ExerciseFailed",
           *(e.check.__name__ for e in EXERCISES.values())]

__doc__ += "\nThe exercises:\n\n" + "\n".join(
    f"* notebook {e.notebook[:2]}: :func:`{e.check.__name__}`, ``{e.usage}``, in "
    f":mod:`~{e.check.__module__}`" for e in EXERCISES.values())

# So that doctest.testmod(gradsync_tutorial.exercises) runs the checks' examples too: they live
# in the exercises' modules.
__test__ = {e.check.__name__: e.check for e in EXERCISES.values()}
