"""The detectors catch a planted bug and pass correct code.

The collective detectors run on two real ranks (gloo, CPU) through ``gst.launch``; every
launch uses world_size=2, so the later ones reuse the first one's worker processes.
"""

import pytest
import torch
from torch.distributed import all_reduce as imported_all_reduce
from torch.utils.data import DistributedSampler

import gradsync_tutorial as gst
from gradsync_tutorial.detect import DDP_KEY, sample_overlap

ORDER = torch.randperm(100, generator=torch.Generator().manual_seed(0))

# --------------------------------------------------------------------------------------------
# sample_overlap, in this process
# --------------------------------------------------------------------------------------------


def test_correct_shards_are_disjoint():
    for world_size in (1, 2, 3, 4):
        overlap = sample_overlap([ORDER[r::world_size] for r in range(world_size)], 100)
        assert overlap.disjoint and overlap.shared == 0 and overlap.pairs == {}
        assert overlap.unique == 100 and overlap.coverage == 1.0 and overlap.fraction == 0.0
        assert sum(overlap.sizes) == 100


def test_unsharded_data_is_caught():  # the planted bug: every rank reads the whole order
    overlap = sample_overlap([ORDER, ORDER.tolist(), range(100)], dataset_size=100)
    assert not overlap.disjoint
    assert overlap.shared == overlap.unique == 100 and overlap.fraction == 1.0
    assert overlap.pairs == {(0, 1): 100, (0, 2): 100, (1, 2): 100}
    assert overlap.sizes == [100, 100, 100]
    assert "100 (100%) shared" in str(overlap) and "ranks 0 and 1 share 100" in str(overlap)


def test_partial_overlap_and_coverage():
    overlap = sample_overlap([range(0, 6), range(4, 10), range(20, 22)], dataset_size=40)
    assert overlap.shared == 2 and overlap.unique == 12 and overlap.pairs == {(0, 1): 2}
    assert overlap.coverage == pytest.approx(12 / 40)
    assert overlap.fraction == pytest.approx(2 / 12)
    # Repeats inside one rank are not an overlap between ranks.
    assert sample_overlap([[1, 1, 2], [3]]).shared == 0


def test_distributed_sampler_padding_shares_at_most_world_size_minus_one():
    dataset = range(10)  # 10 samples on 4 ranks: the sampler pads to 12
    samplers = [DistributedSampler(dataset, 4, r, seed=0) for r in range(4)]
    overlap = sample_overlap(samplers, dataset_size=10)  # a Sampler is accepted as it is
    assert overlap.sizes == [3, 3, 3, 3] and overlap.unique == 10
    assert 0 < overlap.shared <= 3
    dropped = [DistributedSampler(dataset, 4, r, seed=0, drop_last=True) for r in range(4)]
    assert sample_overlap(dropped).disjoint


def test_bad_input():
    with pytest.raises(ValueError, match="one list of indices per rank"):
        sample_overlap([])
    with pytest.raises(TypeError, match="must be integers"):
        sample_overlap([torch.tensor([0.0, 1.0])])
    assert sample_overlap([[], [1]]).unique == 1  # an empty shard is fine


# --------------------------------------------------------------------------------------------
# Inside the ranks
# --------------------------------------------------------------------------------------------


def test_rank_checks_pass_correct_code_and_catch_planted_bugs():
    def run(rank, world_size):
        import torch

        from gradsync_tutorial import detect

        def _catch(check, *args, **kwargs):
            """Run a check; return its AssertionError's message, or None if it passed."""
            try:
                check(*args, **kwargs)
            except AssertionError as e:
                return str(e)
            return None

        order = torch.randperm(100, generator=torch.Generator().manual_seed(0))
        out = {
            "good_shards": detect.assert_disjoint_shards(order[rank::world_size], dataset_size=100),
            "bad_shards": _catch(detect.assert_disjoint_shards, order),  # planted: no sharding
            "padded": _catch(detect.assert_disjoint_shards, order[:3] if rank else order[:2]),
            "padded_ok": _catch(detect.assert_disjoint_shards, order[:3] if rank else order[:2],
                                max_shared=2),
            "same": detect.assert_ranks_agree_on(4, "batches per epoch"),
            "same_tensor": detect.assert_ranks_agree_on(torch.ones(2), "a tensor"),
            # Planted: one rank would take one step more than the other.
            "steps": _catch(detect.assert_ranks_agree_on, 5 if rank == 0 else 4, "steps"),
            "tensor": _catch(detect.assert_ranks_agree_on, torch.full((2,), float(rank))),
            "shape": _catch(detect.assert_ranks_agree_on, torch.ones(rank + 1)),
        }
        return out

    results = gst.launch(run, world_size=2, backend="gloo", timeout=120)
    for rank, out in enumerate(results):  # every rank learns, and raises, the same
        good = out["good_shards"]
        assert good.disjoint and good.unique == 100 and good.sizes == [50, 50]
        assert out["bad_shards"] is not None, f"rank {rank} missed unsharded data"
        assert "shards overlap" in out["bad_shards"]
        assert "ranks 0 and 1 share 100" in out["bad_shards"]
        examples = ", ".join(map(str, ORDER[:3].tolist()))
        assert f"ranks 0 and 1 both read samples {examples}, ..." in out["bad_shards"]
        assert "order[rank::world_size]" in out["bad_shards"]  # says what to do
        assert "2 (67%) shared" in out["padded"]
        assert out["padded_ok"] is None
        assert out["same"] == [4, 4] and len(out["same_tensor"]) == 2
        assert "the ranks disagree on steps: rank 0: 5, rank 1: 4" in out["steps"]
        assert "DistributedSampler" in out["steps"]
        assert out["tensor"] is not None and out["shape"] is not None


def test_counter_counts_dist_calls_and_ddp_buckets():
    def run(rank, world_size):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP

        from gradsync_tutorial import checks, detect
        from gradsync_tutorial.model import Net

        original = dist.all_reduce
        out = {}
        torch.manual_seed(0)
        model = Net().eval()
        g = torch.Generator().manual_seed(rank)  # each rank its own data
        x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(10, (8,), generator=g)
        params = len(list(model.parameters()))

        def average(model):
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size

        # Correct accumulation: one average per optimizer step, after the last micro-batch.
        with detect.count_collectives() as once:
            for micro in range(4):
                F.nll_loss(model(x[2 * micro:2 * micro + 2]), y[2 * micro:2 * micro + 2]).backward()
            average(model)
            out["patched"] = dist.all_reduce is not original
        out["once"] = once["all_reduce"]
        # Planted waste: an average after every micro-batch.
        with detect.count_collectives() as every:
            for micro in range(4):
                F.nll_loss(model(x[2 * micro:2 * micro + 2]), y[2 * micro:2 * micro + 2]).backward()
                average(model)
        out["every"] = every["all_reduce"]
        out["restored"] = dist.all_reduce is original

        # Other collectives, and a library that calls dist.<name> (gst.checks).
        with detect.count_collectives() as calls:
            dist.broadcast(torch.zeros(1), src=0)
            dist.all_gather([torch.zeros(1) for _ in range(world_size)], torch.ones(1))
            dist.barrier()
            checks.max_diff_across_ranks(model)
        out["calls"] = dict(calls.calls)

        # Restored after an exception too.
        try:
            with detect.count_collectives():
                raise KeyError("boom")
        except KeyError:
            pass
        out["restored_after_error"] = dist.all_reduce is original

        # A name imported before the block is counted in the functions passed; a collective
        # that torch builds on another (all_gather_object on all_gather) counts once; the
        # arguments of every call are kept.
        def imports_its_own(t):
            imported_all_reduce(t)

        with detect.count_collectives(imports_its_own) as own:
            imports_its_own(torch.ones(2))
            dist.all_gather_object([None] * world_size, rank)
        out["own"] = dict(own.calls)
        out["own_args"] = [args[0].tolist() for args, _ in own.arguments["all_reduce"]]
        out["own_restored"] = imports_its_own.__globals__["imported_all_reduce"] is original

        # DDP: one bucket all-reduce per backward; none under no_sync(); no dist.* calls.
        ddp = DDP(Net().eval())  # 21,840 parameters: one bucket (the default cap is 25 MB)
        with detect.count_collectives() as ddp_calls:
            ddp_calls.watch(ddp)
            F.nll_loss(ddp(x), y).backward()
            per_backward = ddp_calls[DDP_KEY]
            with ddp.no_sync():
                F.nll_loss(ddp(x), y).backward()
            out["after_no_sync"] = ddp_calls[DDP_KEY]
            F.nll_loss(ddp(x), y).backward()
        out["per_backward"] = per_backward
        out["ddp"] = dict(ddp_calls.calls)
        out["params"] = params
        out["ddp_grads_equal"] = checks.max_diff_across_ranks(
            [(n, p.grad) for n, p in ddp.module.named_parameters()])
        return out

    results = gst.launch(run, world_size=2, backend="gloo", timeout=120)
    for out in results:
        assert out["patched"] and out["restored"] and out["restored_after_error"]
        assert out["own"] == {"all_reduce": 1, "all_gather_object": 1}
        assert out["own_args"] == [[2.0, 2.0]] and out["own_restored"]  # the tensor itself
        assert out["once"] == out["params"] == 8
        assert out["every"] == 4 * out["params"]  # the planted waste is counted
        calls = out["calls"]
        # max_diff_across_ranks: one all_gather_object, a broadcast per tensor, one all_reduce.
        assert calls == {"broadcast": 1 + 8, "all_gather": 1, "barrier": 1,
                         "all_gather_object": 1, "all_reduce": 1}
        assert out["per_backward"] == 1  # one bucket
        assert out["after_no_sync"] == 1  # no_sync: nothing reduced
        assert out["ddp"] == {DDP_KEY: 2}  # and no dist.* call either
        assert out["ddp_grads_equal"] == 0.0  # the counting hook still averages


def test_counter_refuses_nesting_itself():
    counter = gst.detect.count_collectives()
    with counter, pytest.raises(RuntimeError, match="already counting"):
        counter.__enter__()


def test_a_counter_inside_another_counts_what_the_outer_one_did_not_swap():
    """The launcher counts every job's collectives (for its hang report); an exercise check's
    counter inside it must still count a name its function imported itself, which the outer
    counter left pointing at torch's own all_reduce."""
    from gradsync_tutorial.detect import CollectiveCounter

    namespace = {"all_reduce": imported_all_reduce}  # `from torch.distributed import all_reduce`
    exec("def average(t):\n    all_reduce(t)\n", namespace)
    average = namespace["average"]
    with CollectiveCounter() as outer, CollectiveCounter(average) as inner:
        with pytest.raises((RuntimeError, ValueError)):  # no process group here: counted first
            average(torch.ones(1))
    assert inner["all_reduce"] == 1 and outer["all_reduce"] == 1
    assert namespace["all_reduce"] is imported_all_reduce  # put back
