"""What ``verify_gradients`` costs: a training step with the check against the step alone, for
DDP and for FSDP2, measured side by side in one run.

    python benchmarks/verify_cost.py                     # 2 and 4 ranks, a 1.9M-parameter MLP
    python benchmarks/verify_cost.py --world-sizes 2 --rounds 10
    SMOKE_TEST=1 python benchmarks/verify_cost.py        # tiny, for CI

For each number of ranks, one launch builds four runs, each with its own copy of the same MLP
(784 -> 1024 -> 1024 -> 10, float32, 1.86M parameters) and SGD: DDP, DDP + check, FSDP2
(``fully_shard`` on each Linear and the root, a CPU device mesh), FSDP2 + check. A plain step is
forward, backward, the sync (DDP's all_reduce, FSDP2's reduce-scatter), ``optimizer.step()``;
a checked step calls ``verify_gradients`` between the sync and ``optimizer.step()``, with the
objective one process minimises (the cross-entropy's mean over every rank's samples). Its
reference must hold the weights the step started from: DDP's own model is passed (only read, on
a copy); FSDP2's is a plain copy, refreshed after each step from ``full_tensor()`` of every
parameter (an all-gather), a cost that belongs to checking FSDP2 and is counted in its checked
step. Every checked step must pass (``report.ok``), so the time is that of a check that works.

After warm-up, each round runs one step of each of the four runs in a rotating order (the same
on every rank), each started by a ``dist.barrier()``; a step's time is the slowest rank's. The
table gives medians over the rounds, and the check's cost as the median over rounds of
(checked step / plain step, same model, same round); "verify ms" is rank 0's
``verify_gradients`` call alone (its median). Every rank runs with one thread
(``gst.launch(num_threads=1)``): on a 2-core machine 2 ranks use a core each and 4 ranks share.

Memory: each rank's peak resident set (``VmHWM``; ``ru_maxrss`` is the same counter), reset
through ``/proc/self/clear_refs`` before each measured step, so the extra is (the largest
rank's peak in a checked step) - (the largest rank's peak in a plain step) of the same round,
the median over rounds. It counts every allocation, torch's included (``tracemalloc`` would see
only Python's); the allocator may keep or reuse freed pages, so it is a measurement, not a
bound. Without ``clear_refs`` (not Linux) the column says "n/a". Theory, on every rank (an
estimate): one model copy and its gradients (2 x 4 bytes x parameters), the gathered batch (N x
the local batch, plus its pickled copies in ``all_gather_object``), then the larger of the copy's
activations on N x the local batch and the comparison's float64 temporaries (about 5 x 8 bytes x
the largest parameter: here 42 MB, the larger); for FSDP2 also the full gradients gathered from
the shards (4 bytes x parameters).

What grows with N: the reference runs one process's forward and backward on N x the local
batch, on every rank, so that part of the check is about N times a rank's own forward and
backward, while the step's work is constant (data parallelism). The comparison (per-parameter
sums in float64) does not grow with N.

Measured on 2026-12-06 04:20 UTC with ``python benchmarks/verify_cost.py`` (12 rounds, local
batch 128, MLP 1.86M parameters, float32), on a 2-core Linux VM, torch 2.14.1 CPU, gloo, load
average 1.5 (1 min) before the run, after the comparison became dot products on flat float64
vectors with a cached fingerprint pattern (it drew ``torch.randn`` for every parameter before):

    model  ranks  step ms  step+check ms  verify ms  ratio  extra peak RSS/rank  theory
    ddp    2      27.8     88.3           59.1       3.08x  15.8 MB              59.3 MB
    fsdp2  2      61.1     138.6          67.8       2.46x   9.9 MB              66.7 MB
    ddp    4      66.1     264.3          202.8      4.14x  11.9 MB              61.7 MB
    fsdp2  4      130.7    408.6          242.1      3.14x  15.4 MB              69.1 MB

The goal, a checked step within 3x of the plain step, is met for FSDP2 at 2 ranks and missed
by a little elsewhere; at 4 ranks on 2 cores, 4 ranks each run the whole batch's reference, so
the check grows about 3.4x from 2 to 4 ranks. Before the comparison was rewritten, the same
machine, busy (load 5.9), gave 7.25x, 4.92x, 7.14x and 4.42x. The extra memory stays under one
model copy plus the gathered batch (the theory column).

Can the reference work be split over the ranks without trusting the code under test? Yes, for
losses that split: each rank would recompute, on its own plain copy (not the user's model),
one process's gradient on its 1/N share of the whole batch, and the checker would sum the
shares' gradients with an ``all_reduce`` of its own (one model's gradients, once), trusting only
torch.distributed's collective, never the user's averaging code; each rank's reference work
would drop from N to about 1 times its own forward and backward. But the shares must add up to
the whole batch's loss exactly: ``loss_fn`` is a mean over the batch it is given, so the checker
would need the loss as a sum plus a count (its own all_reduce of the counts), or to weigh each
share by its rows, which is right only for a mean of per-sample terms: not for a token mean whose
count is not the rows, a mean of per-sequence means, or a loss that couples samples (in-batch
negatives, batch statistics). It would also lose a cross-check: today every rank computes the
whole reference by itself. Not implemented: ``verify_gradients`` runs the whole batch on every
rank, meant for a step or two of a small configuration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync_tutorial as gst

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"
SEED = 1234
HIDDEN = 32 if SMOKE_TEST else 1024
LOCAL_BATCH = 8 if SMOKE_TEST else 128
INPUTS, CLASSES = 784, 10
RUNS = ("ddp", "ddp + check", "fsdp2", "fsdp2 + check")
GOAL = 3.0  #: the checked step's time, at most this multiple of the plain step's
CLEAR_REFS = Path("/proc/self/clear_refs")


def make_model() -> nn.Module:
    """784 -> H -> H -> 10 with ReLUs (1.86M parameters at H = 1024)."""
    return nn.Sequential(nn.Linear(INPUTS, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def mean_loss(module: nn.Module, batch) -> torch.Tensor:
    """The objective one process minimises: the mean cross-entropy over the batch it gets."""
    x, y = batch
    return F.cross_entropy(module(x), y)


def local_batch(rank: int, k: int):
    """This rank's k-th batch: random inputs and labels, different on every rank and step."""
    g = torch.Generator().manual_seed(SEED + 1000 * k + rank)
    return (torch.randn(LOCAL_BATCH, INPUTS, generator=g),
            torch.randint(0, CLASSES, (LOCAL_BATCH,), generator=g))


def peak_rss_kb() -> int | None:
    """This process's peak resident set since the last reset, in kB (None if unknown)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


def reset_peak() -> bool:
    """Reset the peak resident set to the current one; False where the OS cannot."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class Run:
    """One model in training: DDP or FSDP2, checked or not; ``step(k)`` runs one step."""

    def __init__(self, name: str, world_size: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(SEED)  # the same weights on every rank and in every run
        plain = make_model()
        self.checked = name.endswith("check")
        self.reference = None
        if name.startswith("ddp"):
            self.net = DDP(plain)
            self.reference = self.net  # only read, on a copy, before optimizer.step()
        else:
            self.twin = make_model()
            self.twin.load_state_dict(plain.state_dict())
            mesh = init_device_mesh("cpu", (world_size,))
            for layer in plain:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            self.net = fully_shard(plain, mesh=mesh)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.5)
        self.verify_ms: list[float] = []

    def step(self, rank: int, k: int) -> None:
        """Forward, backward, the sync; the check if this run has one; ``optimizer.step()``."""
        from gradsync_tutorial.verify import verify_gradients

        batch = local_batch(rank, k)
        self.optimizer.zero_grad()
        mean_loss(self.net, batch).backward()  # DDP / FSDP2 sync in the backward
        if self.checked:
            start = time.perf_counter()
            report = verify_gradients(self.net, batch, mean_loss,
                                      reference=self.reference or self.twin)
            self.verify_ms.append((time.perf_counter() - start) * 1e3)
            if not report.ok:
                raise AssertionError(f"the check failed a right step:\n{report}")
        self.optimizer.step()
        if self.checked and self.reference is None:  # FSDP2: the next step's weights
            full = {n: p.full_tensor() for n, p in self.net.state_dict().items()}
            self.twin.load_state_dict(full)


def timed(run: Run, rank: int, k: int) -> tuple[float, float | None]:
    """One step of ``run``: (the slowest rank's ms, the largest rank's peak RSS in kB)."""
    dist.barrier()
    can_reset = reset_peak()
    start = time.perf_counter()
    run.step(rank, k)
    ms = (time.perf_counter() - start) * 1e3
    peak = peak_rss_kb() if can_reset else None
    out = torch.tensor([ms, -1.0 if peak is None else float(peak)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out[0].item(), (None if out[1] < 0 else out[1].item())


def time_runs(rank: int, world_size: int, rounds: int, warmup: int) -> dict:
    """Run in every rank: per run, each round's ms and peak RSS (kB), and the verify calls' ms."""
    runs = {name: Run(name, world_size) for name in RUNS}
    for name in RUNS:
        for k in range(warmup):
            runs[name].step(rank, k)
    ms = {name: [] for name in RUNS}
    rss = {name: [] for name in RUNS}
    for r in range(rounds):
        shift = r % len(RUNS)
        for name in RUNS[shift:] + RUNS[:shift]:  # a rotating order, the same on all ranks
            t, peak = timed(runs[name], rank, warmup + r)
            ms[name].append(t)
            rss[name].append(peak)
    sizes = [p.numel() for p in make_model().parameters()]
    verify = {name: run.verify_ms[warmup:] for name, run in runs.items() if run.checked}
    return {"ms": ms, "rss": rss, "verify_ms": verify, "params": sum(sizes),
            "largest": max(sizes)}


def theory_mb(model: str, params: int, largest: int, world_size: int) -> float:
    """The extra memory the check needs on each rank, in MB (see the module's docstring): a
    model copy and its gradients, N x the batch and its pickles, then the larger of the two
    phases (the copy's activations on N x the batch; the comparison's float64 temporaries),
    and for FSDP2 the full gradients gathered from the shards."""
    copy_and_grads = 2 * 4 * params
    batch = world_size * LOCAL_BATCH * (4 * INPUTS + 8)
    pickled = 2 * batch  # all_gather_object: this rank's pickle, and the others' received
    activations = world_size * LOCAL_BATCH * 4 * (2 * HIDDEN * 2 + CLASSES * 2)
    compare = 5 * 8 * largest  # yours, one process's, the fingerprint, a difference, its square
    full_grads = 4 * params if model == "fsdp2" else 0
    return (copy_and_grads + batch + pickled + max(activations, compare) + full_grads) / 1e6


def summarize(out: dict, world_size: int) -> list[dict]:
    """One row per model (DDP, FSDP2): medians, the per-round ratio, the extra peak RSS."""
    rows = []
    for model in ("ddp", "fsdp2"):
        plain, checked = out["ms"][model], out["ms"][f"{model} + check"]
        rss_plain, rss_checked = out["rss"][model], out["rss"][f"{model} + check"]
        extra = None
        if None not in rss_plain and None not in rss_checked:
            extra = statistics.median(c - p for c, p in zip(rss_checked, rss_plain, strict=True))
        rows.append(dict(
            model=model, ranks=world_size, params=out["params"],
            step_ms=statistics.median(plain), checked_ms=statistics.median(checked),
            verify_ms=statistics.median(out["verify_ms"][f"{model} + check"] or [0.0]),
            ratio=statistics.median(c / p for c, p in zip(checked, plain, strict=True)),
            extra_mb=None if extra is None else extra / 1024,
            theory_mb=theory_mb(model, out["params"], out["largest"], world_size)))
    return rows


def run(world_sizes=(2, 4), *, rounds=None, warmup=None, show=True) -> list[dict]:
    """Time the four runs at each number of ranks; return one row per (model, ranks)."""
    rounds = rounds or (2 if SMOKE_TEST else 12)
    warmup = warmup or (1 if SMOKE_TEST else 3)
    rows, before = [], machine()
    for world_size in world_sizes:
        out = gst.launch(time_runs, world_size, args=(rounds, warmup), num_threads=1,
                         backend="gloo", timeout=1800)[0]
        rows += summarize(out, world_size)
    if show:
        print(f"before: {before}")
        print_table(rows, rounds)
    return rows


def machine() -> str:
    """The machine's facts that move the numbers: cores, load, torch."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} cores, load average {load} (1, 5, 15 min), 1 thread per rank, "
            f"torch {torch.__version__}, gloo")


def print_table(rows: list[dict], rounds: int) -> None:
    """The table, the goal's verdict per row, and how the check's time grows with N."""
    params = rows[0]["params"]
    print(f"MLP {params / 1e6:.2f}M parameters, float32, local batch {LOCAL_BATCH}; medians of "
          f"{rounds} interleaved rounds; ratio: median of per-round (step + check) / step.")
    print(f"after:  {machine()} (the load counts the benchmark's own ranks)")
    header = ("model", "ranks", "step ms", "step+check ms", "verify ms", "ratio",
              f"goal <= {GOAL:.0f}x", "extra peak RSS/rank", "theory")
    lines = [header]
    for r in rows:
        extra = "n/a" if r["extra_mb"] is None else f"{r['extra_mb']:.1f} MB"
        lines.append((r["model"], str(r["ranks"]), f"{r['step_ms']:.1f}",
                      f"{r['checked_ms']:.1f}", f"{r['verify_ms']:.1f}", f"{r['ratio']:.2f}x",
                      "met" if r["ratio"] <= GOAL else "NOT met", extra,
                      f"{r['theory_mb']:.1f} MB"))
    widths = [max(len(x[i]) for x in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    print_growth(rows)


def print_growth(rows: list[dict]) -> None:
    """The verify call's time per model against N (the reference: N x one rank's batch)."""
    for model in ("ddp", "fsdp2"):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["ranks"])
        if len(mine) < 2:
            continue
        first = mine[0]
        steps = ", ".join(f"N={r['ranks']}: {r['verify_ms'] / first['verify_ms']:.2f}x"
                          for r in mine[1:])
        print(f"growth, {model}: the verify call at N={first['ranks']} = 1x; {steps} "
              "(the reference does N x one rank's forward and backward on every rank)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    a = parser.parse_args(argv)
    run(a.world_sizes, rounds=a.rounds, warmup=a.warmup)
    gst.shutdown_workers()


if __name__ == "__main__":
    main()
