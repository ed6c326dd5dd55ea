"""Exercise of notebook 09 (``09_precision_of_the_sum.ipynb``):
``average_gradients_in_fp32(model)`` averages a bf16 model's gradients over the ranks with the
sum in float32, and rounds the mean to bf16 once.

The check reads what the learner's collectives carried (an :class:`evidence.Recorder`): the
format they travelled in (``Call.dtype``: bfloat16 means the sum was rounded in bf16) and what
they delivered (the sum of every rank's gradients, which no rank holds alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import common, evidence
from .common import Run

#: How far float32's own rounding may move the mean before the one rounding to bf16, relative to
#: the size of its terms: a sum of N terms, a division before or after it, each a float32 step
#: (2^-24) at most. Near a bf16 tie (halfway between two bf16 numbers) that may tip the mean to
#: the other side. A second rounding in bf16 moves it by up to half a bf16 step (2^-8): it shows
#: far from any tie. (On 2 ranks a + b rounded once is exact to bf16, so only the format of the
#: all_reduce shows a sum in bf16.)
FLOAT32_DRIFT = 2.0**-18


def _flat(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors])


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    """On every rank: the course's CNN in bf16 with this rank's own gradients (fresh random
    data), every rank's gradients (for the expected mean), the learner's call, what happened."""
    model, images, labels = evidence.model_and_data(rank)
    F.nll_loss(model(images), labels).backward()
    model.to(torch.bfloat16)  # a model trained in bf16: bf16 weights, bf16 gradients
    params = evidence.params_of(model)
    own = _flat([p.grad for p in model.parameters()]).float()
    everyone = [torch.empty_like(own) for _ in range(world_size)]
    dist.all_gather(everyone, own)  # the check's own collective, before fn: float32 is exact
    with evidence.Recorder(fn) as calls:
        common.attempt(fn, model)
    grads = [p.grad for p in model.parameters()]
    formats = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}
                     - {"bfloat16"})
    return {
        "everyone": torch.stack(everyone).double() if rank == 0 else None,
        "own": own.double(),
        "counts": dict(calls.calls),
        "calls": calls.log,
        "grad_dtypes": sorted({str(g.dtype) for g in grads if g is not None}),
        "missing": sum(g is None for g in grads),
        "got": None if any(g is None for g in grads) else _flat(grads),
        "params": (f"turned the parameters {', '.join(formats)}" if formats else
                   evidence.changed_text(params, evidence.params_of(model),
                                         "changed the parameters:")),
    }


# --- What every rank should end with --------------------------------------------------------


def _exact_mean(run: Run) -> torch.Tensor:
    return run.outs[0]["everyone"].mean(0)


def _rounded_once(run: Run) -> torch.Tensor:
    """The exact mean, rounded once to bf16: what every rank's gradients should hold."""
    return _exact_mean(run).to(torch.bfloat16).double()


def _reduces(out: dict) -> list[evidence.Call]:
    return [c for c in out["calls"] if c.name == "all_reduce"]


def _what_arrived(run: Run, out: dict) -> str | None:
    """"sum" or "mean" if a rank's all_reduce calls delivered the ranks' gradients' sum (or
    their mean, with ReduceOp.AVG or a division before), else None."""
    got = evidence.delivered(_reduces(out))
    total = run.out["everyone"].sum(0)
    return next((what for what, e in (("sum", total), ("mean", total / run.size))
                 if evidence.among(e, got)), None)


# --- The diagnoses, most telling mistake first: each returns a message or None --------------


def _no_all_reduce(run: Run) -> str | None:
    if not any(o["counts"].get("all_reduce") for o in run.outs):
        return (f"{run.name} made no all_reduce call (collectives called: "
                f"{evidence.calls_text(run.out['counts'])}). Sum the ranks' gradients with one "
                "dist.all_reduce of a float32 buffer.")


def _not_float32(run: Run) -> str | None:
    formats = sorted({str(c.dtype).removeprefix("torch.") for o in run.outs
                      for c in _reduces(o)} - {"float32"})
    if not formats:
        return None
    how = ("the sum was computed in bfloat16, each addition rounded to 8 bits: cast first, "
           "buffer = torch.cat([p.grad.float().flatten() for p in model.parameters()])"
           if "bfloat16" in formats else "cast the gradients to float32 before the all_reduce")
    return f"your all_reduce carried {', '.join(formats)}, not float32: {how}."


_parameters_touched = common.left_alone(
    "params", "leave the model as it is, and write the mean into each p.grad "
    "(p.grad.copy_(...) rounds it to bf16).")


def _gradients_not_bf16(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        if out["missing"]:
            return (f"on rank {rank}, {out['missing']} parameters have no gradient after "
                    f"{run.name}: write the mean into each p.grad, do not remove it.")
        if out["grad_dtypes"] != ["torch.bfloat16"]:
            return (f"on rank {rank}, the gradients are {', '.join(out['grad_dtypes'])}: keep "
                    "them bf16 (p.grad.copy_(mean) casts and rounds once).")


def _unchanged(run: Run) -> str | None:
    if all(torch.equal(out["got"], out["own"]) for out in run.outs):
        return ("the gradients did not change: every rank still holds its own. Did you reduce "
                "a float32 copy and not copy the mean back into each p.grad?")


def _ranks_differ(run: Run) -> str | None:
    for rank, out in enumerate(run.outs[1:], start=1):
        if not torch.equal(out["got"], run.out["got"]):
            return (f"rank {rank}'s gradients differ from rank 0's: after averaging, every rank "
                    "must hold the same mean.")


def _scaled(run: Run) -> str | None:
    """The mean's multiple (least squares: bf16 rounds every number a little)."""
    got, mean = run.out["got"], _exact_mean(run)
    c = (got.dot(mean) / mean.dot(mean)).item()
    if abs(c - 1) < 0.01:
        return None
    if abs(c - run.size) < 0.01 * run.size:
        return (f"your gradients are {evidence.times_text(c)} the mean: all_reduce(SUM) gives "
                "the sum; divide it by the world size.")
    return (f"your gradients are {evidence.times_text(c)} the mean over ranks: divide the sum "
            f"by the world size.{evidence.divisor_hint(c, run.size, 'the world size')}")


def _rounded_more_than_once(run: Run) -> str | None:
    """Every number is the exact mean rounded once to bf16, except where float32's rounding
    tipped a mean that lies at a bf16 tie (by at most :data:`FLOAT32_DRIFT`)."""
    got, expected, exact = run.out["got"], _rounded_once(run), _exact_mean(run)
    # float32's rounding moves the mean by a few of its steps of the terms' size (not of the
    # mean's, which cancellation may make far smaller): any bf16 rounding of a mean moved that
    # little is rounded once. Rounding is monotone: those are the numbers between two roundings.
    moved = FLOAT32_DRIFT * run.out["everyone"].abs().mean(0)
    lowest, highest = ((exact + d).to(torch.bfloat16).double() for d in (-moved, moved))
    off = got != expected
    if ((got >= lowest) & (got <= highest)).all():
        return None
    return (f"{off.sum().item():,} of your {got.numel():,} numbers are not the float32 mean "
            "rounded once to bf16: round only at the end. Divide in float32, then copy into "
            "the bf16 gradient (a division in bf16, before or after, rounds a second time).")


def _not_delivered(run: Run) -> str | None:
    """The all_reduce calls must deliver the sum of every rank's gradients (or their mean):
    numbers no rank has alone."""
    for rank, out in enumerate(run.outs):
        if not _what_arrived(run, out):
            return (f"the gradients are right, but on rank {rank} your all_reduce calls "
                    f"delivered {evidence.numbers_text(evidence.delivered(_reduces(out)))}, not "
                    f"the sum of the ranks' {run.out['own'].numel():,} gradient numbers: the "
                    "mean reached the ranks another way. Reduce every gradient, once, in one "
                    "float32 buffer.")


DIAGNOSES = (_no_all_reduce, _not_float32, _parameters_touched, _gradients_not_bf16, _unchanged,
             _ranks_differ, _scaled, _rounded_more_than_once, _not_delivered)


def _verified(runs: Sequence[Run]) -> str:
    """The ✓ sentence, from what the runs computed."""
    calls = sorted({len(_reduces(o)) for r in runs for o in r.outs})
    numbers = sorted({sum(c.sent.numel() for c in _reduces(o)) for r in runs for o in r.outs})
    formats = sorted({str(c.dtype).removeprefix("torch.") for r in runs for o in r.outs
                      for c in _reduces(o)})
    arrived = sorted({_what_arrived(r, o) for r in runs for o in r.outs})
    exact = sum(int((o["got"] == _rounded_once(r)).sum()) for r in runs for o in r.outs)
    total = sum(o["got"].numel() for r in runs for o in r.outs)
    equal = (f"all {total:,} numbers" if exact == total else
             f"{exact:,} of {total:,} numbers; the rest, float32 ties, within one bf16 step")
    n_calls = " or ".join(map(str, calls))
    return (f"{common.sizes_text(runs)}, your all_reduce carried {', '.join(formats)} "
            f"({n_calls} call{'s' * (calls != [1])}, {' or '.join(f'{n:,}' for n in numbers)} "
            f"numbers) and delivered the {' or '.join(arrived)} of the ranks' bf16 gradients; "
            f"every rank's bf16 gradients are the mean rounded once ({equal}), and the "
            "parameters are untouched.")


@common.exercise("09_precision_of_the_sum.ipynb", "average_gradients_in_fp32(model)")
def check_average_gradients_in_fp32(
    average_gradients_in_fp32: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES,
    *, timeout: float = common.CHECK_TIMEOUT,
) -> str:
    """Check ``average_gradients_in_fp32(model)``: ``model`` is in bf16 (weights and
    gradients); afterwards every rank's bf16 gradients hold the mean over the ranks, summed in
    float32 and rounded to bf16 once.

    Runs it on 2, then 3 to 5 ranks, and on 3 too where 4 was drawn (``world_size``: another
    number, or several), each with the
    course's CNN and its own gradients from fresh random data. Says so if no all_reduce was
    called, if one carried bf16 (the sum rounded in bf16), if the parameters or the gradients'
    format changed, if the mean was not copied back, if ranks differ, if the gradients are N×
    the mean (or divided by a fixed number), if they were rounded twice (a division in bf16),
    or if the all_reduce did not deliver the sum of every rank's gradients (no rank holds it).

        >>> import gradsync_tutorial as gst
        >>> def average_gradients_in_fp32(model):      # the sum in bf16
        ...     for p in model.parameters():
        ...         dist.all_reduce(p.grad)
        ...         p.grad /= dist.get_world_size()
        >>> gst.exercises.check_average_gradients_in_fp32(average_gradients_in_fp32)
        ... # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: your all_reduce carried bfloat16, not float32: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, average_gradients_in_fp32, world_size, timeout, DIAGNOSES,
                           _verified, not_only_powers_of_two=True)
