"""Notebook 07, copy this into your code: a loss that is the mean over every valid token of every
micro-batch of every rank, under DDP with gradient accumulation.

    torchrun --standalone --nproc-per-node 2 snippets/07_global_token_mean.py
"""

import copy
import os
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SEED = 1234
VOCAB, IGNORE_INDEX = 50, -100  # -100: F.cross_entropy's default ignore_index (padding)


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


def micro_batches_of(rank, device, k=2, lines=3):
    """Rank `rank`'s k micro-batches (inputs, targets) of padded random sequences: the ranks and
    the micro-batches hold different numbers of valid tokens."""
    g = torch.Generator().manual_seed(SEED + rank)
    batches = []
    for _ in range(k):
        lengths = torch.randint(1, 6 + 10 * rank, (lines,), generator=g)
        inputs = torch.randint(0, VOCAB, (lines, int(lengths.max())), generator=g)
        targets = torch.randint(0, VOCAB, inputs.shape, generator=g)
        targets[torch.arange(inputs.shape[1]) >= lengths[:, None]] = IGNORE_INDEX  # padding
        batches.append((inputs.to(device), targets.to(device)))
    return batches


def loss_sum(model, inputs, targets):
    logits = model(inputs)                     # (lines, positions, VOCAB)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def token_mean_backward(model, micro_batches):
    """backward() on this rank's micro-batches; then every rank's .grad is the gradient of the
    mean loss over every valid token of every rank. Returns that loss (to log)."""
    count = sum((targets != IGNORE_INDEX).sum() for _, targets in micro_batches)
    dist.all_reduce(count)                     # the valid tokens of all micro-batches and ranks
    count = count.clamp(min=1)                 # a step of padding only: loss 0, not NaN
    total = torch.zeros((), device=count.device)
    for k, (inputs, targets) in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():   # DDP averages in the last backward
            loss = loss_sum(model, inputs, targets)
            (loss / count * dist.get_world_size()).backward()  # × N: DDP divides by N
        total += loss.detach()
    dist.all_reduce(total)                     # for the log: the loss sum over all ranks
    return (total / count).item()


def main():
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)                    # the same initial weights on every rank
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)).to(device)
    one_process = copy.deepcopy(model)         # for the check below
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    optimizer.zero_grad()
    loss = token_mean_backward(ddp, micro_batches_of(rank, device))
    grads = [p.grad.clone() for p in ddp.parameters()]
    optimizer.step()
    if rank == 0:
        print(f"loss {loss:.4f}")              # the global loss, the same on every rank

    # Check: one process on every rank's micro-batches, PyTorch's mean over the valid tokens.
    everything = [b for r in range(world_size) for b in micro_batches_of(r, device)]
    logits = torch.cat([one_process(x).flatten(0, 1) for x, _ in everything])
    targets = torch.cat([y.flatten() for _, y in everything])
    whole = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)  # mean over valid tokens
    whole.backward()
    for g, p in zip(grads, one_process.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
    torch.testing.assert_close(loss, whole.item(), rtol=1e-5, atol=0)  # float32 sums, other order
    # The 2024 accumulation bug, each micro-batch's own mean / K, averaged over the ranks: wrong.
    buggy = copy.deepcopy(one_process)
    buggy.zero_grad()
    for r in range(world_size):
        batches = micro_batches_of(r, device)
        for x, y in batches:
            (loss_sum(buggy, x, y) / (y != IGNORE_INDEX).sum() / len(batches) / world_size
             ).backward()
    assert not torch.allclose(buggy[1].weight.grad, one_process[1].weight.grad, rtol=1e-2)
    print(f"rank {rank}: gradient and loss == one process on all {len(everything)} "
          "micro-batches; the per-micro-batch mean is not")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
