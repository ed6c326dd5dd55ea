"""Exercise of notebook 15 (``15_verify_your_own_step.ipynb``): ``one_process_loss(model, batch)``
is the loss one process minimises on a whole batch of padded lines of text: the mean over every
valid token. ``verify_gradients`` is only as good as that loss.

The check runs, at two world sizes, a step of notebook 07's task under DDP with 2 micro-batches
per rank: once right (each rank's loss sum / the global count of valid tokens, × N), once with
the 2024 accumulation bug (each micro-batch's own mean / K). Both are checked by
``verify_gradients`` with the learner's loss. The learner's loss must pass the right step and fail
the bug; when it does not, the check passes on ``verify_gradients``'s own verdict, which names how
the learner's objective differs (a factor: a sum, padding counted; a weighting: a mean of line
means).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import tokens
from . import common, evidence
from .common import Run

LINES, MICRO_BATCHES = 2, 2  # lines per micro-batch, micro-batches per rank


def _model() -> nn.Module:
    torch.manual_seed(evidence.SEED)  # the same initial weights on every rank
    return nn.Sequential(nn.Embedding(tokens.VOCAB_SIZE, 6),
                         nn.Linear(6, tokens.VOCAB_SIZE)).double()


def _lines(world_size: int, seed: int) -> list[list[list[str]]]:
    """lines[rank][k]: the lines of each micro-batch, drawn by ``seed`` until no two micro-batches
    hold as many valid tokens (so that the bug's mean of means is always wrong)."""
    g = torch.Generator().manual_seed(seed)
    per_rank = LINES * MICRO_BATCHES
    while True:
        order = torch.randperm(len(tokens.LINES), generator=g).tolist()
        drawn = [[[tokens.LINES[i] for i in order[r * per_rank + k * LINES:][:LINES]]
                  for k in range(MICRO_BATCHES)] for r in range(world_size)]
        counts = [sum(len(line) - 1 for line in mb) for rank in drawn for mb in rank]
        if len(set(counts)) == len(counts):
            return drawn


def _micro_batches(rank: int, world_size: int, seed: int) -> list[tuple]:
    """This rank's micro-batches of padded lines."""
    return [tokens.pad(lines) for lines in _lines(world_size, seed)[rank]]


def _step(micro_batches: list[tuple], right: bool) -> nn.Module:
    """A DDP step: the global token count (right), or each micro-batch's own mean / K (the bug)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    count = sum((y != tokens.IGNORE_INDEX).sum() for _, y in micro_batches).double()
    dist.all_reduce(count)
    for k, (x, y) in enumerate(micro_batches):
        with model.no_sync() if k < len(micro_batches) - 1 else nullcontext():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
            if right:
                (loss / count * dist.get_world_size()).backward()
            else:
                (loss / (y != tokens.IGNORE_INDEX).sum() / len(micro_batches)).backward()
    return model


def _verdict(model: nn.Module, micro_batches: list[tuple], fn: Callable) -> dict:
    """verify_gradients's verdict on ``model``'s step with the learner's loss, or its refusal."""
    from ..verify import CannotVerify, padded, verify_gradients

    try:
        report = verify_gradients(model, None, fn, reference=model, micro_batches=micro_batches,
                                  concat=padded({0: tokens.PAD, 1: tokens.IGNORE_INDEX}))
    except CannotVerify as e:
        return {"ok": None, "verdict": str(e)}
    return {"ok": report.ok, "verdict": report.verdict}


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist

    seed = [evidence.fresh_seed()]
    dist.broadcast_object_list(seed, src=0)
    mine = _micro_batches(rank, world_size, seed[0])
    common.attempt(fn, _model(), mine[0])  # the stub says so; an error shows its line
    return {"right": _verdict(_step(mine, right=True), mine, fn),
            "bug": _verdict(_step(mine, right=False), mine, fn)}


# --------------------------------------------------------------------------------------------
# The diagnoses
# --------------------------------------------------------------------------------------------

_ONE_PROCESS = ("One process minimises the mean over every valid token of the whole batch: "
                "F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)")


def _refused(run: Run) -> str | None:
    for step in ("right", "bug"):
        if run.out[step]["ok"] is None:
            return f"verify_gradients could not use your loss: {run.out[step]['verdict']}"


def _right_step_fails(run: Run) -> str | None:
    if not run.out["right"]["ok"]:
        verdict = run.out["right"]["verdict"].rstrip(".")
        hint = ""
        if "weighted differently" in verdict or "not a factor" in verdict:
            hint = (" Yours weighs the tokens otherwise, for example a mean of the lines' means "
                    "(a short line's tokens weigh more).")
        elif "factor" in verdict:
            hint = (" Yours differs by a constant factor: a sum instead of a mean, or padding "
                    "counted as tokens?")
        return (f"with your loss, verify_gradients rejects the right step: {verdict}.{hint} "
                f"{_ONE_PROCESS}.")


#: A loss that passes the right step gives one process's gradient, so it cannot pass the bug
#: too: the two steps' gradients differ (no two micro-batches hold as many tokens, _lines).
DIAGNOSES = (_refused, _right_step_fails)


def _verified(runs: Sequence[Run]) -> str:
    named = runs[-1].out["bug"]["verdict"].split("[1] ", 1)[-1].split(" (notebook", 1)[0]
    return (f"{common.sizes_text(runs)}, verify_gradients with your loss passes the right step "
            f"and names the 2024 accumulation bug: {named} (notebook 07).")


@common.exercise("15_verify_your_own_step.ipynb", "one_process_loss(model, batch)")
def check_one_process_loss(one_process_loss: Callable,
                           world_size: int | Sequence[int] = common.WORLD_SIZES, *,
                           timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``one_process_loss(model, batch)``: the loss one process minimises on a whole batch
    ``(inputs, targets)`` of padded lines (targets padded with -100), as ``verify_gradients``
    needs it. With it, ``verify_gradients`` must pass a right DDP step with gradient
    accumulation (the global token count) and reject the 2024 accumulation bug, at two world
    sizes on fresh lines. Says so, with ``verify_gradients``'s own verdict, if your loss is a sum,
    counts padding, or takes a mean of the lines' means.

        >>> import gradsync_tutorial as gst
        >>> def one_process_loss(model, batch):    # a sum, not a mean: caught
        ...     x, y = batch
        ...     return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
        >>> gst.exercises.check_one_process_loss(one_process_loss)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: with your loss, verify_gradients rejects the right step: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, one_process_loss, world_size, timeout, DIAGNOSES, _verified)
