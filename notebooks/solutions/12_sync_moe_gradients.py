"""Notebook 12, exercise: after each rank's backward through an expert-parallel layer, the
dense gradients reduced over every rank and the expert gradients over the ranks holding the
same expert, both divided by the whole data-parallel size.

In the notebook: `%load solutions/12_sync_moe_gradients.py`. From the repository root:
`python notebooks/solutions/12_sync_moe_gradients.py` runs the check.
"""

import torch.distributed as dist

import gradsync_tutorial as gst


def sync_moe_gradients(dense_params, expert_params, expert_group):
    world_size = dist.get_world_size()  # every rank brought tokens: the data-parallel size
    for p in dense_params:
        dist.all_reduce(p.grad)  # SUM over all ranks: each holds one rank's mean
        p.grad /= world_size
    for p in expert_params:
        dist.all_reduce(p.grad, group=expert_group)  # SUM over the ranks holding this expert
        p.grad /= world_size  # not dist.get_world_size(expert_group): that gives × EP


if __name__ == "__main__":
    gst.exercises.check_sync_moe_gradients(sync_moe_gradients)
