"""Functions written for torchrun or mp.spawn, which call ``dist.init_process_group`` themselves,
run under ``gst.launch`` unchanged (docs/launcher.md, "Code that sets up its own process group").

The programs are files in ``tests/programs/``, each in the shape of a well-known program -- the
same structure and the same calls -- written for these tests, with only the device edits a CPU
laptop needs (nccl -> gloo, cuda -> cpu): PyTorch's "Getting started with DDP" (demo_basic,
demo_checkpoint, demo_model_parallel; elastic_ddp), the dist_tuto ``init_process(rank, size,
fn)``, pytorch/examples ddp-tutorial-series ``multigpu.py`` and ``multigpu_torchrun.py``,
``distributed/ddp/example.py``, and the CS336 DDP tests. They are defined the way a notebook
cell defines them (``tests.programs.cell``): compiled in a ``__main__`` namespace from source
that only linecache knows.
"""

from __future__ import annotations

import os

import pytest
import torch

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import RankFailedError

from ..conftest import worker_pids
from ..programs import cell, program, source

pytestmark = pytest.mark.usefixtures("no_workers_left")


def _same(a, b, atol=0.0):
    return len(a) == len(b) and all(
        torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a, b, strict=True))


def test_getting_started_demos_run_unchanged(tmp_path, capsys):
    ns = program("getting_started_ddp")
    basic = gst.launch(ns["demo_basic"], world_size=2)
    assert _same(basic[0], basic[1])  # DDP kept the replicas equal
    # The same step by hand: the mean of the two ranks' gradients.
    torch.manual_seed(0)
    model = ns["ToyModel"]()
    grads = []
    for rank in (0, 1):
        model.zero_grad()
        torch.manual_seed(rank)
        out = model(torch.randn(20, 10))
        torch.nn.MSELoss()(out, torch.randn(20, 5)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    expected = [p.detach() - 0.001 * (g0 + g1) / 2
                for p, g0, g1 in zip(model.parameters(), *grads, strict=True)]
    assert _same(basic[0], expected, atol=1e-6)
    out = capsys.readouterr().out
    assert "[rank 1] Finished running basic DDP example on rank 1." in out

    checkpoint = gst.launch(ns["demo_checkpoint"], world_size=2, args=(str(tmp_path),))
    assert _same(checkpoint[0], checkpoint[1])
    assert not (tmp_path / "model.checkpoint").exists()  # rank 0 removed it

    parallel = gst.launch(ns["demo_model_parallel"], world_size=2)
    assert _same(parallel[0], parallel[1])
    assert _same(parallel[0], basic[0], atol=1e-6)  # the same model, split in two
    # Each launch destroyed its own group; the next plain launch works.
    assert gst.launch(lambda rank, ws: torch.distributed.get_world_size(), 2) == [2, 2]


def test_elastic_ddp_torchrun_entry_point(capsys):
    ns = program("elastic_ddp")
    demo_basic = ns["demo_basic"]
    results = gst.launch(lambda rank, world_size: demo_basic(), world_size=2)
    assert _same(results[0], results[1])
    assert "[rank 0] Start running basic DDP example on rank 0." in capsys.readouterr().out


def test_dist_tuto_init_process():
    ns = program("dist_tuto")
    results = gst.launch(ns["init_process"], world_size=2, args=(ns["run"],))
    assert results == [(1.0, 3.0), (1.0, 3.0)]


def test_ddp_tutorial_series_multigpu(tmp_path, capsys):
    ns = program("multigpu")
    checkpoint = str(tmp_path / "checkpoint.pt")
    results = gst.launch(ns["main"], world_size=2, args=(1, 2, 32, checkpoint))
    assert _same(results[0], results[1])
    saved = torch.load(checkpoint)
    assert torch.equal(saved["weight"], results[0][0])
    out = capsys.readouterr().out
    assert "[rank 1] [GPU1] Epoch 1 | Batchsize: 32 | Steps: 4" in out


def test_ddp_tutorial_series_multigpu_torchrun_resumes_from_its_snapshot(tmp_path, capsys):
    ns = program("multigpu_torchrun")
    main = ns["main"]
    snapshot = str(tmp_path / "snapshot.pt")
    first = gst.launch(lambda rank, world_size: main(1, 2, 32, snapshot), world_size=2)
    assert _same(first[0], first[1])
    assert torch.load(snapshot)["EPOCHS_RUN"] == 1
    second = gst.launch(lambda rank, world_size: main(1, 3, 32, snapshot), world_size=2)
    assert _same(second[0], second[1])
    out = capsys.readouterr().out
    assert "[rank 0] Resuming training from snapshot at Epoch 1" in out


def test_distributed_ddp_example_spmd_main(capsys):
    ns = program("ddp_example")
    spmd_main = ns["spmd_main"]
    results = gst.launch(lambda rank, world_size: spmd_main(world_size, rank), world_size=2)
    assert _same(results[0], results[1])
    out = capsys.readouterr().out
    assert "rank = 1, backend=gloo" in out


def test_cs336_style_ddp_test():
    ns = program("cs336_ddp_test")
    results = gst.launch(ns["_test_DistributedDataParallelIndividualParameters"],
                         world_size=2, args=(ns["ToyModel"],))
    assert results == ["passed", "passed"]


def test_setup_and_cleanup_twice_in_one_function():
    ns = program("getting_started_ddp")
    setup, cleanup = ns["setup"], ns["cleanup"]

    def twice(rank, world_size):
        import torch.distributed as dist

        sums = []
        for _ in range(2):
            setup(rank, world_size)
            t = torch.ones(1)
            dist.all_reduce(t)
            sums.append(t.item())
            cleanup()
        return sums

    assert gst.launch(twice, world_size=2) == [[2.0, 2.0], [2.0, 2.0]]


def test_an_init_with_another_world_size_says_what_to_change():
    def fn(rank, world_size):
        import torch.distributed as dist

        os.environ["MASTER_PORT"] = "12355"
        dist.init_process_group("gloo", rank=rank, world_size=4)

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    message = str(info.value)
    assert "init_process_group(world_size=4) in a launch of 2 ranks" in message
    assert "gst.launch(fn, world_size=4)" in message
    assert worker_pids() == []


def test_an_init_with_another_rank_says_what_to_change():
    def fn(rank, world_size):
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=world_size - 1 - rank, world_size=world_size)

    with pytest.raises(RankFailedError, match=r"pass the rank fn receives"):
        gst.launch(fn, world_size=2)


def test_an_init_for_another_backend_replaces_the_launchers_group():
    def fn(rank, world_size):
        import torch.distributed as dist

        dist.init_process_group("cpu:gloo", rank=rank, world_size=world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        return dist.get_backend(), t.item()

    assert gst.launch(fn, world_size=2) == [("cpu:gloo", 2.0)] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_an_unedited_nccl_setup_on_a_cpu_machine_gets_the_device_hint():
    ns = cell(source("getting_started_ddp").replace('"gloo", rank=rank', '"nccl", rank=rank'))
    with pytest.raises(RankFailedError) as info:
        gst.launch(ns["demo_basic"], world_size=2)
    assert "NCCL" in str(info.value) and "gst.local_device()" in str(info.value)
