"""In the shape of the same tutorial's torchrun entry point (elastic_ddp.py): demo_basic() takes no
arguments and reads its rank from the environment torchrun sets. Device edits are marked.
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


def demo_basic():
    # device edit: torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"])) removed
    dist.init_process_group("gloo")  # device edit: the accelerator's backend
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    # create model and move it to GPU with id rank
    device_id = "cpu"  # device edit: rank % torch.accelerator.device_count()
    torch.manual_seed(0)
    model = ToyModel().to(device_id)
    ddp_model = DDP(model)  # device edit: device_ids=[device_id]
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    torch.manual_seed(rank)
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(device_id)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")
    return params
