"""How long does `gst.launch` take to start N ranks? Ratios measured side by side, one run.

    python benchmarks/launch_overhead.py            # 2 ranks, 5 rounds
    SMOKE_TEST=1 python benchmarks/launch_overhead.py   # 1 round, for CI

Five ways to run a function that initializes the process group on N ranks, interleaved
round by round so that machine noise hits them alike:

* bare spawn  - N `python -c "import torch; init_process_group(...)"` processes: the floor for
                any launcher that starts fresh interpreters (what torchrun does);
* cold launch - a kernel's first `gst.launch`: its template imports torch once, then forks the
                ranks (Linux; elsewhere each rank imports torch; goal: 1.1x bare or less);
* first launch - `gst.launch(..., reuse_workers=False)`: fresh workers, forked from the
                template that is already there (`gst.shutdown_workers()` ends the templates too);
* repeat launch - `gst.launch(...)` with the workers kept from the previous launch (goal:
                0.03 s or less, and below fork);
* fork        - `torch.multiprocessing.start_processes(start_method="fork")`, for reference:
                fast, but unsafe once CUDA is initialized and absent on Windows.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

import gradsync_tutorial as gst

BARE = (
    "import torch, torch.distributed as dist, sys; "
    "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', "
    "rank=int(sys.argv[1]), world_size={n}); dist.destroy_process_group()"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bare_spawn(n: int) -> None:
    code = BARE.format(port=free_port(), n=n)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)]) for r in range(n)]
    assert all(p.wait() == 0 for p in procs)


def init_only(rank: int, world_size: int) -> None:
    """For fork: what launch does for us (the process group), then nothing."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.destroy_process_group()


def forked(n: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.start_processes(init_only, args=(n,), nprocs=n, start_method="fork")


def noop(rank: int, world_size: int) -> int:
    return rank


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1 if os.environ.get("SMOKE_TEST") else 5)
    a = parser.parse_args(argv)
    n = a.world_size
    gst.launch(noop, n)  # warm up imports and the pool once
    times: dict[str, list[float]] = {k: [] for k in ("bare", "cold", "first", "repeat", "fork")}
    for round_ in range(a.rounds):
        times["bare"].append(timed(bare_spawn, n))
        gst.shutdown_workers()
        os.environ["GRADSYNC_BENCH_ROUND"] = str(round_)  # an environment no template has seen
        times["cold"].append(timed(gst.launch, noop, n))
        times["first"].append(timed(lambda: gst.launch(noop, n, reuse_workers=False)))
        gst.launch(noop, n)  # a pool kept for the repeat launches
        times["repeat"].append(statistics.median(timed(gst.launch, noop, n) for _ in range(5)))
        if sys.platform != "win32":
            times["fork"].append(timed(forked, n))
    gst.shutdown_workers()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    print(f"{n} ranks, {a.rounds} rounds, {os.cpu_count()} cores, load average {load} "
          "(median seconds)")
    print(f"  bare spawn (floor)    {med['bare']:6.3f} s")
    ratio = {k: med[k] / med["bare"] for k in ("cold", "first", "repeat")}
    print(f"  cold launch           {med['cold']:6.3f} s   {ratio['cold']:5.2f}x bare"
          f"   (goal <= 1.1x bare: {_met(ratio['cold'] <= 1.1)})")
    print(f"  first launch          {med['first']:6.3f} s   {ratio['first']:5.2f}x bare")
    below_fork = "fork" not in med or med["repeat"] < med["fork"]
    print(f"  repeat launch         {med['repeat']:6.3f} s   {ratio['repeat']:5.2f}x bare"
          f"   (goal <= {REPEAT_GOAL} s and below fork: "
          f"{_met(med['repeat'] <= REPEAT_GOAL and below_fork)})")
    if "fork" in med:
        print(f"  fork (CUDA-unsafe)    {med['fork']:6.3f} s   "
              f"repeat launch is {med['repeat'] / med['fork']:4.2f}x fork")


REPEAT_GOAL = 0.03  # seconds: a repeat launch of a trivial job


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


if __name__ == "__main__":
    main()
