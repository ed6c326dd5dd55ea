# %% [markdown]
# # 03 — `DistributedDataParallel`: the same averaging, done for you
#
# **Question: what does `DistributedDataParallel` (DDP) do, and does it give the same result as
# averaging gradients by hand?**
#
# **Short answer:** wrap the model in `DDP(model)` and delete your averaging. On 2 ranks it trains
# to notebook 02's parameters, bit for bit.
#
# Notebook 02 averaged gradients with one `all_reduce` per parameter, after `backward()`. DDP wraps
# the model and does the same averaging *during* `backward()`, in a few large **buckets** (see the
# [glossary](../README.md#glossary)). It also **broadcasts rank 0's parameters when it is built**.
# So the replicas start equal even if the ranks were seeded differently. This notebook checks both
# claims against notebook 02's own code. It then measures three pitfalls whose fix is a DDP option.

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
# `order[r::N]`. `DistributedSampler` does the same. Its `set_epoch(epoch)` reseeds the shuffle with
# `seed + epoch`, identically on every rank. Forget `set_epoch`, and every epoch repeats the same
# order (notebook 04).

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
# One difference: the dataset's size may not be a multiple of N. `DistributedSampler` then gives
# every rank the same number of samples by **repeating** the first ones of the order. Notebook 02's
# `order[rank::N]` would give some ranks one sample fewer, and the ranks would then disagree on the
# number of steps. Here with 3N + 1 samples, unshuffled so the indices are readable:

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
# `drop_last=True` drops the extra samples instead of repeating some. Both are in
# `DistributedSampler`'s documentation: "If `False`, the sampler will add extra indices to make the
# data evenly divisible across the replicas." Evaluation has to care (below).
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
# Six places change, for three ideas:
#
# | idea | places |
# |---|---|
# | the model is wrapped in `DDP` | one line |
# | the shard comes from a `DistributedSampler` | two: the sampler, and `set_epoch` in place of the shuffle |
# | the hand-written averaging is gone, since `backward()` now averages | two: the `average` argument and the `average(model)` call |
#
# The last change reads the state dict from `model.module`, the `Net` that DDP wraps.
#
# Like notebook 02's, this loop seeds once, so every rank draws the same dropout masks. The exact
# comparisons need that. A script reseeds with `SEED + rank` right after building the model, as
# the snippet at the end does.

# %%
ddp = gst.launch(train, world_size=WORLD_SIZE, args=(EPOCHS,))
manual = gst.launch(train_02, world_size=WORLD_SIZE, args=(EPOCHS,))

# %% [markdown]
# ## DDP = manual averaging
#
# Same seed, same shards, same optimizer: DDP's parameters match notebook 02's manual averaging. DDP
# scales each gradient by 1/N *before* summing, in one bucket. `average_gradients` sums, then
# divides, tensor by tensor. With 2 ranks the two are even bit-identical. Scaling by 1/2 is exact in
# floating point, and a sum of two numbers does not depend on their order. On GPUs this is expected
# as well, but not yet run there; both runs use the deterministic kernels that `gst.launch` asks
# cuDNN for.
#
# With more ranks the last bits can differ, hence the tolerance. The main cause is the order of
# scaling and summing. DDP multiplies each gradient by 1/N before the sum, and `average_gradients`
# divides after it. Only for N a power of two are both exact (measured below). The order of the
# additions can differ too: one large bucket against 8 separate tensors.

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
# The two loss curves lie on top of each other; the dashed line is manual averaging. Their distance
# per step is printed under the plot.

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
# Without a hook, DDP multiplies each gradient by 1/N as it copies it into its bucket. It then calls
# `all_reduce(SUM)` on the bucket. A **communication hook** replaces that step. DDP hands it each
# filled bucket: `bucket.buffer()`, the gradients flattened, not yet scaled. It takes back a
# `torch.futures.Future` of the reduced bucket. Three calls build it:
#
# - `dist.all_reduce(buffer, async_op=True)` starts the call and returns a handle at once;
# - `.get_future()` turns the handle into a future;
# - `.then(fn)` says what the future's value is when the call has finished (the buffer).
#
# Notebook 05 uses hooks for more. Below, DDP's reduction is spelled out as our own hook, with a
# record of what it sees. Each rank's hook receives one bucket: all 21,840 gradients of this small
# model. If this is what DDP does, registering it changes nothing, bit for bit.

# %%
def ddp_gradients(rank, world_size, batch, hook=None):  # hook: None, "ours", "allreduce_hook"
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
    elif hook == "ours":
        model.register_comm_hook(None, scale_then_sum)
    images, labels = gst.data.load(train=True)
    idx = batch[rank::world_size]
    F.nll_loss(model(images[idx].to(device)), labels[idx].to(device)).backward()
    grads = {name: p.grad for name, p in model.module.named_parameters()}
    return {"grads": grads, "buckets": seen}

batch = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED))[:GLOBAL_BATCH]
plain = gst.launch(ddp_gradients, world_size=WORLD_SIZE, args=(batch,))
hooked = gst.launch(ddp_gradients, world_size=WORLD_SIZE, args=(batch, "ours"))

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
# With 2 ranks, multiplying by 1/2 and dividing by 2 are the same, since 1/2 is exact. With 3 they
# are not: 1/3 is rounded. Here on 3 ranks are our hook, DDP's built-in reduction, and PyTorch's own
# `default_hooks.allreduce_hook`. The last one divides the bucket by N instead:

# %%
three = {hook: gst.launch(ddp_gradients, world_size=3, args=(batch, hook))[0]["grads"]
         for hook in (None, "ours", "allreduce_hook")}
flat = {hook: torch.cat([g.flatten() for g in grads.values()]) for hook, grads in three.items()}
ours = (flat["ours"] != flat[None]).sum().item()
divided = (flat["allreduce_hook"] != flat[None]).sum().item()
print(f"3 ranks, gradients that differ from DDP's built-in reduction: our hook (x 1/N) {ours}, "
      f"allreduce_hook (/ N) {divided:,} of {len(flat[None]):,} "
      f"(max {(flat['allreduce_hook'] - flat[None]).abs().max():.1e})")
assert ours == 0 < divided

# %% [markdown]
# ## DDP broadcasts rank 0's weights at construction
#
# Now seed every rank differently, as a script does when it seeds with the rank or not at all.
# (Notebook 02 measured how far apart that starts the replicas.) `DDP(model)` copies rank 0's
# parameters to every rank. So the replicas agree before the first step.

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
# Evaluation can be split across the ranks too, each scoring its part of the test set. Two things
# make the naive version wrong. `DistributedSampler` pads the ranks' parts to equal length by
# **repeating** samples (above), so the repeated ones are counted twice. And the mean of the ranks'
# accuracies weighs ranks, not samples, whenever their parts differ in size.
#
# Here is the trained DDP model on the first 1,001 test images, a size that no number of ranks from
# 2 to 4 divides. We compare two ways:
#
# | way | samples | accuracy |
# |---|---|---|
# | naive | `DistributedSampler` | the mean of the ranks' accuracies |
# | fix | each sample on exactly one rank (`order[rank::N]`, unequal parts) | one `all_reduce` of the number correct *and* the number scored |
#
# The accuracy is low: an under-trained model, 96 steps, where notebook 01 trains 470. It is not the
# point here.

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
# ## Three pitfalls whose fix is a DDP option
#
# Notebook 04's gallery has three pitfalls whose fix is an option of DDP. They are measured here: an
# unused parameter, BatchNorm buffers and gradient accumulation. Each one compares notebook 02's
# manual averaging with DDP. On a first read you may skip to "Copy this into your code": the
# answer does not depend on them.
#
# ### Unused parameter: a parameter without a gradient
#
# **Bug**: a module takes no part in the loss. It may be a head used only in another task, or a
# layer left over from an experiment. Its `.grad` stays `None` after `backward()`.

# %%
from torch import nn

HANG_TIMEOUT = 5  # seconds; each launch below takes well under one, so longer means a hang
average_gradients = gst.notebooks.load_function("02_manual_allreduce_averaging",
                                                "average_gradients")  # skips None gradients


class WithUnusedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = gst.model.Net()
        self.aux_head = nn.Linear(10, 10)  # used only if use_aux: else its .grad stays None

    def forward(self, x, use_aux=False):
        out = self.net(x)
        return out + self.aux_head(out) if use_aux else out


def tutorial_average_gradients(model):  # the tutorial's, ReduceOp for reduce_op: no None check
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def train_unused(rank, world_size, mode, aux_ranks=(), steps=2):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = WithUnusedHead().to(device)
    if mode.startswith("ddp"):
        model = DDP(model, find_unused_parameters=mode == "ddp, find_unused_parameters")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    g = torch.Generator().manual_seed(rank)  # random images: the data do not matter here
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH // world_size, 1, 28, 28, generator=g).to(device)
        y = torch.randint(10, (GLOBAL_BATCH // world_size,), generator=g).to(device)
        optimizer.zero_grad()
        F.nll_loss(model(x, use_aux=rank in aux_ranks), y).backward()
        if mode == "tutorial":
            tutorial_average_gradients(model)
        elif mode == "skip None":
            average_gradients(model)  # notebook 02's version
        elif mode == "zeros":  # a zero gradient where there is none: every rank, every call
            for param in model.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            average_gradients(model)
        optimizer.step()
    plain = model.module if mode.startswith("ddp") else model
    no_grad = [name for name, param in plain.named_parameters() if param.grad is None]
    return {"rank_diff": gst.checks.max_diff_across_ranks(plain), "no_grad": no_grad}

# %% [markdown]
# **Symptom, manual averaging**: the tutorial's `average_gradients` fails in the first step. It
# raises an `AttributeError` at the first `None` gradient:

# %%
try:
    gst.launch(train_unused, WORLD_SIZE, args=("tutorial", (), 1))  # one step
except gst.RankFailedError as err:
    print(str(err).splitlines()[0])
    assert "AttributeError: 'NoneType' object has no attribute 'data'" in str(err)
else:
    raise AssertionError("the tutorial's average_gradients should fail on a None gradient")

# %% [markdown]
# **Symptom, DDP**: step 1 runs without an error, but its gradients are not averaged. DDP still
# waits for the gradient of `aux_head`, so the bucket that holds it is never reduced. The replicas
# differ after step 1. The forward pass of step 2 then raises a `RuntimeError`. Its message names
# the cause, the fix, and the indices of the parameters without a gradient (8 and 9 here:
# `aux_head`'s weight and bias):

# %%
one_step = gst.launch(train_unused, WORLD_SIZE, args=("ddp", (), 1))
print(f"DDP, after step 1: no error, max difference between ranks {one_step[0]['rank_diff']:.1e}")
assert one_step[0]["rank_diff"] > 0  # step 1's gradients were not averaged
try:
    gst.launch(train_unused, WORLD_SIZE, args=("ddp",))  # 2 steps
except gst.RankFailedError as err:
    message = str(err)
    print(message[: message.index("If you already")])
    print(next(line for line in message.splitlines() if line.startswith("Parameter indices")))
    assert "Expected to have finished reduction in the prior iteration" in message
    assert "find_unused_parameters=True" in message and "did not receive grad" in message
else:
    raise AssertionError("DDP should fail in the second step")

# %% [markdown]
# **Detect**: the errors above. Or list the parameters whose `.grad` is still `None` after
# `backward()`, as `train_unused` returns them below.
#
# **Fix**: remove the unused module. In manual code, skip `None` gradients (notebook 02's
# `average_gradients`). With DDP, pass `find_unused_parameters=True`. Both train, and the replicas
# agree:

# %%
skip_none = gst.launch(train_unused, WORLD_SIZE, args=("skip None",))
find_unused = gst.launch(train_unused, WORLD_SIZE, args=("ddp, find_unused_parameters",))

# %% tags=["nbval-check-output"]
print("parameters without a gradient:", skip_none[0]["no_grad"])
print("max difference between ranks:", skip_none[0]["rank_diff"], "(skip None),",
      find_unused[0]["rank_diff"], "(DDP)")
assert all(r["no_grad"] == ["aux_head.weight", "aux_head.bias"] for r in skip_none + find_unused)
assert all(r["rank_diff"] == 0.0 for r in skip_none + find_unused)

# %% [markdown]
# `find_unused_parameters=True` has a cost. After every forward pass, DDP traverses the autograd
# graph to find the parameters that will get no gradient. PyTorch's
# [DDP notes](https://docs.pytorch.org/docs/stable/notes/ddp.html#internal-design) say:
# "traversing the autograd graph introduces extra overheads, so applications should only set
# `find_unused_parameters` to `True` when necessary". How much it costs depends on the model; this
# course does not time it. DDP warns when the flag finds nothing to do (below).
#
# Skipping `None` is right only if **every** rank skips the same parameters. A branch that depends
# on the data can give one rank a gradient where another has `None`. The ranks then make different
# numbers of `all_reduce` calls: notebook 04's skipped-collective pitfall. The fix replaces a
# missing gradient with zeros, so that every rank makes every call. DDP with
# `find_unused_parameters=True` handles this case by itself. Here only rank 0 uses `aux_head`:

# %%
only_rank_0 = (0,)  # the ranks that use aux_head
zeros = gst.launch(train_unused, WORLD_SIZE, args=("zeros", only_rank_0))
ddp_rank_0 = gst.launch(train_unused, WORLD_SIZE, args=("ddp, find_unused_parameters", only_rank_0))

# %% [markdown]
# Rank 0's warning, `find_unused_parameters=True was specified`, is expected. Rank 0 uses every
# parameter, so DDP found nothing unused *there*. Rank 1 skips `aux_head`, and that is why the flag
# is needed: the warning looks at one rank only. (`[rank 0]` is the launcher's tag, `[rank0]:`
# torch's own.) Both fixes keep the replicas equal:

# %% tags=["nbval-check-output"]
print("max difference between ranks:", zeros[0]["rank_diff"], "(zeros),",
      ddp_rank_0[0]["rank_diff"], "(DDP)")
assert all(r["rank_diff"] == 0.0 for r in zeros + ddp_rank_0)

# %% [markdown]
# ### BatchNorm buffers: the statistics drift apart
#
# **Bug**: averaging gradients keeps the *parameters* equal, but not `BatchNorm`'s running mean and
# variance. Those are *buffers*, updated in the forward pass from each rank's own batch. Nothing
# averages them, so each rank evaluates with its own statistics.

# %%
def train_bn(rank, world_size, mode, steps=3):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = nn.Sequential(nn.Conv2d(1, 8, 5), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 24 * 24, 10)).to(device)
    if mode == "SyncBatchNorm":  # batch statistics over the global batch; GPU only
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if mode in ("DDP", "SyncBatchNorm"):
        model = DDP(model)  # forward_sync_buffers=True, the default
    plain = model.module if isinstance(model, DDP) else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    images, labels = gst.data.load(train=True)
    for step in range(steps):
        idx = torch.arange(GLOBAL_BATCH)[rank::world_size] + step * GLOBAL_BATCH
        optimizer.zero_grad()
        F.cross_entropy(model(images[idx].to(device)), labels[idx].to(device)).backward()
        if mode == "manual":
            average_gradients(model)
        optimizer.step()
    diffs = {"parameters": gst.checks.max_diff_across_ranks(plain),
             "buffers after training": gst.checks.max_diff_across_ranks(plain.named_buffers())}
    model.eval()
    with torch.no_grad():
        model(images[:8].to(device))  # evaluation, through the DDP wrapper if there is one
    diffs["buffers at evaluation"] = gst.checks.max_diff_across_ranks(plain.named_buffers())
    return diffs

# %%
bn_manual = gst.launch(train_bn, WORLD_SIZE, args=("manual",))[0]
bn_ddp = gst.launch(train_bn, WORLD_SIZE, args=("DDP",))[0]

# %% [markdown]
# **Symptom and detection**: the parameters agree, the running statistics do not.
# `gst.checks.max_diff_across_ranks(model, buffers=True)` compares the buffers too, and so does
# `assert_replicas_equal`.

# %%
print("max difference between ranks:")
for name, diffs in [("manual averaging", bn_manual), ("DDP", bn_ddp)]:
    print(f"  {name:16}", ", ".join(f"{key} {value:.2g}" for key, value in diffs.items()))
assert bn_manual["parameters"] == 0.0 and bn_manual["buffers at evaluation"] > 1e-4
assert bn_ddp["parameters"] == 0.0 and bn_ddp["buffers at evaluation"] == 0.0
assert bn_ddp["buffers after training"] > 0.0  # each rank's last forward pass updated its own

# %% [markdown]
# **Fix**: DDP's `forward_sync_buffers=True` (the default) copies rank 0's buffers to every rank.
# Before torch 2.13 it was called `broadcast_buffers`, a name now deprecated. The copy happens at
# the start of the first forward pass after a training step, evaluation included. So the first
# evaluation batch through the wrapper is a collective. There are two safe ways to evaluate:
#
# - through the wrapper, on every rank, with the same number of batches;
# - `model.module` on rank 0 alone, whose buffers are the ones DDP broadcasts.
#
# The end of this section checks both. Do not evaluate `model.module` on another rank: between two
# forward passes, each rank's buffers hold its own last update.
#
# `nn.SyncBatchNorm` goes further. Its documentation says: "The mean and standard-deviation are
# calculated per-dimension over all mini-batches of the same process groups". So the running
# statistics should agree right after training. The cell after next checks it on a machine with a
# GPU per rank; this notebook's committed outputs ran on CPUs. SyncBatchNorm runs on accelerators.
# On the CPU it raises:

# %%
def sync_batchnorm_on_cpu(rank, world_size):
    try:
        nn.SyncBatchNorm(8)(torch.randn(4, 8, 3, 3))  # training mode, a CPU tensor
    except ValueError as e:
        return str(e)


message = gst.launch(sync_batchnorm_on_cpu, WORLD_SIZE)[0]
print("on the CPU:", message)
assert message.startswith("SyncBatchNorm expected input tensor to be on GPU")

# %%
if torch.cuda.is_available() and torch.cuda.device_count() >= WORLD_SIZE:  # a GPU per rank
    bn_sync = gst.launch(train_bn, WORLD_SIZE, args=("SyncBatchNorm",))[0]
    print("SyncBatchNorm, max difference between ranks:", bn_sync)
    assert bn_sync["parameters"] == 0.0 and bn_sync["buffers after training"] <= 1e-6
else:
    print(f"{torch.cuda.device_count()} GPUs for {WORLD_SIZE} ranks: SyncBatchNorm not run")

# %% [markdown]
# **Bug, in the fix**: `if rank == 0: evaluate(ddp_model)`. Its first forward pass broadcasts the
# buffers on rank 0 alone, even in `eval()` mode under `no_grad()`. This is notebook 04's
# skipped-collective pitfall. At the end of training no later forward on the other ranks answers
# it: a hang. Here are two steps of training, then one evaluation batch, evaluated three ways:

# %%
def evaluate_bn(rank, world_size, how, steps=2):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = DDP(nn.Sequential(nn.Conv2d(1, 8, 5), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                              nn.Linear(8 * 24 * 24, 10)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    images, labels = gst.data.load(train=True)
    for step in range(steps):  # each rank updates its statistics from its own batches
        idx = torch.arange(GLOBAL_BATCH)[rank::world_size] + step * GLOBAL_BATCH
        optimizer.zero_grad()
        F.cross_entropy(model(images[idx].to(device)), labels[idx].to(device)).backward()
        optimizer.step()
    model.eval()
    x = images[-64:].to(device)  # the evaluation batch
    with torch.no_grad():
        if how == "DDP, every rank":
            return model(x).cpu()
        if rank == 0:  # evaluation on rank 0 only
            return (model if how == "DDP, rank 0 only" else model.module)(x).cpu()
    return None

# %% [markdown]
# **Symptom**: rank 0 waits in DDP's broadcast, and the launcher's timeout names it. (It runs in its
# own launch: a failed collective breaks its group.)

# %%
try:
    gst.launch(evaluate_bn, WORLD_SIZE, args=("DDP, rank 0 only",), timeout=HANG_TIMEOUT)
except gst.LaunchTimeoutError as err:
    print(err)
    assert err.unfinished == [0]

# %% [markdown]
# **Fix**: on rank 0 alone, evaluate `model.module`. It gives what every rank computes through the
# wrapper, to the last bit:

# %%
every_rank = gst.launch(evaluate_bn, WORLD_SIZE, args=("DDP, every rank",))[0]
module_on_0 = gst.launch(evaluate_bn, WORLD_SIZE, args=("model.module, rank 0 only",))[0]
difference = (every_rank - module_on_0).abs().max().item()
print(f"max |DDP on every rank - model.module on rank 0| = {difference}")
assert difference == 0.0

# %% [markdown]
# ### Accumulation: all-reducing every micro-batch
#
# A global batch may be larger than fits in memory. Each rank then runs several micro-batches and
# steps once. **Waste**: averaging after every micro-batch's `backward()`. DDP does this by default.
# The result is right, since averaging is linear, but it costs K times the communication. **Fix**:
# average once, after the last micro-batch. With DDP, run the other micro-batches inside
# `model.no_sync()`.
#
# The code below divides each micro-batch's mean loss by `MICRO_BATCHES`. That gives the mean over
# the whole batch **only because its micro-batches are equal**. With unequal micro-batches it is
# notebook 04's mean-of-means pitfall again, across micro-batches. They are unequal in the last
# batch of an epoch, or with losses over a varying number of tokens. [Notebook
# 07](07_which_mean.ipynb) shows that case and its fix: the loss sum divided by the count over all
# micro-batches and ranks.

# %%
MICRO_BATCHES = 4

def train_accumulate(rank, world_size, use_ddp, sync_every_micro_batch, steps=3):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = gst.model.Net().eval().to(device)  # eval: no dropout, for exact comparisons
    with gst.detect.count_collectives() as calls:
        if use_ddp:
            model = calls.watch(DDP(model))  # also count DDP's bucket all-reduces
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        images, labels = gst.data.load(train=True)
        for step in range(steps):
            batch = torch.arange(GLOBAL_BATCH)[rank::world_size] + step * GLOBAL_BATCH
            optimizer.zero_grad()
            for k, idx in enumerate(batch.chunk(MICRO_BATCHES)):
                last = k == MICRO_BATCHES - 1
                x, y = images[idx].to(device), labels[idx].to(device)
                if use_ddp and not (last or sync_every_micro_batch):
                    with model.no_sync():  # the fix, DDP: no all-reduce in this backward
                        (F.nll_loss(model(x), y) / MICRO_BATCHES).backward()
                else:
                    (F.nll_loss(model(x), y) / MICRO_BATCHES).backward()
                if not use_ddp and (last or sync_every_micro_batch):  # the fix: last only
                    average_gradients(model)
            optimizer.step()
    plain = model.module if use_ddp else model
    return {"state": plain.state_dict(), "calls": dict(calls.calls)}

# %%
accumulated = {
    (use_ddp, every): gst.launch(train_accumulate, WORLD_SIZE, args=(use_ddp, every))[0]
    for use_ddp in (False, True) for every in (True, False)
}

# %%
print(f"{'':6}  {'sync':17}  collective calls in 3 steps")
for (use_ddp, every), r in accumulated.items():
    sync = "every micro-batch" if every else "last only"
    print(f"{'DDP' if use_ddp else 'manual':6}  {sync:17}  {r['calls']}")

reference = accumulated[(False, False)]["state"]
for key, r in accumulated.items():
    assert gst.checks.compare_state_dicts(r["state"], reference, show=False) <= 1e-6, key
manual_every, manual_last = (accumulated[(False, e)]["calls"]["all_reduce"] for e in (True, False))
ddp_every, ddp_last = (accumulated[(True, e)]["calls"][gst.detect.DDP_KEY] for e in (True, False))
assert manual_every == MICRO_BATCHES * manual_last and ddp_every == MICRO_BATCHES * ddp_last
print(f"same parameters (<= 1e-6) with {MICRO_BATCHES}x fewer all-reduces: "
      f"manual {manual_every} -> {manual_last}, DDP buckets {ddp_every} -> {ddp_last}")


# %% [markdown]
# ## Copy this into your code
#
# `snippets/03_ddp.py` is a whole script. The course's tests run it with
# `torchrun --standalone --nproc-per-node 2`. It holds DDP, the sampler and its `set_epoch`, and the
# loop over a `DataLoader` that deals each rank its shard. Rank 0 alone writes a checkpoint, then
# every rank calls `dist.barrier()` (notebook 06 says why). Rank 0 alone reads the file back. The
# other ranks compare their weights with rank 0's, so the check needs no shared file system.
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
#     # Check: the file holds every rank's weights. Rank 0 alone reads it back (it is on rank 0's
#     # disk), and every rank compares its weights with rank 0's, so no machine needs the file.
#     # map_location: onto this rank's device, not onto the GPU the tensors were saved from.
#     saved = torch.load(path, map_location=device, weights_only=True) if rank == 0 else None
#     for name, p in model.module.state_dict().items():
#         rank_0 = p.clone()
#         dist.broadcast(rank_0, src=0)          # every rank receives rank 0's tensor
#         assert torch.equal(rank_0, p), name    # the replicas are equal...
#         assert rank != 0 or torch.equal(saved[name], p), name  # ...and equal to the file
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
# `dist.broadcast(tensor, src=0)` for every parameter: it works in place, rank 0 sends `tensor` and
# every other rank's `tensor` is overwritten with rank 0's values. So pass the parameter itself
# (`p.detach()` or `p.data`: the same memory), not a copy.
#
# The check below starts each rank (2, then 3 to 5 of them) from a different seed, calls your function
# and compares the ranks. It prints "✓ correct", or fails with what is wrong; until you write the
# function, it says "not attempted yet". Stuck? `%load solutions/03_broadcast_parameters.py` in a
# new cell.
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
