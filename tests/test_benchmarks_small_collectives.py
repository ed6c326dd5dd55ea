"""benchmarks/small_collectives.py runs end to end in its smoke mode: forked and fresh ranks
time the same small all_reduce, and the table says each one's ratio to the fresh ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from .conftest import REPO


def test_small_collectives_benchmark_runs_in_smoke_mode():
    env = dict(os.environ, SMOKE_TEST="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "small_collectives.py")],
                          env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^  (forked|fresh) ranks .*?([\d.]+) ms +([\d.]+)x fresh", proc.stdout, re.M)
    assert [row[0] for row in rows] == ["forked", "fresh"], proc.stdout
    assert float(rows[1][2]) == 1.0 and float(rows[0][1]) > 0, proc.stdout
    assert "load average" in proc.stdout
