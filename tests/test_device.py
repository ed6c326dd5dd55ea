"""gradsync_tutorial.device: the one "a GPU per rank, else the CPU" rule, asked by everything.

The GPU cases run here with torch.cuda's answers replaced (this machine has no GPU): the rule
reads only ``torch.cuda.is_available()``, ``torch.cuda.device_count()`` and the environment.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
import torch

from gradsync_tutorial import device
from gradsync_tutorial.launcher import errors

from .conftest import REPO


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_torchrun_script_that_imports_local_device_loads_no_launcher():
    """What scripts/train_*.py import, in every torchrun rank: the device rule, nothing more."""
    code = ("import sys\nfrom gradsync_tutorial import local_device\nlocal_device()\n"
            "print(sorted(m for m in sys.modules if m.startswith('gradsync_tutorial')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out.strip() == "['gradsync_tutorial', 'gradsync_tutorial.device']"


def test_without_a_gpu_every_rank_is_on_the_cpu_over_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert device.local_device() == torch.device("cpu")
    assert device.backend_for("auto", 2) == ("gloo", "cpu")
    with pytest.raises(ValueError, match="backend='nccl' needs one CUDA GPU per rank"):
        device.backend_for("nccl", 2)


def test_a_gpu_per_rank_gives_cuda_local_rank_and_nccl(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert device.local_device() == torch.device("cuda", 1)
    assert device.backend_for("auto", 2) == ("nccl", "cuda")
    assert device.backend_for("gloo", 2) == ("gloo", "cuda")  # gloo asked for: a GPU each still


def test_fewer_gpus_than_ranks_is_the_cpu_for_every_rank(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert device.local_device() == torch.device("cpu")
    assert device.backend_for("auto", 3) == ("gloo", "cpu")


def test_the_launchers_cuda_hint_asks_the_same_rule(two_gpus):
    cuda_error = errors.Failure(0, "raised", exc_type="RuntimeError", message="No CUDA GPUs")
    assert errors._hint(cuda_error) == ""  # there are GPUs: the hint would be wrong


def test_nothing_else_in_the_package_asks_torch_cuda_how_many_gpus_there_are():
    """One rule, one place: the launcher, checks, doctor and errors all ask device.py."""
    asking = []
    for path in sorted((REPO / "gradsync_tutorial").rglob("*.py")):
        if path.name == "device.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("device_count", "is_available"):
                if ast.unparse(node.value) in ("torch.cuda", "cuda"):
                    asking.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not asking, f"ask gradsync_tutorial.device instead: {asking}"
