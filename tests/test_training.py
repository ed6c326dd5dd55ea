"""The core lesson's claims, as tests: manual averaging = one process = DDP; runs reproduce."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_tutorial as gst

SEED, GLOBAL_BATCH, STEPS = 1234, 64, 3


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(GLOBAL_BATCH * STEPS, 1, 28, 28, generator=g), torch.randint(
        0, 10, (GLOBAL_BATCH * STEPS,), generator=g
    )


def _train(rank, world_size, mode):
    """STEPS steps of SGD, dropout off; each rank takes its slice of each global batch."""
    torch.manual_seed(SEED)
    model = gst.model.Net().eval()
    if mode == "ddp":
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    images, labels = _data()
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        x, y = images[batch][rank::world_size], labels[batch][rank::world_size]
        optimizer.zero_grad()
        F.nll_loss(model(x), y).backward()
        if mode == "manual":
            gst.averaging.average_per_parameter(model)  # notebook 02's loop
        optimizer.step()
    return (model.module if mode == "ddp" else model).state_dict()


def test_manual_averaging_equals_single_process_equals_ddp():
    single = gst.launch(_train, world_size=1, args=("manual",))[0]
    manual = gst.launch(_train, world_size=2, args=("manual",))
    ddp = gst.launch(_train, world_size=2, args=("ddp",))
    for name, ref in single.items():
        for states in (manual, ddp):
            for state in states:
                torch.testing.assert_close(state[name], ref, rtol=0, atol=1e-6)
    assert gst.checks.compare_ranks(manual, show=False) == 0.0
    assert gst.checks.compare_state_dicts(manual[0], single, show=False) <= 1e-6


def test_dropping_the_division_is_caught():
    """The popular answer's bug changes the parameters: the equality check must see it."""

    def no_divide(rank, world_size):
        torch.manual_seed(SEED)
        model = gst.model.Net().eval()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        images, labels = _data()
        x, y = images[:GLOBAL_BATCH][rank::world_size], labels[:GLOBAL_BATCH][rank::world_size]
        F.nll_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # no division
        optimizer.step()
        return model.state_dict()

    buggy = gst.launch(no_divide, world_size=2)[0]
    correct = gst.launch(_train, world_size=2, args=("manual",))[0]
    assert gst.checks.compare_state_dicts(buggy, correct, show=False) > 1e-4


def test_same_seed_gives_identical_loss_histories():
    def losses(rank, world_size):
        torch.manual_seed(SEED)  # dropout on: the RNG is seeded too
        model = gst.model.Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
        images, labels = _data()
        history = []
        for step in range(STEPS):
            batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
            optimizer.zero_grad()
            loss = F.nll_loss(model(images[batch][rank::2]), labels[batch][rank::2])
            loss.backward()
            gst.averaging.average_per_parameter(model)  # notebook 02's loop
            optimizer.step()
            history.append(loss.item())
        return history

    first = gst.launch(losses, world_size=2)
    second = gst.launch(losses, world_size=2)
    assert first == second
    assert first[0] != first[1]  # the ranks saw different data
