"""gloo with CUDA tensors on 2 ranks: what a machine with one GPU can test of 2 ranks.

    torchrun --standalone --nproc-per-node 2 tests/gpu/gloo_cuda.py

nccl cannot put two ranks on one GPU, so ``init_distributed`` picks gloo on the CPU there. gloo
also reduces CUDA tensors (it copies them through the host), which lets both ranks share GPU 0:
this runs the snippets' averaging code (notebook 02's ``average_gradients``, notebook 05's
``FlatAverager``) and DDP on CUDA tensors, on 2 ranks, against one process that sees the whole
batch, and prints the figures for ``make gpu-check``. (Without a GPU it runs the same on the
CPU, which only tests this program.)
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SNIPPETS = Path(__file__).resolve().parents[2] / "snippets"


def snippet(name: str):
    spec = importlib.util.spec_from_file_location(name, SNIPPETS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.grad - q.grad).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:  # tests/test_gpu_check.py runs the program itself on a CPU
        device = torch.device("cpu")
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    t = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(t)  # a CUDA tensor through gloo
    assert t.device == device and t.item() == world_size * (world_size + 1) / 2

    torch.manual_seed(0)  # the same weights and the same global batch on every rank
    model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
    x, y = torch.randn(64, 20, device=device), torch.randint(0, 3, (64,), device=device)
    whole, flat, ddp_model = (copy.deepcopy(model) for _ in range(3))
    F.cross_entropy(whole(x), y).backward()  # one process, all 64 samples
    shard = slice(rank, None, world_size)

    F.cross_entropy(model(x[shard]), y[shard]).backward()
    snippet("02_average_gradients").average_gradients(model)
    manual = max_diff(model, whole)

    average = snippet("05_flat_averager").FlatAverager(flat)
    F.cross_entropy(flat(x[shard]), y[shard]).backward()
    average()
    flat_vs_manual = max_diff(flat, model)

    ddp = DDP(ddp_model)
    F.cross_entropy(ddp(x[shard]), y[shard]).backward()
    ddp_vs_manual = max_diff(ddp_model, model)
    del ddp  # free DDP before its group

    if rank == 0:
        print(f"rank 0: gloo on {device}: average_gradients vs one process {manual:.1e}; "
              f"FlatAverager vs average_gradients {flat_vs_manual:.1e}; DDP vs "
              f"average_gradients {ddp_vs_manual:.1e}", flush=True)
    # a sum of 2 numbers has no order: the three averages agree to the last bit
    assert manual <= 1e-6 and flat_vs_manual == 0.0 and ddp_vs_manual == 0.0
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
