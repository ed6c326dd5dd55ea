"""DDP, and the loss divided by the world size as well: DDP already averages.

Source: NVIDIA/apex#696, "Questions about how DDP handles gradients"
(https://github.com/NVIDIA/apex/issues/696): "Are they averaged? If so, is it equivalent to loss
function scaled with : loss = sum(loss) / batch_size / world_size?", answered "gradients are
allreduced and averaged over processes during backward(). No need to divide by world_size."
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_tutorial.verify import verify_gradients

EXPECT = "divided by the world size twice"
FACTOR = 0.5


def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x).squeeze(1), y)


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(6, 4, generator=g, dtype=torch.float64),
             torch.randn(6, generator=g, dtype=torch.float64))
    loss = loss_fn(ddp, batch)
    if bug:
        loss = loss / world_size
    loss.backward()
    return verify_gradients(ddp, batch, loss_fn, reference=reference)


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
