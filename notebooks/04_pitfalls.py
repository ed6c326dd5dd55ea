# %% [markdown]
# # 04 — What goes wrong: a gallery of gradient-averaging bugs
#
# **Question: which bugs in distributed training code run without an error, and how do I catch each
# one?**
#
# **Short answer:** check your code for the 8 bugs below. Each runs without an error, and each has a
# check that catches it in seconds.
#
# Code copied from a tutorial can print a falling loss and still be wrong. This notebook reproduces
# each bug in a few lines launched from a cell. For each one it **measures the symptom** and shows a
# **check** you can drop into your code. A cell then **proves the fix**: it would fail if the fix
# did not work.
#
# | Pitfall | Bug | What you see |
# |---|-----|--------------|
# | forgotten division | all_reduce without dividing | the learning rate is N times larger |
# | different weights | ranks start from different weights | the replicas never agree |
# | unsharded data | every rank reads all the data | N ranks do the work of one |
# | no `set_epoch` | `DistributedSampler` without `set_epoch` | every epoch has the same order |
# | mean of means | unequal local batch sizes | mean of means ≠ global mean |
# | uneven steps | ranks run different numbers of steps | a hang |
# | skipped collective | a rank skips a collective | a hang; in a loop, an error, a hang or wrong sums |
# | local loss | logging a rank's own loss | the curve of 1/N of the data |
#
# Three more pitfalls have a DDP option as their fix, so [notebook
# 03](03_distributed_data_parallel.ipynb) measures them next to DDP:
#
# | Pitfall | Bug | What you see |
# |---|-----|--------------|
# | unused parameter | a parameter without a gradient | the tutorial's averaging: an `AttributeError`; notebook 02's skips `None`; DDP: `RuntimeError` in step 2 |
# | BatchNorm buffers | BatchNorm statistics | the buffers drift apart |
# | accumulation | gradient accumulation | N times the communication |
#
# The text refers to each one by its name, as "the mean-of-means pitfall".

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # set it to 1 for a short run (the tests do)
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5
EPOCHS = 1
N_TRAIN = 2048 if SMOKE_TEST else 16384  # every bug shows within a few steps
HANG_TIMEOUT = 5  # seconds; each reproduction takes well under one, so longer means a hang

import re
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import gradsync_tutorial as gst

assert GLOBAL_BATCH % WORLD_SIZE == 0, "each rank takes GLOBAL_BATCH // WORLD_SIZE samples"


# %% [markdown]
# ## The loop under test
#
# Notebook 02's `average_gradients` and its training loop, with a few switches that plant a bug or
# apply a fix. Each switch changes one or two lines, marked with the name of its pitfall. After each
# step, `train` also records the largest difference between the ranks' parameters
# (`gst.checks.max_diff_across_ranks`). `log(loss)` decides what a step logs. By default it logs
# this rank's own loss, as in notebook 02.

# %%
def average_gradients(model):  # notebook 02's, the code under test
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world_size


def local_loss(loss):
    return loss.item()  # this rank's loss, on its own samples


def train(rank, world_size, n=N_TRAIN, seed_per_rank=False, broadcast=False, sharding="slice",
          check_steps=False, log=local_loss):
    torch.manual_seed(SEED + rank if seed_per_rank else SEED)  # different weights: the bug
    device = gst.local_device()
    model = gst.model.Net().to(device)
    if broadcast:  # different weights, the fix: every rank takes rank 0's weights
        for param in model.parameters():
            dist.broadcast(param.data, src=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    images, labels = images[:n], labels[:n]
    batch_size = GLOBAL_BATCH // world_size
    logged, rank_diff = [], []
    for epoch in range(EPOCHS):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED + epoch))
        shard = order[rank::world_size]  # uneven steps: one sample more on some ranks
        if sharding != "slice":  # uneven steps, the fix: equal shards
            sampler = DistributedSampler(range(n), seed=SEED, drop_last=sharding == "drop_last")
            sampler.set_epoch(epoch)
            shard = torch.tensor(list(sampler))
        batches = shard.split(batch_size)
        if check_steps:  # uneven steps, the check: do all ranks take the same number of steps?
            gst.detect.assert_ranks_agree_on(len(batches), "batches per epoch")
        model.train()
        for idx in batches:
            x, y = images[idx].to(device), labels[idx].to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            average_gradients(model)
            optimizer.step()
            logged.append(log(loss))  # local loss: what gets logged
            rank_diff.append(gst.checks.max_diff_across_ranks(model))
    return {"logged": logged, "rank_diff": rank_diff, "state": model.state_dict()}


# %% [markdown]
# The correct run, for reference: the replicas agree after every step.

# %%
correct = gst.launch(train, world_size=WORLD_SIZE)
steps = len(correct[0]["rank_diff"])
print(f"{steps} steps; largest difference between ranks: {max(correct[0]['rank_diff'])}")
assert steps > 0 and all(d == 0.0 for r in correct for d in r["rank_diff"])


# %% [markdown]
# ## Forgotten division: all_reduce without dividing
#
# **Bug**: `dist.all_reduce(param.grad)` without `param.grad /= world_size`, the popular answer to
# the tutorial's code. **Symptom**: every rank holds the *sum* of the gradients, N times their mean.
# Plain SGD then runs with N times the learning rate, and Adam almost hides it. Notebook 02 proves
# both with full training runs. Here is the gradient itself, after one backward pass:

# %%
def one_gradient(rank, world_size, divide):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().eval().to(device)  # eval: dropout off, so every number is reproducible
    images, labels = gst.data.load(train=True)
    idx = torch.arange(GLOBAL_BATCH)[rank::world_size]
    F.nll_loss(model(images[idx].to(device)), labels[idx].to(device)).backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        if divide:
            param.grad /= world_size
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# %%
summed = gst.launch(one_gradient, WORLD_SIZE, args=(False,))[0]
mean = gst.launch(one_gradient, WORLD_SIZE, args=(True,))[0]

# %% tags=["nbval-check-output"]
ratio = (summed.norm() / mean.norm()).item()
print(f"|gradient without dividing| / |mean gradient| = {ratio:.4f} (world size {WORLD_SIZE})")
assert torch.allclose(summed, WORLD_SIZE * mean, rtol=1e-6, atol=0)

# %% [markdown]
# **Detect**: compare with one process that takes the whole global batch, as notebook 02 does for a
# training step. Its gradient is the mean, and the sum is N times it.

# %%
images, labels = gst.data.load(train=True)
torch.manual_seed(SEED)
single = gst.model.Net().eval()
F.nll_loss(single(images[:GLOBAL_BATCH]), labels[:GLOBAL_BATCH]).backward()
single_grad = torch.cat([p.grad.flatten() for p in single.parameters()])
to_single = {name: (g - single_grad).abs().max().item() for name, g in
             [("mean", mean), ("sum", summed)]}
print("max |distributed - one process|:", {k: f"{v:.1e}" for k, v in to_single.items()})
assert to_single["mean"] <= 1e-6 < to_single["sum"]

# %% [markdown]
# **Fix**: divide by `dist.get_world_size()`, or use DDP (notebook 03).
#
# ## Different weights: ranks start from different weights
#
# **Bug**: each rank seeds its generator differently, with `torch.manual_seed(SEED + rank)`. Scripts
# often do it to vary dropout or augmentation across ranks. Nothing copies rank 0's weights to the
# others. Manual averaging then applies the same averaged update to N different models.
#
# The fix, run alongside, broadcasts rank 0's parameters before training. To vary dropout or
# augmentation, seed twice instead. Call `torch.manual_seed(SEED)`, build the model, then call
# `torch.manual_seed(SEED + rank)`, as `scripts/train_ddp.py` does. This notebook's loop keeps one
# seed: every rank draws the same dropout masks, which the exact checks need.

# %%
seeded_per_rank = gst.launch(partial(train, seed_per_rank=True), WORLD_SIZE)
broadcast = gst.launch(partial(train, seed_per_rank=True, broadcast=True), WORLD_SIZE)

# %% [markdown]
# **Symptom**: it trains without a complaint, but the replicas never agree. Every rank applies the
# same update. So the difference between two replicas stays what it was after step 1 (to 1e-5), step
# after step:

# %%
gap = seeded_per_rank[0]["rank_diff"]
print(f"max difference between ranks: {gap[0]:.4f} after step 1, {gap[-1]:.4f} after the last")
assert gap[0] > 0.01  # far apart...
assert abs(gap[-1] - gap[0]) <= 1e-5  # ...and they stay as far apart, to 1e-5

# %%
fig = gst.plots.plot_loss_curves(
    [gap, broadcast[0]["rank_diff"]], labels=["seed per rank", "seed per rank + broadcast"],
    title="Replicas seeded differently never agree", ylabel="max |rank - rank 0|",
)


# %% [markdown]
# **Detect**: notebook 02 compares the ranks' final parameters in the notebook
# (`gst.checks.compare_ranks`). Inside the ranks, use `gst.checks.assert_replicas_equal(model)`. It
# compares every rank's tensors with rank 0's and names the first one that differs. Call it once
# after building the model, and after a step now and then. It raises on every rank, so no rank is
# left waiting.

# %%
def first_weights(rank, world_size, fix=None):
    torch.manual_seed(SEED + rank)  # the bug
    model = gst.model.Net().to(gst.local_device())
    if fix == "broadcast":
        for param in model.parameters():
            dist.broadcast(param.data, src=0)  # every rank receives rank 0's values
    if fix == "ddp":
        model = DDP(model).module  # DDP broadcasts rank 0's parameters when it is built
    gst.checks.assert_replicas_equal(model)  # the check: raises on every rank if they differ
    return fix


try:
    gst.launch(first_weights, WORLD_SIZE)
except gst.RankFailedError as err:
    print(str(err).splitlines()[0])
    assert "replicas differ: 'conv1.weight' on rank" in str(err)

# %% [markdown]
# **Fix**: broadcast rank 0's parameters before training, or wrap the model in DDP, which does the
# same when it is built (notebook 03). Both pass the check. With the broadcast, the training run
# above had identical replicas after every step:

# %%
fixed = [gst.launch(first_weights, WORLD_SIZE, args=(fix,)) for fix in ("broadcast", "ddp")]
assert fixed == [["broadcast"] * WORLD_SIZE, ["ddp"] * WORLD_SIZE]
assert all(d == 0.0 for r in broadcast for d in r["rank_diff"])
print("both fixes pass the check; with the broadcast, every step: max difference between ranks = 0")


# %% [markdown]
# ## Unsharded data: every rank reads all the data
#
# **Bug**: a `DataLoader(dataset, shuffle=True)` with no `DistributedSampler`. With the
# different-weights pitfall fixed by a common seed, every rank even shuffles **the same way**. Each
# step's global batch is then N copies of the same samples.

# %%
def one_epoch(rank, world_size, use_sampler):
    torch.manual_seed(SEED)  # the same seed on every rank (different weights)
    dataset = range(N_TRAIN)  # a stand-in data set: each sample is its own index
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED) if use_sampler else None
    loader = DataLoader(dataset, GLOBAL_BATCH // world_size, shuffle=not use_sampler,
                        sampler=sampler)
    return [batch.tolist() for batch in loader]  # the indices of every batch this rank reads


unsharded = gst.launch(one_epoch, WORLD_SIZE, args=(False,))
sharded = gst.launch(one_epoch, WORLD_SIZE, args=(True,))


# %% [markdown]
# **Symptom**: `gst.detect.sample_overlap` takes each rank's indices and counts the samples that two
# or more ranks read. Without the sampler it is all of them. Each rank takes N times as many steps
# per epoch as it should: N ranks do the work of one.

# %%
def flat(batches):
    return [i for batch in batches for i in batch]

bug = gst.detect.sample_overlap([flat(b) for b in unsharded], dataset_size=N_TRAIN)
fix = gst.detect.sample_overlap([flat(b) for b in sharded], dataset_size=N_TRAIN)
print("no sampler:         ", bug)
print("DistributedSampler: ", fix)
first_step = {i for batches in unsharded for i in batches[0]}
print(f"distinct samples in the first global batch: {len(first_step)} of {GLOBAL_BATCH}")
print(f"steps per epoch: {len(unsharded[0])} without the sampler, {len(sharded[0])} with it")
assert bug.shared == bug.unique == N_TRAIN  # every sample, on every rank
assert len(first_step) == GLOBAL_BATCH // WORLD_SIZE
assert len(unsharded[0]) == WORLD_SIZE * len(sharded[0])
assert fix.disjoint and fix.coverage == 1.0


# %% [markdown]
# **Detect, inside your code**: `gst.detect.assert_disjoint_shards(indices)` gathers every rank's
# indices with one `all_gather_object`. It raises on every rank if the shards overlap:

# %%
def check_shards(rank, world_size, use_sampler):
    indices = flat(one_epoch(rank, world_size, use_sampler))
    gst.detect.assert_disjoint_shards(indices, dataset_size=N_TRAIN)  # the check


gst.launch(check_shards, WORLD_SIZE, args=(True,))  # with the sampler: passes
try:
    gst.launch(check_shards, WORLD_SIZE, args=(False,))
except gst.RankFailedError as err:
    print(str(err).splitlines()[0])
    assert "the ranks' shards overlap" in str(err)


# %% [markdown]
# **Fix**: a `DistributedSampler` (shown above), or notebook 02's `order[rank::world_size]`.
#
# ## No `set_epoch`: `DistributedSampler` without `set_epoch`
#
# **Bug**: the sampler's shuffle is seeded with `seed + epoch`, and only `set_epoch(epoch)` changes
# its epoch. Forget it, and every epoch repeats the first epoch's order.

# %%
def epoch_orders(rank, world_size, set_epoch, epochs=3):
    sampler = DistributedSampler(range(N_TRAIN), shuffle=True, seed=SEED)  # rank: from dist
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # the fix
        orders.append(list(sampler))
    return orders


same = gst.launch(epoch_orders, WORLD_SIZE, args=(False,))
reshuffled = gst.launch(epoch_orders, WORLD_SIZE, args=(True,))

# %% [markdown]
# **Symptom**: the orders are identical, epoch after epoch, on every rank. With `set_epoch` they
# change every epoch. Within each epoch the ranks' shards stay disjoint.

# %%
for rank in range(WORLD_SIZE):
    assert same[rank][0] == same[rank][1] == same[rank][2]  # the bug: one order, repeated
    assert reshuffled[rank][0] != reshuffled[rank][1] != reshuffled[rank][2]  # the fix
for epoch in range(3):
    assert gst.detect.sample_overlap([r[epoch] for r in reshuffled]).disjoint
print("rank 0's first indices in epochs 0, 1, 2")
print("  without set_epoch:", *[order[:4] for order in same[0]])
print("  with set_epoch:   ", *[order[:4] for order in reshuffled[0]])


# %% [markdown]
# **Detect**: compare two epochs' indices, as above, in a test of your data pipeline. **Fix**: call
# `sampler.set_epoch(epoch)` at the start of every epoch.
#
# ## Mean of means: unequal local batch sizes
#
# **Bug**: the ranks hold different numbers of samples in a step. Causes include an uneven last
# batch, ranks that drop filtered samples, and losses averaged over a varying number of tokens. Each
# rank takes the **mean** over its own samples, and the ranks average those means. The mean of the
# per-rank means is not the mean over all samples. Rank `r`'s samples get weight $1 / (N \cdot n_r)$
# instead of $1 / \sum n$.
#
# Here is the last global batch of an epoch. Every rank gets its full share but the last, which gets
# 8 samples. The fix reduces the **sum** of the losses and the **count** together, and divides once.
# For the gradient, each rank differentiates its loss sum divided by the global count. The ranks
# then **sum** the gradients, not average them. [Notebook 07](07_which_mean.ipynb) covers the same
# bug with losses averaged over tokens and across gradient-accumulation micro-batches, and its fix.

# %%
def uneven_step(rank, world_size, weighted):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().eval().to(device)  # eval: dropout off, for exact comparisons
    images, labels = gst.data.load(train=True)
    per_rank = GLOBAL_BATCH // world_size
    last_batch = torch.arange(per_rank * (world_size - 1) + 8)  # the last rank gets 8 samples
    idx = last_batch[rank * per_rank : (rank + 1) * per_rank]
    x, y = images[idx].to(device), labels[idx].to(device)
    loss_sum = F.nll_loss(model(x), y, reduction="sum")
    count = torch.tensor(float(len(idx)), device=device)
    if weighted:  # the fix
        totals = torch.stack([loss_sum.detach(), count])
        dist.all_reduce(totals)  # [sum of all losses, number of samples]
        (loss_sum / totals[1]).backward()  # this rank's part of the global mean
        for param in model.parameters():
            dist.all_reduce(param.grad)  # sum over ranks = gradient of the global mean
        logged = totals[0] / totals[1]
    else:  # the bug: a mean per rank, then the mean of the means
        loss = loss_sum / count
        loss.backward()
        average_gradients(model)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        logged /= world_size
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"loss": logged.item(), "grad": grad, "count": len(idx)}


mean_of_means = gst.launch(uneven_step, WORLD_SIZE, args=(False,))
weighted = gst.launch(uneven_step, WORLD_SIZE, args=(True,))

# %% [markdown]
# The same batch in this process, no `torch.distributed`: the true global mean and its gradient.

# %%
images, labels = gst.data.load(train=True)
counts = [r["count"] for r in weighted]
last_batch = torch.arange(sum(counts))
torch.manual_seed(SEED)
single = gst.model.Net().eval()
true_loss = F.nll_loss(single(images[last_batch]), labels[last_batch])
true_loss.backward()
true_grad = torch.cat([p.grad.flatten() for p in single.parameters()])


def errors(result):  # (loss error, largest gradient error) against the single process
    loss_error = abs(result["loss"] - true_loss.item())
    return loss_error, (result["grad"] - true_grad).abs().max().item()

print(f"samples per rank: {counts}; global mean loss {true_loss.item():.5f}")
for name, result in [("mean of means", mean_of_means[0]), ("weighted", weighted[0])]:
    loss_error, grad_error = errors(result)
    print(f"  {name:13}: loss {result['loss']:.5f} (off by {loss_error:.1e}), "
          f"gradient off by up to {grad_error:.1e}")
assert errors(mean_of_means[0])[0] > 1e-3 and errors(mean_of_means[0])[1] > 1e-4  # the bug
assert errors(weighted[0])[0] <= 1e-5 and errors(weighted[0])[1] <= 1e-6  # the fix

# %% [markdown]
# **Detect**: compare the distributed loss with a single-process computation on the same samples, as
# here. Where your code assumes equal batches, guard it with
# `gst.detect.assert_ranks_agree_on(len(idx), "batch size")`. The uneven-steps pitfall shows this
# check at work.
#
# ## Uneven steps: ranks run different numbers of steps
#
# **Bug**: notebook 02's `order[rank::world_size]` on a data set whose size is not a multiple of the
# number of ranks. Take one sample more than 4 global batches. Rank 0's shard gets the extra sample,
# hence a fifth, one-sample batch that no other rank has.

# %%
N_UNEVEN = 4 * GLOBAL_BATCH + 1
order = torch.randperm(N_UNEVEN, generator=torch.Generator().manual_seed(SEED))
shards = [order[r::WORLD_SIZE] for r in range(WORLD_SIZE)]
batches_per_rank = [len(shard.split(GLOBAL_BATCH // WORLD_SIZE)) for shard in shards]
print("batches per rank:", batches_per_rank)
assert batches_per_rank == [5] + [4] * (WORLD_SIZE - 1)

# %% [markdown]
# **Symptom**: in its fifth step, rank 0 calls `all_reduce` and waits for partners that have already
# finished: the job hangs. `gst.launch(..., timeout=)` turns the hang into an error that names the
# ranks that did not finish.

# %%
try:
    gst.launch(partial(train, n=N_UNEVEN), WORLD_SIZE, timeout=HANG_TIMEOUT)
except gst.LaunchTimeoutError as err:
    print(err)
    assert err.unfinished == [0]

# %% [markdown]
# Without `gst.launch`, in a script under torchrun say, the **process group's** timeout ends the
# hang. Every collective waits at most the `timeout` given to `init_process_group(timeout=...)` or
# `dist.new_group`. The default is 30 minutes with gloo and 10 with NCCL. It belongs to the group,
# not to the launcher. A group with a 1-second timeout:

# %%
ON_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD_SIZE  # NCCL, else gloo


def hang_with_timeout(rank, world_size, seconds):
    group = dist.new_group(timeout=timedelta(seconds=seconds))  # every rank creates it
    if rank == 0:
        dist.all_reduce(torch.ones(1, device=gst.local_device()), group=group)  # rank 0 alone
    else:
        time.sleep(seconds + 5)  # alive, but never joins the all_reduce
    return "finished"


print("default timeouts:", default_pg_timeout, "(gloo),", default_pg_nccl_timeout, "(NCCL)")
try:
    gst.launch(hang_with_timeout, WORLD_SIZE, args=(1,), timeout=60)
except gst.RankFailedError as err:
    timed_out = str(err)[str(err).find("Timed out"):].splitlines()[0]  # gloo's message
    print(f"rank {err.rank} raised", timed_out if not ON_GPU else str(err).splitlines()[0])
    assert err.rank == 0 and (ON_GPU or timed_out.startswith("Timed out waiting 1000ms"))
else:
    raise AssertionError("the group's timeout should have ended rank 0's all_reduce")

# %% [markdown]
# **Detect, before it hangs**: `gst.detect.assert_ranks_agree_on(len(batches), "batches per epoch")`
# gathers the value from every rank. It raises on every rank if they differ: an error in a second,
# naming every rank's count, instead of a hang. The `check_steps` switch of `train` turns it on.

# %%
try:
    gst.launch(partial(train, n=N_UNEVEN, check_steps=True), WORLD_SIZE)
except gst.RankFailedError as err:
    print(str(err).splitlines()[0])  # the first line: which rank raised, and the check's message
    assert "the ranks disagree on batches per epoch: rank 0: 5, rank 1: 4" in str(err)

# %% [markdown]
# **Detect, with torch alone**: `dist.monitored_barrier(timeout=...)` is a barrier that names the
# ranks that did not arrive in time. Its documentation says it "can have a performance impact and
# should only be used for debugging". It also says it "is only supported with the GLOO backend". So
# under nccl, create a gloo group of all ranks once, `dist.new_group(backend="gloo")`, and pass it.
# Under gloo that side group changes nothing.
#
# Here it is called at the top of every step of the uneven shards above. It turns rank 0's fifth
# step into an error in 2 seconds that names rank 1. torch also logs that error on rank 0's stderr.
# That is the line tagged `[rank 0] [rank0]:` below: the launcher's tag, then torch's own.

# %%
def steps_with_a_monitored_barrier(rank, world_size):
    cpu_group = dist.new_group(backend="gloo")  # once: nccl has no monitored_barrier
    batches = torch.arange(N_UNEVEN)[rank::world_size].split(GLOBAL_BATCH // world_size)
    for _ in batches:
        dist.monitored_barrier(cpu_group, timeout=timedelta(seconds=2))  # is every rank here?
        ...  # the step: forward, backward, all_reduce, optimizer step
    return len(batches)


try:
    gst.launch(steps_with_a_monitored_barrier, WORLD_SIZE, timeout=60)
except gst.RankFailedError as err:
    print(str(err).splitlines()[0])
    assert err.rank == 0 and "Rank 1 failed to pass monitoredBarrier in 2000 ms" in str(err)


# %% [markdown]
# **Fix**: give every rank equally long shards. `DistributedSampler(drop_last=True)` cuts the data
# to a multiple of the number of ranks. The default, `drop_last=False`, pads it by repeating a few
# samples. Dropping each rank's last *partial batch* is not enough. Shards of 256 and 255 samples
# would still give 2 and 1 full batches of 128.
#
# With DDP you may instead keep uneven shards and wrap the loop in `Join`. A rank that runs out of
# batches keeps answering the others' all-reduces, with zero gradients, until all are done. At the
# end DDP copies the parameters of the last rank to finish to every rank (checked below). Two
# things it does not make equal, measured below:
#
# | what | with `Join` | the way out |
# |---|---|---|
# | a step taken by fewer ranks | divided by the *initial* world size, so scaled down | `divide_by_initial_world_size=False` divides by the ranks still active |
# | the optimizer state (here SGD's momentum) | a rank that stopped early misses the last steps | none: equal shards |

# %%
def train_join(rank, world_size, n=N_UNEVEN, divide_by_initial_world_size=True):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = DDP(gst.model.Net().to(device).eval())  # eval: no dropout, exact comparisons
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED))
    batches = order[rank::world_size].split(GLOBAL_BATCH // world_size)  # still uneven
    fewest = torch.tensor(len(batches), device=device)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)  # the steps that every rank takes
    scale = None  # in a step after the others ended: |DDP's gradient| / |this rank's own|
    with Join([model], divide_by_initial_world_size=divide_by_initial_world_size):  # the fix
        for step, idx in enumerate(batches):
            x, y = images[idx].to(device), labels[idx].to(device)
            optimizer.zero_grad()
            if step >= fewest:  # the others have ended: what would this rank's gradient be?
                alone = gst.model.Net().to(device).eval()  # a copy, outside DDP
                alone.load_state_dict(model.module.state_dict())
                F.nll_loss(alone(x), y).backward()
            F.nll_loss(model(x), y).backward()
            if step >= fewest:
                scale = (model.module.fc2.bias.grad.norm() / alone.fc2.bias.grad.norm()).item()
            optimizer.step()
            own = [p.detach().clone() for p in model.module.parameters()]  # after its last step
    kept_own = all(torch.equal(p, q) for p, q in zip(model.module.parameters(), own, strict=True))
    momentum = [(name, optimizer.state[p]["momentum_buffer"])
                for name, p in model.module.named_parameters()]
    return {"steps": len(batches), "rank_diff": gst.checks.max_diff_across_ranks(model.module),
            "momentum_diff": gst.checks.max_diff_across_ranks(momentum), "last_scale": scale,
            "kept_own": kept_own}  # True: its parameters are those of its own last step


padded = gst.launch(partial(train, n=N_UNEVEN, sharding="pad", check_steps=True), WORLD_SIZE)
cut = gst.launch(partial(train, n=N_UNEVEN, sharding="drop_last", check_steps=True), WORLD_SIZE)
joined = gst.launch(train_join, WORLD_SIZE)
joined_active = gst.launch(partial(train_join, divide_by_initial_world_size=False), WORLD_SIZE)

# %%
for name, result in [("padded", padded), ("drop_last", cut)]:
    print(f"{name:9}: {len(result[0]['logged'])} steps on every rank, replicas equal")
    assert all(len(r["logged"]) == len(result[0]["logged"]) for r in result)
    assert all(r["rank_diff"][-1] == 0.0 for r in result)
print(f"Join     : steps per rank {[r['steps'] for r in joined]}, replicas equal at the end")
assert [r["steps"] for r in joined] == batches_per_rank
assert all(r["rank_diff"] == 0.0 for r in joined)
assert [r["kept_own"] for r in joined] == [True] + [False] * (WORLD_SIZE - 1)  # rank 0's, copied
for name, runs in [("True (default)", joined), ("False", joined_active)]:
    print(f"  divide_by_initial_world_size={name}: rank 0's step 5, the others done: its "
          f"gradient is {runs[0]['last_scale']:.3f} x its own")
print("  momentum buffers after Join, max difference between ranks: "
      f"{joined[0]['momentum_diff']:.2g}")
assert abs(joined[0]["last_scale"] - 1 / WORLD_SIZE) <= 1e-5  # divided by the initial N
assert abs(joined_active[0]["last_scale"] - 1) <= 1e-5  # divided by the 1 rank still active
assert joined[0]["momentum_diff"] > 0  # rank 0's momentum saw a step that rank 1's did not


# %% [markdown]
# ## Skipped collective: a rank skips a collective
#
# **Bug**: a collective inside a branch that not every rank takes, typically "only rank 0 logs".
# Every rank must make the same collective calls, in the same order.

# %%
def log_final_loss(rank, world_size, every_rank_reduces):
    loss = torch.tensor([float(rank + 1)], device=gst.local_device())  # this rank's last loss
    if rank == 0 or every_rank_reduces:
        dist.all_reduce(loss)  # the bug: under `if rank == 0`, rank 0 waits here forever
    if rank == 0:
        print(f"mean loss over the ranks: {loss.item() / world_size}")
    return loss.item() / world_size


# %% [markdown]
# **Symptom and detection**: the same hang, the same error, naming rank 0.

# %%
try:
    gst.launch(log_final_loss, WORLD_SIZE, args=(False,), timeout=HANG_TIMEOUT)
except gst.LaunchTimeoutError as err:
    print(err)
    assert err.unfinished == [0]


# %% [markdown]
# Inside a training loop the same bug fails differently. Rank 0's extra `all_reduce` pairs with the
# other ranks' *next* call, the gradient of the first parameter. The sizes differ. What happens then
# is up to the backend and to timing. In this run:

# %%
def log_inside_the_loop(rank, world_size):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device)
    g = torch.Generator().manual_seed(rank)  # random images: the data do not matter here
    x = torch.randn(GLOBAL_BATCH // world_size, 1, 28, 28, generator=g).to(device)
    y = torch.randint(10, (GLOBAL_BATCH // world_size,), generator=g).to(device)
    loss = F.nll_loss(model(x), y)
    loss.backward()
    if rank == 0:
        dist.all_reduce(loss.detach().clone())  # the bug: only rank 0 reduces its loss
    average_gradients(model)


try:
    gst.launch(log_inside_the_loop, WORLD_SIZE, timeout=HANG_TIMEOUT, show_ranks=[])  # quiet
except (gst.RankFailedError, gst.LaunchTimeoutError) as err:
    print(f"{type(err).__name__}: {err}")
else:
    raise AssertionError("an extra all_reduce on rank 0 should fail")

# %% [markdown]
# A path such as `/__w/pytorch/pytorch/third_party/gloo/...` in gloo's message is where torch was
# built, not a file on this machine.
#
# **Detect, with torch alone**: run the job once with the environment variable
# `TORCH_DISTRIBUTED_DEBUG=DETAIL`. Then, in the words of torch's
# [documentation](https://docs.pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications),
# every collective gets "additional consistency and synchronization checks". It works "by ensuring
# all collective functions match and are called with consistent tensor shapes. If this is not the
# case, a detailed error report is included when the application crashes, rather than a hang or
# uninformative error message." Torch reads the variable once, when `torch.distributed` is imported
# (`set_debug_level_from_env()` in its `__init__.py`, torch 2.14). It then wraps every process group
# created after that. So set it before the job starts (`TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun
# ...`). Here the launcher starts fresh workers with it:

# %%
def with_detail_checks(fn, *args):
    """Launch fn on fresh workers started with TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        return gst.launch(fn, WORLD_SIZE, args=args, timeout=60, show_ranks=[],
                          reuse_workers=False)
    finally:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]


try:
    with_detail_checks(log_inside_the_loop)
except gst.RankFailedError as err:
    failures = err.failures  # every rank's own error
else:
    raise AssertionError("DETAIL should report the mismatched collectives")
own_call = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber="
                      r"(\d+), OpType=(\w+), TensorShape=\[([^\]]*)\]")
print(f"every rank raised: {failures[0].message.split('. ')[0]}; each names its own call:")
shapes = {}
for rank in sorted(failures):
    _, number, op, shapes[rank] = own_call.search(failures[rank].message).groups()
    print(f"  rank {rank}: its collective number {number} is {op} of a tensor of shape "
          f"[{shapes[rank]}]")
assert all("Detected mismatch between collectives" in f.message for f in failures.values())
assert shapes == {0: "", **{r: "10, 1, 5, 5" for r in range(1, WORLD_SIZE)}}  # loss; conv1.weight

# %% [markdown]
# When the shapes happen to match, nothing fails at all. Each rank adds whatever tensor the others
# passed to the same call. Here a model has two layers of the same shape, and rank 1 averages them
# in the other order. That happens when a rank builds its list of parameters in its own order, from
# a set or a dict:

# %%
def mismatched_order(rank, world_size, swap):
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)).to(gst.local_device())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))  # this rank's data
    model(x.to(gst.local_device())).pow(2).mean().backward()
    own = [p.grad.clone() for p in model.parameters()]  # before averaging
    params = list(model.parameters())
    if swap and rank == 1:
        params = params[2:] + params[:2]  # the bug: rank 1 sends the second layer first
    for param in params:
        dist.all_reduce(param.grad)
        param.grad /= world_size
    return own, [p.grad for p in model.parameters()]


def wrong_by(results):  # largest |gradient - true mean| on any rank; largest rank difference
    owns, averaged = zip(*results, strict=True)  # per rank: its own gradients, the averaged ones
    true_mean = [sum(grads) / len(owns) for grads in zip(*owns, strict=True)]
    error = max((g - m).abs().max().item()
                for avg in averaged for g, m in zip(avg, true_mean, strict=True))
    ranks = max((a - b).abs().max().item()
                for avg in averaged for a, b in zip(avg, averaged[0], strict=True))
    return error, ranks


for swap in (False, True):
    error, ranks = wrong_by(gst.launch(mismatched_order, WORLD_SIZE, args=(swap,)))
    print(f"{'rank 1 swapped' if swap else 'same order':14}: no error; max |averaged - true mean| "
          f"{error:.1e}, max difference between ranks {ranks:.1e}")
    if swap:
        assert min(error, ranks) > 1e-3  # wrong sums, and the replicas no longer agree
    else:  # every rank the same sum; the true mean to float rounding (exact on 2 ranks)
        assert ranks == 0.0 and error <= (0.0 if WORLD_SIZE == 2 else 1e-6)

# %% [markdown]
# The replicas then drift apart, so `gst.checks.assert_replicas_equal(model)` after a step catches
# it (the different-weights pitfall). `gst.detect.count_collectives()` counts the calls each rank
# makes through `dist.<name>`, for the case where their number differs.
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` does not catch this one. It compares each call's operation and
# shapes, and here they agree:

# %%
error, ranks = wrong_by(with_detail_checks(mismatched_order, True))
print(f"rank 1 swapped, TORCH_DISTRIBUTED_DEBUG=DETAIL: no error; max |averaged - true mean| "
      f"{error:.1e}, max difference between ranks {ranks:.1e}")
assert min(error, ranks) > 1e-3

# %% [markdown]
#
# **On GPUs (NCCL)**, the same environment variable works, and a hang ends at the process group's
# timeout (above). NCCL's **flight recorder** records the last collectives of every rank. It writes
# them to a file when that timeout hits. Two variables turn it on, per PyTorch's
# [Flight Recorder tutorial](https://docs.pytorch.org/tutorials/prototype/flight_recorder_tutorial.html):
# `TORCH_NCCL_TRACE_BUFFER_SIZE=2000` (the number of entries kept) and
# `TORCH_NCCL_DUMP_ON_TIMEOUT=true`. An analyzer script then compares the ranks' records. It finds
# the
# rank and the call where they diverged. This is not run here: it needs NCCL, that is GPUs.
#
# **Fix**: call the collective on every rank, and branch only around the printing. Counted, every
# rank now makes the same calls:

# %% tags=["nbval-check-output"]
def log_final_loss_counted(rank, world_size):
    with gst.detect.count_collectives() as calls:
        mean_loss = log_final_loss(rank, world_size, every_rank_reduces=True)
    return mean_loss, calls.total


results = gst.launch(log_final_loss_counted, WORLD_SIZE)
print("(mean loss, collective calls) per rank:", results)
assert results == [((WORLD_SIZE + 1) / 2, 1)] * WORLD_SIZE


# %% [markdown]
# ## Local loss: logging a rank's own loss as the global loss
#
# **Bug**: `losses.append(loss.item())` on rank 0, plotted as "the training loss". It is the loss of
# rank 0's 1/N of each batch, not of the batch. Every run of `train` above logged exactly this.
#
# **Fix**: all-reduce a copy of the loss, on every rank, and divide. When the batches are uneven,
# weight it by the counts (the mean-of-means pitfall). That is one more collective per logged step,
# which every rank must make (counted below). Log every few steps if it costs you.

# %%
def global_loss(loss):  # the fix: every rank calls it, every rank gets the same value
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return (mean / dist.get_world_size()).item()


logged_global = gst.launch(partial(train, log=global_loss), WORLD_SIZE)


def one_logged_step(rank, world_size):
    with gst.detect.count_collectives() as calls:
        global_loss(torch.tensor(float(rank), device=gst.local_device()))  # nccl: on the GPU
    return calls.total


assert gst.launch(one_logged_step, WORLD_SIZE) == [1] * WORLD_SIZE  # one all_reduce a log

# %% [markdown]
# **Symptom**: each rank's curve wanders around the global one (dashed). The training is the same;
# only the logging changed. The global loss is the mean of the ranks' own losses, and every rank
# logs the same value.

# %%
local0 = torch.tensor(correct[0]["logged"])  # rank 0's own loss, step by step
mean_of_ranks = torch.tensor([r["logged"] for r in correct]).mean(dim=0)
logged = torch.tensor(logged_global[0]["logged"])  # the all-reduced loss
off = (local0 - mean_of_ranks).abs()
print(f"rank 0's loss vs the global: mean |difference| {off.mean():.4f}, largest {off.max():.4f}")
assert all(r["logged"] == logged_global[0]["logged"] for r in logged_global)  # same on every rank
assert (logged - mean_of_ranks).abs().max() <= 1e-5  # = the mean of the ranks' own losses
assert off.mean() > 1e-3

# %%
fig = gst.plots.plot_loss_curves(
    [r["logged"] for r in correct], baseline={"global loss (all-reduced)": logged},
    labels=[f"rank {r}'s own loss" for r in range(WORLD_SIZE)],
    title="What each rank logs vs the loss of the whole batch",
)


# %% [markdown]
# ## Copy this into your code
#
# `snippets/04_pitfall_fixes.py` is a whole script in plain torch. The course's tests run it with
# `torchrun --standalone --nproc-per-node 2`. The three checks that `gst.checks` and `gst.detect` do
# here take a few lines each, and the comments name the pitfalls. Its end is the DDP form of the
# mean-of-means fix: DDP divides by the world size, so scale this rank's part by it. The snippet
# checks it against the loop's on uneven local batches.
#
# <!-- snippets/04_pitfall_fixes.py -->
# ```python
# """Notebook 04, copy this into your code: the training loop with every pitfall's fix, by name.
#
#     torchrun --standalone --nproc-per-node 2 snippets/04_pitfall_fixes.py
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
# from torch.nn.parallel import DistributedDataParallel as DDP
# from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
#
# SEED = 1234
#
#
# def assert_same_across_ranks(value, what):     # uneven steps: a count all ranks must agree on
#     everyone = [None] * dist.get_world_size()
#     dist.all_gather_object(everyone, value)
#     assert all(v == everyone[0] for v in everyone), f"{what} differ across ranks: {everyone}"
#
#
# def assert_disjoint_shards(indices):          # unsharded data: no sample on two ranks
#     everyone = [None] * dist.get_world_size()
#     dist.all_gather_object(everyone, list(indices))
#     seen = [i for shard in everyone for i in shard]
#     repeats = len(seen) - len(set(seen))       # DistributedSampler pads with < world_size
#     assert repeats < dist.get_world_size(), f"{repeats} samples are on several ranks"
#
#
# def assert_equal_replicas(model):             # different weights, BatchNorm buffers
#     mine = torch.cat([t.detach().double().flatten() for t in model.state_dict().values()])
#     rank_0 = mine.clone()
#     dist.broadcast(rank_0, src=0)
#     differ = torch.tensor([float(not torch.equal(mine, rank_0))], device=mine.device)
#     dist.all_reduce(differ)                    # every rank learns it, so every rank raises
#     assert differ.item() == 0, "the replicas differ"
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
#     device = init_distributed()                # set_device first: all_gather_object uses it
#     rank = dist.get_rank()
#     dataset = TensorDataset(torch.randn(500, 20, generator=torch.Generator().manual_seed(SEED)),
#                             torch.arange(500) % 3)
#     per_rank_batch, epochs = 32, 2
#
#     torch.manual_seed(SEED)                                # different weights: one seed...
#     model = nn.Linear(20, 3).to(device)
#     for p in model.parameters():
#         dist.broadcast(p.data, src=0)                      # ...and rank 0's weights everywhere
#     torch.manual_seed(SEED + rank)                         # then each rank its own dropout masks
#     assert_equal_replicas(model)                           # different weights, BatchNorm
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
#
#     sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # unsharded data, uneven steps
#     loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler)
#     assert_disjoint_shards(sampler)                        # unsharded data
#     assert_same_across_ranks(len(loader), "batches per epoch")  # uneven steps
#     for epoch in range(epochs):
#         sampler.set_epoch(epoch)                           # no set_epoch
#         for step, (x, y) in enumerate(loader):
#             x, y = x.to(device), y.to(device)
#             loss_sum = F.cross_entropy(model(x), y, reduction="sum")
#             totals = torch.stack([loss_sum.detach(), torch.tensor(float(len(y)), device=x.device)])
#             dist.all_reduce(totals)                        # mean of means, local loss: every rank
#             (loss_sum / totals[1]).backward()              # this rank's part of the global mean
#             for p in model.parameters():
#                 if p.grad is None:                         # unused parameter (or zeros)
#                     continue
#                 dist.all_reduce(p.grad)                    # the parts sum to the global mean
#             optimizer.step()
#             optimizer.zero_grad()
#             if rank == 0 and step % 10 == 0:
#                 print(f"loss {totals[0] / totals[1]:.4f}")  # local loss: log the global one
#     assert_equal_replicas(model)
#
#     # Mean of means with DDP: DDP divides the summed gradients by world_size, so scale this
#     # rank's part by world_size. Checked on unequal local batches: 8 samples on even ranks, 5 on
#     # odd ones.
#     n = 8 - 3 * (rank % 2)
#     x, y = (t.to(device) for t in dataset[rank * 8 : rank * 8 + n])
#     ddp = DDP(copy.deepcopy(model))
#     loss_sum = F.cross_entropy(ddp(x), y, reduction="sum")
#     count = torch.tensor(float(len(y)), device=device)
#     dist.all_reduce(count)
#     (loss_sum * dist.get_world_size() / count).backward()  # mean of means, with DDP
#     loss_sum = F.cross_entropy(model(x), y, reduction="sum")
#     (loss_sum / count).backward()                          # mean of means, by hand
#     for p in model.parameters():
#         dist.all_reduce(p.grad)
#     for p, q in zip(model.parameters(), ddp.module.parameters(), strict=True):
#         torch.testing.assert_close(p.grad, q.grad)
#     print(f"rank {rank}: replicas equal; DDP's gradient == the global mean's on uneven batches, "
#           f"on {device} ({dist.get_backend()})")
#     del ddp                                    # free DDP before its group (notebook 06: why)
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# With DDP, the fixes take one line each:
#
# - `DDP(model)` copies rank 0's weights (different weights).
# - `with Join([model]):` handles uneven inputs (uneven steps). Add
#   `divide_by_initial_world_size=False`; the optimizer state still differs (both measured above).
# - `find_unused_parameters=True`, only if needed (unused parameter, notebook 03).
# - `nn.SyncBatchNorm.convert_sync_batchnorm(model)` on GPUs (BatchNorm buffers, notebook 03).
#   Evaluate through the wrapper on every rank, or `model.module` on rank 0 alone.
# - `with model.no_sync():` for all but the last micro-batch (accumulation, notebook 03).
#
# Under nccl, pass `monitored_barrier` a gloo group, `dist.new_group(backend="gloo")`. To check
# that every rank makes the same calls, set `TORCH_DISTRIBUTED_DEBUG=DETAIL` (torch). To count
# them, use the course's helper: `with gst.detect.count_collectives() as calls:` (and
# `calls.watch(ddp_model)`).
#
# ## Exercise
#
# Write `global_mean_loss(losses)`, the number to log (the mean-of-means and local-loss pitfalls).
# `losses` holds this rank's per-sample losses in a step (`F.nll_loss(..., reduction="none")`). The
# ranks hold different numbers of them. Return the mean over **all** the ranks' samples, as a float,
# the same on every rank. Reduce this rank's sum of the losses together with its count, then divide
# once. One `dist.all_reduce` on `torch.stack([...])` sends both. Leave `losses` itself alone: in
# training, `backward()` still needs it. Remember that every rank must call the collective (the
# skipped-collective pitfall).
#
# The check below runs it at two world sizes, each rank holding its own number of samples. The
# numbers and losses are drawn afresh each time. It compares what each rank returns with the mean
# over all of them. It prints "✓ correct", or fails with what is wrong: the mean of the means, a sum
# not divided, a rank that skipped the all_reduce... Until you write the function, it says "not
# attempted yet". Stuck? `%load solutions/04_global_mean_loss.py` in a new cell.

# %%
def global_mean_loss(losses):
    # your code here: this rank's sum and count, one dist.all_reduce, divide once, .item()
    raise NotImplementedError("write global_mean_loss")


# %%
gst.exercises.check_global_mean_loss(global_mean_loss)

# %% [markdown]
# **One more, not checked**: make the uneven-steps pitfall finish **without** a sampler and without
# DDP. In `train`, before the loop, let the ranks agree on the smallest number of batches
# (`dist.all_reduce(..., op=dist.ReduceOp.MIN)`), and have every rank stop there. Check with
# `gst.launch(..., timeout=HANG_TIMEOUT)` on `n=N_UNEVEN` that it finishes. Check that every rank
# took the same number of steps, and that the replicas agree. Which samples did training skip?
