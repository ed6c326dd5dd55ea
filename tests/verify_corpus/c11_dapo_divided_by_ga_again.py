"""A token-mean loss already normalised over the whole accumulation window, divided by the
number of accumulation steps once more before backward.

Source: modelscope/ms-swift#10117, "[RLHF] DAPO/CISPO/FIPO 的 loss 在梯度累积下被额外除以
gradient_accumulation_steps" (https://github.com/modelscope/ms-swift/issues/10117): the loss is
``(per_token_loss * completion_mask).sum() / normalizer`` with ``normalizer =
num_items_in_batch / num_processes``, and then "期望梯度 g，`gradient_accumulation_steps=4`
时实际只有 g/4" (expected gradient g, only g/4 with 4 accumulation steps). Fixed by
modelscope/ms-swift#10116, "fix(rlhf): undo gradient-accumulation scaling for DAPO/CISPO/FIPO
losses".
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_tutorial.verify import padded, verify_gradients

EXPECT = "divided by the micro-batches twice"
FACTOR = 1 / 3
VOCAB, IGNORE, K = 7, -100, 3


def token_sum(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")


def loss_fn(model, batch):
    return token_sum(model, batch) / (batch[1] != IGNORE).sum()  # DAPO's token mean


def step(rank, world_size, bug):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 6), nn.Tanh(), nn.Linear(6, VOCAB)).double()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    g = torch.Generator().manual_seed(rank)
    micro = []
    for i in range(K):
        ids = torch.randint(1, VOCAB, (2, 3 + i), generator=g)
        labels = torch.randint(0, VOCAB, (2, 3 + i), generator=g)
        labels[1, 1 + i:] = IGNORE
        micro.append((ids, labels))
    items = torch.tensor(float(sum((lab != IGNORE).sum() for _, lab in micro)))
    dist.all_reduce(items)  # num_items_in_batch: every micro-batch on every process
    normalizer = items / world_size
    for i, mb in enumerate(micro):
        with ddp.no_sync() if i < K - 1 else contextlib.nullcontext():
            loss = token_sum(ddp, mb) / normalizer
            if bug:  # the Trainer's division by the accumulation steps
                loss = loss / K
            loss.backward()
    return verify_gradients(ddp, None, loss_fn, reference=reference, micro_batches=micro,
                            concat=padded({0: 0, 1: IGNORE}))


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
