# %% [markdown]
# # 15 — Verify your own step: one call, against one process
#
# **Question: my own training step runs on several ranks. How do I check that its gradients are
# those of one process on the whole batch, and not N times too large?**
#
# **Short answer: call `verify_gradients(model, batch, loss_fn, reference=...)` on every rank,
# after your backward and your sync, before `optimizer.step()`.** Give it the loss one process
# would minimise on the whole batch, and a copy of the model taken before `fully_shard`. It
# gathers every rank's batch, computes one process's gradient on the copy, and compares it with
# yours, parameter by parameter. It names the mistake in this course's words: the world size, the
# micro-batches, a weighting. Run it on a tiny configuration of your code, in float64, for a step
# or two. It changes nothing of your training.
#
# Every notebook of this course proved its rule the same way: N ranks against one process, in
# float64. `gradsync_tutorial.verify` turns that proof into one call for your own code. It imports
# torch only, so a torchrun script on a GPU machine can use it. Users ask for such a check: "the
# gradients are different between single-GPU and multi-GPU"
# ([sentence-transformers#3415](https://github.com/UKPLab/sentence-transformers/issues/3415)).

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: the same checks, fewer repeats
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
TIMED = 5 if SMOKE_TEST else 20  # timed repeats of the step and of the check

import copy
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_tutorial as gst
from gradsync_tutorial.verify import CannotVerify, padded, verify_gradients

# %% [markdown]
# ## Why checking the replicas is not enough
#
# Take notebook 02's popular answer: `all_reduce(SUM)`, and no division. Every rank receives the
# same sum, so the replicas stay equal. `gst.checks.assert_replicas_equal` passes. Yet every
# gradient is N times too large.

# %%
def make_model():
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def batch_of(rank, samples=8):
    """This rank's batch: (inputs, targets), its own random samples."""
    g = torch.Generator().manual_seed(SEED + rank)
    return (torch.randn(samples, 8, generator=g, dtype=torch.float64),
            torch.randn(samples, 1, generator=g, dtype=torch.float64))


def mse(model, batch):
    """The loss one process minimises on a whole batch: the mean over its samples."""
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def summed_not_divided(rank, world_size):
    model = make_model().to(gst.local_device())
    reference = copy.deepcopy(model)  # the weights this step starts from
    batch = [t.to(gst.local_device()) for t in batch_of(rank)]
    mse(model, batch).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # summed over the ranks... and never divided
    gst.checks.assert_replicas_equal({n: p.grad for n, p in model.named_parameters()})  # passes
    return str(verify_gradients(model, batch, mse, reference=reference))


print(gst.launch(summed_not_divided, WORLD_SIZE)[0])

# %% [markdown]
# The replicas agree, and the check still fails: every gradient is `WORLD_SIZE` × one process's.
# The report fits the factor c that brings one process's gradient closest to yours, ⟨g, r⟩ /
# ⟨r, r⟩. A factor that equals a size of the job is named. The last lines give both gradient
# norms: a clipping threshold would see the factor too.
#
# ## A correct step
#
# DDP with each rank's mean over equal batches is notebook 03's step. A DDP model may serve as
# its own reference: the check only reads it, on a copy.

# %%
def ddp_step(rank, world_size):
    model = DDP(make_model().to(gst.local_device()))
    batch = [t.to(gst.local_device()) for t in batch_of(rank)]
    mse(model, batch).backward()  # DDP averages the gradients here
    report = verify_gradients(model, batch, mse, reference=model)
    return {"ok": report.ok, "text": str(report)}


ddp = gst.launch(ddp_step, WORLD_SIZE)
print(ddp[0]["text"])
assert all(r["ok"] for r in ddp) and len({r["text"] for r in ddp}) == 1  # the same report

# %% [markdown]
# ## The 2024 accumulation bug, on lines of text
#
# Notebook 07's task: a character-level model on lines of different lengths, 2 micro-batches per
# rank. The bug divides each micro-batch's own token mean by the number of micro-batches. Give the
# check the loss one process minimises, the mean over every valid token. Give it the micro-batches
# too, and `padded` to join lines of different lengths.

# %%
def token_mean(model, batch):
    """One process's loss on a whole batch: the mean over its valid tokens (-100 is padding)."""
    inputs, targets = batch
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100)


def accumulation(rank, world_size, fixed):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = DDP(nn.Sequential(nn.Embedding(gst.tokens.VOCAB_SIZE, 8),
                              nn.Linear(8, gst.tokens.VOCAB_SIZE)).double().to(device))
    lines = gst.tokens.LINES[rank * 4: rank * 4 + 4]  # 2 micro-batches of 2 lines per rank
    micro_batches = [[t.to(device) for t in gst.tokens.pad(lines[:2])],
                     [t.to(device) for t in gst.tokens.pad(lines[2:])]]
    count = sum((y != -100).sum() for _, y in micro_batches).double()
    dist.all_reduce(count)  # the fix's global count of valid tokens
    for k, (x, y) in enumerate(micro_batches):
        with model.no_sync() if k < len(micro_batches) - 1 else nullcontext():  # DDP: 1 sync
            loss_sum = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                                       reduction="sum")
            if fixed:  # notebook 07's fix: / the global count, × N for DDP's mean
                (loss_sum / count * world_size).backward()
            else:  # the bug: this micro-batch's own mean, / K
                (loss_sum / (y != -100).sum() / len(micro_batches)).backward()
    report = verify_gradients(model, None, token_mean, reference=model,
                              micro_batches=micro_batches, concat=padded({0: 0, 1: -100}))
    return {"ok": report.ok, "text": str(report)}


bug, fix = (gst.launch(accumulation, WORLD_SIZE, args=(fixed,))[0] for fixed in (False, True))
print(bug["text"], fix["text"].splitlines()[-1], sep="\n\n")
assert not bug["ok"] and "weighted differently" in bug["text"] and fix["ok"]

# %% [markdown]
# The gradient is no multiple of one process's, so no factor names it. The report fits instead
# how your step weighed each micro-batch's mean, and compares that with each one's share of the
# tokens. That is notebook 07's diagnosis, measured on your step.
#
# ## FSDP2 with its division turned off on the root only
#
# torchtitan divides each rank's loss sum by the global token count and turns FSDP2's mean off
# with `set_gradient_divide_factor(1.0)`. That setter does not recurse (notebook 08). Set on the
# root alone, the blocks wrapped by their own `fully_shard` still divide by N. FSDP2 refuses
# `copy.deepcopy`, so the reference is copied before `fully_shard`.

# %%
def fsdp_root_only(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1)).double().to(gst.local_device())
    reference = copy.deepcopy(model)  # before fully_shard: FSDP2 refuses deepcopy
    mesh = init_device_mesh(gst.local_device().type, (world_size,))
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(1.0)  # the root only: the blocks still divide by N
    inputs, targets = (t.to(gst.local_device()) for t in batch_of(rank))
    count = torch.tensor(float(len(inputs)), device=gst.local_device())
    dist.all_reduce(count)
    ((model(inputs) - targets).pow(2).sum() / count).backward()  # sum / the global count
    return str(verify_gradients(model, (inputs, targets), mse, reference=reference))


fsdp_text = gst.launch(fsdp_root_only, WORLD_SIZE)[0]
print(fsdp_text)
assert "divided by the world size twice" in fsdp_text and "exact" in fsdp_text

# %% [markdown]
# The report is per parameter. The root's last layer is exact; the two wrapped blocks are 1/N of
# one process's. The fix sets the factor on every `FSDPModule` (notebook 08).
#
# ## What it cannot check, and what it leaves alone
#
# Dropout draws its own masks on every rank, and BatchNorm normalises by each rank's statistics.
# Neither is an averaging question, so the check refuses them in training mode. It refuses on
# every rank together, before any collective could leave one waiting. Check in `model.eval()`.

# %%
def with_dropout(rank, world_size):
    torch.manual_seed(SEED)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 1)).double()
                .to(gst.local_device()))
    batch = [t.to(gst.local_device()) for t in batch_of(rank)]
    mse(model, batch).backward()
    try:
        verify_gradients(model, batch, mse, reference=model)
    except CannotVerify as e:
        return str(e)


refused = gst.launch(with_dropout, WORLD_SIZE)
print(refused[0])
assert all(r == refused[0] and "eval()" in r for r in refused)  # every rank, the same message

# %% [markdown]
# Nothing of your training changes: the parameters, the gradients, the buffers and the random
# state are as before the call. Check it on the correct DDP step:

# %%
def state(model):
    """Copies of the parameters, the gradients and the random state."""
    return [*(p.detach().clone() for p in model.parameters()),
            *(p.grad.clone() for p in model.parameters()), torch.get_rng_state()]


def unchanged(rank, world_size):
    model = DDP(make_model().to(gst.local_device()))
    batch = [t.to(gst.local_device()) for t in batch_of(rank)]
    mse(model, batch).backward()
    before = state(model)
    verify_gradients(model, batch, mse, reference=model)
    return all(torch.equal(a, b) for a, b in zip(before, state(model), strict=True))


kept = gst.launch(unchanged, WORLD_SIZE)
print(f"parameters, gradients and random state unchanged on every rank: {all(kept)}")
assert all(kept)

# %% [markdown]
# It checks gradients only, not the optimizer's state. It cannot see randomness inside
# `forward` (`F.dropout`). The model must fit on one device: check a tiny configuration of the
# same code.
#
# ## What it costs
#
# The check gathers every rank's batch and runs one process's step on all of it, on every rank.
# So it costs about N times one rank's forward and backward, and a copy of the model. Measured
# side by side, interleaved, on this notebook's DDP step:

# %%
def cost(rank, world_size, repeats):
    model = DDP(make_model().to(gst.local_device()))
    batch = [t.to(gst.local_device()) for t in batch_of(rank, samples=64)]
    seconds = {"step": [], "check": []}
    for i in range(repeats + 2):  # 2 warm-up rounds, not kept
        start = time.perf_counter()
        model.zero_grad()
        mse(model, batch).backward()
        if gst.local_device().type == "cuda":
            torch.cuda.synchronize()
        middle = time.perf_counter()
        verify_gradients(model, batch, mse, reference=model)
        if gst.local_device().type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        if i >= 2:
            seconds["step"].append(middle - start)
            seconds["check"].append(end - middle)
    return {k: statistics.median(v) for k, v in seconds.items()}


timed = gst.launch(cost, WORLD_SIZE, args=(TIMED,))[0]
print(f"median of {TIMED}: forward + backward {timed['step'] * 1e3:.2f} ms, the check "
      f"{timed['check'] * 1e3:.2f} ms: {timed['check'] / timed['step']:.1f} × the step "
      f"({WORLD_SIZE} ranks, {os.cpu_count()} CPU cores)")
assert timed["check"] > 0 and timed["step"] > 0

# %% [markdown]
# `benchmarks/verify_cost.py` measures a larger model, DDP and FSDP2, at 2 and 4 ranks. Check one
# or two steps, then train without it.
#
# ## Copy this into your code
#
# `snippets/15_verify_first_step.py` is a torchrun script that checks its first step and then
# trains on. The course's tests run it with `torchrun --standalone --nproc-per-node 2`. It
# imports `verify_gradients`, the one module of this course made for your scripts.
#
# <!-- snippets/15_verify_first_step.py -->
# ```python
# """Notebook 15, copy this into your code: a torchrun script that checks its first step against one
# process (verify_gradients), then trains on without the check.
#
#     torchrun --standalone --nproc-per-node 2 snippets/15_verify_first_step.py
#
# Check a tiny configuration of your own code this way, in float64: the check gathers every rank's
# batch and runs one process's step on all of it, on every rank.
# """
#
# import os
# import sys
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
#
# from gradsync_tutorial.verify import verify_gradients  # imports torch only
#
# SEED, STEPS = 1234, 5
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
# def batch_of(rank, step, device, samples=16):
#     """This rank's batch of the step: its own random samples (inputs, targets)."""
#     g = torch.Generator().manual_seed(SEED + 1000 * step + rank)
#     inputs = torch.randn(samples, 8, generator=g, dtype=torch.float64)
#     return inputs.to(device), inputs.sum(dim=1, keepdim=True).to(device)
#
#
# def one_process_loss(model, batch):
#     """The loss ONE process minimises on a whole batch: the mean over its samples."""
#     inputs, targets = batch
#     return F.mse_loss(model(inputs), targets)
#
#
# def main():
#     device = init_distributed()
#     rank = dist.get_rank()
#     torch.manual_seed(SEED)                    # the same initial weights on every rank
#     model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).double().to(device))
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
#     for step in range(STEPS):
#         batch = batch_of(rank, step, device)
#         optimizer.zero_grad()
#         loss = one_process_loss(model, batch)  # each rank's mean; DDP averages the gradients
#         loss.backward()
#         if step == 0:                          # check the first step, then train without it
#             report = verify_gradients(model, batch, one_process_loss, reference=model)
#             if rank == 0:
#                 print(report)
#             if not report.ok:                  # the same verdict on every rank: all stop
#                 dist.destroy_process_group()
#                 sys.exit(f"rank {rank}: the gradients are not one process's: {report.verdict}")
#         optimizer.step()
#     print(f"rank {rank}: step 0 verified against one process, then {STEPS} steps trained")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# ## Exercise
#
# The check is only as good as the loss you give it. Write `one_process_loss(model, batch)`, the
# loss one process minimises, for a step that trains on lines of text. `batch` is `(inputs,
# targets)`, targets padded with −100. The step under test divides each rank's loss sum by the
# global count of valid tokens. The exercise runs `verify_gradients` with your function on that
# step, which is right, and on the 2024 accumulation bug, which is wrong. It prints "✓ correct"
# when your loss passes the right step and fails the bug. Until you write the function, it says
# "not attempted yet". Stuck? `%load solutions/15_one_process_loss.py` in a new cell.

# %%
def one_process_loss(model, batch):
    # your code here: the loss over the whole batch that one process would minimise
    raise NotImplementedError("write one_process_loss")


# %%
gst.exercises.check_one_process_loss(one_process_loss)
