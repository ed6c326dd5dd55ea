"""Detectors for the silent bugs of data-parallel training: overlapping shards, ranks that
disagree on a value, and how many collectives a piece of code really makes.

Each one turns a bug that runs without complaint into a number or an error message:

* :func:`sample_overlap` (in the notebook) and :func:`assert_disjoint_shards` (inside the
  ranks): do two ranks read the same samples? (Every rank reading all the data runs fine, and
  N ranks then do the work of one.)
* :func:`assert_ranks_agree_on` (inside the ranks): do all ranks agree on a value, such as
  the number of batches they are about to take? Run it *before* a loop whose collectives would
  otherwise hang when one rank takes one step more than the others.
* :func:`count_collectives` (inside the ranks): how many ``all_reduce``, ``broadcast``, ...
  calls does a piece of code make, and how many bucket all-reduces does DDP make?

For the replicas themselves (are the parameters equal on every rank?) use
:func:`gradsync_tutorial.checks.assert_replicas_equal`.

    >>> import torch
    >>> from gradsync_tutorial.detect import sample_overlap
    >>> order = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    >>> sample_overlap([order[0::2], order[1::2]]).shared      # each rank its own half
    0
    >>> sample_overlap([order, order]).shared                  # every rank reads everything
    8

Introduced in ``notebooks/04_pitfalls.ipynb``. The detectors are one idea, notebook 04's;
:class:`CollectiveCounter` is also what the launcher counts a job's collectives with, for its
hang report.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "COUNTED_FUNCTIONS",
    "DDP_KEY",
    "CollectiveCounter",
    "Overlap",
    "assert_disjoint_shards",
    "assert_ranks_agree_on",
    "count_collectives",
    "sample_overlap",
]


# --------------------------------------------------------------------------------------------
# Do the ranks read the same samples?
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Overlap:
    """How the ranks' sample indices overlap; what :func:`sample_overlap` returns.

    Attributes:
        sizes: how many indices each rank reads (repeats included).
        unique: how many distinct indices the ranks read together.
        shared: how many distinct indices two or more ranks read ("shared" when printed).
            ``0``: disjoint shards.
        pairs: ``{(i, j): n}`` for ranks ``i < j`` that share ``n > 0`` distinct indices.
        dataset_size: the number of samples in the data set, if given.
    """

    sizes: list[int]
    unique: int
    shared: int
    pairs: dict[tuple[int, int], int] = field(default_factory=dict)
    dataset_size: int | None = None

    @property
    def disjoint(self) -> bool:
        """True when no index is read by two ranks."""
        return self.shared == 0

    @property
    def fraction(self) -> float:
        """The share of the distinct indices that two or more ranks read (0.0 to 1.0)."""
        return self.shared / self.unique if self.unique else 0.0

    @property
    def coverage(self) -> float | None:
        """The share of the data set the ranks read together (``None`` without a size)."""
        return self.unique / self.dataset_size if self.dataset_size else None

    def __str__(self) -> str:
        text = f"{len(self.sizes)} ranks, {' + '.join(map(str, self.sizes))} indices"
        text += f", {self.unique} distinct"
        if self.dataset_size:
            text += f" ({self.coverage:.0%} of {self.dataset_size})"
        text += f"; {self.shared} ({self.fraction:.0%}) shared"
        if self.pairs:
            shown = list(self.pairs.items())[:3]
            text += ": " + ", ".join(f"ranks {i} and {j} share {n}" for (i, j), n in shown)
            text += ", ..." * (len(self.pairs) > 3)
        return text


def _as_index_tensor(indices: Any) -> torch.Tensor:
    """One rank's indices (tensor, list, range, Sampler, ...) as a flat int64 CPU tensor."""
    if not isinstance(indices, (torch.Tensor, list, tuple)):
        indices = list(indices)  # a range, a Sampler, a generator...
    t = torch.as_tensor(indices)
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"sample indices must be integers, got a tensor of {t.dtype}.")
    return t.detach().to("cpu", torch.int64).flatten()


def sample_overlap(index_lists: Sequence[Any], dataset_size: int | None = None) -> Overlap:
    """Count the sample indices that two or more ranks read; ``index_lists[r]`` is rank r's.

    Each entry may be a list, a range, a tensor, or a ``Sampler`` (anything ``list()`` takes).
    Correct sharding (``order[rank::world_size]``, ``DistributedSampler``) gives
    ``shared == 0``, except for the few samples ``DistributedSampler`` repeats to pad the
    shards to equal length. Forgetting to shard gives ``shared == unique``.

    Example:
        >>> from gradsync_tutorial.detect import sample_overlap
        >>> overlap = sample_overlap([range(0, 6), range(4, 10)], dataset_size=10)
        >>> print(overlap)
        2 ranks, 6 + 6 indices, 10 distinct (100% of 10); 2 (20%) shared: ranks 0 and 1 share 2
        >>> overlap.shared, overlap.fraction, overlap.disjoint
        (2, 0.2, False)

    Introduced in ``notebooks/04_pitfalls.ipynb``.
    """
    if len(index_lists) == 0:
        raise ValueError("sample_overlap needs one list of indices per rank, got none.")
    per_rank = [_as_index_tensor(ix) for ix in index_lists]
    distinct = [t.unique() for t in per_rank]
    everything = torch.cat(distinct)
    values, readers = everything.unique(return_counts=True)  # readers: ranks per index
    pairs = {}
    for i in range(len(distinct)):
        for j in range(i + 1, len(distinct)):
            n = int(torch.isin(distinct[i], distinct[j]).sum())
            if n:
                pairs[(i, j)] = n
    return Overlap(
        sizes=[len(t) for t in per_rank],
        unique=len(values),
        shared=int((readers > 1).sum()),
        pairs=pairs,
        dataset_size=dataset_size,
    )


def assert_disjoint_shards(
    indices: Any, *, dataset_size: int | None = None, max_shared: int = 0
) -> Overlap:
    """Inside the ranks: raise ``AssertionError`` on *every* rank if the shards overlap.

    Call it on every rank with the indices this rank is about to read (for an epoch, say). One
    ``all_gather_object`` brings every rank's indices to every rank, so every rank computes the
    same :class:`Overlap` and every rank raises (no rank is left waiting in a later collective).
    ``max_shared`` tolerates a few shared samples, such as the ``world_size - 1`` at most that
    ``DistributedSampler(drop_last=False)`` repeats to pad the shards. Returns the overlap.

    Example (in a function run by ``gst.launch``):
        >>> import gradsync_tutorial as gst
        >>> def epoch(rank, world_size):
        ...     import torch
        ...     order = torch.randperm(100, generator=torch.Generator().manual_seed(0))
        ...     shard = order                     # the bug: should be order[rank::world_size]
        ...     gst.detect.assert_disjoint_shards(shard)
        >>> gst.launch(epoch, world_size=2)
        Traceback (most recent call last):
        gradsync_tutorial.launcher.errors.RankFailedError: rank ... raised AssertionError: the
        ranks' shards overlap: ...

    Introduced in ``notebooks/04_pitfalls.ipynb``.
    """
    mine = _as_index_tensor(indices).tolist()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    overlap = sample_overlap(everyone, dataset_size)
    if overlap.shared > max_shared:
        (i, j), _ = next(iter(overlap.pairs.items()))
        common = torch.isin(_as_index_tensor(everyone[i]), _as_index_tensor(everyone[j]))
        examples = _as_index_tensor(everyone[i])[common][:3].tolist()
        raise AssertionError(
            f"the ranks' shards overlap: {overlap} (ranks {i} and {j} both read samples "
            f"{', '.join(map(str, examples))}, ...). Give each rank its own part of every epoch: "
            "shard = order[rank::world_size], or a DistributedSampler (with set_epoch(epoch))."
        )
    return overlap


# --------------------------------------------------------------------------------------------
# Do the ranks agree on a value?
# --------------------------------------------------------------------------------------------


def assert_ranks_agree_on(value: Any, what: str = "value") -> list:
    """Inside the ranks: raise ``AssertionError`` on every rank unless all ranks pass equal
    values; return the list of every rank's value.

    ``value`` is anything picklable and comparable with ``==`` (a number, a string, a tuple of
    shapes...). Typical use, before a training loop whose every step makes collectives::

        gst.detect.assert_ranks_agree_on(len(batches), "batches per epoch")

    If one rank would take more steps than the others, it would wait forever in a collective
    that the others never call. This check turns that hang into an error naming every rank's
    value, before the loop starts. Tensors are compared with ``torch.equal``.

    Introduced in ``notebooks/04_pitfalls.ipynb``.
    """
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)

    def same(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
                a.shape == b.shape and bool(torch.equal(a, b)))
        return a == b

    if not all(same(v, everyone[0]) for v in everyone):
        listing = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(everyone))
        raise AssertionError(
            f"the ranks disagree on {what}: {listing}. Every rank must make the same "
            "collective calls in the same order; with different values here, some rank would "
            "wait forever in a collective that the others never call. For a number of batches: "
            "give every rank equally long shards (DistributedSampler pads them, drop_last=True "
            "cuts them) or wrap a DDP loop in torch.distributed.algorithms.Join."
        )
    return everyone


# --------------------------------------------------------------------------------------------
# How many collectives does this code make?
# --------------------------------------------------------------------------------------------

#: The ``torch.distributed`` functions that :func:`count_collectives` counts (those that exist).
#: torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to
#: ``all_gather_single`` and ``reduce_scatter_single`` (FSDP2 calls the new names; an old name
#: calls the new one, and counts once, as itself).
COUNTED_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "all_gather_object", "gather",
    "gather_object", "scatter", "scatter_object_list", "broadcast_object_list", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)

#: The key under which DDP's gradient bucket all-reduces are counted.
DDP_KEY = "ddp_bucket_allreduce"


class CollectiveCounter:
    """Counts, by name, the collective calls made while a ``with`` block runs.

    What :func:`count_collectives` returns (the exercises' checks use it too).
    ``counter["all_reduce"]`` is the number of ``all_reduce`` calls seen (0 if none),
    ``counter[DDP_KEY]`` (``"ddp_bucket_allreduce"``) the number of gradient buckets that
    watched DDP models all-reduced, ``counter.total`` the sum, ``counter.calls`` a
    ``collections.Counter`` of them all, ``counter.arguments["all_reduce"]`` the
    ``(args, kwargs)`` of each of those calls, in order.

    While active, each function named in :data:`COUNTED_FUNCTIONS` is replaced by a counting
    wrapper wherever a reference to it is kept: in ``torch.distributed``, in its
    ``distributed_c10d`` module, and in the globals of the ``functions`` you pass (where
    ``from torch.distributed import all_reduce`` put a reference of its own). A collective
    that calls another one (``all_gather_object`` calls ``all_gather``) counts once, as the
    outer call.
    """

    def __init__(self, *functions: Callable, keep_arguments: bool = True) -> None:
        self.functions = functions
        self.keep_arguments = keep_arguments  # False: count only (a long run keeps no tensors)
        self.calls: Counter = Counter()
        self.arguments: dict[str, list[tuple[tuple, dict]]] = defaultdict(list)
        self._local = threading.local()  # .depth > 0: inside a counted call (or a DDP hook)
        self._undo: list | None = None

    def __getitem__(self, name: str) -> int:
        return self.calls[name]

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in sorted(self.calls.items()))
        return f"CollectiveCounter({inner})"

    # -- the torch.distributed functions -------------------------------------------------------

    @contextmanager
    def _inside(self) -> Iterator[bool]:
        """Yields True for an outer call, False for one made inside another (or a DDP hook)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield depth == 0
        finally:
            self._local.depth = depth

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def counted(*args, **kwargs):
            __tracebackhide__ = True  # a rank's traceback shows the reader's call, not this
            with self._inside() as outer:
                if outer:
                    self.calls[name] += 1
                    if self.keep_arguments:
                        self.arguments[name].append((args, kwargs))
                return original(*args, **kwargs)

        return counted

    def __enter__(self) -> CollectiveCounter:
        from torch.distributed import distributed_c10d

        if self._undo is not None:
            raise RuntimeError("this CollectiveCounter is already counting; use a new one.")
        wrappers = {}
        for name in COUNTED_FUNCTIONS:
            original = getattr(distributed_c10d, name, getattr(dist, name, None))
            wrapper = self._wrap(name, original) if original is not None else None
            while original is not None:  # another counter's wrapper (the launcher counts
                wrappers[id(original)] = wrapper  # too), and the function it wraps, which a
                original = getattr(original, "__wrapped__", None)  # module may hold itself
        namespaces = [vars(dist), vars(distributed_c10d)]
        self._undo = _swap_in(wrappers, namespaces, self.functions)
        return self

    def __exit__(self, *exc) -> None:
        _swap_back(self._undo or [])
        self._undo = None

    # -- DDP -------------------------------------------------------------------------------------

    def watch(self, ddp_model, hook: Callable | None = None, state: Any = None):
        """Count the gradient buckets that ``ddp_model`` all-reduces; returns ``ddp_model``.

        DDP does not call ``dist.all_reduce``: its reducer talks to the process group
        directly, in buckets of gradients, during ``backward()``. So this registers a DDP
        *communication hook* that counts one per bucket and then runs ``hook`` (default:
        torch's ``allreduce_hook``, which is what DDP does without a hook: divide by the world
        size, all-reduce). Call it once, before the first ``backward()`` (a DDP rule for
        hooks); pass your own ``hook`` and ``state`` if you use another one. DDP's other
        communication (the broadcast of rank 0's parameters when it is built, the buffer
        broadcast before each forward) is not counted. Each bucket counts once, under
        ``DDP_KEY``, even though the hook itself calls ``dist.all_reduce``. Unlike the
        ``dist.*`` counting, this counts whether or not the ``with`` block is active.
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if hook is None:
            hook = default_hooks.allreduce_hook
            state = ddp_model.process_group if state is None else state

        def counting_hook(hook_state, bucket):
            self.calls[DDP_KEY] += 1
            with self._inside():  # the hook's own dist.all_reduce is this same bucket
                return hook(hook_state, bucket)  # it only starts the all-reduce: no waiting

        ddp_model.register_comm_hook(state, counting_hook)
        return ddp_model


def _swap_in(replacements: dict[int, Any], namespaces: list[dict],
             functions: Sequence[Any] = ()) -> list[tuple]:
    """Put ``replacements[id(value)]`` in place of every such value in ``namespaces`` and in
    the globals of ``functions`` (where ``from torch.distributed import all_reduce`` or
    ``from torch import save`` put a reference of its own).

    Returns what :func:`_swap_back` needs to put the originals back.
    """
    namespaces = list(namespaces)
    for fn in functions:
        fn_globals = getattr(fn, "__globals__", None)
        if isinstance(fn_globals, dict) and all(fn_globals is not n for n in namespaces):
            namespaces.append(fn_globals)
    undo = []
    for namespace in namespaces:
        for key, value in list(namespace.items()):
            replacement = replacements.get(id(value))
            if replacement is not None:
                undo.append((namespace, key, value))
                namespace[key] = replacement
    return undo


def _swap_back(undo: list[tuple]) -> None:
    for namespace, key, value in reversed(undo):
        namespace[key] = value


def count_collectives(*functions: Callable) -> CollectiveCounter:
    """Inside the ranks: count the collective calls made while a ``with`` block runs.

    While active, it replaces the functions named in :data:`COUNTED_FUNCTIONS` with counting
    wrappers in ``torch.distributed`` (and puts the originals back on exit). So it counts
    every call made *through the module*, ``dist.all_reduce(...)``, by your code or by any
    library that calls it that way (``gst.checks``, ``Join``), once per call whatever the
    tensor's size; a collective that torch implements with another one counts once. Calls
    through a name imported before the block (``from torch.distributed import all_reduce``)
    are counted in the ``functions`` you pass (their module's globals). DDP's gradient
    all-reduces are not ``dist.*`` calls: count them with ``counter.watch(ddp_model)`` (see
    :meth:`CollectiveCounter.watch`).

    Example (in a function run by ``gst.launch``):
        >>> import gradsync_tutorial as gst
        >>> def step(rank, world_size):
        ...     import torch, torch.distributed as dist
        ...     with gst.detect.count_collectives() as calls:
        ...         for _ in range(3):
        ...             dist.all_reduce(torch.ones(1))
        ...     return calls["all_reduce"]
        >>> gst.launch(step, world_size=2)
        [3, 3]

    Introduced in ``notebooks/04_pitfalls.ipynb``.
    """
    return CollectiveCounter(*functions)
