"""Why DDP is fast: four ways to average gradients, from notebook 02's loop to a mini DDP.

Every variant leaves each rank holding the *mean* of the ranks' gradients in ``param.grad``, as
``DistributedDataParallel`` does; they differ only in how many ``all_reduce`` calls they make
and *when*. In teaching order:

1. :func:`average_per_parameter` - notebook 02's loop: one call per parameter, after backward;
2. :class:`FlatAverager` - one flat buffer (a :class:`Bucket`), one call, after backward;
3. :class:`BucketedAverager` - buckets of about ``bucket_cap_mb``, one call each, after backward;
4. :class:`OverlappedAverager` - a mini DDP: gradient hooks launch each bucket's call while
   backward is still running, and ``wait()`` collects them before ``optimizer.step()``.

:func:`prepare` gives all of them, and DDP itself, one shape for the training loop, and
:func:`ring_all_reduce` shows what one ``all_reduce`` does inside, with ``send``/``recv``.

Inside a function run by ``gst.launch``:

    >>> import gradsync_tutorial as gst
    >>> def step(rank, world_size, variant):
    ...     import torch
    ...     import torch.nn.functional as F
    ...     torch.manual_seed(0)                          # the same weights on every rank
    ...     model = gst.model.Net()
    ...     net, average = gst.averaging.prepare(model, variant)
    ...     x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(rank))
    ...     F.nll_loss(net(x), torch.zeros(8, dtype=torch.long)).backward()
    ...     average()                                     # every rank: the mean gradient
    ...     grads = [(name, p.grad) for name, p in model.named_parameters()]
    ...     return gst.checks.max_diff_across_ranks(grads)
    >>> gst.launch(step, world_size=2, args=("overlap",))
    [0.0, 0.0]

Introduced in ``notebooks/05_performance.ipynb``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "VARIANTS",
    "Bucket",
    "BucketedAverager",
    "FlatAverager",
    "OverlappedAverager",
    "average_per_parameter",
    "make_buckets",
    "prepare",
    "ring_all_reduce",
]

#: The variant names :func:`prepare` accepts, in teaching order.
VARIANTS = ("per-parameter", "flat", "bucketed", "overlap", "ddp")


# --------------------------------------------------------------------------------------------
# 1. Per parameter: one all_reduce per gradient (notebook 02)
# --------------------------------------------------------------------------------------------


def average_per_parameter(model: nn.Module) -> None:
    """Variant 1 (notebook 05): notebook 02's loop, one ``all_reduce`` per parameter.

    Correct, but every call pays the collective's fixed cost (its latency) again: 8 calls for
    the course's CNN, hundreds for a real network. This is the package's one
    ``average_gradients``; notebooks 02 to 04 and ``scripts/train_manual.py`` write it out
    again on purpose, as the lesson (each copy says so where it stands).
    """
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:  # a parameter that took no part in the loss
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
        param.grad /= world_size  # sum / N = mean over ranks


# --------------------------------------------------------------------------------------------
# 2. Flat: every gradient in one buffer, one all_reduce
# --------------------------------------------------------------------------------------------


class Bucket:
    """A flat buffer for a group of parameters' gradients, allocated once (notebook 05).

    ``fill()`` copies the gradients into the buffer (flatten); after an ``all_reduce`` of
    ``buffer``, ``unload(n)`` writes ``buffer / n`` back into each ``.grad`` (unflatten).
    The buffer is allocated once and reused every step, as DDP does: a fresh 40 MB
    ``torch.cat`` every step costs more than the copy itself (the memory is new to the process,
    so every page faults on first touch).
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        p0 = self.params[0]
        self.buffer = torch.empty(sum(p.numel() for p in self.params), dtype=p0.dtype,
                                  device=p0.device)
        # One view of the buffer per parameter, shaped like it: writing a slot writes the buffer.
        pieces = self.buffer.split([p.numel() for p in self.params])
        self.slots = [piece.view_as(p) for piece, p in zip(pieces, self.params, strict=True)]

    def fill(self) -> None:
        """Copy every parameter's gradient into its slot of the buffer."""
        for p, slot in zip(self.params, self.slots, strict=True):
            if p.grad is None:
                raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has no gradient: "
                                   "every parameter must take part in the loss on every rank.")
            slot.copy_(p.grad)

    def unload(self, world_size: int) -> None:
        """Write ``slot / world_size``, the mean over the ranks, into every ``.grad``."""
        for p, slot in zip(self.params, self.slots, strict=True):
            torch.div(slot, world_size, out=p.grad)  # divide and copy back in one pass


class FlatAverager:
    """Variant 2 (notebook 05): all gradients in one flat buffer, one ``all_reduce``.

    The latency is paid once per step instead of once per parameter; the price is a buffer as
    large as all gradients together, and two copies (into the buffer and back)::

        average = FlatAverager(model)   # once: allocates the buffer
        loss.backward()
        average()                       # every rank now holds the mean gradient
    """

    def __init__(self, model: nn.Module) -> None:
        self.bucket = Bucket(p for p in model.parameters() if p.requires_grad)

    def __call__(self) -> None:
        self.bucket.fill()  # flatten: copy every gradient into the buffer
        dist.all_reduce(self.bucket.buffer, op=dist.ReduceOp.SUM)  # one call for the model
        self.bucket.unload(dist.get_world_size())  # unflatten: the means back into .grad


# --------------------------------------------------------------------------------------------
# 3. Bucketed: buckets of about bucket_cap_mb, one all_reduce each
# --------------------------------------------------------------------------------------------


def make_buckets(params: Iterable[torch.Tensor], bucket_cap_mb: float = 25.0) -> list[list]:
    """Group parameters into buckets of about ``bucket_cap_mb`` MiB, **last parameter first**.

    Backward produces the last layer's gradients first, so buckets in reverse order fill up in
    the order backward runs (DDP's order). As in DDP, a bucket closes as soon as it holds at
    least the cap, so a tensor larger than the cap gets a bucket of its own. Used by
    :class:`BucketedAverager` and :class:`OverlappedAverager` (notebook 05).

        >>> from gradsync_tutorial.averaging import make_buckets
        >>> from gradsync_tutorial.model import Net
        >>> net = Net()
        >>> names = {p: name for name, p in net.named_parameters()}
        >>> for bucket in make_buckets(net.parameters(), bucket_cap_mb=0.015):  # 15.4 KiB
        ...     print([names[p] for p in bucket])
        ['fc2.bias', 'fc2.weight', 'fc1.bias', 'fc1.weight']
        ['conv2.bias', 'conv2.weight']
        ['conv1.bias', 'conv1.weight']
    """
    cap = bucket_cap_mb * 1024 * 1024  # bytes, as DDP counts them
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:  # full: close it
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedAverager:
    """Variant 3 (notebook 05): one ``all_reduce`` per bucket of about ``bucket_cap_mb`` MiB.

    Each bucket's call starts asynchronously (``async_op=True``) as soon as the bucket is
    filled, so filling the next bucket overlaps with sending this one. After backward this
    buys little over :class:`FlatAverager`; its point is that buckets let the next variant
    start communicating *during* backward.
    """

    def __init__(self, model: nn.Module, bucket_cap_mb: float = 25.0) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [Bucket(group) for group in make_buckets(params, bucket_cap_mb)]

    def __call__(self) -> None:
        works = []
        for bucket in self.buckets:
            bucket.fill()
            works.append(dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, async_op=True))
        for bucket, work in zip(self.buckets, works, strict=True):
            work.wait()  # this bucket's sum has arrived
            bucket.unload(dist.get_world_size())


# --------------------------------------------------------------------------------------------
# 4. Overlapped: a mini DDP, communication during backward
# --------------------------------------------------------------------------------------------


class OverlappedAverager:
    """Variant 4 (notebook 05): a mini DDP that averages *while* backward runs.

    A hook on every parameter (``register_post_accumulate_grad_hook``) fires as soon as that
    parameter's gradient is final, and copies it into its slot of a bucket. When a bucket is
    full, its ``all_reduce`` starts asynchronously (``async_op=True``) and backward goes on
    computing the earlier layers' gradients meanwhile. Calling the averager (:meth:`wait`)
    waits for the calls and writes the means back into ``.grad``, before ``optimizer.step()``::

        average = OverlappedAverager(model)  # once: broadcasts rank 0's weights, adds hooks
        loss.backward()                      # the hooks launch each bucket's all_reduce
        average()                            # every rank now holds the mean gradient

    Buckets are launched in bucket order on every rank, since every rank must issue the same
    collectives in the same order. Like DDP (without ``find_unused_parameters``), it expects
    every parameter to receive a gradient in every backward, and one backward per step.
    """

    def __init__(self, model: nn.Module, bucket_cap_mb: float = 25.0) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # like DDP: start every replica from rank 0's weights
            dist.broadcast(p.detach(), src=0)
        self.buckets = [Bucket(group) for group in make_buckets(params, bucket_cap_mb)]
        self.handles = []
        for i, bucket in enumerate(self.buckets):
            for p, slot in zip(bucket.params, bucket.slots, strict=True):
                hook = functools.partial(self._grad_ready, i, slot)
                self.handles.append(p.register_post_accumulate_grad_hook(hook))
        self._reset()

    def _reset(self) -> None:
        self.missing = [len(b.params) for b in self.buckets]  # gradients each bucket awaits
        self.works = []  # one handle per launched bucket, in bucket order

    def _grad_ready(self, i: int, slot: torch.Tensor, param: torch.Tensor) -> None:
        """Called by autograd, during backward, once ``param.grad`` is final."""
        slot.copy_(param.grad)  # into its place in bucket i
        self.missing[i] -= 1
        # Launch every full bucket whose predecessors are launched: the same order on all ranks.
        while len(self.works) < len(self.buckets) and self.missing[len(self.works)] == 0:
            buffer = self.buckets[len(self.works)].buffer
            self.works.append(dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True))

    def wait(self) -> None:
        """Wait for every bucket's ``all_reduce``; write the means into ``.grad``."""
        if len(self.works) < len(self.buckets):
            self._reset()
            raise RuntimeError(
                "the averager was called before every bucket was launched: call it once after "
                "each loss.backward(), and make every parameter take part in the loss."
            )
        for bucket, work in zip(self.buckets, self.works, strict=True):
            work.wait()
            bucket.unload(dist.get_world_size())
        self._reset()

    __call__ = wait

    def remove(self) -> None:
        """Remove the hooks: the model trains without averaging again."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


# --------------------------------------------------------------------------------------------
# One shape for the training loop
# --------------------------------------------------------------------------------------------


def prepare(
    model: nn.Module, variant: str, *, bucket_cap_mb: float = 25.0, **ddp_options
) -> tuple[nn.Module, Callable[[], None]]:
    """Return ``(net, average)`` for one of :data:`VARIANTS`, so one loop runs them all::

        net, average = prepare(model, "flat")
        loss = F.nll_loss(net(x), y)
        loss.backward()
        average()               # every rank now holds the mean gradient in model's .grad
        optimizer.step()

    ``net`` is ``model`` itself, or for ``"ddp"`` the ``DistributedDataParallel`` wrapper
    (built with ``bucket_cap_mb`` and ``ddp_options``, e.g. ``gradient_as_bucket_view=True``),
    whose ``average`` does nothing, since DDP averages inside ``backward()``. Keep using
    ``model`` for the optimizer and the state dict. Introduced in notebook 05.
    """
    if variant == "per-parameter":
        return model, functools.partial(average_per_parameter, model)
    if variant == "flat":
        return model, FlatAverager(model)
    if variant == "bucketed":
        return model, BucketedAverager(model, bucket_cap_mb)
    if variant == "overlap":
        return model, OverlappedAverager(model, bucket_cap_mb)
    if variant == "ddp":
        device = next(model.parameters()).device
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb, **ddp_options
        )
        return ddp, lambda: None
    raise ValueError(f"unknown variant {variant!r}: use one of {', '.join(VARIANTS)}.")


# --------------------------------------------------------------------------------------------
# Inside all_reduce: a ring of send/recv
# --------------------------------------------------------------------------------------------


def ring_all_reduce(tensor: torch.Tensor) -> int:
    """Sum ``tensor`` over all ranks in place with a ring of ``send``/``recv``; return the
    number of bytes this rank sent.

    Rank r only talks to its neighbours: it sends to r+1 and receives from r-1. The tensor is
    cut into N chunks (sizes may differ by one element). Then:

    1. *reduce-scatter*, N-1 steps: pass a chunk to the right, add the one arriving from the
       left to your own; afterwards rank r holds the full sum of chunk r+1;
    2. *all-gather*, N-1 steps: pass the finished chunks around the ring.

    Each rank sends 2(N-1) chunks, 2(N-1)/N times the tensor's size in all: as N grows, that
    tends to 2x the size. No all-reduce in which the ranks do the additions themselves can send
    less (hardware that adds in the network can). Call it on every rank, with the same shape,
    on the group's device (notebook 05).

        >>> import gradsync_tutorial as gst
        >>> def ring(rank, world_size):
        ...     import torch
        ...     t = torch.full((10,), rank + 1.0)
        ...     sent = gst.averaging.ring_all_reduce(t)
        ...     return t[0].item(), sent
        >>> gst.launch(ring, world_size=4)
        [(10.0, 60), (10.0, 64), (10.0, 60), (10.0, 56)]
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works in place on a contiguous tensor: pass "
                         "t.contiguous() and use the result.")
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(tensor.view(-1).tensor_split(n))  # views: writing them writes `tensor`
    incoming = torch.empty_like(chunks[0])  # chunk 0 is the largest
    sent = 0

    def exchange(send: int, recv: int) -> torch.Tensor:
        """Send chunk `send` to the right while receiving chunk `recv` from the left."""
        nonlocal sent
        out, got = chunks[send], incoming[: chunks[recv].numel()]
        request = dist.isend(out, dst=right) if out.numel() else None  # async: no deadlock
        if got.numel():
            dist.recv(got, src=left)
        if request is not None:
            request.wait()
        sent += out.numel() * out.element_size()
        return got

    for step in range(n - 1):  # 1. reduce-scatter
        recv = (rank - step - 1) % n
        chunks[recv] += exchange((rank - step) % n, recv)  # add the left neighbour's partial sum
    for step in range(n - 1):  # 2. all-gather
        recv = (rank - step) % n
        chunks[recv].copy_(exchange((rank + 1 - step) % n, recv))  # a finished chunk
    return sent
