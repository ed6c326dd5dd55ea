# %% [markdown]
# # 07 — Which mean? Tokens, micro-batches and ranks
#
# **Question: each rank's loss is a mean over its own number of tokens. Is "each rank's mean, then
# DDP's mean over the ranks" the mean over the global batch, and if not, what do I divide by?**
#
# **Short answer:** divide each rank's **sum** of token losses by the **global** number of valid
# tokens. Count them over every micro-batch of every rank, with one `all_reduce` of one number.
# Under DDP, also multiply by the world size N, because DDP divides by N. With notebook 02's
# `all_reduce(SUM)` and no division, leave out the × N. The per-rank mean, and the mean per
# micro-batch, are right only when every rank and every micro-batch hold the same number of tokens.
# The rest of this notebook measures each of these sentences. It works in float64 where it claims
# exactness, with float32 next to it.
#
# Notebook 02 proved that `all_reduce(SUM)` then `/ world_size` averages the gradients. Notebook
# 04's mean-of-means pitfall showed the catch. Dividing by the world size is right only when every
# rank's loss is a mean over **the same number of items**. With variable-length sequences (padding,
# `ignore_index`), the items are tokens. The ranks, and the micro-batches of gradient accumulation,
# hold different numbers of them.
#
# This is the "gradient accumulation bug" that LLM trainers fixed in 2024, and its distributed twin.
# Hugging Face's write-up says: "Gradient accumulation is *supposed* to be mathematically equivalent
# to full batch training; however, losses did not match between training runs where the setting was
# toggled on and off" ([huggingface/blog#2414](https://github.com/huggingface/blog/pull/2414)). The
# fix is [transformers#34191](https://github.com/huggingface/transformers/pull/34191).

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: fewer steps, same checks
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
MICRO_BATCHES = 2  # gradient accumulation: micro-batches per rank and step
LINES_PER_MICRO_BATCH = 2
LR = 1.0
TRAIN_STEPS = 15 if SMOKE_TEST else 60
TIMED_STEPS = 10 if SMOKE_TEST else 100

import copy
import statistics
import time
from contextlib import nullcontext

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_tutorial as gst

LINES, IGNORE_INDEX = gst.tokens.LINES, gst.tokens.IGNORE_INDEX

# %% [markdown]
# ## The task: lines of text, of different lengths
#
# The task is a character-level language model: given a character, predict the next one. Each line
# of `gst.tokens.LINES` (short sentences, in memory) is one sequence. A line of L characters gives L
# − 1 tokens to predict. A batch pads its lines to the longest. It pads the inputs with 0, and the
# targets with `IGNORE_INDEX` (−100), which `F.cross_entropy` skips.

# %%
inputs, targets = gst.tokens.pad(["sum, then divide", "ok"])
print("inputs: ", inputs.tolist())
print("targets:", targets.tolist())
print("valid tokens per line:", (targets != IGNORE_INDEX).sum(dim=1).tolist())
assert (targets != IGNORE_INDEX).sum(dim=1).tolist() == [15, 1]
tokens_per_line = sorted(len(line) - 1 for line in LINES)
print(f"{len(LINES)} lines of {tokens_per_line[0]} to {tokens_per_line[-1]} tokens: 2 lines hold "
      f"{sum(tokens_per_line[:2])} to {sum(tokens_per_line[-2:])} valid tokens")

# %% [markdown]
# The model is as small as a language model gets: an embedding and a linear layer (a "bigram"
# model). Every rank starts from the same initial weights, from the same seed, as in notebook 02.
# The loss is written as a **sum** over the valid tokens. `F.cross_entropy`'s default, the mean over
# the valid tokens, is that sum divided by their count:

# %%
def make_model():
    return nn.Sequential(nn.Embedding(gst.tokens.VOCAB_SIZE, 16),
                         nn.Linear(16, gst.tokens.VOCAB_SIZE))


def valid_tokens(targets):
    return (targets != IGNORE_INDEX).sum()  # padding is not a token


def loss_sum(model, inputs, targets):
    """The cross-entropy summed over the valid tokens (a sum, not a mean)."""
    logits = model(inputs)  # (lines, positions, VOCAB_SIZE)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


torch.manual_seed(SEED)
model = make_model()
mean_loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                            ignore_index=IGNORE_INDEX)
print(f"F.cross_entropy's mean {mean_loss.item():.6f} = loss sum / valid tokens "
      f"{(loss_sum(model, inputs, targets) / valid_tokens(targets)).item():.6f}")
assert torch.allclose(mean_loss, loss_sum(model, inputs, targets) / valid_tokens(targets))


# %% [markdown]
# One step's global batch holds lines drawn at random. They are dealt to the ranks and, on each
# rank, to its micro-batches. Training code often **groups lines by length** to waste less padding.
# Then a step's short lines land on one rank and its long ones on another. `by_length=True` does
# that.

# %%
def draw(step, micro_batches=1, lines_per_micro_batch=4, world_size=WORLD_SIZE,
         by_length=False):
    """One step's lines as batch[rank][micro-batch] -> a list of lines."""
    order = torch.randperm(len(LINES), generator=torch.Generator().manual_seed(SEED + step))
    per_rank = micro_batches * lines_per_micro_batch
    lines = [LINES[i] for i in order[: world_size * per_rank]]
    if by_length:
        lines.sort(key=len)  # rank 0 gets the shortest lines
    return [[lines[r * per_rank + k * lines_per_micro_batch:][:lines_per_micro_batch]
             for k in range(micro_batches)] for r in range(world_size)]


def token_counts(batch):
    """The valid tokens of each rank's micro-batches: counts[rank][micro-batch]."""
    return [[valid_tokens(gst.tokens.pad(lines)[1]).item() for lines in rank] for rank in batch]


grouped = draw(0, by_length=True)
shuffled = draw(0)
for name, batch in [("grouped by length", grouped), ("shuffled", shuffled)]:
    print(f"{name}: valid tokens per rank {[sum(c) for c in token_counts(batch)]}")
    for rank, lines in enumerate(batch):
        print(f"  rank {rank}: {lines[0]}")
assert len({sum(c) for c in token_counts(grouped)}) == WORLD_SIZE  # every rank a different count

# %% [markdown]
# ## The reference: one process, the whole batch
#
# What N ranks must reproduce is one process that takes every line of every rank's micro-batches as
# one batch. It uses PyTorch's own mean over the valid tokens, `F.cross_entropy`'s default
# `reduction="mean"`. That is the sum of the token losses divided by the number of valid tokens.

# %%
def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def reference(batch, dtype=torch.float64, model=None):
    """One process on the union of every rank's micro-batches: its gradient and loss. `model`:
    start from these weights (a copy) instead of the seeded initial ones."""
    if model is None:
        torch.manual_seed(SEED)
        model = make_model().to(gst.local_device(), dtype)
    else:
        model = copy.deepcopy(model)
        model.zero_grad()
    device = next(model.parameters()).device
    lines = [line for rank in batch for micro_batch in rank for line in micro_batch]
    inputs, targets = (t.to(device) for t in gst.tokens.pad(lines))
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX)  # the mean over the valid tokens
    loss.backward()
    return {"grad": flat_grad(model).cpu(), "loss": loss.item()}


def off(grad, ref):
    """(relative error, max abs difference) of a gradient against the reference's."""
    diff = (grad - ref["grad"]).double()
    return (diff.norm() / ref["grad"].double().norm()).item(), diff.abs().max().item()


# %% [markdown]
# ## The step on N ranks, three ways to divide
#
# Each rank runs `backward()` on each of its micro-batches. `mean` says what divides each
# micro-batch's loss sum. Under DDP, every micro-batch but the last runs inside `no_sync()`. So DDP
# averages once, in the last backward (notebook 03's accumulation pitfall).
#
# * `"per rank"`: this rank's sum over its own count, so each rank's mean, then DDP's mean over the
#   ranks. The usual code, `F.cross_entropy(logits, targets)`, computes exactly this (with one
#   micro-batch).
# * `"per micro-batch"`: each micro-batch's own mean, divided by the number of micro-batches K. This
#   is the 2024 accumulation bug: `F.cross_entropy(...) / K`.
# * `"global"`: the fix. Count this rank's valid tokens over all its micro-batches. `all_reduce` the
#   count, so every rank receives the global count, and divide by it. Then multiply by N, because
#   DDP divides the summed gradients by N, like notebook 02's `average_gradients`.

# %%
def backward_over(model, micro_batches, mean, times_world_size=True):
    """backward() on each of this rank's micro-batches (inputs, targets), each loss sum divided
    as `mean` says. Returns this rank's loss sum and valid-token count, for logging."""
    rank_count = sum(valid_tokens(targets) for _, targets in micro_batches)
    if mean == "global":
        global_count = rank_count.clone()
        dist.all_reduce(global_count)  # every rank receives the count over all ranks
        scale = dist.get_world_size() if times_world_size else 1
    total = 0.0
    for k, (inputs, targets) in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with model.no_sync() if isinstance(model, DDP) and not last else nullcontext():
            loss = loss_sum(model, inputs, targets)
            if mean == "per micro-batch":  # the 2024 bug: each micro-batch's mean, / K
                scaled = loss / valid_tokens(targets) / len(micro_batches)
            elif mean == "per rank":  # this rank's mean; DDP then takes the mean over ranks
                scaled = loss / rank_count
            else:  # the fix: / the global count, × N because DDP divides by N
                scaled = loss / global_count * scale
            scaled.backward()  # adds this micro-batch's gradient into .grad
        total = total + loss.detach()
    return total, rank_count


# %% [markdown]
# The step itself: the model, DDP (or notebook 02's functions, read from notebook 02), the
# micro-batches on this rank's device, and what each rank would log. The collectives are counted
# (`gst.detect.count_collectives`, notebook 04).

# %%
average_gradients = gst.notebooks.load_function("02_manual_allreduce_averaging",
                                                "average_gradients")
sum_gradients = gst.notebooks.load_function("02_manual_allreduce_averaging", "sum_gradients")


def step(rank, world_size, batch, mean, spelling="DDP", dtype=torch.float64):
    torch.manual_seed(SEED)  # the same initial weights on every rank
    device = gst.local_device()
    model = make_model().to(device, dtype)
    micro_batches = [[t.to(device) for t in gst.tokens.pad(lines)] for lines in batch[rank]]
    with gst.detect.count_collectives() as calls:
        wrapped = calls.watch(DDP(model)) if spelling.startswith("DDP") else model
        total, count = backward_over(wrapped, micro_batches, mean,
                                     times_world_size=spelling in ("DDP", "average_gradients"))
        if spelling == "average_gradients":
            average_gradients(model)  # notebook 02's: all_reduce(SUM), then / N
        elif spelling == "SUM only":
            sum_gradients(model)  # notebook 02's popular answer: all_reduce(SUM), no division
    totals = torch.stack([total, count.to(dtype)])
    own_loss = (totals[0] / totals[1]).item()  # this rank's own mean: what it would print
    dist.all_reduce(totals)  # [loss sum, valid tokens] over all ranks
    return {"grad": flat_grad(model), "own loss": own_loss, "calls": dict(calls.calls),
            "all_reduce sizes": [args[0].numel() for args, _ in calls.arguments["all_reduce"]],
            "global loss": (totals[0] / totals[1]).item(), "tokens": count.item()}


def run(batch, mean, spelling="DDP", dtypes=(torch.float64, torch.float32)):
    """The step on WORLD_SIZE ranks, in each dtype: rank 0's result, and its error."""
    results = {}
    for dtype in dtypes:
        ranks = gst.launch(step, WORLD_SIZE, args=(batch, mean, spelling, dtype))
        assert all(torch.equal(r["grad"], ranks[0]["grad"]) for r in ranks)  # replicas agree
        results[dtype] = {**ranks[0], "off": off(ranks[0]["grad"], reference(batch, dtype)),
                          "ranks": ranks}
    return results


def show(name, results):
    row = "; ".join(f"{str(dtype)[6:]}: off by {rel:.2g} (max |difference| {worst:.2g})"
                    for dtype, r in results.items() for rel, worst in [r["off"]])
    print(f"{name:32} {row}")


# %% [markdown]
# ## 1. The per-rank mean under DDP is wrong
#
# One step without accumulation (one micro-batch of 4 lines per rank), against one process on the
# same 4 × N lines. "Off by" is the relative error of the gradient, |g − g_ref| / |g_ref|:

# %%
per_rank = {name: run(batch, "per rank") for name, batch in
            [("grouped by length", grouped), ("shuffled", shuffled)]}
for name, results in per_rank.items():
    show(f"per-rank mean, {name}", results)

# %%
for results in per_rank.values():
    for r in results.values():
        assert r["off"][0] > 1e-2  # wrong, far beyond rounding, in float64 and float32
assert per_rank["grouped by length"][torch.float64]["off"][0] > 0.1

# %% [markdown]
# Why: rank r's tokens get the weight 1 / (N · n_r) instead of 1 / Σ n. So a rank holding few tokens
# counts each of them more. How wrong it is depends on how different the counts are. Here each rank
# gets 4 lines of more than 30 tokens. They are cut to 30 tokens on even ranks, and to 30 / ratio on
# odd ones. At a ratio of 1, every rank holds the same number of tokens:

# %%
RATIOS = [1, 2, 3, 5, 10, 15, 30]
long_lines = [line for line in LINES if len(line) > 30][: 4 * WORLD_SIZE]


def cut(ratio):
    """4 lines per rank: 30 tokens each on even ranks, 30 // ratio on odd ranks."""
    keep = [31, 30 // ratio + 1]  # characters per line: tokens + 1
    return [[[line[: keep[rank % 2]] for line in long_lines[4 * rank: 4 * rank + 4]]]
            for rank in range(WORLD_SIZE)]


sweep = {ratio: run(cut(ratio), "per rank") for ratio in RATIOS}

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for dtype, style in [(torch.float64, "o-"), (torch.float32, "x--")]:
    ax.plot(RATIOS, [sweep[r][dtype]["off"][0] for r in RATIOS], style, label=str(dtype)[6:])
ax.set(xscale="log", xticks=RATIOS, xticklabels=RATIOS, ylim=(0, None),
       xlabel="tokens on even ranks / tokens on odd ranks", ylabel="|g - g_ref| / |g_ref|",
       title="Per-rank mean + DDP vs one process: the gradient's error")
ax.grid(alpha=0.3)
ax.legend()
plt.show()
errors = [sweep[r][torch.float64]["off"][0] for r in RATIOS]
print("ratio:", RATIOS)
print("error:", [f"{e:.2g}" for e in errors])
assert errors[0] <= 1e-12  # equal counts: the per-rank mean is right
assert all(a < b for a, b in zip(errors, errors[1:], strict=False))  # grows with the imbalance
assert errors[-1] > 0.3

# %% [markdown]
# ## 2. The fix: divide by the global count
#
# The same steps with `mean="global"`: DDP with the × N, notebook 02's `average_gradients` (SUM,
# then / N) with the × N, and notebook 02's SUM without dividing, without the × N:

# %%
fixed = {spelling: run(grouped, "global", spelling)
         for spelling in ("DDP", "average_gradients", "SUM only")}
for spelling, results in fixed.items():
    show(f"global count, {spelling}", results)

# %%
for results in fixed.values():
    assert results[torch.float64]["off"][0] <= 1e-12  # = one process, to float64 rounding
    assert results[torch.float32]["off"][0] <= 1e-5
spellings = [results[torch.float64]["grad"] for results in fixed.values()]
agree = max((g - spellings[0]).abs().max().item() for g in spellings)
print(f"the three spellings agree to {agree:.2g} (float64)")
assert agree <= 1e-14
for spelling, results in fixed.items():
    r = results[torch.float64]
    print(f"collectives, {spelling}: {r['calls']}, all_reduce sizes {r['all_reduce sizes']}")
bug_calls = per_rank["grouped by length"][torch.float64]["calls"]
print(f"collectives, per-rank mean under DDP: {bug_calls}")
assert bug_calls == {gst.detect.DDP_KEY: 1}
assert fixed["DDP"][torch.float64]["calls"] == {gst.detect.DDP_KEY: 1, "all_reduce": 1}
assert fixed["DDP"][torch.float64]["all_reduce sizes"] == [1]  # the count: one number

# %% [markdown]
# Under DDP the fix makes one `all_reduce` more than the bug: the count, one number.
# (`average_gradients` and `sum_gradients` reduce each of the model's 3 parameters on its own, as in
# notebook 02, after the count.) The × N is what people forget. Without it, under DDP, every
# gradient is N times too small: the learning rate divided by N.

# %%
forgot = run(grouped, "global", "DDP, no × N", dtypes=(torch.float64,))[torch.float64]
c = (forgot["grad"].dot(fixed["DDP"][torch.float64]["grad"])
     / fixed["DDP"][torch.float64]["grad"].norm() ** 2).item()
print(f"global count without the × N, under DDP: the gradient is {c:.6f} × the right one "
      f"(1 / {WORLD_SIZE} = {1 / WORLD_SIZE:.6f})")
assert abs(c - 1 / WORLD_SIZE) <= 1e-12
assert torch.allclose(forgot["grad"], c * fixed["DDP"][torch.float64]["grad"], rtol=1e-12, atol=0)


# %% [markdown]
# ## 3. Gradient accumulation with unequal micro-batches
#
# The 2024 bug needs no second GPU. Take one process and one batch cut into K micro-batches. Divide
# each micro-batch's mean by K: the classic accumulation recipe, notebook 01's exercise. The result
# is the mean over the K micro-batches' means. It is right only when every micro-batch holds the
# same number of tokens.

# %%
accumulated = draw(0, MICRO_BATCHES, LINES_PER_MICRO_BATCH, by_length=True)
print("valid tokens, counts[rank][micro-batch]:", token_counts(accumulated))

one_rank = accumulated[0]  # rank 0's micro-batches, in one process
ref_one = reference([one_rank])
for mean in ("per micro-batch", "global"):
    torch.manual_seed(SEED)
    model = make_model().to(gst.local_device(), torch.float64)
    micro_batches = [[t.to(gst.local_device()) for t in gst.tokens.pad(lines)]
                     for lines in one_rank]
    count = sum(valid_tokens(targets) for _, targets in micro_batches)
    for inputs, targets in micro_batches:
        loss = loss_sum(model, inputs, targets)
        if mean == "per micro-batch":
            (loss / valid_tokens(targets) / len(micro_batches)).backward()  # the 2024 bug
        else:
            (loss / count).backward()  # the sum over all micro-batches / their count
    rel, worst = off(flat_grad(model).cpu(), ref_one)
    print(f"one process, {mean:15}: off by {rel:.2g} (max |difference| {worst:.2g})")
    assert (rel > 1e-2) if mean == "per micro-batch" else (rel <= 1e-12)

# %% [markdown]
# On N ranks the micro-batches differ within a rank and the ranks differ from each other. The count
# must run over both: all the micro-batches of all the ranks.

# %%
accumulation = {mean: run(accumulated, mean) for mean in ("per micro-batch", "per rank",
                                                           "global")}
for mean, results in accumulation.items():
    show(f"{mean}, {MICRO_BATCHES} micro-batches", results)

# %%
assert accumulation["per micro-batch"][torch.float64]["off"][0] > 0.1
assert accumulation["per rank"][torch.float64]["off"][0] > 1e-2
assert accumulation["global"][torch.float64]["off"][0] <= 1e-12
assert accumulation["global"][torch.float32]["off"][0] <= 1e-5
calls = accumulation["global"][torch.float64]["calls"]
print(f"{MICRO_BATCHES} micro-batches, no_sync: {calls}")
assert calls == {gst.detect.DDP_KEY: 1, "all_reduce": 1}  # DDP synced once; one count

# %% [markdown]
# These are the 4 × N lines of section 1's grouped batch, only split into 2 micro-batches of 2 lines
# instead of 1 of 4. The fix gives the same gradient for both splits. With the mean per micro-batch,
# changing the number of accumulation steps changes the step:

# %%
same_lines = [sorted(line for micro_batch in rank for line in micro_batch) for rank in grouped]
assert same_lines == [sorted(line for mb in rank for line in mb) for rank in accumulated]
split_gap = {mean: (accumulation[mean][torch.float64]["grad"]
                    - per_rank["grouped by length"][torch.float64]["grad"]).abs().max().item()
             for mean in ("per micro-batch", "global")}
fix_gap = (accumulation["global"][torch.float64]["grad"]
           - fixed["DDP"][torch.float64]["grad"]).abs().max().item()
print(f"1 vs {MICRO_BATCHES} micro-batches, same lines: the fix's gradients differ by "
      f"{fix_gap:.2g}, the mean per micro-batch's by {split_gap['per micro-batch']:.2g}")
assert fix_gap <= 1e-14 and split_gap["per micro-batch"] > 1e-2

# %% [markdown]
# ## 4. The logged loss
#
# Each rank usually prints its own loss. With different token counts, neither a rank's own mean nor
# the mean of the ranks' means is the global batch's loss. The global loss takes one more
# `all_reduce`, of the loss sum and the count together. `step` above does it after `backward_over`:

# %%
r = accumulation["global"][torch.float64]
ref_loss = reference(accumulated)["loss"]
own = [rank["own loss"] for rank in r["ranks"]]
print(f"each rank's own mean: {[round(x, 4) for x in own]}; their mean {sum(own) / len(own):.4f}")
print(f"global loss (all-reduced sum / count): {r['global loss']:.4f}; one process: {ref_loss:.4f}")
assert all(abs(rank["global loss"] - ref_loss) <= 1e-12 for rank in r["ranks"])
assert abs(sum(own) / len(own) - ref_loss) > 1e-2 and all(abs(x - ref_loss) > 1e-2 for x in own)

# %% [markdown]
# And why the bug survived in real trainers: **the loss curve looks right**. Train `TRAIN_STEPS`
# steps of SGD on batches grouped by length, each way, and log the global loss correctly in every
# run. At each step, also measure the gradient's error against one process on the same weights and
# the same batch.

# %%
def train(rank, world_size, mean, steps, lr=LR, dtype=torch.float64):
    torch.manual_seed(SEED)
    device = gst.local_device()
    model = DDP(make_model().to(device, dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    logged, errors = [], []
    for i in range(steps):
        batch = draw(i, MICRO_BATCHES, LINES_PER_MICRO_BATCH, world_size, by_length=True)
        micro_batches = [[t.to(device) for t in gst.tokens.pad(lines)] for lines in batch[rank]]
        optimizer.zero_grad()
        total, count = backward_over(model, micro_batches, mean)
        totals = torch.stack([total, count.to(dtype)])
        dist.all_reduce(totals)  # the global loss, logged the same way in every run
        logged.append((totals[0] / totals[1]).item())
        errors.append(off(flat_grad(model.module).cpu(), reference(batch, model=model.module))[0])
        optimizer.step()
    return {"logged": logged, "errors": errors}


runs = {mean: gst.launch(train, WORLD_SIZE, args=(mean, TRAIN_STEPS))[0]
        for mean in ("per micro-batch", "per rank", "global")}

# %%
labels = {"per micro-batch": "mean per micro-batch / K (the 2024 bug)",
          "per rank": "mean per rank (DDP's mean of means)", "global": "global count (the fix)"}
fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, layout="constrained")
gst.plots.plot_loss_curves({labels[mean]: r["logged"] for mean, r in runs.items()}, ax=top,
                           title="The global loss, logged right, of three trainings", xlabel="")
for line, (mean, r) in zip(top.lines, runs.items(), strict=True):
    if mean != "global":  # the fix's error is at most 1e-12: below this axis
        bottom.plot(r["errors"], color=line.get_color(), label=labels[mean])
bottom.set(yscale="log", xlabel="step", ylabel="gradient's relative error",
           title="The same runs: each step's gradient against one process")
bottom.axhline(0.05, color="grey", lw=0.8, ls="--", label="5%")
bottom.legend(fontsize=8)
plt.show()
drop = runs["global"]["logged"][0] - min(runs["global"]["logged"])
for mean, r in runs.items():
    gap = statistics.mean(abs(a - b) for a, b in zip(r["logged"], runs["global"]["logged"],
                                                     strict=True))
    print(f"{mean:15}: loss {r['logged'][0]:.3f} -> {r['logged'][-1]:.3f}, mean |gap to the "
          f"fix's curve| {gap:.3f} ({gap / drop:.0%} of its fall); gradient off by "
          f"{min(r['errors']):.2g} to {max(r['errors']):.2g} "
          f"(median {statistics.median(r['errors']):.2g})")
    assert r["logged"][-1] < r["logged"][0] - 0.5 * drop  # every curve falls
    if mean != "global":
        assert gap < 0.1 * drop  # close to the fix's curve...
        assert min(r["errors"]) > 0.05  # ...while every step's gradient is off by over 5%
assert max(runs["global"]["errors"]) <= 1e-12

# %% [markdown]
# Every curve falls, and the buggy ones stay close to the fix's: a mean gap under 10% of its fall.
# Yet at every step their gradient is off by more than 5% (the lower panel). The output gives the
# median and the largest error of each. The bug does not stop training: it trains on another
# objective. In that
# mean, the tokens of short lines, of small micro-batches and of ranks with few tokens weigh more.
# Nothing in the curve says so. Comparing one step with one process, as this notebook does, shows
# it.
#
# ## When the per-rank mean is right
#
# The per-rank mean is right when every rank and every micro-batch holds **the same number of
# tokens**. That means no padding and no `ignore_index`, as when text is packed into pieces of one
# length (`gst.tokens.pack`). Then 1 / (N · K · n) is 1 / Σ n, and every recipe above is the same:

# %%
pieces = iter(gst.tokens.pack(WORLD_SIZE * MICRO_BATCHES * LINES_PER_MICRO_BATCH, 24))
packed = [[[next(pieces) for _ in range(LINES_PER_MICRO_BATCH)] for _ in range(MICRO_BATCHES)]
          for _ in range(WORLD_SIZE)]
print("valid tokens, counts[rank][micro-batch]:", token_counts(packed))
equal = {mean: run(packed, mean) for mean in ("per micro-batch", "per rank", "global")}
for mean, results in equal.items():
    show(f"{mean}, packed", results)
for results in equal.values():
    assert results[torch.float64]["off"][0] <= 1e-12 and results[torch.float32]["off"][0] <= 1e-5

# %% [markdown]
# Equal counts per rank are not enough under accumulation: the micro-batches of each rank must be
# equal too. Here every rank holds the same number of tokens. One micro-batch holds lines of 12
# tokens and the other lines of 24, in the other order on odd ranks:

# %%
short, long = gst.tokens.pack(2 * WORLD_SIZE, 12), gst.tokens.pack(2 * WORLD_SIZE, 24)
equal_ranks = [[short[2 * r: 2 * r + 2], long[2 * r: 2 * r + 2]][:: 1 if r % 2 == 0 else -1]
               for r in range(WORLD_SIZE)]
print("valid tokens, counts[rank][micro-batch]:", token_counts(equal_ranks))
assert len({sum(counts) for counts in token_counts(equal_ranks)}) == 1
unequal_micro = {mean: run(equal_ranks, mean) for mean in ("per rank", "per micro-batch")}
for mean, results in unequal_micro.items():
    show(f"{mean}, equal ranks", results)
assert unequal_micro["per rank"][torch.float64]["off"][0] <= 1e-12
assert unequal_micro["per micro-batch"][torch.float64]["off"][0] > 1e-2

# %% [markdown]
# Dropped or filtered samples, masked prompt tokens in fine-tuning, or a last partial batch break
# the equality again. So counting is the safe default.
#
# ## What counting costs
#
# Counting costs one `all_reduce` of one number per step (section 2 counted it), whatever the size
# of the model. In time, that is at least one small collective's latency (notebook 05's α). It is
# also one more point where every rank waits for the slowest, so it can cost more. Measured side
# by side: whole steps (forward, backward, DDP, SGD) with the per-rank mean and with the global
# count, interleaved. The models are the lesson's (width 16) and a wider one (width 512, with a
# hidden layer), in float32, with 2 micro-batches.

# %%
def time_steps(rank, world_size, width, steps):
    torch.manual_seed(SEED)
    device = gst.local_device()
    layers = [nn.Embedding(gst.tokens.VOCAB_SIZE, width)]
    if width > 16:  # the wider model: one hidden layer more
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = DDP(nn.Sequential(*layers, nn.Linear(width, gst.tokens.VOCAB_SIZE)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = draw(0, MICRO_BATCHES, LINES_PER_MICRO_BATCH, world_size, by_length=True)
    micro_batches = [[t.to(device) for t in gst.tokens.pad(lines)] for lines in batch[rank]]
    seconds = {"per rank": [], "global": []}
    for i in range(steps + 5):  # 5 warm-up steps, not kept
        for mean in (("per rank", "global") if i % 2 else ("global", "per rank")):
            start = time.perf_counter()
            optimizer.zero_grad()
            backward_over(model, micro_batches, mean)
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 5:
                seconds[mean].append(time.perf_counter() - start)
    return {mean: statistics.median(s) for mean, s in seconds.items()}


timed = {width: gst.launch(time_steps, WORLD_SIZE, args=(width, TIMED_STEPS))[0]
         for width in (16, 512)}
load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

# %%
print(f"median of {TIMED_STEPS} steps each, {WORLD_SIZE} ranks, {os.cpu_count()} CPU cores, "
      f"load average {load:.1f} while measuring"
      + (" (other programs were running: noisy)" if load > (os.cpu_count() or 1) else ""))
for width, t in timed.items():
    extra = t["global"] - t["per rank"]
    print(f"width {width:3}: step {t['per rank'] * 1e3:.2f} ms with the per-rank mean, "
          f"{t['global'] * 1e3:.2f} ms with the count: ratio {t['global'] / t['per rank']:.2f} "
          f"({extra * 1e3:+.2f} ms)")
assert all(t["global"] > 0 and t["per rank"] > 0 for t in timed.values())

# %% [markdown]
# These steps last a few milliseconds, so one more collective is a visible share of them. Its bytes
# do not grow with the model: one number. Its time is latency and waiting, which this machine's
# neighbours change from run to run. A difference below zero is that noise, larger than the count's
# cost. So time your own step to see yours: the longer the step, the smaller the share. The
# torchtitan trainer keeps the count on the GPU, to avoid a CPU synchronization (quoted below).
#
# ## How the frameworks spell it
#
# Both frameworks count the valid tokens of the whole step, micro-batches and ranks, before the
# first backward. (Hugging Face's Trainer counts over the ranks with its default,
# `average_tokens_across_devices=True`.) Both divide a sum by that count. They differ in where the × N goes.
#
# | framework | counts | divides | × N |
# |---|---|---|---|
# | Hugging Face Trainer | `get_batch_samples`, then `accelerator.gather(...).sum()` if `average_tokens_across_devices` | `fixed_cross_entropy`: sum / `num_items_in_batch` | yes, if `average_tokens_across_devices`: `loss *= self.accelerator.num_processes` |
# | torchtitan | `dist_utils.dist_sum_tensor(local_valid_tokens, dp_mesh)` | `loss / global_valid_tokens` | no: `gradient_divide_factor=1.0` turns FSDP's division off |
#
# * **Hugging Face Trainer**, in `Trainer.get_batch_samples` and `Trainer.compute_loss`
#   ([trainer.py](https://github.com/huggingface/transformers/blob/000945a9b726d87a93e61e873b88ff8f3cd411b5/src/transformers/trainer.py)):
#   * **Count.** It counts only if the batches carry `"labels"` and either the model takes the
#     loss's keyword arguments (`self.model_accepts_loss_kwargs`) or you passed a
#     `compute_loss_func`. It counts the labels that are not −100, over the step's micro-batches:
#     `num_items_in_batch = sum([(batch["labels"].ne(-100)).sum() for batch in batch_samples])`.
#   * **Gather.** `if self.args.average_tokens_across_devices`, it sums that count over the
#     processes: `num_items_in_batch = self.accelerator.gather(num_items_in_batch).sum()`.
#   * **Divide.** The model's loss divides a sum by the count (`fixed_cross_entropy`:
#     `reduction = "sum"`, then `loss = loss / num_items_in_batch`;
#     [loss/loss_utils.py](https://github.com/huggingface/transformers/blob/0114da07ec0e101b420a923dedeb6032b6ac3a44/src/transformers/loss/loss_utils.py)).
#   * **× N.** `compute_loss` multiplies by the number of processes when three conditions hold:
#     `self.args.average_tokens_across_devices`, then
#     `(self.model_accepts_loss_kwargs or self.compute_loss_func)`, then
#     `num_items_in_batch is not None`. The line is `loss *= self.accelerator.num_processes`. That
#     undoes DDP's division: this notebook's sum / global count × N.
#   * **Otherwise**, `training_step` divides by the number of micro-batches, the 2024 bug's mean:
#     `loss = loss / self.current_gradient_accumulation_steps`. It does so
#     `if (not self.model_accepts_loss_kwargs or num_items_in_batch is None) and
#     self.compute_loss_func is None`.
#   * **The switch.** `TrainingArguments` documents it: "average_tokens_across_devices (`bool`,
#     *optional*, defaults to `True`): Whether or not to average tokens across devices. If enabled,
#     will use all_reduce to synchronize num_tokens_in_batch for precise loss calculation"
#     ([training_args.py](https://github.com/huggingface/transformers/blob/00349ae87eddc872ffa21a8a54f264375a0056a8/src/transformers/training_args.py)).
# * **torchtitan.** Its training step adds up `local_valid_tokens` over the step's micro-batches
#   (`(labels != IGNORE_INDEX).sum()`). Then
#   `global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens.to(self.device), dp_mesh)`.
#   The comment says: "Keep the global token count on device so loss normalization does not
#   introduce a CPU synchronization in the training path". The loss is a cross-entropy with
#   `reduction="sum"` divided by it, `loss = loss / global_valid_tokens`, "local SUM loss /
#   global_valid_tokens"
#   ([trainer.py](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/trainer.py),
#   [components/loss.py](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/components/loss.py)).
#   There is no × N: it turns the data-parallel division off instead. "Set gradient_divide_factor=1.0
#   to disable FSDP's automatic gradient division. We handle gradient scaling ourselves in the
#   training loop with global token count"
#   ([distributed/fsdp.py](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/distributed/fsdp.py)).
#   That is notebook 02's SUM without dividing, the third spelling of section 2.
#
# ## The rule
#
# This notebook's fix is the rule's sum form: the global count, × N under DDP. The per-rank mean
# is its mean form, right only with equal counts. The course says the rule once, in these words:
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
# ## Copy this into your code
#
# `snippets/07_global_token_mean.py` is a whole script in plain torch. The course's tests run it
# with `torchrun --standalone --nproc-per-node 2`. It does gradient accumulation under DDP with the
# global token count, and computes the loss to log. On every rank it checks that the gradient is the
# one of one process on every rank's micro-batches, and that the per-micro-batch mean is not.
#
# <!-- snippets/07_global_token_mean.py -->
# ```python
# """Notebook 07, copy this into your code: a loss that is the mean over every valid token of every
# micro-batch of every rank, under DDP with gradient accumulation.
#
#     torchrun --standalone --nproc-per-node 2 snippets/07_global_token_mean.py
# """
#
# import copy
# import os
# import warnings
# from contextlib import nullcontext
#
# import torch
# import torch.distributed as dist
#
# # before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
# import torch.distributed.nn  # noqa: F401
# import torch.nn.functional as F
# from torch import nn
# from torch.nn.parallel import DistributedDataParallel as DDP
#
# SEED = 1234
# VOCAB, IGNORE_INDEX = 50, -100  # -100: F.cross_entropy's default ignore_index (padding)
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
# def micro_batches_of(rank, device, k=2, lines=3):
#     """Rank `rank`'s k micro-batches (inputs, targets) of padded random sequences: the ranks and
#     the micro-batches hold different numbers of valid tokens."""
#     g = torch.Generator().manual_seed(SEED + rank)
#     batches = []
#     for _ in range(k):
#         lengths = torch.randint(1, 6 + 10 * rank, (lines,), generator=g)
#         inputs = torch.randint(0, VOCAB, (lines, int(lengths.max())), generator=g)
#         targets = torch.randint(0, VOCAB, inputs.shape, generator=g)
#         targets[torch.arange(inputs.shape[1]) >= lengths[:, None]] = IGNORE_INDEX  # padding
#         batches.append((inputs.to(device), targets.to(device)))
#     return batches
#
#
# def loss_sum(model, inputs, targets):
#     logits = model(inputs)                     # (lines, positions, VOCAB)
#     return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
#                            ignore_index=IGNORE_INDEX, reduction="sum")
#
#
# def token_mean_backward(model, micro_batches):
#     """backward() on this rank's micro-batches; then every rank's .grad is the gradient of the
#     mean loss over every valid token of every rank. Returns that loss (to log)."""
#     count = sum((targets != IGNORE_INDEX).sum() for _, targets in micro_batches)
#     dist.all_reduce(count)                     # the valid tokens of all micro-batches and ranks
#     count = count.clamp(min=1)                 # a step of padding only: loss 0, not NaN
#     total = torch.zeros((), device=count.device)
#     for k, (inputs, targets) in enumerate(micro_batches):
#         last = k == len(micro_batches) - 1
#         with nullcontext() if last else model.no_sync():   # DDP averages in the last backward
#             loss = loss_sum(model, inputs, targets)
#             (loss / count * dist.get_world_size()).backward()  # × N: DDP divides by N
#         total += loss.detach()
#     dist.all_reduce(total)                     # for the log: the loss sum over all ranks
#     return (total / count).item()
#
#
# def main():
#     device = init_distributed()
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     torch.manual_seed(SEED)                    # the same initial weights on every rank
#     model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)).to(device)
#     one_process = copy.deepcopy(model)         # for the check below
#     ddp = DDP(model)
#     optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
#
#     optimizer.zero_grad()
#     loss = token_mean_backward(ddp, micro_batches_of(rank, device))
#     grads = [p.grad.clone() for p in ddp.parameters()]
#     optimizer.step()
#     if rank == 0:
#         print(f"loss {loss:.4f}")              # the global loss, the same on every rank
#
#     # Check: one process on every rank's micro-batches, PyTorch's mean over the valid tokens.
#     everything = [b for r in range(world_size) for b in micro_batches_of(r, device)]
#     logits = torch.cat([one_process(x).flatten(0, 1) for x, _ in everything])
#     targets = torch.cat([y.flatten() for _, y in everything])
#     whole = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)  # mean over valid tokens
#     whole.backward()
#     for g, p in zip(grads, one_process.parameters(), strict=True):
#         torch.testing.assert_close(g, p.grad)
#     torch.testing.assert_close(loss, whole.item(), rtol=1e-5, atol=0)  # float32 sums, other order
#     # The 2024 accumulation bug, each micro-batch's own mean / K, averaged over the ranks: wrong.
#     buggy = copy.deepcopy(one_process)
#     buggy.zero_grad()
#     for r in range(world_size):
#         batches = micro_batches_of(r, device)
#         for x, y in batches:
#             (loss_sum(buggy, x, y) / (y != IGNORE_INDEX).sum() / len(batches) / world_size
#              ).backward()
#     assert not torch.allclose(buggy[1].weight.grad, one_process[1].weight.grad, rtol=1e-2)
#     print(f"rank {rank}: gradient and loss == one process on all {len(everything)} "
#           "micro-batches; the per-micro-batch mean is not")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# ## Exercise
#
# Write `token_mean_backward(model, micro_batches)`, one step's backward passes under DDP. `model`
# is a `DistributedDataParallel` model. `micro_batches` is this rank's list of `(inputs, targets)`
# pairs, the targets padded with −100. The ranks and micro-batches hold different numbers of valid
# tokens. After it, every rank's `.grad` must hold the gradient of the mean over **every valid token
# of every rank's micro-batches**. It returns that mean loss, a float, the same on every rank: the
# number to log. Count, `all_reduce` the count, and divide each micro-batch's loss sum by it.
# Remember DDP's division by N, and let DDP synchronize only once (`model.no_sync()`).
#
# The check runs it at two world sizes, each with its own number of micro-batches, on fresh random
# sequences. It compares the gradients and the loss with one process on all of them. Your
# collectives must have delivered the global count. The parameters and the micro-batches must be
# left as they were. It prints "✓ correct", or says what is wrong: the mean per micro-batch, a local
# count, a forgotten × N... Until you write the function, it says "not attempted yet". Stuck?
# `%load solutions/07_token_mean_backward.py` in a new cell.

# %%
def token_mean_backward(model, micro_batches):
    # your code here: count the valid tokens, one dist.all_reduce, loss sums / count × N,
    # no_sync for all but the last micro-batch, then the global mean loss as a float
    raise NotImplementedError("write token_mean_backward")


# %%
gst.exercises.check_token_mean_backward(token_mean_backward)
