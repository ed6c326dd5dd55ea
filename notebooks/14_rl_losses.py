# %% [markdown]
# # 14 — RL losses: divide by completions or by tokens?
#
# **Question: a policy-gradient loss (GRPO, DAPO, Dr. GRPO) averages over tokens, or over
# completions. Split over micro-batches and ranks, what must each piece divide by?**
#
# **Short answer: give every token the weight it has in the loss one process computes on the
# whole step.** Those weights need two counts of the whole step: its completion tokens and its
# completions. Count them over every micro-batch of every rank, with one `all_reduce` of two
# numbers. Under DDP or FSDP, also multiply by the world size N, because they divide by N. Divide
# by nothing else: not again by the micro-batches, not by N a second time. A mean taken per
# micro-batch is right only when the count it divides by is the same in every micro-batch. The
# rest of this notebook measures each of these sentences against one process, in float64.
#
# Notebook 07 fixed the language model's token mean. Reinforcement learning (RL) trainers met the
# same question again in 2025 and 2026, with more ways to average. These threads each report one
# of the bugs reproduced below:
# [ms-swift#10117](https://github.com/modelscope/ms-swift/issues/10117) (a loss divided again by
# the accumulation steps),
# [verl#5798](https://github.com/verl-project/verl/pull/5798) ("dp_size² times too small"),
# [verl#5625](https://github.com/verl-project/verl/issues/5625) (a token mean per micro-batch).
#
# ## The words
#
# * A **policy** is the model being trained: it gives a probability to each next token.
# * A step samples a **group** of G **completions** of each prompt and gives each a **reward**.
# * A completion's **advantage** is its reward minus its group's mean, over the group's standard
#   deviation (GRPO's). It says how much better than its siblings the completion did.
# * The **policy loss** of one completion token is −advantage × the probability ratio
#   π(token) / π_old(token), with π_old the policy that sampled it. Its gradient pushes up the
#   tokens of completions better than their group, and pushes down the others.
# * A **token-level mean** divides the sum of these losses by the number of completion tokens.
#   A **sequence-level mean** first averages within each completion, then over completions.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: the same checks, fewer draws
WORLD_SIZE = 2  # number of ranks; the notebook also runs with 4

SEED = 1234
PROMPTS, GROUP = 6, 4  # a step samples GROUP completions of each of PROMPTS prompts
MICRO_BATCHES = 2  # gradient accumulation: micro-batches per rank and step
DRAWS = 2 if SMOKE_TEST else 6  # steps of fresh completions each proof runs on
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

import inspect
from contextlib import nullcontext

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from IPython.display import Markdown
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_tutorial as gst

MAX_LEN = gst.rollouts.MAX_LEN  # the longest completion: a trainer's max_completion_length

# %% [markdown]
# ## A step's completions, rewards and advantages
#
# `gst.rollouts.sample` draws the completions at random, since averaging does not care how they
# were sampled. Each has a prompt of 2 tokens and a completion of 1 to `MAX_LEN` tokens. Its
# reward is the share of even token ids in the completion. GRPO's advantage normalises each
# reward within its group:

# %%
def group_advantages(rewards, group=GROUP):
    """Each reward minus its group's mean, over its group's standard deviation (GRPO's)."""
    by_group = rewards.view(-1, group)  # completions of one prompt are consecutive
    mean = by_group.mean(dim=1, keepdim=True)
    std = by_group.std(dim=1, keepdim=True)
    return ((by_group - mean) / (std + 1e-4)).flatten()


completions = gst.rollouts.sample(PROMPTS, GROUP, seed=SEED)
rewards = torch.tensor([c.reward for c in completions], dtype=torch.float64)
advantages = group_advantages(rewards)
for c, a in list(zip(completions, advantages, strict=True))[:GROUP]:
    print(f"prompt {c.prompt}: {len(c.completion):2} tokens, reward {c.reward:.2f}, "
          f"advantage {a:+.2f}")
assert advantages.view(-1, GROUP).sum(dim=1).abs().max() <= 1e-12  # each group's sum is 0

# %% [markdown]
# The policy is as small as a language model gets: an embedding and a linear layer. The loss of
# each position is `gst.rollouts.per_token_loss`, shown below; the exercise uses it too. In a
# step's first pass, π equals π_old, so the ratio is 1. Its gradient is then the gradient of
# log π. PPO's clipping, min(ratio × A, clip(ratio) × A), changes nothing at a ratio of 1, so it
# is left out.

# %%
def make_policy():
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return nn.Sequential(nn.Embedding(gst.rollouts.VOCAB_SIZE, 16),
                         nn.Linear(16, gst.rollouts.VOCAB_SIZE)).double()


per_token_loss = gst.rollouts.per_token_loss
Markdown(f"```python\n{inspect.getsource(per_token_loss)}```")  # the code every cell runs


# %% [markdown]
# ## Three losses, one formula: a weight per token
#
# Each way to average gives every completion token a weight. The loss is the sum of the
# weighted per-token losses. The weights need only two counts: the completion tokens `tokens`
# and the completions `completions`.
#
# | mode (verl's name) | who uses it | weight of a token of a completion of n tokens |
# |---|---|---|
# | `token-mean` | DAPO; TRL's default `dapo` | 1 / tokens |
# | `seq-mean-token-mean` | GRPO; TRL's `grpo` | 1 / (n × completions) |
# | `seq-mean-token-sum-norm` | Dr. GRPO; TRL's `dr_grpo` | 1 / (completions × MAX_LEN) |

# %%
def token_weights(mask, mode, tokens, completions):
    """Each position's weight in the loss, from the counts of the whole step. `mask` is 1 on
    completion tokens; `tokens` and `completions` count them over the whole step."""
    if mode == "token-mean":  # every completion token of the step weighs the same
        return mask / tokens
    if mode == "seq-mean-token-mean":  # each completion's token mean, then their mean
        return mask / mask.sum(dim=1, keepdim=True) / completions
    if mode == "seq-mean-token-sum-norm":  # each completion's token sum over a constant length
        return mask / (completions * MAX_LEN)
    raise ValueError(f"unknown mode {mode!r}")


def weighted_loss(policy, batch, mode, tokens, completions):
    return (token_weights(batch["mask"], mode, tokens, completions)
            * per_token_loss(policy, batch)).sum()


# %% [markdown]
# On one batch, with its own counts, these weights are exactly the trainers' formulas. Here their
# gradients are compared with those of TRL's expressions (quoted in the last section):

# %%
batch = gst.rollouts.pad(completions, advantages)
policy = make_policy()
per_token, mask = per_token_loss(policy, batch), batch["mask"]
trl = {"token-mean": (per_token * mask).sum() / mask.sum(),
       "seq-mean-token-mean": ((per_token * mask).sum(-1) / mask.sum(-1)).mean(),
       "seq-mean-token-sum-norm": (per_token * mask).sum() / (per_token.size(0) * MAX_LEN)}
for mode in MODES:
    ours = weighted_loss(policy, batch, mode, mask.sum(), len(mask))
    g_ours = torch.cat([g.flatten() for g in torch.autograd.grad(ours, policy.parameters())])
    g_trl = torch.cat([g.flatten() for g in torch.autograd.grad(trl[mode], policy.parameters(),
                                                                retain_graph=True)])
    gap = ((g_ours - g_trl).norm() / g_trl.norm()).item()
    print(f"{mode:24} the weights' gradient and TRL's differ by {gap:.2g} (relative)")
    assert gap <= 1e-14

# %% [markdown]
# ## Why the modes are different objectives
#
# The three modes weigh a long completion differently. Here is the weight of each of its tokens,
# and of the whole completion, against its length, in a step of 16 completions of 1 to `MAX_LEN`
# tokens:

# %%
lengths = torch.arange(1, MAX_LEN + 1)
fake_mask = (torch.arange(MAX_LEN) < lengths.unsqueeze(1)).double()  # one row per length
n_completions, n_tokens = 16, int(16 * lengths.double().mean())  # a step of average lengths
per_mode = {mode: token_weights(fake_mask, mode, n_tokens, n_completions)[:, 0]
            for mode in MODES}
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.3), layout="constrained")
for mode, weight in per_mode.items():
    left.plot(lengths, weight, "o-", label=mode)
    right.plot(lengths, weight * lengths, "o-", label=mode)
left.set(xlabel="completion length n (tokens)", ylabel="weight of each of its tokens",
         title="One token")
right.set(xlabel="completion length n (tokens)", ylabel="weight of the whole completion",
          title="One completion")
left.legend(fontsize=8)
plt.show()
short, long = per_mode["seq-mean-token-mean"][[0, -1]]
print(f"seq-mean-token-mean: a token of a 1-token completion weighs {short / long:.0f} × a token "
      f"of a {MAX_LEN}-token one")
assert abs(short / long - MAX_LEN) <= 1e-12  # the weight is 1 / n: a long completion's tokens
for mode in ("token-mean", "seq-mean-token-sum-norm"):  # the same weight for every token
    assert torch.all(per_mode[mode] == per_mode[mode][0])

# %% [markdown]
# Under the sequence-level mean, every completion weighs the same in total. So a token of a long
# completion weighs less, 12 times less at 12 tokens. A long completion with a negative advantage
# is then pushed down less per token than a short one. TRL's documentation calls this "length
# bias" (quoted below). The token-level mean and Dr. GRPO give every token one weight: a long
# completion weighs more in total. None of this is a bug: they are three objectives. The bugs
# come when an objective is split over micro-batches and ranks.
#
# ## Split over micro-batches and ranks
#
# A step's completions are dealt to the ranks in order, as TRL slices them. Each rank splits its
# share into `MICRO_BATCHES` micro-batches, in one of two layouts:
#
# * `"fixed"`: the same number of completions in every micro-batch (TRL's
#   `per_device_train_batch_size`).
# * `"balanced"`: micro-batches of about the same number of tokens, longest completions first
#   (verl's `use_dynamic_bsz` packs by tokens). They hold different numbers of completions.

# %%
def deal(completions, advantages, world_size, layout, micro_batches=MICRO_BATCHES):
    """step[rank][k]: the k-th micro-batch of a rank, as a list of (completion, advantage)."""
    pairs = list(zip(completions, advantages.tolist(), strict=True))
    per_rank = len(pairs) // world_size
    step = []
    for rank in range(world_size):
        mine = pairs[rank * per_rank: (rank + 1) * per_rank]
        if layout == "fixed":
            size = per_rank // micro_batches
            step.append([mine[k * size: (k + 1) * size] for k in range(micro_batches)])
            continue
        bins = [[] for _ in range(micro_batches)]  # "balanced": cut by tokens, longest first
        total, filled = sum(len(c.completion) for c, _ in mine), 0
        for pair in sorted(mine, key=lambda p: -len(p[0].completion)):
            bins[min(filled * micro_batches // total, micro_batches - 1)].append(pair)
            filled += len(pair[0].completion)
        step.append(bins)
    return step


def counts(step):
    """(completions, completion tokens) of each micro-batch: [rank][k]."""
    return [[(len(mb), sum(len(c.completion) for c, _ in mb)) for mb in rank] for rank in step]


for layout in ("fixed", "balanced"):
    print(f"{layout:8}: (completions, tokens) per micro-batch, per rank: "
          f"{counts(deal(completions, advantages, WORLD_SIZE, layout))}")
balanced = counts(deal(completions, advantages, WORLD_SIZE, "balanced"))
assert len({n for rank in balanced for n, _ in rank}) > 1  # unequal numbers of completions

# %% [markdown]
# The step on each rank counts first. One `all_reduce` gives every rank the completion tokens and
# the completions of the whole step. Every micro-batch then computes its tokens' share of the
# one-process loss, times N for DDP's mean. `spelling` selects the other ways to divide, the
# trainers' and the bugs' (each explained where it is measured):

# %%
def backward_over(model, micro_batches, mode, spelling="global"):
    """backward() on each of this rank's micro-batches (padded, as gst.rollouts.pad gives them),
    each loss divided as `spelling` says."""
    N, K = dist.get_world_size(), len(micro_batches)
    step_counts = torch.stack([sum(b["mask"].sum() for b in micro_batches),
                               torch.tensor(float(sum(len(b["mask"]) for b in micro_batches)))])
    rank_completions = step_counts[1].item()
    dist.all_reduce(step_counts)  # [completion tokens, completions] of every rank
    tokens, completions = step_counts
    for k, b in enumerate(micro_batches):
        with model.no_sync() if k < K - 1 else nullcontext():  # DDP averages in the last one
            if spelling == "global":  # the rule: the step's counts, × N for DDP's mean
                loss = weighted_loss(model, b, mode, tokens, completions) * N
            elif spelling == "per micro-batch":  # TRL: this micro-batch's own counts, / K
                loss = weighted_loss(model, b, mode, b["mask"].sum(), len(b["mask"])) / K
            elif spelling == "ms-swift#10117":  # the step's token count, then / K again
                loss = weighted_loss(model, b, mode, tokens, completions) * N / K
            elif spelling == "verl#5798":  # global_batch_size * dp_size, where / dp_size is right
                loss = weighted_loss(model, b, mode, tokens, completions * N)
            elif spelling == "verl#5625":  # its own token mean, × its share of the completions
                loss = (weighted_loss(model, b, mode, b["mask"].sum(), len(b["mask"]))
                        * len(b["mask"]) / rank_completions)
            elif spelling == "padded width":  # Dr. GRPO over the micro-batch's width
                loss = (weighted_loss(model, b, mode, tokens, completions) * N
                        * MAX_LEN / b["mask"].shape[1])
            loss.backward()  # adds this micro-batch's gradient into .grad


# %% [markdown]
# The reference is one process on every completion of the step, with the counts of the whole
# step. `compare` gives the relative error of a gradient against it. It also fits the factor c
# that brings the reference closest, and says whether the gradient is exactly c × the reference.

# %%
def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def one_process(step, mode):
    """The gradient of one process on every micro-batch of every rank, as one batch."""
    pairs = [pair for rank in step for mb in rank for pair in mb]
    batch = gst.rollouts.pad([c for c, _ in pairs], [a for _, a in pairs])
    policy = make_policy()
    weighted_loss(policy, batch, mode, batch["mask"].sum(), len(pairs)).backward()
    return flat_grad(policy)


def on_rank(rank, world_size, step, mode, spelling):
    device = gst.local_device()
    model = DDP(make_policy().to(device))
    micro_batches = [{key: t.to(device) for key, t in
                      gst.rollouts.pad([c for c, _ in mb], [a for _, a in mb]).items()}
                     for mb in step[rank]]
    backward_over(model, micro_batches, mode, spelling)
    return flat_grad(model.module).cpu()


def compare(grad, ref):
    """(relative error, fitted factor c, exactly c × ref?) of a gradient against the reference."""
    c = (grad.dot(ref) / ref.dot(ref)).item()
    exact = ((grad - c * ref).norm() / grad.norm()).item() <= 1e-12
    return (grad - ref).norm().item() / ref.norm().item(), c, exact


def run(layout, mode, spelling, draws=DRAWS):
    """The worst relative error over `draws` fresh steps, and the fits of the first."""
    worst, first = 0.0, None
    for draw in range(draws):
        done = gst.rollouts.sample(PROMPTS, GROUP, seed=SEED + draw)
        adv = group_advantages(torch.tensor([c.reward for c in done], dtype=torch.float64))
        step = deal(done, adv, WORLD_SIZE, layout)
        ranks = gst.launch(on_rank, WORLD_SIZE, args=(step, mode, spelling))
        assert all(torch.equal(g, ranks[0]) for g in ranks)  # the replicas agree
        rel, c, exact = compare(ranks[0], one_process(step, mode))
        worst, first = max(worst, rel), first or (c, exact)
    return {"off": worst, "factor": first[0], "exact factor": first[1]}


def show(name, r):
    fit = (f"exactly {r['factor']:.4f} × the reference" if r["exact factor"] else
           f"not a multiple of it; the closest is {r['factor']:.2f} ×")
    print(f"{name:51} off by {r['off']:.2g}   ({fit})")


# %% [markdown]
# ## 1. The global counts give one process, in every mode and layout
#
# Each line is the worst of `DRAWS` steps of fresh completions, on `WORLD_SIZE` ranks:

# %%
proven = {(layout, mode): run(layout, mode, "global")
          for layout in ("fixed", "balanced") for mode in MODES}
for (layout, mode), r in proven.items():
    show(f"global counts, {layout}, {mode}", r)
worst_global = max(r["off"] for r in proven.values())
print(f"the worst of the {len(proven)}: {worst_global:.2g}")
assert worst_global <= 1e-12  # one process, to float64 rounding

# %% [markdown]
# ## 2. A mean per micro-batch is right only where its count is the same everywhere
#
# TRL's `grpo`, `bnpo` and `dr_grpo` take each micro-batch's own mean, divide it by the
# accumulation steps K, and let DDP average over the ranks. Each token then weighs 1 / (K × N) of
# its weight within its micro-batch. That equals its weight in the step only if every
# micro-batch holds the same count:

# %%
local = {(layout, mode): run(layout, mode, "per micro-batch")
         for layout in ("fixed", "balanced") for mode in MODES}
for (layout, mode), r in local.items():
    show(f"per micro-batch, {layout}, {mode}", r)

# %%
for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
    assert local["fixed", mode]["off"] <= 1e-12  # equal completions: right
    assert local["balanced", mode]["off"] > 1e-2  # unequal completions: wrong
assert local["fixed", "token-mean"]["off"] > 1e-2  # tokens differ between micro-batches
assert local["balanced", "token-mean"]["off"] > 1e-3  # balanced, but not equal

# %% [markdown]
# The sequence-level modes divide by completions. With a fixed number of completions per
# micro-batch, their local mean is right: TRL's `grpo` and `dr_grpo` are exact there. The token
# mean divides by tokens, which differ between any two micro-batches. So a token mean per
# micro-batch (TRL's `bnpo`) is wrong in both layouts. TRL's documentation warns: "results may
# slightly vary depending on the local batch size". With balanced micro-batches, the sequence
# modes' local means are wrong too.
#
# The errors are large, tens of percent. A policy gradient is a difference: completions better
# than their group push their tokens up, the others push theirs down. Wrong weights upset that
# balance, so little of the gradient is left right.
#
# ## 3. Four bugs from 2026, by their factors
#
# Each spelling below is a reported bug, in its project's own terms:
#
# * **ms-swift#10117.** DAPO's loss already divides by the token count of the whole accumulated
#   batch. Then transformers' `Trainer` divides it again by the accumulation steps K. The report:
#   "expected gradient g, with `gradient_accumulation_steps=4` actually only g/4" (translated).
# * **verl#5798.** verl's sequence-level denominator was `global_batch_size * dp_size`. It should
#   divide by dp_size instead, to undo FSDP's mean. The PR: "the effective loss to be `dp_size²`
#   times too small".
# * **verl#5625.** verl's older FSDP path divides each micro-batch by its own token count. It
#   then scales by the micro-batch's share of the completions. The report: "This mismatch causes
#   the accumulated loss/gradient to diverge from the correct full-batch result".
# * **Dr. GRPO over the padded width.** verl's `agg_loss` divides Dr. GRPO's token sum by
#   `loss_mask.shape[-1]` when no constant is given. That is the micro-batch's padded width, not
#   the constant the paper asks for. Its docstring says: "Set this to a constant value to ensure
#   consistent normalization throughout training."

# %%
bugs = {
    "ms-swift#10117": ("fixed", "token-mean"),
    "verl#5798": ("fixed", "seq-mean-token-mean"),
    "verl#5625": ("balanced", "token-mean"),
    "padded width": ("balanced", "seq-mean-token-sum-norm"),
}
measured = {spelling: run(layout, mode, spelling) for spelling, (layout, mode) in bugs.items()}
for spelling, r in measured.items():
    layout, mode = bugs[spelling]
    show(f"{spelling} ({mode}, {layout})", r)
    fixed_r = proven[layout, mode]
    print(f"{'  fixed: the global counts':51} off by {fixed_r['off']:.2g}")

# %%
K, N = MICRO_BATCHES, WORLD_SIZE
assert measured["ms-swift#10117"]["exact factor"]
assert abs(measured["ms-swift#10117"]["factor"] - 1 / K) <= 1e-12  # g / K
assert measured["verl#5798"]["exact factor"]
assert abs(measured["verl#5798"]["factor"] - 1 / N**2) <= 1e-12  # g / dp_size²
for spelling in ("verl#5625", "padded width"):
    assert not measured[spelling]["exact factor"] and measured[spelling]["off"] > 1e-2
print(f"ms-swift#10117: 1 / K = {1 / K}; verl#5798: 1 / N² = {1 / N**2}")

# %% [markdown]
# The first two are exact factors: 1 / K and 1 / N². With AdamW, a constant factor barely changes
# the step, while the gradient norm shows it (notebook 10 measures both). The last two are not
# factors: each micro-batch weighs differently, so the step trains on another objective. Every
# fix is the same formula, the weights with the step's counts (section 1's line of the same mode
# and layout).
#
# ## 4. The advantages need the whole group
#
# The advantage normalises a reward by its group's mean and standard deviation. A rank that
# holds only part of a group must not take those statistics over its part. Here each group is
# split over two ranks: its first half on one, its second half on the next. Each rank computes
# the advantages of its completions in one of two ways:
#
# * `"local"`: over the part of each group this rank holds.
# * `"all_reduce"`: over the whole group. One `all_reduce` sums each group's count, rewards and
#   squared rewards over the ranks.

# %%
def advantages_on_rank(rewards, groups, how):
    """The advantages of this rank's completions; `groups` holds each one's prompt number."""
    stats = torch.zeros(PROMPTS, 3, dtype=rewards.dtype, device=rewards.device)
    stats.index_add_(0, groups, torch.stack([torch.ones_like(rewards), rewards, rewards**2], 1))
    if how == "all_reduce":
        dist.all_reduce(stats)  # [count, sum, sum of squares] of each group, over every rank
    n, total, squares = stats[groups].unbind(1)
    mean = total / n
    std = ((squares - n * mean**2) / (n - 1)).clamp(min=0).sqrt()  # like torch.std: n - 1
    return (rewards - mean) / (std + 1e-4)


def split_groups(done, world_size):
    """indices[rank]: each group's first half on rank (prompt % N), its second half on the next."""
    indices = [[] for _ in range(world_size)]
    for i, c in enumerate(done):
        half = (i % GROUP) // (GROUP // 2)
        indices[(c.prompt + half) % world_size].append(i)
    return indices


def on_rank_with_rewards(rank, world_size, done, how):
    device = gst.local_device()
    mine = [done[i] for i in split_groups(done, world_size)[rank]]
    rewards = torch.tensor([c.reward for c in mine], dtype=torch.float64, device=device)
    groups = torch.tensor([c.prompt for c in mine], device=device)
    adv = advantages_on_rank(rewards, groups, how)
    model = DDP(make_policy().to(device))
    batch = {k: t.to(device) for k, t in gst.rollouts.pad(mine, adv.cpu()).items()}
    backward_over(model, [batch], "seq-mean-token-mean")
    return {"grad": flat_grad(model.module).cpu(), "advantages": adv.cpu()}


done = gst.rollouts.sample(PROMPTS, GROUP, seed=SEED)
reference_adv = group_advantages(torch.tensor([c.reward for c in done], dtype=torch.float64))
reference = one_process([[list(zip(done, reference_adv.tolist(), strict=True))]],
                        "seq-mean-token-mean")
split = {}
for how in ("local", "all_reduce"):
    ranks = gst.launch(on_rank_with_rewards, WORLD_SIZE, args=(done, how))
    adv_error = max((r["advantages"] - reference_adv[i]).abs().max().item()
                    for r, i in zip(ranks, split_groups(done, WORLD_SIZE), strict=True))
    split[how] = {"advantages": adv_error, "grad": compare(ranks[0]["grad"], reference)[0]}
    print(f"advantages over {how:10}: advantages off by up to {adv_error:.2g}, gradient off by "
          f"{split[how]['grad']:.2g}")
assert split["local"]["grad"] > 1e-2
assert split["all_reduce"]["advantages"] <= 1e-12 and split["all_reduce"]["grad"] <= 1e-12

# %% [markdown]
# The local statistics move every advantage: the gradient is far off. The group's statistics
# over the ranks give one process. TRL avoids the question: it gathers every process's rewards
# before it normalises, then keeps its own slice. verl computes advantages on one process, its
# driver, for the whole batch. A trainer that normalises over the whole batch (TRL's
# `scale_rewards="batch"`) needs the same `all_reduce`, with one group.
#
# ## How the trainers spell it
#
# Quoted from their code and documentation at the commits linked.
#
# **TRL**, `GRPOTrainer`
# ([grpo_trainer.py](https://github.com/huggingface/trl/blob/f2cd57710ae345ea6428ae95363267fcf38a3dc8/trl/trainer/grpo_trainer.py),
# [grpo_config.py](https://github.com/huggingface/trl/blob/f2cd57710ae345ea6428ae95363267fcf38a3dc8/trl/trainer/grpo_config.py)):
#
# | `loss_type` | the code | over micro-batches and ranks |
# |---|---|---|
# | `"grpo"` | `((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()`, then `loss / normalizer` with `normalizer = self.current_gradient_accumulation_steps` | local mean / K: exact with a fixed number of completions per micro-batch (section 2) |
# | `"bnpo"` | `(per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)`, then `/ normalizer` | local token mean / K: not exact (section 2) |
# | `"dr_grpo"` | `(per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)`, then `/ normalizer` | exact with a fixed number of completions per micro-batch |
# | `"dapo"` (default) | `normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes`, `(per_token_loss * mask).sum() / normalizer` | global count, × N, no / K: section 1's rule |
#
# The count comes from `num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()`.
# The documentation of `loss_type` says `"dapo"` normalizes "with the number of active token in
# the global accumulated batch". It says `"bnpo"` normalizes "over the local batch only, so
# results may slightly vary depending on the local batch size". It calls `"grpo"` "Not
# recommended due to length bias". For the advantages, the code comments: "rewards will be
# normalized per group, and completions are distributed. We will later slice rewards_per_func to
# extract each process's subset."
#
# **verl**, `agg_loss` in
# [core_algos.py](https://github.com/verl-project/verl/blob/1dda039b9c6311889a9c9a26040677e1254814f9/verl/trainer/ppo/core_algos.py):
#
# | `loss_agg_mode` | the code |
# |---|---|
# | `"token-mean"` | `loss = verl_F.masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size` |
# | `"seq-mean-token-mean"` | each completion's `torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)`, then `verl_F.masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size` |
# | `"seq-mean-token-sum-norm"` | the same sum over completions, then `loss /= loss_scale_factor`, which is `loss_mask.shape[-1]` when not given |
#
# Its docstring: "Aggregate the loss across global batch to ensure the loss is invariant to
# fsdp/megatron parallelism". `batch_num_tokens` and `global_batch_size` count the global batch.
# Without them, `agg_loss` raises when dp_size > 1: "(global) batch_num_tokens is required when
# dp_size > 1". That is section 1's rule, × dp_size for FSDP's mean.
#
# **ms-swift**'s DAPO loss is TRL's: `normalizer = grpo_batch.num_items_in_batch /
# self.accelerator.num_processes` (quoted in #10117). Its fix,
# [ms-swift#10116](https://github.com/modelscope/ms-swift/pull/10116), undoes the Trainer's
# second division for the losses that use the global count.
#
# ## The rule
#
# Section 1's global counts are the rule's sum form. TRL's `grpo` with a fixed number of
# completions per micro-batch is its mean form. The course says the rule once, in these words:
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
# `snippets/14_rl_policy_loss.py` is a whole script in plain torch. The course's tests run it with
# `torchrun --standalone --nproc-per-node 2`. It runs one GRPO-style step under DDP, with
# micro-batches that hold different numbers of completions. It computes the three modes with the
# step's counts. On every rank it checks each mode's gradient against one process on every
# completion, and that dividing again by K gives 1 / K of it.
#
# <!-- snippets/14_rl_policy_loss.py -->
# ```python
# """Notebook 14, copy this into your code: an RL policy loss (GRPO, DAPO, Dr. GRPO) that gives one
# process's gradient under DDP, with micro-batches that hold different numbers of completions.
#
#     torchrun --standalone --nproc-per-node 2 snippets/14_rl_policy_loss.py
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
# from torch import nn
# from torch.nn.parallel import DistributedDataParallel as DDP
#
# SEED, VOCAB = 1234, 12
# MAX_COMPLETION_LENGTH = 8  # Dr. GRPO divides each completion's token sum by this constant
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
# def micro_batches_of(rank, device, sizes=(3, 1)):
#     """Rank `rank`'s micro-batches of random completions: (inputs, targets, mask, advantages).
#     They hold `sizes` completions (different numbers, as balanced micro-batches do) of 1 to
#     MAX_COMPLETION_LENGTH tokens after a prompt of 2; mask is 1 on the completion's tokens."""
#     g = torch.Generator().manual_seed(SEED + rank)
#     batches = []
#     position = torch.arange(2 + MAX_COMPLETION_LENGTH)
#     for n in sizes:
#         lengths = torch.randint(1, MAX_COMPLETION_LENGTH + 1, (n, 1), generator=g)
#         inputs = torch.randint(1, VOCAB, (n, len(position)), generator=g)
#         targets = torch.randint(1, VOCAB, inputs.shape, generator=g)
#         mask = (position >= 2) & (position < 2 + lengths)  # not the prompt, not the padding
#         advantages = torch.randn(n, generator=g)
#         batches.append(tuple(t.to(device) for t in (inputs, targets, mask.float(), advantages)))
#     return batches
#
#
# def per_token_loss(model, inputs, targets, advantages):
#     """-ratio * advantage at every position (PPO at ratio 1: the step's first pass)."""
#     logp = torch.log_softmax(model(inputs), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
#     return -torch.exp(logp - logp.detach()) * advantages.unsqueeze(-1)
#
#
# def token_weights(mask, mode, tokens, completions):
#     """Each position's weight in the loss one process computes on the whole step."""
#     if mode == "token-mean":                  # DAPO: every completion token weighs the same
#         return mask / tokens
#     if mode == "seq-mean-token-mean":         # GRPO: each completion's token mean, then their mean
#         return mask / mask.sum(dim=1, keepdim=True) / completions
#     if mode == "seq-mean-token-sum-norm":     # Dr. GRPO: token sums over a constant length
#         return mask / (completions * MAX_COMPLETION_LENGTH)
#     raise ValueError(f"unknown mode {mode!r}")
#
#
# def policy_loss_backward(model, micro_batches, mode, divide_by_k_again=False):
#     """backward() on this rank's micro-batches: then every rank's .grad is the gradient of
#     `mode`'s loss over every completion of every micro-batch of every rank."""
#     counts = torch.stack([sum(mask.sum() for _, _, mask, _ in micro_batches),
#                           sum(mask.new_tensor(len(mask)) for _, _, mask, _ in micro_batches)])
#     dist.all_reduce(counts)                   # [completion tokens, completions] of the step
#     tokens, completions = counts
#     for k, (inputs, targets, mask, advantages) in enumerate(micro_batches):
#         last = k == len(micro_batches) - 1
#         with nullcontext() if last else model.no_sync():   # DDP averages in the last backward
#             weights = token_weights(mask, mode, tokens, completions)
#             loss = (weights * per_token_loss(model, inputs, targets, advantages)).sum()
#             loss = loss * dist.get_world_size()           # × N: DDP divides by N
#             if divide_by_k_again:                         # ms-swift#10117's bug, for the check
#                 loss = loss / len(micro_batches)
#             loss.backward()
#
#
# def main():
#     device = init_distributed()
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     torch.manual_seed(SEED)                    # the same initial weights on every rank
#     model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)).to(device)
#     one_process = copy.deepcopy(model)         # for the check below
#     ddp = DDP(model)
#     mine = micro_batches_of(rank, device, sizes=(3, 1) if rank % 2 == 0 else (1, 2))
#     everything = [b for r in range(world_size)
#                   for b in micro_batches_of(r, device, sizes=(3, 1) if r % 2 == 0 else (1, 2))]
#     inputs, targets, mask, advantages = (torch.cat(t) for t in zip(*everything, strict=True))
#
#     for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
#         # Check: one process on every rank's micro-batches, with the counts of the whole step.
#         reference = copy.deepcopy(one_process)
#         weights = token_weights(mask, mode, mask.sum(), len(mask))
#         (weights * per_token_loss(reference, inputs, targets, advantages)).sum().backward()
#         for divide_by_k_again in (False, True):
#             ddp.zero_grad()
#             policy_loss_backward(ddp, mine, mode, divide_by_k_again)
#             for p, q in zip(ddp.parameters(), reference.parameters(), strict=True):
#                 expected = q.grad / (len(mine) if divide_by_k_again else 1)
#                 torch.testing.assert_close(p.grad, expected)
#     print(f"rank {rank}: token-mean, seq-mean-token-mean and seq-mean-token-sum-norm each give "
#           f"the gradient of one process on all {len(mask)} completions; divided by K again, "
#           f"1/{len(mine)} of it")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# ## Exercise
#
# Write `seq_mean_backward(model, micro_batches)`, GRPO's sequence-level mean under DDP.
# `model` is a `DistributedDataParallel` policy. `micro_batches` is this rank's list of
# micro-batches, each a dict from `gst.rollouts.pad`: `inputs`, `targets`, `mask`, `advantages`.
# The micro-batches hold different numbers of completions, as with balanced micro-batches. After
# it, every rank's `.grad` must hold the gradient of the mean over **every completion of every
# rank** of each completion's token mean. `gst.rollouts.per_token_loss(model, batch)` gives the
# loss of every position. Return nothing.
#
# The check runs it at two world sizes, each with its own number of micro-batches, on fresh
# completions. It compares the gradients with one process on all of them. It says
# what is wrong: a mean per micro-batch, a second division by K, a denominator multiplied by N, a
# guessed world size or micro-batch count. Until you write the function, it says "not attempted
# yet". Stuck? `%load solutions/14_seq_mean_backward.py` in a new cell.

# %%
def seq_mean_backward(model, micro_batches):
    # your code here: count this rank's completions, one dist.all_reduce, then each
    # micro-batch's sum of completion token means / the step's completions × N, with no_sync
    raise NotImplementedError("write seq_mean_backward")


# %%
gst.exercises.check_seq_mean_backward(seq_mean_backward)
