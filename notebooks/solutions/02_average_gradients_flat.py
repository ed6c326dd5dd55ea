"""Notebook 02, exercise: the mean gradient with a single all_reduce on one flat tensor.

In the notebook: `%load solutions/02_average_gradients_flat.py`. From the repository root:
`python notebooks/solutions/02_average_gradients_flat.py` runs the check.
"""

import torch
import torch.distributed as dist

import gradsync_tutorial as gst


def average_gradients_flat(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])  # a copy of every gradient, end to end
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # one call: every rank receives the sum
    flat /= dist.get_world_size()  # the mean
    for grad, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(piece.view_as(grad))  # back into each .grad: flat was only a copy


if __name__ == "__main__":
    gst.exercises.check_average_gradients_flat(average_gradients_flat)
