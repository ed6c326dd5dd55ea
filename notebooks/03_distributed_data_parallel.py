# %% [markdown]
# # 03 — `DistributedDataParallel`: the same averaging, done for you
#
# **Question: what does `DistributedDataParallel` (DDP) do, and does it give the same result as
# averaging gradients by hand?**
#
# Notebook 02 averaged gradients with one `all_reduce` per parameter, after `backward()`. DDP wraps
# the model and does the same averaging *during* `backward()`, in a few large **buckets** (see the
# [glossary](../README.md#glossary)). It also **broadcasts rank 0's parameters when it is built**,
# so the replicas start equal even if the ranks were seeded differently. This notebook checks
# both claims against notebook 02's own code.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # set it to 1 for a short run (the tests do)
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5  # the classic example's SGD settings
EPOCHS = 1 if SMOKE_TEST else 2
N_TRAIN = 4096 if SMOKE_TEST else 12_288  # images per epoch, as in notebook 02 (DDP = manual
# averaging is an identity: a few thousand images prove it as well as 60,000)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

import gradsync_tutorial as gst

# %% [markdown]
# ## `DistributedSampler` gives each rank the same shard as notebook 02
#
# Notebook 02 shuffled with a generator seeded `SEED + epoch` and gave rank `r` every N-th index,
# `order[r::N]`. `DistributedSampler` does the same: its `set_epoch(epoch)` reseeds the shuffle
# with `seed + epoch`, identically on every rank. (Forget `set_epoch` and every epoch repeats the
# same order: notebook 04.)

# %%
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
# One difference: when the dataset's size is not a multiple of N, `DistributedSampler` gives
# every rank the same number of samples by **repeating** the first ones of the order (notebook
# 02's `order[rank::N]` would give some ranks one sample fewer, and the ranks would then disagree
# on the number of steps). Here with 3N + 1 samples, unshuffled so the indices are readable:

# %%
size = 3 * WORLD_SIZE + 1
shards = [list(DistributedSampler(range(size), WORLD_SIZE, rank, shuffle=False))
          for rank in range(WORLD_SIZE)]
for rank, shard in enumerate(shards):
    print(f"rank {rank}: {shard}")
drawn = sorted(i for shard in shards for i in shard)
repeated = [i for i in range(size) if drawn.count(i) > 1]
print(f"{size} samples, {len(drawn)} drawn: repeated {repeated}")
assert {len(shard) for shard in shards} == {-(-size // WORLD_SIZE)}  # ceil(size / N) each
assert repeated == list(range(len(drawn) - size))  # the first ones, once more
assert len(images) % WORLD_SIZE == 0  # the lesson's data: no repeats

# %% [markdown]
# (`drop_last=True` drops the extra samples instead of repeating some. Both are in
# `DistributedSampler`'s documentation: "If `False`, the sampler will add extra indices to make
# the data evenly divisible across the replicas." Evaluation has to care: see "Evaluating on N
# ranks" below.)
#
# ## The training loop with DDP
#
# Notebook 02's `train`, read from notebook 02, against this one:

# %% tags=["training-loop"]
def train(rank, world_size, epochs, lr=LR, dropout=True, dtype=torch.float32):
    torch.manual_seed(SEED)  # the initial weights, the same wherever this runs
    device = gst.local_device()  # a GPU if there is one, else the CPU
    model = gst.model.Net().to(device, dtype)
    model = DDP(model)  # broadcasts rank 0's weights; averages gradients in backward()
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
    return {"losses": losses, "state": model.module.state_dict()}  # .module: the Net inside


# %%
train_02 = gst.notebooks.load_function("02_manual_allreduce_averaging", "train",
                                       requires=["average_gradients"],
                                       settings={"N_TRAIN": N_TRAIN})  # on this notebook's images
changes = gst.notebooks.show_diff(train_02, train, names=("02: train", "03: train"))
assert changes == 6

# %% [markdown]
# Six places change, for three ideas: the model is wrapped in `DDP` (one line); the shard comes
# from a `DistributedSampler` (two places: the sampler, and `set_epoch` in place of the shuffle);
# the hand-written averaging is gone (the `average` argument and the `average(model)` call),
# since `backward()` now averages. The last change reads the state dict from `model.module`,
# the `Net` that DDP wraps.

# %%
ddp = gst.launch(train, world_size=WORLD_SIZE, args=(EPOCHS,))
manual = gst.launch(train_02, world_size=WORLD_SIZE, args=(EPOCHS,))

# %% [markdown]
# ## DDP = manual averaging
#
# Same seed, same shards, same optimizer: DDP's parameters match notebook 02's manual averaging.
# DDP scales each gradient by 1/N *before* summing, in one bucket, while `average_gradients` sums,
# then divides, tensor by tensor. With 2 ranks the two are even bit-identical: scaling by 1/2 is
# exact in floating point, and a sum of two numbers does not depend on their order. (On GPUs,
# expected as well, not yet run there: both runs use the deterministic kernels that
# `gst.launch` asks cuDNN for.) With more ranks the last bits can differ, hence the tolerance.
# The main cause: DDP multiplies each gradient by 1/N before the sum, `average_gradients`
# divides after it, and only for N a power of two are both exact (measured below). The order
# of the additions can differ too, one large bucket against 8 separate tensors.

# %%
diff = gst.checks.compare_state_dicts(ddp[0]["state"], manual[0]["state"], names=("DDP", "manual"))

# %%
steps = len(ddp[0]["losses"])
print(f"after {steps} steps, max |DDP - manual| = {diff:.2g} (<= 1e-4: {diff <= 1e-4})")
assert diff <= 1e-4
if WORLD_SIZE == 2:  # bit for bit
    assert diff == 0.0
assert gst.checks.compare_ranks([r["state"] for r in ddp], show=False) == 0.0
print("DDP's replicas are identical across ranks")

# %% [markdown]
# The two loss curves lie on top of each other (the dashed line is manual averaging); how far
# apart they are, step by step, is printed under the plot.

# %% tags=["image:loss_curves_ddp.png"]
fig = gst.plots.plot_loss_curves(
    {"DDP, rank 0": ddp[0]["losses"]},
    baseline={"manual averaging (notebook 02), rank 0": manual[0]["losses"]},
    title=f"DDP vs manual averaging, {WORLD_SIZE} ranks",
)
gaps = [abs(a - b) for a, b in zip(ddp[0]["losses"], manual[0]["losses"], strict=True)]
print(f"max |DDP - manual| over every step's loss: {max(gaps):.2g}")

# %% [markdown]
# ## Inside DDP: 1/N first, then one `all_reduce` per bucket
#
# With no hook registered, DDP's built-in reduction multiplies each gradient by 1/N as it copies
# it into its bucket, then calls `all_reduce(SUM)` on the bucket. A **communication hook**
# replaces that step: DDP hands it each filled bucket (`bucket.buffer()`, the gradients
# flattened, not yet scaled) and takes back a `torch.futures.Future` of the reduced bucket.
# `dist.all_reduce(buffer, async_op=True)` starts the call and returns a handle at once,
# `.get_future()` turns the handle into a future, and `.then(fn)` says what the future's value
# is when the call has finished: here the reduced buffer itself (notebook 05 uses hooks for
# more). Below, DDP's reduction spelled out as our own hook, with a record of what it sees. Each
# rank's hook receives one bucket: all 21,840 gradients of this small model. If this is what DDP
# does, registering it changes nothing, bit for bit.

# %%
def ddp_gradients(rank, world_size, batch, hook=None):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = DDP(gst.model.Net().to(device).eval())  # eval: dropout off
    seen = []

    def scale_then_sum(state, bucket):  # DDP's built-in reduction, spelled out
        buffer = bucket.buffer()  # this rank's gradients, flattened into one bucket
        local = buffer.clone()
        buffer.mul_(1 / dist.get_world_size())  # 1/N first...
        seen.append({"local": local, "sent": buffer.clone()})
        fut = dist.all_reduce(buffer, async_op=True).get_future()  # ...then the sum
        return fut.then(lambda f: f.value()[0])

    if hook == "allreduce_hook":  # PyTorch's Python hook: divides the bucket by N
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook:
        model.register_comm_hook(None, scale_then_sum)
    images, labels = gst.data.load(train=True)
    idx = batch[rank::world_size]
    F.nll_loss(model(images[idx].to(device)), labels[idx].to(device)).backward()
    grads = {name: p.grad for name, p in model.module.named_parameters()}
    return {"grads": grads, "buckets": seen}

batch = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED))[:GLOBAL_BATCH]
plain = gst.launch(ddp_gradients, world_size=WORLD_SIZE, args=(batch,))
hooked = gst.launch(ddp_gradients, world_size=WORLD_SIZE, args=(batch, True))

# %%
same = gst.checks.compare_state_dicts(plain[0]["grads"], hooked[0]["grads"], show=False)
buckets = hooked[0]["buckets"]
sent = [r["buckets"][0]["sent"] for r in hooked]
local = [r["buckets"][0]["local"] for r in hooked]
scaled = max((s - loc / WORLD_SIZE).abs().max().item() for s, loc in zip(sent, local, strict=True))
mean = torch.stack(local).mean(0)
final = torch.cat([g.flatten() for g in hooked[0]["grads"].values()])
print(f"buckets per step: {len(buckets)}, holding {buckets[0]['local'].numel()} gradients")
print(f"max |what each rank sends - its gradient / {WORLD_SIZE}| = {scaled:.2g}")
print(f"our hook vs DDP's built-in reduction, max |gradient difference| = {same:.2g}")
assert len(buckets) == 1 and buckets[0]["local"].numel() == 21840
assert scaled == 0.0 and same == 0.0
assert torch.allclose(final.sort().values, mean.sort().values, atol=1e-7)  # the mean, reordered

# %% [markdown]
# With 2 ranks, multiplying by 1/2 and dividing by 2 are the same (1/2 is exact). With 3 they
# are not: 1/3 is rounded. On 3 ranks, our hook against DDP's built-in reduction, and PyTorch's
# own `default_hooks.allreduce_hook`, which divides the bucket by N instead:

# %%
three = {hook: gst.launch(ddp_gradients, world_size=3, args=(batch, hook))[0]["grads"]
         for hook in (None, True, "allreduce_hook")}
flat = {hook: torch.cat([g.flatten() for g in grads.values()]) for hook, grads in three.items()}
ours = (flat[True] != flat[None]).sum().item()
divided = (flat["allreduce_hook"] != flat[None]).sum().item()
print(f"3 ranks, gradients that differ from DDP's built-in reduction: our hook (x 1/N) {ours}, "
      f"allreduce_hook (/ N) {divided:,} of {len(flat[None]):,} "
      f"(max {(flat['allreduce_hook'] - flat[None]).abs().max():.1e})")
assert ours == 0 < divided

# %% [markdown]
# ## DDP broadcasts rank 0's weights at construction
#
# Now seed every rank differently, as happens when a script seeds with the rank or not at all
# (notebook 02 measured how far apart that starts the replicas). `DDP(model)` copies rank 0's
# parameters to every rank, so the replicas agree before the first step.

# %%
def seeded_apart(rank, world_size):
    torch.manual_seed(SEED + rank)  # a different seed on every rank: a bug, on purpose
    model = gst.model.Net().to(gst.local_device())
    before = gst.checks.max_diff_across_ranks(model)
    model = DDP(model)  # broadcasts rank 0's parameters and buffers
    return before, gst.checks.max_diff_across_ranks(model.module)

before, after = gst.launch(seeded_apart, world_size=WORLD_SIZE)[0]
print(f"max difference between ranks: before DDP(model) {before:.2g}, after {after:.2g}")
assert before > 0.1 and after == 0.0


# %% [markdown]
# ## Evaluating on N ranks: count every sample once
#
# Evaluation can be split across the ranks too, each scoring its part of the test set. Two
# things make the naive version wrong. `DistributedSampler` pads the ranks' parts to equal
# length by **repeating** samples (above), so the repeated ones are counted twice; and the mean
# of the ranks' accuracies weighs ranks, not samples, whenever their parts differ in size. Here
# the trained DDP model on a test set whose size no number of ranks from 2 to 4 divides, the
# first 1,001 test images: the naive way (`DistributedSampler`, the mean of the ranks'
# accuracies), and the fix, each sample on exactly one rank (`order[rank::N]`, unequal parts)
# and one `all_reduce` of the number correct *and* the number scored. (The accuracy is low, an
# under-trained model: 96 steps, where notebook 01 trains 470. It is not the point here.)

# %%
N_EVAL = 1_001

def evaluate(rank, world_size, state, fix):
    device = gst.local_device()
    model = gst.model.Net().to(device).eval()
    model.load_state_dict(state)
    images, labels = gst.data.load(train=False)
    if fix:  # every sample on exactly one rank: parts of 501 and 500 on 2 ranks
        idx = torch.arange(N_EVAL)[rank::world_size]
    else:  # the training sampler: padded, so some samples are scored twice
        idx = torch.tensor(list(DistributedSampler(range(N_EVAL), world_size, rank,
                                                   shuffle=False)))
    with torch.no_grad():
        correct = (model(images[idx].to(device)).argmax(1) == labels[idx].to(device)).sum()
    totals = torch.stack([correct.float(), torch.tensor(float(len(idx)), device=device)])
    dist.all_reduce(totals)  # [correct, scored] over all ranks
    if fix:
        accuracy = totals[0] / totals[1]  # correct over all ranks / scored over all ranks
    else:  # the mean of the ranks' own accuracies
        accuracy = correct.float() / len(idx)
        dist.all_reduce(accuracy)
        accuracy /= world_size
    return {"accuracy": accuracy.item(), "correct": int(totals[0]), "scored": int(totals[1])}

state = ddp[0]["state"]
naive = gst.launch(evaluate, world_size=WORLD_SIZE, args=(state, False))[0]
fixed = gst.launch(evaluate, world_size=WORLD_SIZE, args=(state, True))[0]

# %%
test_images, test_labels = gst.data.load(train=False)
one_process = gst.model.Net().eval()
one_process.load_state_dict(state)
with torch.no_grad():
    correct = (one_process(test_images[:N_EVAL]).argmax(1) == test_labels[:N_EVAL]).sum().item()
print(f"one process: {correct} of {N_EVAL} correct, accuracy {correct / N_EVAL:.6f}")
for name, r in [("DistributedSampler, mean of the ranks", naive),
                ("each sample once, all_reduce", fixed)]:
    print(f"{name:38}: {r['scored']} predictions scored, accuracy {r['accuracy']:.6f}")
assert naive["scored"] > N_EVAL and naive["accuracy"] != correct / N_EVAL  # counted twice
assert fixed["scored"] == N_EVAL and fixed["correct"] == correct  # each sample once
assert abs(fixed["accuracy"] - correct / N_EVAL) <= 1e-7


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
# import os
# import warnings
#
# import torch
# import torch.distributed as dist
#
# # now, not after init_process_group (DDP would): its group=WORLD defaults hold gloo open at exit
# import torch.distributed.nn  # noqa: F401
# import torch.nn.functional as F
# from torch import nn
# from torch.nn.parallel import DistributedDataParallel as DDP
# from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
#
# SEED = 1234
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
#     dataset = TensorDataset(torch.randn(512, 20, generator=torch.Generator().manual_seed(SEED)),
#                             torch.arange(512) % 3)
#     global_batch, epochs, path = 64, 2, "ddp_checkpoint.pt"
#
#     model = DDP(nn.Linear(20, 3).to(device))  # after init: copies rank 0's weights to all
#     torch.manual_seed(SEED + rank)            # then each rank its own dropout masks
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
#     sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # a different shard per rank
#     loader = DataLoader(dataset, batch_size=global_batch // world_size, sampler=sampler)
#     for epoch in range(epochs):
#         sampler.set_epoch(epoch)               # or every epoch repeats the same order
#         for x, y in loader:
#             x, y = x.to(device), y.to(device)
#             optimizer.zero_grad()
#             F.cross_entropy(model(x), y).backward()  # gradients are averaged across ranks here
#             optimizer.step()
#
#     if rank == 0:                              # one file, written once
#         torch.save(model.module.state_dict(), path)  # .module: the unwrapped model
#     dist.barrier()                             # no rank reads it, or exits, before it is written
#
#     # Check: the file holds every rank's weights (the replicas are equal). map_location: each
#     # rank loads onto its own device, not onto the GPU rank 0 saved from. Every rank reads
#     # rank 0's file: one machine, or a file system the machines share.
#     saved = torch.load(path, map_location=device, weights_only=True)
#     for name, p in model.module.state_dict().items():
#         assert torch.equal(saved[name], p), name
#     print(f"rank {rank}: {len(loader)} steps an epoch, weights equal to the checkpoint, "
#           f"on {device} ({dist.get_backend()})")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```

# %% [markdown]
# ## Exercise
#
# DDP copies rank 0's weights to every rank when it is built. Do it by hand: write
# `broadcast_parameters(model)` so that afterwards every rank's parameters equal rank 0's. Call
# `dist.broadcast(tensor, src=0)` for every parameter: it works in place, rank 0 sends `tensor`
# and every other rank's `tensor` is overwritten with rank 0's values. So pass the parameter
# itself (`p.detach()` or `p.data`: the same memory), not a copy.
#
# The check below starts each rank (2, then 3 of them) from a different seed, calls your function and compares
# the ranks. It prints "✓ correct", or fails with what is wrong; until you write the function,
# it says "not attempted yet". Stuck? `%load solutions/03_broadcast_parameters.py` in a new cell.
#
# Then use it in training, not checked: copy notebook 02's `train` into a cell, seed with
# `torch.manual_seed(SEED + rank)` instead of `SEED` (the bug), and call
# `broadcast_parameters(model)` right after the model is built. Launch it on `WORLD_SIZE` ranks:
# `gst.checks.compare_ranks` on the returned states finds identical replicas, as with DDP.

# %%
def broadcast_parameters(model):
    # your code here: dist.broadcast every parameter from rank 0
    raise NotImplementedError("write broadcast_parameters")


# %%
gst.exercises.check_broadcast_parameters(broadcast_parameters)
