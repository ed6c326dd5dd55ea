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
# **Short answer: the code is right.** `all_reduce` is a *collective* (see the
# [glossary](../README.md#glossary)): every rank calls it with its own tensor, every rank
# contributes it, and every rank receives the sum of all of them, in place. Dividing by the
# number of ranks turns the sum into the mean. Dropping the division multiplies SGD's learning
# rate by the number of ranks. The rest of this notebook measures each of these sentences.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: less data, same checks
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5  # the classic example's SGD settings
EPOCHS = 1 if SMOKE_TEST else 2
N_TRAIN = 4096 if SMOKE_TEST else None  # None: all 60,000 training images

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradsync_tutorial as gst

assert GLOBAL_BATCH % WORLD_SIZE == 0, "each rank takes GLOBAL_BATCH // WORLD_SIZE samples"
# GPUs: cuDNN's deterministic kernels, in full float32 (no TF32), so that a run repeats bit for
# bit and compares with the others (CPUs ignore both; gst.launch's ranks use the same).
torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = True, False


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
    t = torch.tensor([10.0 * (rank + 1), 1.0], device=gst.local_device())  # nccl: on the GPU
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
# ## Your question, on the real model
#
# Each rank builds its own `Net()`, computes the gradient of *its* slice of a batch, then calls
# `average_gradients`. Here is `fc2.bias.grad` (the first 4 of its 10 values) on every rank,
# right after `backward()` and right after `average_gradients`. The ranks hold no shared memory:
# the gradients move only through `all_reduce`. Dropout is off (`eval()`), so nothing random
# differs.

# %%
images, labels = gst.data.load(train=True)
batch = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED))[:GLOBAL_BATCH]

def gradient_probe(rank, world_size, batch, average=average_gradients, seed=SEED,
                   global_mean=False):
    torch.manual_seed(seed)  # the initial weights
    device = gst.local_device()
    model = gst.model.Net().to(device).eval()  # eval: dropout off
    images, labels = gst.data.load(train=True)
    idx = batch[rank::world_size]  # this rank's 256/N samples of the global batch
    output, y = model(images[idx].to(device)), labels[idx].to(device)
    if global_mean:  # each rank divides its sum by the *global* number of samples
        loss = F.nll_loss(output, y, reduction="sum") / len(batch)
    else:  # the usual mean over this rank's own samples
        loss = F.nll_loss(output, y)
    loss.backward()
    before = {name: p.grad.clone() for name, p in model.named_parameters()}
    average(model)
    after = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"before": before, "after": after, "weights": model.state_dict()}

probe = gst.launch(gradient_probe, world_size=WORLD_SIZE, args=(batch,))

# %%
show = lambda t: " ".join(f"{v:+.5f}" for v in t[:4].tolist())
for rank, p in enumerate(probe):
    print(f"rank {rank}: after backward {show(p['before']['fc2.bias'])}   "
          f"after average_gradients {show(p['after']['fc2.bias'])}")

# %% [markdown]
# Checked for every parameter, not only `fc2.bias`: after `backward()` the ranks' gradients
# differ (each rank saw other samples); after `average_gradients` they are identical on every
# rank, bit for bit (on GPUs too: NCCL sends every rank the same finished sum), and equal to the
# mean of the gradients before; and that mean equals the gradient one process computes on the
# whole batch of 256, up to float rounding.

# %%
before_gap = gst.checks.compare_ranks([p["before"] for p in probe], show=False)
after_gap = gst.checks.compare_ranks([p["after"] for p in probe], show=False)
mean_before = {k: torch.stack([p["before"][k] for p in probe]).mean(0) for k in probe[0]["before"]}
vs_mean = gst.checks.compare_state_dicts(probe[0]["after"], mean_before, show=False)
whole = gst.launch(gradient_probe, world_size=1, args=(batch,))[0]  # 1 process, whole batch
vs_whole = gst.checks.compare_state_dicts(probe[0]["after"], whole["after"], show=False)
print(f"max difference between ranks: after backward {before_gap:.2g}, "
      f"after average_gradients {after_gap:.2g}")
print(f"max |averaged - mean of the ranks' gradients| = {vs_mean:.2g}")
print(f"max |averaged - one process's gradient on the whole batch| = {vs_whole:.2g}")
assert before_gap > 1e-3 and after_gap == 0.0
assert vs_mean <= 1e-7 and vs_whole <= 1e-6

# %% [markdown]
# **The precondition: the replicas start identical.** Averaging makes the *gradients* equal; the
# *weights* stay equal only if they start equal. Above, every rank seeded the same generator
# before `Net()`, so the initial weights agree. Seed each rank differently (a common slip:
# seeding with the rank) and the replicas differ from the start, and go on differing, since each
# applies the same averaged step to other weights. Notebook 03 shows the usual cure: DDP (or a
# `dist.broadcast` from rank 0) copies rank 0's weights to every rank.

# %%
same_start = gst.checks.compare_ranks([p["weights"] for p in probe], show=False)
other_seeds = [
    gst.launch(gradient_probe, world_size=1, args=(batch, average_gradients, SEED + rank))[0]
    for rank in range(WORLD_SIZE)  # what each rank would build, seeded SEED + rank
]
seeded_apart = gst.checks.compare_ranks([p["weights"] for p in other_seeds], show=False)
print(f"initial weights, max difference between ranks: same seed {same_start:.2g}, "
      f"seed + rank {seeded_apart:.2g}")
assert same_start == 0.0 and seeded_apart > 0.1


# %% [markdown]
# ## Training on N ranks
#
# The whole training loop, as each rank runs it. Here is what changed since notebook 01's
# `train`, read from both notebooks: the signature takes the rank and the world size; each rank
# takes its **shard**, every N-th index of the shared, seeded data order, in batches of 256/N;
# and `average(model)` (by default `average_gradients`) runs between `backward()` and `step()`.

# %% tags=["training-loop"]
def train(rank, world_size, epochs, lr=LR, dropout=True, dtype=torch.float32,
          average=average_gradients):
    torch.manual_seed(SEED)  # the initial weights, the same wherever this runs
    device = gst.local_device()  # a GPU if there is one, else the CPU
    model = gst.model.Net().to(device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    images, labels = images[:N_TRAIN], labels[:N_TRAIN]
    batch_size = GLOBAL_BATCH // world_size  # each rank's share of the global batch
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED + epoch))
        shard = order[rank::world_size]  # this rank's 1/N of the data
        model.train(dropout)  # train(False) = eval mode: dropout off
        for start in range(0, len(shard), batch_size):
            idx = shard[start : start + batch_size]
            x, y = images[idx].to(device, dtype), labels[idx].to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)  # mean over the batch
            loss.backward()
            average(model)  # every rank now holds the mean gradient
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


# %%
train_01 = gst.notebooks.load_function("01_single_device_baseline", "train")
changes = gst.notebooks.show_diff(train_01, train, names=("01: train", "02: train"))
assert changes == 5

# %% [markdown]
# With `world_size=1` the shard is the whole order, the batch is 256 and `all_reduce` over one
# rank changes nothing: it is notebook 01's loop. Checked by running both, notebook 01's `train`
# read from notebook 01, to the last bit (on a GPU thanks to the deterministic kernels asked for
# in the first cell):

# %%
baseline = train_01(EPOCHS)  # notebook 01's loop, in this process
one_rank = gst.launch(train, world_size=1, args=(EPOCHS,))[0]
results = gst.launch(train, world_size=WORLD_SIZE, args=(EPOCHS,))

# %%
same_as_01 = gst.checks.compare_state_dicts(one_rank["state"], baseline["state"], show=False)
print(f"02's train on 1 rank vs 01's train, after {EPOCHS} epochs: max |difference| = "
      f"{same_as_01:.2g}, identical losses: {one_rank['losses'] == baseline['losses']}")
assert same_as_01 == 0.0 and one_rank["losses"] == baseline["losses"]

# %% [markdown]
# On N ranks the replicas stay identical, parameter for parameter, to the last bit:

# %%
rank_diff = gst.checks.compare_ranks([r["state"] for r in results])

# %%
print(f"max difference between ranks after {len(results[0]['losses'])} steps: {rank_diff}")
assert rank_diff == 0.0

# %% [markdown]
# Each rank's loss is measured on its own 256/N samples, so the ranks' curves wiggle around each
# other and around the single-process run.

# %% tags=["image:loss_curves_manual.png"]
fig = gst.plots.plot_loss_curves(
    [r["losses"] for r in results],
    baseline=baseline["losses"],
    title=f"Manual averaging on {WORLD_SIZE} ranks vs one process",
)

# %% [markdown]
# ## The whole run: N ranks = one process
#
# One step matched above. Does the whole run? Two things differ between an N-rank run and the
# single process, and neither is the averaging:
#
# * **Dropout.** Every rank seeds the same generator, so rank 1 draws the same masks for its
#   128 samples as rank 0 for its own, where one process draws 256 different masks: the runs
#   train different sub-networks. `dropout=False` turns it off. (Kept here for the equalities;
#   the scripts and snippets you copy seed `SEED + rank` after building the model, so that
#   each rank draws its own masks.)
# * **Rounding.** Float addition is not associative, and a batch of 256 is summed in another
#   order than two of 128 (about 1e-9 per step, as above). Training amplifies such differences
#   step after step. `dtype=torch.float64` makes them a billion times smaller.
#
# With both switches, one epoch on 2 and on 4 ranks against notebook 01's loop on one process:

# %%
exact = dict(dropout=False, dtype=torch.float64)
single = train_01(1, **exact)
ranks = {n: gst.launch(partial(train, **exact), world_size=n, args=(1,)) for n in (2, 4)}

# %%
for n, runs in ranks.items():
    gap = gst.checks.compare_state_dicts(runs[0]["state"], single["state"], show=False)
    print(f"{n} ranks vs 1 process, after one epoch ({len(single['losses'])} steps): "
          f"max |difference of parameters| = {gap:.2g}")
    assert gap <= 1e-6

# %% [markdown]
# The mean of the ranks' losses is the single process's loss at every step (each rank's loss is
# the mean over an equal share of the batch):

# %%
mean_over_ranks = {n: [sum(s) / n for s in zip(*(r["losses"] for r in runs), strict=True)]
                   for n, runs in ranks.items()}
fig = gst.plots.plot_loss_curves(
    {f"mean over {n} ranks": m for n, m in mean_over_ranks.items()},
    baseline={"1 process": single["losses"]},
    title="One epoch, dropout off, float64: the curves coincide",
)

# %%
loss_gap = max(abs(a - b) for m in mean_over_ranks.values()
               for a, b in zip(m, single["losses"], strict=True))
print(f"max |mean over ranks - 1 process| over every step: {loss_gap:.2g}")
assert loss_gap <= 1e-9

# %% [markdown]
# What each switch hides, measured on 2 ranks against one process: float32 without dropout
# (one epoch), and the lesson's runs above, float32 with dropout (`EPOCHS` epochs):

# %%
float32_single = train_01(1, dropout=False)
float32_ranks = gst.launch(partial(train, dropout=False), world_size=2, args=(1,))

# %%
rounding = gst.checks.compare_state_dicts(float32_ranks[0]["state"], float32_single["state"],
                                          show=False)
with_dropout = gst.checks.compare_state_dicts(results[0]["state"], baseline["state"], show=False)
print(f"float32, dropout off: max |difference| = {rounding:.2g} (float rounding, amplified)")
print(f"float32, dropout on:  max |difference| = {with_dropout:.2g} (other masks)")
assert 0 < rounding < with_dropout

# %% [markdown]
# So with averaged gradients, N ranks train the same model as one process with the whole batch:
# to 1e-6 or better in float64, after a full epoch, for 2 and 4 ranks. In float32 the runs
# drift apart as any two runs that add numbers in another order do.

# %% [markdown]
# ## The popular answer: all_reduce without dividing
#
# Without the division every rank holds the **sum** of the gradients, N times the mean. For
# plain SGD (momentum included) that is the correct average with the learning rate multiplied
# by N. Run both, one epoch on the same ranks:

# %%
def sum_gradients(model):  # the popular answer: no division
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)


# %%
no_divide = gst.launch(partial(train, average=sum_gradients), world_size=WORLD_SIZE, args=(1,))
lr_times_n = gst.launch(train, world_size=WORLD_SIZE, args=(1, LR * WORLD_SIZE))
averaged = gst.launch(train, world_size=WORLD_SIZE, args=(1,))

# %%
diff = gst.checks.compare_state_dicts(no_divide[0]["state"], lr_times_n[0]["state"], show=False)
print(f"no division at lr={LR} vs average at lr={LR * WORLD_SIZE}: max |difference| {diff:.2g}")
assert diff <= 1e-6

# %%
fig = gst.plots.plot_loss_curves(
    {f"average, lr={LR}": averaged[0]["losses"],
     f"average, lr={LR * WORLD_SIZE}": lr_times_n[0]["losses"]},
    baseline={f"no division, lr={LR}": no_divide[0]["losses"]},
    title=f"Dropping the division = SGD with lr x {WORLD_SIZE} (rank 0's loss)",
)

# %% [markdown]
# ### The harm: the learning rate now depends on the number of GPUs
#
# At this notebook's small `lr=0.01` the ×N run even learns faster, and the bug looks like a
# feature. But you tune the learning rate for your setup; the bug multiplies it by however many
# GPUs the job gets. Take a learning rate tuned on one process, then move to 8 GPUs. No 8 ranks
# are needed to see it: on N equal shards, the sum of the ranks' mean gradients is N times the
# whole batch's mean gradient, so one process that multiplies its gradient by 8 takes the step
# 8 ranks without division take. First that emulation, checked against a real `all_reduce` sum
# on 4 ranks (one step):

# %%
def times(n):  # what the popular answer computes on n ranks, emulated in one process
    def scale(model):
        for param in model.parameters():
            param.grad *= n
    return scale

summed = gst.launch(gradient_probe, world_size=4, args=(batch, sum_gradients))[0]
emulated = gst.launch(gradient_probe, world_size=1, args=(batch, times(4)))[0]
gap = gst.checks.compare_state_dicts(summed["after"], emulated["after"], show=False)
print(f"all_reduce SUM on 4 ranks vs gradient x 4 in one process: max |difference| {gap:.2g}")
assert gap <= 1e-6

# %% [markdown]
# Now train the first `STEPS` steps with `lr=0.1`, ten times the lesson's, on one process, then
# with the popular answer on 8 ranks, emulated. (With the division, 8 ranks are the one-process
# run, as proven above.)

# %%
STEPS = 50  # optimizer steps (12,800 samples), in CI too

def first_steps(rank, world_size, steps, optimizer, average=average_gradients, max_norm=None):
    """train's first `steps` steps, with another optimizer and optional gradient clipping."""
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device)
    opt = optimizer(model.parameters())
    images, labels = gst.data.load(train=True)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED))
    shard, batch_size = order[rank::world_size], GLOBAL_BATCH // world_size
    losses, norms = [], []
    for start in range(0, steps * batch_size, batch_size):
        idx = shard[start : start + batch_size]
        opt.zero_grad()
        loss = F.nll_loss(model(images[idx].to(device)), labels[idx].to(device))
        loss.backward()
        average(model)
        if max_norm is not None:  # returns the norm before clipping
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict(), "norms": norms}

sgd = lambda lr, **kw: partial(torch.optim.SGD, lr=lr, momentum=MOMENTUM, **kw)
tail = lambda run: sum(run["losses"][-10:]) / 10  # mean loss over the last 10 steps

# %%
tuned = {
    "lr=0.01, 1 process (the lesson's)": gst.launch(first_steps, 1, (STEPS, sgd(LR)))[0],
    "lr=0.1, 1 process = average on 8 ranks": gst.launch(first_steps, 1, (STEPS, sgd(0.1)))[0],
    "lr=0.1, no division on 8 ranks (emulated)":
        gst.launch(first_steps, 1, (STEPS, sgd(0.1), times(8)))[0],
}
fig = gst.plots.plot_loss_curves({k: r["losses"] for k, r in tuned.items()},
                                 title="A learning rate tuned on one process, then 8 GPUs")

# %%
for label, run in tuned.items():
    print(f"{label}: mean loss over the last 10 steps {tail(run):.3f}")
lesson, one, eight = tuned.values()
assert tail(one) < tail(lesson)  # lr=0.1 is the better choice on one process
assert tail(eight) > tail(one) + 0.2  # and the popular answer on 8 GPUs ruins it

# %% [markdown]
# ### When no division is right
#
# When each rank's loss is already divided by the **global** number of samples (its sum over
# its own samples, divided by 256, as in notebook 04's mean-of-means pitfall), the sum over
# ranks is already the mean: then `all_reduce` without dividing is right. Checked on one step:

# %%
global_mean = gst.launch(gradient_probe, world_size=WORLD_SIZE,
                         args=(batch, sum_gradients, SEED, True))
gap = gst.checks.compare_state_dicts(global_mean[0]["after"], whole["after"], show=False)
print(f"loss summed / 256 on each rank, all_reduce without division, vs one process: "
      f"max |difference| {gap:.2g}")
assert gap <= 1e-6

# %% [markdown]
# ### Where "lr × N" is not the whole story
#
# The equivalence holds for the gradient alone. Anything the optimizer adds or measures after
# the averaging sees the difference:
#
# * **Weight decay.** `SGD(weight_decay=wd)` adds `wd * param` to the gradient inside `step()`,
#   after your averaging: not multiplied by N. So no division at `lr` equals averaging at
#   `lr × N` with `wd / N`, not with `wd`.
# * **Gradient clipping.** `clip_grad_norm_` sees a gradient norm N times larger, so it clips
#   more: no division with `max_norm` equals averaging at `lr × N` with `max_norm / N`.
#
# Measured over the first `STEPS` steps on the ranks, against the averaged run at `lr × N`:

# %%
N, WD, CLIP = WORLD_SIZE, 0.01, 1.0
run = lambda *args: gst.launch(first_steps, WORLD_SIZE, (STEPS, *args))[0]
decay = {"no division": run(sgd(LR, weight_decay=WD), sum_gradients),
         "average, wd": run(sgd(LR * N, weight_decay=WD)),
         "average, wd / N": run(sgd(LR * N, weight_decay=WD / N))}
clipped = {"no division": run(sgd(LR), sum_gradients, CLIP),
           "average, max_norm": run(sgd(LR * N), average_gradients, CLIP),
           "average, max_norm / N": run(sgd(LR * N), average_gradients, CLIP / N)}

# %%
def vs(runs, a, b):
    return gst.checks.compare_state_dicts(runs[a]["state"], runs[b]["state"], show=False)

norm_ratio = clipped["no division"]["norms"][0] / clipped["average, max_norm"]["norms"][0]
print(f"weight decay {WD}: no division at lr vs average at lr x {N}: "
      f"{vs(decay, 'no division', 'average, wd'):.2g} with wd, "
      f"{vs(decay, 'no division', 'average, wd / N'):.2g} with wd / {N}")
print(f"clipping at {CLIP}: the norm clip_grad_norm_ sees is {norm_ratio:.4g} x larger; "
      f"no division vs average at lr x {N}: "
      f"{vs(clipped, 'no division', 'average, max_norm'):.2g} with max_norm, "
      f"{vs(clipped, 'no division', 'average, max_norm / N'):.2g} with max_norm / {N}")
assert vs(decay, "no division", "average, wd") > 1e-4
assert vs(decay, "no division", "average, wd / N") <= 1e-6
assert abs(norm_ratio - N) <= 1e-4 * N
assert vs(clipped, "no division", "average, max_norm") > 1e-4
assert vs(clipped, "no division", "average, max_norm / N") <= 1e-5  # see below

# %% [markdown]
# With `max_norm / N` the runs agree to about 1e-6, not bit for bit: `clip_grad_norm_` scales by
# `max_norm / (norm + 1e-6)`, and that 1e-6 is not multiplied by N.

# %% [markdown]
# ### Why the bug goes unnoticed with Adam
#
# Adam divides each update by a running estimate of the gradient's magnitude, so multiplying
# every gradient by N almost cancels: the update is $m / (\sqrt{v} + \epsilon)$, and with gradients
# N times larger it becomes $N m / (N \sqrt{v} + \epsilon) = m / (\sqrt{v} + \epsilon / N)$.
# Only $\epsilon$ differs: the bug equals correct averaging with $\epsilon / N$, and $\epsilon$
# (1e-8) is tiny next to $\sqrt{v}$, so the runs barely differ.

# %%
adam = lambda eps: partial(torch.optim.Adam, lr=1e-3, eps=eps)
adam_avg = run(adam(1e-8))
adam_sum = run(adam(1e-8), sum_gradients)
adam_eps = run(adam(1e-8 / N))
sgd_avg, sgd_sum = run(sgd(LR)), run(sgd(LR), sum_gradients)


# %%
def curve_gap(a, b):  # mean |loss difference|, step by step
    return sum(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) / len(a["losses"])

eps_diff = gst.checks.compare_state_dicts(adam_eps["state"], adam_sum["state"], show=False)
print(f"SGD:  no division vs average, mean |loss difference| {curve_gap(sgd_avg, sgd_sum):.4f}")
print(f"Adam: no division vs average, mean |loss difference| {curve_gap(adam_avg, adam_sum):.4f}")
print(f"Adam: no division vs average with eps / N, max |parameter difference| {eps_diff:.2g}")
assert curve_gap(adam_avg, adam_sum) < curve_gap(sgd_avg, sgd_sum) / 5  # Adam almost hides it
assert eps_diff <= 1e-6  # and what remains is eps / N


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
# import os
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
# def init_distributed():
#     """Join the group torchrun prepared (RANK, WORLD_SIZE, MASTER_ADDR...); return the device.
#
#     With a GPU for every rank on this machine: nccl, this rank on GPU LOCAL_RANK. Otherwise
#     gloo, on the CPU (a laptop; also 2 ranks on 1 GPU, which nccl cannot share).
#     """
#     local_rank = int(os.environ["LOCAL_RANK"])
#     if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
#         device = torch.device("cuda", local_rank)
#         torch.cuda.set_device(device)          # before init: nccl and *_object calls use it
#         dist.init_process_group("nccl", device_id=device)  # barrier() too
#         return device
#     dist.init_process_group("gloo")
#     return torch.device("cpu")
#
#
# def main():
#     device = init_distributed()
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     torch.manual_seed(0)                       # the same initial weights on every rank
#     model = nn.Linear(20, 3).to(device)
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
#     x, y = torch.randn(64, 20).to(device), torch.randint(0, 3, (64,)).to(device)  # one batch...
#     shard = slice(rank, None, world_size)      # ...a different shard of it on each rank
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
#     print(f"rank {rank}: averaged gradient == gradient of the whole batch, "
#           f"on {device} ({dist.get_backend()})")
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
# The check below runs it on 2 ranks, each with its own gradients, compares the result with the
# mean over ranks and counts your `all_reduce` calls. It prints "✓ correct", or fails with what
# is wrong; until you write the function, it says "not attempted yet". Stuck?
# `%load solutions/02_average_gradients_flat.py` in a new cell.

# %%
def average_gradients_flat(model):
    # your code here: torch.cat, one dist.all_reduce, divide, copy the pieces back
    raise NotImplementedError("write average_gradients_flat")


# %%
gst.exercises.check_average_gradients_flat(average_gradients_flat)
