"""Is my own distributed step right? Compare its gradients with one process's on the whole batch.

Call :func:`verify_gradients` on every rank after your backward(s) and whatever gradient sync
you do (DDP, FSDP2, a manual ``all_reduce``, accumulation, a pipeline), before
``optimizer.step()``. It gathers every rank's batch, lets a copy of the model as it was before
the step (``reference``: taken before ``fully_shard``) compute the gradient that ONE process
would get on the whole batch, and compares it with yours, parameter by parameter. A wrong
factor is named (the world size: notebook 02; the micro-batches: notebooks 07 and 11; a group's
size: notebook 12), and so is a mean of means with the weights you gave each rank's or
micro-batch's mean (notebook 07), or ranks that disagree (a missing sync). Every rank returns
the same :class:`Report`.

    >>> import gradsync_tutorial as gst
    >>> def step(rank, world_size):
    ...     import copy
    ...     import torch
    ...     import torch.distributed as dist
    ...     from gradsync_tutorial.verify import verify_gradients
    ...     torch.manual_seed(0)
    ...     model = torch.nn.Linear(3, 1).double()
    ...     reference = copy.deepcopy(model)           # a plain copy, before any wrapper
    ...     batch = torch.randn(4, 3, dtype=torch.float64) + rank    # this rank's batch
    ...     def loss_fn(module, x):                     # the loss ONE process minimises
    ...         return module(x).pow(2).mean()
    ...     loss_fn(model, batch).backward()
    ...     for p in model.parameters():
    ...         dist.all_reduce(p.grad)                 # summed... and never divided
    ...     report = verify_gradients(model, batch, loss_fn, reference=reference)
    ...     return report.ok, report.worst.diagnosis
    >>> gst.launch(step, world_size=2)
    [(False, 'factor 2 = the world size: summed, not divided by the world size (notebook 02)'),
     (False, 'factor 2 = the world size: summed, not divided by the world size (notebook 02)')]

It imports torch only, so a torchrun script can ``from gradsync_tutorial.verify import
verify_gradients``. It costs a copy of the model and N times one rank's batch on every rank:
check a tiny configuration of your code (float64 for the finest verdict), a step or two.
Nothing of your training changes: parameters, gradients, buffers and the random state (CPU
and CUDA) are as before the call.

What it cannot check it refuses, on every rank together: dropout or BatchNorm in training mode
(random masks and per-rank statistics are not an averaging question: check in ``eval()``). It
cannot see randomness inside ``forward`` (``F.dropout``), it checks gradients only (not the
optimizer's state), and a model must fit one device: check a small configuration of the same
code, with ``name_map`` for stages whose names differ.

Introduced in ``notebooks/15_verify_your_own_step.ipynb``; the mistakes it names are those of
notebooks 02, 07, 08, 11 and 12 (:mod:`gradsync_tutorial.diagnoses` words the factors).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import _verify_report as _report
from ._verify_report import DEFAULT_RTOL, CannotVerify, Report, Row

__all__ = ["DEFAULT_RTOL", "CannotVerify", "Report", "Row", "clean_name", "padded",
           "verify_gradients"]

#: Path parts that wrappers add to parameter names (DDP adds a leading ``module.``).
WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
             nn.FeatureAlphaDropout)


# --------------------------------------------------------------------------------------------
# Batches: a tensor, or tuples, lists and dicts of them
# --------------------------------------------------------------------------------------------


def _structure(batch: Any, path: str = "batch") -> Any:
    """A comparable description of ``batch`` (types, dtypes, dimensions); ``TypeError`` names a
    leaf that is not a tensor."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", str(batch.dtype), batch.dim())
    if isinstance(batch, Mapping):
        return ("dict", tuple((k, _structure(v, f"{path}[{k!r}]")) for k, v in batch.items()))
    if isinstance(batch, (tuple, list)):
        return (type(batch).__name__,
                tuple(_structure(v, f"{path}[{i}]") for i, v in enumerate(batch)))
    raise TypeError(f"{path} is of type {type(batch).__name__}, not a tensor: pass the batch as a "
                    "tensor, or a tuple, list or dict of tensors (the tensors the loss reads)")


def _rebuild(like: Any, children: list) -> Any:
    if isinstance(like, Mapping):
        return dict(zip(like.keys(), children, strict=True))
    if hasattr(like, "_fields"):  # a namedtuple
        return type(like)(*children)
    return type(like)(children)


def _map(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    values = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
    return _rebuild(batch, [_map(v, fn) for v in values])


def _zip_leaves(chunks: Sequence[Any], join: Callable[[list], torch.Tensor], key: Any = None):
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return join(list(chunks), key)
    keys = list(first.keys()) if isinstance(first, Mapping) else range(len(first))
    return _rebuild(first, [_zip_leaves([c[k] for c in chunks], join, k) for k in keys])


def concat_dim0(chunks: Sequence[Any]) -> Any:
    """The default ``concat``: every tensor of the chunks joined along dim 0, in order."""
    return _zip_leaves(chunks, lambda ts, _key: torch.cat(ts))


def padded(pad_value: float | Mapping[Any, float] = 0) -> Callable[[Sequence[Any]], Any]:
    """A ``concat`` for padded sequences of different lengths: each tensor is padded at the end
    of every dimension but the first to the longest chunk's size, then joined along dim 0.

    ``pad_value`` is one number, or one per key (a dict batch) or position (a tuple batch),
    e.g. ``padded({"input_ids": PAD, "labels": -100})``.

        >>> import torch
        >>> from gradsync_tutorial.verify import padded
        >>> padded(-100)([torch.tensor([[1, 2, 3]]), torch.tensor([[4]])]).tolist()
        [[1, 2, 3], [4, -100, -100]]
    """

    def join(tensors: list, key: Any) -> torch.Tensor:
        value = pad_value[key] if isinstance(pad_value, Mapping) else pad_value
        size = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
        out = []
        for t in tensors:
            big = t.new_full((t.shape[0], *size), value)
            big[tuple(slice(0, n) for n in t.shape)] = t
            out.append(big)
        return torch.cat(out)

    return lambda chunks: _zip_leaves(chunks, join)


# --------------------------------------------------------------------------------------------
# Names, and what a rank can tell before any collective
# --------------------------------------------------------------------------------------------


def clean_name(name: str) -> str:
    """A parameter name without its wrappers' parts: ``module.`` (DDP) in front, and
    ``_orig_mod`` (torch.compile), ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``.

        >>> from gradsync_tutorial.verify import clean_name
        >>> clean_name("module._orig_mod.layers.0._checkpoint_wrapped_module.weight")
        'layers.0.weight'
    """
    parts = name.split(".")
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(p for p in parts if p not in WRAPPER_PARTS)


def _user_params(model: nn.Module, name_map: Mapping[str, str] | None) -> dict:
    """Reference name -> the user's parameter."""
    name_map = name_map or {}
    out = {}
    for name, p in model.named_parameters():
        name = clean_name(name)
        out[name_map.get(name, name)] = p
    return out


def _is_sharded(module: nn.Module) -> bool:
    """FSDP2 or tensor parallelism: parameters that are DTensors (and refuse deepcopy)."""
    kinds = {c.__name__ for m in module.modules() for c in type(m).__mro__}
    return "FSDPModule" in kinds or any(type(p).__name__ == "DTensor" for p in module.parameters())


def _stochastic(module: nn.Module, who: str, sync_bn_ok: bool) -> str | None:
    for name, m in module.named_modules():
        if m.training and isinstance(m, _DROPOUTS) and m.p > 0:
            return _report.DROPOUT.format(who=who, name=name or type(m).__name__, p=m.p)
        if m.training and isinstance(m, _BatchNorm) and not sync_bn_ok:
            if not isinstance(m, nn.SyncBatchNorm):
                return _report.BATCHNORM.format(who=who, name=name or type(m).__name__)
    return None


def _arch_error(user: dict, reference: nn.Module) -> str | None:
    ref = {clean_name(n): tuple(p.shape) for n, p in reference.named_parameters()}
    unknown = [n for n in user if n not in ref]
    shapes = [f"{n} {tuple(p.shape)} vs {ref[n]}" for n, p in user.items()
              if n in ref and tuple(p.shape) != ref[n]]
    if unknown or shapes:
        return _report.ARCHITECTURE.format(unknown=unknown or "none", shapes=shapes or "none")
    return None


def _local_refusal(model, reference, batches, name_map) -> str | None:
    """What this rank alone can tell is wrong, worded for the user; None if nothing."""
    if _is_sharded(reference):
        return _report.SHARDED_REFERENCE
    if not batches:
        return _report.NO_BATCH
    labels = ["local_batch"] if len(batches) == 1 else [f"micro_batches[{i}]" for i in
                                                        range(len(batches))]
    try:
        shapes = {_structure(b, label) for b, label in zip(batches, labels, strict=True)}
    except TypeError as e:
        return f"{e}."
    if len(shapes) > 1:
        return _report.MICRO_STRUCTURE
    sync_bn = any(isinstance(m, nn.SyncBatchNorm) and m.training for m in model.modules())
    error = _stochastic(model, "the model", False) or _stochastic(reference, "the reference",
                                                                   sync_bn)
    if error:
        return error
    trainable = [p for p in model.parameters() if p.requires_grad]
    if trainable and all(p.grad is None for p in trainable):
        return _report.NO_GRADIENTS
    return _arch_error(_user_params(model, name_map), reference)


def _facts(model, reference, batches, name_map) -> dict:
    """What every rank tells the others before anything else: its refusal, or its batches and
    the names it holds. An unexpected error is a refusal too, so that no rank is left waiting."""
    try:
        error = _local_refusal(model, reference, batches, name_map)
    except Exception as e:
        error = f"reading the model, the reference and the batch raised {type(e).__name__}: {e}"
    if error:
        return {"error": error}
    return {
        "error": None,
        "structure": _structure(batches[0]),
        "micro_batches": len(batches),
        "held": sorted(_user_params(model, name_map)),
        "reference": [clean_name(n) for n, _ in reference.named_parameters()],
        "batches": [_map(b, lambda t: t.detach().cpu()) for b in batches],
    }


def _gather(obj: Any, group) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _refuse_together(facts: list) -> None:
    """Raise the same CannotVerify on every rank if any rank, or the ranks together, refuse."""
    bad = [(r, f["error"]) for r, f in enumerate(facts) if f["error"]]
    if bad:
        rank, error = bad[0]
        others = [r for r, e in bad[1:] if e == error]
        who = _report.ranks([rank, *others])
        raise CannotVerify(f"verify_gradients cannot check this step ({who}): {error}")
    for what, key in (("batches of another structure", "structure"),
                      ("a different number of micro-batches", "micro_batches"),
                      ("references of different architectures", "reference")):
        differ = [r for r, f in enumerate(facts) if f[key] != facts[0][key]]
        if differ:
            raise CannotVerify(_report.RANKS_DIFFER.format(ranks=_report.ranks(differ), what=what))
    held = {n for f in facts for n in f["held"]}
    missing = [n for n in facts[0]["reference"] if n not in held]
    if missing:
        raise CannotVerify(_report.NOT_HELD.format(missing=missing))


# --------------------------------------------------------------------------------------------
# The two gradients, and what one rank finds
# --------------------------------------------------------------------------------------------


def _user_grads(model: nn.Module, name_map) -> dict:
    """Reference name -> this rank's full gradient (DTensors gathered: a collective, in the
    model's order on every rank), or None."""
    out = {}
    for name, p in _user_params(model, name_map).items():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach()
    return out


def _reference_grads(reference: nn.Module, loss_fn, batch, device: torch.device) -> dict:
    """Reference name -> one process's gradient on the whole batch, on a fresh copy, with the
    random state forked (so the caller's is untouched)."""
    twin = copy.deepcopy(reference)
    named = [(clean_name(n), p) for n, p in twin.named_parameters()]
    trainable = [p for _, p in named if p.requires_grad]
    cuda = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        loss = loss_fn(twin, batch)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            got = (f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
                   if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
            raise TypeError(_report.NOT_A_LOSS.format(got=got))
        grads = iter(torch.autograd.grad(loss.reshape(()), trainable, allow_unused=True))
    return {n: (next(grads) if p.requires_grad else None) for n, p in named}


@functools.lru_cache(maxsize=64)  # a step or two check the same shapes: made once each
def _pattern(n: int, device: torch.device) -> torch.Tensor:
    """A fixed pattern of ``n`` numbers in [0, 1), the same on every rank: the fractional parts
    of k × the plastic number's inverse (an additive recurrence, spread like random numbers, and
    as cheap as ``arange``)."""
    return torch.arange(n, dtype=torch.float64, device=device).mul_(0.7548776662466927).frac_()


def _stats(g: torch.Tensor | None, r: torch.Tensor | None) -> dict:
    """Sums that the ranks can combine: norms, the fit, a fingerprint of ``g``. Dot products on
    flat float64 vectors, and the difference computed once (never as gg - 2gr + rr, which would
    lose a small difference to rounding)."""
    out: dict = {"mine": g is not None, "ref": r is not None, "dtype": None}
    if g is not None:
        out["dtype"] = str(g.dtype)
        g = g.to(r.device if r is not None else g.device, torch.float64).reshape(-1)
        out["gg"] = torch.dot(g, g).item()
        out["print"] = torch.dot(g, _pattern(g.numel(), g.device)).item()  # replicas differ?
    if r is not None:
        r = r.to(torch.float64).reshape(-1)
        out["rr"] = torch.dot(r, r).item()
    if g is not None and r is not None:
        out["gr"] = torch.dot(g, r).item()
        d = g - r
        out["dd"] = torch.dot(d, d).item()
        out["max"] = max(0.0, -d.min().item(), d.max().item()) if g.numel() else 0.0  # no |d|
        f = out["gr"] / out["rr"] if out["rr"] else 0.0
        d.add_(r, alpha=1.0 - f)  # now g - f r: what no single factor explains
        out["fit"] = torch.dot(d, d).item()
        out["n"] = g.numel()
    return out


def _rows(batch: Any) -> int:
    """How many samples a batch holds: its first tensor's size along dim 0."""
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values() if isinstance(batch, Mapping) else batch))
    return batch.shape[0] if batch.dim() else 1


def _chunk_weights(reference, loss_fn, chunks, device, mine: dict, ref: dict) -> dict | None:
    """Your gradient as a weighted sum of one process's gradients on each chunk (rank 0's
    micro-batches, then rank 1's...): the weights you give them, the ones one process gives
    them (their counts' shares), and what no weighting explains. None where the chunks'
    gradients cannot tell weights apart (fewer numbers than chunks)."""
    names = [n for n, g in mine.items() if g is not None and ref.get(n) is not None]
    kept = [i for i, chunk in enumerate(chunks) if _rows(chunk)]
    if len(kept) < 2 or not names:
        return None

    def flat(grads: dict) -> torch.Tensor:
        parts = [grads[n] if grads.get(n) is not None else torch.zeros_like(ref[n])
                 for n in names]
        return torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in parts])

    basis = torch.stack([flat(_reference_grads(reference, loss_fn,
                                               _map(chunks[i], lambda t: t.to(device)),
                                               device)) for i in kept], dim=1)
    if basis.shape[0] <= basis.shape[1] or torch.linalg.matrix_rank(basis) < basis.shape[1]:
        return None
    yours, theirs = flat(mine), flat(ref)
    w = torch.linalg.lstsq(basis, yours[:, None]).solution[:, 0]
    w_ref = torch.linalg.lstsq(basis, theirs[:, None]).solution[:, 0]
    left = (basis @ w - yours).norm() / yours.norm().clamp_min(1e-300)
    return {"chunks": kept, "yours": w.tolist(), "one_process": w_ref.tolist(),
            "residual": left.item()}


def _findings(model, reference, loss_fn, facts, name_map, concat, rtol) -> dict:
    """This rank's per-parameter sums (and, for a wrong gradient that no factor explains, the
    chunks' weights), or the error its reference computation raised."""
    mine = _user_grads(model, name_map)  # first: full_tensor() is a collective
    first = next(iter(reference.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    try:
        chunks = [b for f in facts for b in f["batches"]]
        batch = _map((concat or concat_dim0)(chunks), lambda t: t.to(device))
        ref = _reference_grads(reference, loss_fn, batch, device)
        params = {n: _stats(g, ref.get(n)) for n, g in mine.items()}
        weights = None
        if _report.needs_weights(params, rtol):
            weights = _chunk_weights(reference, loss_fn, chunks, device, mine, ref)
    except Exception as e:  # told to every rank, then raised on every rank
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None, "params": params, "weights": weights}


def verify_gradients(
    model: nn.Module,
    local_batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    reference: nn.Module,
    rtol: float | None = None,
    group: Any = None,
    name_map: Mapping[str, str] | None = None,
    micro_batches: Sequence[Any] | None = None,
    concat: Callable[[Sequence[Any]], Any] | None = None,
    group_sizes: Mapping[str, int] | None = None,
) -> Report:
    """Compare this step's gradients with one process's on the whole batch; the same
    :class:`Report` on every rank. Call it on every rank, after backward and your sync, before
    ``optimizer.step()``; see the module's docstring for an example.

    Args:
        model: your model as it trains: plain, DDP, ``fully_shard``-ed (DTensor gradients are
            gathered), compiled; wrapper parts of the names are ignored.
        local_batch: this rank's batch: a tensor, or a tuple, list or dict of tensors.
        loss_fn: ``loss_fn(module, batch)``: the loss ONE process minimises on a whole batch
            (a mean over samples, a token mean with ``ignore_index``...), not your per-rank one.
        reference: a module with whole parameters holding the weights this step started
            from: ``copy.deepcopy(model)`` taken before ``fully_shard`` / ``parallelize_module``
            (a plain or DDP model may be passed itself: it is only read, on a copy).
        rtol: the relative error allowed; default from the gradients' dtype.
        group: the data-parallel process group whose batches make the whole batch (with
            nccl, each rank's current CUDA device set, as torchrun scripts do). For a pipeline
            without data parallelism, the first stage passes the batch and the others empty
            tensors (0 rows) of the same structure.
        name_map: your parameter name -> the reference's, for a pipeline stage or a model
            that names them differently. Each rank compares the parameters it holds.
        micro_batches: with gradient accumulation, this rank's micro-batches in order, instead
            of ``local_batch`` (pass ``None`` there).
        concat: joins the chunks (rank 0's micro-batches, then rank 1's...) into one batch;
            default along dim 0; :func:`padded` for sequences of different lengths.
        group_sizes: names of your groups' sizes, e.g. ``{"expert-parallel": 2}``: a wrong
            factor equal to one of them, or to a ratio of two, is named.

    Raises:
        CannotVerify: on every rank together, before a collective could leave one waiting:
            active dropout or BatchNorm in training mode, no gradients yet, a batch that is not
            tensors, ranks with different structures, a reference of another architecture or
            wrapped, ``loss_fn`` raising (the rank named).
    """
    if micro_batches is not None and local_batch is not None:
        raise CannotVerify("pass local_batch or micro_batches=[...], not both "
                           "(verify_gradients(model, None, loss_fn, micro_batches=[...])).")
    batches = list(micro_batches) if micro_batches is not None else [local_batch]
    if isinstance(reference, nn.parallel.DistributedDataParallel):
        reference = reference.module  # DDP's weights are the plain model's: only read
    facts = _gather(_facts(model, reference, batches, name_map), group)
    _refuse_together(facts)
    found = _gather(_findings(model, reference, loss_fn, facts, name_map, concat, rtol), group)
    return _report.combine(found, facts[0]["reference"], rtol, len(facts), len(batches),
                           group_sizes or {})
