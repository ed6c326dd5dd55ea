"""In the shape of PyTorch's "Writing distributed applications with PyTorch" (intermediate/
dist_tuto): run(rank, size) and init_process(rank, size, fn, backend). Device edits are marked.
"""

import os

import torch
import torch.distributed as dist


def run(rank, size):
    """Blocking point-to-point communication, then an all-reduce."""
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0])
    group = dist.new_group(list(range(size)))
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return tensor.item(), total.item()


def init_process(rank, size, fn, backend="gloo"):
    """ Initialize the distributed environment. """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    return fn(rank, size)
