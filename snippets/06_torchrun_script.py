"""Notebook 06, copy this into your code: the shape of a torchrun script (the whole course
version: scripts/train_ddp.py).

    torchrun --standalone --nproc-per-node 2 snippets/06_torchrun_script.py --checkpoint ckpt.pt
    torchrun --standalone --nproc-per-node 2 snippets/06_torchrun_script.py --checkpoint ckpt.pt \\
        --resume --epochs 4
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 1234


def init_distributed():
    """Join the group torchrun prepared (it set RANK, WORLD_SIZE, MASTER_ADDR...)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.device_count() > local_rank:
        torch.cuda.set_device(local_rank)      # before init: nccl uses this GPU
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def train(args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = TensorDataset(torch.randn(512, 20, generator=torch.Generator().manual_seed(SEED)),
                            torch.arange(512) % 3)
    torch.manual_seed(SEED)
    model = DDP(nn.Linear(20, 3).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    done = 0
    if args.resume:                            # every rank loads the file rank 0 wrote
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        done = checkpoint["epochs_done"]
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=64 // world_size, sampler=sampler)
    for epoch in range(done, args.epochs):
        sampler.set_epoch(epoch)               # a new order every epoch, the same on all ranks
        total = torch.zeros(2, device=device)  # this rank's loss sum and sample count
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(len(y), device=device)])
        dist.all_reduce(total)                 # the loss over all ranks, on every rank
        if rank == 0:                          # log from rank 0 only
            print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}")
        if args.checkpoint:
            if rank == 0:                      # rank 0 saves, once
                torch.save({"model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "epochs_done": epoch + 1},
                           args.checkpoint)
            dist.barrier()                     # then no rank goes on before the file is whole


@record                                        # the failing rank's traceback in torchrun's summary
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    device = init_distributed()
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()           # after an error too


if __name__ == "__main__":
    main()
