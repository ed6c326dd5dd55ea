"""What every exercise check shares: declaring an exercise, the launch, the messages, the
comparisons of tensors, the course's model with random data.

An exercise is declared once, by decorating its check (in a module of its own, named after the
idea it checks)::

    @exercise("02_manual_allreduce_averaging.ipynb", "average_gradients_flat(model)")
    def check_average_gradients_flat(average_gradients_flat, world_size=WORLD_SIZE, *,
                                     timeout=CHECK_TIMEOUT) -> str:
        outs = run_on_ranks(_worker, average_gradients_flat, world_size, timeout)
        ...                      # diagnose: fail("...") on the most telling mistake first
        return "one all_reduce for all 8 gradients ..."   # what was verified

:func:`exercise` registers it in :data:`EXERCISES` (under the function's name, the check's
name without ``check_``), derives its reference solution, ``notebooks/solutions/<NN>_<name>.py``,
and does what every check does around its diagnosis: refuse what is not a function taking the
arguments of ``usage``; print "not attempted yet" when the learner's function still raises
``NotImplementedError`` (:func:`run_on_ranks` and :func:`call_or_stub` say so by raising
:class:`NotAttempted`); print "✓ correct: <what the check returned>" otherwise. The package
imports every module of ``exercises/``, so a new exercise is its module, its solution, its
test (and the notebook that sets it).

The workers that run on the ranks are module-level functions, so that they reach the ranks by
reference to their module; they call the learner's function inside a
:class:`~gradsync_tutorial.detect.CollectiveCounter`.

Part of :mod:`gradsync_tutorial.exercises` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._wording import ranks, require_int
from ..checks import max_abs_diff as max_abs_diff  # the package's one comparison of tensors
from ..detect import CollectiveCounter as CollectiveCounter
from ..launcher import HANG_HINT, LaunchTimeoutError, RankFailedError, launch
from ..model import Net

SEED = 1234
#: Seconds a check waits for your function on every rank (start-up included) before it calls
#: it a hang. Pass ``timeout=`` to a check to change it.
CHECK_TIMEOUT = 60.0
#: The ranks a check runs on by default: 3, a number a solution cannot take for granted (the
#: course's examples use 2, so a hard-coded 2 shows).
WORLD_SIZE = 3
#: What a worker returns when the learner's function raised NotImplementedError (the stub).
STUB = "gradsync-exercise-not-attempted"
# Relative and absolute tolerance for "the same numbers" (sums in another order round apart).
RTOL, ATOL = 1e-4, 1e-7


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

    The decorated function diagnoses: it calls :func:`fail` on a mistake and returns what it
    verified. The check that learners call prints one status line and returns None.
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
# Running the learner's function
# --------------------------------------------------------------------------------------------


def call_or_stub(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` in this process; :class:`NotAttempted` if it raises NotImplementedError."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise NotAttempted from None


def run_on_ranks(worker: Callable, fn: Any, world_size: int, timeout: float) -> list:
    """Run ``worker(rank, world_size, fn)`` on ``world_size`` gloo ranks; the per-rank results.

    Raises :class:`NotAttempted` if a worker returned :data:`STUB` (``fn`` raised
    NotImplementedError). An error in ``fn`` or a hang becomes an :class:`ExerciseFailed` that
    says so.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    require_int(world_size, "world_size", minimum=2, what="a check needs several ranks")

    def run(rank: int, world_size: int) -> Any:
        # A closure over fn, rather than args=(fn,), so that the launcher finds fn's source and
        # shows the learner's own line in a traceback.
        return worker(rank, world_size, fn)

    try:
        results = launch(run, world_size, backend="gloo", timeout=timeout)
    except RankFailedError as e:
        raise ExerciseFailed(
            f"{name_of(fn)} raised an error on rank {e.rank}; fix the line the traceback below "
            f"points to, then run the check again.\n\n{e}"
        ) from None
    except LaunchTimeoutError as e:
        raise ExerciseFailed(
            f"{name_of(fn)} did not finish within {timeout:g} s: {ranks(e.unfinished)} had not "
            f"finished, so it hangs. {HANG_HINT}"
        ) from None
    if any(isinstance(r, str) and r == STUB for r in results):
        raise NotAttempted
    return results


def fresh_seed() -> int:
    """A seed nobody can know in advance: data that only communication can deliver."""
    return int.from_bytes(os.urandom(6), "little")


# --------------------------------------------------------------------------------------------
# Comparing what came back
# --------------------------------------------------------------------------------------------


def calls_text(counts: dict) -> str:
    """"all_reduce 8 times, broadcast once" (or "none")."""
    parts = []
    for name, n in counts.items():
        parts.append(f"{name} {'once' if n == 1 else f'{n} times'}")
    return ", ".join(parts) or "none"


def flatten(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors.values()])


def _unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pieces = flat.split([t.numel() for t in like.values()])
    return {name: p.view_as(t).clone() for (name, t), p in zip(like.items(), pieces, strict=True)}


def all_ranks(tensors: dict[str, torch.Tensor], world_size: int) -> list[dict]:
    """Every rank's copy of ``tensors`` (an all_gather), on every rank."""
    import torch.distributed as dist

    flat = flatten(tensors)
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return [_unflatten(f, tensors) for f in everyone]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=RTOL, atol=ATOL)


def differing_tensors(got: dict, expected: dict) -> list[tuple[str, float]]:
    """(name, max abs difference) of each tensor of ``got`` not close to ``expected``'s."""
    return [(name, max_abs_diff(got[name], expected[name]))
            for name in expected if not _close(got[name], expected[name])]


def mean_over_ranks(everyone: list[dict]) -> dict[str, torch.Tensor]:
    """The mean, tensor by tensor, of every rank's copy (as :func:`all_ranks` returns them)."""
    return {n: torch.stack([e[n] for e in everyone]).mean(0) for n in everyone[0]}


def scale(got: dict, expected: dict) -> float | None:
    """``c`` if ``got`` is ``c * expected``, tensor by tensor, with one ``c``; else None."""
    g, e = flatten(got).double(), flatten(expected).double()
    if e.dot(e) == 0:
        return None
    c = (g.dot(e) / e.dot(e)).item()
    return c if torch.allclose(g, c * e, rtol=RTOL, atol=ATOL) else None


def times_text(c: float) -> str:
    return f"{c:.1f}×" if abs(c) >= 1 else f"{c:.2g}×"


def where_text(differing: list[tuple[str, float]], total: int) -> str:
    """"`fc2.weight` (max abs difference 0.03; 3 of 8 tensors differ)"."""
    name, diff = differing[0]
    what = "a different shape" if diff == float("inf") else f"max abs difference {diff:.3g}"
    return f"`{name}` ({what}; {len(differing)} of {total} tensors differ)"


def divisor_hint(c: float, right: int, what: str) -> str:
    """" Did you divide by 2 instead of world_size (3 here)? ..." if ``c == right / k``."""
    if c <= 0:
        return ""
    k = right / c
    if abs(k - round(k)) > 1e-3 or round(k) in (0, right):
        return ""
    return (f" Did you divide by {round(k)} instead of {what} ({right} here)? Use the value "
            f"you are given: it is not always {round(k)}.")


def model_and_data(rank: int, batch: int = 8, seed: int | None = None
                    ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The course's model (the same weights on every rank, dropout off) and a rank's own batch
    of random images, so every rank has different gradients: drawn from ``seed + rank``, by
    default a :func:`fresh_seed` (then no rank can compute another's)."""
    torch.manual_seed(SEED)
    model = Net().eval()  # eval: dropout off, so every forward pass is deterministic
    g = torch.Generator().manual_seed((fresh_seed() if seed is None else seed) + rank)
    images = torch.randn(batch, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return model, images, labels


def is_number(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    return type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0  # np.float32(1.0)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def reference_gradient(model: nn.Module, images, labels) -> tuple[dict, float]:
    """The gradient of the mean loss over ``images`` and that loss, on a copy of ``model``."""
    copy_ = copy.deepcopy(model)
    copy_.zero_grad(set_to_none=True)
    loss = F.nll_loss(copy_(images), labels)
    loss.backward()
    return grads_of(copy_), loss.item()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
