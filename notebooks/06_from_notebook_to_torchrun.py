# %% [markdown]
# # 06 — From notebook to torchrun: the same code on one machine or many
#
# **Question: how do I run this training under `torchrun`, on one machine or several, and resume it
# after a crash?**
#
# **Short answer:** use `torchrun`. Make the function you launched the body of a script. The script
# adds 3 things: `init_process_group` before it, `destroy_process_group` after it, and `@record`, so
# that a failing rank's traceback reaches torchrun's error summary.
#
# Notebooks 00 to 05 launch functions from cells with `gst.launch`. Real jobs run under `torchrun`,
# PyTorch's own launcher. On a cluster, a scheduler (SLURM, Kubernetes) starts one `torchrun` per
# machine (`docs/cluster.md` has the commands). `torchrun` gives every process the environment
# that `gst.launch` gave your function.
#
# This notebook runs the course's script `scripts/train_ddp.py` with torchrun, from here. It checks
# four things with numbers:
#
# | check | section |
# |---|---|
# | torchrun and `gst.launch` give the same parameters | `gst.launch` and torchrun |
# | a run resumed from a checkpoint equals a straight run | Checkpoint and resume |
# | two "machines" give what one gives | Many machines |
# | a failing rank's error is what torchrun reports | When a rank fails |

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # set it to 1 for a short run (the tests do)
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
GLOBAL_BATCH = 256  # samples per optimizer step, summed over all ranks
LR, MOMENTUM = 0.01, 0.5
EPOCHS = 2  # the resume check splits them: 1, save, resume, 1
# The script's arguments in every run below. --smoke: the scripts' first 1,024 images only.
ARGS = ["--batch-size", GLOBAL_BATCH, "--lr", LR, "--seed", SEED]
if SMOKE_TEST:
    ARGS.append("--smoke")

import inspect
import json
import re
import socket
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_tutorial as gst

REPO = Path(gst.__file__).resolve().parent.parent  # the course's folder
sys.path.insert(0, str(REPO / "scripts"))
import train_ddp  # the script is a module too: the notebook can call its functions

assert train_ddp.MOMENTUM == MOMENTUM and GLOBAL_BATCH % WORLD_SIZE == 0

# %% [markdown]
# ## `gst.launch` gave your function torchrun's environment
#
# `torchrun --standalone --nproc-per-node N script.py` starts N fresh Python processes. It gives
# each one `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`,
# and runs `script.py` in every one. `gst.launch` starts its workers the same way. Here is what each
# rank sees, under both. torchrun's `--no-python` runs any program; here it is a one-line Python
# command that writes the variables as one line of JSON:

# %%
KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
# The ranks share torchrun's output pipe. print() may write a line in two pieces (the text, then
# "\n") when output is unbuffered, and another rank's line can land between them. One
# os.write of a short line arrives whole.
probe = (f"import json, os; env = {{k: os.environ.get(k) for k in {KEYS + ['OMP_NUM_THREADS']}}}; "
         "os.write(1, (json.dumps(env) + '\\n').encode())")

def environment(rank, world_size):
    return {k: os.environ.get(k) for k in KEYS}

launch_envs = gst.launch(environment, world_size=WORLD_SIZE)
run = subprocess.run(
    [sys.executable, "-m", "torch.distributed.run", "--standalone",
     "--nproc-per-node", str(WORLD_SIZE), "--no-python", sys.executable, "-c", probe],
    capture_output=True, text=True, check=True,
)
torchrun_envs = sorted(map(json.loads, run.stdout.splitlines()), key=lambda env: int(env["RANK"]))

# %%
print(f"{'rank 0 / rank 1 / ...':20}{'gst.launch':>22}{'torchrun':>22}")
for k in KEYS:
    values = [" / ".join(env[k] for env in envs) for envs in (launch_envs, torchrun_envs)]
    print(f"{k:20}{values[0]:>22}{values[1]:>22}")

# %% [markdown]
# The rendezvous address and port differ from run to run, since each launcher picks a free port. The
# rank variables are the same, rank by rank.

# %% tags=["nbval-check-output"]
same = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"]
for env_launch, env_torchrun in zip(launch_envs, torchrun_envs, strict=True):
    assert {k: env_launch[k] for k in same} == {k: env_torchrun[k] for k in same}
assert all(e["MASTER_ADDR"] and e["MASTER_PORT"] for e in launch_envs + torchrun_envs)
print(f"rank variables equal on all {WORLD_SIZE} ranks:", same)

# %% [markdown]
# ## The script is the function plus three lines
#
# A function that ran under `gst.launch` runs under torchrun as it is. What a script adds is what
# `gst.launch` did around your function:
#
# | in the notebook: `gst.launch(train, world_size=2)` | in `scripts/train_ddp.py`, under `torchrun --nproc-per-node 2` |
# |---|---|
# | starts 2 fresh Python processes with the variables above | starts 2 fresh Python processes with the same variables |
# | picks the device and backend, `set_device`, `init_process_group` | `init_distributed()`: the same rule, the same calls |
# | calls `train(rank, world_size, *args)` | calls `train(args)`; the arguments come from the command line |
# | returns each rank's result to the cell | rank 0 prints the log and writes the checkpoint |
# | raises `RankFailedError` with the failing rank's traceback | exits non-zero; thanks to `@record`, its summary shows the failing rank's traceback |
# | `destroy_process_group()` at the end | `finally:` free what `train` built, then `dist.destroy_process_group()`, after an error too |
#
# Here are the two functions that do it, read from the script itself:

# %%
print(inspect.getsource(train_ddp.init_distributed))
print(inspect.getsource(train_ddp.main))


# %% [markdown]
# Inside `train(args)` is notebook 03's loop: DDP, and each rank's indices from `DistributedSampler`
# with `set_epoch(epoch)`. The sampler deals out exactly notebook 02's shards
# `order[rank::world_size]` (notebook 03 checks it). `scripts/train_manual.py` is the same script
# with notebook 02's `average_gradients` instead of DDP. What `train` adds for a real job is small.
# Its settings come from the command line. Rank 0 alone prints a loss averaged over the ranks, and
# writes a checkpoint after every epoch.
#
# ## Run it with torchrun, from here
#
# The same command as in a terminal, started with this kernel's Python.
# (`python -m torch.distributed.run` *is* the `torchrun` command.) Each rank runs one thread, so
# that every run below adds its numbers in the same order. The comparisons can then ask for
# equality. That is torchrun's own default when a machine runs several ranks. It sets
# `OMP_NUM_THREADS=1` in every rank unless the variable is already set, as the ranks of the first
# run above saw:

# %%
omp = {env["OMP_NUM_THREADS"] for env in torchrun_envs}
print(f"OMP_NUM_THREADS in torchrun's {WORLD_SIZE} ranks: {omp} "
      f"(in this kernel: {os.environ.get('OMP_NUM_THREADS', 'not set')})")
assert omp == {os.environ.get("OMP_NUM_THREADS", "1")}

# %%
def shorten(text):
    """Shorten the folders of this machine, which differ on yours (venv, python, course, /tmp)."""
    for path, short in ((sysconfig.get_paths()["purelib"], "<site-packages>"),
                        (sys.executable, "python"), (f"{REPO}/", ""),
                        (tempfile.gettempdir(), "<tmp>")):
        text = text.replace(str(path), short)
    return text

def torchrun(*args, env=None):
    """Run `torchrun ARGS` in the course's folder, as in a terminal; return the finished process."""
    print("$ torchrun", shorten(" ".join(map(str, args))))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *map(str, args)], cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), capture_output=True, text=True,
    )
    run.stdout, run.stderr = shorten(run.stdout), shorten(run.stderr)
    return run

def fresh(name):
    """A checkpoint path under checkpoints/ (git ignores it), with no file there yet."""
    (REPO / "checkpoints" / name).unlink(missing_ok=True)
    return f"checkpoints/{name}"

def checkpoint(path):
    return torch.load(REPO / path, map_location="cpu", weights_only=True)

def ok(run):
    assert run.returncode == 0, f"torchrun exited with {run.returncode}:\n{run.stderr[-3000:]}"
    return run.stdout

STANDALONE = ["--standalone", "--nproc-per-node", WORLD_SIZE]  # one machine, WORLD_SIZE ranks
SCRIPT = ["scripts/train_ddp.py", *ARGS]  # the script and the arguments every run shares

# %%
straight = fresh("06_straight.pt")
run = torchrun(*STANDALONE, *SCRIPT, "--epochs", EPOCHS, "--checkpoint", straight)
print(ok(run))

# %% [markdown]
# Only rank 0 printed, and the loss it printed is the mean over all ranks. The last line is the
# script's own check that every rank ended with the same parameters.

# %%
equal = rf"parameters equal across {WORLD_SIZE} ranks: max \|p - p on rank 0\| = 0\.0$"
assert re.search(equal, run.stdout, re.M)
assert run.stdout.count(f"epoch {EPOCHS}/{EPOCHS}") == 1  # one line, from rank 0
print("epochs done in the checkpoint:", checkpoint(straight)["epochs_done"])


# %% [markdown]
# ## `gst.launch` and torchrun give the same parameters
#
# The script's `train(args)` is an ordinary function. So we can also launch it from the notebook,
# with the same command-line arguments. `gst.launch` stands in for `init_distributed()` and
# `destroy_process_group()`. `num_threads=1` matches torchrun's one thread per rank.

# %%
def train_from_notebook(rank, world_size, argv):
    args = train_ddp.parse_args(argv)  # the command line, as a list of strings
    return train_ddp.train(args)  # what main() calls between init and destroy

argv = [str(a) for a in ARGS + ["--epochs", EPOCHS]]
launched = gst.launch(train_from_notebook, world_size=WORLD_SIZE, args=(argv,), num_threads=1)

# %%
diff = gst.checks.compare_state_dicts(
    launched[0], checkpoint(straight)["model"], names=("gst.launch", "torchrun")
)

# %% [markdown]
# On CPUs the two runs add the same numbers in the same order, so they agree to the last bit. On
# GPUs kernels may add in another order, so the check allows 1e-5 (not yet run on GPUs). The
# script asks cuDNN for deterministic kernels, `torch.backends.cudnn.deterministic = True`.

# %%
ON_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD_SIZE
TOL = 1e-5 if ON_GPU else 0.0
print(f"gst.launch vs torchrun, same seed and data: max abs difference {diff:.1e}")
assert diff <= TOL

# %% [markdown]
# ## Checkpoint and resume
#
# After every epoch, rank 0 saves a checkpoint (`save_checkpoint`). Every rank waits at a barrier
# until the file is complete. One copy of the model and the optimizer is enough, since every rank
# holds the same ones. The random generators are gathered from every rank (`all_gather_object`),
# since each rank has its own. Here is what must be in the file, for a resumed run to be the run
# that never stopped:

# %%
WHY = {
    "model": "the Net's state dict (no DDP 'module.' prefix)",
    "optimizer": "SGD's momentum buffers: they carry the past steps into the next ones",
    "epochs_done": "where to go on: the data order is a function of seed + epoch",
    "rng": "every rank's random generators, which dropout draws from",
}
for key in checkpoint(straight):
    print(f"{key:12} {WHY[key]}")
assert list(checkpoint(straight)) == list(WHY)
assert len(checkpoint(straight)["rng"]) == WORLD_SIZE  # one state per rank

# %% [markdown]
# `--resume` continues from `--checkpoint` when the file exists, and starts from scratch when it
# does not. So one command line serves the first start and every restart: a requeued SLURM job, or a
# torchrun restart. Rank 0 looks for the file and broadcasts what it found, so every rank loads it
# or none does.
#
# Loading uses `map_location="cpu"`. Rank 0 saved tensors from its own GPU; without it, every rank
# would load them onto that GPU. In `torch.load`'s
# [documentation](https://docs.pytorch.org/docs/stable/generated/torch.load.html), storages "are
# first deserialized on the CPU and are then moved to the device they were saved from". We train 1
# epoch, stop, and run the same command again with `--epochs 2`:

# %%
resumed = fresh("06_resumed.pt")
first = torchrun(*STANDALONE, *SCRIPT, "--epochs", 1, "--checkpoint", resumed, "--resume")
print(ok(first))
after_one = checkpoint(resumed)
second = torchrun(*STANDALONE, *SCRIPT, "--epochs", EPOCHS, "--checkpoint", resumed, "--resume")
print(ok(second))


# %%
def momentum(ckpt):
    return {f"param {i}": s["momentum_buffer"] for i, s in ckpt["optimizer"]["state"].items()}

a, b = checkpoint(straight), checkpoint(resumed)
model_diff = gst.checks.compare_state_dicts(a["model"], b["model"], show=False)
momentum_diff = gst.checks.compare_state_dicts(momentum(a), momentum(b), show=False)
print(f"{EPOCHS} epochs straight vs 1, save, resume, {EPOCHS - 1}: max abs difference "
      f"{model_diff:.1e} in the parameters, {momentum_diff:.1e} in the momentum buffers")
assert "no checkpoint at" in first.stdout and "resumed from" in second.stdout
assert after_one["epochs_done"] == 1 and b["epochs_done"] == EPOCHS
if WORLD_SIZE == 2:  # a sum of 2 numbers has no order: the resumed run is the straight one
    assert model_diff <= TOL and momentum_diff <= TOL

# %% [markdown]
# That equality is for 2 ranks. With more (`WORLD_SIZE = 4`), a resumed DDP's first step sums the
# gradients in one bucket. The straight run sums them in the buckets DDP rebuilt after its first
# step (notebook 05). These are the same numbers added in another order, so that step differs in the
# last bits. An epoch of training then carries the difference on; notebook 02 measures how far
# float32 rounding grows in an epoch. The checkpoint is not the cause. `scripts/train_manual.py`,
# the same script with `average_gradients` and no buckets, resumes to the last bit on any number of
# ranks. Checked when this notebook runs on more than 2 ranks:

# %%
if WORLD_SIZE > 2:
    MANUAL = ["scripts/train_manual.py", *ARGS]
    manual_straight, manual_resumed = fresh("06_manual_straight.pt"), fresh("06_manual_resumed.pt")
    for epochs, path, resume in ((EPOCHS, manual_straight, []), (1, manual_resumed, ["--resume"]),
                                 (EPOCHS, manual_resumed, ["--resume"])):
        ok(torchrun(*STANDALONE, *MANUAL, "--epochs", epochs, "--checkpoint", path, *resume))
    manual_diff = gst.checks.compare_state_dicts(checkpoint(manual_straight)["model"],
                                                 checkpoint(manual_resumed)["model"], show=False)
    print(f"{WORLD_SIZE} ranks, train_manual.py straight vs resumed: {manual_diff:.1e}; "
          f"train_ddp.py: {model_diff:.1e}")
    assert manual_diff <= TOL < model_diff
else:
    print(f"skipped on {WORLD_SIZE} ranks: run this notebook with WORLD_SIZE = 4 to check it "
          "(tools/build_notebooks.py --world-size 4)")

# %% [markdown]
# Why the RNG state: dropout draws new masks at every step. After epoch 1 the generator has moved on
# from where `torch.manual_seed` put it. A resumed run that only re-seeded would draw epoch 1's
# masks again in epoch 2.

# %%
torch.manual_seed(SEED)
gst.model.Net()  # what every rank does before training: seed, then build the model
assert not torch.equal(torch.get_rng_state(), after_one["rng"][0]["cpu"])
print("the saved generator state is not the seeded one: re-seeding would replay epoch 1's dropout")

# %% [markdown]
# Why every rank's generator: the script seeds every rank alike for the initial weights. Then it
# seeds each rank differently, `torch.manual_seed(seed + rank)`, so that each rank draws its own
# dropout masks, as one process would for the whole batch. So every rank has its own state, and each
# rank must resume from its own.
#
# Here is that pattern with the script's `save_checkpoint` and `load_checkpoint`. We take 2 steps,
# save, and take 2 more steps, against a restart from the file. Then the same with every rank given
# rank 0's state, as a checkpoint with rank 0's generator alone would do:

# %%
def resume_with_a_seed_per_rank(rank, world_size, path, restore):
    device = gst.local_device()

    def build():
        torch.manual_seed(SEED)  # the same initial weights on every rank...
        model = gst.model.Net().to(device)
        torch.manual_seed(SEED + rank)  # ...then each rank draws its own dropout masks
        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model, ddp_model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def steps(model, ddp_model, optimizer, numbers):  # training mode: dropout draws each step
        images, labels = gst.data.load(train=True)
        model.train()
        for step in numbers:
            idx = torch.arange(64)[rank::world_size] + 64 * step
            optimizer.zero_grad()
            F.nll_loss(ddp_model(images[idx].to(device)), labels[idx].to(device)).backward()
            optimizer.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    model, ddp_model, optimizer = build()
    steps(model, ddp_model, optimizer, range(2))
    train_ddp.save_checkpoint(path, model, optimizer, 1, device)  # the script's own functions
    straight = steps(model, ddp_model, optimizer, range(2, 4))
    model, ddp_model, optimizer = build()  # a restart: seed, build, load
    train_ddp.load_checkpoint(path, model, optimizer, device)
    if restore == "rank 0's":
        rank_0 = torch.load(path, map_location="cpu", weights_only=True)["rng"][0]
        torch.set_rng_state(rank_0["cpu"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(rank_0["cuda"], device)
    return (steps(model, ddp_model, optimizer, range(2, 4)) - straight).abs().max().item()


# %%
path = str(REPO / fresh("06_seed_per_rank.pt"))
drift = {restore: gst.launch(resume_with_a_seed_per_rank, WORLD_SIZE, args=(path, restore))
         for restore in ("its own", "rank 0's")}
for restore, per_rank in drift.items():
    print(f"each rank resumed with {restore} generator: max |resumed - straight| per rank",
          [f"{d:.1e}" for d in per_rank])
# exact on the CPU with 2 ranks; with more, the last bits of DDP's first step after the restart
# (its initial bucket, above), here over 2 steps only
assert max(drift["its own"]) <= (TOL if WORLD_SIZE == 2 else max(TOL, 1e-6))
assert min(drift["rank 0's"]) > 1e-4  # other masks on rank 1, and through the averaged
#                                       gradients every rank drifts

# %% [markdown]
# ## Many machines: one torchrun per machine
#
# On a cluster, each machine runs one `torchrun` agent. The agents meet at a *rendezvous*, a store
# on one of them (`--rdzv-backend c10d --rdzv-endpoint HOST:PORT`). They agree on who is rank what,
# and start their workers:
#
# ```bash
# # on every machine (the same line; HOST is one of them, e.g. the first):
# torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
#     --rdzv-id my-job scripts/train_ddp.py --checkpoint ckpt.pt --resume
# ```
#
# Put `ckpt.pt` on a file system every machine sees (NFS, Lustre). Rank 0 decides to resume, and
# then every rank loads the file: on a machine of its own disk, a rank finds none and stops.
#
# Two agents on this one machine are two "machines" as far as torch is concerned. So we can check
# that the result does not depend on how the ranks are spread. 2 agents with `WORLD_SIZE / 2` ranks
# each must give what 1 agent with `WORLD_SIZE` ranks gave. `is_host` says which agent hosts the
# store; on real machines torchrun works it out from the host name. With GPUs, each agent gets GPUs
# of its own, as each machine would (`CUDA_VISIBLE_DEVICES` below; not yet run on GPUs). Only
# rank 0 logs, so the agent without it prints nothing.

# %%
with socket.socket() as s:  # a free port for the rendezvous
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
two_nodes = fresh("06_two_nodes.pt")

def agent(node):
    per_node = WORLD_SIZE // 2
    gpus = ",".join(str(node * per_node + i) for i in range(per_node))
    return torchrun("--nnodes", 2, "--nproc-per-node", per_node, "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "notebook-06",
                    "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
                    *SCRIPT, "--epochs", EPOCHS, "--checkpoint", two_nodes,
                    env={"CUDA_VISIBLE_DEVICES": gpus} if ON_GPU else None)

with ThreadPoolExecutor(2) as pool:  # both agents at once, as on two machines
    agents = list(pool.map(agent, [0, 1]))
for node, run in enumerate(agents):
    print(f"--- agent {node}:\n{ok(run)}")

# %%
diff = gst.checks.compare_state_dicts(
    checkpoint(two_nodes)["model"], checkpoint(straight)["model"], show=False
)
print(f"2 agents x {WORLD_SIZE // 2} ranks vs 1 agent x {WORLD_SIZE} ranks: "
      f"max abs difference {diff:.1e}")
assert diff <= TOL

# %% [markdown]
# ## When a rank fails
#
# The course has a wrapper for this demonstration, `scripts/fail_rank.py 1 SCRIPT`. It runs the
# script with rank 1 raising an exception once the process group is up. The script itself has no
# such switch: it is the file you copy. torchrun stops the other ranks and exits with a non-zero
# status, which is what a scheduler or a CI job needs to see. It ends with a summary:

# %%
failed = torchrun(*STANDALONE, "scripts/fail_rank.py", 1, *SCRIPT, "--epochs", 1)
summary = failed.stderr[failed.stderr.index("scripts/fail_rank.py FAILED"):]
print(f"exit status {failed.returncode}; torchrun's error summary, the end of its stderr:\n")
print(summary)

# %% [markdown]
# How to read it, from the bottom up:
#
# * **Root Cause (first observed failure)**: the rank that failed first, its exit code, and —
#   because `main` is decorated with `@record` — its traceback. Start here, with one caveat:
#   torchrun dates failures in whole seconds. If two ranks fail in the same second, it may name the
#   lower rank, even when that rank only failed because of the other (checked below). So read each
#   traceback: the cause is the rank whose traceback is its own exception, not a lost peer
#   ("Connection closed by peer") or a SIGTERM.
# * **Failures**: the other ranks that failed, usually *because* of the real cause: here rank 0,
#   whose `barrier` lost its peer or which torchrun stopped with SIGTERM. Not a second bug.

# %%
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

assert failed.returncode != 0
assert "RuntimeError: rank 1 fails on purpose" in summary  # rank 1's own exception is there
named = re.search(r"Root Cause.*?rank\s*:\s*(\d)", summary, re.S).group(1)
print(f"exit status {failed.returncode}; rank 1's own exception is in the summary; "
      f"this time torchrun named rank {named} as the root cause")
# torchrun collects failures in rank order, and on a tie of timestamps keeps the first: rank 0.
same_second = {rank: ProcessFailure(rank, pid=0, exitcode=1, error_file="") for rank in (0, 1)}
for failure in same_second.values():
    failure.timestamp = 1_700_000_000
first, _ = ChildFailedError("train_ddp.py", same_second).get_first_failure()
assert first == 0
print("two failures dated the same second: torchrun names rank", first, "as the root cause")

# %% [markdown]
# Without `@record` the root cause has no traceback, only a link. The same kind of failure in a
# one-line program that does not use it:

# %%
bare = torchrun("--standalone", "--nproc-per-node", 1, "--no-python", sys.executable, "-c",
                "raise RuntimeError('a script without @record')")
bare_root_cause = bare.stderr[bare.stderr.rindex("Root Cause"):]
print(bare_root_cause)

# %%
assert bare.returncode != 0 and "without @record" not in bare_root_cause
assert "To enable traceback see" in bare_root_cause
assert "without @record" in bare.stderr  # the worker's own stderr, mixed with every other rank's
print("without @record, the summary has no traceback: the error is only in the worker's own output")


# %% [markdown]
# ## Copy this into your code
#
# `snippets/06_torchrun_script.py` trains a small model on random data. The course's tests run it
# with `torchrun --standalone --nproc-per-node 2`. The whole course version is
# `scripts/train_ddp.py`; `docs/cluster.md` has the multi-node and SLURM commands.
#
# <!-- snippets/06_torchrun_script.py -->
# ```python
# """Notebook 06, copy this into your code: the shape of a torchrun script (the whole course
# version: scripts/train_ddp.py).
#
#     torchrun --standalone --nproc-per-node 2 snippets/06_torchrun_script.py --checkpoint ckpt.pt
#     torchrun --standalone --nproc-per-node 2 snippets/06_torchrun_script.py --checkpoint ckpt.pt \\
#         --resume --epochs 4
# """
#
# import argparse
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
# from torch.distributed.elastic.multiprocessing.errors import record
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
# def save_checkpoint(path, model, optimizer, epochs_done, device):
#     """Every rank calls it; rank 0 writes model, optimizer, epochs done, every rank's RNG."""
#     rng = {"cpu": torch.get_rng_state(),
#            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
#     rngs = [None] * dist.get_world_size()
#     dist.all_gather_object(rngs, rng)          # each rank's generators: its own dropout masks
#     if dist.get_rank() == 0:                   # rank 0 saves, once
#         os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # its folder, the first time
#         torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
#                     "epochs_done": epochs_done, "rng": rngs}, path + ".tmp")
#         os.replace(path + ".tmp", path)        # atomic if the process dies: old file or new
#         # (if the machine dies, the rename can reach the disk first: os.fsync the .tmp before)
#     dist.barrier()                             # then no rank goes on before the file is whole
#
#
# def load_checkpoint(path, model, optimizer, device):
#     """Every rank loads the file rank 0 wrote; returns the number of epochs done."""
#     checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # not onto rank 0's GPU
#     model.module.load_state_dict(checkpoint["model"])
#     optimizer.load_state_dict(checkpoint["optimizer"])
#     rngs = checkpoint["rng"]                   # (on another number of ranks: other draws)
#     rng = rngs[dist.get_rank() % len(rngs)]    # this rank's own generators
#     torch.set_rng_state(rng["cpu"])
#     if device.type == "cuda" and rng["cuda"] is not None:
#         torch.cuda.set_rng_state(rng["cuda"], device)
#     return checkpoint["epochs_done"]
#
#
# def train(args, device):
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     dataset = TensorDataset(torch.randn(512, 20, generator=torch.Generator().manual_seed(SEED)),
#                             torch.arange(512) % 3)
#     torch.manual_seed(SEED)                    # the same initial weights on every rank...
#     model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
#     model = DDP(model.to(device))
#     torch.manual_seed(SEED + rank)             # ...then each rank its own dropout masks
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
#     done = 0
#     resume = [args.resume and os.path.exists(args.checkpoint)]  # a first start has no file yet
#     dist.broadcast_object_list(resume, src=0)  # rank 0 decides for all: every rank loads, or none
#     if resume[0]:
#         done = load_checkpoint(args.checkpoint, model, optimizer, device)
#     if rank == 0 and args.resume:
#         print(f"resumed after epoch {done}" if done else "no checkpoint yet: from scratch")
#     sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
#     loader = DataLoader(dataset, batch_size=64 // world_size, sampler=sampler)
#     for epoch in range(done, args.epochs):
#         sampler.set_epoch(epoch)               # a new order every epoch, the same on all ranks
#         total = torch.zeros(2, device=device)  # this rank's loss sum and sample count
#         for x, y in loader:
#             x, y = x.to(device), y.to(device)
#             optimizer.zero_grad()
#             loss = F.cross_entropy(model(x), y)
#             loss.backward()
#             optimizer.step()
#             total += torch.stack([loss.detach() * len(y), torch.tensor(len(y), device=device)])
#         dist.all_reduce(total)                 # the loss over all ranks, on every rank
#         if rank == 0:                          # log from rank 0 only
#             print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}")
#         if args.checkpoint:
#             save_checkpoint(args.checkpoint, model, optimizer, epoch + 1, device)
#
#
# @record                                        # the failing rank's traceback in torchrun's summary
# def main():
#     parser = argparse.ArgumentParser()
#     parser.add_argument("--epochs", type=int, default=2)
#     parser.add_argument("--checkpoint", default="")
#     parser.add_argument("--resume", action="store_true")
#     args = parser.parse_args()
#     if args.resume and not args.checkpoint:
#         parser.error("--resume continues from --checkpoint: give --checkpoint PATH too")
#     device = init_distributed()
#     try:
#         train(args, device)
#     finally:
#         dist.destroy_process_group()           # after an error too
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# ```bash
# torchrun --standalone --nproc-per-node 4 scripts/train_ddp.py --checkpoint ckpt.pt --resume
# ```
#
# * Each rank's data: `DistributedSampler(dataset, shuffle=True, seed=SEED)` and
#   `sampler.set_epoch(epoch)` at the start of every epoch.
# * Log from rank 0 only, a loss averaged across ranks (`all_reduce`, then divide).
# * Checkpoint: rank 0 saves model, optimizer, epochs done and every rank's RNG state
#   (`dist.all_gather_object`) to `path.tmp`. It then `os.replace`s it, then calls `dist.barrier()`.
#   A crashed process leaves the old file whole; for a crashed machine, `os.fsync` the file first.
# * Load with `torch.load(path, map_location="cpu")` on every rank, each taking its own RNG state.
#   `--resume` with no file yet starts from scratch. Rank 0 decides and broadcasts it
#   (`dist.broadcast_object_list`), so no rank resumes alone.
# * `init_distributed()` picks nccl only when the machine has a GPU for every local rank
#   (`LOCAL_WORLD_SIZE`), as `gst.launch` does. With 2 ranks on 1 GPU every rank takes gloo, and
#   warns with both numbers.
# * `scripts/train_ddp.py` also calls `gc.collect()` just before `destroy_process_group()`. It is
#   only needed when something `train` built, the DDP model, can outlive it in a reference cycle.
#   There, importing torchvision inside `train` made one. The model was freed at exit after the
#   group, and gloo sometimes aborted a run that had finished. This snippet has no such cycle.
# * Every snippet and script imports `torch.distributed.nn` before `init_process_group`. Its
#   collectives take the group as a default argument, bound at import (`def broadcast(tensor, src,
#   group=group.WORLD)` in torch 2.14's `torch/distributed/nn/functional.py`). DDP's constructor
#   imports it after init. Its defaults then hold the group after `destroy_process_group()`, and
#   gloo can abort at exit ("terminate called without an active exception"). Imported first, they
#   hold `None` (`tests/test_clean_exit.py` checks both).
#
# ## Exercise
#
# Write `save_checkpoint(path, model, optimizer, epochs_done)` from what this notebook showed,
# without looking at the script. After it, a run that restarts must be exactly the run that never
# stopped. The restart seeds, builds the model and the optimizer, and loads the file. Every rank
# calls your function. `model` is the DDP wrapper, as in the script (the Net is `model.module`), and
# `optimizer` SGD with momentum. Think of what the file needs (the list under "Checkpoint and
# resume"). Think of which rank writes it, and of when the other ranks may go on.
#
# The check below runs it at two world sizes, in the middle of a training run with dropout. It
# then compares 2 more steps of that run with 2 steps of a run resumed from your file. Your keys do
# not matter: it finds the pieces by what they are. It prints "✓ correct", or fails with what is
# wrong: a missing piece and how far the resumed run drifts, a file written by every rank, a rank
# that did not wait. Until you write the function, it says "not attempted yet". Stuck?
# `%load solutions/06_save_checkpoint.py` in a new cell.

# %%
def save_checkpoint(path, model, optimizer, epochs_done):
    # your code here: on rank 0, torch.save a dict of what a resumed run needs; then every rank
    # waits until the file is complete
    raise NotImplementedError("write save_checkpoint")


# %%
gst.exercises.check_save_checkpoint(save_checkpoint)

# %% [markdown]
# **One more, not checked**: torchrun can restart a failed job by itself. `--max-restarts 1` starts
# every worker again after a failure, with the same command line. Change the failure switch so that
# rank 1 fails only once, during epoch 2. For example, fail only while a file `fail-once` exists,
# and delete it before raising. Run 2 epochs with `--max-restarts 1 --checkpoint ... --resume`.
# Check that the job succeeds, that the log shows the restart resuming after epoch 1, and that the
# final parameters equal the straight run's.
