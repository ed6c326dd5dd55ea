# %% [markdown]
# # 02 — Averaging gradients by hand with `all_reduce`
#
# **Question: is this the right way to average gradients across GPUs, and how should one read it?**
#
# ```python
# def average_gradients(model):
#     size = float(dist.get_world_size())
#     for param in model.parameters():
#         dist.all_reduce(param.grad.data, op=dist.reduce_op.SUM)
#         param.grad.data /= size
# ```
#
# This is the classic code from PyTorch's "Writing Distributed Applications" tutorial. Two
# processes each build their own `model = Net()`, and the function seems to touch only the local
# model's gradients. A popular answer says to drop the division. Who is right?
#
# **Short answer: the code is right.** `all_reduce` is a *collective*: every rank calls it with its
# own tensor, every rank contributes it, and every rank receives the sum of all of them, in place.
# Dividing by the number of ranks turns the sum into the mean. Dropping the division multiplies
# SGD's learning rate by the number of ranks. The rest of this notebook proves each of these
# sentences with numbers.

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

import gradsync_tutorial as gst

assert GLOBAL_BATCH % WORLD_SIZE == 0, "each rank takes GLOBAL_BATCH // WORLD_SIZE samples"


# %% [markdown]
# ## How to read it
#
# ![all_reduce: every rank contributes its gradient, every rank receives the sum](../images/allreduce.png)
#
# Each rank (process) holds a full **replica** of the model and computes gradients on its own
# slice of the batch. `dist.all_reduce(t, op=SUM)` is called by *every* rank with *its own* `t`;
# when it returns, each rank's `t` holds the element-wise sum over all ranks. So after the loop
# every replica holds the same, averaged gradient, every optimizer takes the same step, and the
# replicas stay identical. Nothing is "only local": the call is the communication.
#
# The modern spelling: `dist.ReduceOp.SUM` (not `reduce_op`), no `.data`, an integer world
# size, and parameters without a gradient skipped (a deliberate lesson copy: the package keeps
# the same loop as `gst.averaging.average_per_parameter`, and never asks you to use it instead):

# %%
def average_gradients(model):
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:  # a parameter that took no part in the loss
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
        param.grad /= world_size  # sum / N = mean over ranks


# %% [markdown]
# First, the collective itself: each rank starts with a different tensor and all end with the sum.

# %%
def show_all_reduce(rank, world_size):
    t = torch.tensor([10.0 * (rank + 1), 1.0])
    before = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # in place: t is overwritten with the sum
    print(f"before {before.tolist()} -> after {t.tolist()}")
    return t

sums = gst.launch(show_all_reduce, world_size=WORLD_SIZE)

# %%
# NBVAL_CHECK_OUTPUT
expected = torch.tensor([10.0 * sum(range(1, WORLD_SIZE + 1)), WORLD_SIZE])
assert all(torch.equal(s, expected) for s in sums)
print("every rank received", expected.tolist())

# %% [markdown]
# ## Proof: N ranks with batch 256/N each = one process with batch 256
#
# The loss is a mean over the batch, so the gradient of the global batch's loss is the mean of the
# gradients of N equal slices. Averaging gradients across ranks therefore reproduces a
# single-process step on the union of the slices. Let us check it for one SGD step, dropout off
# (`model.eval()`), so nothing random differs:

# %%
images, labels = gst.data.load(train=True)
batch = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED))[:GLOBAL_BATCH]

def one_step(rank, world_size, batch):
    torch.manual_seed(SEED)  # the same initial weights on every rank
    model = gst.model.Net().eval()  # eval: dropout off, for an exact comparison
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    idx = batch[rank::world_size]  # this rank's 256/N samples
    F.nll_loss(model(images[idx]), labels[idx]).backward()
    average_gradients(model)
    optimizer.step()
    return model.state_dict()

# The same step in this process, with no torch.distributed at all: the whole batch at once.
torch.manual_seed(SEED)
single = gst.model.Net().eval()
optimizer = torch.optim.SGD(single.parameters(), lr=LR, momentum=MOMENTUM)
F.nll_loss(single(images[batch]), labels[batch]).backward()
optimizer.step()

states = gst.launch(one_step, world_size=WORLD_SIZE, args=(batch,))

# %%
diff = gst.checks.compare_state_dicts(
    states[0], single.state_dict(), names=("rank 0", "single process")
)

# %%
print(f"max abs difference, {WORLD_SIZE} ranks vs 1 process: {diff:.1e} (<= 1e-6: {diff <= 1e-6})")
assert diff <= 1e-6


# %% [markdown]
# ## Training on N ranks
#
# The whole training loop, as each rank runs it. Compared with notebook 01's loop, two lines
# are new: each rank takes **every N-th index** of the shared, seeded data order (its shard), and
# `average_gradients(model)` runs between `backward()` and `step()`. With `world_size=1` this is
# exactly notebook 01's loop, so it also gives us the baseline.

# %% tags=["training-loop"]
def train(rank, world_size, epochs, average=average_gradients, lr=LR, optim="sgd", eps=1e-8):
    torch.manual_seed(SEED)  # same seed on every rank: the replicas start identical
    device = gst.local_device()  # cuda:LOCAL_RANK with a GPU per rank, else the CPU
    model = gst.model.Net().to(device)
    if optim == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, eps=eps)
    images, labels = gst.data.load(train=True)
    images, labels = images[:N_TRAIN], labels[:N_TRAIN]
    batch_size = GLOBAL_BATCH // world_size  # each rank's share of the global batch
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED + epoch))
        shard = order[rank::world_size]  # new: this rank's 1/N of the data
        model.train()
        for start in range(0, len(shard), batch_size):
            idx = shard[start : start + batch_size]
            x, y = images[idx].to(device), labels[idx].to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            average(model)  # new: every rank now holds the mean gradient
            optimizer.step()
            losses.append(loss.item())  # this rank's loss, on its own samples
    return {"losses": losses, "state": model.state_dict()}


# %%
baseline = gst.launch(train, world_size=1, args=(EPOCHS,))[0]
results = gst.launch(train, world_size=WORLD_SIZE, args=(EPOCHS,))

# %% [markdown]
# After training, the replicas are still identical, parameter for parameter:

# %%
rank_diff = gst.checks.compare_ranks([r["state"] for r in results])

# %%
print(f"max difference between ranks after {len(results[0]['losses'])} steps: {rank_diff}")
assert rank_diff == 0.0

# %% [markdown]
# Each rank's loss is measured on its own half of the batch, so the curves wiggle around each other
# and around the single-process baseline (dashed); they follow the same path.

# %% tags=["image:loss_curves_manual.png"]
fig = gst.plots.plot_loss_curves(
    [r["losses"] for r in results],
    baseline=baseline["losses"],
    title=f"Manual averaging on {WORLD_SIZE} ranks vs one process",
    save=None if SMOKE_TEST else "loss_curves_manual.png",
)


# %%
def tail_mean(losses, n=20):
    return sum(losses[-n:]) / n

gap = abs(tail_mean(results[0]["losses"]) - tail_mean(baseline["losses"]))
print(f"final loss: rank 0 {tail_mean(results[0]['losses']):.3f}, "
      f"baseline {tail_mean(baseline['losses']):.3f}")
assert gap < 0.15


# %% [markdown]
# ## The popular answer: all_reduce without dividing
#
# Without the division every rank holds the **sum** of the gradients, N times the mean. For
# plain SGD (momentum included) that is exactly the correct average with the learning rate
# multiplied by N:

# %%
def sum_gradients(model):  # the popular answer: no division
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)


# %%
no_divide = gst.launch(train, world_size=WORLD_SIZE, args=(EPOCHS, sum_gradients))
lr_times_n = gst.launch(
    train, world_size=WORLD_SIZE, args=(EPOCHS, average_gradients, LR * WORLD_SIZE)
)

# %%
diff = gst.checks.compare_state_dicts(no_divide[0]["state"], lr_times_n[0]["state"], show=False)
print(f"no division at lr={LR} vs average at lr={LR * WORLD_SIZE}: max abs difference {diff:.1e}")
assert diff <= 1e-5

# %% [markdown]
# So the bug does not crash, and the loss still falls: it trains with a learning rate N times
# larger than the one you chose, and changes again when you change the number of GPUs.

# %%
fig = gst.plots.plot_loss_curves(
    {"correct average, rank 0": results[0]["losses"],
     "no division, rank 0": no_divide[0]["losses"]},
    title=f"Dropping the division = SGD with lr x {WORLD_SIZE}",
)

# %% [markdown]
# ### Why the bug goes unnoticed with Adam
#
# Adam divides each update by a running estimate of the gradient's magnitude, so multiplying
# every gradient by N almost cancels: the update is $m / (\sqrt{v} + \epsilon)$, and with gradients
# N times larger it becomes $N m / (N \sqrt{v} + \epsilon) = m / (\sqrt{v} + \epsilon / N)$.
# Only $\epsilon$ differs: the bug equals correct averaging with $\epsilon / N$.

# %%
ADAM_LR = 1e-3
adam = [  # one epoch each: average, no division, average with eps / N
    gst.launch(train, world_size=WORLD_SIZE, args=(1, average, ADAM_LR, "adam", eps))
    for average, eps in [(average_gradients, 1e-8), (sum_gradients, 1e-8),
                         (average_gradients, 1e-8 / WORLD_SIZE)]
]
adam_avg, adam_sum, adam_eps = adam


# %% [markdown]
# How far apart are the loss curves with and without the division? (Mean absolute difference
# of rank 0's loss, step by step, over the first epoch.)

# %%
def curve_gap(a, b):
    n = min(len(a), len(b))
    return sum(abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)) / n

steps = len(adam_avg[0]["losses"])
sgd_gap = curve_gap(results[0]["losses"][:steps], no_divide[0]["losses"][:steps])
adam_gap = curve_gap(adam_avg[0]["losses"], adam_sum[0]["losses"])
eps_diff = gst.checks.compare_state_dicts(adam_eps[0]["state"], adam_sum[0]["state"], show=False)
print(f"SGD:  no division vs average, mean |loss difference| {sgd_gap:.4f}")
print(f"Adam: no division vs average, mean |loss difference| {adam_gap:.4f}")
print(f"Adam: no division vs average with eps / N, max abs parameter difference {eps_diff:.1e}")
assert adam_gap < sgd_gap / 5  # Adam almost hides the bug
assert eps_diff <= 1e-6  # and what remains is exactly eps / N


# %% [markdown]
# ## Copy this into your code
#
# `snippets/02_average_gradients.py` is a whole script, run by the course's tests with
# `torchrun --standalone --nproc-per-node 2`: `average_gradients` and the three lines that call it
# are the part to copy; the rest checks, on every rank, that the averaged gradient is the one of
# the whole batch.
#
# <!-- snippets/02_average_gradients.py -->
# ```python
# """Notebook 02, copy this into your code: average the gradients by hand, SUM then divide.
#
#     torchrun --standalone --nproc-per-node 2 snippets/02_average_gradients.py
# """
#
# import copy
#
# import torch
# import torch.distributed as dist
# import torch.nn.functional as F
# from torch import nn
#
#
# def average_gradients(model):
#     world_size = dist.get_world_size()
#     for param in model.parameters():
#         if param.grad is None:
#             continue
#         dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
#         param.grad /= world_size                            # the mean
#
#
# def main():
#     dist.init_process_group("gloo")  # "nccl" with one GPU per rank
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     torch.manual_seed(0)                       # the same initial weights on every rank
#     model = nn.Linear(20, 3)
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
#     x, y = torch.randn(64, 20), torch.randint(0, 3, (64,))  # one global batch...
#     shard = slice(rank, None, world_size)                   # ...a different shard on each rank
#     whole = copy.deepcopy(model)               # for the check below: one process, all 64
#
#     loss = F.cross_entropy(model(x[shard]), y[shard])
#     loss.backward()
#     average_gradients(model)
#     optimizer.step()
#
#     # Check: every rank holds the gradient of the loss over the whole batch, as one process would.
#     F.cross_entropy(whole(x), y).backward()
#     for p, q in zip(model.parameters(), whole.parameters(), strict=True):
#         torch.testing.assert_close(p.grad, q.grad)
#     print(f"rank {rank}: averaged gradient == gradient of the whole batch")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# Start every rank from the same weights (same seed, or a broadcast from rank 0) and give each
# rank a different shard of every batch. Notebook 03 gets all of this from `DistributedDataParallel`;
# notebook 05 shows why 8 small `all_reduce` calls per step are slow.

# %% [markdown]
# ## Exercise
#
# Write `average_gradients_flat(model)` that makes **one** `all_reduce` call per step, instead of
# one per parameter: flatten all gradients into one tensor (`torch.cat([p.grad.flatten() ...])`),
# reduce it, divide, and copy the pieces back into each `p.grad` (`torch.cat` makes a copy).
#
# The check below runs it on 3 ranks, each with its own gradients, compares the result with the
# mean over ranks and counts your `all_reduce` calls. It prints "✓ correct", or fails with what
# is wrong; until you write the function, it says "not attempted yet". Stuck?
# `%load solutions/02_average_gradients_flat.py` in a new cell.

# %%
def average_gradients_flat(model):
    # your code here: torch.cat, one dist.all_reduce, divide, copy the pieces back
    raise NotImplementedError("write average_gradients_flat")


# %%
gst.exercises.check_average_gradients_flat(average_gradients_flat)
