"""Notebook 10, exercise: who divides by what on a (replicas, shards, tp) mesh.

In the notebook: `%load solutions/10_gradient_plan.py`. From the repository root:
`python notebooks/solutions/10_gradient_plan.py` runs the check.
"""

import torch.distributed as dist

import gradsync_tutorial as gst


def gradient_plan(replicas, shards, tp, tokens):
    divide_factor = replicas * shards  # FSDP2's total divisor: every data-parallel rank
    replicated_op = dist.ReduceOp.SUM  # each tp rank holds a share of the gradient: add them
    loss_divisor = tokens * tp  # the data rank's count, every sequence shard included
    return divide_factor, replicated_op, loss_divisor


if __name__ == "__main__":
    gst.exercises.check_gradient_plan(gradient_plan)
