"""Notebook 03, copy this into your code: DistributedDataParallel, a sampler, a checkpoint.

    torchrun --standalone --nproc-per-node 2 snippets/03_ddp.py
"""

import os
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 1234


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
    dataset = TensorDataset(torch.randn(512, 20, generator=torch.Generator().manual_seed(SEED)),
                            torch.arange(512) % 3)
    global_batch, epochs, path = 64, 2, "ddp_checkpoint.pt"

    model = DDP(nn.Linear(20, 3).to(device))  # after init: copies rank 0's weights to all
    torch.manual_seed(SEED + rank)            # then each rank its own dropout masks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # a different shard per rank
    loader = DataLoader(dataset, batch_size=global_batch // world_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)               # or every epoch repeats the same order
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()  # gradients are averaged across ranks here
            optimizer.step()

    if rank == 0:                              # one file, written once
        torch.save(model.module.state_dict(), path)  # .module: the unwrapped model
    dist.barrier()                             # no rank reads it, or exits, before it is written

    # Check: the file holds every rank's weights. Rank 0 alone reads it back (it is on rank 0's
    # disk), and every rank compares its weights with rank 0's, so no machine needs the file.
    # map_location: onto this rank's device, not onto the GPU the tensors were saved from.
    saved = torch.load(path, map_location=device, weights_only=True) if rank == 0 else None
    for name, p in model.module.state_dict().items():
        rank_0 = p.clone()
        dist.broadcast(rank_0, src=0)          # every rank receives rank 0's tensor
        assert torch.equal(rank_0, p), name    # the replicas are equal...
        assert rank != 0 or torch.equal(saved[name], p), name  # ...and equal to the file
    print(f"rank {rank}: {len(loader)} steps an epoch, weights equal to the checkpoint, "
          f"on {device} ({dist.get_backend()})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
