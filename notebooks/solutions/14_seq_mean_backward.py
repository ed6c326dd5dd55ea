"""Notebook 14, exercise: under DDP with gradient accumulation, the gradient of GRPO's
sequence-level mean over every completion of every micro-batch of every rank.

In the notebook: `%load solutions/14_seq_mean_backward.py`. From the repository root:
`python notebooks/solutions/14_seq_mean_backward.py` runs the check.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist

import gradsync_tutorial as gst


def seq_mean_backward(model, micro_batches):
    # Count first, over all of this rank's micro-batches: one row of the mask per completion.
    device = micro_batches[0]["mask"].device
    completions = torch.tensor(float(sum(len(b["mask"]) for b in micro_batches)), device=device)
    dist.all_reduce(completions)  # every rank receives the completions of the whole step
    for k, b in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():  # DDP averages in the last backward
            per_token, mask = gst.rollouts.per_token_loss(model, b), b["mask"]
            token_means = (per_token * mask).sum(dim=1) / mask.sum(dim=1)  # one per completion
            (token_means.sum() / completions * dist.get_world_size()).backward()  # × N: DDP / N


if __name__ == "__main__":
    gst.exercises.check_seq_mean_backward(seq_mean_backward)
