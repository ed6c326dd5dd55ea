"""DDP with a token mean on each rank: ranks with fewer valid tokens weigh as much as the
others, so the average of the ranks' means is not the mean over the whole batch.

Source: huggingface/transformers#34242, "Add DDP token averaging for equivalent non-parallel
training similar to #34191" (https://github.com/huggingface/transformers/issues/34242): "Token
averaging in gradient accumulation was fixed in #34191 . But token averaging in DDP seems to have
the same issue." The identity behind it, as meta-pytorch/torchtune#1875 puts it:
"(x1 / n1) + (x2 / n2) != (x1 + x2) / (n1 + n2)".
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_tutorial.verify import padded, verify_gradients

EXPECT = "weighted differently"
FACTOR = None
VOCAB, IGNORE = 7, -100


def token_sum(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")


def loss_fn(model, batch):
    return token_sum(model, batch) / (batch[1] != IGNORE).sum()


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 6), nn.Tanh(), nn.Linear(6, VOCAB)).double()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    g = torch.Generator().manual_seed(rank)
    width = 7 if rank == 0 else 2  # rank 0: long lines; the others: short ones
    ids = torch.randint(1, VOCAB, (3, width), generator=g)
    labels = torch.randint(0, VOCAB, (3, width), generator=g)
    if rank == 0:
        labels[1:, 4:] = IGNORE  # padding: 15 valid tokens here, 6 on rank 1
    batch = (ids, labels)
    tokens = (labels != IGNORE).sum().double()
    if bug:
        loss = token_sum(ddp, batch) / tokens
    else:
        dist.all_reduce(tokens)
        loss = token_sum(ddp, batch) / tokens * world_size
    loss.backward()
    return verify_gradients(ddp, batch, loss_fn, reference=reference,
                            concat=padded({0: 0, 1: IGNORE}))


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
