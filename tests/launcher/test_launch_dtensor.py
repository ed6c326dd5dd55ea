"""What FSDP2 code returns reaches the notebook (notebook 08): DTensors as each rank's shard,
a ``full_tensor()`` state dict as whole tensors, and an FSDP2 model refused with what to
return instead.

A DTensor names its device mesh and the ranks' process group, which the notebook does not
have: unpickled there, it would be a tensor whose every collective fails. So the worker sends
each rank's own shard (``DTensor.to_local()``), a plain tensor, and says so on stderr.
Real launches, 2 gloo ranks on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import RankFailedError

pytestmark = pytest.mark.usefixtures("no_workers_left")


def _sharded_model(world_size):
    """A small MLP with fully_shard on a CPU device mesh: 7 rows shard unevenly on 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model


def test_dtensors_arrive_as_each_ranks_shard_and_a_full_state_dict_whole(capsys):
    def fn(rank, world_size):
        model = _sharded_model(world_size)
        model(torch.randn(4, 5)).sum().backward()
        state = model.state_dict()  # DTensors
        return {"state": state, "grad": model[0].weight.grad,
                "full": {k: v.full_tensor() for k, v in state.items()}}

    results = gst.launch(fn, world_size=2)
    err = capsys.readouterr().err
    for name, full in results[0]["full"].items():
        assert type(full) is torch.Tensor
        shards = [r["state"][name] for r in results]
        assert all(type(s) is torch.Tensor for s in shards)  # plain tensors, not DTensors
        assert torch.equal(torch.cat(shards), full)  # Shard(0): the rows, rank after rank
    assert [tuple(r["state"]["0.weight"].shape) for r in results] == [(4, 5), (3, 5)]
    assert [tuple(r["grad"].shape) for r in results] == [(4, 5), (3, 5)]
    assert torch.equal(results[0]["full"]["0.weight"], results[1]["full"]["0.weight"])
    # said once, for every rank, by the launcher
    assert ("gst.launch (every rank): fn returned 5 DTensor(s), e.g. a DTensor of shape "
            "(7, 5) placed (Shard(dim=0),). The notebook receives each rank's local tensor of "
            "each, a plain tensor (DTensor.to_local()): a shard (Shard).") in err
    assert err.count("DTensor(s)") == 1
    assert "full_tensor()" in err
    assert "pickling/unpickling of the DeviceMesh" not in err  # no mesh crossed over


def test_a_full_state_dict_alone_needs_no_note(capsys):
    def fn(rank, world_size):
        model = _sharded_model(world_size)
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    states = gst.launch(fn, world_size=2)
    assert states[0].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert "DTensor" not in capsys.readouterr().err


def test_an_fsdp2_model_is_refused_with_what_to_return():
    def fn(rank, world_size):
        return _sharded_model(world_size)

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    message = str(info.value)
    assert "could not be serialized back to the notebook" in message
    assert "return model.state_dict()" in message


def test_a_dtensor_returned_by_one_rank_only_is_told_naming_that_rank(capsys):
    def fn(rank, world_size):
        model = _sharded_model(world_size)
        return model.state_dict() if rank == 1 else None

    results = gst.launch(fn, world_size=2)
    assert results[0] is None and type(results[1]["0.weight"]) is torch.Tensor
    err = capsys.readouterr().err
    assert err.count("DTensor(s)") == 1
    assert "gst.launch (rank 1): fn returned 4 DTensor(s)" in err


def test_a_partial_dtensor_is_told_as_a_sum_not_yet_taken_not_a_shard(capsys):
    def fn(rank, world_size):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial

        mesh = init_device_mesh("cpu", (world_size,))
        return DTensor.from_local(torch.full((2,), float(rank + 1)), mesh, [Partial()])

    local = gst.launch(fn, world_size=2)
    assert [t.tolist() for t in local] == [[1.0, 1.0], [2.0, 2.0]]  # each rank's term
    err = capsys.readouterr().err
    assert "one rank's term of a sum not yet taken (Partial" in err
    assert "a shard (Shard)" not in err
