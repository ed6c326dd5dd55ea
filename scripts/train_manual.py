"""Train the course's CNN with notebook 02's hand-written gradient averaging, under torchrun.

    torchrun --standalone --nproc-per-node 2 scripts/train_manual.py --smoke     # seconds, on CPUs
    torchrun --standalone --nproc-per-node 4 scripts/train_manual.py --checkpoint ckpt.pt

It takes the same arguments as ``scripts/train_ddp.py`` and runs in the same places (CPUs with
gloo, GPUs with nccl, one machine or many). It *is* train_ddp.py with DistributedDataParallel
replaced by ``average_gradients``: the torchrun plumbing (environment, backend, sampler, logging,
checkpoints, errors) is imported from train_ddp.py, so that it stands in one place and these two
files differ in exactly what notebooks 02 and 03 teach: ``build`` and ``train_step`` below.
To copy one file into your own code, copy train_ddp.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_ddp import MOMENTUM, main  # the same directory: python puts it on sys.path

from gradsync_tutorial.model import Net


def average_gradients(model: torch.nn.Module) -> None:
    """Notebook 02: every rank ends with the mean of all ranks' gradients."""
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:  # a parameter that took no part in the loss
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
        param.grad /= world_size  # sum / N = mean over ranks


def build(args, device: torch.device):
    """The model and its optimizer: a plain replica, the same start on every rank."""
    torch.manual_seed(args.seed)  # the same initial weights and dropout draws on every rank
    model = Net().to(device)  # no wrapper: train_step averages the gradients itself
    return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM)


def train_step(model, optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step on this rank's share of the global batch; returns this rank's loss."""
    optimizer.zero_grad()
    loss = F.nll_loss(model(x), y)
    loss.backward()  # this rank's gradients only
    average_gradients(model)  # now every rank holds the mean gradient
    optimizer.step()
    return loss.detach()


if __name__ == "__main__":
    main(build=build, train_step=train_step)
