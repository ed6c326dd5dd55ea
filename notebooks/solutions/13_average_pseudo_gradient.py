"""Notebook 13, exercise: DiLoCo's pseudo-gradient, start - weights, averaged over the replicas
that take part; a healing replica sends zeros and receives the average.

In the notebook: `%load solutions/13_average_pseudo_gradient.py`. From the repository root:
`python notebooks/solutions/13_average_pseudo_gradient.py` runs the check.
"""

import torch
import torch.distributed as dist

import gradsync_tutorial as gst


def average_pseudo_gradient(model, start, participating):
    count = torch.tensor([float(participating)], dtype=start[0].dtype, device=start[0].device)
    dist.all_reduce(count)  # every rank receives the number of replicas that take part
    averaged = []
    for s, p in zip(start, model.parameters(), strict=True):
        # before - after: the direction an outer SGD step goes against. A healing replica
        # sends zeros, but still calls all_reduce: every rank must.
        pseudo = s - p.detach() if participating else torch.zeros_like(s)
        dist.all_reduce(pseudo)  # the sum over the replicas
        averaged.append(pseudo / count)  # / the participants, not / the world size
    return averaged


if __name__ == "__main__":
    gst.exercises.check_average_pseudo_gradient(average_pseudo_gradient)
