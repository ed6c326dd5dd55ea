"""Notebook 05, exercise: a mini DDP, every gradient's all_reduce started during backward.

In the notebook: `%load solutions/05_average_overlapped.py`. From the repository root:
`python notebooks/solutions/05_average_overlapped.py` runs the check.
"""

import torch.distributed as dist

import gradsync_tutorial as gst


def average_overlapped(model):
    pending = []  # (parameter, handle) of the calls started in this step, in launch order

    def start(param):  # autograd calls it the moment param.grad is final, during backward
        pending.append((param, dist.all_reduce(param.grad, async_op=True)))  # returns at once

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(start)

    def finish():  # after backward, before optimizer.step()
        for param, handle in pending:
            handle.wait()  # the sum has arrived in param.grad
            param.grad /= dist.get_world_size()
        pending.clear()  # the next step waits on its own calls only

    return finish


if __name__ == "__main__":
    gst.exercises.check_average_overlapped(average_overlapped)
