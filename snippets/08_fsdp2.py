"""Notebook 08, copy this into your code: FSDP2 (fully_shard), each rank holding 1/N of the
parameters, gradients and optimizer state.

    torchrun --standalone --nproc-per-node 2 snippets/08_fsdp2.py
"""

import copy
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

CHECKPOINT = "checkpoints/08_fsdp2"  # a folder every rank can read (shared file system on many
                                    # machines): each rank writes its own file into it


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


def sum_gradients_over_ranks(model):
    """For token-count losses (each rank's loss: its sum / the global count): FSDP2 sums the
    gradients over the ranks instead of averaging them. Neither setter recurses, so set both on
    every FSDP unit: on the root alone, the blocks still divide by N (notebook 08: 0.5x)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):     # each fully_shard'ed block, and the root
            module.set_gradient_divide_factor(1.0)          # no ÷ N: the loss holds the mean
            module.set_force_sum_reduction_for_comms(True)  # SUM: gloo has no PREMUL_SUM


def check_token_count_loss(whole, mesh, device):
    """Check: a token-count loss on uneven ranks (8, 16, ... tokens) gives one process's mean
    over every token, with sum_gradients_over_ranks on a model sharded block by block."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    whole.zero_grad()
    model = copy.deepcopy(whole)               # the same weights on every rank
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_gradients_over_ranks(model)            # after the last fully_shard
    counts = [8 * (r + 1) for r in range(world_size)]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), 20, generator=g).to(device)
    y = torch.randint(0, 3, (sum(counts),), generator=g).to(device)
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    tokens = torch.tensor(float(counts[rank]), device=device)
    dist.all_reduce(tokens)                    # the global count
    (F.cross_entropy(model(x[mine]), y[mine], reduction="sum") / tokens).backward()
    F.cross_entropy(whole(x), y).backward()    # one process: the mean over every token
    for p, q in zip(model.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)


def main():
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The same initial weights on every rank: FSDP2, unlike DDP, broadcasts nothing.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3)).to(device)
    whole = copy.deepcopy(model)               # for the check below: one process, every sample

    mesh = init_device_mesh(device.type, (world_size,))  # "cuda" with nccl, "cpu" with gloo
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)      # its gradients are reduce-scattered once ready
    fully_shard(model, mesh=mesh)              # the root: whatever is left
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # 1/N of the state
    # A token-count loss needs sum_gradients_over_ranks(model) here (checked at the end).

    g = torch.Generator().manual_seed(1)       # one global batch, 16 samples per rank...
    n = 16 * world_size                        # equal shards: FSDP2's mean is then the mean
    x, y = torch.randn(n, 20, generator=g).to(device), torch.randint(0, 3, (n,), generator=g)
    y = y.to(device)
    mine = slice(rank, None, world_size)       # ...a different shard on each rank
    reference = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()  # reduce-scattered: the mean, 1/N
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # the global norm
        optimizer.step()
        reference.zero_grad()
        F.cross_entropy(whole(x), y).backward()
        whole_norm = nn.utils.clip_grad_norm_(whole.parameters(), max_norm=0.5)
        reference.step()

    # To checkpoint FSDP2, DCP writes each rank's own shards: no rank holds the whole model.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=CHECKPOINT)

    # For the check only: full_tensor() gathers every whole tensor onto every rank.
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank calls it
    # Check: 3 steps of FSDP2 on N ranks are 3 steps of one process on the whole batch.
    torch.testing.assert_close(norm.full_tensor(), whole_norm)
    for name, p in whole.state_dict().items():
        torch.testing.assert_close(state[name], p)
    # Check: loading the checkpoint brings back the weights, after they were zeroed.
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=CHECKPOINT)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p.full_tensor(), state[name])
    check_token_count_loss(whole, mesh, device)
    print(f"rank {rank}: holds {sum(p.to_local().numel() for p in model.parameters())} of "
          f"{sum(p.numel() for p in whole.parameters())} parameters; after 3 steps the model "
          "equals one process's on the whole batch, and so does the reloaded checkpoint; a "
          "token-count loss on uneven ranks gives one process's gradient")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
