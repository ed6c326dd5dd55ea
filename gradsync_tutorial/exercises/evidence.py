"""What a check reads and compares: what the collectives carried (a :class:`Recorder` on each
rank), the numbers in it, tensors against the expected ones, and the course's model with
random data no rank can guess.

    >>> import torch
    >>> from gradsync_tutorial.exercises.evidence import among, numbers
    >>> numbers([torch.tensor([1.0, 2.0]), 3, {"a": 4.5}])
    tensor([1.0000, 2.0000, 3.0000, 4.5000], dtype=torch.float64)
    >>> among(torch.tensor([3.0, 1.0]), numbers([torch.tensor([1.0, 2.0]), 3]))
    True

The diagnoses of :mod:`~gradsync_tutorial.exercises.common`'s checks are written with these.
Part of :mod:`gradsync_tutorial.exercises` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import diagnoses
from ..checks import max_abs_diff as max_abs_diff  # the package's one comparison of tensors
from ..detect import CollectiveCounter
from ..model import Net

SEED = 1234
# Relative and absolute tolerance for "the same numbers" (sums in another order round apart).
RTOL, ATOL = 1e-4, 1e-7


def fresh_seed() -> int:
    """A seed nobody can know in advance: data that only communication can deliver."""
    return int.from_bytes(os.urandom(6), "little")


# --------------------------------------------------------------------------------------------
# What the collectives carried
# --------------------------------------------------------------------------------------------

# A collective's parameters that carry data (the others say how: op, src, group, async_op...).
_DATA_WORDS = ("tensor", "obj", "list", "input", "output")
# Those a rank receives into, not sends from (all_gather's tensor_list, a gather's list).
_RECEIVED = ("output", "tensor_list", "object_list", "gather_list", "object_gather_list")


@dataclass
class Call:
    """One collective call: the numbers its data arguments held before it (what this rank
    sent) and after it (what it delivered: for an ``async_op=True`` call, read when asked,
    after the learner waited), and the format they travelled in (``dtype``: its first
    tensor's, None when it carried none, as a barrier). ``contributed``: the numbers of the
    arguments it sends from, not those it receives into (an all_gather's ``tensor``, not its
    ``tensor_list``)."""

    name: str
    sent: torch.Tensor
    is_async: bool
    dtype: torch.dtype | None
    data: list = field(repr=False)
    after: torch.Tensor | None = field(default=None, repr=False)
    contributed: torch.Tensor = field(default_factory=lambda: numbers([]), repr=False)

    @property
    def delivered(self) -> torch.Tensor:
        return numbers(self.data) if self.after is None else self.after

    def settle(self) -> None:
        """Read what an async call delivered now (after its wait()), before anything else
        writes into its tensors."""
        self.after = self.delivered

    def __getstate__(self) -> dict:  # back to the notebook: the numbers, not the arguments
        return {**vars(self), "after": self.delivered, "data": []}


class Recorder(CollectiveCounter):
    """A :class:`~gradsync_tutorial.detect.CollectiveCounter` that also keeps, in ``log``, a
    :class:`Call` for each collective (what it sent and delivered), in order."""

    def __init__(self, *functions: Callable) -> None:
        super().__init__(*functions)
        self.log: list[Call] = []

    def _wrap(self, name: str, original: Callable) -> Callable:
        counted = super()._wrap(name, original)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if getattr(self._local, "depth", 0):  # inside another collective: counted there
                return counted(*args, **kwargs)
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return counted(*args, **kwargs)  # torch says what is wrong with the call
            keys = [k for k in bound if any(w in k for w in _DATA_WORDS)
                    and not k.endswith("split_sizes")]
            data = [bound[k] for k in keys]
            call = Call(name, numbers(data), bool(bound.get("async_op")), dtype_of(data), data,
                        contributed=numbers([bound[k] for k in keys
                                             if not k.startswith(_RECEIVED)]))
            result = counted(*args, **kwargs)
            if not call.is_async:
                call.after = numbers(data)
            self.log.append(call)
            return result

        return recorded


def _leaves(value: Any, depth: int = 0) -> Iterator[Any]:
    """The tensors and numbers in ``value`` (and in its lists, tuples, dicts), in order."""
    if isinstance(value, torch.Tensor) or is_number(value):
        yield value
        return
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)) and depth < 4:
        for v in value:
            yield from _leaves(v, depth + 1)


def numbers(value: Any) -> torch.Tensor:
    """Every number in ``value`` (tensors, numbers, and lists, tuples, dicts of them), flat,
    as float64 on the CPU."""
    parts = [v.detach().to("cpu", torch.float64).flatten() if isinstance(v, torch.Tensor)
             else torch.tensor([float(v)], dtype=torch.float64) for v in _leaves(value)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def dtype_of(value: Any) -> torch.dtype | None:
    """The dtype of the first tensor in ``value`` (as :func:`numbers` reads it), else None."""
    return next((v.dtype for v in _leaves(value) if isinstance(v, torch.Tensor)), None)


def among(values: torch.Tensor, haystack: torch.Tensor) -> bool:
    """Whether every number of ``values`` is in ``haystack`` (within the tolerance)."""
    values = values.detach().to(torch.float64).flatten()
    if haystack.numel() == 0:
        return values.numel() == 0
    s = haystack.to(torch.float64).flatten().sort().values
    i = torch.searchsorted(s, values).clamp(max=len(s) - 1)
    near = torch.minimum((s[i] - values).abs(), (s[(i - 1).clamp(min=0)] - values).abs())
    return bool((near <= ATOL + RTOL * values.abs()).all())


def delivered(calls: Sequence[Call]) -> torch.Tensor:
    """Every number that ``calls`` delivered, end to end."""
    parts = [c.delivered for c in calls]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def count_delivered(calls: Sequence[Call], count: int, per_rank: Sequence[int]) -> str | None:
    """What ``calls`` delivered of a count that no rank knows alone: "the count N" (as an
    all_reduce would), "every rank's count" (as an all_gather would), or None.

        >>> count_delivered([], 12, [5, 7]) is None
        True
    """
    got = delivered(calls)
    if among(torch.tensor([float(count)]), got):
        return f"the count {count}"
    if among(torch.tensor([float(c) for c in per_rank]), got):
        return "every rank's count"
    return None


def count_not_delivered(outs: Sequence[dict], count: int, per_rank: Sequence[int],
                        what: str) -> str | None:
    """The first rank whose collectives delivered neither ``count`` nor every rank's count,
    said with what they did deliver; None if every rank got it."""
    for rank, out in enumerate(outs):
        if not count_delivered(out["calls"], count, per_rank):
            return (f"rank {rank}'s collectives delivered {carried_text(out['calls'])}: never "
                    f"{what} ({count}), nor every rank's count. Exchange the count with "
                    "dist.all_reduce, not another way.")
    return None


def calls_text(counts: dict) -> str:
    """"all_reduce 8 times, broadcast once" (or "none")."""
    parts = []
    for name, n in counts.items():
        parts.append(f"{name} {'once' if n == 1 else f'{n} times'}")
    return ", ".join(parts) or "none"


def numbers_text(t: torch.Tensor) -> str:
    """"3 numbers ([0.5, 1, 2])", or "1,000 numbers ([0.5, 1, 2, 3, ...])"."""
    n = t.numel()
    shown = ", ".join(f"{x:.4g}" for x in t[:4].tolist()) + ", ..." * (n > 4)
    return f"{n:,} number{'s' * (n != 1)} ([{shown}])"


def carried_text(calls: Sequence[Call], most: int = 3) -> str:
    """"all_reduce of 1 number ([3]), barrier": what ``calls`` delivered, briefly."""
    said = [f"{c.name} of {numbers_text(c.delivered)}" if c.delivered.numel() else c.name
            for c in calls[:most]]
    return (", ".join(said) + ", ..." * (len(calls) > most)) or "none"


# --------------------------------------------------------------------------------------------
# Comparing what came back
# --------------------------------------------------------------------------------------------


def flatten(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors.values()])


def _unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pieces = flat.split([t.numel() for t in like.values()])
    return {name: p.view_as(t).clone() for (name, t), p in zip(like.items(), pieces, strict=True)}


def all_ranks(tensors: dict[str, torch.Tensor], world_size: int) -> list[dict]:
    """Every rank's copy of ``tensors`` (an all_gather), on every rank."""
    import torch.distributed as dist

    flat = flatten(tensors)
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return [_unflatten(f, tensors) for f in everyone]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=RTOL, atol=ATOL)


def differing_tensors(got: dict, expected: dict) -> list[tuple[str, float]]:
    """(name, max abs difference) of each tensor of ``got`` not close to ``expected``'s."""
    return [(name, max_abs_diff(got[name], expected[name]))
            for name in expected if not _close(got[name], expected[name])]


def unequal_tensors(got: dict, expected: dict) -> list[tuple[str, float]]:
    """(name, max abs difference) of each tensor of ``got`` not *exactly* ``expected``'s."""
    return [(name, max_abs_diff(got[name], expected[name])) for name in expected
            if got[name].shape != expected[name].shape or not torch.equal(got[name],
                                                                          expected[name])]


def mean_over_ranks(everyone: list[dict]) -> dict[str, torch.Tensor]:
    """The mean, tensor by tensor, of every rank's copy (as :func:`all_ranks` returns them)."""
    return {n: torch.stack([e[n] for e in everyone]).mean(0) for n in everyone[0]}


def scale(got: dict, expected: dict) -> float | None:
    """``c`` if ``got`` is ``c * expected``, tensor by tensor, with one ``c``; else None."""
    g, e = flatten(got).double(), flatten(expected).double()
    if e.dot(e) == 0:
        return None
    c = (g.dot(e) / e.dot(e)).item()
    return c if torch.allclose(g, c * e, rtol=RTOL, atol=ATOL) else None


#: Two float64 gradients of one step, summed in another order: equal to about 1e-16 relative.
GRADIENT_RTOL, GRADIENT_ATOL = 1e-7, 1e-12


def same_gradient(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat float64 gradients are the same up to the rounding of their sums."""
    return torch.allclose(a, b, rtol=GRADIENT_RTOL, atol=GRADIENT_ATOL)


def named_mistake(got: torch.Tensor, mistakes: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """The words of the first ``(words, gradient)`` that ``got`` is, else None.

        >>> named_mistake(torch.ones(2), [("halved", torch.ones(2) / 2), ("as is", torch.ones(2))])
        'as is'
    """
    return next((words for words, grad in mistakes if same_gradient(got, grad)), None)


def gradient_factor(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    """``c`` if ``got`` is ``c × expected`` (one flat gradient), else None."""
    c = (got.dot(expected) / expected.dot(expected)).item()
    return c if same_gradient(got, c * expected) else None


def typed_world_size(c: float, world_size: int) -> int | None:
    """``k`` if a factor ``c`` is ``k / world_size`` for a whole ``k`` other than 0 and the
    world size: the world size typed as a number that is right at another size.

        >>> typed_world_size(2 / 3, 3), typed_world_size(1.0, 3)
        (2, None)
    """
    k = round(c * world_size)
    return k if abs(c * world_size - k) < 1e-6 and k not in (0, world_size) else None


def wrong_scale(got: torch.Tensor, expected: torch.Tensor, world_size: int, micro: int,
                said: str, unguessed: str = "") -> str | None:
    """What to say when a gradient is ``c ×`` the expected one: ``said`` with ``{times}`` filled
    in, a world size typed as a number if ``c`` points to one (else ``unguessed``), and what the
    factor means (:func:`factor_words`). None if ``got`` is no multiple of ``expected``."""
    c = gradient_factor(got, expected)
    if c is None:
        return None
    k = typed_world_size(c, world_size)
    guess = (f" Did you multiply by {k} instead of the world size ({world_size} here)? Use "
             f"dist.get_world_size(): it is not always {k}." if k else unguessed)
    return said.format(times=times_text(c)) + guess + factor_words(c, world_size, micro)


def times_text(c: float) -> str:
    return f"{c:.1f}×" if abs(c) >= 1 else f"{c:.2g}×"


def where_text(differing: list[tuple[str, float]], total: int) -> str:
    """"`fc2.weight` (max abs difference 0.03; 3 of 8 tensors differ)"."""
    name, diff = differing[0]
    what = "a different shape" if diff == float("inf") else f"max abs difference {diff:.3g}"
    return f"`{name}` ({what}; {len(differing)} of {total} tensors differ)"


def divisor_hint(c: float, right: int, what: str) -> str:
    """" Did you divide by 2 instead of world_size (3 here)? ..." if ``c == right / k``."""
    if c <= 0:
        return ""
    k = right / c
    if abs(k - round(k)) > 1e-3 or round(k) in (0, right):
        return ""
    return (f" Did you divide by {round(k)} instead of {what} ({right} here)? Use the value "
            f"you are given: it is not always {round(k)}.")


def factor_words(c: float, world_size: int = 1, micro: int = 1) -> str:
    """What verify_gradients (notebook 15) says of a gradient ``c`` times the right one, when
    ``c`` is a size of the job: the same words (:mod:`gradsync_tutorial.diagnoses`); else ""."""
    said = diagnoses.meaning(c, world_size=world_size, micro=micro, tol=1e-4)
    return f" verify_gradients (notebook 15) would say: {said}." if said else ""


def mean_mismatch(got: dict, expected: dict, n: int, what: str, how: str,
                  divisor: str = "world_size, dist.get_world_size()") -> str | None:
    """What is wrong with ``got``, gradients that should be ``expected`` (``what``: "the mean
    over ranks"), a mean over ``n`` pieces (ranks, micro-batches), if it is a multiple of it:
    ``n``× (no division: ``how`` says what to do), or divided by a hard-coded number instead
    of ``divisor``; else None."""
    c = scale(got, expected)
    if c is None or abs(c - 1) <= 1e-3:
        return None
    words = factor_words(c, **{"micro" if "micro" in divisor else "world_size": n})
    if abs(c - n) < 1e-3:
        return f"your gradients are {times_text(c)} the expected ones ({what}): {how}{words}"
    return (f"your gradients are {times_text(c)} the expected ones ({what}): divide the sum "
            f"by {divisor.split(',')[0]} ({n} here), once.{divisor_hint(c, n, divisor)}{words}")


def changed_text(before: dict, after: dict, what: str) -> str | None:
    """"<what> `conv1.weight` (max abs difference 0.3; ...)" if ``after`` is not ``before``
    bit for bit, else None."""
    changed = unequal_tensors(after, before)
    return f"{what} {where_text(changed, len(before))}" if changed else None


def token_model(vocab: int) -> nn.Module:
    """A language model of the smallest kind, in float64: an embedding, then a linear layer to
    the vocabulary; the same initial weights on every rank (seeded)."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Embedding(vocab, 6), nn.Linear(6, vocab)).double()


def model_and_data(rank: int, batch: int = 8, seed: int | None = None
                    ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The course's model (the same weights on every rank, dropout off) and a rank's own batch
    of random images, so every rank has different gradients: drawn from ``seed + rank``, by
    default a :func:`fresh_seed` (then no rank can compute another's)."""
    torch.manual_seed(SEED)
    model = Net().eval()  # eval: dropout off, so every forward pass is deterministic
    g = torch.Generator().manual_seed((fresh_seed() if seed is None else seed) + rank)
    images = torch.randn(batch, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return model, images, labels


def is_number(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    return type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0  # np.float32(1.0)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def reference_gradient(model: nn.Module, images, labels) -> tuple[dict, float]:
    """The gradient of the mean loss over ``images`` and that loss, on a copy of ``model``."""
    copy_ = copy.deepcopy(model)
    copy_.zero_grad(set_to_none=True)
    loss = F.nll_loss(copy_(images), labels)
    loss.backward()
    return grads_of(copy_), loss.item()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}

