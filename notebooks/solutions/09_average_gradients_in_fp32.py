"""Notebook 09, exercise: average a bf16 model's gradients with the sum in float32.

In the notebook: `%load solutions/09_average_gradients_in_fp32.py`. From the repository root:
`python notebooks/solutions/09_average_gradients_in_fp32.py` runs the check.
"""

import torch
import torch.distributed as dist

import gradsync_tutorial as gst


def average_gradients_in_fp32(model):
    grads = [p.grad for p in model.parameters()]
    buffer = torch.cat([g.float().flatten() for g in grads])  # float32: the sum rounds at 2^-24
    dist.all_reduce(buffer)  # every rank receives the float32 sum
    buffer /= dist.get_world_size()  # the mean, still float32
    for g, piece in zip(grads, buffer.split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))  # back into the bf16 gradient: rounded once, here


if __name__ == "__main__":
    gst.exercises.check_average_gradients_in_fp32(average_gradients_in_fp32)
