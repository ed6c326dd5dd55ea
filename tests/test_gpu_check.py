"""``make gpu-check`` (tests/gpu/check.py) on a machine without a GPU, and what GPU runs rely on.

No GPU is needed here: without one the check must say that every part was skipped and why; its
plan for 1, 2 and 8 GPUs is read without running it; the program it runs for gloo with CUDA
tensors runs on the CPU as it would on a GPU; and a part that does not reach nccl is reported
as failed, not as passed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import gradsync_tutorial as gst

from .conftest import REPO, SNIPPETS
from .gpu import check

NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))


def test_without_a_gpu_every_part_is_skipped_and_says_why():
    run = subprocess.run([sys.executable, "-m", "tests.gpu.check"], cwd=REPO, env=NO_GPU,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| part ")]
    assert len(rows) == len(check.plan(1)) >= 10
    for row in rows:
        assert "| skipped | no CUDA GPU visible (torch.cuda.device_count() == 0)" in row, row
    assert f"{len(rows)} skipped, on torch {torch.__version__}" in run.stdout
    assert "0 GPU(s): none" in run.stdout


def test_the_plan_runs_every_snippet_both_scripts_and_the_notebooks_on_min_n_2_ranks():
    snippets = [p.name for p in SNIPPETS]
    notebooks = [p.name for p in check.gpu_notebooks()]  # found: their sources call local_device()
    # 04 (monitored_barrier on a gloo side group), 05 and 06 (tensors on the rank's device)
    assert {f"{n:02d}" for n in range(1, 10)} <= {name[:2] for name in notebooks}
    for gpus, ranks in ((1, 1), (2, 2), (8, 2)):
        parts = check.plan(gpus)
        by_kind = {kind: [p for p in parts if p.kind == kind] for kind in
                   ("snippet", "script", "gloo+cuda", "notebook")}
        assert [p.name for p in by_kind["snippet"]] == [f"snippets/{s}" for s in snippets]
        assert [p.name for p in by_kind["notebook"]] == [f"notebooks/{n}" for n in notebooks]
        for part in by_kind["snippet"] + by_kind["script"]:
            assert (part.ranks, part.backend) == (ranks, "nccl"), part
            assert all(c[c.index("--nproc-per-node") + 1] == str(ranks) for c in part.commands)
        [gloo] = by_kind["gloo+cuda"]
        assert (gloo.ranks, gloo.backend) == (2, "gloo")
        assert ("both ranks" in gloo.device) == (gpus == 1)
        scripts = " ".join(" ".join(c) for p in by_kind["script"] for c in p.commands)
        assert "train_manual.py" in scripts and "train_ddp.py" in scripts and "--resume" in scripts
        assert all(p.timeout <= 180 for p in parts)  # each part time-boxed; the whole: BUDGET


def test_a_snippets_commands_are_the_ones_its_docstring_shows():
    commands = check.snippet_commands(REPO / "snippets" / "06_torchrun_script.py", 1)
    assert [c[c.index("--nproc-per-node") + 1:] for c in commands] == [
        ["1", str(REPO / "snippets" / "06_torchrun_script.py"), "--checkpoint", "ckpt.pt"],
        ["1", str(REPO / "snippets" / "06_torchrun_script.py"), "--checkpoint", "ckpt.pt",
         "--resume", "--epochs", "4"]]


def test_gloo_with_cuda_tensors_program_checks_itself_and_prints_its_figures(tmp_path):
    """The program runs on the CPU when there is no GPU; check.py reads its line."""
    [part] = [p for p in check.plan(1) if p.kind == "gloo+cuda"]
    run = subprocess.run(part.commands[0], cwd=tmp_path, env=dict(NO_GPU, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    shown = check.figures(part, [run.stdout], tmp_path)
    assert shown.startswith("gloo on cpu: average_gradients vs one process "), shown
    assert "FlatAverager vs average_gradients 0.0e+00; DDP vs average_gradients 0.0e+00" in shown


def test_a_part_that_never_reaches_nccl_is_a_failure(tmp_path):
    """Here init_distributed falls back to gloo: the snippet passes its own check, but the row
    must not say "ok" for an nccl part."""
    [part] = [p for p in check.plan(1) if p.name == "snippets/02_average_gradients.py"]
    row = check.run_part(part, tmp_path, time_left=part.timeout)
    assert row.result == "FAILED" and "nccl never started" in row.figures, row


def test_a_part_out_of_time_is_not_run_and_a_slow_one_is_stopped(tmp_path):
    slow = check.Part("snippet", "sleeps", 1, "cpu", "gloo",
                      [[sys.executable, "-c", "import time; time.sleep(60)"]], timeout=4)
    assert check.run_part(slow, tmp_path, time_left=1).result == "not run"
    row = check.run_part(slow, tmp_path, time_left=4)
    assert (row.result, row.figures) == ("FAILED", "timed out after 4 s")


def _flags_after(rank, world_size, flip):
    if flip:  # a job that changes them; the next job must not inherit its choice
        torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = False, True
        torch.backends.cuda.matmul.allow_tf32 = True
    return (torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32)


@pytest.mark.parametrize("flip_first", [False, True])
def test_launched_ranks_use_deterministic_float32_kernels(flip_first):
    """On GPUs the notebooks' bit-for-bit checks need cuDNN's deterministic kernels and no TF32
    (the scripts set the same): every launched job starts with them."""
    if flip_first:
        gst.launch(_flags_after, 2, args=(True,))
    assert gst.launch(_flags_after, 2, args=(False,)) == [(True, False, False)] * 2
