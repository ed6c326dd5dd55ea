"""Exercise of notebook 03 (``03_distributed_data_parallel.ipynb``): ``broadcast_parameters(model)``
gives every rank rank 0's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..model import Net
from .common import (
    CHECK_TIMEOUT,
    STUB,
    WORLD_SIZE,
    CollectiveCounter,
    all_ranks,
    calls_text,
    differing_tensors,
    exercise,
    fail,
    fresh_seed,
    max_abs_diff,
    mean_over_ranks,
    name_of,
    params_of,
    run_on_ranks,
    where_text,
)


def _broadcast_worker(rank: int, world_size: int, fn: Callable) -> Any:
    # Fresh random weights on every rank, every time: no rank can compute rank 0's, it must
    # receive them.
    torch.manual_seed(fresh_seed())
    model = Net()
    ids = [id(p) for p in model.parameters()]
    everyone = all_ranks(params_of(model), world_size)  # every rank's weights, before
    with CollectiveCounter(fn) as counter:
        try:
            fn(model)
        except NotImplementedError:
            return STUB
    not_trainable = [n for n, p in model.named_parameters()
                     if not (isinstance(p, nn.Parameter) and p.requires_grad)]
    replaced = [id(p) for p in model.parameters()] != ids
    return {"after": params_of(model), "everyone": everyone, "counts": dict(counter.calls),
            "not_trainable": not_trainable, "replaced": replaced}


@exercise("03_distributed_data_parallel.ipynb", "broadcast_parameters(model)")
def check_broadcast_parameters(
    broadcast_parameters: Callable, world_size: int = WORLD_SIZE, *, timeout: float = CHECK_TIMEOUT
) -> str:
    """Check ``broadcast_parameters(model)``: afterwards every rank holds rank 0's parameters.

    Runs it on ``world_size`` ranks (3 by default) whose models start from *different* fresh
    random weights (so only communication can deliver rank 0's). Says if no collective was
    called, which tensor differs between ranks, whether you broadcast into a copy, whether the
    ranks agree on the *average* (an all_reduce) instead of rank 0's weights, and whether the
    parameters are still trainable.

        >>> import gradsync_tutorial as gst
        >>> def broadcast_parameters(model):
        ...     for p in model.parameters():
        ...         dist.broadcast(p.detach(), src=0)   # in place: p itself changes
        >>> gst.exercises.check_broadcast_parameters(broadcast_parameters)  # doctest: +SKIP
        ✓ correct: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    outs = run_on_ranks(_broadcast_worker, broadcast_parameters, world_size, timeout)
    name = name_of(broadcast_parameters)
    before = outs[0]["everyone"]
    total = len(before[0])
    counts = outs[0]["counts"]
    mean = mean_over_ranks(before)

    for rank, out in enumerate(outs):
        if out["not_trainable"]:
            fail(f"on rank {rank}, `{out['not_trainable'][0]}` is no longer a trainable "
                 f"parameter after {name}: copy the values into the existing parameters "
                 "(dist.broadcast(p.detach(), src=0) works in place) instead of replacing them.")
    if not any(out["counts"] for out in outs):
        fail(f"{name} made no collective call, so the other ranks cannot have received rank 0's "
             "weights (they start from fresh random weights, different at every check). Call "
             "dist.broadcast(p.detach(), src=0) for every parameter, on every rank.")
    if all(not differing_tensors(out["after"], mean) for out in outs):
        fail(
            "the replicas agree, but on the average of the ranks' weights, not on rank 0's: "
            "all_reduce and divide averages; use dist.broadcast(tensor, src=0), which copies "
            "rank 0's tensor into every rank's."
        )
    changed0 = differing_tensors(outs[0]["after"], before[0])
    for src in range(1, world_size):
        if changed0 and all(not differing_tensors(out["after"], before[src]) for out in outs):
            fail(f"every rank holds rank {src}'s weights: broadcast from rank 0, src=0 (the "
                 "rank that sends), on every rank.")
    if changed0:
        fail(f"rank 0's own parameters changed, in {where_text(changed0, total)}: rank 0 is the "
             "source (src=0), its weights must stay as they were.")
    for rank, out in enumerate(outs[1:], start=1):
        differing = differing_tensors(out["after"], outs[0]["after"])
        if not differing:
            continue
        untouched = not differing_tensors(out["after"], before[rank])
        if untouched and counts:
            fail(
                f"rank {rank}'s parameters did not change, although you called "
                f"{calls_text(counts)}: you broadcast into a copy (p.clone(), "
                "p.detach().clone(), torch.tensor(p), p.tolist()...). broadcast writes into "
                "the tensor you pass: pass the parameter itself, p.detach() or p.data."
            )
        if untouched:
            fail(f"rank {rank}'s parameters did not change: {name} made no collective call. "
                 "Call dist.broadcast(p.detach(), src=0) for every parameter.")
        fail(
            f"rank {rank}'s parameters differ from rank 0's in {where_text(differing, total)}: did "
            "you broadcast every parameter? model.parameters() gives all of them, biases too."
        )
    if outs[0]["replaced"] or any(o["replaced"] for o in outs):
        print(f"note: {name} replaced the model's parameter objects; an optimizer built "
              "before it would still hold the old ones. Copy into them instead.")
    spread = max(max_abs_diff(b[n], before[0][n]) for b in before[1:] for n in before[0])
    return (
        f"the {world_size} ranks started from different weights (max difference "
        f"{spread:.2g}); after {name} every rank holds rank 0's, all {total} tensors exactly "
        f"(collectives called: {calls_text(counts)})."
    )
