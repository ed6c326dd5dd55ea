"""Exercises with self-checks: run your function against the reference, learn what is wrong.

Each notebook ends with an exercise: you write one function in a cell, then pass it to its
check. The check runs it the way the course runs code, on 2 ranks with ``gst.launch`` (gloo, on
the CPU, whatever the machine), on a small model and small random data, next to the reference
computation, so it takes a second or two:

    >>> import gradsync_tutorial as gst
    >>> def average_gradients_flat(model):
    ...     raise NotImplementedError  # the stub: the check says "not attempted yet"
    >>> gst.exercises.check_average_gradients_flat(average_gradients_flat)  # doctest: +SKIP
    ... not attempted yet: average_gradients_flat still raises NotImplementedError. ...
    False

Every ``check_<name>(fn)`` answers in one of three ways:

* **correct**: it prints ``✓ correct: ...`` (what was verified) and returns ``True``;
* **wrong**: it raises :class:`ExerciseFailed`, an ``AssertionError`` whose message says
  precisely what is wrong and what to try, e.g. "your gradients are 2.0× the expected ones: did
  you divide by the world size?", so the notebook cell fails loudly;
* **not attempted**: your function still raises ``NotImplementedError`` (the notebook's stub
  does): it prints ``... not attempted yet`` and returns ``False``, without failing. So a
  notebook runs top to bottom before you start the exercise (CI runs them that way).

To see how a check counts your collective calls ("you called all_reduce 8 times; one call is
enough"): while your function runs, the ``torch.distributed`` collectives are replaced by
counting wrappers, in ``torch.distributed`` and in your function's globals (so
``from torch.distributed import all_reduce`` is counted too).

The exercises (see :data:`EXERCISES`), with reference solutions in ``notebooks/solutions/``:

=====================================  ===============================================  ========
check                                  your function                                    notebook
=====================================  ===============================================  ========
:func:`check_gather_ranks`             ``gather_ranks(rank, world_size) -> list``       00
:func:`check_accumulate_gradients`     ``accumulate_gradients(model, images, labels,    01
                                       micro_batches) -> float``
:func:`check_average_gradients_flat`   ``average_gradients_flat(model)``                02
:func:`check_broadcast_parameters`     ``broadcast_parameters(model)``                  03
:func:`check_global_mean_loss`         ``global_mean_loss(losses) -> float``            04
:func:`check_average_overlapped`       ``average_overlapped(model) -> finish``          05
:func:`check_save_checkpoint`          ``save_checkpoint(path, model, optimizer,        06
                                       epochs_done)``
=====================================  ===============================================  ========

Introduced in ``notebooks/00_launching_workers.ipynb`` (its exercise).
"""

from __future__ import annotations

import copy
import inspect
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .launcher import HANG_HINT, LaunchTimeoutError, RankFailedError, launch
from .model import Net

__all__ = [
    "EXERCISES",
    "Exercise",
    "ExerciseFailed",
    "check_accumulate_gradients",
    "check_average_gradients_flat",
    "check_average_overlapped",
    "check_broadcast_parameters",
    "check_gather_ranks",
    "check_global_mean_loss",
    "check_save_checkpoint",
]

SEED = 1234
#: Seconds a check waits for your function on every rank (start-up included) before it calls
#: it a hang. Pass ``timeout=`` to a check to change it.
CHECK_TIMEOUT = 60.0
# What a worker returns when the learner's function raised NotImplementedError (the stub).
_STUB = "gradsync-exercise-not-attempted"
# Relative and absolute tolerance for "the same numbers" (sums in another order round apart).
RTOL, ATOL = 1e-4, 1e-7


class ExerciseFailed(AssertionError):
    """Your function ran, but did not do what the exercise asks; the message says how."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function you write, its check, its notebook, its solution file."""

    function: str  # the name of the function you write
    check: Callable[..., bool]
    notebook: str  # the notebook whose "## Exercise" section sets it
    solution: str  # the reference solution, in notebooks/solutions/


# --------------------------------------------------------------------------------------------
# Shared machinery
# --------------------------------------------------------------------------------------------


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _require_function(fn: Any, n_args: int, usage: str) -> None:
    """Fail with a clear message if ``fn`` is not a function that takes ``n_args`` arguments."""
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    if not callable(fn):
        raise ExerciseFailed(
            f"pass your function itself, as in {usage}; got {type(fn).__name__} "
            f"{fn!r:.80}. (Did you call it, check(f(...)), instead of check(f)?)"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(n_args))
    except TypeError:
        raise ExerciseFailed(
            f"{_name(fn)}{signature} cannot be called as {usage}: define it with exactly these "
            "arguments."
        ) from None


def _passed(message: str) -> bool:
    print(f"✓ correct: {message}")
    return True


def _not_attempted(fn: Any, exercise: str) -> bool:
    solution = EXERCISES[exercise].solution
    print(
        f"... not attempted yet: {_name(fn)} still raises NotImplementedError. Write it in its "
        "cell (replace the `raise NotImplementedError` line), run that cell, then run this "
        f"check again. Stuck? The reference solution: notebooks/solutions/{solution} "
        f"(in Jupyter: `%load solutions/{solution}`)."
    )
    return False


def _fail(message: str):
    __tracebackhide__ = True
    raise ExerciseFailed(message)


def _launch(worker: Callable, fn: Any, world_size: int, timeout: float) -> list | None:
    """Run ``worker(rank, world_size, fn)`` on ``world_size`` gloo ranks.

    Returns the per-rank results, or None if ``fn`` raised NotImplementedError (the stub).
    An error in ``fn`` or a hang becomes an :class:`ExerciseFailed` that says so.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 (a check needs several ranks), got "
                         f"{world_size!r}.")

    def run(rank: int, world_size: int) -> Any:
        # A closure over fn, rather than args=(fn,), so that the launcher finds fn's source and
        # shows the learner's own line in a traceback.
        return worker(rank, world_size, fn)

    try:
        results = launch(run, world_size, backend="gloo", timeout=timeout)
    except RankFailedError as e:
        raise ExerciseFailed(
            f"{_name(fn)} raised an error on rank {e.rank}; fix the line the traceback below "
            f"points to, then run the check again.\n\n{e}"
        ) from None
    except LaunchTimeoutError as e:
        stuck = ", ".join(map(str, e.unfinished))
        raise ExerciseFailed(
            f"{_name(fn)} did not finish within {timeout:g} s: rank(s) {stuck} were still "
            f"waiting, so it hangs. {HANG_HINT}"
        ) from None
    if any(isinstance(r, str) and r == _STUB for r in results):
        return None
    return results


# The torch.distributed calls a check counts.
_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_to_all", "all_to_all_single", "broadcast_object_list",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
)


class _CollectiveCounter:
    """Count the collectives ``fn`` calls, by swapping in counting wrappers while it runs.

    The wrappers go into ``torch.distributed``, its ``distributed_c10d`` module (so a collective
    that calls another one internally is counted once, as the outer call), and ``fn``'s
    globals, where ``from torch.distributed import all_reduce`` put its own reference. Used in
    the ranks, around the learner's call only::

        with _CollectiveCounter(fn) as counter:
            fn(model)
        counter.counts["all_reduce"]      # how many times fn called it
    """

    def __init__(self, fn: Any):
        self.fn = fn
        self.counts: Counter = Counter()
        self.calls: dict[str, list] = defaultdict(list)  # name -> [(args, kwargs), ...]
        self._depth = 0
        self._undo: list = []

    def _wrap(self, name: str, original: Callable) -> Callable:
        def counted(*args, **kwargs):
            self._depth += 1
            try:
                if self._depth == 1:  # an outer call, not one made inside another collective
                    self.counts[name] += 1
                    self.calls[name].append((args, kwargs))
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> _CollectiveCounter:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        originals = {}
        for name in _COLLECTIVES:
            original = getattr(distributed_c10d, name, None)
            if original is not None:
                originals[id(original)] = self._wrap(name, original)
        namespaces = [vars(dist), vars(distributed_c10d)]
        fn_globals = getattr(self.fn, "__globals__", None)
        if isinstance(fn_globals, dict):
            namespaces.append(fn_globals)
        for namespace in namespaces:
            for key, value in list(namespace.items()):
                wrapper = originals.get(id(value))
                if wrapper is not None:
                    self._undo.append((namespace, key, value))
                    namespace[key] = wrapper
        return self

    def __exit__(self, *exc) -> None:
        for namespace, key, value in reversed(self._undo):
            namespace[key] = value
        self._undo = []


def _calls_text(counts: dict) -> str:
    """"all_reduce 8 times, broadcast once" (or "none")."""
    parts = []
    for name, n in counts.items():
        parts.append(f"{name} {'once' if n == 1 else f'{n} times'}")
    return ", ".join(parts) or "none"


def _flatten(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors.values()])


def _unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pieces = flat.split([t.numel() for t in like.values()])
    return {name: p.view_as(t).clone() for (name, t), p in zip(like.items(), pieces, strict=True)}


def _all_ranks(tensors: dict[str, torch.Tensor], world_size: int) -> list[dict]:
    """Every rank's copy of ``tensors`` (an all_gather), on every rank."""
    import torch.distributed as dist

    flat = _flatten(tensors)
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return [_unflatten(f, tensors) for f in everyone]


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=RTOL, atol=ATOL)


def _differing(got: dict, expected: dict) -> list[tuple[str, float]]:
    """(name, max abs difference) of each tensor of ``got`` not close to ``expected``'s."""
    return [(name, _max_abs_diff(got[name], expected[name]))
            for name in expected if not _close(got[name], expected[name])]


def _scale(got: dict, expected: dict) -> float | None:
    """``c`` if ``got`` is ``c * expected``, tensor by tensor, with one ``c``; else None."""
    g, e = _flatten(got).double(), _flatten(expected).double()
    if e.dot(e) == 0:
        return None
    c = (g.dot(e) / e.dot(e)).item()
    return c if torch.allclose(g, c * e, rtol=RTOL, atol=ATOL) else None


def _times(c: float) -> str:
    return f"{c:.1f}×" if abs(c) >= 1 else f"{c:.2g}×"


def _where(differing: list[tuple[str, float]], total: int) -> str:
    """"`fc2.weight` (max abs difference 0.03; 3 of 8 tensors differ)"."""
    name, diff = differing[0]
    return f"`{name}` (max abs difference {diff:.3g}; {len(differing)} of {total} tensors differ)"


def _model_and_data(rank: int, batch: int = 8) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The course's model (the same weights on every rank, dropout off) and a rank's own batch
    of random images, so every rank has different gradients."""
    torch.manual_seed(SEED)
    model = Net().eval()  # eval: dropout off, so every forward pass is deterministic
    g = torch.Generator().manual_seed(SEED + 1 + rank)
    images = torch.randn(batch, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return model, images, labels


# --------------------------------------------------------------------------------------------
# 00: gather_ranks(rank, world_size) -> [0, 1, ..., world_size - 1], with all_gather
# --------------------------------------------------------------------------------------------


def _gather_ranks_worker(rank: int, world_size: int, fn: Callable) -> Any:
    with _CollectiveCounter(fn) as counter:
        try:
            result = fn(rank, world_size)
        except NotImplementedError:
            return _STUB
    # [torch.zeros(1)] * world_size repeats ONE tensor: all_gather then writes every rank's
    # value into it, and the last write wins.
    aliased = False
    for args, kwargs in counter.calls.get("all_gather", []):
        out = kwargs.get("tensor_list", args[0] if args else None)
        if isinstance(out, (list, tuple)) and len({id(t) for t in out}) < len(out):
            aliased = True
    return {"result": result, "counts": dict(counter.counts), "aliased": aliased}


def _is_number(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    return type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0  # np.float32(1.0)


def check_gather_ranks(
    gather_ranks: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> bool:
    """Check ``gather_ranks(rank, world_size)``: every rank returns ``[0, 1, ..., N - 1]``,
    learned from the other ranks with ``dist.all_gather``.

    Runs it on ``world_size`` ranks. Says so if it made no collective call (a list computed
    locally proves nothing), if ``all_gather`` wrote into one tensor repeated N times
    (``[t] * N``), if it returned tensors instead of numbers, or which rank returned what.

        >>> import gradsync_tutorial as gst
        >>> def gather_ranks(rank, world_size):
        ...     return list(range(world_size))         # no communication: caught
        >>> gst.exercises.check_gather_ranks(gather_ranks)   # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: gather_ranks made no collective call: ...

    Returns True (correct) or False (not attempted: it raises NotImplementedError); raises
    :class:`ExerciseFailed` otherwise. Exercise of ``notebooks/00_launching_workers.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(gather_ranks, 2, "gather_ranks(rank, world_size)")
    outs = _launch(_gather_ranks_worker, gather_ranks, world_size, timeout)
    if outs is None:
        return _not_attempted(gather_ranks, "gather_ranks")
    name = _name(gather_ranks)
    expected = list(range(world_size))
    results = [o["result"] for o in outs]
    if all(not o["counts"] for o in outs):
        _fail(
            f"{name} made no collective call, so no rank learned anything from the others (rank "
            f"0 returned {results[0]!r}). Each rank knows only its own number: put it in a "
            "tensor, and call dist.all_gather(tensor_list, tensor) to receive every rank's."
        )
    if any(o["aliased"] for o in outs):
        _fail(
            f"the list you passed to all_gather holds the same tensor {world_size} times (rank 0 "
            f"returned {results[0]!r}): `[t] * {world_size}` repeats one tensor object, so "
            "every rank's value is written into it and the last one wins. Create one tensor per "
            "rank: `[torch.zeros(1) for _ in range(world_size)]`."
        )
    for rank, result in enumerate(results):
        if isinstance(result, torch.Tensor):
            _fail(
                f"rank {rank} returned a tensor, {result!r}: return a list of numbers, e.g. "
                "`t.tolist()` or `[int(t.item()) for t in tensors]`."
            )
        if not isinstance(result, (list, tuple)):
            _fail(f"rank {rank} returned {type(result).__name__} {result!r:.80}: return a list.")
        if any(isinstance(x, torch.Tensor) for x in result):
            _fail(
                f"rank {rank} returned a list of tensors, {result!r:.120}: turn each into a "
                "number, `[int(t.item()) for t in tensors]`."
            )
        if not all(_is_number(x) for x in result):
            _fail(f"rank {rank} returned {result!r:.120}: return a list of numbers.")
        if list(result) != expected:
            hint = ""
            if len(result) != world_size:
                hint = f" It has {len(result)} entries: one per rank is {world_size}."
            elif len(set(result)) == 1:
                hint = " Every entry is the same: is every rank sending its own rank?"
            _fail(f"rank {rank} returned {list(result)!r}; expected {expected!r}.{hint}")
    calls = _calls_text(outs[0]["counts"])
    return _passed(f"every one of the {world_size} ranks returned {expected} (collectives "
                   f"called on rank 0: {calls}).")


# --------------------------------------------------------------------------------------------
# 01: accumulate_gradients(model, images, labels, micro_batches) -> mean loss (one process)
# --------------------------------------------------------------------------------------------


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def _reference_gradient(model: nn.Module, images, labels) -> tuple[dict, float]:
    """The gradient of the mean loss over ``images`` and that loss, on a copy of ``model``."""
    copy_ = copy.deepcopy(model)
    copy_.zero_grad(set_to_none=True)
    loss = F.nll_loss(copy_(images), labels)
    loss.backward()
    return _grads(copy_), loss.item()


def check_accumulate_gradients(accumulate_gradients: Callable, micro_batches: int = 4) -> bool:
    """Check ``accumulate_gradients(model, images, labels, micro_batches)``.

    It must leave in ``.grad`` the gradient of the *whole* batch's mean loss
    (``F.nll_loss``), computed one micro-batch at a time (``micro_batches`` equal pieces, one
    ``backward()`` each), and return that mean loss as a float. The caller zeroes the
    gradients before and steps the optimizer after. Runs in this process (one process, no
    ranks) on the course's model, dropout off, and a batch of ``8 * micro_batches`` random
    images; compares with one ``backward()`` on the whole batch. Says so if the gradients are
    ``micro_batches``× too large (no division), hold only the last micro-batch's (a
    ``zero_grad`` inside the loop), or if the model saw the whole batch at once.

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
        True

    Returns True (correct) or False (not attempted); raises :class:`ExerciseFailed` otherwise.
    Exercise of ``notebooks/01_single_device_baseline.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    usage = "accumulate_gradients(model, images, labels, micro_batches)"
    _require_function(accumulate_gradients, 4, usage)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 2:
        raise ValueError(f"micro_batches must be an int >= 2, got {micro_batches!r}.")
    name = _name(accumulate_gradients)
    batch = 8 * micro_batches
    with torch.random.fork_rng(devices=[]):  # leave the notebook's random state alone
        model, images, labels = _model_and_data(0, batch)
        expected, expected_loss = _reference_gradient(model, images, labels)
        pieces = list(zip(images.chunk(micro_batches), labels.chunk(micro_batches), strict=True))
        last_grad, last_loss = _reference_gradient(model, *pieces[-1])
        piece_losses = [_reference_gradient(model, x, y)[1] for x, y in pieces]
        seen: list[int] = []
        hook = model.register_forward_pre_hook(
            lambda module, args: seen.append(len(args[0]) if args else 0)
        )
        try:
            loss = accumulate_gradients(model, images.clone(), labels.clone(), micro_batches)
        except NotImplementedError:
            return _not_attempted(accumulate_gradients, "accumulate_gradients")
        finally:
            hook.remove()
    got = _grads(model)
    piece = batch // micro_batches

    if not seen:
        _fail(f"{name} never called the model: run model(x) on each micro-batch.")
    if max(seen) > piece:
        _fail(
            f"your model saw {max(seen)} samples in one forward pass: split the batch of "
            f"{batch} into {micro_batches} micro-batches of {piece} (images.chunk(micro_batches)) "
            "and run one piece at a time; that is what keeps the memory small."
        )
    if model.training:
        _fail(f"{name} switched the model to train mode: leave the mode to the caller (the "
              "check runs it in eval mode, so that dropout does not make the result random).")
    missing = [n for n, g in got.items() if g is None]
    if missing:
        _fail(f"`{missing[0]}` has no gradient after {name}: call backward() on each "
              "micro-batch's loss.")
    if _flatten(got).abs().max() == 0:
        _fail(f"your gradients are all zero after {name}: call backward() on each micro-batch's "
              "loss, and do not zero the gradients after it.")
    c = _scale(got, expected)
    if c is not None and abs(c - micro_batches) < 1e-3:
        _fail(
            f"your gradients are {_times(c)} the expected ones: did you divide each micro-batch's "
            f"loss by micro_batches? backward() adds into .grad, so {micro_batches} backward "
            f"calls add up {micro_batches} gradients; the batch's mean loss is their sum / "
            f"{micro_batches}."
        )
    if c is None or abs(c - 1) > 1e-3:
        last = _scale(got, last_grad)
        if last is not None:
            _fail(
                f"your gradient is the last micro-batch's only (times {last:.3g}): the earlier "
                "pieces' gradients were thrown away. Did you call zero_grad() (or set .grad = "
                "None) inside the loop? Zero once, before all the pieces (the caller does it), "
                "and let backward() add them up."
            )
    if c is not None and abs(c - 1) > 1e-3:
        _fail(f"your gradients are {_times(c)} the expected ones (the gradient of the whole "
              "batch's mean loss): how do you scale each micro-batch's loss?")
    differing = _differing(got, expected)
    if differing:
        _fail(f"your gradient differs from the whole batch's in {_where(differing, len(got))}: "
              "are the micro-batches equal pieces covering the whole batch once?")

    if loss is None:
        _fail(f"{name} returned None: return the whole batch's mean loss, as a float (for "
              "logging).")
    if isinstance(loss, torch.Tensor):
        _fail(f"{name} returned a tensor, {loss!r:.60}: return a float (`loss.item()`), so that "
              "the loss you keep for logging does not hold on to the computation graph.")
    if not _is_number(loss):
        _fail(f"{name} returned {type(loss).__name__} {loss!r:.60}: return the mean loss, a "
              "float.")
    loss = float(loss)
    if abs(loss - expected_loss) > 1e-5 * max(1.0, abs(expected_loss)):
        if abs(loss - sum(piece_losses)) < 1e-4:
            hint = (f" It is the sum of the {micro_batches} micro-batch losses: divide by "
                    "micro_batches (or add up the scaled losses).")
        elif abs(loss - last_loss) < 1e-5 or abs(loss - last_loss / micro_batches) < 1e-5:
            hint = " It is the last micro-batch's: add up every piece's (scaled) loss."
        else:
            hint = ""
        _fail(f"{name} returned the loss {loss:.6g}; the whole batch's mean loss is "
              f"{expected_loss:.6g}.{hint}")
    worst = max(_max_abs_diff(got[n], expected[n]) for n in expected)
    return _passed(
        f"{micro_batches} micro-batches of {piece} give the gradient of the whole batch of "
        f"{batch} (max abs difference {worst:.1e}) and its mean loss {expected_loss:.4f}."
    )


# --------------------------------------------------------------------------------------------
# 02: average_gradients_flat(model): the mean gradient with ONE all_reduce
# --------------------------------------------------------------------------------------------


def _average_flat_worker(rank: int, world_size: int, fn: Callable) -> Any:
    model, images, labels = _model_and_data(rank)
    F.nll_loss(model(images), labels).backward()  # this rank's own gradients
    everyone = _all_ranks(_grads(model), world_size)  # every rank's, to compute the mean
    with _CollectiveCounter(fn) as counter:
        try:
            fn(model)
        except NotImplementedError:
            return _STUB
    return {"got": _grads(model), "everyone": everyone, "counts": dict(counter.counts)}


def check_average_gradients_flat(
    average_gradients_flat: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> bool:
    """Check ``average_gradients_flat(model)``: every rank ends with the mean of the ranks'
    gradients in ``.grad``, after **one** ``all_reduce``.

    Runs it on ``world_size`` ranks, each with the course's model (the same weights) and its own
    gradients. Says so if the gradients did not change (the reduced buffer was never copied
    back), if they are N× the mean (no division), if ranks differ (naming the tensor), and how
    many ``all_reduce`` calls were made.

        >>> import gradsync_tutorial as gst
        >>> def average_gradients_flat(model):     # notebook 02's loop: 8 calls
        ...     for p in model.parameters():
        ...         dist.all_reduce(p.grad)
        ...         p.grad /= dist.get_world_size()
        >>> gst.exercises.check_average_gradients_flat(average_gradients_flat)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: the gradients are right, but you called all_reduce 8 times; ...

    Returns True (correct) or False (not attempted); raises :class:`ExerciseFailed` otherwise.
    Exercise of ``notebooks/02_manual_allreduce_averaging.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(average_gradients_flat, 1, "average_gradients_flat(model)")
    outs = _launch(_average_flat_worker, average_gradients_flat, world_size, timeout)
    if outs is None:
        return _not_attempted(average_gradients_flat, "average_gradients_flat")
    name = _name(average_gradients_flat)
    everyone = outs[0]["everyone"]
    expected = {n: torch.stack([e[n] for e in everyone]).mean(0) for n in everyone[0]}
    total = len(expected)
    counts = outs[0]["counts"]
    reduces = counts.get("all_reduce", 0)

    for rank, out in enumerate(outs):
        missing = [n for n, g in out["got"].items() if g is None]
        if missing:
            _fail(f"on rank {rank}, `{missing[0]}` has no gradient after {name}: write the "
                  "averaged values into each p.grad (p.grad.copy_(...)), do not remove them.")
    if all(not _differing(out["got"], everyone[rank]) for rank, out in enumerate(outs)):
        if reduces:
            _fail(
                "the gradients did not change: every rank still holds its own. You reduced a "
                "copy: torch.cat copies the gradients into a new tensor, so after all_reduce "
                "and the division, copy each piece back into its p.grad "
                "(p.grad.copy_(piece.view_as(p.grad)))."
            )
        _fail(f"the gradients did not change: every rank still holds its own (collectives "
              f"called: {_calls_text(counts)}). Reduce them with one dist.all_reduce.")
    for rank, out in enumerate(outs[1:], start=1):
        differing = _differing(out["got"], outs[0]["got"])
        if differing:
            _fail(
                f"rank {rank}'s gradients differ from rank 0's in {_where(differing, total)}: "
                "after averaging, every rank must hold the same mean gradient."
            )
    got = outs[0]["got"]
    if _flatten(got).abs().max() == 0:
        _fail(f"your gradients are all zero after {name}: write the averaged values into each "
              "p.grad, do not zero them.")
    c = _scale(got, expected)
    if c is not None and abs(c - world_size) < 1e-3:
        _fail(f"your gradients are {_times(c)} the expected ones: did you divide by the world "
              "size? all_reduce(SUM) gives every rank the sum; the mean is sum / world_size.")
    if c is not None and abs(c - 1) > 1e-3:
        _fail(f"your gradients are {_times(c)} the expected ones (the mean over ranks): divide "
              "the sum by the world size, once.")
    differing = _differing(got, expected)
    if differing:
        _fail(
            f"your gradients differ from the mean over ranks in {_where(differing, total)}: "
            "do you copy the pieces back in the order you concatenated them, each with its own "
            "shape (piece.view_as(p.grad))?"
        )
    if reduces != 1:
        if reduces:
            _fail(f"the gradients are right, but you called all_reduce {reduces} times; one "
                  "call is enough: flatten all gradients into one tensor (torch.cat), reduce it "
                  "once, then copy the pieces back.")
        _fail(f"the gradients are right, but you did not use all_reduce (collectives called: "
              f"{_calls_text(counts)}): the exercise is one all_reduce on a flat tensor.")
    numbers = sum(t.numel() for t in expected.values())
    return _passed(f"one all_reduce for all {total} gradients ({numbers:,} numbers); every one "
                   f"of the {world_size} ranks holds the mean gradient.")


# --------------------------------------------------------------------------------------------
# 03: broadcast_parameters(model): every rank gets rank 0's weights
# --------------------------------------------------------------------------------------------


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _broadcast_worker(rank: int, world_size: int, fn: Callable) -> Any:
    torch.manual_seed(SEED + rank)  # a different seed per rank: different initial weights
    model = Net()
    ids = [id(p) for p in model.parameters()]
    everyone = _all_ranks(_params(model), world_size)  # every rank's weights, before
    with _CollectiveCounter(fn) as counter:
        try:
            fn(model)
        except NotImplementedError:
            return _STUB
    not_trainable = [n for n, p in model.named_parameters()
                     if not (isinstance(p, nn.Parameter) and p.requires_grad)]
    replaced = [id(p) for p in model.parameters()] != ids
    return {"after": _params(model), "everyone": everyone, "counts": dict(counter.counts),
            "not_trainable": not_trainable, "replaced": replaced}


def check_broadcast_parameters(
    broadcast_parameters: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> bool:
    """Check ``broadcast_parameters(model)``: afterwards every rank holds rank 0's parameters.

    Runs it on ``world_size`` ranks whose models start from *different* seeds. Says which
    tensor differs between ranks, whether you broadcast into a copy, whether the ranks agree on
    the *average* (an all_reduce) instead of rank 0's weights, and whether the parameters are
    still trainable.

        >>> import gradsync_tutorial as gst
        >>> def broadcast_parameters(model):
        ...     for p in model.parameters():
        ...         dist.broadcast(p.detach(), src=0)   # in place: p itself changes
        >>> gst.exercises.check_broadcast_parameters(broadcast_parameters)  # doctest: +SKIP
        ✓ correct: ...
        True

    Returns True (correct) or False (not attempted); raises :class:`ExerciseFailed` otherwise.
    Exercise of ``notebooks/03_distributed_data_parallel.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(broadcast_parameters, 1, "broadcast_parameters(model)")
    outs = _launch(_broadcast_worker, broadcast_parameters, world_size, timeout)
    if outs is None:
        return _not_attempted(broadcast_parameters, "broadcast_parameters")
    name = _name(broadcast_parameters)
    before = outs[0]["everyone"]
    total = len(before[0])
    counts = outs[0]["counts"]
    mean = {n: torch.stack([b[n] for b in before]).mean(0) for n in before[0]}

    for rank, out in enumerate(outs):
        if out["not_trainable"]:
            _fail(f"on rank {rank}, `{out['not_trainable'][0]}` is no longer a trainable "
                  f"parameter after {name}: copy the values into the existing parameters "
                  "(dist.broadcast(p.detach(), src=0) works in place) instead of replacing them.")
    if all(not _differing(out["after"], mean) for out in outs):
        _fail(
            "the replicas agree, but on the average of the ranks' weights, not on rank 0's: "
            "all_reduce and divide averages; use dist.broadcast(tensor, src=0), which copies "
            "rank 0's tensor into every rank's."
        )
    changed0 = _differing(outs[0]["after"], before[0])
    for src in range(1, world_size):
        if changed0 and all(not _differing(out["after"], before[src]) for out in outs):
            _fail(f"every rank holds rank {src}'s weights: broadcast from rank 0, src=0 (the "
                  "rank that sends), on every rank.")
    if changed0:
        _fail(f"rank 0's own parameters changed, in {_where(changed0, total)}: rank 0 is the "
              "source (src=0), its weights must stay as they were.")
    for rank, out in enumerate(outs[1:], start=1):
        differing = _differing(out["after"], outs[0]["after"])
        if not differing:
            continue
        untouched = not _differing(out["after"], before[rank])
        if untouched and counts:
            _fail(
                f"rank {rank}'s parameters did not change, although you called "
                f"{_calls_text(counts)}: you broadcast into a copy (p.clone(), "
                "p.detach().clone(), torch.tensor(p), p.tolist()...). broadcast writes into "
                "the tensor you pass: pass the parameter itself, p.detach() or p.data."
            )
        if untouched:
            _fail(f"rank {rank}'s parameters did not change: {name} made no collective call. "
                  "Call dist.broadcast(p.detach(), src=0) for every parameter.")
        _fail(
            f"rank {rank}'s parameters differ from rank 0's in {_where(differing, total)}: did "
            "you broadcast every parameter? model.parameters() gives all of them, biases too."
        )
    if outs[0]["replaced"] or any(o["replaced"] for o in outs):
        print(f"note: {name} replaced the model's parameter objects; an optimizer built "
              "before it would still hold the old ones. Copy into them instead.")
    spread = max(_max_abs_diff(b[n], before[0][n]) for b in before[1:] for n in before[0])
    return _passed(
        f"the {world_size} ranks started from different weights (max difference "
        f"{spread:.2g}); after {name} every rank holds rank 0's, all {total} tensors exactly "
        f"(collectives called: {_calls_text(counts)})."
    )


# --------------------------------------------------------------------------------------------
# 04: global_mean_loss(losses) -> the mean over every rank's samples, the same on every rank
# --------------------------------------------------------------------------------------------


def _uneven_losses(rank: int) -> torch.Tensor:
    """Rank ``rank``'s per-sample losses: 8 samples on even ranks, 3 on odd ones (plus one per
    pair of ranks), values around ``rank + 1``, so that every way of averaging them differs."""
    count = (8, 3)[rank % 2] + rank // 2
    g = torch.Generator().manual_seed(SEED + 1 + rank)
    weight = torch.ones((), requires_grad=True)  # losses come out of a graph, as in training
    return (rank + 1) * (0.5 + torch.rand(count, generator=g)) * weight


def _mean_loss_worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist

    losses = _uneven_losses(rank)
    before = losses.detach().clone()
    mine = torch.tensor([before.double().sum().item(), float(len(before))], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)  # every rank's (sum, count), for the diagnosis
    with _CollectiveCounter(fn) as counter:
        try:
            result = fn(losses)
        except NotImplementedError:
            return _STUB
    if isinstance(result, torch.Tensor):
        result = {"tensor": repr(result.detach().cpu())}
    elif not (_is_number(result) or result is None):
        result = {"other": f"{type(result).__name__} {result!r:.60}"}
    elif result is not None:
        result = float(result)
    changed = not torch.equal(losses.detach(), before)
    return {"result": result, "sums_counts": [e.tolist() for e in everyone],
            "counts": dict(counter.counts), "changed": changed}


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def check_global_mean_loss(
    global_mean_loss: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> bool:
    """Check ``global_mean_loss(losses) -> float``: the mean loss over *every* rank's samples,
    the same float on every rank, when the ranks hold different numbers of samples.

    ``losses`` is this rank's per-sample losses (``F.nll_loss(..., reduction="none")``): 8 on
    rank 0, 3 on rank 1. Runs it on ``world_size`` ranks and compares with the mean of all the
    samples. Says so if you returned the mean of the ranks' means (pitfall 5), a sum you did not
    divide, a rank's own value (no collective), the global sum over a rank's own count, if ranks
    returned different values, or if one rank skipped the all_reduce (it hangs).

        >>> import gradsync_tutorial as gst
        >>> def global_mean_loss(losses):          # the mean of the means: caught
        ...     mean = losses.detach().mean()
        ...     dist.all_reduce(mean)
        ...     return (mean / dist.get_world_size()).item()
        >>> gst.exercises.check_global_mean_loss(global_mean_loss)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: every rank returned 1.36..., the mean of the ranks' means; ...

    Returns True (correct) or False (not attempted); raises :class:`ExerciseFailed` otherwise.
    Exercise of ``notebooks/04_pitfalls.ipynb``.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(global_mean_loss, 1, "global_mean_loss(losses)")
    outs = _launch(_mean_loss_worker, global_mean_loss, world_size, timeout)
    if outs is None:
        return _not_attempted(global_mean_loss, "global_mean_loss")
    name = _name(global_mean_loss)
    sums, counts = zip(*outs[0]["sums_counts"], strict=True)
    total, n = sum(sums), sum(counts)
    expected = total / n
    means = [s / c for s, c in zip(sums, counts, strict=True)]
    mean_of_means = sum(means) / world_size
    calls = outs[0]["counts"]
    sizes = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts))

    for rank, out in enumerate(outs):
        result = out["result"]
        if result is None:
            _fail(f"{name} returned None on rank {rank}: return the mean loss, a float.")
        if isinstance(result, dict) and "tensor" in result:
            _fail(f"rank {rank} returned a tensor, {result['tensor']:.60}: return a float "
                  "(`.item()`), the number you log.")
        if isinstance(result, dict):
            _fail(f"rank {rank} returned {result['other']}: return the mean loss, a float.")
        if out["changed"]:
            _fail(f"on rank {rank}, {name} changed the `losses` tensor it was given: in "
                  "training it is also what backward() uses. Reduce a copy (losses.detach()."
                  "sum() is a new tensor).")
    results = [out["result"] for out in outs]
    if not all(_same(r, results[0]) for r in results):
        got = ", ".join(f"rank {r}: {x:.6g}" for r, x in enumerate(results))
        if all(_same(r, m) for r, m in zip(results, means, strict=True)):
            _fail(f"every rank returned its own mean ({got}; collectives called: "
                  f"{_calls_text(calls)}): the ranks must exchange their sums and counts with "
                  "dist.all_reduce, and every rank gets the same global mean.")
        if all(_same(r, total / c) for r, c in zip(results, counts, strict=True)):
            _fail(f"the ranks returned different values ({got}): each divided the global sum "
                  "of the losses by its own count. all_reduce the count too (one call: "
                  "torch.stack([loss_sum, count])) and divide by the total count.")
        _fail(f"the ranks returned different values ({got}): every rank must make the same "
              "all_reduce calls and divide the same totals, so that all log the same number.")
    got = results[0]
    if not _same(got, expected):
        if _same(got, mean_of_means):
            hint = (f"the mean of the ranks' means ({' and '.join(f'{m:.4g}' for m in means)}). "
                    f"The ranks hold different numbers of samples ({sizes}), so the mean of "
                    "means weighs a sample on a small rank more (pitfall 5). all_reduce the sum "
                    "of the losses and the number of samples, then divide once.")
        elif _same(got, world_size * mean_of_means):
            hint = ("the sum of the ranks' means: all_reduce(SUM) adds them up, and even "
                    "divided by the world size the mean of means is wrong when the ranks hold "
                    f"different numbers of samples ({sizes}). all_reduce the sum of the losses "
                    "and the number of samples, then divide once.")
        elif _same(got, total):
            hint = (f"the sum of all {int(n)} losses: divide by the total number of samples "
                    "(all_reduce the count too).")
        elif _same(got, total / world_size):
            hint = (f"the sum of all losses divided by the world size; divide by the number of "
                    f"samples, {int(n)} in all ({sizes}): all_reduce the count too.")
        elif any(_same(got, m) for m in means):
            hint = "one rank's own mean: reduce over every rank."
        else:
            hint = f"not any of the usual mistakes (ranks' samples: {sizes})."
        _fail(f"every rank returned {got:.6g}; the mean over all {int(n)} samples is "
              f"{expected:.6g}. Yours is {hint}")
    reduces = calls.get("all_reduce", 0)
    if reduces > 1:
        print(f"note: you called all_reduce {reduces} times; one call on "
              "torch.stack([loss_sum, count]) sends both numbers at once.")
    return _passed(
        f"with {sizes} samples, every one of the {world_size} ranks returned {got:.6g}, the mean "
        f"over all {int(n)} samples (the mean of the ranks' means would be {mean_of_means:.6g}; "
        f"collectives called: {_calls_text(calls)})."
    )


# --------------------------------------------------------------------------------------------
# 05: average_overlapped(model) -> finish: all_reduces started from hooks, during backward
# --------------------------------------------------------------------------------------------


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
    with _CollectiveCounter(fn) as counter:
        try:
            finish = fn(model)
        except NotImplementedError:
            return _STUB
        at_setup = dict(counter.counts)
        if not callable(finish):
            return {"finish": f"{type(finish).__name__} {finish!r:.60}"}
        for x, y in batches:
            model.zero_grad()
            before = len(counter.calls["all_reduce"])
            F.nll_loss(model(x), y).backward()
            during = counter.calls["all_reduce"][before:]
            finish()
            after = counter.calls["all_reduce"][before + len(during):]
            steps.append({"during": len(during), "async": sum(_is_async(*c) for c in during),
                          "after": len(after), "got": _grads(model)})
    return {"setup": at_setup, "steps": steps, "expected": expected}


def check_average_overlapped(
    average_overlapped: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> bool:
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

    Returns True (correct) or False (not attempted); raises :class:`ExerciseFailed` otherwise.
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
        expected = {n: torch.stack([e[n] for e in everyone]).mean(0) for n in everyone[0]}
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


# --------------------------------------------------------------------------------------------
# 06: save_checkpoint(path, model, optimizer, epochs_done): a resumed run = the straight run
# --------------------------------------------------------------------------------------------

_EPOCHS_DONE = 3  # what the check passes as epochs_done
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
    """Count this rank's torch.save calls; rank 0's write waits ``_SAVE_DELAY`` s first."""

    def __init__(self, fn: Any, rank: int):
        self.fn, self.rank, self.calls = fn, rank, 0
        self._undo: list = []

    def __enter__(self) -> _CountingSave:
        import time

        import torch.serialization

        original = torch.save

        def save(*args, **kwargs):
            self.calls += 1
            if self.rank == 0:
                time.sleep(_SAVE_DELAY)
            return original(*args, **kwargs)

        namespaces = [vars(torch), vars(torch.serialization)]
        fn_globals = getattr(self.fn, "__globals__", None)
        if isinstance(fn_globals, dict):
            namespaces.append(fn_globals)
        for namespace in namespaces:
            for key, value in list(namespace.items()):
                if value is original:
                    self._undo.append((namespace, key, value))
                    namespace[key] = save
        return self

    def __exit__(self, *exc) -> None:
        for namespace, key, value in reversed(self._undo):
            namespace[key] = value
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
    with _CollectiveCounter(fn) as counter, _CountingSave(fn, rank) as saves:
        try:
            fn(path, model, optimizer, _EPOCHS_DONE)
        except NotImplementedError:
            return _STUB
    out: dict[str, Any] = {"saves": saves.calls, "exists": os.path.exists(path),
                           "counts": dict(counter.counts)}
    dist.barrier()  # the check's own: from here on, the file is complete whatever fn did
    _train_steps(model, optimizer, rank, range(2, 4))  # the straight run goes on
    straight = _params(model.module)

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
        elif isinstance(value, int) and not isinstance(value, bool) and value == _EPOCHS_DONE:
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
    resumed = _params(model.module)
    out["diff"] = max(_max_abs_diff(resumed[k], straight[k]) for k in straight)
    return out


def check_save_checkpoint(
    save_checkpoint: Callable, world_size: int = 2, *, timeout: float = CHECK_TIMEOUT
) -> bool:
    """Check ``save_checkpoint(path, model, optimizer, epochs_done)``: a run resumed from your
    file is exactly the run that never stopped.

    Runs it on ``world_size`` ranks, as ``scripts/train_ddp.py`` would: ``model`` is the Net in
    DDP, in training mode (dropout draws random numbers), ``optimizer`` SGD with momentum, after
    2 steps. Then the straight run takes 2 more steps, and a restarted one (seed, build, load
    what your file holds, by what it is, whatever the keys) takes the same 2 steps; their
    parameters must be equal to the bit. Says what the file lacks: the model's state dict
    (without DDP's "module." prefix), the optimizer's (momentum), the RNG state (dropout),
    ``epochs_done``; and whether every rank wrote the file, or a rank went on before it was
    complete (no barrier). It loads the file with ``torch.load(path, weights_only=True)``.

        >>> import gradsync_tutorial as gst
        >>> def save_checkpoint(path, model, optimizer, epochs_done):   # no optimizer, no RNG
        ...     if dist.get_rank() == 0:
        ...         torch.save({"model": model.module.state_dict(), "epochs_done": epochs_done},
        ...                    path)
        ...     dist.barrier()
        >>> gst.exercises.check_save_checkpoint(save_checkpoint)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: your checkpoint has no optimizer state: ...

    Returns True (correct) or False (not attempted); raises :class:`ExerciseFailed` otherwise.
    Exercise of ``notebooks/06_from_notebook_to_torchrun.ipynb``.
    """
    import functools
    import tempfile

    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    _require_function(save_checkpoint, 4, "save_checkpoint(path, model, optimizer, epochs_done)")
    with tempfile.TemporaryDirectory(prefix="gradsync-check-") as folder:
        path = f"{folder}/checkpoint.pt"
        worker = functools.partial(_checkpoint_worker, path=path)
        outs = _launch(worker, save_checkpoint, world_size, timeout)
    if outs is None:
        return _not_attempted(save_checkpoint, "save_checkpoint")
    out = outs[0]
    counts = out["counts"]
    if out.get("missing"):
        _fail(f"no file at `path` after {_name(save_checkpoint)} (collectives called: "
              f"{_calls_text(counts)}): write the checkpoint there, torch.save(checkpoint, "
              "path), on rank 0.")
    if "load_error" in out:
        _fail(
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
        _fail("your checkpoint has no model state dict (a dict with the Net's parameter names): "
              "save model.module.state_dict() (model is the DDP wrapper).")
    if "optimizer" not in found or not out["momentum"]:
        _fail(
            "your checkpoint has no optimizer state: SGD's momentum buffers carry the past steps "
            f"into the next ones, and a resumed run starts them from zero ({after}). Save "
            "optimizer.state_dict()."
        )
    if "optimizer_error" in out:
        _fail(f"optimizer.load_state_dict cannot load your optimizer state: "
              f"{out['optimizer_error']}. Save optimizer.state_dict() as it is.")
    if "rng" not in found:
        _fail(
            "your checkpoint has no RNG state (nothing in it equals torch.get_rng_state() at the "
            "time of saving): dropout draws random numbers, so a resumed run that re-seeds draws "
            f"other masks than the straight run ({after}). Save torch.get_rng_state() (and on "
            "GPUs torch.cuda.get_rng_state())."
        )
    if "epochs" not in found:
        _fail(f"your checkpoint does not record epochs_done (the check passed "
              f"{_EPOCHS_DONE}): without it, a resumed run does not know which epoch comes next, "
              "and the data order is a function of seed + epoch.")
    savers = [rank for rank, o in enumerate(outs) if o["saves"]]
    if len(savers) > 1:
        _fail(
            f"ranks {', '.join(map(str, savers))} all wrote the file: every rank holds the same "
            "state, so one copy is enough, and several processes writing one file can leave it "
            "corrupt. Save on rank 0 only (if dist.get_rank() == 0:)."
        )
    early = [rank for rank, o in enumerate(outs) if not o["exists"]]
    if early:
        _fail(
            f"rank(s) {', '.join(map(str, early))} returned from {_name(save_checkpoint)} before "
            "the file existed: a rank that goes on (or exits, or is restarted) while rank 0 is "
            "still writing can find no checkpoint, or half of one. After rank 0's torch.save, "
            "call dist.barrier() on every rank."
        )
    if out.get("prefixed"):
        _fail(
            "your model state dict's names start with 'module.': that is the DDP wrapper's. "
            "Save model.module.state_dict(), the Net's own, so that the checkpoint loads into a "
            "plain Net (for evaluation, or in a script without DDP)."
        )
    if diff != 0.0:
        _fail(f"{after}; they should be equal. Save the model's, optimizer's and RNG's state "
              "as they are when save_checkpoint is called.")
    return _passed(
        f"your file holds the model, the optimizer (momentum), the RNG state and epochs_done; "
        f"rank 0 wrote it and every rank waited for it. 2 steps after a resume equal the "
        f"straight run's to the bit, on {world_size} ranks (collectives called: "
        f"{_calls_text(counts)})."
    )


#: Every exercise, by the name of the function you write.
EXERCISES: dict[str, Exercise] = {
    e.function: e
    for e in (
        Exercise("gather_ranks", check_gather_ranks, "00_launching_workers.ipynb",
                 "00_gather_ranks.py"),
        Exercise("accumulate_gradients", check_accumulate_gradients,
                 "01_single_device_baseline.ipynb", "01_accumulate_gradients.py"),
        Exercise("average_gradients_flat", check_average_gradients_flat,
                 "02_manual_allreduce_averaging.ipynb", "02_average_gradients_flat.py"),
        Exercise("broadcast_parameters", check_broadcast_parameters,
                 "03_distributed_data_parallel.ipynb", "03_broadcast_parameters.py"),
        Exercise("global_mean_loss", check_global_mean_loss, "04_pitfalls.ipynb",
                 "04_global_mean_loss.py"),
        Exercise("average_overlapped", check_average_overlapped, "05_performance.ipynb",
                 "05_average_overlapped.py"),
        Exercise("save_checkpoint", check_save_checkpoint,
                 "06_from_notebook_to_torchrun.ipynb", "06_save_checkpoint.py"),
    )
}
