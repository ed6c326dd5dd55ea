"""Gradient accumulation over K micro-batches, each loss backpropagated without dividing by K.

Source: karpathy/nanoGPT#206, "Logic Error in gradient accumulation?"
(https://github.com/karpathy/nanoGPT/issues/206): "Line 293 in train.py performs loss.backward()
without first normalizing the loss value to account for number of gradient accumulation
steps." (Here under DDP, with ``no_sync()`` for all but the last micro-batch.)
"""

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_tutorial.verify import verify_gradients

EXPECT = "not divided by the micro-batches"
FACTOR = 3.0  # K
K = 3


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    g = torch.Generator().manual_seed(rank)
    micro = [(torch.randn(4, 4, generator=g, dtype=torch.float64),
              torch.randint(0, 3, (4,), generator=g)) for _ in range(K)]
    for i, mb in enumerate(micro):
        with ddp.no_sync() if i < K - 1 else contextlib.nullcontext():
            loss = loss_fn(ddp, mb)
            (loss if bug else loss / K).backward()
    return verify_gradients(ddp, None, loss_fn, reference=reference, micro_batches=micro)


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
