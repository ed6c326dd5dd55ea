# %% [markdown]
# # 01 — The single-device baseline
#
# **Question: what result should distributed training reproduce?**
#
# **Short answer:** train once on one device, and keep that run. It uses a global batch of 256
# samples per step; a correct distributed run reproduces it.
#
# Before we split training across processes, we train once on a single device. Every later notebook
# compares against this reference run. It has the same model, the same data order, the same global
# batch and the same optimizer. Words such as *rank* and *world size* are defined in the
# [glossary](../README.md#glossary).

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # set it to 1 for a short run (the tests do)
WORLD_SIZE = 2  # not used here: this notebook is the 1-process reference

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5  # the classic example's SGD settings
EPOCHS = 1 if SMOKE_TEST else 2
N_TRAIN = 4096 if SMOKE_TEST else None  # None: all 60,000 training images

import torch
import torch.nn.functional as F

import gradsync_tutorial as gst

# GPUs: cuDNN's deterministic kernels, in full float32 (no TF32), so that a run repeats bit for
# bit and compares with the others (CPUs ignore both; gst.launch's ranks use the same).
torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = True, False

# %% [markdown]
# ## Data and model
#
# The data set is Fashion-MNIST: 28×28 grey images of clothes in 10 classes. It is a drop-in
# replacement for MNIST that is harder to fit, so the loss curves say more. `gst.data.load()`
# returns the whole set as two normalized tensors in memory. It fetches the files the first time
# (see the README).

# %%
images, labels = gst.data.load(train=True)
test_images, test_labels = gst.data.load(train=False)
print(f"train {tuple(images[:N_TRAIN].shape)}, test {tuple(test_images.shape)}, "
      f"classes {labels.unique().numel()}")

# %% [markdown]
# The model is the small CNN of PyTorch's "Writing Distributed Applications" tutorial: two
# convolutions, dropout, two linear layers (`gst.model.Net`).

# %% tags=["nbval-check-output"]
torch.manual_seed(SEED)
print(gst.model.Net())
print("parameters:", sum(p.numel() for p in gst.model.Net().parameters()))


# %% [markdown]
# ## The training loop
#
# Notebooks 02 and 03 keep this function's names and order, and change only the lines they teach.
# One detail matters for them: the **data order** comes from a generator seeded with `SEED + epoch`.
# So any process can recompute it. Each step takes the next 256 indices of that order. This is how
# `DistributedSampler` shuffles too, as notebook 03 shows.
#
# Two switches are for notebook 02, which compares runs number by number and explains why it needs
# them. `dropout=False` turns dropout's random masks off. `dtype=torch.float64` computes in double
# precision. The lesson trains with the defaults.

# %% tags=["training-loop"]
def train(epochs, lr=LR, dropout=True, dtype=torch.float32):
    torch.manual_seed(SEED)  # the initial weights, the same wherever this runs
    device = gst.local_device()  # a GPU if there is one, else the CPU
    model = gst.model.Net().to(device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    images, labels = images[:N_TRAIN], labels[:N_TRAIN]
    batch_size = GLOBAL_BATCH
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED + epoch))
        model.train(dropout)  # train(False) = eval mode: dropout off
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            x, y = images[idx].to(device, dtype), labels[idx].to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)  # mean over the batch
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


@torch.no_grad()
def accuracy(state, images, labels):
    model = gst.model.Net()
    model.load_state_dict(state)  # copied onto the CPU, as float32
    return (model.eval()(images).argmax(1) == labels).float().mean().item()


# %% [markdown]
# Train on one device: a GPU if there is one, else the CPU. How long it takes depends on the
# machine; `make doctor` prints this machine's time for one epoch.

# %%
baseline = train(EPOCHS)
baseline_accuracy = accuracy(baseline["state"], test_images, test_labels)
print(f"{EPOCHS} epochs on {gst.local_device()}: "
      f"last loss {baseline['losses'][-1]:.3f}, test accuracy {baseline_accuracy:.1%}")

# %% [markdown]
# The loss falls, and the model beats chance (10 %) by far. It reaches over 50 % after the full
# lesson, and a lower bar in the short CI run.

# %%
losses = baseline["losses"]
steps_per_epoch = -(-len(images[:N_TRAIN]) // GLOBAL_BATCH)
assert len(losses) == EPOCHS * steps_per_epoch
first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
print(f"mean loss over the first 10 steps {first:.2f}, over the last 10 steps {last:.2f}")
assert last < first
assert baseline_accuracy > (0.12 if SMOKE_TEST else 0.5)  # CI: 16 steps, 15 %

# %%
fig = gst.plots.plot_loss_curves({"single device": losses}, title="Single-device baseline")


# %% [markdown]
# ## Reproducible, so comparable
#
# The same seed gives the same run, step for step. That lets the next notebooks compare a
# distributed run with this one, number by number. Train one epoch again: its losses are the
# baseline's first epoch, bit for bit. On a GPU this needs deterministic kernels, which the first
# cell asks cuDNN for. It is expected to hold there, but has not yet run on a GPU. Torch lists
# `NLLLoss` on CUDA among its nondeterministic operations.

# %% tags=["nbval-check-output"]
again = train(1)
print("identical loss histories over the first epoch:", again["losses"] == losses[:steps_per_epoch])
assert again["losses"] == losses[:steps_per_epoch]


# %% [markdown]
# ## Copy this into your code
#
# * Seed the initial weights (`torch.manual_seed`). Derive the data order from a seed plus the
#   epoch. Distributed training needs every rank to agree on both.
# * Keep a single-process run of your model as the reference for any distributed change.

# %% [markdown]
# ## Exercise: a batch too large for memory
#
# With a large model, a batch of 256 may not fit in a GPU's memory. **Gradient accumulation** takes
# the same optimizer step in pieces. Split the batch into `micro_batches` equal micro-batches and
# call `backward()` on each. `backward()` *adds* into `.grad`, so the pieces' gradients add up.
# Scale each micro-batch's loss so that the sum is the gradient of the whole batch's mean loss.
#
# Write `accumulate_gradients(model, images, labels, micro_batches)`. The caller zeroes the
# gradients before and steps the optimizer after. Your function leaves in `.grad` the gradient of
# `F.nll_loss` over the whole batch, computed one micro-batch at a time. It returns that mean loss
# as a float, for logging:
#
# ```python
# optimizer.zero_grad()
# loss = accumulate_gradients(model, images[idx], labels[idx], micro_batches=4)
# optimizer.step()
# ```
#
# Notebook 02 does the same across processes: each rank computes one slice's gradient, and the ranks
# add them up. The check below compares your gradient with one `backward()` on the whole batch
# (dropout off). It prints "✓ correct", or fails with what is wrong. Until you write it, it says
# "not attempted yet". Stuck? `%load solutions/01_accumulate_gradients.py` in a new cell.

# %%
def accumulate_gradients(model, images, labels, micro_batches):
    # your code here: one forward and backward per micro-batch; return the mean loss
    raise NotImplementedError("write accumulate_gradients")


# %%
gst.exercises.check_accumulate_gradients(accumulate_gradients)
