"""A sequence-mean loss whose denominator multiplies by the data-parallel size where it should
divide: with the data-parallel average on top, the gradient is dp² times too small.

Source: verl-project/verl#5798, "[algo] fix: correct seq-mean loss denominator for DP-invariant
aggregation" (https://github.com/verl-project/verl/pull/5798): "causes the effective loss to be
`dp_size²` times too small in multi-GPU training ... it still multiplies `global_batch_size *
dp_size` instead of dividing."
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_tutorial.verify import padded, verify_gradients

EXPECT = "1/world size²"
FACTOR = 0.25  # 1 / dp² with dp = 2
VOCAB, IGNORE, LOCAL = 7, -100, 3


def seq_losses(model, batch):
    """Each sequence's token mean."""
    ids, labels = batch
    per_token = F.cross_entropy(model(ids).transpose(1, 2), labels, ignore_index=IGNORE,
                                reduction="none")
    return per_token.sum(1) / (labels != IGNORE).sum(1)


def loss_fn(model, batch):
    return seq_losses(model, batch).mean()  # seq-mean-token-mean over the whole batch


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 6), nn.Tanh(), nn.Linear(6, VOCAB)).double()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    g = torch.Generator().manual_seed(rank)
    width = 3 + 2 * rank
    ids = torch.randint(1, VOCAB, (LOCAL, width), generator=g)
    labels = torch.randint(0, VOCAB, (LOCAL, width), generator=g)
    labels[0, 2:] = IGNORE
    batch = (ids, labels)
    global_batch_size = LOCAL * world_size
    if bug:
        denominator = global_batch_size * world_size
    else:  # DDP divides by dp: multiply it back
        denominator = global_batch_size / world_size
    (seq_losses(ddp, batch).sum() / denominator).backward()
    return verify_gradients(ddp, batch, loss_fn, reference=reference,
                            concat=padded({0: 0, 1: IGNORE}))


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
