# %% [markdown]
# # 00 — Launching workers from a notebook
#
# **Question: how do I run one training function on several processes, from a notebook cell?**
#
# **Short answer:** call `gst.launch(fn, world_size)`. It runs `fn(rank, world_size)` on 2 or more
# fresh processes and returns one result per rank. What each rank prints shows below the cell.
#
# Every later notebook trains a model on *N ranks*. A **rank** is one of N processes, each with its
# own copy of the model, talking through `torch.distributed`. The ranks are numbered 0 to N−1; N is
# the **world size**. On a cluster you start them with `torchrun`. A notebook needs a launcher that
# runs a function *defined in a cell* on N fresh processes. This notebook shows why the obvious tool
# fails, then the one this course uses: `gst.launch`.
#
# Each new word is defined where it first appears, in **bold**; the README's
# [glossary](../README.md#glossary) collects them all.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # set it to 1 for a short run (the tests do)
WORLD_SIZE = 2  # number of ranks; try 4

import inspect
import re
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gradsync_tutorial as gst


# %% [markdown]
# ## Why `torch.multiprocessing.spawn` fails here
#
# `mp.spawn(fn, nprocs=2)` starts fresh Python interpreters and sends them `fn` with `pickle`.
# Pickle stores a function **by name** (`__main__.hello`), and the child looks that name up again. A
# function defined in a notebook cell lives only inside the kernel, so the child cannot find it and
# dies:

# %%
def hello(rank, world_size):
    print(f"hello from rank {rank}")


# Plumbing, not the lesson: the next 3 lines and the `finally` only capture the children's
# errors. Each child writes to file descriptor 2, inherited from the kernel: point it at a file.
children_stderr = tempfile.TemporaryFile()
kernel_stderr = os.dup(2)
os.dup2(children_stderr.fileno(), 2)
try:
    mp.spawn(hello, args=(2,), nprocs=2)
    spawn_failed = False
except Exception as e:  # the children died before running hello
    spawn_failed = True
    print(f"{type(e).__name__}: {e}")
finally:
    os.dup2(kernel_stderr, 2)
    os.close(kernel_stderr)
assert spawn_failed

# %% [markdown]
# Once one child has died, `spawn` stops the other, and torch may log a warning that it did so
# (`via signal SIGTERM`). The last line each child wrote is the cause:

# %% tags=["nbval-check-output"]
children_stderr.seek(0)
lines = children_stderr.read().decode().splitlines()
causes = {line for line in lines if line.startswith("AttributeError")}  # the same in both
print(*causes)
assert len(causes) == 1 and "Can't get attribute 'hello' on <module '__main__'" in causes.pop()


# %% [markdown]
# `fork` would avoid pickling: the child is a copy of the kernel, cells included. But a forked child
# cannot use CUDA once the parent has initialized it. Torch's own error says so: "Cannot
# re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use the
# 'spawn' start method".
#
# Accelerate's `notebook_launcher` forks all the same:
# `start_processes(..., start_method="fork")` in
# [`accelerate/launchers.py`](https://github.com/huggingface/accelerate/blob/main/src/accelerate/launchers.py).
# It refuses to start once `torch.cuda` is initialized. Python's
# [multiprocessing
# documentation](https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods)
# lists `fork` as POSIX only, not on Windows. It also warns: "The *fork* start method should be
# considered unsafe as it can lead to crashes of the subprocess". *Spawn* is the default on macOS
# since Python 3.8, and *forkserver* on POSIX since Python 3.14.

# %% [markdown]
# ## `gst.launch`: fresh processes, the function sent by value
#
# `gst.launch(fn, world_size)` starts `world_size` processes, fresh as far as `fn` can tell
# (`docs/launcher.md` says how). It sends them `fn` **by value**, with `cloudpickle`, so cells,
# lambdas and closures work. In each one it:
#
# 1. sets the environment `torchrun` would set (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
#    `MASTER_PORT`, ...);
# 2. calls `dist.init_process_group()`, which creates the **process group**;
# 3. runs `fn(rank, world_size)`, and sends back its return value.
#
# The process group is the set of ranks that communicate together, and the connections between them.
# Its **backend** is the library that moves the tensors. It is gloo on CPUs, and nccl when there is
# one NVIDIA GPU per rank. This machine's backend is printed and checked further down; every
# committed output of the course ran on gloo.
#
# Everything a rank prints appears below the cell, tagged with its rank. Here is the "hello world"
# of distributed training: every rank contributes a number, and **every rank receives the sum**.
# `all_reduce` is a **collective**: an operation that every rank of the group must call, each with
# its own tensor. With gloo it returns when all of them have called it. With nccl it may return
# before the GPU is done: "it is not guaranteed that the CUDA operation is completed, since CUDA
# operations are asynchronous" (torch's
# [docs](https://docs.pytorch.org/docs/stable/distributed.html#synchronous-and-asynchronous-collective-operations)).
# The tensor lives on the rank's device, `gst.local_device()`. That
# is the CPU here, and GPU `LOCAL_RANK` under nccl. nccl takes GPU tensors only, per torch's
# [table of backends](https://docs.pytorch.org/docs/stable/distributed.html#backends).

# %%
def hello_allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)], device=gst.local_device())  # rank 0: 1, rank 1: 2, ...
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # every rank receives the sum over all ranks
    print(f"I am rank {rank} of {world_size}; the sum over all ranks is {t.item()}")
    return t.item()


results = gst.launch(hello_allreduce, world_size=WORLD_SIZE)

# %% [markdown]
# The lines come in whatever order the ranks print them. The return values come back as a list
# ordered by rank: every rank holds the same sum, 1 + 2 + ... + N.

# %% tags=["nbval-check-output"]
print(results)
assert results == [WORLD_SIZE * (WORLD_SIZE + 1) / 2] * WORLD_SIZE

# %% [markdown]
# The same function on 4 ranks, no change. On a 2-core laptop, 4 ranks share 2 cores: fine for
# learning, just slower.

# %%
results4 = gst.launch(hello_allreduce, world_size=4)
print(results4)
assert results4 == [10.0] * 4


# %% [markdown]
# ## Each rank sees what `torchrun` would give it
#
# Each rank finds the variables that `torchrun` sets. Code in a cell reads them as a script would.
# Notebook 06 moves a cell's training into a `torchrun` script. `MASTER_ADDR` and
# `MASTER_PORT` are the **rendezvous**, where the ranks find each other when the job starts. They
# are the same for every rank:

# %%
def environment(rank, world_size):
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    return {k: os.environ[k] for k in keys} | {"backend": dist.get_backend()}


envs = gst.launch(environment, world_size=WORLD_SIZE)
for env in envs:
    print(env)

# %%
assert [int(e["RANK"]) for e in envs] == list(range(WORLD_SIZE))
assert all(e["WORLD_SIZE"] == str(WORLD_SIZE) for e in envs)
assert len({e["MASTER_PORT"] for e in envs}) == 1  # one rendezvous point for all ranks
print("backend:", envs[0]["backend"])
gpu_per_rank = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD_SIZE
assert envs[0]["backend"] == ("nccl" if gpu_per_rank else "gloo")  # the rule stated above


# %% [markdown]
# ## When a rank fails
#
# An exception in one rank stops every rank and is raised here. The error names the rank, the
# exception and the line that raised it. You can fix the bug from the message alone.

# %% tags=["raises-exception"]
def buggy(rank, world_size):
    t = torch.ones(3)
    if rank == 1:
        t = t[:2]  # a bug that only rank 1 hits
    return t.sum() / t[2]


gst.launch(buggy, world_size=WORLD_SIZE)

# %% [markdown]
# The error is a `gst.RankFailedError`; you can catch it and look at it:

# %% tags=["nbval-check-output"]
try:
    gst.launch(buggy, world_size=WORLD_SIZE)
except gst.RankFailedError as err:
    print("failed rank:", err.rank, "| exception:", err.exc_type)
    assert err.rank == 1 and err.exc_type == "IndexError"


# %% [markdown]
# A **hang** is the other classic failure: one rank waits in a collective that another rank never
# calls. `launch` stops every rank and raises, naming the stuck ranks and where each one waited. It
# acts as soon as a rank waits in a collective that another rank returned without calling. Such
# a wait can never finish, so `launch` stops it a few seconds later. Otherwise it stops at its
# wall-clock `timeout`, 300 s by default. The check below asserts both numbers:

# %%
def skips_a_collective(rank, world_size):
    if rank == 0:  # the bug: only rank 0 calls all_reduce, so it waits forever
        dist.all_reduce(torch.ones(1, device=gst.local_device()))


try:
    gst.launch(skips_a_collective, world_size=WORLD_SIZE, timeout=5)
except gst.LaunchTimeoutError as err:
    print(err)  # the whole message: the line each rank was waiting on comes after the first
    assert err.unfinished == [0] and "Where each rank was:" in str(err)
    stopped_after = float(re.search(r"stopped after ([\d.]+) s", str(err)).group(1))
    assert stopped_after < 5  # before the 5 s timeout: rank 1 had returned
assert inspect.signature(gst.launch).parameters["timeout"].default == 300  # the default timeout


# %% [markdown]
# ## Copy this into your code
#
# In a notebook:
#
# ```python
# import gradsync_tutorial as gst
#
# def train(rank, world_size):
#     ...  # the process group is ready: dist.all_reduce etc. work here
#     return result
#
# results = gst.launch(train, world_size=2)   # one result per rank
# ```
#
# The body of `train` is what goes into a script for `torchrun` (notebook 06 shows how).

# %% [markdown]
# ## Exercise
#
# Write `gather_ranks(rank, world_size)` so that **every rank returns the list
# `[0, 1, ..., world_size - 1]`**. Each rank knows only its own number, so it must learn the others.
# `dist.all_gather(tensor_list, tensor)` fills `tensor_list[i]` with rank `i`'s `tensor`, on every
# rank. `tensor_list` must hold one tensor per rank, each of the same shape and dtype as `tensor`.
#
# Replace the `raise` line with your code and run the cell, then run the check below it. The check
# runs your function at two world sizes and prints "✓ correct" with them, or fails with what is
# wrong.
# Until you write it, it says "not attempted yet". Stuck? `%load solutions/00_gather_ranks.py` in a
# new cell loads a solution.

# %%
def gather_ranks(rank, world_size):
    # your code here: one dist.all_gather, then return a list of ints
    raise NotImplementedError("write gather_ranks")


# %%
gst.exercises.check_gather_ranks(gather_ranks)

# %% [markdown]
# Once it passes, run it on 4 ranks: `gst.exercises.check_gather_ranks(gather_ranks, world_size=4)`.
