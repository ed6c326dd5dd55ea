"""Notebook 02, copy this into your code: average the gradients by hand, SUM then divide.

    torchrun --standalone --nproc-per-node 2 snippets/02_average_gradients.py
"""

import copy
import os
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn


def average_gradients(model):
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
        param.grad /= world_size                            # the mean


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


def main():
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                       # the same initial weights on every rank
    model = nn.Linear(20, 3).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 20).to(device), torch.randint(0, 3, (64,)).to(device)  # one batch...
    shard = slice(rank, None, world_size)      # ...a different shard of it on each rank
    whole = copy.deepcopy(model)               # for the check below: one process, all 64
    torch.manual_seed(0 + rank)                # then each rank its own dropout masks (seed + rank)

    loss = F.cross_entropy(model(x[shard]), y[shard])
    loss.backward()
    average_gradients(model)
    optimizer.step()

    # Check: every rank holds the gradient of the loss over the whole batch, as one process would.
    F.cross_entropy(whole(x), y).backward()
    for p, q in zip(model.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    print(f"rank {rank}: averaged gradient == gradient of the whole batch, "
          f"on {device} ({dist.get_backend()})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
