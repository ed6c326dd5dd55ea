"""Exercise of notebook 01 (``01_single_device_baseline.ipynb``): ``accumulate_gradients(model,
images, labels, micro_batches)`` leaves the whole batch's gradient, one micro-batch at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import common, evidence
from .common import Run

#: The numbers of micro-batches a check asks for by default: 3 (of 8 images each), then 5 (of
#: 4): neither the number of pieces nor their size is the notebook's 4, nor the same twice.
MICRO_BATCHES = (3, 5)
_BATCH = {3: 24, 5: 20}  # the batch for each default; another number k gets 8 * k images


def _batch(k: int) -> int:
    return _BATCH.get(k, 8 * k)


def _run(fn: Callable, k: int, timeout: float) -> dict[str, Any]:
    """Call ``fn`` on a fresh batch split into ``k`` pieces, for at most ``timeout`` seconds;
    what it did, and the reference."""
    with torch.random.fork_rng(devices=[]):  # leave the notebook's random state alone
        model, images, labels = evidence.model_and_data(0, _batch(k), seed=evidence.SEED + k)
        expected, loss = evidence.reference_gradient(model, images, labels)
        pieces = list(zip(images.chunk(k), labels.chunk(k), strict=True))
        facts = {"expected": expected, "loss": loss, "params": evidence.params_of(model),
                 "last": evidence.reference_gradient(model, *pieces[-1]),
                 "piece_losses": [evidence.reference_gradient(model, x, y)[1] for x, y in pieces],
                 "seen": [], "inputs": (images.clone(), labels.clone())}
        hook = model.register_forward_pre_hook(
            lambda module, args: facts["seen"].append(len(args[0]) if args else 0))
        try:
            facts["returned"] = _attempt(fn, (model, images, labels, k), timeout)
        finally:
            hook.remove()
    facts["changed"] = (evidence.changed_text(facts["params"], evidence.params_of(model),
                                            "changed the parameters:")
                        or ("changed the images or labels it was given" if not all(
                            torch.equal(a, b) for a, b in zip(facts["inputs"], (images, labels),
                                                              strict=True)) else None))
    facts.update(got=evidence.grads_of(model), training=model.training)
    return facts


def _attempt(fn: Callable, args: tuple, timeout: float) -> Any:
    """``fn(*args)`` in this process, with a time limit; a torch.distributed call in it fails
    with why there is no process group here, not torch's bare "not initialized"."""
    __tracebackhide__ = True
    name, k = common.name_of(fn), args[-1]
    with common.time_limit(timeout, (
            f"{name} did not return within {timeout:g} s (with micro_batches={k}): does a loop "
            "never end? Loop over the pieces, `for x, y in zip(images.chunk(micro_batches), "
            "labels.chunk(micro_batches))`. If it is only slow, pass a larger timeout=.")):
        try:
            return common.attempt(fn, *args)
        except ValueError as e:
            if "process group has not been initialized" not in str(e):
                raise
    common.fail(f"{name} called torch.distributed, but this check runs it in the notebook's "
                "own process, on one model, with no ranks and no process group. Accumulating "
                "gradients needs no collective: backward() on each micro-batch adds into .grad. "
                "Remove the dist.* call (notebook 02 averages across ranks).")


# --- the diagnoses, most telling mistake first ----------------------------------------------


def _forward_passes(run: Run) -> str | None:
    seen, k, batch = run.out["seen"], run.size, _batch(run.size)
    piece = batch // k
    if not seen:
        return f"{run.name} never called the model: run model(x) on each micro-batch."
    if len(seen) != k and len(seen) > 1:
        sizes = ", ".join(map(str, seen[:8])) + (", ..." if len(seen) > 8 else "")
        return (f"your model ran {len(seen)} forward passes (of {sizes} samples); with "
                f"micro_batches={k}, run one per micro-batch: {k} of {piece}. Split by the "
                "micro_batches you are given (images.chunk(micro_batches)), not a fixed number.")
    if max(seen) > piece:
        return (f"your model saw {max(seen)} samples in one forward pass: split the batch of "
                f"{batch} into {k} micro-batches of {piece} (images.chunk(micro_batches)) and "
                "run one piece at a time; that is what keeps the memory small.")


def _touched(run: Run) -> str | None:
    if run.out["training"]:
        return (f"{run.name} switched the model to train mode: leave the mode to the caller (the "
                "check runs it in eval mode, so that dropout does not make the result random).")
    if run.out["changed"]:
        return (f"{run.name} {run.out['changed']}: leave them alone; the caller steps the "
                "optimizer after it, with the gradients you accumulated.")


def _gradient_missing_or_zero(run: Run) -> str | None:
    got = run.out["got"]
    missing = [n for n, g in got.items() if g is None]
    if missing:
        return (f"`{missing[0]}` has no gradient after {run.name}: call backward() on each "
                "micro-batch's loss.")
    if evidence.flatten(got).abs().max() == 0:
        return (f"your gradients are all zero after {run.name}: call backward() on each "
                "micro-batch's loss, and do not zero the gradients after it.")


def _not_the_whole_batch(run: Run) -> str | None:
    got, expected, k = run.out["got"], run.out["expected"], run.size
    no_division = (f"did you divide each micro-batch's loss by micro_batches? backward() adds "
                   f"into .grad, so {k} backward calls add up {k} gradients; the batch's mean "
                   f"loss is their sum / {k}.")
    mismatch = evidence.mean_mismatch(got, expected, k, "the gradient of the whole batch's mean "
                                    "loss", no_division, divisor="micro_batches")
    c, last = evidence.scale(got, expected), evidence.scale(got, run.out["last"][0])
    if last is not None and (c is None or abs(c - k) >= 1e-3):  # not the no-division case
        return (f"your gradient is the last micro-batch's only (times {last:.3g}): the earlier "
                "pieces' gradients were thrown away. Did you call zero_grad() (or set .grad = "
                "None) inside the loop? Zero once, before all the pieces (the caller does it), "
                "and let backward() add them up.")
    if mismatch:
        return mismatch
    differing = evidence.differing_tensors(got, expected)
    if differing:
        return (f"your gradient differs from the whole batch's in "
                f"{evidence.where_text(differing, len(got))}: are the micro-batches equal pieces "
                "covering the whole batch once?")


def _not_the_mean_loss(run: Run) -> str | None:
    loss, expected, k = run.out["returned"], run.out["loss"], run.size
    if loss is None:
        return f"{run.name} returned None: return the whole batch's mean loss, as a float."
    if isinstance(loss, torch.Tensor):
        return (f"{run.name} returned a tensor, {loss!r:.60}: return a float (`loss.item()`), "
                "so that the loss you keep for logging does not hold on to the computation "
                "graph.")
    if not evidence.is_number(loss):
        return f"{run.name} returned {type(loss).__name__} {loss!r:.60}: return the mean loss."
    if abs(float(loss) - expected) <= 1e-5 * max(1.0, abs(expected)):
        return None
    last = run.out["last"][1]
    hints = [  # what a mistake returns, and what it is
        (sum(run.out["piece_losses"]), f" It is the sum of the {k} micro-batch losses: divide "
         "by micro_batches (or add up the scaled losses)."),
        (last, " It is the last micro-batch's: add up every piece's (scaled) loss."),
        (last / k, " It is the last micro-batch's: add up every piece's (scaled) loss.")]
    hint = next((h for value, h in hints if abs(float(loss) - value) < 1e-4), "")
    return (f"{run.name} returned the loss {float(loss):.6g}; the whole batch's mean loss is "
            f"{expected:.6g}.{hint}")


DIAGNOSES = (_forward_passes, _touched, _gradient_missing_or_zero, _not_the_whole_batch,
             _not_the_mean_loss)


def _verified(runs: Sequence[Run]) -> str:
    said = []
    for run in runs:
        worst = max(evidence.max_abs_diff(run.out["got"][n], g)
                    for n, g in run.out["expected"].items())
        said.append(f"{run.size} micro-batches of {_batch(run.size) // run.size} give the "
                    f"gradient of the whole batch of {_batch(run.size)} (max abs difference "
                    f"{worst:.1e}) and its mean loss {run.out['loss']:.4f}")
    return "; ".join(said) + "; the parameters and the batch are untouched."


@common.exercise("01_single_device_baseline.ipynb",
                 "accumulate_gradients(model, images, labels, micro_batches)")
def check_accumulate_gradients(
    accumulate_gradients: Callable, micro_batches: int | Sequence[int] = MICRO_BATCHES, *,
    timeout: float = common.CHECK_TIMEOUT,
) -> str:
    """Check ``accumulate_gradients(model, images, labels, micro_batches)``.

    It must leave in ``.grad`` the gradient of the *whole* batch's mean loss
    (``F.nll_loss``), computed one micro-batch at a time (``micro_batches`` equal pieces, one
    ``backward()`` each), and return that mean loss as a float. The caller zeroes the
    gradients before and steps the optimizer after. Runs in this process (one process, no
    ranks) on the course's model, dropout off: a batch of 24 random images in 3 micro-batches,
    then one of 20 in 5 (``micro_batches``: another number k, or several, on 8 * k images);
    compares with one ``backward()`` on the whole batch. Says so if the gradients are
    ``micro_batches``× too large (no division) or divided by a fixed number, hold only the last
    micro-batch's (a ``zero_grad`` inside the loop), if the model saw the whole batch at once,
    or another number of micro-batches than asked, and if the parameters, the batch or the
    model's mode changed. Stops a run that takes longer than ``timeout`` seconds, and says why
    a torch.distributed call cannot work here.

        >>> import gradsync_tutorial as gst
        >>> def accumulate_gradients(model, images, labels, micro_batches):
        ...     total = 0.0
        ...     for x, y in zip(images.chunk(micro_batches), labels.chunk(micro_batches)):
        ...         loss = F.nll_loss(model(x), y) / micro_batches
        ...         loss.backward()                  # adds this piece's share into .grad
        ...         total += loss.item()
        ...     return total
        >>> gst.exercises.check_accumulate_gradients(accumulate_gradients)  # doctest: +SKIP
        ✓ correct: ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    name = common.name_of(accumulate_gradients)
    runs: list[Run] = []
    for k in common.sizes(micro_batches, "micro_batches", 2):
        run = Run(name, k, [_run(accumulate_gradients, k, timeout)],
                  f"with micro_batches={k} (a batch of {_batch(k)})")
        common.diagnose(run, DIAGNOSES, runs)
        runs.append(run)
    return _verified(runs)
