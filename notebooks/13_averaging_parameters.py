# %% [markdown]
# # 13 — Averaging parameters instead of gradients: local SGD, DiLoCo, and replicas that come and go
#
# **Question: some training averages the *parameters* across ranks, not the gradients. When is
# that the same as averaging gradients, and what does it cost when it is not?**
#
# **Local SGD** lets each rank take its own optimizer steps and averages the parameters every K
# steps. **DiLoCo** does the same across data centres, with an outer optimizer on the average.
# Fault-tolerant trainers such as torchft average over the replicas that are alive this step.
# PyTorch's RFC warns that "parameter averaging can be detrimental to model accuracy due to the
# potential divergence of optimizer states especially if momentum is involved"
# ([pytorch#59699](https://github.com/pytorch/pytorch/issues/59699)).
#
# **Short answer:** average the parameters after every step, and only with SGD, if you need gradient
# averaging's result. With or without momentum, SGD then matches it to float64 rounding; Adam does
# not. Each rank's Adam divides its own gradient by its own scale, and that is not linear. Averaged
# every K steps, the ranks drift apart between averages. DiLoCo with an outer SGD of learning rate 1
# is local SGD exactly. Its pseudo-gradient is "weights before − average after"; the other sign
# trains backwards. When a replica is out, divide by the replicas that took part, never by the world
# size. With 1 of 3 replicas out, the world size gives 0.667 × the step.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: fewer DiLoCo rounds, same checks
WORLD_SIZE = 3  # the ranks (replicas); the notebook also runs with 4

SEED = 1234
PER_RANK = 4  # samples per rank and step
STEPS = 16  # inner steps of each run: K = 8 averages twice
EVERY = (1, 2, 4, 8)  # K: average the parameters every K steps
H = 4  # DiLoCo's inner steps per outer round
DILOCO_STEPS = 16 if SMOKE_TEST else 32  # 4 or 8 outer rounds

import copy
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

import gradsync_tutorial as gst

DTYPE = torch.float64  # exactness is claimed: float64 everywhere

# %% [markdown]
# ## The task: a small regression, a different shard on every rank
#
# A small MLP learns a fixed random map from 4 numbers to 2. Every step draws a fresh global
# batch from a seed; rank r takes every N-th sample, `x[r::N]`, as notebook 02's shard does.
# The **union batch** is the whole global batch: what one process would train on.

# %%
TEACHER = torch.randn(4, 2, generator=torch.Generator().manual_seed(SEED), dtype=DTYPE)


def make_model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(DTYPE)


def global_batch(step, world_size=WORLD_SIZE):
    """Step `step`'s batch of all ranks: inputs (N * PER_RANK, 4) and targets (N * PER_RANK, 2)."""
    g = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(world_size * PER_RANK, 4, generator=g, dtype=DTYPE)
    noise = torch.randn(world_size * PER_RANK, 2, generator=g, dtype=DTYPE)
    y = torch.tanh(x @ TEACHER) + 0.1 * noise
    return x, y


def flat(tensors):
    return torch.cat([t.detach().flatten().cpu() for t in tensors])


def full_loss(params, steps=STEPS):
    """The loss over every step's union batch, for a flat parameter vector."""
    model = make_model()
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    with torch.no_grad():
        return sum(F.mse_loss(model(x), y).item() for x, y in map(global_batch, range(steps))) / steps


x, y = global_batch(0)
print(f"global batch {tuple(x.shape)}; rank 1's shard {tuple(x[1::WORLD_SIZE].shape)}")
assert torch.equal(torch.cat([x[r::WORLD_SIZE] for r in range(WORLD_SIZE)]).sort(0).values,
                   x.sort(0).values)  # the shards are the union batch, nothing twice

# %% [markdown]
# ## Notebook 02's loop, and the one line that changes
#
# Here is notebook 02's training loop on this task. `average_gradients` is read from notebook 02
# itself. Each rank computes the gradient of its shard, averages it, then steps.

# %%
average_gradients = gst.notebooks.load_function("02_manual_allreduce_averaging",
                                                "average_gradients")


def train(rank, world_size, make_optimizer, average=average_gradients, steps=STEPS):
    torch.manual_seed(SEED)  # the same initial weights on every rank
    device = gst.local_device()
    model = make_model().to(device)
    optimizer = make_optimizer(model.parameters())
    for step in range(steps):
        x, y = (t[rank::world_size].to(device) for t in global_batch(step))  # this rank's shard
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        average(model)  # every rank now holds the mean gradient
        optimizer.step()
    return {"params": flat(model.parameters()), "state": optimizer_state(optimizer)}


def optimizer_state(optimizer):
    """Each buffer of the optimizer (momentum, Adam's moments), flat, by name."""
    states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
    return {name: flat(s[name] for s in states) for name in states[0]
            if states[0][name].dim() > 0}


# %% [markdown]
# **Parameter averaging** moves the average after `optimizer.step()` and averages the weights.
# Each rank steps with its own gradient; then every rank receives the mean of the new weights.

# %%
def average_parameters(model):
    world_size = dist.get_world_size()
    for param in model.parameters():
        dist.all_reduce(param.data, op=dist.ReduceOp.SUM)  # every rank receives the sum
        param.data /= world_size  # sum / N = mean over ranks


def train_local(rank, world_size, make_optimizer, average=average_parameters, steps=STEPS):
    torch.manual_seed(SEED)  # the same initial weights on every rank
    device = gst.local_device()
    model = make_model().to(device)
    optimizer = make_optimizer(model.parameters())
    for step in range(steps):
        x, y = (t[rank::world_size].to(device) for t in global_batch(step))  # this rank's shard
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        average(model)  # every rank now holds the mean parameters
    return {"params": flat(model.parameters()), "state": optimizer_state(optimizer)}


changes = gst.notebooks.show_diff(train, train_local, names=("train", "train_local"))
assert changes == 3  # the name, the default, the line that moved

# %% [markdown]
# Besides the function's name and its default, one line moved: `average(model)` now runs after
# `step()`, on the parameters. **Local SGD** calls it every K steps only; `every(k)` wraps it so.

# %%
def every(k, average=average_parameters):
    """`average`, called on every k-th call only (the steps in between stay local)."""
    calls = [0]

    def average_every_k(model):
        calls[0] += 1
        if calls[0] % k == 0:
            average(model)

    return average_every_k


OPTIMIZERS = {
    "SGD": partial(torch.optim.SGD, lr=0.1),
    "SGD, momentum 0.9": partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "Adam": partial(torch.optim.Adam, lr=0.01),
}

# %% [markdown]
# One launch runs every case on every rank: gradient averaging, then parameter averaging every
# K = 1, 2, 4 and 8 steps, with each optimizer. The reference is one process on the union batch,
# here in the notebook's own process: no averaging to do.

# %%
def torch_averager(k):
    """PyTorch's own local SGD averager as an `average(model)`, after steps k, 2k, ..."""
    averager = PeriodicModelAverager(period=k, warmup_steps=k - 1)  # built on the rank
    return lambda model: averager.average_parameters(model.parameters())


def all_runs(rank, world_size):
    runs = {}
    for name, make_optimizer in OPTIMIZERS.items():
        runs[name, "gradients"] = train(rank, world_size, make_optimizer)
        for k in EVERY:
            runs[name, k] = train_local(rank, world_size, make_optimizer, every(k))
    momentum = OPTIMIZERS["SGD, momentum 0.9"]
    runs["PeriodicModelAverager"] = train_local(rank, world_size, momentum, torch_averager(4))
    return runs


ranks = gst.launch(all_runs, WORLD_SIZE)
one_process = {name: train(0, 1, make, average=lambda model: None)
               for name, make in OPTIMIZERS.items()}


def distance(a, b):
    return (a - b).abs().max().item()


# %% [markdown]
# ## 1. Averaging every step: the same as averaging gradients, for SGD
#
# Checked for each optimizer, on every parameter after 16 steps: gradient averaging against one
# process (notebook 02's claim), and parameter averaging every step against gradient averaging.

# %%
runs = ranks[0]
every_step = {}
for name in OPTIMIZERS:
    grads, params = runs[name, "gradients"]["params"], runs[name, 1]["params"]
    every_step[name] = distance(params, grads)
    print(f"{name:18}: gradients vs one process {distance(grads, one_process[name]['params']):.2g}"
          f"; parameters every step vs gradients {every_step[name]:.2g}")
for name in OPTIMIZERS:
    assert distance(runs[name, "gradients"]["params"], one_process[name]["params"]) <= 1e-13
assert every_step["SGD"] <= 1e-13 and every_step["SGD, momentum 0.9"] <= 1e-13
assert every_step["Adam"] > 1e-3
same_on_every_rank = all(torch.equal(r[name, 1]["params"], runs[name, 1]["params"])
                         for r in ranks for name in OPTIMIZERS)
assert same_on_every_rank  # after an average every rank holds the same weights, bit for bit

# %% [markdown]
# Why SGD is exact: the update is linear in the gradient. Each rank steps to θ − lr·g_r; the
# mean of those weights is θ − lr·(mean of g_r), gradient averaging's step. Momentum is linear
# too, although each rank keeps its own buffer. The buffers differ between ranks, yet their
# mean is the buffer of the averaged gradients:

# %%
buffers = [r["SGD, momentum 0.9", 1]["state"]["momentum_buffer"] for r in ranks]
apart = max(distance(b, buffers[0]) for b in buffers)
mean_vs_averaged = distance(torch.stack(buffers).mean(0),
                            runs["SGD, momentum 0.9", "gradients"]["state"]["momentum_buffer"])
print(f"momentum buffers: max difference between ranks {apart:.2g}; their mean vs gradient "
      f"averaging's buffer {mean_vs_averaged:.2g}")
assert apart > 1e-2 and mean_vs_averaged <= 1e-13

# %% [markdown]
# **Adam** is not linear. A Horovod answer puts it so: parameter averaging equals gradient
# averaging "for vanilla SGD (or with momentum), but will be false for optimizers like Adam
# which accumulate and use statistics nonlinearly (e.g. dividing by moments)"
# ([horovod#651](https://github.com/horovod/horovod/issues/651)). Adam's first step is
# lr · g / (|g| + ε), element by element: about lr · sign(g). With parameter averaging, each
# rank takes its own sign; the average of the signs is not the sign of the average gradient.
# Checked on step 1, against that formula:

# %%
def first_gradients():
    """Each rank's gradient at step 0, on the initial weights (one process, shard by shard)."""
    grads = []
    for rank in range(WORLD_SIZE):
        torch.manual_seed(SEED)
        model = make_model()
        x, y = (t[rank::WORLD_SIZE] for t in global_batch(0))
        F.mse_loss(model(x), y).backward()
        grads.append(flat(p.grad for p in model.parameters()))
    return torch.stack(grads), flat(model.parameters())


g, theta0 = first_gradients()
adam = OPTIMIZERS["Adam"]([nn.Parameter(torch.zeros(1))])  # a throwaway, to read its defaults
lr, eps = adam.defaults["lr"], adam.defaults["eps"]
one_step = gst.launch(train_local, WORLD_SIZE, (OPTIMIZERS["Adam"], average_parameters, 1))[0]
own_signs = theta0 - lr * (g / (g.abs() + eps)).mean(0)  # each rank's step, then the mean
mean_gradient = g.mean(0)
sign_of_mean = theta0 - lr * mean_gradient / (mean_gradient.abs() + eps)
print(f"Adam, step 1: parameter averaging vs mean of the ranks' own steps "
      f"{distance(one_step['params'], own_signs):.2g}; vs gradient averaging's step "
      f"{distance(one_step['params'], sign_of_mean):.2g}")
assert distance(one_step["params"], own_signs) <= 1e-15
assert distance(one_step["params"], sign_of_mean) > 0.5 * lr
assert (torch.sign(g) != torch.sign(g[0])).any(0).sum() > 0  # the ranks disagree on signs

# %% [markdown]
# So each rank's optimizer state is its own, and for Adam it changes the step itself. After 16
# steps the gap is section 1's figure for Adam. To average parameters with Adam, measure that
# gap against gradient averaging first.
#
# ## 2. Every K steps: the replicas drift between averages
#
# Between two averages, each rank follows its own shard's gradients from its own weights. The
# distance from gradient averaging, the loss on the union batches, and the number of averaging
# rounds (each is one `all_reduce` per parameter tensor):

# %%
drift = {(name, k): distance(runs[name, k]["params"], runs[name, "gradients"]["params"])
         for name in OPTIMIZERS for k in EVERY}
print(f"{'optimizer':18} {'K':>2} {'rounds':>6} {'distance':>9} {'loss':>8} "
      f"(gradient averaging's loss)")
for name in OPTIMIZERS:
    base = full_loss(runs[name, "gradients"]["params"])
    for k in EVERY:
        print(f"{name:18} {k:>2} {STEPS // k:>6} {drift[name, k]:>9.3g} "
              f"{full_loss(runs[name, k]['params']):>8.4f} ({base:.4f})")

# %%
for name in ("SGD", "SGD, momentum 0.9"):
    assert all(drift[name, k] > 1e-4 for k in EVERY[1:])  # K > 1: not the same training
    assert drift[name, 8] > drift[name, 2]  # rarer averages, farther apart
assert all(drift["SGD, momentum 0.9", k] > drift["SGD", k] for k in EVERY[1:])
assert drift["Adam", 1] > 0.5 * max(drift["Adam", k] for k in EVERY)  # there at K = 1
momentum_losses = [full_loss(runs["SGD, momentum 0.9", k]["params"]) for k in EVERY[1:]]
assert max(momentum_losses) < full_loss(runs["SGD, momentum 0.9", "gradients"]["params"])

# %% [markdown]
# PyTorch ships local SGD's averager: `PeriodicModelAverager` in
# `torch.distributed.algorithms.model_averaging.averagers`. Its first average comes after
# `warmup_steps`, so `warmup_steps = K - 1` gives `every(K)`'s schedule. It flattens the
# parameters into one tensor and divides before the sum; the result is the same:

# %%
same_as_torch = distance(runs["PeriodicModelAverager"]["params"],
                         runs["SGD, momentum 0.9", 4]["params"])
print(f"SGD with momentum, K = 4: PeriodicModelAverager vs every(4) {same_as_torch:.2g}")
assert same_as_torch <= 1e-14

# %% [markdown]
# Momentum drifts farther than plain SGD at every K > 1: each rank's buffer carries its own
# shard's direction into the next local steps. This is the RFC's "divergence of optimizer
# states". Adam's gap is there at K = 1 already: it comes from the per-rank scale, not from the
# interval. The loss does not tell which run is right; here momentum's local runs even end
# lower. They are another training, and the distance measures how far. The distance grows with K
# overall (K = 8 against K = 2 is asserted), not at every step of K: one run's snapshot can dip.
# The averaging rounds fall as 16 / K: that saving is what the drift buys.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for name in OPTIMIZERS:
    ax.plot(EVERY[1:], [drift[name, k] for k in EVERY[1:]], "o-", label=name)
ax.set(xscale="log", yscale="log", xticks=EVERY[1:], xticklabels=EVERY[1:],
       xlabel="K: average the parameters every K steps",
       ylabel="max |θ - θ_gradient averaging|",
       title=f"Local SGD vs gradient averaging, {WORLD_SIZE} ranks, {STEPS} steps")
ax.minorticks_off()
ax.grid(alpha=0.3)
ax.legend()
plt.show()

# %% [markdown]
# ## 3. DiLoCo: an outer optimizer on the average
#
# DiLoCo runs H inner steps on every replica (AdamW), as local SGD does. Then each replica
# computes its **pseudo-gradient**, the weights at the round's start minus its weights now. The
# average pseudo-gradient goes to an **outer optimizer**, which steps the global weights;
# every replica starts the next round from them. torchft's DiLoCo example uses an inner
# `AdamW(lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))` and an outer
# `SGD(lr=0.7, momentum=0.9, nesterov=True)`
# ([torchft#76](https://github.com/meta-pytorch/torchft/pull/76)).

# %%
INNER = partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1)


def outer_step(model, global_params, outer_optimizer, sign=1):
    """Average the pseudo-gradients, step the global weights, copy them into the model."""
    for g, p in zip(global_params, model.parameters(), strict=True):
        pseudo = g.detach() - p.detach()  # before - after: the direction an SGD step goes
        dist.all_reduce(pseudo)
        g.grad = sign * pseudo / dist.get_world_size()
    outer_optimizer.step()
    with torch.no_grad():
        for g, p in zip(global_params, model.parameters(), strict=True):
            p.copy_(g)  # the next round starts from the global weights


def train_diloco(rank, world_size, make_outer, sign=1, steps=DILOCO_STEPS, every=H):
    torch.manual_seed(SEED)  # the same initial weights on every rank
    device = gst.local_device()
    model = make_model().to(device)
    optimizer = INNER(model.parameters())
    global_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    outer_optimizer = make_outer(global_params)
    losses = [full_loss(flat(model.parameters()), steps)]
    for step in range(steps):
        x, y = (t[rank::world_size].to(device) for t in global_batch(step))  # this rank's shard
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if (step + 1) % every == 0:
            outer_step(model, global_params, outer_optimizer, sign)
            losses.append(full_loss(flat(model.parameters()), steps))
    return {"params": flat(model.parameters()), "losses": losses}


changes = gst.notebooks.show_diff(train_local, train_diloco, names=("train_local", "train_diloco"))

# %% [markdown]
# The diff is the outer optimizer: its copy of the weights, and `outer_step` every H steps in
# place of `average(model)`. Four runs, against local SGD with the same AdamW averaged every H:

# %%
OUTER = {
    "outer SGD, lr 1": partial(torch.optim.SGD, lr=1.0),
    "outer Nesterov, lr 0.7, momentum 0.9": partial(torch.optim.SGD, lr=0.7, momentum=0.9,
                                                    nesterov=True),
}


def diloco_runs(rank, world_size):
    runs = {"local SGD": train_local(rank, world_size, INNER, every(H), DILOCO_STEPS)}
    for name, make_outer in OUTER.items():
        runs[name] = train_diloco(rank, world_size, make_outer)
        runs[name + ", wrong sign"] = train_diloco(rank, world_size, make_outer, sign=-1)
    return runs


diloco = gst.launch(diloco_runs, WORLD_SIZE)[0]
local = diloco["local SGD"]["params"]
for name, run in diloco.items():
    print(f"{name:44} distance to local SGD {distance(run['params'], local):.3g}; "
          f"loss {run.get('losses', [full_loss(run['params'], DILOCO_STEPS)])[-1]:.4f}")

# %%
assert distance(diloco["outer SGD, lr 1"]["params"], local) <= 1e-14
nesterov = distance(diloco["outer Nesterov, lr 0.7, momentum 0.9"]["params"], local)
assert nesterov > 1e-2

# %% [markdown]
# With an outer SGD of learning rate 1 and no momentum, the outer step is
# θ − 1·(θ − mean θ_r) = mean θ_r: the average itself, so DiLoCo *is* local SGD. The usual
# Nesterov outer step goes elsewhere, by the distance printed above. It is a different
# optimizer, not a rounding of the same one.
#
# **The sign.** torchft fixed "the sign of the pseudogradient" in 2025
# ([torchft#233](https://github.com/meta-pytorch/torchft/pull/233)). The pseudo-gradient is
# the direction the weights must move *against*, as a gradient: before − after. With the other
# sign, after − before, the outer step undoes the replicas' progress. The loss at every round:

# %%
fig = gst.plots.plot_loss_curves(
    {name: run["losses"] for name, run in diloco.items() if "losses" in run},
    title=f"DiLoCo, {WORLD_SIZE} replicas, H = {H}: the loss after each outer step",
    xlabel="outer step", ylabel="loss on the union batches")
fig.axes[0].set_yscale("log")

# %%
start = diloco["outer SGD, lr 1"]["losses"][0]
for name in OUTER:
    right, wrong = diloco[name]["losses"][-1], diloco[name + ", wrong sign"]["losses"][-1]
    print(f"{name:38}: loss {start:.4f} -> {right:.4f}; wrong sign -> {wrong:.4f}")
    assert right < 0.8 * start and wrong > start  # the wrong sign trains backwards

# %% [markdown]
# ## 4. Replicas that come and go: divide by who took part
#
# A fault-tolerant trainer keeps going when a replica fails. A replica that rejoins is
# **healing**: it loads the weights from a peer and sends nothing useful this step. torchft's
# `Manager.allreduce` handles it in three moves: `if not self.is_participating():
# tensor.zero_()`, a `ReduceOp.SUM` all-reduce, then `tensor /= self.num_participants()`
# ([torchft/manager.py](https://github.com/meta-pytorch/torchft/blob/c71bbbcc41c9eb56dc78246bc0851027763d8a7b/torchft/manager.py), at the commit quoted).
# The same three moves here, the count of participants all-reduced too:

# %%
def average_over_participants(tensors, participating, divide_by_world_size=False):
    """Average `tensors` over the ranks that take part; a healing rank sends zeros."""
    count = torch.tensor([float(participating)], device=tensors[0].device)
    dist.all_reduce(count)  # how many replicas take part in this step
    for t in tensors:
        if not participating:
            t.zero_()  # it still calls the collective: every rank must
        dist.all_reduce(t)
        t /= dist.get_world_size() if divide_by_world_size else count


def one_step_gradients(rank, world_size, divide_by_world_size):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = make_model().to(device)
    x, y = (t[rank::world_size].to(device) for t in global_batch(0))
    F.mse_loss(model(x), y).backward()
    participating = rank != world_size - 1  # the last replica is healing this step
    grads = [p.grad for p in model.parameters()]
    average_over_participants(grads, participating, divide_by_world_size)
    weights = [p.detach().clone() for p in model.parameters()]  # local SGD's average instead
    average_over_participants(weights, participating, divide_by_world_size)
    return {"grads": flat(grads), "weights": flat(weights)}


out = {flag: gst.launch(one_step_gradients, WORLD_SIZE, (flag,)) for flag in (False, True)}

# %% [markdown]
# The reference: one process on the participants' data only, the shards of ranks 0 to N − 2.

# %%
torch.manual_seed(SEED)
model = make_model()
x, y = global_batch(0)
taking_part = torch.cat([torch.arange(len(x))[r::WORLD_SIZE] for r in range(WORLD_SIZE - 1)])
F.mse_loss(model(x[taking_part]), y[taking_part]).backward()
reference = flat(p.grad for p in model.parameters())
right, by_world = out[False][0]["grads"], out[True][0]["grads"]
ratio = (by_world.norm() / reference.norm()).item()
print(f"{WORLD_SIZE - 1} of {WORLD_SIZE} replicas: divided by the participants, vs one process "
      f"on their data {distance(right, reference):.2g}; divided by the world size: "
      f"{ratio:.4f} x the right gradient")
assert distance(right, reference) <= 1e-15
assert all(torch.equal(r["grads"], right) for r in out[False])  # the healing one receives it
assert torch.allclose(by_world, reference * (WORLD_SIZE - 1) / WORLD_SIZE, rtol=1e-13, atol=0)
assert abs(ratio - (WORLD_SIZE - 1) / WORLD_SIZE) <= 1e-13

# %% [markdown]
# Dividing by the world size scales the step by (N − 1) / N while a replica heals: a learning
# rate that jumps whenever one leaves. Averaging *parameters* that way is worse: the weights
# themselves shrink by that factor. The same worker averaged the initial weights too, equal on
# every rank:

# %%
torch.manual_seed(SEED)
theta0 = flat(make_model().parameters())  # the initial weights, as every rank builds them
kept, shrunk = out[False][0]["weights"], out[True][0]["weights"]
print(f"weights averaged over the participants vs the weights: {distance(kept, theta0):.2g}; "
      f"over the world size: {(shrunk.norm() / theta0.norm()).item():.4f} x the weights")
assert distance(kept, theta0) <= 1e-15
assert torch.allclose(shrunk, theta0 * (WORLD_SIZE - 1) / WORLD_SIZE, rtol=1e-13, atol=0)

# %% [markdown]
# The batch changes with the participants too: torchft#292 notes that "When the replica group
# world size changes, the total batch size used for gradient aggregation will change"
# ([torchft#292](https://github.com/meta-pytorch/torchft/pull/292)). Divide by the samples that
# took part, and the step is one process's on them, as checked above.
#
# ## Copy this into your code
#
# `snippets/13_diloco_outer_step.py` is a whole script, run by the course's tests with
# `torchrun --standalone --nproc-per-node 2`. It runs two DiLoCo rounds with AdamW inside and
# Nesterov outside; in the second, the last rank is healing. It checks, on every rank, the
# averaged pseudo-gradient against the replicas' weights gathered from every rank.
#
# <!-- snippets/13_diloco_outer_step.py -->
# ```python
# """Notebook 13, copy this into your code: DiLoCo's outer step, its pseudo-gradient averaged over
# the replicas that take part (a healing replica sends zeros).
#
#     torchrun --standalone --nproc-per-node 2 snippets/13_diloco_outer_step.py
# """
#
# import os
# import warnings
#
# import torch
# import torch.distributed as dist
#
# # before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
# import torch.distributed.nn  # noqa: F401
# import torch.nn.functional as F
# from torch import nn
#
# INNER_STEPS = 4  # H: inner steps per round
#
#
# def init_distributed():
#     """Join the group torchrun prepared (RANK, WORLD_SIZE, MASTER_ADDR...); return the device.
#
#     With a GPU for every rank on this machine: nccl, this rank on GPU LOCAL_RANK. Otherwise
#     gloo, on the CPU (a laptop; also 2 ranks on 1 GPU, which nccl cannot share): with a
#     warning that gives both numbers when CUDA is there but has fewer GPUs than ranks.
#     """
#     local_rank, ranks_here = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
#     gpus = torch.cuda.device_count()
#     if gpus >= ranks_here:
#         device = torch.device("cuda", local_rank)
#         torch.cuda.set_device(device)          # before init: nccl and *_object calls use it
#         dist.init_process_group("nccl", device_id=device)  # barrier() too
#         return device
#     if gpus:                                   # CUDA, but not a GPU per rank: never silently
#         warnings.warn(f"{gpus} GPU(s) visible for {ranks_here} ranks on this machine: this "
#                       "job trains on the CPU with gloo. For nccl, start one rank per GPU "
#                       f"(--nproc-per-node {gpus}) or check CUDA_VISIBLE_DEVICES.", stacklevel=2)
#     dist.init_process_group("gloo")
#     return torch.device("cpu")
#
#
# def average_pseudo_gradient(model, start, participating):
#     """(start - weights now), averaged over the replicas that take part: the same list on every
#     rank. A healing replica (participating=False) sends zeros and receives the average."""
#     count = torch.tensor([float(participating)], dtype=start[0].dtype, device=start[0].device)
#     dist.all_reduce(count)                     # how many replicas take part in this round
#     if count.item() == 0:
#         raise RuntimeError("no replica takes part in this round: skip the outer step")
#     averaged = []
#     for s, p in zip(start, model.parameters(), strict=True):
#         pseudo = s - p.detach() if participating else torch.zeros_like(s)  # before - after
#         dist.all_reduce(pseudo)                # SUM over the replicas
#         averaged.append(pseudo / count)        # / the participants, not / the world size
#     return averaged
#
#
# def outer_step(model, global_params, outer_optimizer, pseudo_gradients):
#     """The outer optimizer steps the global weights; every replica starts the next round there."""
#     for g, d in zip(global_params, pseudo_gradients, strict=True):
#         g.grad = d
#     outer_optimizer.step()
#     outer_optimizer.zero_grad()
#     with torch.no_grad():
#         for g, p in zip(global_params, model.parameters(), strict=True):
#             p.copy_(g)
#
#
# def flat(tensors):
#     return torch.cat([t.detach().flatten() for t in tensors])
#
#
# def main():
#     device = init_distributed()
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     torch.manual_seed(0)                       # the same initial weights on every replica
#     model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
#     inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
#     global_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
#     outer = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
#     data = torch.Generator().manual_seed(1 + rank)  # each replica trains on its own data
#
#     for round_ in range(2):
#         healing = world_size - 1 if round_ == 1 and world_size > 1 else None  # round 2: one out
#         for _ in range(INNER_STEPS):
#             x = torch.randn(32, 8, generator=data).to(device)
#             inner.zero_grad()
#             F.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
#             inner.step()
#         start = [g.detach() for g in global_params]  # the weights this round started from
#         pseudo = average_pseudo_gradient(model, start, participating=rank != healing)
#
#         # Check: the participants' mean of (start - weights), from every replica's weights.
#         everyone = [torch.empty_like(flat(model.parameters())) for _ in range(world_size)]
#         dist.all_gather(everyone, flat(model.parameters()))
#         taking_part = torch.stack([w for r, w in enumerate(everyone) if r != healing])
#         torch.testing.assert_close(flat(pseudo), flat(start) - taking_part.mean(0))
#         outer_step(model, global_params, outer, pseudo)
#
#     mine = flat(model.parameters())
#     everyone = [torch.empty_like(mine) for _ in range(world_size)]
#     dist.all_gather(everyone, mine)
#     assert all(torch.equal(w, mine) for w in everyone)  # the replicas start round 3 equal
#     print(f"rank {rank}: pseudo-gradient == mean over the participants of (start - weights), "
#           f"a healing replica out; replicas equal after the outer step, on {device} "
#           f"({dist.get_backend()})")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# ## Exercise
#
# Write `average_pseudo_gradient(model, start, participating)`. `model` is this replica's model
# after its inner steps; `start` is the list of the global weights at the round's start, one
# tensor per parameter; `participating` is False on a healing replica. Return, on every rank,
# the list of pseudo-gradients (start − weights now) averaged over the replicas that took part.
# A healing replica sends zeros, and still receives the average. Leave `model` and `start`
# unchanged.
#
# The check runs it at two world sizes, three rounds each: everyone takes part, then rank 1
# is healing, then rank 0 and the last rank. It compares with the participants' mean, computed from every rank's weights. It
# says so if you divided by the world size, flipped the sign, or let the healing replica send
# its weights. Stuck? `%load solutions/13_average_pseudo_gradient.py` in a new cell.

# %%
def average_pseudo_gradient(model, start, participating):
    # your code here: count the participants with one all_reduce, (start - weights) or zeros,
    # all_reduce each, divide by the participants
    raise NotImplementedError("write average_pseudo_gradient")


# %%
gst.exercises.check_average_pseudo_gradient(average_pseudo_gradient)

# %% [markdown]
# ## Summary
#
# | what is averaged | equals gradient averaging? | measured above |
# |---|---|---|
# | parameters every step, SGD or SGD + momentum | yes, to float64 rounding | section 1 |
# | parameters every step, Adam | no: each rank's scale is its own | section 1 |
# | parameters every K > 1 steps | no: the replicas drift | section 2 |
# | DiLoCo, outer SGD lr 1 | = local SGD exactly | section 3 |
# | DiLoCo, outer Nesterov | another optimizer | section 3 |
# | a replica healing, ÷ participants | = one process on their data | section 4 |
# | a replica healing, ÷ world size | × (N − 1) / N | section 4 |
#
# Check a parameter-averaging setup the way this notebook does: against gradient averaging on
# the same data, in float64, and against one process on the data that took part.
