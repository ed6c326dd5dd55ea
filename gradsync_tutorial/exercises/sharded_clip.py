"""Exercise of notebook 08 (``08_sharded_gradients.ipynb``): ``average_and_clip_shard(flat_grad,
max_norm)`` returns this rank's shard of the mean gradient, clipped by the whole gradient's norm.

The check runs the learner's function on 2 and on 3 ranks (a hard-coded 2 passes on 2 ranks
only), twice each: once with ``max_norm`` far above the norm (no clipping: the division shows)
and once with a quarter of it (clipping: the norm shows). It looks at what each collective
carried, not only at the result: a reduce-scatter of the whole gradient, and one number
all-reduced for the norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..detect import CollectiveCounter
from .common import (
    CHECK_TIMEOUT,
    STUB,
    exercise,
    fail,
    name_of,
    run_on_ranks,
)
from .evidence import divisor_hint, fresh_seed, times_text

#: The world sizes a check runs on, in turn: 3 shows a hard-coded 2.
WORLD_SIZES = (2, 3)
SHARD = 12  # numbers in each rank's shard; the flat gradient has SHARD * world_size
EPS = 1e-6  # what clip_grad_norm_ adds to the norm
RTOL = 1e-4
# The names of a reduce-scatter (torch 2.13 renamed reduce_scatter_tensor reduce_scatter_single).
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")
_OP_ARG = {"all_reduce": 1, "reduce_scatter_single": 2, "reduce_scatter_tensor": 2,
           "reduce_scatter": 2, "reduce": 2}  # where op= sits among the positional arguments


def _numbers(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numbers(v) for v in value)
    return 0


def _carried(counter: CollectiveCounter) -> list[tuple[str, str, int]]:
    """(collective, op, numbers sent) of every call made, by name: what the collectives carried."""
    carried = []
    for name, calls in counter.arguments.items():
        for args, kwargs in calls:
            position = _OP_ARG.get(name)
            op = kwargs.get("op", args[position] if position and len(args) > position else "SUM")
            if name in REDUCE_SCATTERS:  # (output, input, op): the input is what is sent
                sent = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_list"))
            else:  # all_reduce(tensor, op), all_gather(..., tensor), ...: every tensor passed
                sent = args[0] if name == "all_reduce" and args else [*args, *kwargs.values()]
            op = str(getattr(op, "op", op)).split(".")[-1]  # PREMUL_SUM(f): its kind is .op
            carried.append((name, op, _numbers(sent)))
    return carried


def _shard_worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(fresh_seed() + rank)  # no rank can guess another's
    flat = torch.randn(SHARD * world_size, generator=g) * (rank + 1)
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)  # for the reference (before the learner's calls are counted)
    norm = torch.stack(everyone).mean(0).norm().item()
    cases = {}
    for case, max_norm in (("no clipping", 10 * norm), ("clipping", norm / 4)):
        with CollectiveCounter(fn) as counter:
            try:
                got = fn(flat.clone(), max_norm)
            except NotImplementedError:
                return STUB
        if isinstance(got, torch.Tensor):
            got = got.detach().clone()
        else:
            got = f"{type(got).__name__} {got!r:.60}"
        cases[case] = {"got": got, "max_norm": max_norm, "carried": _carried(counter)}
    return {"everyone": everyone, "cases": cases}


def _expected(outs: list, world_size: int) -> dict:
    """The reference, from every rank's gradient: each rank's shard of the mean, and more."""
    mean = torch.stack(outs[0]["everyone"]).double().mean(0)
    shards = list(mean.split(SHARD))
    norm = mean.norm().item()
    return {"shards": shards, "norm": norm, "own": [o["everyone"][r].double().split(SHARD)[r]
                                                     for r, o in enumerate(outs)]}


def _clipped(shard: torch.Tensor, max_norm: float, norm: float) -> torch.Tensor:
    return shard * min(1.0, max_norm / (norm + EPS))


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.shape == expected.shape and torch.allclose(got.double(), expected, rtol=RTOL,
                                                          atol=1e-6)


def _ratio(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    """``c`` if ``got`` is ``c * expected``, else None."""
    g, e = got.double().flatten(), expected.flatten()
    c = (g @ e / (e @ e)).item()
    return c if torch.allclose(g, c * e, rtol=RTOL, atol=1e-6) else None


def _check_returned(outs: list, world_size: int, name: str) -> None:
    __tracebackhide__ = True
    size = SHARD * world_size
    for rank, out in enumerate(outs):
        got = out["cases"]["no clipping"]["got"]
        if isinstance(got, str):
            fail(f"{name} returned {got} on rank {rank}: return a tensor, this rank's shard of "
                 "the mean gradient.")
        if got.numel() == size:
            fail(f"on rank {rank}, {name} returned {size} numbers, the whole gradient: return "
                 f"this rank's shard only, {SHARD} numbers (len(flat_grad) // world_size), "
                 "what reduce_scatter writes into its output.")
        if got.numel() != SHARD:
            fail(f"on rank {rank}, {name} returned a tensor of shape {tuple(got.shape)}: with "
                 f"{world_size} ranks and a flat gradient of {size}, each shard has {SHARD}.")


def _check_collectives(outs: list, world_size: int, name: str) -> None:
    __tracebackhide__ = True
    carried = outs[0]["cases"]["no clipping"]["carried"]
    scatters = [c for c in carried if c[0] in REDUCE_SCATTERS]
    if not carried:
        fail(f"{name} made no collective call, so no rank knows the others' gradients: "
             "reduce-scatter the flat gradient (dist.reduce_scatter_tensor, named "
             "dist.reduce_scatter_single since torch 2.13).")
    if not scatters:
        whole = [c for c in carried if c[2] == SHARD * world_size]
        calls = ", ".join(f"{c[0]} of {c[2]} number{'s' * (c[2] != 1)}" for c in carried)
        what = (f"{whole[0][0]} of the whole gradient ({whole[0][2]} numbers): every rank then "
                "holds every shard, as in notebook 02" if whole else f"only {calls}")
        fail(f"{name} made no reduce-scatter ({what}). The exercise is a sharded step: "
             "dist.reduce_scatter_tensor(shard, flat_grad) (reduce_scatter_single since torch "
             "2.13) gives each rank the sum of its shard only.")
    if len(scatters) > 1:
        fail(f"you called a reduce-scatter {len(scatters)} times; one, on the whole flat "
             "gradient, gives every rank its shard.")


def _check_mean(outs: list, world_size: int, expected: dict) -> None:
    __tracebackhide__ = True
    op = next(c[1] for c in outs[0]["cases"]["no clipping"]["carried"] if c[0] in REDUCE_SCATTERS)
    for rank, out in enumerate(outs):
        got, right = out["cases"]["no clipping"]["got"], expected["shards"][rank]
        if _close(got, right):
            continue
        c = _ratio(got, right)
        where = f"on rank {rank} of {world_size}, without clipping,"
        if c is not None and abs(c - world_size) < 1e-3:
            fail(f"{where} your shard is {times_text(c)} the mean: it is the sum that the "
                 "reduce-scatter returns. Divide it by the world size (or pass "
                 "op=dist.ReduceOp.AVG), once.")
        if c is not None and abs(c - 1 / world_size) < 1e-3 and op == "AVG":
            fail(f"{where} your shard is {times_text(c)} the mean: op=ReduceOp.AVG already "
                 "divides by the world size; do not divide again.")
        if c is not None:
            fail(f"{where} your shard is {times_text(c)} the mean: divide the sum by the world "
                 f"size, once.{divisor_hint(c, world_size, 'world_size, dist.get_world_size()')}")
        if _close(got, expected["own"][rank]):
            fail(f"{where} you returned this rank's own gradient, not summed over the ranks: "
                 "return what the reduce-scatter wrote into its output, divided.")
        others = [k for k, s in enumerate(expected["shards"]) if k != rank and _close(got, s)]
        if others:
            fail(f"{where} you returned shard {others[0]} of the mean: rank r's shard is "
                 "elements r * size to (r + 1) * size, what reduce_scatter gives rank r.")
        fail(f"{where} your shard differs from the mean's (max abs difference "
             f"{(got.double() - right).abs().max().item():.3g}).")


def _check_clipping(outs: list, world_size: int, expected: dict) -> None:
    __tracebackhide__ = True
    norm = expected["norm"]
    for rank, out in enumerate(outs):
        case = out["cases"]["clipping"]
        got, shard, max_norm = case["got"], expected["shards"][rank], case["max_norm"]
        if _close(got, _clipped(shard, max_norm, norm)):
            continue
        where = f"on rank {rank} of {world_size}, with max_norm {max_norm:.3g},"
        local = shard.norm().item()
        if _close(got, _clipped(shard, max_norm, local)):
            fail(f"{where} you clipped with the norm of your own shard, {local:.4g}, "
                 f"{local / norm:.2f}× the whole gradient's norm {norm:.4g}: each rank clips by "
                 "its own factor. All-reduce the squared norm of your shard (one number), then "
                 "take the square root: that is the whole gradient's norm.")
        if _close(got, shard):
            fail(f"{where} your shard was not clipped, although the gradient's norm is "
                 f"{norm:.4g}: multiply it by min(1, max_norm / (norm + 1e-6)).")
        summed = sum(s.norm().item() for s in expected["shards"])
        if _close(got, _clipped(shard, max_norm, summed)):
            fail(f"{where} you clipped with the sum of the shards' norms, {summed:.4g}; the "
                 f"norm is the square root of the sum of their squares, {norm:.4g}.")
        own = torch.stack(outs[0]["everyone"])[rank].norm().item()
        if _close(got, _clipped(shard, max_norm, own)):
            fail(f"{where} you clipped with the norm of this rank's gradient before "
                 f"averaging ({own:.4g}); clip with the norm of the mean, {norm:.4g}.")
        fail(f"{where} your clipped shard differs from the expected one (max abs difference "
             f"{(got.double() - _clipped(shard, max_norm, norm)).abs().max().item():.3g}).")


def _check_carried(outs: list, world_size: int) -> None:
    __tracebackhide__ = True
    for case in ("no clipping", "clipping"):
        carried = outs[0]["cases"][case]["carried"]
        reduces = [c for c in carried if c[0] not in REDUCE_SCATTERS]
        big = [c for c in reduces if c[2] > 1]
        if big:
            fail(f"the values are right, but your {big[0][0]} carried {big[0][2]} numbers: the "
                 "norm needs one per rank. All-reduce the sum of the squares of your shard, "
                 "a single number.")
        if len(reduces) != 1:
            fail(f"the values are right, with {len(reduces)} collectives after the "
                 "reduce-scatter; the exercise is one all_reduce of one number (the squared "
                 "norm of your shard).")


@exercise("08_sharded_gradients.ipynb", "average_and_clip_shard(flat_grad, max_norm)")
def check_average_and_clip_shard(
    average_and_clip_shard: Callable, world_sizes: tuple[int, ...] = WORLD_SIZES, *,
    timeout: float = CHECK_TIMEOUT,
) -> str:
    """Check ``average_and_clip_shard(flat_grad, max_norm)``: rank r returns shard r of the mean
    of the ranks' flat gradients, clipped like ``clip_grad_norm_`` by the norm of the *whole*
    mean gradient, after one reduce-scatter and one all-reduce of a single number.

    Runs it on 2, then 3 ranks, each with its own fresh random gradient, with and without
    clipping. Says so if the shard is N× the mean (no division) or divided twice or by a fixed
    number, if it is another rank's shard or this rank's own gradient, if the clipping used
    the rank's own shard's norm, the sum of the norms or the gradient before averaging, and if
    the collectives were not one reduce-scatter and one all-reduce of one number.

        >>> import gradsync_tutorial as gst
        >>> def average_and_clip_shard(flat_grad, max_norm):   # no division: caught
        ...     shard = torch.empty(len(flat_grad) // dist.get_world_size())
        ...     dist.reduce_scatter_tensor(shard, flat_grad)
        ...     return shard
        >>> gst.exercises.check_average_and_clip_shard(average_and_clip_shard)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on rank 0 of 2, without clipping, your shard is 2.0× the mean: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    name = name_of(average_and_clip_shard)
    for world_size in world_sizes:
        outs = run_on_ranks(_shard_worker, average_and_clip_shard, world_size, timeout)
        expected = _expected(outs, world_size)
        _check_returned(outs, world_size, name)
        _check_collectives(outs, world_size, name)
        _check_mean(outs, world_size, expected)
        _check_clipping(outs, world_size, expected)
        _check_carried(outs, world_size)
    return (f"on {' and '.join(map(str, world_sizes))} ranks, one reduce-scatter and one "
            "all-reduce of one number: every rank holds its shard of the mean gradient, "
            "clipped by the whole gradient's norm.")
