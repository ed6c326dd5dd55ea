"""Exercise of notebook 03 (``03_distributed_data_parallel.ipynb``): ``broadcast_parameters(model)``
gives every rank rank 0's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..model import Net
from . import common, evidence
from .common import Run


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    # Fresh random weights on every rank, every time: no rank can compute rank 0's, it must
    # receive them.
    torch.manual_seed(evidence.fresh_seed())
    model = Net()
    ids = [id(p) for p in model.parameters()]
    everyone = evidence.all_ranks(evidence.params_of(model), world_size)  # every rank's, before
    with evidence.Recorder(fn) as calls:
        common.attempt(fn, model)
    not_trainable = [n for n, p in model.named_parameters()
                     if not (isinstance(p, nn.Parameter) and p.requires_grad)]
    return {"after": evidence.params_of(model), "everyone": everyone,
            "counts": dict(calls.calls), "calls": calls.log, "not_trainable": not_trainable,
            "replaced": [id(p) for p in model.parameters()] != ids}


def _rank0(run: Run) -> dict:
    return run.out["everyone"][0]


# --- the diagnoses, most telling mistake first ----------------------------------------------


def _not_trainable(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        if out["not_trainable"]:
            return (f"on rank {rank}, `{out['not_trainable'][0]}` is no longer a trainable "
                    f"parameter after {run.name}: copy the values into the existing parameters "
                    "(dist.broadcast(p.detach(), src=0) works in place) instead of replacing "
                    "them.")


def _no_collective(run: Run) -> str | None:
    if not any(out["counts"] for out in run.outs):
        return (f"{run.name} made no collective call, so the other ranks cannot have received "
                "rank 0's weights (they start from fresh random weights, different at every "
                "check). Call dist.broadcast(p.detach(), src=0) for every parameter, on every "
                "rank.")


def _averaged(run: Run) -> str | None:
    mean = evidence.mean_over_ranks(run.out["everyone"])
    if all(not evidence.differing_tensors(out["after"], mean) for out in run.outs):
        return ("the replicas agree, but on the average of the ranks' weights, not on rank 0's: "
                "all_reduce and divide averages; use dist.broadcast(tensor, src=0), which "
                "copies rank 0's tensor into every rank's.")


def _from_another_rank(run: Run) -> str | None:
    before = run.out["everyone"]
    if not evidence.differing_tensors(run.out["after"], before[0]):
        return None
    for src in range(1, run.size):
        if all(not evidence.differing_tensors(out["after"], before[src]) for out in run.outs):
            return (f"every rank holds rank {src}'s weights: broadcast from rank 0, src=0 (the "
                    "rank that sends), on every rank.")
    changed = evidence.differing_tensors(run.out["after"], before[0])
    return (f"rank 0's own parameters changed, in {evidence.where_text(changed, len(before[0]))}: "
            "rank 0 is the source (src=0), its weights must stay as they were.")


def _rank_differs(run: Run) -> str | None:
    before, counts = run.out["everyone"], run.out["counts"]
    for rank, out in enumerate(run.outs[1:], start=1):
        differing = evidence.differing_tensors(out["after"], _rank0(run))
        if not differing:
            continue
        if not evidence.differing_tensors(out["after"], before[rank]):
            return (f"rank {rank}'s parameters did not change, although you called "
                    f"{evidence.calls_text(counts)}: you broadcast into a copy (p.clone(), "
                    "p.detach().clone(), torch.tensor(p), p.tolist()...). broadcast writes into "
                    "the tensor you pass: pass the parameter itself, p.detach() or p.data.")
        return (f"rank {rank}'s parameters differ from rank 0's in "
                f"{evidence.where_text(differing, len(before[0]))}: did you broadcast every "
                "parameter? model.parameters() gives all of them, biases too.")


def _not_exact(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        unequal = evidence.unequal_tensors(out["after"], _rank0(run))
        if unequal:
            return (f"rank {rank}'s parameters are close to rank 0's but not equal, in "
                    f"{evidence.where_text(unequal, len(unequal))}: a broadcast copies rank 0's "
                    "numbers exactly; did you compute them (a mean, a sum) instead?")


def _weights_not_delivered(run: Run) -> str | None:
    weights = evidence.flatten(_rank0(run))
    for rank, out in enumerate(run.outs[1:], start=1):
        got = evidence.delivered(out["calls"])
        if not evidence.among(weights, got):
            return (f"rank {rank} holds rank 0's weights, but its collectives delivered "
                    f"{evidence.numbers_text(got)}, not rank 0's {weights.numel():,} numbers: they "
                    "reached it another way. Broadcast the parameters themselves.")


DIAGNOSES = (_not_trainable, _no_collective, _averaged, _from_another_rank, _rank_differs,
             _not_exact, _weights_not_delivered)


def _verified(runs: Sequence[Run]) -> str:
    if any(o["replaced"] for r in runs for o in r.outs):
        print(f"note: {runs[0].name} replaced the model's parameter objects; an optimizer built "
              "before it would still hold the old ones. Copy into them instead.")
    spread = min(max(evidence.max_abs_diff(b[n], r.out["everyone"][0][n])
                     for b in r.out["everyone"][1:] for n in b) for r in runs)
    total = len(runs[0].out["after"])
    return (f"{common.sizes_text(runs)}, the ranks started from different weights (max "
            f"difference at least {spread:.2g}); after {runs[0].name} every rank holds rank "
            f"0's, all {total} tensors bit for bit, delivered by its collectives (on rank 1: "
            f"{evidence.calls_text(runs[-1].outs[1]['counts'])}).")


@common.exercise("03_distributed_data_parallel.ipynb", "broadcast_parameters(model)")
def check_broadcast_parameters(
    broadcast_parameters: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES, *,
    timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``broadcast_parameters(model)``: afterwards every rank holds rank 0's parameters.

    Runs it on 2, then 3 to 5 ranks (``world_size``: another number, or several) whose models start
    from *different* fresh random weights (so only communication can deliver rank 0's). Says
    if no collective was called, which tensor differs between ranks, whether you broadcast into
    a copy, whether the ranks agree on the *average* (an all_reduce) instead of rank 0's
    weights, whether rank 0's own changed, whether the parameters are still trainable, and
    whether rank 0's numbers are what the other ranks' collectives delivered.

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
    return common.on_ranks(_worker, broadcast_parameters, world_size, timeout, DIAGNOSES,
                           _verified)
