"""Notebook 09, copy this into your code: compute in bf16 or fp16, average the gradients in fp32.

    torchrun --standalone --nproc-per-node 2 snippets/09_mixed_precision_ddp.py
"""

import copy
import os
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


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


def train_step(model, optimizer, scaler, x, y, dtype, max_norm=1.0):
    with torch.autocast(x.device.type, dtype=dtype):   # forward in bf16/fp16, weights stay fp32
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()                      # DDP all-reduces fp32 gradients
    scaler.unscale_(optimizer)                         # first the true gradients...
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # ...then clip them
    scaler.step(optimizer)                             # skipped if a gradient is inf or nan
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm


def check_one_step(dtype, device, x, y):
    torch.manual_seed(0)                               # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    reduced = []

    def watch(state, bucket):                          # for the check: what DDP reduces
        reduced.append(bucket.buffer().dtype)
        return default_hooks.allreduce_hook(state, bucket)   # what DDP does without a hook

    model.register_comm_hook(None, watch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 only
    own = copy.deepcopy(net)                           # this rank's own gradient, without DDP
    with torch.autocast(device.type, dtype=dtype):
        own_loss = F.cross_entropy(own(x), y)
    own_loss.backward()                                # backward outside autocast, as above
    mean = torch.cat([p.grad.flatten() for p in own.parameters()])
    dist.all_reduce(mean)
    norm = train_step(model, optimizer, scaler, x, y, dtype)

    # Check: DDP reduced fp32, and clip_grad_norm_ saw the true mean gradient's norm.
    assert set(reduced) == {torch.float32}, reduced
    torch.testing.assert_close(norm, (mean / dist.get_world_size()).norm(), rtol=1e-3, atol=0)
    del model                                          # before the process group goes


def main():
    device = init_distributed()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)            # every rank its own batch
    x, y = torch.randn(32, 20, generator=g), torch.randint(0, 3, (32,), generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        check_one_step(dtype, device, x.to(device), y.to(device))
    print(f"rank {rank}: bf16 and fp16 autocast: DDP reduced fp32 gradients, "
          f"clipped after unscale_")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
