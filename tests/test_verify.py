"""verify_gradients passes right steps, names wrong ones, and refuses what it cannot check.

Two launches at world_size=2 (gloo, CPU, float64), the second reusing the first's workers: one
runs every training step (DDP, manual, accumulation, per-rank means, FSDP2, a pipeline-like
split), the other every refusal, each followed by the next case's collectives, so a rank left
waiting would hang the launch.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import gradsync_tutorial as gst
from gradsync_tutorial._verify_report import name_factor
from gradsync_tutorial.verify import CannotVerify, clean_name, padded, verify_gradients

from .conftest import REPO


def _steps(rank, world_size):
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradsync_tutorial.verify import verify_gradients

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.BatchNorm1d(4), nn.Linear(4, 1)
                             ).double().eval()

    def mean_loss(module, batch):
        x, y = batch
        return (module(x).squeeze(1) - y).pow(2).mean()

    def local(n, seed):
        g = torch.Generator().manual_seed(seed + 10 * rank)
        return (torch.randn(n, 3, generator=g, dtype=torch.float64),
                torch.randn(n, generator=g, dtype=torch.float64))

    def summary(rep):
        w = rep.worst
        return {"ok": rep.ok, "rel": w.rel_error, "factor": w.factor, "diagnosis": w.diagnosis,
                "text": str(rep), "norms": (rep.grad_norm, rep.reference_grad_norm)}

    def manual(model, batches, divide_by_n=True, divide_by_k=True):
        for b in batches:
            loss = mean_loss(model, b)
            (loss / len(batches) if divide_by_k else loss).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if divide_by_n:
                p.grad /= world_size

    out = {}
    # DDP, right; and the user's state (params, grads, buffers, RNG) untouched by the check.
    model = net()
    ref, ddp, batch = copy.deepcopy(model), DDP(model), local(4, 0)
    mean_loss(ddp, batch).backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    out["ddp"] = summary(verify_gradients(ddp, batch, mean_loss, reference=ref))
    pairs = zip(grads, model.parameters(), strict=True)
    out["untouched"] = (all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
                        and all(torch.equal(g, p.grad) for g, p in pairs)
                        and torch.equal(rng, torch.get_rng_state())
                        and all(p.grad is None for p in ref.parameters()))
    # float32: the tolerance follows the dtype; a DDP model passed as its own reference.
    torch.manual_seed(0)
    ddp32 = DDP(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)))
    batch32 = tuple(t.float() for t in batch)
    mean_loss(ddp32, batch32).backward()
    rep = verify_gradients(ddp32, batch32, mean_loss, reference=ddp32)
    out["float32"] = summary(rep) | {"rtol": rep.rtol, "dtype": rep.dtype}
    # DDP, then divided once more by N.
    for p in model.parameters():
        p.grad /= world_size
    out["twice"] = summary(verify_gradients(ddp, batch, mean_loss, reference=ref))
    # Manual all_reduce: without ÷N, and right.
    for divide in (False, True):
        model = net()
        ref = copy.deepcopy(model)
        manual(model, [batch], divide_by_n=divide)
        out[f"manual_{divide}"] = summary(verify_gradients(model, batch, mean_loss, reference=ref))
    # Accumulation over 3 micro-batches: without ÷K, and right.
    micro = [local(2, s) for s in (1, 2, 3)]
    for divide in (False, True):
        model = net()
        ref = copy.deepcopy(model)
        manual(model, micro, divide_by_k=divide)
        out[f"accumulate_{divide}"] = summary(
            verify_gradients(model, None, mean_loss, reference=ref, micro_batches=micro))
    # Two micro-batches on two ranks: factor 2 reads as either count, and says both.
    model = net()
    ref = copy.deepcopy(model)
    manual(model, micro[:2], divide_by_k=False)
    out["accumulate2_False"] = summary(
        verify_gradients(model, None, mean_loss, reference=ref, micro_batches=micro[:2]))
    # Unequal local batches (6 and 2): a per-rank mean, then the global-count fix.
    uneven = local(6 if rank == 0 else 2, 4)
    for fix in (False, True):
        model = net()
        ref, ddp = copy.deepcopy(model), DDP(model)
        x, y = uneven
        loss = (ddp(x).squeeze(1) - y).pow(2)
        loss = loss.sum() / 8 * world_size if fix else loss.mean()
        loss.backward()
        out[f"uneven_{fix}"] = summary(verify_gradients(ddp, uneven, mean_loss, reference=ref))
    # Another loss than the reference's (targets shifted): no factor, no weighting.
    model = net()
    ref = copy.deepcopy(model)
    mean_loss(model, (batch[0], batch[1] + 3)).backward()
    manual(model, [], divide_by_n=True)
    out["other_loss"] = summary(verify_gradients(model, batch, mean_loss, reference=ref))
    # No sync at all: the ranks disagree.
    model = net()
    ref = copy.deepcopy(model)
    mean_loss(model, batch).backward()
    out["no_sync"] = summary(verify_gradients(model, batch, mean_loss, reference=ref))
    # FSDP2 on a CPU mesh: right, then divide factor 1.0 on every FSDPModule.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for factor in (None, 1.0):
        model = net()
        ref = copy.deepcopy(model)
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        if factor is not None:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(factor)
        mean_loss(model, batch).backward()
        out[f"fsdp_{factor}"] = summary(verify_gradients(model, batch, mean_loss, reference=ref))
    # A pipeline-like split: each rank holds one Linear under its own names (name_map).
    model = net()
    ref = copy.deepcopy(model)
    manual(model, [batch])
    stage = copy.deepcopy(model[3 * rank])
    for p, q in zip(stage.parameters(), model[3 * rank].parameters(), strict=True):
        p.grad = q.grad.clone()
    names = {"weight": f"{3 * rank}.weight", "bias": f"{3 * rank}.bias"}
    extra = {"2.weight", "2.bias"}  # the BatchNorm: held (by name) by rank 0 too
    if rank == 0:
        stage = nn.ModuleDict({"lin": stage, "bn": copy.deepcopy(model[2])})
        for p, q in zip(stage["bn"].parameters(), model[2].parameters(), strict=True):
            p.grad = q.grad.clone()
        names = {f"lin.{k}": v for k, v in names.items()} | {f"bn.{n[2:]}": n for n in extra}
    out["pipeline"] = summary(verify_gradients(stage, batch, mean_loss, reference=ref,
                                               name_map=names))
    return out


def _refusals(rank, world_size):
    import copy

    import torch
    from torch import nn

    from gradsync_tutorial.verify import CannotVerify, verify_gradients

    def mean_loss(module, batch):
        return module(batch).pow(2).mean()

    torch.manual_seed(0)
    batch = torch.randn(4, 3, dtype=torch.float64)

    def attempt(model, reference=None, batch=batch, loss_fn=mean_loss, backward=True):
        reference = copy.deepcopy(model) if reference is None else reference
        if backward:
            loss_fn(model, batch if torch.is_tensor(batch) else torch.ones(2, 3).double()
                    ).backward()
        try:
            verify_gradients(model, batch, loss_fn, reference=reference)
        except CannotVerify as e:
            return str(e)
        return None

    linear = nn.Linear(3, 1).double()
    out = {
        "dropout": attempt(nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.5)).double()),
        "batchnorm": attempt(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).double()),
        "no_grad": attempt(nn.Linear(3, 1).double(), backward=False),
        "not_tensors": attempt(linear, batch=[1, 2, 3]),
        "structure": attempt(linear, batch=batch if rank == 0 else (batch,)),
        "architecture": attempt(linear, reference=nn.Linear(3, 2).double()),
        "reference_dropout": attempt(nn.Linear(3, 1).double(),
                                     reference=nn.Sequential(nn.Linear(3, 1), nn.Dropout(0.1))),
    }

    def fails_on_one(module, b):
        if rank == 1:
            raise RuntimeError("this loss fails on rank 1")
        return module(b).pow(2).mean()

    model = nn.Linear(3, 1).double()
    reference = copy.deepcopy(model)
    mean_loss(model, batch).backward()
    try:
        verify_gradients(model, batch, fails_on_one, reference=reference)
    except CannotVerify as e:
        out["loss_fn"] = str(e)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Linear(3, 1).double()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    out["fsdp_reference"] = attempt(model, reference=model)
    return out


@pytest.fixture(scope="module")
def steps():
    return gst.launch(_steps, world_size=2, backend="gloo", timeout=180)


def test_every_rank_returns_the_same_report(steps):
    assert steps[0] == steps[1]


def test_right_steps_pass_to_float64_rounding(steps):
    for case in ("ddp", "manual_True", "accumulate_True", "uneven_True", "fsdp_None",
                 "pipeline"):
        out = steps[0][case]
        assert out["ok"], (case, out["text"])
        assert out["rel"] < 1e-12, case
        assert out["text"].splitlines()[-1].startswith("OK: all")


def test_float32_is_judged_to_its_own_rounding(steps):
    out = steps[0]["float32"]
    assert out["ok"] and out["rtol"] == 1e-5 and out["dtype"] == "float32", out["text"]
    assert 0 < out["rel"] < 1e-5
    assert "float32 rounding allows about 1e-05" in out["text"]


def test_the_check_leaves_the_users_state_as_it_was(steps):
    assert steps[0]["untouched"] and steps[1]["untouched"]


@pytest.mark.parametrize("case, factor, words", [
    ("manual_False", 2.0, "summed, not divided by the world size (notebook 02)"),
    ("twice", 0.5, "divided by the world size twice"),
    ("accumulate_False", 3.0, "not divided by the micro-batches (notebooks 07, 11)"),
    ("fsdp_1.0", 2.0, "summed, not divided by the world size"),
])
def test_a_wrong_factor_is_named(steps, case, factor, words):
    out = steps[0][case]
    assert not out["ok"]
    assert out["factor"] == pytest.approx(factor, rel=1e-9)
    assert words in out["diagnosis"]
    assert out["norms"][0] == pytest.approx(factor * out["norms"][1], rel=1e-9)
    assert out["text"].splitlines()[-1].startswith("WRONG: ")


def test_with_as_many_micro_batches_as_ranks_both_readings_are_given(steps):
    out = steps[0]["accumulate2_False"]
    assert not out["ok"] and out["factor"] == pytest.approx(2.0, rel=1e-9)
    assert out["diagnosis"] == (
        "factor 2 = the world size = the micro-batch count: summed, not divided by the world "
        "size (notebook 02), or not divided by the micro-batches (notebooks 07, 11)")


def test_a_mean_of_per_rank_means_is_a_weighting_not_a_factor(steps):
    out = steps[0]["uneven_False"]
    assert not out["ok"]
    assert "weighted differently" in out["diagnosis"] and "notebook 07" in out["diagnosis"]
    # 6 samples on rank 0, 2 on rank 1: one process weighs their means 6/8 and 2/8
    assert out["diagnosis"].endswith(
        "you weigh the ranks' batches 0.5, 0.5, one process 0.75, 0.25 (their counts' shares)")


def test_another_loss_is_neither_a_factor_nor_a_weighting(steps):
    out = steps[0]["other_loss"]
    assert not out["ok"]
    assert out["diagnosis"].startswith("a different gradient, not a factor nor a weighting")


def test_ranks_that_disagree_are_a_missing_sync(steps):
    out = steps[0]["no_sync"]
    assert not out["ok"]
    assert "the ranks hold different gradients" in out["diagnosis"]
    assert "missing or partial sync" in out["diagnosis"]


def _three_ranks(rank, world_size):
    import copy

    import torch
    import torch.distributed as dist

    from gradsync_tutorial.verify import verify_gradients

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, dtype=torch.float64) + rank

    def loss_fn(module, batch):
        return module(batch).pow(2).mean()

    loss_fn(model, x).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # summed over 3 ranks, never divided
    rep = verify_gradients(model, None, loss_fn, reference=reference,
                           micro_batches=[x[:1], x[1:]])
    return rep.ok, rep.worst.factor, rep.worst.diagnosis


def test_three_ranks_and_two_micro_batches_tell_the_factors_apart():
    for ok, factor, diagnosis in gst.launch(_three_ranks, world_size=3, backend="gloo",
                                            timeout=180):
        assert not ok and factor == pytest.approx(3.0, rel=1e-12)
        assert diagnosis.startswith("factor 3 = the world size: summed"), diagnosis


@pytest.fixture(scope="module")
def refusals():
    return gst.launch(_refusals, world_size=2, backend="gloo", timeout=180)


@pytest.mark.parametrize("case, words", [
    ("dropout", "call model.eval() and reference.eval() for the checked step, or set p=0"),
    ("batchnorm", "SyncBatchNorm"),
    ("no_grad", "call verify_gradients after backward()"),
    ("not_tensors", "local_batch[0] is of type int, not a tensor"),
    ("structure", "rank 1 passed batches of another structure"),
    ("architecture", "the reference is not the model's architecture"),
    ("reference_dropout", "the reference has an active dropout layer '1' (p=0.1)"),
    ("loss_fn", "raised on rank 1: RuntimeError: this loss fails on rank 1"),
    ("fsdp_reference", "take copy.deepcopy(model) before fully_shard"),
])
def test_refusals_are_raised_on_every_rank_with_what_to_do(refusals, case, words):
    for rank in (0, 1):
        message = refusals[rank][case]
        assert message is not None, f"rank {rank} did not refuse {case}"
        assert words.lower() in message.lower(), message
    assert refusals[0][case] == refusals[1][case]


# --------------------------------------------------------------------------------------------
# In one process
# --------------------------------------------------------------------------------------------


def test_one_process_without_a_process_group():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    ref = torch.nn.Linear(3, 1).double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(5, 3, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    rep = verify_gradients(model, x, lambda m, b: m(b).pow(2).mean(), reference=ref)
    assert rep.ok and rep.world_size == 1 and rep.rtol == 1e-10 and rep.dtype == "float64"
    with pytest.raises(CannotVerify, match="not both"):
        verify_gradients(model, x, None, reference=ref, micro_batches=[x])


def test_names_factors_and_padding():
    assert clean_name("module._fsdp_wrapped_module.0.weight") == "0.weight"
    assert clean_name("net.module.weight") == "net.module.weight"
    both = name_factor(2.0, world_size=2, micro=2, sizes={}, tol=1e-6)
    assert "world size" in both and "micro-batches" in both
    assert name_factor(0.25, world_size=2, micro=1, sizes={}, tol=1e-6).startswith(
        "factor 0.25 = 1/world size²")
    assert name_factor(1.7, world_size=2, micro=1, sizes={}, tol=1e-6) == (
        "off by a constant factor 1.7")
    chunks = [{"ids": torch.ones(1, n), "labels": torch.ones(1, n)} for n in (2, 1)]
    batch = padded({"ids": 0, "labels": -100})(chunks)
    assert batch["labels"].tolist() == [[1, 1], [1, -100]] and batch["ids"][1, 1] == 0
    assert math.isfinite(float(batch["ids"].sum()))


def _one_process_case(perturb=None, loss_fn=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    x = torch.randn(6, 3)
    default_loss = lambda m, b: m(b).pow(2).mean()
    default_loss(model, x).backward()
    if perturb:
        perturb(model)
    return verify_gradients(model, x, loss_fn or default_loss, reference=model)


def test_rounding_noise_a_missing_gradient_and_a_bad_loss_are_told_apart():
    def noise(model):
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad += 1e-4 * p.grad.abs().max() * torch.randn(p.grad.shape, generator=g)

    close = _one_process_case(noise)
    assert not close.ok and close.dtype == "float32" and "close, but beyond" in str(close)

    def drop(model):
        model[0].bias.grad = None

    missing = _one_process_case(drop)
    rows = {r.name: r for r in missing.rows}
    assert not rows["0.bias"].ok and "no gradient on your side" in rows["0.bias"].diagnosis
    assert all(r.ok for name, r in rows.items() if name != "0.bias")

    with pytest.raises(CannotVerify, match=r"one number .* got a tensor of shape \(6, 1\)"):
        _one_process_case(loss_fn=lambda m, b: m(b))


def test_a_torchrun_script_that_imports_verify_gradients_loads_torch_and_nothing_else():
    code = ("import sys\nfrom gradsync_tutorial.verify import verify_gradients\n"
            "print(sorted(m for m in sys.modules if m.startswith('gradsync_tutorial')))\n"
            "print(any(m.split('.')[0] in ('matplotlib', 'cloudpickle') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.splitlines()
    assert out == ["['gradsync_tutorial', 'gradsync_tutorial._verify_report', "
                   "'gradsync_tutorial._wording', "
                   "'gradsync_tutorial.diagnoses', 'gradsync_tutorial.verify']", "False"]
