"""Notebook 04, exercise: the mean loss over every rank's samples, for logging (the pitfalls
"mean of means" and "local loss").

In the notebook: `%load solutions/04_global_mean_loss.py`. From the repository root:
`python notebooks/solutions/04_global_mean_loss.py` runs the check.
"""

import torch
import torch.distributed as dist

import gradsync_tutorial as gst


def global_mean_loss(losses):
    # This rank's sum and count, in one tensor: one all_reduce sends both. detach(): a copy for
    # logging, outside the graph that backward() uses.
    totals = torch.stack([losses.detach().sum(), torch.tensor(float(len(losses)))])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # on every rank: [sum of all, count of all]
    return (totals[0] / totals[1]).item()  # a sample weighs the same on every rank


if __name__ == "__main__":
    gst.exercises.check_global_mean_loss(global_mean_loss)
