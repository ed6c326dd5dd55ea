"""Do ranks forked from the launcher's templates pay more for a small collective than fresh ones?

    python benchmarks/small_collectives.py            # 2 ranks, 5 rounds
    SMOKE_TEST=1 python benchmarks/small_collectives.py   # 1 round, 50 calls, for CI

Notebook 05 measures the latency α of a small `all_reduce` on ranks that `gst.launch` forks
from a template process (Linux). A template imported torch before the fork, so a question is
whether a forked rank's gloo is slower than a rank that started as its own interpreter, as under
torchrun. The same function times a 4-byte `all_reduce`, median of back-to-back calls, on:

* forked ranks - `gst.launch(...)`, the course's way (workers forked from the templates);
* fresh ranks  - `torch.multiprocessing.start_processes(start_method="spawn")`: each rank a new
                 interpreter that imports torch itself, as torchrun's workers do.

The two run interleaved, round by round, so that the machine's noise hits them alike; the ratio
of their medians is the figure to read. Each call's time depends on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gradsync_tutorial as gst


def small_all_reduce_ms(rank: int, world_size: int, calls: int) -> float:
    """The median time of ``calls`` back-to-back all_reduces of one float32, in ms."""
    t = torch.zeros(1)
    for _ in range(20):  # warm-up: the first calls set up connections and buffers
        dist.all_reduce(t)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _spawned(rank: int, world_size: int, port: int, calls: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        ms = small_all_reduce_ms(rank, world_size, calls)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out.put(ms)


def fresh(world_size: int, calls: int) -> float:
    """Rank 0's median on spawned interpreters (a new process group each time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_spawned, args=(world_size, port, calls, out), nprocs=world_size,
                       start_method="spawn")
    return out.get()


def forked(world_size: int, calls: int) -> float:
    """Rank 0's median on the launcher's workers."""
    return gst.launch(small_all_reduce_ms, world_size=world_size, args=(calls,))[0]


def main(argv: list[str] | None = None) -> int:
    smoke = os.environ.get("SMOKE_TEST") == "1"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1 if smoke else 5)
    parser.add_argument("--calls", type=int, default=50 if smoke else 500)
    args = parser.parse_args(argv)
    ways = {"forked ranks (gst.launch)": forked, "fresh ranks (spawn)": fresh}
    medians: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            medians[name].append(way(args.world_size, args.calls))
    gst.shutdown_workers()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.world_size} ranks, a 4-byte all_reduce, median of {args.calls} calls a round, "
          f"{args.rounds} rounds interleaved (load average {load:.2f} after)")
    base = statistics.median(medians["fresh ranks (spawn)"])
    for name, values in medians.items():
        m = statistics.median(values)
        print(f"  {name:<26} {m:7.3f} ms   {m / base:5.2f}x fresh   "
              f"(rounds: {', '.join(f'{v:.3f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
