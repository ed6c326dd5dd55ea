# %% [markdown]
# # 11 — Pipelines: who divides by the micro-batches
#
# **Question: a pipeline schedule runs the backward for me, one micro-batch at a time. What does it
# divide the gradients by, and what must my loss divide by so that the result is the mean over the
# whole batch?**
#
# **Pipeline parallelism** (PP) cuts the model into **stages**, one per rank. The batch is cut into
# **micro-batches** that flow through the stages one after another. Each stage adds each
# micro-batch's gradient into `.grad`: that is gradient accumulation, as in notebook 03. The
# difference is who divides.
#
# **Short answer:** give the schedule a mean `loss_fn`. The schedule divides every `.grad` by
# `n_microbatches`, once, at the end of each `step()`; that is right for a mean loss, and only for
# that. Dividing your loss by a global
# count as well divides twice (×1/4 with 4 micro-batches). Turning it off with a mean loss divides
# never (×4). Two `step()` calls without zeroing give `g1/4 + g2`. For token counts or accumulation
# across steps: `scale_grads=False`, and a `loss_fn` that is the sum divided by the global count.
# Each sentence is measured below, in float64, against one process on the whole batch.

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: the same checks, fewer cases
WORLD_SIZE = 2  # number of ranks = pipeline stages; the notebook also runs with 4

SEED = 1234
N_MICROBATCHES = 4  # micro-batches per schedule step
ROWS = 2  # rows of each micro-batch
BATCH = N_MICROBATCHES * ROWS  # rows of one step's batch

import inspect
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import gradsync_tutorial as gst

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
if SMOKE_TEST:
    SCHEDULES = {"GPipe": ScheduleGPipe}

# %% [markdown]
# ## Accumulation, from notebook 03: where the division goes
#
# Notebook 03 accumulated K micro-batches on each rank and ran all but the last inside
# `model.no_sync()`. It divided each micro-batch's **loss** by K before `backward()`:

# %%
accumulate_03 = gst.notebooks.function_source("03_distributed_data_parallel", "train_accumulate")
division_03 = "(F.nll_loss(model(x), y) / MICRO_BATCHES).backward()"
assert division_03 in accumulate_03 and "with model.no_sync():" in accumulate_03
print("notebook 03:", [ln.strip() for ln in accumulate_03.splitlines() if division_03 in ln][0])


# %% [markdown]
# A pipeline schedule divides in another place: it backpropagates each micro-batch's loss as
# `loss_fn` returns it, then divides the **gradients** by the number of micro-batches. Both give the
# whole batch's mean, for a mean loss over equal micro-batches. With a loss already divided by the
# batch's count, the second division is one too many. In one process, on a small model:

# %%
def model_and_data(stages, batch=BATCH, seed=SEED):
    """A model of `stages` blocks (float64), one per pipeline stage, and one batch for it."""
    torch.manual_seed(seed)
    widths = [4] + [8] * (stages - 1) + [2]
    blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths[:-2], widths[1:-1], strict=True)]
    model = nn.Sequential(*blocks, nn.Linear(widths[-2], widths[-1])).double()
    x, y = torch.randn(batch, 4, dtype=torch.float64), torch.randn(batch, 2, dtype=torch.float64)
    return model, x, y


def gradient(model):
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    return grad


model, x, y = model_and_data(WORLD_SIZE)
F.mse_loss(model(x), y).backward()
whole = gradient(model)  # one process, the whole batch
pieces = list(zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES), strict=True))
for xs, ys in pieces:  # notebook 03: the loss divided before backward
    (F.mse_loss(model(xs), ys) / N_MICROBATCHES).backward()
loss_divided = gradient(model)
for xs, ys in pieces:  # the schedule: backward as it is, then .grad / n
    F.mse_loss(model(xs), ys).backward()
grad_divided = gradient(model) / N_MICROBATCHES
for xs, ys in pieces:  # a loss over the whole batch's count, then .grad / n again
    (F.mse_loss(model(xs), ys, reduction="sum") / y.numel()).backward()
twice = gradient(model) / N_MICROBATCHES
for name, g in {"loss / n": loss_divided, "grad / n": grad_divided, "sum / count, grad / n": twice}.items():
    print(f"{name:<22} {(g.norm() / whole.norm()).item():.4f} × the whole batch's gradient")
assert torch.allclose(loss_divided, whole, atol=1e-15) and torch.allclose(grad_divided, whole, atol=1e-15)
assert torch.allclose(twice, whole / N_MICROBATCHES, atol=1e-15)

# %% [markdown]
# ## A pipeline on N ranks
#
# `torch.distributed.pipelining` runs this on ranks. Stage r is block r of the model, on rank r,
# wrapped in a `PipelineStage`. A **schedule** orders the forward and backward passes of the
# micro-batches. **GPipe** runs every forward, then every backward. **1F1B** alternates one forward
# and one backward once the pipeline is full, so fewer activations wait in memory.
#
# The schedule's `step()` splits the batch into `n_microbatches` along dimension 0. The first stage
# is given the inputs, the last stage the targets and the `loss_fn`; a middle stage gets only what
# its neighbours send. Each case below builds a fresh stage and schedule and runs one step. It
# returns this stage's
# gradient with one process's.

# %%
def run_step(schedule, stage, x, y, losses=None):
    """One schedule step: each stage gives what it has."""
    if stage.is_first:
        schedule.step(x)  # the first stage: the whole batch's inputs
    elif stage.is_last:
        schedule.step(target=y, losses=losses)  # the last: the targets; the losses come back
    else:
        schedule.step()  # a middle stage: only what its neighbours send


def mean_loss(output, target):  # the mean over the micro-batch: what scale_grads=True expects
    return F.mse_loss(output, target)


def sum_over(count):  # each micro-batch's sum / a count fixed before the step
    return lambda output, target: F.mse_loss(output, target, reduction="sum") / count


def pipeline_gradients(rank, world_size, cases):
    device = gst.local_device()
    results = {}
    for name, (schedule_name, loss_fn, scale_grads) in cases.items():
        model, x, y = model_and_data(world_size)
        model, x, y = model.to(device), x.to(device), y.to(device)  # the whole model, here
        stage = PipelineStage(model[rank], stage_index=rank, num_stages=world_size, device=device)
        schedule = SCHEDULES[schedule_name](stage, n_microbatches=N_MICROBATCHES,
                                            loss_fn=loss_fn, scale_grads=scale_grads)
        losses = []
        run_step(schedule, stage, x, y, losses)
        got = torch.cat([p.grad.flatten() for p in model[rank].parameters()])
        model.zero_grad()
        whole_loss = F.mse_loss(model(x), y)  # one process, the whole batch: the reference
        whole_loss.backward()
        expected = torch.cat([p.grad.flatten() for p in model[rank].parameters()])
        results[name] = {"got": got, "expected": expected, "whole loss": whole_loss.item(),
                         "losses": [loss.item() for loss in losses]}
    return results


# %% [markdown]
# ## What the schedule divides by, read from torch
#
# Each single-stage schedule ends its `_step_microbatches` with one call. Its argument is
# `n_microbatches`, or 1 with `scale_grads=False`. The stage's `scale_grads` then divides every
# parameter's `.grad` in place, whatever it held before the step. The loss is not divided. From the
# installed torch (`torch/distributed/pipelining/schedules.py` and `stage.py`):

# %%
def lines_with(function, *words):
    source = inspect.getsource(function)
    return [line.strip() for line in source.splitlines() if any(w in line for w in words)]


ends_step = {name: lines_with(cls._step_microbatches, "perform_reduce_grad(")
             for name, cls in {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}.items()}
divides = lines_with(PipelineStage.scale_grads, "grad_scale_factor != 1", "div_(")
reduce_grad = lines_with(PipelineStage.perform_reduce_grad, "self.scale_grads(")
for name, found in ends_step.items():
    print(f"schedules.py, Schedule{name}._step_microbatches: {found[0]}")
print("stage.py, perform_reduce_grad:", reduce_grad[0])
print("stage.py, scale_grads:", " / ".join(divides))
said = " ".join(ScheduleGPipe.__mro__[1].__doc__.split())  # PipelineScheduleSingle's
said = said[said.index("Gradients are scaled"):]
print(f"{ScheduleGPipe.__mro__[1].__name__}'s docstring: {said}")
assert all(f == ["self._stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)"]
           for f in ends_step.values())
assert divides == ["if grad_scale_factor != 1:", "p.grad.div_(grad_scale_factor)"]
assert reduce_grad == ["self.scale_grads(grad_scale_factor)"]
assert inspect.signature(ScheduleGPipe).parameters["scale_grads"].default is True
assert "average losses (scale_grads=True) or sum losses (scale_grads=False)" in said

# %% [markdown]
# ## Four losses, measured
#
# The factor below is this stage's gradient over one process's, on every rank. A mean loss with the
# default is exact; so is the sum over the whole batch's count with `scale_grads=False`. The other
# two pairings are off by exactly `n_microbatches`, one way or the other.

# %%
count = BATCH * 2  # elements of the whole batch's targets (2 outputs a row)
cases = {f"{s}, mean loss, scale_grads=True (default)": (s, mean_loss, True) for s in SCHEDULES}
cases |= {
    "GPipe, mean loss, scale_grads=False": ("GPipe", mean_loss, False),
    "GPipe, sum / count, scale_grads=True": ("GPipe", sum_over(count), True),
    "GPipe, sum / count, scale_grads=False": ("GPipe", sum_over(count), False),
}
measured = gst.launch(pipeline_gradients, WORLD_SIZE, args=(cases,))


# %%
def factor_and_gap(result, times=1.0):
    """(got / expected, max |got - times · expected|), worst over the ranks."""
    ratios = [(r["got"].norm() / r["expected"].norm()).item() for r in result]
    gap = max((r["got"] - times * r["expected"]).abs().max().item() for r in result)
    return ratios, gap


expected_factor = {"mean loss, scale_grads=True": 1.0, "mean loss, scale_grads=False": 4.0,
                   "sum / count, scale_grads=True": 0.25, "sum / count, scale_grads=False": 1.0}
print(f"{'case':<48} factor on each stage   max |difference|")
for name in cases:
    key = name.split(", ", 1)[1].removesuffix(" (default)")
    ratios, gap = factor_and_gap([m[name] for m in measured], expected_factor[key])
    print(f"{name:<48} {', '.join(f'{r:.4f}' for r in ratios):<22} {gap:.1e}")
    assert N_MICROBATCHES == 4 and gap < 1e-15, name
last = measured[-1][next(iter(cases))]
print(f"mean of the {N_MICROBATCHES} micro-batch losses {sum(last['losses']) / N_MICROBATCHES:.16f}, "
      f"whole batch's {last['whole loss']:.16f}")
assert abs(sum(last["losses"]) / N_MICROBATCHES - last["whole loss"]) < 1e-15

# %% [markdown]
# The losses the schedule hands back are each micro-batch's own `loss_fn`, undivided. For a mean
# loss their mean is the batch's loss (last line). For equal micro-batches and a mean loss, keep the
# default. Everything else below needs `scale_grads=False`.
#
# ## Accumulating over two `step()` calls
#
# A batch too large for one step is run as two steps before one optimizer step. With the default,
# the second step's division also divides what the first step left. This is torchtitan#1733: "The
# result is that the accumulated gradient is an exponential moving average, rather than a sum." Its
# fix (torchtitan#1732, merged): "Set "scale_grads=False" when creating the scheduler instance", and
# scale the loss instead.

# %%
def accumulated(rank, world_size, scale_grads):
    """Two steps on the two halves of a batch of 2 · BATCH, without zeroing in between."""
    device = gst.local_device()
    model, x, y = model_and_data(world_size, batch=2 * BATCH)
    model, x, y = model.to(device), x.to(device), y.to(device)
    mine = model[rank]
    halves = list(zip(x.chunk(2), y.chunk(2), strict=True))
    per_half = []  # one process, each half's mean loss: g1, g2
    for xs, ys in halves:
        F.mse_loss(model(xs), ys).backward()
        per_half.append(torch.cat([p.grad.flatten() for p in mine.parameters()]))
        model.zero_grad()
    F.mse_loss(model(x), y).backward()
    whole = torch.cat([p.grad.flatten() for p in mine.parameters()])  # the whole batch's mean
    model.zero_grad()
    loss_fn = mean_loss if scale_grads else sum_over(y.numel())  # the fix: the count of both
    stage = PipelineStage(mine, stage_index=rank, num_stages=world_size, device=device)
    schedule = ScheduleGPipe(stage, N_MICROBATCHES, loss_fn=loss_fn, scale_grads=scale_grads)
    for xs, ys in halves:  # no zero_grad in between: the gradients add up
        run_step(schedule, stage, xs, ys)
    got = torch.cat([p.grad.flatten() for p in mine.parameters()])
    return {"got": got, "g1": per_half[0], "g2": per_half[1], "whole": whole}


default, fixed = (gst.launch(accumulated, WORLD_SIZE, args=(s,)) for s in (True, False))

# %%
n = N_MICROBATCHES
for label, result, formula in (("default", default, lambda r: r["g1"] / n + r["g2"]),
                               ("fixed", fixed, lambda r: r["whole"])):
    gap = max((r["got"] - formula(r)).abs().max().item() for r in result)
    off = max((r["got"] - r["whole"]).abs().max().item() for r in result)
    print(f"{label:<8} vs its formula {gap:.1e}; vs the whole batch's mean {off:.2g}")
    assert gap < 1e-15
ratio = default[0]["got"].norm() / default[0]["whole"].norm()
print(f"default: stage 0's gradient is {ratio:.3f} × the whole batch's, = g1/{n} + g2")
assert max((r["got"] - r["whole"]).abs().max().item() for r in default) > 0.01

# %% [markdown]
# The default's result is `g1/4 + g2`, where the mean of the two halves is `(g1 + g2)/2`. The fix
# divides once, in the loss: each micro-batch's sum over the element count of **both** steps, with
# `scale_grads=False`. It is exact. For equal micro-batches, still with `scale_grads=False`, a mean
# loss divided by `n_microbatches` × the number of steps works too.

# %% [markdown]
# ## Token counts: where the global count enters
#
# A language model's loss is the mean over **valid tokens**: padding is marked -100 and left out
# ([notebook 07](07_which_mean.ipynb)). Micro-batches then hold different numbers of tokens, so the
# mean per micro-batch is not the mean. The count must enter the `loss_fn`, before the schedule's
# backward. torchtitan#2972 (open) is the case where it came after: "In PP, the schedule backwards
# the raw sum loss and the `/ global_valid_tokens` division happens after backward (for metrics
# only). This means PP gradients are `global_valid_tokens` times larger than non-PP gradients."
#
# Three `loss_fn`s on the same padded batch, each on a fresh stage:

# %%
VOCAB, LENGTH, IGNORE_INDEX = 3, 6, -100


def token_batch(stages, rows=BATCH, seed=SEED):
    """A model whose last block predicts VOCAB classes per position, and padded sequences."""
    model, _, _ = model_and_data(stages, seed=seed)
    model[-1] = nn.Linear(model[-1].in_features, VOCAB).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, LENGTH, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
    lengths = torch.randint(1, LENGTH + 1, (rows,), generator=g)
    y[torch.arange(LENGTH) >= lengths[:, None]] = IGNORE_INDEX  # padding after each sequence
    return model, x, y


def token_sum(output, target):  # the loss summed over this micro-batch's valid tokens
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def token_losses(valid_tokens):
    return {
        "mean per micro-batch, scale_grads=True": (
            lambda o, t: token_sum(o, t) / (t != IGNORE_INDEX).sum(), True),
        "sum, divided after the step (torchtitan#2972)": (token_sum, False),
        "sum / global count, scale_grads=False": (
            lambda o, t: token_sum(o, t) / valid_tokens, False),
    }


def token_gradients(rank, world_size):
    device = gst.local_device()
    results = {}
    _, _, y = token_batch(world_size)
    valid_tokens = (y != IGNORE_INDEX).sum().item()  # counted before the step: every rank can
    for name, (loss_fn, scale_grads) in token_losses(valid_tokens).items():
        model, x, y = (t.to(device) for t in token_batch(world_size))
        stage = PipelineStage(model[rank], stage_index=rank, num_stages=world_size, device=device)
        schedule = ScheduleGPipe(stage, N_MICROBATCHES, loss_fn=loss_fn, scale_grads=scale_grads)
        run_step(schedule, stage, x, y)
        got = torch.cat([p.grad.flatten() for p in model[rank].parameters()])
        model.zero_grad()
        token_sum(model(x), y).div(valid_tokens).backward()  # one process: the token mean
        expected = torch.cat([p.grad.flatten() for p in model[rank].parameters()])
        results[name] = {"got": got, "expected": expected}
    per_piece = [(t != IGNORE_INDEX).sum().item() for t in y.chunk(N_MICROBATCHES)]
    return {"results": results, "valid tokens": valid_tokens, "per micro-batch": per_piece}


tokens = gst.launch(token_gradients, WORLD_SIZE)

# %%
T = tokens[0]["valid tokens"]
print(f"valid tokens per micro-batch {tokens[0]['per micro-batch']}, {T} in all")
for name in tokens[0]["results"]:
    ratios, gap = factor_and_gap([t["results"][name] for t in tokens])
    print(f"{name:<48} factor {', '.join(f'{r:.4g}' for r in ratios):<16} max |diff| {gap:.2g}")
results = [t["results"] for t in tokens]
assert len(set(tokens[0]["per micro-batch"])) > 1  # unequal counts: the case that matters
assert 1e-4 < factor_and_gap([r["mean per micro-batch, scale_grads=True"] for r in results])[1]
assert factor_and_gap([r["sum, divided after the step (torchtitan#2972)"] for r in results], T)[1] < 1e-12
assert factor_and_gap([r["sum / global count, scale_grads=False"] for r in results])[1] < 1e-15

# %% [markdown]
# The mean per micro-batch is off, but not by one factor (a different one on each stage): notebook
# 07's mean of means. Dividing after the step is `T` times too large. The count must be known
# **before** `step()`, as a number the `loss_fn` closes over. With data parallelism it counts every
# data-parallel rank, with one `all_reduce` (below).

# %% [markdown]
# ## Micro-batches of unequal size
#
# `step()` splits with `tensor_split`, so a batch of 10 in 4 micro-batches gives pieces of 3, 3, 2
# and 2. Nothing refuses it. The stages size their receive buffers from the first micro-batch, so
# the third one arrives into a buffer of 3 rows. The launch below runs it on gloo, in a launch of
# its own, since a failed collective leaves its process group unusable.

# %%
print("tensor_split of 10 rows into 4:", [len(t) for t in torch.arange(10).tensor_split(4)])


def uneven(rank, world_size):
    import warnings  # show torch's warning without the temporary file of this cell

    warnings.formatwarning = lambda message, category, *_, **__: f"{category.__name__}: {message}\n"
    device = gst.device.collective_device()  # gloo: the CPU, whatever the machine
    model, x, y = model_and_data(world_size, batch=10)
    stage = PipelineStage(model[rank], stage_index=rank, num_stages=world_size, device=device)
    schedule = ScheduleGPipe(stage, N_MICROBATCHES, loss_fn=mean_loss)
    run_step(schedule, stage, x, y)
    return "finished"


try:
    gst.launch(uneven, WORLD_SIZE, backend="gloo", timeout=120)
except gst.RankFailedError as err:
    print(f"rank {err.rank} raised {str(err).splitlines()[0].split(' raised ', 1)[1]}")
    assert err.rank == WORLD_SIZE - 1 and "must match the size of tensor b (2)" in str(err)
else:
    raise AssertionError("a batch of 10 in 4 micro-batches should have failed")

# %% [markdown]
# The last stage received a third micro-batch of 3 rows for 2 targets, so the loss failed (after
# torch's `UserWarning`, `Using a target size`, about broadcasting, above). Had the sizes happened
# to match, the result would still be wrong: a mean per micro-batch weighs each row of a smaller
# piece more. **Check before the step** that the batch splits into equal micro-batches:

# %%
def equal_micro_batches(batch, n_microbatches):
    """Raise unless `batch` (a tensor, rows first) splits into n_microbatches equal pieces."""
    if len(batch) % n_microbatches:
        raise ValueError(
            f"a batch of {len(batch)} rows does not split into {n_microbatches} equal "
            "micro-batches: drop or pad the last batch (DataLoader(drop_last=True)), or pick "
            f"n_microbatches dividing the batch size")
    return batch


try:
    equal_micro_batches(torch.zeros(10, 4), N_MICROBATCHES)
except ValueError as e:
    print(e)
    assert "does not split into 4 equal micro-batches" in str(e)
else:
    raise AssertionError("10 rows in 4 micro-batches should have been refused")
assert equal_micro_batches(torch.zeros(BATCH, 4), N_MICROBATCHES).shape == (BATCH, 4)

# %% [markdown]
# ## Pipeline × data parallel, on 4 ranks
#
# A **2-D device mesh** of 2 × 2 ranks: pipeline stages along `"pp"`, data-parallel replicas along
# `"dp"`. Each stage is sharded with `fully_shard` on its `"dp"` sub-mesh (notebook 08), and each
# replica takes half of the batch. The schedule sends between the stages of one replica, over the
# `"pp"` group. FSDP2 divides by the dp size, the schedule by `n_microbatches`. These cells set
# their world size to 4 themselves.
#
# The token count's fix becomes: each stage's `loss_fn` divides by the valid tokens of **all**
# replicas (one `all_reduce` over the `"dp"` group), × the dp size, since FSDP2 divides by it.

# %%
PP_DP_RANKS = 4  # a 2 x 2 mesh, whatever WORLD_SIZE is


def pp_times_dp(rank, world_size):
    device = gst.local_device()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    dp_size = mesh["dp"].size()
    # FSDP2 warns that the last stage's output is a view; nothing here changes it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    results = {}
    for name in [f"{s}, mean loss" for s in SCHEDULES] + ["GPipe, sum / global token count"]:
        tokens = name.endswith("count")
        model, x, y = token_batch(2) if tokens else model_and_data(2)
        model, x, y = model.to(device), x.to(device), y.to(device)
        loss = token_sum if tokens else lambda o, t: F.mse_loss(o, t, reduction="sum")
        count = (y != IGNORE_INDEX).sum() if tokens else torch.tensor(y.numel(), device=device)
        loss(model(x), y).div(count).backward()  # one process, the whole batch
        expected = torch.cat([p.grad.flatten() for p in model[pp].parameters()])
        model.zero_grad()
        xs, ys = x.chunk(dp_size)[dp], y.chunk(dp_size)[dp]  # this replica's half
        loss_fn, scale_grads = mean_loss, True
        if tokens:  # the global count: this replica's tokens, summed over the dp group
            valid = (ys != IGNORE_INDEX).sum()
            dist.all_reduce(valid, group=mesh["dp"].get_group())
            loss_fn = lambda o, t, v=valid: token_sum(o, t) / v * dp_size  # noqa: E731
            scale_grads = False
        stage_module = model[pp]
        fully_shard(stage_module, mesh=mesh["dp"])  # FSDP2 over the replicas of this stage
        stage = PipelineStage(stage_module, stage_index=pp, num_stages=2, device=device,
                              group=mesh["pp"].get_group())
        schedule = SCHEDULES[name.split(",")[0]](stage, n_microbatches=2, loss_fn=loss_fn,
                                                 scale_grads=scale_grads)
        run_step(schedule, stage, xs, ys)
        got = torch.cat([p.grad.full_tensor().flatten() for p in stage_module.parameters()])
        results[name] = {"got": got, "expected": expected}
    return results


pp_dp = gst.launch(pp_times_dp, PP_DP_RANKS)

# %%
for name in pp_dp[0]:
    ratios, gap = factor_and_gap([r[name] for r in pp_dp])
    print(f"PP 2 × DP 2, {name:<32} factor {', '.join(f'{r:.4f}' for r in ratios)}; "
          f"max |difference| {gap:.1e}")
    assert gap < 1e-15, name

# %% [markdown]
# Exact on all 4 ranks, for both schedules. The schedule's `perform_reduce_grad` also runs FSDP2's
# post-backward, which reduce-scatters over `"dp"` and divides by its size. Then it divides by
# `n_microbatches`. Its code says: "PP scales only for its own contribution
# (microbatches), but relies on DP to scale further for DP degree."
#
# ## Copy this into your code
#
# `snippets/11_pipeline_token_mean.py` is a whole script, run by the course's tests with
# `torchrun --standalone --nproc-per-node 2`. It uses notebook 06's `init_distributed()`, one stage
# per rank, and a token-count loss with `scale_grads=False`. It accumulates two schedule steps and
# checks that the gradient equals one process's on both batches.
#
# <!-- snippets/11_pipeline_token_mean.py -->
# ```python
# """Notebook 11, copy this into your code: a pipeline (one stage per rank) whose gradient is the
# mean over every valid token of several schedule steps, divided once.
#
#     torchrun --standalone --nproc-per-node 2 snippets/11_pipeline_token_mean.py
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
# from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
#
# SEED = 1234
# VOCAB, IGNORE_INDEX = 5, -100  # -100: F.cross_entropy's default ignore_index (padding)
# N_MICROBATCHES, STEPS = 4, 2  # micro-batches per schedule step; steps per optimizer step
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
# def token_loss_sum(output, target):
#     """The loss summed over the valid tokens of one micro-batch."""
#     return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX,
#                            reduction="sum")
#
#
# def main():
#     device = init_distributed()
#     rank, world_size = dist.get_rank(), dist.get_world_size()
#     torch.manual_seed(SEED)                    # the same model and data on every rank
#     widths = [8] + [16] * (world_size - 1)     # one block per stage (at least 2 ranks)
#     blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh())
#               for a, b in zip(widths[:-1], widths[1:], strict=True)]
#     model = nn.Sequential(*blocks, nn.Linear(16, VOCAB))
#     model = model.double().to(device)
#     whole = copy.deepcopy(model)               # for the check below: one process
#     batches = []
#     for _ in range(STEPS):                     # padded sequences of different lengths
#         x = torch.randn(2 * N_MICROBATCHES, 6, 8, dtype=torch.float64)
#         y = torch.randint(0, VOCAB, (2 * N_MICROBATCHES, 6))
#         y[torch.rand(y.shape) < 0.3] = IGNORE_INDEX
#         batches.append((x.to(device), y.to(device)))
#
#     # The count of valid tokens of ALL the steps, known before the first step. With data
#     # parallelism too: all_reduce it over the dp group, and multiply the loss by the dp size.
#     valid_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches)
#
#     def loss_fn(output, target):               # each micro-batch's share of the token mean
#         return token_loss_sum(output, target) / valid_tokens
#
#     stage = PipelineStage(model[rank], stage_index=rank, num_stages=world_size, device=device)
#     # scale_grads=False: the loss is already divided. The default would divide .grad by
#     # N_MICROBATCHES at the end of every step, the earlier steps' gradients included.
#     schedule = ScheduleGPipe(stage, N_MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
#     for x, y in batches:                       # no zero_grad in between: the gradients add up
#         if len(x) % N_MICROBATCHES:
#             raise ValueError(f"a batch of {len(x)} does not split into {N_MICROBATCHES} equal "
#                              "micro-batches: drop or pad it")
#         if stage.is_first:
#             schedule.step(x)
#         elif stage.is_last:
#             schedule.step(target=y)
#         else:
#             schedule.step()
#
#     # Check: this stage's gradient is one process's, for the token mean over both batches.
#     x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
#     F.cross_entropy(whole(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).backward()
#     for mine, reference in zip(model[rank].parameters(), whole[rank].parameters(), strict=True):
#         torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-12, atol=1e-14)
#     print(f"rank {rank}: stage {rank} of {world_size}, {STEPS} steps of {N_MICROBATCHES} "
#           f"micro-batches: the gradient of the mean over {int(valid_tokens)} valid tokens, as "
#           "one process computes it")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```

# %% [markdown]
# ## Exercise
#
# Write `pipeline_gradient(stage, batches, n_microbatches)`. Build a schedule on `stage` (a
# `PipelineStage`, stage r on rank r). Run one `step()` per `(inputs, targets)` in `batches`, each
# split into `n_microbatches`. Leave in `.grad` the gradient of `F.mse_loss` over **all** the
# batches together, without zeroing between the steps.
#
# The check runs it at two world sizes, each with its own micro-batches and steps, on fresh random
# data. It
# rejects a double division, a missing one, and the default scaling across steps, and says which.
# Stuck? `%load solutions/11_pipeline_gradient.py` in a new cell.

# %%
def pipeline_gradient(stage, batches, n_microbatches):
    # your code here: a loss_fn that divides once, scale_grads to match, one step per batch
    raise NotImplementedError("write pipeline_gradient")


# %%
gst.exercises.check_pipeline_gradient(pipeline_gradient)

# %% [markdown]
# ## What to remember
#
# | your `loss_fn` | `scale_grads` | result |
# |---|---|---|
# | mean over the micro-batch, equal micro-batches, one step | `True` (default) | exact |
# | mean over the micro-batch | `False` | × `n_microbatches` |
# | sum / the whole batch's count | `True` | × 1/`n_microbatches` |
# | sum / the count of all steps (and all dp replicas, × dp size) | `False` | exact |
# | anything, over several `step()` calls | `True` | `g1/n + g2`: earlier steps divided again |
#
# Feed equal micro-batches, and check it before the step. With data parallelism, FSDP2 divides by
# the dp size and the schedule by `n_microbatches`: count tokens over every replica.
#
# A mean `loss_fn` with equal micro-batches is the rule's mean form; a sum over the count of all
# steps is its sum form. The course says the rule once, in these words:
#
# > **The rule.** Every gradient must be the gradient of one loss over the whole step's data. Sum form:
# > each rank adds up its loss terms (tokens, samples, completions) and divides by their global count,
# > over every micro-batch of every rank that holds other data. Mean form: each data shard takes its
# > own mean, and the summed gradients are divided by the number of data shards. The data shards are
# > the data-parallel × context-parallel ranks × the micro-batches, and this form needs as many loss
# > terms in each. DDP and FSDP divide by the data-parallel size themselves: multiply a sum-form loss
# > by it. Divide once, and never by the size of a group a gradient is only reduced over. Sum partial
# > gradients; never average them.
