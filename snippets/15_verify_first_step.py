"""Notebook 15, copy this into your code: a torchrun script that checks its first step against one
process (verify_gradients), then trains on without the check.

    torchrun --standalone --nproc-per-node 2 snippets/15_verify_first_step.py

Check a tiny configuration of your own code this way, in float64: the check gathers every rank's
batch and runs one process's step on all of it, on every rank.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_tutorial.verify import verify_gradients  # imports torch only

SEED, STEPS = 1234, 5


def init_distributed():
    """Join the group torchrun prepared (RANK, WORLD_SIZE, MASTER_ADDR...); return the device.

    With a GPU for every rank on this machine: nccl, this rank on GPU LOCAL_RANK. Otherwise
    gloo, on the CPU (a laptop; also 2 ranks on 1 GPU, which nccl cannot share): with a
    warning that gives both numbers when CUDA is there but has fewer GPUs than ranks.
    """
    local_rank, ranks_here = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    if gpus >= ranks_here:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)          # before init: nccl and *_object calls use it
        dist.init_process_group("nccl", device_id=device)  # barrier() too
        return device
    if gpus:                                   # CUDA, but not a GPU per rank: never silently
        warnings.warn(f"{gpus} GPU(s) visible for {ranks_here} ranks on this machine: this "
                      "job trains on the CPU with gloo. For nccl, start one rank per GPU "
                      f"(--nproc-per-node {gpus}) or check CUDA_VISIBLE_DEVICES.", stacklevel=2)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def batch_of(rank, step, device, samples=16):
    """This rank's batch of the step: its own random samples (inputs, targets)."""
    g = torch.Generator().manual_seed(SEED + 1000 * step + rank)
    inputs = torch.randn(samples, 8, generator=g, dtype=torch.float64)
    return inputs.to(device), inputs.sum(dim=1, keepdim=True).to(device)


def one_process_loss(model, batch):
    """The loss ONE process minimises on a whole batch: the mean over its samples."""
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def main():
    device = init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(SEED)                    # the same initial weights on every rank
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).double().to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        batch = batch_of(rank, step, device)
        optimizer.zero_grad()
        loss = one_process_loss(model, batch)  # each rank's mean; DDP averages the gradients
        loss.backward()
        if step == 0:                          # check the first step, then train without it
            report = verify_gradients(model, batch, one_process_loss, reference=model)
            if rank == 0:
                print(report)
            if not report.ok:                  # the same verdict on every rank: all stop
                dist.destroy_process_group()
                sys.exit(f"rank {rank}: the gradients are not one process's: {report.verdict}")
        optimizer.step()
    print(f"rank {rank}: step 0 verified against one process, then {STEPS} steps trained")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
