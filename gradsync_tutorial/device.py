"""Where a rank computes, and over which backend: one GPU per rank (nccl), else the CPU (gloo).

The one rule everything in the course asks: :func:`gst.launch <gradsync_tutorial.launch>`
picking its backend, ``gst.local_device()`` in training code (the notebooks' and the torchrun
scripts'), the replica checks putting a collective's tensors on the group's device, the doctor,
and the launcher's hint for CUDA code on a machine without a GPU. It imports torch and nothing
else of the course, so a torchrun script that calls :func:`local_device` loads no launcher.

    >>> from gradsync_tutorial.device import backend_for, gpu_per_rank, local_device
    >>> local_device()                  # in the notebook itself: rank 0 of 1, no GPU here
    device(type='cpu')
    >>> gpu_per_rank(2), backend_for("auto", world_size=2)
    (False, ('gloo', 'cpu'))

Introduced in ``notebooks/01_single_device_baseline.ipynb``; notebook 06 shows the same rule in a
torchrun script.
"""

from __future__ import annotations

import os

import torch

__all__ = ["backend_for", "collective_device", "gpu_count", "gpu_per_rank", "local_device"]


def gpu_count() -> int:
    """How many CUDA GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_per_rank(ranks_here: int) -> bool:
    """Is there a GPU for each of the ``ranks_here`` ranks on this machine?"""
    return gpu_count() >= max(1, ranks_here)


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when there is a GPU per local rank, else CPU.

    The rule ``launch`` uses to pick nccl or gloo; it reads the same variables under
    ``torchrun``, so training code that calls it moves to a script unchanged.

        >>> import gradsync_tutorial as gst
        >>> gst.local_device()          # in the notebook itself: rank 0 of 1
        device(type='cpu')
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if gpu_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", 1))):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(backend: str, world_size: int) -> tuple[str, str]:
    """``(backend, device)`` for a launch of ``world_size`` ranks on this machine.

    ``"auto"``: nccl and cuda with a GPU per rank, else gloo and cpu. ``"nccl"`` without a GPU
    per rank is refused with what to do instead.
    """
    device = "cuda" if gpu_per_rank(world_size) else "cpu"
    if backend == "auto":
        return ("nccl" if device == "cuda" else "gloo"), device
    if backend == "nccl" and device != "cuda":
        raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size}, "
                         f"GPUs found: {gpu_count()}. Use backend='gloo' (runs on the CPU) or "
                         "backend='auto', or lower world_size.")
    return backend, device


def collective_device() -> torch.device:
    """Where the tensors of this process group's collectives must be: the rank's GPU for nccl,
    the CPU for gloo."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
