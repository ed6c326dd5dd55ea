"""Lightning Fabric with ``devices=N`` on the CPU (``strategy="ddp"``): what a Fabric script does
when it is started by a launcher that made fewer processes than it asks for.

    torchrun --standalone --nproc-per-node 2 tests/programs/fabric_devices.py 4

torchrun refuses: "the product (4 * 1) does not match the world size (2)". Each rank prints (and
``main`` returns) the world size Fabric trains with and how many samples its sampler gave it.
"""

import json
import sys

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset


def main(devices=None):
    devices = int(sys.argv[1]) if devices is None else devices
    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp")
    fabric.launch()
    data = TensorDataset(torch.arange(64.0).unsqueeze(1), torch.zeros(64, 1))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    seen = 0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen += len(x)
    state = {"world_size": fabric.world_size, "global_rank": fabric.global_rank,
             "samples_seen": seen}
    print("STATE " + json.dumps(state, sort_keys=True))
    # Free the DDP model, then the group (a DDP object alive at exit can abort gloo).
    del model, optimizer, loader
    torch.distributed.destroy_process_group()
    return state


if __name__ == "__main__":
    main()
