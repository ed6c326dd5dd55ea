"""Exercise of notebook 05 (``05_performance.ipynb``): ``average_overlapped(model) -> finish``
starts every gradient's all_reduce from a hook during backward; ``finish()`` waits and divides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

from ._common import (
    _STUB,
    CHECK_TIMEOUT,
    CollectiveCounter,
    _all_ranks,
    _differing,
    _fail,
    _grads,
    _launch,
    _mean_over_ranks,
    _model_and_data,
    _name,
    _not_attempted,
    _passed,
    _reference_gradient,
    _require_function,
    _scale,
    _times,
    _where,
)


def _is_async(args: tuple, kwargs: dict) -> bool:
    """Whether an all_reduce call was made with async_op=True (keyword or 4th argument)."""
    return bool(kwargs.get("async_op", args[3] if len(args) > 3 else False))


def _overlap_worker(rank: int, world_size: int, fn: Callable) -> Any:
    model, images, labels = _model_and_data(rank, batch=16)
    batches = list(zip(images.chunk(2), labels.chunk(2), strict=True))  # 2 steps
    expected = []
    for x, y in batches:  # every rank's gradients at each step, to compute the means
        grads, _ = _reference_gradient(model, x, y)
        expected.append(_all_ranks(grads, world_size))
    steps = []
    with CollectiveCounter(fn) as counter:
        try:
            finish = fn(model)
        except NotImplementedError:
            return _STUB
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
                          "after": len(after), "got": _grads(model)})
    return {"setup": at_setup, "steps": steps, "expected": expected}


def check_average_overlapped(
    average_overlapped: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> None:
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
    Exercise of ``notebooks/05_performance.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(average_overlapped, 1, "average_overlapped(model)")
    outs = _launch(_overlap_worker, average_overlapped, world_size, timeout)
    if outs is None:
        return _not_attempted(average_overlapped, "average_overlapped")
    name = _name(average_overlapped)
    if "finish" in outs[0]:
        _fail(f"{name}(model) returned {outs[0]['finish']}: return the function that finishes a "
              "step (it waits for the calls and divides), e.g. `return finish` after "
              "`def finish(): ...`, without calling it.")
    n_params = len(outs[0]["expected"][0][0])
    for step, (out_steps) in enumerate(zip(*(o["steps"] for o in outs), strict=True), start=1):
        first = out_steps[0]
        if first["during"] == 0:
            where = (f"all {first['after']} in finish()" if first["after"] else
                     "none at all")
            _fail(
                f"no all_reduce started during backward in step {step} ({where}): nothing "
                "overlaps. Register a hook on every parameter, "
                "p.register_post_accumulate_grad_hook(hook): autograd calls hook(p) the moment "
                "p.grad is final, and the hook starts dist.all_reduce(p.grad, async_op=True)."
            )
        if first["async"] < first["during"]:
            _fail(
                f"{first['during'] - first['async']} of the {first['during']} all_reduce calls "
                f"made during backward in step {step} had no async_op=True: such a call "
                "returns only when it is done, so backward waits for it and nothing overlaps. "
                "Pass async_op=True, keep the handle it returns, and wait() on it in finish()."
            )
        everyone = outs[0]["expected"][step - 1]
        expected = _mean_over_ranks(everyone)
        for rank, out in enumerate(out_steps):
            got = out["got"]
            missing = [n for n, g in got.items() if g is None]
            if missing:
                _fail(f"on rank {rank}, `{missing[0]}` has no gradient after finish() in step "
                      f"{step}: average p.grad in place, do not remove it.")
            if not _differing(got, expected):
                continue
            if not _differing(got, everyone[rank]):
                _fail(f"in step {step}, rank {rank}'s gradients did not change: did finish() "
                      "wait on the handles? Reduce p.grad itself, in place, not a copy.")
            c = _scale(got, expected)
            if c is not None and abs(c - world_size) < 1e-3:
                _fail(f"in step {step}, your gradients are {_times(c)} the mean over ranks: "
                      "divide by the world size in finish(), after wait() (all_reduce sums).")
            if step > 1:
                off = (f"are {_times(c)} the mean over ranks" if c is not None else
                       f"differ from the mean over ranks in "
                       f"{_where(_differing(got, expected), n_params)}")
                _fail(
                    f"step 1 is right, but in step {step} your gradients {off}: did finish() "
                    "handle step 1's handles again? Empty the list of handles after waiting, so "
                    "that each step waits on (and divides) its own calls only."
                )
            if c is not None:
                _fail(f"in step {step}, your gradients are {_times(c)} the mean over ranks: "
                      "divide the sum by the world size, once.")
            _fail(
                f"in step {step}, rank {rank}'s gradients differ from the mean over ranks in "
                f"{_where(_differing(got, expected), n_params)}: did finish() wait() on every "
                "handle before dividing? An async all_reduce is done only after wait()."
            )
    first = outs[0]["steps"][0]
    return _passed(
        f"in each of 2 steps, {first['during']} async all_reduce calls started during backward "
        f"and finish() left the mean gradient on all {world_size} ranks ({n_params} tensors)."
    )
