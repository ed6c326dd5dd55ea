"""What a wrong factor means, in the course's words: written once, for the exercises' checks and
for :func:`gradsync_tutorial.verify.verify_gradients` (notebook 15).

A gradient that is a clean multiple of the right one was divided by the wrong number. The
multiple says which: the world size N (notebook 02), the micro-batches K (notebooks 07 and 11),
both, or a group's size (notebook 12).

    >>> from gradsync_tutorial.diagnoses import meaning, name_factor
    >>> name_factor(2.0, world_size=2, micro=3, sizes={}, tol=1e-6)
    'factor 2 = the world size: summed, not divided by the world size (notebook 02)'
    >>> name_factor(1 / 3, world_size=2, micro=3, sizes={}, tol=1e-6)
    'factor 0.3333 = 1/micro-batch count: divided by the micro-batches twice (notebooks 07, 11)'
    >>> name_factor(2.0, world_size=4, micro=1, sizes={"expert-parallel": 2}, tol=1e-6)
    'factor 2 = the expert-parallel size: not divided by the expert-parallel size'
    >>> meaning(0.25, world_size=2), meaning(0.3, world_size=2)
    ('divided by the world size twice too often', None)

Introduced in ``notebooks/15_verify_your_own_step.ipynb``; it imports nothing but the standard
library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["factor_meanings", "fmt", "meaning", "name_factor"]


def fmt(x: float) -> str:
    """A factor as the reports print it: 4 significant digits, "-" for NaN."""
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.4g}"


def factor_meanings(world_size: int, micro: int, sizes: Mapping[str, int]) -> list:
    """(factor, "name: what it means"), in the order the course teaches them, for a job of
    ``world_size`` ranks, ``micro`` micro-batches per rank and groups of ``sizes``."""
    n, k, out = world_size, micro, []
    if n > 1:
        out += [(n, "the world size: summed, not divided by the world size (notebook 02)"),
                (1 / n, "1/world size: divided by the world size twice"),
                (1 / n**2, "1/world size²: divided by the world size twice too often")]
    if k > 1:
        out += [(k, "the micro-batch count: not divided by the micro-batches (notebooks 07, 11)"),
                (1 / k, "1/micro-batch count: divided by the micro-batches twice "
                        "(notebooks 07, 11)")]
    if n > 1 and k > 1:
        out += [(n * k, "world size x micro-batches: divided by neither the world size nor "
                        "the micro-batches (notebooks 02, 07, 11)"),
                (1 / (n * k), "1/(world size x micro-batches): divided by the world size and "
                              "by the micro-batches once too often (notebooks 02, 07, 11)")]
    for a, size in sizes.items():
        out += [(size, f"the {a} size: not divided by the {a} size"),
                (1 / size, f"1/{a} size: divided by the {a} size once too often")]
        out += [(size / s, f"{a} size / {b} size: divided by the {b} size where the {a} size "
                           "was due") for b, s in sizes.items() if b != a and s != size]
    return out


def name_factor(f: float, *, world_size: int, micro: int, sizes: Mapping[str, int],
                tol: float) -> str:
    """The diagnosis of a gradient that is a clean multiple ``f`` of one process's."""
    found = [what for c, what in factor_meanings(world_size, micro, sizes)
             if abs(f - c) <= tol * abs(c)]
    if not found:
        return f"off by a constant factor {fmt(f)}"
    first = found[0].split(": ", 1)
    for what in found[1:]:  # equal counts (2 ranks, 2 micro-batches): both readings
        name, why = what.split(": ", 1)
        first = [f"{first[0]} = {name}", f"{first[1]}, or {why}"]
    return f"factor {fmt(f)} = {first[0]}: {first[1]}"


def meaning(f: float, *, world_size: int = 1, micro: int = 1,
            sizes: Mapping[str, int] | None = None, tol: float = 1e-6) -> str | None:
    """What a clean factor ``f`` means ("summed, not divided by the world size (notebook 02)"),
    or None if it is no size of the job."""
    found = [what for c, what in factor_meanings(world_size, micro, sizes or {})
             if abs(f - c) <= tol * abs(c)]
    return found[0].split(": ", 1)[1] if found else None
