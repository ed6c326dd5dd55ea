"""What :mod:`gradsync_tutorial.verify` makes of every rank's findings: one report, the same on
every rank, each parameter's diagnosis, and the words of the refusals, the verdict and the table.

A wrong factor is named by :func:`gradsync_tutorial.diagnoses.name_factor`, the words the
exercises' checks use too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._wording import plural, ranks
from .diagnoses import fmt as _fmt
from .diagnoses import name_factor

__all__ = ["DEFAULT_RTOL", "CannotVerify", "Report", "Row", "combine", "name_factor",
           "needs_weights", "ranks", "report", "row", "shared_factor", "verdict"]

#: The default rtol per gradient dtype: what its rounding allows on a small model.
DEFAULT_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2,
                torch.float16: 1e-2}


# The report's records: verify.py hands them on (``gst.verify.Report``), this module fills them.


class CannotVerify(ValueError):
    """Raised on every rank together when the step cannot be checked; the message says why and
    what to do."""


@dataclass(frozen=True)
class Row:
    """One parameter: your gradient ``g`` against one process's ``r``."""

    name: str
    rel_error: float  #: ``|g - r| / |r|`` (L2 norms)
    factor: float  #: the fitted factor ``<g, r> / <r, r>``: 1.0 when right
    max_abs_diff: float  #: ``max |g - r|``
    diagnosis: str  #: "exact", or what went wrong, in the course's words
    ok: bool


@dataclass(frozen=True)
class Report:
    """What :func:`~gradsync_tutorial.verify.verify_gradients` found; the same on every rank.
    ``print(report)`` shows a table and a one-line verdict."""

    ok: bool
    rows: tuple[Row, ...]
    grad_norm: float  #: your total gradient norm: what ``clip_grad_norm_`` would clip
    reference_grad_norm: float  #: one process's
    rtol: float
    dtype: str
    world_size: int
    micro_batches: int

    @property
    def worst(self) -> Row | None:
        """The parameter with the largest relative error (a failing one first)."""
        rows = [r for r in self.rows if not r.ok] or list(self.rows)
        return max(rows, key=lambda r: (r.rel_error, r.max_abs_diff), default=None)

    @property
    def verdict(self) -> str:
        """One line in plain words."""
        return verdict(self)

    def __str__(self) -> str:
        return report(self)

SHARDED_REFERENCE = (
    "reference must hold whole parameters, the model's weights before this step: this one is "
    "sharded (its parameters are DTensors, and FSDP2 modules refuse copy.deepcopy). Take "
    "copy.deepcopy(model) before fully_shard (or parallelize_module) and pass that copy as "
    "reference=."
)
NO_BATCH = "no batch: pass this rank's local_batch, or micro_batches=[...] with at least one."
MICRO_STRUCTURE = ("this rank's micro-batches do not share one structure (types, dtypes, "
                   "dimensions): pass them as the same kind of tensors.")
DROPOUT = (
    "{who} has an active dropout layer {name!r} (p={p}): its random masks differ between your "
    "ranks and one process, so no gradient could match. Call model.eval() and reference.eval() "
    "for the checked step, or set p=0."
)
BATCHNORM = (
    "{who} has BatchNorm {name!r} in training mode: it normalises with each rank's own batch "
    "statistics, which differ from one process's on the whole batch (a difference of meaning, "
    "not an averaging error). Call model.eval() and reference.eval() for the checked step, or "
    "use nn.SyncBatchNorm (GPU) in the model and leave the reference in training mode."
)
NO_GRADIENTS = ("no parameter of the model has a gradient yet: call verify_gradients after "
                "backward() and your gradient sync, before optimizer.step() and zero_grad().")
ARCHITECTURE = (
    "the reference is not the model's architecture: not in the reference: {unknown}; another "
    "shape: {shapes}. Pass copy.deepcopy(model) taken before any wrapper; for a pipeline stage "
    "named differently, pass name_map={{your name: reference name}}."
)
RANKS_DIFFER = ("verify_gradients cannot check this step: {ranks} passed {what} than rank 0: "
                "every rank must pass the same kind of batch and reference.")
NOT_HELD = ("verify_gradients cannot check this step: no rank holds the reference's "
            "parameters {missing}: is the reference the model's architecture? (For a "
            "pipeline, name_map maps each stage's names.)")
NOT_A_LOSS = ("loss_fn must return one number as a tensor that requires grad (the reference's "
              "parameters must require grad), got {got}")
LOSS_FAILED = ("verify_gradients cannot check this step: computing one process's gradient "
               "(loss_fn on a copy of the reference, on the whole batch) raised on rank {rank}: "
               "{error}")
SPLIT = "the ranks hold different gradients ({ranks} differ): a missing or partial sync"
NO_GRADIENT = "no gradient {where}: unused or frozen parameter"
WEIGHTED = ("weighted differently: a mean of per-rank/per-micro-batch means where the counts "
            "differ (notebook 07)")
DIFFERENT = ("a different gradient, not a factor nor a weighting: another loss, other data or "
             "another model than the reference")
CLOSE = ("close, but beyond the dtype's rounding: a lower precision somewhere (autocast, a bf16 "
         "reduction) or a slight weighting difference; check in float64")


def _missing(name: str, s: dict, rtol: float) -> tuple:
    where = "on your side" if not s["mine"] else "in one process (the reference)"
    other = s.get("gg", s.get("rr", 0.0))
    if not s["mine"] and not s["ref"]:
        return 0.0, math.nan, 0.0, "no gradient on either side: unused or frozen parameter", True
    if other == 0.0:  # None against zeros: the same update
        return 0.0, math.nan, 0.0, "exact (no gradient against zeros)", True
    return math.inf, math.nan, math.sqrt(other), NO_GRADIENT.format(where=where), False


def _tol(rtol: float) -> float:
    """How close to a clean factor, or to the fitted line, counts as on it."""
    return max(10 * rtol, 1e-6)


def shared_factor(stats: list, rtol: float) -> float | None:
    """The one factor that explains every wrong gradient at once, or None if none does.

    One factor ``F`` for all: the residual is ``sum(fit + (f - F)**2 * rr)`` over the wrong
    parameters (each one's own fit residual is orthogonal to its reference)."""
    wrong = [s for s in stats if s["mine"] and s["ref"] and s["rr"]
             and s["dd"] > (rtol**2) * s["rr"]]
    if not wrong:
        return None
    rr = sum(s["rr"] for s in wrong)
    big_f = sum(s["gr"] for s in wrong) / rr
    residual = sum(s["fit"] + (s["gr"] / s["rr"] - big_f) ** 2 * s["rr"] for s in wrong)
    if big_f and math.sqrt(residual) <= _tol(rtol) * abs(big_f) * math.sqrt(rr):
        return big_f
    return None


def _diagnose(s: dict, rtol: float, world_size: int, micro: int, sizes, shared,
              weights) -> tuple:
    rel = math.sqrt(s["dd"] / s["rr"]) if s["rr"] else (0.0 if s["dd"] == 0 else math.inf)
    if rel <= rtol:
        return rel, (s["gr"] / s["rr"] if s["rr"] else 1.0), "exact", True
    if not s["rr"]:
        return rel, math.nan, "a gradient where one process has zeros", False
    f = s["gr"] / s["rr"]
    cosine = s["gr"] / math.sqrt(s["gg"] * s["rr"]) if s["gg"] else 0.0
    own = s["n"] > 1 and math.sqrt(s["fit"]) <= _tol(rtol) * abs(f) * math.sqrt(s["rr"])
    named = name_factor(shared if shared is not None else f, world_size=world_size,
                        micro=micro, sizes=sizes, tol=_tol(rtol))
    if shared is None and not (own and named.startswith("factor ")):
        named = None  # one parameter's own clean factor counts only when it has a name
    if named and abs((shared or f) - 1) <= _tol(rtol) * 10:
        return rel, f, "not exact, beyond the dtype's rounding: check in float64", False
    if named:
        return rel, f, named, False
    if rel <= 1e-2:
        return rel, f, CLOSE, False
    if weights is not None:  # the chunks' gradients tell: weighted, or something else
        fits = weights["residual"] <= _tol(rtol)
        return rel, f, (_weighted(weights, micro) if fits else DIFFERENT), False
    return rel, f, (WEIGHTED if cosine >= 0.5 else DIFFERENT), False


def _weighted(weights: dict, micro: int) -> str:
    what = "ranks' batches" if micro == 1 else "micro-batches (rank 0's first)"

    def listed(ws: list) -> str:
        return ", ".join(f"{w:.3g}" for w in ws[:8]) + (", ..." if len(ws) > 8 else "")

    return (f"{WEIGHTED}: you weigh the {what} {listed(weights['yours'])}, one process "
            f"{listed(weights['one_process'])} (their counts' shares)")


def row(name: str, s: dict, rtol: float, world_size: int, micro: int, sizes,
        shared: float | None = None, weights: dict | None = None) -> Any:
    """The :class:`~gradsync_tutorial.verify.Row` of one parameter's combined sums;
    ``shared``: the factor all wrong gradients share, if they do; ``weights``: the chunks'."""
    if not (s["mine"] and s["ref"]):
        return Row(name, *_missing(name, s, rtol))
    rel, f, diagnosis, ok = _diagnose(s, rtol, world_size, micro, sizes, shared, weights)
    return Row(name, rel, f, s["max"], diagnosis, ok)


def _rtol_of(dtypes: set, rtol: float | None) -> float:
    """The rtol asked for, else the loosest that the gradients' dtypes call for."""
    if rtol is not None:
        return rtol
    return max((DEFAULT_RTOL.get(getattr(torch, d[6:]), 1e-5) for d in dtypes), default=1e-10)


def needs_weights(params: dict, rtol: float | None) -> bool:
    """Does this rank hold a clearly wrong gradient that no one factor explains? Then its
    chunks' weights are worth fitting (they cost a backward per chunk)."""
    stats = [s for s in params.values() if s["mine"] and s["ref"] and s["rr"]]
    rtol = _rtol_of({s["dtype"] for s in stats}, rtol)
    wrong = any(s["dd"] > 1e-4 * s["rr"] for s in stats)  # a relative error over 1e-2
    return wrong and shared_factor(stats, rtol) is None


def _agree(a: dict, b: dict, tol: float) -> bool:
    if a["mine"] != b["mine"]:
        return False
    if not a["mine"]:
        return True
    scale = math.sqrt(max(a["gg"], b["gg"]))
    return (abs(a["gg"] - b["gg"]) <= tol * max(a["gg"], b["gg"])
            and abs(a["print"] - b["print"]) <= tol * scale * 10)


def _pick(found: list, name: str, rtol: float) -> tuple:
    """``(name, the worst holder's sums, the ranks whose gradients differ)`` of one parameter."""
    holders = [(r, f["params"][name]) for r, f in enumerate(found) if name in f["params"]]
    split = [r for r, s in holders if not _agree(holders[0][1], s, rtol)]
    worst = max((s for _, s in holders), key=lambda s: s.get("dd", 0.0))
    return name, worst, ([holders[0][0], *split] if split else [])


def combine(found: list, order: list, rtol: float | None, world_size: int, micro: int,
            sizes: Mapping[str, int]) -> Any:
    """Every rank's findings -> the :class:`~gradsync_tutorial.verify.Report`, the same on
    every rank (or the same CannotVerify raised on every rank)."""
    errors = [(r, f["error"]) for r, f in enumerate(found) if f["error"]]
    if errors:
        raise CannotVerify(LOSS_FAILED.format(rank=errors[0][0], error=errors[0][1]))
    dtypes = {s["dtype"] for f in found for s in f["params"].values() if s["dtype"]}
    rtol = _rtol_of(dtypes, rtol)
    picked = [_pick(found, name, rtol) for name in order]
    shared = shared_factor([s for _, s, split in picked if not split], rtol)
    weights = next((f["weights"] for f in found if f["weights"]), None)
    rows = []
    for name, s, split in picked:
        one = row(name, s, rtol, world_size, micro, sizes, shared, weights)
        if split:
            one = Row(name, one.rel_error, one.factor, one.max_abs_diff,
                      SPLIT.format(ranks=ranks(split)), False)
        rows.append(one)
    norms = [math.sqrt(sum(s.get(k, 0.0) for _, s, _ in picked)) for k in ("gg", "rr")]
    dtype = max(dtypes, key=lambda d: DEFAULT_RTOL.get(getattr(torch, d[6:]), 0), default="?")
    return Report(all(r.ok for r in rows), tuple(rows), *norms, rtol,
                  dtype.replace("torch.", ""), world_size, micro)


def _wrong_by_diagnosis(rep: Any) -> dict[str, list[str]]:
    """Each diagnosis of a wrong gradient -> the parameters it explains, in the rows' order."""
    bad: dict[str, list[str]] = {}
    for r in rep.rows:
        if not r.ok:
            bad.setdefault(r.diagnosis, []).append(r.name)
    return bad


def verdict(rep: Any) -> str:
    """The report's one line; each diagnosis of a wrong gradient numbered, [1], [2]..."""
    n = len(rep.rows)
    allows = f"{rep.dtype} rounding allows about {rep.rtol:.0e}"
    shape = f"{plural(rep.world_size, 'rank')} x {plural(rep.micro_batches, 'micro-batch')}"
    shape = shape.replace("batchs", "batches")
    if rep.ok:
        worst = max((r.rel_error for r in rep.rows), default=0.0)
        return (f"OK: all {plural(n, 'gradient')} match one process's on the whole batch "
                f"({shape}); worst relative error {worst:.1e}, and {allows}.")
    bad = _wrong_by_diagnosis(rep)
    parts = [f"[{k}] {d} ({', '.join(names[:3])}"
             + (f", ... {len(names)} in all)" if len(names) > 3 else ")")
             for k, (d, names) in enumerate(bad.items(), start=1)]
    wrong = sum(len(v) for v in bad.values())
    return (f"WRONG: {wrong} of {plural(n, 'gradient')} differ from one process's on the "
            f"whole batch ({shape}; {allows}): " + "; ".join(parts) + ".")


def report(rep: Any, limit: int = 12) -> str:
    """The table (failing parameters first, at most ``limit`` rows), the norms, the verdict. A
    wrong gradient's diagnosis is the verdict's number for it, [1], said once there."""
    rows = sorted(rep.rows, key=lambda r: r.ok)
    number = {d: f"[{k}]" for k, d in enumerate(_wrong_by_diagnosis(rep), start=1)}
    head = ("parameter", "rel error", "factor", "max |diff|", "diagnosis")
    cells = [(r.name, f"{r.rel_error:.2e}", _fmt(r.factor), f"{r.max_abs_diff:.2e}",
              r.diagnosis if r.ok else number[r.diagnosis]) for r in rows[:limit]]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(c4[:4], widths, strict=True)) + "  " + c4[4]
             for c4 in [head, *cells]]
    if len(rows) > limit:
        lines.append(f"... and {len(rows) - limit} more")
    ratio = rep.grad_norm / rep.reference_grad_norm if rep.reference_grad_norm else math.nan
    lines.append(f"gradient norm, what clip_grad_norm_ would clip: yours {rep.grad_norm:.6g}, "
                 f"one process's {rep.reference_grad_norm:.6g} (ratio {_fmt(ratio)})")
    lines.append(verdict(rep))
    return "\n".join(lines)
