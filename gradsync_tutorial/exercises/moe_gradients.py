"""Exercise of notebook 12 (``12_expert_gradients.ipynb``): ``sync_moe_gradients(dense_params,
expert_params, expert_group)`` reduces, after each rank's backward through an expert-parallel
layer, the dense gradients over every rank and the expert gradients over the ranks holding the
same expert, both divided by the whole data-parallel size.

The check runs the learner's function on 2 ranks (EP 2, EDP 1), 3 ranks (EP 3, EDP 1) and 4
ranks (EP 2, EDP 2): no number hard-coded in place of the world size or of a group's size is
right at all three. Each rank routes its own fresh random tokens (from a seed rank 0 draws and
sends) through a top-1 layer with one expert per rank of its expert-parallel group, two
``all_to_all_single`` calls with uneven splits, and backward on its own mean loss. Each rank
also computes one process's gradients on every rank's tokens, and keeps its own gradients from
before the learner's function: the diagnoses build the reference's and each usual mistake's
gradients from them (the expert group's size as divisor, experts reduced over all ranks, no sum
over the expert group, no division).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..moe import ToyMoE
from . import common, evidence
from .common import Run

HIDDEN, TOKENS = 3, 5  # features per token, tokens per rank
DENSE = ("dense.weight", "dense.bias", "router.weight", "router.bias")


def experts_at(world_size: int) -> int:
    """The expert-parallel size EP at ``world_size`` ranks: 3 at 3 ranks, else 2."""
    return 3 if world_size == 3 else 2


def _label(world_size: int) -> str:
    return f"on {world_size} ranks"


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        import torch.distributed as dist

        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def _expert_parallel(layer: ToyMoE, expert: nn.Module, x: torch.Tensor, ep: int,
                     group: Any) -> torch.Tensor:
    import torch.distributed as dist

    h, choice, gate = layer.route(x)
    order = torch.argsort(choice, stable=True)
    send = torch.bincount(choice, minlength=ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send, recv = send.tolist(), recv.tolist()
    back = _AllToAll.apply(expert(_AllToAll.apply(h[order], send, recv, group)), recv, send,
                           group)
    return gate * back[torch.argsort(order)]


def _tokens(seed: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(world_size * TOKENS, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(world_size * TOKENS, HIDDEN, generator=g, dtype=torch.float64))


# --------------------------------------------------------------------------------------------
# On the ranks
# --------------------------------------------------------------------------------------------


def _grads(named: dict[str, nn.Parameter]) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in named.items()}


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ep = experts_at(world_size)
    seed = [evidence.fresh_seed()]
    dist.broadcast_object_list(seed, src=0)  # the same tokens everywhere; each rank its rows
    # "cpu", not local_device(): every check runs on gloo, in float64 (common.py launches it)
    mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("edp", "ep"))
    ep_rank = mesh.get_local_rank("ep")
    x, y = _tokens(seed[0], world_size)
    whole = ToyMoE(HIDDEN, ep, evidence.SEED).double()
    F.mse_loss(whole(x), y).backward()  # one process, every rank's tokens
    reference = {n: p.grad.clone() for n, p in whole.named_parameters()}
    layer = copy.deepcopy(ToyMoE(HIDDEN, ep, evidence.SEED).double())
    expert = layer.experts[ep_rank]
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    out = _expert_parallel(layer, expert, x[mine], ep, mesh["ep"].get_group())
    F.mse_loss(out, y[mine]).backward()  # this rank's mean loss
    named = {**{n: p for n, p in layer.named_parameters() if n in DENSE},
             **{f"expert.{n}": p for n, p in expert.named_parameters()}}
    local = _grads(named)
    with evidence.Recorder(fn) as calls:
        common.attempt(fn, [named[n] for n in DENSE], list(expert.parameters()),
                       mesh["edp"].get_group())
    expected = {**{n: reference[n] for n in DENSE},
                **{f"expert.{w}": reference[f"experts.{ep_rank}.{w}"] for w in ("weight", "bias")}}
    counts = torch.bincount(whole.route(x)[1], minlength=ep).tolist()
    return {"got": _grads(named), "local": local, "expected": expected, "ep_rank": ep_rank,
            "ep": ep, "counts": counts, "calls": dict(calls.calls),
            "delivered": evidence.delivered(calls.log)}


# --------------------------------------------------------------------------------------------
# The usual mistakes, built from every rank's own gradients
# --------------------------------------------------------------------------------------------


def _sum(outs: list[dict], ranks: list[int], names: Sequence[str]) -> dict[str, torch.Tensor]:
    return {n: sum(outs[r]["local"][n] for r in ranks) for n in names}


def _scaled(grads: dict, c: float) -> dict:
    return {n: g * c for n, g in grads.items()}


def _edp_of(run: Run, rank: int) -> list[int]:
    """The ranks holding the same expert as ``rank``."""
    return [r for r, o in enumerate(run.outs) if o["ep_rank"] == run.outs[rank]["ep_rank"]]


def _expert_mistakes(run: Run, rank: int) -> list[tuple[str, dict]]:
    W, ep = run.size, run.out["ep"]
    edp, names = _edp_of(run, rank), ("expert.weight", "expert.bias")
    group_sum, everyone = _sum(run.outs, edp, names), _sum(run.outs, list(range(W)), names)
    own = _sum(run.outs, [rank], names)
    tail = ("divide by the whole data-parallel size, dist.get_world_size() "
            f"({W} here): every rank brought tokens to the sum.")
    return [
        (f"your expert gradients are {ep}× the expected ones (EP = {ep}): you divided the sum "
         f"over expert_group by its size ({len(edp)} here), or not at all. Sum over "
         f"expert_group, then {tail}", _scaled(group_sum, 1 / len(edp))),
        ("you reduced the expert gradients over all ranks, like the dense ones: that adds "
         "every expert's gradient to every other's. Reduce them over expert_group only, "
         "the ranks that hold the same expert.", _scaled(everyone, 1 / W)),
        ("you reduced the expert gradients over all ranks without dividing: reduce them over "
         f"expert_group only, then {tail}", everyone),
        ("you did not sum the expert gradients over expert_group: the other ranks holding "
         "this expert saw other tokens. all_reduce them over expert_group, then "
         f"{tail}", _scaled(own, 1 / W)),
        (f"you summed the expert gradients over expert_group but did not divide: {tail}",
         group_sum),
    ]


def _dense_mistakes(run: Run, rank: int) -> list[tuple[str, dict]]:
    W, edp = run.size, _edp_of(run, rank)
    everyone = _sum(run.outs, list(range(W)), DENSE)
    return [
        (f"you summed the dense gradients over all ranks but did not divide by the world size "
         f"({W} here).", everyone),
        ("you reduced the dense gradients over expert_group: dense parameters are replicated "
         "on every rank, so all_reduce them over all ranks (the default group), then divide "
         "by the world size.", _scaled(_sum(run.outs, edp, DENSE), 1 / W)),
        ("you did not reduce the dense gradients: all_reduce them over all ranks, then divide "
         "by the world size.", _sum(run.outs, [rank], DENSE)),
    ]


def _same(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[n], b[n], rtol=1e-9, atol=1e-14) for n in b)


# --------------------------------------------------------------------------------------------
# The diagnoses, most telling first: each takes a Run, returns a message or None
# --------------------------------------------------------------------------------------------


def _no_gradient(run: Run) -> str | None:
    for rank, out in enumerate(run.outs):
        missing = [n for n, g in out["got"].items() if g is None]
        if missing:
            return (f"on rank {rank}, `{missing[0]}` has no gradient after {run.name}: reduce "
                    ".grad in place (all_reduce, then /=); do not set it to None.")


def _wrong(run: Run, part: str) -> str | None:
    names = DENSE if part == "dense" else ("expert.weight", "expert.bias")
    mistakes = _dense_mistakes if part == "dense" else _expert_mistakes
    for rank, out in enumerate(run.outs):
        got = {n: out["got"][n] for n in names}
        expected = {n: out["expected"][n] for n in names}
        if _same(got, expected):
            continue
        for message, grads in mistakes(run, rank):
            if _same(got, grads):
                return f"on rank {rank}, {message}"
        c = evidence.scale(got, expected)
        what = f"{evidence.times_text(c)} the expected ones" if c else "not the expected ones"
        return (f"on rank {rank}, the {part} gradients are {what} (max abs difference "
                f"{max(evidence.max_abs_diff(got[n], expected[n]) for n in names):.3g}), nor "
                "any of the usual mistakes: sum over all ranks (dense) or over expert_group "
                "(experts), then divide both by dist.get_world_size().")


def _dense_wrong(run: Run) -> str | None:
    return _wrong(run, "dense")


def _expert_wrong(run: Run) -> str | None:
    return _wrong(run, "expert")


def _not_carried(run: Run) -> str | None:
    """The values are right: did the collectives carry the dense gradients' sum over all ranks,
    and (where a group has several ranks) the expert gradients' sum over the group (or those
    sums divided), numbers no rank holds alone?"""
    W, experts = run.size, ("expert.weight", "expert.bias")
    dense = evidence.flatten(_sum(run.outs, list(range(W)), DENSE))
    for rank, out in enumerate(run.outs):
        edp, got = _edp_of(run, rank), out["delivered"]
        wanted = [("dense", dense, (1, W))]
        if len(edp) > 1:
            wanted.append(("expert", evidence.flatten(_sum(run.outs, edp, experts)),
                           (1, W, len(edp))))
        for part, total, divisors in wanted:
            if not any(evidence.among(total / k, got) for k in divisors):
                over = "all ranks" if part == "dense" else "expert_group"
                return (f"the values are right, but on rank {rank} your collectives delivered "
                        f"{evidence.numbers_text(got)}, not the sum of the {part} gradients "
                        f"over {over} ({total.numel()} numbers no rank holds alone): they "
                        f"reached the ranks another way. all_reduce them over {over}.")


DIAGNOSES = (_no_gradient, _dense_wrong, _expert_wrong, _not_carried)


def _verified(runs: Sequence[Run]) -> str:
    """"on 2 and 3 ranks (EP 2 and 3, EDP 1), on 4 ranks (EP 2 × EDP 2), ...": the runs
    grouped by the size of their expert-data-parallel groups."""
    by_edp: dict[int, list[Run]] = {}
    for run in runs:
        by_edp.setdefault(run.size // run.out["ep"], []).append(run)
    parts = [f"on {' and '.join(str(r.size) for r in group)} ranks (EP "
             f"{' and '.join(str(r.out['ep']) for r in group)} × EDP {edp})"
             for edp, group in by_edp.items()]
    counts = ", ".join(str(r.out["counts"]) for r in runs)
    return (f"{', '.join(parts)}, tokens per expert {counts}: every rank's dense and expert "
            "gradients are one process's on every rank's tokens; collectives on rank 0 of the "
            f"last run: {evidence.calls_text(runs[-1].out['calls'])}.")


@common.exercise("12_expert_gradients.ipynb",
                 "sync_moe_gradients(dense_params, expert_params, expert_group)")
def check_sync_moe_gradients(sync_moe_gradients: Callable,
                             world_size: int | Sequence[int] = (2, 3, 4), *,
                             timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``sync_moe_gradients(dense_params, expert_params, expert_group)``: after it,
    every rank's dense and expert gradients equal one process's on every rank's tokens.

    Each rank has run backward on the mean loss over its own tokens, through a top-1
    expert-parallel layer (one expert per rank of an expert-parallel group, two
    ``all_to_all_single`` calls). ``dense_params`` are replicated on every rank,
    ``expert_params`` are this rank's expert's, ``expert_group`` the ranks holding the same
    expert. Runs on 2, 3 and 4 ranks (``world_size``: others, each with EP = 3 at 3 ranks and
    2 elsewhere), on fresh random tokens. Says so if you divided the expert gradients by the
    expert group's size (× EP), reduced them over all ranks (mixing experts), did not sum
    them over the group, or did not divide...

        >>> import gradsync_tutorial as gst
        >>> import torch.distributed as dist
        >>> def sync_moe_gradients(dense_params, expert_params, expert_group):  # ÷ the group
        ...     for p in dense_params:
        ...         dist.all_reduce(p.grad)
        ...         p.grad /= dist.get_world_size()
        ...     for p in expert_params:
        ...         dist.all_reduce(p.grad, group=expert_group)
        ...         p.grad /= dist.get_world_size(expert_group)
        >>> gst.exercises.check_sync_moe_gradients(sync_moe_gradients)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: on rank 0, your expert gradients are 2× the expected ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, sync_moe_gradients, world_size, timeout, DIAGNOSES,
                           _verified, label=_label)
