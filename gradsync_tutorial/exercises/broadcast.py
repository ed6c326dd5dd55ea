"""Exercise of notebook 03 (``03_distributed_data_parallel.ipynb``): ``broadcast_parameters(model)``
gives every rank rank 0's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..model import Net
from ._common import (
    _STUB,
    CHECK_TIMEOUT,
    SEED,
    CollectiveCounter,
    _all_ranks,
    _calls_text,
    _differing,
    _fail,
    _launch,
    _max_abs_diff,
    _mean_over_ranks,
    _name,
    _not_attempted,
    _params,
    _passed,
    _require_function,
    _where,
)


def _broadcast_worker(rank: int, world_size: int, fn: Callable) -> Any:
    torch.manual_seed(SEED + rank)  # a different seed per rank: different initial weights
    model = Net()
    ids = [id(p) for p in model.parameters()]
    everyone = _all_ranks(_params(model), world_size)  # every rank's weights, before
    with CollectiveCounter(fn) as counter:
        try:
            fn(model)
        except NotImplementedError:
            return _STUB
    not_trainable = [n for n, p in model.named_parameters()
                     if not (isinstance(p, nn.Parameter) and p.requires_grad)]
    replaced = [id(p) for p in model.parameters()] != ids
    return {"after": _params(model), "everyone": everyone, "counts": dict(counter.calls),
            "not_trainable": not_trainable, "replaced": replaced}


def check_broadcast_parameters(
    broadcast_parameters: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> None:
    """Check ``broadcast_parameters(model)``: afterwards every rank holds rank 0's parameters.

    Runs it on ``world_size`` ranks whose models start from *different* seeds. Says which
    tensor differs between ranks, whether you broadcast into a copy, whether the ranks agree on
    the *average* (an all_reduce) instead of rank 0's weights, and whether the parameters are
    still trainable.

        >>> import gradsync_tutorial as gst
        >>> def broadcast_parameters(model):
        ...     for p in model.parameters():
        ...         dist.broadcast(p.detach(), src=0)   # in place: p itself changes
        >>> gst.exercises.check_broadcast_parameters(broadcast_parameters)  # doctest: +SKIP
        ✓ correct: ...
        True

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    Exercise of ``notebooks/03_distributed_data_parallel.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(broadcast_parameters, 1, "broadcast_parameters(model)")
    outs = _launch(_broadcast_worker, broadcast_parameters, world_size, timeout)
    if outs is None:
        return _not_attempted(broadcast_parameters, "broadcast_parameters")
    name = _name(broadcast_parameters)
    before = outs[0]["everyone"]
    total = len(before[0])
    counts = outs[0]["counts"]
    mean = _mean_over_ranks(before)

    for rank, out in enumerate(outs):
        if out["not_trainable"]:
            _fail(f"on rank {rank}, `{out['not_trainable'][0]}` is no longer a trainable "
                  f"parameter after {name}: copy the values into the existing parameters "
                  "(dist.broadcast(p.detach(), src=0) works in place) instead of replacing them.")
    if all(not _differing(out["after"], mean) for out in outs):
        _fail(
            "the replicas agree, but on the average of the ranks' weights, not on rank 0's: "
            "all_reduce and divide averages; use dist.broadcast(tensor, src=0), which copies "
            "rank 0's tensor into every rank's."
        )
    changed0 = _differing(outs[0]["after"], before[0])
    for src in range(1, world_size):
        if changed0 and all(not _differing(out["after"], before[src]) for out in outs):
            _fail(f"every rank holds rank {src}'s weights: broadcast from rank 0, src=0 (the "
                  "rank that sends), on every rank.")
    if changed0:
        _fail(f"rank 0's own parameters changed, in {_where(changed0, total)}: rank 0 is the "
              "source (src=0), its weights must stay as they were.")
    for rank, out in enumerate(outs[1:], start=1):
        differing = _differing(out["after"], outs[0]["after"])
        if not differing:
            continue
        untouched = not _differing(out["after"], before[rank])
        if untouched and counts:
            _fail(
                f"rank {rank}'s parameters did not change, although you called "
                f"{_calls_text(counts)}: you broadcast into a copy (p.clone(), "
                "p.detach().clone(), torch.tensor(p), p.tolist()...). broadcast writes into "
                "the tensor you pass: pass the parameter itself, p.detach() or p.data."
            )
        if untouched:
            _fail(f"rank {rank}'s parameters did not change: {name} made no collective call. "
                  "Call dist.broadcast(p.detach(), src=0) for every parameter.")
        _fail(
            f"rank {rank}'s parameters differ from rank 0's in {_where(differing, total)}: did "
            "you broadcast every parameter? model.parameters() gives all of them, biases too."
        )
    if outs[0]["replaced"] or any(o["replaced"] for o in outs):
        print(f"note: {name} replaced the model's parameter objects; an optimizer built "
              "before it would still hold the old ones. Copy into them instead.")
    spread = max(_max_abs_diff(b[n], before[0][n]) for b in before[1:] for n in before[0])
    return _passed(
        f"the {world_size} ranks started from different weights (max difference "
        f"{spread:.2g}); after {name} every rank holds rank 0's, all {total} tensors exactly "
        f"(collectives called: {_calls_text(counts)})."
    )
