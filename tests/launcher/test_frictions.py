"""The frictions a new user meets bringing torchrun-style code, each with its test.

Where torchrun refuses something, ``gst.launch`` refuses it with torch's own words (plus what to
do); where torchrun fails in seconds, ``gst.launch`` does not wait its whole timeout.
"""

from __future__ import annotations

import time

import pytest

import gradsync_tutorial as gst

from ..programs import cell

pytestmark = pytest.mark.usefixtures("no_workers_left")


def test_accelerate_style_args_get_the_lambda_that_runs_them():
    def training_function(config, args):
        return config["lr"]

    with pytest.raises(TypeError, match=r"gst\.launch\(lambda rank, world_size: "
                                        r"training_function\(config, args\)"):
        gst.launch(training_function, world_size=2, args=({"lr": 0.1}, None))


def test_init_process_group_device_id_cpu_fails_as_under_torchrun():
    def main(rank, world_size):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", device_id=torch.device("cpu"))

    with pytest.raises(gst.RankFailedError) as caught:
        gst.launch(main, world_size=2)
    message = str(caught.value)
    assert "device_id parameter must be an accelerator with an index" in message  # torch's
    assert "torchrun" in message


def test_init_process_group_timeout_shorter_than_the_launch_s_applies():
    def main(rank, world_size):
        import datetime
        import time

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 is late: 2 s is the limit asked for
        else:
            time.sleep(15)
        return rank

    start = time.monotonic()
    with pytest.raises(gst.RankFailedError, match="rank 0 raised"):
        gst.launch(main, world_size=2, timeout=120)
    assert time.monotonic() - start < 60


def test_string_rank_and_world_size_get_a_message_that_says_so():
    def main(rank, world_size):
        import os

        import torch.distributed as dist

        dist.init_process_group("gloo", rank=os.environ["RANK"],
                                world_size=os.environ["WORLD_SIZE"])

    with pytest.raises(gst.RankFailedError) as caught:
        gst.launch(main, world_size=2)
    message = str(caught.value).split("\nTraceback")[0]
    assert "must be an integer" in message  # torch's words, as under torchrun
    assert "int(os.environ['WORLD_SIZE'])" in message or "int(os.environ['RANK'])" in message
    assert "in a launch of 2 ranks" not in message  # not "world_size=2 ... launch of 2"


def test_init_process_group_timeout_as_a_number_fails_as_under_torchrun():
    def main(rank, world_size):
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=30)

    with pytest.raises(gst.RankFailedError) as caught:
        gst.launch(main, world_size=2)
    message = str(caught.value)
    assert "Expected timeout argument to be of type datetime.timedelta" in message
    assert "timedelta(seconds=30)" in message
    assert "TCPStore" not in message and "incompatible function arguments" not in message


def test_a_rank_that_returned_while_another_waits_in_a_collective_is_reported_early():
    def fn(rank, world_size):
        import torch
        import torch.distributed as dist

        if rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never calls it: it returns at once
        return rank

    start = time.monotonic()
    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=300)
    assert time.monotonic() - start < 60  # torchrun fails in seconds; not the whole 300 s
    message = str(caught.value)
    assert "rank 1 returned" in message and "rank 0 is waiting in dist.all_reduce" in message
    assert "before its timeout" in message


def test_a_rank_still_working_after_another_returned_is_not_reported_early():
    def fn(rank, world_size):
        import time

        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1))
        if rank == 1:
            time.sleep(8)  # busy, not waiting in a collective: rank 0 returned first
        return rank

    assert gst.launch(fn, world_size=2, timeout=120) == [0, 1]


def test_ranks_busy_in_a_group_without_the_returned_rank_are_not_reported_early():
    def fn(rank, world_size):
        import time

        import torch
        import torch.distributed as dist

        pair = dist.new_group([0, 1])  # every rank creates it; rank 2 is not in it
        if rank < 2:
            for _ in range(150):
                dist.all_reduce(torch.ones(1), group=pair)
                time.sleep(0.03)
        return rank

    assert gst.launch(fn, world_size=3, timeout=120) == [0, 1, 2]


SPAWN_CELL = """
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([float(i * i)])

def fn(rank, world_size, start_method):
    loader = DataLoader(Squares(), batch_size=2, num_workers=1,
                        multiprocessing_context=start_method)
    return sum(batch.sum().item() for batch in loader)
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_data_loader_workers_with_spawn_take_a_dataset_class_defined_in_a_cell(start_method):
    fn = cell(SPAWN_CELL)["fn"]
    assert gst.launch(fn, world_size=2, args=(start_method,), timeout=240) == [14.0, 14.0]


def test_a_launcher_inside_a_rank_is_named_as_the_cause():
    def fn(rank, world_size):
        import torch.multiprocessing as mp

        def inner(i):
            pass

        mp.start_processes(inner, nprocs=2, start_method="fork")  # what ddp_notebook does

    start = time.monotonic()
    with pytest.raises(gst.RankFailedError, match="a launcher inside a rank"):
        gst.launch(fn, world_size=2, timeout=120)
    assert time.monotonic() - start < 60


def test_fabric_ddp_notebook_inside_a_rank_is_named_as_the_cause():
    pytest.importorskip("lightning")

    def fn(rank, world_size):
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook")
        return fabric.launch(lambda fabric: fabric.global_rank)

    with pytest.raises(gst.RankFailedError) as caught:
        gst.launch(fn, world_size=2, timeout=120)
    assert "a launcher inside a rank" in str(caught.value)
    assert 'strategy="ddp"' in str(caught.value)
