"""A loss normalised by the global token count, under a DDP that still averages: the
gradients are divided by the number of ranks twice.

Source: pytorch/torchtitan#2323, "Disable DDP averaging to avoid repeated gradient averaging"
(https://github.com/pytorch/torchtitan/pull/2323): "the averaging for FSDP was disabled ... but
not for DDP. This adds an additional scaling to the gradients diving them twice by the number for
DP ranks when using pure DDP." Reported as pytorch/torchtitan#2318, "Grad norm inconsistency when
DDP / HSDP is applied before and after #2206": "a scaling difference of a factor of 8". The fix
there, and here: "a comm hook that replaces the default all reduce average operation with an all
reduce sum operation".
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_tutorial.verify import verify_gradients

EXPECT = "divided by the world size twice"
FACTOR = 0.5


def loss_fn(model, batch):
    x, y = batch
    return (model(x).squeeze(1) - y).pow(2).mean()


def allreduce_sum(state, bucket):
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    if not bug:
        ddp.register_comm_hook(None, allreduce_sum)
    g = torch.Generator().manual_seed(rank)
    n = 5 + 3 * rank  # uneven local batches: the global count matters
    batch = (torch.randn(n, 4, generator=g, dtype=torch.float64),
             torch.randn(n, generator=g, dtype=torch.float64))
    total = torch.tensor(float(n))
    dist.all_reduce(total)
    ((ddp(batch[0]).squeeze(1) - batch[1]).pow(2).sum() / total).backward()
    return verify_gradients(ddp, batch, loss_fn, reference=reference)


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
