"""Exercise of notebook 04 (``04_pitfalls.ipynb``): ``global_mean_loss(losses)`` is the mean over
every rank's samples, the same float on every rank, when the ranks hold different numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .common import (
    CHECK_TIMEOUT,
    STUB,
    WORLD_SIZE,
    CollectiveCounter,
    calls_text,
    exercise,
    fail,
    fresh_seed,
    is_number,
    name_of,
    run_on_ranks,
)


def _uneven_losses(rank: int) -> torch.Tensor:
    """Rank ``rank``'s per-sample losses: 8 samples on even ranks, 3 on odd ones (plus one per
    pair of ranks), values around ``rank + 1``, so that every way of averaging them differs.
    Fresh random values at every check: no rank can compute another's, it must receive them."""
    count = (8, 3)[rank % 2] + rank // 2
    g = torch.Generator().manual_seed(fresh_seed())
    weight = torch.ones((), requires_grad=True)  # losses come out of a graph, as in training
    return (rank + 1) * (0.5 + torch.rand(count, generator=g)) * weight


def _mean_loss_worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist

    losses = _uneven_losses(rank)
    before = losses.detach().clone()
    mine = torch.tensor([before.double().sum().item(), float(len(before))], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)  # every rank's (sum, count), for the diagnosis
    with CollectiveCounter(fn) as counter:
        try:
            result = fn(losses)
        except NotImplementedError:
            return STUB
    if isinstance(result, torch.Tensor):
        result = {"tensor": repr(result.detach().cpu())}
    elif not (is_number(result) or result is None):
        result = {"other": f"{type(result).__name__} {result!r:.60}"}
    elif result is not None:
        result = float(result)
    changed = not torch.equal(losses.detach(), before)
    return {"result": result, "sums_counts": [e.tolist() for e in everyone],
            "counts": dict(counter.calls), "changed": changed}


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


@exercise("04_pitfalls.ipynb", "global_mean_loss(losses)")
def check_global_mean_loss(
    global_mean_loss: Callable, world_size: int = WORLD_SIZE, *, timeout: float = CHECK_TIMEOUT
) -> str:
    """Check ``global_mean_loss(losses) -> float``: the mean loss over *every* rank's samples,
    the same float on every rank, when the ranks hold different numbers of samples.

    ``losses`` is this rank's per-sample losses (``F.nll_loss(..., reduction="none")``): 8 on
    rank 0, 3 on rank 1, 9 on rank 2, fresh random values at every check. Runs it on
    ``world_size`` ranks (3 by default) and compares with the mean of all the samples. Says so
    if you returned the mean of the ranks' means (notebook 04's mean-of-means pitfall), a sum
    you did not divide, a rank's own value (no collective), the global sum over a rank's own
    count, if ranks returned different values, or if one rank skipped the all_reduce (it hangs).

        >>> import gradsync_tutorial as gst
        >>> def global_mean_loss(losses):          # the mean of the means: caught
        ...     mean = losses.detach().mean()
        ...     dist.all_reduce(mean)
        ...     return (mean / dist.get_world_size()).item()
        >>> gst.exercises.check_global_mean_loss(global_mean_loss)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: every rank returned 1.36..., the mean of the ranks' means; ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    outs = run_on_ranks(_mean_loss_worker, global_mean_loss, world_size, timeout)
    name = name_of(global_mean_loss)
    sums, counts = zip(*outs[0]["sums_counts"], strict=True)
    total, n = sum(sums), sum(counts)
    expected = total / n
    means = [s / c for s, c in zip(sums, counts, strict=True)]
    mean_of_means = sum(means) / world_size
    calls = outs[0]["counts"]
    sizes = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts))

    for rank, out in enumerate(outs):
        result = out["result"]
        if result is None:
            fail(f"{name} returned None on rank {rank}: return the mean loss, a float.")
        if isinstance(result, dict) and "tensor" in result:
            fail(f"rank {rank} returned a tensor, {result['tensor']:.60}: return a float "
                 "(`.item()`), the number you log.")
        if isinstance(result, dict):
            fail(f"rank {rank} returned {result['other']}: return the mean loss, a float.")
        if out["changed"]:
            fail(f"on rank {rank}, {name} changed the `losses` tensor it was given: in "
                 "training it is also what backward() uses. Reduce a copy (losses.detach()."
                 "sum() is a new tensor).")
    results = [out["result"] for out in outs]
    got = ", ".join(f"rank {r}: {x:.6g}" for r, x in enumerate(results))
    if not all(_same(r, results[0]) for r in results) and all(
            _same(r, m) for r, m in zip(results, means, strict=True)):
        fail(f"every rank returned its own mean ({got}; collectives called: "
             f"{calls_text(calls)}): the ranks must exchange their sums and counts with "
             "dist.all_reduce, and every rank gets the same global mean.")
    if not any(out["counts"] for out in outs):
        fail(f"{name} made no collective call, so no rank knows the others' losses (fresh random "
             f"numbers at every check): the ranks returned {got}, the mean over all samples is "
             f"{expected:.6g}. Reduce this rank's sum and count with dist.all_reduce.")
    if not all(_same(r, results[0]) for r in results):
        if all(_same(r, total / c) for r, c in zip(results, counts, strict=True)):
            fail(f"the ranks returned different values ({got}): each divided the global sum "
                 "of the losses by its own count. all_reduce the count too (one call: "
                 "torch.stack([loss_sum, count])) and divide by the total count.")
        fail(f"the ranks returned different values ({got}): every rank must make the same "
             "all_reduce calls and divide the same totals, so that all log the same number.")
    got = results[0]
    if not _same(got, expected):
        if _same(got, mean_of_means):
            hint = (f"the mean of the ranks' means ({' and '.join(f'{m:.4g}' for m in means)}). "
                    f"The ranks hold different numbers of samples ({sizes}), so the mean of "
                    "means weighs a sample on a small rank more (the mean-of-means pitfall). "
                    "all_reduce the sum of the losses and the number of samples, then divide "
                    "once.")
        elif _same(got, world_size * mean_of_means):
            hint = ("the sum of the ranks' means: all_reduce(SUM) adds them up, and even "
                    "divided by the world size the mean of means is wrong when the ranks hold "
                    f"different numbers of samples ({sizes}). all_reduce the sum of the losses "
                    "and the number of samples, then divide once.")
        elif _same(got, total):
            hint = (f"the sum of all {int(n)} losses: divide by the total number of samples "
                    "(all_reduce the count too).")
        elif _same(got, total / world_size):
            hint = (f"the sum of all losses divided by the world size; divide by the number of "
                    f"samples, {int(n)} in all ({sizes}): all_reduce the count too.")
        elif any(_same(got, m) for m in means):
            hint = "one rank's own mean: reduce over every rank."
        else:
            hint = f"not any of the usual mistakes (ranks' samples: {sizes})."
        fail(f"every rank returned {got:.6g}; the mean over all {int(n)} samples is "
             f"{expected:.6g}. Yours is {hint}")
    reduces = calls.get("all_reduce", 0)
    if reduces > 1:
        print(f"note: you called all_reduce {reduces} times; one call on "
              "torch.stack([loss_sum, count]) sends both numbers at once.")
    return (
        f"with {sizes} samples, every one of the {world_size} ranks returned {got:.6g}, the mean "
        f"over all {int(n)} samples (the mean of the ranks' means would be {mean_of_means:.6g}; "
        f"collectives called: {calls_text(calls)})."
    )
