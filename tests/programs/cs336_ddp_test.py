"""In the shape of Stanford CS336 assignment 2's DDP tests: a student's NaiveDDP and the test
function that runs on each rank, with its own process-group set-up and teardown. Device edits
are marked.
"""

import os
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, 5, bias=False)

    def forward(self, x):
        return self.fc2(self.ln(torch.relu(self.fc1(x))))


class NaiveDDP(nn.Module):
    """The student's DDP: broadcast rank 0's parameters, all-reduce every gradient."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *inputs):
        return self.module(*inputs)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= dist.get_world_size()


def _setup_process_group(rank, world_size, backend):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12390"
    device = "cpu"  # device edit: f"cuda:{rank}" with nccl
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return device


def _cleanup_process_group():
    # Synchronize before we destroy the process group
    dist.barrier()
    dist.destroy_process_group()


def _test_DistributedDataParallelIndividualParameters(rank, world_size, model_class):
    device = _setup_process_group(rank=rank, world_size=world_size, backend="gloo")
    dist.barrier()
    torch.manual_seed(rank)  # different initial parameters on each rank

    non_parallel_model = model_class().to(device)
    ddp_base = deepcopy(non_parallel_model)
    ddp_model = NaiveDDP(ddp_base)

    # After construction every rank holds rank 0's parameters.
    for (name, p), q in zip(ddp_model.module.named_parameters(), non_parallel_model.parameters()):
        gathered = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(gathered, p.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered), name
        if rank == 0:
            assert torch.equal(p, q)

    torch.manual_seed(42)
    all_x = torch.randn(20, 10)
    all_y = torch.randn(20, 5)
    # Broadcast rank 0's non-parallel model, which is the reference.
    for p in non_parallel_model.parameters():
        dist.broadcast(p.data, src=0)
    ddp_optimizer = optim.SGD(ddp_model.parameters(), lr=0.1)
    non_parallel_optimizer = optim.SGD(non_parallel_model.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    local_bs = all_x.size(0) // world_size
    for _ in range(5):
        ddp_optimizer.zero_grad()
        non_parallel_optimizer.zero_grad()
        loss_fn(non_parallel_model(all_x), all_y).backward()
        non_parallel_optimizer.step()
        offset = rank * local_bs
        out = ddp_model(all_x[offset: offset + local_bs])
        loss_fn(out, all_y[offset: offset + local_bs]).backward()
        ddp_model.finish_gradient_synchronization()
        ddp_optimizer.step()
        for p, q in zip(non_parallel_model.parameters(), ddp_model.parameters()):
            assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
    _cleanup_process_group()
    return "passed"
