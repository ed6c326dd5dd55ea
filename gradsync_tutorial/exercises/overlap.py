"""Exercise of notebook 05 (``05_performance.ipynb``): ``average_overlapped(model) -> finish``
starts every gradient's all_reduce from a hook during backward; ``finish()`` waits and divides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

from .common import (
    CHECK_TIMEOUT,
    STUB,
    WORLD_SIZE,
    CollectiveCounter,
    all_ranks,
    differing_tensors,
    divisor_hint,
    exercise,
    fail,
    grads_of,
    mean_over_ranks,
    model_and_data,
    name_of,
    reference_gradient,
    run_on_ranks,
    scale,
    times_text,
    where_text,
)


def _is_async(args: tuple, kwargs: dict) -> bool:
    """Whether an all_reduce call was made with async_op=True (keyword or 4th argument)."""
    return bool(kwargs.get("async_op", args[3] if len(args) > 3 else False))


def _overlap_worker(rank: int, world_size: int, fn: Callable) -> Any:
    model, images, labels = model_and_data(rank, batch=16)
    batches = list(zip(images.chunk(2), labels.chunk(2), strict=True))  # 2 steps
    expected = []
    for x, y in batches:  # every rank's gradients at each step, to compute the means
        grads, _ = reference_gradient(model, x, y)
        expected.append(all_ranks(grads, world_size))
    steps = []
    with CollectiveCounter(fn) as counter:
        try:
            finish = fn(model)
        except NotImplementedError:
            return STUB
        at_setup = dict(counter.calls)
        if not callable(finish):
            return {"finish": f"{type(finish).__name__} {finish!r:.60}"}
        for x, y in batches:
            model.zero_grad()
            before = len(counter.arguments["all_reduce"])
            F.nll_loss(model(x), y).backward()
            during = counter.arguments["all_reduce"][before:]
            finish()
            after = counter.arguments["all_reduce"][before + len(during):]
            steps.append({"during": len(during), "async": sum(_is_async(*c) for c in during),
                          "after": len(after), "got": grads_of(model)})
    return {"setup": at_setup, "steps": steps, "expected": expected}


@exercise("05_performance.ipynb", "average_overlapped(model)")
def check_average_overlapped(
    average_overlapped: Callable, world_size: int = WORLD_SIZE, *, timeout: float = CHECK_TIMEOUT
) -> str:
    """Check ``average_overlapped(model) -> finish``: hooks that start every gradient's
    ``all_reduce`` asynchronously *during* backward, and a ``finish()`` that waits and divides.

    Called once on a model; then, for each step: ``loss.backward()`` (your hooks launch the
    calls), ``finish()`` (every rank holds the mean gradient), ``optimizer.step()``. Runs 2
    steps on ``world_size`` ranks with the course's model and compares each step's gradients
    with the mean over ranks. Says so if no ``all_reduce`` starts during backward, if the hooks
    call it without ``async_op=True`` (then each call blocks backward: no overlap), if the
    gradients are N× the mean, if the second step goes wrong (handles kept from the first), or
    which tensor differs.

        >>> import gradsync_tutorial as gst
        >>> def average_overlapped(model):              # after backward: no overlap
        ...     def finish():
        ...         for p in model.parameters():
        ...             dist.all_reduce(p.grad)
        ...             p.grad /= dist.get_world_size()
        ...     return finish
        >>> gst.exercises.check_average_overlapped(average_overlapped)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: no all_reduce started during backward: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    outs = run_on_ranks(_overlap_worker, average_overlapped, world_size, timeout)
    name = name_of(average_overlapped)
    if "finish" in outs[0]:
        fail(f"{name}(model) returned {outs[0]['finish']}: return the function that finishes a "
             "step (it waits for the calls and divides), e.g. `return finish` after "
             "`def finish(): ...`, without calling it.")
    n_params = len(outs[0]["expected"][0][0])
    for step, (out_steps) in enumerate(zip(*(o["steps"] for o in outs), strict=True), start=1):
        first = out_steps[0]
        if first["during"] == 0:
            where = (f"all {first['after']} in finish()" if first["after"] else
                     "none at all")
            fail(
                f"no all_reduce started during backward in step {step} ({where}): nothing "
                "overlaps. Register a hook on every parameter, "
                "p.register_post_accumulate_grad_hook(hook): autograd calls hook(p) the moment "
                "p.grad is final, and the hook starts dist.all_reduce(p.grad, async_op=True)."
            )
        if first["async"] < first["during"]:
            fail(
                f"{first['during'] - first['async']} of the {first['during']} all_reduce calls "
                f"made during backward in step {step} had no async_op=True: such a call "
                "returns only when it is done, so backward waits for it and nothing overlaps. "
                "Pass async_op=True, keep the handle it returns, and wait() on it in finish()."
            )
        everyone = outs[0]["expected"][step - 1]
        expected = mean_over_ranks(everyone)
        for rank, out in enumerate(out_steps):
            got = out["got"]
            missing = [n for n, g in got.items() if g is None]
            if missing:
                fail(f"on rank {rank}, `{missing[0]}` has no gradient after finish() in step "
                     f"{step}: average p.grad in place, do not remove it.")
            if not differing_tensors(got, expected):
                continue
            if not differing_tensors(got, everyone[rank]):
                fail(f"in step {step}, rank {rank}'s gradients did not change: did finish() "
                     "wait on the handles? Reduce p.grad itself, in place, not a copy.")
            c = scale(got, expected)
            if c is not None and abs(c - world_size) < 1e-3:
                fail(f"in step {step}, your gradients are {times_text(c)} the mean over ranks: "
                     "divide by the world size in finish(), after wait() (all_reduce sums).")
            if step > 1:
                off = (f"are {times_text(c)} the mean over ranks" if c is not None else
                       f"differ from the mean over ranks in "
                       f"{where_text(differing_tensors(got, expected), n_params)}")
                fail(
                    f"step 1 is right, but in step {step} your gradients {off}: did finish() "
                    "handle step 1's handles again? Empty the list of handles after waiting, so "
                    "that each step waits on (and divides) its own calls only."
                )
            if c is not None:
                fail(f"in step {step}, your gradients are {times_text(c)} the mean over ranks: "
                     "divide the sum by the world size, once."
                     f"{divisor_hint(c, world_size, 'world_size, dist.get_world_size()')}")
            fail(
                f"in step {step}, rank {rank}'s gradients differ from the mean over ranks in "
                f"{where_text(differing_tensors(got, expected), n_params)}: did finish() wait() "
                "on every handle before dividing? An async all_reduce is done only after wait()."
            )
    first = outs[0]["steps"][0]
    return (
        f"in each of 2 steps, {first['during']} async all_reduce calls started during backward "
        f"and finish() left the mean gradient on all {world_size} ranks ({n_params} tensors)."
    )
