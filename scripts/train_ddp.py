"""Train the course's CNN with DistributedDataParallel on every rank that torchrun starts.

    torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py --smoke        # seconds, on CPUs
    torchrun --standalone --nproc-per-node 4 scripts/train_ddp.py --checkpoint checkpoints/ddp.pt
    torchrun --standalone --nproc-per-node 4 scripts/train_ddp.py --checkpoint checkpoints/ddp.pt \\
        --resume --epochs 6                     # three more epochs, from where the first run ended

Both scripts, ``scripts/train_manual.py`` (notebook 02's ``average_gradients``) and
``scripts/train_ddp.py`` (DistributedDataParallel, notebook 03), run on CPUs (gloo) and on one GPU
per rank (nccl), on one machine or on many (docs/cluster.md has the multi-node and SLURM commands),
with no edits. Each is a deliberate lesson copy of the other, so ``diff
scripts/train_manual.py scripts/train_ddp.py`` is exactly what DDP changes. Each needs the
course's package (``gradsync_tutorial``) for the data, the model, the check of the checkpoint's
path and the final check. Notebook 06 (notebooks/06_from_notebook_to_torchrun.ipynb) runs
train_ddp.py and checks that it gives the same parameters as ``gst.launch``, and that a resumed
run equals a straight one.

What a rank does, in order:

* torchrun starts it with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ... set;
* ``main``: ``init_distributed`` (device, backend, process group), ``train``, and on the way
  out, after an error too, free what ``train`` built, then ``destroy_process_group``.
  ``@record`` puts a failing rank's traceback into torchrun's error summary;
* ``train``: one seed for every rank's initial weights, then seed + rank for its own dropout
  masks; the model wrapped in DDP, ``DistributedSampler`` + ``set_epoch`` for the shards, the
  loop, the loss averaged over the ranks printed by rank 0, a checkpoint after every epoch (and
  on ``--resume``, a clear error for a file it cannot continue from), and at the end a check
  that every rank holds the same parameters.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

from gradsync_tutorial import local_device
from gradsync_tutorial.checkpoints import unwritable
from gradsync_tutorial.checks import max_diff_across_ranks
from gradsync_tutorial.data import DATASETS, ensure_files, load
from gradsync_tutorial.model import Net

MOMENTUM = 0.5
SMOKE_SAMPLES = 1024  # --smoke: the first 1,024 images, 4 steps an epoch at --batch-size 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train the course's CNN on every rank that torchrun starts.",
        epilog="example: torchrun --standalone --nproc-per-node 2 %(prog)s --smoke",
    )
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs in all; a resumed run counts those already done (%(default)s)")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="global batch: samples per step, over all ranks (%(default)s)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (%(default)s)")
    parser.add_argument("--seed", type=int, default=1234,
                        help="initial weights and data order; dropout: seed + rank (%(default)s)")
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fashion-mnist")
    parser.add_argument("--data-root", default=None,
                        help="data folder (default: $GRADSYNC_DATA, else the course's data/)")
    parser.add_argument("--checkpoint", default=None,
                        help="file to save model, optimizer, epoch and RNG state to, every epoch")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint if it exists: one command line for the "
                             "first start and every restart")
    parser.add_argument("--smoke", action="store_true",
                        help=f"a quick check: the first {SMOKE_SAMPLES} training images only")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint:
        parser.error("--resume continues from --checkpoint: give --checkpoint PATH too")
    if args.checkpoint and (problem := unwritable(args.checkpoint)):  # not after an epoch
        parser.error(f"--checkpoint {args.checkpoint}: {problem}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # set by torchrun
    if args.batch_size % world_size:
        parser.error(f"--batch-size {args.batch_size} is the global batch, split evenly over "
                     f"{world_size} ranks: give a multiple of {world_size}")
    return args


def init_distributed() -> torch.device:
    """Join the group torchrun prepared (RANK, WORLD_SIZE, MASTER_ADDR...); return the device.

    With a GPU for every rank on this machine: nccl, this rank on GPU LOCAL_RANK. Otherwise
    gloo, on the CPU (a laptop; also 2 ranks on 1 GPU, which nccl cannot share): with a
    warning that gives both numbers when CUDA is there but has fewer GPUs than ranks.
    """
    local_rank, ranks_here = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    if gpus >= ranks_here:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)          # before init: nccl and *_object calls use it
        dist.init_process_group("nccl", device_id=device)  # barrier() too
        return device
    if gpus:                                   # CUDA, but not a GPU per rank: never silently
        warnings.warn(f"{gpus} GPU(s) visible for {ranks_here} ranks on this machine: this "
                      "job trains on the CPU with gloo. For nccl, start one rank per GPU "
                      f"(--nproc-per-node {gpus}) or check CUDA_VISIBLE_DEVICES.", stacklevel=2)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def train_step(model, optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step on this rank's share of the global batch; returns this rank's loss."""
    optimizer.zero_grad()
    loss = F.nll_loss(model(x), y)
    loss.backward()  # DDP all_reduces the gradients during backward: every rank gets the mean
    optimizer.step()
    return loss.detach()


def log(message: str) -> None:
    if dist.get_rank() == 0:  # one line per event, not one per rank
        print(message, flush=True)


def save_checkpoint(path: str, model, optimizer, epochs_done: int, device: torch.device) -> None:
    """Rank 0 writes the file, with every rank's RNG state; the barrier holds every rank until
    it is complete.

    Every rank holds the same model and optimizer state, so one copy is enough. The RNG state
    is saved because dropout draws random numbers: a resumed run must draw the ones the straight
    run would have drawn. It is saved for every rank, since each rank seeds its own (seed +
    rank: its own dropout masks). The data order needs nothing: it is a function of seed and
    epoch.
    """
    rng = {"cpu": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng)  # every rank's generators, in rank order
    if dist.get_rank() == 0:
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),  # SGD's momentum buffers
            "epochs_done": epochs_done,
            "rng": rngs,  # rngs[r]: rank r's
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, f"{path}.tmp")
        # Atomic for a crashed process: the old file or the new one, whole. (For a crashed
        # machine, os.fsync the new file before the rename.)
        os.replace(f"{path}.tmp", path)
    dist.barrier()  # no rank goes on (or exits) before the checkpoint is on disk


class BadCheckpoint(Exception):
    """A --resume file that this script cannot continue from: the message says what to do."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"--resume: cannot continue from {path}: {problem}.\n"
                         f"Delete it to start from scratch (rm {path}), or give --checkpoint "
                         "a checkpoint this script saved.")


def _first_line(error: BaseException | str) -> str:
    """What torch said, for the message: its first sentence, on one line."""
    text = " ".join(str(error).split()).split(". ")[0].rstrip(".")
    return text if len(text) <= 200 else text[:200] + " ..."


def python_objects_in(path: str) -> list[str]:
    """The classes and functions in a whole ``torch.save`` file that ``weights_only=True``
    refuses (``["argparse.Namespace"]``), or [] when there are none or the file is not whole."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a whole torch.save file: the caller says so
        return []


def read_checkpoint(path: str) -> dict:
    """``torch.load`` the file, or raise :class:`BadCheckpoint` saying what is wrong with it."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise BadCheckpoint(path, "the file is empty (0 bytes)")
    try:
        # map_location="cpu": rank 0 saved tensors that lived on its GPU, cuda:0; without it
        # every rank would load them onto cuda:0. load_state_dict copies them to its device.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise BadCheckpoint(path, f"it cannot be read ({e.strerror})") from None
    except Exception as e:  # noqa: BLE001 - whatever torch.load says of a damaged file
        objects = python_objects_in(path)  # asked of torch's API, not read from its message
        if objects:  # a whole file, with Python objects in it
            raise BadCheckpoint(path, f"another program wrote it: it holds Python objects "
                                      f"({', '.join(objects)}) that this script never saves, "
                                      "nor unpickles") from None
        raise BadCheckpoint(path, "it is not a whole torch.save file: cut short, overwritten "
                                  f"or damaged ({type(e).__name__}: {_first_line(e)})") from None
    keys = {"model", "optimizer", "epochs_done", "rng"}
    if not isinstance(checkpoint, dict) or not keys <= checkpoint.keys():
        found = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise BadCheckpoint(path, f"it holds {found}, not this script's {sorted(keys)}")
    return checkpoint


def load_checkpoint(path: str, model, optimizer, device: torch.device) -> int:
    """Load the checkpoint on every rank; return the number of epochs it has done.

    A file it cannot continue from (empty, cut short, damaged, another program's, another
    model's) raises :class:`BadCheckpoint`, whose message says what is wrong and what to do.
    """
    checkpoint = read_checkpoint(path)
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise BadCheckpoint(path, f"it was saved for another model ({_first_line(e)})") from None
    rngs = checkpoint["rng"]
    if not (isinstance(rngs, list) and rngs and all(isinstance(r, dict) for r in rngs)):
        raise BadCheckpoint(path, "its 'rng' is not a list of every rank's generator states")
    if len(rngs) != dist.get_world_size():  # resumed on another number of ranks: not exact
        log(f"{path} was saved by {len(rngs)} ranks, resumed on {dist.get_world_size()}: "
            "random draws (dropout) differ from a run that never stopped")
    rng = rngs[dist.get_rank() % len(rngs)]  # this rank's own generators
    try:
        torch.set_rng_state(rng["cpu"])
        if device.type == "cuda" and rng.get("cuda") is not None:
            torch.cuda.set_rng_state(rng["cuda"], device)
    except (RuntimeError, TypeError, KeyError) as e:
        raise BadCheckpoint(path, f"its generator states are damaged ({_first_line(e)})") from None
    done = checkpoint["epochs_done"]
    if type(done) is not int or done < 0:  # range(done, epochs) needs a count (a bool is not)
        raise BadCheckpoint(path, f"its 'epochs_done' is {done!r}, not a number of epochs")
    return done


def train(args: argparse.Namespace) -> dict:
    """Train on this rank and return the model's final state dict. Needs the process group."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = local_device()  # what init_distributed chose: the same rule
    batch_size = args.batch_size // world_size  # this rank's share of every step

    # The data: rank 0 fetches the files first. Then local rank 0 of every other machine finds
    # them (a shared file system) or fetches its own copy (a local disk); the others wait.
    if rank == 0:
        ensure_files(args.dataset, root=args.data_root)
    dist.barrier()
    if rank != 0 and int(os.environ["LOCAL_RANK"]) == 0:
        ensure_files(args.dataset, root=args.data_root)
    dist.barrier()
    images, labels = load(args.dataset, root=args.data_root, download=False)
    if args.smoke:
        images, labels = images[:SMOKE_SAMPLES], labels[:SMOKE_SAMPLES]
    # Each epoch: a permutation seeded with seed + epoch, of which rank r takes every
    # world_size-th index from r on -- notebook 02's order[rank::world_size].
    sampler = DistributedSampler(TensorDataset(images, labels), num_replicas=world_size,
                                 rank=rank, shuffle=True, seed=args.seed)

    # GPUs: the same sums in the same order every run (cuDNN's deterministic kernels), in
    # float32 (no TF32): slower convolutions, results that compare with the notebooks'.
    torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = True, False
    torch.manual_seed(args.seed)  # the same initial weights on every rank ...
    model = Net().to(device)
    torch.manual_seed(args.seed + rank)  # ... then each rank its own dropout masks
    # DDP broadcasts rank 0's weights now, and averages the gradients inside every backward().
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM)
    done = 0
    # Rank 0 decides whether to resume, for every rank: all load the file, or none does (a
    # rank that cannot see rank 0's file then fails with its name, instead of training apart).
    resume = [bool(args.resume and Path(args.checkpoint).exists())]
    dist.broadcast_object_list(resume, src=0)
    if resume[0]:
        done = load_checkpoint(args.checkpoint, model, optimizer, device)
        log(f"resumed from {args.checkpoint} after epoch {done}")
    elif args.resume:
        log(f"no checkpoint at {args.checkpoint} yet: starting from scratch")

    for epoch in range(done, args.epochs):
        start = time.perf_counter()
        sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
        shard = torch.tensor(list(sampler))  # this rank's indices, as many as on every other rank
        model.train()
        losses = []
        for i in range(0, len(shard), batch_size):
            idx = shard[i : i + batch_size]
            x, y = images[idx].to(device), labels[idx].to(device)
            losses.append(train_step(ddp_model, optimizer, x, y))
        loss = torch.stack(losses).mean()  # this rank's mean loss over its steps
        dist.all_reduce(loss)  # every rank receives the sum over all ranks ...
        loss /= world_size  # ... and the mean, as for the gradients
        log(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f} (mean over {world_size} "
            f"ranks), {time.perf_counter() - start:.1f} s")
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, optimizer, epoch + 1, device)

    diff = max_diff_across_ranks(model)  # a collective: every rank calls it
    log(f"parameters equal across {world_size} ranks: max |p - p on rank 0| = {diff}")
    return model.state_dict()


@record  # a failing rank writes its traceback where torchrun's error summary picks it up
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    init_distributed()
    try:
        train(args)
    except BadCheckpoint as e:  # every rank read the same file: rank 0 says it, all exit 1
        if dist.get_rank() == 0:
            print(e, file=sys.stderr, flush=True)
        dist.barrier()  # no rank exits (and torchrun stops the others) before rank 0 said it
        raise SystemExit(1) from None
    finally:
        # What train() built (DDP holds the process group) can outlive it in a reference cycle
        # (importing torchvision inside it makes one). Freed only at interpreter exit, after the
        # group, it sometimes made gloo abort the finished process (SIGABRT).
        gc.collect()
        dist.destroy_process_group()  # after an error too: close the sockets, free the GPU


if __name__ == "__main__":
    main()
