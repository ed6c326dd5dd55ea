"""Exercise of notebook 00 (``00_launching_workers.ipynb``): ``gather_ranks(rank, world_size)``
returns ``[0, 1, ..., world_size - 1]`` on every rank, learned with ``dist.all_gather``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import common, evidence
from .common import Run

# Collectives that move no data: a rank learns nothing from the others through them.
_NO_DATA = {"barrier", "monitored_barrier"}


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    with evidence.Recorder(fn) as calls:
        result = common.attempt(fn, rank, world_size)
    # [torch.zeros(1)] * world_size repeats ONE tensor: all_gather then writes every rank's
    # value into it, and the last write wins.
    aliased = False
    for args, kwargs in calls.arguments.get("all_gather", []):
        out = kwargs.get("tensor_list", args[0] if args else None)
        if isinstance(out, (list, tuple)) and len({id(t) for t in out}) < len(out):
            aliased = True
    return {"result": result, "counts": dict(calls.calls), "aliased": aliased,
            "calls": calls.log}


# --- the diagnoses, most telling mistake first ----------------------------------------------


def _no_data_moved(run: Run) -> str | None:
    if any(set(o["counts"]) - _NO_DATA for o in run.outs):
        return None
    return (f"{run.name} made no collective call that moves data (collectives called: "
            f"{evidence.calls_text(run.out['counts'])}), so no rank learned anything from the "
            f"others (rank 0 returned {run.out['result']!r}). Each rank knows only its own "
            "number: put it in a tensor, and call dist.all_gather(tensor_list, tensor) to "
            "receive every rank's.")


def _one_tensor_repeated(run: Run) -> str | None:
    if any(o["aliased"] for o in run.outs):
        n = run.size
        return (f"the list you passed to all_gather holds the same tensor {n} times (rank 0 "
                f"returned {run.out['result']!r}): `[t] * {n}` repeats one tensor object, so "
                "every rank's value is written into it and the last one wins. Create one tensor "
                "per rank: `[torch.zeros(1) for _ in range(world_size)]`.")


def _not_a_list_of_numbers(run: Run) -> str | None:
    for rank, result in enumerate(o["result"] for o in run.outs):
        if isinstance(result, torch.Tensor):
            return (f"rank {rank} returned a tensor, {result!r}: return a list of numbers, e.g. "
                    "`t.tolist()` or `[int(t.item()) for t in tensors]`.")
        if not isinstance(result, (list, tuple)):
            return f"rank {rank} returned {type(result).__name__} {result!r:.80}: return a list."
        if any(isinstance(x, torch.Tensor) for x in result):
            return (f"rank {rank} returned a list of tensors, {result!r:.120}: turn each into a "
                    "number, `[int(t.item()) for t in tensors]`.")
        if not all(evidence.is_number(x) for x in result):
            return f"rank {rank} returned {result!r:.120}: return a list of numbers."


def _wrong_list(run: Run) -> str | None:
    expected = list(range(run.size))
    for rank, result in enumerate(list(o["result"]) for o in run.outs):
        if result == expected:
            continue
        hint = ""
        if len(result) != run.size:
            hint = f" It has {len(result)} entries: one per rank is {run.size}."
        elif len(set(result)) == 1:
            hint = " Every entry is the same: is every rank sending its own rank?"
        return f"rank {rank} returned {result!r}; expected {expected!r}.{hint}"


def _others_numbers_sent(run: Run) -> str | None:
    """A rank that sent other ranks' numbers in its first collective, before it received any:
    it built the list alone (rank 0's ``list(range(world_size))``, broadcast). Numbers 2 and up
    only (0 and 1 fill buffers and one-hot vectors), so it shows from 3 ranks on."""
    for rank, out in enumerate(run.outs):
        others = [float(r) for r in range(2, run.size) if r != rank]
        first = next((c for c in out["calls"] if c.name not in _NO_DATA), None)
        if not others or first is None:
            continue
        sent = first.sent if first.name.startswith("broadcast") else first.contributed
        if evidence.among(torch.tensor(others), sent):
            return (f"rank {rank} sent other ranks' numbers ({evidence.numbers_text(sent)}) in "
                    f"its first collective, {first.name}, before it had received any: it built "
                    f"the list alone, and the others received it from rank {rank}. A list that "
                    "one rank sends learns nothing from the others. Each rank sends only its "
                    "own number, torch.tensor([rank]), with dist.all_gather.")


def _same_numbers_sent(run: Run) -> str | None:
    sent = [evidence.numbers([c.sent for c in o["calls"]]) for o in run.outs]
    if all(s.shape == sent[0].shape and torch.equal(s, sent[0]) for s in sent):
        return (f"every rank sent the same numbers through its collectives "
                f"({evidence.numbers_text(sent[0])}), so no rank learned anything from the "
                "others: the right list was built without them (a count of ranks, or a list "
                "built locally, proves nothing). Each rank sends its own number, "
                "torch.tensor([rank]), with dist.all_gather.")


def _ranks_not_delivered(run: Run) -> str | None:
    expected = torch.arange(run.size, dtype=torch.float64)
    for rank, out in enumerate(run.outs):
        sent = evidence.numbers([c.sent for c in out["calls"]])
        if not evidence.among(torch.tensor([float(rank)]), sent):
            return (f"rank {rank} did not send its own number through its collectives (it sent "
                    f"{evidence.numbers_text(sent)}): each rank sends its rank, "
                    "torch.tensor([rank]), with dist.all_gather.")
        if not evidence.among(expected, evidence.delivered(out["calls"])):
            return (f"rank {rank} returned the right list, but its collectives delivered "
                    f"{evidence.carried_text(out['calls'])}: not every rank's number, so the list "
                    "was not learned from them (counting the ranks, or a list built locally, "
                    "proves nothing). Each rank sends its own number with dist.all_gather.")


DIAGNOSES = (_no_data_moved, _one_tensor_repeated, _not_a_list_of_numbers, _wrong_list,
             _others_numbers_sent, _same_numbers_sent, _ranks_not_delivered)


def _verified(runs: Sequence[Run]) -> str:
    lists = " and ".join(str(list(range(r.size))) for r in runs)
    return (f"{common.sizes_text(runs)}, every rank returned {lists}: each number sent by its "
            f"own rank and delivered by the collectives (on rank 0: "
            f"{evidence.calls_text(runs[-1].out['counts'])}).")


@common.exercise("00_launching_workers.ipynb", "gather_ranks(rank, world_size)")
def check_gather_ranks(
    gather_ranks: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES, *,
    timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``gather_ranks(rank, world_size)``: every rank returns ``[0, 1, ..., N - 1]``,
    learned from the other ranks with ``dist.all_gather``.

    Runs it on 2, then 3 to 5 ranks (``world_size``: another number, or several). Says so if it made
    no collective call that moves data (a list computed locally proves nothing; a barrier sends
    no numbers), if ``all_gather`` wrote into one tensor repeated N times (``[t] * N``), if it
    returned tensors instead of numbers, which rank returned what, and whether the numbers
    returned are the ones the ranks sent each other (not a count of ranks, nor a list that
    every rank built alike).

        >>> import gradsync_tutorial as gst
        >>> def gather_ranks(rank, world_size):
        ...     return list(range(world_size))         # no communication: caught
        >>> gst.exercises.check_gather_ranks(gather_ranks)   # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: gather_ranks made no collective call that moves data ...

    Prints one status line and returns None, correct or not attempted (it raises
    NotImplementedError); raises :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, gather_ranks, world_size, timeout, DIAGNOSES, _verified)
