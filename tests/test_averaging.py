"""gst.averaging: every variant gives DDP's gradients; the ring all-reduce equals all_reduce.

Real ranks (gloo, CPU) through ``gst.launch``. The launches are grouped by world size, since
consecutive launches with the same world size reuse the same worker processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import gradsync_tutorial as gst
from gradsync_tutorial.averaging import VARIANTS, Bucket, make_buckets, prepare
from gradsync_tutorial.model import Net

from .conftest import REPO

SMALL_CAP_MB = 0.015  # cuts the CNN into 3 buckets (at the default 25 MiB it is one)


def variants_vs_ddp(rank, world_size, steps, cap_mb):
    """In every rank: each variant trains `steps` SGD steps on this rank's own random batches;
    returns, per variant, the max |grad - DDP's grad| at each step and the final parameters."""
    import torch
    import torch.nn.functional as F

    import gradsync_tutorial as gst

    def batch(step):  # different on every rank and at every step, the same for every variant
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)

    grads, params, calls = {}, {}, {}
    for variant in gst.averaging.VARIANTS:
        torch.manual_seed(0)
        model = gst.model.Net()
        net, average = gst.averaging.prepare(model, variant, bucket_cap_mb=cap_mb)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        grads[variant] = []
        for step in range(steps):
            x, y = batch(step)
            optimizer.zero_grad()
            F.nll_loss(net(x), y).backward()
            average()
            grads[variant].append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
        params[variant] = [p.detach().clone() for p in model.parameters()]
        # the replicas hold the same parameters on every rank
        gst.checks.assert_replicas_equal(model)
        calls[variant] = len(getattr(average, "buckets", [None]))
    return {"grads": grads, "params": params, "calls": calls}


def check_against_ddp(results, exact):
    for rank, out in enumerate(results):
        ddp_grads, ddp_params = out["grads"]["ddp"], out["params"]["ddp"]
        for variant in VARIANTS:
            for step, (mine, ref) in enumerate(zip(out["grads"][variant], ddp_grads, strict=True)):
                for g, r in zip(mine, ref, strict=True):
                    if exact:
                        assert torch.equal(g, r), f"{variant}, rank {rank}, step {step}"
                    else:
                        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7,
                                                   msg=f"{variant}, rank {rank}, step {step}")
            for p, r in zip(out["params"][variant], ddp_params, strict=True):
                torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    calls = results[0]["calls"]
    assert calls["bucketed"] == calls["overlap"] == 3 and calls["flat"] == 1


def ring_checks(rank, world_size, sizes):
    """In every rank: ring_all_reduce vs dist.all_reduce on integer-valued and random floats."""
    import torch
    import torch.distributed as dist

    import gradsync_tutorial as gst

    out = []
    for size in sizes:
        g = torch.Generator().manual_seed(rank * 7919 + size)
        ints = torch.randint(-1000, 1000, (size,), generator=g).float()
        floats = torch.randn(size, generator=g, dtype=torch.float64).float()
        row = {"size": size}
        for kind, t in (("ints", ints), ("floats", floats)):
            ring, ref = t.clone(), t.clone()
            row["sent"] = gst.averaging.ring_all_reduce(ring)
            dist.all_reduce(ref)
            row[kind] = (ring, ref)
        matrix = torch.arange(12.0).reshape(3, 4) * (rank + 1)  # 2-D, in place
        gst.averaging.ring_all_reduce(matrix)
        row["matrix"] = matrix
        out.append(row)
    try:
        gst.averaging.ring_all_reduce(torch.zeros(4, 4).t())
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    return out


def check_ring(results, world_size, sizes):
    n = world_size
    for rank_rows in results:
        assert "contiguous" in rank_rows[-1]
    for i, size in enumerate(sizes):
        rows = [r[i] for r in results]
        for row in rows:
            ring, ref = row["ints"]
            assert torch.equal(ring, ref), f"{n} ranks, size {size}: integers differ"
            ring, ref = row["floats"]
            torch.testing.assert_close(ring, ref, rtol=1e-5, atol=1e-5)
            expected = torch.arange(12.0).reshape(3, 4) * (n * (n + 1) / 2)
            assert torch.equal(row["matrix"], expected)
        sent = [row["sent"] for row in rows]
        # every chunk goes N-1 times round the ring in each phase: 2(N-1)/N x size per rank
        assert sum(sent) == 2 * (n - 1) * 4 * size
        assert max(sent) - min(sent) <= 2 * (n - 1) * 4


SIZES = [1, 2, 3, 5, 10, 1001, 21_841]  # small, and not divisible by 2, 3 or 4


def test_two_ranks_variants_equal_ddp_exactly_and_ring():
    # 2 ranks: dividing by 2 is exact and sums of two numbers do not depend on order, so
    # every variant gives DDP's gradients bit for bit.
    results = gst.launch(variants_vs_ddp, world_size=2, args=(3, SMALL_CAP_MB), timeout=120)
    check_against_ddp(results, exact=True)
    check_ring(gst.launch(ring_checks, world_size=2, args=(SIZES,), timeout=120), 2, SIZES)


def test_three_ranks_variants_close_to_ddp_and_ring():
    results = gst.launch(variants_vs_ddp, world_size=3, args=(3, SMALL_CAP_MB), timeout=120)
    check_against_ddp(results, exact=False)
    check_ring(gst.launch(ring_checks, world_size=3, args=(SIZES,), timeout=120), 3, SIZES)


def test_four_ranks_ring_and_docstring_example():
    check_ring(gst.launch(ring_checks, world_size=4, args=(SIZES,), timeout=120), 4, SIZES)

    def doc_example(rank, world_size):
        import torch

        import gradsync_tutorial as gst

        t = torch.full((10,), rank + 1.0)
        sent = gst.averaging.ring_all_reduce(t)
        return t[0].item(), sent

    assert gst.launch(doc_example, world_size=4) == [(10.0, 60), (10.0, 64), (10.0, 60),
                                                     (10.0, 56)]


def test_overlap_misuse_and_remove():
    def run(rank, world_size):
        import torch
        import torch.nn.functional as F

        import gradsync_tutorial as gst

        model = gst.model.Net()
        average = gst.averaging.OverlappedAverager(model)
        out = {}
        try:
            average()  # no backward yet: no bucket launched
        except RuntimeError as e:
            out["early"] = str(e)
        x, y = torch.randn(4, 1, 28, 28), torch.zeros(4, dtype=torch.long)
        F.nll_loss(model(x), y).backward()
        average()  # fine now
        average.remove()
        model.zero_grad()
        F.nll_loss(model(x), y).backward()
        out["after_remove"] = len(average.works)  # no hook ran
        return out

    out = gst.launch(run, world_size=2, timeout=60)[0]
    assert "call it once after each loss.backward()" in out["early"]
    assert out["after_remove"] == 0


def test_make_buckets_reverse_order_and_cap():
    net = Net()
    names = {p: n for n, p in net.named_parameters()}
    buckets = make_buckets(net.parameters(), SMALL_CAP_MB)
    assert [[names[p] for p in b] for b in buckets] == [
        ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"],
        ["conv2.bias", "conv2.weight"],
        ["conv1.bias", "conv1.weight"],
    ]
    assert len(make_buckets(net.parameters())) == 1  # default 25 MiB: one bucket
    assert [len(b) for b in make_buckets(net.parameters(), 0)] == [1] * 8  # one per tensor


def test_bucket_fill_unload_and_errors():
    net = Net()
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    bucket = Bucket(net.parameters())
    bucket.fill()
    expected = torch.cat([p.grad.flatten() for p in net.parameters()])
    assert torch.equal(bucket.buffer, expected)
    bucket.unload(4)
    for p, piece in zip(net.parameters(), expected.split([p.numel() for p in net.parameters()]),
                        strict=True):
        assert torch.equal(p.grad, piece.view_as(p) / 4)
    net.fc2.bias.grad = None
    with pytest.raises(RuntimeError, match="no gradient"):
        bucket.fill()
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        prepare(net, "fast")


def test_benchmark_runs_end_to_end_in_smoke_mode():
    env = dict(os.environ, SMOKE_TEST="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "averaging.py")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = [line for line in lines if line.startswith(("cnn", "mlp"))]
    # 2 and 4 ranks x 2 models x (every variant + "compute only")
    assert len(table) == 2 * 2 * (len(VARIANTS) + 1), proc.stdout
    assert all(line.split()[-1] for line in table)
    assert sum("1.00x" in line for line in table if " ddp " in line) == 4
