"""Notebook 00, exercise: every rank returns [0, 1, ..., world_size - 1], with all_gather.

In the notebook: `%load solutions/00_gather_ranks.py`. From the repository root:
`python notebooks/solutions/00_gather_ranks.py` runs the check.
"""

import torch
import torch.distributed as dist

import gradsync_tutorial as gst


def gather_ranks(rank, world_size):
    mine = torch.tensor([rank])  # the one thing this rank knows
    everyone = [torch.zeros(1, dtype=mine.dtype) for _ in range(world_size)]  # one per rank
    dist.all_gather(everyone, mine)  # everyone[i] now holds rank i's tensor, on every rank
    return [int(t.item()) for t in everyone]


if __name__ == "__main__":
    gst.exercises.check_gather_ranks(gather_ranks)
    gst.exercises.check_gather_ranks(gather_ranks, world_size=4)
