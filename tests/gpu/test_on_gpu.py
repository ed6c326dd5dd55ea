"""The course on GPUs, as pytest tests marked ``gpu``: skipped without CUDA, never run by CI.

    python -m pytest -m gpu tests/gpu          # one test per part of ``make gpu-check``

Each test is one part of :mod:`tests.gpu.check` (every snippet and both scripts under torchrun
with nccl on min(N, 2) ranks, gloo with CUDA tensors on 2 ranks, the notebooks' checks), and
passes when that part's row says "ok". ``make gpu-check`` runs the same parts within a time
budget and prints them as one table.
"""

from __future__ import annotations

import pytest
import torch

from . import check

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (torch.cuda.device_count() == 0)"),
]


@pytest.fixture(scope="module")
def no_data() -> str:
    return check.missing_data()


@pytest.mark.parametrize("part", check.plan(max(GPUS, 1)), ids=lambda part: part.name)
def test_part_runs_on_this_machines_gpus(part, tmp_path, no_data):
    if no_data and part.kind in ("script", "notebook"):
        pytest.skip(no_data)
    row = check.run_part(part, tmp_path, time_left=part.timeout)
    print(check.table([row]))
    assert row.result == "ok", row.figures
