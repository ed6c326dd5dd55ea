"""Issue 39: a launch pickles what torch scripts touch, stops only jobs that can never end,
loses no rank's work, and forgets each job exactly.

Each test is a class of program that a torchrun script is, run through ``gst.launch``: what
torchrun would do is what the launch must do.
"""

from __future__ import annotations

import pytest

import gradsync_tutorial as gst

pytestmark = pytest.mark.usefixtures("no_workers_left")


# -- (1) what fn touches is sent: torch's module subclasses by reference -------------------------


def test_a_function_that_sets_torch_backends_flags_is_launched():
    import torch.backends.cudnn  # noqa: F401 - the module subclasses torch puts in sys.modules
    import torch.backends.mkldnn  # noqa: F401

    def train(rank, world_size):
        torch.backends.cudnn.benchmark = True  # the first line of many torchrun scripts
        torch.backends.cuda.matmul.allow_tf32 = False
        return torch.backends.mkldnn.is_available() in (True, False)

    assert gst.launch(train, world_size=2) == [True, True]


def test_a_module_passed_as_an_argument_arrives_as_the_worker_s_own():
    import torch.backends.cudnn

    def same_module(rank, world_size, module):
        import sys

        return module is sys.modules["torch.backends.cudnn"]

    assert gst.launch(same_module, 2, args=(torch.backends.cudnn,)) == [True, True]


def test_an_unpicklable_global_is_named_as_what_fn_uses_not_as_an_argument():
    import threading

    lock = threading.Lock()

    def uses_a_lock(rank, world_size):
        with lock:
            return rank

    with pytest.raises(TypeError) as caught:
        gst.launch(uses_a_lock, world_size=2)
    message = str(caught.value)
    assert "`lock`" in message and "inside fn" in message
    assert "pass tensors" not in message  # fn was passed nothing

    with pytest.raises(TypeError) as caught:
        gst.launch(lambda rank, world_size, x: rank, 2, args=(threading.Lock(),))
    assert "args[0]" in str(caught.value)


# -- (2) the early stop: only a collective (or send/recv) of a group a returned rank is in --------


def test_a_subgroup_made_with_local_synchronization_is_not_stopped_early():
    def fn(rank, world_size):
        import time

        import torch
        import torch.distributed as dist

        if rank == 0:
            return "skipped"  # the flag exists so that rank 0 need not call new_group
        if rank == 2:
            time.sleep(5)  # late: rank 1 waits in new_group meanwhile, in no collective
        pair = dist.new_group([1, 2], use_local_synchronization=True)
        t = torch.ones(1)
        dist.all_reduce(t, group=pair)
        return t.item()

    assert gst.launch(fn, world_size=3, timeout=120) == ["skipped", 2.0, 2.0]


def test_a_checkpoint_saved_alone_is_not_stopped_early(tmp_path):
    def fn(rank, world_size, folder):
        import time
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        if rank == 1:  # saved by rank 1 alone, as no_dist=True allows, again and again for 6 s
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single..."
            state = {f"w{i}": torch.randn(512, 512) for i in range(20)}
            end = time.monotonic() + 6
            while time.monotonic() < end:
                dcp.save(state, checkpoint_id=str(folder / "step"), no_dist=True)
        return rank

    assert gst.launch(fn, 2, args=(tmp_path,), timeout=120) == [0, 1]
    assert (tmp_path / "step" / ".metadata").exists()


def test_a_monitored_barrier_whose_coordinator_returned_fails_at_once():
    import time

    def fn(rank, world_size):
        from datetime import timedelta

        import torch.distributed as dist

        if rank == 1:  # rank 0, its coordinator, never calls it: it returns at once
            dist.monitored_barrier(timeout=timedelta(seconds=100))
        return rank

    start = time.monotonic()
    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=100)
    assert time.monotonic() - start < 30  # torchrun fails in seconds, not at the 100 s timeout
    message = str(caught.value)
    assert "rank 0 returned" in message and "rank 1 is waiting in dist.monitored_barrier" in message


# -- (3) threads fn leaves running finish, as at the exit of a torchrun process ----------------


def test_a_thread_fn_left_running_finishes_before_the_launch_returns(tmp_path):
    def fn(rank, world_size, folder):
        import threading
        import time

        def save():
            time.sleep(2)  # a background save, still writing when fn returns
            (folder / f"rank{rank}").write_text("saved")

        threading.Thread(target=save, name="background-save").start()
        return rank

    assert gst.launch(fn, 2, args=(tmp_path,), timeout=60) == [0, 1]
    gst.shutdown_workers()  # under torchrun the process would have waited for the thread
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_work_queued_on_an_executor_finishes_and_an_idle_one_does_not_hold_the_launch(tmp_path):
    def fn(rank, world_size, folder):
        import builtins
        import time
        from concurrent.futures import ThreadPoolExecutor

        def save():
            time.sleep(2)
            (folder / f"rank{rank}").write_text("saved")

        ThreadPoolExecutor(1).submit(save)  # dropped: its thread ends after the save
        builtins.idle_pool = kept = ThreadPoolExecutor(2)  # kept alive, idle, across the job
        kept.submit(time.sleep, 0).result()
        return rank

    start = __import__("time").monotonic()
    assert gst.launch(fn, 2, args=(tmp_path,), timeout=60) == [0, 1]
    assert __import__("time").monotonic() - start < 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_a_thread_that_never_ends_is_named_at_the_timeout():
    def fn(rank, world_size):
        import threading
        import time

        def forever():
            while True:
                time.sleep(0.1)

        threading.Thread(target=forever, name="never-ending").start()
        return rank

    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=5)
    assert "'never-ending'" in str(caught.value) and "in forever" in str(caught.value)
