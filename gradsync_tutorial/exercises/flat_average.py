"""Exercise of notebook 02 (``02_manual_allreduce_averaging.ipynb``):
``average_gradients_flat(model)`` averages every gradient over the ranks with ONE all_reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

from ._common import (
    _STUB,
    CHECK_TIMEOUT,
    CollectiveCounter,
    _all_ranks,
    _calls_text,
    _differing,
    _fail,
    _flatten,
    _grads,
    _launch,
    _mean_over_ranks,
    _model_and_data,
    _name,
    _not_attempted,
    _passed,
    _require_function,
    _scale,
    _times,
    _where,
)


def _average_flat_worker(rank: int, world_size: int, fn: Callable) -> Any:
    model, images, labels = _model_and_data(rank)
    F.nll_loss(model(images), labels).backward()  # this rank's own gradients
    everyone = _all_ranks(_grads(model), world_size)  # every rank's, to compute the mean
    with CollectiveCounter(fn) as counter:
        try:
            fn(model)
        except NotImplementedError:
            return _STUB
    return {"got": _grads(model), "everyone": everyone, "counts": dict(counter.calls)}


def check_average_gradients_flat(
    average_gradients_flat: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> None:
    """Check ``average_gradients_flat(model)``: every rank ends with the mean of the ranks'
    gradients in ``.grad``, after **one** ``all_reduce``.

    Runs it on ``world_size`` ranks, each with the course's model (the same weights) and its own
    gradients. Says so if the gradients did not change (the reduced buffer was never copied
    back), if they are N× the mean (no division), if ranks differ (naming the tensor), and how
    many ``all_reduce`` calls were made.

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
    Exercise of ``notebooks/02_manual_allreduce_averaging.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(average_gradients_flat, 1, "average_gradients_flat(model)")
    outs = _launch(_average_flat_worker, average_gradients_flat, world_size, timeout)
    if outs is None:
        return _not_attempted(average_gradients_flat, "average_gradients_flat")
    name = _name(average_gradients_flat)
    everyone = outs[0]["everyone"]
    expected = _mean_over_ranks(everyone)
    total = len(expected)
    counts = outs[0]["counts"]
    reduces = counts.get("all_reduce", 0)

    for rank, out in enumerate(outs):
        missing = [n for n, g in out["got"].items() if g is None]
        if missing:
            _fail(f"on rank {rank}, `{missing[0]}` has no gradient after {name}: write the "
                  "averaged values into each p.grad (p.grad.copy_(...)), do not remove them.")
    if all(not _differing(out["got"], everyone[rank]) for rank, out in enumerate(outs)):
        if reduces:
            _fail(
                "the gradients did not change: every rank still holds its own. You reduced a "
                "copy: torch.cat copies the gradients into a new tensor, so after all_reduce "
                "and the division, copy each piece back into its p.grad "
                "(p.grad.copy_(piece.view_as(p.grad)))."
            )
        _fail(f"the gradients did not change: every rank still holds its own (collectives "
              f"called: {_calls_text(counts)}). Reduce them with one dist.all_reduce.")
    for rank, out in enumerate(outs[1:], start=1):
        differing = _differing(out["got"], outs[0]["got"])
        if differing:
            _fail(
                f"rank {rank}'s gradients differ from rank 0's in {_where(differing, total)}: "
                "after averaging, every rank must hold the same mean gradient."
            )
    got = outs[0]["got"]
    if _flatten(got).abs().max() == 0:
        _fail(f"your gradients are all zero after {name}: write the averaged values into each "
              "p.grad, do not zero them.")
    c = _scale(got, expected)
    if c is not None and abs(c - world_size) < 1e-3:
        _fail(f"your gradients are {_times(c)} the expected ones: did you divide by the world "
              "size? all_reduce(SUM) gives every rank the sum; the mean is sum / world_size.")
    if c is not None and abs(c - 1) > 1e-3:
        _fail(f"your gradients are {_times(c)} the expected ones (the mean over ranks): divide "
              "the sum by the world size, once.")
    differing = _differing(got, expected)
    if differing:
        _fail(
            f"your gradients differ from the mean over ranks in {_where(differing, total)}: "
            "do you copy the pieces back in the order you concatenated them, each with its own "
            "shape (piece.view_as(p.grad))?"
        )
    if reduces != 1:
        if reduces:
            _fail(f"the gradients are right, but you called all_reduce {reduces} times; one "
                  "call is enough: flatten all gradients into one tensor (torch.cat), reduce it "
                  "once, then copy the pieces back.")
        _fail(f"the gradients are right, but you did not use all_reduce (collectives called: "
              f"{_calls_text(counts)}): the exercise is one all_reduce on a flat tensor.")
    numbers = sum(t.numel() for t in expected.values())
    return _passed(f"one all_reduce for all {total} gradients ({numbers:,} numbers); every one "
                   f"of the {world_size} ranks holds the mean gradient.")
