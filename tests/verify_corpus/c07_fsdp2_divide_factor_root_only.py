"""FSDP2 with a loss normalised by the global count, and the gradient division turned off on the
root module only: ``set_gradient_divide_factor`` does not recurse, so the blocks wrapped by their
own ``fully_shard`` still average (notebook 08).

Source: pytorch/torchtitan#2206, "Fix loss computation by handling valid token imbalance in train
loop" (https://github.com/pytorch/torchtitan/pull/2206): "we are back-propagating with loss =
local_rank_loss_sum / global_valid_tokens ... The convergence speed / gradient will be the same
because we disabled the AVG of gradient in FSDP." Disabled on every FSDP module, that is: here
the buggy step disables it on the root alone.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from gradsync_tutorial.verify import verify_gradients

EXPECT = "divided by the world size twice"
FACTOR = 0.5


def loss_fn(model, batch):
    x, y = batch
    return (model(x).squeeze(1) - y).pow(2).mean()


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 1)).double()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = [model] if bug else [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
    g = torch.Generator().manual_seed(rank)
    n = 4 + 2 * rank
    batch = (torch.randn(n, 4, generator=g, dtype=torch.float64),
             torch.randn(n, generator=g, dtype=torch.float64))
    total = torch.tensor(float(n))
    dist.all_reduce(total)
    ((model(batch[0]).squeeze(1) - batch[1]).pow(2).sum() / total).backward()
    return verify_gradients(model, batch, loss_fn, reference=reference)


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
