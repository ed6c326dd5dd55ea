"""Notebook 04, copy this into your code: the training loop with every pitfall's fix, by name.

    torchrun --standalone --nproc-per-node 2 snippets/04_pitfall_fixes.py
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 1234


def assert_same_across_ranks(value, what):     # uneven steps: a count all ranks must agree on
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    assert all(v == everyone[0] for v in everyone), f"{what} differ across ranks: {everyone}"


def assert_disjoint_shards(indices):          # unsharded data: no sample on two ranks
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(indices))
    seen = [i for shard in everyone for i in shard]
    repeats = len(seen) - len(set(seen))       # DistributedSampler pads with < world_size
    assert repeats < dist.get_world_size(), f"{repeats} samples are on several ranks"


def assert_equal_replicas(model):             # different weights, BatchNorm buffers
    mine = torch.cat([t.detach().double().flatten() for t in model.state_dict().values()])
    rank_0 = mine.clone()
    dist.broadcast(rank_0, src=0)
    differ = torch.tensor([float(not torch.equal(mine, rank_0))], device=mine.device)
    dist.all_reduce(differ)                    # every rank learns it, so every rank raises
    assert differ.item() == 0, "the replicas differ"


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
    device = init_distributed()                # set_device first: all_gather_object uses it
    rank = dist.get_rank()
    dataset = TensorDataset(torch.randn(500, 20, generator=torch.Generator().manual_seed(SEED)),
                            torch.arange(500) % 3)
    per_rank_batch, epochs = 32, 2

    torch.manual_seed(SEED)                                # different weights: one seed...
    model = nn.Linear(20, 3).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)                      # ...and rank 0's weights everywhere
    torch.manual_seed(SEED + rank)                         # then each rank its own dropout masks
    assert_equal_replicas(model)                           # different weights, BatchNorm
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # unsharded data, uneven steps
    loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler)
    assert_disjoint_shards(sampler)                        # unsharded data
    assert_same_across_ranks(len(loader), "batches per epoch")  # uneven steps
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                           # no set_epoch
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            loss_sum = F.cross_entropy(model(x), y, reduction="sum")
            totals = torch.stack([loss_sum.detach(), torch.tensor(float(len(y)), device=x.device)])
            dist.all_reduce(totals)                        # mean of means, local loss: every rank
            (loss_sum / totals[1]).backward()              # this rank's part of the global mean
            for p in model.parameters():
                if p.grad is None:                         # unused parameter (or zeros)
                    continue
                dist.all_reduce(p.grad)                    # the parts sum to the global mean
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0 and step % 10 == 0:
                print(f"loss {totals[0] / totals[1]:.4f}")  # local loss: log the global one
    assert_equal_replicas(model)

    # Mean of means with DDP: DDP divides the summed gradients by world_size, so scale this
    # rank's part by world_size. Checked on unequal local batches: 8 samples on even ranks, 5 on
    # odd ones.
    n = 8 - 3 * (rank % 2)
    x, y = (t.to(device) for t in dataset[rank * 8 : rank * 8 + n])
    ddp = DDP(copy.deepcopy(model))
    loss_sum = F.cross_entropy(ddp(x), y, reduction="sum")
    count = torch.tensor(float(len(y)), device=device)
    dist.all_reduce(count)
    (loss_sum * dist.get_world_size() / count).backward()  # mean of means, with DDP
    loss_sum = F.cross_entropy(model(x), y, reduction="sum")
    (loss_sum / count).backward()                          # mean of means, by hand
    for p in model.parameters():
        dist.all_reduce(p.grad)
    for p, q in zip(model.parameters(), ddp.module.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    print(f"rank {rank}: replicas equal; DDP's gradient == the global mean's on uneven batches, "
          f"on {device} ({dist.get_backend()})")
    del ddp                                    # free DDP before its group (notebook 06: why)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
