"""Notebook 13, copy this into your code: DiLoCo's outer step, its pseudo-gradient averaged over
the replicas that take part (a healing replica sends zeros).

    torchrun --standalone --nproc-per-node 2 snippets/13_diloco_outer_step.py
"""

import os
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn

INNER_STEPS = 4  # H: inner steps per round


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


def average_pseudo_gradient(model, start, participating):
    """(start - weights now), averaged over the replicas that take part: the same list on every
    rank. A healing replica (participating=False) sends zeros and receives the average."""
    count = torch.tensor([float(participating)], dtype=start[0].dtype, device=start[0].device)
    dist.all_reduce(count)                     # how many replicas take part in this round
    if count.item() == 0:
        raise RuntimeError("no replica takes part in this round: skip the outer step")
    averaged = []
    for s, p in zip(start, model.parameters(), strict=True):
        pseudo = s - p.detach() if participating else torch.zeros_like(s)  # before - after
        dist.all_reduce(pseudo)                # SUM over the replicas
        averaged.append(pseudo / count)        # / the participants, not / the world size
    return averaged


def outer_step(model, global_params, outer_optimizer, pseudo_gradients):
    """The outer optimizer steps the global weights; every replica starts the next round there."""
    for g, d in zip(global_params, pseudo_gradients, strict=True):
        g.grad = d
    outer_optimizer.step()
    outer_optimizer.zero_grad()
    with torch.no_grad():
        for g, p in zip(global_params, model.parameters(), strict=True):
            p.copy_(g)


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def main():
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                       # the same initial weights on every replica
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    global_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    outer = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
    data = torch.Generator().manual_seed(1 + rank)  # each replica trains on its own data

    for round_ in range(2):
        healing = world_size - 1 if round_ == 1 and world_size > 1 else None  # round 2: one out
        for _ in range(INNER_STEPS):
            x = torch.randn(32, 8, generator=data).to(device)
            inner.zero_grad()
            F.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
            inner.step()
        start = [g.detach() for g in global_params]  # the weights this round started from
        pseudo = average_pseudo_gradient(model, start, participating=rank != healing)

        # Check: the participants' mean of (start - weights), from every replica's weights.
        everyone = [torch.empty_like(flat(model.parameters())) for _ in range(world_size)]
        dist.all_gather(everyone, flat(model.parameters()))
        taking_part = torch.stack([w for r, w in enumerate(everyone) if r != healing])
        torch.testing.assert_close(flat(pseudo), flat(start) - taking_part.mean(0))
        outer_step(model, global_params, outer, pseudo)

    mine = flat(model.parameters())
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(w, mine) for w in everyone)  # the replicas start round 3 equal
    print(f"rank {rank}: pseudo-gradient == mean over the participants of (start - weights), "
          f"a healing replica out; replicas equal after the outer step, on {device} "
          f"({dist.get_backend()})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
