"""Exercise of notebook 05 (``05_performance.ipynb``): ``average_overlapped(model) -> finish``
starts every gradient's all_reduce from a hook during backward; ``finish()`` waits and divides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.nn.functional as F

from . import common, evidence
from .common import Run

STEPS = 2  # a second step shows handles kept from the first


def _step(model, x, y, finish: Callable, calls: evidence.Recorder) -> dict:
    """One training step as DDP's user writes it: backward, then finish(); what happened."""
    model.zero_grad()
    before = len(calls.log)
    F.nll_loss(model(x), y).backward()
    during = calls.log[before:]
    finish()
    after = calls.log[before + len(during):]
    for call in during:
        call.settle()  # what it delivered, now that finish() waited for it
    reduces = [c for c in during if c.name == "all_reduce"]
    return {"during": len(reduces), "async": sum(c.is_async for c in reduces),
            "after": sum(c.name == "all_reduce" for c in after), "got": evidence.grads_of(model),
            "calls": during + after}


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    model, images, labels = evidence.model_and_data(rank, batch=8 * STEPS)
    batches = list(zip(images.chunk(STEPS), labels.chunk(STEPS), strict=True))
    expected = []
    for x, y in batches:  # every rank's gradients at each step, to compute the means
        grads, _ = evidence.reference_gradient(model, x, y)
        expected.append(evidence.all_ranks(grads, world_size))
    params = evidence.params_of(model)
    with evidence.Recorder(fn) as calls:
        finish = common.attempt(fn, model)
        if not callable(finish):
            return {"finish": f"{type(finish).__name__} {finish!r:.60}"}
        steps = [_step(model, x, y, finish, calls) for x, y in batches]
    return {"steps": steps, "expected": expected,
            "params": evidence.changed_text(params, evidence.params_of(model),
                                            f"changed the parameters in {STEPS} steps of "
                                            "backward and finish():")}


def _steps(run: Run):
    """(step, every rank's facts at that step, every rank's own gradients, their mean)."""
    for step in range(STEPS):
        everyone = run.out["expected"][step]
        yield step + 1, [o["steps"][step] for o in run.outs], everyone, \
            evidence.mean_over_ranks(everyone)


# --- the diagnoses, most telling mistake first ----------------------------------------------


def _finish_not_returned(run: Run) -> str | None:
    if "finish" in run.out:
        return (f"{run.name}(model) returned {run.out['finish']}: return the function that "
                "finishes a step (it waits for the calls and divides), e.g. `return finish` "
                "after `def finish(): ...`, without calling it.")


_parameters_touched = common.left_alone(
    "params", "average the gradients only (the optimizer's step changes the weights).")


def _nothing_during_backward(run: Run) -> str | None:
    for step, facts, _, _ in _steps(run):
        first = facts[0]
        if first["during"] == 0:
            where = f"all {first['after']} in finish()" if first["after"] else "none at all"
            return (f"no all_reduce started during backward in step {step} ({where}): nothing "
                    "overlaps. Register a hook on every parameter, "
                    "p.register_post_accumulate_grad_hook(hook): autograd calls hook(p) the "
                    "moment p.grad is final, and the hook starts dist.all_reduce(p.grad, "
                    "async_op=True).")


def _not_async(run: Run) -> str | None:
    for step, facts, _, _ in _steps(run):
        first = facts[0]
        if first["async"] < first["during"]:
            return (f"{first['during'] - first['async']} of the {first['during']} all_reduce "
                    f"calls made during backward in step {step} had no async_op=True: such a "
                    "call returns only when it is done, so backward waits for it and nothing "
                    "overlaps. Pass async_op=True, keep the handle it returns, and wait() on it "
                    "in finish().")


def _not_the_mean(run: Run) -> str | None:
    n = len(run.out["expected"][0][0])
    for step, facts, everyone, expected in _steps(run):
        for rank, got in enumerate(f["got"] for f in facts):
            missing = [name for name, g in got.items() if g is None]
            if missing:
                return (f"on rank {rank}, `{missing[0]}` has no gradient after finish() in step "
                        f"{step}: average p.grad in place, do not remove it.")
            if not evidence.differing_tensors(got, expected):
                continue
            return _what_differs(run, step, rank, got, everyone[rank], expected, n)


def _what_differs(run: Run, step: int, rank: int, got: dict, own: dict, expected: dict,
                  n: int) -> str:
    if not evidence.differing_tensors(got, own):
        return (f"in step {step}, rank {rank}'s gradients did not change: did finish() wait on "
                "the handles? Reduce p.grad itself, in place, not a copy.")
    c = evidence.scale(got, expected)
    if step > 1 and (c is None or abs(c - run.size) > 1e-3):
        off = (f"are {evidence.times_text(c)} the mean over ranks" if c is not None else
               f"differ from the mean over ranks in "
               f"{evidence.where_text(evidence.differing_tensors(got, expected), n)}")
        return (f"step 1 is right, but in step {step} your gradients {off}: did finish() "
                "handle step 1's handles again? Empty the list of handles after waiting, so "
                "that each step waits on (and divides) its own calls only.")
    mismatch = evidence.mean_mismatch(got, expected, run.size, "the mean over ranks",
                                    "divide by the world size in finish(), after wait() "
                                    "(all_reduce sums).")
    return f"in step {step}, " + (mismatch or (
        f"rank {rank}'s gradients differ from the mean over ranks in "
        f"{evidence.where_text(evidence.differing_tensors(got, expected), n)}: did finish() "
        "wait() on every handle before dividing? An async all_reduce is done only after "
        "wait()."))


def _gradients_not_carried(run: Run) -> str | None:
    """The calls of a step must carry every gradient: their results, the sum (or the mean)."""
    for step, facts, _, expected in _steps(run):
        flat = evidence.flatten(expected).double()
        for rank, f in enumerate(facts):
            got = evidence.delivered(f["calls"])
            if got.numel() >= flat.numel() and any(
                    evidence.among(e, got) for e in (flat * run.size, flat)):
                continue
            return (f"the gradients are right, but in step {step} rank {rank}'s all_reduce "
                    f"calls delivered {evidence.numbers_text(got)}, not the sum of the ranks' "
                    f"{flat.numel():,} gradient numbers: the mean reached the ranks another "
                    "way. Reduce p.grad itself, from the hook.")


DIAGNOSES = (_finish_not_returned, _parameters_touched, _nothing_during_backward, _not_async,
             _not_the_mean, _gradients_not_carried)


def _verified(runs: Sequence[Run]) -> str:
    during = sorted({f["during"] for r in runs for o in r.outs for f in o["steps"]})
    calls = " or ".join(map(str, during))
    return (f"{common.sizes_text(runs)}, in each of {STEPS} steps, {calls} async all_reduce "
            f"calls started during backward and carried every gradient; finish() left the "
            f"mean gradient on every rank ({len(runs[0].out['expected'][0][0])} tensors), and "
            "the parameters untouched.")


@common.exercise("05_performance.ipynb", "average_overlapped(model)")
def check_average_overlapped(
    average_overlapped: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES, *,
    timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``average_overlapped(model) -> finish``: hooks that start every gradient's
    ``all_reduce`` asynchronously *during* backward, and a ``finish()`` that waits and divides.

    Called once on a model; then, for each step: ``loss.backward()`` (your hooks launch the
    calls), ``finish()`` (every rank holds the mean gradient), ``optimizer.step()``. Runs 2
    steps on 2, then 3 to 5 ranks (``world_size``: another number, or several) with the course's
    model and compares each step's gradients with the mean over ranks. Says so if no
    ``all_reduce`` starts during backward, if the hooks call it without ``async_op=True``
    (then each call blocks backward: no overlap), if the gradients are N× the mean or divided
    by a fixed number, if the second step goes wrong (handles kept from the first), which
    tensor differs, if the parameters changed, and whether the calls carried the gradients.

        >>> import gradsync_tutorial as gst
        >>> def average_overlapped(model):              # after backward: no overlap
        ...     def finish():
        ...         for p in model.parameters():
        ...             dist.all_reduce(p.grad)
        ...             p.grad /= dist.get_world_size()
        ...     return finish
        >>> gst.exercises.check_average_overlapped(average_overlapped)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: no all_reduce started during backward: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, average_overlapped, world_size, timeout, DIAGNOSES,
                           _verified)
