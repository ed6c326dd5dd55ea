"""Notebook 10, copy this into your code: FSDP2 over "dp" x tensor + sequence parallel over
"tp" on a 2-D mesh, each rank's loss its sum over the count of its data-parallel rank's batch.

    torchrun --standalone --nproc-per-node 2 snippets/10_fsdp_tp.py   # dp 1 x tp 2
    torchrun --standalone --nproc-per-node 4 snippets/10_fsdp_tp.py   # dp 2 x tp 2
"""

import copy
import os
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TP = 2  # tensor-parallel ranks; the other ranks are data parallel


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


class Block(nn.Module):
    """LayerNorm (sequence parallel), then a column- and a row-parallel layer."""

    def __init__(self, hidden=8, inner=16):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.w1, self.act, self.w2 = nn.Linear(hidden, inner), nn.Tanh(), nn.Linear(inner, hidden)

    def forward(self, x):
        return self.w2(self.act(self.w1(self.norm(x))))


def main():
    device = init_distributed()
    world_size = dist.get_world_size()
    assert world_size % TP == 0, f"run a multiple of {TP} ranks, not {world_size}"
    mesh = init_device_mesh(device.type, (world_size // TP, TP), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    torch.manual_seed(0)                       # the same weights on every rank
    model = Block().to(device)
    whole = copy.deepcopy(model)               # for the check: one process, every token
    parallelize_module(model, mesh["tp"], {
        "norm": SequenceParallel(),            # its weight's grad: a Partial (pending) sum
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1))})
    fully_shard(model, mesh=mesh["dp"])        # FSDP divides by the dp ranks only
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    g = torch.Generator().manual_seed(1)       # one global batch: (rows, sequence, hidden)
    x = torch.randn(2 * mesh["dp"].size(), 4 * TP, 8, generator=g).to(device)
    y = torch.randn(x.shape, generator=g).to(device)
    rows = slice(2 * dp, 2 * dp + 2)           # this data rank's rows...
    tokens = slice(4 * tp, 4 * tp + 4)         # ...and this TP rank's part of the sequence
    reference = torch.optim.SGD(whole.parameters(), lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        errors = (model(x[rows, tokens]) - y[rows, tokens]) ** 2
        loss = errors.sum() / y[rows].numel()  # NOT errors.mean(): that is tp times too large
        # (no padding here; with padding, divide by the valid tokens, all-reduced over dp and tp)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # counts each once
        optimizer.step()
        reference.zero_grad()
        ((whole(x) - y) ** 2).mean().backward()
        whole_norm = nn.utils.clip_grad_norm_(whole.parameters(), max_norm=1.0)
        reference.step()

    # Check: 3 steps on the 2-D mesh are 3 steps of one process on the whole batch.
    torch.testing.assert_close(norm.full_tensor(), whole_norm)
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank calls it
    for name, p in whole.state_dict().items():
        torch.testing.assert_close(state[name], p)
    print(f"rank {dist.get_rank()}: dp {dp}, tp {tp}, on {device.type} ({dist.get_backend()}); "
          "after 3 steps the model equals one process's on the whole batch")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
