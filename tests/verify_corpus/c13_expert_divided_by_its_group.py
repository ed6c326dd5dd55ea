"""Experts' gradients divided by the size of their own (expert-data-parallel) group instead of
the data-parallel size: the dense layers are right, the experts too large by dp / edp.

Source: deepspeedai/DeepSpeed#6546, "Fix expert grad scaling problem with ZeRO optimizer"
(https://github.com/deepspeedai/DeepSpeed/pull/6546): "expert gradient average: divide
edp_world_size -> divide dp_world_size; unit test: make sure model with different dp/ep has same
expert gradient". Here dp = 2, ep = 2, so edp = 1; ``group_sizes`` names both.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from gradsync_tutorial.verify import verify_gradients

EXPECT = "divided by the expert-data-parallel size where the data-parallel size was due"
FACTOR = 2.0
LOCAL = 6


def route(h, experts):
    return h[:, :experts].argmax(dim=1)


def loss_fn(model, batch):
    x, y = batch
    h = model["dense"](x)
    which = route(h.detach(), len(model["experts"]))
    out = torch.stack([model["experts"][int(e)](row) for row, e in zip(h, which, strict=True)])
    return (out.squeeze(1) - y).pow(2).mean()


def step(rank, world_size, bug):
    torch.manual_seed(0)
    reference = nn.ModuleDict({
        "dense": nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
        "experts": nn.ModuleList(nn.Linear(4, 1) for _ in range(world_size)),
    }).double()
    mine = nn.ModuleDict({"dense": copy.deepcopy(reference["dense"]),
                          "expert": copy.deepcopy(reference["experts"][rank])})
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(LOCAL, 4, generator=g, dtype=torch.float64),
             torch.randn(LOCAL, generator=g, dtype=torch.float64))
    everyone = [[torch.empty_like(t) for _ in range(world_size)] for t in batch]
    for gathered, t in zip(everyone, batch, strict=True):
        dist.all_gather(gathered, t)
    x, y = (torch.cat(t) for t in everyone)
    h = mine["dense"](x)  # (computed for every token here, to keep the program short)
    routed = route(h.detach(), world_size) == rank
    ((mine["expert"](h[routed]).squeeze(1) - y[routed]).pow(2).sum() / LOCAL).backward()
    for p in mine["dense"].parameters():  # dense: summed over every rank, / dp
        dist.all_reduce(p.grad)
        p.grad /= world_size
    edp, dp = 1, world_size
    for p in mine["expert"].parameters():  # experts: nothing to reduce over edp = 1
        p.grad /= edp if bug else dp
    names = {f"expert.{n}": f"experts.{rank}.{n}" for n in ("weight", "bias")}
    return verify_gradients(mine, batch, loss_fn, reference=reference, name_map=names,
                            group_sizes={"data-parallel": dp, "expert-data-parallel": edp})


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
