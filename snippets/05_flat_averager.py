"""Notebook 05, copy this into your code: one all_reduce per step for all the gradients.

    torchrun --standalone --nproc-per-node 2 snippets/05_flat_averager.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class FlatAverager:  # average = FlatAverager(model); ...; loss.backward(); average()
    def __init__(self, model):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffer = torch.empty(sum(p.numel() for p in self.params),  # allocated once
                                  device=self.params[0].device)
        pieces = self.buffer.split([p.numel() for p in self.params])
        self.slots = [s.view_as(p) for s, p in zip(pieces, self.params, strict=True)]

    def __call__(self):
        for p, slot in zip(self.params, self.slots, strict=True):
            slot.copy_(p.grad)                                    # flatten
        dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM)        # one call
        for p, slot in zip(self.params, self.slots, strict=True):
            torch.div(slot, dist.get_world_size(), out=p.grad)    # the mean, back into .grad


def main():
    dist.init_process_group("gloo")  # "nccl" with one GPU per rank
    rank = dist.get_rank()
    torch.manual_seed(0)                       # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3))
    average = FlatAverager(model)
    x, y = torch.randn(8, 20) * (rank + 1), torch.randint(0, 3, (8,))  # this rank's batch

    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]  # for the check below
    average()

    # Check: the same mean as notebook 02's loop, one all_reduce per parameter.
    for p, g in zip(model.parameters(), grads, strict=True):
        dist.all_reduce(g)
        torch.testing.assert_close(p.grad, g / dist.get_world_size())
    print(f"rank {rank}: one all_reduce, the same mean gradient as one per parameter")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
