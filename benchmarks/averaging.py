"""Per-step time of each way to average gradients, against DDP's, measured side by side.

    python benchmarks/averaging.py                    # 2 and 4 ranks, the CNN and a 10M MLP
    python benchmarks/averaging.py --world-sizes 2 --models cnn
    SMOKE_TEST=1 python benchmarks/averaging.py       # tiny, for CI

For each case (number of ranks x model) one launch builds every variant of
``gst.averaging`` (per-parameter, flat, bucketed, overlap), DDP, and a "compute only" floor
that does not average at all, each with its own copy of the same model and optimizer, and
times whole training steps (forward, backward,
averaging, ``optimizer.step()``) on the same Fashion-MNIST batches. After a few warm-up
steps of each, every round runs K timed steps of each variant (K = 3 for the CNN, 1 for the
MLP), each step started by a ``dist.barrier()`` and timed on every rank (a step's time is the
slowest rank's). Variants are interleaved round by round, in a rotating order, so that bursts
of machine noise hit them alike. The table gives the median over all timed steps (72 for the
CNN, 48 for the MLP), the interquartile range, and each variant's ratio to DDP: the median
over rounds of (its time / DDP's time in the same round), which cancels noise that lasts
longer than a round.

Every rank runs with one thread (``gst.launch(num_threads=1)``): on a 2-core machine, 2 ranks
use one core each and 4 ranks share them, the same for every variant.

Notebook 05 (``notebooks/05_performance.ipynb``) runs :func:`run` and plots its rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync_tutorial as gst

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"
SEED = 1234
LR, MOMENTUM = 0.01, 0.5

#: The models: the course's CNN, and an MLP large enough (10M parameters, 40 MB of gradients
#: in float32) that communication is a large part of each step. Small per-rank batches keep
#: its step short, as on a fast accelerator where compute is cheap and communication is not.
MODELS = {
    "cnn": {"global_batch": 256},
    "mlp": {"global_batch": 64, "hidden": 256 if SMOKE_TEST else 2048},
}

#: What to time: name -> ``gst.averaging.prepare`` arguments (``variant`` and its options);
#: ``"hook"`` registers one of DDP's communication hooks by name (see :func:`build`).
#: ``"variant": None`` does no averaging at all: the floor, what a step costs without
#: communication (its replicas drift apart; only its time counts).
VARIANTS = {name: {"variant": name} for name in gst.averaging.VARIANTS}
VARIANTS["compute only"] = {"variant": None}

#: Goal for each variant's step time, as a ratio to DDP's.
GOALS = {"flat": 1.05, "bucketed": 1.05, "overlap": 1.05}


def make_model(name: str) -> nn.Module:
    """The course's CNN, or an MLP 784 -> H -> H -> H -> 10 (10.0M parameters at H=2048)."""
    if name == "cnn":
        return gst.model.Net()
    h = MODELS["mlp"]["hidden"]
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
        nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10), nn.LogSoftmax(dim=1),
    )


def build(model: nn.Module, spec: dict):
    """``(net, average)`` for one spec (see ``VARIANTS``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    options = dict(spec)
    variant, hook = options.pop("variant"), options.pop("hook", None)
    if variant is None:  # the floor: no communication at all
        return model, lambda: None
    net, average = gst.averaging.prepare(model, variant, **options)
    if hook is not None:
        net.register_comm_hook(None, hooks[hook])
    return net, average


def all_reduce_calls(model: nn.Module, net: nn.Module, average, spec: dict) -> int | None:
    """How many all_reduce calls one step makes (for DDP, read from its logging data)."""
    if spec["variant"] is None:
        return 0
    if isinstance(average, gst.averaging.FlatAverager):
        return 1
    if hasattr(average, "buckets"):  # bucketed, overlap
        return len(average.buckets)
    if net is not model:  # DDP; private API, may change: only for display
        try:
            return int(net._get_ddp_logging_data()["num_buckets_reduced"])
        except Exception:  # noqa: BLE001
            return None
    return sum(1 for p in model.parameters() if p.grad is not None)  # per-parameter


def finish(device: torch.device) -> None:
    """Wait until ``device`` has done the work queued so far: a GPU runs kernels (and nccl's
    calls) after the Python call returns, so a timer stopped without this would time only the
    launches. A no-op on the CPU, whose calls return when done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(rank, world_size, model_name, specs, rounds, warmup, steps):
    """Run in every rank: for each spec, the ms of its timed steps in each round (the slowest
    rank's), and its all_reduce calls per step."""
    device = gst.local_device()
    images, labels = gst.data.load(train=True)
    batch = MODELS[model_name]["global_batch"]
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED))
    n_batches = len(images) // batch

    def batch_at(k):  # the k-th global batch, this rank's share of it: the same for all variants
        idx = order[(k % n_batches) * batch : (k % n_batches + 1) * batch][rank::world_size]
        return images[idx].to(device), labels[idx].to(device)

    runs = {}
    for name, spec in specs.items():
        torch.manual_seed(SEED)  # every variant starts from the same weights
        model = make_model(model_name).to(device)
        net, average = build(model, spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        runs[name] = (model, net, average, optimizer)

    def train_step(name, k):
        model, net, average, optimizer = runs[name]
        x, y = batch_at(k)
        optimizer.zero_grad()
        F.nll_loss(net(x), y).backward()
        average()
        optimizer.step()

    names = list(specs)
    for name in names:  # warm-up; DDP also rebuilds its buckets in its first steps
        for k in range(warmup):
            train_step(name, k)
    times = {name: [] for name in specs}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:  # a rotating order, the same on all ranks
            step_ms = torch.zeros(steps, device=device)  # a collective's tensor: on its device
            for k in range(steps):
                dist.barrier()  # every rank starts the step together
                start = time.perf_counter()
                train_step(name, k + 1)
                finish(device)
                step_ms[k] = (time.perf_counter() - start) * 1e3
            dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)  # each step: the slowest rank's time
            times[name].append(step_ms.tolist())
    calls = {name: all_reduce_calls(*runs[name][:3], specs[name]) for name in names}
    n_params = sum(p.numel() for p in runs[names[0]][0].parameters())
    return {"ms": times, "calls": calls, "params": n_params}


def run(world_sizes=(2, 4), models=("cnn", "mlp"), specs=None, *, rounds=None, warmup=None,
        steps=None, reference="ddp", show=True, goals=True) -> list[dict]:
    """Time every spec in every case; return one row per case and spec; print the table.

    ``rounds``: timed rounds per case, one number or ``{model: rounds}`` (default 24 for the
    CNN, 48 for the MLP). ``goals=False`` prints the table without the goal column (the
    maintainers' acceptance check, which a reader of notebook 05 does not need).

    Each row: ``model, params, ranks, name, ms`` (median ms per step), ``ms_all`` (every
    timed step), ``calls`` (all_reduce calls per step) and ``ratio``: the median, over rounds,
    of this spec's time divided by the reference's time *in the same round*. Pairing the two
    cancels machine noise that lasts longer than a round.
    """
    specs = VARIANTS if specs is None else specs
    warmup = warmup or (1 if SMOKE_TEST else 3)
    rows = []
    for world_size in world_sizes:
        for model_name in models:
            cnn = model_name == "cnn"
            r = rounds.get(model_name) if isinstance(rounds, dict) else rounds
            r = r or (1 if SMOKE_TEST else (24 if cnn else 48))
            k = steps or (1 if SMOKE_TEST else (3 if cnn else 1))
            out = gst.launch(time_steps, world_size, args=(model_name, specs, r, warmup, k),
                             num_threads=1, timeout=1800)[0]
            ref_rounds = out["ms"][reference]
            for name in specs:
                ms_all = [t for one_round in out["ms"][name] for t in one_round]
                ratio = statistics.median(
                    statistics.fmean(mine) / statistics.fmean(ref)
                    for mine, ref in zip(out["ms"][name], ref_rounds, strict=True))
                rows.append(dict(model=model_name, params=out["params"], ranks=world_size,
                                 name=name, ms=statistics.median(ms_all), ms_all=ms_all,
                                 calls=out["calls"][name], ratio=ratio))
    if show:
        print_table(rows, reference, goals=goals)
    return rows


def print_table(rows: list[dict], reference: str = "ddp", goals: bool = True) -> None:
    """One line per row: median ms per step, interquartile range, ratio to the reference, and
    (``goals=True``) each variant's goal and whether this run met it."""
    counts = {}  # timed steps per line, for each model: rounds x steps differ between models
    for r in rows:
        counts.setdefault(r["model"], len(r["ms_all"]))
    per_model = ", ".join(f"{n} for the {model.upper()}" for model, n in counts.items())
    print(f"ms/step: median of the timed steps of each line ({per_model}), interleaved; "
          f"vs {reference}: median of the per-round ratios. {os.cpu_count()} cores, "
          f"1 thread per rank, torch {torch.__version__}")
    header = ("model", "ranks", "variant", "calls/step", "ms/step", "middle 50%",
              f"vs {reference}", "goal")[: None if goals else -1]
    lines = []
    for r in rows:
        goal = GOALS.get(r["name"])
        if goal is not None:
            verdict = f"<= {goal:.2f}x: {'met' if r['ratio'] <= goal else 'NOT met'}"
        else:
            verdict = {"per-parameter": "the slow case",
                       "compute only": "floor: no communication"}.get(r["name"], "")
        ms_all = r["ms_all"] if len(r["ms_all"]) > 1 else r["ms_all"] * 2  # quantiles needs 2
        q1, _, q3 = statistics.quantiles(ms_all, n=4)
        lines.append((f"{r['model']} ({r['params'] / 1e6:.2f}M)", str(r["ranks"]), r["name"],
                      "?" if r["calls"] is None else str(r["calls"]), f"{r['ms']:.1f}",
                      f"{q1:.1f}-{q3:.1f}", f"{r['ratio']:.2f}x", verdict)[: len(header)])
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
    for line in [header, *lines]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["cnn", "mlp"])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round")
    a = parser.parse_args(argv)
    run(a.world_sizes, a.models, rounds=a.rounds, steps=a.steps)
    gst.shutdown_workers()


if __name__ == "__main__":
    main()
