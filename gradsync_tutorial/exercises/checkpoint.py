"""Exercise of notebook 06 (``06_from_notebook_to_torchrun.ipynb``): ``save_checkpoint(path,
model, optimizer, epochs_done)`` writes a file that a resumed run continues from exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._wording import ranks
from ..detect import _swap_back, _swap_in
from ..model import Net
from .common import (
    CHECK_TIMEOUT,
    SEED,
    STUB,
    WORLD_SIZE,
    CollectiveCounter,
    calls_text,
    exercise,
    fail,
    max_abs_diff,
    name_of,
    params_of,
    run_on_ranks,
)

# What the check passes as epochs_done: not a number a checkpoint holds anyway (the world size,
# the 2 steps taken), nor the 3 it passed before. A file may record it as epochs done (7) or as
# the epoch to start from (8): both resume right.
_EPOCHS_DONE = 7
_RESUME_TOLERANCE = 1e-6  # resumed vs straight run, with more than 2 ranks (see below)
_SAVE_DELAY = 0.5  # seconds rank 0's torch.save waits, so that a missing barrier shows


def _ddp_net() -> tuple[nn.Module, torch.optim.Optimizer]:
    """What every rank of the script builds: the seeded Net in DDP, SGD with momentum."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(SEED)
    model = DDP(Net())
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)


def _train_steps(model, optimizer, rank: int, steps: range) -> None:
    """Steps on random images of this rank's; dropout on, so they draw random numbers."""
    model.train()
    for step in steps:
        g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
        images = torch.randn(8, 1, 28, 28, generator=g)
        labels = torch.randint(0, 10, (8,), generator=g)
        optimizer.zero_grad()
        F.nll_loss(model(images), labels).backward()
        optimizer.step()


class _CountingSave:
    """Count this rank's torch.save calls to a file; rank 0's write waits ``_SAVE_DELAY`` s."""

    def __init__(self, fn: Any, rank: int):
        self.fn, self.rank, self.calls = fn, rank, 0
        self._undo: list = []

    def __enter__(self) -> _CountingSave:
        import io
        import time

        import torch.serialization

        original = torch.save

        def save(*args, **kwargs):
            f = args[1] if len(args) > 1 else kwargs.get("f")
            if not isinstance(f, io.BytesIO):  # a file, not a buffer (all_gather_object's)
                self.calls += 1
                if self.rank == 0:
                    time.sleep(_SAVE_DELAY)
            return original(*args, **kwargs)

        self._undo = _swap_in({id(original): save}, [vars(torch), vars(torch.serialization)],
                              [self.fn])
        return self

    def __exit__(self, *exc) -> None:
        _swap_back(self._undo)
        self._undo = []


def _walk(obj: Any, depth: int = 0):
    """Every value inside nested dicts, lists and tuples (and the object itself)."""
    yield obj
    if depth >= 4 or (isinstance(obj, dict) and "param_groups" in obj):
        return  # not into an optimizer's state dict: its "params" lists are numbers too
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _walk(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk(value, depth + 1)


def _checkpoint_worker(rank: int, world_size: int, fn: Callable, path: str) -> Any:
    import os

    import torch.distributed as dist

    model, optimizer = _ddp_net()
    _train_steps(model, optimizer, rank, range(2))
    rng = torch.get_rng_state()
    keys = set(model.module.state_dict())
    with CollectiveCounter(fn) as counter, _CountingSave(fn, rank) as saves:
        try:
            fn(path, model, optimizer, _EPOCHS_DONE)
        except NotImplementedError:
            return STUB
    out: dict[str, Any] = {"saves": saves.calls, "exists": os.path.exists(path),
                           "counts": dict(counter.calls)}
    dist.barrier()  # the check's own: from here on, the file is complete whatever fn did
    _train_steps(model, optimizer, rank, range(2, 4))  # the straight run goes on
    straight = params_of(model.module)

    if not os.path.exists(path):
        return {**out, "missing": True}
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- reported to the learner
        return {**out, "load_error": f"{type(e).__name__}: {str(e).splitlines()[0]:.200}"}
    found: dict[str, Any] = {}
    for value in _walk(saved):
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            if set(value) == keys:
                found.setdefault("model", value)
            elif set(value) == {f"module.{k}" for k in keys}:
                found.setdefault("model", {k.removeprefix("module."): v for k, v in value.items()})
                out["prefixed"] = True
            if {"state", "param_groups"} <= set(value):
                found.setdefault("optimizer", value)
        elif isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            if value.shape == rng.shape and torch.equal(value, rng):
                found["rng"] = value
        elif (isinstance(value, int) and not isinstance(value, bool)
              and value in (_EPOCHS_DONE, _EPOCHS_DONE + 1)):
            found["epochs"] = value
    out["found"] = sorted(found)
    out["momentum"] = "optimizer" in found and any(
        "momentum_buffer" in s for s in found["optimizer"].get("state", {}).values()
        if isinstance(s, dict))

    # A restart: seed, build, load what the checkpoint has, go on with the same steps.
    model, optimizer = _ddp_net()
    if "model" in found:
        model.module.load_state_dict(found["model"])
    if "optimizer" in found:
        try:
            optimizer.load_state_dict(found["optimizer"])
        except Exception as e:  # noqa: BLE001 -- reported to the learner
            out["optimizer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]:.200}"
    if "rng" in found:
        torch.set_rng_state(found["rng"])
    _train_steps(model, optimizer, rank, range(2, 4))
    resumed = params_of(model.module)
    out["diff"] = max(max_abs_diff(resumed[k], straight[k]) for k in straight)
    return out


@exercise("06_from_notebook_to_torchrun.ipynb",
          "save_checkpoint(path, model, optimizer, epochs_done)")
def check_save_checkpoint(
    save_checkpoint: Callable, world_size: int = WORLD_SIZE, *, timeout: float = CHECK_TIMEOUT
) -> str:
    """Check ``save_checkpoint(path, model, optimizer, epochs_done)``: a run resumed from your
    file is exactly the run that never stopped.

    Runs it on ``world_size`` ranks (3 by default), as ``scripts/train_ddp.py`` would:
    ``model`` is the DDP wrapper (the Net is ``model.module``), in training mode (dropout draws
    random numbers), ``optimizer`` SGD with momentum, after 2 steps. Then the straight run takes
    2 more steps, and a restarted one (seed, build, load what your file holds, by what it is,
    whatever the keys) takes the same 2 steps; their parameters must be equal to the bit
    (within 1e-6 with more than 2 ranks, whose gradients gloo may add in another order). Says
    what the file lacks: the model's state dict (without DDP's "module." prefix), the
    optimizer's (momentum), the RNG state (dropout), ``epochs_done`` (or the epoch to start
    from, ``epochs_done + 1``); and whether every rank wrote the file, or a rank went on before
    it was complete (no barrier). It loads the file with ``torch.load(path, weights_only=True)``.

        >>> import gradsync_tutorial as gst
        >>> def save_checkpoint(path, model, optimizer, epochs_done):   # no optimizer, no RNG
        ...     if dist.get_rank() == 0:
        ...         torch.save({"model": model.module.state_dict(), "epochs_done": epochs_done},
        ...                    path)
        ...     dist.barrier()
        >>> gst.exercises.check_save_checkpoint(save_checkpoint)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: your checkpoint has no optimizer state: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    import tempfile

    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    with tempfile.TemporaryDirectory(prefix="gradsync-check-") as folder:
        path = f"{folder}/checkpoint.pt"
        worker = functools.partial(_checkpoint_worker, path=path)
        outs = run_on_ranks(worker, save_checkpoint, world_size, timeout)
    out = outs[0]
    counts = out["counts"]
    if out.get("missing"):
        fail(f"no file at `path` after {name_of(save_checkpoint)} (collectives called: "
             f"{calls_text(counts)}): write the checkpoint there, torch.save(checkpoint, "
             "path), on rank 0.")
    if "load_error" in out:
        fail(
            "torch.load(path, weights_only=True) cannot read your file: "
            f"{out['load_error']}. Save state dicts, tensors and numbers (model.module."
            "state_dict(), optimizer.state_dict(), torch.get_rng_state(), epochs_done), not the "
            "model or optimizer objects: loading objects runs arbitrary code, so torch refuses."
        )
    found = out["found"]
    diff = out["diff"]
    after = (f"2 steps after a resume from your file end up to {diff:.2g} away from the "
             "straight run's parameters")
    if "model" not in found:
        fail("your checkpoint has no model state dict (a dict with the Net's parameter names): "
             "save model.module.state_dict() (model is the DDP wrapper).")
    if "optimizer" not in found or not out["momentum"]:
        fail(
            "your checkpoint has no optimizer state: SGD's momentum buffers carry the past steps "
            f"into the next ones, and a resumed run starts them from zero ({after}). Save "
            "optimizer.state_dict()."
        )
    if "optimizer_error" in out:
        fail(f"optimizer.load_state_dict cannot load your optimizer state: "
             f"{out['optimizer_error']}. Save optimizer.state_dict() as it is.")
    if "rng" not in found:
        fail(
            "your checkpoint has no RNG state (nothing in it equals torch.get_rng_state() at the "
            "time of saving): dropout draws random numbers, so a resumed run that re-seeds draws "
            f"other masks than the straight run ({after}). Save torch.get_rng_state() (and on "
            "GPUs torch.cuda.get_rng_state())."
        )
    if "epochs" not in found:
        fail(f"your checkpoint does not record epochs_done (the check passed "
             f"{_EPOCHS_DONE}; the epoch to start from, {_EPOCHS_DONE + 1}, would do too): "
             "without it, a resumed run does not know which epoch comes next, "
             "and the data order is a function of seed + epoch.")
    savers = [rank for rank, o in enumerate(outs) if o["saves"]]
    if len(savers) > 1:
        fail(
            f"ranks {', '.join(map(str, savers))} all wrote the file: every rank holds the same "
            "state, so one copy is enough, and several processes writing one file can leave it "
            "corrupt. Save on rank 0 only (if dist.get_rank() == 0:)."
        )
    early = [rank for rank, o in enumerate(outs) if not o["exists"]]
    if early:
        fail(
            f"{ranks(early)} returned from {name_of(save_checkpoint)} before "
            "the file existed: a rank that goes on (or exits, or is restarted) while rank 0 is "
            "still writing can find no checkpoint, or half of one. After rank 0's torch.save, "
            "call dist.barrier() on every rank."
        )
    if out.get("prefixed"):
        fail(
            "your model state dict's names start with 'module.': that is the DDP wrapper's. "
            "Save model.module.state_dict(), the Net's own, so that the checkpoint loads into a "
            "plain Net (for evaluation, or in a script without DDP)."
        )
    # With 2 ranks a resumed run is the straight run to the bit. With more, gloo may add the
    # ranks' gradients in another order from one all-reduce to the next (float sums round
    # apart): about 1e-8. A missing piece of state moves them far more (measured on 3 ranks:
    # 4e-3 without the momentum, 1e-2 without the RNG state).
    tolerance = 0.0 if world_size == 2 else _RESUME_TOLERANCE
    if diff > tolerance:
        fail(f"{after}; they should be equal. Save the model's, optimizer's and RNG's state "
             "as they are when save_checkpoint is called.")
    equal = ("to the bit" if diff == 0.0 else
             f"within {diff:.1g} (the order in which gloo adds {world_size} ranks' gradients)")
    return (
        f"your file holds the model, the optimizer (momentum), the RNG state and epochs_done; "
        f"rank 0 wrote it and every rank waited for it. 2 steps after a resume equal the "
        f"straight run's {equal}, on {world_size} ranks (collectives called: "
        f"{calls_text(counts)})."
    )
