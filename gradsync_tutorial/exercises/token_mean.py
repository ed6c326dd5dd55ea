"""Exercise of notebook 07 (``07_which_mean.ipynb``): ``token_mean_backward(model,
micro_batches)`` leaves in every rank's ``.grad``, under DDP with gradient accumulation, the
gradient of the mean over every valid token of every rank's micro-batches, and returns that mean.

The check runs the learner's function at two sizes that no guess passes both of: 2 ranks with 4
micro-batches each, then 3 ranks with 3 (the notebook uses 2 and 2; 2 ranks first, so that a
check run from the notebook starts on its warm workers). Every micro-batch holds fresh random
sequences with its own number of valid tokens, drawn from a seed that rank 0 draws and sends
before the learner's function runs. Each rank also computes, for the diagnosis, its own
micro-batches' gradient sums, loss sums and counts; the diagnoses build the reference and each
usual mistake from them. What the learner's collectives delivered must include the global
count of valid tokens, which no rank knows alone.

The shape is notes/EXERCISE_RECIPE.md's (a worker, then diagnoses taking one run each, most
telling first, then the computed "✓ correct" sentence), with its run and recorder written here
until the shared ``evidence`` and ``common.on_ranks`` of the exercises' rework are merged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..detect import CollectiveCounter
from .common import (
    CHECK_TIMEOUT,
    STUB,
    exercise,
    fail,
    name_of,
    run_on_ranks,
)
from .evidence import SEED, calls_text, fresh_seed, is_number, times_text

#: The world sizes a check runs at, and the micro-batches per rank at each: neither is the
#: notebook's 2 and 2 together, and no number is the same at both sizes.
WORLD_SIZES = (2, 3)
VOCAB, IGNORE_INDEX, LINES = 11, -100, 3


def micro_batches_at(world_size: int) -> int:
    """How many micro-batches each rank gets at ``world_size`` ranks: 4 at 2, else 3."""
    return 4 if world_size == 2 else 3


@dataclass
class Run:
    """One size's run (the shape of ``common.Run`` in the exercises' rework)."""

    name: str
    size: int
    outs: list  # what the worker returned, by rank
    label: str  # "on 3 ranks × 3 micro-batches"

    @property
    def out(self) -> Any:
        return self.outs[0]


# --------------------------------------------------------------------------------------------
# On the ranks
# --------------------------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank
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


def _pieces(micro_batches: list[tuple]) -> dict:
    """This rank's facts, micro-batch by micro-batch: gradient sum S, loss sum L, valid tokens
    n, positions m (padding included), each on a fresh copy of the initial model."""
    facts: dict[str, list] = {"S": [], "L": [], "n": [], "m": []}
    for x, y in micro_batches:
        model = _model()
        loss = _loss_sum(model, x, y)
        loss.backward()
        facts["S"].append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        facts["L"].append(loss.item())
        facts["n"].append(int((y != IGNORE_INDEX).sum()))
        facts["m"].append(y.numel())
    return facts


class _Recorder(CollectiveCounter):
    """Counts the collectives and keeps what each delivered: the numbers its first argument
    (the tensor, or the output list) held right after it returned, or for an ``async_op=True``
    call, when :meth:`numbers` is asked (after the learner's function, which waited)."""

    def __init__(self, *functions: Callable) -> None:
        super().__init__(*functions)
        self._delivered: list[tuple[bool, Any]] = []  # (async?, its numbers or its data)

    def _wrap(self, name: str, original: Callable) -> Callable:
        counted = super()._wrap(name, original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            outer = not getattr(self._local, "depth", 0)
            result = counted(*args, **kwargs)
            if outer and args:
                is_async = bool(kwargs.get("async_op"))
                self._delivered.append((is_async, args[0] if is_async else _numbers(args[0])))
            return result

        return recorded

    def numbers(self) -> list[float]:
        return [v for is_async, d in self._delivered for v in (_numbers(d) if is_async else d)]


def _numbers(value: Any) -> list[float]:
    if isinstance(value, torch.Tensor):
        return value.detach().double().flatten().tolist()
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _numbers(item)]
    return [float(value)] if is_number(value) else []


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    seed = [fresh_seed()]
    dist.broadcast_object_list(seed, src=0)  # every rank draws the same data, keeps its own
    mine = _data(world_size, micro_batches_at(world_size), seed[0])[rank]
    facts, model = _pieces(mine), _model()
    ddp = DDP(model)  # built before the recorder: its broadcast of the weights is not yours
    before = [p.detach().clone() for p in model.parameters()]
    given = [(x.clone(), y.clone()) for x, y in mine]
    with _Recorder(fn) as calls:
        calls.watch(ddp)
        try:
            loss = fn(ddp, given)
        except NotImplementedError:
            return STUB
        delivered = calls.numbers()  # after fn: its async calls have been waited for
    changed = [name for (name, p), b in zip(model.named_parameters(), before, strict=True)
               if not torch.equal(p.detach(), b)]
    changed += ["micro_batches"] * any(not (torch.equal(x, a) and torch.equal(y, b))
                                       for (x, y), (a, b) in zip(given, mine, strict=True))
    if isinstance(loss, torch.Tensor) or not is_number(loss):
        loss = {"what": f"{type(loss).__name__} {loss!r:.60}"}
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    grad = None if missing else torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"loss": loss if isinstance(loss, dict) else float(loss), "grad": grad,
            "missing": missing, "calls": dict(calls.calls), "delivered": delivered,
            "changed": changed, "facts": facts}


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
        ("only the last micro-batch's gradient is left: do not zero the gradients (or set "
         ".grad = None) inside your loop.", sum(r[-1] for r in S) / T),
        (_NO_DIVISION, total), (_NO_DIVISION + _TIMES_N, total / N),
        ("you multiplied by the world size and also summed the gradients yourself: DDP already "
         "averages them in backward(); do not all_reduce the gradients.", total / T * N),
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-7, atol=1e-12)


# --------------------------------------------------------------------------------------------
# The diagnoses, most telling first: each takes a Run, returns a message or None
# --------------------------------------------------------------------------------------------


def _no_gradient(run: Run) -> str | None:
    if run.out["missing"]:
        return (f"`{run.out['missing'][0]}` has no gradient after {run.name}: call backward() "
                "on each micro-batch's loss.")


def _wrong_gradient(run: Run) -> str | None:
    S, n, T, _ = _totals(run)
    got, expected = run.out["grad"], sum(sum(r) for r in S) / T
    if _same(got, expected):
        return None
    for mistake, grad in _mistakes(run):
        if _same(got, grad):
            return f"your gradient is not the mean over all {T} valid tokens: {mistake}"
    c = (got.dot(expected) / expected.dot(expected)).item()
    if _same(got, c * expected):
        k = round(c * run.size)
        guess = (f" Did you multiply by {k} instead of the world size ({run.size} here)? Use "
                 "dist.get_world_size(): it is not always 2."
                 if abs(c * run.size - k) < 1e-6 and k not in (0, run.size) else "")
        return (f"your gradients are {times_text(c)} the expected ones (the gradient of the mean "
                f"over all {T} valid tokens): how do you scale each micro-batch's loss sum? / "
                "the global count × the world size." + guess)
    return (f"your gradient is not the mean over all {T} valid tokens (max abs difference "
            f"{(got - expected).abs().max().item():.3g}), nor any of the usual mistakes: sum the"
            " loss over each micro-batch's valid tokens (reduction='sum', ignore_index=-100) and "
            "divide by the global count of valid tokens, × the world size.")


def _ranks_differ(run: Run) -> str | None:
    if any(not torch.equal(o["grad"], run.out["grad"]) for o in run.outs):
        return ("the ranks ended with different gradients: let DDP average them (in the last "
                "micro-batch's backward), and do not change one rank's .grad afterwards.")


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


def _count_not_carried(run: Run) -> str | None:
    """The global count is known to no rank alone: a collective must have delivered it (or
    every rank's count, as an all_gather would)."""
    _, n, T, _ = _totals(run)
    for rank, out in enumerate(run.outs):
        got = out["delivered"]
        near = [any(abs(v - x) < 1e-6 for v in got) for x in [T, *(sum(c) for c in n)]]
        if not near[0] and not all(near[1:]):
            return (f"rank {rank}'s collectives delivered {_numbers_text(got)} "
                    f"({calls_text(out['calls'])}), never the count of valid tokens of all the "
                    f"ranks ({T}), nor every rank's count: exchange the count with "
                    "dist.all_reduce, not another way.")


def _synced_every_micro_batch(run: Run) -> str | None:
    k, ddp = len(run.out["facts"]["n"]), run.out["calls"].get("ddp_bucket_allreduce", 0)
    if ddp > 1:
        return (f"DDP all-reduced the gradients in {ddp} backward passes: run every micro-batch "
                "but the last inside `with model.no_sync():`, so that DDP communicates once per "
                f"step instead of {k} times (notebook 04's accumulation pitfall).")


def _changed(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        if out["changed"]:
            what = out["changed"][0]
            if what == "micro_batches":
                return (f"on rank {rank}, {run.name} changed the micro-batches it was given: "
                        "leave the inputs and targets as they are (a copy, if you must).")
            return (f"on rank {rank}, {run.name} changed the parameter `{what}`: compute the "
                    "gradients only; the caller's optimizer takes the step.")


#: In order: a wrong gradient after changed inputs is told as the changed inputs.
DIAGNOSES = (_no_gradient, _changed, _wrong_gradient, _ranks_differ, _wrong_loss,
             _count_not_carried, _synced_every_micro_batch)


def _numbers_text(values: list[float]) -> str:
    shown = ", ".join(f"{v:.4g}" for v in values[:4]) + ", ..." * (len(values) > 4)
    return f"[{shown}]"


def _verified(runs: Sequence[Run]) -> str:
    parts = []
    for run in runs:
        _, _, T, _ = _totals(run)
        loss, delivered = run.out["loss"], run.out["delivered"]
        carried = (f"the count {T}" if any(abs(v - T) < 1e-6 for v in delivered)
                   else "every rank's count")
        parts.append(f"{run.label[3:]} ({T} valid tokens, loss {loss:.4f}; collectives: "
                     f"{calls_text(run.out['calls'])}, delivering {carried})")
    return ("the gradient and the loss are those of one process on every valid token, on "
            + " and on ".join(parts) + ".")


@exercise("07_which_mean.ipynb", "token_mean_backward(model, micro_batches)")
def check_token_mean_backward(token_mean_backward: Callable,
                              world_size: int | Sequence[int] = WORLD_SIZES, *,
                              timeout: float = CHECK_TIMEOUT) -> str:
    """Check ``token_mean_backward(model, micro_batches) -> float`` under DDP: afterwards every
    rank's ``.grad`` is the gradient of the mean over every valid token of every rank's
    micro-batches, and it returns that mean loss, the same on every rank.

    ``model`` is a ``DistributedDataParallel`` model; ``micro_batches`` this rank's list of
    ``(inputs, targets)``, targets padded with -100, fresh random sequences at every check.
    Runs it on 2 ranks with 4 micro-batches each, then on 3 ranks with 3 (``world_size``: another
    number, or several), and compares with one process on all of them. Says so if you took the
    mean per micro-batch (the 2024 accumulation bug), divided by a rank's own count, forgot the ×
    world size that DDP's division needs, counted padding, exchanged the count without a
    collective, let DDP synchronize every micro-batch (no ``no_sync``)...

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
    sizes = (world_size,) if isinstance(world_size, int) else tuple(world_size)
    runs: list[Run] = []
    for size in sizes:
        outs = run_on_ranks(_worker, token_mean_backward, size, timeout)
        label = f"on {size} ranks × {micro_batches_at(size)} micro-batches"
        run = Run(name_of(token_mean_backward), size, outs, label)
        for diagnosis in DIAGNOSES:
            message = diagnosis(run)
            if message:
                right = " and ".join(r.label for r in runs)
                fail(f"{f'right {right}, but ' if right else ''}{label}: {message}")
        runs.append(run)
    return _verified(runs)
