"""benchmarks/verify_cost.py runs end to end in its smoke mode and prints its whole table.

The benchmark times real checks: a checked step whose report is not ok raises in the ranks, so
this also proves verify_gradients passes right DDP and FSDP2 steps at 2 and 4 ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import REPO


def test_verify_cost_benchmark_runs_in_smoke_mode():
    env = dict(os.environ, SMOKE_TEST="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "verify_cost.py")],
                          env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = [line.split() for line in lines if line.startswith(("ddp ", "fsdp2 "))]
    assert [(row[0], row[1]) for row in table] == [
        ("ddp", "2"), ("fsdp2", "2"), ("ddp", "4"), ("fsdp2", "4")], proc.stdout
    assert all(row[5].endswith("x") and float(row[5][:-1]) > 0 for row in table), proc.stdout
    assert any("load average" in line and "cores" in line for line in lines), proc.stdout
    assert sum(line.startswith("growth, ") for line in lines) == 2, proc.stdout
