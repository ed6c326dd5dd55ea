"""Exercise of notebook 08 (``08_sharded_gradients.ipynb``): ``average_and_clip_shard(flat_grad,
max_norm)`` returns this rank's shard of the mean gradient, clipped by the whole gradient's norm.

The check runs the learner's function on 2 and on 3 ranks, with shards of another size at each
(12 numbers, then 10: neither a hard-coded world size nor a hard-coded shard size passes both),
three times each: with ``max_norm`` far above the norm (no clipping: the division shows), with
a quarter of it (clipping: the norm shows), and with twice the norm (no clipping: a squared norm
compared with ``max_norm`` shows, the norm being above 2). Every rank's flat gradient is fresh
random data, so it looks at what each collective delivered, not only at the result: this rank's
shard of the sum from a reduce-scatter, and the squared norm, one number, from an all-reduce.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import common, evidence
from .common import Run

EPS = 1e-6  # what clip_grad_norm_ adds to the norm
RTOL, ATOL = 1e-4, 1e-6
# The names of a reduce-scatter (torch 2.13 renamed reduce_scatter_tensor reduce_scatter_single).
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")
CASES = ("no clipping", "clipping", "max_norm just above the norm")
#: max_norm in each case, as a multiple of the mean gradient's norm (about 5 here, never near 1:
#: twice the norm lies between the norm and its square, where comparing the square misleads).
MAX_NORM_TIMES = (10.0, 0.25, 2.0)
# What gloo says when a reduce-scatter's output is not len(input) // world_size.
_SIZE_ERRORS = re.compile(r"outputShape\[0\] \* worldSize == inputShape\[0\]|world_size times")


def shard_size(world_size: int) -> int:
    """The numbers in each rank's shard at ``world_size`` ranks (12 at 2, 10 at 3, ...): the
    flat gradient has ``shard_size * world_size``."""
    return max(16 - 2 * world_size, 4)


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(evidence.fresh_seed() + rank)  # no rank can guess another's
    flat = torch.randn(shard_size(world_size) * world_size, generator=g) * (rank + 1)
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)  # for the reference (before the learner's calls are recorded)
    norm = torch.stack(everyone).mean(0).norm().item()
    cases, changed = {}, None
    for case, max_norm in zip(CASES, (k * norm for k in MAX_NORM_TIMES), strict=True):
        given = flat.clone()
        with evidence.Recorder(fn) as calls:
            try:
                got = common.attempt(fn, given, max_norm)
            except RuntimeError as e:  # a shard of the wrong size: say so, not a trace
                if not _SIZE_ERRORS.search(str(e)):
                    raise
                return {"size_error": str(e).strip().splitlines()[0].split("Check failed: ")[-1]}
        for call in calls.log:
            call.settle()
        got = (got.detach().clone() if isinstance(got, torch.Tensor)
               else f"{type(got).__name__} {got!r:.60}")
        cases[case] = {"got": got, "max_norm": max_norm, "calls": calls.log}
        if changed is None and not torch.equal(given, flat):
            changed = (f"changed the flat gradient it was given (max abs difference "
                       f"{evidence.max_abs_diff(given, flat):.3g})")
    return {"everyone": everyone, "cases": cases, "flat_grad": changed}


# --- the reference, from every rank's gradient -----------------------------------------------


def _expected(run: Run) -> dict:
    """Each rank's shard of the mean, the mean's norm, each rank's own shard r."""
    size = shard_size(run.size)
    mean = torch.stack(run.out["everyone"]).double().mean(0)
    return {"shards": list(mean.split(size)), "norm": mean.norm().item(), "size": size,
            "own": [o["everyone"][r].double().split(size)[r] for r, o in enumerate(run.outs)]}


def _clipped(shard: torch.Tensor, max_norm: float, norm: float) -> torch.Tensor:
    return shard * min(1.0, max_norm / (norm + EPS))


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.shape == expected.shape and torch.allclose(got.double(), expected, rtol=RTOL,
                                                          atol=ATOL)


def _ratio(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    """``c`` if ``got`` is ``c * expected``, else None."""
    g, e = got.double().flatten(), expected.flatten()
    c = (g @ e / (e @ e)).item()
    return c if torch.allclose(g, c * e, rtol=RTOL, atol=ATOL) else None


def _calls(out: dict, case: str = "no clipping", scatter: bool = True) -> list:
    """A rank's reduce-scatters in ``case`` (``scatter=False``: its other collectives)."""
    return [c for c in out["cases"][case]["calls"] if (c.name in REDUCE_SCATTERS) == scatter]


def _scatter_arrived(run: Run, rank: int, case: str = "no clipping") -> str | None:
    """"sum" or "mean" if rank's reduce-scatter delivered that of its shard over the ranks:
    numbers no rank holds alone."""
    got = evidence.delivered(_calls(run.outs[rank], case)[:1])
    shard = _expected(run)["shards"][rank]
    return next((what for what, e in (("sum", shard * run.size), ("mean", shard))
                 if evidence.among(e, got)), None)


def _norm_arrived(run: Run, rank: int, case: str) -> str | None:
    """"the squared norm" if rank's other collectives delivered that of the mean gradient (or
    "4.0× the squared norm": of the sum, × N², or of an average, × N or / N), else None."""
    got = evidence.delivered(_calls(run.outs[rank], case, scatter=False))
    squared = _expected(run)["norm"] ** 2
    return next((f"{evidence.times_text(s) + ' ' if s != 1 else ''}the squared norm"
                 for s in (1, run.size**2, run.size, 1 / run.size)
                 if evidence.among(torch.tensor([squared * s]), got)), None)


# --- the diagnoses, most telling mistake first -----------------------------------------------


def _size_refused(run: Run) -> str | None:
    rank, error = run.first("size_error")
    if error:
        size = shard_size(run.size)
        return (f"on rank {rank}, the reduce-scatter refused your tensors ({error.rstrip('. ')}): "
                f"with {run.size} ranks and a flat gradient of {size * run.size} numbers, each "
                f"shard has {size}, len(flat_grad) // world_size. Is a size hard-coded?")


def _not_a_shard(run: Run) -> str | None:
    size = _expected(run)["size"]
    for rank, out in enumerate(run.outs):
        got = out["cases"]["no clipping"]["got"]
        if isinstance(got, str):
            return (f"{run.name} returned {got} on rank {rank}: return a tensor, this rank's "
                    "shard of the mean gradient.")
        if got.numel() == size * run.size:
            return (f"on rank {rank}, {run.name} returned {got.numel()} numbers, the whole "
                    f"gradient: return this rank's shard only, {size} numbers (len(flat_grad) "
                    "// world_size), what reduce_scatter writes into its output.")
        if got.numel() != size:
            return (f"on rank {rank}, {run.name} returned a tensor of shape {tuple(got.shape)}: "
                    f"with {run.size} ranks and a flat gradient of {size * run.size}, each "
                    f"shard has {size} (len(flat_grad) // world_size).")


def _no_collective(run: Run) -> str | None:
    if not any(o["cases"]["no clipping"]["calls"] for o in run.outs):
        return (f"{run.name} made no collective call, so no rank knows the others' gradients: "
                "reduce-scatter the flat gradient (dist.reduce_scatter_tensor, named "
                "dist.reduce_scatter_single since torch 2.13).")


def _no_reduce_scatter(run: Run) -> str | None:
    if _calls(run.out):
        return None
    others = _calls(run.out, scatter=False)
    whole = [c for c in others if c.sent.numel() == _expected(run)["size"] * run.size]
    what = (f"{whole[0].name} of the whole gradient ({whole[0].sent.numel()} numbers): every "
            "rank then holds every shard, as in notebook 02" if whole else
            f"only {evidence.carried_text(others)}")
    return (f"{run.name} made no reduce-scatter ({what}). The exercise is a sharded step: "
            "dist.reduce_scatter_tensor(shard, flat_grad) (reduce_scatter_single since torch "
            "2.13) gives each rank the sum of its shard only.")


def _reduce_scatter_repeated(run: Run) -> str | None:
    scatters = len(_calls(run.out))
    if scatters > 1:
        return (f"you called a reduce-scatter {scatters} times; one, on the whole flat "
                "gradient, gives every rank its shard.")


def _not_the_mean(run: Run) -> str | None:
    expected = _expected(run)
    for rank, out in enumerate(run.outs):
        got, right = out["cases"]["no clipping"]["got"], expected["shards"][rank]
        if not _close(got, right):
            return (f"on rank {rank} of {run.size}, without clipping, "
                    f"{_shard_mistake(run, rank, got, expected)}")


def _shard_mistake(run: Run, rank: int, got: torch.Tensor, expected: dict) -> str:
    """What is wrong with rank's shard, ``got``, which is not the mean's."""
    right, n = expected["shards"][rank], run.size
    c = _ratio(got, right)
    factor = run.outs[rank]["cases"]["no clipping"]["max_norm"] / (expected["norm"] + EPS)
    if c is not None and abs(c / factor - 1) < 1e-3:  # max_norm is 10× the norm here
        return (f"your shard is {evidence.times_text(c)} the mean: max_norm / (norm + 1e-6), "
                f"{factor:.3g} here, scaled it up. Cap the factor at 1, min(1, max_norm / "
                "(norm + 1e-6)), as clip_grad_norm_ does: clipping only ever shrinks.")
    if c is not None and abs(c - n) < 1e-3:
        return (f"your shard is {evidence.times_text(c)} the mean: it is the sum that the "
                "reduce-scatter returns. Divide it by the world size (or pass "
                "op=dist.ReduceOp.AVG), once.")
    if c is not None and abs(c - 1 / n) < 1e-3 and _scatter_arrived(run, rank) == "mean":
        return (f"your shard is {evidence.times_text(c)} the mean: op=ReduceOp.AVG already "
                "divides by the world size; do not divide again.")
    if c is not None:
        return (f"your shard is {evidence.times_text(c)} the mean: divide the sum by the world "
                f"size, once.{evidence.divisor_hint(c, n, 'world_size, dist.get_world_size()')}")
    if _close(got, expected["own"][rank]):
        return ("you returned this rank's own gradient, not summed over the ranks: return what "
                "the reduce-scatter wrote into its output, divided.")
    others = [k for k, s in enumerate(expected["shards"]) if k != rank and _close(got, s)]
    if others:
        return (f"you returned shard {others[0]} of the mean: rank r's shard is elements "
                "r * size to (r + 1) * size, what reduce_scatter gives rank r.")
    return (f"your shard differs from the mean's (max abs difference "
            f"{evidence.max_abs_diff(got.double(), right):.3g}).")


def _first_rank_off(run: Run, case_name: str, right: Callable, said: Callable) -> str | None:
    """The first rank whose shard in case ``case_name`` is not ``right(rank, case, expected)``,
    told by ``said(rank, case, expected)``; None if every rank's is."""
    expected = _expected(run)
    for rank, out in enumerate(run.outs):
        case = out["cases"][case_name]
        if not _close(case["got"], right(rank, case, expected)):
            return (f"on rank {rank} of {run.size}, with max_norm {case['max_norm']:.3g}, "
                    + said(rank, case, expected))
    return None


def _not_clipped_by_the_norm(run: Run) -> str | None:
    return _first_rank_off(
        run, "clipping", lambda r, case, e: _clipped(e["shards"][r], case["max_norm"], e["norm"]),
        lambda r, case, e: _clip_mistake(run, r, case, e))


def _clipped_below_max_norm(run: Run) -> str | None:
    """max_norm above the norm: nothing to clip. A squared norm compared with max_norm clips."""
    def said(rank: int, case: dict, expected: dict) -> str:
        c = _ratio(case["got"], expected["shards"][rank])
        how = f" (×{c:.3g})" if c is not None else ""
        return (f"above the gradient's norm {expected['norm']:.4g}, your shard changed{how}: "
                "clip only when the norm itself, the square root of the summed squares, exceeds "
                "max_norm (not the squared norm), and never scale up: min(1, max_norm / "
                "(norm + 1e-6)).")

    return _first_rank_off(run, "max_norm just above the norm",
                           lambda r, case, e: e["shards"][r], said)


def _clip_mistake(run: Run, rank: int, case: dict, expected: dict) -> str:
    """What is wrong with rank's clipped shard: clipped by which norm?"""
    got, shard, max_norm, norm = (case["got"], expected["shards"][rank], case["max_norm"],
                                  expected["norm"])
    local = shard.norm().item()
    if _close(got, _clipped(shard, max_norm, local)):
        return (f"you clipped with the norm of your own shard, {local:.4g}, {local / norm:.2f}× "
                f"the whole gradient's norm {norm:.4g}: each rank clips by its own factor. "
                "All-reduce the squared norm of your shard (one number), then take the square "
                "root: that is the whole gradient's norm.")
    if _close(got, shard):
        return (f"your shard was not clipped, although the gradient's norm is {norm:.4g}: "
                "multiply it by min(1, max_norm / (norm + 1e-6)).")
    summed = sum(s.norm().item() for s in expected["shards"])
    if _close(got, _clipped(shard, max_norm, summed)):
        return (f"you clipped with the sum of the shards' norms, {summed:.4g}; the norm is the "
                f"square root of the sum of their squares, {norm:.4g}.")
    own = torch.stack(run.out["everyone"])[rank].norm().item()
    if _close(got, _clipped(shard, max_norm, own)):
        return (f"you clipped with the norm of this rank's gradient before averaging "
                f"({own:.4g}); clip with the norm of the mean, {norm:.4g}.")
    return (f"your clipped shard differs from the expected one (max abs difference "
            f"{evidence.max_abs_diff(got.double(), _clipped(shard, max_norm, norm)):.3g}).")


_flat_grad_touched = common.left_alone(
    "flat_grad", "return the shard, and leave the flat gradient you were given as it is (it is "
    "the caller's): divide the shard, not flat_grad.")


def _shard_not_carried(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        if not _scatter_arrived(run, rank):
            got = evidence.delivered(_calls(out)[:1])
            return (f"the values are right, but on rank {rank} the reduce-scatter's output and "
                    f"input held {evidence.numbers_text(got)} afterwards, not the sum over the "
                    f"ranks of shard {rank} ({_expected(run)['size']} numbers no rank holds "
                    "alone): the mean reached the ranks another way. Reduce-scatter the flat "
                    "gradient itself.")


def _norm_not_one_number(run: Run) -> str | None:
    for case in CASES:
        others = _calls(run.out, case, scatter=False)
        gathers = [c for c in others if "gather" in c.name]
        if gathers and gathers[0].contributed.numel() == 1:
            return (f"the values are right, but your {gathers[0].name} of one number per rank "
                    f"delivered {run.size} squared norms, for each rank to add up: an "
                    "all_reduce of that one number delivers their sum, the exercise's one "
                    "collective after the reduce-scatter.")
        big = [c for c in others if c.contributed.numel() > 1]
        if big:
            return (f"the values are right, but your {big[0].name} carried "
                    f"{big[0].contributed.numel()} numbers: the norm needs one per rank. "
                    "All-reduce "
                    "the sum of the squares of your shard, a single number.")
        if len(others) != 1:
            return (f"the values are right, with {len(others)} collectives after the "
                    "reduce-scatter; the exercise is one all_reduce of one number (the squared "
                    "norm of your shard).")


def _norm_not_carried(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        for case in CASES:
            if not _norm_arrived(run, rank, case):
                return (f"the values are right, but on rank {rank} (with {case}) your "
                        f"{evidence.carried_text(_calls(out, case, scatter=False))} is not the "
                        f"squared norm of the mean gradient ({_expected(run)['norm'] ** 2:.4g}),"
                        " which no rank knows alone: the norm reached the ranks another way. "
                        "All-reduce the sum of the squares of your shard.")


DIAGNOSES = (_size_refused, _not_a_shard, _no_collective, _no_reduce_scatter,
             _reduce_scatter_repeated, _not_the_mean, _not_clipped_by_the_norm,
             _clipped_below_max_norm, _flat_grad_touched,
             _shard_not_carried, _norm_not_one_number, _norm_not_carried)


def _verified(runs: Sequence[Run]) -> str:
    sizes = " and ".join(str(shard_size(r.size)) for r in runs)
    arrived = sorted({_scatter_arrived(r, rank) for r in runs for rank in range(r.size)})
    norms = " and ".join(f"{_expected(r)['norm']:.4g}" for r in runs)
    name = _calls(runs[-1].out, scatter=False)[0].name
    norm = sorted({_norm_arrived(r, rank, case) for r in runs for rank in range(r.size)
                   for case in CASES})
    return (f"{common.sizes_text(runs)} (shards of {sizes} numbers), with and without "
            f"clipping, one reduce-scatter delivered every rank the {' or '.join(arrived)} of "
            f"its shard over the ranks, and one {name} of one number {' or '.join(norm)}; every "
            f"rank returned its shard of the mean gradient, clipped by the whole gradient's "
            f"norm ({norms}), and left the flat gradient it was given as it was.")


@common.exercise("08_sharded_gradients.ipynb", "average_and_clip_shard(flat_grad, max_norm)")
def check_average_and_clip_shard(
    average_and_clip_shard: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES, *,
    timeout: float = common.CHECK_TIMEOUT,
) -> str:
    """Check ``average_and_clip_shard(flat_grad, max_norm)``: rank r returns shard r of the mean
    of the ranks' flat gradients, clipped like ``clip_grad_norm_`` by the norm of the *whole*
    mean gradient, after one reduce-scatter and one all-reduce of a single number.

    Runs it on 2, then 3 to 5 ranks (``world_size``: another number, or several), with shards of 12,
    then 10 numbers, each rank with its own fresh random gradient, with and without clipping.
    Says so if the shard is N× the mean (no division) or divided twice or by a fixed number, if
    it is another rank's shard or this rank's own gradient, if the clipping used the rank's own
    shard's norm, the sum of the norms or the gradient before averaging, if ``flat_grad``
    changed, if the collectives were not one reduce-scatter and one all-reduce of one number,
    and whether they delivered the shard's sum and the squared norm (no rank knows them alone).

        >>> import gradsync_tutorial as gst
        >>> def average_and_clip_shard(flat_grad, max_norm):   # no division: caught
        ...     shard = torch.empty(len(flat_grad) // dist.get_world_size())
        ...     dist.reduce_scatter_tensor(shard, flat_grad)
        ...     return shard
        >>> gst.exercises.check_average_and_clip_shard(average_and_clip_shard)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: on rank 0 of 2, without clipping, your shard is 2.0× the ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, average_and_clip_shard, world_size, timeout, DIAGNOSES,
                           _verified)
