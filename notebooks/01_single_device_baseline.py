# %% [markdown]
# # 01 — The single-device baseline
#
# **Question: what result should distributed training reproduce?**
#
# Before we split training across processes, we train once on a single device. This run is the
# reference that every later notebook compares against: the same model, the same data order,
# the same global batch of 256 samples per step, the same optimizer. If distributed training is
# correct, it reproduces this run.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: less data, same checks
WORLD_SIZE = 2  # not used here: this notebook is the 1-process reference

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5  # the classic example's SGD settings
EPOCHS = 2 if SMOKE_TEST else 3
N_TRAIN = 8192 if SMOKE_TEST else None  # None: all 60,000 training images

import time

import torch
import torch.nn.functional as F

import gradsync_tutorial as gst

# %% [markdown]
# ## Data and model
#
# Fashion-MNIST: 28×28 grey images of clothes in 10 classes, a drop-in replacement for MNIST
# that is harder to fit, so the loss curves say more. `gst.data.load()` returns the whole set as
# two normalized tensors in memory (it fetches the files the first time: see the README).

# %%
images, labels = gst.data.load(train=True)
test_images, test_labels = gst.data.load(train=False)
images, labels = images[:N_TRAIN], labels[:N_TRAIN]
print(f"train {tuple(images.shape)}, test {tuple(test_images.shape)}, "
      f"classes {labels.unique().numel()}")

# %% [markdown]
# The model is the small CNN of PyTorch's "Writing Distributed Applications" tutorial:
# two convolutions, dropout, two linear layers (`gst.model.Net`).

# %%
# NBVAL_CHECK_OUTPUT
torch.manual_seed(SEED)
print(gst.model.Net())
print("parameters:", sum(p.numel() for p in gst.model.Net().parameters()))


# %% [markdown]
# ## The training loop
#
# One detail matters for what follows: the **data order** comes from a generator seeded with
# `SEED + epoch`, so any process can recompute it. Each step takes the next 256 indices of that
# order. (This is how `DistributedSampler` shuffles too, as notebook 03 shows.)

# %% tags=["training-loop"]
def train_one_epoch(model, optimizer, images, labels, epoch, batch_size, device):
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED + epoch))
    losses = []
    model.train()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        x, y = images[idx].to(device), labels[idx].to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)  # mean over the batch
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def accuracy(model, images, labels, device, batch_size=1000):
    model.eval()
    correct = 0
    for i in range(0, len(images), batch_size):
        predicted = model(images[i : i + batch_size].to(device)).argmax(1).cpu()
        correct += (predicted == labels[i : i + batch_size]).sum().item()
    return correct / len(images)


# %% [markdown]
# Train on one device: a GPU if there is one, else the CPU.

# %%
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(SEED)  # the initial weights
model = gst.model.Net().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

baseline_losses = []
for epoch in range(EPOCHS):
    start = time.perf_counter()
    baseline_losses += train_one_epoch(
        model, optimizer, images, labels, epoch, GLOBAL_BATCH, device
    )
    seconds = time.perf_counter() - start
    print(f"epoch {epoch}: last loss {baseline_losses[-1]:.3f}, {seconds:.1f} s on {device}")
baseline_accuracy = accuracy(model, test_images, test_labels, device)
print(f"test accuracy: {baseline_accuracy:.1%}")

# %% [markdown]
# The loss falls, and the model beats chance (10 %) by far: over 50 % after the full lesson,
# a lower bar in the short CI run.

# %%
steps_per_epoch = -(-len(images) // GLOBAL_BATCH)
assert len(baseline_losses) == EPOCHS * steps_per_epoch
first, last = sum(baseline_losses[:10]) / 10, sum(baseline_losses[-10:]) / 10
print(f"mean loss over the first 10 steps {first:.2f}, over the last 10 steps {last:.2f}")
assert last < first
assert baseline_accuracy > (0.2 if SMOKE_TEST else 0.5)

# %%
fig = gst.plots.plot_loss_curves([], baseline=baseline_losses, title="Single-device baseline")


# %% [markdown]
# ## Reproducible, so comparable
#
# The same seed gives the same run, step for step, on the CPU. That is what lets the next
# notebooks compare a distributed run against this one number by number.

# %%
# NBVAL_CHECK_OUTPUT
def short_run(steps=5):
    torch.manual_seed(SEED)
    m = gst.model.Net()
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
    n = steps * GLOBAL_BATCH
    return train_one_epoch(m, opt, images[:n], labels[:n], 0, GLOBAL_BATCH, "cpu")

run_a, run_b = short_run(), short_run()
print("identical loss histories:", run_a == run_b)
assert run_a == run_b


# %% [markdown]
# ## Copy this into your code
#
# * Seed the initial weights (`torch.manual_seed`) and derive the data order from a seed plus the
#   epoch: both are what distributed training will need every rank to agree on.
# * Keep a single-process run of your model as the reference for any distributed change.

# %% [markdown]
# ## Exercise: a batch too large for memory
#
# A batch of 256 may not fit in a small GPU's memory. **Gradient accumulation** takes the same
# optimizer step in pieces: split the batch into `micro_batches` equal micro-batches and call
# `backward()` on each. `backward()` *adds* into `.grad`, so the pieces' gradients add up; scale
# each micro-batch's loss so that the sum is the gradient of the whole batch's mean loss.
#
# Write `accumulate_gradients(model, images, labels, micro_batches)`. The caller zeroes the
# gradients before and steps the optimizer after; your function leaves in `.grad` the gradient of
# `F.nll_loss` over the whole batch, computed one micro-batch at a time, and returns that mean
# loss as a float, for logging:
#
# ```python
# optimizer.zero_grad()
# loss = accumulate_gradients(model, images[idx], labels[idx], micro_batches=4)
# optimizer.step()
# ```
#
# Notebook 02 does the same across processes: each rank computes one slice's gradient, and the
# ranks add them up. The check below compares your gradient with one `backward()` on the whole
# batch (dropout off) and prints "✓ correct", or fails with what is wrong; until you write it, it
# says "not attempted yet". Stuck? `%load solutions/01_accumulate_gradients.py` in a new cell.

# %%
def accumulate_gradients(model, images, labels, micro_batches):
    # your code here: one forward and backward per micro-batch; return the mean loss
    raise NotImplementedError("write accumulate_gradients")


# %%
gst.exercises.check_accumulate_gradients(accumulate_gradients)
