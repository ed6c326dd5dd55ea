"""What every exercise check shares: the messages, the launch, the collective counter, the
comparisons of tensors, the course's model with random data.

A check (``check_<name>``, in the module of its exercise) follows one pattern: validate the
learner's function (:func:`_require_function`); run it next to the reference on the ranks
(:func:`_launch`, with a worker function that calls it inside a
:class:`~gradsync_tutorial.detect.CollectiveCounter`);
then diagnose the per-rank results, the most telling mistake first, with :func:`_fail`;
:func:`_passed` when all is right, :func:`_not_attempted` for the stub. The workers are
module-level functions, so that they reach the ranks by reference to their module.

Part of :mod:`gradsync_tutorial.exercises` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..detect import CollectiveCounter as CollectiveCounter
from ..detect import _swap_back as _swap_back
from ..detect import _swap_in as _swap_in
from ..launcher import HANG_HINT, LaunchTimeoutError, RankFailedError, launch
from ..model import Net

SEED = 1234
#: Seconds a check waits for your function on every rank (start-up included) before it calls
#: it a hang. Pass ``timeout=`` to a check to change it.
CHECK_TIMEOUT = 60.0
# What a worker returns when the learner's function raised NotImplementedError (the stub).
_STUB = "gradsync-exercise-not-attempted"
# Relative and absolute tolerance for "the same numbers" (sums in another order round apart).
RTOL, ATOL = 1e-4, 1e-7


class ExerciseFailed(AssertionError):
    """Your function ran, but did not do what the exercise asks; the message says how."""

    __module__ = "gradsync_tutorial.exercises"  # where learners import it from


def _name(fn: Any) -> str:
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
            f"{_name(fn)}{signature} cannot be called as {usage}: define it with exactly these "
            "arguments."
        ) from None


def _passed(message: str) -> None:
    # One status line; no return value, so a check cell shows no `True` under it.
    print(f"✓ correct: {message}")


def _not_attempted(fn: Any, exercise: str) -> None:
    from . import EXERCISES  # the package's table of exercises (it imports this module)

    solution = EXERCISES[exercise].solution
    print(
        f"... not attempted yet: {_name(fn)} still raises NotImplementedError. Write it in its "
        "cell (replace the `raise NotImplementedError` line), run that cell, then run this "
        f"check again. Stuck? The reference solution: notebooks/solutions/{solution} "
        f"(in Jupyter: `%load solutions/{solution}`)."
    )


def _fail(message: str):
    __tracebackhide__ = True
    raise ExerciseFailed(message)


def _launch(worker: Callable, fn: Any, world_size: int, timeout: float) -> list | None:
    """Run ``worker(rank, world_size, fn)`` on ``world_size`` gloo ranks.

    Returns the per-rank results, or None if ``fn`` raised NotImplementedError (the stub).
    An error in ``fn`` or a hang becomes an :class:`ExerciseFailed` that says so.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 (a check needs several ranks), got "
                         f"{world_size!r}.")

    def run(rank: int, world_size: int) -> Any:
        # A closure over fn, rather than args=(fn,), so that the launcher finds fn's source and
        # shows the learner's own line in a traceback.
        return worker(rank, world_size, fn)

    try:
        results = launch(run, world_size, backend="gloo", timeout=timeout)
    except RankFailedError as e:
        raise ExerciseFailed(
            f"{_name(fn)} raised an error on rank {e.rank}; fix the line the traceback below "
            f"points to, then run the check again.\n\n{e}"
        ) from None
    except LaunchTimeoutError as e:
        stuck = ", ".join(map(str, e.unfinished))
        raise ExerciseFailed(
            f"{_name(fn)} did not finish within {timeout:g} s: rank(s) {stuck} were still "
            f"waiting, so it hangs. {HANG_HINT}"
        ) from None
    if any(isinstance(r, str) and r == _STUB for r in results):
        return None
    return results


def _calls_text(counts: dict) -> str:
    """"all_reduce 8 times, broadcast once" (or "none")."""
    parts = []
    for name, n in counts.items():
        parts.append(f"{name} {'once' if n == 1 else f'{n} times'}")
    return ", ".join(parts) or "none"


def _flatten(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors.values()])


def _unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pieces = flat.split([t.numel() for t in like.values()])
    return {name: p.view_as(t).clone() for (name, t), p in zip(like.items(), pieces, strict=True)}


def _all_ranks(tensors: dict[str, torch.Tensor], world_size: int) -> list[dict]:
    """Every rank's copy of ``tensors`` (an all_gather), on every rank."""
    import torch.distributed as dist

    flat = _flatten(tensors)
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return [_unflatten(f, tensors) for f in everyone]


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=RTOL, atol=ATOL)


def _differing(got: dict, expected: dict) -> list[tuple[str, float]]:
    """(name, max abs difference) of each tensor of ``got`` not close to ``expected``'s."""
    return [(name, _max_abs_diff(got[name], expected[name]))
            for name in expected if not _close(got[name], expected[name])]


def _mean_over_ranks(everyone: list[dict]) -> dict[str, torch.Tensor]:
    """The mean, tensor by tensor, of every rank's copy (as :func:`_all_ranks` returns them)."""
    return {n: torch.stack([e[n] for e in everyone]).mean(0) for n in everyone[0]}


def _scale(got: dict, expected: dict) -> float | None:
    """``c`` if ``got`` is ``c * expected``, tensor by tensor, with one ``c``; else None."""
    g, e = _flatten(got).double(), _flatten(expected).double()
    if e.dot(e) == 0:
        return None
    c = (g.dot(e) / e.dot(e)).item()
    return c if torch.allclose(g, c * e, rtol=RTOL, atol=ATOL) else None


def _times(c: float) -> str:
    return f"{c:.1f}×" if abs(c) >= 1 else f"{c:.2g}×"


def _where(differing: list[tuple[str, float]], total: int) -> str:
    """"`fc2.weight` (max abs difference 0.03; 3 of 8 tensors differ)"."""
    name, diff = differing[0]
    return f"`{name}` (max abs difference {diff:.3g}; {len(differing)} of {total} tensors differ)"


def _model_and_data(rank: int, batch: int = 8) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The course's model (the same weights on every rank, dropout off) and a rank's own batch
    of random images, so every rank has different gradients."""
    torch.manual_seed(SEED)
    model = Net().eval()  # eval: dropout off, so every forward pass is deterministic
    g = torch.Generator().manual_seed(SEED + 1 + rank)
    images = torch.randn(batch, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return model, images, labels


def _is_number(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    return type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0  # np.float32(1.0)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def _reference_gradient(model: nn.Module, images, labels) -> tuple[dict, float]:
    """The gradient of the mean loss over ``images`` and that loss, on a copy of ``model``."""
    copy_ = copy.deepcopy(model)
    copy_.zero_grad(set_to_none=True)
    loss = F.nll_loss(copy_(images), labels)
    loss.backward()
    return _grads(copy_), loss.item()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
