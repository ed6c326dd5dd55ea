"""A failure is a record: who is blamed is decided from its fields, and the text says what to do.

Real launches (gloo on the CPU) for what a learner meets; the record classes directly for the
blame rules. Every test ends with no worker left (the `no_workers_left` fixture).
"""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import RankFailedError
from gradsync_tutorial.launcher.errors import Failure, _blame, _fold_cpp_frames, rank_failed_error

from ..conftest import worker_pids

pytestmark = pytest.mark.usefixtures("no_workers_left")


# -- blame from fields, not from words in the text -------------------------------------------


def test_a_type_whose_name_contains_peer_is_not_a_lost_peer():
    """"TypeError".lower() contains "peer": the old text search took it for a consequence."""

    def fn(rank, world_size):
        if rank == 0:
            raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")
        time.sleep(1.0)  # rank 1 then dies on its own, later
        os._exit(3)

    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    print(f"reported in {time.monotonic() - start:.2f} s")  # measured, not asserted
    err = info.value
    assert err.rank == 0 and err.exc_type == "TypeError"
    assert str(err).startswith("rank 0 raised TypeError: unsupported operand")
    assert not err.failure.lost_peer
    assert "consequence" not in str(err)
    assert worker_pids() == []


def test_blame_reads_the_lost_peer_field_only():
    typeerror = Failure(0, "raised", exc_type="TypeError", message="peer review")
    lost = Failure(0, "raised", exc_type="RuntimeError", lost_peer=True,
                   message="Connection closed by peer")
    died = Failure(1, "killed", signal="SIGKILL")
    assert _blame([typeerror, died]) is typeerror
    assert _blame([lost, died]) is died
    assert _blame([lost]) is lost  # nobody else to blame: the first


def test_the_worker_decides_lost_peer_from_where_the_error_was_raised():
    from gradsync_tutorial.launcher.rank_failure import lost_peer as _lost_peer

    assert not _lost_peer(TypeError("peer"), "peer")
    # A RuntimeError with the words, but raised in the user's code, not in torch.distributed.
    try:
        raise RuntimeError("Connection reset by peer")
    except RuntimeError as e:
        assert not _lost_peer(e, str(e))


def test_a_real_lost_peer_is_a_consequence_and_its_cpp_frames_are_folded():
    def fn(rank, world_size):
        import torch
        import torch.distributed as dist

        if rank == 1:
            time.sleep(0.5)
            os._exit(3)
        dist.all_reduce(torch.ones(1))  # rank 0 waits here; its peer goes away

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    err = info.value
    assert err.rank == 1 and err.failure.kind == "exited" and err.failure.exit_code == 3
    if 0 in err.failures:  # rank 0 reported its lost peer before it was stopped
        assert err.failures[0].lost_peer
        assert "(a consequence: a peer went away)" in str(err)
        assert "frame #" not in str(err)


def test_cpp_frames_are_folded_into_one_note():
    message = textwrap.dedent("""\
        [pair.cc:561] Connection closed by peer [127.0.0.1]:7364
        Exception raised from recvBytes at /torch/csrc/distributed/c10d/Utils.hpp:670 (most recent call first):
        frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in libc10.so)
        frame #1: <unknown function> + 0x5a2f (0x7f in libtorch_cpu.so)
        """)  # noqa: E501 - gloo's own line
    assert _fold_cpp_frames(message) == ("[pair.cc:561] Connection closed by peer "
                                         "[127.0.0.1]:7364 [3 lines of C++ stack folded]")
    lost = Failure(0, "raised", exc_type="DistBackendError", message=message, lost_peer=True)
    died = Failure(1, "exited", exit_code=3)
    text = str(rank_failed_error([lost, died], started=True))
    assert "frame #" not in text and "3 lines of C++ stack folded" in text


# -- errors that must not crash the worker or reach the notebook raw --------------------------


class _StrRaises(Exception):
    def __str__(self):
        raise RuntimeError("__str__ is broken too")


def test_an_exception_whose_str_raises_names_the_rank():
    def fn(rank, world_size):
        if rank == 1:
            raise _StrRaises()
        return rank

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    err = info.value
    assert err.rank == 1 and err.failure.kind == "raised"  # not a crashed worker
    assert "_StrRaises" in str(err) and "__str__ raised RuntimeError" in str(err)
    assert "raise _StrRaises()" in err.traceback
    assert gst.launch(lambda rank, ws: rank, 2) == [0, 1]  # the next launch works


def test_a_result_class_only_the_worker_can_import_names_the_rank(tmp_path):
    (tmp_path / "only_in_the_worker.py").write_text("class Result:\n    pass\n")
    folder = str(tmp_path)

    def fn(rank, world_size):
        sys.path.insert(0, folder)  # in the rank only: the notebook cannot import it
        import only_in_the_worker

        return only_in_the_worker.Result()

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    message = str(info.value)
    assert message.startswith("rank 0's return value could not be rebuilt in the notebook: "
                              "ModuleNotFoundError: No module named 'only_in_the_worker'")
    assert "return tensors, numbers" in message
    assert not isinstance(info.value, ModuleNotFoundError)
    assert gst.launch(lambda rank, ws: rank, 2) == [0, 1]


def test_a_cyclic_result_comes_back_or_names_the_rank():
    def fn(rank, world_size):
        cycle = [rank]
        cycle.append(cycle)
        return cycle

    try:
        results = gst.launch(fn, world_size=2)
    except RankFailedError as e:  # a clear error naming the rank, not a crashed worker
        assert e.failure.kind == "raised" and "return value" in str(e)
        assert str(e).startswith(f"rank {e.rank} ")
    else:
        for rank, cycle in enumerate(results):
            assert cycle[0] == rank and cycle[1] is cycle
    assert gst.launch(lambda rank, ws: rank, 2) == [0, 1]


# -- frictions met when bringing code from elsewhere -----------------------------------------


def test_user_variables_reach_the_ranks_but_not_the_launchers_own(monkeypatch):
    monkeypatch.setenv("GRADSYNC_DATA", "/srv/course-data")  # the README's offline recipe
    monkeypatch.setenv("GRADSYNC_TOKEN", "not-for-the-job")

    def fn(rank, world_size):
        return os.environ.get("GRADSYNC_DATA"), os.environ.get("GRADSYNC_TOKEN")

    assert gst.launch(fn, world_size=2) == [("/srv/course-data", None)] * 2


def test_a_returned_ddp_model_arrives_unwrapped(capsys):
    def fn(rank, world_size):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        return DDP(torch.nn.Linear(2, 1))

    models = gst.launch(fn, world_size=2)
    import torch

    assert all(type(m) is torch.nn.Linear for m in models)
    assert torch.equal(models[0].weight, models[1].weight)
    assert "[rank 0] fn returned a DistributedDataParallel model" in capsys.readouterr().err


def test_an_entry_point_without_rank_and_world_size_gets_the_lambda():
    def main():
        return 0

    with pytest.raises(TypeError) as info:
        gst.launch(main, world_size=2)
    assert "launch `lambda rank, world_size: main()`" in str(info.value)
    assert worker_pids() == []


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_gpu_only_code_on_a_cpu_machine_gets_a_hint():
    def fn(rank, world_size):
        import torch

        return torch.ones(1).cuda(rank)

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    message = str(info.value)
    assert "put tensors and models on gst.local_device()" in message
    assert "backend 'auto'" in message


def test_premul_sum_on_gloo_gets_the_fixes_the_course_knows():
    def fn(rank, world_size):
        import torch
        import torch.distributed as dist

        # What FSDP2 sends for a gradient divide factor (torchtitan's gradient_divide_factor).
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(0.5))

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2, backend="gloo")
    message = str(info.value)
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in message
    assert "set_force_sum_reduction_for_comms(True) on every FSDPModule" in message
    assert "notebook 08" in message and "ReduceOp.SUM, then multiply" in message


def test_sys_exit_in_a_rank(capsys):
    def clean(rank, world_size):
        sys.exit()  # ends a torchrun process successfully

    assert gst.launch(clean, world_size=2) == [None, None]
    assert "[rank 1] fn called sys.exit(): counted as success" in capsys.readouterr().err

    def failing(rank, world_size):
        if rank == 1:
            sys.exit(3)
        return rank

    with pytest.raises(RankFailedError) as info:
        gst.launch(failing, world_size=2)
    assert str(info.value).startswith("rank 1 called sys.exit(3): exit code 3, which counts as "
                                      "a failure")
    assert info.value.failure.exit_code == 3


def test_methods_of_a_class_from_a_notebook_cell_point_to_the_cell(capsys):
    from ..programs import cell

    ns = cell("""
        import warnings

        class Trainer:
            def step(self, rank):
                warnings.warn(f"learning rate too high on rank {rank}")
                if rank == 1:
                    raise ValueError("loss is NaN")

        def train(rank, world_size):
            Trainer().step(rank)
    """)
    with pytest.raises(RankFailedError) as info:
        gst.launch(ns["train"], world_size=2)
    tb = info.value.traceback
    assert "<dynamic-code>" not in tb
    assert 'cell_' in tb and 'line 8, in step\n    raise ValueError("loss is NaN")' in tb
    err = capsys.readouterr().err
    assert "<dynamic-code>" not in err
    assert ".py:6: UserWarning: learning rate too high on rank 1" in err  # rank 0 may be stopped
    assert 'warnings.warn(f"learning rate too high on rank {rank}")' in err
