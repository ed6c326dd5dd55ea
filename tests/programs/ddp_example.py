"""In the shape of pytorch/examples distributed/ddp/example.py: spmd_main(local_world_size,
local_rank), which reads the environment and initializes the group itself. Device edits are
marked.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(local_world_size, local_rank):
    # setup devices for this process. For local_world_size = 2, num_gpus = 8,
    # rank 0 uses GPUs [0, 1, 2, 3] and rank 1 uses GPUs [4, 5, 6, 7].
    n = 0  # device edit: torch.cuda.device_count() // local_world_size
    device_ids = list(range(local_rank * n, (local_rank + 1) * n))

    print(f"[{os.getpid()}] rank = {dist.get_rank()}, world_size = {dist.get_world_size()}, "
          f"n = {n}, device_ids = {device_ids}")

    torch.manual_seed(0)
    model = ToyModel()  # device edit: .cuda(device_ids[0])
    ddp_model = DDP(model)  # device edit: device_ids

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    torch.manual_seed(local_rank)
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)  # device edit: .to(device_ids[0])
    loss_fn(outputs, labels).backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def spmd_main(local_world_size, local_rank):
    # These are the parameters used to initialize the process group
    env_dict = {
        key: os.environ[key]
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    print(f"[{os.getpid()}] Initializing process group with: {env_dict}")
    dist.init_process_group(backend="gloo")  # device edit: nccl
    print(
        f"[{os.getpid()}]: world_size = {dist.get_world_size()}, "
        + f"rank = {dist.get_rank()}, backend={dist.get_backend()}"
    )

    params = demo_basic(local_world_size, local_rank)

    # Tear down the process group
    dist.destroy_process_group()
    return params
