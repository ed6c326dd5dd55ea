"""Exercise of notebook 09 (``09_precision_of_the_sum.ipynb``):
``average_gradients_in_fp32(model)`` averages a bf16 model's gradients over the ranks with the
sum in float32, and rounds the mean to bf16 once.

In the shape every check has: a worker that runs on the ranks, a table of diagnoses (most
telling mistake first), a "✓ correct" sentence computed from the runs, two world sizes. The
collectives are recorded with :class:`~gradsync_tutorial.detect.CollectiveCounter`, which keeps
the tensors they carried: the check reads their format (``dtype``) and what they delivered.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..detect import CollectiveCounter
from ..model import Net
from .common import CHECK_TIMEOUT, STUB, exercise, fail, name_of, run_on_ranks

SEED = 1234
#: The world sizes the check runs at, one launch each: a number hard-coded for the world size
#: is wrong at one of them, and 3 ranks show a sum rounded in bf16 (on 2 ranks, a + b rounded
#: once is exact to bf16, so only the format of the all_reduce shows it).
WORLD_SIZES = (2, 3)
#: Numbers that may differ from the exact mean rounded to bf16 (float32 rounds too, rarely
#: right at a bf16 tie), as a fraction of all; each by one bf16 step at most.
TIE_FRACTION = 1e-3


@dataclass
class Run:
    """One world size's run: what each rank's worker returned, and where it ran."""

    name: str
    size: int
    outs: list
    label: str


def _snapshot(counter: CollectiveCounter) -> list[dict]:
    """Each all_reduce call's tensor: its format, and what it holds now (after the function)."""
    calls = []
    for args, kwargs in counter.arguments["all_reduce"]:
        t = args[0] if args else kwargs.get("tensor")
        if isinstance(t, torch.Tensor):
            calls.append({"dtype": t.dtype, "numbers": t.detach().double().flatten().clone()})
    return calls


def _flat(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors])


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    """On every rank: the course's CNN in bf16 with this rank's own gradients (fresh random
    data), every rank's gradients (for the expected mean), the learner's call, what happened."""
    torch.manual_seed(SEED)  # the same weights on every rank
    model = Net().eval()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(6), "little") + rank)
    images, labels = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    F.nll_loss(model(images), labels).backward()
    model.to(torch.bfloat16)  # a model trained in bf16: bf16 weights, bf16 gradients
    before = [p.detach().clone() for p in model.parameters()]
    own = _flat([p.grad for p in model.parameters()]).float()
    everyone = [torch.empty_like(own) for _ in range(world_size)]
    dist.all_gather(everyone, own)  # the check's own collective, before fn: float32 is exact
    with CollectiveCounter(fn) as counter:
        try:
            fn(model)
        except NotImplementedError:
            return STUB
    grads = [p.grad for p in model.parameters()]
    return {
        "everyone": torch.stack(everyone).double() if rank == 0 else None,
        "own": own.double(),
        "counts": dict(counter.calls),
        "calls": _snapshot(counter),
        "grad_dtypes": sorted({str(g.dtype) for g in grads if g is not None}),
        "missing": sum(g is None for g in grads),
        "got": None if any(g is None for g in grads) else _flat(grads),
        "changed": [str(p.dtype) if p.dtype != b.dtype else "values"
                    for p, b in zip(model.parameters(), before, strict=True)
                    if p.dtype != b.dtype or not torch.equal(p.detach(), b)],
    }


# --- What every rank should end with --------------------------------------------------------


def _exact_mean(run: Run) -> torch.Tensor:
    return run.outs[0]["everyone"].mean(0)


def _rounded_once(run: Run) -> torch.Tensor:
    """The exact mean, rounded once to bf16: what every rank's gradients should hold."""
    return _exact_mean(run).to(torch.bfloat16).double()


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The gap between x and the next bf16 number (2^-7 relative, at least the smallest)."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(exponent - 7)


# --- The diagnoses, most telling mistake first: each returns a message or None --------------


def _no_all_reduce(run: Run) -> str | None:
    counts = run.outs[0]["counts"]
    if not counts.get("all_reduce"):
        called = ", ".join(f"{k} {v}x" for k, v in counts.items()) or "none"
        return (f"{run.name} made no all_reduce call (collectives called: {called}). Sum the "
                "ranks' gradients with one dist.all_reduce of a float32 buffer.")


def _not_float32(run: Run) -> str | None:
    formats = sorted({str(c["dtype"]).removeprefix("torch.") for c in run.outs[0]["calls"]}
                     - {"float32"})
    if not formats:
        return None
    how = ("the sum was computed in bfloat16, each addition rounded to 8 bits: cast first, "
           "buffer = torch.cat([p.grad.float().flatten() for p in model.parameters()])"
           if "bfloat16" in formats else "cast the gradients to float32 before the all_reduce")
    return f"your all_reduce carried {', '.join(formats)}, not float32: {how}."


def _not_left_alone(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        if out["changed"]:
            what = ("turned float32" if "torch.float32" in out["changed"]
                    else "changed their values")
            return (f"on rank {rank}, the parameters {what}: leave the model as it is, and "
                    "write the mean into each p.grad (p.grad.copy_(...) rounds it to bf16).")
        if out["missing"]:
            return (f"on rank {rank}, {out['missing']} parameters have no gradient after "
                    f"{run.name}: write the mean into each p.grad, do not remove it.")
        if out["grad_dtypes"] != ["torch.bfloat16"]:
            return (f"on rank {rank}, the gradients are {', '.join(out['grad_dtypes'])}: keep "
                    "them bf16 (p.grad.copy_(mean) casts and rounds once).")


def _unchanged(run: Run) -> str | None:
    if all(torch.equal(out["got"], out["own"]) for out in run.outs):
        return ("the gradients did not change: every rank still holds its own. Did you reduce "
                "a float32 copy and not copy the mean back into each p.grad?")


def _not_delivered(run: Run) -> str | None:
    """The all_reduce buffers must hold the sum of every rank's gradients (or a multiple of
    it, when divided in place afterwards): numbers no rank has alone."""
    held = torch.cat([c["numbers"] for c in run.outs[0]["calls"]])
    exact = run.outs[0]["everyone"].sum(0)
    if held.numel() == exact.numel():
        held, target = held.sort().values, exact.sort().values
        c = held.dot(target) / target.dot(target)  # 1, or 1 / N after an in-place division
        off = (held - c * target).norm() / (c * target).norm()  # bf16 roundings: ~3e-3
        if c > 0 and off < 0.05:
            return None
    return (f"your all_reduce calls carried {held.numel():,} numbers, which are not the sum of "
            f"the ranks' {exact.numel():,} gradients: reduce every gradient, once, in one "
            "float32 buffer.")


def _ranks_differ(run: Run) -> str | None:
    for rank, out in enumerate(run.outs[1:], start=1):
        if not torch.equal(out["got"], run.outs[0]["got"]):
            return (f"rank {rank}'s gradients differ from rank 0's: after averaging, every rank "
                    "must hold the same mean.")


def _scaled(run: Run) -> str | None:
    got, mean = run.outs[0]["got"], _exact_mean(run)
    c = (got.dot(mean) / mean.dot(mean)).item()
    if abs(c - 1) < 0.01:
        return None
    if abs(c - run.size) < 0.01 * run.size:
        return (f"your gradients are {c:.1f}× the mean: all_reduce(SUM) gives the sum; divide it "
                "by the world size.")
    k = run.size / c
    hint = (f" Did you divide by {round(k)} instead of the world size ({run.size} here)?"
            if abs(k - round(k)) < 0.01 else "")
    return (f"your gradients are {c:.3g}× the mean over ranks: divide the sum by the world "
            f"size.{hint}")


def _rounded_more_than_once(run: Run) -> str | None:
    got, expected = run.outs[0]["got"], _rounded_once(run)
    off = got != expected
    far = ((got - expected).abs() > _bf16_step(expected)).sum().item()
    if off.float().mean() <= TIE_FRACTION and far == 0:
        return None
    return (f"{off.sum().item():,} of your {got.numel():,} numbers are not the float32 mean "
            "rounded once to bf16: round only at the end. Divide in float32, then copy into "
            "the bf16 gradient (a division in bf16, before or after, rounds a second time).")


DIAGNOSES = (_no_all_reduce, _not_float32, _not_left_alone, _unchanged, _not_delivered,
             _ranks_differ, _scaled, _rounded_more_than_once)


def _verified(runs: Sequence[Run]) -> str:
    """The ✓ sentence, from what the runs computed."""
    last = runs[-1]
    calls = last.outs[0]["counts"]["all_reduce"]
    numbers = sum(c["numbers"].numel() for c in last.outs[0]["calls"])
    exact = sum(int((r.outs[0]["got"] == _rounded_once(r)).sum()) for r in runs)
    total = sum(r.outs[0]["got"].numel() for r in runs)
    sizes = " and ".join(str(r.size) for r in runs)
    equal = (f"all {total:,} numbers" if exact == total else
             f"{exact:,} of {total:,} numbers; the rest, float32 ties, within one bf16 step")
    return (f"on {sizes} ranks, your all_reduce carried float32 ({calls} call"
            f"{'s' * (calls != 1)}, {numbers:,} numbers, the sum of the ranks' bf16 gradients) "
            f"and every rank's bf16 gradients are the mean rounded once ({equal}).")


@exercise("09_precision_of_the_sum.ipynb", "average_gradients_in_fp32(model)")
def check_average_gradients_in_fp32(
    average_gradients_in_fp32: Callable, world_size: int | Sequence[int] = WORLD_SIZES, *,
    timeout: float = CHECK_TIMEOUT,
) -> str:
    """Check ``average_gradients_in_fp32(model)``: ``model`` is in bf16 (weights and
    gradients); afterwards every rank's bf16 gradients hold the mean over the ranks, summed in
    float32 and rounded to bf16 once.

    Runs it on 2, then 3 ranks (``world_size``: another number, or several), each with the
    course's CNN and its own gradients from fresh random data. Says so if no all_reduce was
    called, if one carried bf16 (the sum rounded in bf16), if the parameters or the gradients'
    format changed, if the mean was not copied back, if the all_reduce did not carry every
    rank's gradients, if ranks differ, if the gradients are N× the mean (or divided by a fixed
    number), or if they were rounded twice (a division in bf16).

        >>> import gradsync_tutorial as gst
        >>> def average_gradients_in_fp32(model):      # the sum in bf16
        ...     for p in model.parameters():
        ...         dist.all_reduce(p.grad)
        ...         p.grad /= dist.get_world_size()
        >>> gst.exercises.check_average_gradients_in_fp32(average_gradients_in_fp32)
        ... # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: your all_reduce carried bfloat16, not float32: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    sizes = (world_size,) if isinstance(world_size, int) else tuple(world_size)
    name, runs = name_of(average_gradients_in_fp32), []
    for n in sizes:
        outs = run_on_ranks(_worker, average_gradients_in_fp32, n, timeout)
        run = Run(name, n, outs, f"on {n} ranks")
        for diagnosis in DIAGNOSES:
            message = diagnosis(run)
            if message:
                right = " and ".join(r.label for r in runs)
                fail(f"{f'right {right}, but ' if right else ''}{run.label}: {message}")
        runs.append(run)
    return _verified(runs)
