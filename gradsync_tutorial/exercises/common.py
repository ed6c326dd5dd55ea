"""What every exercise check shares: declaring an exercise, running the learner's function at
several sizes, and the table of diagnoses that reads each run.

A check lives in a module of its own, named after the idea it checks, in four parts::

    def _worker(rank, world_size, fn):           # 1. on every rank: run fn, return the facts
        model, images, labels = evidence.model_and_data(rank)
        ...
        with evidence.Recorder(fn) as calls:     # counts fn's collectives, keeps what they carried
            common.attempt(fn, model)            # NotImplementedError: "not attempted yet"
        return {"got": ..., "calls": calls.log}

    def _gradients_unchanged(run):               # 2. one diagnosis: what is wrong, or None
        if ...:
            return "the gradients did not change: ..."

    DIAGNOSES = (_shape_error, _gradients_unchanged, ...)   # most telling mistake first

    def _verified(runs):                         # 3. the "✓ correct" sentence, from the runs
        return f"{common.sizes_text(runs)}, one all_reduce carried ..."

    @common.exercise("02_manual_allreduce_averaging.ipynb", "average_gradients_flat(model)")
    def check_average_gradients_flat(average_gradients_flat, world_size=common.WORLD_SIZES, *,
                                     timeout=common.CHECK_TIMEOUT) -> str:   # 4. the check
        return common.on_ranks(_worker, average_gradients_flat, world_size, timeout,
                               DIAGNOSES, _verified)

:func:`on_ranks` launches the worker at each world size and hands each size's :class:`Run` to
the diagnoses in order; the first that finds something fails the check with its message,
prefixed with the size (and the sizes at which the answer was right). By default a check runs
2 ranks, then a size drawn once per Python process from 3 to 5 (:data:`WORLD_SIZES`). A number
hard-coded in place of the world size is wrong at one of them. A table of answers by size
({2: ..., 3: ...}) fails most sessions. A failure at the drawn size says how to run it again:
set ``GRADSYNC_CHECK_WORLD_SIZE`` (to 4, say: every check then runs 2 and 4 ranks), or pass
``world_size=(2, 4)`` to the check. A check that runs in
the notebook's own process (notebook 01's) builds its runs itself and calls :func:`diagnose`.
:func:`exercise` registers the check in :data:`EXERCISES` (under the learner's function's
name, the check's name without ``check_``), derives its reference solution,
``notebooks/solutions/<NN>_<name>.py``, refuses what is not a function taking the arguments of
``usage``, prints "not attempted yet" when the learner's function still raises
``NotImplementedError``, and "✓ correct: <what _verified said>" otherwise. The package imports
every module of ``exercises/``, so a new exercise is its module, its solution, its test (and
the notebook that sets it).

The workers are module-level functions, so that they reach the ranks by reference to their
module. What they record and how the diagnoses compare it is
:mod:`~gradsync_tutorial.exercises.evidence`: a check verifies what the collectives carried
(values no rank could know alone), not only that one was called.

Part of :mod:`gradsync_tutorial.exercises` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import os
import random
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import LaunchTimeoutError, RankFailedError, launch
from .._wording import require_int

#: Seconds a check waits for your function on every rank, at each size (start-up included),
#: before it calls it a hang. Pass ``timeout=`` to a check to change it.
CHECK_TIMEOUT = 60.0
#: The environment variable that fixes the second world size of every check (``4``): the size
#: at which a check failed, to run it there again.
SIZE_VARIABLE = "GRADSYNC_CHECK_WORLD_SIZE"
#: The sizes the second one is drawn from, once per Python process. 3 to 5: a table of answers
#: by size must hold the size drawn, and 5 ranks start in a few seconds on 2 cores.
DRAWN_SIZES = range(3, 6)


def second_size() -> int:
    """The second world size of a check: ``GRADSYNC_CHECK_WORLD_SIZE`` if set, else the one
    drawn for this process (:data:`WORLD_SIZES`). Read at every check, so that setting it in a
    notebook (``os.environ[...] = "4"``) takes effect without a restart."""
    value = os.environ.get(SIZE_VARIABLE, "").strip()
    if not value:
        return _DRAWN
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 3:
        raise ValueError(
            f"{SIZE_VARIABLE}={value!r}: it must be a whole number of ranks >= 3, the second "
            "size every exercise check runs at (2 ranks always run first); for example "
            f"{SIZE_VARIABLE}=4. Unset it to have the size drawn from "
            f"{DRAWN_SIZES[0]} to {DRAWN_SIZES[-1]}.")
    return n


# os.urandom, not the random module's shared state: a learner's random.seed(0) fixes nothing.
_DRAWN = random.SystemRandom().choice(DRAWN_SIZES)
with contextlib.suppress(ValueError):  # a wrong value is told by the first check
    _DRAWN = second_size()
#: The world sizes a check runs at by default, one launch each: 2 (the course's examples), then
#: a size drawn once per process from 3 to 5, or ``GRADSYNC_CHECK_WORLD_SIZE``. Drawn once, not
#: per check: the launcher keeps the idle workers of both sizes, so the checks after the first
#: start no process. Any number a solution hard-codes is wrong at one of them.
WORLD_SIZES = (2, _DRAWN)
#: What a worker returns when the learner's function raised NotImplementedError (the stub).
STUB = "gradsync-exercise-not-attempted"


class ExerciseFailed(AssertionError):
    """Your function ran, but did not do what the exercise asks; the message says how."""

    __module__ = "gradsync_tutorial.exercises"  # where learners import it from


class NotAttempted(Exception):
    """Raised inside a check when the learner's function still raises NotImplementedError."""


# --------------------------------------------------------------------------------------------
# Declaring an exercise
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function you write, its check, its notebook, its solution file."""

    function: str  # the name of the function you write
    check: Callable[..., None]
    notebook: str  # the notebook whose "## Exercise" section sets it
    solution: str  # the reference solution, in notebooks/solutions/
    usage: str  # how the check calls your function: "average_gradients_flat(model)"

    __module__ = "gradsync_tutorial.exercises"


#: Every exercise, by the name of the function you write, in the order of the notebooks.
EXERCISES: dict[str, Exercise] = {}


def exercise(notebook: str, usage: str) -> Callable[[Callable[..., str]], Callable[..., None]]:
    """Declare the exercise that the decorated ``check_<name>`` checks (see the module's
    docstring): ``notebook`` sets it, ``usage`` is how the check calls the learner's function.

    The decorated function returns what it verified (it fails through :func:`fail`). The
    check that learners call prints one status line and returns None.
    """

    def declare(diagnose: Callable[..., str]) -> Callable[..., None]:
        function = diagnose.__name__.removeprefix("check_")
        solution = f"{notebook[:2]}_{function}.py"
        n_args = len(usage[usage.index("(") + 1:usage.rindex(")")].split(","))

        @functools.wraps(diagnose)
        def check(fn: Callable, *args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True  # IPython and pytest show the message, not this frame
            _require_function(fn, n_args, usage)
            try:
                verified = diagnose(fn, *args, **kwargs)
            except NotAttempted:
                _not_attempted(fn, solution)
                return
            # One status line; no return value, so a check cell shows no `True` under it.
            print(f"✓ correct: {verified}")

        check.__doc__ = (check.__doc__ or "").rstrip() + (
            f"\n\n    Exercise of ``notebooks/{notebook}``; a reference solution:\n"
            f"    ``notebooks/solutions/{solution}``.\n    ")
        # What learners see (help(), a notebook's Shift-Tab): the check returns nothing.
        check.__signature__ = inspect.signature(diagnose).replace(return_annotation=None)
        EXERCISES[function] = Exercise(function, check, notebook, solution, usage)
        return check

    return declare


def name_of(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _require_function(fn: Any, n_args: int, usage: str) -> None:
    """Fail with a clear message if ``fn`` is not a function that takes ``n_args`` arguments."""
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    if not callable(fn):
        raise ExerciseFailed(
            f"pass your function itself, as in {usage}; got {type(fn).__name__} "
            f"{fn!r:.80}. (Did you call it, check(f(...)), instead of check(f)?)"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(n_args))
    except TypeError:
        raise ExerciseFailed(
            f"{name_of(fn)}{signature} cannot be called as {usage}: define it with exactly "
            "these arguments."
        ) from None


def _not_attempted(fn: Any, solution: str) -> None:
    print(
        f"... not attempted yet: {name_of(fn)} still raises NotImplementedError. Write it in "
        "its cell (replace the `raise NotImplementedError` line), run that cell, then run this "
        f"check again. Stuck? The reference solution: notebooks/solutions/{solution} "
        f"(in Jupyter: `%load solutions/{solution}`)."
    )


def fail(message: str):
    """Stop the check with ``message`` (an :class:`ExerciseFailed`)."""
    __tracebackhide__ = True
    raise ExerciseFailed(message)


# --------------------------------------------------------------------------------------------
# Running the learner's function, at every size, and diagnosing each run
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One size's run of the learner's function: what every diagnosis is given.

    ``outs`` holds what the worker returned, by rank (one entry for a check that runs in the
    notebook's process); ``label`` says where it ran ("on 3 ranks").
    """

    name: str  # the learner's function's name
    size: int  # the world size (or the number of micro-batches)
    outs: list
    label: str

    @property
    def out(self) -> Any:
        """Rank 0's facts."""
        return self.outs[0]

    def first(self, fact: str) -> tuple[int, Any]:
        """(rank, value) of the first rank whose ``fact`` is there and true, else (None, None)."""
        return next(((r, o[fact]) for r, o in enumerate(self.outs) if o.get(fact)), (None, None))


#: A diagnosis: what is wrong with one run (a message for the learner), or None.
Diagnosis = Callable[[Run], "str | None"]


def left_alone(fact: str, advice: str) -> Diagnosis:
    """A diagnosis for what the answer must not touch: the first rank whose ``fact`` is a text
    ("changed the parameters: `conv1.weight` ..." from :func:`evidence.changed_text`) gets
    "on rank <r>, <fn> <text>: <advice>"."""

    def touched(run: Run) -> str | None:
        rank, changed = run.first(fact)
        if changed:
            return f"on rank {rank}, {run.name} {changed}: {advice}"

    touched.__name__ = touched.__qualname__ = f"_{fact}_left_alone"
    return touched


# The diagnoses of a DDP step over micro-batches (notebooks 07 and 14), shared by their checks:
# each worker returns "missing" (parameters without a gradient), "grad" (rank's flat gradient)
# and "counts" (its collectives by kind).


#: Two mistakes of such a step, in the words both checks use.
ZEROED_INSIDE = ("only the last micro-batch's gradient is left: do not zero the gradients (or set "
                 ".grad = None) inside your loop.")
SUMMED_TOO = ("you multiplied by the world size and also summed the gradients yourself: DDP "
              "already averages them in backward(); do not all_reduce the gradients.")


def no_gradient(run: Run) -> str | None:
    """A parameter left without a gradient on some rank."""
    rank, missing = run.first("missing")
    if missing:
        return (f"on rank {rank}, `{missing[0]}` has no gradient after {run.name}: call "
                "backward() on each micro-batch's loss.")


def ranks_differ(run: Run) -> str | None:
    """Ranks that ended the step with different gradients."""
    if any(not torch.equal(o["grad"], run.out["grad"]) for o in run.outs):
        return ("the ranks ended with different gradients: let DDP average them (in the last "
                "micro-batch's backward), and do not change one rank's .grad afterwards.")


parameters_left_alone = left_alone(
    "params", "compute the gradients only; the caller's optimizer takes the step.")


def synced_once(micro_batches: Callable[[Run], int]) -> Diagnosis:
    """A diagnosis: DDP must all-reduce once per step, not once per micro-batch
    (``micro_batches(run)``: how many the rank had)."""

    def synced_every_micro_batch(run: Run) -> str | None:
        ddp = run.out["counts"].get("ddp_bucket_allreduce", 0)
        if ddp > 1:
            return (f"DDP all-reduced the gradients in {ddp} backward passes: run every "
                    "micro-batch but the last inside `with model.no_sync():`, so that DDP "
                    f"communicates once per step instead of {micro_batches(run)} times "
                    "(notebook 03's accumulation pitfall).")

    return synced_every_micro_batch


def diagnose(run: Run, diagnoses: Sequence[Diagnosis], right: Sequence[Run] = ()) -> None:
    """Fail with the first of ``diagnoses`` that finds something wrong with ``run``; the
    message says where (and at which sizes, ``right``, the answer was right)."""
    __tracebackhide__ = True
    for diagnosis in diagnoses:
        message = diagnosis(run)
        if message:
            where = " and ".join(r.label for r in right)
            fail(f"{f'right {where}, but ' if where else ''}{run.label}: {message}")


def sizes(value: int | Sequence[int], name: str, minimum: int, what: str = "") -> tuple[int, ...]:
    """The sizes a check runs at: ``value`` (an int, or several), each checked."""
    values = (value,) if isinstance(value, int) else tuple(value)
    if not values:
        raise ValueError(f"{name} must be an int or a non-empty list of ints, got {value!r}.")
    for v in values:
        require_int(v, name, minimum=minimum, what=what)
    return tuple(dict.fromkeys(values))


def sizes_text(runs: Sequence[Run]) -> str:
    """"on 2 and 4 ranks", "on 2, 3 and 4 ranks": every run's label, joined, smallest first.

        >>> sizes_text([Run("f", n, [], f"on {n} ranks") for n in (2, 4, 3)])
        'on 2, 3 and 4 ranks'
    """
    def listed(words: list[str]) -> str:
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]

    labels = [r.label for r in sorted(runs, key=lambda r: r.size)]
    if all(label.startswith("on ") and label.endswith(" ranks") for label in labels):
        return "on " + listed([label[3:-6] for label in labels]) + " ranks"
    return listed(labels)


# The world size the last check launched at last: `launch` keeps one pool of idle workers, of
# that size, and a launch that finds it starts no process. (A guess: a launch of another size
# since then, in the notebook, has replaced that pool.)
_last_launched: list[int] = []


def warm_first(world_sizes: Iterable[int]) -> list[int]:
    """``world_sizes`` with the one the last check launched at first: its workers are idle."""
    return sorted(world_sizes, key=lambda n: n not in _last_launched)


def note_launched(world_size: int) -> None:
    """A launch of ``world_size`` ranks ended: its workers are the idle pool now."""
    _last_launched[:] = [world_size]


def micro_batch_label(micro_batches_at: Callable[[int], int]) -> Callable[[int], str]:
    """A check's ``label`` for :func:`on_ranks` when each rank gets ``micro_batches_at(n)``
    micro-batches.

        >>> micro_batch_label(lambda n: 3)(2)
        'on 2 ranks × 3 micro-batches'
    """
    return lambda world_size: (f"on {world_size} ranks × {micro_batches_at(world_size)} "
                               "micro-batches")


def on_ranks(worker: Callable, fn: Callable, world_size: int | Sequence[int], timeout: float,
             diagnoses: Sequence[Diagnosis], verified: Callable[[list[Run]], str], *,
             label: Callable[[int], str] = "on {} ranks".format,
             not_only_powers_of_two: bool = False) -> str:
    """Run ``worker(rank, world_size, fn)`` at each world size in turn and diagnose each run;
    return ``verified(runs)``: the check of a distributed exercise. ``label(n)`` says where
    the run of ``n`` ranks ran ("on 2 ranks × 4 micro-batches", for a check whose other
    counts follow the world size).

    A wrong answer stops at the first size that shows it. The size whose idle workers are
    still there (the last one launched) runs first, whatever its turn: it costs no start-up.
    ``world_size=WORLD_SIZES`` (the checks' default) is 2 and :func:`second_size`; a failure
    at the second size then says how to run that size again. ``not_only_powers_of_two``: where
    that default draws 4, 3 ranks run too (a bf16 division by 2 or 4 is exact: a second
    rounding shows only at other sizes).
    """
    __tracebackhide__ = True
    drawn = None
    if world_size is WORLD_SIZES:
        world_size = (2, drawn := second_size())
        if not_only_powers_of_two and drawn & (drawn - 1) == 0:
            world_size += (3,)
    order = sizes(world_size, "world_size", 2, "a check needs several ranks")
    runs: dict[int, Run] = {}

    def run_at(n: int) -> Run:
        if n not in runs:
            runs[n] = Run(name_of(fn), n, run_on_ranks(worker, fn, n, timeout), label(n))
            note_launched(n)
        return runs[n]

    warm = [n for n in order if n in _last_launched]
    for i, n in enumerate(order):
        at = n
        try:
            for at in warm + [n]:
                run_at(at)
            warm = []
            diagnose(runs[n], diagnoses, [runs[m] for m in order[:i]])
        except ExerciseFailed as e:
            if drawn is None or at != drawn:
                raise
            raise ExerciseFailed(f"{e}\n\n{_again(drawn)}") from None
    return verified([runs[n] for n in order])


def _again(n: int) -> str:
    """How to run a check again at ``n`` ranks, the size that failed."""
    how = (f"this session's second size, drawn from {DRAWN_SIZES[0]} to {DRAWN_SIZES[-1]}"
           if not os.environ.get(SIZE_VARIABLE, "").strip() else f"set by {SIZE_VARIABLE}")
    return (f"({n} ranks was {how}. To check at {n} ranks again: {SIZE_VARIABLE}={n} in the "
            f"environment, or world_size=(2, {n}) in the check's call.)")


def attempt(fn: Callable, *args: Any) -> Any:
    """``fn(*args)``; :class:`NotAttempted` if it raises NotImplementedError (the stub)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise NotAttempted from None


class _TimeUp(BaseException):  # not an Exception: a learner's `except Exception` lets it by
    pass


@contextlib.contextmanager
def time_limit(seconds: float, message: str) -> Iterator[None]:
    """Fail with ``message`` if the block (the learner's function, in this process) runs longer
    than ``seconds``: a check never waits forever on a loop that never ends.

    The main thread gets a SIGALRM (it also ends a sleep); another thread, or Windows, gets the
    error at its next line of Python.

        >>> with time_limit(0.2, "your loop never ends"):
        ...     while True:
        ...         pass
        Traceback (most recent call last):
        gradsync_tutorial.exercises.ExerciseFailed: your loop never ends
    """
    __tracebackhide__ = True
    def expire(*_):
        raise _TimeUp

    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        stop = functools.partial(signal.setitimer, signal.ITIMER_REAL, 0)
    else:
        previous, target = None, ctypes.c_ulong(threading.get_ident())
        raise_in = ctypes.pythonapi.PyThreadState_SetAsyncExc
        timer = threading.Timer(seconds, raise_in, (target, ctypes.py_object(_TimeUp)))
        timer.daemon = True
        timer.start()

        def stop():
            timer.cancel()
            timer.join()
            raise_in(target, None)  # an error set as the block ended: not raised later
    try:
        yield
    except _TimeUp:
        fail(message)
    finally:
        stop()
        if previous is not None:
            signal.signal(signal.SIGALRM, previous)


def run_on_ranks(worker: Callable, fn: Any, world_size: int, timeout: float) -> list:
    """Run ``worker(rank, world_size, fn)`` on ``world_size`` gloo ranks; the per-rank results.

    Raises :class:`NotAttempted` if ``fn`` raised NotImplementedError (through
    :func:`attempt`). An error in ``fn`` or a hang becomes an :class:`ExerciseFailed` that
    says so; a hang's message is the launcher's own, with where each rank was.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    require_int(world_size, "world_size", minimum=2, what="a check needs several ranks")

    def run(rank: int, world_size: int) -> Any:
        # A closure over fn, rather than args=(fn,), so that the launcher finds fn's source and
        # shows the learner's own line in a traceback.
        try:
            return worker(rank, world_size, fn)
        except NotAttempted:
            return STUB

    try:
        results = launch(run, world_size, backend="gloo", timeout=timeout)
    except RankFailedError as e:
        raise ExerciseFailed(
            f"{name_of(fn)} raised an error on rank {e.rank} (of {world_size}); fix the line "
            f"the traceback below points to, then run the check again.\n\n{e}"
        ) from None
    except LaunchTimeoutError as e:
        raise ExerciseFailed(f"{name_of(fn)} hangs on {world_size} ranks: {e}") from None
    if any(isinstance(r, str) and r == STUB for r in results):
        raise NotAttempted
    return results
