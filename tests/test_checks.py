"""The replica checks catch a planted difference and pass correct code.

The collective checks run on two real ranks (gloo, CPU) through ``gst.launch``; both launches
use world_size=2, so the second one reuses the first one's worker processes.
"""

import math

import pytest
import torch
from torch import nn

import gradsync_tutorial as gst
from gradsync_tutorial.checks import compare_ranks, compare_state_dicts
from gradsync_tutorial.model import Net

# --------------------------------------------------------------------------------------------
# Inside the ranks
# --------------------------------------------------------------------------------------------


def test_equal_replicas_pass_and_a_planted_difference_is_caught():
    def run(rank, world_size):
        import torch

        from gradsync_tutorial import checks
        from gradsync_tutorial.model import Net

        torch.manual_seed(0)  # same seed on every rank: the same initial weights
        model = Net()
        out = {
            "module": checks.max_diff_across_ranks(model),
            "state_dict": checks.max_diff_across_ranks(model.state_dict()),
            "pairs": checks.max_diff_across_ranks(model.named_parameters()),
        }
        checks.assert_replicas_equal(model)  # must pass silently

        if rank == 1:  # the planted bug: one rank's update differs a little
            with torch.no_grad():
                model.fc2.weight[3, 7] += 1e-3
        out["planted"] = checks.max_diff_across_ranks(model)
        try:
            checks.assert_replicas_equal(model)
            out["message"] = None
        except AssertionError as e:
            out["message"] = str(e)
        checks.assert_replicas_equal(model, atol=1e-2)  # within tolerance: passes
        return out

    results = gst.launch(run, world_size=2, backend="gloo", timeout=120)

    for rank, out in enumerate(results):
        assert out["module"] == out["state_dict"] == out["pairs"] == 0.0
        assert out["planted"] == pytest.approx(1e-3, rel=1e-3)  # the same float on every rank
        message = out["message"]
        assert message is not None, f"rank {rank} did not raise"  # every rank raises
        assert "'fc2.weight' on rank 1" in message
        assert "0.001" in message
        assert "1 of 8 tensors differ" in message
    assert results[0]["planted"] == results[1]["planted"]


def test_buffers_odd_dtypes_and_mismatched_structure():
    def run(rank, world_size):
        import torch
        from torch import nn

        from gradsync_tutorial import checks

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        if rank == 1:
            model[1].running_mean += 0.25  # a buffer, not a parameter
        out = {
            "params_only": checks.max_diff_across_ranks(model),
            "with_buffers": checks.max_diff_across_ranks(model, buffers=True),
        }
        try:
            checks.assert_replicas_equal(model, buffers=True)
        except AssertionError as e:
            out["buffer_message"] = str(e)

        nan = float("nan")
        odd = [
            ("steps", torch.tensor([5, 6], dtype=torch.int64)),
            ("mask", torch.tensor([True, False])),
            ("nan_same", torch.tensor([1.0, nan])),  # NaN in the same place: equal
            ("empty", torch.zeros(0)),
        ]
        out["odd_equal"] = checks.max_diff_across_ranks(odd)
        odd[2] = ("nan_same", torch.tensor([1.0, nan if rank == 0 else 2.0]))
        out["nan_vs_number"] = checks.max_diff_across_ranks(odd)

        tensors = {"w": torch.zeros(3)}
        if rank == 1:
            tensors["extra"] = torch.zeros(1)
        try:
            checks.max_diff_across_ranks(tensors)
        except ValueError as e:
            out["structure_message"] = str(e)
        return out

    for out in gst.launch(run, world_size=2, backend="gloo", timeout=120):
        assert out["params_only"] == 0.0
        assert out["with_buffers"] == pytest.approx(0.25)
        assert "'1.running_mean' on rank 1" in out["buffer_message"]
        assert out["odd_equal"] == 0.0
        assert math.isinf(out["nan_vs_number"])
        assert "only on rank 1: ['extra']" in out["structure_message"]


# --------------------------------------------------------------------------------------------
# In the notebook
# --------------------------------------------------------------------------------------------


@pytest.fixture
def two_nets():
    torch.manual_seed(0)
    a = Net()
    b = Net()
    b.load_state_dict(a.state_dict())
    return a, b


def test_compare_state_dicts_equal_is_zero(two_nets, capsys):
    a, b = two_nets
    assert compare_state_dicts(a.state_dict(), b.state_dict()) == 0.0
    out = capsys.readouterr().out
    assert "differs" not in out
    assert out.splitlines()[-1] == "overall max |a - b| = 0"
    assert compare_state_dicts(a, b, show=False) == 0.0  # models work too
    assert capsys.readouterr().out == ""


def test_compare_state_dicts_catches_a_planted_difference(two_nets, capsys):
    a, b = two_nets
    with torch.no_grad():
        b.fc2.weight[0, 0] += 1e-3
    overall = compare_state_dicts(a.state_dict(), b.state_dict(), names=("single", "ddp"))
    assert overall == pytest.approx(1e-3, rel=1e-3)

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tensor", "shape", "max", "|single", "-", "ddp|"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert list(rows) == list(a.state_dict())  # one row per tensor, in order
    assert rows["fc2.weight"].endswith("0.001  <- differs")
    assert "(10, 50)" in rows["fc2.weight"]
    assert rows["fc2.bias"].endswith(" 0")
    # aligned: every row's shape column starts where the header's does
    col = lines[0].index("shape")
    assert all(line[col - 2 : col] == "  " and line[col] == "(" for line in lines[1:-1])
    assert lines[-1] == "overall max |single - ddp| = 0.001"


def test_compare_state_dicts_rejects_different_keys_and_shapes():
    a = {"w": torch.zeros(2), "b": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"only in a: \['b'\]; only in b: \['v'\]"):
        compare_state_dicts(a, {"w": torch.zeros(2), "v": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'w' has shape \(2,\) in a but \(3,\) in b"):
        compare_state_dicts(a, {"w": torch.zeros(3), "b": torch.zeros(1)})
    ddp_like = {f"module.{k}": v for k, v in a.items()}
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        compare_state_dicts(a, ddp_like)


def test_compare_ranks(two_nets, capsys):
    a, b = two_nets
    states = [a.state_dict(), b.state_dict(), {k: v.clone() for k, v in a.state_dict().items()}]
    assert compare_ranks(states) == 0.0
    assert capsys.readouterr().out.splitlines()[-1] == "overall max diff vs rank 0 = 0 (3 ranks)"

    states[2]["conv1.bias"] = states[2]["conv1.bias"] + 0.5
    assert compare_ranks(states) == pytest.approx(0.5)
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert rows["conv1.bias"].split()[-2:] == ["0.5", "2"]  # max diff, the rank that differs
    assert rows["conv1.weight"].split()[-2:] == ["0", "-"]
    assert lines[-1] == "overall max diff vs rank 0 = 0.5 (3 ranks)"

    with pytest.raises(ValueError, match=r"only in rank 0: \['fc2.bias'\]"):
        compare_ranks([states[0], {k: v for k, v in states[0].items() if k != "fc2.bias"}])
    with pytest.raises(ValueError, match="at least one"):
        compare_ranks([])


def test_compare_handles_nan_and_other_dtypes():
    a = {"x": torch.tensor([1.0, float("nan")]), "n": torch.tensor([3]), "m": torch.tensor([True])}
    assert compare_state_dicts(a, {k: v.clone() for k, v in a.items()}, show=False) == 0.0
    b = dict(a, x=torch.tensor([1.0, 2.0]))
    assert math.isinf(compare_state_dicts(a, b, show=False))
    c = dict(a, n=torch.tensor([5]))
    assert compare_state_dicts(a, c, show=False) == 2.0
    assert compare_state_dicts(nn.Linear(2, 2), nn.Linear(2, 2), show=False) > 0
