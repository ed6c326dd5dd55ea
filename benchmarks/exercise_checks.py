"""How long does each exercise check take on its reference solution? Side by side, one run.

    python benchmarks/exercise_checks.py              # every check, 3 rounds
    python benchmarks/exercise_checks.py --rounds 1 gather_ranks average_gradients_flat

A check launches its worker at two world sizes (2 ranks, then a size drawn once per process
from 3 to 5); the launcher keeps the idle workers of the last two sizes, so a check after the
first starts no process. Next to each check, in the same round, this times the floor it cannot
go under: two launches of a function that does nothing, at the same sizes and in the same order
(``launch floor``). The ratio check / floor is what the check itself adds, and it holds on a
busy machine, where the seconds do not. The target: each check under 10 s on a quiet 2-core
machine.

Rounds are interleaved (every check once, then again), so that bursts of machine noise hit
them alike; the table gives the median of the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import statistics
import time
from pathlib import Path

import gradsync_tutorial as gst
from gradsync_tutorial.exercises import EXERCISES, common

SOLUTIONS = Path(__file__).resolve().parent.parent / "notebooks" / "solutions"


def nothing(rank: int, world_size: int) -> None:
    return None


def floor() -> float:
    """Two launches of nothing, as a check makes them: one on warm workers, one on fresh."""
    start = time.perf_counter()
    for n in common.warm_first(common.WORLD_SIZES):
        gst.launch(nothing, n, backend="gloo")
        common.note_launched(n)
    return time.perf_counter() - start


def timed_check(name: str) -> float:
    fn = runpy.run_path(str(SOLUTIONS / EXERCISES[name].solution))[name]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        EXERCISES[name].check(fn)
    took = time.perf_counter() - start
    assert out.getvalue().startswith("✓ correct"), out.getvalue()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(EXERCISES), help="exercises to time")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in args.names}
    floor()  # so that the first round starts, as the others do, with idle workers of one size
    for _ in range(args.rounds):
        for name in args.names:
            launches = floor() if name != "accumulate_gradients" else 0.0  # runs in-process
            times[name].append((timed_check(name), launches))
    print(f"{'exercise':24} {'check s':>8} {'floor s':>8} {'check - floor':>14}  (median of "
          f"{args.rounds} rounds)")
    for name, pairs in times.items():
        check = statistics.median(c for c, _ in pairs)
        low = statistics.median(f for _, f in pairs)
        print(f"{name:24} {check:8.2f} {low:8.2f} {check - low:14.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    gst.shutdown_workers()


if __name__ == "__main__":
    main()
