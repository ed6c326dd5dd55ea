"""Exercise of notebook 13 (``13_averaging_parameters.ipynb``):
``average_pseudo_gradient(model, start, participating)`` returns, on every rank, DiLoCo's
pseudo-gradient (the round's start weights minus the weights now) averaged over the replicas
that take part; a healing replica sends zeros and receives the average.

The check runs the learner's function on 2 ranks, then at the second size, three rounds each: in
the first every replica takes part, in the second rank 1 is healing, in the third rank 0 and, from
3 ranks on, the last rank too. So dividing by the world size is right in round 1 only, no
hard-coded count or healing rank is right in all three, and "someone heals" is not N - 1. Every
rank's weights are fresh random numbers, drawn from a seed that rank 0 draws and sends before the
learner's function runs: a rank can know the others' weights only through a collective. """

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import common, evidence
from .common import Run

ROUNDS = 3  # every replica takes part; rank 1 heals; rank 0 (and the last, from 3 ranks) heal


def _healing(round_: int, world_size: int) -> list[int]:
    """The ranks that are healing in round ``round_`` (0-based) of a run on ``world_size``."""
    return [[], [1], [0, world_size - 1] if world_size > 2 else [0]][round_]


def _participating(rank: int, round_: int, world_size: int) -> bool:
    return rank not in _healing(round_, world_size)


def _round_text(round_: int, world_size: int) -> str:
    healing = _healing(round_, world_size)
    if not healing:
        return "every replica takes part"
    return (f"rank {healing[0]} is healing" if len(healing) == 1 else
            f"ranks {' and '.join(map(str, healing))} are healing")


# --------------------------------------------------------------------------------------------
# On the ranks
# --------------------------------------------------------------------------------------------


def _model(seed: int, rank: int, round_: int) -> tuple[nn.Module, list[torch.Tensor]]:
    """This rank's model after its inner steps (its own random weights) and the round's start
    weights (the same on every rank)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    g = torch.Generator().manual_seed(seed + 2 * round_)
    start = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in model.parameters()]
    mine = torch.Generator().manual_seed(seed + 2 * round_ + 1 + 100 * (rank + 1))
    with torch.no_grad():
        for s, p in zip(start, model.parameters(), strict=True):
            p.copy_(s + 0.1 * torch.randn(p.shape, generator=mine, dtype=torch.float64))
    return model, start


def _as_list(got: Any, shapes: list[torch.Size]) -> torch.Tensor | str:
    """The returned pseudo-gradients as one flat tensor, or what is wrong with them."""
    if not isinstance(got, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in got):
        return (f"returned {type(got).__name__} {got!r:.60}: return a list of tensors, one per "
                "parameter, in the order of model.parameters().")
    if [t.shape for t in got] != shapes:
        return (f"returned tensors of shapes {[tuple(t.shape) for t in got]}; the parameters' "
                f"are {[tuple(s) for s in shapes]}: one tensor per parameter, of its shape.")
    return torch.cat([t.detach().to("cpu", torch.float64).flatten() for t in got])


def _round(fn: Callable, rank: int, world_size: int, seed: int, round_: int) -> dict:
    model, start = _model(seed, rank, round_)
    params, given = evidence.params_of(model), [s.clone() for s in start]
    with evidence.Recorder(fn) as calls:
        got = common.attempt(fn, model, given, _participating(rank, round_, world_size))
    return {"got": _as_list(got, [p.shape for p in model.parameters()]),
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
            "start": torch.cat([s.flatten() for s in start]),
            "counts": dict(calls.calls),
            "delivered": evidence.delivered(calls.log),
            "params": evidence.changed_text(params, evidence.params_of(model),
                                            "changed the model's weights:"),
            "start_changed": evidence.changed_text(
                {f"start[{i}]": s for i, s in enumerate(start)},
                {f"start[{i}]": s for i, s in enumerate(given)}, "changed `start`:")}


def _worker(rank: int, world_size: int, fn: Callable) -> list[dict]:
    import torch.distributed as dist

    seed = [evidence.fresh_seed()]
    dist.broadcast_object_list(seed, src=0)  # every rank draws the same start weights
    return [_round(fn, rank, world_size, seed[0], r) for r in range(ROUNDS)]


# --------------------------------------------------------------------------------------------
# What each round should have given, and the usual mistakes
# --------------------------------------------------------------------------------------------


def _pieces(run: Run, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(start, sum of the participants' weights, sum of every rank's weights, participants P,
    world size N) of round ``r``."""
    outs = [o[r] for o in run.outs]
    taking_part = [o["weights"] for rank, o in enumerate(outs)
                   if _participating(rank, r, run.size)]
    return (outs[0]["start"], torch.stack(taking_part).sum(0),
            torch.stack([o["weights"] for o in outs]).sum(0), len(taking_part), run.size)


def _expected(run: Run, r: int) -> torch.Tensor:
    start, part, _, P, _ = _pieces(run, r)
    return start - part / P


_COUNT = ("count the replicas that take part: all_reduce a tensor holding 1.0 if participating, "
          "else 0.0, and divide the sum by it")


def _mistakes(run: Run, r: int) -> list[tuple[str, torch.Tensor]]:
    start, part, every, P, N = _pieces(run, r)
    own = P * start - part  # the participants' pseudo-gradients, summed
    return [
        ("the sign is wrong: the pseudo-gradient is start - weights (before minus after), the "
         "direction an outer SGD step goes against, as for a gradient.", -own / P),
        (f"you divided by the world size ({N}), but {N - P} "
         f"{'replica is' if N - P == 1 else 'replicas are'} healing and sent zeros: {_COUNT}.",
         own / N),
        (f"the sign is wrong (start - weights, not weights - start), and you divided by the "
         f"world size ({N}) where {P} replicas took part: {_COUNT}.", -own / N),
        ("the healing replica sent its own pseudo-gradient: it must send zeros (its weights are "
         "not trained), and still call the collectives.", (N * start - every) / N),
        ("the healing replica sent its own pseudo-gradient: it must send zeros (its weights are "
         "not trained), and still call the collectives.", (N * start - every) / P),
        (f"you did not divide: all_reduce(SUM) gives the sum over the replicas; {_COUNT}.", own),
        ("you returned the participants' mean weights; return start minus that mean.", part / P),
        (f"you averaged the weights over the world size ({N}), zeros included; average over "
         f"the {P} participants: {_COUNT}.", start - part / N),
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------
# The diagnoses, most telling first: each takes a Run, returns a message or None
# --------------------------------------------------------------------------------------------


def _each_round(check: Callable[[Run, int, list], str | None]) -> Callable[[Run], str | None]:
    """A diagnosis that looks at each round in turn; its message names the round."""

    def diagnosis(run: Run) -> str | None:
        for r in range(ROUNDS):
            message = check(run, r, [o[r] for o in run.outs])
            if message:
                return f"in round {r + 1} ({_round_text(r, run.size)}), {message}"

    diagnosis.__name__ = check.__name__
    return diagnosis


@_each_round
def _not_a_list(run: Run, r: int, outs: list) -> str | None:
    for rank, out in enumerate(outs):
        if isinstance(out["got"], str):
            return f"on rank {rank}, {run.name} {out['got']}"


@_each_round
def _touched(run: Run, r: int, outs: list) -> str | None:
    for rank, out in enumerate(outs):
        for fact, advice in (("params", "read the weights, do not change them (the outer "
                              "step does, afterwards)."),
                             ("start_changed", "read it; compute start - weights into new "
                              "tensors.")):
            if out[fact]:
                return f"on rank {rank}, {run.name} {out[fact]}: {advice}"


@_each_round
def _ranks_differ(run: Run, r: int, outs: list) -> str | None:
    for rank, out in enumerate(outs[1:], start=1):
        if not _same(out["got"], outs[0]["got"]):
            who = " (a healing one)" if not _participating(rank, r, run.size) else ""
            return (f"rank {rank}{who} returned other numbers than rank 0: every rank, the "
                    "healing one too, must return the same average (all_reduce gives it to all).")


@_each_round
def _wrong(run: Run, r: int, outs: list) -> str | None:
    got, expected = outs[0]["got"], _expected(run, r)
    if _same(got, expected):
        return None
    for mistake, value in _mistakes(run, r):
        if _same(got, value):
            return f"your pseudo-gradient is not the participants' mean: {mistake}"
    c = (got.dot(expected) / expected.dot(expected)).item()
    if _same(got, c * expected):
        return (f"your pseudo-gradient is {evidence.times_text(c)} the participants' mean of "
                f"(start - weights): divide the sum by the number of replicas that take part, "
                f"{_pieces(run, r)[3]} here; {_COUNT}.")
    return (f"your pseudo-gradient is not the participants' mean of (start - weights) (max abs "
            f"difference {(got - expected).abs().max().item():.3g}), nor a usual mistake.")


@_each_round
def _not_carried(run: Run, r: int, outs: list) -> str | None:
    """The values are right: did the collectives carry the pseudo-gradients' sum (or their mean
    over the participants or over the world), numbers no rank holds alone?"""
    start, part, _, P, N = _pieces(run, r)
    own = P * start - part  # the participants' pseudo-gradients, summed
    for rank, out in enumerate(outs):
        if not any(evidence.among(own / k, out["delivered"]) for k in (1, P, N)):
            return (f"the values are right, but on rank {rank} your collectives delivered "
                    f"{evidence.numbers_text(out['delivered'])}, not the sum over the replicas "
                    f"of their {own.numel()} pseudo-gradient numbers, which no rank holds alone: "
                    "the average reached the ranks another way. All-reduce each (start - "
                    "weights), or zeros on a healing replica.")


DIAGNOSES = (_not_a_list, _touched, _ranks_differ, _wrong, _not_carried)


def _verified(runs: Sequence[Run]) -> str:
    calls = evidence.calls_text(runs[-1].out[1]["counts"])
    return (f"{common.sizes_text(runs)}, every rank returned the mean of (start - weights) over "
            f"the replicas taking part: all of them, then with rank 1 healing, then rank 0 and "
            f"the last rank (collectives on rank 0: {calls}); the weights and `start` are "
            "untouched.")


@common.exercise("13_averaging_parameters.ipynb",
                 "average_pseudo_gradient(model, start, participating)")
def check_average_pseudo_gradient(average_pseudo_gradient: Callable,
                                  world_size: int | Sequence[int] = common.WORLD_SIZES, *,
                                  timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``average_pseudo_gradient(model, start, participating) -> list of tensors``: on
    every rank, the mean over the participating replicas of ``start - weights``, one tensor per
    parameter; a healing replica (``participating=False``) sends zeros and receives the mean.

    Runs it on 2 ranks, then on 3 to 5 (``world_size``: another number, or several), three
    rounds each: every replica takes part, then rank 1 is healing, then rank 0 and the last
    rank. Says so if you divided by the world
    size, flipped the sign, let the healing replica send its weights, did not divide, returned
    the mean weights, or changed the weights or ``start``.

        >>> import gradsync_tutorial as gst
        >>> def average_pseudo_gradient(model, start, participating):  # / world size: caught
        ...     out = [s - p.detach() if participating else torch.zeros_like(s)
        ...            for s, p in zip(start, model.parameters())]
        ...     for t in out:
        ...         dist.all_reduce(t)
        ...     return [t / dist.get_world_size() for t in out]
        >>> gst.exercises.check_average_pseudo_gradient(average_pseudo_gradient)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: in round 2 (rank 1 is healing), your pseudo-gradient ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, average_pseudo_gradient, world_size, timeout, DIAGNOSES,
                           _verified)
