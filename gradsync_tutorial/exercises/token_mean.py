"""Exercise of notebook 07 (``07_which_mean.ipynb``): ``token_mean_backward(model,
micro_batches)`` leaves in every rank's ``.grad``, under DDP with gradient accumulation, the
gradient of the mean over every valid token of every rank's micro-batches, and returns that mean.

The check runs the learner's function at two sizes that no guess passes both of: 2 ranks with 4
micro-batches each, then the second size with 3 (the notebook uses 2 and 2; 2 ranks first, so
that a check run from the notebook starts on its warm workers). Every micro-batch holds fresh random
sequences with its own number of valid tokens, drawn from a seed that rank 0 draws and sends
before the learner's function runs. Each rank also computes, for the diagnosis, its own
micro-batches' gradient sums, loss sums and counts; the diagnoses build the reference and each
usual mistake from them. What the learner's collectives delivered must include the global
count of valid tokens, which no rank knows alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import common, evidence
from .common import Run

VOCAB, IGNORE_INDEX, LINES = 11, -100, 3


def micro_batches_at(world_size: int) -> int:
    """How many micro-batches each rank gets at ``world_size`` ranks: 4 at 2, else 3."""
    return 4 if world_size == 2 else 3


# --------------------------------------------------------------------------------------------
# On the ranks
# --------------------------------------------------------------------------------------------


def _data(world_size: int, micro_batches: int, seed: int) -> list[list[tuple]]:
    """data[rank][k] = (inputs, targets) of LINES random sequences padded with IGNORE_INDEX;
    every micro-batch, and every rank, holds a different number of valid tokens."""
    g = torch.Generator().manual_seed(seed)
    while True:
        data = []
        for rank in range(world_size):
            data.append([])
            for _ in range(micro_batches):
                lengths = torch.randint(1, 5 + 4 * rank, (LINES,), generator=g)
                inputs = torch.randint(0, VOCAB, (LINES, 4 + 4 * world_size), generator=g)
                targets = torch.randint(0, VOCAB, inputs.shape, generator=g)
                targets[torch.arange(inputs.shape[1]) >= lengths[:, None]] = IGNORE_INDEX
                data[-1].append((inputs, targets))
        counts = [[int((y != IGNORE_INDEX).sum()) for _, y in rank] for rank in data]
        every = [c for rank in counts for c in rank]
        if len(set(every)) == len(every) and len({sum(c) for c in counts}) == world_size:
            return data


def _loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _pieces(micro_batches: list[tuple]) -> dict:
    """This rank's facts, micro-batch by micro-batch: gradient sum S, loss sum L, valid tokens
    n, positions m (padding included), each on a fresh copy of the initial model."""
    facts: dict[str, list] = {"S": [], "L": [], "n": [], "m": []}
    for x, y in micro_batches:
        model = evidence.token_model(VOCAB)
        loss = _loss_sum(model, x, y)
        loss.backward()
        facts["S"].append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        facts["L"].append(loss.item())
        facts["n"].append(int((y != IGNORE_INDEX).sum()))
        facts["m"].append(y.numel())
    return facts


def _named(micro_batches: list[tuple]) -> dict[str, torch.Tensor]:
    """The micro-batches' tensors by name ("inputs[0]", "targets[0]", ...), to compare."""
    return {f"{what}[{k}]": t for k, batch in enumerate(micro_batches)
            for what, t in zip(("inputs", "targets"), batch, strict=True)}


def _as_float(loss: Any) -> float | dict:
    """The loss returned, or what it is instead of a float."""
    if isinstance(loss, torch.Tensor) or not evidence.is_number(loss):
        return {"what": f"{type(loss).__name__} {loss!r:.60}"}
    return float(loss)


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    seed = [evidence.fresh_seed()]
    dist.broadcast_object_list(seed, src=0)  # every rank draws the same data, keeps its own
    mine = _data(world_size, micro_batches_at(world_size), seed[0])[rank]
    facts, model = _pieces(mine), evidence.token_model(VOCAB)
    ddp = DDP(model)  # built before the recorder: its broadcast of the weights is not yours
    params = evidence.params_of(model)
    given = [(x.clone(), y.clone()) for x, y in mine]
    with evidence.Recorder(fn) as calls:
        calls.watch(ddp)
        loss = common.attempt(fn, ddp, given)
    for call in calls.log:
        call.settle()  # after fn: its async calls have been waited for
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    grad = None if missing else torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"loss": _as_float(loss), "grad": grad, "missing": missing, "facts": facts,
            "counts": dict(calls.calls), "calls": calls.log,
            "params": evidence.changed_text(params, evidence.params_of(model),
                                            "changed the parameters:"),
            "micro_batches": evidence.changed_text(_named(mine), _named(given),
                                                   "changed the micro-batches it was given:")}


# --------------------------------------------------------------------------------------------
# What the run should have given, and the usual mistakes
# --------------------------------------------------------------------------------------------


def _totals(run: Run) -> tuple[list, list, int, int]:
    """(S[r][k], n[r][k], valid tokens T, positions M) of every rank's micro-batches."""
    S = [o["facts"]["S"] for o in run.outs]
    n = [o["facts"]["n"] for o in run.outs]
    return S, n, sum(map(sum, n)), sum(sum(o["facts"]["m"]) for o in run.outs)


_ONE_COUNT = ("divide every micro-batch's loss sum by one count, the valid tokens of all the "
              "micro-batches of all the ranks (count them all first, then one all_reduce)")
_TIMES_N = " And multiply by the world size: DDP divides the summed gradients by it."
_BUG = ("this is the 2024 accumulation bug: each micro-batch's own mean, divided by the number "
        f"of micro-batches. Instead, {_ONE_COUNT}.")
_LOCAL = ("this is each rank's own mean (its loss sum / its own count), which DDP then averages "
          "over the ranks: all_reduce the count, so that every rank divides by the valid tokens "
          "of all ranks.")
_PER_K = ("you divided each micro-batch by the count of that micro-batch over the ranks: "
          f"{_ONE_COUNT}.")
_PADDING = ("you counted every position, padding included (targets.numel()): count the valid "
            "tokens only, (targets != -100).sum().")
_NO_DIVISION = "you did not divide: divide each micro-batch's loss sum by the global count."


def _mistakes(run: Run) -> list[tuple[str, torch.Tensor]]:
    """(what to tell the learner, the gradient DDP leaves) for each usual mistake."""
    S, n, T, M = _totals(run)
    N = run.size
    total = sum(sum(r) for r in S)
    per_rank = sum(sum(r) / sum(c) for r, c in zip(S, n, strict=True))  # sum of ranks' means
    per_micro = sum(s / c for r, cs in zip(S, n, strict=True) for s, c in zip(r, cs, strict=True))
    per_k = sum(sum(r[k] for r in S) / sum(c[k] for c in n) for k in range(len(S[0])))
    return [
        (f"you forgot the × N: DDP divides the summed gradients by the world size ({N} here), "
         "so multiply each loss by dist.get_world_size() (not by a number).", total / T / N),
        (_LOCAL + _TIMES_N, per_rank / N), (_LOCAL, per_rank),
        (_BUG + _TIMES_N, per_micro / len(S[0]) / N), (_BUG, per_micro / len(S[0])),
        (f"each micro-batch's own mean, added up: {_ONE_COUNT}.{_TIMES_N}", per_micro / N),
        (f"each micro-batch's own mean, added up: {_ONE_COUNT}.", per_micro),
        (_PER_K, per_k), (_PER_K + _TIMES_N, per_k / N),
        (_PADDING, total / M), (_PADDING + _TIMES_N, total / M / N),
        (common.ZEROED_INSIDE, sum(r[-1] for r in S) / T),
        (_NO_DIVISION, total), (_NO_DIVISION + _TIMES_N, total / N),
        (common.SUMMED_TOO, total / T * N),
    ]


# --------------------------------------------------------------------------------------------
# The diagnoses, most telling first: each takes a Run, returns a message or None
# --------------------------------------------------------------------------------------------


_micro_batches_touched = common.left_alone(
    "micro_batches", "leave the inputs and targets as they are (a copy, if you must).")


def _wrong_gradient(run: Run) -> str | None:
    S, _, T, _ = _totals(run)
    got, expected = run.out["grad"], sum(sum(r) for r in S) / T
    if evidence.same_gradient(got, expected):
        return None
    mistake = evidence.named_mistake(got, _mistakes(run))
    if mistake:
        return f"your gradient is not the mean over all {T} valid tokens: {mistake}"
    return _scaled(run, got, expected, T) or (
        f"your gradient is not the mean over all {T} valid tokens (max abs difference "
        f"{(got - expected).abs().max().item():.3g}), nor any of the usual mistakes: sum the "
        "loss over each micro-batch's valid tokens (reduction='sum', ignore_index=-100) and "
        "divide by the global count of valid tokens, × the world size.")


def _scaled(run: Run, got: torch.Tensor, expected: torch.Tensor, T: int) -> str | None:
    """What to say if ``got`` is a multiple of ``expected``: × a hard-coded world size?"""
    return evidence.wrong_scale(
        got, expected, run.size, micro_batches_at(run.size),
        "your gradients are {times} the expected ones (the gradient of the mean over all "
        f"{T} valid tokens): how do you scale each micro-batch's loss sum? / the global count × "
        "the world size.")


def _wrong_loss(run: Run) -> str | None:
    L = [sum(o["facts"]["L"]) for o in run.outs]
    n = [sum(o["facts"]["n"]) for o in run.outs]
    expected = sum(L) / sum(n)
    for rank, out in enumerate(run.outs):
        loss = out["loss"]
        if isinstance(loss, dict):
            return (f"{run.name} returned {loss['what']} on rank {rank}: return the mean loss "
                    "as a float (`.item()`), the number to log.")
        if abs(loss - expected) <= 1e-9 * max(1.0, abs(expected)):
            continue
        candidates = {
            "this rank's own mean (its loss sum / its own count)": L[rank] / n[rank],
            "the mean of the ranks' means": sum(a / b for a, b in zip(L, n, strict=True))
            / run.size,
            "this rank's loss sum / the global count: all_reduce the loss sum too":
                L[rank] / sum(n),
            "the loss you backpropagated (× the world size): return the loss sum of all ranks "
            "/ the global count": L[rank] / sum(n) * run.size,
        }
        hint = next((k for k, v in candidates.items() if abs(loss - v) <= 1e-9 * max(1, v)),
                    "not any of the usual mistakes")
        return (f"{run.name} returned {loss:.6g} on rank {rank}; the mean loss over all "
                f"{sum(n)} valid tokens is {expected:.6g}. Yours is {hint}.")


def _count_carried(run: Run, out: dict) -> str | None:
    """What a rank's collectives delivered of the counts no rank knows alone: "the count T"
    (all-reduced), "every rank's count" (all-gathered), or None."""
    _, n, T, _ = _totals(run)
    return evidence.count_delivered(out["calls"], T, [sum(c) for c in n])


def _count_not_carried(run: Run) -> str | None:
    """The global count is known to no rank alone: a collective must have delivered it (or
    every rank's count, as an all_gather would)."""
    _, n, T, _ = _totals(run)
    return evidence.count_not_delivered(run.outs, T, [sum(c) for c in n],
                                        "the count of valid tokens of all the ranks")


_synced_every_micro_batch = common.synced_once(lambda run: len(run.out["facts"]["n"]))

#: In order: a wrong gradient after changed inputs is told as the changed inputs.
DIAGNOSES = (common.no_gradient, common.parameters_left_alone, _micro_batches_touched,
             _wrong_gradient, common.ranks_differ, _wrong_loss, _count_not_carried,
             _synced_every_micro_batch)


def _verified(runs: Sequence[Run]) -> str:
    parts = []
    for run in runs:
        T, out = _totals(run)[2], run.out
        parts.append(f"{run.label[3:]} ({T} valid tokens, loss {out['loss']:.4f}; collectives: "
                     f"{evidence.calls_text(out['counts'])}, delivering "
                     f"{_count_carried(run, out)})")
    return ("the gradient and the loss are those of one process on every valid token, on "
            + " and on ".join(parts) + "; the parameters and the micro-batches are untouched.")


@common.exercise("07_which_mean.ipynb", "token_mean_backward(model, micro_batches)")
def check_token_mean_backward(token_mean_backward: Callable,
                              world_size: int | Sequence[int] = common.WORLD_SIZES, *,
                              timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``token_mean_backward(model, micro_batches) -> float`` under DDP: afterwards every
    rank's ``.grad`` is the gradient of the mean over every valid token of every rank's
    micro-batches, and it returns that mean loss, the same on every rank.

    ``model`` is a ``DistributedDataParallel`` model; ``micro_batches`` this rank's list of
    ``(inputs, targets)``, targets padded with -100, fresh random sequences at every check. Runs it
    on 2 ranks with 4 micro-batches each, then at the second size with 3 (``world_size``: another
    number, or several), and compares with one process on all of them. Says so if you took the mean
    per micro-batch (the 2024 accumulation bug), divided by a rank's own count, forgot the × world
    size that DDP's division needs, counted padding, exchanged the count without a collective, let
    DDP synchronize every micro-batch (no ``no_sync``), changed the parameters or the
    micro-batches...

        >>> import gradsync_tutorial as gst
        >>> def token_mean_backward(model, micro_batches):   # the mean per micro-batch: caught
        ...     for x, y in micro_batches:
        ...         loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        ...         (loss / len(micro_batches)).backward()
        >>> gst.exercises.check_token_mean_backward(token_mean_backward)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks × 4 micro-batches: your gradient is not the mean over ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, token_mean_backward, world_size, timeout, DIAGNOSES,
                           _verified, label=common.micro_batch_label(micro_batches_at))
