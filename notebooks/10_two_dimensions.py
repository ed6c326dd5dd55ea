# %% [markdown]
# # 10 — Two dimensions: HSDP, tensor and sequence parallel
#
# **Question: on a 2-D mesh of ranks, which mesh dimension reduces which gradient, with which
# operation, and who divides by what?**
#
# Notebooks 02 to 09 average over one group of ranks. Large models put the ranks on a grid:
# HSDP (replicate × shard), FSDP × tensor parallel, sequence parallel. Mistakes there are
# silent: LayerNorm gradients left unsummed (Megatron-LM#443, #1446), norms that count a
# parameter twice (NeMo-RL#3788), divide factors that miss the replicas (pytorch#155903).
#
# **Short answer: divide once, by the data shards, the data-parallel × context-parallel ranks;
# sum over the tensor-parallel ranks.** Each rank's loss is its sum of errors over the count of
# its data-parallel rank's batch, every sequence shard included. FSDP2 divides by the data-parallel ranks: R·S on an HSDP mesh, the total that
# `set_gradient_divide_factor` sets. A parameter replicated over tensor-parallel ranks gets
# their partial gradients **summed**, never averaged. On a 2 × 2 mesh, a factor equal to the
# shard size gives ×2. Each claim is measured below, in float64, against one process.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: the same checks, fewer steps
WORLD_SIZE = 2  # ranks of the tensor-parallel cells; the notebook also runs with 4
MESH_SHAPE = (2, 2)  # the 2-D cells: 4 ranks, whatever WORLD_SIZE is
MESH_RANKS = MESH_SHAPE[0] * MESH_SHAPE[1]

SEED = 0
STEPS = 2 if SMOKE_TEST else 3  # SGD steps of each comparison
LR = 0.5

import copy
import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import gradsync_tutorial as gst

torch.set_default_dtype(torch.float64)  # exactness is claimed: float64 here and in every rank


def float64_and_quiet():
    """In a rank: float64, and two harmless warnings of these toy models silenced (an FSDP2
    module that returns a view; DTensor's advice to flatten mesh dimensions)."""
    torch.set_default_dtype(torch.float64)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def full(t):
    """The whole tensor of a DTensor (every rank must call it), a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a, b):
    """The largest |difference| between two lists (or dicts) of tensors."""
    if isinstance(a, dict):
        a, b = list(a.values()), [b[k] for k in a]
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def one_process(model, loss_of, steps=STEPS, lr=LR):
    """Parameters and the first gradients of `steps` SGD steps of one process."""
    model = copy.deepcopy(model)
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        sgd.zero_grad()
        loss_of(model).backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        sgd.step()
    return {"params": {n: p.detach() for n, p in model.named_parameters()}, "grads": grads}


def ratio(grads, reference):
    """|g| / |g_ref| over every gradient: 1.0 when right, the factor when scaled."""
    norm = lambda gs: torch.sqrt(sum((g**2).sum() for g in gs.values()))
    return (norm(grads) / norm(reference)).item()


# %% [markdown]
# ## Meshes and placements
#
# A **device mesh** arranges the ranks on a grid with named dimensions. `init_device_mesh(
# device.type, (2, 2), mesh_dim_names=("replicate", "shard"))` puts ranks 0 to 3 on a 2 × 2
# grid. With `device = gst.local_device()`, as in notebook 08, the type is "cpu" with gloo and
# "cuda" with nccl. Each row and each column is a process group of its own. A **DTensor**
# stores, for each mesh dimension, a **placement**: **Shard(d)** (each rank holds a slice along
# dimension d), **Replicate()** (each rank holds the whole tensor) or **Partial()** (each rank
# holds a term; the tensor is their pending sum). Redistributing a Partial to Replicate runs the
# all-reduce.

# %%
def placements(rank, world_size):
    device = gst.local_device()  # a GPU if there is one per rank, else the CPU
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    mine = torch.tensor([1.0, 10.0], device=device) * (rank + 1)
    pending_sum = DTensor.from_local(mine, mesh, [Partial()], run_check=False)
    pending_avg = DTensor.from_local(mine, mesh, [Partial("avg")], run_check=False)
    return {"Partial() -> Replicate()": pending_sum.redistribute(mesh, [Replicate()]).to_local(),
            "Partial('avg') -> Replicate()": pending_avg.redistribute(mesh, [Replicate()]).to_local(),
            "Partial() -> Shard(0)": pending_sum.redistribute(mesh, [Shard(0)]).to_local()}

redistributed = gst.launch(placements, world_size=WORLD_SIZE)

# %%
terms = torch.stack([torch.tensor([1.0, 10.0]) * (r + 1) for r in range(WORLD_SIZE)])
for name, value in redistributed[0].items():
    print(f"rank 0, {name:<30} {value.tolist()}")
assert all(torch.equal(r["Partial() -> Replicate()"], terms.sum(0)) for r in redistributed)
assert torch.equal(redistributed[0]["Partial('avg') -> Replicate()"], terms.mean(0))
assert torch.equal(torch.cat([r["Partial() -> Shard(0)"] for r in redistributed]), terms.sum(0))

# %% [markdown]
# `Partial()` means a sum: the placement of a gradient that every rank holds a share of.
# `Partial("avg")` exists too, and it is a different number: the mean (the last assert). A
# gradient of which each rank holds a share needs the sum, so this course never uses it.
#
# ## Tensor parallel: column and row shards
#
# **Tensor parallel** (TP) splits one layer's weight across ranks. `ColwiseParallel` gives each
# rank some output features, `RowwiseParallel` some input features, and the row layer's outputs
# are summed. Every rank sees the same batch. WORLD_SIZE ranks form the TP group here.

# %%
torch.manual_seed(SEED)
tp_mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
XT, YT = torch.randn(6, 4), torch.randn(6, 4)
tp_reference = one_process(tp_mlp, lambda m: F.mse_loss(m(XT), YT), lr=0.1)


def tensor_parallel(rank, world_size):
    float64_and_quiet()
    device = gst.local_device()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    model = parallelize_module(copy.deepcopy(tp_mlp).to(device), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x, y = XT.to(device), YT.to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        sgd.zero_grad()
        F.mse_loss(model(x), y).backward()  # the same batch on every TP rank
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
            kinds = {n: str(p.grad.placements) for n, p in model.named_parameters()}
            local = {n: p.grad.to_local() for n, p in model.named_parameters()}
        sgd.step()
    return {"grads": grads, "kinds": kinds, "local": local,
            "params": {n: full(p) for n, p in model.named_parameters()}}

tp_results = gst.launch(tensor_parallel, world_size=WORLD_SIZE)

# %%
tp0 = tp_results[0]
for name, kind in tp0["kinds"].items():
    print(f"{name:<10} grad placements {kind}")
print(f"TP on {WORLD_SIZE} ranks, {STEPS} steps: params vs 1 process "
      f"{max_diff(tp0['params'], tp_reference['params']):.2g}")
assert max_diff(tp0["params"], tp_reference["params"]) < 1e-14
assert tp0["kinds"] == {"0.weight": "(Shard(dim=0),)", "0.bias": "(Shard(dim=0),)",
                        "2.weight": "(Shard(dim=1),)", "2.bias": "(Replicate(),)"}

# %% [markdown]
# No gradient of a TP-sharded weight is reduced: each rank owns its slice's whole gradient.
# `2.bias` is replicated, and every rank computed the same whole gradient for it.
#
# ### A hand-written gradient norm counts replicated parameters tp times
#
# Clipping needs the norm of the whole gradient. Summing every local square, then one
# all-reduce, counts `2.bias` once per rank. Count replicated parameters once;
# `clip_grad_norm_` on DTensors does it for you.

# %%
true_norm = torch.sqrt(sum((g**2).sum() for g in tp_reference["grads"].values())).item()
squares = [{n: (g**2).sum() for n, g in r["local"].items()} for r in tp_results]
naive = sum(sum(s.values()) for s in squares).sqrt().item()  # = all_reduce of local squares
once = (sum(s[n] for s in squares for n in s if "Shard" in tp0["kinds"][n])
        + sum(squares[0][n] for n in squares[0] if "Replicate" in tp0["kinds"][n])).sqrt().item()
print(f"gradient norm: one process {true_norm:.5f}; all-reduce of every local square "
      f"{naive:.5f}; replicated parameters counted once {once:.5f}")
bias_squares = squares[0]["2.bias"].item()
assert abs(naive**2 - true_norm**2 - (WORLD_SIZE - 1) * bias_squares) < 1e-12
assert abs(once - true_norm) < 1e-12

# %% [markdown]
# ## Sequence parallel: the LayerNorm weight's gradient is a pending sum
#
# **Sequence parallel** (SP) splits the sequence between the TP ranks in the layers TP does not
# split, such as LayerNorm. Each rank normalizes its own tokens. The LayerNorm weight is
# replicated, but its gradient on each rank covers only that rank's tokens. The whole gradient
# is the **sum** over the TP ranks. The block: LayerNorm, a column layer, tanh, a row layer.
# Each rank's loss is its sum of squared errors over the global count.

# %%
class Block(nn.Module):
    def __init__(self, hidden=4, inner=8):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.w1, self.act, self.w2 = nn.Linear(hidden, inner), nn.Tanh(), nn.Linear(inner, hidden)

    def forward(self, x):
        return self.w2(self.act(self.w1(self.norm(x))))


torch.manual_seed(1)
block = Block()
with torch.no_grad():  # a LayerNorm whose weight and bias are not 1 and 0
    block.norm.weight.add_(0.1 * torch.randn(4))
    block.norm.bias.add_(0.1 * torch.randn(4))
XS, YS = torch.randn(2, 8, 4), torch.randn(2, 8, 4)  # (batch, sequence, hidden)
sp_reference = one_process(block, lambda m: ((m(XS) - YS) ** 2).sum() / YS.numel())
SP_PLAN = {"w1": ColwiseParallel(input_layouts=Shard(1)),
           "w2": RowwiseParallel(output_layouts=Shard(1))}


def sequence_parallel(rank, world_size, dtensor_norm=True, sync_norm=None):
    """SP block on the TP group: the first gradients (whole and local), norm, params after."""
    float64_and_quiet()
    device = gst.local_device()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    plan = dict(SP_PLAN, norm=SequenceParallel()) if dtensor_norm else SP_PLAN
    model = parallelize_module(copy.deepcopy(block).to(device), mesh, plan)
    x, y = XS.chunk(world_size, dim=1)[rank], YS.chunk(world_size, dim=1)[rank]  # my tokens
    x, y = x.to(device), y.to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        sgd.zero_grad()
        (((model(x) - y) ** 2).sum() / YS.numel()).backward()  # my sum / the global count
        if sync_norm is not None:  # Megatron style: all-reduce the norm's grads over TP
            for p in model.norm.parameters():
                dist.all_reduce(p.grad, op=sync_norm)
        if step == 0:
            out = {"grads": {n: full(p.grad).clone() for n, p in model.named_parameters()},
                   "norm grad": str(getattr(model.norm.weight.grad, "placements", "a tensor")),
                   "grad kinds": {n: str(getattr(p.grad, "placements", "a tensor"))
                                  for n, p in model.named_parameters()},
                   "to_local": model.norm.weight.grad.to_local()
                   if dtensor_norm else model.norm.weight.grad.clone(),
                   "clip": full(nn.utils.clip_grad_norm_(model.parameters(), 1e9)).item()
                   if dtensor_norm else None}
        sgd.step()
    out["params"] = {n: full(p) for n, p in model.named_parameters()}
    return out

sp_dtensor = gst.launch(sequence_parallel, world_size=WORLD_SIZE)

# %%
sp0 = sp_dtensor[0]
ref_norm = torch.sqrt(sum((g**2).sum() for g in sp_reference["grads"].values())).item()
share = (sp0["to_local"] - sp_reference["grads"]["norm.weight"]).abs().max().item()
print(f"norm.weight.grad placements {sp0['norm grad']}; grads vs 1 process "
      f"{max_diff(sp0['grads'], sp_reference['grads']):.2g}")
print(f"clip_grad_norm_ {sp0['clip']:.12f} vs 1 process {ref_norm:.12f}; params after "
      f"{STEPS} steps vs 1 process {max_diff(sp0['params'], sp_reference['params']):.2g}")
print(f"norm.weight.grad.to_local() on rank 0 is {share:.3f} off: one rank's share")
assert sp0["norm grad"] == "(Partial(sum),)"
assert max_diff(sp0["grads"], sp_reference["grads"]) < 1e-15
assert abs(sp0["clip"] - ref_norm) < 1e-13
assert max_diff(sp0["params"], sp_reference["params"]) < 1e-14
local_sum = sum(r["to_local"] for r in sp_dtensor)  # the shares add up to the gradient
assert (local_sum - sp_reference["grads"]["norm.weight"]).abs().max() < 1e-15 and share > 1e-3

# %% [markdown]
# DTensor keeps the sum pending: the optimizer and `clip_grad_norm_` see the whole gradient.
# Only `to_local()` shows one rank's share. Read a DTensor gradient with `full_tensor()`.
#
# ### Megatron style: a plain LayerNorm on the sequence shard
#
# Code written by hand (Megatron-LM, TransformerEngine) runs a plain `nn.LayerNorm` on the
# local tokens. Its gradient is then an ordinary tensor holding one rank's share. Megatron-LM
# all-reduces it over the TP group in `_allreduce_layernorm_grads`
# (`megatron/core/distributed/finalize_model_grads.py`). Without that step, the gradient is
# wrong and the TP ranks' copies drift apart. With an average instead of a sum, it is 1/tp.

# %%
def megatron_style(rank, world_size):
    return {op: sequence_parallel(rank, world_size, dtensor_norm=False, sync_norm=sync)
            for op, sync in {"none": None, "SUM": dist.ReduceOp.SUM,
                             "AVG": dist.ReduceOp.AVG}.items()}

megatron_ranks = gst.launch(megatron_style, world_size=WORLD_SIZE)
megatron = {op: [r[op] for r in megatron_ranks] for op in megatron_ranks[0]}

# %%
ln = ["norm.weight", "norm.bias"]
print(f"{'LayerNorm grads':<18}{'grad vs 1 process':>18}{'ratio':>8}"
      f"{'params vs 1 process':>21}{'TP copies apart':>17}")
for op, ranks in megatron.items():
    norm_grads = {n: ranks[0]["grads"][n] for n in ln}
    ref = {n: sp_reference["grads"][n] for n in ln}
    apart = max(max_diff({n: r["params"][n] for n in ln}, ranks[0]["params"]) for r in ranks)
    print(f"{'all-reduce ' + op:<18}{max_diff(norm_grads, ref):>18.2g}"
          f"{ratio(norm_grads, ref):>8.3f}{max_diff(ranks[0]['params'], sp_reference['params']):>21.2g}"
          f"{apart:>17.2g}")
unsynced, summed, averaged = (megatron[op] for op in ("none", "SUM", "AVG"))
assert max_diff(summed[0]["params"], sp_reference["params"]) < 1e-14
assert max_diff({n: unsynced[0]["grads"][n] for n in ln},
                {n: sp_reference["grads"][n] for n in ln}) > 1e-3
assert max_diff({n: unsynced[1]["params"][n] for n in ln}, unsynced[0]["params"]) > 1e-3
assert abs(ratio({n: averaged[0]["grads"][n] for n in ln},
                 {n: sp_reference["grads"][n] for n in ln}) - 1 / WORLD_SIZE) < 1e-12

# %% [markdown]
# ## HSDP: replicate × shard
#
# **HSDP** (hybrid sharded data parallel) shards each parameter over one mesh dimension and
# replicates it over the other. `fully_shard(model, mesh=mesh)` with a 2-D mesh does it. The
# gradient is reduce-scattered over "shard", then all-reduced over "replicate". Every one of the
# 4 ranks holds different data. So the mean needs one division by 4 in total. The reference is
# one process on all 16 samples.

# %%
torch.manual_seed(SEED)
mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
X, Y = torch.randn(16, 4), torch.randn(16, 2)


hsdp_reference = one_process(mlp, lambda m: F.mse_loss(m(X), Y))


# %%
def hsdp(rank, world_size, factor=None, micro_batches=1, sync="every micro-batch",
         dtype=torch.float64, loss_scale=1.0):
    """HSDP on MESH_SHAPE: the first gradients and the parameters after STEPS steps."""
    float64_and_quiet()
    # gst.local_device(), but the CPU in a launch with backend="gloo" (the float32 cells below)
    device = gst.local_device() if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(device.type, MESH_SHAPE, mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(mlp).to(device, dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if factor is not None:  # the total divisor, set on every fully_shard-ed module
        for module in (model[0], model[2], model):
            module.set_gradient_divide_factor(factor)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = X.chunk(world_size)[rank].to(device, dtype), Y.chunk(world_size)[rank].to(device, dtype)
    for step in range(STEPS):
        sgd.zero_grad()
        for k, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
            last = k == micro_batches - 1
            if sync == "set_requires_gradient_sync":  # no reduction until the last
                model.set_requires_gradient_sync(last)
            elif sync == "set_requires_all_reduce":  # reduce-scatter each, all-reduce the last
                model.set_requires_all_reduce(last)
            with gst.detect.count_collectives() as counted:
                (loss_scale * F.mse_loss(model(xm), ym) / micro_batches).backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            backward = dict(counted.calls)  # the last micro-batch's backward
        sgd.step()
    p = model[0].weight
    return {"grads": grads, "params": {n: full(p) for n, p in model.named_parameters()},
            "placements": str(p.placements), "backward": backward}


# %%
hsdp_runs = {
    "default factor": {},
    "2 micro-batches, set_requires_gradient_sync": {"micro_batches": 2,
                                                    "sync": "set_requires_gradient_sync"},
    "2 micro-batches, set_requires_all_reduce": {"micro_batches": 2,
                                                 "sync": "set_requires_all_reduce"},
    "factor = R·S = 4": {"factor": 4.0},
    "factor = shard size = 2": {"factor": 2.0},
    "factor = 1 (the sum)": {"factor": 1.0},
}
hsdp_results = gst.launch(lambda r, w: {name: hsdp(r, w, **kw) for name, kw in hsdp_runs.items()},
                          MESH_RANKS)[0]


# %%
default = hsdp_results["default factor"]
print(f"HSDP on a {MESH_SHAPE} mesh, placements {default['placements']}; one backward: "
      f"{default['backward']}")
print(f"{'run':<46}{'params vs 1 process':>20}{'grad ratio':>12}")
for name, res in hsdp_results.items():
    gap = max_diff(res["params"], hsdp_reference["params"])
    print(f"{name:<46}{gap:>20.2g}{ratio(res['grads'], hsdp_reference['grads']):>12.4f}")
for name in list(hsdp_runs)[:4]:  # the default, both accumulations, R·S
    assert max_diff(hsdp_results[name]["params"], hsdp_reference["params"]) < 1e-14, name
wrong = hsdp_results["factor = shard size = 2"]
assert abs(ratio(wrong["grads"], hsdp_reference["grads"]) - MESH_SHAPE[0]) < 1e-12  # × R
reduce_scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") \
    else "reduce_scatter_tensor"  # its name in this torch (2.13 renamed it)
assert default["backward"][reduce_scatter] == default["backward"]["all_reduce"] == 2  # 2 layers
summed = hsdp_results["factor = 1 (the sum)"]
assert abs(ratio(summed["grads"], hsdp_reference["grads"]) - MESH_RANKS) < 1e-12  # × R·S

# %% [markdown]
# The default divides by R·S = 4, whichever of the three accumulation spellings you use.
# `set_gradient_divide_factor` replaces that total, not the division of one dimension: the
# shard size 2 leaves the gradient twice too large, × the number of replicas.
# Each layer's backward made one reduce-scatter and one all-reduce.
#
# ### The grad norm is the only witness
#
# A constant factor on every gradient barely moves AdamW: its step divides the gradient by its
# own running size. torchtitan#2323 (2026) fixed gradients divided twice by the data-parallel
# ranks: "This error does not emerge in change in loss for short runs due to the scale
# invariance property of the AdamW optimizer but can be seen clearly in the grad norm". Its issue,
# torchtitan#2318, saw "a scaling difference of a factor of 8". Here are the shard-size factor's
# gradients (× R) against one process's, through one AdamW step and one SGD step from the same
# weights:

# %%
def one_step(grads, optimizer_class, **kwargs):
    """The parameters after one step from mlp's weights with these gradients."""
    model = copy.deepcopy(mlp).double()
    for n, p in model.named_parameters():
        p.grad = grads[n].double().cpu()
    optimizer_class(model.parameters(), **kwargs).step()
    return {n: p.detach() for n, p in model.named_parameters()}


wrong_grads = hsdp_results["factor = shard size = 2"]["grads"]
norms = [torch.sqrt(sum((g.double() ** 2).sum() for g in gs.values())).item()
         for gs in (wrong_grads, hsdp_reference["grads"])]
steps = {name: max_diff(one_step(wrong_grads, opt, **kw),
                        one_step(hsdp_reference["grads"], opt, **kw))
         for name, opt, kw in [("AdamW", torch.optim.AdamW, {"lr": 1e-3}),
                               ("SGD", torch.optim.SGD, {"lr": 1e-3})]}
print(f"grad norm: {norms[0]:.6f} against one process's {norms[1]:.6f}: × {norms[0] / norms[1]:.4f}")
for name, gap in steps.items():
    print(f"one {name} step (lr 1e-3) with the × {MESH_SHAPE[0]} gradients: parameters off by {gap:.2g}")
assert abs(norms[0] / norms[1] - MESH_SHAPE[0]) < 1e-12  # the norm shows the factor
assert steps["AdamW"] < 1e-6 < 1e-4 < steps["SGD"]  # AdamW all but hides it; SGD does not

# %% [markdown]
# ### In float32, gloo refuses a divide factor
#
# Every factor above worked on gloo (nccl not run here), because float64 takes FSDP2's SUM path. In
# float32, FSDP2 sends a factor other than the shard size as `ReduceOp.PREMUL_SUM` (notebook 08
# reads the source that picks it). Gloo has no `PREMUL_SUM`. Here is the sum, factor 1, in
# float32. It gets a launch of its own, since a failed collective breaks its process group.
# This cell and the next launch gloo even with GPUs: nccl has `PREMUL_SUM`, the refusal is gloo's.

# %%
try:
    gst.launch(lambda r, w: hsdp(r, w, factor=1.0, dtype=torch.float32), MESH_RANKS,
               backend="gloo")
    premul_error = None
except gst.RankFailedError as error:
    premul_error = error.failure.message
    print(f"HSDP, float32, factor 1: rank {error.rank} raised {error.exc_type}: {premul_error}")
assert premul_error == "Cannot use ReduceOp.PREMUL_SUM with Gloo"

# %% [markdown]
# In float32 on gloo, leave the factor at its default and scale the loss instead. Multiply it
# by R·S / the factor you wanted: × 4 for the sum. Float64, as above, is the other way out.
# Notebook 08 shows a third, `set_force_sum_reduction_for_comms(True)`, on one mesh dimension (not
# run on HSDP here). The loss × 4, against
# float64's factor 1:

# %%
float32_sum = gst.launch(lambda r, w: hsdp(r, w, dtype=torch.float32, loss_scale=MESH_RANKS),
                         MESH_RANKS, backend="gloo")[0]
float64_sum = hsdp_results["factor = 1 (the sum)"]["grads"]
float32_gap = max_diff(float32_sum["grads"], float64_sum) / max(
    g.abs().max().item() for g in float64_sum.values())
print(f"float32, default factor, loss × {MESH_RANKS}: grad ratio "
      f"{ratio(float32_sum['grads'], hsdp_reference['grads']):.4f}; vs float64's factor 1 "
      f"{float32_gap:.1g} (relative)")
assert abs(ratio(float32_sum["grads"], hsdp_reference["grads"]) - MESH_RANKS) < 1e-5
assert float32_gap < 1e-6

# %% [markdown]
# ## FSDP × TP + SP on a 2 × 2 mesh: the loss divisor
#
# Now both dimensions at once: `fully_shard` over "dp" and the SP block over "tp". Rank (d, t)
# holds batch rows of data rank d and the sequence shard t. FSDP divides by the 2 data ranks.
# TP divides by nothing. So each rank's loss is its sum over the count of its *data rank*'s
# batch, all sequence shards included. A mean over its own shard is tp times too large.

# %%
XB, YB = torch.randn(4, 8, 4), torch.randn(4, 8, 4)  # 2 rows per data rank, 4 tokens per shard
fsdp_tp_reference = one_process(block, lambda m: ((m(XB) - YB) ** 2).mean())


def fsdp_tp(rank, world_size, loss="sum / data-rank count", factor=None):
    float64_and_quiet()
    device = gst.local_device()
    mesh = init_device_mesh(device.type, MESH_SHAPE, mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = parallelize_module(copy.deepcopy(block).to(device), mesh["tp"],
                               dict(SP_PLAN, norm=SequenceParallel()))
    fully_shard(model, mesh=mesh["dp"])
    if factor is not None:
        model.set_gradient_divide_factor(factor)  # one fully_shard: the root only
    rows_x, rows_y = XB.chunk(MESH_SHAPE[0])[d], YB.chunk(MESH_SHAPE[0])[d]
    x, y = rows_x.chunk(MESH_SHAPE[1], dim=1)[t], rows_y.chunk(MESH_SHAPE[1], dim=1)[t]
    x, y = x.to(device), y.to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        sgd.zero_grad()
        errors = (model(x) - y) ** 2
        (errors.sum() / rows_y.numel() if loss == "sum / data-rank count"
         else errors.mean()).backward()
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
            kinds = {n: str(p.placements) for n, p in model.named_parameters()}
        sgd.step()
    return {"grads": grads, "kinds": kinds,
            "params": {n: full(p) for n, p in model.named_parameters()}}

fsdp_tp_runs = {"sum / data-rank count": {}, "local mean": {"loss": "local mean"},
                "sum / data-rank count, factor 1": {"factor": 1.0}}
fsdp_tp_results = gst.launch(
    lambda r, w: {name: fsdp_tp(r, w, **kw) for name, kw in fsdp_tp_runs.items()}, MESH_RANKS)[0]

# %%
print(f"FSDP(dp={MESH_SHAPE[0]}) × TP+SP(tp={MESH_SHAPE[1]}), {STEPS} steps")
for name, res in fsdp_tp_results.items():
    print(f"loss = {name:<34} params vs 1 process "
          f"{max_diff(res['params'], fsdp_tp_reference['params']):>8.2g}, grad ratio "
          f"{ratio(res['grads'], fsdp_tp_reference['grads']):.4f}")
right = fsdp_tp_results["sum / data-rank count"]
assert max_diff(right["params"], fsdp_tp_reference["params"]) < 1e-14
local_mean = fsdp_tp_results["local mean"]["grads"]
assert abs(ratio(local_mean, fsdp_tp_reference["grads"]) - MESH_SHAPE[1]) < 1e-12  # × tp
summed_dp = fsdp_tp_results["sum / data-rank count, factor 1"]["grads"]
assert abs(ratio(summed_dp, fsdp_tp_reference["grads"]) - MESH_SHAPE[0]) < 1e-12  # × dp

# %% [markdown]
# ## Context parallel: over which ranks is the token count taken?
#
# **Context parallel** (CP) splits each sequence between ranks in every layer, attention
# included. Each rank keeps its share of the tokens; attention gathers the other ranks' keys and
# values. `context_parallel(mesh, buffers=...)` shards the buffers along the sequence and
# patches `scaled_dot_product_attention` (its docstring says both). On a (dp, cp) mesh, rank
# (d, c) holds data rank d's rows, and the c-th share of their tokens. A token mean must then
# count the tokens over dp × cp. verl#5983 counted them over the data-parallel group only: its
# "`batch_num_tokens` is undercounted by a factor of CP". Megatron-LM#906 is titled "wrong loss
# scaling when context parallel is on". In transformers#39648, with CP or TP set, "the training
# loss will be scaled up by the product of those values".
#
# Below, each rank divides its sum of per-token losses by a count all-reduced over dp × cp,
# then every gradient is summed over dp × cp. The backward needs
# `sdpa_kernel(SDPBackend.MATH)` on the CPU. CP registers sharding rules for the GPU kernels,
# none for the default CPU kernel's backward (printed below, from torch's source).

# %%
class Attention(nn.Module):
    """Self-attention with 2 heads: the layer that context parallel splits."""

    def __init__(self, hidden=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape  # q, k, v: (batch, heads, sequence, hidden / heads)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


torch.manual_seed(2)
attention = Attention()
XC, YC = torch.randn(4, 8, 8), torch.randn(4, 8, 8)  # (batch, sequence, hidden): 32 tokens
cp_reference = one_process(attention, lambda m: ((m(XC) - YC) ** 2).mean(-1).mean())


def context_parallel_run(rank, world_size, count_over="dp × cp"):
    """CP on a (dp, cp) mesh: the first gradients, the count and the parameters after."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    float64_and_quiet()
    device = gst.local_device()
    mesh = init_device_mesh(device.type, MESH_SHAPE, mesh_dim_names=("dp", "cp"))
    count_group = None if count_over == "dp × cp" else mesh.get_group("dp")  # None: every rank
    d = mesh.get_local_rank("dp")
    model = copy.deepcopy(attention).to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        sgd.zero_grad()
        x = XC.chunk(MESH_SHAPE[0])[d].to(device, copy=True)  # my rows, a copy: CP shards it
        y = YC.chunk(MESH_SHAPE[0])[d].to(device, copy=True)  # in place
        with sdpa_kernel(SDPBackend.MATH), context_parallel(
                mesh["cp"], buffers=[x, y], buffer_seq_dims=[1, 1], no_restore_buffers={x, y}):
            per_token = ((model(x) - y) ** 2).mean(-1)  # x, y: now my share of the sequence
            tokens = torch.tensor(float(per_token.numel()), device=device)
            dist.all_reduce(tokens, group=count_group)  # the token count
            (per_token.sum() / tokens).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # SUM over dp × cp: the mean is in the loss
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            seen = {"local tokens": list(per_token.shape), "count": int(tokens.item())}
        sgd.step()
    return dict(seen, grads=grads, params={n: p.detach() for n, p in model.named_parameters()})


cp_runs = {"count over dp × cp": {}, "count over dp (verl#5983)": {"count_over": "dp"}}
cp_results = gst.launch(
    lambda r, w: {name: context_parallel_run(r, w, **kw) for name, kw in cp_runs.items()},
    MESH_RANKS)[0]

# %%
print(f"CP on a {MESH_SHAPE} (dp, cp) mesh, {STEPS} steps; tokens (rows, sequence) on each rank: "
      f"{cp_results['count over dp × cp']['local tokens']}")
for name in cp_runs:
    res = cp_results[name]
    print(f"{name:<27} count {res['count']:>3}, grad ratio "
          f"{ratio(res['grads'], cp_reference['grads']):.4f}, params vs 1 process "
          f"{max_diff(res['params'], cp_reference['params']):.2g}")
import inspect
import re
from torch.distributed.tensor.experimental._context_parallel import _sharding_rules  # private
cp_rules = re.findall(r"aten\.(\w+)\.default", inspect.getsource(
    _sharding_rules.register_cp_sharding_rules))  # the SDPA kernels that CP can shard
print(f"CP's sharding rules (torch {torch.__version__}): {', '.join(cp_rules)}")
full_count = cp_results["count over dp × cp"]
assert full_count["local tokens"] == [2, 4] and full_count["count"] == XC.shape[0] * XC.shape[1]
assert max_diff(full_count["grads"], cp_reference["grads"]) < 1e-15
assert max_diff(full_count["params"], cp_reference["params"]) < 1e-14
dp_count = cp_results["count over dp (verl#5983)"]
assert dp_count["count"] * MESH_SHAPE[1] == full_count["count"]  # undercounted by a factor of cp
assert abs(ratio(dp_count["grads"], cp_reference["grads"]) - MESH_SHAPE[1]) < 1e-12  # × cp
assert "_scaled_dot_product_flash_attention_backward" in cp_rules  # the GPU flash kernel's
assert not any(name.endswith("_for_cpu_backward") for name in cp_rules)  # none for the CPU's

# %% [markdown]
# Counting over dp alone gives half the tokens, and gradients × cp = 2. The fix is the count's
# group, not a rescaling: every rank that holds some of the tokens takes part in the count.
#
# ### In bfloat16, the TP sum runs in bfloat16
#
# Notebook 09 measured the precision of the sum. FSDP2's `MixedPrecisionPolicy(param_dtype=
# torch.bfloat16, reduce_dtype=torch.float32)` reduces FSDP's gradients in float32. The TP
# all-reduce of a Partial gradient is another matter: FSDP2's post-backward runs it as a DTensor
# redistribute, outside `reduce_dtype`. Logging each collective's dtype during one backward shows
# it runs in bfloat16 (pytorch#190626 reports it).

# %%
def reduce_dtypes(rank, world_size):
    """The collectives of one backward of the FSDP × TP block in bf16, by name and dtype."""
    import collections

    import torch.distributed._functional_collectives as funcol  # what DTensor calls

    float64_and_quiet()
    device = gst.local_device()
    mesh = init_device_mesh(device.type, MESH_SHAPE, mesh_dim_names=("dp", "tp"))
    model = parallelize_module(copy.deepcopy(block).to(device, torch.float32), mesh["tp"],
                               dict(SP_PLAN, norm=SequenceParallel()))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    out = model(torch.randn(2, 2, 4, dtype=torch.float32, device=device))
    seen = collections.Counter()
    all_reduce, scatter = funcol.all_reduce, getattr(dist, reduce_scatter)

    def logged_all_reduce(t, *args, **kwargs):
        seen["TP all-reduce (DTensor)", str(t.dtype)] += 1
        return all_reduce(t, *args, **kwargs)

    def logged_scatter(*args, **kwargs):
        sent = kwargs["input"] if "input" in kwargs else args[1]  # (output, input, ...)
        seen["FSDP reduce-scatter", str(sent.dtype)] += 1
        return scatter(*args, **kwargs)

    funcol.all_reduce = logged_all_reduce
    setattr(dist, reduce_scatter, logged_scatter)
    try:
        out.float().pow(2).sum().backward()
    finally:
        funcol.all_reduce = all_reduce
        setattr(dist, reduce_scatter, scatter)
    return dict(seen)

dtypes = gst.launch(reduce_dtypes, MESH_RANKS)[0]

# %%
for (name, dtype), calls in dtypes.items():
    print(f"{name:<26}{dtype:<16}× {calls}")
assert dtypes == {("TP all-reduce (DTensor)", "torch.bfloat16"): 2,
                  ("FSDP reduce-scatter", "torch.float32"): 1}

# %% [markdown]
# So `reduce_dtype` does not cover the TP sums: they add bfloat16 numbers. Notebook 09
# measures what such a sum costs.
#
# ## Who reduces what: the table, from the runs
#
# Each entry below is read from the runs above, not typed. "Placements" are the parameter's
# on the 2-D mesh. "Over tp" is its gradient's placement in the sequence-parallel run: a
# Partial needs the sum. "Divide by" is the ratio of the summed gradient to one process's.

# %%
def divisor(grads, reference, name):
    """How many times one process's gradient `name` is in the summed one: what to divide by."""
    return ratio({name: grads[name]}, {name: reference[name]})


def over_tp(grad_placements):
    """What the TP ranks must do with a gradient of these placements."""
    kind = grad_placements[1:-2]  # "(Partial(sum),)": one mesh dimension's placement
    return f"{kind}: all-reduce SUM" if kind.startswith("Partial") else f"{kind}: nothing"


kinds = fsdp_tp_results["sum / data-rank count"]["kinds"]
counted = (f"reduce-scatter ×{default['backward'][reduce_scatter]}, "
           f"all-reduce ×{default['backward']['all_reduce']}")
sums = {"HSDP": (hsdp_results["factor = 1 (the sum)"], hsdp_reference),
        "FSDP × TP": (fsdp_tp_results["sum / data-rank count, factor 1"], fsdp_tp_reference),
        "TP": (tp0, tp_reference)}
rows = [  # kind, example, run, its placements, over dp (FSDP), over tp
    ("HSDP, every parameter", "0.weight", "HSDP", default["placements"], counted, "(no tp)"),
    ("TP-sharded", "w1.weight", "FSDP × TP", kinds["w1.weight"], "FSDP",
     over_tp(sp0["grad kinds"]["w1.weight"])),
    ("TP-replicated under SP", "norm.weight", "FSDP × TP", kinds["norm.weight"], "FSDP",
     over_tp(sp0["grad kinds"]["norm.weight"])),
    ("TP-replicated, plain TP", "2.bias", "TP", tp0["kinds"]["2.bias"], "(no dp)",
     over_tp(tp0["kinds"]["2.bias"])),
]
print(f"{'parameter kind':<25}{'example':<12}{'placements':<44}{'over dp':<36}"
      f"{'over tp':<32}divide by")
measured = []
for kind, name, run, placed, dp, tp in rows:
    measured.append(divisor(sums[run][0]["grads"], sums[run][1]["grads"], name))
    print(f"{kind:<25}{name:<12}{placed:<44}{dp:<36}{tp:<32}{measured[-1]:g}")
assert [round(m, 12) for m in measured] == [MESH_RANKS, MESH_SHAPE[0], MESH_SHAPE[0], 1]
assert [r[5].split(":")[1] for r in rows[1:]] == [" nothing", " all-reduce SUM", " nothing"]
assert "Partial(sum)" in rows[2][5] and "Shard" in rows[1][3] and "Replicate" in rows[2][3]

# %% [markdown]
# The rule behind the table has three parts. Divide once, by the data shards (FSDP2's factor:
# R·S, or dp; dp × cp with context parallel). Sum over the TP ranks a gradient of which each
# holds a share. Leave alone what each rank holds whole.
#
# ## Copy this into your code
#
# `snippets/10_fsdp_tp.py` is a whole script, run by the course's tests with
# `torchrun --standalone --nproc-per-node 2` (dp 1 × tp 2). With 4 ranks it is dp 2 × tp 2. It
# checks on every rank that three steps, clipping included, equal one process's.
#
# <!-- snippets/10_fsdp_tp.py -->
# ```python
# """Notebook 10, copy this into your code: FSDP2 over "dp" x tensor + sequence parallel over
# "tp" on a 2-D mesh, each rank's loss its sum over the count of its data-parallel rank's batch.
#
#     torchrun --standalone --nproc-per-node 2 snippets/10_fsdp_tp.py   # dp 1 x tp 2
#     torchrun --standalone --nproc-per-node 4 snippets/10_fsdp_tp.py   # dp 2 x tp 2
# """
#
# import copy
# import os
# import warnings
#
# import torch
# import torch.distributed as dist
#
# # before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
# import torch.distributed.nn  # noqa: F401
# from torch import nn
# from torch.distributed.device_mesh import init_device_mesh
# from torch.distributed.fsdp import fully_shard
# from torch.distributed.tensor import Shard
# from torch.distributed.tensor.parallel import (
#     ColwiseParallel,
#     RowwiseParallel,
#     SequenceParallel,
#     parallelize_module,
# )
#
# TP = 2  # tensor-parallel ranks; the other ranks are data parallel
#
#
# def init_distributed():
#     """Join the group torchrun prepared (RANK, WORLD_SIZE, MASTER_ADDR...); return the device.
#
#     With a GPU for every rank on this machine: nccl, this rank on GPU LOCAL_RANK. Otherwise
#     gloo, on the CPU (a laptop; also 2 ranks on 1 GPU, which nccl cannot share): with a
#     warning that gives both numbers when CUDA is there but has fewer GPUs than ranks.
#     """
#     local_rank, ranks_here = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
#     gpus = torch.cuda.device_count()
#     if gpus >= ranks_here:
#         device = torch.device("cuda", local_rank)
#         torch.cuda.set_device(device)          # before init: nccl and *_object calls use it
#         dist.init_process_group("nccl", device_id=device)  # barrier() too
#         return device
#     if gpus:                                   # CUDA, but not a GPU per rank: never silently
#         warnings.warn(f"{gpus} GPU(s) visible for {ranks_here} ranks on this machine: this "
#                       "job trains on the CPU with gloo. For nccl, start one rank per GPU "
#                       f"(--nproc-per-node {gpus}) or check CUDA_VISIBLE_DEVICES.", stacklevel=2)
#     dist.init_process_group("gloo")
#     return torch.device("cpu")
#
#
# class Block(nn.Module):
#     """LayerNorm (sequence parallel), then a column- and a row-parallel layer."""
#
#     def __init__(self, hidden=8, inner=16):
#         super().__init__()
#         self.norm = nn.LayerNorm(hidden)
#         self.w1, self.act, self.w2 = nn.Linear(hidden, inner), nn.Tanh(), nn.Linear(inner, hidden)
#
#     def forward(self, x):
#         return self.w2(self.act(self.w1(self.norm(x))))
#
#
# def main():
#     device = init_distributed()
#     world_size = dist.get_world_size()
#     assert world_size % TP == 0, f"run a multiple of {TP} ranks, not {world_size}"
#     mesh = init_device_mesh(device.type, (world_size // TP, TP), mesh_dim_names=("dp", "tp"))
#     dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
#     torch.manual_seed(0)                       # the same weights on every rank
#     model = Block().to(device)
#     whole = copy.deepcopy(model)               # for the check: one process, every token
#     parallelize_module(model, mesh["tp"], {
#         "norm": SequenceParallel(),            # its weight's grad: a Partial (pending) sum
#         "w1": ColwiseParallel(input_layouts=Shard(1)),
#         "w2": RowwiseParallel(output_layouts=Shard(1))})
#     fully_shard(model, mesh=mesh["dp"])        # FSDP divides by the dp ranks only
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
#
#     g = torch.Generator().manual_seed(1)       # one global batch: (rows, sequence, hidden)
#     x = torch.randn(2 * mesh["dp"].size(), 4 * TP, 8, generator=g).to(device)
#     y = torch.randn(x.shape, generator=g).to(device)
#     rows = slice(2 * dp, 2 * dp + 2)           # this data rank's rows...
#     tokens = slice(4 * tp, 4 * tp + 4)         # ...and this TP rank's part of the sequence
#     reference = torch.optim.SGD(whole.parameters(), lr=0.5)
#     for _ in range(3):
#         optimizer.zero_grad()
#         errors = (model(x[rows, tokens]) - y[rows, tokens]) ** 2
#         loss = errors.sum() / y[rows].numel()  # NOT errors.mean(): that is tp times too large
#         # (no padding here; with padding, divide by the valid tokens, all-reduced over dp and tp)
#         loss.backward()
#         norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # counts each once
#         optimizer.step()
#         reference.zero_grad()
#         ((whole(x) - y) ** 2).mean().backward()
#         whole_norm = nn.utils.clip_grad_norm_(whole.parameters(), max_norm=1.0)
#         reference.step()
#
#     # Check: 3 steps on the 2-D mesh are 3 steps of one process on the whole batch.
#     torch.testing.assert_close(norm.full_tensor(), whole_norm)
#     state = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank calls it
#     for name, p in whole.state_dict().items():
#         torch.testing.assert_close(state[name], p)
#     print(f"rank {dist.get_rank()}: dp {dp}, tp {tp}, on {device.type} ({dist.get_backend()}); "
#           "after 3 steps the model equals one process's on the whole batch")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# ## Exercise
#
# Write `gradient_plan(replicas, shards, tp, tokens)`. The mesh is (replicas, shards, tp):
# FSDP2 over the first two dimensions, tensor and sequence parallel over the last. Each rank
# holds `tokens` squared errors, its sequence shard. Return three things:
#
# 1. `divide_factor`, for `set_gradient_divide_factor` on the (replicas, shards) mesh;
# 2. `replicated_op`, the `dist.ReduceOp` that all-reduces a LayerNorm weight's gradient over
#    the tp ranks (Megatron style);
# 3. `loss_divisor`, what each rank divides its sum of squared errors by.
#
# The check asks about several mesh shapes. Then it runs your op and divisor on 2 ranks, then
# 3 to 5, against one process. It rejects an average where a sum is needed, a factor equal to the
# shard size, and a local mean. Stuck? `%load solutions/10_gradient_plan.py` in a new cell.

# %%
def gradient_plan(replicas, shards, tp, tokens):
    # your code here: return divide_factor, replicated_op, loss_divisor
    raise NotImplementedError("write gradient_plan")


# %%
gst.exercises.check_gradient_plan(gradient_plan)

# %% [markdown]
# ## Summary
#
# - Divide once, by the data shards: the data-parallel ranks, × the context-parallel ones when
#   the sequence is split. FSDP2's default does it over dp; so does
#   `set_gradient_divide_factor(R·S)` on an HSDP mesh. The shard size is wrong.
# - Each rank's loss is its sum over its data rank's count, every sequence shard included.
# - A parameter replicated over TP ranks that see different tokens gets a **sum**. DTensor
#   keeps it `Partial(sum)`; code by hand must all-reduce with `SUM`.
# - Count replicated parameters once in a gradient norm, or use `clip_grad_norm_` on DTensors.
#
# The course says the rule once, in these words:
#
# > **The rule.** Every gradient must be the gradient of one loss over the whole step's data. Sum form:
# > each rank adds up its loss terms (tokens, samples, completions) and divides by their global count,
# > over every micro-batch of every rank that holds other data. Mean form: each data shard takes its
# > own mean, and the summed gradients are divided by the number of data shards. The data shards are
# > the data-parallel × context-parallel ranks × the micro-batches, and this form needs as many loss
# > terms in each. DDP and FSDP divide by the data-parallel size themselves: multiply a sum-form loss
# > by it. Divide once, and never by the size of a group a gradient is only reduced over. Sum partial
# > gradients; never average them.
