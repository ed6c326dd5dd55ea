"""The notebooks' "copy this into your code" snippets are code that ran.

Each snippet is a file, ``snippets/NN_*.py``, that its notebook shows (filled in by the build).
Here each one runs as a reader would run it: ``torchrun --standalone --nproc-per-node 2`` on CPUs,
in a fresh interpreter, from an empty folder, importing only torch and the standard library (no
``gradsync_tutorial``, no notebook globals). Each snippet ends by checking what it claims.

Every snippet picks its device and backend with notebook 06's ``init_distributed`` (the same
function, letter for letter, in the scripts too), so that it runs unchanged on a CPU laptop
(gloo) and on one GPU per rank (nccl). The GPU side is run by ``tests/gpu`` (``make gpu-check``,
skipped without CUDA); here the rule itself is checked with the GPU count faked.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import nbformat
import pytest
import torch

import gradsync_tutorial as gst

from . import preloaded
from .conftest import NOTEBOOKS as NOTEBOOK_PATHS
from .conftest import REPO, SNIPPETS

NOTEBOOKS = {p.name[:2]: p for p in NOTEBOOK_PATHS}
ALLOWED = {"torch", "torchvision"}  # and the standard library
COURSE_MODULE_FOR_SCRIPTS = "gradsync_tutorial.verify"  # notebook 15's snippet imports it
SCRIPTS = [REPO / "scripts" / "train_manual.py", REPO / "scripts" / "train_ddp.py"]
IDIOM = REPO / "snippets" / "06_torchrun_script.py"  # where init_distributed is taught


def torchrun(snippet, cwd, *args, ranks=2):
    """Run a snippet as its docstring says; PYTHONPATH is cleared, so the course is not found."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SMOKE_TEST")}
    env["OMP_NUM_THREADS"] = "1"
    proc = preloaded.torchrun(["--standalone", "--nproc-per-node", ranks, snippet, *args],
                              cwd=cwd, env=env, timeout=300)
    assert proc.returncode == 0, f"{snippet.name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


SNIPPET_MARK = re.compile(r"<!-- snippets/([\w.-]+\.py) -->")


def test_every_snippet_marked_in_a_notebook_is_a_file_and_every_file_is_marked():
    """The snippets are found, not listed: a notebook that shows one marks it
    ``<!-- snippets/NN_x.py -->``, and every file in snippets/ is marked by its own notebook."""
    marked = {}
    for number, path in NOTEBOOKS.items():
        for name in SNIPPET_MARK.findall(path.read_text()):
            marked[name] = number
    assert SNIPPETS, "no snippets found"
    assert set(marked) == {s.name for s in SNIPPETS}, (
        f"marked but missing: {sorted(set(marked) - {s.name for s in SNIPPETS})}; files no "
        f"notebook shows: {sorted({s.name for s in SNIPPETS} - set(marked))}")
    wrong = {name: number for name, number in marked.items() if not name.startswith(number)}
    assert not wrong, f"snippets shown by another notebook than their number's: {wrong}"


def test_every_snippet_is_shown_by_its_notebook():
    """Its notebook's "Copy this into your code" shows the file as it is now (make notebooks
    fills the block that follows ``<!-- snippets/NN_x.py -->`` from the file)."""
    for snippet in SNIPPETS:
        nb = nbformat.read(NOTEBOOKS[snippet.name[:2]], as_version=4)
        copy_section = next(c.source for c in nb.cells if "## Copy this into your code" in c.source)
        copy_section = copy_section.split("## Copy this into your code")[1].split("## Exercise")[0]
        marker = f"<!-- snippets/{snippet.name} -->\n```python\n"
        assert marker in copy_section, f"{snippet.name}: not shown by its notebook"
        shown = copy_section.split(marker, 1)[1].split("\n```", 1)[0]
        assert shown == snippet.read_text().rstrip("\n"), (
            f"{snippet.name} changed since its notebook was built: make notebooks "
            f"NB={snippet.name[:2]}")
        assert copy_section.count("```python") == 1, "one python block: the snippet file"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_snippet_imports_only_torch_and_the_standard_library(snippet):
    """...and, of the course, only ``gradsync_tutorial.verify``: the one module made for your
    own scripts (it imports torch and nothing else of the course; tests/test_verify.py)."""
    imported = set()
    for node in ast.walk(ast.parse(snippet.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    imported -= {COURSE_MODULE_FOR_SCRIPTS}
    assert {m.split(".")[0] for m in imported} - ALLOWED - sys.stdlib_module_names == set()


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if not s.name.startswith("06")],
                         ids=lambda p: p.name)
def test_snippet_runs_under_torchrun_and_checks_itself(snippet, tmp_path):
    out = torchrun(snippet, tmp_path)
    # Each snippet ends with its check, printed "rank R: ..." by every rank once it passed (two
    # processes share the pipe, so their lines may run into each other), with its device.
    assert sorted(re.findall(r"rank (\d+): ", out)) == ["0", "1"], out
    if "dist.get_backend()" in snippet.read_text():  # it says where it ran
        assert out.count("on cpu (gloo)") == 2, out  # no GPU visible here (tests/gpu: nccl)


def test_checkpoint_is_written_by_rank_0_then_a_barrier():
    """Notebook 03's and 06's snippets: one rank writes the file, every rank waits for it."""
    for name in ("03_ddp.py", "06_torchrun_script.py"):
        lines = (REPO / "snippets" / name).read_text().splitlines()
        saves = [i for i, line in enumerate(lines) if "torch.save(" in line]
        assert saves, name
        for i in saves:
            assert re.search(r"if (dist\.get_)?rank(\(\))? == 0:",
                             "\n".join(lines[max(0, i - 2):i])), name
            assert any("dist.barrier()" in line for line in lines[i:i + 6]), name


def test_ddp_snippet_checks_its_checkpoint_on_machines_that_share_no_file_system(tmp_path):
    """Notebook 03's snippet on two "machines": two torchrun agents, one rank each, in their own
    working directories. Rank 0 writes the checkpoint in its own; only rank 0 reads it back, so
    the check passes where a rank that read the file from its own folder would not find it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SMOKE_TEST")}
    env["OMP_NUM_THREADS"] = "1"
    agents = []
    for node in (0, 1):
        cwd = tmp_path / f"machine{node}"
        cwd.mkdir()
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
             str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
             str(port), str(REPO / "snippets" / "03_ddp.py")],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [agent.communicate(timeout=300) for agent in agents]
    for node, (agent, (out, err)) in enumerate(zip(agents, outs, strict=True)):
        assert agent.returncode == 0, f"machine {node}:\n{out}\n{err[-4000:]}"
        assert f"rank {node}: " in out and "weights equal to the checkpoint" in out, out
    assert [p.name for p in (tmp_path / "machine0").iterdir()] == ["ddp_checkpoint.pt"]
    assert list((tmp_path / "machine1").iterdir()) == []  # machine 1 never had the file


# -- one device idiom: notebook 06's init_distributed ------------------------------------------


def _source_of(path: Path, name: str) -> str | None:
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    return None


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(f"copied_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", SNIPPETS + SCRIPTS, ids=lambda p: p.name)
def test_every_snippet_and_script_joins_the_group_with_notebook_06s_init_distributed(path):
    """One idiom, the same text in every file people copy (the scripts add a type hint); the
    process group is started nowhere else, and main uses the device it returns."""
    canonical = _source_of(IDIOM, "init_distributed")
    mine = _source_of(path, "init_distributed")
    assert mine is not None, f"{path.name}: no init_distributed(); copy it from {IDIOM.name}"
    mine = mine.replace("def init_distributed() -> torch.device:", "def init_distributed():")
    assert mine == canonical, f"{path.name}: init_distributed differs from {IDIOM.name}'s"
    source = path.read_text()
    assert source.count("init_process_group(") == 2, "only init_distributed starts the group"
    assert "init_distributed()" in _source_of(path, "main")


# torch.manual_seed(SEED + rank), torch.manual_seed(args.seed + rank), torch.manual_seed(0 + rank)
RANK_SEED = re.compile(r"torch\.manual_seed\([\w.]+ \+ rank\)")


@pytest.mark.parametrize("path", SNIPPETS + SCRIPTS, ids=lambda p: p.name)
def test_a_model_with_dropout_is_reseeded_per_rank_after_it_is_built(path):
    """Notebook 02 says so: the model is built with the same weights on every rank (one seed, or
    DDP's broadcast), then each rank seeds ``SEED + rank`` so that its dropout masks are its own
    (not rank 0's, repeated)."""
    source = path.read_text(encoding="utf-8")
    if "dropout" not in source.lower():  # neither a model with dropout nor code ready for one
        return
    reseed = RANK_SEED.search(source)
    assert reseed, f"{path.name} trains with dropout and never seeds SEED + rank"
    built = re.search(r"^\s+model = ", source, re.M)
    assert built and built.start() < reseed.start(), (
        f"{path.name} seeds SEED + rank before it builds the model: the ranks' weights differ")


GPU_RULE_CASES = [  # GPUs on the machine, LOCAL_RANK, LOCAL_WORLD_SIZE -> backend, device
    (0, 0, 1, "gloo", "cpu"),        # a laptop
    (0, 1, 2, "gloo", "cpu"),
    (1, 0, 1, "nccl", "cuda:0"),     # one GPU, one rank
    (1, 1, 2, "gloo", "cpu"),        # one GPU, two ranks: nccl cannot share it; every rank gloo
    (4, 5, 8, "gloo", "cpu"),        # --nproc-per-node 8 on 4 GPUs: gloo, and a warning
    (2, 1, 2, "nccl", "cuda:1"),
    (8, 3, 4, "nccl", "cuda:3"),
]


@pytest.mark.parametrize(("gpus", "local_rank", "local_world_size", "backend", "device"),
                         GPU_RULE_CASES)
def test_init_distributed_picks_nccl_only_with_a_gpu_for_every_local_rank(
        monkeypatch, gpus, local_rank, local_world_size, backend, device):
    """The GPU branch, with the GPU count faked: set_device before init_process_group, the
    backend every local rank agrees on, and the same rule as gst.launch's gst.local_device()."""
    module = _module(IDIOM)
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(module.dist, "init_process_group",
                        lambda b, device_id=None: calls.append(("init", b, device_id)))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert module.init_distributed() == torch.device(device)
    said = [str(w.message) for w in caught]
    if 0 < gpus < local_world_size:  # CUDA, but short of GPUs: said, with both numbers
        assert said == [f"{gpus} GPU(s) visible for {local_world_size} ranks on this machine: "
                        "this job trains on the CPU with gloo. For nccl, start one rank per "
                        f"GPU (--nproc-per-node {gpus}) or check CUDA_VISIBLE_DEVICES."], said
    else:  # a laptop, or a GPU per rank: nothing to say
        assert said == [], said
    if backend == "nccl":  # the group bound to the rank's GPU: barrier() uses it too
        gpu = torch.device(device)
        assert calls == [("set_device", gpu), ("init", "nccl", gpu)]
    else:
        assert calls == [("init", "gloo", None)]
    assert gst.local_device() == torch.device(device)  # the notebooks' rule


def test_torchrun_script_resumes_where_a_straight_run_would_be(tmp_path):
    """Notebook 06's snippet: one command line for the first start and the restart (--resume
    with no file yet starts from scratch); 2 epochs, then --resume to 4, equals 4 epochs
    straight, dropout included: each rank's own generator is saved and restored."""
    snippet = REPO / "snippets" / "06_torchrun_script.py"
    straight = torchrun(snippet, tmp_path, "--checkpoint", "straight.pt", "--epochs", "4")
    first = torchrun(snippet, tmp_path, "--checkpoint", "resumed.pt", "--epochs", "2", "--resume")
    assert "no checkpoint yet: from scratch" in first
    resumed = torchrun(snippet, tmp_path, "--checkpoint", "resumed.pt", "--epochs", "4", "--resume")
    assert "resumed after epoch 2" in resumed
    assert straight.splitlines()[-2:] == resumed.splitlines()[-2:]  # epochs 3 and 4 logged
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("straight.pt", "resumed.pt"))
    assert a["epochs_done"] == b["epochs_done"] == 4
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert set(a) == {"model", "optimizer", "epochs_done", "rng"}  # what notebook 06 lists
    assert not torch.equal(a["rng"][0]["cpu"], a["rng"][1]["cpu"])  # seed + rank: own masks
    assert not list(tmp_path.glob("*.tmp"))
    assert "gc.collect" not in snippet.read_text()  # not needed here (notebook 06 says when)


def _save_interrupted(rank, world_size, snippet, path):
    """Save a checkpoint, then save again with a torch.save that dies half-way through."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = _module(Path(snippet))
    model = DDP(nn.Linear(20, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    module.save_checkpoint(path, model, optimizer, 1, torch.device("cpu"))

    def dies_half_way(obj, f, *args, **kwargs):
        if not isinstance(f, str):  # all_gather_object pickling a tensor: let it
            return real_save(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt("killed while saving")

    real_save, module.torch.save = module.torch.save, dies_half_way
    try:
        module.save_checkpoint(path, model, optimizer, 2, torch.device("cpu"))
    except KeyboardInterrupt:
        pass
    finally:
        module.torch.save = real_save
    return torch.load(path, weights_only=True)["epochs_done"]


def test_torchrun_script_saves_atomically(tmp_path):
    """A save cut off half-way leaves the previous checkpoint whole (a .tmp, then os.replace)."""
    snippet = REPO / "snippets" / "06_torchrun_script.py"
    path = str(tmp_path / "ckpt.pt")
    assert gst.launch(_save_interrupted, 1, args=(str(snippet), path)) == [1]


def _flat_average(rank, world_size, snippet):
    """The snippet's FlatAverager on a float64 model whose second layer only rank 0 uses."""
    from torch import nn

    module = _module(Path(snippet))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    average = module.FlatAverager(model)
    x = torch.randn(5, 4, dtype=torch.float64) * (rank + 1)
    out = model(x) if rank == 0 else model[0](x)  # rank 1 leaves the second layer unused
    out.sum().backward()
    mine = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    average()
    return {"dtype": average.buffer.dtype, "mine": mine,
            "averaged": [p.grad for p in model.parameters()]}


def test_flat_averager_keeps_the_dtype_and_averages_a_gradient_a_rank_lacks(tmp_path):
    """float64 stays float64 (not reduced in float32); a parameter without a gradient on one
    rank counts as zeros there (notebook 04's fix), and every rank ends with the mean."""
    snippet = REPO / "snippets" / "05_flat_averager.py"
    ranks = gst.launch(_flat_average, 2, args=(str(snippet),))
    for rank in ranks:
        assert rank["dtype"] == torch.float64
        for got, *theirs in zip(rank["averaged"], *(r["mine"] for r in ranks), strict=True):
            assert got.dtype == torch.float64
            assert torch.equal(got, (theirs[0] + theirs[1]) / 2)


def _flat_average_unused_and_bf16(rank, world_size, snippet):
    """A parameter no rank uses keeps grad None; a bfloat16 model summed in float32."""
    from torch import nn

    module = _module(Path(snippet))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    average = module.FlatAverager(model)
    model[0](torch.randn(5, 4)).sum().backward()  # model[1] unused on every rank
    average()
    unused = [p.grad is None for p in model.parameters()]
    bf16 = nn.Linear(4, 3).to(torch.bfloat16)
    average = module.FlatAverager(bf16, reduce_dtype=torch.float32)
    bf16(torch.randn(5, 4, generator=torch.Generator().manual_seed(rank)).bfloat16()).sum(
        ).backward()
    mine = [p.grad.clone() for p in bf16.parameters()]
    average()
    return {"unused": unused, "buffer": average.buffer.dtype, "mine": mine,
            "averaged": [p.grad for p in bf16.parameters()]}


def test_flat_averager_leaves_unused_parameters_alone_and_can_sum_in_float32():
    """DDP leaves a gradient that no rank computed None, so the optimizer skips the parameter
    as one process would; ``reduce_dtype=torch.float32`` sums a bf16 model's gradients in
    float32 (notebook 09), then rounds the mean once, into the bf16 ``.grad``."""
    snippet = REPO / "snippets" / "05_flat_averager.py"
    ranks = gst.launch(_flat_average_unused_and_bf16, 2, args=(str(snippet),))
    for rank in ranks:
        assert rank["unused"] == [False, False, True, True]  # as one process: no zero .grad
        assert rank["buffer"] == torch.float32
        for got, mine_0, mine_1 in zip(rank["averaged"], *(r["mine"] for r in ranks),
                                       strict=True):
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, ((mine_0.float() + mine_1.float()) / 2).bfloat16())


def _pseudo_gradient_in_bf16(rank, world_size, snippet):
    from torch import nn

    module = _module(Path(snippet))
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.125 * (rank + 1))  # a local round moved the weights
    moved = [s - p.detach() for s, p in zip(start, model.parameters(), strict=True)]
    return module.average_pseudo_gradient(model, start, participating=True), moved


def test_the_pseudo_gradient_keeps_the_model_s_dtype():
    """A bfloat16 pseudo-gradient comes back bfloat16 (the participant count is made in the
    weights' dtype: a float32 count would promote it), equal to the participants' mean."""
    snippet = next((REPO / "snippets").glob("13_*.py"))
    (averaged, moved_0), (_, moved_1) = gst.launch(_pseudo_gradient_in_bf16, 2,
                                                   args=(str(snippet),))
    for got, a, b in zip(averaged, moved_0, moved_1, strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, (a + b) / 2)  # the sum rounded once in bf16, then ÷ 2 (exact)
