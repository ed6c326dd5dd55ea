"""The course's "copy this" snippets pass verify_gradients, and their classic bugs are named.

Each snippet (``snippets/NN_*.py``) is imported as a module (its ``main()`` is guarded, and its
``init_distributed()`` is never called: ``gst.launch`` has made the process group already).
Inside one launch of 2 ranks, every case below builds the snippet's model and data the
snippet's way, runs its step with the snippet's own helpers (``average_gradients``,
``FlatAverager``, ``token_mean_backward``, ``sum_gradients_over_ranks``, ``expert_parallel`` and
``sync_moe_gradients``, ``policy_loss_backward``), then calls ``verify_gradients`` with the
objective the snippet claims (one process's loss on every rank's batch). Planted bugs (a
division done twice, DDP's local mean on uneven batches, FSDP2's ÷ N kept for a token-count
loss, ÷ the expert-data-parallel size, ÷ K again) must be named.

Covered: 02, 03, 04 (the loop's global mean, and DDP's mean of means on uneven batches), 05,
07, 08 (the mean, and the token-count loss), 10 (FSDP2 x tensor parallel, dp 1 x tp 2), 12, 14.

Not covered, and why:

- 06 (``torchrun_script.py``): its step lives inside ``train(args, device)``, a whole
  training run with argument parsing and checkpoint files; its averaging is DDP's, which case
  03 checks. What it teaches (resuming from a checkpoint) is not a gradient question.
- 09 (mixed precision DDP): ``train_step`` unscales, clips, steps and zeroes the gradients in
  one call, so there is no point between the sync and ``optimizer.step()`` to check without
  rewriting it; and bf16/fp16 autocast makes the whole batch round differently from two
  halves, so a verdict would need a loose ``rtol`` that says little.
- 11 (pipeline): ``PipelineStage``/``ScheduleGPipe`` stages need ``name_map`` per stage and a
  schedule built in ``main()``; reproducing it is the heavy plumbing the check's own tests
  cover with a pipeline-like split (tests/test_verify.py).
- 13 (DiLoCo's outer step): it averages a pseudo-gradient (the weights' change over inner
  steps), not a gradient of a loss, so there is no ``loss_fn`` one process would minimise.
- 15 (``verify_first_step.py``): it calls ``verify_gradients`` itself, and tests/test_snippets.py
  runs it under torchrun.
"""

from __future__ import annotations

import pytest

import gradsync_tutorial as gst

from .conftest import REPO

SNIPPETS = REPO / "snippets"
WORLD_SIZE = 2


def _load(folder, stem):
    """``snippets/<stem>.py`` as a module (its ``main()`` is guarded, so nothing runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"snippet_{stem}", folder / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ce(module, batch):
    """One process's objective for classification snippets: the mean over every sample."""
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(module(x), y)


def _summary(report):
    return {"ok": report.ok, "diagnosis": report.worst.diagnosis, "text": str(report)}


def _case_02(s, rank, world_size, plant=False):
    """02: average_gradients (SUM, then ÷ N); planted: ÷ N a second time."""
    import copy

    import torch
    from torch import nn

    from gradsync_tutorial.verify import verify_gradients

    torch.manual_seed(0)
    model = nn.Linear(20, 3)
    x, y = torch.randn(64, 20), torch.randint(0, 3, (64,))
    shard = slice(rank, None, world_size)
    reference = copy.deepcopy(model)
    _ce(model, (x[shard], y[shard])).backward()
    s.average_gradients(model)
    if plant:
        for p in model.parameters():
            p.grad /= world_size
    return _summary(verify_gradients(model, (x[shard], y[shard]), _ce, reference=reference))


def _case_03(s, rank, world_size):
    """03: DDP with a DistributedSampler; the first step of epoch 0."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from gradsync_tutorial.verify import verify_gradients

    g = torch.Generator().manual_seed(s.SEED)
    dataset = TensorDataset(torch.randn(512, 20, generator=g), torch.arange(512) % 3)
    model = DDP(nn.Linear(20, 3))
    sampler = DistributedSampler(dataset, shuffle=True, seed=s.SEED)
    loader = DataLoader(dataset, batch_size=64 // world_size, sampler=sampler)
    sampler.set_epoch(0)
    x, y = next(iter(loader))
    _ce(model, (x, y)).backward()
    report = verify_gradients(model, (x, y), _ce, reference=model)
    del model
    return _summary(report)


def _case_04_loop(s, rank, world_size):
    """04's loop: each rank's loss sum ÷ the global count, then all_reduce with no ÷ N."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from gradsync_tutorial.verify import verify_gradients

    g = torch.Generator().manual_seed(s.SEED)
    dataset = TensorDataset(torch.randn(500, 20, generator=g), torch.arange(500) % 3)
    torch.manual_seed(s.SEED)
    model = nn.Linear(20, 3)
    reference = copy.deepcopy(model)
    sampler = DistributedSampler(dataset, shuffle=True, seed=s.SEED)
    x, y = next(iter(DataLoader(dataset, batch_size=32, sampler=sampler)))
    loss_sum = F.cross_entropy(model(x), y, reduction="sum")
    totals = torch.stack([loss_sum.detach(), torch.tensor(float(len(y)))])
    dist.all_reduce(totals)
    (loss_sum / totals[1]).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return _summary(verify_gradients(model, (x, y), _ce, reference=reference))


def _case_04_uneven(s, rank, world_size, plant=False):
    """04's end: DDP on uneven batches (8 and 5), each rank's sum × N ÷ the global count;
    planted: DDP's usual local mean, a mean of means."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import TensorDataset

    from gradsync_tutorial.verify import verify_gradients

    g = torch.Generator().manual_seed(s.SEED)
    dataset = TensorDataset(torch.randn(500, 20, generator=g), torch.arange(500) % 3)
    torch.manual_seed(s.SEED)
    ddp = DDP(nn.Linear(20, 3))
    n = 8 - 3 * (rank % 2)
    x, y = dataset[rank * 8 : rank * 8 + n]
    if plant:
        F.cross_entropy(ddp(x), y).backward()
    else:
        loss_sum = F.cross_entropy(ddp(x), y, reduction="sum")
        count = torch.tensor(float(len(y)))
        dist.all_reduce(count)
        (loss_sum * dist.get_world_size() / count).backward()
    report = verify_gradients(ddp, (x, y), _ce, reference=ddp)
    del ddp
    return _summary(report)


def _case_05(s, rank, world_size):
    """05: FlatAverager, one all_reduce for every gradient."""
    import copy

    import torch
    from torch import nn

    from gradsync_tutorial.verify import verify_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3))
    average = s.FlatAverager(model)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 20) * (rank + 1), torch.randint(0, 3, (8,))
    _ce(model, (x, y)).backward()
    average()
    return _summary(verify_gradients(model, (x, y), _ce, reference=reference))


def _case_07(s, rank, world_size):
    """07: token_mean_backward under DDP, 2 micro-batches of padded sequences a rank."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradsync_tutorial.verify import padded, verify_gradients

    def token_mean(module, batch):  # one process: the mean over every valid token
        inputs, targets = batch
        return F.cross_entropy(module(inputs).flatten(0, 1), targets.flatten(),
                               ignore_index=s.IGNORE_INDEX)

    torch.manual_seed(s.SEED)
    model = nn.Sequential(nn.Embedding(s.VOCAB, 16), nn.Linear(16, s.VOCAB))
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    micro = s.micro_batches_of(rank, torch.device("cpu"))
    s.token_mean_backward(ddp, micro)
    report = verify_gradients(ddp, None, token_mean, reference=reference, micro_batches=micro,
                              concat=padded({0: 0, 1: s.IGNORE_INDEX}))
    del ddp
    return _summary(report)


def _fsdp(model, mesh):
    """08's sharding: each Linear, then the root."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _case_08(s, rank, world_size):
    """08: FSDP2's first step on a strided shard of one global batch (reduce-scatter, ÷ N)."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from gradsync_tutorial.verify import verify_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    whole = copy.deepcopy(model)
    _fsdp(model, init_device_mesh("cpu", (world_size,)))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 20, generator=g), torch.randint(0, 3, (64,), generator=g)
    mine = slice(rank, None, world_size)
    _ce(model, (x[mine], y[mine])).backward()
    return _summary(verify_gradients(model, (x[mine], y[mine]), _ce, reference=whole))


def _case_08_tokens(s, rank, world_size, plant=False):
    """08's token-count loss on uneven ranks (8, 16 samples) with sum_gradients_over_ranks;
    planted: without it, FSDP2 still divides by N."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from gradsync_tutorial.verify import verify_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    whole = copy.deepcopy(model)
    _fsdp(model, init_device_mesh("cpu", (world_size,)))
    if not plant:
        s.sum_gradients_over_ranks(model)
    counts = [8 * (r + 1) for r in range(world_size)]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), 20, generator=g)
    y = torch.randint(0, 3, (sum(counts),), generator=g)
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    tokens = torch.tensor(float(counts[rank]))
    dist.all_reduce(tokens)
    (F.cross_entropy(model(x[mine]), y[mine], reduction="sum") / tokens).backward()
    return _summary(verify_gradients(model, (x[mine], y[mine]), _ce, reference=whole))


def _case_10(s, rank, world_size):
    """10: FSDP2 over "dp" x tensor + sequence parallel over "tp" (dp 1 x tp 2): the data
    group is "dp", whose rows every TP rank holds; each rank's loss is its error sum over the
    count of its dp rank's batch."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from gradsync_tutorial.verify import verify_gradients

    def mse(module, batch):  # one process: the mean over every element of the batch
        x, y = batch
        return ((module(x) - y) ** 2).mean()

    mesh = init_device_mesh("cpu", (world_size // s.TP, s.TP), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    torch.manual_seed(0)
    model = s.Block()
    whole = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1))})
    fully_shard(model, mesh=mesh["dp"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * mesh["dp"].size(), 4 * s.TP, 8, generator=g)
    y = torch.randn(x.shape, generator=g)
    rows, tokens = slice(2 * dp, 2 * dp + 2), slice(4 * tp, 4 * tp + 4)
    errors = (model(x[rows, tokens]) - y[rows, tokens]) ** 2
    (errors.sum() / y[rows].numel()).backward()
    report = verify_gradients(model, (x[rows], y[rows]), mse, reference=whole,
                              group=mesh["dp"].get_group())
    return _summary(report)


def _case_12(s, rank, world_size, plant=False):
    """12: expert parallelism, experts reduced over their expert-data-parallel group and ÷ the
    whole data-parallel size; planted: ÷ the EDP size (a factor EP)."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from gradsync_tutorial.verify import verify_gradients

    def mse(module, batch):
        x, y = batch
        return F.mse_loss(module(x), y)

    mesh = init_device_mesh("cpu", (world_size // s.EP, s.EP), mesh_dim_names=("edp", "ep"))
    ep_rank, edp_group = mesh.get_local_rank("ep"), mesh["edp"].get_group()
    torch.manual_seed(0)
    whole = s.MoE().to(torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world_size * s.TOKENS, s.HIDDEN, generator=g, dtype=torch.float64)
    y = torch.randn(world_size * s.TOKENS, s.HIDDEN, generator=g, dtype=torch.float64)
    mine = slice(rank * s.TOKENS, (rank + 1) * s.TOKENS)
    layer = copy.deepcopy(whole)
    expert = layer.experts[ep_rank]
    out = s.expert_parallel(layer, expert, x[mine], mesh["ep"].get_group())
    F.mse_loss(out, y[mine]).backward()
    dense = [*layer.dense.parameters(), *layer.router.parameters()]
    divide_by = dist.get_world_size(edp_group) if plant else None
    s.sync_moe_gradients(dense, list(expert.parameters()), edp_group, divide_by)
    held = nn.Module()  # what this rank holds: the dense part and its own expert
    held.dense, held.router = layer.dense, layer.router
    held.experts = nn.ModuleDict({str(ep_rank): expert})
    report = verify_gradients(held, (x[mine], y[mine]), mse, reference=whole,
                              group_sizes={"expert-parallel": s.EP})
    return _summary(report)


def _case_14(s, rank, world_size, mode, plant=False):
    """14: policy_loss_backward under DDP in ``mode``, uneven micro-batches; planted: its
    ``divide_by_k_again`` (ms-swift#10117)."""
    import copy

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradsync_tutorial.verify import verify_gradients

    def policy_loss(module, batch):  # one process: mode's weights with the whole step's counts
        inputs, targets, mask, advantages = batch
        weights = s.token_weights(mask, mode, mask.sum(), len(mask))
        return (weights * s.per_token_loss(module, inputs, targets, advantages)).sum()

    torch.manual_seed(s.SEED)
    model = nn.Sequential(nn.Embedding(s.VOCAB, 16), nn.Linear(16, s.VOCAB))
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    micro = s.micro_batches_of(rank, torch.device("cpu"),
                               sizes=(3, 1) if rank % 2 == 0 else (1, 2))
    s.policy_loss_backward(ddp, micro, mode, divide_by_k_again=plant)
    report = verify_gradients(ddp, None, policy_loss, reference=reference, micro_batches=micro)
    del ddp
    return _summary(report)


#: case name -> (snippet, the case's function, its keyword arguments)
CASES = {
    "02": ("02_average_gradients", _case_02, {}),
    "02 ÷ N twice": ("02_average_gradients", _case_02, {"plant": True}),
    "03": ("03_ddp", _case_03, {}),
    "04 loop": ("04_pitfall_fixes", _case_04_loop, {}),
    "04 uneven": ("04_pitfall_fixes", _case_04_uneven, {}),
    "04 uneven, local mean": ("04_pitfall_fixes", _case_04_uneven, {"plant": True}),
    "05": ("05_flat_averager", _case_05, {}),
    "07": ("07_global_token_mean", _case_07, {}),
    "08": ("08_fsdp2", _case_08, {}),
    "08 token count": ("08_fsdp2", _case_08_tokens, {}),
    "08 token count, ÷ N kept": ("08_fsdp2", _case_08_tokens, {"plant": True}),
    "10": ("10_fsdp_tp", _case_10, {}),
    "12": ("12_expert_gradients", _case_12, {}),
    "12 ÷ EDP": ("12_expert_gradients", _case_12, {"plant": True}),
    **{f"14 {mode}": ("14_rl_policy_loss", _case_14, {"mode": mode})
       for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")},
    "14 ÷ K again": ("14_rl_policy_loss", _case_14, {"mode": "token-mean", "plant": True}),
}

#: planted bug -> words its diagnosis must hold
PLANTED = {
    "02 ÷ N twice": "divided by the world size twice",
    "04 uneven, local mean": "weighted differently: a mean of per-rank",
    "08 token count, ÷ N kept": "divided by the world size twice",
    "12 ÷ EDP": "not divided by the expert-parallel size",
    "14 ÷ K again": "divided by the micro-batches twice",
}


def _all_cases(rank, world_size, folder, cases):
    """Run in every rank: every case in order, each with its snippet freshly imported."""
    out = {}
    for name, (stem, fn, kwargs) in cases.items():
        out[name] = fn(_load(folder, stem), rank, world_size, **kwargs)
    return out


@pytest.fixture(scope="module")
def results():
    """Every case's summary on every rank: one launch of 2 ranks."""
    return gst.launch(_all_cases, WORLD_SIZE, args=(SNIPPETS, CASES), backend="gloo",
                      timeout=120)


@pytest.mark.parametrize("name", [n for n in CASES if n not in PLANTED])
def test_snippet_step_matches_one_process(results, name):
    for rank_results in results:
        assert rank_results[name]["ok"], rank_results[name]["text"]


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_bug_is_named(results, name):
    for rank_results in results:
        found = rank_results[name]
        assert not found["ok"], found["text"]
        assert PLANTED[name] in found["diagnosis"], found["text"]


def test_every_snippet_is_covered_or_explained():
    covered = {stem[:2] for stem, _, _ in CASES.values()}
    skipped = {"06", "09", "11", "13", "15"}
    numbers = {p.name[:2] for p in SNIPPETS.glob("[0-9][0-9]_*.py")}
    assert numbers - {"01"} == covered | skipped, sorted(numbers - covered - skipped)
    for number in skipped:
        assert f"- {number} (" in __doc__, number
