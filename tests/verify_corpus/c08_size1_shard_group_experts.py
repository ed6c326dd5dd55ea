"""Expert parallelism over every rank (expert-data-parallel degree 1): the experts' division by
the data-parallel size is skipped on a group of size 1, so expert gradients come out the world
size too large.

Source: pytorch/pytorch#167178, "fix: use grad div factor when fsdp_degree=1"
(https://github.com/pytorch/pytorch/pull/167178): "`fully_shard`'s `gradient_divide_factor`
isn't currently respected when the sharding degree = 1 ... The net effect is that the EP grads
are too-large by a factor of the world size". torch 2.14.1 has the fix, so this program plays
the skipped division by hand: each rank holds one expert, gathers the tokens routed to it from
every rank, and normalises by its local count as if the reduction would divide by the world size.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from gradsync_tutorial.verify import verify_gradients

EXPECT = "summed, not divided by the world size"
FACTOR = 2.0
LOCAL = 6  # samples per rank


def route(x, experts):
    return x[:, :experts].argmax(dim=1)  # each sample's expert, from its features


def loss_fn(experts, batch):
    """One process: every sample through its expert, the mean over samples."""
    x, y = batch
    which = route(x, len(experts))
    out = torch.stack([experts[int(e)](row) for row, e in zip(x, which, strict=True)])
    return (out.squeeze(1) - y).pow(2).mean()


def step(rank, world_size, bug):
    torch.manual_seed(0)
    reference = nn.ModuleList(nn.Linear(4, 1) for _ in range(world_size)).double()
    expert = copy.deepcopy(reference[rank])  # this rank's expert only
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(LOCAL, 4, generator=g, dtype=torch.float64),
             torch.randn(LOCAL, generator=g, dtype=torch.float64))
    everyone = [[torch.empty_like(t) for _ in range(world_size)] for t in batch]
    for gathered, t in zip(everyone, batch, strict=True):
        dist.all_gather(gathered, t)  # the all-to-all's effect: all tokens, then ours
    x, y = (torch.cat(t) for t in everyone)
    mine = route(x, world_size) == rank
    loss = (expert(x[mine]).squeeze(1) - y[mine]).pow(2).sum() / LOCAL
    if not bug:  # the expert-data-parallel reduction's division, also on a group of size 1
        loss = loss / world_size
    loss.backward()
    names = {"weight": f"{rank}.weight", "bias": f"{rank}.bias"}
    return verify_gradients(expert, batch, loss_fn, reference=reference, name_map=names)


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
