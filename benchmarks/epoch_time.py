"""Do the notebooks' training loops cost more than a bare loop? Ratios side by side, one run.

    python benchmarks/epoch_time.py                  # full Fashion-MNIST epochs, 3 rounds
    SMOKE_TEST=1 python benchmarks/epoch_time.py     # a small subset, 1 round (for CI)

It runs, in this process and with a world size of 1, one epoch of:

* bare      - the floor: batches sliced in order from in-memory tensors, forward, backward, step;
* nb01      - notebook 01's ``train`` (seeded shuffle, index, ``loss.item()``);
* nb02      - notebook 02's ``train`` (plus ``average_gradients``: one all_reduce per parameter);
* nb03      - notebook 03's ``train`` with DDP and ``DistributedSampler``.

The notebooks' code is read from the notebooks themselves (``gst.notebooks.load_function``:
their settings cell and their ``train``), so this measures the code a reader runs. Goal: each
notebook loop within 1.1x of the bare loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradsync_tutorial as gst

SMOKE = os.environ.get("SMOKE_TEST") == "1"


def bare_epoch(images, labels, batch_size: int) -> None:
    torch.manual_seed(0)
    model = gst.model.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    model.train()
    for start in range(0, len(images), batch_size):
        x, y = images[start : start + batch_size], labels[start : start + batch_size]
        optimizer.zero_grad()
        F.nll_loss(model(x), y).backward()
        optimizer.step()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1 if SMOKE else 3)
    a = parser.parse_args(argv)
    n_train = 8192 if SMOKE else None
    images, labels = gst.data.load(train=True)
    images, labels = images[:n_train], labels[:n_train]

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    load = gst.notebooks.load_function
    nb01 = load("01_single_device_baseline", "train")
    nb02 = load("02_manual_allreduce_averaging", "train", requires=["average_gradients"])
    nb03 = load("03_distributed_data_parallel", "train")
    for fn in (nb01, nb02, nb03):
        fn.__globals__["N_TRAIN"] = n_train  # the notebooks' own setting follows SMOKE_TEST

    variants = {
        "bare": lambda: bare_epoch(images, labels, 256),
        "nb01": lambda: nb01(1),
        "nb02": lambda: nb02(0, 1, 1),
        "nb03": lambda: nb03(0, 1, 1),
    }
    for fn in variants.values():  # warm-up: first calls pay for lazy initialization
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    dist.destroy_process_group()

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"one epoch of {len(images)} images, batch 256, {torch.get_num_threads()} threads, "
          f"median of {a.rounds} rounds")
    for name, seconds in med.items():
        ratio = seconds / med["bare"]
        goal = "" if name == "bare" else ("  ok (<= 1.1x)" if ratio <= 1.1 else "  over 1.1x")
        print(f"  {name:5s} {seconds:7.2f} s  {ratio:5.2f}x bare{goal}")


if __name__ == "__main__":
    main()
