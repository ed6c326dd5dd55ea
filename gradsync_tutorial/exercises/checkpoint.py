"""Exercise of notebook 06 (``06_from_notebook_to_torchrun.ipynb``): ``save_checkpoint(path,
model, optimizer, epochs_done)`` writes a file that a resumed run continues from exactly.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._wording import ranks
from ..detect import _swap_back, _swap_in
from ..model import Net
from . import common, evidence
from .common import Run

_RESUME_TOLERANCE = 1e-6  # resumed vs straight run, with more than 2 ranks (see _not_resumed)
_SAVE_DELAY = 0.5  # seconds rank 0's torch.save waits, so that a missing barrier shows


def _epochs_done(world_size: int) -> int:
    """What the check passes as epochs_done: 7 on 2 ranks, 11 on 3, ...: never the world size
    nor the 2 steps taken, and another number at every size. A file may record it as epochs
    done or as the epoch to start from (one more): both resume right."""
    return 4 * world_size - 1


def _ddp_net() -> tuple[nn.Module, torch.optim.Optimizer]:
    """What every rank of the script builds: the seeded Net in DDP, SGD with momentum."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(evidence.SEED)
    model = DDP(Net())
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)


def _train_steps(model, optimizer, rank: int, steps: range) -> None:
    """Steps on random images of this rank's; dropout on, so they draw random numbers."""
    model.train()
    for step in steps:
        g = torch.Generator().manual_seed(evidence.SEED + 1000 * rank + step)
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


def _walk(obj: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(where, value) for every value inside nested dicts, lists and tuples (and the object
    itself, where ""): ``"['rng'][0]"``."""
    yield path, obj
    if depth >= 4 or (isinstance(obj, dict) and "param_groups" in obj):
        return  # not into an optimizer's state dict: its "params" lists are numbers too
    items = obj.items() if isinstance(obj, dict) else (
        enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    for key, value in items:
        yield from _walk(value, f"{path}[{key!r}]", depth + 1)


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    """The model's parameters, the optimizer's momentum and the RNG: what a save must leave."""
    momentum = {f"momentum of {n}": optimizer.state[p]["momentum_buffer"].clone()
                for n, p in model.module.named_parameters() if "momentum_buffer"
                in optimizer.state[p]}
    return {**evidence.params_of(model.module), **momentum, "the RNG state": torch.get_rng_state()}


def _pieces(saved: Any, keys: set, rng: torch.Tensor, epochs: int) -> dict[str, tuple]:
    """What the file holds, found by what it is: {"model": (where, value), ...}."""
    found: dict[str, tuple] = {}
    for where, value in _walk(saved):
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            if set(value) == keys:
                found.setdefault("model", (where, value))
            elif set(value) == {f"module.{k}" for k in keys}:
                found.setdefault("prefixed model", (where, value))
            if {"state", "param_groups"} <= set(value):
                found.setdefault("optimizer", (where, value))
        elif isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            if value.shape == rng.shape and torch.equal(value, rng):
                found["rng"] = (where, value)
        elif isinstance(value, int) and not isinstance(value, bool) and value in (
                epochs, epochs + 1):
            found["epochs"] = (where, value)
    return found


def _load_error(e: Exception) -> str:
    """What torch.load refused, in a line: the object it met ("it holds a
    torch.optim.sgd.SGD"), not torch's advice to load with weights_only=False."""
    refused = re.search(r"Unsupported (?:global: GLOBAL|class) ([\w.]+)", str(e))
    if refused:
        return f"it holds a {refused.group(1)} object"
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0]:.200}" if str(e).strip() else (
        type(e).__name__)


def _resume(found: dict, rank: int, out: dict) -> dict[str, torch.Tensor]:
    """A restart: seed, build, load what the file holds, go on with the same 2 steps."""
    model, optimizer = _ddp_net()
    if "model" in found or "prefixed model" in found:
        state = found.get("model", found.get("prefixed model"))[1]
        model.module.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    if "optimizer" in found:
        try:
            optimizer.load_state_dict(found["optimizer"][1])
        except Exception as e:  # noqa: BLE001 -- reported to the learner
            out["optimizer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]:.200}"
    if "rng" in found:
        torch.set_rng_state(found["rng"][1])
    _train_steps(model, optimizer, rank, range(2, 4))
    return evidence.params_of(model.module)


def _worker(rank: int, world_size: int, fn: Callable, folder: str) -> Any:
    import os

    import torch.distributed as dist

    path, epochs = f"{folder}/checkpoint-{world_size}.pt", _epochs_done(world_size)
    model, optimizer = _ddp_net()
    _train_steps(model, optimizer, rank, range(2))
    before, rng = _state(model, optimizer), torch.get_rng_state()
    keys = set(model.module.state_dict())
    with evidence.Recorder(fn) as calls, _CountingSave(fn, rank) as saves:
        common.attempt(fn, path, model, optimizer, epochs)
    touched = (evidence.changed_text(before, _state(model, optimizer), "changed")
               or (None if model.training else "switched the model to eval mode"))
    out: dict[str, Any] = {"saves": saves.calls, "exists": os.path.exists(path),
                           "counts": dict(calls.calls), "epochs": epochs, "touched": touched}
    dist.barrier()  # the check's own: from here on, the file is complete whatever fn did
    _train_steps(model, optimizer, rank, range(2, 4))  # the straight run goes on
    straight = evidence.params_of(model.module)
    if not os.path.exists(path):
        return {**out, "missing": True}
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- reported to the learner
        return {**out, "load_error": _load_error(e)}
    found = _pieces(saved, keys, rng, epochs)
    out["found"] = {k: where for k, (where, _) in found.items()}
    out["momentum"] = "optimizer" in found and any(
        "momentum_buffer" in s for s in found["optimizer"][1].get("state", {}).values()
        if isinstance(s, dict))
    resumed = _resume(found, rank, out)
    out["diff"] = max(evidence.max_abs_diff(resumed[k], straight[k]) for k in straight)
    return out


# --- the diagnoses, most telling mistake first ----------------------------------------------


def _after(run: Run) -> str:
    return (f"2 steps after a resume from your file end up {run.out['diff']:.2g} away from the "
            "straight run's parameters")


def _unreadable(run: Run) -> str | None:
    out = run.out
    if out.get("missing"):
        return (f"no file at `path` after {run.name} (collectives called: "
                f"{evidence.calls_text(out['counts'])}): write the checkpoint there, "
                "torch.save(checkpoint, path), on rank 0.")
    if "load_error" in out:
        return ("torch.load(path, weights_only=True) cannot read your file: "
                f"{out['load_error']}. Save state dicts, tensors and numbers (model.module."
                "state_dict(), optimizer.state_dict(), torch.get_rng_state(), epochs_done), not "
                "the model or optimizer objects: loading objects runs arbitrary code, so torch "
                "refuses.")


def _no_model(run: Run) -> str | None:
    if not {"model", "prefixed model"} & set(run.out["found"]):
        return ("your checkpoint has no model state dict (a dict with the Net's parameter "
                "names): save model.module.state_dict() (model is the DDP wrapper).")


def _no_optimizer(run: Run) -> str | None:
    if "optimizer" not in run.out["found"] or not run.out["momentum"]:
        return ("your checkpoint has no optimizer state: SGD's momentum buffers carry the past "
                f"steps into the next ones, and a resumed run starts them from zero "
                f"({_after(run)}). Save optimizer.state_dict().")
    if "optimizer_error" in run.out:
        return (f"optimizer.load_state_dict cannot load your optimizer state: "
                f"{run.out['optimizer_error']}. Save optimizer.state_dict() as it is.")


def _no_rng(run: Run) -> str | None:
    if "rng" not in run.out["found"]:
        return ("your checkpoint has no RNG state (nothing in it equals torch.get_rng_state() "
                "at the time of saving): dropout draws random numbers, so a resumed run that "
                f"re-seeds draws other masks than the straight run ({_after(run)}). Save "
                "torch.get_rng_state() (and on GPUs torch.cuda.get_rng_state()).")


def _no_epochs(run: Run) -> str | None:
    if "epochs" not in run.out["found"]:
        epochs = run.out["epochs"]
        return (f"your checkpoint does not record epochs_done (the check passed {epochs}; the "
                f"epoch to start from, {epochs + 1}, would do too): without it, a resumed run "
                "does not know which epoch comes next, and the data order is a function of "
                "seed + epoch.")


def _not_rank_0_alone(run: Run) -> str | None:
    savers = [rank for rank, o in enumerate(run.outs) if o["saves"]]
    if len(savers) > 1:
        return (f"{ranks(savers)} all wrote the file: every rank holds the same state, so one "
                "copy is enough, and several processes writing one file can leave it corrupt. "
                "Save on rank 0 only (if dist.get_rank() == 0:).")
    if savers != [0]:
        who = f"{ranks(savers)} wrote the file" if savers else "no rank called torch.save"
        return (f"{who}: rank 0 is the one that saves, with torch.save(checkpoint, path) (if "
                "dist.get_rank() == 0:), so that the file exists wherever rank 0 runs.")


def _no_barrier(run: Run) -> str | None:
    early = [rank for rank, o in enumerate(run.outs) if not o["exists"]]
    if early:
        return (f"{ranks(early)} returned from {run.name} before the file existed: a rank "
                "that goes on (or exits, or is restarted) while rank 0 is still writing can find "
                "no checkpoint, or half of one. After rank 0's torch.save, call dist.barrier() "
                "on every rank.")


def _prefixed(run: Run) -> str | None:
    if "model" not in run.out["found"]:
        return ("your model state dict's names start with 'module.': that is the DDP wrapper's. "
                "Save model.module.state_dict(), the Net's own, so that the checkpoint loads "
                "into a plain Net (for evaluation, or in a script without DDP).")


_touched = common.left_alone(
    "touched", "a save must leave the run as it was, so that the run that goes on is the one "
    "the file records.")


def _not_resumed(run: Run) -> str | None:
    # With 2 ranks a resumed run is the straight run to the bit. With more, gloo may add the
    # ranks' gradients in another order from one all-reduce to the next (float sums round
    # apart): about 1e-8. A missing piece of state moves them far more (measured on 3 ranks:
    # 4e-3 without the momentum, 1e-2 without the RNG state).
    tolerance = 0.0 if run.size == 2 else _RESUME_TOLERANCE
    if run.out["diff"] > tolerance:
        return (f"{_after(run)}; they should be equal. Save the model's, optimizer's and RNG's "
                "state as they are when save_checkpoint is called.")


DIAGNOSES = (_unreadable, _no_model, _no_optimizer, _no_rng, _no_epochs, _not_rank_0_alone,
             _no_barrier, _prefixed, _touched, _not_resumed)


def _verified(runs: Sequence[Run]) -> str:
    found, last = runs[-1].out["found"], runs[-1]
    equal = " and ".join(
        "to the bit" if r.out["diff"] == 0.0 else
        f"within {r.out['diff']:.1g} (the order in which gloo adds {r.size} ranks' gradients)"
        for r in runs)
    return (f"{common.sizes_text(runs)}, your file holds the model (at {found['model']}), the "
            f"optimizer with its momentum (at {found['optimizer']}), the RNG state (at "
            f"{found['rng']}) and the epoch count (at {found['epochs']}); rank 0 wrote it and "
            f"every rank waited for it; 2 steps after a resume equal the straight run's {equal}"
            f" (collectives called on {last.label}: {evidence.calls_text(last.out['counts'])}).")


@common.exercise("06_from_notebook_to_torchrun.ipynb",
                 "save_checkpoint(path, model, optimizer, epochs_done)")
def check_save_checkpoint(
    save_checkpoint: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES, *,
    timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``save_checkpoint(path, model, optimizer, epochs_done)``: a run resumed from your
    file is exactly the run that never stopped.

    Runs it on 2, then 3 to 5 ranks (``world_size``: another number, or several), as
    ``scripts/train_ddp.py`` would: ``model`` is the DDP wrapper (the Net is ``model.module``),
    in training mode (dropout draws random numbers), ``optimizer`` SGD with momentum, after 2
    steps. Then the straight run takes 2 more steps, and a restarted one (seed, build, load
    what your file holds, by what it is, whatever the keys) takes the same 2 steps; their
    parameters must be equal to the bit (within 1e-6 with more than 2 ranks, whose gradients
    gloo may add in another order). Says what the file lacks: the model's state dict (without
    DDP's "module." prefix), the optimizer's (momentum), the RNG state (dropout),
    ``epochs_done`` (or the epoch to start from, ``epochs_done + 1``); whether rank 0 alone
    wrote the file, whether a rank went on before it was complete (no barrier), and whether
    the save changed the model, the optimizer or the RNG. It loads the file with
    ``torch.load(path, weights_only=True)``.

        >>> import gradsync_tutorial as gst
        >>> def save_checkpoint(path, model, optimizer, epochs_done):   # no optimizer, no RNG
        ...     if dist.get_rank() == 0:
        ...         torch.save({"model": model.module.state_dict(), "epochs_done": epochs_done},
        ...                    path)
        ...     dist.barrier()
        >>> gst.exercises.check_save_checkpoint(save_checkpoint)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: your checkpoint has no optimizer state: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    import tempfile

    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    with tempfile.TemporaryDirectory(prefix="gradsync-check-") as folder:
        worker = functools.partial(_worker, folder=folder)
        return common.on_ranks(worker, save_checkpoint, world_size, timeout, DIAGNOSES,
                               _verified)
