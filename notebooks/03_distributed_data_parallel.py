# %% [markdown]
# # 03 — `DistributedDataParallel`: the same averaging, done for you
#
# **Question: what does `DistributedDataParallel` (DDP) do, and does it give the same result as
# averaging gradients by hand?**
#
# Notebook 02 averaged gradients with one `all_reduce` per parameter, after `backward()`. DDP wraps
# the model and does the same averaging *during* `backward()`, in a few large buckets. It also
# **broadcasts rank 0's parameters when it is built**, so the replicas start equal even if the
# ranks were seeded differently. This notebook checks both claims against notebook 02's code.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: less data, same checks
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5
EPOCHS = 1 if SMOKE_TEST else 2
N_TRAIN = 4096 if SMOKE_TEST else None  # None: all 60,000 training images

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

import gradsync_tutorial as gst

# %% [markdown]
# ## `DistributedSampler` gives each rank the same shard as notebook 02
#
# Notebook 02 shuffled with a generator seeded `SEED + epoch` and gave rank `r` every N-th index,
# `order[r::N]`. `DistributedSampler` does exactly that: its `set_epoch(epoch)` reseeds the shuffle
# with `seed + epoch`, identically on every rank. (Forget `set_epoch` and every epoch repeats the
# same order: notebook 04.)

# %%
# NBVAL_CHECK_OUTPUT
images, labels = gst.data.load(train=True)
images, labels = images[:N_TRAIN], labels[:N_TRAIN]
dataset = TensorDataset(images, labels)

for epoch in range(2):
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED + epoch))
    for rank in range(WORLD_SIZE):
        sampler = DistributedSampler(dataset, WORLD_SIZE, rank, shuffle=True, seed=SEED)
        sampler.set_epoch(epoch)
        assert list(sampler) == order[rank::WORLD_SIZE].tolist()
print(f"DistributedSampler == order[rank::{WORLD_SIZE}] for every rank and epoch")


# %% [markdown]
# ## The training loop with DDP
#
# The loop of notebook 02 with three changes: the model is wrapped in `DDP`, the shard comes
# from a `DistributedSampler`, and `average_gradients` is gone, since `backward()` now averages.
# A flag keeps the manual path so we can compare the two in one function (notebook 02's
# `average_gradients`, a deliberate lesson copy: the package's is
# `gst.averaging.average_per_parameter`).

# %%
def average_gradients(model):  # notebook 02's version, for the comparison
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
            param.grad /= dist.get_world_size()


# %% tags=["training-loop"]
def train(rank, world_size, epochs, use_ddp=True, seed_per_rank=False):
    torch.manual_seed(SEED + rank if seed_per_rank else SEED)  # seed_per_rank: a bug, on purpose
    device = gst.local_device()  # cuda:LOCAL_RANK with a GPU per rank, else the CPU
    model = gst.model.Net().to(device)
    if use_ddp:
        model = DDP(model)  # new: broadcasts rank 0's weights; averages gradients in backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    images, labels = images[:N_TRAIN], labels[:N_TRAIN]
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=SEED)
    batch_size = GLOBAL_BATCH // world_size  # each rank's share of the global batch
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # new: reshuffle, the same way on every rank
        shard = torch.tensor(list(sampler))  # this rank's 1/N of the data
        model.train()
        for start in range(0, len(shard), batch_size):
            idx = shard[start : start + batch_size]
            x, y = images[idx].to(device), labels[idx].to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()  # with DDP, every rank holds the mean gradient after this line
            if not use_ddp:
                average_gradients(model)
            optimizer.step()
            losses.append(loss.item())
    plain = model.module if use_ddp else model  # DDP keeps the original model in .module
    return {"losses": losses, "state": plain.state_dict()}


# %%
ddp = gst.launch(train, world_size=WORLD_SIZE, args=(EPOCHS, True))
manual = gst.launch(train, world_size=WORLD_SIZE, args=(EPOCHS, False))

# %% [markdown]
# ## DDP = manual averaging
#
# Same seed, same shards, same optimizer: DDP's parameters match notebook 02's manual averaging.
# DDP scales each gradient by 1/N *before* summing (in buckets), while `average_gradients` sums,
# then divides. With 2 ranks the two are even bit-identical: scaling by 1/2 is exact in floating
# point, and a sum of two numbers does not depend on their order. With more ranks gloo adds the
# ranks' values in a different order for one large bucket than for 8 separate tensors, so the last
# bits can differ: hence the tolerance.

# %%
diff = gst.checks.compare_state_dicts(ddp[0]["state"], manual[0]["state"], names=("DDP", "manual"))

# %%
steps = len(ddp[0]["losses"])
print(f"after {steps} steps, max |DDP - manual| = {diff:.1e} (<= 1e-4: {diff <= 1e-4})")
assert diff <= 1e-4
if WORLD_SIZE == 2:  # exact
    assert diff == 0.0
assert gst.checks.compare_ranks([r["state"] for r in ddp], show=False) == 0.0
print("DDP's replicas are identical across ranks")

# %% tags=["image:loss_curves_ddp.png"]
fig = gst.plots.plot_loss_curves(
    [r["losses"] for r in ddp], baseline={"manual averaging, rank 0": manual[0]["losses"]},
    title=f"DDP on {WORLD_SIZE} ranks vs manual averaging",
)

# %% [markdown]
# ## DDP broadcasts rank 0's weights at construction
#
# Now seed every rank differently, as happens when a script seeds with the rank or not at all.
# Manual averaging keeps the replicas apart forever: each applies the same averaged update to
# different weights. DDP copies rank 0's parameters to every rank when it is built, so the
# replicas agree from the first step.

# %%
ddp_seeded = gst.launch(train, world_size=WORLD_SIZE, args=(1, True, True))
manual_seeded = gst.launch(train, world_size=WORLD_SIZE, args=(1, False, True))

# %%
ddp_gap = gst.checks.compare_ranks([r["state"] for r in ddp_seeded], show=False)
manual_gap = gst.checks.compare_ranks([r["state"] for r in manual_seeded], show=False)
print("different seeds per rank, after one epoch: max difference between ranks")
print(f"  DDP:    {ddp_gap:.1e}")
print(f"  manual: {manual_gap:.1e}")
assert ddp_gap == 0.0 and manual_gap > 1e-2


# %% [markdown]
# ## Copy this into your code
#
# `snippets/03_ddp.py` is a whole script, run by the course's tests with
# `torchrun --standalone --nproc-per-node 2`: DDP, the sampler and its `set_epoch`, the loop over a
# `DataLoader` that deals each rank its shard, and a checkpoint written by rank 0 alone, then a
# `dist.barrier()` (notebook 06 says why).
#
# <!-- snippets/03_ddp.py -->
# ```python
# """Notebook 03, copy this into your code: DistributedDataParallel, a sampler, a checkpoint.
#
#     torchrun --standalone --nproc-per-node 2 snippets/03_ddp.py
# """
#
# import torch
# import torch.distributed as dist
# import torch.nn.functional as F
# from torch import nn
# from torch.nn.parallel import DistributedDataParallel as DDP
# from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
#
# SEED = 1234
#
#
# def main():
#     dist.init_process_group("gloo")  # "nccl" with one GPU per rank, and device_ids=[local_rank]
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     dataset = TensorDataset(torch.randn(512, 20, generator=torch.Generator().manual_seed(SEED)),
#                             torch.arange(512) % 3)
#     global_batch, epochs, path = 64, 2, "ddp_checkpoint.pt"
#
#     model = DDP(nn.Linear(20, 3))  # after init_process_group: copies rank 0's weights to all
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
#     sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # a different shard per rank
#     loader = DataLoader(dataset, batch_size=global_batch // world_size, sampler=sampler)
#     for epoch in range(epochs):
#         sampler.set_epoch(epoch)               # or every epoch repeats the same order
#         for x, y in loader:
#             optimizer.zero_grad()
#             F.cross_entropy(model(x), y).backward()  # gradients are averaged across ranks here
#             optimizer.step()
#
#     if rank == 0:                              # one file, written once
#         torch.save(model.module.state_dict(), path)  # .module: the unwrapped model
#     dist.barrier()                             # no rank reads it, or exits, before it is written
#
#     # Check: the file holds every rank's weights (the replicas are equal).
#     saved = torch.load(path, map_location="cpu", weights_only=True)
#     for name, p in model.module.state_dict().items():
#         assert torch.equal(saved[name], p), name
#     print(f"rank {rank}: {len(loader)} steps an epoch, weights equal to the checkpoint")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# ## Exercise
#
# DDP copies rank 0's weights to every rank when it is built. Do it by hand: write
# `broadcast_parameters(model)` so that afterwards every rank's parameters equal rank 0's. Call
# `dist.broadcast(tensor, src=0)` for every parameter: it works in place, rank 0 sends `tensor`
# and every other rank's `tensor` is overwritten with rank 0's values. So pass the parameter
# itself (`p.detach()` or `p.data`: the same memory), not a copy.
#
# The check below starts each of 3 ranks from different random weights, calls your function and
# compares the ranks. It prints "✓ correct", or fails with what is wrong; until you write the
# function, it says "not attempted yet". Stuck? `%load solutions/03_broadcast_parameters.py` in a
# new cell.
#
# Then use it: call `broadcast_parameters(model)` in `train` right after the model is built, and
# train with `use_ddp=False, seed_per_rank=True`: `gst.checks.compare_ranks` now finds identical
# replicas, as with DDP.

# %%
def broadcast_parameters(model):
    # your code here: dist.broadcast every parameter from rank 0
    raise NotImplementedError("write broadcast_parameters")


# %%
gst.exercises.check_broadcast_parameters(broadcast_parameters)
