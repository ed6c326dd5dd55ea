"""Functions written for torchrun or mp.spawn, which call ``dist.init_process_group`` themselves,
run under ``gst.launch`` unchanged (issue 13, "Bring-your-own process group").

Each function below has the shape of a well-known program -- the same structure and the same
calls -- written for this test, with only the device edits a CPU laptop needs (nccl -> gloo,
cuda -> cpu): PyTorch's "Getting started with DDP" (demo_basic, demo_checkpoint,
demo_model_parallel, elastic_ddp), the dist_tuto ``init_process(rank, size, fn)``,
pytorch/examples ddp-tutorial-series ``multigpu.py`` and ``multigpu_torchrun.py``,
``distributed/ddp/example.py``, and the CS336 DDP tests. They are defined the way a notebook
cell defines them: compiled in a ``__main__`` namespace from source that only linecache knows.
"""

from __future__ import annotations

import itertools
import linecache
import os
import textwrap

import pytest
import torch

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import RankFailedError

from ..conftest import worker_pids

pytestmark = pytest.mark.usefixtures("no_workers_left")

_cells = itertools.count(1)


def cell(source: str) -> dict:
    """Run ``source`` as IPython runs a notebook cell: in ``__main__``, from a file only
    linecache has. Returns the cell's namespace."""
    source = textwrap.dedent(source)
    filename = f"/tmp/ipykernel_test/cell_{next(_cells)}.py"  # never a file on disk
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


GETTING_STARTED = """
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"

    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # device edit: nccl


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    torch.manual_seed(0)
    model = ToyModel()  # device edit: .to(rank)
    ddp_model = DDP(model)  # device edit: device_ids=[rank]

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    torch.manual_seed(rank)
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    params = [p.detach().clone() for p in model.parameters()]  # what the test compares
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")
    return params


def demo_checkpoint(rank, world_size, checkpoint_dir):
    print(f"Running DDP checkpoint example on rank {rank}.")
    setup(rank, world_size)

    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)

    CHECKPOINT_PATH = os.path.join(checkpoint_dir, "model.checkpoint")
    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process 0 saves it.
    dist.barrier()
    map_location = {"cuda:0": "cpu"}  # device edit: {'cuda:%d' % 0: 'cuda:%d' % rank}
    ddp_model.load_state_dict(
        torch.load(CHECKPOINT_PATH, map_location=map_location, weights_only=True))

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the backward pass of DDP already served as
    # a synchronization.
    if rank == 0:
        os.remove(CHECKPOINT_PATH)

    cleanup()
    print(f"Finished running DDP checkpoint example on rank {rank}.")
    return [p.detach().clone() for p in model.parameters()]


class ToyMpModel(nn.Module):
    def __init__(self, dev0, dev1):
        super(ToyMpModel, self).__init__()
        self.dev0 = dev0
        self.dev1 = dev1
        self.net1 = torch.nn.Linear(10, 10).to(dev0)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5).to(dev1)

    def forward(self, x):
        x = x.to(self.dev0)
        x = self.relu(self.net1(x))
        x = x.to(self.dev1)
        return self.net2(x)


def demo_model_parallel(rank, world_size):
    print(f"Running DDP with model parallel example on rank {rank}.")
    setup(rank, world_size)

    # setup mp_model and devices for this process
    dev0 = "cpu"  # device edit: rank * 2
    dev1 = "cpu"  # device edit: rank * 2 + 1
    torch.manual_seed(0)
    mp_model = ToyMpModel(dev0, dev1)
    ddp_mp_model = DDP(mp_model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_mp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    # outputs will be on dev1
    torch.manual_seed(rank)
    outputs = ddp_mp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(dev1)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    params = [p.detach().clone() for p in mp_model.parameters()]
    cleanup()
    return params
"""

ELASTIC_DDP = """
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic():
    # device edit: torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"])) removed
    dist.init_process_group("gloo")  # device edit: the accelerator's backend
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    # create model and move it to GPU with id rank
    device_id = "cpu"  # device edit: rank % torch.accelerator.device_count()
    torch.manual_seed(0)
    model = ToyModel().to(device_id)
    ddp_model = DDP(model)  # device edit: device_ids=[device_id]
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    torch.manual_seed(rank)
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(device_id)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")
    return params
"""

DIST_TUTO = """
import os

import torch
import torch.distributed as dist


def run(rank, size):
    \"\"\"Blocking point-to-point communication, then an all-reduce.\"\"\"
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0])
    group = dist.new_group(list(range(size)))
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return tensor.item(), total.item()


def init_process(rank, size, fn, backend="gloo"):
    \"\"\" Initialize the distributed environment. \"\"\"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    return fn(rank, size)
"""

MULTIGPU = """
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g))
                     for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup(rank, world_size):
    \"\"\"
    Args:
        rank: Unique identifier of each process
        world_size: Total number of processes
    \"\"\"
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    init_process_group(backend="gloo", rank=rank, world_size=world_size)  # device edit: nccl
    # device edit: torch.cuda.set_device(rank) removed


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id, save_every, checkpoint):
        self.gpu_id = gpu_id
        self.model = model  # device edit: .to(gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.checkpoint = checkpoint
        self.model = DDP(model)  # device edit: device_ids=[gpu_id]

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_checkpoint(self, epoch):
        ckp = self.model.module.state_dict()
        torch.save(ckp, self.checkpoint)
        print(f"Epoch {epoch} | Training checkpoint saved at {self.checkpoint}")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def load_train_objs():
    train_set = MyTrainDataset(256)  # load your dataset
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=False,  # device edit: True
        shuffle=False,
        sampler=DistributedSampler(dataset)
    )


def main(rank, world_size, save_every, total_epochs, batch_size, checkpoint):
    ddp_setup(rank, world_size)
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, rank, save_every, checkpoint)
    trainer.train(total_epochs)
    destroy_process_group()
    return [p.detach().clone() for p in model.parameters()]
"""

MULTIGPU_TORCHRUN = """
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g))
                     for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")  # device edit: nccl
    # device edit: torch.cuda.set_device(int(os.environ["LOCAL_RANK"])) removed


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model  # device edit: .to(self.gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)

        self.model = DDP(self.model)  # device edit: device_ids=[self.gpu_id]

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")  # device edit: f"cuda:{id}"
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    train_set = MyTrainDataset(256)  # load your dataset
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=False,  # device edit: True
        shuffle=False,
        sampler=DistributedSampler(dataset)
    )


def main(save_every, total_epochs, batch_size, snapshot_path="snapshot.pt"):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    destroy_process_group()
    return [p.detach().clone() for p in model.parameters()]
"""

DDP_EXAMPLE = """
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(local_world_size, local_rank):
    # setup devices for this process. For local_world_size = 2, num_gpus = 8,
    # rank 0 uses GPUs [0, 1, 2, 3] and rank 1 uses GPUs [4, 5, 6, 7].
    n = 0  # device edit: torch.cuda.device_count() // local_world_size
    device_ids = list(range(local_rank * n, (local_rank + 1) * n))

    print(f"[{os.getpid()}] rank = {dist.get_rank()}, world_size = {dist.get_world_size()}, "
          f"n = {n}, device_ids = {device_ids}")

    torch.manual_seed(0)
    model = ToyModel()  # device edit: .cuda(device_ids[0])
    ddp_model = DDP(model)  # device edit: device_ids

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    torch.manual_seed(local_rank)
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)  # device edit: .to(device_ids[0])
    loss_fn(outputs, labels).backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def spmd_main(local_world_size, local_rank):
    # These are the parameters used to initialize the process group
    env_dict = {
        key: os.environ[key]
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    print(f"[{os.getpid()}] Initializing process group with: {env_dict}")
    dist.init_process_group(backend="gloo")  # device edit: nccl
    print(
        f"[{os.getpid()}]: world_size = {dist.get_world_size()}, "
        + f"rank = {dist.get_rank()}, backend={dist.get_backend()}"
    )

    params = demo_basic(local_world_size, local_rank)

    # Tear down the process group
    dist.destroy_process_group()
    return params
"""

CS336_TESTS = """
import os
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, 5, bias=False)

    def forward(self, x):
        return self.fc2(self.ln(torch.relu(self.fc1(x))))


class NaiveDDP(nn.Module):
    \"\"\"The student's DDP: broadcast rank 0's parameters, all-reduce every gradient.\"\"\"

    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *inputs):
        return self.module(*inputs)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= dist.get_world_size()


def _setup_process_group(rank, world_size, backend):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12390"
    device = "cpu"  # device edit: f"cuda:{rank}" with nccl
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return device


def _cleanup_process_group():
    # Synchronize before we destroy the process group
    dist.barrier()
    dist.destroy_process_group()


def _test_DistributedDataParallelIndividualParameters(rank, world_size, model_class):
    device = _setup_process_group(rank=rank, world_size=world_size, backend="gloo")
    dist.barrier()
    torch.manual_seed(rank)  # different initial parameters on each rank

    non_parallel_model = model_class().to(device)
    ddp_base = deepcopy(non_parallel_model)
    ddp_model = NaiveDDP(ddp_base)

    # After construction every rank holds rank 0's parameters.
    for (name, p), q in zip(ddp_model.module.named_parameters(), non_parallel_model.parameters()):
        gathered = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(gathered, p.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered), name
        if rank == 0:
            assert torch.equal(p, q)

    torch.manual_seed(42)
    all_x = torch.randn(20, 10)
    all_y = torch.randn(20, 5)
    # Broadcast rank 0's non-parallel model, which is the reference.
    for p in non_parallel_model.parameters():
        dist.broadcast(p.data, src=0)
    ddp_optimizer = optim.SGD(ddp_model.parameters(), lr=0.1)
    non_parallel_optimizer = optim.SGD(non_parallel_model.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    local_bs = all_x.size(0) // world_size
    for _ in range(5):
        ddp_optimizer.zero_grad()
        non_parallel_optimizer.zero_grad()
        loss_fn(non_parallel_model(all_x), all_y).backward()
        non_parallel_optimizer.step()
        offset = rank * local_bs
        out = ddp_model(all_x[offset: offset + local_bs])
        loss_fn(out, all_y[offset: offset + local_bs]).backward()
        ddp_model.finish_gradient_synchronization()
        ddp_optimizer.step()
        for p, q in zip(non_parallel_model.parameters(), ddp_model.parameters()):
            assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
    _cleanup_process_group()
    return "passed"
"""


def _same(a, b, atol=0.0):
    return len(a) == len(b) and all(
        torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a, b, strict=True))


def test_getting_started_demos_run_unchanged(tmp_path, capsys):
    ns = cell(GETTING_STARTED)
    basic = gst.launch(ns["demo_basic"], world_size=2)
    assert _same(basic[0], basic[1])  # DDP kept the replicas equal
    # The same step by hand: the mean of the two ranks' gradients.
    torch.manual_seed(0)
    model = ns["ToyModel"]()
    grads = []
    for rank in (0, 1):
        model.zero_grad()
        torch.manual_seed(rank)
        out = model(torch.randn(20, 10))
        torch.nn.MSELoss()(out, torch.randn(20, 5)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    expected = [p.detach() - 0.001 * (g0 + g1) / 2
                for p, g0, g1 in zip(model.parameters(), *grads, strict=True)]
    assert _same(basic[0], expected, atol=1e-6)
    out = capsys.readouterr().out
    assert "[rank 1] Finished running basic DDP example on rank 1." in out

    checkpoint = gst.launch(ns["demo_checkpoint"], world_size=2, args=(str(tmp_path),))
    assert _same(checkpoint[0], checkpoint[1])
    assert not (tmp_path / "model.checkpoint").exists()  # rank 0 removed it

    parallel = gst.launch(ns["demo_model_parallel"], world_size=2)
    assert _same(parallel[0], parallel[1])
    assert _same(parallel[0], basic[0], atol=1e-6)  # the same model, split in two
    # Each launch destroyed its own group; the next plain launch works.
    assert gst.launch(lambda rank, ws: torch.distributed.get_world_size(), 2) == [2, 2]


def test_elastic_ddp_torchrun_entry_point(capsys):
    ns = cell(ELASTIC_DDP)
    demo_basic = ns["demo_basic"]
    results = gst.launch(lambda rank, world_size: demo_basic(), world_size=2)
    assert _same(results[0], results[1])
    assert "[rank 0] Start running basic DDP example on rank 0." in capsys.readouterr().out


def test_dist_tuto_init_process():
    ns = cell(DIST_TUTO)
    results = gst.launch(ns["init_process"], world_size=2, args=(ns["run"],))
    assert results == [(1.0, 3.0), (1.0, 3.0)]


def test_ddp_tutorial_series_multigpu(tmp_path, capsys):
    ns = cell(MULTIGPU)
    checkpoint = str(tmp_path / "checkpoint.pt")
    results = gst.launch(ns["main"], world_size=2, args=(1, 2, 32, checkpoint))
    assert _same(results[0], results[1])
    saved = torch.load(checkpoint)
    assert torch.equal(saved["weight"], results[0][0])
    out = capsys.readouterr().out
    assert "[rank 1] [GPU1] Epoch 1 | Batchsize: 32 | Steps: 4" in out


def test_ddp_tutorial_series_multigpu_torchrun_resumes_from_its_snapshot(tmp_path, capsys):
    ns = cell(MULTIGPU_TORCHRUN)
    main = ns["main"]
    snapshot = str(tmp_path / "snapshot.pt")
    first = gst.launch(lambda rank, world_size: main(1, 2, 32, snapshot), world_size=2)
    assert _same(first[0], first[1])
    assert torch.load(snapshot)["EPOCHS_RUN"] == 1
    second = gst.launch(lambda rank, world_size: main(1, 3, 32, snapshot), world_size=2)
    assert _same(second[0], second[1])
    out = capsys.readouterr().out
    assert "[rank 0] Resuming training from snapshot at Epoch 1" in out


def test_distributed_ddp_example_spmd_main(capsys):
    ns = cell(DDP_EXAMPLE)
    spmd_main = ns["spmd_main"]
    results = gst.launch(lambda rank, world_size: spmd_main(world_size, rank), world_size=2)
    assert _same(results[0], results[1])
    out = capsys.readouterr().out
    assert "rank = 1, backend=gloo" in out


def test_cs336_style_ddp_test():
    ns = cell(CS336_TESTS)
    results = gst.launch(ns["_test_DistributedDataParallelIndividualParameters"],
                         world_size=2, args=(ns["ToyModel"],))
    assert results == ["passed", "passed"]


def test_setup_and_cleanup_twice_in_one_function():
    ns = cell(GETTING_STARTED)
    setup, cleanup = ns["setup"], ns["cleanup"]

    def twice(rank, world_size):
        import torch.distributed as dist

        sums = []
        for _ in range(2):
            setup(rank, world_size)
            t = torch.ones(1)
            dist.all_reduce(t)
            sums.append(t.item())
            cleanup()
        return sums

    assert gst.launch(twice, world_size=2) == [[2.0, 2.0], [2.0, 2.0]]


def test_an_init_with_another_world_size_says_what_to_change():
    def fn(rank, world_size):
        import torch.distributed as dist

        os.environ["MASTER_PORT"] = "12355"
        dist.init_process_group("gloo", rank=rank, world_size=4)

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    message = str(info.value)
    assert "init_process_group(world_size=4) in a launch of 2 ranks" in message
    assert "gst.launch(fn, world_size=4)" in message
    assert worker_pids() == []


def test_an_init_with_another_rank_says_what_to_change():
    def fn(rank, world_size):
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=world_size - 1 - rank, world_size=world_size)

    with pytest.raises(RankFailedError, match=r"pass the rank fn receives"):
        gst.launch(fn, world_size=2)


def test_an_init_for_another_backend_replaces_the_launchers_group():
    def fn(rank, world_size):
        import torch.distributed as dist

        dist.init_process_group("cpu:gloo", rank=rank, world_size=world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        return dist.get_backend(), t.item()

    assert gst.launch(fn, world_size=2) == [("cpu:gloo", 2.0)] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_an_unedited_nccl_setup_on_a_cpu_machine_gets_the_device_hint():
    ns = cell(GETTING_STARTED.replace('"gloo", rank=rank', '"nccl", rank=rank'))
    with pytest.raises(RankFailedError) as info:
        gst.launch(ns["demo_basic"], world_size=2)
    assert "NCCL" in str(info.value) and "gst.local_device()" in str(info.value)
