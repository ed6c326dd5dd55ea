"""A pipeline whose schedule divides each micro-batch's loss by the number of micro-batches,
under a loss already normalised over the whole batch: every gradient K times too small.

Source: areal-project/AReaL#1273, "fix(megatron): compensate pipeline schedule's
/num_microbatches in grad" (https://github.com/areal-project/AReaL/pull/1273): "Megatron Core's
`_forward_step_helper` divides the loss by `num_microbatches` ... AReaL already normalizes
per-microbatch loss globally via `w_i / W_total`, so that extra division shrinks every gradient
... by `num_microbatches`."

Two stages, one per rank, micro-batches one after the other (send the activations forward, the
gradients back). No data parallelism: the first stage passes the batch, the last passes empty
micro-batches of the same structure, so the whole batch is the batch once.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from gradsync_tutorial.verify import verify_gradients

EXPECT = "divided by the micro-batches twice"
FACTOR = 1 / 3
K, ROWS, HIDDEN = 3, 2, 8


def loss_fn(model, batch):
    x, y = batch
    return (model(x).squeeze(1) - y).pow(2).mean()


def run_schedule(rank, stage, micro, bug):
    total = K * ROWS
    for x, y in micro:
        if rank == 0:
            act = stage(x)
            dist.send(act.detach(), 1)
            grad = torch.empty_like(act)
            dist.recv(grad, 1)
            act.backward(grad)
        else:
            act = torch.empty(ROWS, HIDDEN, dtype=torch.float64)
            dist.recv(act, 0)
            act.requires_grad_()
            loss = (stage(act).squeeze(1) - y).pow(2).sum() / total  # w_i / W_total
            if bug:  # the schedule's own / num_microbatches
                loss = loss / K
            loss.backward()
            dist.send(act.grad, 0)


def step(rank, world_size, bug):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)).double()
    stage = copy.deepcopy(reference[:2] if rank == 0 else reference[2])
    g = torch.Generator().manual_seed(0)  # the pipeline's one batch, known to both stages
    micro = [(torch.randn(ROWS, 4, generator=g, dtype=torch.float64),
              torch.randn(ROWS, generator=g, dtype=torch.float64)) for _ in range(K)]
    run_schedule(rank, stage, micro, bug)
    names = {} if rank == 0 else {"weight": "2.weight", "bias": "2.bias"}
    passed = micro if rank == 0 else [(x[:0], y[:0]) for x, y in micro]
    return verify_gradients(stage, None, loss_fn, reference=reference, micro_batches=passed,
                            name_map=names)


def buggy_step(rank, world_size):
    return step(rank, world_size, bug=True)


def fixed_step(rank, world_size):
    return step(rank, world_size, bug=False)
