"""Exercise of notebook 02 (``02_manual_allreduce_averaging.ipynb``):
``average_gradients_flat(model)`` averages every gradient over the ranks with ONE all_reduce.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import common, evidence
from .common import Run

# What torch says when a flat (1-D) piece meets a gradient of another shape: copy_, `p.grad =`,
# `p.grad[...] =`.
_SHAPE_ERRORS = re.compile(r"must match the (existing )?size|assign a gradient of size|"
                           r"shape mismatch|cannot be broadcast")


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    model, images, labels = evidence.model_and_data(rank)  # fresh random data: no rank can
    F.nll_loss(model(images), labels).backward()  # guess another's gradients, only receive them
    everyone = evidence.all_ranks(evidence.grads_of(model), world_size)  # for the mean
    params = evidence.params_of(model)
    with evidence.Recorder(fn) as calls:
        try:
            common.attempt(fn, model)
        except RuntimeError as e:  # a flat piece put back without its shape: say so, not a trace
            if not _SHAPE_ERRORS.search(str(e)):
                raise
            return {"shape_error": str(e).splitlines()[0]}
    return {"got": evidence.grads_of(model), "everyone": everyone, "counts": dict(calls.calls),
            "calls": calls.log, "params": evidence.changed_text(params, evidence.params_of(model),
                                                              "changed the parameters:")}


def _expected(run: Run) -> dict:
    return evidence.mean_over_ranks(run.out["everyone"])


# --- the diagnoses, most telling mistake first ----------------------------------------------


def _shape_error(run: Run) -> str | None:
    rank, error = run.first("shape_error")
    if error:
        return (f"on rank {rank}, putting a piece of the flat tensor back into a gradient "
                f"failed ({error.rstrip('.')}). A piece of the flat tensor is 1-D, (numel,), and "
                "a gradient has its parameter's shape, e.g. (6, 1, 5, 5): give the piece that "
                "shape, p.grad.copy_(piece.view_as(p.grad)).")


_parameters_touched = common.left_alone(
    "params", "average the gradients only, and leave the weights alone (the optimizer's step "
    "changes them, with the averaged gradients).")


def _gradient_missing(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        missing = [n for n, g in out["got"].items() if g is None]
        if missing:
            return (f"on rank {rank}, `{missing[0]}` has no gradient after {run.name}: write "
                    "the averaged values into each p.grad (p.grad.copy_(...)), do not remove "
                    "them.")


def _gradients_unchanged(run: Run) -> str | None:
    everyone = run.out["everyone"]
    if any(evidence.differing_tensors(o["got"], everyone[r]) for r, o in enumerate(run.outs)):
        return None
    if run.out["counts"].get("all_reduce"):
        return ("the gradients did not change: every rank still holds its own. You reduced a "
                "copy: torch.cat copies the gradients into a new tensor, so after all_reduce "
                "and the division, copy each piece back into its p.grad "
                "(p.grad.copy_(piece.view_as(p.grad))).")
    return (f"the gradients did not change: every rank still holds its own (collectives "
            f"called: {evidence.calls_text(run.out['counts'])}). Reduce them with one "
            "dist.all_reduce.")


def _ranks_differ(run: Run) -> str | None:
    for rank, out in enumerate(run.outs[1:], start=1):
        differing = evidence.differing_tensors(out["got"], run.out["got"])
        if differing:
            return (f"rank {rank}'s gradients differ from rank 0's in "
                    f"{evidence.where_text(differing, len(out['got']))}: after "
                    "averaging, every rank must hold the same mean gradient.")


def _all_zero(run: Run) -> str | None:
    if evidence.flatten(run.out["got"]).abs().max() == 0:
        return (f"your gradients are all zero after {run.name}: write the averaged values into "
                "each p.grad, do not zero them.")


def _not_the_mean(run: Run) -> str | None:
    return evidence.mean_mismatch(
        run.out["got"], _expected(run), run.size, "the mean over ranks",
        "did you divide by the world size? all_reduce(SUM) gives every rank the sum; the mean "
        "is sum / world_size.")


def _differs_from_mean(run: Run) -> str | None:
    expected = _expected(run)
    differing = evidence.differing_tensors(run.out["got"], expected)
    if differing:
        return (f"your gradients differ from the mean over ranks in "
                f"{evidence.where_text(differing, len(expected))}: do you copy the pieces back in "
                "the order you concatenated them, each with its own shape "
                "(piece.view_as(p.grad))?")


def _not_one_all_reduce(run: Run) -> str | None:
    reduces = run.out["counts"].get("all_reduce", 0)
    if reduces == 1:
        return None
    if reduces:
        return (f"the gradients are right, but you called all_reduce {reduces} times; one call "
                "is enough: flatten all gradients into one tensor (torch.cat), reduce it once, "
                "then copy the pieces back.")
    return (f"the gradients are right, but you did not use all_reduce (collectives called: "
            f"{evidence.calls_text(run.out['counts'])}): the exercise is one all_reduce on a "
            "flat tensor.")


def _delivered_by_the_all_reduce(out: dict) -> torch.Tensor:
    return evidence.delivered([c for c in out["calls"] if c.name == "all_reduce"][:1])


def _what_arrived(run: Run, got: torch.Tensor) -> str | None:
    """"sum" or "mean" if ``got`` is the ranks' gradients' sum or mean (as a flat tensor, in
    any order), else None."""
    expected = evidence.flatten(_expected(run)).double()
    if got.numel() != expected.numel():
        return None
    return next((what for what, e in (("sum", expected * run.size), ("mean", expected))
                 if evidence.among(e, got)), None)


def _gradients_not_carried(run: Run) -> str | None:
    """The one all_reduce must carry every gradient: its result, the sum (or the mean)."""
    expected = evidence.flatten(_expected(run)).double()
    for rank, out in enumerate(run.outs):
        got = _delivered_by_the_all_reduce(out)
        if _what_arrived(run, got):
            continue
        return (f"the gradients are right, but on rank {rank} the all_reduce delivered "
                f"{evidence.numbers_text(got)}, not the sum of "
                f"the ranks' {expected.numel():,} gradient numbers: the mean reached the ranks "
                "another way. Reduce the flat tensor of the gradients themselves.")


DIAGNOSES = (_shape_error, _parameters_touched, _gradient_missing, _gradients_unchanged,
             _ranks_differ, _all_zero, _not_the_mean, _differs_from_mean, _not_one_all_reduce,
             _gradients_not_carried)


def _verified(runs: Sequence[Run]) -> str:
    expected = _expected(runs[0])
    numbers = sum(t.numel() for t in expected.values())
    arrived = sorted({_what_arrived(r, _delivered_by_the_all_reduce(o))
                      for r in runs for o in r.outs})
    return (f"{common.sizes_text(runs)}, one all_reduce carried all {numbers:,} numbers of the "
            f"{len(expected)} gradients and delivered their {' or '.join(arrived)}; every rank "
            "holds the mean gradient, and the parameters are untouched.")


@common.exercise("02_manual_allreduce_averaging.ipynb", "average_gradients_flat(model)")
def check_average_gradients_flat(
    average_gradients_flat: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES, *,
    timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``average_gradients_flat(model)``: every rank ends with the mean of the ranks'
    gradients in ``.grad``, after **one** ``all_reduce`` that carries them all.

    Runs it on 2, then 3 to 5 ranks (``world_size``: another number, or several), each with the
    course's model (the same weights) and its own gradients, from fresh random data. Says so if
    the gradients did not change (the reduced buffer was never copied back), if a flat piece
    went back without its gradient's shape (``view_as``), if they are N× the mean (no division)
    or divided by a fixed number, if ranks differ (naming the tensor), if the parameters
    changed, how many ``all_reduce`` calls were made, and whether the one call carried the
    gradients (their sum is what it must deliver).

        >>> import gradsync_tutorial as gst
        >>> def average_gradients_flat(model):     # notebook 02's loop: 8 calls
        ...     for p in model.parameters():
        ...         dist.all_reduce(p.grad)
        ...         p.grad /= dist.get_world_size()
        >>> gst.exercises.check_average_gradients_flat(average_gradients_flat)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: the gradients are right, but you called all_reduce 8 times; ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, average_gradients_flat, world_size, timeout, DIAGNOSES,
                           _verified)
