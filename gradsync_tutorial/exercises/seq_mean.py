"""Exercise of notebook 14 (``14_rl_losses.ipynb``): ``seq_mean_backward(model, micro_batches)``
leaves in every rank's ``.grad``, under DDP with gradient accumulation, the gradient of GRPO's
sequence-level mean: the mean over every completion of every rank of each completion's token
mean.

The check runs the learner's function at two sizes that no guess passes both of: 2 ranks with 3
micro-batches each, then a drawn size with 2. Every micro-batch holds its own number of fresh
random completions (:mod:`gradsync_tutorial.rollouts`), as balanced micro-batches do, drawn from a
seed that rank 0 draws and sends before the learner's function runs. Each rank also computes,
for the diagnosis, each of its micro-batches' gradient sums; the diagnoses build the reference and
each usual mistake from them. What the learner's collectives delivered must include the step's
number of completions, which no rank knows alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import rollouts
from . import common, evidence
from .common import Run


def micro_batches_at(world_size: int) -> int:
    """How many micro-batches each rank gets at ``world_size`` ranks: 3 at 2, else 2."""
    return 3 if world_size == 2 else 2


# --------------------------------------------------------------------------------------------
# On the ranks
# --------------------------------------------------------------------------------------------


def _data(world_size: int, micro_batches: int, seed: int) -> list[list[dict]]:
    """data[rank][k]: a padded micro-batch of 1 to 4 fresh completions with random advantages;
    no two micro-batches of a rank hold as many completions, nor do all ranks."""
    g = torch.Generator().manual_seed(seed)
    while True:
        sizes = torch.randint(1, 5, (world_size, micro_batches), generator=g)
        if all(len(set(row.tolist())) == micro_batches for row in sizes) and \
                len(set(sizes.sum(1).tolist())) > 1:
            break
    done = iter(rollouts.sample(int(sizes.sum()), 1, seed=seed))
    return [[rollouts.pad(c, torch.randn(len(c), generator=g, dtype=torch.float64))
             for c in ([next(done) for _ in range(int(n))] for n in row)] for row in sizes]


def _grad(loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, model.parameters())])


def _pieces(micro_batches: list[dict]) -> dict:
    """This rank's facts, micro-batch by micro-batch, on the initial model: G, the gradient of
    the sum of its completions' token means; H, of its token sum; c its completions, n its
    completion tokens, w its padded width."""
    facts: dict[str, list] = {"G": [], "H": [], "c": [], "n": [], "w": []}
    model = evidence.token_model(rollouts.VOCAB_SIZE)
    for b in micro_batches:
        mask = b["mask"]
        per_token = rollouts.per_token_loss(model, b)
        facts["G"].append(_grad(((per_token * mask).sum(1) / mask.sum(1)).sum(), model))
        per_token = rollouts.per_token_loss(model, b)
        facts["H"].append(_grad((per_token * mask).sum(), model))
        facts["c"].append(len(mask))
        facts["n"].append(int(mask.sum()))
        facts["w"].append(mask.shape[1])
    return facts


def _named(micro_batches: list[dict]) -> dict[str, torch.Tensor]:
    """The micro-batches' tensors by name ("mask[0]", ...), to compare."""
    return {f"{key}[{k}]": t for k, b in enumerate(micro_batches) for key, t in b.items()}


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    seed = [evidence.fresh_seed()]
    dist.broadcast_object_list(seed, src=0)  # every rank draws the same data, keeps its own
    mine = _data(world_size, micro_batches_at(world_size), seed[0])[rank]
    facts, model = _pieces(mine), evidence.token_model(rollouts.VOCAB_SIZE)
    ddp = DDP(model)  # built before the recorder: its broadcast of the weights is not yours
    params = evidence.params_of(model)
    given = [{key: t.clone() for key, t in b.items()} for b in mine]
    with evidence.Recorder(fn) as calls:
        calls.watch(ddp)
        common.attempt(fn, ddp, given)
    for call in calls.log:
        call.settle()  # after fn: its async calls have been waited for
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    grad = None if missing else torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"grad": grad, "missing": missing, "facts": facts, "counts": dict(calls.calls),
            "calls": calls.log,
            "params": evidence.changed_text(params, evidence.params_of(model),
                                            "changed the parameters:"),
            "micro_batches": evidence.changed_text(_named(mine), _named(given),
                                                   "changed the micro-batches it was given:")}


# --------------------------------------------------------------------------------------------
# What the run should have given, and the usual mistakes
# --------------------------------------------------------------------------------------------


def _facts(run: Run, key: str) -> list[list]:
    return [o["facts"][key] for o in run.outs]


def _completions(run: Run) -> int:
    """S, the completions of the whole step: every micro-batch of every rank."""
    return sum(map(sum, _facts(run, "c")))


_ONE_COUNT = ("count the completions of all the micro-batches first, all_reduce that count, "
              "and divide every micro-batch's sum of completion token means by it")
_TIMES_N = " And multiply by the world size: DDP divides the summed gradients by it."
_PER_MICRO_BATCH = ("each micro-batch's own mean over its completions, divided by the number of "
                    "micro-batches (TRL's grpo): right only when every micro-batch holds as many "
                    f"completions. Instead, {_ONE_COUNT}.")


def _mistakes(run: Run) -> list[tuple[str, torch.Tensor]]:
    """(what to tell the learner, the gradient DDP leaves) for each usual mistake."""
    G, H, c, n = (_facts(run, key) for key in "GHcn")
    N, K, S = run.size, len(G[0]), _completions(run)
    total = sum(sum(r) for r in G)
    per_micro = sum(g / k for r, cs in zip(G, c, strict=True) for g, k in zip(r, cs, strict=True))
    per_rank = sum(sum(r) / sum(cs) for r, cs in zip(G, c, strict=True))
    tokens = sum(sum(r) for r in H) / sum(map(sum, n))
    return [
        (f"you forgot the × N: DDP divides the summed gradients by the world size ({N} here), "
         "so multiply each loss by dist.get_world_size() (not by a number).", total / S / N),
        ("you divided by the micro-batches a second time: the step's count of completions "
         "already covers every micro-batch, so do not also divide by their number "
         "(ms-swift#10117's bug).", total / S / K),
        ("your denominator is the step's completions × the world size, and you left out the × N: "
         "the gradients are N² times too small (verl#5798's bug). Divide by the step's "
         "completions, then multiply by the world size.", total / S / N**2),
        (_PER_MICRO_BATCH, per_micro / K / N), (_PER_MICRO_BATCH, per_micro / K),
        (f"each micro-batch's own mean, added up: {_ONE_COUNT}.{_TIMES_N}", per_micro / N),
        (f"each micro-batch's own mean, added up: {_ONE_COUNT}.", per_micro),
        (f"each rank's own mean over its completions: {_ONE_COUNT}.{_TIMES_N}", per_rank / N),
        (f"each rank's own mean, times N: {_ONE_COUNT}.", per_rank),
        ("this is the token-level mean (every completion token weighs the same), not the "
         "sequence-level mean: first take each completion's mean over its tokens, "
         "(per_token * mask).sum(1) / mask.sum(1), then divide their sum by the step's "
         "completions.", tokens),
        (common.ZEROED_INSIDE, sum(r[-1] for r in G) / S),
        (common.SUMMED_TOO, total / S * N),
    ]


# --------------------------------------------------------------------------------------------
# The diagnoses, most telling first: each takes a Run, returns a message or None
# --------------------------------------------------------------------------------------------


_micro_batches_touched = common.left_alone(
    "micro_batches", "leave the micro-batches as they are (a copy, if you must).")


def _wrong_gradient(run: Run) -> str | None:
    S = _completions(run)
    got, expected = run.out["grad"], sum(sum(r) for r in _facts(run, "G")) / S
    if evidence.same_gradient(got, expected):
        return None
    what = f"your gradient is not the mean over all {S} completions of their token means"
    mistake = evidence.named_mistake(got, _mistakes(run))
    if mistake:
        return f"{what}: {mistake}"
    return _scaled(run, got, expected, what) or (
        f"{what} (max abs difference {(got - expected).abs().max().item():.3g}), nor any of the "
        "usual mistakes: for each completion, its loss summed over its tokens / its tokens; sum "
        "those, divide by the step's count of completions, × the world size.")


def _scaled(run: Run, got: torch.Tensor, expected: torch.Tensor, what: str) -> str | None:
    """What to say if ``got`` is a multiple of ``expected``: a guessed world size or count?"""
    return evidence.wrong_scale(
        got, expected, run.size, micro_batches_at(run.size),
        what + ": yours are {times} the expected gradients. How do you count the completions, "
        "and scale each loss? / the step's completions × the world size.",
        unguessed=" Count the completions of every micro-batch of every rank: one all_reduce, "
        "never a number you guess.")


def _count_carried(run: Run, out: dict) -> str | None:
    """What a rank's collectives delivered of the counts no rank knows alone."""
    return evidence.count_delivered(out["calls"], _completions(run),
                                    [sum(c) for c in _facts(run, "c")])


def _count_not_carried(run: Run) -> str | None:
    return evidence.count_not_delivered(run.outs, _completions(run),
                                        [sum(c) for c in _facts(run, "c")],
                                        "the step's count of completions")


_synced_every_micro_batch = common.synced_once(lambda run: len(run.out["facts"]["c"]))

#: In order: a wrong gradient after changed inputs is told as the changed inputs.
DIAGNOSES = (common.no_gradient, common.parameters_left_alone, _micro_batches_touched,
             _wrong_gradient, common.ranks_differ, _count_not_carried, _synced_every_micro_batch)


def _verified(runs: Sequence[Run]) -> str:
    parts = []
    for run in runs:
        counts = [c for rank in _facts(run, "c") for c in rank]
        parts.append(f"{run.label[3:]} ({_completions(run)} completions, {min(counts)} to "
                     f"{max(counts)} per micro-batch; collectives: "
                     f"{evidence.calls_text(run.out['counts'])}, delivering "
                     f"{_count_carried(run, run.out)})")
    return ("the gradient is that of one process on every completion, on " + " and on ".join(parts)
            + "; the parameters and the micro-batches are untouched.")


@common.exercise("14_rl_losses.ipynb", "seq_mean_backward(model, micro_batches)")
def check_seq_mean_backward(seq_mean_backward: Callable,
                            world_size: int | Sequence[int] = common.WORLD_SIZES, *,
                            timeout: float = common.CHECK_TIMEOUT) -> str:
    """Check ``seq_mean_backward(model, micro_batches)`` under DDP: afterwards every rank's
    ``.grad`` is the gradient of GRPO's sequence-level mean, the mean over every completion of
    every rank's micro-batches of each completion's token mean.

    ``model`` is a ``DistributedDataParallel`` policy; ``micro_batches`` this rank's list of
    dicts from ``gst.rollouts.pad`` (``inputs``, ``targets``, ``mask``, ``advantages``), with
    different numbers of completions, fresh at every check. Runs it on 2 ranks with 3
    micro-batches each, then at the second size with 2 (``world_size``: another number, or
    several), and compares with one process on all of them. Says so if you took each
    micro-batch's own mean, divided by the micro-batches again (ms-swift#10117), multiplied the
    denominator by the world size (verl#5798), forgot the × world size that DDP's division needs,
    guessed a world size or a count, took the token-level mean, exchanged the count without a
    collective, let DDP synchronize every micro-batch, changed the parameters or the
    micro-batches...

        >>> import gradsync_tutorial as gst
        >>> def seq_mean_backward(model, micro_batches):   # each micro-batch's mean: caught
        ...     for b in micro_batches:
        ...         per_token = gst.rollouts.per_token_loss(model, b)
        ...         loss = ((per_token * b["mask"]).sum(1) / b["mask"].sum(1)).mean()
        ...         (loss / len(micro_batches)).backward()
        >>> gst.exercises.check_seq_mean_backward(seq_mean_backward)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks × 3 micro-batches: your gradient is not the mean over ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, seq_mean_backward, world_size, timeout, DIAGNOSES,
                           _verified, label=common.micro_batch_label(micro_batches_at))
