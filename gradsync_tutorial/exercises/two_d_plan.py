"""Exercise of notebook 10 (``10_two_dimensions.ipynb``): ``gradient_plan(replicas, shards,
tp, tokens)`` says who divides by what on a (replicas, shards, tp) mesh.

The learner returns three things: FSDP2's ``set_gradient_divide_factor`` on the (replicas,
shards) data-parallel mesh, the ``dist.ReduceOp`` that all-reduces a tensor-parallel-replicated
parameter's gradient (a LayerNorm under sequence parallel) over the tp ranks, and what each
rank divides its sum of squared errors by, when it holds ``tokens`` of them (its sequence
shard). The check asks for several mesh shapes, at which no hard-coded number is right twice.
Then it *runs* the answer on 2 and 3 to 5 ranks as the tp group: each rank normalizes its own
sequence shard with a replicated LayerNorm, backs its loss divided as the answer says, and
all-reduces the LayerNorm's gradients with the answer's op; the result is compared with one
process on the whole sequence. Each part is run apart, so each mistake shows its own factor:
an average where a sum is needed gives 1/tp, a local mean gives tp, and a divide factor equal to
the shard size leaves the gradient ``replicas`` times too large.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import common, evidence
from .common import Run

HIDDEN = 4
POSITIONS, ROWS = 3, 2  # the run: each rank's sequence shard, of 2 rows
TOKENS = ROWS * POSITIONS * HIDDEN  # the squared errors each rank of the run holds
#: (replicas, shards, tp, tokens) shapes the answer is asked about, besides the run's own.
SHAPES = ((2, 2, 2, 6), (1, 4, 2, 5), (3, 2, 3, 7), (2, 1, 4, 3), (2, 3, 1, 8))


def _expected(replicas: int, shards: int, tp: int, tokens: int) -> int:
    """The global count: every loss term of every rank."""
    return replicas * shards * tp * tokens


def _answer(fn: Callable, shape: tuple) -> tuple[dict, Any]:
    """The learner's answer at ``shape``: the facts (numbers, the op's name, or "bad": what is
    wrong with it) and the op itself."""
    import torch.distributed as dist

    got = common.attempt(fn, *shape)
    if not (isinstance(got, tuple | list) and len(got) == 3):
        return {"bad": f"returned {type(got).__name__} {got!r:.60}: return three things, "
                       "(divide_factor, replicated_op, loss_divisor)"}, None
    factor, op, divisor = got
    for value, what in ((factor, "divide_factor"), (divisor, "loss_divisor")):
        if not evidence.is_number(value) or float(value) <= 0:
            return {"bad": f"returned {value!r:.40} as its {what}: return a positive number"}, None
    if not isinstance(op, dist.ReduceOp.RedOpType):
        return {"bad": f"returned {op!r:.40} as its replicated_op: return a dist.ReduceOp, "
                       "such as dist.ReduceOp.SUM"}, None
    return {"factor": float(factor), "op": op.name, "divisor": float(divisor)}, op


def _layer_norm_run(rank: int, world_size: int, op: Any, divisor: float) -> float:
    """The LayerNorm's gradients after each tp rank backs its sum / ``divisor`` and they are
    all-reduced with ``op``, as a multiple of one process's on the whole sequence."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(evidence.SEED)  # the same whole sequence on every rank
    x = torch.randn(ROWS, POSITIONS * world_size, HIDDEN, generator=g, dtype=torch.float64)
    y = torch.randn(x.shape, generator=g, dtype=torch.float64)
    norm = nn.LayerNorm(HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64))
    whole = nn.LayerNorm(HIDDEN, dtype=torch.float64)
    whole.load_state_dict(norm.state_dict())
    ((whole(x) - y) ** 2).mean().backward()
    mine = slice(rank * POSITIONS, (rank + 1) * POSITIONS)  # this rank's sequence shard
    (((norm(x[:, mine]) - y[:, mine]) ** 2).sum() / divisor).backward()
    got = torch.cat([p.grad for p in norm.parameters()])
    dist.all_reduce(got, op=op)
    expected = torch.cat([p.grad for p in whole.parameters()])
    c = (got @ expected / (expected @ expected)).item()
    return c if torch.allclose(got, c * expected, rtol=1e-9, atol=1e-12) else None


def _worker(rank: int, world_size: int, fn: Callable) -> Any:
    import torch.distributed as dist

    own_shape = (1, 1, world_size, TOKENS)  # the run's own mesh: the ranks are the tp group
    answers = {shape: _answer(fn, shape) for shape in (own_shape, *SHAPES)}
    out = {"shapes": {shape: facts for shape, (facts, _) in answers.items()}}
    (own, op) = answers[own_shape]
    if "bad" not in own:  # each part apart: the answer's op on the gradients of the right
        # loss, then the answer's divisions with the right op
        out["op ratio"] = _layer_norm_run(rank, world_size, op, TOKENS * world_size)
        out["divisor ratio"] = _layer_norm_run(rank, world_size, dist.ReduceOp.SUM,
                                               own["divisor"] * own["factor"])
    return out


# --- the diagnoses, most telling mistake first -----------------------------------------------


def _not_three(run: Run) -> str | None:
    for shape, a in run.out["shapes"].items():
        if "bad" in a:
            return f"{run.name}{shape} {a['bad']}."


def _average_not_sum(run: Run) -> str | None:
    r = run.out["op ratio"]
    op = run.out["shapes"][1, 1, run.size, TOKENS]["op"]
    if op == "AVG" or (r is not None and abs(r - 1 / run.size) < 1e-9):
        return (f"the LayerNorm's gradients came out {evidence.times_text(r)} one process's "
                f"on {run.size} tp ranks: an average where a sum is needed. Each tp rank holds "
                "the gradient of its own tokens only, a share: the whole gradient is their "
                "sum. Use dist.ReduceOp.SUM.")
    if r is None or abs(r - 1) > 1e-9:
        return (f"all-reducing the LayerNorm's gradients with ReduceOp.{op} did not give one "
                "process's gradients: the tp ranks' shares add up, use dist.ReduceOp.SUM.")


def _wrong_count(run: Run) -> str | None:
    for shape, a in run.out["shapes"].items():
        replicas, shards, tp, tokens = shape
        total = a["factor"] * a["divisor"]
        if abs(total - _expected(*shape)) < 1e-9:
            continue
        c = _expected(*shape) / total
        where = f"for replicas={replicas}, shards={shards}, tp={tp}, tokens={tokens}"
        if a["factor"] == shards and replicas > 1:
            return (f"{where}, your divide factor is the shard size, {shards:g}: FSDP2's "
                    f"factor replaces the *total* division, so the gradient is {c:g}× (the "
                    f"replicas). Divide by every data-parallel rank: replicas × shards.")
        if a["divisor"] == tokens and tp > 1:
            return (f"{where}, your loss is a mean over this rank's {tokens} tokens: under "
                    f"sequence parallel the gradient is then {c:g}× one process's (the tp "
                    "ranks). Divide the sum by the data rank's count, every sequence shard "
                    "included: tokens × tp.")
        return (f"{where}, divide_factor × loss_divisor is {total:g}, not the global count "
                f"{_expected(*shape)} (every loss term of every rank): the gradient is {c:g}× "
                "one process's.")


def _run_not_one_process(run: Run) -> str | None:
    r = run.out["divisor ratio"]
    if r is None or abs(r - 1) > 1e-9:
        return (f"with your loss divisor, the summed LayerNorm gradients are "
                f"{evidence.times_text(r) if r else 'not a multiple of'} one process's.")


DIAGNOSES = (_not_three, _average_not_sum, _wrong_count, _run_not_one_process)


def _verified(runs: Sequence[Run]) -> str:
    shapes = len(runs[0].out["shapes"])
    op = runs[0].out["shapes"][1, 1, runs[0].size, TOKENS]["op"]
    return (f"{common.sizes_text(runs)} as the tp group, the LayerNorm's gradients all-reduced "
            f"with ReduceOp.{op} and each rank's sum "
            f"divided as you said equal one process's on the whole sequence (ratio 1.0); at "
            f"{shapes} mesh shapes, divide factor × loss divisor is the global count.")


@common.exercise("10_two_dimensions.ipynb", "gradient_plan(replicas, shards, tp, tokens)")
def check_gradient_plan(
    gradient_plan: Callable, world_size: int | Sequence[int] = common.WORLD_SIZES, *,
    timeout: float = common.CHECK_TIMEOUT,
) -> str:
    """Check ``gradient_plan(replicas, shards, tp, tokens)``: it returns ``(divide_factor,
    replicated_op, loss_divisor)`` for a (replicas, shards, tp) mesh whose ranks hold
    ``tokens`` loss terms each.

    Asks it about several mesh shapes, then runs its op and its divisor on 2 and 3 to 5 ranks (the
    tp group) against one process. Says so if the op is an average where a sum is needed, if
    the divide factor is the shard size (× replicas), if the loss is a local mean under
    sequence parallel (× tp), or if the divisions do not add up to the global count.

        >>> import gradsync_tutorial as gst
        >>> import torch.distributed as dist
        >>> def gradient_plan(replicas, shards, tp, tokens):   # an average: caught
        ...     return replicas * shards, dist.ReduceOp.AVG, tokens * tp
        >>> gst.exercises.check_gradient_plan(gradient_plan)  # doctest: +SKIP
        Traceback (most recent call last):
        ExerciseFailed: on 2 ranks: the LayerNorm's gradients came out 0.5× one process's ...

    Prints one status line and returns None, correct or not attempted; raises
    :class:`ExerciseFailed` otherwise.
    """
    __tracebackhide__ = True  # IPython and pytest show the message, not this frame
    return common.on_ranks(_worker, gradient_plan, world_size, timeout, DIAGNOSES, _verified)
