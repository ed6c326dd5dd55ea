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
# This is the classic code from PyTorch's "Writing Distributed Applications" tutorial. Two processes
# each build their own `model = Net()`, and the function seems to touch only the local model's
# gradients. A popular answer says to drop the division. Who is right?
#
# **Short answer:** keep the code, and start every rank from the same weights. Use the same
# `torch.manual_seed` before `Net()` on every rank, or broadcast rank 0's weights; DDP does the
# broadcast for you (notebook 03). To vary dropout across ranks, reseed with `seed + rank` after
# building the model.
#
# `all_reduce` is a *collective* (see the [glossary](../README.md#glossary)). Every rank calls it
# with its own tensor, and every rank receives the sum of all of them, in place. Dividing by the
# number of ranks turns the sum into the mean. So every replica takes the same step and, having
# started equal, stays equal. Dropping the division multiplies SGD's learning rate by the number of
# ranks. Adam hides it, except for gradient clipping and Adam's own `weight_decay`. The rest of this
# notebook measures each of these sentences.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # set it to 1 for a short run (the tests do)
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5  # the classic example's SGD settings
EPOCHS = 1 if SMOKE_TEST else 2
# The images each epoch trains on. Every comparison below is an identity (equal replicas, the
# same parameters as one process), which a few thousand images prove as well as all 60,000.
N_TRAIN = 4096 if SMOKE_TEST else 12_288

import inspect
import math
import warnings
from functools import partial

import matplotlib.pyplot as plt
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
# Each rank (process) holds a full **replica** of the model. It computes gradients on its own slice
# of the batch. `dist.all_reduce(t, op=SUM)` is called by *every* rank with *its own* `t`. When it
# returns, each rank's `t` holds the element-wise sum over all ranks. So after the loop every
# replica holds the same, averaged gradient. Every optimizer takes the same step, and the replicas
# stay identical. Nothing is "only local": the call is the communication.
#
# The rest of the course uses today's spelling. `dist.ReduceOp.SUM` replaces `reduce_op`, its
# deprecated old name. There is no `.data`, since the gradient is not part of any autograd graph.
# The world size is an integer, and parameters without a gradient are skipped. (One call can also
# average: `op=dist.ReduceOp.AVG`, on nccl and gloo. It is checked in the section on 3 ranks.)

# %%
def average_gradients(model):
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:  # took no part in the loss; safe only if every rank skips
            continue            # the same ones (notebook 03's unused-parameter pitfall)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
        param.grad /= world_size  # sum / N = mean over ranks


# %% [markdown]
# First, the collective itself. Each rank starts with a different tensor and all end with the sum.

# %%
def show_all_reduce(rank, world_size):
    t = torch.tensor([10.0 * (rank + 1), 1.0], device=gst.local_device())  # nccl: on the GPU
    before = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # in place: t is overwritten with the sum
    print(f"before {before.tolist()} -> after {t.tolist()}")
    return t

sums = gst.launch(show_all_reduce, world_size=WORLD_SIZE)

# %% tags=["nbval-check-output"]
expected = torch.tensor([10.0 * sum(range(1, WORLD_SIZE + 1)), WORLD_SIZE])
assert all(torch.equal(s, expected) for s in sums)
print("every rank received", expected.tolist())

# %% [markdown]
# ## Your question, on the real model
#
# Each rank builds its own `Net()`, computes the gradient of *its* slice of a batch, then calls
# `average_gradients`. Here is `fc2.bias.grad` (the first 4 of its 10 values) on every rank, right
# after `backward()` and right after `average_gradients`. The ranks hold no shared memory: the
# gradients move only through `all_reduce`. Dropout is off (`eval()`), so nothing random differs.

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
# Checked for every parameter, not only `fc2.bias`. After `backward()` the ranks' gradients differ,
# since each rank saw other samples. After `average_gradients` they are identical on every rank, bit
# for bit. They equal the mean of the gradients before. And that mean equals the gradient one
# process computes on the whole batch of 256, up to float rounding. With nccl, too, every rank should
# get the same bits: NCCL computes the sum once and sends it to every rank unchanged. Its maintainer
# says so in [NVIDIA/nccl#855](https://github.com/NVIDIA/nccl/issues/855). No GPU has run it here.

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
# ### The question's code, as written
#
# The code in the question, character for character, with its deprecated `dist.reduce_op`, its
# `.data` and its float world size, on the same batch:

# %%
def average_gradients_as_asked(model):  # the question's code, verbatim
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.reduce_op.SUM)
        param.grad.data /= size


def probe_as_asked(rank, world_size, batch):
    with warnings.catch_warnings(record=True) as caught:  # what it warns about, once
        warnings.simplefilter("always")
        result = gradient_probe(rank, world_size, batch, average=average_gradients_as_asked)
    result["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return result


as_asked = gst.launch(probe_as_asked, world_size=WORLD_SIZE, args=(batch,))

# %%
for warning in as_asked[0]["warnings"]:
    print(warning)
same_bits = all(torch.equal(a["after"][k], m["after"][k])
                for a, m in zip(as_asked, probe, strict=True) for k in m["after"])
gap = max(gst.checks.compare_state_dicts(a["after"], m["after"], show=False)
          for a, m in zip(as_asked, probe, strict=True))
print(f"as asked vs today's spelling, every parameter on every rank: max |difference| {gap}, "
      f"{'equal bit for bit' if same_bits else 'NOT equal'}")
assert same_bits and gap == 0.0
assert any("reduce_op" in w and "deprecated" in w for w in as_asked[0]["warnings"])

# %% [markdown]
# The question's code gives today's spelling's gradients bit for bit. Its one complaint is the
# `FutureWarning` above: `torch.distributed.reduce_op` `is deprecated, please use`
# `torch.distributed.ReduceOp` instead. Dividing by `2.0` or by `2` is the same operation. `.data`
# changes nothing here, since no gradient is part of a graph. The modern spelling is a matter of
# style and of future versions, not of correctness.
#
# **The precondition: the replicas start identical.** Averaging makes the *gradients* equal; the
# *weights* stay equal only if they start equal. Above, every rank seeded the same generator before
# `Net()`, so the initial weights agree. A common slip is to seed each rank differently, with the
# rank. The replicas then differ from the start. They go on differing, since each applies the same
# averaged step to other weights (notebook 04 measures it). Notebook 03 shows the usual cure: DDP,
# or a `dist.broadcast` from rank 0, copies rank 0's weights to every rank.

# %%
same_start = gst.checks.compare_ranks([p["weights"] for p in probe], show=False)
other_seeds = [
    gst.launch(partial(gradient_probe, seed=SEED + rank), world_size=1, args=(batch,))[0]
    for rank in range(WORLD_SIZE)  # what each rank would build, seeded SEED + rank
]
seeded_apart = gst.checks.compare_ranks([p["weights"] for p in other_seeds], show=False)
print(f"initial weights, max difference between ranks: same seed {same_start:.2g}, "
      f"seed + rank {seeded_apart:.2g}")
assert same_start == 0.0 and seeded_apart > 0.1


# %% [markdown]
# ## Training on N ranks
#
# The whole training loop, as each rank runs it. Here is what changed since notebook 01's `train`,
# read from both notebooks. The signature takes the rank and the world size. Each rank takes its
# **shard**: every N-th index of the shared, seeded data order, in batches of 256/N. And
# `average(model)`, by default `average_gradients`, runs between `backward()` and `step()`.

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
train_01 = gst.notebooks.load_function("01_single_device_baseline", "train",
                                       settings={"N_TRAIN": N_TRAIN})  # on this notebook's images
changes = gst.notebooks.show_diff(train_01, train, names=("01: train", "02: train"))
assert changes == 5

# %% [markdown]
# With `world_size=1` the shard is the whole order and the batch is 256. An `all_reduce` over one
# rank changes nothing: it is notebook 01's loop. The check runs both, with notebook 01's `train`
# read from notebook 01, and compares them to the last bit. On a GPU this needs deterministic
# kernels. The first cell asks cuDNN for them, but torch 2.14's `use_deterministic_algorithms`
# documentation lists `NLLLoss` on CUDA as nondeterministic. No GPU has run this check yet:

# %%
baseline = train_01(EPOCHS)  # notebook 01's loop, in this process
one_rank = gst.launch(train, world_size=1, args=(EPOCHS,))[0]
results = gst.launch(train, world_size=WORLD_SIZE, args=(EPOCHS,))

# %%
same_as_01 = gst.checks.compare_state_dicts(one_rank["state"], baseline["state"], show=False)
print(f"02's train on 1 rank vs 01's train, after {EPOCHS} epochs: max |difference| = "
      f"{same_as_01:.2g}, identical losses: {one_rank['losses'] == baseline['losses']}")
assert same_as_01 == 0.0 and one_rank["losses"] == baseline["losses"]
# the doc cited: the operations with no deterministic CUDA kernel, listed after this heading
no_deterministic_kernel = torch.use_deterministic_algorithms.__doc__.partition(
    "normally-nondeterministic operations will throw")[2]
assert "torch.nn.NLLLoss` when called on a CUDA tensor" in no_deterministic_kernel

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
# One step matched above. Does the whole run? Two things differ between an N-rank run and the single
# process, and neither is the averaging:
#
# * **Dropout.** Every rank seeds the same generator, so rank 1 draws the same masks for its 128
#   samples as rank 0 for its own. One process draws 256 different masks, so the runs train
#   different sub-networks. `dropout=False` turns dropout off. This notebook keeps one seed for the
#   equalities. The scripts and the snippets whose model has dropout, 02's below included, seed
#   `SEED + rank` after building the model, so that each rank draws its own masks.
# * **Rounding.** Float addition is not associative. A batch of 256 is summed in another order than
#   two of 128; the step above showed that difference after one step. Training carries such
#   differences into every later step. `dtype=torch.float64` makes each rounding error 2^29 (about 5
#   × 10^8) times smaller. That is the ratio of float32's machine epsilon to float64's, printed
#   below.
#
# Both switches on, the whole run (`EPOCHS` epochs) on 2 and on 4 ranks is compared with notebook
# 01's loop on one process. For comparison, the same run in float32 on 2 ranks:

# %%
exact = dict(dropout=False, dtype=torch.float64)
single = train_01(EPOCHS, **exact)
ranks = {n: gst.launch(partial(train, **exact), world_size=n, args=(EPOCHS,)) for n in (2, 4)}
float32_single = train_01(EPOCHS, dropout=False)
float32_ranks = gst.launch(partial(train, dropout=False), world_size=2, args=(EPOCHS,))

# %%
eps_ratio = torch.finfo(torch.float32).eps / torch.finfo(torch.float64).eps
print(f"float32's machine epsilon / float64's = {eps_ratio:,.0f} = 2^{math.log2(eps_ratio):.0f}")
assert eps_ratio == 2**29
for n, runs in ranks.items():
    gap = gst.checks.compare_state_dicts(runs[0]["state"], single["state"], show=False)
    print(f"float64, {n} ranks vs 1 process, after {len(single['losses'])} steps: "
          f"max |difference of parameters| = {gap:.2g}")
    assert gap <= 1e-14  # a few units of float64's last bit

# %% [markdown]
# The mean of the ranks' losses is the single process's loss at every step. (Each rank's loss is the
# mean over an equal share of the batch.) On the left, the float64 curves coincide. On the right,
# how far apart they are, step by step, in float64 and in float32. A difference of exactly 0 is
# drawn at 1e-18, on the grey line along the bottom:

# %%
def mean_over_ranks(runs):
    return [sum(s) / len(runs) for s in zip(*(r["losses"] for r in runs), strict=True)]

def loss_gaps(runs, one):
    return [abs(a - b) for a, b in zip(mean_over_ranks(runs), one["losses"], strict=True)]

gaps = {"float64, 2 ranks": loss_gaps(ranks[2], single),
        "float64, 4 ranks": loss_gaps(ranks[4], single),
        "float32, 2 ranks": loss_gaps(float32_ranks, float32_single)}

# %% tags=["image:ranks_equal_one_process.png"]
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
gst.plots.plot_loss_curves(
    {f"mean over {n} ranks": mean_over_ranks(runs) for n, runs in ranks.items()},
    baseline={"1 process": single["losses"]}, ax=left,
    title="Dropout off, float64: the curves coincide",
)
for (label, gap), marker in zip(gaps.items(), ["o", "x", "."], strict=True):
    right.semilogy([max(g, 1e-18) for g in gap], marker, linestyle="none", label=label)
right.axhline(1e-18, color="grey", linewidth=0.8, label="exactly 0 (drawn at 1e-18)")
right.set(xlabel="step", ylabel="|mean over ranks - 1 process|",
          title="How far from one process, step by step")
right.legend()
plt.show()

# %%
loss_gap = max(max(gaps["float64, 2 ranks"]), max(gaps["float64, 4 ranks"]))
print(f"float64: max |mean over ranks - 1 process| over every step: {loss_gap:.2g}; "
      f"float32: {max(gaps['float32, 2 ranks']):.2g}")
assert loss_gap <= 1e-9 < max(gaps["float32, 2 ranks"])

# %% [markdown]
# What each switch hides, measured on 2 ranks against one process over the same `EPOCHS` epochs.
# First float32 without dropout (above), then the lesson's runs, float32 with dropout:

# %%
rounding = gst.checks.compare_state_dicts(float32_ranks[0]["state"], float32_single["state"],
                                          show=False)
with_dropout = gst.checks.compare_state_dicts(results[0]["state"], baseline["state"], show=False)
print(f"after {len(baseline['losses'])} steps, max |2 ranks - 1 process| of the parameters:")
print(f"  float32, dropout off: {rounding:.2g} (float rounding)")
print(f"  float32, dropout on:  {with_dropout:.2g} (other masks)")
assert 0 < rounding < with_dropout

# %% [markdown]
# So with averaged gradients, N ranks train the same model as one process with the whole batch. In
# float64 they agree to about 1e-16 over the whole run, for 2 and 4 ranks: a few units of the last
# bit. In float32 the runs drift apart, as any two runs that add numbers in another order do.

# %% [markdown]
# ## The popular answer: all_reduce without dividing
#
# Without the division every rank holds the **sum** of the gradients, N times the mean. For plain
# SGD (momentum included) that is the correct average with the learning rate multiplied by N. Run
# both, one epoch on the same ranks:

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
assert diff == 0.0  # exact, because N is a power of two (the section on 3 ranks shows why)

# %% [markdown]
# The difference is exactly 0 because dividing by 2 (or 4) is exact in binary floats, and so is
# multiplying `lr` by it. With 3 ranks it is not 0 (see the section on 3 ranks, below). In the plot,
# the no-division curve (dashed) lies exactly on the curve of averaging at `lr × N`.
# That run learns faster than the lesson's only because `lr=0.01` is small for this model. A bigger
# learning rate helps, for now. The next section shows what the bug does to a learning rate that is
# already good.

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
# You choose a learning rate for your setup. The bug multiplies it by however many GPUs the job
# gets. Take a learning rate that works better than the lesson's on one process, then move to 8 GPUs
# without the division.
#
# No 8 ranks are needed to see it. On N equal shards, the sum of the ranks' mean gradients is N
# times the whole batch's mean gradient. So one process that multiplies its gradient by 8 takes the
# step of 8 ranks without the division. First that emulation, checked against a real `all_reduce`
# sum on 4 ranks (one step):

# %%
def times(n):  # what the popular answer computes on n ranks, emulated in one process
    def scale(model):
        for param in model.parameters():
            param.grad *= n
    return scale

summed = gst.launch(partial(gradient_probe, average=sum_gradients), world_size=4, args=(batch,))[0]
emulated = gst.launch(partial(gradient_probe, average=times(4)), world_size=1, args=(batch,))[0]
gap = gst.checks.compare_state_dicts(summed["after"], emulated["after"], show=False)
print(f"all_reduce SUM on 4 ranks vs gradient x 4 in one process: max |difference| {gap:.2g}")
assert gap <= 1e-6

# %% [markdown]
# Now train the first `STEPS` steps with `lr=0.1`, ten times the lesson's. First on one process,
# then with the popular answer on 8 ranks, emulated. With the division, 8 ranks take the one-process
# steps, up to rounding and dropout.

# %%
STEPS = 50  # optimizer steps (12,800 samples), in the short run too
SHORT = 20  # steps, for the comparisons below: runs that are equal stay equal at every step

def first_steps(rank, world_size, steps, optimizer, average=average_gradients, max_norm=None,
                clip=torch.nn.utils.clip_grad_norm_):
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
            norms.append(clip(model.parameters(), max_norm).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict(), "norms": norms}

sgd = lambda lr, **kw: partial(torch.optim.SGD, lr=lr, momentum=MOMENTUM, **kw)
tail = lambda run: sum(run["losses"][-10:]) / 10  # mean loss over the last 10 steps

# %%
tuned = {
    "lr=0.01, 1 process (the lesson's)": gst.launch(first_steps, 1, (STEPS, sgd(LR)))[0],
    "lr=0.1, 1 process (~ average on 8 ranks)": gst.launch(first_steps, 1, (STEPS, sgd(0.1)))[0],
    "lr=0.1, no division on 8 ranks (emulated)":
        gst.launch(partial(first_steps, average=times(8)), 1, (STEPS, sgd(0.1)))[0],
}
fig = gst.plots.plot_loss_curves({k: r["losses"] for k, r in tuned.items()},
                                 title="lr=0.1 on one process, then without the division on 8 GPUs")
fig.axes[0].legend(loc="lower left")  # off the curves, which start high
plt.show()

# %%
for label, run in tuned.items():
    print(f"{label}: mean loss over the last 10 steps {tail(run):.3f}")
lesson, one, eight = tuned.values()
assert tail(one) < tail(lesson)  # lr=0.1 works better than the lesson's on one process
assert tail(eight) > tail(one) + 0.2  # and the popular answer on 8 GPUs slows it down

# %% [markdown]
# ### When no division is right
#
# Each rank's loss may already be divided by the **global** number of samples. That is its sum over
# its own samples, divided by 256 (notebook 04's mean-of-means pitfall). The sum over ranks is then
# already the mean, and `all_reduce` without dividing is right. Checked on one step:

# %%
global_mean = gst.launch(partial(gradient_probe, average=sum_gradients, global_mean=True),
                         world_size=WORLD_SIZE, args=(batch,))
gap = gst.checks.compare_state_dicts(global_mean[0]["after"], whole["after"], show=False)
print(f"loss summed / 256 on each rank, all_reduce without division, vs one process: "
      f"max |difference| {gap:.2g}")
assert gap <= 1e-6

# %% [markdown]
# ### Where "lr × N" is not the whole story
#
# The equivalence holds for the gradient alone. Anything the optimizer adds or measures after the
# averaging sees the difference:
#
# * **Weight decay.** `SGD(weight_decay=wd)` adds `wd * param` to the gradient inside `step()`,
#   after your averaging, so it is not multiplied by N. No division at `lr` thus equals averaging at
#   `lr × N` with `wd / N`, not with `wd`.
# * **Gradient clipping.** `clip_grad_norm_` sees a gradient norm N times larger, so it clips more.
#   No division with `max_norm` equals averaging at `lr × N` with `max_norm / N`.
#
# Measured over the first `SHORT` steps on the ranks, against the averaged run at `lr × N`:

# %%
N, WD, CLIP = WORLD_SIZE, 0.01, 0.5

def run(optimizer, world_size=WORLD_SIZE, **options):  # options: average=, max_norm=, clip=
    return gst.launch(partial(first_steps, **options), world_size, (SHORT, optimizer))[0]

decay = {"no division": run(sgd(LR, weight_decay=WD), average=sum_gradients),
         "average, wd": run(sgd(LR * N, weight_decay=WD)),
         "average, wd / N": run(sgd(LR * N, weight_decay=WD / N))}
clipped = {"no division": run(sgd(LR), average=sum_gradients, max_norm=CLIP),
           "average, max_norm": run(sgd(LR * N), max_norm=CLIP),
           "average, max_norm / N": run(sgd(LR * N), max_norm=CLIP / N)}

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
# With `max_norm / N` the runs agree closely (printed above), but not bit for bit. The suspect is in
# `clip_grad_norm_`'s own code. It scales by `max_norm / (total_norm + 1e-6)`, and that 1e-6 is not
# multiplied by N. A run without it, after the Adam section, shows it is the whole cause:

# %%
clip_code = inspect.getsource(torch.nn.utils.clip_grad)
print(next(line.strip() for line in clip_code.splitlines() if "clip_coef = max_norm" in line))
assert "max_norm / (total_norm + 1e-6)" in clip_code

# %% [markdown]
# **What to do**: keep the division. Then `lr`, `weight_decay` and `max_norm` mean the same on N
# ranks as on one process.
#
# ### Why the bug goes unnoticed with Adam, and where it does not
#
# Adam divides each update by a running estimate of the gradient's magnitude. So multiplying every
# gradient by N almost cancels. The update is $m / (\sqrt{v} + \epsilon)$. With gradients N times
# larger it becomes $N m / (N \sqrt{v} + \epsilon) = m / (\sqrt{v} + \epsilon / N)$. Only $\epsilon$
# differs: the bug equals correct averaging with $\epsilon / N$. And $\epsilon$ (1e-8) is tiny next
# to $\sqrt{v}$, so the runs barely differ. Two things common with Adam see the gradient before
# Adam's division, as in SGD:
#
# * **`clip_grad_norm_`** sees the N times larger norm. No division with `max_norm` equals averaging
#   with `max_norm / N` (and $\epsilon / N$).
# * **Adam's `weight_decay`** is an L2 term added to the gradient before the moments:
#   `grad + wd * param`. With an N times larger gradient it weighs N times less. So no division
#   equals averaging with `wd / N` (and $\epsilon / N$). `AdamW` decays the weights directly, apart
#   from the gradient, so its decay is unaffected.
#
# Measured over the first `SHORT` steps on the ranks:

# %%
def adam(eps=1e-8, **kw):
    return partial(torch.optim.Adam, lr=1e-3, eps=eps, **kw)

def adamw(eps=1e-8, **kw):
    return partial(torch.optim.AdamW, lr=1e-3, eps=eps, **kw)

adam_runs = {
    "plain": {"no division": run(adam(), average=sum_gradients), "average": run(adam()),
              "average, eps / N": run(adam(1e-8 / N))},
    "clip_grad_norm_": {
        "no division": run(adam(), average=sum_gradients, max_norm=CLIP),
        "average": run(adam(), max_norm=CLIP),
        "average, eps / N": run(adam(1e-8 / N), max_norm=CLIP),
        "average, eps / N, max_norm / N": run(adam(1e-8 / N), max_norm=CLIP / N)},
    "Adam(weight_decay)": {
        "no division": run(adam(weight_decay=WD), average=sum_gradients),
        "average": run(adam(weight_decay=WD)),
        "average, eps / N": run(adam(1e-8 / N, weight_decay=WD)),
        "average, eps / N, wd / N": run(adam(1e-8 / N, weight_decay=WD / N))},
    "AdamW(weight_decay)": {
        "no division": run(adamw(weight_decay=WD), average=sum_gradients),
        "average": run(adamw(weight_decay=WD)),
        "average, eps / N": run(adamw(1e-8 / N, weight_decay=WD))},
}
sgd_avg, sgd_sum = run(sgd(LR)), run(sgd(LR), average=sum_gradients)


# %%
def curve_gap(a, b):  # mean |loss difference|, step by step
    return sum(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) / len(a["losses"])

plain, clip = adam_runs["plain"], adam_runs["clip_grad_norm_"]
adam_curve_gap = curve_gap(plain["no division"], plain["average"])
print(f"no division vs average, mean |loss difference|: SGD "
      f"{curve_gap(sgd_avg, sgd_sum):.2g}, Adam {adam_curve_gap:.2g}")
print(f"steps that clip_grad_norm_ clipped at max_norm={CLIP}: "
      f"{sum(n > CLIP for n in clip['no division']['norms'])} of {SHORT} without the division, "
      f"{sum(n > CLIP for n in clip['average']['norms'])} with it")
print(f"Adam without the division vs averaging with...{'max |parameter difference|':>38}")
adam_gaps = {}
for case, runs in adam_runs.items():
    for name in runs:
        if name != "no division":
            adam_gaps[case, name] = vs(runs, "no division", name)
            print(f"  {case:20} {name:32} {adam_gaps[case, name]:.2g}")
assert adam_curve_gap < curve_gap(sgd_avg, sgd_sum) / 5
assert adam_gaps["plain", "average, eps / N"] == 0.0  # what remains is eps / N
assert adam_gaps["AdamW(weight_decay)", "average, eps / N"] == 0.0  # AdamW: still hidden
assert adam_gaps["Adam(weight_decay)", "average, eps / N"] > 1e-4  # Adam's L2 decay: not
assert adam_gaps["Adam(weight_decay)", "average, eps / N, wd / N"] == 0.0  # it is wd / N
assert adam_gaps["clip_grad_norm_", "average, eps / N"] > 1e-4  # clipping: not hidden
equivalent = adam_gaps["clip_grad_norm_", "average, eps / N, max_norm / N"]
assert equivalent < adam_gaps["clip_grad_norm_", "average, eps / N"] / 10  # see below

# %% [markdown]
# With clipping, the runs with `max_norm / N` come close but are not equal, for SGD and for Adam. Is
# `clip_grad_norm_`'s `1e-6` the whole cause? `clip_without_eps` is its rule without it: scale by
# `max_norm / total_norm`, capped at 1. With that clip in both runs, the differences are 0:

# %%
def clip_without_eps(parameters, max_norm):  # clip_grad_norm_'s rule, without its + 1e-6
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for grad in grads:
        grad.mul_(torch.clamp(max_norm / total_norm, max=1.0))
    return total_norm

without_eps = {
    f"SGD, lr x {N}": (run(sgd(LR), average=sum_gradients, max_norm=CLIP, clip=clip_without_eps),
                       run(sgd(LR * N), max_norm=CLIP / N, clip=clip_without_eps)),
    f"Adam, eps / {N}": (run(adam(), average=sum_gradients, max_norm=CLIP, clip=clip_without_eps),
                      run(adam(1e-8 / N), max_norm=CLIP / N, clip=clip_without_eps)),
}
for label, (no_division, with_division) in without_eps.items():
    gap = gst.checks.compare_state_dicts(no_division["state"], with_division["state"], show=False)
    print(f"clipped without the 1e-6: no division vs average ({label}, max_norm / {N}): "
          f"max |difference| {gap:.2g}")
    assert gap == 0.0

# %% [markdown]
# **If you use Adam**: keep the division too. Without it, `clip_grad_norm_(max_norm)` clips as if at
# `max_norm / N`. `Adam(weight_decay=wd)` decays as if with `wd / N`. Only the plain update, and
# `AdamW`'s decay, hide the bug.

# %% [markdown]
# ### On 3 ranks: why "difference 0" needs N = 2
#
# Several checks above print a difference of exactly 0. No division at `lr` equals averaging at
# `lr × N`, and Adam without the division equals averaging with `eps / N`. That is exact only because
# N = 2 (or 4) is a power of two. Multiplying or dividing a float by 2 changes only its exponent, so
# `sum / 2`, `lr × 2` and `eps / 2` round nothing. Dividing by 3 rounds. With 3 GPUs the same pairs
# of runs differ a little, and training carries the difference on. Over the first `SHORT` steps:

# %%
three_ranks = {
    "SGD, no division at lr vs average at lr x 3":
        (run(sgd(LR), 3, average=sum_gradients), run(sgd(LR * 3), 3)),
    "Adam, no division vs average with eps / 3":
        (run(adam(), 3, average=sum_gradients), run(adam(1e-8 / 3), 3)),
}
for label, (no_division, with_division) in three_ranks.items():
    gap = gst.checks.compare_state_dicts(no_division["state"], with_division["state"], show=False)
    print(f"3 ranks, {label}: max |difference| {gap:.2g}")
    assert 0 < gap <= 1e-4  # not 0: rounding, carried on by training

# %% [markdown]
# `dist.all_reduce(t, op=dist.ReduceOp.AVG)` averages in one call. torch 2.14's documentation of
# `ReduceOp` says that `AVG` "divides values by the world size before summing", with nccl only. Yet
# gloo runs it too. The check compares it with both orders, on 3 ranks and on `WORLD_SIZE`. On 3
# ranks the division rounds, so the two orders give different bits. The course keeps `SUM` and
# `/=`, so that the division stays in sight.

# %%
def avg_vs_sum_then_divide(rank, world_size):
    torch.manual_seed(rank)  # each rank its own values
    t = torch.randn(10_000, device=gst.local_device())
    summed, divided_first, averaged = t.clone(), t * (1 / world_size), t.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    summed /= world_size  # average_gradients' order: sum, then divide
    dist.all_reduce(divided_first, op=dist.ReduceOp.SUM)  # the other order: × 1/N, then sum
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)  # one call
    return dist.get_backend(), torch.equal(averaged, summed), torch.equal(averaged, divided_first)

assert "divides values by the world size before summing" in dist.ReduceOp.__doc__
for n in (3, WORLD_SIZE):
    (backend, as_sum_then_divide, as_divide_then_sum), *_ = gst.launch(avg_vs_sum_then_divide, n)
    print(f"{n} ranks, {backend}: ReduceOp.AVG equals SUM then / {n}: {as_sum_then_divide}; "
          f"equals × 1/{n} then SUM: {as_divide_then_sum}")
    if backend == "gloo":  # what gloo does here; nccl has not run here
        assert as_sum_then_divide and as_divide_then_sum == (n != 3)

# %% [markdown]
# So on gloo, `AVG` gives `average_gradients`' bits: it sums first, then divides. The
# documentation describes nccl's order, dividing first. nccl multiplies each rank's float32
# tensor by 1/N rounded to float32 (`f32 = float(1.0/comm->nRanks)` in its `src/enqueue.cc`), as
# DDP does, then sums. The cell emulates that order. When N is not a power of two, the last bits
# may differ from `average_gradients`' (no GPU has run it here).

# %% [markdown]
# ## Copy this into your code
#
# `snippets/02_average_gradients.py` is a whole script, run by the course's tests with
# `torchrun --standalone --nproc-per-node 2`. Copy `average_gradients` and the three lines that call
# it. The rest checks, on every rank, that the averaged gradient is the one of the whole batch.
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
# def main():
#     device = init_distributed()
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     torch.manual_seed(0)                       # the same initial weights on every rank
#     model = nn.Linear(20, 3).to(device)
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
#     x, y = torch.randn(64, 20).to(device), torch.randint(0, 3, (64,)).to(device)  # one batch...
#     shard = slice(rank, None, world_size)      # ...a different shard of it on each rank
#     whole = copy.deepcopy(model)               # for the check below: one process, all 64
#     torch.manual_seed(0 + rank)                # then each rank its own dropout masks (seed + rank)
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
# Start every rank from the same weights: the same seed, or a broadcast from rank 0. Then reseed
# with `seed + rank`, as the snippet does, so that each rank draws its own dropout masks. Give each
# rank a different shard of every batch. Notebook 03 gets all of this from `DistributedDataParallel`.
# Notebook 05 shows why 8 small `all_reduce` calls per step are slow.

# %% [markdown]
# ## Exercise
#
# Write `average_gradients_flat(model)` that makes **one** `all_reduce` call per step, instead of
# one per parameter. Flatten all gradients into one tensor (`torch.cat([p.grad.flatten() ...])`),
# reduce it, and divide. Then copy the pieces back into each `p.grad`, since `torch.cat` makes a
# copy.
#
# The check below runs it at two world sizes, each rank with its own gradients. It compares the result
# with the mean over ranks and counts your `all_reduce` calls. It prints "✓ correct", or fails with
# what is wrong. Until you write the function, it says "not attempted yet". Stuck?
# `%load solutions/02_average_gradients_flat.py` in a new cell.

# %%
def average_gradients_flat(model):
    # your code here: torch.cat, one dist.all_reduce, divide, copy the pieces back
    raise NotImplementedError("write average_gradients_flat")


# %%
gst.exercises.check_average_gradients_flat(average_gradients_flat)
