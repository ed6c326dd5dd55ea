# %% [markdown]
# # 05 — What makes DDP fast, and what a CPU shows of it
#
# **Question: `DistributedDataParallel` averages the same gradients as notebook 02's loop (notebook
# 03). What does it do differently to be fast, and which of it pays off where?**
#
# **Short answer:** send all the gradients in one call, not one call per parameter. On this CPU,
# notebook 02's 8 calls a step take several times the time of one; the ratio is printed below.
# Overlap with backward pays only where something else moves the bytes, as on GPUs.
#
# Notebook 02 averaged gradients with one `all_reduce` per parameter, after `backward()`. DDP is
# built on three ideas:
#
# 1. **Flat**: a call costs time of its own, its latency, besides the time its bytes take. So send
#    all gradients in *one* flat buffer instead of 8, or hundreds of, small tensors.
# 2. **Buckets**: cut that buffer into buckets of about 25 MiB, in the order backward produces
#    gradients.
# 3. **Overlap**: start each bucket's `all_reduce` **while backward is still running**. Wait for
#    them at the end of `backward()`; our own version below waits in its `average()`.
#
# We build each idea in turn, prove that it gives DDP's result, and time it on this machine, a CPU
# with gloo. The code lives in `gst.averaging` (`gradsync_tutorial/averaging.py`), so this notebook,
# the benchmark and the tests run the same code.
#
# What it shows: idea 1 pays off here, where the steps are short. Per-parameter averaging pays 8
# latencies a step, one flat buffer one. Idea 2 matters for memory and for overlap, not for speed on
# this small model. Idea 3 does not pay here, for DDP as for our own version. On a CPU the
# communication runs on the same cores as backward, so it cannot run *beside* it. On GPUs it can:
# the interconnect moves the bytes while the GPU computes. That is where DDP's gain is expected. In
# PyTorch's own words: "DDP's performance advantage comes from overlapping allreduce collectives
# with computations during backwards"
# ([DDP notes](https://docs.pytorch.org/docs/stable/notes/ddp.html)). This notebook does not measure
# that: every output below ran on CPUs.
#
# Then come DDP's knobs, the numerics of dividing before or after summing, and a ring of
# `send`/`recv`.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # set it to 1 for a short run (the tests do)
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5
EPOCHS = 1
# The images each training run below uses: every variant's equality with DDP is an identity,
# which a few thousand images prove as well as 60,000. (The benchmark times single steps.)
N_TRAIN = 4096 if SMOKE_TEST else 12_288

import inspect
import runpy
import statistics
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from IPython.display import Markdown
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_tutorial as gst


def show(obj):
    """Display the source of a `gst.averaging` function: the code every cell below runs."""
    return Markdown(f"```python\n{inspect.getsource(obj)}```")  # highlighted, stored once


# %% [markdown]
# ## Where the time goes: latency, then bandwidth
#
# Time one `all_reduce` of n floats, for n from 1 to millions. The usual model of a collective is
# **time ≈ α + β · bytes**. The *latency* α is what a call costs whatever its size: starting it, and
# the ranks' messages finding each other. The time per byte β is the inverse of the bandwidth. Below
# some size α dominates; above it, β · bytes does.

# %%
def time_all_reduce(rank, world_size, sizes):
    device = gst.local_device()
    for _ in range(20):  # warm-up: the first calls set up connections and buffers
        dist.all_reduce(torch.zeros(1, device=device))
    medians = {}
    for n in sizes:
        t = torch.zeros(n, device=device)
        dist.all_reduce(t)  # warm-up for this size
        times = []
        for _ in range(100 if n <= 100_000 else 10):  # back to back: each call syncs the ranks
            start = time.perf_counter()
            dist.all_reduce(t)
            if t.is_cuda:
                torch.cuda.synchronize()  # nccl returns before the work is done
            times.append(time.perf_counter() - start)
        medians[n] = statistics.median(times) * 1e3  # ms; the median ignores rare hiccups
    return medians


SIZES = [10**k for k in range(6 if SMOKE_TEST else 8)]  # 1 ... 10 million floats

# %%
ms = gst.launch(time_all_reduce, world_size=WORLD_SIZE, args=(SIZES,))[0]
for n, t in ms.items():
    print(f"all_reduce of {n:>10,} floats ({4 * n / 1e6:9.6f} MB): {t:7.3f} ms")

# %% [markdown]
# We estimate α and β from the two ends of these times. The latency α is the median time of the
# calls of at most 1,000 floats, whose bytes cost next to nothing. The time per byte β comes from
# the two largest calls, where the bytes are nearly all of it. Then how far each measurement is from
# the model:

# %%
t = torch.tensor(list(ms.values()), dtype=torch.float64)  # ms
mb = 4 * torch.tensor(list(ms), dtype=torch.float64) / 1e6  # float32: 4 bytes; 1 MB = 1e6 bytes
alpha = t[torch.tensor(list(ms)) <= 1000].median().item()  # ms: the latency
beta = ((t[-1] - t[-2]) / (mb[-1] - mb[-2])).item()  # ms per MB: the inverse bandwidth
model_ms = alpha + beta * mb
print(f"alpha = {alpha:.3f} ms, beta = {beta:.3f} ms per MB ({1 / beta:.2f} GB/s); "
      f"alpha = beta x bytes at {alpha / beta * 1e6 / 4:,.0f} floats")
for n, measured, modelled in zip(ms, t.tolist(), model_ms.tolist(), strict=True):
    print(f"{n:>10,} floats: measured {measured:7.3f} ms, alpha + beta x bytes {modelled:7.3f} ms"
          f"  (measured / model {measured / modelled:.2f})")

# %% [markdown]
# How to read it: the model is a first approximation. For the large calls, measured / model shows
# how well one straight line (one bandwidth) fits them. The small calls scatter around α, from call
# to call and from run to run (each is a round trip between two processes). Below the crossover
# printed on the first line, most of a call's time is not spent moving bytes. The course's CNN has
# 21,840 parameters in 8 tensors; the largest, `fc1.weight`, holds 16,000 floats:

# %%
net = gst.model.Net()
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.loglog(list(ms), list(ms.values()), "o-", label=f"one all_reduce, {WORLD_SIZE} ranks")
for i, p in enumerate(net.parameters()):
    label = "the CNN's 8 tensors, one line each" if i == 0 else None
    ax.axvline(p.numel(), color="grey", lw=0.5, label=label)
ax.axvline(sum(p.numel() for p in net.parameters()), color="C1", label="CNN, all 8 tensors")
ax.loglog(list(ms), model_ms.tolist(), ":", color="C0", label="alpha + beta x bytes")
ax.set(xlabel="floats per call", ylabel="ms per call", title="all_reduce time vs size")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the data
plt.show()


# %% [markdown]
# What do 8 calls for the 8 tensors cost, against one call for all of them? We use the CNN's own
# gradients, with notebook 02's loop and with one flat buffer (both defined below). The calls are
# counted, and the times measured alternately. A bare `all_reduce` of one float is timed with them:

# %%
def time_averaging(rank, world_size, reps):
    device = gst.local_device()
    model = gst.model.Net().to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    one_float = torch.zeros(1, device=device)
    variants = {"per-parameter": lambda: gst.averaging.average_per_parameter(model),
                "flat": gst.averaging.FlatAverager(model),
                "one float": lambda: dist.all_reduce(one_float)}  # a bare round trip
    calls = {}
    for name, average in variants.items():  # once, counted
        with gst.detect.count_collectives() as counter:
            average()
        calls[name] = counter.calls["all_reduce"]
    times = {name: [] for name in variants}
    for _ in range(reps):  # alternate the two, so that machine noise hits both alike
        for name, average in variants.items():
            start = time.perf_counter()
            average()
            if device.type == "cuda":
                torch.cuda.synchronize()  # nccl returns before the GPU has done the work
            times[name].append(time.perf_counter() - start)
    return calls, {name: statistics.median(t) * 1e3 for name, t in times.items()}


# %%
reps = 200  # a few seconds; with 20 (tried for the tests) the medians were too noisy to compare
calls, averaging_ms = gst.launch(time_averaging, world_size=WORLD_SIZE, args=(reps,))[0]
for name, t in averaging_ms.items():
    print(f"{name:>13}: {calls[name]} all_reduce calls, {t:.2f} ms per step (median)")
print(f"per-parameter / flat: {averaging_ms['per-parameter'] / averaging_ms['flat']:.1f}x the time")

# %%
assert calls == {"per-parameter": 8, "flat": 1, "one float": 1}  # the same bytes, in 8 calls or 1
assert averaging_ms["per-parameter"] > 2 * averaging_ms["flat"]  # 7 more latencies a step

# %% [markdown]
# The ratio can exceed the 8 calls: each call costs more than a bare round trip. It also pays
# Python, torch's dispatch and its own division by N. Compare with the one-float call, timed alongside:

# %%
per_call = averaging_ms["per-parameter"] / calls["per-parameter"]
print(f"per-parameter: {per_call:.2f} ms per call, "
      f"against {averaging_ms['one float']:.2f} ms for one float")
assert per_call > averaging_ms["one float"]  # a call is more than its latency

# %% [markdown]
# ## 1. Per parameter: notebook 02's loop
#
# The reference, and the slow case: one call per parameter, after backward.

# %%
show(gst.averaging.average_per_parameter)

# %% [markdown]
# ## 2. One flat buffer
#
# Copy every gradient into one buffer, reduce it in one call, and copy each piece back into its
# `.grad`, divided by N. A `Bucket` holds the buffer and, for each parameter, a view of its slot
# (`split` + `view_as`), so that both copies are plain `copy_` calls:

# %%
show(gst.averaging.Bucket)

# %%
show(gst.averaging.FlatAverager)

# %% [markdown]
# Why keep the buffer instead of a fresh `torch.cat(...)` every step? On the CPU, for a large model,
# the fresh buffer is memory new to the process. Each of its pages faults and is zeroed on first
# touch, which can cost more than the copy itself. Here for 40 MB, the gradients of a 10M-parameter
# model. The operating system counts the page faults; a count does not depend on how busy the
# machine is. The times show what they cost here.
#
# On a GPU the argument is another one. Per PyTorch's
# [CUDA notes](https://docs.pytorch.org/docs/stable/notes/cuda.html#cuda-memory-management),
# "PyTorch uses a caching memory allocator to speed up memory allocations". So a fresh buffer
# usually reuses memory. DDP keeps its buckets anyway, for `gradient_as_bucket_view` among others
# (below).

# %%
try:
    import resource  # Linux and macOS: the process's page-fault counter
except ImportError:  # Windows
    resource = None


def page_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


grads = [torch.randn(2048, 2048) for _ in range(2)] + [torch.randn(1_600_000)]  # 10M floats
buffer = torch.empty(sum(g.numel() for g in grads))
torch.cat([g.flatten() for g in grads], out=buffer)  # the kept buffer: touched once, here
copy_ms = {"fresh torch.cat": [], "into a kept buffer": []}
faults = {"fresh torch.cat": [], "into a kept buffer": []}
for _ in range(5):
    for name, out in [("fresh torch.cat", None), ("into a kept buffer", buffer)]:
        before, start = page_faults(), time.perf_counter()
        torch.cat([g.flatten() for g in grads], out=out)
        copy_ms[name].append((time.perf_counter() - start) * 1e3)
        faults[name].append(page_faults() - before)
copy_ms = {name: statistics.median(t) for name, t in copy_ms.items()}
faults = {name: min(f) for name, f in faults.items()}
for name in copy_ms:
    print(f"{name:>18}: {copy_ms[name]:5.1f} ms, {faults[name]:6,} page faults")

# %%
pages = buffer.numel() * buffer.element_size() // 4096  # 4-KB pages
if resource:  # every step, the fresh buffer faults its pages in again; the kept one never does
    assert faults["fresh torch.cat"] >= 10 * (faults["into a kept buffer"] + 1)
    print(f"fresh buffer: {faults['fresh torch.cat']:,} page faults a step "
          f"({pages:,} pages of 4 KB in 40 MB); kept buffer: {faults['into a kept buffer']}")
slower = copy_ms["fresh torch.cat"] / copy_ms["into a kept buffer"]
print(f"what it costs on this machine: a fresh buffer every step is {slower:.1f}x the time")

# %% [markdown]
# ## 3. Buckets
#
# One flat buffer for every gradient is a second copy of them: for a 10-GB model, 10 GB more. It
# could only be sent after the *whole* backward. So DDP cuts the parameters into buckets of about `bucket_cap_mb` (25 MiB by
# default). It fills them **last layer first**, since backward produces the last layer's gradients
# first.

# %%
show(gst.averaging.make_buckets)

# %%
show(gst.averaging.BucketedAverager)

# %% [markdown]
# At the default 25 MiB the whole CNN (85 KiB of gradients) is one bucket. To see several buckets on
# this small model, we use a tiny cap of 0.015 MiB (15.4 KiB) from here on:

# %% tags=["nbval-check-output"]
BUCKET_CAP_MB = 0.015
names = {p: name for name, p in net.named_parameters()}
buckets = gst.averaging.make_buckets(net.parameters(), BUCKET_CAP_MB)
for i, bucket in enumerate(buckets):
    kib = sum(p.numel() * p.element_size() for p in bucket) / 1024
    print(f"bucket {i}: {kib:5.1f} KiB  {[names[p] for p in bucket]}")
assert len(gst.averaging.make_buckets(net.parameters())) == 1  # default cap: one bucket
assert [names[p] for p in buckets[0]] == ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]


# %% [markdown]
# DDP's own buckets follow this rule with two differences, which a communication hook (see "DDP's
# knobs") lets us watch bucket by bucket:
#
# * In the **first iteration**, DDP puts every parameter in **one** bucket. After it, DDP
#   **rebuilds** the buckets in the order the gradients really arrived, and keeps them.
# * With `bucket_cap_mb` left at its default, the rebuilt **first bucket** is capped at **1 MiB**
#   (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`). It holds the gradients that arrive first, so
#   that communication starts early. The other buckets hold 25 MiB. Passing `bucket_cap_mb=25`
#   explicitly caps every bucket at 25 MiB.
#
# On a stack of 30 layers whose weights take 1 MiB each:

# %%
def ddp_buckets(rank, world_size, bucket_cap_mb, iterations=3):
    torch.manual_seed(SEED)
    device = gst.local_device()
    layers = nn.Sequential(*[nn.Linear(512, 512) for _ in range(30)]).to(device)  # 30 x 1 MiB
    ddp = DDP(layers) if bucket_cap_mb is None else DDP(layers, bucket_cap_mb=bucket_cap_mb)
    sizes = []  # for each iteration, each bucket's MiB, in the order DDP reduces them

    def record(process_group, bucket):  # a hook that notes the bucket, then all-reduces it
        sizes[-1].append(bucket.buffer().numel() * bucket.buffer().element_size() / 2**20)
        return default_hooks.allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, record)
    x = torch.randn(8, 512, device=device)
    for _ in range(iterations):
        sizes.append([])
        ddp(x).sum().backward()
    return sizes


# %%
first_bucket = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES / 2**20
ddp_sizes = {cap: gst.launch(ddp_buckets, WORLD_SIZE, args=(cap,))[0] for cap in (None, 25)}
for cap, sizes in ddp_sizes.items():
    print(f"bucket_cap_mb={cap}:" if cap else "default:")
    for i, iteration in enumerate(sizes, 1):
        mib = ", ".join(f"{size:.2f}" for size in iteration)
        print(f"  iteration {i}: {len(iteration)} bucket(s) of {mib} MiB")
default, explicit = ddp_sizes[None], ddp_sizes[25]
assert len(default[0]) == len(explicit[0]) == 1  # iteration 1: one bucket of everything
assert default[1] == default[2] and explicit[1] == explicit[2]  # rebuilt once, then kept
assert first_bucket == 1.0 and 1.0 <= default[1][0] < 1.01  # a first bucket of one layer
assert [round(size) for size in default[1]] == [1, 25, 4]  # 1 layer, 25 layers, the last 4
assert [round(size) for size in explicit[1]] == [25, 5]

# %% [markdown]
# A bucket closes as soon as it holds at least its cap, so each holds a little more: a bias, or a
# tensor larger than the cap.
#
# The rebuild also explains a resume on more than 2 ranks (notebook 06). A resumed DDP run can
# differ in the last bits from one that never stopped. Its first iteration reduces one bucket, where
# the straight run reduced the rebuilt ones. On more than 2 ranks, another split changes the last
# bits of some sums (measured below, "per parameter and in one flat buffer").

# %% [markdown]
# ## 4. Overlap: a mini DDP
#
# Buckets pay off once a bucket's `all_reduce` can start as soon as its gradients exist. Backward
# then goes on computing the earlier layers meanwhile. PyTorch calls a hook registered with
# `param.register_post_accumulate_grad_hook(hook)` the moment `param.grad` is final. The hook copies
# the gradient into its bucket's buffer. When the bucket is full, the hook launches the bucket's
# `all_reduce` with `async_op=True`, which returns at once with a handle. After `loss.backward()`,
# `wait()` waits on the handles, divides, and copies the means back.
#
# One rule matters: every rank must issue the same collectives **in the same order**. The averager
# launches buckets strictly in bucket order, as DDP does: a full bucket waits until the buckets
# before it are launched. Then the calls match even if the gradients arrived in another order on
# some rank, after a branch that depends on the data, say.
#
# Launching each gradient the moment it is ready is also safe; the exercise at the end does it. But
# it is safe only because the graph fixes backward's order. The same model and code give the same
# order on every rank, at every step:

# %%
def gradient_order(rank, world_size, steps=2):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device)
    names = {p: name for name, p in model.named_parameters()}
    order = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[p]))
    images, labels = gst.data.load(train=True)
    for step in range(steps):  # other samples on every rank and at every step
        idx = torch.arange(64)[rank::world_size] + 64 * step
        F.nll_loss(model(images[idx].to(device)), labels[idx].to(device)).backward()
    return order


orders = gst.launch(gradient_order, world_size=WORLD_SIZE)
n_params = len(list(net.parameters()))
print("the order in which gradients are ready:", orders[0][:n_params])
assert all(order == orders[0] for order in orders)  # the same on every rank...
assert orders[0][:n_params] == orders[0][n_params:]  # ...and at every step

# %% [markdown]
# `conv2.weight`'s gradient is ready before `conv2.bias`'s, although `make_buckets` lists them the
# other way round. Backward's order is not exactly the reverse of the parameters'. That is why DDP
# rebuilds its buckets from the order it observed.

# %%
show(gst.averaging.OverlappedAverager)


# %% [markdown]
# Does communication really start during backward? A probe on `conv1.weight`, the last gradient that
# backward computes, counts the buckets already launched when it arrives:

# %% tags=["nbval-check-output"]
def overlap_probe(rank, world_size, cap):
    torch.manual_seed(SEED)
    device = gst.local_device()  # the averager's buckets take the parameters' device
    model = gst.model.Net().to(device)
    averager = gst.averaging.OverlappedAverager(model, bucket_cap_mb=cap)
    launched = {}

    def probe(grad):  # runs when conv1.weight's gradient has been computed, before the copy
        launched["before conv1.weight's gradient"] = len(averager.works)

    model.conv1.weight.register_hook(probe)
    images, labels = gst.data.load(train=True)
    F.nll_loss(model(images[:64].to(device)), labels[:64].to(device)).backward()
    launched["when backward() returns"] = len(averager.works)
    averager.wait()
    return launched | {"buckets": len(averager.buckets)}


probe = gst.launch(overlap_probe, world_size=WORLD_SIZE, args=(BUCKET_CAP_MB,))[0]
for moment, n in probe.items():
    print(f"{moment}: {n}")
assert probe["before conv1.weight's gradient"] == probe["buckets"] - 1  # all but conv1's bucket
assert probe["when backward() returns"] == probe["buckets"]

# %% [markdown]
# ## Every variant gives DDP's result
#
# The training loop of notebook 02, with the lines being taught changed. `gst.averaging.prepare`
# returns the module to call: `model` itself, or DDP's wrapper. It also returns the averaging to run
# between `backward()` and `step()`; that is nothing for DDP, which averages inside `backward()`.

# %%
show(gst.averaging.prepare)


# %% tags=["training-loop"]
def train(rank, world_size, variant, epochs, options=None, comm_hook=None):
    torch.manual_seed(SEED)  # same seed on every rank: the replicas start identical
    device = gst.local_device()  # cuda:LOCAL_RANK with a GPU per rank, else the CPU
    model = gst.model.Net().to(device)
    net, average = gst.averaging.prepare(model, variant, **(options or {}))  # new
    if comm_hook is not None:  # DDP only: replaces its all_reduce (see "DDP's knobs")
        net.register_comm_hook(None, comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    images, labels = images[:N_TRAIN], labels[:N_TRAIN]
    batch_size = GLOBAL_BATCH // world_size  # each rank's share of the global batch
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED + epoch))
        shard = order[rank::world_size]  # this rank's 1/N of the data
        model.train()
        for start in range(0, len(shard), batch_size):
            idx = shard[start : start + batch_size]
            x, y = images[idx].to(device), labels[idx].to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(net(x), y)  # new: net, DDP's wrapper for "ddp"
            loss.backward()  # "overlap" and "ddp" start averaging in here
            average()  # new: this variant's averaging; every rank now holds the mean gradient
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


# %% [markdown]
# One epoch with each variant, all with the small bucket cap (DDP too). So bucketed, overlapped and
# DDP averaging each make 3 calls per step. How long each takes is the job of the benchmark below,
# which times them side by side.

# %%
runs = {}
for variant in gst.averaging.VARIANTS:
    runs[variant] = gst.launch(train, world_size=WORLD_SIZE,
                               args=(variant, EPOCHS, {"bucket_cap_mb": BUCKET_CAP_MB}))

# %%
steps = len(runs["ddp"][0]["losses"])
print(f"after {steps} steps on {WORLD_SIZE} ranks:")
for variant, results in runs.items():
    state, ddp_state = results[0]["state"], runs["ddp"][0]["state"]
    vs_ddp = gst.checks.compare_state_dicts(state, ddp_state, show=False)
    between_ranks = gst.checks.compare_ranks([r["state"] for r in results], show=False)
    print(f"{variant:>13}: max |variant - DDP| = {vs_ddp:.1e}, "
          f"max difference between ranks = {between_ranks}")
    assert vs_ddp <= 1e-4 and between_ranks == 0.0
    assert vs_ddp == 0.0 or WORLD_SIZE > 2  # bit-identical with 2 ranks

# %% [markdown]
# With 2 ranks the parameters are bit-identical to DDP's. A sum of 2 numbers does not depend on
# their order, and DDP's multiplication by 1/2 is exact (see "Divide, then sum" below). With more
# ranks, gloo adds the N numbers in an order that depends on where each one sits in the buffer. Each
# variant lays the gradients out differently, so the last bits can differ. Against manual averaging,
# notebook 03 finds a second cause: DDP scales by 1/N before the sum. One `all_reduce` of the CNN's gradients, per parameter and
# in one flat buffer, on 2, 3 and 4 ranks:

# %%
def per_parameter_vs_flat(rank, world_size):
    torch.manual_seed(rank)  # each rank its own gradients
    grads = [torch.randn_like(p, device=gst.local_device()) for p in gst.model.Net().parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    for g in grads:
        dist.all_reduce(g)  # per parameter
    dist.all_reduce(flat)  # one flat buffer
    per_parameter = torch.cat([g.flatten() for g in grads])
    return (per_parameter != flat).sum().item(), (per_parameter - flat).abs().max().item()


for n in (2, 3, 4):
    differ, largest = gst.launch(per_parameter_vs_flat, world_size=n)[0]
    print(f"{n} ranks: {differ:,} of 21,840 sums differ in the last bits (max {largest:.1e})")
    assert (differ == 0) if n == 2 else largest <= 1e-5

# %% [markdown]
# ## Measured: the step time of each variant against DDP's
#
# `benchmarks/averaging.py` times whole training steps: forward, backward, averaging and step. It
# runs every variant and DDP in one launch, on the same batches, interleaved round by round. It does
# so for the CNN and for an MLP with 10 million parameters, whose 40 MB of gradients make bandwidth
# count too. Every rank runs one thread, and every variant uses DDP's default 25 MiB buckets. A
# "compute only" line, which does not average at all, shows what a step costs without any
# communication. This cell runs it as `python benchmarks/averaging.py` does, with fewer timed
# rounds: 8 for the CNN and 12 for the MLP, against the script's 24 and 48:

# %%
bench = runpy.run_path("../benchmarks/averaging.py")  # the benchmark script's functions
ROUNDS = {"cnn": 8, "mlp": 12}  # timed rounds of every variant, interleaved
rows = bench["run"](world_sizes=(WORLD_SIZE,) if SMOKE_TEST else (2, 4), models=("cnn", "mlp"),
                    rounds=None if SMOKE_TEST else ROUNDS, goals=False)

# %%
def middle_half(ms):  # the table's "middle 50%": the first and third quartiles
    return statistics.quantiles(ms if len(ms) > 1 else ms * 2, n=4)[::2]


cases = sorted({(r["model"], r["ranks"]) for r in rows}, key=lambda c: (c[1], c[0]))
row = {(r["model"], r["ranks"], r["name"]): r for r in rows}
fig, ax = plt.subplots(figsize=(9, 3.8))
names = [name for name in gst.averaging.VARIANTS if name != "ddp"] + ["compute only"]
width = 0.8 / len(names)
ddp_ms = torch.tensor([row[(*c, "ddp")]["ms"] for c in cases])  # DDP's median, per case
for i, name in enumerate(names):
    xs = [k + (i - len(names) / 2 + 0.5) * width for k in range(len(cases))]
    ax.bar(xs, [row[(*c, name)]["ratio"] for c in cases], width, label=name,
           color="lightgrey" if name == "compute only" else None)
    q1, q3 = torch.tensor([middle_half(row[(*c, name)]["ms_all"]) for c in cases]).T
    ax.vlines(xs, q1 / ddp_ms, q3 / ddp_ms, color="black", lw=0.8)  # its middle 50%
ax.axhline(1.0, color="black", lw=0.8, label="DDP")
ax.set_xticks(range(len(cases)), [f"{m}, {n} ranks" for m, n in cases])
ax.set(ylabel="step time / DDP's", title="Step time relative to DDP's (lower is faster)")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %%
assert {r["name"] for r in rows} == {*names, "ddp"}
assert all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)
print("all_reduce calls per step:")
for model, n in cases:
    calls = {r["name"]: r["calls"] for r in rows if (r["model"], r["ranks"]) == (model, n)}
    print(f"  {model}, {n} ranks: {calls}")
assert all(r["calls"] == 8 for r in rows if r["name"] == "per-parameter")
assert all(r["calls"] == 1 for r in rows if r["name"] == "flat")

# %% [markdown]
# How to read it: your numbers will differ from the ones above, which depend on the machine and on
# its load. The "vs ddp" ratios are measured side by side, so they vary less. In the plot, DDP is
# the black line at 1. Each whisker spans the middle 50% of that variant's step times, divided by
# DDP's median: the table's "middle 50%" column.
#
# * The distance from a variant to **compute only** is what its communication costs per step.
# * **Per-parameter** pays 7 latencies a step more than flat. That shows where the step is short, as
#   for the CNN. For the MLP the 40 MB dominate, and 8 calls cost about what one costs.
# * **Flat**, **bucketed** and **overlap** make one or two calls a step, as DDP does. On this
#   machine they take about DDP's time, within the noise of the measurement.
# * **Overlap** hides communication behind backward only if something else moves the bytes while
#   backward computes. On a CPU with one core per rank, gloo's communication thread has to share
#   that core with backward (our reading of the timings, not measured apart). So overlapping, DDP's
#   included, saves nothing here. That is why a
#   variant that does not overlap can match or beat DDP on this machine. On GPUs the interconnect
#   moves the bytes while the GPU computes (PyTorch's DDP notes, quoted at the top). That is
#   expected, not measured here.
#
# ## DDP's knobs
#
# DDP's constructor and hooks expose the ideas above as settings. They are measured on the MLP,
# where they matter, on 2 ranks:
#
# * `bucket_cap_mb` (default 25): smaller buckets can start communicating earlier, but pay more
#   latencies. Larger ones pay fewer, but start later.
# * `gradient_as_bucket_view=True`: `.grad` becomes a view into its bucket. Its documentation says:
#   "This can reduce peak memory usage, where the saved memory size will be equal to the total
#   gradients size. Moreover, it avoids the overhead of copying between gradients and `allreduce`
#   communication buckets." The views are checked below.
# * A **communication hook** replaces DDP's `all_reduce` by any function of the bucket; notebook 03
#   wrote one. The documented `fp16_compress_hook` sends float16: half the bytes, but fewer digits.
#   [Notebook 09](09_precision_of_the_sum.ipynb) shows what low precision does to the mean as the
#   number of ranks grows, and bfloat16's hook.

# %%
show(default_hooks.fp16_compress_hook)

# %%
knobs = {
    "ddp": {"variant": "ddp"},
    "bucket_cap_mb=1": {"variant": "ddp", "bucket_cap_mb": 1},
    "bucket_cap_mb=5": {"variant": "ddp", "bucket_cap_mb": 5},
    "bucket_cap_mb=100": {"variant": "ddp", "bucket_cap_mb": 100},
    "gradient_as_bucket_view": {"variant": "ddp", "gradient_as_bucket_view": True},
    "fp16_compress_hook": {"variant": "ddp", "hook": "fp16"},
}
knob_rows = bench["run"](world_sizes=(WORLD_SIZE,), models=("mlp",), specs=knobs,
                         rounds=None if SMOKE_TEST else ROUNDS, goals=False)

# %% [markdown]
# How to read it: with one core per rank nothing overlaps (see above), so the bucket size changes
# little here. The float16 hook halves the bytes sent. But it adds two conversions, float32 to
# float16 before sending and back after, and gloo sums float16 on the CPU. Each of them is timed on
# 10 million floats, against a float32 sum:

# %%
a32, b32 = torch.randn(10_000_000), torch.randn(10_000_000)
a16, b16 = a32.half(), b32.half()
work = {"to float16": lambda: a32.half(), "back to float32": lambda: a16.float(),
        "float16 sum": lambda: torch.add(a16, b16), "float32 sum": lambda: torch.add(a32, b32)}
work_ms = {name: [] for name in work}
for _ in range(5):  # alternated, so that machine noise hits all alike
    for name, do in work.items():
        start = time.perf_counter()
        do()
        work_ms[name].append((time.perf_counter() - start) * 1e3)
work_ms = {name: statistics.median(t) for name, t in work_ms.items()}
for name, t in work_ms.items():
    print(f"{name:>15}: {t:5.1f} ms")
conversions = work_ms["to float16"] + work_ms["back to float32"]
print(f"the two conversions: {conversions:.1f} ms, "
      f"{conversions / work_ms['float32 sum']:.1f}x a float32 sum of the same floats")
assert all(t > 0 for t in work_ms.values())

# %% [markdown]
# Whether half the bytes pay for the two conversions depends on the link and on the hardware. The
# `fp16_compress_hook` line of the table above is what it came to on this machine. And
# `gradient_as_bucket_view=True` does make every `.grad` a view into DDP's bucket, one block of
# memory for all of them:

# %%
def gradient_storage(rank, world_size, as_view):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = DDP(gst.model.Net().to(device), gradient_as_bucket_view=as_view)
    images, labels = gst.data.load(train=True)
    x, y = images[:16].to(device), labels[:16].to(device)  # inputs on the model's device
    for _ in range(2):  # "gradients will be views after first iteration" (its documentation)
        model.zero_grad()
        F.nll_loss(model(x), y).backward()
    return len({p.grad.untyped_storage().data_ptr() for p in model.parameters()})

storages = {view: gst.launch(gradient_storage, WORLD_SIZE, args=(view,))[0]
            for view in (False, True)}
print(f"distinct blocks of memory holding the 8 gradients: {storages[False]} by default, "
      f"{storages[True]} with gradient_as_bucket_view=True (DDP's one bucket)")
assert storages == {False: 8, True: 1}

# %% [markdown]
# Do the knobs change the result? Buckets only move the same numbers around. So do the views here,
# with the plain `zero_grad()` of this loop; "Divide, then sum" below shows when they do not. The
# float16 hook rounds every gradient to float16's 11 bits of precision, about 3 significant digits,
# before sending it (notebook 09 prints the formats' bits):

# %%
ddp_state = runs["ddp"][0]["state"]  # small buckets, see above
knob_runs = {
    "bucket_cap_mb=25 (default)": gst.launch(train, world_size=WORLD_SIZE, args=("ddp", EPOCHS)),
    "gradient_as_bucket_view": gst.launch(
        train, world_size=WORLD_SIZE, args=("ddp", EPOCHS, {"gradient_as_bucket_view": True})),
    "fp16_compress_hook": gst.launch(
        train, world_size=WORLD_SIZE, args=("ddp", EPOCHS, None, default_hooks.fp16_compress_hook)),
}

# %%
knob_diffs = {}
for name, results in knob_runs.items():
    knob_diffs[name] = gst.checks.compare_state_dicts(results[0]["state"], ddp_state, show=False)
    print(f"{name:>27}: max |knob - DDP| after {steps} steps = {knob_diffs[name]:.1e}")
assert knob_diffs["bucket_cap_mb=25 (default)"] <= 1e-4
assert knob_diffs["gradient_as_bucket_view"] <= 1e-4
assert knob_diffs["fp16_compress_hook"] > 10 * max(knob_diffs["gradient_as_bucket_view"], 1e-7)

# %% [markdown]
# ## Divide, then sum, or sum, then divide?
#
# Our variants sum, then divide by N (notebook 02). DDP multiplies each gradient by 1/N while
# copying it into its bucket, *before* summing. With `gradient_as_bucket_view=True` and the
# gradients zeroed in place, the gradient already is the bucket. DDP then divides it in place by N,
# also before summing. `fp16_compress_hook` above divides before summing too. In exact arithmetic
# these are equal. In floating point:
#
# * Multiplying by 1/2 or 1/4 only changes the exponent, so it is exact, and the two orders give
#   bit-identical results. 1/3 is rounded, so they can differ in the last bit.

# %%
g = torch.randn(3, 100_000, generator=torch.Generator().manual_seed(SEED))  # 3 ranks' gradients
for n in (2, 3, 4):
    grads = list(g.repeat(2, 1)[:n])  # n ranks' gradients
    sum_then_divide = sum(grads) / n  # our variants
    divide_then_sum = sum(x * (1 / n) for x in grads)  # DDP
    d = (sum_then_divide - divide_then_sum).abs().max().item()
    print(f"N={n}: max |sum/N - sum(x * 1/N)| = {d:.1e}, elements that differ: "
          f"{(sum_then_divide != divide_then_sum).float().mean():.1%}")
    assert (d == 0) == (n in (2, 4))


# %% [markdown]
# * For the same reason, `gradient_as_bucket_view=True` can change the last bits on 3 ranks.
#   `x * (1/3)` (the default) and `x / 3` (the in-place division) round differently. It does so when
#   the gradients are zeroed in place, `zero_grad(set_to_none=False)`. With plain `zero_grad()`,
#   which sets them to `None`, the bits are the default's. Two steps of DDP on the same batches,
#   against the default:

# %%
def ddp_gradients(rank, world_size, as_view, set_to_none=True):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = DDP(gst.model.Net().to(device), gradient_as_bucket_view=as_view)
    images, labels = gst.data.load(train=True)
    idx = torch.arange(64)[rank::world_size]  # this rank's samples
    x, y = images[idx].to(device), labels[idx].to(device)
    for _ in range(2):  # the views begin after the first iteration
        model.zero_grad(set_to_none=set_to_none)
        F.nll_loss(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()


view_differ = {}
for n in (2, 3):
    default = gst.launch(ddp_gradients, n, args=(False,))[0]
    for set_to_none in (True, False):
        views = gst.launch(ddp_gradients, n, args=(True, set_to_none))[0]
        view_differ[n, set_to_none] = (default != views).sum().item()
        print(f"N={n}, views, zero_grad(set_to_none={set_to_none}): "
              f"{view_differ[n, set_to_none]:,} of {default.numel():,} mean gradients differ "
              f"from the default's, max |difference| {(default - views).abs().max():.1e}")
        assert torch.allclose(default, views, rtol=1e-5, atol=1e-7)  # the same mean
assert view_differ == {(2, True): 0, (2, False): 0, (3, True): 0, (3, False): view_differ[3, False]}
assert view_differ[3, False] > 0  # x / 3 against x * (1/3): other last bits


# %% [markdown]
# * In float16 the order matters much more. The largest float16 is 65,504, so summing first
#   overflows to `inf` where dividing first does not. Dividing first turns tiny gradients into zeros
#   where summing first does not. Here with real `all_reduce` calls in float16; notebook 09 goes on
#   from here:

# %% tags=["nbval-check-output"]
def fp16_orders(rank, world_size):
    grad = torch.tensor([40_000.0, 2**-24, 1.0], dtype=torch.float16)  # large, the tiniest, 1
    sum_first = grad.clone().to(gst.local_device())
    dist.all_reduce(sum_first)
    sum_first /= world_size
    divide_first = grad.clone().to(gst.local_device()) / world_size  # what the fp16 hook does
    dist.all_reduce(divide_first)
    return {"sum, then divide": sum_first.tolist(), "divide, then sum": divide_first.tolist(),
            "exact mean": grad.tolist()}  # every rank holds the same values here


orders = gst.launch(fp16_orders, world_size=WORLD_SIZE)[0]
for name, values in orders.items():
    print(f"{name:>17}: {values}")
assert orders["sum, then divide"][0] == float("inf") and orders["divide, then sum"][0] == 40_000
assert orders["sum, then divide"][1] > 0 and orders["divide, then sum"][1] == 0

# %% [markdown]
# ## Inside `all_reduce`: a ring of `send` and `recv`
#
# How does `all_reduce` sum a tensor over N ranks? The classic algorithm, the **ring**, only ever
# talks to neighbours. Each rank cuts its tensor into N chunks. It passes one chunk to the right N-1
# times, adding the chunk arriving from the left (*reduce-scatter*). It then passes the finished
# chunks around N-1 more times (*all-gather*). Real libraries have several algorithms. The
# [documentation](https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-algo) of
# NCCL's `NCCL_ALGO` lists Ring, Tree, CollnetChain, CollnetDirect, NVLS, NVLSTree and PAT. By
# default NCCL chooses "based on the node topology and architecture".

# %%
show(gst.averaging.ring_all_reduce)


# %% [markdown]
# It equals `dist.all_reduce` for any number of ranks and any size, even one the number of ranks
# does not divide. Integer-valued floats are summed exactly in any order, so there the results must
# be equal bit for bit. Random floats may differ in the last bits, since the ring adds in a
# different order from gloo's algorithm. Each rank also counts the bytes it sends:

# %%
def ring_vs_all_reduce(rank, world_size, size):
    generator = torch.Generator().manual_seed(rank)
    out = {}
    for kind, t in [("integers", torch.randint(-1000, 1000, (size,), generator=generator).float()),
                    ("random floats", torch.randn(size, generator=generator))]:
        t = t.to(gst.local_device())  # nccl's send, recv and all_reduce take GPU tensors only
        ring, reference = t.clone(), t.clone()
        out["sent"] = gst.averaging.ring_all_reduce(ring)
        dist.all_reduce(reference)
        out[kind] = (ring - reference).abs().max().item()
    return out


SIZE = 21_840 + 1  # the CNN's gradients, plus one: no N from 2 to 4 divides it
ring_rows = {n: gst.launch(ring_vs_all_reduce, world_size=n, args=(SIZE,)) for n in (2, 3, 4)}

# %%
size_bytes = 4 * SIZE
print(f"tensor: {SIZE:,} floats = {size_bytes:,} bytes")
for n, results in ring_rows.items():
    sent = [r["sent"] for r in results]
    optimal = 2 * (n - 1) / n * size_bytes
    print(f"N={n}: |ring - all_reduce| integers {max(r['integers'] for r in results)}, "
          f"floats {max(r['random floats'] for r in results):.1e}; bytes sent per rank {sent}, "
          f"mean {sum(sent) / n:,.0f} = 2(N-1)/N x size = {optimal:,.0f}")
    assert all(r["integers"] == 0 for r in results)
    assert all(r["random floats"] <= 1e-4 for r in results)
    assert sum(sent) == 2 * (n - 1) * size_bytes  # the mean is exactly 2(N-1)/N x size
    assert max(sent) - min(sent) <= 2 * (n - 1) * 4  # chunks differ by at most one float


# %% [markdown]
# Each rank sends 2(N−1)/N times the tensor: 1× for 2 ranks, 1.5× for 4, never more than 2×. Among
# algorithms in which the ranks do the additions themselves, none can send less. NCCL's tests say
# why: each element needs "2(n-1) data transfers", over n links, "independent of the algorithm used
# (ring, tree, or other) as long as they use point-to-point operations"
# ([nccl-tests](https://github.com/NVIDIA/nccl-tests/blob/03a204a1f38aaea17f1a777885bb2d9600ba7eff/doc/PERFORMANCE.md)).
# That is why the ring is *bandwidth*-optimal. Hardware that adds in the network changes the count. The same NCCL
# page says: "NVLS and NVLSTree enable NVLink SHARP offload". NVLink SHARP lets the NVLink switch
# inside a machine do the additions. An NCCL maintainer calls it "an AllReduce offload system over
# NVLink only" ([NVIDIA/nccl#1031](https://github.com/NVIDIA/nccl/issues/1031)). CollNet is the same
# idea between machines: the network's switches add (InfiniBand's SHARP), through a plugin that
# NVIDIA describes as "switch-based collectives"
# ([HPC-X](https://docs.nvidia.com/networking/display/hpcxv226/NCCL-RDMA-SHARP-Plugins)). The ring's
# price is 2(N−1) steps, each with its own latency. For small tensors that latency is the cost,
# which is where this notebook started.
#
# ## Copy this into your code
#
# Use DDP (notebook 03): it buckets, overlaps, and is tested. If you must average by hand, make
# **one** call per step, not one per parameter, as `FlatAverager` does. The script
# `snippets/05_flat_averager.py` checks it against notebook 02's loop. The course's tests run it
# with `torchrun --standalone --nproc-per-node 2`:
#
# <!-- snippets/05_flat_averager.py -->
# ```python
# """Notebook 05, copy this into your code: one all_reduce per step for all the gradients.
#
#     torchrun --standalone --nproc-per-node 2 snippets/05_flat_averager.py
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
#
# class FlatAverager:  # average = FlatAverager(model); ...; loss.backward(); average()
#     def __init__(self, model, reduce_dtype=None):  # a bf16 model: reduce_dtype=torch.float32
#         self.params = [p for p in model.parameters() if p.requires_grad]
#         first = self.params[0]                 # the buffer: the gradients' device (and dtype)
#         if any(p.dtype != first.dtype or p.device != first.device for p in self.params):
#             raise TypeError("one buffer holds one dtype on one device: one averager per group")
#         sizes = [p.numel() for p in self.params]
#         self.buffer = torch.empty(sum(sizes) + len(sizes),  # allocated once: the gradients,
#                                   dtype=reduce_dtype or first.dtype,  # then one count per
#                                   device=first.device)                # parameter
#         *pieces, self.counts = self.buffer.split([*sizes, len(sizes)])
#         self.slots = [s.view_as(p) for s, p in zip(pieces, self.params, strict=True)]
#
#     def __call__(self):
#         used = [p.grad is not None for p in self.params]
#         for p, slot in zip(self.params, self.slots, strict=True):
#             if p.grad is None:                                    # unused on this rank: it
#                 slot.zero_()                                      # adds zeros (notebook 03)
#             else:
#                 slot.copy_(p.grad)                                # flatten
#         self.counts.copy_(torch.tensor(used, dtype=self.counts.dtype))  # ranks that used it
#         dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM)        # one call for everything
#         for p, slot, ranks in zip(self.params, self.slots, self.counts.tolist(), strict=True):
#             if ranks == 0:                     # unused on every rank: no gradient, as in one
#                 continue                       # process (and DDP): the optimizer skips it
#             slot /= dist.get_world_size()                         # the mean, in the sum's dtype
#             if p.grad is None:
#                 p.grad = torch.empty_like(p)
#             p.grad.copy_(slot)                                    # back into .grad
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
#     rank = dist.get_rank()
#     torch.manual_seed(0)                       # the same initial weights on every rank
#     model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
#     average = FlatAverager(model)
#     x, y = torch.randn(8, 20) * (rank + 1), torch.randint(0, 3, (8,))  # this rank's batch
#     x, y = x.to(device), y.to(device)
#
#     F.cross_entropy(model(x), y).backward()
#     grads = [p.grad.clone() for p in model.parameters()]  # for the check below
#     average()
#
#     # Check: the same mean as notebook 02's loop, one all_reduce per parameter.
#     for p, g in zip(model.parameters(), grads, strict=True):
#         dist.all_reduce(g)
#         torch.testing.assert_close(p.grad, g / dist.get_world_size())
#     print(f"rank {rank}: one all_reduce, the same mean gradient as one per parameter, "
#           f"on {device} ({dist.get_backend()})")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# To hide the communication behind backward, start each bucket's call from
# `param.register_post_accumulate_grad_hook` with `async_op=True`, in the same order on every rank,
# and `wait()` before `optimizer.step()` (`gst.averaging.OverlappedAverager`).
#
# ## Exercise
#
# Write the overlap of section 4 without buckets. `average_overlapped(model)` registers a hook on
# every parameter (`p.register_post_accumulate_grad_hook(hook)`). The hook starts
# `dist.all_reduce(p.grad, async_op=True)` the moment `p.grad` is final, and keeps the handle it
# returns. `average_overlapped` returns a function `finish()`. It waits on this step's handles,
# divides by the world size, and forgets the handles. It is used like this:
#
# ```python
# finish = average_overlapped(model)  # once, before training
# loss.backward()                     # your hooks start one all_reduce per parameter
# finish()                            # every rank now holds the mean gradient
# optimizer.step()
# ```
#
# The check below runs 2 steps at each of two world sizes. It counts the calls that start during
# backward, and how many of them are asynchronous. It compares each step's gradients with the mean
# over ranks. It prints "✓ correct", or fails with what is wrong. Until you write the function, it
# says "not attempted yet". Stuck? `%load solutions/05_average_overlapped.py` in a new cell.

# %%
def average_overlapped(model):
    # your code here: a hook per parameter that starts an async all_reduce; return finish
    raise NotImplementedError("write average_overlapped")


# %%
gst.exercises.check_average_overlapped(average_overlapped)

# %% [markdown]
# **One more, not checked**: write `RingAverager`, a `gst.averaging.FlatAverager` whose `__call__`
# uses your own `gst.averaging.ring_all_reduce(self.bucket.buffer)` in place of `dist.all_reduce`.
# Check on 2 and 3 ranks that one training epoch with it gives DDP's parameters (within 1e-6). Then
# time one call of each on the CNN's gradients, as `time_averaging` does above. The ring makes
# 2(N-1) `send`/`recv` steps per call: how does its time grow from 2 to 4 ranks?
