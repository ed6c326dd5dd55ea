"""Notebook 06, copy this into your code: the shape of a torchrun script (the whole course
version: scripts/train_ddp.py).

    torchrun --standalone --nproc-per-node 2 snippets/06_torchrun_script.py --checkpoint ckpt.pt
    torchrun --standalone --nproc-per-node 2 snippets/06_torchrun_script.py --checkpoint ckpt.pt \\
        --resume --epochs 4
"""

import argparse
import os
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
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


def save_checkpoint(path, model, optimizer, epochs_done, device):
    """Every rank calls it; rank 0 writes model, optimizer, epochs done, every rank's RNG."""
    rng = {"cpu": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng)          # each rank's generators: its own dropout masks
    if dist.get_rank() == 0:                   # rank 0 saves, once
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # its folder, the first time
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epochs_done": epochs_done, "rng": rngs}, path + ".tmp")
        os.replace(path + ".tmp", path)        # atomic if the process dies: old file or new
        # (if the machine dies, the rename can reach the disk first: os.fsync the .tmp before)
    dist.barrier()                             # then no rank goes on before the file is whole


def load_checkpoint(path, model, optimizer, device):
    """Every rank loads the file rank 0 wrote; returns the number of epochs done."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # not onto rank 0's GPU
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    rngs = checkpoint["rng"]                   # (on another number of ranks: other draws)
    rng = rngs[dist.get_rank() % len(rngs)]    # this rank's own generators
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"], device)
    return checkpoint["epochs_done"]


def train(args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = TensorDataset(torch.randn(512, 20, generator=torch.Generator().manual_seed(SEED)),
                            torch.arange(512) % 3)
    torch.manual_seed(SEED)                    # the same initial weights on every rank...
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    model = DDP(model.to(device))
    torch.manual_seed(SEED + rank)             # ...then each rank its own dropout masks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    done = 0
    resume = [args.resume and os.path.exists(args.checkpoint)]  # a first start has no file yet
    dist.broadcast_object_list(resume, src=0)  # rank 0 decides for all: every rank loads, or none
    if resume[0]:
        done = load_checkpoint(args.checkpoint, model, optimizer, device)
    if rank == 0 and args.resume:
        print(f"resumed after epoch {done}" if done else "no checkpoint yet: from scratch")
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
            save_checkpoint(args.checkpoint, model, optimizer, epoch + 1, device)


@record                                        # the failing rank's traceback in torchrun's summary
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    if args.resume and not args.checkpoint:
        parser.error("--resume continues from --checkpoint: give --checkpoint PATH too")
    device = init_distributed()
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()           # after an error too


if __name__ == "__main__":
    main()
