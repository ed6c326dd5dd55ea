"""Are the replicas equal? Compare every rank's copy of the model with rank 0's.

Data-parallel training is correct only if every rank ends each step with *exactly* the same
parameters: the same start (same seed, or a broadcast from rank 0) and the same update (the
gradients averaged over all ranks). These checks make that visible, number by number.

Inside a launched function, where the process group is initialized, use the collective versions:

    >>> import gradsync_tutorial as gst
    >>> def train(rank, world_size):
    ...     import torch
    ...     torch.manual_seed(0)                      # same seed -> same initial weights
    ...     model = gst.model.Net()
    ...     gst.checks.assert_replicas_equal(model)   # raises on every rank if not
    ...     return gst.checks.max_diff_across_ranks(model)
    >>> gst.launch(train, world_size=2)
    [0.0, 0.0]

In the notebook itself, on state dicts that the ranks returned, use :func:`compare_state_dicts`
(two models) and :func:`compare_ranks` (one state dict per rank): they print a table with one
row per tensor and return the largest difference.

Introduced in ``notebooks/02_manual_allreduce_averaging.ipynb``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ._wording import ranks as _ranks
from .device import collective_device

__all__ = [
    "assert_replicas_equal",
    "compare_ranks",
    "compare_state_dicts",
    "max_abs_diff",
    "max_diff_across_ranks",
]

#: What the checks accept: a model (its parameters), a state dict, or (name, tensor) pairs.
Tensors = nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def _named_tensors(obj: Tensors | torch.Tensor, buffers: bool = False) -> list:
    """Turn a model, a state dict or (name, tensor) pairs into a list of (name, tensor)."""
    if isinstance(obj, torch.Tensor):
        return [("tensor", obj)]
    if isinstance(obj, nn.Module):
        named = list(obj.named_parameters())
        if buffers:  # e.g. BatchNorm's running statistics
            named += list(obj.named_buffers())
        return named
    items = obj.items() if isinstance(obj, Mapping) else obj
    named = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError("expected an nn.Module, a state dict, or (name, tensor) pairs; "
                            f"found the item {item!r}")
        named.append((str(item[0]), item[1]))
    return named


def max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``max |x - y|`` over all elements, in float64; ``0.0`` for empty tensors.

    Equal infinities, and NaN against NaN, count as equal; a NaN against a number counts as
    infinitely far; tensors of different shapes are infinitely far apart. Every comparison in
    the package (and in the exercises' checks) uses it.

        >>> import torch
        >>> from gradsync_tutorial.checks import max_abs_diff
        >>> max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        0.5
        >>> max_abs_diff(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
        0.0
        >>> max_abs_diff(torch.tensor([float("nan")]), torch.tensor([0.0]))
        inf
    """
    if x.shape != y.shape:
        return float("inf")
    x, y = x.detach().to(torch.float64), y.detach().to(torch.float64)
    if x.numel() == 0:
        return 0.0
    diff = (x - y).abs()
    same = (x == y) | (x.isnan() & y.isnan())  # inf - inf and nan - nan would give nan
    # A NaN against a number is as different as can be: call it infinitely far.
    return torch.where(same, 0.0, diff).nan_to_num(nan=float("inf")).max().item()


def _fmt(d: float) -> str:
    return "0" if d == 0 else f"{d:.3g}"


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print columns aligned on the widest cell; the last column is left unpadded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)] + [row[-1]]
        print("  ".join(cells).rstrip())


# --------------------------------------------------------------------------------------------
# Inside the ranks: collectives
# --------------------------------------------------------------------------------------------


def _check_same_structure(named: list) -> None:
    """Every rank must hold the same names, shapes and dtypes, or the broadcasts would hang or
    fail deep inside the backend. One collective tells every rank what the others hold."""
    mine = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            only0 = [n for n, *_ in everyone[0] if n not in {m for m, *_ in theirs}]
            only_r = [n for n, *_ in theirs if n not in {m for m, *_ in everyone[0]}]
            pairs = zip(everyone[0], theirs, strict=False)  # the lists may differ in length
            changed = [f"{a[0]} {a[1]} {a[2]} vs {b[1]} {b[2]}"
                       for a, b in pairs if a[0] == b[0] and a != b]
            raise ValueError(
                f"rank {rank} does not hold the same tensors as rank 0, so they cannot be "
                f"compared: only on rank 0: {only0 or 'none'}; only on rank {rank}: "
                f"{only_r or 'none'}; different shape or dtype: {changed or 'none'}. Build "
                "the same model on every rank."
            )


def _diffs_from_rank0(named: list, device: torch.device) -> torch.Tensor:
    """For each tensor, ``max |mine - rank 0's|`` on this rank (zeros on rank 0)."""
    diffs = []  # floats; one tensor of them for the collectives that follow
    for _, t in named:
        mine = t.detach().to(device)
        if mine.dtype == torch.bool:  # not every backend sends bools
            mine = mine.to(torch.uint8)
        theirs = mine.clone(memory_format=torch.contiguous_format)
        dist.broadcast(theirs, src=0)  # now `theirs` holds rank 0's values on every rank
        diffs.append(max_abs_diff(mine, theirs))
    return torch.tensor(diffs, dtype=torch.float64, device=device)


def max_diff_across_ranks(model_or_tensors: Tensors, *, buffers: bool = False) -> float:
    """The largest ``|x - x on rank 0|`` over all ranks and tensors; the same on every rank.

    Call it on every rank (it runs collectives). The recipe, one tensor at a time: rank 0
    broadcasts its values, each rank compares its own with them, then an ``all_reduce`` with
    ``MAX`` gives every rank the worst difference anywhere. ``0.0`` means the replicas are
    bit-for-bit equal. Works with gloo (CPU) and nccl (CUDA), wherever the tensors live.

    Args:
        model_or_tensors: an ``nn.Module`` (its parameters), a state dict, or an iterable of
            ``(name, tensor)`` pairs such as ``model.named_parameters()``.
        buffers: with a module, also compare its buffers (e.g. BatchNorm running statistics).

    Example (in a function run by ``gst.launch``):
        >>> import gradsync_tutorial as gst
        >>> def step(rank, world_size):
        ...     import torch
        ...     torch.manual_seed(0)
        ...     model = gst.model.Net()
        ...     return gst.checks.max_diff_across_ranks(model)
        >>> gst.launch(step, world_size=2)
        [0.0, 0.0]

    Introduced in ``notebooks/02_manual_allreduce_averaging.ipynb``.
    """
    named = _named_tensors(model_or_tensors, buffers)
    _check_same_structure(named)
    device = collective_device()
    diffs = _diffs_from_rank0(named, device)
    worst = diffs.max() if diffs.numel() else torch.zeros((), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # this rank's worst -> the worst anywhere
    return worst.item()


def assert_replicas_equal(
    model_or_tensors: Tensors, atol: float = 0.0, *, buffers: bool = False
) -> None:
    """Raise ``AssertionError`` on *every* rank if any rank's tensors differ from rank 0's.

    Call it on every rank. The message names the first tensor (in order) that differs by more
    than ``atol``, by how much, and on which ranks, and lists the other tensors that differ.
    Since every rank learns every difference (an ``all_gather``), every rank raises: none is
    left waiting in a collective for a rank that has stopped.

    Example (in a function run by ``gst.launch``):
        >>> import gradsync_tutorial as gst
        >>> def step(rank, world_size):
        ...     import torch
        ...     torch.manual_seed(rank)                   # a seed per rank: different weights!
        ...     model = gst.model.Net()
        ...     gst.checks.assert_replicas_equal(model)
        >>> gst.launch(step, world_size=2)
        Traceback (most recent call last):
        gradsync_tutorial.launcher.errors.RankFailedError: rank ... raised AssertionError: replicas
        differ: 'conv1.weight' on rank 1 differs from rank 0's by up to ...

    Introduced in ``notebooks/02_manual_allreduce_averaging.ipynb``.
    """
    named = _named_tensors(model_or_tensors, buffers)
    _check_same_structure(named)
    if not named:
        return
    device = collective_device()
    diffs = _diffs_from_rank0(named, device)
    gathered = [torch.empty_like(diffs) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, diffs)  # every rank gets every rank's differences
    table = torch.stack(gathered).cpu()  # (world_size, number of tensors)
    bad = ~(table <= atol)  # written this way round, a NaN would count as a difference too
    if not bad.any():
        return
    differing = bad.any(dim=0).nonzero().flatten().tolist()
    first = differing[0]
    ranks = bad[:, first].nonzero().flatten().tolist()
    others = [named[i][0] for i in differing[1:]]
    raise AssertionError(
        f"replicas differ: {named[first][0]!r} on {_ranks(ranks)} differs from rank 0's by up to "
        f"{_fmt(table[:, first].max().item())} (atol={atol:g}); "
        f"{len(differing)} of {len(named)} tensors differ"
        + (f" (also: {', '.join(others)})" if others else "")
        + ". Did every rank start from the same weights and apply the same averaged gradients?"
    )


# --------------------------------------------------------------------------------------------
# In the notebook: state dicts returned by the ranks
# --------------------------------------------------------------------------------------------


def _as_dict(obj: Tensors) -> dict[str, torch.Tensor]:
    if isinstance(obj, nn.Module):
        return dict(obj.state_dict())
    return dict(_named_tensors(obj))


def _check_keys_and_shapes(a: dict, b: dict, name_a: str, name_b: str) -> None:
    if set(a) != set(b):
        only_a = [k for k in a if k not in b]
        only_b = [k for k in b if k not in a]
        hint = ""
        if any(k.startswith("module.") for k in [*only_a, *only_b]):
            hint = (" (keys starting with 'module.' come from a DistributedDataParallel "
                    "wrapper: compare ddp_model.module.state_dict() instead)")
        raise ValueError(f"{name_a} and {name_b} do not have the same tensors: only in "
                         f"{name_a}: {only_a or 'none'}; only in {name_b}: {only_b or 'none'}"
                         f"{hint}.")
    for key, t in a.items():
        if tuple(t.shape) != tuple(b[key].shape):
            raise ValueError(f"{key!r} has shape {tuple(t.shape)} in {name_a} but "
                             f"{tuple(b[key].shape)} in {name_b}.")


def compare_state_dicts(
    a: Tensors,
    b: Tensors,
    *,
    names: tuple[str, str] = ("a", "b"),
    show: bool = True,
) -> float:
    """Print ``max |a - b|`` for each tensor of two state dicts; return the overall maximum.

    ``a`` and ``b`` may be state dicts, models, or ``(name, tensor)`` pairs, on any devices.
    They must hold the same names with the same shapes (else ``ValueError`` says what differs).

    Example:
        >>> import torch
        >>> from gradsync_tutorial.checks import compare_state_dicts
        >>> a = {"w": torch.zeros(3), "b": torch.zeros(1)}
        >>> b = {"w": torch.tensor([0.0, 0.5, 0.0]), "b": torch.zeros(1)}
        >>> compare_state_dicts(a, b, names=("single", "ddp"))
        tensor  shape  max |single - ddp|
        w       (3,)   0.5  <- differs
        b       (1,)   0
        overall max |single - ddp| = 0.5
        0.5

    Introduced in ``notebooks/02_manual_allreduce_averaging.ipynb``.
    """
    name_a, name_b = names
    da, db = _as_dict(a), _as_dict(b)
    _check_keys_and_shapes(da, db, name_a, name_b)
    diffs = {k: max_abs_diff(da[k].cpu(), db[k].cpu()) for k in da}
    overall = max(diffs.values(), default=0.0)
    if show:
        label = f"max |{name_a} - {name_b}|"
        rows = [(k, str(tuple(da[k].shape)), _fmt(d) + ("  <- differs" if d > 0 else ""))
                for k, d in diffs.items()]
        _print_table(("tensor", "shape", label), rows)
        print(f"overall {label} = {_fmt(overall)}")
    return overall


def compare_ranks(states: Sequence[Tensors], show: bool = True) -> float:
    """Compare each rank's state dict with rank 0's; print a table; return the largest diff.

    ``states[r]`` is rank ``r``'s state dict (or model), typically the list that
    ``gst.launch`` returns when every rank ends with ``return model.state_dict()``.

    Example:
        >>> import torch
        >>> from gradsync_tutorial.checks import compare_ranks
        >>> states = [{"w": torch.ones(2)}, {"w": torch.ones(2)}, {"w": torch.tensor([1.0, 2.0])}]
        >>> compare_ranks(states)
        tensor  shape  max diff vs rank 0  ranks that differ
        w       (2,)   1                   2
        overall max diff vs rank 0 = 1 (3 ranks)
        1.0

    Introduced in ``notebooks/02_manual_allreduce_averaging.ipynb``.
    """
    if len(states) == 0:
        raise ValueError("compare_ranks needs at least one state dict (one per rank).")
    dicts = [_as_dict(s) for s in states]
    for rank, d in enumerate(dicts[1:], start=1):
        _check_keys_and_shapes(dicts[0], d, "rank 0", f"rank {rank}")
    rows, overall = [], 0.0
    for key, ref in dicts[0].items():
        per_rank = [max_abs_diff(d[key].cpu(), ref.cpu()) for d in dicts]
        worst = max(per_rank)
        overall = max(overall, worst)
        differ = [str(r) for r, d in enumerate(per_rank) if d > 0]
        rows.append((key, str(tuple(ref.shape)), _fmt(worst), ", ".join(differ) or "-"))
    if show:
        _print_table(("tensor", "shape", "max diff vs rank 0", "ranks that differ"), rows)
        print(f"overall max diff vs rank 0 = {_fmt(overall)} ({len(dicts)} ranks)")
    return overall
