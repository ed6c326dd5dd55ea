"""Exercise of notebook 11 (``11_pipeline_micro_batches.ipynb``): ``pipeline_gradient(stage,
batches, n_microbatches)`` runs one ``torch.distributed.pipelining`` schedule step per batch and
leaves in every stage's ``.grad`` the gradient of the mean loss over all the batches together.

The check cuts a small float64 model into one stage per rank and runs the learner's function on
2 ranks with 4 micro-batches × 2 steps, then at the second size with 3 × 3 (at N = 4 or 5
ranks, N × 3: a step count hard-coded as 2 fails at any second size), on fresh random data. It
compares every stage's gradient with one process's on the union batch. Each step's mean-loss
gradient ``g_s`` is computed too, and the answer is fitted as ``Σ a_s g_s``: the coefficients
name the mistake. The right answer has every ``a_s = 1/S`` (S steps of n micro-batches);
dividing twice gives ``1/(n S)``, no division ``n``; the default ``scale_grads=True`` across
steps gives ``a_s = n^-(S-s)``: each ``step()`` divides everything in ``.grad`` by ``n``, the
earlier steps' gradients included (torchtitan#1733).

    >>> from gradsync_tutorial.exercises.pipeline_gradient import coefficients
    >>> import torch
    >>> g = torch.eye(3)[:2]                      # two steps' gradients, 3 numbers each
    >>> [round(a, 3) for a in coefficients(g[0] / 4 + g[1], g)]   # the default, 2 steps of 4
    [0.25, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import common, evidence
from .common import Run

#: (micro-batches per step, steps) at each world size the check runs at by default.
SHAPES = {2: (4, 2), 3: (3, 3)}
ROWS = 2  # rows of each micro-batch


def shape_at(world_size: int) -> tuple[int, int]:
    """(n_microbatches, steps) the check uses on ``world_size`` ranks."""
    return SHAPES.get(world_size, (world_size, 3))


def _model(world_size: int, seed: int) -> nn.Sequential:
    """One block per stage: Linear+Tanh blocks, then a last Linear (float64)."""
    torch.manual_seed(seed)
    widths = [3] + [5] * (world_size - 1) + [2]
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(a, b), nn.Tanh())
                               for a, b in zip(widths[:-2], widths[1:-1], strict=True)]
    blocks.append(nn.Linear(widths[-2], widths[-1]))
    return nn.Sequential(*blocks).double()


def _grad_of_mean(model: nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean loss over (x, y), one process, for stage ``rank``'s params."""
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model[rank].parameters()])


def coefficients(got: torch.Tensor, per_step: torch.Tensor) -> list[float] | None:
    """``a`` with ``got == Σ a_s per_step[s]`` (least squares), or None if no such ``a`` fits."""
    solution = torch.linalg.lstsq(per_step.T, got[:, None]).solution[:, 0]
    if not torch.allclose(per_step.T @ solution, got, rtol=1e-6, atol=1e-10):
        return None
    return solution.tolist()


def _worker(rank: int, world_size: int, fn: Callable) -> dict[str, Any]:
    import copy

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    seed = [evidence.fresh_seed()]
    dist.broadcast_object_list(seed, src=0)  # the same data on every rank, unknown in advance
    n, steps = shape_at(world_size)
    model = _model(world_size, seed[0] % 2**31)
    generator = torch.Generator().manual_seed(seed[0] % 2**31 + 1)
    batches = [(torch.randn(n * ROWS, 3, generator=generator, dtype=torch.float64),
                torch.randn(n * ROWS, 2, generator=generator, dtype=torch.float64))
               for _ in range(steps)]
    whole = copy.deepcopy(model)
    per_step = torch.stack([_grad_of_mean(whole, rank, x, y) for x, y in batches])
    expected = _grad_of_mean(whole, rank, torch.cat([x for x, _ in batches]),
                             torch.cat([y for _, y in batches]))
    mine = model[rank]
    params = evidence.params_of(mine)
    stage = PipelineStage(mine, stage_index=rank, num_stages=world_size,
                          device=torch.device("cpu"))
    given = [(x.clone(), y.clone()) for x, y in batches]
    with evidence.Recorder(fn) as calls:
        common.attempt(fn, stage, given, n)
    missing = [name for name, p in mine.named_parameters() if p.grad is None]
    got = None if missing else torch.cat([p.grad.flatten() for p in mine.parameters()])
    return {"got": got, "expected": expected, "per_step": per_step, "missing": missing,
            "calls": dict(calls.calls),
            "params": evidence.changed_text(params, evidence.params_of(mine),
                                            "changed the parameters:")}


# --- the diagnoses, most telling mistake first ----------------------------------------------


def _no_gradient(run: Run) -> str | None:
    rank, missing = run.first("missing")
    if missing:
        return (f"on rank {rank} (stage {rank}), `{missing[0]}` has no gradient after "
                f"{run.name}: build a schedule on `stage` with a loss_fn and call "
                "schedule.step(...) once per batch, on every rank.")


_parameters_touched = common.left_alone(
    "params", "leave the parameters alone; the caller's optimizer takes the step.")

_FIX = ("Either a loss_fn that is each micro-batch's sum / the element count of ALL the batches, "
        "with scale_grads=False, or the mean loss / (n_microbatches × the number of batches), "
        "with scale_grads=False.")


def _which_mistake(a: list[float], n: int, steps: int) -> str:
    """What the coefficients ``a`` (of each step's mean-loss gradient) say went wrong."""
    right = 1 / steps
    if abs(a[-1]) > 1e-9 and all(abs(x) < 1e-9 * abs(a[-1]) for x in a[:-1]):
        return ("only the last batch's gradient is left: do not zero the gradients between the "
                "steps; let the schedule add every batch's gradient into .grad.")
    ratios = [a[s] / a[s + 1] for s in range(steps - 1)] if all(a) else []
    if ratios and all(abs(r - 1 / n) < 1e-6 for r in ratios):
        twice = (" The last batch is divided twice, too: your loss_fn already divides by the "
                 "count, and the default divides by n_microbatches again."
                 if abs(a[-1] - right / n) < 1e-6 * right else "")
        return (f"each earlier batch's gradient is divided by {n} once more per later step "
                f"(coefficients {', '.join(f'{x:.3g}' for x in a)}): scale_grads=True (the "
                "default) divides everything in .grad by n_microbatches at the end of every "
                "step(), the gradients of the earlier steps included (torchtitan#1733)."
                f"{twice} Accumulating across step() calls needs scale_grads=False. " + _FIX)
    if all(abs(x - a[0]) <= 1e-6 * abs(a[0]) for x in a):
        c = a[0] / right
        known = {
            1 / n: ("the gradient is divided twice: your loss_fn already divides by the count of "
                    "all the batches, and scale_grads=True divides by n_microbatches again. "),
            float(n * steps): ("nothing divided it: a mean loss_fn with scale_grads=False "
                               "leaves the sum over every micro-batch of every batch. "),
            float(steps): ("each step is divided by its own micro-batches only: divide by the "
                           "number of batches too. "),
            float(n): ("the micro-batches were not divided: with scale_grads=False, divide by "
                       "n_microbatches yourself. "),
        }
        said = next((text for value, text in known.items() if abs(c - value) < 1e-6 * value),
                    "")
        return f"your gradients are {evidence.times_text(c)} the expected ones: {said}{_FIX}"
    return ("each batch's gradient enters with another weight "
            f"({', '.join(f'{x:.3g}' for x in a)}; all should be {right:.3g}). {_FIX}")


def _wrong_gradient(run: Run) -> str | None:
    n, steps = shape_at(run.size)
    for rank, out in enumerate(run.outs):
        if torch.allclose(out["got"], out["expected"], rtol=1e-9, atol=1e-12):
            continue
        a = coefficients(out["got"], out["per_step"])
        where = f"on rank {rank} (stage {rank}), the gradient is not the mean over all the batches"
        if a is None:
            diff = (out["got"] - out["expected"]).abs().max().item()
            return (f"{where} (max abs difference {diff:.3g}), nor a mix of the batches' "
                    "gradients: did every batch go through schedule.step(), split into "
                    "n_microbatches micro-batches, on every rank? " + _FIX)
        return f"{where}: {_which_mistake(a, n, steps)}"


#: How a schedule moves activations forward and gradients back, stage to stage.
POINT_TO_POINT = ("batch_isend_irecv", "isend", "irecv", "send", "recv")


def _no_schedule(run: Run) -> str | None:
    """The gradients are right: did the stages send each other anything? A schedule sends
    every micro-batch's activations forward and its gradients back."""
    for rank, out in enumerate(run.outs):
        if not any(out["calls"].get(name) for name in POINT_TO_POINT):
            return (f"the gradients are right, but on rank {rank} (stage {rank}) nothing went "
                    "to or from another stage through torch.distributed (collectives: "
                    f"{evidence.calls_text(out['calls'])}): run a pipelining schedule on "
                    "`stage`, whose step() sends the activations forward and the gradients "
                    "back.")


DIAGNOSES = (_no_gradient, _parameters_touched, _wrong_gradient, _no_schedule)


def _verified(runs: Sequence[Run]) -> str:
    parts = []
    for run in runs:
        n, steps = shape_at(run.size)
        worst = max((o["got"] - o["expected"]).abs().max().item() for o in run.outs)
        parts.append(f"{run.size} stages, {steps} steps of {n} micro-batches "
                     f"(max abs difference {worst:.1e})")
    return (f"{common.sizes_text(runs)}, every stage's gradient is one process's on all the "
            "batches together: " + "; ".join(parts) + "; the parameters are untouched.")


@common.exercise("11_pipeline_micro_batches.ipynb",
                 "pipeline_gradient(stage, batches, n_microbatches)")
def check_pipeline_gradient(pipeline_gradient: Callable,
                            world_size: int | Sequence[int] = common.WORLD_SIZES, *,
                            timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``pipeline_gradient(stage, batches, n_microbatches)``: a pipeline schedule on
    ``stage`` (a ``PipelineStage``, stage r on rank r), one ``step()`` per ``(inputs,
    targets)`` of ``batches``, each split into ``n_microbatches``, leaves in ``.grad`` the
    gradient of ``F.mse_loss`` over all the batches together.

    Every rank is given the same batches; the first stage feeds the inputs, the last the
    targets. Runs on 2 ranks (4 micro-batches × 2 steps), then 3 to 5 (3 × 3, N × 3), float64.
    Says so if the gradient is divided twice (a count-normalized loss with the default
    ``scale_grads=True``), not divided (a mean loss with ``scale_grads=False``), divided
    by the default at every step (accumulation across ``step()`` calls, torchtitan#1733),
    zeroed between the steps, if the parameters changed, or if the stages sent each other
    nothing through torch.distributed (no schedule ran).

        >>> import gradsync_tutorial as gst
        >>> def pipeline_gradient(stage, batches, n_microbatches):   # default scaling: caught
        ...     schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=F.mse_loss)
        ...     for x, y in batches:
        ...         schedule.step(x) if stage.is_first else schedule.step(target=y)
        >>> gst.exercises.check_pipeline_gradient(pipeline_gradient)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: on rank 0 (stage 0), the gradient is not the mean ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, pipeline_gradient, world_size, timeout, DIAGNOSES,
                           _verified)
