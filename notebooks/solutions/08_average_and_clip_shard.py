"""Notebook 08, exercise: this rank's shard of the mean gradient, clipped by the whole norm.

In the notebook: `%load solutions/08_average_and_clip_shard.py`. From the repository root:
`python notebooks/solutions/08_average_and_clip_shard.py` runs the check.
"""

import torch
import torch.distributed as dist

import gradsync_tutorial as gst

# torch 2.13 renamed reduce_scatter_tensor reduce_scatter_single: the same function.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def average_and_clip_shard(flat_grad, max_norm):
    world_size = dist.get_world_size()
    shard = torch.empty(len(flat_grad) // world_size, dtype=flat_grad.dtype,
                        device=flat_grad.device)
    reduce_scatter(shard, flat_grad, op=dist.ReduceOp.SUM)  # rank r: the sum of shard r
    shard /= world_size  # the mean
    squares = (shard**2).sum()  # this shard's share of the squared norm: one number
    dist.all_reduce(squares)  # the whole mean gradient's squared norm, on every rank
    norm = squares.sqrt()
    return shard * torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grad_norm_ clips


if __name__ == "__main__":
    gst.exercises.check_average_and_clip_shard(average_and_clip_shard)
