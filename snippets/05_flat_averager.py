"""Notebook 05, copy this into your code: one all_reduce per step for all the gradients.

    torchrun --standalone --nproc-per-node 2 snippets/05_flat_averager.py
"""

import os
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn


class FlatAverager:  # average = FlatAverager(model); ...; loss.backward(); average()
    def __init__(self, model, reduce_dtype=None):  # a bf16 model: reduce_dtype=torch.float32
        self.params = [p for p in model.parameters() if p.requires_grad]
        first = self.params[0]                 # the buffer: the gradients' device (and dtype)
        if any(p.dtype != first.dtype or p.device != first.device for p in self.params):
            raise TypeError("one buffer holds one dtype on one device: one averager per group")
        sizes = [p.numel() for p in self.params]
        self.buffer = torch.empty(sum(sizes) + len(sizes),  # allocated once: the gradients,
                                  dtype=reduce_dtype or first.dtype,  # then one count per
                                  device=first.device)                # parameter
        *pieces, self.counts = self.buffer.split([*sizes, len(sizes)])
        self.slots = [s.view_as(p) for s, p in zip(pieces, self.params, strict=True)]

    def __call__(self):
        used = [p.grad is not None for p in self.params]
        for p, slot in zip(self.params, self.slots, strict=True):
            if p.grad is None:                                    # unused on this rank: it
                slot.zero_()                                      # adds zeros (notebook 03)
            else:
                slot.copy_(p.grad)                                # flatten
        self.counts.copy_(torch.tensor(used, dtype=self.counts.dtype))  # ranks that used it
        dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM)        # one call for everything
        for p, slot, ranks in zip(self.params, self.slots, self.counts.tolist(), strict=True):
            if ranks == 0:                     # unused on every rank: no gradient, as in one
                continue                       # process (and DDP): the optimizer skips it
            slot /= dist.get_world_size()                         # the mean, in the sum's dtype
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(slot)                                    # back into .grad


def init_distributed():
    """Join the group torchrun prepared (RANK, WORLD_SIZE, MASTER_ADDR...); return the device.

    With a GPU for every rank on this machine: nccl, this rank on GPU LOCAL_RANK. Otherwise
    gloo, on the CPU (a laptop; also 2 ranks on 1 GPU, which nccl cannot share): with a
    warning that gives both numbers when CUDA is there but has fewer GPUs than ranks.
    """
    local_rank, ranks_here = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    if gpus >= ranks_here:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)          # before init: nccl and *_object calls use it
        dist.init_process_group("nccl", device_id=device)  # barrier() too
        return device
    if gpus:                                   # CUDA, but not a GPU per rank: never silently
        warnings.warn(f"{gpus} GPU(s) visible for {ranks_here} ranks on this machine: this "
                      "job trains on the CPU with gloo. For nccl, start one rank per GPU "
                      f"(--nproc-per-node {gpus}) or check CUDA_VISIBLE_DEVICES.", stacklevel=2)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def main():
    device = init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)                       # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
    average = FlatAverager(model)
    x, y = torch.randn(8, 20) * (rank + 1), torch.randint(0, 3, (8,))  # this rank's batch
    x, y = x.to(device), y.to(device)

    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]  # for the check below
    average()

    # Check: the same mean as notebook 02's loop, one all_reduce per parameter.
    for p, g in zip(model.parameters(), grads, strict=True):
        dist.all_reduce(g)
        torch.testing.assert_close(p.grad, g / dist.get_world_size())
    print(f"rank {rank}: one all_reduce, the same mean gradient as one per parameter, "
          f"on {device} ({dist.get_backend()})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
