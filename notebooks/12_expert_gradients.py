# %% [markdown]
# # 12 — Experts: when each parameter has its own data-parallel group
#
# **Question: in a mixture-of-experts layer with expert parallelism, an expert's gradient is
# reduced over a smaller group than the dense parameters'. What do I divide it by?**
#
# A **mixture of experts** (MoE) layer holds several feed-forward blocks, the **experts**. A
# small **router** sends each token to one of them (**top-1** routing). With **expert
# parallelism** (EP), each rank of an **expert-parallel group** holds one expert. An
# `all_to_all` sends every token to its expert's rank, and a second one brings the answer back.
# Ranks that hold the same expert form its **expert-data-parallel group** (EDP).
#
# **Short answer: sum an expert's gradient over its expert-data-parallel group, then divide by
# the whole data-parallel size.** That size is W, every rank that brought tokens. Dividing by
# the group's size makes expert gradients EP = 2 times too large. Reducing experts over all
# ranks, like dense parameters, mixes them. Each claim is checked below against one process, in
# float64, on 2 and 4 ranks.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: fewer random batches, same checks
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
EP = 2  # experts, one on each rank of an expert-parallel group
HIDDEN, TOKENS = 4, 6  # features per token, tokens per rank
BATCHES = 2 if SMOKE_TEST else 4  # random global batches each proof runs on
SIZES = sorted({2, 4, WORLD_SIZE})  # the world sizes of the proofs: EDP = W / EP

import copy
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from IPython.display import Markdown
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradsync_tutorial as gst

assert all(size % EP == 0 for size in SIZES), "EP must divide every world size"

# %% [markdown]
# ## The layer in one process
#
# The toy layer: a dense `Linear` with `tanh`, a router, and `EP` experts (`Linear` each). The
# router picks each token's expert by its largest logit. The expert's output is multiplied by
# that logit's softmax probability, the **gate**, so that the router gets a gradient. It lives in
# `gradsync_tutorial/moe.py`, where this notebook's exercise reads it too:

# %%
from gradsync_tutorial.moe import ToyMoE  # one copy, which the exercise uses too

Markdown(f"```python\n{inspect.getsource(ToyMoE)}```")

# %%
def global_batch(seed, world_size):
    """TOKENS tokens per rank, inputs and targets; rank r holds rows r*TOKENS to (r+1)*TOKENS."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(world_size * TOKENS, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(world_size * TOKENS, HIDDEN, generator=g, dtype=torch.float64))


def one_process(seed, world_size, layer=None):
    """The reference: one process, the union batch, PyTorch's mean loss. Returns its gradients
    by name and each expert's token count."""
    layer = copy.deepcopy(layer) if layer is not None else ToyMoE(HIDDEN, EP, SEED).double()
    x, y = global_batch(seed, world_size)
    F.mse_loss(layer(x), y).backward()
    counts = torch.bincount(layer.route(x)[1], minlength=EP).tolist()
    return {n: p.grad for n, p in layer.named_parameters()}, counts


reference, counts = one_process(SEED, WORLD_SIZE)
print(f"{WORLD_SIZE * TOKENS} tokens; tokens per expert: {counts}")
assert sum(counts) == WORLD_SIZE * TOKENS and list(reference) == [
    "dense.weight", "dense.bias", "router.weight", "router.bias",
    *(f"experts.{e}.{w}" for e in range(EP) for w in ("weight", "bias"))]

# %% [markdown]
# ## `all_to_all_single` with uneven splits
#
# `dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes)` cuts `input`
# into pieces, one per rank. Piece j goes to rank j. Rank r receives one piece from each rank,
# in rank order. The sizes may differ, so each rank must know what it will receive. Here rank r
# sends r + 1 numbers to rank 0 and the rest of its 3 to rank 1:

# %%
def exchange(rank, world_size):
    device = gst.local_device()
    mine = torch.arange(3.0, device=device) + 10 * rank  # rank 1: [10, 11, 12]
    send = [1, 2] if rank == 0 else [2, 1]  # to rank 0, to rank 1
    counts = torch.tensor(send, device=device)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts)  # first, how many each rank will send me
    received = torch.empty(int(recv.sum()), device=device)
    dist.all_to_all_single(received, mine, recv.tolist(), send)
    return {"sent": mine.tolist(), "received": received.tolist()}


swapped = gst.launch(exchange, world_size=2)

# %%
for rank, r in enumerate(swapped):
    print(f"rank {rank}: sent {r['sent']}, received {r['received']}")
assert [r["received"] for r in swapped] == [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]]

# %% [markdown]
# A collective is not differentiable by itself. Its backward is the same exchange reversed.
# The gradient of each received row goes back to the rank that sent it. `AllToAll` writes
# that, so every collective of the layer stays visible.

# %%
class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


# %% [markdown]
# ## The layer on N ranks: dispatch, expert, combine
#
# The W ranks form a **device mesh** of shape (W / EP, EP), named `("edp", "ep")`. Rank r
# holds expert r mod EP. Its row of the mesh is its expert-parallel group. Its column is its
# expert-data-parallel group: the ranks that hold the same expert. With W = 2 the EDP group
# has one rank; with W = 4 it has two.
#
# Each rank routes its own tokens and sorts them by expert. The **dispatch** `all_to_all`
# sends them to their experts. The **combine** `all_to_all` brings the outputs back, and the
# rank puts them in its tokens' order.

# %%
def expert_parallel(layer, expert, x, ep_group):
    """The layer on one rank: its own tokens `x`, its one expert, the others on `ep_group`."""
    h, choice, gate = layer.route(x)  # dense and router: replicated, on this rank's tokens
    order = torch.argsort(choice, stable=True)  # this rank's tokens, sorted by expert
    send = torch.bincount(choice, minlength=EP)  # tokens for each rank of the EP group
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep_group)  # tokens each rank will send me
    send, recv = send.tolist(), recv.tolist()
    routed = AllToAll.apply(h[order], send, recv, ep_group)  # dispatch
    done = expert(routed)  # my expert, on every token routed to it, from every rank
    back = AllToAll.apply(done, recv, send, ep_group)  # combine
    return gate * back[torch.argsort(order)]  # in this rank's token order


# %% [markdown]
# ## Each rank's gradient, and four ways to reduce it
#
# Each rank runs `backward()` on the mean loss over its own `TOKENS` tokens. Then the dense
# and router gradients are all-reduced over every rank and divided by W, as in notebook 02.
# The expert gradients are reduced five ways:
#
# * `"rule"`: sum over the EDP group, divide by W.
# * `"÷ EDP"`: sum over the EDP group, divide by its size.
# * `"AVG"`: `ReduceOp.AVG` over the EDP group, the same mistake in one call.
# * `"like dense"`: sum over all W ranks, divide by W, as a dense parameter.
# * `"micro-batches"`: the rule with 2 micro-batches per rank, each loss divided by 2.

# %%
def sync_gradients(dense, experts, edp_group, how, world_size):
    """Reduce this rank's gradients in place: `dense` and `experts` are parameter lists."""
    for p in dense:
        dist.all_reduce(p.grad)  # SUM over all ranks
        p.grad /= world_size
    for p in experts:
        if how == "like dense":
            dist.all_reduce(p.grad)  # SUM over all ranks: every expert's gradient, mixed
            p.grad /= world_size
        elif how == "AVG":
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=edp_group)  # ÷ the group
        else:
            dist.all_reduce(p.grad, group=edp_group)  # SUM over the ranks holding this expert
            p.grad /= dist.get_world_size(edp_group) if how == "÷ EDP" else world_size


def mesh_of(world_size):
    return init_device_mesh(gst.local_device().type, (world_size // EP, EP),
                            mesh_dim_names=("edp", "ep"))


def ep_step(rank, world_size, seed, how, layer, micro_batches=1):
    """One backward on this rank's tokens, then sync_gradients(how). Returns the gradients."""
    device = gst.local_device()
    mesh = mesh_of(world_size)
    ep_rank = mesh.get_local_rank("ep")
    layer = copy.deepcopy(layer).to(device)
    expert = layer.experts[ep_rank]  # this rank holds only this one (the others stay unused)
    x, y = (t[rank * TOKENS:(rank + 1) * TOKENS].to(device) for t in global_batch(seed, world_size))
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        out = expert_parallel(layer, expert, xs, mesh["ep"].get_group())
        (F.mse_loss(out, ys) / micro_batches).backward()  # accumulates into .grad
    dense = [*layer.dense.parameters(), *layer.router.parameters()]
    sync_gradients(dense, list(expert.parameters()), mesh["edp"].get_group(), how, world_size)
    grads = {n: p.grad.cpu() for n, p in layer.named_parameters() if p.grad is not None}
    return {"ep_rank": ep_rank, "grads": grads}


# %% [markdown]
# One launch per world size runs every batch and every way. Each run starts from the same
# weights. The notebook compares each rank's gradients with one process's on the union batch.

# %%
HOWS = ("rule", "÷ EDP", "AVG", "like dense", "micro-batches")


def every_way(rank, world_size, seeds, layer):
    return {(seed, how): ep_step(rank, world_size, seed, how.replace("micro-batches", "rule"),
                                 layer, 2 if how == "micro-batches" else 1)
            for seed in seeds for how in HOWS}


seeds = [SEED + i for i in range(BATCHES)]
layer0 = ToyMoE(HIDDEN, EP, SEED).double()
runs = {size: gst.launch(every_way, world_size=size, args=(seeds, layer0)) for size in SIZES}

# %%
def compare(size, how, seed=SEED):
    """For each rank: max |difference| of its dense and expert gradients from one process's,
    and its expert gradient's norm over one process's."""
    ref, _ = one_process(seed, size)
    rows = []
    for r in runs[size]:
        got, e = r[seed, how]["grads"], r[seed, how]["ep_rank"]
        expert = {w: got[f"experts.{e}.{w}"] for w in ("weight", "bias")}
        rows.append({
            "dense": max((got[n] - ref[n]).abs().max().item() for n in got if "experts" not in n),
            "expert": max((expert[w] - ref[f"experts.{e}.{w}"]).abs().max().item() for w in expert),
            "ratio": (expert["weight"].norm() / ref[f"experts.{e}.weight"].norm()).item(),
            "grads": expert, "ep_rank": e})
    return rows


for size in SIZES:
    for seed in seeds:
        for r in compare(size, "rule", seed):
            assert r["dense"] <= 1e-15 and r["expert"] <= 1e-15
rule = {size: compare(size, "rule") for size in SIZES}
for size in SIZES:
    worst = max(max(r["dense"], r["expert"]) for r in rule[size])
    print(f"W = {size} (EP {EP}, EDP {size // EP}), {len(seeds)} batches: every gradient of "
          f"every rank = one process's, max |difference| {worst:.2g}")

# %% [markdown]
# ## 1. The rule is exact, router included
#
# The dense and router gradients match one process too (the column "dense" above covers
# `dense` and `router`). The router's gradient reaches it through the gate. The gate multiplies
# the expert outputs that the combine brought back. The dense layer's gradient also flows back
# through both `all_to_all`s: the combine's backward, then the dispatch's.
#
# Why W and not the group's size? Rank r's expert has already seen tokens from every rank of
# its EP group. Its local gradient is a sum over EP ranks' data before any collective runs.
# The sum over EDP then covers all W ranks' tokens, and each rank's loss was a mean over its
# own. So the sum holds W means: divide by W.
#
# ## 2. Dividing by the expert group's size: × EP
#
# `"÷ EDP"` and `"AVG"` divide that sum of W means by W / EP only:

# %%
for size in SIZES:
    ref = one_process(SEED, size)[0]
    for how in ("÷ EDP", "AVG"):
        ratios = [r["ratio"] for r in compare(size, how)]
        print(f"W = {size}, EDP {size // EP}, {how:5}: expert gradient / one process's, per "
              f"rank: {[round(x, 12) for x in ratios]}")
        for r in compare(size, how):
            assert torch.allclose(r["grads"]["weight"], EP * ref[f"experts.{r['ep_rank']}.weight"],
                                  rtol=1e-13, atol=0)

# %% [markdown]
# Exactly EP = 2, on every rank, at both sizes. The division comes after `backward()`, so the
# loss is the same either way: loss curves cannot show it.
#
# ## 3. Experts reduced like dense parameters: mixed
#
# An all-reduce over all ranks adds expert 0's gradient to expert 1's. Every rank then holds
# the same number: the sum of both experts' right gradients.

# %%
for size in SIZES:
    ref = one_process(SEED, size)[0]
    both = sum(ref[f"experts.{e}.weight"] for e in range(EP))
    mixed = compare(size, "like dense")
    print(f"W = {size}: expert gradient / one process's, per rank: "
          f"{[round(r['ratio'], 3) for r in mixed]}")
    for r in mixed:
        assert (r["grads"]["weight"] - both).abs().max() <= 1e-15
        assert r["expert"] > 1e-3
    assert abs(mixed[0]["ratio"] - mixed[1]["ratio"]) > 0.01  # expert 0's, expert 1's

# %% [markdown]
# Both experts then take the same step, each with the other's gradient mixed in. The ratios
# differ per expert, so no learning rate undoes it.
#
# ## 4. Micro-batches change nothing in the rule
#
# With 2 micro-batches per rank, each loss is divided by 2, as notebook 01 accumulates. The
# gradient sums 2 · W micro-batch means, each weighted 1/2. Still divide by W:

# %%
for size in SIZES:
    worst = max(max(r["dense"], r["expert"]) for r in compare(size, "micro-batches"))
    print(f"W = {size}, 2 micro-batches: max |difference| from one process {worst:.2g}")
    assert worst <= 1e-15

# %% [markdown]
# ## 5. FSDP2 on the expert mesh: its default factor is the group's size
#
# torchtitan shards the experts with `fully_shard(mesh=<the EDP mesh>)`. FSDP2 then
# reduce-scatters over that mesh and, by default, divides by its size: the `"÷ EDP"` mistake.
# `set_gradient_divide_factor(W)` fixes it. This needs EDP > 1, so it runs on 4 ranks. In
# float64 FSDP2 sums, then divides, so any factor works on gloo. In float32 a factor other
# than the mesh size needs `PREMUL_SUM`, which gloo lacks (notebook 08).

# %%
def fsdp_experts(rank, world_size, factor, layer, dtype=torch.float64):
    """Experts sharded by FSDP2 over the EDP mesh, dense parameters as before."""
    device = gst.local_device()
    mesh = mesh_of(world_size)
    layer = copy.deepcopy(layer).to(device, dtype)
    expert = layer.experts[mesh.get_local_rank("ep")]
    fully_shard(expert, mesh=mesh["edp"])  # reduce-scatter over the ranks holding it
    if factor is not None:
        expert.set_gradient_divide_factor(factor)
    x, y = (t[rank * TOKENS:(rank + 1) * TOKENS].to(device, dtype)
            for t in global_batch(SEED, world_size))
    F.mse_loss(expert_parallel(layer, expert, x, mesh["ep"].get_group()), y).backward()
    sync_gradients([*layer.dense.parameters(), *layer.router.parameters()], [], None, "rule",
                   world_size)
    full = {w: p.grad.full_tensor().cpu() for w, p in expert.named_parameters()}  # every rank
    return {"ep_rank": mesh.get_local_rank("ep"), "grads": full}


fsdp = {factor: gst.launch(fsdp_experts, world_size=4, args=(factor, layer0))
        for factor in (None, 4.0)}

# %%
ref4 = one_process(SEED, 4)[0]
for factor, ranks in fsdp.items():
    ratios, worst = [], 0.0
    for r in ranks:
        e = r["ep_rank"]
        ratios.append((r["grads"]["weight"].norm() / ref4[f"experts.{e}.weight"].norm()).item())
        worst = max(worst, *((r["grads"][w] - ref4[f"experts.{e}.{w}"]).abs().max().item()
                             for w in ("weight", "bias")))
    print(f"fully_shard(mesh=edp), divide factor {factor}: expert gradient / one process's "
          f"{[round(x, 12) for x in ratios]}, max |difference| {worst:.2g}")
    if factor is None:
        assert all(abs(x - EP) <= 1e-12 for x in ratios)  # × EP, as "÷ EDP"
    else:
        assert worst <= 1e-15

# %% [markdown]
# ### A mesh of one rank: the factor, once or twice
#
# With W = EP, each expert lives on one rank, and its EDP mesh has a single rank. FSDP2 then
# skips its reduce-scatter. pytorch#167178 (2025) found that it also skipped the divide factor:
# "The net effect is that the EP grads are too-large by a factor of the world size". The same
# run at W = EP = 2, factor W, in float32 and in float64:

# %%
single = {dtype: gst.launch(fsdp_experts, world_size=EP, args=(float(EP), layer0, dtype))
          for dtype in (torch.float32, torch.float64)}
ref_ep = one_process(SEED, EP)[0]
single_ratios = {dtype: [(r["grads"]["weight"].double().norm()
                          / ref_ep[f"experts.{r['ep_rank']}.weight"].norm()).item()
                         for r in ranks] for dtype, ranks in single.items()}
for dtype, ratios in single_ratios.items():
    print(f"torch {torch.__version__}, {str(dtype)[6:]}, EDP mesh of 1 rank, divide factor {EP}: "
          f"expert gradient / one process's {[round(x, 6) for x in ratios]}")
assert all(abs(x - 1) <= 1e-5 for x in single_ratios[torch.float32])  # #167178's fix: once
assert all(abs(x - 1 / EP) <= 1e-12 for x in single_ratios[torch.float64])  # twice: ÷ W²

# %% [markdown]
# In float32 the factor applies once: #167178's fix is in. In float64 it applies twice, so the
# expert gradients are 1/W of one process's. The source shows why. For float64 and float16,
# FSDP2 splits the factor into a division before the reduce-scatter and one after it. On a mesh
# of one rank, the fix divides by the whole factor too:

# %%
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

collectives = inspect.getsource(_fsdp_collectives)
lines = ["reduce_output.copy_(reduce_scatter_input / gradient_divide_factor)",
         "_div_if_needed(reduce_scatter_input, predivide_factor)",
         "_div_if_needed(reduce_output, postdivide_factor)",
         "overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)"]
for line in lines:
    print(f"{'found' if line in collectives else 'MISSING'}: {line}")
assert all(line in collectives for line in lines)

# %% [markdown]
# So on a mesh of one rank, reduce in float32 (`MixedPrecisionPolicy(reduce_dtype=torch.float32)`),
# as the first run above did. Check it against one process, as here.
#
# ## 6. Uneven tokens per expert, and an expert with none
#
# The router rarely splits tokens evenly: the counts above were uneven, and the rule was still
# exact. An expert's gradient is a sum over the tokens routed to it. The denominator is every
# token in the loss, as in notebook 07, not the expert's own count. In one process, expert e's
# gradient is the sum of its tokens' gradients over all W · TOKENS tokens:

# %%
def per_token_sum(seed, world_size, e):
    """Expert e's gradient, summed token by token over its own tokens (sum losses, no mean)."""
    layer = ToyMoE(HIDDEN, EP, SEED).double()
    x, y = global_batch(seed, world_size)
    total = torch.zeros_like(layer.experts[e].weight)
    for t in range(len(x)):
        layer.zero_grad()
        F.mse_loss(layer(x[t:t + 1]), y[t:t + 1], reduction="sum").backward()
        if layer.experts[e].weight.grad is not None:
            total += layer.experts[e].weight.grad
    return total


ref, counts = one_process(SEED, WORLD_SIZE)
own_ratios = []
for e in range(EP):
    summed = per_token_sum(SEED, WORLD_SIZE, e)
    everyone = summed / (WORLD_SIZE * TOKENS * HIDDEN)  # F.mse_loss's mean: tokens × features
    own = summed / (counts[e] * HIDDEN)  # a mean over this expert's tokens only
    ratio = (own.norm() / ref[f"experts.{e}.weight"].norm()).item()
    print(f"expert {e}: {counts[e]} tokens; sum / all tokens = one process "
          f"({(everyone - ref[f'experts.{e}.weight']).abs().max():.2g}); "
          f"sum / its own tokens = {ratio:.4f} × one process")
    assert torch.allclose(everyone, ref[f"experts.{e}.weight"], rtol=1e-12, atol=1e-15)
    assert abs(ratio - WORLD_SIZE * TOKENS / counts[e]) <= 1e-9
    own_ratios.append(ratio)

# %% [markdown]
# Dividing by an expert's own count would scale it by W · TOKENS / count, a different factor
# per expert. What uneven routing does change: the split sizes of both `all_to_all`s, and each
# expert's share of the work. A different number of tokens per *rank* would change the
# denominator: that is notebook 07's case, with its global token count.
#
# A router can also send no token at all to an expert. Here its bias sends every token to
# expert 0. Expert 1 then runs on an empty tensor, and its gradient is zero, not `None`:

# %%
starved = ToyMoE(HIDDEN, EP, SEED).double()
with torch.no_grad():
    starved.router.bias.copy_(torch.tensor([100.0, -100.0]))  # every token to expert 0
starved_ref, starved_counts = one_process(SEED, 4, starved)
starved_runs = gst.launch(every_way, world_size=4, args=([SEED], starved))

# %%
print(f"tokens per expert: {starved_counts}")
assert starved_counts == [4 * TOKENS, 0]
for r in starved_runs:
    got, e = r[SEED, "rule"]["grads"], r[SEED, "rule"]["ep_rank"]
    for w in ("weight", "bias"):
        assert torch.equal(got[f"experts.{e}.{w}"], starved_ref[f"experts.{e}.{w}"]) or (
            (got[f"experts.{e}.{w}"] - starved_ref[f"experts.{e}.{w}"]).abs().max() <= 1e-15)
    if e == 1:
        assert all(not got[f"experts.1.{w}"].any() for w in ("weight", "bias"))
print("expert 1, 0 tokens: its gradient is zeros on its ranks, as in one process;"
      " every other gradient = one process's")

# %% [markdown]
# Zeros, not `None`, matter twice. Every rank of the EDP group must call the same all-reduce,
# or the group hangs (notebook 04 shows such a hang; this one is not run here). And an optimizer skips a parameter
# whose `.grad` is `None`, weight decay included:

# %%
for grad in (None, torch.zeros(2)):
    p = nn.Parameter(torch.ones(2))
    p.grad = grad
    torch.optim.AdamW([p], lr=0.1, weight_decay=0.5).step()
    print(f".grad {'None' if grad is None else 'zeros'}: after one AdamW step {p.tolist()}")
    assert torch.equal(p.detach(), torch.ones(2)) == (grad is None)  # None: not even decayed

# %% [markdown]
# So that expert's copies drift apart: one rank decays it, another does not. NeMo
# Automodel#2995 (2026) fixed exactly that: "leaving every other local expert with
# `grad=None`. Those parameters then skip momentum decay, decoupled weight decay, and their
# optimizer step". So never skip an expert that received no tokens; run it on the empty tensor.
#
# ## The one rule of notebooks 02, 07, 08, 10, 11 and 12
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
#
# Here the experts' rule is the mean form: each rank's mean, ÷ W, the data shards. Notebooks 10
# and 11 reach the rule for 2-D meshes, tensor parallelism and pipelines. The table below is
# computed from this notebook's checks, at W = 4 but for its last row.

# %%
W4 = 4
ratio_of = lambda how: [r["ratio"] for r in compare(W4, how)]  # noqa: E731 (one line each)
fsdp_ratio = [(r["grads"]["weight"].norm() / ref4[f"experts.{r['ep_rank']}.weight"].norm()
               ).item() for r in fsdp[None]]
checks = [  # (notebooks, the rule's part, what this notebook did, its result)
    ("02", "÷ the data shards, W", "dense and router: SUM all, ÷ W",
     max(r["dense"] for r in compare(W4, "rule"))),
    ("12", "", "experts: SUM over EDP, ÷ W", max(r["expert"] for r in compare(W4, "rule"))),
    ("12", "never ÷ a group's size", "experts: SUM over EDP, ÷ EDP", ratio_of("÷ EDP")),
    ("10", "sum partial gradients", "experts: AVG over EDP", ratio_of("AVG")),
    ("12", "reduce over its holders", "experts: SUM all, ÷ W", ratio_of("like dense")),
    ("08", "FSDP2's factor = data", "experts: fully_shard(edp), default", fsdp_ratio),
    ("08", "", "experts: fully_shard(edp), factor W",
     max((r["grads"][w] - ref4[f"experts.{r['ep_rank']}.{w}"]).abs().max().item()
         for r in fsdp[4.0] for w in ("weight", "bias"))),
    ("11", "micro-batches: loss ÷ K", "2 micro-batches, then the rule",
     max(max(r["dense"], r["expert"]) for r in compare(W4, "micro-batches"))),
    ("07", "÷ the tokens in the loss", f"expert ÷ its own tokens (W = {WORLD_SIZE})",
     own_ratios),
]
print(f"W = {W4}, EP {EP}, EDP {W4 // EP} (the last row: W = {WORLD_SIZE}, computed above); "
      "result against one process on the union batch")
print(f"{'nb':<4}{'the rule':<26}{'this notebook':<38}result")
for nb, part, did, result in checks:
    shown = (f"exact ({result:.1g})" if isinstance(result, float)
             else "× " + ", ".join(f"{x:.3g}" for x in result))
    print(f"{nb:<4}{part:<26}{did:<38}{shown}")
exact = [c for c in checks if isinstance(c[3], float)]
assert len(exact) == 4 and all(c[3] <= 1e-15 for c in exact)
assert all(any(abs(x - 1) > 0.1 for x in c[3]) for c in checks if c not in exact)

# %% [markdown]
# Every exact row divides by W, the data shards in the loss. Every wrong row divides by
# something else: a group's size, or an expert's own tokens. The ranks of an EDP group each hold
# part of a sum, so `AVG` over them is wrong by the same × EP. Notebook 10 meets the same
# partial sums under tensor parallelism.
#
# ## How the frameworks spell it
#
# Each is quoted from its own code or pull request.
#
# * **torchtitan** divides expert gradients by the data size in `fsdp_gradient_divide_factor`,
#   `dp_replicate * dp_shard * cp`. Its comment: "Although the FSDP sharding of experts is done
#   on a mesh of a different size than other parameters, the gradient division factor should
#   be consistent with data" (`torchtitan/distributed/parallel_dims.py`,
#   pytorch/torchtitan@73bb964).
# * **Megatron-LM#5956** (2026): "expert gradients come out `ep_size` times too large". It
#   adds: "MCore DDP applies exactly this correction as `expert_gradient_scaling_factor =
#   expt_dp / dp`".
# * **DeepSpeed#5259** (2024): "MoE parameter grads should be summed using ep_dp_group and
#   scaled using dp group". Before the fix, "parameter gradients are exactly **2x**".
#   DeepSpeed#6546 made the same change in ZeRO: "divide edp_world_size -> divide
#   dp_world_size".
# * **pytorch#160285** (2025, open): "the gradients are doubled with EP=2". Its author adds that
#   "loss curves are equivalent even with the doubled gradients".
#
# ## Copy this into your code
#
# `snippets/12_expert_gradients.py` is a whole script in plain torch. Run it with
# `torchrun --standalone --nproc-per-node 2` (or 4). It builds the layer with the two
# `all_to_all`s and applies the rule. Then it checks, on every rank, that the gradients equal
# one process's, and that dividing by the EDP size gives × EP.
#
# <!-- snippets/12_expert_gradients.py -->
# ```python
# """Notebook 12, copy this into your code: a top-1 mixture-of-experts layer with expert
# parallelism, and its gradients reduced right: experts over their expert-data-parallel group,
# everything divided by the whole data-parallel size.
#
#     torchrun --standalone --nproc-per-node 2 snippets/12_expert_gradients.py  # or 4 ranks
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
# import torch.nn.functional as F
# from torch import nn
# from torch.distributed.device_mesh import init_device_mesh
#
# EP, HIDDEN, TOKENS = 2, 8, 16  # experts (one per rank of an EP group), features, tokens/rank
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
# class MoE(nn.Module):
#     """A dense layer, a top-1 router, EP experts. forward(): all experts, one process."""
#
#     def __init__(self):
#         super().__init__()
#         self.dense, self.router = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, EP)
#         self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EP))
#
#     def route(self, x):
#         h = torch.tanh(self.dense(x))
#         logits = self.router(h)
#         choice = logits.argmax(dim=-1)                     # each token's expert
#         return h, choice, logits.softmax(dim=-1).gather(1, choice[:, None])  # the gate
#
#     def forward(self, x):
#         h, choice, gate = self.route(x)
#         y = torch.zeros_like(h)
#         for e, expert in enumerate(self.experts):
#             y[choice == e] = expert(h[choice == e])
#         return gate * y
#
#
# class AllToAll(torch.autograd.Function):
#     """all_to_all_single with uneven splits; the backward sends the gradients back."""
#
#     @staticmethod
#     def forward(ctx, x, send, recv, group):
#         ctx.send, ctx.recv, ctx.group = send, recv, group
#         out = x.new_empty(sum(recv), *x.shape[1:])
#         dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
#         return out
#
#     @staticmethod
#     def backward(ctx, grad):
#         back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
#         dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
#         return back, None, None, None
#
#
# def expert_parallel(layer, expert, x, ep_group):
#     """The layer on this rank: its tokens x, its one expert; the others on ep_group."""
#     h, choice, gate = layer.route(x)
#     order = torch.argsort(choice, stable=True)         # tokens sorted by expert = by EP rank
#     send = torch.bincount(choice, minlength=EP)
#     recv = torch.empty_like(send)
#     dist.all_to_all_single(recv, send, group=ep_group)  # how many tokens each rank sends me
#     send, recv = send.tolist(), recv.tolist()
#     routed = AllToAll.apply(h[order], send, recv, ep_group)              # dispatch
#     back = AllToAll.apply(expert(routed), recv, send, ep_group)          # combine
#     return gate * back[torch.argsort(order)]
#
#
# def sync_moe_gradients(dense_params, expert_params, expert_group, divide_by=None):
#     """After each rank's backward on the mean loss over its own tokens: every .grad is one
#     process's on every rank's tokens. divide_by: what to divide by (default: right)."""
#     world_size = dist.get_world_size()                 # every rank brought tokens
#     for p in dense_params:
#         dist.all_reduce(p.grad)                        # SUM over all ranks
#         p.grad /= world_size
#     for p in expert_params:
#         dist.all_reduce(p.grad, group=expert_group)    # SUM over the ranks holding this expert
#         p.grad /= divide_by or world_size              # NOT the expert group's size: × EP
#
#
# def main():
#     device = init_distributed()
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     if world_size % EP:                                # a mesh would leave ranks out: refuse
#         raise SystemExit(f"run a multiple of EP = {EP} ranks (--nproc-per-node 2, 4...), not "
#                          f"{world_size}: each expert-parallel group holds EP ranks")
#     mesh = init_device_mesh(device.type, (world_size // EP, EP), mesh_dim_names=("edp", "ep"))
#     ep_rank, edp_group = mesh.get_local_rank("ep"), mesh["edp"].get_group()
#     torch.manual_seed(0)                               # the same initial weights on every rank
#     whole = MoE().to(device, torch.float64)
#     g = torch.Generator().manual_seed(1)               # one global batch, a slice per rank
#     x = torch.randn(world_size * TOKENS, HIDDEN, generator=g, dtype=torch.float64).to(device)
#     y = torch.randn(world_size * TOKENS, HIDDEN, generator=g, dtype=torch.float64).to(device)
#     mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
#
#     grads = {}
#     for name, divide_by in (("right", None), ("÷ EDP", dist.get_world_size(edp_group))):
#         layer = copy.deepcopy(whole)
#         expert = layer.experts[ep_rank]                # this rank uses only its own expert
#         out = expert_parallel(layer, expert, x[mine], mesh["ep"].get_group())
#         F.mse_loss(out, y[mine]).backward()            # the mean over this rank's tokens
#         dense = [*layer.dense.parameters(), *layer.router.parameters()]
#         sync_moe_gradients(dense, list(expert.parameters()), edp_group, divide_by)
#         grads[name] = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
#
#     # Check: one process on every rank's tokens, every expert in it.
#     F.mse_loss(whole(x), y).backward()
#     for n, g_ in grads["right"].items():
#         torch.testing.assert_close(g_, dict(whole.named_parameters())[n].grad)
#     w = f"experts.{ep_rank}.weight"
#     torch.testing.assert_close(grads["÷ EDP"][w], EP * dict(whole.named_parameters())[w].grad)
#     print(f"rank {rank}: on {device.type} ({dist.get_backend()}), expert {ep_rank}, EDP "
#           f"{world_size // EP}: gradients == one process's; ÷ the EDP size gives {EP}×")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# ## Exercise
#
# Write `sync_moe_gradients(dense_params, expert_params, expert_group)`. Every rank has run
# `backward()` on the mean loss over its own tokens, through an expert-parallel layer.
# `dense_params` are replicated on every rank. `expert_params` are this rank's expert's, and
# `expert_group` holds the ranks with the same expert. Afterwards every `.grad` must equal one
# process's on every rank's tokens.
#
# The check runs it on 2 ranks (EP 2), 3 ranks (EP 3) and 4 ranks (EP 2, EDP 2), on fresh
# random tokens. It says so if you divided by the expert group's size, reduced experts over all
# ranks, or skipped a group. Until you write the function, it says "not attempted yet". Stuck?
# `%load solutions/12_sync_moe_gradients.py` in a new cell.

# %%
def sync_moe_gradients(dense_params, expert_params, expert_group):
    # your code here: dense, SUM over all ranks; experts, SUM over expert_group; both ÷ W
    raise NotImplementedError("write sync_moe_gradients")


# %%
gst.exercises.check_sync_moe_gradients(sync_moe_gradients)

# %% [markdown]
# ## Summary
#
# * An expert's gradient on one rank already sums the tokens of its whole EP group.
# * Sum it over its EDP group, then divide by W, every rank that brought tokens: exact.
# * Dividing by the EDP size gives × EP; FSDP2's default factor on the EDP mesh does the same.
#   `set_gradient_divide_factor(W)` fixes it.
# * Reducing experts over all ranks gives each expert the sum of both experts' gradients.
# * Uneven routing changes no denominator. A zero-token expert's gradient is zeros: keep it in
#   the all-reduce.
