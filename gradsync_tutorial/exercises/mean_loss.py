"""Exercise of notebook 04 (``04_pitfalls.ipynb``): ``global_mean_loss(losses)`` is the mean over
every rank's samples, the same float on every rank, when the ranks hold different numbers.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import common, evidence
from .common import Run


def _uneven_losses(rank: int, count: int) -> torch.Tensor:
    """Rank ``rank``'s ``count`` per-sample losses, values around ``rank + 1``, fresh random
    values at every check: no rank can compute another's, it must receive them."""
    g = torch.Generator().manual_seed(evidence.fresh_seed())
    weight = torch.ones((), requires_grad=True)  # losses come out of a graph, as in training
    return (rank + 1) * (0.5 + torch.rand(count, generator=g)) * weight


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist

    # How many samples each rank holds: different numbers, drawn afresh by rank 0 at every
    # check, so that no rank knows the others' (nor their total) without asking.
    counts = [random.Random(evidence.fresh_seed()).sample(range(2, 2 + 8 * world_size),
                                                        world_size)]
    dist.broadcast_object_list(counts, src=0)
    losses = _uneven_losses(rank, counts[0][rank])
    before = losses.detach().clone()
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, before.double().tolist())  # for the diagnosis
    with evidence.Recorder(fn) as calls:
        result = common.attempt(fn, losses)
    if isinstance(result, torch.Tensor):
        result = {"tensor": repr(result.detach().cpu())}
    elif not (evidence.is_number(result) or result is None):
        result = {"other": f"{type(result).__name__} {result!r:.60}"}
    elif result is not None:
        result = float(result)
    return {"result": result, "losses": everyone, "counts": dict(calls.calls),
            "calls": calls.log, "changed": not torch.equal(losses.detach(), before)}


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


@dataclass
class _Totals:
    """What the ranks held, for the diagnoses: sums, counts, the mean and the usual mistakes."""

    losses: list[list[float]]

    def __post_init__(self) -> None:
        self.sums = [sum(x) for x in self.losses]
        self.counts = [len(x) for x in self.losses]
        self.total, self.n = sum(self.sums), sum(self.counts)
        self.expected = self.total / self.n
        self.means = [s / c for s, c in zip(self.sums, self.counts, strict=True)]
        self.mean_of_means = sum(self.means) / len(self.means)
        self.sizes = ", ".join(f"rank {r}: {c}" for r, c in enumerate(self.counts))

    def usual_mistakes(self) -> list[tuple[float, str]]:
        """(what a mistake returns, what it is): the table of the usual wrong means."""
        divide_once = ("all_reduce the sum of the losses and the number of samples, then "
                       "divide once.")
        return [
            (self.mean_of_means, f"the mean of the ranks' means "
             f"({' and '.join(f'{m:.4g}' for m in self.means)}). The ranks hold different "
             f"numbers of samples ({self.sizes}), so the mean of means weighs a sample on a "
             f"small rank more (the mean-of-means pitfall). {divide_once}"),
            (len(self.means) * self.mean_of_means, "the sum of the ranks' means: "
             "all_reduce(SUM) adds them up, and even divided by the world size the mean of "
             f"means is wrong when the ranks hold different numbers of samples ({self.sizes})."
             f" {divide_once}"),
            (self.total, f"the sum of all {self.n} losses: divide by the total number of "
             "samples (all_reduce the count too)."),
            (self.total / len(self.means), "the sum of all losses divided by the world size; "
             f"divide by the number of samples, {self.n} in all ({self.sizes}): all_reduce the "
             "count too."),
            *((m, "one rank's own mean: reduce over every rank.") for m in self.means),
        ]


def _results(run: Run) -> str:
    return ", ".join(f"rank {r}: {o['result']:.6g}" for r, o in enumerate(run.outs))


# --- the diagnoses, most telling mistake first ----------------------------------------------


def _not_a_float_or_losses_changed(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        result = out["result"]
        if result is None:
            return f"{run.name} returned None on rank {rank}: return the mean loss, a float."
        if isinstance(result, dict) and "tensor" in result:
            return (f"rank {rank} returned a tensor, {result['tensor']:.60}: return a float "
                    "(`.item()`), the number you log.")
        if isinstance(result, dict):
            return f"rank {rank} returned {result['other']}: return the mean loss, a float."
        if out["changed"]:
            return (f"on rank {rank}, {run.name} changed the `losses` tensor it was given: in "
                    "training it is also what backward() uses. Reduce a copy (losses.detach()."
                    "sum() is a new tensor).")


def _own_means(run: Run) -> str | None:
    t, results = _Totals(run.out["losses"]), [o["result"] for o in run.outs]
    if not all(_same(r, results[0]) for r in results) and all(
            _same(r, m) for r, m in zip(results, t.means, strict=True)):
        return (f"every rank returned its own mean ({_results(run)}; collectives called: "
                f"{evidence.calls_text(run.out['counts'])}): the ranks must exchange their sums "
                "and counts with dist.all_reduce, and every rank gets the same global mean.")


def _no_collective(run: Run) -> str | None:
    if not any(out["counts"] for out in run.outs):
        t = _Totals(run.out["losses"])
        return (f"{run.name} made no collective call, so no rank knows the others' losses "
                f"(fresh random numbers at every check): the ranks returned {_results(run)}, "
                f"the mean over all samples is {t.expected:.6g}. Reduce this rank's sum and "
                "count with dist.all_reduce.")


def _ranks_disagree(run: Run) -> str | None:
    t, results = _Totals(run.out["losses"]), [o["result"] for o in run.outs]
    if all(_same(r, results[0]) for r in results):
        return None
    if all(_same(r, t.total / c) for r, c in zip(results, t.counts, strict=True)):
        return (f"the ranks returned different values ({_results(run)}): each divided the "
                "global sum of the losses by its own count. all_reduce the count too (one "
                "call: torch.stack([loss_sum, count])) and divide by the total count.")
    return (f"the ranks returned different values ({_results(run)}): every rank must make the "
            "same all_reduce calls and divide the same totals, so that all log the same number.")


def _not_the_mean(run: Run) -> str | None:
    t, got = _Totals(run.out["losses"]), run.out["result"]
    if _same(got, t.expected):
        return None
    k = t.total / got if got else 0.0
    fixed = (f"the sum of all losses divided by {round(k)}: the ranks hold {t.n} samples in all "
             f"({t.sizes}), a number that changes; all_reduce the count too."
             if abs(k - round(k)) < 1e-4 and round(k) > 0 else
             f"not any of the usual mistakes (ranks' samples: {t.sizes}).")
    hint = next((what for value, what in t.usual_mistakes() if _same(got, value)), fixed)
    return (f"every rank returned {got:.6g}; the mean over all {t.n} samples is "
            f"{t.expected:.6g}. Yours is {hint}")


def _among(delivered: torch.Tensor, *values: float) -> bool:
    return evidence.among(torch.tensor(values, dtype=torch.float64), delivered)


def _totals_not_delivered(run: Run) -> str | None:
    """What arrived must hold the totals (or every rank's sum, mean or losses, and counts)."""
    t = _Totals(run.out["losses"])
    for rank, out in enumerate(run.outs):
        got = evidence.delivered(out["calls"])
        has = functools.partial(_among, got)
        if (has(t.total, t.n) or (has(*t.sums) or has(*t.means)) and has(*t.counts)
                or has(*(x for losses in t.losses for x in losses))):
            continue
        return (f"every rank returned the right mean, but rank {rank}'s collectives delivered "
                f"{evidence.carried_text(out['calls'])}: not the sum of the losses and the count "
                "of samples, so the mean reached the ranks another way. all_reduce "
                "torch.stack([loss_sum, count]) and divide what it delivers.")


DIAGNOSES = (_not_a_float_or_losses_changed, _own_means, _no_collective, _ranks_disagree,
             _not_the_mean, _totals_not_delivered)


def _verified(runs: Sequence[Run]) -> str:
    reduces = max(o["counts"].get("all_reduce", 0) for r in runs for o in r.outs)
    if reduces > 1:
        print(f"note: you called all_reduce {reduces} times; one call on "
              "torch.stack([loss_sum, count]) sends both numbers at once.")
    said = []
    for run in runs:
        t = _Totals(run.out["losses"])
        said.append(f"{run.label}, with {t.sizes} samples, every rank returned "
                    f"{run.out['result']:.6g}, the mean over all {t.n} (the mean of the ranks' "
                    f"means would be {t.mean_of_means:.6g})")
    return ("; ".join(said) + "; the totals were delivered by the collectives (on rank 0: "
            f"{evidence.calls_text(runs[-1].out['counts'])}).")


@common.exercise("04_pitfalls.ipynb", "global_mean_loss(losses)")
def check_global_mean_loss(
    global_mean_loss: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES, *,
    timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``global_mean_loss(losses) -> float``: the mean loss over *every* rank's samples,
    the same float on every rank, when the ranks hold different numbers of samples.

    ``losses`` is this rank's per-sample losses (``F.nll_loss(..., reduction="none")``):
    different numbers of them on different ranks (from 2 to 8 times the world size), numbers
    and values drawn afresh at every check. Runs it on 2, then 3 to 5 ranks (``world_size``: another
    number, or several) and compares with the mean of all the samples. Says so if you returned
    the mean of the ranks' means (notebook 04's mean-of-means pitfall), a sum you did not
    divide, a rank's own value (no collective), the global sum over a rank's own count, if
    ranks returned different values, if one rank skipped the all_reduce (it hangs), or if the
    totals did not come through the collectives.

        >>> import gradsync_tutorial as gst
        >>> def global_mean_loss(losses):          # the mean of the means: caught
        ...     mean = losses.detach().mean()
        ...     dist.all_reduce(mean)
        ...     return (mean / dist.get_world_size()).item()
        >>> gst.exercises.check_global_mean_loss(global_mean_loss)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: every rank returned 1.36..., the mean of the ranks' means; ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, global_mean_loss, world_size, timeout, DIAGNOSES, _verified)
