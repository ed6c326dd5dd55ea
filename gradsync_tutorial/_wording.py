"""How the package's messages word things: durations, counting, naming ranks, rejecting a bad
count.

One place for each, so that the launcher, its errors, the checks, the doctor and the exercises
say it the same way (and a change of wording is one edit):

    >>> from gradsync_tutorial._wording import duration, plural, ranks, require_int
    >>> [duration(s) for s in (40, 120, 130)]
    ['40 s', '2 min', '2 min 10 s']
    >>> plural(1, "check"), plural(2, "check")
    ('1 check', '2 checks')
    >>> ranks([1]), ranks([0, 2])
    ('rank 1', 'ranks 0, 2')
    >>> require_int(0, "world_size", what="the number of ranks", hint="Try world_size=2.")
    Traceback (most recent call last):
    ValueError: world_size must be a positive int (the number of ranks), got 0. Try world_size=2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def duration(seconds: float) -> str:
    """``130`` -> ``"2 min 10 s"``; ``40`` -> ``"40 s"``; ``120`` -> ``"2 min"`` (whole seconds)."""
    minutes, rest = divmod(round(seconds), 60)
    if not minutes:
        return f"{rest} s"
    return f"{minutes} min" + (f" {rest} s" if rest else "")


def plural(n: int, noun: str) -> str:
    """``"1 check"``, ``"2 checks"``: ``n`` and the noun, with an ``s`` unless ``n == 1``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def ranks(numbers: Iterable[int]) -> str:
    """``"rank 1"`` for one rank, ``"ranks 0, 2"`` for several."""
    numbers = list(numbers)
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    return "ranks " + ", ".join(map(str, numbers))


def require_int(value: Any, name: str, *, minimum: int = 1, what: str = "", hint: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) of at least ``minimum``.

    The message names the argument, what it is for (``what``), the value received, and what to
    do (``hint``): ``world_size must be a positive int (the number of ranks), got 0. Try
    world_size=2.``
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    why = f" ({what})" if what else ""
    raise ValueError(f"{name} must be {kind}{why}, got {value!r}." + (f" {hint}" if hint else ""))
