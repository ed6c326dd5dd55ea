"""Gradient accumulation with a token mean per micro-batch: micro-batches with fewer valid
tokens weigh as much as the others (the 2024 transformers Trainer bug).

Source: huggingface/blog#2414, "Gradient accumulation"
(https://github.com/huggingface/blog/pull/2414): "Gradient accumulation is *supposed* to be
mathematically equivalent to full batch training; however, losses did not match between training
runs where the setting was toggled on and off." Fixed in huggingface/transformers#34191, "Fix
Gradient Accumulation issue": divide the token sum by the number of items in the whole batch.
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_tutorial.verify import padded, verify_gradients

EXPECT = "weighted differently"
FACTOR = None
VOCAB, K, IGNORE = 7, 2, -100


def token_sum(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")


def loss_fn(model, batch):
    """One process: the mean over every valid token of the whole batch."""
    return token_sum(model, batch) / (batch[1] != IGNORE).sum()


def micro_batch(seed, rows, width):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    valid = torch.arange(width)[None] < lengths[:, None]
    ids = torch.randint(1, VOCAB, (rows, width), generator=g).masked_fill(~valid, 0)
    labels = torch.randint(0, VOCAB, (rows, width), generator=g).masked_fill(~valid, IGNORE)
    return ids, labels


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 6), nn.Tanh(), nn.Linear(6, VOCAB)).double()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    micro = [micro_batch(10 * rank + i, 3, 2 + 3 * i + rank) for i in range(K)]
    tokens = torch.tensor(float(sum((labels != IGNORE).sum() for _, labels in micro)))
    dist.all_reduce(tokens)  # every rank's, every micro-batch's valid tokens
    for i, mb in enumerate(micro):
        with ddp.no_sync() if i < K - 1 else contextlib.nullcontext():
            if bug:  # the mean over this micro-batch's tokens, then / K
                loss = token_sum(ddp, mb) / (mb[1] != IGNORE).sum() / K
            else:  # DDP divides by the world size: multiply it back
                loss = token_sum(ddp, mb) / tokens * world_size
            loss.backward()
    return verify_gradients(ddp, None, loss_fn, reference=reference, micro_batches=micro,
                            concat=padded({0: 0, 1: IGNORE}))


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
