"""Notebook 11, copy this into your code: a pipeline (one stage per rank) whose gradient is the
mean over every valid token of several schedule steps, divided once.

    torchrun --standalone --nproc-per-node 2 snippets/11_pipeline_token_mean.py
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
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

SEED = 1234
VOCAB, IGNORE_INDEX = 5, -100  # -100: F.cross_entropy's default ignore_index (padding)
N_MICROBATCHES, STEPS = 4, 2  # micro-batches per schedule step; steps per optimizer step


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


def token_loss_sum(output, target):
    """The loss summed over the valid tokens of one micro-batch."""
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def main():
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)                    # the same model and data on every rank
    widths = [8] + [16] * (world_size - 1)     # one block per stage (at least 2 ranks)
    blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh())
              for a, b in zip(widths[:-1], widths[1:], strict=True)]
    model = nn.Sequential(*blocks, nn.Linear(16, VOCAB))
    model = model.double().to(device)
    whole = copy.deepcopy(model)               # for the check below: one process
    batches = []
    for _ in range(STEPS):                     # padded sequences of different lengths
        x = torch.randn(2 * N_MICROBATCHES, 6, 8, dtype=torch.float64)
        y = torch.randint(0, VOCAB, (2 * N_MICROBATCHES, 6))
        y[torch.rand(y.shape) < 0.3] = IGNORE_INDEX
        batches.append((x.to(device), y.to(device)))

    # The count of valid tokens of ALL the steps, known before the first step. With data
    # parallelism too: all_reduce it over the dp group, and multiply the loss by the dp size.
    valid_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches)

    def loss_fn(output, target):               # each micro-batch's share of the token mean
        return token_loss_sum(output, target) / valid_tokens

    stage = PipelineStage(model[rank], stage_index=rank, num_stages=world_size, device=device)
    # scale_grads=False: the loss is already divided. The default would divide .grad by
    # N_MICROBATCHES at the end of every step, the earlier steps' gradients included.
    schedule = ScheduleGPipe(stage, N_MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
    for x, y in batches:                       # no zero_grad in between: the gradients add up
        if len(x) % N_MICROBATCHES:
            raise ValueError(f"a batch of {len(x)} does not split into {N_MICROBATCHES} equal "
                             "micro-batches: drop or pad it")
        if stage.is_first:
            schedule.step(x)
        elif stage.is_last:
            schedule.step(target=y)
        else:
            schedule.step()

    # Check: this stage's gradient is one process's, for the token mean over both batches.
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    F.cross_entropy(whole(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).backward()
    for mine, reference in zip(model[rank].parameters(), whole[rank].parameters(), strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-12, atol=1e-14)
    print(f"rank {rank}: stage {rank} of {world_size}, {STEPS} steps of {N_MICROBATCHES} "
          f"micro-batches: the gradient of the mean over {int(valid_tokens)} valid tokens, as "
          "one process computes it")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
