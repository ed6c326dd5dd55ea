"""Exercise of notebook 00 (``00_launching_workers.ipynb``): ``gather_ranks(rank, world_size)``
returns ``[0, 1, ..., world_size - 1]`` on every rank, learned with ``dist.all_gather``.
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
    is_number,
    name_of,
    run_on_ranks,
)

# Collectives that move no data: a rank learns nothing from the others through them.
_NO_DATA = {"barrier", "monitored_barrier"}


def _gather_ranks_worker(rank: int, world_size: int, fn: Callable) -> Any:
    with CollectiveCounter(fn) as counter:
        try:
            result = fn(rank, world_size)
        except NotImplementedError:
            return STUB
    # [torch.zeros(1)] * world_size repeats ONE tensor: all_gather then writes every rank's
    # value into it, and the last write wins.
    aliased = False
    for args, kwargs in counter.arguments.get("all_gather", []):
        out = kwargs.get("tensor_list", args[0] if args else None)
        if isinstance(out, (list, tuple)) and len({id(t) for t in out}) < len(out):
            aliased = True
    return {"result": result, "counts": dict(counter.calls), "aliased": aliased}


@exercise("00_launching_workers.ipynb", "gather_ranks(rank, world_size)")
def check_gather_ranks(
    gather_ranks: Callable, world_size: int = WORLD_SIZE, *, timeout: float = CHECK_TIMEOUT
) -> str:
    """Check ``gather_ranks(rank, world_size)``: every rank returns ``[0, 1, ..., N - 1]``,
    learned from the other ranks with ``dist.all_gather``.

    Runs it on ``world_size`` ranks (3 by default). Says so if it made no collective call that
    moves data (a list computed locally proves nothing; a barrier sends no numbers), if
    ``all_gather`` wrote into one tensor repeated N times (``[t] * N``), if it returned tensors
    instead of numbers, or which rank returned what.

        >>> import gradsync_tutorial as gst
        >>> def gather_ranks(rank, world_size):
        ...     return list(range(world_size))         # no communication: caught
        >>> gst.exercises.check_gather_ranks(gather_ranks)   # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: gather_ranks made no collective call that moves data ...

    Prints one status line and returns None, correct or not attempted (it raises
    NotImplementedError); raises :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    outs = run_on_ranks(_gather_ranks_worker, gather_ranks, world_size, timeout)
    name = name_of(gather_ranks)
    expected = list(range(world_size))
    results = [o["result"] for o in outs]
    if all(not set(o["counts"]) - _NO_DATA for o in outs):
        made = calls_text(outs[0]["counts"])
        fail(
            f"{name} made no collective call that moves data (collectives called: {made}), so "
            f"no rank learned anything from the others (rank 0 returned {results[0]!r}). Each "
            "rank knows only its own number: put it in a tensor, and call "
            "dist.all_gather(tensor_list, tensor) to receive every rank's."
        )
    if any(o["aliased"] for o in outs):
        fail(
            f"the list you passed to all_gather holds the same tensor {world_size} times (rank 0 "
            f"returned {results[0]!r}): `[t] * {world_size}` repeats one tensor object, so "
            "every rank's value is written into it and the last one wins. Create one tensor per "
            "rank: `[torch.zeros(1) for _ in range(world_size)]`."
        )
    for rank, result in enumerate(results):
        if isinstance(result, torch.Tensor):
            fail(
                f"rank {rank} returned a tensor, {result!r}: return a list of numbers, e.g. "
                "`t.tolist()` or `[int(t.item()) for t in tensors]`."
            )
        if not isinstance(result, (list, tuple)):
            fail(f"rank {rank} returned {type(result).__name__} {result!r:.80}: return a list.")
        if any(isinstance(x, torch.Tensor) for x in result):
            fail(
                f"rank {rank} returned a list of tensors, {result!r:.120}: turn each into a "
                "number, `[int(t.item()) for t in tensors]`."
            )
        if not all(is_number(x) for x in result):
            fail(f"rank {rank} returned {result!r:.120}: return a list of numbers.")
        if list(result) != expected:
            hint = ""
            if len(result) != world_size:
                hint = f" It has {len(result)} entries: one per rank is {world_size}."
            elif len(set(result)) == 1:
                hint = " Every entry is the same: is every rank sending its own rank?"
            fail(f"rank {rank} returned {list(result)!r}; expected {expected!r}.{hint}")
    calls = calls_text(outs[0]["counts"])
    return (f"every one of the {world_size} ranks returned {expected} (collectives called on "
            f"rank 0: {calls}).")
