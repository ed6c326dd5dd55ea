"""Notebook 14, copy this into your code: an RL policy loss (GRPO, DAPO, Dr. GRPO) that gives one
process's gradient under DDP, with micro-batches that hold different numbers of completions.

    torchrun --standalone --nproc-per-node 2 snippets/14_rl_policy_loss.py
"""

import copy
import os
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SEED, VOCAB = 1234, 12
MAX_COMPLETION_LENGTH = 8  # Dr. GRPO divides each completion's token sum by this constant


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


def micro_batches_of(rank, device, sizes=(3, 1)):
    """Rank `rank`'s micro-batches of random completions: (inputs, targets, mask, advantages).
    They hold `sizes` completions (different numbers, as balanced micro-batches do) of 1 to
    MAX_COMPLETION_LENGTH tokens after a prompt of 2; mask is 1 on the completion's tokens."""
    g = torch.Generator().manual_seed(SEED + rank)
    batches = []
    position = torch.arange(2 + MAX_COMPLETION_LENGTH)
    for n in sizes:
        lengths = torch.randint(1, MAX_COMPLETION_LENGTH + 1, (n, 1), generator=g)
        inputs = torch.randint(1, VOCAB, (n, len(position)), generator=g)
        targets = torch.randint(1, VOCAB, inputs.shape, generator=g)
        mask = (position >= 2) & (position < 2 + lengths)  # not the prompt, not the padding
        advantages = torch.randn(n, generator=g)
        batches.append(tuple(t.to(device) for t in (inputs, targets, mask.float(), advantages)))
    return batches


def per_token_loss(model, inputs, targets, advantages):
    """-ratio * advantage at every position (PPO at ratio 1: the step's first pass)."""
    logp = torch.log_softmax(model(inputs), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -torch.exp(logp - logp.detach()) * advantages.unsqueeze(-1)


def token_weights(mask, mode, tokens, completions):
    """Each position's weight in the loss one process computes on the whole step."""
    if mode == "token-mean":                  # DAPO: every completion token weighs the same
        return mask / tokens
    if mode == "seq-mean-token-mean":         # GRPO: each completion's token mean, then their mean
        return mask / mask.sum(dim=1, keepdim=True) / completions
    if mode == "seq-mean-token-sum-norm":     # Dr. GRPO: token sums over a constant length
        return mask / (completions * MAX_COMPLETION_LENGTH)
    raise ValueError(f"unknown mode {mode!r}")


def policy_loss_backward(model, micro_batches, mode, divide_by_k_again=False):
    """backward() on this rank's micro-batches: then every rank's .grad is the gradient of
    `mode`'s loss over every completion of every micro-batch of every rank."""
    counts = torch.stack([sum(mask.sum() for _, _, mask, _ in micro_batches),
                          sum(mask.new_tensor(len(mask)) for _, _, mask, _ in micro_batches)])
    dist.all_reduce(counts)                   # [completion tokens, completions] of the step
    tokens, completions = counts
    for k, (inputs, targets, mask, advantages) in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():   # DDP averages in the last backward
            weights = token_weights(mask, mode, tokens, completions)
            loss = (weights * per_token_loss(model, inputs, targets, advantages)).sum()
            loss = loss * dist.get_world_size()           # × N: DDP divides by N
            if divide_by_k_again:                         # ms-swift#10117's bug, for the check
                loss = loss / len(micro_batches)
            loss.backward()


def main():
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)                    # the same initial weights on every rank
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)).to(device)
    one_process = copy.deepcopy(model)         # for the check below
    ddp = DDP(model)
    mine = micro_batches_of(rank, device, sizes=(3, 1) if rank % 2 == 0 else (1, 2))
    everything = [b for r in range(world_size)
                  for b in micro_batches_of(r, device, sizes=(3, 1) if r % 2 == 0 else (1, 2))]
    inputs, targets, mask, advantages = (torch.cat(t) for t in zip(*everything, strict=True))

    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        # Check: one process on every rank's micro-batches, with the counts of the whole step.
        reference = copy.deepcopy(one_process)
        weights = token_weights(mask, mode, mask.sum(), len(mask))
        (weights * per_token_loss(reference, inputs, targets, advantages)).sum().backward()
        for divide_by_k_again in (False, True):
            ddp.zero_grad()
            policy_loss_backward(ddp, mine, mode, divide_by_k_again)
            for p, q in zip(ddp.parameters(), reference.parameters(), strict=True):
                expected = q.grad / (len(mine) if divide_by_k_again else 1)
                torch.testing.assert_close(p.grad, expected)
    print(f"rank {rank}: token-mean, seq-mean-token-mean and seq-mean-token-sum-norm each give "
          f"the gradient of one process on all {len(mask)} completions; divided by K again, "
          f"1/{len(mine)} of it")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
