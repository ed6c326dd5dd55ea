"""Notebook 12, copy this into your code: a top-1 mixture-of-experts layer with expert
parallelism, and its gradients reduced right: experts over their expert-data-parallel group,
everything divided by the whole data-parallel size.

    torchrun --standalone --nproc-per-node 2 snippets/12_expert_gradients.py  # or 4 ranks
"""

import copy
import os
import warnings

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), gloo may abort at exit (see notebook 06)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

EP, HIDDEN, TOKENS = 2, 8, 16  # experts (one per rank of an EP group), features, tokens/rank


def init_distributed():
    """Join the group torchrun prepared (RANK, WORLD_SIZE, MASTER_ADDR...); return the device.

    With a GPU for every rank on this machine: nccl, this rank on GPU LOCAL_RANK. Otherwise
    gloo, on the CPU (a laptop; also 2 ranks on 1 GPU, which nccl cannot share): with a
    warning that gives both numbers when CUDA is there but has fewer GPUs than ranks.
    """
    local_rank, ranks_here = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    if gpus >= ranks_here:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)          # before init: nccl and *_object calls use it
        dist.init_process_group("nccl", device_id=device)  # barrier() too
        return device
    if gpus:                                   # CUDA, but not a GPU per rank: never silently
        warnings.warn(f"{gpus} GPU(s) visible for {ranks_here} ranks on this machine: this "
                      "job trains on the CPU with gloo. For nccl, start one rank per GPU "
                      f"(--nproc-per-node {gpus}) or check CUDA_VISIBLE_DEVICES.", stacklevel=2)
    dist.init_process_group("gloo")
    return torch.device("cpu")


class MoE(nn.Module):
    """A dense layer, a top-1 router, EP experts. forward(): all experts, one process."""

    def __init__(self):
        super().__init__()
        self.dense, self.router = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, EP)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EP))

    def route(self, x):
        h = torch.tanh(self.dense(x))
        logits = self.router(h)
        choice = logits.argmax(dim=-1)                     # each token's expert
        return h, choice, logits.softmax(dim=-1).gather(1, choice[:, None])  # the gate

    def forward(self, x):
        h, choice, gate = self.route(x)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            y[choice == e] = expert(h[choice == e])
        return gate * y


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward sends the gradients back."""

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


def expert_parallel(layer, expert, x, ep_group):
    """The layer on this rank: its tokens x, its one expert; the others on ep_group."""
    h, choice, gate = layer.route(x)
    order = torch.argsort(choice, stable=True)         # tokens sorted by expert = by EP rank
    send = torch.bincount(choice, minlength=EP)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep_group)  # how many tokens each rank sends me
    send, recv = send.tolist(), recv.tolist()
    routed = AllToAll.apply(h[order], send, recv, ep_group)              # dispatch
    back = AllToAll.apply(expert(routed), recv, send, ep_group)          # combine
    return gate * back[torch.argsort(order)]


def sync_moe_gradients(dense_params, expert_params, expert_group, divide_by=None):
    """After each rank's backward on the mean loss over its own tokens: every .grad is one
    process's on every rank's tokens. divide_by: what to divide by (default: right)."""
    world_size = dist.get_world_size()                 # every rank brought tokens
    for p in dense_params:
        dist.all_reduce(p.grad)                        # SUM over all ranks
        p.grad /= world_size
    for p in expert_params:
        dist.all_reduce(p.grad, group=expert_group)    # SUM over the ranks holding this expert
        p.grad /= divide_by or world_size              # NOT the expert group's size: × EP


def main():
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size % EP:                                # a mesh would leave ranks out: refuse
        raise SystemExit(f"run a multiple of EP = {EP} ranks (--nproc-per-node 2, 4...), not "
                         f"{world_size}: each expert-parallel group holds EP ranks")
    mesh = init_device_mesh(device.type, (world_size // EP, EP), mesh_dim_names=("edp", "ep"))
    ep_rank, edp_group = mesh.get_local_rank("ep"), mesh["edp"].get_group()
    torch.manual_seed(0)                               # the same initial weights on every rank
    whole = MoE().to(device, torch.float64)
    g = torch.Generator().manual_seed(1)               # one global batch, a slice per rank
    x = torch.randn(world_size * TOKENS, HIDDEN, generator=g, dtype=torch.float64).to(device)
    y = torch.randn(world_size * TOKENS, HIDDEN, generator=g, dtype=torch.float64).to(device)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)

    grads = {}
    for name, divide_by in (("right", None), ("÷ EDP", dist.get_world_size(edp_group))):
        layer = copy.deepcopy(whole)
        expert = layer.experts[ep_rank]                # this rank uses only its own expert
        out = expert_parallel(layer, expert, x[mine], mesh["ep"].get_group())
        F.mse_loss(out, y[mine]).backward()            # the mean over this rank's tokens
        dense = [*layer.dense.parameters(), *layer.router.parameters()]
        sync_moe_gradients(dense, list(expert.parameters()), edp_group, divide_by)
        grads[name] = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}

    # Check: one process on every rank's tokens, every expert in it.
    F.mse_loss(whole(x), y).backward()
    for n, g_ in grads["right"].items():
        torch.testing.assert_close(g_, dict(whole.named_parameters())[n].grad)
    w = f"experts.{ep_rank}.weight"
    torch.testing.assert_close(grads["÷ EDP"][w], EP * dict(whole.named_parameters())[w].grad)
    print(f"rank {rank}: on {device.type} ({dist.get_backend()}), expert {ep_rank}, EDP "
          f"{world_size // EP}: gradients == one process's; ÷ the EDP size gives {EP}×")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
