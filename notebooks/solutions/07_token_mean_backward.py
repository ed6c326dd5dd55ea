"""Notebook 07, exercise: under DDP with gradient accumulation, the gradient of the mean over
every valid token of every micro-batch of every rank, and that mean loss to log.

In the notebook: `%load solutions/07_token_mean_backward.py`. From the repository root:
`python notebooks/solutions/07_token_mean_backward.py` runs the check.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradsync_tutorial as gst


def token_mean_backward(model, micro_batches):
    # Count first, over all of this rank's micro-batches: targets of -100 are padding.
    count = sum((targets != -100).sum() for _, targets in micro_batches)
    dist.all_reduce(count)  # every rank receives the valid tokens of all ranks
    total = torch.zeros((), dtype=torch.float64)
    for k, (inputs, targets) in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():  # DDP averages in the last backward
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                   reduction="sum")  # a sum over the valid tokens
            (loss / count * dist.get_world_size()).backward()  # × N: DDP divides by N
        total += loss.detach().double()
    dist.all_reduce(total)  # the loss sum of all ranks, for the log
    return (total / count).item()


if __name__ == "__main__":
    gst.exercises.check_token_mean_backward(token_mean_backward)
