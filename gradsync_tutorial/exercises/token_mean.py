"""Exercise of notebook 07 (``07_which_mean.ipynb``): ``token_mean_backward(model,
micro_batches)`` leaves in every rank's ``.grad``, under DDP with gradient accumulation, the
gradient of the mean over every valid token of every rank's micro-batches, and returns that mean.

The check draws fresh random sequences for every rank and micro-batch (each with its own number
of valid tokens) and runs the learner's function on them under DDP in two configurations that a
guess cannot pass: 2 ranks with 4 micro-batches, then 3 ranks with 3 (the notebook uses 2 and 2;
2 ranks first, so that a check run from the notebook starts on its warm workers). In this
process it computes the reference and each usual mistake from every micro-batch's own gradient
sum. What the learner's ``all_reduce`` calls carried (their results) is part of the report.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .common import (
    CHECK_TIMEOUT,
    SEED,
    STUB,
    CollectiveCounter,
    calls_text,
    exercise,
    fail,
    fresh_seed,
    is_number,
    name_of,
    run_on_ranks,
    times_text,
)

#: (world size, micro-batches per rank) of each run: not the notebook's (2, 2), so that neither
#: a hard-coded world size nor a hard-coded number of micro-batches passes both.
CONFIGS = ((2, 4), (3, 3))
VOCAB, IGNORE_INDEX, LINES = 11, -100, 3


def _model() -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank and in the check
    return nn.Sequential(nn.Embedding(VOCAB, 6), nn.Linear(6, VOCAB)).double()


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


def _worker(rank: int, world_size: int, fn: Callable, data: list) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model)  # built outside the counter: its broadcast of the weights is not yours
    mine = [(x.clone(), y.clone()) for x, y in data[rank]]
    with CollectiveCounter(fn) as counter:
        counter.watch(ddp)
        try:
            loss = fn(ddp, mine)
        except NotImplementedError:
            return STUB
    if isinstance(loss, torch.Tensor):
        loss = {"tensor": f"{loss.detach()!r:.60}"}
    elif not is_number(loss):
        loss = {"other": f"{type(loss).__name__} {loss!r:.60}"}
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    grad = None if missing else torch.cat([p.grad.flatten() for p in model.parameters()])
    carried = [args[0].detach().flatten().tolist() for args, _ in counter.arguments["all_reduce"]
               if args and isinstance(args[0], torch.Tensor)]
    return {"loss": loss if isinstance(loss, dict) else float(loss), "grad": grad,
            "missing": missing, "calls": dict(counter.calls), "carried": carried}


def _pieces(data: list) -> dict:
    """Every micro-batch's own gradient sum S[r][k], loss sum L[r][k], valid tokens n[r][k] and
    positions m[r][k] (padding included), computed here, one micro-batch at a time."""
    S, L, n, m = [], [], [], []
    for rank in data:
        for lst in (S, L, n, m):
            lst.append([])
        for x, y in rank:
            model = _model()
            loss = _loss_sum(model, x, y)
            loss.backward()
            S[-1].append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            L[-1].append(loss.item())
            n[-1].append(int((y != IGNORE_INDEX).sum()))
            m[-1].append(y.numel())
    return {"S": S, "L": L, "n": n, "m": m}


_ONE_COUNT = ("divide every micro-batch's loss sum by one count, the valid tokens of all the "
              "micro-batches of all the ranks (count them all first, then one all_reduce)")
_TIMES_N = " And multiply by the world size: DDP divides the summed gradients by it."


def _mistakes(p: dict, N: int, K: int) -> list[tuple[str, torch.Tensor]]:
    """(what to tell the learner, the gradient DDP leaves) for each usual mistake."""
    S, n = p["S"], p["n"]
    T, M = sum(map(sum, n)), sum(map(sum, p["m"]))
    total = sum(sum(r) for r in S)
    per_rank = sum(sum(r) / sum(c) for r, c in zip(S, n, strict=True))  # sum of ranks' means
    per_micro = sum(s / c for r, cs in zip(S, n, strict=True) for s, c in zip(r, cs, strict=True))
    per_micro_global = sum(sum(S[r][k] for r in range(N)) / sum(n[r][k] for r in range(N))
                           for k in range(K))
    bug = ("this is the 2024 accumulation bug: each micro-batch's own mean, divided by the "
           f"number of micro-batches. Instead, {_ONE_COUNT}.")
    local = ("this is each rank's own mean (its loss sum / its own count), which DDP then "
             "averages over the ranks: all_reduce the count, so that every rank divides by the "
             "valid tokens of all ranks.")
    per_k = ("you divided each micro-batch by the count of that micro-batch over the ranks: "
             f"{_ONE_COUNT}.")
    padding = ("you counted every position, padding included (targets.numel()): count the "
               "valid tokens only, (targets != -100).sum().")
    return [
        (f"you forgot the × N: DDP divides the summed gradients by the world size ({N} here), "
         "so multiply each loss by dist.get_world_size() (not by a number).", total / T / N),
        (local + _TIMES_N, per_rank / N), (local, per_rank),
        (bug + _TIMES_N, per_micro / K / N), (bug, per_micro / K),
        (f"each micro-batch's own mean, added up: {_ONE_COUNT}." + _TIMES_N, per_micro / N),
        (f"each micro-batch's own mean, added up: {_ONE_COUNT}.", per_micro),
        (per_k, per_micro_global), (per_k + _TIMES_N, per_micro_global / N),
        (padding, total / M), (padding + _TIMES_N, total / M / N),
        ("only the last micro-batch's gradient is left: do not zero the gradients (or set "
         ".grad = None) inside your loop.", sum(r[-1] for r in S) / T),
        ("you did not divide: divide each micro-batch's loss sum by the global count of valid "
         "tokens.", total), ("you did not divide: divide each micro-batch's loss sum by the "
                             "global count of valid tokens." + _TIMES_N, total / N),
        ("you multiplied by the world size and also summed the gradients yourself: DDP already "
         "averages them in backward(); do not all_reduce the gradients.", total / T * N),
    ]


def _diagnose_gradient(name: str, outs: list, p: dict, N: int, K: int) -> None:
    """fail(...) with the most telling message if the gradient is not the global token mean."""
    __tracebackhide__ = True
    got = outs[0]["grad"]
    T = sum(map(sum, p["n"]))
    expected = sum(sum(r) for r in p["S"]) / T
    if outs[0]["missing"]:
        fail(f"`{outs[0]['missing'][0]}` has no gradient after {name}: call backward() on each "
             "micro-batch's loss.")
    ddp = outs[0]["calls"].get("ddp_bucket_allreduce", 0)
    if not _same(got, expected):
        for mistake, grad in _mistakes(p, N, K):
            if _same(got, grad):
                fail(f"with {N} ranks and {K} micro-batches, your gradient is not the mean over "
                     f"all {T} valid tokens: {mistake}")
        c = (got.dot(expected) / expected.dot(expected)).item()
        if _same(got, c * expected):
            k = round(c * N)
            guess = (f" Did you multiply by {k} instead of the world size ({N} here)? Use "
                     "dist.get_world_size(): it is not always 2."
                     if abs(c * N - k) < 1e-6 and k not in (0, N) else "")
            fail(f"with {N} ranks and {K} micro-batches, your gradients are {times_text(c)} the "
                 f"expected ones (the gradient of the mean over all {T} valid tokens): how do "
                 "you scale each micro-batch's loss sum? / the global count × the world size."
                 + guess)
        fail(f"your gradient is not the mean over all {T} valid tokens (max abs difference "
             f"{(got - expected).abs().max().item():.3g}), nor any of the usual mistakes: sum "
             "the loss over each micro-batch's valid tokens (reduction='sum', ignore_index=-100)"
             " and divide by the global count of valid tokens, × the world size.")
    if any(not torch.equal(o["grad"], got) for o in outs):
        fail("the ranks ended with different gradients: let DDP average them (in the last "
             "micro-batch's backward), and do not change one rank's .grad afterwards.")
    if ddp > 1:
        fail(f"DDP all-reduced the gradients in {ddp} backward passes: run every micro-batch "
             "but the last inside `with model.no_sync():`, so that DDP communicates once per "
             f"step instead of {K} times (notebook 04's accumulation pitfall).")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-7, atol=1e-12)


def _diagnose_loss(name: str, outs: list, p: dict, N: int) -> float:
    """fail(...) unless every rank returned the mean loss over all valid tokens; return it."""
    __tracebackhide__ = True
    L, n = [sum(r) for r in p["L"]], [sum(r) for r in p["n"]]
    expected = sum(L) / sum(n)
    for rank, out in enumerate(outs):
        loss = out["loss"]
        if isinstance(loss, dict):
            what = loss.get("tensor") or loss.get("other")
            fail(f"{name} returned {what} on rank {rank}: return the mean loss as a float "
                 "(`.item()`), the number to log.")
        if abs(loss - expected) <= 1e-9 * max(1.0, abs(expected)):
            continue
        candidates = {
            "this rank's own mean (its loss sum / its own count)": L[rank] / n[rank],
            "the mean of the ranks' means": sum(a / b for a, b in zip(L, n, strict=True)) / N,
            "this rank's loss sum / the global count: all_reduce the loss sum too":
                L[rank] / sum(n),
            "the loss you backpropagated (× the world size): return the loss sum of all ranks"
            " / the global count": L[rank] / sum(n) * N,
        }
        hint = next((k for k, v in candidates.items() if abs(loss - v) <= 1e-9 * max(1, v)),
                    "not any of the usual mistakes")
        fail(f"{name} returned {loss:.6g} on rank {rank}; the mean loss over all {sum(n)} valid "
             f"tokens is {expected:.6g}. Yours is {hint}.")
    return expected


def _carried_text(outs: list, T: int) -> str:
    """What the learner's all_reduce calls carried, as seen on rank 0."""
    carried = outs[0]["carried"]
    if any(abs(v - T) < 1e-9 for values in carried for v in values):
        return f"one all_reduce carried the count of valid tokens, {T}"
    return f"your all_reduce calls returned {carried}"


@exercise("07_which_mean.ipynb", "token_mean_backward(model, micro_batches)")
def check_token_mean_backward(token_mean_backward: Callable, *,
                              timeout: float = CHECK_TIMEOUT) -> str:
    """Check ``token_mean_backward(model, micro_batches) -> float`` under DDP: afterwards every
    rank's ``.grad`` is the gradient of the mean over every valid token of every rank's
    micro-batches, and it returns that mean loss, the same on every rank.

    ``model`` is a ``DistributedDataParallel`` model; ``micro_batches`` this rank's list of
    ``(inputs, targets)``, targets padded with -100, fresh random sequences at every check.
    Runs it on 2 ranks with 4 micro-batches, then on 3 ranks with 3, and compares with one
    process on all of them. Says so if you took the mean per micro-batch (the 2024 accumulation
    bug), divided by a rank's own count, forgot the × world size that DDP's division needs,
    counted padding, let DDP synchronize every micro-batch (no ``no_sync``)...

        >>> import gradsync_tutorial as gst
        >>> def token_mean_backward(model, micro_batches):   # the mean per micro-batch: caught
        ...     for x, y in micro_batches:
        ...         loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        ...         (loss / len(micro_batches)).backward()
        >>> gst.exercises.check_token_mean_backward(token_mean_backward)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: with 2 ranks and 4 micro-batches, your gradient is not the mean ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    name, verified = name_of(token_mean_backward), []
    for N, K in CONFIGS:
        data = _data(N, K, fresh_seed())
        worker = functools.partial(_worker, data=data)
        outs = run_on_ranks(worker, token_mean_backward, N, timeout)
        p = _pieces(data)
        _diagnose_gradient(name, outs, p, N, K)
        loss = _diagnose_loss(name, outs, p, N)
        T = sum(map(sum, p["n"]))
        verified.append(f"{N} ranks × {K} micro-batches ({T} valid tokens; loss {loss:.4f}; "
                        f"collectives: {calls_text(outs[0]['calls'])}; "
                        f"{_carried_text(outs, T)})")
    return ("the gradient and the loss are those of one process on every valid token, with "
            + " and with ".join(verified) + ".")
