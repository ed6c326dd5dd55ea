"""Notebook 01, exercise: the gradient of a whole batch, one micro-batch at a time.

In the notebook: `%load solutions/01_accumulate_gradients.py`. From the repository root:
`python notebooks/solutions/01_accumulate_gradients.py` runs the check.
"""

import torch.nn.functional as F

import gradsync_tutorial as gst


def accumulate_gradients(model, images, labels, micro_batches):
    total = 0.0
    for x, y in zip(images.chunk(micro_batches), labels.chunk(micro_batches), strict=True):
        loss = F.nll_loss(model(x), y) / micro_batches  # this piece's share of the batch mean
        loss.backward()  # adds (+=) this piece's gradient into every .grad
        total += loss.item()  # the shares add up to the batch's mean loss
    return total


if __name__ == "__main__":
    gst.exercises.check_accumulate_gradients(accumulate_gradients)
