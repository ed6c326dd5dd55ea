"""A manual all_reduce that sums the gradients and never divides them.

Source: tensorflow/benchmarks#466, "Gradients are not averaged in AllReduceSpec=nccl
(variable_update=replicated) mode" (https://github.com/tensorflow/benchmarks/issues/466): "the
gradients are summed, after which it should be averaged. But as far as I know, it is not
averaged before updating the variables." The PyTorch tutorial's ``average_gradients``
(pytorch/tutorials#2305 quotes it) is the fix: ``param.grad.data /= size`` after the SUM.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradsync_tutorial.verify import verify_gradients

EXPECT = "summed, not divided by the world size"
FACTOR = 2.0  # the world size of the corpus run


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, 4, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (8,), generator=g))
    loss_fn(model, batch).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        if not bug:
            p.grad /= world_size
    return verify_gradients(model, batch, loss_fn, reference=reference)


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
