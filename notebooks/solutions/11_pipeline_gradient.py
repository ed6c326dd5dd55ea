"""Notebook 11, exercise: accumulate over several pipeline steps, dividing once.

In the notebook: `%load solutions/11_pipeline_gradient.py`. From the repository root:
`python notebooks/solutions/11_pipeline_gradient.py` runs the check.
"""

import torch.nn.functional as F
from torch.distributed.pipelining import ScheduleGPipe

import gradsync_tutorial as gst


def pipeline_gradient(stage, batches, n_microbatches):
    count = sum(targets.numel() for _, targets in batches)  # elements of ALL the batches

    def loss_fn(output, target):  # each micro-batch's share of the mean over all the batches
        return F.mse_loss(output, target, reduction="sum") / count

    # scale_grads=False: the loss is already divided; the default would divide .grad again,
    # at the end of every step, the earlier steps' gradients included.
    schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    for inputs, targets in batches:
        if stage.is_first:
            schedule.step(inputs)  # the first stage feeds the inputs
        elif stage.is_last:
            schedule.step(target=targets)  # the last one computes the loss
        else:
            schedule.step()  # a middle stage: what its neighbours send


if __name__ == "__main__":
    gst.exercises.check_pipeline_gradient(pipeline_gradient)
