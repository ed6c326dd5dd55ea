"""Notebook 03, exercise: every rank starts from rank 0's weights, as DDP makes sure.

In the notebook: `%load solutions/03_broadcast_parameters.py`. From the repository root:
`python notebooks/solutions/03_broadcast_parameters.py` runs the check.
"""

import torch.distributed as dist

import gradsync_tutorial as gst


def broadcast_parameters(model):
    for p in model.parameters():
        # In place: rank 0 sends its values, every other rank's tensor is overwritten with them.
        # detach(): the same memory as p, without autograd tracking the write.
        dist.broadcast(p.detach(), src=0)


if __name__ == "__main__":
    gst.exercises.check_broadcast_parameters(broadcast_parameters)
