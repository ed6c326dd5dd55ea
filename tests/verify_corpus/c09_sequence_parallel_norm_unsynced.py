"""Sequence parallelism: each rank normalises its own part of the sequence, so the norm's weight
gradient is partial on each rank and must be all-reduced; forgetting it leaves the ranks with
different gradients.

Source: NVIDIA/TransformerEngine#435, "Need all-reduce for norm weight gradients with sequence
parallel" (https://github.com/NVIDIA/TransformerEngine/issues/435): "When we use sequence
parallel we need all-reduce norm weight gradients after the code above among TP groups?",
answered "Yes, that's correct. Currently we expect that this all-reduce happens outside of TE".
Here the rest of the model's gradients are summed the same way (standing for the tensor-parallel
layers' own collectives), the norm's only in the fixed step.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from gradsync_tutorial.verify import verify_gradients

EXPECT = "the ranks hold different gradients"
FACTOR = None
TOKENS = 8  # of the whole sequence, split over the ranks


def loss_fn(model, tokens):
    x, y = tokens
    return (model(x).squeeze(-1) - y).pow(2).mean()


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 1)).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)  # one sequence, the same on every rank
    x = torch.randn(TOKENS, 4, generator=g, dtype=torch.float64)
    y = torch.randn(TOKENS, generator=g, dtype=torch.float64)
    part = slice(rank * TOKENS // world_size, (rank + 1) * TOKENS // world_size)
    mine = (x[part], y[part])  # this rank's part of the sequence
    ((model(mine[0]).squeeze(-1) - mine[1]).pow(2).sum() / TOKENS).backward()
    for name, p in model.named_parameters():
        if not (bug and name.startswith("0.")):  # "0.": the LayerNorm
            dist.all_reduce(p.grad)
    return verify_gradients(model, mine, loss_fn, reference=reference)


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
