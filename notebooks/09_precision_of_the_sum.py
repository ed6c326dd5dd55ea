# %% [markdown]
# # 09 — The precision of the sum: averaging gradients in fp32, bf16 and fp16
#
# **Question: when a model trains in bf16 or fp16, may its gradients be averaged in that precision
# too? What does the average lose, and does the loss grow with the number of GPUs?**
#
# **Short answer:** keep the *sum* in float32 where you can. A bf16 sum is off by about 2e-3 of the
# mean gradient on 2 ranks, and the error grows about as √N. The rest, measured below on the
# course's CNN:
#
# | sum in | 2 ranks | 256 ranks |
# |---|---|---|
# | bf16 | about 2e-3 | about 2e-2 |
# | fp16 | about 3e-4 | about 2e-3 |
# | fp32 | below 1e-6 | below 1e-6 |

# %%
import os

SMOKE_TEST = os.environ.get("SMOKE_TEST") == "1"  # CI sets it: shorter runs, same checks
WORLD_SIZE = 2  # the real ranks; the larger numbers of ranks below are emulated

SEED = 1234
import copy
import math
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.func import functional_call, grad, grad_and_value, vmap
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_tutorial as gst

DEVICE = gst.local_device()  # this process's emulations run here: a GPU if there is one
FORMATS = (torch.float32, torch.bfloat16, torch.float16)
NAME = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16",
        torch.float16: "fp16"}

# %% [markdown]
# ## Where the sum is, and why it drifts
#
# | setup | where the sum is |
# |---|---|
# | `torch.autocast` alone (its gradients are float32) | float32 |
# | FSDP2 with `reduce_dtype=torch.float32` | float32 (a tensor-parallel sum stays bf16: notebook 10) |
# | DDP's `bf16_compress_hook` and `fp16_compress_hook`, a model converted to bf16 | 16 bits |
# | a model converted to bf16, with a hook that casts each bucket to float32 (section 3) | float32 |
#
# Why: a sum in a 16-bit format rounds at every addition. In a ring all-reduce every rank adds its
# gradient to a running sum, so the error grows with N. fp16 has 3 more bits than bf16, but a range
# that ends at 65,504. When the reduction itself is in fp16, a sum of loss-scaled gradients
# overflows. That happens with an fp16 model, `fp16_compress_hook`, or FSDP2's
# `reduce_dtype=torch.float16`. Dividing by N first loses the small gradients at small scales.
# FSDP's split, about √N before the sum and the rest after, avoids both here.
#
# In a short training run, the loss does not notice at 64 or 256 ranks; the parameters do. With
# fp16's `GradScaler`, unscale before clipping. The other order runs without a message and does not
# train. And PowerSGD, a compression hook, is not an average at all.
#
# Notebook 02's `average_gradients` sums the N ranks' gradients, then divides by N. In float32 that
# sum is exact to about 1e-7. The gradients may instead be sent in 16 bits, for half the bytes.
# FSDP2 does it by default when it computes in bf16 (section 3). The backend then also *adds* them
# in 16 bits. One report comes from FSDP users. A model "trained well on 12x8 GPUs, but the training
# would become unstable on 48x8 GPUs", and "changing `reduce_dtype` to `None` instead of `bf16`
# resolved the issue". With their settings, None meant full precision
# ([pytorch#106395](https://github.com/pytorch/pytorch/issues/106395)).

# %% [markdown]
# ## Three formats, and what a sum does to them
#
# A float is a sign, an exponent and a fraction. The bf16 format keeps fp32's exponent, so its
# range, but has 8 bits of precision instead of 24. The fp16 format has 11 bits of precision and a
# 5-bit exponent. Nothing lies above 65,504. Below its smallest normal number lie the *subnormal*
# numbers, with fewer and fewer bits. `eps`, the gap between 1 and the next number, is the relative
# step of rounding. A number rounded to the format moves by at most half a step, eps / 2 of itself.

# %% tags=["nbval-check-output"]
for dtype in FORMATS:
    info = torch.finfo(dtype)
    precision = 1 - round(math.log2(info.eps))  # bits of precision: the fraction's, plus 1
    print(f"{NAME[dtype]}: {info.bits} bits = 1 sign + {info.bits - precision} exponent + "
          f"{precision - 1} fraction; eps = {info.eps:.2e} = 2^{math.log2(info.eps):.0f}; "
          f"largest {info.max:.4g}; smallest normal {info.tiny:.2e}, subnormal "
          f"{info.tiny * info.eps:.2e}")
assert torch.finfo(torch.bfloat16).eps == 2**-7 and torch.finfo(torch.float16).eps == 2**-10
assert torch.finfo(torch.float16).max == 65504 and torch.finfo(torch.bfloat16).max > 3e38

# %% [markdown]
# The step is relative: it grows with the number. A running sum grows, so every new term is rounded
# to the step of the sum so far. Add 1 to a bf16 sum 512 times. At 256 the step is 2, so 256 + 1
# rounds back to 256 (a tie, rounded to the even neighbour), and the sum stops there. `torch.sum` of
# the same bf16 tensor gets 512. It does not add one number at a time to a running sum rounded to
# bf16. A ring all-reduce does. Each rank sends its partial sum to the next in the tensor's own
# format. The next rank adds its own number and rounds again.

# %% tags=["nbval-check-output"]
ones = torch.ones(512, device=DEVICE)
running = {dtype: torch.zeros((), dtype=dtype, device=DEVICE) for dtype in FORMATS}
for one in ones:
    for dtype in FORMATS:
        running[dtype] = running[dtype] + one.to(dtype)  # each addition rounded to dtype
print("512 ones, added one by one:", {NAME[d]: s.item() for d, s in running.items()})
print("torch.sum of 512 bf16 ones:", ones.bfloat16().sum().item())
assert running[torch.bfloat16] == 256 and running[torch.float16] == running[torch.float32] == 512
assert ones.bfloat16().sum() == 512

# %% [markdown]
# ## 1. One reduction, from 2 to 256 ranks
#
# Two real ranks cannot show an error that grows with N, and a laptop cannot start 256. But a ring
# all-reduce in bf16 is arithmetic that one process can do, as notebook 02 emulated 8 GPUs. First,
# the gradients: the course's CNN, one gradient per rank, each on its own 8 images, for 256 ranks.
# `torch.func.vmap` computes them in one call, in float32, as DDP computes them:

# %%
N_MAX, PER_RANK = 256, 8  # emulated ranks, images per rank
torch.manual_seed(SEED)
net = gst.model.Net().to(DEVICE).eval()  # eval: dropout off
weights = {name: p.detach() for name, p in net.named_parameters()}
images, labels = gst.data.load(train=True)
pick = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED))
pick = pick[:N_MAX * PER_RANK]
x = images[pick].view(N_MAX, PER_RANK, 1, 28, 28).to(DEVICE)  # x[r]: rank r's 8 images
y = labels[pick].view(N_MAX, PER_RANK).to(DEVICE)


def loss_of(weights, x, y):  # one rank's mean loss, as a function of the weights
    return F.nll_loss(functional_call(net, weights, (x,)), y)


per_rank = vmap(grad(loss_of), in_dims=(None, 0, 0))(weights, x, y)  # {name: [ranks, ...]}
grads = torch.cat([g.flatten(1) for g in per_rank.values()], dim=1)  # grads[r]: rank r's
print(f"{grads.shape[0]} ranks x {grads.shape[1]:,} numbers; |gradient| from "
      f"{grads.abs()[grads != 0].min():.1e} to {grads.abs().max():.2f}, "
      f"median {grads.abs().median():.1e}")

# %% [markdown]
# Each row is the gradient that rank's `backward()` computes, checked on rank 5:

# %%
net.zero_grad()
F.nll_loss(net(x[5]), y[5]).backward()
rank_5 = torch.cat([p.grad.flatten() for p in net.parameters()])
print(f"rank 5, vmap vs backward: max |difference| {(rank_5 - grads[5]).abs().max():.1e}")
tolerance = {"rtol": 1e-4, "atol": 1e-7} if DEVICE.type == "cpu" else {"rtol": 1e-2, "atol": 1e-5}
assert torch.allclose(rank_5, grads[5], **tolerance)  # GPUs: other kernels, TF32 (see below)


# %% [markdown]
# The emulated all-reduce. A ring cuts the tensor into N chunks. Each chunk travels once around the
# ring. Each rank adds its own piece to the partial sum it receives before passing it on. So every
# number of the result is a running sum over the ranks, started at some rank, and rounded to the
# tensor's format at every hop. `ring_sum` adds the ranks in order 0, 1, 2...:

# %%
def ring_sum(grads, dtype):
    """The sum of grads[0], grads[1], ... as a ring computes it: each addition rounded to dtype."""
    total = grads[0].to(dtype)
    for g in grads[1:]:
        total = total + g.to(dtype)  # one hop: the partial sum plus this rank's gradient
    return total


# %% [markdown]
# Is that what a real all-reduce does? We check it against gloo on 2 and 4 real ranks, each with its
# own row of `grads`, in bf16 and fp16. On 2 ranks there is one addition, a + b, so the results must
# be equal bit for bit. On 4 ranks the order of the additions is the ring's. Each number of the real
# result must be one of the ring's running sums, started at any rank, in either direction. Its error
# against the exact (float64) sum must be about the emulation's:

# %%
def real_all_reduce(rank, world_size, grads, dtype):
    t = grads[rank].to(gst.local_device(), dtype)  # this rank's gradient, in dtype
    dist.all_reduce(t)  # the sum over the ranks, computed by the backend in dtype
    return {"sum": t.cpu(), "backend": dist.get_backend()}


def relative_error(got, exact):  # |got - exact| / |exact|, over all the numbers
    return ((got.double() - exact).norm() / exact.norm()).item()


def ring_orders(grads, dtype):  # the running sums a ring may compute, one per start and direction
    n = len(grads)
    starts = [grads.roll(-s, dims=0) for s in range(n)]
    return torch.stack([ring_sum(g, dtype) for g in starts + [s.flip(0) for s in starts]])


cpu_grads = grads.cpu()
real = {(n, dtype): gst.launch(real_all_reduce, n, args=(cpu_grads[:n], dtype))[0]
        for n in (4, 2) for dtype in FORMATS[1:]}

# %%
for (n, dtype), out in sorted(real.items(), key=lambda item: item[0][0]):
    exact = cpu_grads[:n].double().sum(0)
    emulated = ring_sum(cpu_grads[:n], dtype)
    one_of_the_ring = (ring_orders(cpu_grads[:n], dtype) == out["sum"]).any(0).float().mean()
    e_real, e_emulated = relative_error(out["sum"], exact), relative_error(emulated, exact)
    print(f"{n} ranks, {NAME[dtype]} ({out['backend']}): error of the real sum {e_real:.3e}, "
          f"of the emulation {e_emulated:.3e}; equal to the emulation "
          f"{(out['sum'] == emulated).float().mean():.1%}, to one of the ring's sums "
          f"{one_of_the_ring:.1%}")
    if n == 2:
        assert torch.equal(out["sum"], emulated)
    elif out["backend"] == "gloo":  # another backend may add in another order (a tree...)
        assert one_of_the_ring == 1.0 and 0.8 < e_real / e_emulated < 1.25
    else:
        assert e_real < 1.5 * e_emulated


# %% [markdown]
# So the emulation is gloo's arithmetic. On 4 ranks only part of the numbers equal `ring_sum`'s.
# Gloo starts each chunk's running sum at another rank, and a rounded sum depends on the order; the
# size of the error does not. NCCL, on GPUs, picks among several algorithms (ring, tree...). In its
# maintainer's words: "NCCL will move from one combination to another depending on the size [...] So
# there is no easy rule to determine which algorithm/protocol is used"
# ([NVIDIA/nccl#754](https://github.com/NVIDIA/nccl/issues/754)). Of the ring and the tree, the ring
# rounds more often: N − 1 times per number, against log2 N (the tree is measured below).
#
# The FSDP maintainers met the same thing. A bf16 all-reduce and a bf16 reduce-scatter disagree,
# "not an issue with world size 2 but starts being an issue at world size 4"
# ([pytorch#125190](https://github.com/pytorch/pytorch/pull/125190)). So a reduce-scatter carries
# the sums of an all-reduce bit for bit on gloo (notebook 08). On NCCL it does so only up to the
# order of the additions.
#
# **On a GPU.** One 16-bit addition rounds the same way on a CPU and on a GPU: the exact sum,
# rounded to the nearest 16-bit number. So `ring_sum` gives the same bits on both; the next cell
# checks it where this notebook runs on a GPU. What differs on a GPU is upstream. The gradients
# themselves differ: other kernels, other orders of the float32 sums inside them. TF32 convolutions
# are on by default, as printed below. **TF32** keeps only part of a float32's fraction (its
# *mantissa*): "only the first 10 bits of the input mantissa are read", per PyTorch's notes on
# numerical accuracy. And NCCL picks its own algorithm. So the figures below move a little on a GPU;
# the checks allow for it.

# %%
on_device = ring_sum(grads[:64], torch.bfloat16).cpu()
on_cpu = ring_sum(cpu_grads[:64], torch.bfloat16)
compared = ("nothing to compare: no GPU here" if DEVICE.type == "cpu" else
            f"equal bit for bit: {torch.equal(on_device, on_cpu)}")
print(f"ring_sum of 64 ranks in bf16, on this device ({DEVICE}) and on the CPU: {compared}; "
      f"torch.backends.cudnn.allow_tf32: {torch.backends.cudnn.allow_tf32}")
assert torch.equal(on_device, on_cpu)

# %% [markdown]
# Now the emulation from 2 to 256 ranks, against the exact mean (float64), in each format. Two more
# lines show where the error comes from:
#
# - a tree: pairs, then pairs of pairs. Each number meets log2(N) additions instead of N−1, of
#   partial sums of similar sizes.
# - bf16 sent but summed in float32. The only rounding left is each rank's gradient rounded to bf16.

# %%
def tree_sum(grads, dtype):  # pairs, then pairs of pairs (N a power of two)
    parts = list(grads.to(dtype))
    while len(parts) > 1:
        parts = [a + b for a, b in zip(parts[0::2], parts[1::2], strict=True)]
    return parts[0]


NS = [2**k for k in range(1, 9)]  # 2 ... 256 ranks
errors = {}
for n in NS:
    exact = grads[:n].double().mean(0)
    for dtype in FORMATS:
        errors[NAME[dtype], n] = relative_error(ring_sum(grads[:n], dtype) / n, exact)
    errors["bf16, tree", n] = relative_error(tree_sum(grads[:n], torch.bfloat16) / n, exact)
    errors["bf16 sent, fp32 sum", n] = relative_error(
        ring_sum(grads[:n].bfloat16().float(), torch.float32) / n, exact)
for label in dict.fromkeys(k for k, _ in errors):
    print(f"{label:>20}: " + "  ".join(f"{errors[label, n]:.1e}" for n in NS))

# %%
fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
styles = {"fp32": "o-", "bf16": "o-", "fp16": "o-", "bf16, tree": "s:",
          "bf16 sent, fp32 sum": "^--"}
for label, style in styles.items():
    ax.loglog(NS, [errors[label, n] for n in NS], style, label=label)
ax.loglog(NS, [errors["bf16", 2] * math.sqrt(n / 2) for n in NS], color="grey", lw=0.8,
          label="∝ √N")
ax.set(xlabel="ranks N", ylabel="|error| / |mean gradient|",
       title="One all-reduce of the CNN's gradients, emulated (ring, then / N)")
ax.set_xscale("log", base=2)
ax.legend(fontsize=8)
plt.show()


# %%
def slope(label):  # the exponent p of error ∝ N^p, fitted from 2 to 256 ranks
    return math.log(errors[label, NS[-1]] / errors[label, NS[0]]) / math.log(NS[-1] / NS[0])


print(f"error ∝ N^p: bf16 p = {slope('bf16'):.2f}, fp16 p = {slope('fp16'):.2f}, "
      f"fp32 p = {slope('fp32'):.2f}, bf16 tree p = {slope('bf16, tree'):.2f}")
print("bf16 / fp16 error: " + ", ".join(f"{errors['bf16', n] / errors['fp16', n]:.1f}"
                                        for n in NS))
moved = ((grads.bfloat16().double() - grads.double()).abs() / grads.double().abs())[grads != 0]
print(f"one gradient rounded to bf16: each number moves by at most {moved.max():.2e} of itself "
      f"(eps / 2 = 2^-8 = {2**-8:.2e}), {moved.mean():.1e} on average")
assert moved.max() <= 2**-8
assert all(errors["fp32", n] < 1e-6 for n in NS)
assert 0.3 < slope("bf16") < 0.7 and 0.3 < slope("fp16") < 0.7  # about √N
assert all(4 < errors["bf16", n] / errors["fp16", n] < 16 for n in NS)  # 3 bits: 8x
assert errors["bf16, tree", 256] < 2 * errors["bf16, tree", 2]  # a tree: no growth
assert errors["bf16 sent, fp32 sum", 256] < errors["bf16 sent, fp32 sum", 2]  # it even falls

# %% [markdown]
# How to read it. Rounding a gradient to bf16 moves each of its numbers by at most 2^-8 of itself
# (printed above). Those roundings are independent from rank to rank, so in a float32 sum they
# average out: the dashed line falls as N grows. The ring's own roundings do not. Its k-th addition
# rounds at the scale of a partial sum of k gradients, which grows with k. N − 1 of them pile up,
# about as √N relative to the mean. The fitted exponent p is about 0.4 to 0.5 above, in all three
# formats; fp32's error stays below 1e-6. A tree only adds partial sums of equal sizes, log2 N deep,
# and stays flat. fp16 is several times more precise than bf16 at every N (the ratios are printed
# above): its 3 more bits.
#
# A Megatron-LM feature request states the same law: "A ring reduce-scatter rounds the partial sum
# at every one of its N-1 hops, so BF16 gradient error grows as √N with the axis size"
# ([NVIDIA/Megatron-LM#6199](https://github.com/NVIDIA/Megatron-LM/issues/6199)).
#
# ## Divide before the sum, or after? fp16's range
#
# In bf16 the place of the division changes nothing here. Each gradient can be divided by N before
# the sum, as DDP and its hooks do (notebook 05), or the sum after. N is a power of two and bf16 has
# fp32's range, so both divisions are exact. fp16's range is the problem.
#
# fp16 training multiplies the loss by a *loss scale*, so that small gradients do not vanish in
# backward. `torch.amp.GradScaler` starts the scale at 2^16 and halves it whenever a gradient
# overflows. A reduction in fp16 sums those scaled gradients: an fp16 model, `fp16_compress_hook`,
# or `reduce_dtype=torch.float16`. With `torch.autocast` the gradients are float32, and so is DDP's
# sum (section 3 measures it).
#
# Summing first in fp16, the sum of 256 ranks is 256 times their mean. It overflows 65,504 long
# before the mean would. Dividing each gradient by 256 first pushes the small ones into fp16's
# subnormal numbers, which have fewer bits, or to 0. FSDP's rule for fp16 splits the division: about
# √N before the sum and the rest after. Its code says why: "To avoid overflow/underflow, we divide
# by ~sqrt(N) before/after the reduction" (torch's
# `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`).
#
# Here are the three orders on 256 ranks, with the course's gradients times scales from 2^-8 to
# 2^18. We count how many numbers overflow. We also measure the error on the smallest tenth of the
# mean gradient's numbers, those that underflow first:

# %%
def predivide_factor(n):  # a power of two near √N, at least √N: FSDP's split for fp16
    factor = 1
    while factor * factor < n:
        factor *= 2
    return factor


def average(grads, dtype, before):  # cast, divide by `before`, ring-sum, divide by N / before
    return ring_sum(grads.to(dtype) / before, dtype) / (len(grads) / before)


exact = grads.double().mean(0)  # all 256 ranks
nonzero = exact.abs()[exact != 0]
small = (exact != 0) & (exact.abs() <= nonzero.quantile(0.1))  # the smallest tenth
ORDERS = {"sum, then / 256": 1, "/ 256, then sum (DDP's hooks)": N_MAX,
          f"/ {predivide_factor(N_MAX)}, sum, / {N_MAX // predivide_factor(N_MAX)} (FSDP)":
          predivide_factor(N_MAX)}
SCALES = [2.0**k for k in range(-8, 20, 2)]
overflowed, small_error = {}, {}
for label, before in ORDERS.items():
    for scale in SCALES:
        got = average(grads * scale, torch.float16, before).double() / scale
        overflowed[label, scale] = (~got.isfinite()).sum().item()
        small_error[label, scale] = relative_error(got[small], exact[small])

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
for label in ORDERS:
    left.plot(SCALES, [overflowed[label, s] for s in SCALES], "o-", label=label)
    right.plot(SCALES, [small_error[label, s] for s in SCALES], "o-", label=label)
left.set_yscale("symlog", linthresh=1)  # 0, then 1, 10, 100...
right.set_yscale("log")
SCALE = torch.amp.GradScaler(DEVICE.type).get_scale()  # GradScaler's initial scale
for ax in (left, right):
    ax.set_xscale("log", base=2)
    ax.set_xticks(SCALES, [f"$2^{{{math.log2(s):.0f}}}$" for s in SCALES], fontsize=8)
    ax.minorticks_off()
    ax.axvline(SCALE, color="grey", lw=0.8, ls="--", label="GradScaler's initial scale")
left.set(xlabel="loss scale", ylabel="numbers that overflowed", title="Too large: inf")
right.set(xlabel="loss scale", ylabel="error, smallest tenth", title="Too small: lost bits")
left.legend(fontsize=8)
plt.show()


# %%
def largest_safe(label):  # the largest scale at which nothing overflowed
    return max(s for s in SCALES if overflowed[label, s] == 0)


first, divide_first, split = ORDERS
for label in ORDERS:
    print(f"{label:>30}: nothing overflows up to a scale of 2^{math.log2(largest_safe(label)):.0f}"
          f"; error of the smallest tenth at 2^-4: {small_error[label, 2**-4]:.2f}, "
          f"at GradScaler's 2^16: {overflowed[label, SCALE]:,} numbers overflowed")
same = [torch.equal(average(grads, torch.bfloat16, b), average(grads, torch.bfloat16, 1))
        for b in ORDERS.values()]
print(f"bf16, the three orders bit for bit equal: {all(same)}")

# %%
assert SCALE == 2**16 and torch.amp.GradScaler(DEVICE.type).get_backoff_factor() == 0.5
assert overflowed[first, SCALE] > 0 and overflowed[split, SCALE] == 0
assert largest_safe(split) == largest_safe(divide_first) >= 8 * largest_safe(first)
assert small_error[divide_first, 2**-4] > 2 * small_error[split, 2**-4]
assert small_error[split, 2**-4] < 1.2 * small_error[first, 2**-4]
assert all(same)

# %% [markdown]
# How to read it. Summing first overflows at a scale 16 times (√256) lower than the others. It
# overflows already at GradScaler's starting scale. GradScaler then skips the step and halves its
# scale, until the sum fits. Its loop, on these gradients:

# %%
scale, skipped = SCALE, 0
while not average(grads * scale, torch.float16, 1).isfinite().all():  # sum, then / 256
    scale *= torch.amp.GradScaler(DEVICE.type).get_backoff_factor()  # 0.5
    skipped += 1
print(f"sum, then / 256: {skipped} skipped steps, scale 2^16 -> 2^{math.log2(scale):.0f}")
assert skipped >= 1 and largest_safe(first) <= scale < 4 * largest_safe(first)

# %% [markdown]
# Halving the scale is exact for a gradient in fp16's normal range: a power of 2 moves only the
# exponent. A gradient pushed below 6.1e-5, into the subnormals, loses one bit per halving. And
# dividing by 256 first overflows at the scale where casting each gradient to fp16 already does,
# on this grid of scales; so does the split. The cell measures both:

# %%
def cast_overflows(scale):  # each rank's gradient, cast to fp16 before any sum
    return not (grads * scale).to(torch.float16).isfinite().all()


def cast_error(scale):  # the smallest tenth's relative error after that cast, scale undone
    got = (grads * scale).to(torch.float16).double() / scale
    return relative_error(got[:, small], grads.double()[:, small])


cast_safe = max(s for s in SCALES if not cast_overflows(s))
print(f"the cast alone: nothing overflows up to 2^{math.log2(cast_safe):.0f}; error of the smallest "
      f"tenth after it: {cast_error(SCALE):.2e} at 2^16, {cast_error(scale):.2e} at "
      f"2^{math.log2(scale):.0f}, {cast_error(2**-4):.2e} at 2^-4")
assert largest_safe(divide_first) == largest_safe(split) == cast_safe
assert abs(cast_error(scale) / cast_error(SCALE) - 1) < 1e-9  # the halvings lost nothing
assert cast_error(2**-4) > cast_error(SCALE)  # the subnormals did

# %% [markdown]
# But at small scales dividing first loses the small gradients. The split has the good end of
# each: the top of dividing first, the bottom of summing first.
#
# bf16 needs none of this. FSDP2 divides before the sum only for the other formats: fp16, and
# float64 (notebook 08's table of divide factors). The same file says: "For fp32/bf16, we do not
# need to worry about overflow/underflow".
#
# ## 2. What training does with it
#
# One reduction on 256 ranks is off by 2e-2. Does a training run notice? We train a small MLP on
# Fashion-MNIST for a short run, with SGD and momentum. The course's global batch of 256 is shared
# by 64, then 256 emulated ranks: 4 images, then 1, per rank. Every step computes each rank's
# float32 gradient (vmap, as above). Then it averages as DDP's hooks do: cast, divide by N, ring
# sum. Float64 is the exact reference, the same for any N. Only the format of the sum differs
# between runs:

# %%
STEPS = 20 if SMOKE_TEST else 60
LR, MOMENTUM, GLOBAL_BATCH = 0.1, 0.5, 256
flat_images = images.flatten(1)
order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SEED))


def emulated_training(n_ranks, dtype, reference=None, steps=STEPS):
    torch.manual_seed(SEED)
    mlp = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10)).to(DEVICE)
    w = {name: p.detach().clone() for name, p in mlp.named_parameters()}
    start, sizes = torch.cat([v.flatten() for v in w.values()]), [v.numel() for v in w.values()]
    momentum = torch.zeros_like(start)
    loss_fn = lambda w, x, y: F.cross_entropy(functional_call(mlp, w, (x,)), y)
    per_rank = vmap(grad_and_value(loss_fn), in_dims=(None, 0, 0))
    losses, path = [], []  # path: the parameters, or their distance from the reference's
    for step in range(steps):
        idx = order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        xs = flat_images[idx].view(n_ranks, -1, 784).to(DEVICE)  # xs[r]: rank r's images
        g, loss = per_rank(w, xs, labels[idx].view(n_ranks, -1).to(DEVICE))
        g = torch.cat([v.flatten(1) for v in g.values()], dim=1)  # [ranks, numbers]
        if dtype == torch.float64:
            mean = g.double().mean(0).float()  # the exact mean, rounded once
        else:
            mean = ring_sum(g.to(dtype) / n_ranks, dtype).float()  # DDP's hooks, emulated
        momentum = MOMENTUM * momentum + mean  # SGD with momentum, on the flat parameters
        flat = torch.cat([v.flatten() for v in w.values()]) - LR * momentum
        pieces = flat.split(sizes)
        w = {name: piece.view_as(v) for (name, v), piece in zip(w.items(), pieces, strict=True)}
        losses.append(loss.mean().item())  # equal shares: the mean of the ranks' losses
        path.append(flat if reference is None else (flat - reference[step]).norm().item())
    return {"losses": losses, "start": start, "end": flat, "path": path}


reference = emulated_training(64, torch.float64)  # the exact mean: the same for any N
runs = {("fp64", 64): reference}
for n in (64, 256):
    for dtype in FORMATS:
        runs[NAME[dtype], n] = emulated_training(n, dtype, reference["path"])

# %% [markdown]
# The loss of each run, and how far its parameters are from the exact run's at every step. The
# distance is a fraction of how far training moved them, |θ − θ_exact| / |θ_exact − θ_start|, at the
# end:

# %%
travelled = (reference["end"] - reference["start"]).norm().item()
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
others = {f"{label}, {n} ranks": run for (label, n), run in runs.items() if label != "fp64"}
gst.plots.plot_loss_curves({label: run["losses"] for label, run in others.items()},
                           baseline={"exact mean (fp64)": reference["losses"]}, ax=left,
                           title=f"{STEPS} steps of SGD: the loss")
for i, (label, run) in enumerate(others.items()):
    right.semilogy([d / travelled for d in run["path"]], color=f"C{i}", label=label)
right.set(xlabel="step", ylabel="|θ − θ_exact| / distance travelled",
          title="The parameters: distance from the exact run")
right.grid(True, alpha=0.3)
right.legend(fontsize=8)
plt.show()

# %%
distance, final = {}, {}
for (label, n), run in runs.items():
    distance[label, n] = ((run["end"] - reference["end"]).norm() / travelled).item()
    final[label, n] = sum(run["losses"][-10:]) / 10
    print(f"{label}, {n:3} ranks: parameters {distance[label, n]:.1e} from the exact run's; "
          f"mean loss of the last 10 steps {final[label, n]:.4f}")

# %%
assert all(abs(final[k] - final["fp64", 64]) < 0.01 for k in final)  # the loss: no difference
assert all(distance["fp32", n] < 1e-5 for n in (64, 256))
assert all(distance[k, n] > 100 * distance["fp32", n] for k in ("bf16", "fp16") for n in (64, 256))
assert distance["bf16", 256] > 1.3 * distance["bf16", 64]  # grows with N, as one reduction does
assert distance["fp16", 256] < distance["bf16", 256]

# %% [markdown]
# The loss curves coincide. The distances grow step after step. Each step's rounding moves the
# parameters a little, and every later step starts from there. So at this size the 16-bit sums
# change where training goes, but not how well it trains. The bf16 runs move it by percents of the
# whole way, more at 256 ranks than at 64. The fp16 runs move it less, and fp32 by less than 1e-5.
#
# That is not a licence. pytorch#106395's model trained well on 96 GPUs and became unstable on 384.
# And the sum is only one place where a 16-bit format enters. In
# [torchtune#2254](https://github.com/meta-pytorch/torchtune/issues/2254), "Very bad convergence with
# bf16", setting "FSDP's `reduce_dtype=fp32`" "did not seem to help much". That run was "end-to-end
# bf16", its optimizer states included. The reduction is the cheap part to keep in float32.
#
# ## 3. The knobs, each measured
#
# ### DDP: compression hooks, a bf16 model, autocast
#
# One backward through DDP on 2 ranks, with a small MLP. The reference is the exact mean of the
# gradients each rank computes in the same way (float64 sum). DDP's own reduction is run as its hook
# `allreduce_hook`. Its docstring says: "DDP results is expected to be same as the case where no
# hook was registered". So every case's `dist.all_reduce` is counted, with the format of the tensor
# it carried:

# %%
def mlp():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def rank_batch(rank, world_size, device, dtype=torch.float32, size=64):
    images, labels = gst.data.load(train=True)
    idx = torch.arange(rank, size * world_size, world_size)  # every rank its own 64 images
    return images[idx].to(device, dtype), labels[idx].to(device)


def flat_grads(model):
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def ddp_backward(rank, world_size, hook=default_hooks.allreduce_hook, model_dtype=torch.float32,
                 autocast=False):
    device = gst.local_device()
    model = mlp().to(device, model_dtype)
    x, y = rank_batch(rank, world_size, device, model_dtype)

    def backward(m):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(m(x), y)
        loss.backward()

    own = copy.deepcopy(model)
    backward(own)  # this rank's own gradient, computed as DDP computes it
    exact = flat_grads(own)
    dist.all_reduce(exact)  # float64: the exact sum over the ranks
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, hook)
    with gst.detect.count_collectives() as calls:
        backward(ddp)
    carried = sorted({NAME[args[0].dtype] for args, _ in calls.arguments["all_reduce"]})
    got, mean = flat_grads(model), exact / world_size
    out = {"error": relative_error(got, mean), "carried": carried,
           "grad": NAME[model[1].weight.grad.dtype],
           "rounded once": (got == mean.to(model_dtype).double()).double().mean().item()}
    del ddp  # freed before the launcher destroys the process group
    return out


cases = {
    "fp32 model, DDP's reduction": {},
    "fp32 model, bf16_compress_hook": {"hook": default_hooks.bf16_compress_hook},
    "fp32 model, fp16_compress_hook": {"hook": default_hooks.fp16_compress_hook},
    "bf16 model (.to(bfloat16))": {"model_dtype": torch.bfloat16},
    "fp32 model, autocast(bfloat16)": {"autocast": True},
}
ddp_runs = {label: gst.launch(partial(ddp_backward, **kwargs), WORLD_SIZE)[0]
            for label, kwargs in cases.items()}

# %%
for label, out in ddp_runs.items():
    print(f"{label:>31}: all_reduce carried {', '.join(out['carried'])}, .grad is "
          f"{out['grad']}; error against the exact mean {out['error']:.1e}")
print("bf16_compress_hook's docstring:",
      default_hooks.bf16_compress_hook.__doc__.strip().splitlines()[0])

# %%
fp32_ddp, bf16_hook, fp16_hook, bf16_model, autocast_ddp = ddp_runs.values()
assert fp32_ddp["carried"] == autocast_ddp["carried"] == ["fp32"]  # autocast: fp32 gradients
assert bf16_hook["carried"] == bf16_model["carried"] == ["bf16"]
assert fp16_hook["carried"] == ["fp16"]
assert fp32_ddp["error"] < 1e-6 and autocast_ddp["error"] < 1e-6
assert 1e-4 < bf16_hook["error"] < 1e-2 and 1e-4 < bf16_model["error"] < 1e-2
assert fp16_hook["error"] < bf16_hook["error"] / 4
assert "NCCL" in default_hooks.bf16_compress_hook.__doc__

# %% [markdown]
# How to read it:
#
# * **`torch.autocast` alone keeps the reduction in float32.** Autocast runs the forward's matrix
#   products in bf16. But the parameters stay float32, so their gradients do, and DDP reduces
#   float32 buckets: the safe setup.
# * **The compression hooks** cast each bucket to bf16 or fp16, divide it by N and all-reduce it in
#   that format. That halves the bytes, with the error of section 1 (here on 2 ranks). The bf16 hook
#   works on gloo, although its docstring (printed above) warns that
#   `it requires NCCL version later than 2.9.6`.
# * **A model converted to bf16** has bf16 gradients. DDP reduces them in bf16, with its own
#   reduction or a compression hook. A hook of your own can sum them in float32 (next).
#
# ### A bf16 model with DDP: a hook that sums in float32
#
# DDP calls a communication hook "once the bucket is ready" (torch's `register_comm_hook`
# docstring). The hook returns a `Future` that holds the bucket's new value. The same docstring
# warns: "Grad bucket's tensors will not be predivided by world_size. User is responsible to divide
# by the world_size". So the hook below casts the bf16 bucket to float32, all-reduces that copy, and
# divides. `copy_` then rounds the float32 mean to bf16 once, into DDP's bucket. DDP keeps its
# buckets, each reduced while backward goes on. Torch's own `fp16_compress_hook` has the same
# shape, with the cast going down.

# %%
def fp32_allreduce_hook(process_group, bucket):  # a bf16 model's bucket, summed in float32
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer()  # bf16: this bucket's gradients, flat
    wide = buffer.float()  # a float32 copy: the sum is float32, sent and added
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()
    return future.then(lambda f: buffer.copy_(f.value()[0] / group.size()))  # bf16, once


# %% [markdown]
# The check runs the bf16 model of the table above on 2 and 3 ranks, with DDP's own reduction and
# with this hook. The reference is the exact mean (float64), rounded once to bf16: what the
# exercise below asks for by hand. We count the numbers equal to it:

# %%
upcast = {}
for n in (2, 3):
    for label, kwargs in {"DDP's reduction": {}, "fp32_allreduce_hook": {
            "hook": fp32_allreduce_hook}}.items():
        upcast[label, n] = gst.launch(partial(ddp_backward, model_dtype=torch.bfloat16,
                                              **kwargs), n)[0]
        out = upcast[label, n]
        print(f"bf16 model, {n} ranks, {label:>19}: all_reduce carried "
              f"{', '.join(out['carried'])}, .grad is {out['grad']}; equal to the exact mean "
              f"rounded once to bf16: {out['rounded once']:.1%}; error {out['error']:.1e}")

# %%
for n in (2, 3):
    hooked, plain = upcast["fp32_allreduce_hook", n], upcast["DDP's reduction", n]
    assert hooked["carried"] == ["fp32"] and plain["carried"] == ["bf16"]
    assert torch.float32.itemsize == 2 * torch.bfloat16.itemsize  # the hook sends twice the bytes
    assert hooked["grad"] == "bf16" and hooked["rounded once"] > 1 - 1e-3  # a tie, at most
assert upcast["DDP's reduction", 3]["rounded once"] < 0.9  # a bf16 sum of 3 rounds twice
assert upcast["fp32_allreduce_hook", 3]["error"] < upcast["DDP's reduction", 3]["error"]
doc = " ".join(DDP.register_comm_hook.__doc__.split())  # the docstring quoted above
assert "once the bucket is ready" in doc and "not be predivided by world_size" in doc

# %% [markdown]
# On 2 ranks the two agree. A bf16 sum of 2 numbers is one addition, rounded once, and so is the
# hook's float32 mean copied to bf16. From 3 ranks on, a bf16 sum rounds at every addition, and
# part of its numbers leave the exact mean's nearest bf16 neighbour. The hook's do not: its error
# is the one rounding that bf16 gradients cannot avoid. It costs twice the bytes of a bf16
# all-reduce, as FSDP2's `reduce_dtype=torch.float32` does (next).
#
# Megatron-LM makes the same choice a switch: `grad_reduce_in_fp32`, "If true, reduce grads in
# fp32", off by default
# ([DistributedDataParallelConfig](https://docs.nvidia.com/megatron-core/developer-guide/latest/apidocs/core/core.distributed.distributed_data_parallel_config.html)).
#
# ### FSDP2: `MixedPrecisionPolicy(param_dtype, reduce_dtype)`
#
# FSDP2 runs forward and backward in `param_dtype` and reduces in `reduce_dtype`. (Notebook 08,
# [08_sharded_gradients.ipynb](08_sharded_gradients.ipynb), shows how it reduce-scatters the
# gradients.) Here is what `reduce_dtype=None` means, in torch's own docstring:

# %%
try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # torch >= 2.6
except ImportError:
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

doc = " ".join(MixedPrecisionPolicy.__doc__.split())
print(doc[doc.index("reduce_dtype ("):doc.index("(Default: ``None``) output_dtype")])
assert ("If this is ``None`` but ``param_dtype`` is not ``None``, then the reduction uses the "
        "compute dtype") in doc


# %% [markdown]
# Measured on 2 ranks: the model in bf16 for compute (`param_dtype=torch.bfloat16`), with each of
# the three `reduce_dtype`s. The reference is the exact mean of the bf16 gradients each rank
# computes:

# %%
def fsdp_backward(rank, world_size, policy):
    from torch.distributed.device_mesh import init_device_mesh

    device = gst.local_device()
    mesh = init_device_mesh(device.type, (world_size,))
    model = mlp().to(device)
    x, y = rank_batch(rank, world_size, device)
    own = copy.deepcopy(model).to(policy.param_dtype or torch.float32)
    F.cross_entropy(own(x.to(policy.param_dtype or torch.float32)).float(), y).backward()
    exact = flat_grads(own)  # this rank's gradient, computed in param_dtype as FSDP does
    dist.all_reduce(exact)
    for layer in (model[1], model[3], model):  # each Linear its own FSDP unit, then the root
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    F.cross_entropy(model(x).float(), y).backward()
    got = torch.cat([p.grad.full_tensor().double().flatten() for p in model.parameters()])
    return {"error": relative_error(got, exact / world_size), "grad": got}


policies = {
    "reduce_dtype=None": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "reduce_dtype=bfloat16": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.bfloat16),
    "reduce_dtype=float32": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32),
}
fsdp_runs = {label: gst.launch(fsdp_backward, WORLD_SIZE, (policy,))[0]
             for label, policy in policies.items()}

# %%
for label, out in fsdp_runs.items():
    print(f"param_dtype=bfloat16, {label:>21}: error against the exact mean {out['error']:.1e}")
none, bf16_reduce, fp32_reduce = fsdp_runs.values()
print("reduce_dtype=None and reduce_dtype=bfloat16 give the same gradients, bit for bit:",
      torch.equal(none["grad"], bf16_reduce["grad"]))
assert torch.equal(none["grad"], bf16_reduce["grad"])
assert fp32_reduce["error"] < 1e-6 < 1e-4 < none["error"] < 1e-2

# %% [markdown]
# So with a bf16 `param_dtype`, leaving `reduce_dtype` out reduces in bf16.
# `reduce_dtype=torch.float32` reduces the same bf16 gradients to float32 rounding. Each rank's
# gradient is cast up before the reduce-scatter, and the sum is float32. It sends twice the bytes
# of bf16, the price pytorch#106395 named: "the model now runs slower since it's sending around full-precision
# gradients".
#
# ### fp16 and `GradScaler` with DDP: unscale before clipping
#
# With fp16 autocast, `GradScaler` multiplies the loss by its scale (2^16 at first). Small gradients
# then survive backward in fp16. It divides the gradients by it before the step. DDP averages the
# *scaled* gradients during `backward()`; the scaler does not mind. Gradient clipping does.
# `clip_grad_norm_` must see the true gradients, so call `scaler.unscale_(optimizer)` first. In the
# wrong order it clips the scaled gradients to `max_norm`. `scaler.step()` then divides them by the
# scale once more. Twenty steps on 2 ranks, in both orders:

# %%
def fp16_training(rank, world_size, unscale_first, steps=20, max_norm=1.0):
    device = gst.local_device()
    model = DDP(mlp().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type)  # fp16 needs it; its scale starts at 2^16
    x, y = rank_batch(rank, world_size, device)
    norms, losses = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()  # DDP averages the gradients of scale x loss
        if unscale_first:
            scaler.unscale_(optimizer)  # the true gradients, before clipping
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        scaler.step(optimizer)  # unscales now if unscale_ was not called; skips on inf
        scaler.update()
        losses.append(loss.item())
    del model
    return {"norms": norms, "losses": losses, "scale": scaler.get_scale()}


clipping = {"unscale_, then clip": gst.launch(fp16_training, WORLD_SIZE, (True,))[0],
            "clip, then step (wrong)": gst.launch(fp16_training, WORLD_SIZE, (False,))[0]}

# %%
for label, run in clipping.items():
    print(f"{label:>24}: clip_grad_norm_ saw a norm of {run['norms'][0]:.4g} at step 1; loss "
          f"{run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}; scale {run['scale']:.0f}")
right, wrong = clipping.values()
ratio = wrong["norms"][0] / right["norms"][0]
print(f"the wrong order's norm / the right one's = {ratio:.0f}: the scale")
assert abs(ratio / right["scale"] - 1) < 0.01 and right["scale"] == wrong["scale"] == 2**16
assert right["losses"][-1] < 0.8 * right["losses"][0]
assert abs(wrong["losses"][-1] - wrong["losses"][0]) < 1e-3 * wrong["losses"][0]

# %% [markdown]
# The wrong order runs without a message and does not train. Every step is clipped to a norm of 1 in
# scaled units, then divided by 65,536. bf16 needs no scaler, since its range is fp32's.

# %% [markdown]
# ### fp16 with sharded gradients: every rank must skip the same step
#
# `GradScaler` skips a step when it finds an inf in the gradients it holds. With sharded gradients
# each rank holds only its shard. An overflow in rank 0's shard is then rank 0's alone. Rank 0
# skips the step and rank 1 takes it, and the two halves of the model no longer fit together.
# `ShardedGradScaler` all-reduces the "found inf" flag, so every rank skips. We put an inf in one
# number of rank 0's gradient, after backward, in two kinds of shards. A plain tensor per rank is
# a hand-written ZeRO, as in notebook 08. FSDP2's gradients are DTensors:

# %%
import warnings

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def overflow_step(rank, world_size, scaler_type, shards):
    device = gst.local_device()
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    if shards == "FSDP2 (DTensor)":
        fully_shard(model)
    else:  # "plain tensors": rank r keeps its rows of the weight, as a ZeRO shard
        model.weight = nn.Parameter(model.weight.detach().chunk(world_size)[rank].clone())
        model.bias = nn.Parameter(model.bias.detach().chunk(world_size)[rank].clone())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_type(device.type)
    x = torch.randn(3, 8, device=device)
    loss = model(x).square().sum()  # with a shard of the rows, rank r computes its outputs
    scaler.scale(loss).backward()
    if rank == 0:
        with torch.no_grad():  # to_local() is then the DTensor's own storage
            grad = model.weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.inf
    with warnings.catch_warnings():  # DTensor's note on the scaler's 1-number flag
        warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1")
        scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() < 2**16  # halved: this rank skipped the step


skips = {(scaler_type.__name__, shards): gst.launch(
             overflow_step, WORLD_SIZE, (scaler_type, shards))
         for scaler_type in (torch.amp.GradScaler, ShardedGradScaler)
         for shards in ("plain tensors", "FSDP2 (DTensor)")}

# %%
for (scaler_name, shards), skipped in skips.items():
    print(f"{scaler_name:>17}, {shards:<15}: skipped the step on ranks "
          f"{[r for r, s in enumerate(skipped) if s]} of {WORLD_SIZE}")
assert skips["GradScaler", "plain tensors"] == [True] + [False] * (WORLD_SIZE - 1)
assert all(all(s) for key, s in skips.items() if key != ("GradScaler", "plain tensors"))
dtensor_handlers = torch.distributed.tensor.DTensor._op_dispatcher._custom_op_handlers
assert torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default in dtensor_handlers

# %% [markdown]
# With plain tensors, `GradScaler` lets the ranks disagree, without a message. Use
# `ShardedGradScaler` (`torch.distributed.fsdp.sharded_grad_scaler`) for any hand-sharded fp16
# training. FSDP2's DTensor gradients need no change: DTensor's dispatcher handles the scaler's inf
# check itself. It reduces the flag over the shards, with a maximum (`found_inf_reduce_handler`, in
# torch's `torch/distributed/tensor/_dispatch.py`). The last assert checks that torch has that
# handler.
#
# ## 4. Compression is not averaging: PowerSGD
#
# DDP's other built-in hook, PowerSGD, sends a low-rank approximation of each gradient matrix
# instead of the matrix. For a weight of m×n numbers and an approximation of matrix rank k, each
# rank sends (m + n)·k numbers; the 1-D biases go whole. What arrives is not the mean gradient, and
# the hook knows it. With *error feedback* each rank keeps what the approximation left out and adds
# it to the next step's gradient. Over many steps the sum of what arrived then approaches the sum of
# the true means.
#
# We measure it with the same batch and the same weights at every step, with no optimizer step. So
# the exact mean is one fixed vector. We measure each step's error, and the error of the running
# average of what arrived, with and without error feedback. The first 2 steps are plain all-reduces:
# `start_powerSGD_iter=2`, the least torch allows with error feedback:

# %%
def powersgd_steps(rank, world_size, steps, error_feedback, matrix_rank=1):
    device = gst.local_device()
    model = mlp().to(device)
    x, y = rank_batch(rank, world_size, device)
    own = copy.deepcopy(model)
    F.cross_entropy(own(x), y).backward()
    exact = flat_grads(own)
    dist.all_reduce(exact)
    exact /= world_size
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=matrix_rank,
                                   start_powerSGD_iter=2, min_compression_rate=1,
                                   use_error_feedback=error_feedback)
    ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    total, step_error, running_error, sent = 0, [], [], []
    for step in range(steps):
        ddp.zero_grad()
        with gst.detect.count_collectives() as calls:
            F.cross_entropy(ddp(x), y).backward()
        got = flat_grads(model)
        total = total + got
        step_error.append(relative_error(got, exact))
        running_error.append(relative_error(total / (step + 1), exact))
        sent.append(sum(args[0].numel() for args, _ in calls.arguments["all_reduce"]))
    del ddp
    return {"step": step_error, "running": running_error, "sent": sent}


PSGD_STEPS = 30 if SMOKE_TEST else 60
psgd = {"error feedback": gst.launch(powersgd_steps, WORLD_SIZE, (PSGD_STEPS, True))[0],
        "no error feedback": gst.launch(powersgd_steps, WORLD_SIZE, (PSGD_STEPS, False))[0]}

# %%
fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
for i, (label, run) in enumerate(psgd.items()):
    ax.plot(run["step"], f"C{i}:", label=f"{label}: this step's gradient")
    ax.plot(run["running"], f"C{i}-", label=f"{label}: average of the steps so far")
ax.set(xlabel="step", ylabel="|error| / |mean gradient|", ylim=(0, None),
       title="PowerSGD (matrix rank 1) on 2 ranks: the same gradients every step")
fig.legend(fontsize=8, loc="outside lower center", ncols=2)  # below the axes, off the curves
plt.show()

# %%
ef, no_ef = psgd.values()
params = sum(p.numel() for p in mlp().parameters())
fewer = ef["sent"][0] / ef["sent"][-1]
print(f"numbers all-reduced per step: {ef['sent'][0]:,} in the first 2 steps (all {params:,} "
      f"gradients), {ef['sent'][-1]:,} from step 3 on ({fewer:.0f}x fewer)")
for label, run in psgd.items():
    print(f"{label:>17}: error of one step {min(run['step'][2:]):.2f} to "
          f"{max(run['step'][2:]):.2f}; of the average after {PSGD_STEPS} steps "
          f"{run['running'][-1]:.2f}")
assert ef["sent"][0] == params and ef["sent"][-1] < params / 50
assert ef["step"][0] < 1e-6 and min(ef["step"][2:] + no_ef["step"][2:]) > 0.3
assert ef["running"][-1] < 0.75 * no_ef["running"][-1] and ef["running"][-1] > 0.05

# %% [markdown]
# Each compressed step is off by about as much as the gradient itself: a rank-1 picture of a 256×784
# matrix. With error feedback it is off by more, since it adds what earlier steps left out. Error
# feedback makes the *average* over steps converge to the mean, slowly; without it the average stays
# wrong. So a PowerSGD step is not an average of the ranks' gradients. It is a different optimizer.
# Its docstring says to tune its `matrix_approximation_rank` and `start_powerSGD_iter` for the
# model's accuracy.
#
# What it buys is bytes: about 130 times fewer numbers here. That pays only where a step waits for
# moving gradients, not for computing them, as on machines joined by a slow network. Its docstring
# says it too: "a tensor is worth compressing only if there can be sufficient saving in bandwidth".
# Nothing here measured that.

# %% [markdown]
# ## Copy this into your code
#
# Compute in low precision, reduce in float32. Keep the parameters in float32 and run the forward
# under `torch.autocast`: bf16, or fp16 with a `GradScaler`. DDP then reduces float32 gradients.
# Unscale before clipping. The script `snippets/09_mixed_precision_ddp.py` trains a step in each
# format. The course's tests run it with `torchrun --standalone --nproc-per-node 2`. It checks on
# every rank that DDP reduced float32 and that clipping saw the true mean gradient:
#
# <!-- snippets/09_mixed_precision_ddp.py -->
# ```python
# """Notebook 09, copy this into your code: compute in bf16 or fp16, average the gradients in fp32.
#
#     torchrun --standalone --nproc-per-node 2 snippets/09_mixed_precision_ddp.py
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
# from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
# from torch.nn.parallel import DistributedDataParallel as DDP
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
# def train_step(model, optimizer, scaler, x, y, dtype, max_norm=1.0):
#     with torch.autocast(x.device.type, dtype=dtype):   # forward in bf16/fp16, weights stay fp32
#         loss = F.cross_entropy(model(x), y)
#     scaler.scale(loss).backward()                      # DDP all-reduces fp32 gradients
#     scaler.unscale_(optimizer)                         # first the true gradients...
#     norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # ...then clip them
#     scaler.step(optimizer)                             # skipped if a gradient is inf or nan
#     scaler.update()
#     optimizer.zero_grad(set_to_none=True)
#     return norm
#
#
# def check_one_step(dtype, device, x, y):
#     torch.manual_seed(0)                               # the same initial weights on every rank
#     net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3)).to(device)
#     model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
#     reduced = []
#
#     def watch(state, bucket):                          # for the check: what DDP reduces
#         reduced.append(bucket.buffer().dtype)
#         return default_hooks.allreduce_hook(state, bucket)   # what DDP does without a hook
#
#     model.register_comm_hook(None, watch)
#     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
#     scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 only
#     own = copy.deepcopy(net)                           # this rank's own gradient, without DDP
#     with torch.autocast(device.type, dtype=dtype):
#         own_loss = F.cross_entropy(own(x), y)
#     own_loss.backward()                                # backward outside autocast, as above
#     mean = torch.cat([p.grad.flatten() for p in own.parameters()])
#     dist.all_reduce(mean)
#     norm = train_step(model, optimizer, scaler, x, y, dtype)
#
#     # Check: DDP reduced fp32, and clip_grad_norm_ saw the true mean gradient's norm.
#     assert set(reduced) == {torch.float32}, reduced
#     torch.testing.assert_close(norm, (mean / dist.get_world_size()).norm(), rtol=1e-3, atol=0)
#     del model                                          # before the process group goes
#
#
# def main():
#     device = init_distributed()
#     rank = dist.get_rank()
#     g = torch.Generator().manual_seed(rank)            # every rank its own batch
#     x, y = torch.randn(32, 20, generator=g), torch.randint(0, 3, (32,), generator=g)
#     for dtype in (torch.bfloat16, torch.float16):
#         check_one_step(dtype, device, x.to(device), y.to(device))
#     print(f"rank {rank}: bf16 and fp16 autocast: DDP reduced fp32 gradients, "
#           f"clipped after unscale_")
#     dist.destroy_process_group()
#
#
# if __name__ == "__main__":
#     main()
# ```
#
# With FSDP2 the same choice is
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`. Leaving
# `reduce_dtype` out reduces in bf16. A DDP model converted to bf16 (`model.to(torch.bfloat16)`)
# reduces in bf16. Register section 3's `fp32_allreduce_hook` on it, or average by hand, as in the
# exercise.
#
# ## Exercise
#
# Write `average_gradients_in_fp32(model)` for a model trained entirely in bf16: its weights and its
# gradients are bf16. Every rank must end with the mean of the ranks' gradients in `p.grad`, still
# bf16, with the **sum in float32**. Copy the gradients into one float32 buffer
# (`torch.cat([p.grad.float().flatten() ...])`), all-reduce it, and divide. Then copy the pieces
# back into each `p.grad`; `copy_` rounds to bf16, once. That is the float32 sum that
# `reduce_dtype=torch.float32` and Megatron's `grad_reduce_in_fp32` keep.
#
# The check below runs it on 2 ranks, then 3 to 5, each with the course's CNN in bf16 and its own
# gradients. It reads the format of what your `all_reduce` carried and what it delivered. It
# compares every rank's gradients with the exact mean rounded once to bf16. It prints "✓ correct",
# or fails with what is wrong. Until you write the function, it says "not attempted yet". Stuck?
# `%load solutions/09_average_gradients_in_fp32.py` in a new cell.

# %%
def average_gradients_in_fp32(model):
    # your code here: a float32 buffer, one dist.all_reduce, divide, copy back into p.grad
    raise NotImplementedError("write average_gradients_in_fp32")


# %%
gst.exercises.check_average_gradients_in_fp32(average_gradients_in_fp32)
