# %% [markdown]
# # 08 — Sharded gradients: reduce-scatter, ZeRO and FSDP2, and who divides by what
#
# **Question: when each rank keeps only a shard of the gradients, as in ZeRO and FSDP2, who divides
# by what?**
#
# **Short answer:** divide once by N. Sharding takes the same mean as notebook 02, in another place:
# by hand (÷ N, or `ReduceOp.AVG`), in FSDP2 by its *gradient divide factor*, and in DeepSpeed and
# NVIDIA's Megatron-LM by settings quoted below from their own code. Two habits of the replicated
# world break. A gradient norm computed on one rank's shard is not the gradient's norm. And
# notebook 02's `average_gradients` cannot even run on FSDP2's gradients; nor is it needed, since
# they are already averaged. Each sentence is measured below.
#
# In notebooks 02 and 03 every rank ends each step with the whole mean gradient and its own copy of
# the optimizer state: N copies of the same numbers. Large models do not fit that way. DeepSpeed's
# **ZeRO** (its "Zero Redundancy Optimizer") and FSDP2 (`torch.distributed.fsdp.fully_shard`) cut
# the gradient into N **shards**. ZeRO cuts the flat gradient; FSDP2 cuts the rows of each tensor.
# The step then has three parts:
#
# 1. A **reduce-scatter** gives rank r the sum over the ranks of shard r only.
# 2. Rank r updates shard r of the parameters with shard r of the optimizer state.
# 3. An **all-gather** then gives every rank every updated shard.
#
# A reduce-scatter and an all-gather carry the sums of one `all_reduce`. On gloo they are equal bit
# for bit, random floats included (measured below). On NCCL they may add in another order
# (notebook 09). So the division by N is still needed, once.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: less data, same checks
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5  # notebook 02's SGD settings
N_TRAIN = 1024 if SMOKE_TEST else 4096  # images of the training runs (16 steps in full mode)

import inspect
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed import fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DistributedSampler, TensorDataset

import gradsync_tutorial as gst

# First the torch this notebook needs, before the imports an older FSDP2 lacks:
assert hasattr(getattr(fsdp, "FSDPModule", None), "set_force_sum_reduction_for_comms"), (
    "this notebook needs a torch whose FSDP2 has set_force_sum_reduction_for_comms (added in "
    f"pytorch#155915, June 2025); this one is {torch.__version__}: pip install -U torch")
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: E402 (quoted)

# pytorch#186123 (2026) renamed all_gather_into_tensor and reduce_scatter_tensor (the old names
# still work, with a FutureWarning): the same two functions, under whichever name this torch has.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
assert GLOBAL_BATCH % WORLD_SIZE == 0, "each rank takes GLOBAL_BATCH // WORLD_SIZE samples"


# %% [markdown]
# ## Reduce-scatter, then all-gather: the sums of one all-reduce
#
# Each rank starts with its own vector of 2N numbers; rank r's are 10^r times rank 0's. With
# `reduce_scatter` (`dist.reduce_scatter_tensor` in older torch), rank r receives the sum over the
# ranks of the r-th piece of 2 numbers, and nothing else. `all_gather` then hands every rank every
# piece, in rank order. That is the whole sum, as `all_reduce` gives it. `op=ReduceOp.AVG` makes the
# reduce-scatter return the mean instead of the sum.

# %%
def three_collectives(rank, world_size):
    device = gst.local_device()
    mine = (torch.arange(2 * world_size, device=device) + 1.0) * 10**rank  # this rank's numbers
    summed = mine.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # every rank: the whole sum
    shard = torch.empty(2, device=device)
    reduce_scatter(shard, mine, op=dist.ReduceOp.SUM)  # rank r: the sum of piece r only
    gathered = torch.empty_like(mine)
    all_gather(gathered, shard)  # every rank: every rank's piece, in rank order
    averaged = torch.empty(2, device=device)
    reduce_scatter(averaged, mine, op=dist.ReduceOp.AVG)  # rank r: the mean of piece r
    print(f"mine {mine.tolist()} -> my piece of the sum {shard.tolist()}, "
          f"of the mean {averaged.tolist()}")
    floats = torch.randn(1000 * world_size, generator=torch.Generator().manual_seed(rank))
    floats = floats.to(device)  # whole numbers add exactly in any order; random floats may not
    floats_summed, floats_shard = floats.clone(), torch.empty(1000, device=device)
    dist.all_reduce(floats_summed)
    reduce_scatter(floats_shard, floats, op=dist.ReduceOp.SUM)
    floats_gathered = torch.empty_like(floats)
    all_gather(floats_gathered, floats_shard)
    return {"summed": summed, "shard": shard, "gathered": gathered, "averaged": averaged,
            "floats": (floats_summed.cpu(), floats_gathered.cpu())}

pieces = gst.launch(three_collectives, world_size=WORLD_SIZE)

# %% tags=["nbval-check-output"]
whole_sum = pieces[0]["summed"]
for rank, p in enumerate(pieces):
    assert torch.equal(p["shard"], whole_sum[2 * rank : 2 * rank + 2])  # piece r of the sum
    assert torch.equal(p["gathered"], whole_sum)  # bit for bit what all_reduce gives
    assert torch.allclose(p["averaged"], p["shard"] / WORLD_SIZE)
    assert torch.equal(*p["floats"])  # random floats too: the same order of additions
print(f"all_reduce: {whole_sum.tolist()} on every rank")
print("reduce_scatter then all_gather: the same, bit for bit, on every rank, random floats too")

# %% [markdown]
# A ring all-reduce works the same way inside: a reduce-scatter phase, then an all-gather phase.
# (Notebook 05 wrote one with `send` and `recv`, `gst.averaging.ring_all_reduce`.) Sharding stops
# after the first phase and does the optimizer's work on 1/N of the numbers. It runs the second
# phase on the updated parameters instead of the gradients.
#
# ## ZeRO by hand, from notebook 02's loop
#
# DeepSpeed's ZeRO tutorial (`docs/_tutorials/zero.md` in deepspeedai/DeepSpeed) names the stages:
#
# > "**Stage 1**: The optimizer states [...] are partitioned across the processes, so that each
# > process updates only its partition. **Stage 2**: The reduced 16-bit gradients for updating the
# > model weights are also partitioned such that each process retains only the gradients
# > corresponding to its portion of the optimizer states. **Stage 3**: The 16-bit model parameters
# > are partitioned across the processes."
#
# Here is stage 2 by hand, for SGD with momentum. The model's parameters live in one flat vector of
# N equal shards; the last one is padded with zeros. Rank r keeps shard r of the gradient and of the
# momentum. It updates shard r of the parameters with `torch.optim.SGD` itself.

# %%
class ShardedSGD:
    """SGD with momentum, ZeRO stage 2 by hand: rank r keeps shard r of the flat gradient and
    of the momentum, updates shard r of the parameters, then all-gathers every shard."""

    def __init__(self, model, lr, momentum):
        self.params = list(model.parameters())
        self.sizes = [p.numel() for p in self.params]
        world_size, rank = dist.get_world_size(), dist.get_rank()
        self.size = -(-sum(self.sizes) // world_size)  # one shard: ceil(numel / N)
        like = self.params[0]
        self.flat = torch.zeros(self.size * world_size, dtype=like.dtype, device=like.device)
        pieces = self.flat[: sum(self.sizes)].split(self.sizes)
        for p, piece in zip(self.params, pieces, strict=True):
            piece.copy_(p.detach().flatten())
            p.data = piece.view_as(p)  # now in self.flat (.data: re-points, not an update)
        self.shard = self.flat[rank * self.size : (rank + 1) * self.size].clone()
        self.shard.requires_grad_()  # this rank's shard of the parameters, the one it updates
        self.optimizer = torch.optim.SGD([self.shard], lr=lr, momentum=momentum)  # 1/N state

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        grads = torch.zeros_like(self.flat)
        grads[: sum(self.sizes)] = torch.cat([p.grad.flatten() for p in self.params])
        self.zero_grad()  # the whole gradient is no longer needed: free it
        self.shard.grad = torch.empty_like(self.shard)
        reduce_scatter(self.shard.grad, grads, op=dist.ReduceOp.SUM)  # shard r of the sum
        self.shard.grad /= dist.get_world_size()  # the mean (or op=dist.ReduceOp.AVG above)
        self.optimizer.step()  # SGD on shard r, with the momentum of shard r
        all_gather(self.flat, self.shard)  # every rank: every updated shard, into the model


# %% [markdown]
# The training loop is notebook 02's, read from notebook 02, with the optimizer replaced.
# `average(model)` goes, since `step()` now does the averaging; the rest stays.

# %% tags=["training-loop"]
def train(rank, world_size, epochs, lr=LR, dropout=True, dtype=torch.float32):
    torch.manual_seed(SEED)  # the initial weights, the same wherever this runs
    device = gst.local_device()  # a GPU if there is one, else the CPU
    model = gst.model.Net().to(device, dtype)
    optimizer = ShardedSGD(model, lr=lr, momentum=MOMENTUM)  # 1/N of gradient and momentum
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
            optimizer.step()  # reduce-scatter ÷ N, SGD on this rank's shard, all-gather
            losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


# %%
train_02 = gst.notebooks.load_function("02_manual_allreduce_averaging", "train",
                                       requires=["average_gradients"])
changes = gst.notebooks.show_diff(train_02, train, names=("02: train", "08: train"))
assert changes == 3

# %% [markdown]
# Three places change: the signature loses `average`, the optimizer is `ShardedSGD`, and the
# `average(model)` call is gone. We run it against notebook 02's loop and notebook 03's DDP loop.
# Both are read from their notebooks and given this notebook's images. The runs are in float64 with
# dropout off, as notebook 02 compared whole runs:

# %%
train_03 = gst.notebooks.load_function("03_distributed_data_parallel", "train")
for loop in (train_02, train_03):
    loop.__globals__["N_TRAIN"] = N_TRAIN  # their own loops, on this notebook's images
exact = dict(dropout=False, dtype=torch.float64)
zero = gst.launch(partial(train, **exact), world_size=WORLD_SIZE, args=(1,))
manual = gst.launch(partial(train_02, **exact), world_size=WORLD_SIZE, args=(1,))
ddp = gst.launch(partial(train_03, **exact), world_size=WORLD_SIZE, args=(1,))

# %%
steps = len(zero[0]["losses"])
vs_02 = gst.checks.compare_state_dicts(zero[0]["state"], manual[0]["state"], show=False)
vs_03 = gst.checks.compare_state_dicts(zero[0]["state"], ddp[0]["state"], show=False)
between_ranks = gst.checks.compare_ranks([r["state"] for r in zero], show=False)
print(f"ZeRO by hand, {WORLD_SIZE} ranks, {steps} steps, float64: max |difference| of the "
      f"parameters vs notebook 02's loop {vs_02:.2g}, vs notebook 03's DDP {vs_03:.2g}; "
      f"between ranks {between_ranks:.2g}")
assert steps == N_TRAIN // GLOBAL_BATCH
assert vs_02 <= 1e-12 and vs_03 <= 1e-12 and between_ranks == 0.0

# %% [markdown]
# ### The bytes each rank holds
#
# The bytes are counted from the tensors after one step (`nbytes` of each), in float32. We count
# them for notebook 02's replicated SGD and for `ShardedSGD`. The parameters stay whole in stage 2,
# since each rank runs the whole model. The gradient and the momentum shrink to 1/N. `ShardedSGD`
# also holds its parameter shard, the 1/N copy its optimizer updates.

# %%
def bytes_per_rank(rank, world_size):
    torch.manual_seed(SEED)
    device = gst.local_device()
    x = torch.randn(8, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (8,), device=device)
    replicated, sharded = gst.model.Net().to(device), gst.model.Net().to(device)
    sgd = torch.optim.SGD(replicated.parameters(), lr=LR, momentum=MOMENTUM)
    F.nll_loss(replicated(x), y).backward()
    for p in replicated.parameters():  # notebook 02's average_gradients
        dist.all_reduce(p.grad)
        p.grad /= world_size
    sgd.step()
    zero = ShardedSGD(sharded, lr=LR, momentum=MOMENTUM)
    F.nll_loss(sharded(x), y).backward()
    zero.step()
    size = lambda tensors: sum(t.nbytes for t in tensors if t is not None)
    state = lambda opt: [s["momentum_buffer"] for s in opt.state.values()]
    return {
        "replicated": {"parameters": size(replicated.parameters()),
                       "gradient": size(p.grad for p in replicated.parameters()),
                       "momentum": size(state(sgd))},
        "ZeRO-2 by hand": {"parameters": zero.flat.nbytes + zero.shard.nbytes,
                           "gradient": size([zero.shard.grad] + [p.grad for p in zero.params]),
                           "momentum": size(state(zero.optimizer))},
    }

held = gst.launch(bytes_per_rank, world_size=WORLD_SIZE)

# %%
numel = sum(p.numel() for p in gst.model.Net().parameters())  # the course's Net
shard_bytes = 4 * -(-numel // WORLD_SIZE)
print(f"bytes on rank 0 of {WORLD_SIZE}    parameters   gradient   momentum")
for setup, counts in held[0].items():
    print(f"{setup:<22} {counts['parameters']:>11,} {counts['gradient']:>10,} "
          f"{counts['momentum']:>10,}")
assert held[0]["replicated"] == {"parameters": 4 * numel, "gradient": 4 * numel,
                                 "momentum": 4 * numel}
zero_held = held[0]["ZeRO-2 by hand"]
assert zero_held["parameters"] == 4 * numel + shard_bytes  # whole, plus the shard it updates
assert zero_held["gradient"] == zero_held["momentum"] == shard_bytes  # 1/N each
assert all(h == held[0] for h in held)  # every rank holds as much

# %% [markdown]
# During `backward()` the whole gradient still exists here, until `step()` reduce-scatters it. FSDP2
# does better. It reduce-scatters each `fully_shard`ed module's gradients during backward, module by
# module (counted below), and shards the parameters too.
#
# ## FSDP2: `fully_shard` on a CPU device mesh
#
# FSDP2 shards the parameters too: stage 3 in DeepSpeed's words. `fully_shard(model, mesh=...)`
# replaces every parameter by a **DTensor**. Each rank stores one shard of a DTensor's rows
# (`Shard(dim=0)`). Before the module's forward and backward, FSDP2 all-gathers them. After backward
# it reduce-scatters the gradients. The device mesh lists the ranks. It is
# `init_device_mesh("cpu", (N,))` with gloo here, and `init_device_mesh("cuda", (N,))` with nccl on
# GPUs (`device.type` picks it). The loop is notebook 03's, with one line in place of `DDP(model)`
# and whole tensors in the state dict:

# %% tags=["training-loop"]
def train_fsdp(rank, world_size, epochs, lr=LR, dropout=True, dtype=torch.float32):
    torch.manual_seed(SEED)  # the initial weights, the same wherever this runs
    device = gst.local_device()  # a GPU if there is one, else the CPU
    model = gst.model.Net().to(device, dtype)
    fully_shard(model, mesh=init_device_mesh(device.type, (world_size,)))  # 1/N of each tensor
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    images, labels = images[:N_TRAIN], labels[:N_TRAIN]
    sampler = DistributedSampler(TensorDataset(images, labels), world_size, rank, seed=SEED)
    batch_size = GLOBAL_BATCH // world_size  # each rank's share of the global batch
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # shuffles with SEED + epoch, the same way on every rank
        shard = torch.tensor(list(sampler))  # this rank's 1/N of the data
        model.train(dropout)  # train(False) = eval mode: dropout off
        for start in range(0, len(shard), batch_size):
            idx = shard[start : start + batch_size]
            x, y = images[idx].to(device, dtype), labels[idx].to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)  # mean over the batch
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


# %%
changes = gst.notebooks.show_diff(train_03, train_fsdp, names=("03: train", "08: train_fsdp"))
assert changes == 3

# %%
fsdp = gst.launch(partial(train_fsdp, **exact), world_size=WORLD_SIZE, args=(1,))
train_01 = gst.notebooks.load_function("01_single_device_baseline", "train")
train_01.__globals__["N_TRAIN"] = N_TRAIN
single = [train_01(1, **exact)]  # notebook 01's loop, one process, in this kernel

# %%
runs = {"DDP (03)": ddp, "one process (01)": single, "ZeRO by hand": zero}
fsdp_vs = {name: gst.checks.compare_state_dicts(fsdp[0]["state"], run[0]["state"], show=False)
           for name, run in runs.items()}
print(f"FSDP2, {WORLD_SIZE} ranks, {steps} steps, float64, max |difference| of the parameters: "
      + ", ".join(f"vs {name} {gap:.2g}" for name, gap in fsdp_vs.items()))
assert all(gap <= 1e-12 for gap in fsdp_vs.values())

# %% [markdown]
# ### Module by module, and the bytes
#
# Real models call `fully_shard` on each block, then on the model. Each block's parameters are
# all-gathered just before its forward, and again for its backward. Its gradients are
# reduce-scattered as soon as its backward is done. Torch's `foreach_reduce` then frees the whole
# gradients: "Only after the copy-in finishes can we free the gradients" (checked below against the
# installed torch). Here each layer of the course's `Net` is a block. We count the collectives of
# one forward and one backward, then the bytes held after one step:

# %%
def per_layer(rank, world_size):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)  # one block each
    fully_shard(model, mesh=mesh)  # the root (no parameters of its own left here)
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x = torch.randn(8, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (8,), device=device)
    with gst.detect.count_collectives() as forward:
        loss = F.nll_loss(model(x), y)
    with gst.detect.count_collectives() as backward:
        loss.backward()
    sgd.step()
    local = lambda tensors: sum(t.to_local().nbytes for t in tensors)
    return {"forward": dict(forward.calls), "backward": dict(backward.calls),
            "bytes": {"parameters": local(model.parameters()),
                      "gradient": local(p.grad for p in model.parameters()),
                      "momentum": local(s["momentum_buffer"] for s in sgd.state.values())}}

layered = gst.launch(per_layer, world_size=WORLD_SIZE)

# %%
print(f"one forward: {layered[0]['forward']}; one backward: {layered[0]['backward']}")
assert layered[0]["forward"][all_gather.__name__] == 4  # one per block, before its forward
assert layered[0]["backward"][reduce_scatter.__name__] == 4  # one per block, in backward
assert layered[0]["backward"][all_gather.__name__] == 4  # freed after forward, fetched again
freed = "# Only after the copy-in finishes can we free the gradients"
assert freed in inspect.getsource(_fsdp_collectives.foreach_reduce)
held_fsdp = [r["bytes"] for r in layered]
print(f"bytes on rank 0 of {WORLD_SIZE}    parameters   gradient   momentum")
for setup, counts in [*held[0].items(), ("FSDP2 (ZeRO-3)", held_fsdp[0])]:
    print(f"{setup:<22} {counts['parameters']:>11,} {counts['gradient']:>10,} "
          f"{counts['momentum']:>10,}")
rows_of_rank_0 = sum(-(-p.shape[0] // WORLD_SIZE) * p[0].numel()  # ceil(rows / N) of each
                     for p in gst.model.Net().parameters())
for kind in ("parameters", "gradient", "momentum"):  # the ranks' shards add up to one copy
    assert sum(h[kind] for h in held_fsdp) == 4 * numel
    assert held_fsdp[0][kind] == 4 * rows_of_rank_0  # 1/N, give or take a row per tensor

# %% [markdown]
# In FSDP2 every kind of state is 1/N per rank. (A parameter's rows split unevenly when their number
# is not a multiple of N.) A block's whole parameters exist only while it runs: the all-gathers in
# backward fetch again what forward freed.
#
# ### DTensors, and what a rank returns
#
# Inside the ranks each parameter is a DTensor. It has a global shape, a placement, and the rows
# this rank stores (`to_local()`). `full_tensor()` all-gathers the whole tensor, so every rank must
# call it. A DTensor returned as is reaches the notebook as the rank's shard, a plain tensor. (It
# names the ranks' process group, which the notebook does not have.) The launcher says so under the
# cell.

# %%
def dtensors(rank, world_size):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device)
    fully_shard(model, mesh=init_device_mesh(device.type, (world_size,)))
    w = model.fc2.weight
    if rank == 0:
        print(f"fc2.weight: {type(w).__name__}, shape {tuple(w.shape)}, placements {w.placements}")
    print(f"this rank stores {w.to_local().shape[0]} of its {w.shape[0]} rows")
    state = model.state_dict()  # DTensors: returned as this rank's shards
    torch.manual_seed(SEED + rank)  # a different seed on every rank: a bug, on purpose
    apart = gst.model.Net().to(device)
    own = apart.fc2.weight.detach().clone()  # the weights this rank built
    fully_shard(apart, mesh=init_device_mesh(device.type, (world_size,)))
    return {"shards": state, "full": {k: v.full_tensor() for k, v in state.items()},
            "own": own, "seeded apart": apart.fc2.weight.full_tensor()}

held_by = gst.launch(dtensors, world_size=WORLD_SIZE)

# %% [markdown]
# `Shard(dim=0)` cuts the rows in rank order. So the ranks' shards, concatenated, are the whole
# tensors: the state dict that `full_tensor()` returns. That gathers the whole model onto every
# rank: fine for a check, not for a checkpoint at scale. To checkpoint FSDP2, use
# `torch.distributed.checkpoint.save`. In its documentation's words, it "handles [...] DTensor by
# having each rank only save their local shards" (checked below). The snippet at the end saves and
# loads that way.

# %%
for name, full in held_by[0]["full"].items():
    rows = torch.cat([r["shards"][name] for r in held_by])
    assert type(held_by[0]["shards"][name]) is torch.Tensor and torch.equal(rows, full), name
numel_held = [sum(t.numel() for t in r["shards"].values()) for r in held_by]
print(f"numbers stored per rank: {numel_held} of {numel}; "
      "concatenated in rank order they are the full_tensor() state dict")
assert sum(numel_held) == numel
assert "DTensor`` by having each rank only save their local shards" in " ".join(
    dcp.save.__doc__.split())

# %% [markdown]
# Unlike `DDP(model)`, `fully_shard` broadcasts nothing: each rank keeps its own rows of the tensors
# it built. Seeded apart (notebook 02's bug), the ranks hold pieces of different initializations,
# and no error says so. Seed every rank the same, or load a checkpoint:

# %%
own = [r["own"] for r in held_by]
pieced = torch.cat([w.chunk(WORLD_SIZE)[rank] for rank, w in enumerate(own)])
print(f"seeded apart: fc2.weight = each rank's rows of its own initialization: "
      f"{torch.equal(held_by[0]['seeded apart'], pieced)}; max |difference| from rank 0's init "
      f"{(held_by[0]['seeded apart'] - own[0]).abs().max():.2g}")
assert torch.equal(held_by[0]["seeded apart"], pieced)
assert not torch.equal(held_by[0]["seeded apart"], own[0])

# %% [markdown]
# ### The divide factor
#
# FSDP2's reduce-scatter divides by a *gradient divide factor*, `None` by default: the mean. Torch's
# `_get_gradient_divide_factors` (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`) sets
# what it sends. Quoted and checked against the installed torch below:
#
# | case | op sent |
# |---|---|
# | float32 and bfloat16, the default | `ReduceOp.AVG` |
# | a factor other than the group size | `ReduceOp.PREMUL_SUM(1 / factor)`: × 1/factor, then the sum |
# | `set_force_sum_reduction_for_comms(True)` | `ReduceOp.SUM`, then ÷ the factor |
# | float16 and float64 ("overflow risk") | `ReduceOp.SUM`, with ÷ about √factor before and the rest after |
#
# Here is one backward on the course's model, each rank with its own 8 images. We record the
# reduce-scatter FSDP2 calls:

# %%
quoted = ["return None, None, ReduceOp.AVG, ReduceOp.AVG",
          "reduce_scatter_op = ReduceOp.PREMUL_SUM(1 / factor)",
          "overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)",
          "if not overflow_risk and not force_sum_reduction_for_comms:",
          "pre_factor, post_factor = None, factor"]  # forced SUM in float32: ÷ after only
code = inspect.getsource(_fsdp_collectives._get_gradient_divide_factors)
assert all(line in code for line in quoted)
print(f"torch {torch.__version__}: the quoted lines are in _get_gradient_divide_factors")

# %%
def fsdp_gradient(rank, world_size, dtype=torch.float32, factor=None, force_sum=False,
                  token_loss=False, per_block=False, set_factor=None):
    """One backward of the course's model under FSDP2, each rank on its own 8 images (8 (r + 1)
    for the token-count loss). Returns the whole gradient, one process's on every image, and
    the ops of the reduce-scatters FSDP2 called. per_block: fully_shard on each layer, then on
    the root; set_factor(model): what sets the divide factor, instead of the root's setters."""
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device, dtype).eval()  # eval: dropout off
    whole = gst.model.Net().to(device, dtype).eval()  # the same weights, one process
    whole.load_state_dict(model.state_dict())
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2) if per_block else ():
        fully_shard(layer, mesh=mesh)  # one block each, as real models (and the snippet) do
    fully_shard(model, mesh=mesh)
    if set_factor is not None:
        set_factor(model)
    else:  # on the root only
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        model.set_force_sum_reduction_for_comms(force_sum)
    g = torch.Generator().manual_seed(SEED)
    counts = [8 * (r + 1) if token_loss else 8 for r in range(world_size)]  # uneven "tokens"
    x = torch.randn(sum(counts), 1, 28, 28, generator=g).to(device, dtype)
    y = torch.randint(0, 10, (sum(counts),), generator=g).to(device)
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))  # this rank's samples
    if token_loss:  # notebook 07's loss: this rank's sum over its tokens / the global count
        loss = F.nll_loss(model(x[mine]), y[mine], reduction="sum") / sum(counts)
    else:  # the usual mean over this rank's own samples
        loss = F.nll_loss(model(x[mine]), y[mine])
    with gst.detect.count_collectives() as calls:
        loss.backward()
    F.nll_loss(whole(x), y).backward()  # one process, every sample: the mean gradient
    ops = [kwargs["op"] for _, kwargs in calls.arguments[reduce_scatter.__name__]]  # op=...
    ops = [str(getattr(op, "op", op)).split(".")[-1] for op in ops]  # PREMUL_SUM(f): in .op
    return {"op": ops[0], "ops": ops, "reduce_scatters": calls[reduce_scatter.__name__],
            "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "reference": {n: p.grad for n, p in whole.named_parameters()}}


def ratio(result):  # the gradient / the one-process gradient: c if grads = c * reference
    g = torch.cat([t.flatten() for t in result["grads"].values()]).double()
    ref = torch.cat([t.flatten() for t in result["reference"].values()]).double()
    c = (g @ ref / (ref @ ref)).item()
    return c, (g - c * ref).abs().max().item()


settings = {"default, float32": {}, "default, float64": {"dtype": torch.float64},
            f"set_gradient_divide_factor({WORLD_SIZE})": {"factor": float(WORLD_SIZE)},
            "factor 1.0 + force_sum": {"factor": 1.0, "force_sum": True}}
divided = {name: gst.launch(partial(fsdp_gradient, **kw), world_size=WORLD_SIZE)[0]
           for name, kw in settings.items()}

# %%
print(f"{'setting':<30} reduce-scatter op   gradient / one process's")
for name, result in divided.items():
    c, off = ratio(result)
    print(f"{name:<30} {result['op']:<19} {c:.4f} (max residual {off:.1g})")
    assert result["reduce_scatters"] == 1 and off < 1e-6
assert [r["op"] for r in divided.values()] == ["AVG", "SUM", "AVG", "SUM"]
assert [round(ratio(r)[0], 4) for r in divided.values()] == [1, 1, 1, WORLD_SIZE]

# %% [markdown]
# Whatever the op, the default is the mean: FSDP2 equals DDP's averaging, with no division to write.
# A factor of 1.0 turns the division off, and the ranks' gradients are summed (N× the mean above).
# Without `set_force_sum_reduction_for_comms(True)`, that factor is sent as `PREMUL_SUM`, which gloo
# does not have:

# %%
on_gpus = torch.cuda.device_count() >= WORLD_SIZE  # then gst.launch runs nccl, else gloo
try:
    premul = gst.launch(partial(fsdp_gradient, factor=1.0), world_size=WORLD_SIZE)[0]
    print(f"factor 1.0 on nccl: {premul['op']}, gradient = {ratio(premul)[0]:.4f} × one process's")
    assert on_gpus and premul["op"] == "PREMUL_SUM" and abs(ratio(premul)[0] - WORLD_SIZE) < 1e-4
except gst.RankFailedError as error:
    premul_error = error.failure.message
    print(f"factor 1.0 on gloo: rank {error.rank} raised {error.exc_type}: {premul_error}")
    assert not on_gpus and premul_error == "Cannot use ReduceOp.PREMUL_SUM with Gloo"

# %% [markdown]
# `ReduceOp.PREMUL_SUM(f)` multiplies each rank's tensor by `f`, then sums: a division folded into
# the collective. Installed torch's `ReduceOp` docstring says it "is available with the `NCCL`
# backend (NCCL versions 2.11 or later) and the `XCCL` backend". Gloo refuses it. The launcher
# stopped these ranks, and the next launch starts fresh ones. That also sidesteps a process group
# that a refused op may have left unusable. On nccl the factor alone is expected to work, since
# PREMUL_SUM is documented there. The cell above asserts it on a GPU per rank (`make gpu-check`).
# Not yet run on a GPU. On gloo, force the sum: FSDP2 then sends `ReduceOp.SUM` and divides by the
# factor itself, the table's last line.
#
# **Why a factor of 1 is the knob for notebook 07's token-count losses.** Let each rank's loss be
# its *sum* over its tokens divided by the *global* number of tokens. The gradients must then be
# summed over the ranks, not averaged: the mean is already in the loss. We measure it with uneven
# token counts, where rank r has 8 (r + 1) samples. The reference is one process's mean over every
# sample:

# %%
tokens = {"default (AVG)": gst.launch(partial(fsdp_gradient, token_loss=True), WORLD_SIZE)[0],
          "factor 1.0 + force_sum": gst.launch(
              partial(fsdp_gradient, token_loss=True, factor=1.0, force_sum=True), WORLD_SIZE)[0]}

# %%
for name, result in tokens.items():
    c, off = ratio(result)
    print(f"token-count loss, {name:<24} gradient = {c:.4f} × one process's (residual {off:.1g})")
assert abs(ratio(tokens["default (AVG)"])[0] - 1 / WORLD_SIZE) < 1e-6  # divided twice
assert abs(ratio(tokens["factor 1.0 + force_sum"])[0] - 1) < 1e-6  # right

# %% [markdown]
# With the default the gradient is 1/N of the right one. The loss was divided by the global count,
# then FSDP2 divided again by N. Under SGD that is a learning rate / N: notebook 02's lesson turned
# around. Here the model is one FSDP unit. `model.set_gradient_divide_factor(1.0)` fixes it, plus
# `model.set_force_sum_reduction_for_comms(True)` on gloo. (DDP always divides by N, so under DDP
# the same loss is multiplied by N instead.)
#
# ### With `fully_shard` on each block: set it on every `FSDPModule`
#
# Neither setter recurses: each acts on the one `FSDPModule` it is called on. Unlike
# `set_requires_gradient_sync(..., recurse=True)`, they take no `recurse` argument (checked below).
# With `fully_shard` on each block, then on the root, the root's call misses every block. torchtitan
# loops over `model.modules()` instead. Its `disable_fsdp_gradient_division`
# (`torchtitan/distributed/fsdp.py`, pytorch/torchtitan@b5bcd76) says: "Disable FSDP's automatic
# gradient division for all FSDP modules." And: "We handle gradient scaling ourselves in the
# training loop with global token count." Below is the same loop, with the sum forced on every
# backend, against the root alone. The model is the course's, with each layer a block:

# %%
def sum_gradients_over_ranks(model):
    """For a token-count loss: FSDP2 sums the gradients over the ranks, in every FSDP unit."""
    for module in model.modules():
        if isinstance(module, FSDPModule):  # each fully_shard'ed block, and the root
            module.set_gradient_divide_factor(1.0)  # no ÷ N: the loss holds the mean
            module.set_force_sum_reduction_for_comms(True)  # SUM (gloo has no PREMUL_SUM)


for setter in ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms"):
    assert "recurse" not in inspect.signature(getattr(FSDPModule, setter)).parameters, setter
assert "recurse" in inspect.signature(FSDPModule.set_requires_gradient_sync).parameters
per_block = partial(fsdp_gradient, token_loss=True, per_block=True)
blocks = {"the root only": partial(per_block, factor=1.0, force_sum=True),
          "every FSDPModule": partial(per_block, set_factor=sum_gradients_over_ranks)}
blocks = {name: gst.launch(run, world_size=WORLD_SIZE)[0] for name, run in blocks.items()}

# %%
def ratio_by_tensor(result):  # ratio() of each parameter's gradient alone
    return {n: ratio({"grads": {n: g}, "reference": {n: result["reference"][n]}})
            for n, g in result["grads"].items()}


for name, result in blocks.items():
    ratios = [c for c, _ in ratio_by_tensor(result).values()]
    print(f"factor 1.0 on {name + ':':<17} reduce-scatter ops {sorted(set(result['ops']))}, each of "
          f"the {len(ratios)} gradients = {min(ratios):.4f}× to {max(ratios):.4f}× one process's")
    assert result["reduce_scatters"] == 4  # one per block; the root has no parameters left
    assert all(off < 1e-6 for _, off in ratio_by_tensor(result).values())
root_only, every = (ratio_by_tensor(blocks[n]).values() for n in blocks)
assert set(blocks["the root only"]["ops"]) == {"AVG"}  # the blocks kept their default
assert all(abs(c - 1 / WORLD_SIZE) < 1e-6 for c, _ in root_only)  # 1/N: divided twice
assert set(blocks["every FSDPModule"]["ops"]) == {"SUM"}
assert all(abs(c - 1) < 1e-6 for c, _ in every)  # the token-weighted mean, exactly

# %% [markdown]
# Set on the root only, every gradient is 1/N of the right one, and nothing warns. The blocks kept
# their default mean, and the root holds no parameters of its own. Set on every `FSDPModule`, the
# gradient is one process's. `snippets/08_fsdp2.py` uses this loop and checks it.
#
# ### Accumulating micro-batches: `set_requires_gradient_sync(False)`
#
# DDP's `no_sync()` (notebook 03) has an FSDP2 counterpart. With
# `model.set_requires_gradient_sync(False)`, backward keeps whole, unreduced gradients. The next
# backward with sync on reduce-scatters their sum once. Until then each rank holds whole gradients:
# the memory that sharding saved. With notebook 07's token loss, count the tokens over all the
# micro-batches. Each rank runs two micro-batches of 8 images, each loss halved. One process on all
# the images is the reference:

# %%
def accumulate(rank, world_size):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device).eval()
    whole = gst.model.Net().to(device).eval()
    whole.load_state_dict(model.state_dict())
    fully_shard(model, mesh=init_device_mesh(device.type, (world_size,)))
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(16 * world_size, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (16 * world_size,), generator=g).to(device)
    with gst.detect.count_collectives() as calls:
        for micro, sync in enumerate([False, True]):
            model.set_requires_gradient_sync(sync)  # False: no reduce-scatter in this backward
            idx = slice(16 * rank + 8 * micro, 16 * rank + 8 * micro + 8)
            (F.nll_loss(model(x[idx]), y[idx]) / 2).backward()
    F.nll_loss(whole(x), y).backward()
    gap = max((p.grad.full_tensor() - q.grad).abs().max().item()
              for p, q in zip(model.parameters(), whole.parameters(), strict=True))
    return {"reduce_scatters": calls[reduce_scatter.__name__], "gap": gap}

accumulated = gst.launch(accumulate, world_size=WORLD_SIZE)[0]
print(f"2 micro-batches: {accumulated['reduce_scatters']} reduce-scatter, max |difference| from "
      f"one process {accumulated['gap']:.2g}")
assert accumulated["reduce_scatters"] == 1 and accumulated["gap"] < 1e-6

# %% [markdown]
# ## What breaks when the gradients are sharded
#
# ### A gradient norm over one rank's shard
#
# `clip_grad_norm_(parameters, max_norm)` rescales the gradient when its norm exceeds `max_norm`.
# The norm of the whole gradient is $\sqrt{\sum_r \|g_r\|^2}$ over the ranks' shards $g_r$. Each
# rank alone sees one term. On FSDP2's DTensors, `clip_grad_norm_` computes the global norm:
# DTensor's norm all-reduces the squares. ZeRO by hand invites a rank to compute it on its own shard
# (`self.shard.grad`), and so do FSDP2's `to_local()` shards. That gives another number on every
# rank. By hand, the right one is one `all_reduce` of the squared norms:

# %%
def gradient_norms(rank, world_size, max_norm):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device).eval()
    whole = gst.model.Net().to(device).eval()
    whole.load_state_dict(model.state_dict())
    fully_shard(model, mesh=init_device_mesh(device.type, (world_size,)))
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(8 * world_size, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (8 * world_size,), generator=g).to(device)
    mine = slice(8 * rank, 8 * rank + 8)
    F.nll_loss(model(x[mine]), y[mine]).backward()
    F.nll_loss(whole(x), y).backward()
    local = [p.grad.to_local() for p in model.parameters()]  # this rank's shard of each
    shard_norm = torch.linalg.vector_norm(torch.cat([t.flatten() for t in local]))
    squares = shard_norm**2
    dist.all_reduce(squares)  # the sum over the ranks of the squared shard norms
    by_hand = squares.sqrt()
    wrong = [t * min(1.0, max_norm / (shard_norm.item() + 1e-6)) for t in local]  # shard-local
    fsdp_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor()
    whole_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm)
    right = [p.grad.to_local() for p in model.parameters()]  # clipped by FSDP2, global norm
    scale = max(abs(w / r).nan_to_num(1.0).max().item() for w, r in zip(wrong, right, strict=True))
    return {"shard": shard_norm.item(), "by hand": by_hand.item(), "FSDP2": fsdp_norm.item(),
            "one process": whole_norm.item(), "wrong / right": scale,
            "clipped": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "clipped, one process": {n: p.grad for n, p in whole.named_parameters()}}

norms = gst.launch(gradient_norms, world_size=WORLD_SIZE, args=(0.1,))

# %%
for rank, n in enumerate(norms):
    print(f"rank {rank}: norm of its shard {n['shard']:.4f} = {n['shard'] / n['FSDP2']:.2f} × "
          f"the gradient's norm {n['FSDP2']:.4f} (by hand {n['by hand']:.4f}, one process "
          f"{n['one process']:.4f}); its shard clipped with it: {n['wrong / right']:.2f}× the "
          "right values")
clipped_gap = gst.checks.compare_state_dicts(norms[0]["clipped"], norms[0]["clipped, one process"],
                                             show=False)
print(f"clip_grad_norm_ on FSDP2's DTensors vs one process: max |difference| {clipped_gap:.2g}")
assert all(abs(n["by hand"] - n["FSDP2"]) < 1e-5 and abs(n["FSDP2"] - n["one process"]) < 1e-5
           for n in norms)
assert all(n["shard"] < 0.95 * n["FSDP2"] for n in norms)  # every shard's norm is too small
assert all(n["wrong / right"] > 1.05 for n in norms)  # so every shard is clipped too little
assert abs(sum(n["shard"] ** 2 for n in norms) - norms[0]["FSDP2"] ** 2) < 1e-5
assert clipped_gap < 1e-6

# %% [markdown]
# Each shard's norm is smaller than the gradient's: about 1/√N of it when the shards hold equal
# shares. So each rank clips too little, each by its own factor, and nothing raises. The update is
# larger than `max_norm` allows, and no longer the gradient rescaled. `clip_grad_norm_` on FSDP2's
# parameters does it right, equal to one process. For shards of your own, all-reduce the squared
# norms (the exercise below).
#
# ### Notebook 02's `average_gradients` on an FSDP2 model
#
# After `backward()`, FSDP2's gradients are DTensors, already averaged over the ranks. The classic
# loop calls `dist.all_reduce(param.grad)` on them:

# %%
def average_gradients(model):  # notebook 02's, unchanged
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world_size


def classic_on_fsdp(rank, world_size, on_shards=False):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().to(device).eval()
    whole = gst.model.Net().to(device).eval()
    whole.load_state_dict(model.state_dict())
    fully_shard(model, mesh=init_device_mesh(device.type, (world_size,)))
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(8 * world_size, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (8 * world_size,), generator=g).to(device)
    F.nll_loss(model(x[8 * rank : 8 * rank + 8]), y[8 * rank : 8 * rank + 8]).backward()
    F.nll_loss(whole(x), y).backward()
    already = (model.conv2.weight.grad.full_tensor() - whole.conv2.weight.grad).abs().max()
    if not on_shards:
        average_gradients(model)  # raises: see below
    shard = model.conv2.weight.grad.to_local()  # 20 rows: 20 / N of them on this rank
    dist.all_reduce(shard)  # "fixed": runs, and adds rank 0's rows to rank 1's rows
    shard /= world_size
    rows = model.conv2.weight.grad.full_tensor()  # every rank's result, in rank order
    return {"already averaged": already.item(),
            "after": (rows - whole.conv2.weight.grad).abs().max().item()}

try:
    gst.launch(classic_on_fsdp, world_size=WORLD_SIZE)
except gst.RankFailedError as error:
    classic_error = error.failure
    print(f"average_gradients on FSDP2's gradients: rank {error.rank} raised "
          f"{classic_error.exc_type}: {classic_error.message}")
assert classic_error.exc_type == "NotImplementedError"
assert "c10d.allreduce_.default does not have a sharding strategy" in classic_error.message

# %% [markdown]
# A DTensor refuses `all_reduce`: the collective knows nothing of its placement. The tempting fix is
# `all_reduce(param.grad.to_local())`. It runs without a word on `conv2.weight`, whose shards have
# the same shape on every rank:

# %%
silent = gst.launch(partial(classic_on_fsdp, on_shards=True), world_size=WORLD_SIZE)[0]
print(f"FSDP2's conv2.weight.grad vs one process, right after backward(): max |difference| "
      f"{silent['already averaged']:.2g}; after all_reduce(to_local()) / N: "
      f"{silent['after']:.2g}")
assert silent["already averaged"] < 1e-6 and silent["after"] > 1e-3

# %% [markdown]
# The gradients were right after `backward()`. The "fix" replaced each rank's rows by the mean of
# different rows of the ranks. With FSDP2, write no averaging at all.
#
# ## Which reduce ops each backend accepts
#
# Each op is computed here on a fresh process group, since a refused `PREMUL_SUM` may break the
# group it ran on. We try `all_reduce` and `reduce_scatter`, on float32 and int64 tensors. Where
# this machine has no GPU per rank, the nccl column quotes the documentation instead.

# %%
def reduce_ops(rank, world_size, backend):
    device = gst.local_device() if backend == "nccl" else torch.device("cpu")
    ops = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG,
           "PREMUL_SUM": dist.ReduceOp.PREMUL_SUM(1 / world_size)}
    table = {}
    for (name, op), dtype in [(o, d) for o in ops.items() for d in (torch.float32, torch.int64)]:
        for collective in ("all_reduce", "reduce_scatter"):
            group = dist.new_group(backend=backend)  # its own group: a failure stays there
            t = torch.full((2 * world_size,), rank + 1, dtype=dtype, device=device)
            try:
                if collective == "all_reduce":
                    dist.all_reduce(t, op=op, group=group)
                else:
                    t = t[:2].clone()
                    reduce_scatter(t, torch.full((2 * world_size,), rank + 1, dtype=dtype,
                                                 device=device), op=op, group=group)
                table[name, str(dtype)[6:], collective] = f"ok: {t[0].item():g}"
            except (RuntimeError, TypeError, ValueError) as e:  # nccl's refusals: all three
                table[name, str(dtype)[6:], collective] = str(e).splitlines()[0]
    return table

backends = ["gloo"] + (["nccl"] if dist.is_nccl_available()
                       and torch.cuda.device_count() >= WORLD_SIZE else [])
accepted = {b: gst.launch(reduce_ops, WORLD_SIZE, (b,), backend=b)[0] for b in backends}

# %%
doc = " ".join(dist.ReduceOp.__doc__.split())  # the installed torch's own words
documented = {op: " ".join(s.strip() + "." for s in doc.split(". ") if s.startswith(f"``{op}``"))
              for op in ("AVG", "PREMUL_SUM")}
errors = sorted({v for t in accepted.values() for v in t.values() if not v.startswith("ok")})


def mark(outcome):  # "✓ 3" (the result), or "✗ (1)": error 1, listed below the table
    return outcome.replace("ok: ", "✓ ") if outcome.startswith("ok") else \
        f"✗ ({errors.index(outcome) + 1})"


print(f"all_reduce | reduce_scatter of 1, 2, ... on {WORLD_SIZE} ranks, torch {torch.__version__}")
print(f"{'op':<11}{'dtype':<9}{'gloo':<16}{'nccl'}")
for op in ("SUM", "AVG", "PREMUL_SUM"):
    for dtype in ("float32", "int64"):
        cells = {b: " | ".join(mark(t[op, dtype, c]) for c in ("all_reduce", "reduce_scatter"))
                 for b, t in accepted.items()}
        doc_note = {"AVG": "see (a)", "PREMUL_SUM": "see (b)"}.get(op, "no restriction")
        nccl = cells.get("nccl") or f"not run (no GPU per rank); docs: {doc_note}"
        print(f"{op:<11}{dtype:<9}{cells['gloo']:<16}{nccl}")
for number, error in enumerate(errors, start=1):
    print(f"({number}) {error}")
print(f"ReduceOp's docstring: (a) {documented['AVG']}\n(b) {documented['PREMUL_SUM']}")
gloo = accepted["gloo"]
assert gloo["SUM", "int64", "all_reduce"] == gloo["SUM", "float32", "reduce_scatter"] == \
    f"ok: {WORLD_SIZE * (WORLD_SIZE + 1) // 2:g}"
assert gloo["AVG", "float32", "all_reduce"] == f"ok: {(WORLD_SIZE + 1) / 2:g}"
assert "can't be cast to the desired output type Long" in gloo["AVG", "int64", "all_reduce"]
assert all(gloo["PREMUL_SUM", d, c] == "Cannot use ReduceOp.PREMUL_SUM with Gloo"
           for d in ("float32", "int64") for c in ("all_reduce", "reduce_scatter"))
assert "only available with the ``NCCL`` backend" in documented["AVG"]

# %% [markdown]
# So on gloo `AVG` works for floats, although the installed `ReduceOp` docstring (quoted above)
# still calls it NCCL-only. Gloo gained it in pytorch#149781 ("This is a simple SUM + division", to
# run FSDP on CPUs). For integers it fails: the division's float result cannot be written back into
# an int64 tensor. `PREMUL_SUM` is refused outright. On gloo, divide yourself (`SUM`, then ÷ N) or
# use `AVG`. For nccl and integers, NCCL's own code sums, then divides, rounding toward zero
# (`FuncSumPostDiv` in `src/device/reduce_kernel.h`, NVIDIA/nccl).
#
# ## Who divides by what
#
# Every library computes the same mean. They differ in where the division goes and how you turn it
# off. Each row is quoted from the library's own documentation or code (file, commit). Its formula
# is emulated below with real collectives.
#
# | library | where the 1/N goes | how to turn it off (token-count losses) |
# |---|---|---|
# | DDP | each gradient × 1/N as it is copied into its bucket, then `SUM`: `reducer.cpp` (`mark_variable_ready_dense`, pytorch/pytorch@0041320): "Divides while copying into the bucket view to save one scan over all the input parameters", with `div_factor_ = process_group_->getSize()`. With `gradient_as_bucket_view=True` and the gradients zeroed in place, the gradient is the bucket, divided in place by N (notebook 05) | no switch: multiply the loss by N, or register a communication hook that sums |
# | FSDP2 | the gradient divide factor: `AVG` (float32, bfloat16); `SUM` then ÷ N with the sum forced; in float16 and float64, ÷ about √N before `SUM` and the rest after (`_get_gradient_divide_factors`, above) | on every `FSDPModule`, since neither setter recurses (the loop over `model.modules()` above, as torchtitan does): `set_gradient_divide_factor(1.0)`, with `set_force_sum_reduction_for_comms(True)` on gloo |
# | DeepSpeed | `gradient_predivide_factor` p: "Before mean gradient allreduce, predivide gradients by a specified factor; this can sometimes help with fp16 stability when scaling to large numbers of GPUs" (default 1.0); `prescale_gradients`: "Scale gradients before doing mean allreduce" (default false) (`docs/_pages/config-json.md`). `allreduce_bucket` in `deepspeed/runtime/engine.py`: × 1/p, `all_reduce`, × p/N; with `prescale_gradients`, × 1/N then `all_reduce`. ZeRO 1/2 with `reduce_scatter` asserts p = 1.0 and divides the bucket by N before reducing (`average_tensor`, `deepspeed/runtime/zero/stage_1_and_2.py`; deepspeedai/DeepSpeed@edaa722) | `gradient_allreduce_op: "sum"`: "to keep the unscaled sum" (stages 0, 1 and 2) |
# | Megatron | `average_in_collective`: "If true, compute average in collective directly, as opposed to dividing by the dp_size first and then computing sum in the collective" (default False: `gradient_scaling_factor = 1.0 / data_parallel_world_size`, then `SUM`; True: factor 1.0 and `ReduceOp.AVG`) (`megatron/core/distributed/distributed_data_parallel_config.py`, `distributed_data_parallel.py`, `param_and_grad_buffer.py`; NVIDIA/Megatron-LM@d98e8a6) | `calculate_per_token_loss`: `gradient_scaling_factor = 1.0`, `SUM`; `finalize_model_grads` all-reduces `num_tokens` and scales by `1.0 / num_tokens` |
#
# In the emulation, each rank's gradient is 6 random numbers. For the token-count rows it is the sum
# over its `n_r` tokens, with `n_r` different on every rank. Each formula runs with real
# collectives. It is compared with the mean, or the token-weighted mean, computed from every rank's
# numbers:

# %%
def who_divides(rank, world_size):
    device = gst.local_device()
    N, AVG, SUM = world_size, dist.ReduceOp.AVG, dist.ReduceOp.SUM
    g = torch.randn(6, generator=torch.Generator().manual_seed(SEED + rank)).to(device)
    n = torch.tensor(8.0 * (rank + 1), device=device)  # this rank's tokens
    token_sum = g * n  # the gradient of the sum of the loss over this rank's tokens

    def reduced(t, op=SUM):  # one all_reduce of a copy
        t = t.clone()
        dist.all_reduce(t, op=op)
        return t

    p = 2.0  # a gradient_predivide_factor other than 1
    pre, post, _, _ = _fsdp_collectives._get_gradient_divide_factors(
        dist.group.WORLD, None, torch.float64)  # what FSDP2 divides by, before and after
    means = {
        "DDP: × 1/N, SUM": reduced(g * (1.0 / N)),
        "FSDP2 float32: AVG": reduced(g, AVG),
        "FSDP2 float64: ÷ pre, SUM, ÷ post": reduced(g / pre) / post,  # torch's own factors
        "DeepSpeed default: × 1/p (p = 1), SUM, × p/N": reduced(g * 1.0) * (1.0 / N),
        f"DeepSpeed p = {p:g}: × 1/p, SUM, × p/N": reduced(g * (1 / p)) * (p / N),
        "DeepSpeed prescale_gradients: × 1/N, SUM": reduced(g * (1.0 / N)),
        "Megatron default: × 1/N, SUM": reduced(g * (1.0 / N)),
        "Megatron average_in_collective: AVG": reduced(g, AVG),
    }
    total = reduced(n)
    token_means = {
        "DDP: the loss × N, then × 1/N, SUM": reduced(token_sum / total * N * (1.0 / N)),
        "FSDP2 factor 1: SUM, then the loss's ÷ tokens": reduced(token_sum / total),
        "DeepSpeed gradient_allreduce_op sum: SUM, ÷ tokens": reduced(token_sum / total),
        "Megatron calculate_per_token_loss: SUM, × 1/num_tokens": reduced(token_sum) / total,
    }
    everyone = [torch.empty_like(g) for _ in range(N)]
    dist.all_gather(everyone, g)  # every rank's numbers, for the reference
    counts = torch.tensor([8.0 * (r + 1) for r in range(N)], device=device)
    stacked = torch.stack(everyone)
    return {"means": means, "token_means": token_means, "mean": stacked.mean(0),
            "token_mean": (stacked * counts[:, None]).sum(0) / counts.sum()}

formulas = gst.launch(who_divides, world_size=WORLD_SIZE)[0]

# %%
for name, value in formulas["means"].items():
    gap = (value - formulas["mean"]).abs().max().item()
    print(f"{name:<52} = the mean over ranks (max |difference| {gap:.1g})")
    assert gap < 1e-6
for name, value in formulas["token_means"].items():
    gap = (value - formulas["token_mean"]).abs().max().item()
    print(f"{name:<52} = the mean over all tokens (max |difference| {gap:.1g})")
    assert gap < 1e-6

# %% [markdown]
# Why divide *before* the sum at all, as DDP, DeepSpeed's predivide and FSDP2's float16 and float64
# path do? A sum can overflow where the mean does not. FSDP2's code says it: "To avoid
# overflow/underflow, we divide by ~sqrt(N) before/after the reduction". So does DeepSpeed's "fp16
# stability". Here in float16, whose largest number is 65,504, with every rank holding 40,000:

# %%
def overflow(rank, world_size):
    g = torch.full((3,), 40_000.0, dtype=torch.float16, device=gst.local_device())
    after = g.clone()
    dist.all_reduce(after)  # SUM first: 40,000 N does not fit in float16
    after /= world_size
    before = g / world_size  # divided first: the sum is the mean, and it fits
    dist.all_reduce(before)
    return {"sum, then ÷ N": after[0].item(), "÷ N, then sum": before[0].item()}

fp16 = gst.launch(overflow, world_size=WORLD_SIZE)[0]
print(f"float16, 40,000 on each of {WORLD_SIZE} ranks: {fp16}")
assert fp16["sum, then ÷ N"] == float("inf") and fp16["÷ N, then sum"] == 40_000.0

# %% [markdown]
# ## Copy this into your code
#
# `snippets/08_fsdp2.py` is a whole script. The course's tests run it with
# `torchrun --standalone --nproc-per-node 2`. It has notebook 06's `init_distributed()`, a device
# mesh on the device's type, and `fully_shard` on each layer and on the model. It clips gradients
# with the global norm. It checkpoints with `torch.distributed.checkpoint` (DCP), each rank writing
# its own shards. Its `sum_gradients_over_ranks` is the loop above, for token-count losses. It ends
# by checking three things on every rank. Three steps equal one process's on the whole batch. The
# checkpoint loads back. A token-count loss on uneven ranks gets one process's gradient. The whole
# tensors of its `full_tensor()` state dict are for the check only: they gather the whole model onto
# every rank.
#
# <!-- snippets/08_fsdp2.py -->
# ```python
# """Notebook 08, copy this into your code: FSDP2 (fully_shard), each rank holding 1/N of the
# parameters, gradients and optimizer state.
#
#     torchrun --standalone --nproc-per-node 2 snippets/08_fsdp2.py
# """
#
# import copy
# import os
# import warnings
#
# import torch
# import torch.distributed as dist
# import torch.distributed.checkpoint as dcp
#
# # before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
# import torch.distributed.nn  # noqa: F401
# import torch.nn.functional as F
# from torch import nn
# from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
# from torch.distributed.device_mesh import init_device_mesh
# from torch.distributed.fsdp import FSDPModule, fully_shard
#
# CHECKPOINT = "checkpoints/08_fsdp2"  # a folder every rank can read (shared file system on many
#                                     # machines): each rank writes its own file into it
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
# def sum_gradients_over_ranks(model):
#     """For token-count losses (each rank's loss: its sum / the global count): FSDP2 sums the
#     gradients over the ranks instead of averaging them. Neither setter recurses, so set both on
#     every FSDP unit: on the root alone, the blocks still divide by N (notebook 08: 0.5x)."""
#     for module in model.modules():
#         if isinstance(module, FSDPModule):     # each fully_shard'ed block, and the root
#             module.set_gradient_divide_factor(1.0)          # no ÷ N: the loss holds the mean
#             module.set_force_sum_reduction_for_comms(True)  # SUM: gloo has no PREMUL_SUM
#
#
# def check_token_count_loss(whole, mesh, device):
#     """Check: a token-count loss on uneven ranks (8, 16, ... tokens) gives one process's mean
#     over every token, with sum_gradients_over_ranks on a model sharded block by block."""
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     whole.zero_grad()
#     model = copy.deepcopy(whole)               # the same weights on every rank
#     for layer in model:
#         if isinstance(layer, nn.Linear):
#             fully_shard(layer, mesh=mesh)
#     fully_shard(model, mesh=mesh)
#     sum_gradients_over_ranks(model)            # after the last fully_shard
#     counts = [8 * (r + 1) for r in range(world_size)]
#     g = torch.Generator().manual_seed(2)
#     x = torch.randn(sum(counts), 20, generator=g).to(device)
#     y = torch.randint(0, 3, (sum(counts),), generator=g).to(device)
#     mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
#     tokens = torch.tensor(float(counts[rank]), device=device)
#     dist.all_reduce(tokens)                    # the global count
#     (F.cross_entropy(model(x[mine]), y[mine], reduction="sum") / tokens).backward()
#     F.cross_entropy(whole(x), y).backward()    # one process: the mean over every token
#     for p, q in zip(model.parameters(), whole.parameters(), strict=True):
#         torch.testing.assert_close(p.grad.full_tensor(), q.grad)
#
#
# def main():
#     device = init_distributed()
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     # The same initial weights on every rank: FSDP2, unlike DDP, broadcasts nothing.
#     torch.manual_seed(0)
#     model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3)).to(device)
#     whole = copy.deepcopy(model)               # for the check below: one process, every sample
#
#     mesh = init_device_mesh(device.type, (world_size,))  # "cuda" with nccl, "cpu" with gloo
#     for layer in model:
#         if isinstance(layer, nn.Linear):
#             fully_shard(layer, mesh=mesh)      # its gradients are reduce-scattered once ready
#     fully_shard(model, mesh=mesh)              # the root: whatever is left
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # 1/N of the state
#     # A token-count loss needs sum_gradients_over_ranks(model) here (checked at the end).
#
#     g = torch.Generator().manual_seed(1)       # one global batch, 16 samples per rank...
#     n = 16 * world_size                        # equal shards: FSDP2's mean is then the mean
#     x, y = torch.randn(n, 20, generator=g).to(device), torch.randint(0, 3, (n,), generator=g)
#     y = y.to(device)
#     mine = slice(rank, None, world_size)       # ...a different shard on each rank
#     reference = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
#     for _ in range(3):
#         optimizer.zero_grad()
#         F.cross_entropy(model(x[mine]), y[mine]).backward()  # reduce-scattered: the mean, 1/N
#         norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # the global norm
#         optimizer.step()
#         reference.zero_grad()
#         F.cross_entropy(whole(x), y).backward()
#         whole_norm = nn.utils.clip_grad_norm_(whole.parameters(), max_norm=0.5)
#         reference.step()
#
#     # To checkpoint FSDP2, DCP writes each rank's own shards: no rank holds the whole model.
#     model_state, optimizer_state = get_state_dict(model, optimizer)
#     dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=CHECKPOINT)
#
#     # For the check only: full_tensor() gathers every whole tensor onto every rank.
#     state = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank calls it
#     # Check: 3 steps of FSDP2 on N ranks are 3 steps of one process on the whole batch.
#     torch.testing.assert_close(norm.full_tensor(), whole_norm)
#     for name, p in whole.state_dict().items():
#         torch.testing.assert_close(state[name], p)
#     # Check: loading the checkpoint brings back the weights, after they were zeroed.
#     with torch.no_grad():
#         for p in model.parameters():
#             p.zero_()
#     model_state, optimizer_state = get_state_dict(model, optimizer)
#     dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=CHECKPOINT)
#     set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
#     for name, p in model.state_dict().items():
#         torch.testing.assert_close(p.full_tensor(), state[name])
#     check_token_count_loss(whole, mesh, device)
#     print(f"rank {rank}: holds {sum(p.to_local().numel() for p in model.parameters())} of "
#           f"{sum(p.numel() for p in whole.parameters())} parameters; after 3 steps the model "
#           "equals one process's on the whole batch, and so does the reloaded checkpoint; a "
#           "token-count loss on uneven ranks gives one process's gradient")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```

# %% [markdown]
# ## Exercise
#
# Write `average_and_clip_shard(flat_grad, max_norm)`, the heart of a sharded optimizer step. Every
# rank passes its own whole flat gradient, its length a multiple of the world size. Return this
# rank's shard of the **mean** gradient. Shard r holds elements `r * size` to `(r + 1) * size`, with
# `size = len(flat_grad) // world_size`. Clip it as `clip_grad_norm_` clips: multiply it by
# `min(1, max_norm / (norm + 1e-6))`. Here `norm` is the norm of the *whole* mean gradient. Use one
# `reduce_scatter`, then one `all_reduce` of a single number.
#
# The check runs it at two world sizes, with shards of their own sizes. It runs with and
# without clipping, against the reference. It looks at what your collectives delivered. `flat_grad`
# must be left as it was, since it is the caller's. It prints "✓ correct", or fails with what is
# wrong. Until you write the function, it says "not attempted yet". Stuck?
# `%load solutions/08_average_and_clip_shard.py` in a new cell.

# %%
def average_and_clip_shard(flat_grad, max_norm):
    # your code here: reduce_scatter, ÷ N, the global norm (all_reduce of squares), clip
    raise NotImplementedError("write average_and_clip_shard")


# %%
gst.exercises.check_average_and_clip_shard(average_and_clip_shard)
