"""Notebook 15, exercise: the loss one process minimises on a whole batch of padded lines, for
verify_gradients: the mean over every valid token.

In the notebook: `%load solutions/15_one_process_loss.py`. From the repository root:
`python notebooks/solutions/15_one_process_loss.py` runs the check.
"""

import torch.nn.functional as F

import gradsync_tutorial as gst


def one_process_loss(model, batch):
    inputs, targets = batch
    logits = model(inputs)  # (lines, positions, vocabulary)
    # The mean over the valid tokens of the whole batch: -100 marks padding, which is skipped.
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


if __name__ == "__main__":
    gst.exercises.check_one_process_loss(one_process_loss)
