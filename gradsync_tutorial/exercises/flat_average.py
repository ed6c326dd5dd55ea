"""Exercise of notebook 02 (``02_manual_allreduce_averaging.ipynb``):
``average_gradients_flat(model)`` averages every gradient over the ranks with ONE all_reduce.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

from .common import (
    CHECK_TIMEOUT,
    STUB,
    WORLD_SIZE,
    CollectiveCounter,
    all_ranks,
    calls_text,
    differing_tensors,
    divisor_hint,
    exercise,
    fail,
    flatten,
    grads_of,
    mean_over_ranks,
    model_and_data,
    name_of,
    run_on_ranks,
    scale,
    times_text,
    where_text,
)

# What torch says when a flat (1-D) piece meets a gradient of another shape: copy_, `p.grad =`,
# `p.grad[...] =`.
_SHAPE_ERRORS = re.compile(r"must match the (existing )?size|assign a gradient of size|"
                           r"shape mismatch|cannot be broadcast")


def _average_flat_worker(rank: int, world_size: int, fn: Callable) -> Any:
    model, images, labels = model_and_data(rank)  # fresh random data: no rank can guess another's
    F.nll_loss(model(images), labels).backward()  # this rank's own gradients
    everyone = all_ranks(grads_of(model), world_size)  # every rank's, to compute the mean
    with CollectiveCounter(fn) as counter:
        try:
            fn(model)
        except NotImplementedError:
            return STUB
        except RuntimeError as e:  # a flat piece put back without its shape: say so, not a trace
            if not _SHAPE_ERRORS.search(str(e)):
                raise
            return {"shape_error": str(e).splitlines()[0]}
    return {"got": grads_of(model), "everyone": everyone, "counts": dict(counter.calls)}


@exercise("02_manual_allreduce_averaging.ipynb", "average_gradients_flat(model)")
def check_average_gradients_flat(
    average_gradients_flat: Callable, world_size: int = WORLD_SIZE, *,
    timeout: float = CHECK_TIMEOUT,
) -> str:
    """Check ``average_gradients_flat(model)``: every rank ends with the mean of the ranks'
    gradients in ``.grad``, after **one** ``all_reduce``.

    Runs it on ``world_size`` ranks (3 by default), each with the course's model (the same
    weights) and its own gradients, from fresh random data. Says so if the gradients did not
    change (the reduced buffer was never copied back), if a flat piece went back without its
    gradient's shape (``view_as``), if they are N× the mean (no division) or divided by a fixed
    number, if ranks differ (naming the tensor), and how many ``all_reduce`` calls were made.

        >>> import gradsync_tutorial as gst
        >>> def average_gradients_flat(model):     # notebook 02's loop: 8 calls
        ...     for p in model.parameters():
        ...         dist.all_reduce(p.grad)
        ...         p.grad /= dist.get_world_size()
        >>> gst.exercises.check_average_gradients_flat(average_gradients_flat)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: the gradients are right, but you called all_reduce 8 times; ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    outs = run_on_ranks(_average_flat_worker, average_gradients_flat, world_size, timeout)
    name = name_of(average_gradients_flat)
    shape_errors = [(rank, o["shape_error"]) for rank, o in enumerate(outs) if "shape_error" in o]
    if shape_errors:
        rank, error = shape_errors[0]
        fail(
            f"on rank {rank}, putting a piece of the flat tensor back into a gradient failed "
            f"({error.rstrip('.')}). A piece of the flat tensor is 1-D, (numel,), and a "
            "gradient has its parameter's shape, e.g. (6, 1, 5, 5): give the piece that "
            "shape, p.grad.copy_(piece.view_as(p.grad))."
        )
    everyone = outs[0]["everyone"]
    expected = mean_over_ranks(everyone)
    total = len(expected)
    counts = outs[0]["counts"]
    reduces = counts.get("all_reduce", 0)

    for rank, out in enumerate(outs):
        missing = [n for n, g in out["got"].items() if g is None]
        if missing:
            fail(f"on rank {rank}, `{missing[0]}` has no gradient after {name}: write the "
                 "averaged values into each p.grad (p.grad.copy_(...)), do not remove them.")
    if all(not differing_tensors(out["got"], everyone[rank]) for rank, out in enumerate(outs)):
        if reduces:
            fail(
                "the gradients did not change: every rank still holds its own. You reduced a "
                "copy: torch.cat copies the gradients into a new tensor, so after all_reduce "
                "and the division, copy each piece back into its p.grad "
                "(p.grad.copy_(piece.view_as(p.grad)))."
            )
        fail(f"the gradients did not change: every rank still holds its own (collectives "
             f"called: {calls_text(counts)}). Reduce them with one dist.all_reduce.")
    for rank, out in enumerate(outs[1:], start=1):
        differing = differing_tensors(out["got"], outs[0]["got"])
        if differing:
            fail(
                f"rank {rank}'s gradients differ from rank 0's in {where_text(differing, total)}: "
                "after averaging, every rank must hold the same mean gradient."
            )
    got = outs[0]["got"]
    if flatten(got).abs().max() == 0:
        fail(f"your gradients are all zero after {name}: write the averaged values into each "
             "p.grad, do not zero them.")
    c = scale(got, expected)
    if c is not None and abs(c - world_size) < 1e-3:
        fail(f"your gradients are {times_text(c)} the expected ones: did you divide by the world "
             "size? all_reduce(SUM) gives every rank the sum; the mean is sum / world_size.")
    if c is not None and abs(c - 1) > 1e-3:
        fail(f"your gradients are {times_text(c)} the expected ones (the mean over ranks): divide "
             "the sum by the world size, once."
             f"{divisor_hint(c, world_size, 'world_size, dist.get_world_size()')}")
    differing = differing_tensors(got, expected)
    if differing:
        fail(
            f"your gradients differ from the mean over ranks in {where_text(differing, total)}: "
            "do you copy the pieces back in the order you concatenated them, each with its own "
            "shape (piece.view_as(p.grad))?"
        )
    if reduces != 1:
        if reduces:
            fail(f"the gradients are right, but you called all_reduce {reduces} times; one "
                 "call is enough: flatten all gradients into one tensor (torch.cat), reduce it "
                 "once, then copy the pieces back.")
        fail(f"the gradients are right, but you did not use all_reduce (collectives called: "
             f"{calls_text(counts)}): the exercise is one all_reduce on a flat tensor.")
    numbers = sum(t.numel() for t in expected.values())
    return (f"one all_reduce for all {total} gradients ({numbers:,} numbers); every one "
                   f"of the {world_size} ranks holds the mean gradient.")
