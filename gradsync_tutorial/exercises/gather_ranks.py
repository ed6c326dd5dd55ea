"""Exercise of notebook 00 (``00_launching_workers.ipynb``): ``gather_ranks(rank, world_size)``
returns ``[0, 1, ..., world_size - 1]`` on every rank, learned with ``dist.all_gather``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._common import (
    _STUB,
    CHECK_TIMEOUT,
    CollectiveCounter,
    _calls_text,
    _fail,
    _is_number,
    _launch,
    _name,
    _not_attempted,
    _passed,
    _require_function,
)


def _gather_ranks_worker(rank: int, world_size: int, fn: Callable) -> Any:
    with CollectiveCounter(fn) as counter:
        try:
            result = fn(rank, world_size)
        except NotImplementedError:
            return _STUB
    # [torch.zeros(1)] * world_size repeats ONE tensor: all_gather then writes every rank's
    # value into it, and the last write wins.
    aliased = False
    for args, kwargs in counter.arguments.get("all_gather", []):
        out = kwargs.get("tensor_list", args[0] if args else None)
        if isinstance(out, (list, tuple)) and len({id(t) for t in out}) < len(out):
            aliased = True
    return {"result": result, "counts": dict(counter.calls), "aliased": aliased}


def check_gather_ranks(
    gather_ranks: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> None:
    """Check ``gather_ranks(rank, world_size)``: every rank returns ``[0, 1, ..., N - 1]``,
    learned from the other ranks with ``dist.all_gather``.

    Runs it on ``world_size`` ranks. Says so if it made no collective call (a list computed
    locally proves nothing), if ``all_gather`` wrote into one tensor repeated N times
    (``[t] * N``), if it returned tensors instead of numbers, or which rank returned what.

        >>> import gradsync_tutorial as gst
        >>> def gather_ranks(rank, world_size):
        ...     return list(range(world_size))         # no communication: caught
        >>> gst.exercises.check_gather_ranks(gather_ranks)   # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: gather_ranks made no collective call: ...

    Prints one status line and returns None, correct or not attempted (it raises
    NotImplementedError); raises :class:`ExerciseFailed` otherwise. Exercise of
    ``notebooks/00_launching_workers.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(gather_ranks, 2, "gather_ranks(rank, world_size)")
    outs = _launch(_gather_ranks_worker, gather_ranks, world_size, timeout)
    if outs is None:
        return _not_attempted(gather_ranks, "gather_ranks")
    name = _name(gather_ranks)
    expected = list(range(world_size))
    results = [o["result"] for o in outs]
    if all(not o["counts"] for o in outs):
        _fail(
            f"{name} made no collective call, so no rank learned anything from the others (rank "
            f"0 returned {results[0]!r}). Each rank knows only its own number: put it in a "
            "tensor, and call dist.all_gather(tensor_list, tensor) to receive every rank's."
        )
    if any(o["aliased"] for o in outs):
        _fail(
            f"the list you passed to all_gather holds the same tensor {world_size} times (rank 0 "
            f"returned {results[0]!r}): `[t] * {world_size}` repeats one tensor object, so "
            "every rank's value is written into it and the last one wins. Create one tensor per "
            "rank: `[torch.zeros(1) for _ in range(world_size)]`."
        )
    for rank, result in enumerate(results):
        if isinstance(result, torch.Tensor):
            _fail(
                f"rank {rank} returned a tensor, {result!r}: return a list of numbers, e.g. "
                "`t.tolist()` or `[int(t.item()) for t in tensors]`."
            )
        if not isinstance(result, (list, tuple)):
            _fail(f"rank {rank} returned {type(result).__name__} {result!r:.80}: return a list.")
        if any(isinstance(x, torch.Tensor) for x in result):
            _fail(
                f"rank {rank} returned a list of tensors, {result!r:.120}: turn each into a "
                "number, `[int(t.item()) for t in tensors]`."
            )
        if not all(_is_number(x) for x in result):
            _fail(f"rank {rank} returned {result!r:.120}: return a list of numbers.")
        if list(result) != expected:
            hint = ""
            if len(result) != world_size:
                hint = f" It has {len(result)} entries: one per rank is {world_size}."
            elif len(set(result)) == 1:
                hint = " Every entry is the same: is every rank sending its own rank?"
            _fail(f"rank {rank} returned {list(result)!r}; expected {expected!r}.{hint}")
    calls = _calls_text(outs[0]["counts"])
    return _passed(f"every one of the {world_size} ranks returned {expected} (collectives "
                   f"called on rank 0: {calls}).")
