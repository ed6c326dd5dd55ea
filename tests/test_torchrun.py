"""scripts/train_ddp.py and scripts/train_manual.py under real torchrun agents: CPU, gloo, --smoke.

Each torchrun start costs ~5 s on a 2-core machine (2 workers importing torch; the agent is
preloaded: tests/preloaded.py), so the runs are shared: one straight 2-epoch run per script
(module fixture) serves the replica, two-node, resume and manual-vs-DDP checks. Every run is on
the CPU (no GPU visible), with OMP_NUM_THREADS=1 also for one-rank agents (torchrun sets it only
with several), so that all runs add their numbers in the same order and can be compared for
equality.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import gradsync_tutorial as gst

from . import preloaded
from .conftest import REPO, wait_dead

SCRIPTS = REPO / "scripts"
FAIL_RANK = REPO / "scripts" / "fail_rank.py"  # runs a script with one rank failing on purpose
EQUAL = re.compile(r"^parameters equal across (\d+) ranks: max \|p - p on rank 0\| = (\S+)$", re.M)
TIMEOUT = 240  # seconds per torchrun run: a smoke run takes ~5 s, a stuck one is killed


def torchrun(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun ARGS`` with this interpreter, from the repository root."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **(env or {}))
    return preloaded.torchrun(args, cwd=REPO, env=full_env, timeout=TIMEOUT)


def standalone(script: str, *script_args) -> subprocess.CompletedProcess:
    """One agent, 2 ranks: ``torchrun --standalone --nproc-per-node 2 scripts/SCRIPT --smoke``."""
    return torchrun("--standalone", "--nproc-per-node", 2, SCRIPTS / script, "--smoke",
                    *script_args)


def assert_ok(*runs: subprocess.CompletedProcess) -> str:
    """Every run (agent) exited 0, and rank 0 printed the replica check: 2 ranks, 0.0."""
    for run in runs:
        assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"
    stdout = "".join(run.stdout for run in runs)
    assert EQUAL.findall(stdout) == [("2", "0.0")], f"expected one replica check:\n{stdout}"
    return stdout


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    """max |a - b| over two checkpoints' parameters and SGD momentum buffers."""
    def momentum(c):
        return {str(i): s["momentum_buffer"] for i, s in c["optimizer"]["state"].items()}

    return max(gst.checks.compare_state_dicts(a["model"], b["model"], show=False),
               gst.checks.compare_state_dicts(momentum(a), momentum(b), show=False))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Run each script once for 2 epochs; return {script: (stdout, checkpoint path)}."""
    runs = {}

    def get(script: str):
        if script not in runs:
            path = tmp_path_factory.mktemp("straight") / f"{script}.pt"
            stdout = assert_ok(standalone(script, "--epochs", 2, "--checkpoint", path))
            runs[script] = stdout, path
        return runs[script]

    return get


# -- each script, one agent, 2 ranks ------------------------------------------------------------


@pytest.mark.parametrize("script", ["train_manual.py", "train_ddp.py"])
def test_script_trains_and_ranks_agree_and_checkpoint_is_written(straight, script):
    stdout, path = straight(script)
    # rank 0 logs each epoch once (not once per rank), then the replica check (assert_ok)
    assert re.findall(r"^epoch (\d)/2: loss \d+\.\d+ \(mean over 2 ranks\)", stdout, re.M) == [
        "1", "2"]
    checkpoint = load(path)
    assert set(checkpoint) == {"model", "optimizer", "epochs_done", "rng"}
    assert checkpoint["epochs_done"] == 2
    assert set(checkpoint["model"]) == set(gst.model.Net().state_dict())  # no "module." prefix
    assert not Path(f"{path}.tmp").exists()
    # seed + rank after building the model: each rank drew its own dropout masks
    rank_0, rank_1 = (rng["cpu"] for rng in checkpoint["rng"])
    assert not torch.equal(rank_0, rank_1), "every rank has the same generator: the same masks"


def test_manual_averaging_and_ddp_train_the_same_model(straight):
    # notebook 03: the same mean gradient; on 2 ranks bit for bit (dividing by 2 is exact)
    diff = max_diff(load(straight("train_manual.py")[1]), load(straight("train_ddp.py")[1]))
    assert diff == 0.0


# -- two "machines": two agents on one host, c10d rendezvous ------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_give_the_single_node_result(straight, tmp_path):
    path, port = tmp_path / "two_nodes.pt", free_port()

    def agent(node: int) -> subprocess.CompletedProcess:
        # --node-rank is only read by the static rendezvous; with c10d the agents agree on
        # their ranks themselves. is_host names the agent that hosts the store (on real
        # machines torchrun works it out from the endpoint's host name).
        return torchrun("--nnodes", 2, "--nproc-per-node", 1, "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test-two-nodes",
                        "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
                        SCRIPTS / "train_ddp.py", "--smoke", "--epochs", 2, "--checkpoint", path)

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(agent, [0, 1]))
    assert_ok(*runs)  # rank 0 is on one of the two agents
    assert max_diff(load(path), load(straight("train_ddp.py")[1])) == 0.0


# -- checkpoint and resume ----------------------------------------------------------------------


def test_one_epoch_save_resume_one_epoch_equals_two_epochs(straight, tmp_path):
    path = tmp_path / "resumed.pt"
    # the same command line starts and resumes: --resume with no file yet starts from scratch
    first = assert_ok(standalone("train_ddp.py", "--epochs", 1, "--checkpoint", path, "--resume"))
    assert f"no checkpoint at {path} yet: starting from scratch" in first
    assert load(path)["epochs_done"] == 1
    second = assert_ok(standalone("train_ddp.py", "--epochs", 2, "--checkpoint", path, "--resume"))
    assert f"resumed from {path} after epoch 1" in second
    assert "epoch 1/2" not in second and "epoch 2/2" in second
    resumed, straight_run = load(path), load(straight("train_ddp.py")[1])
    assert resumed["epochs_done"] == 2
    assert max_diff(resumed, straight_run) == 0.0
    assert len(resumed["rng"]) == 2  # every rank's generators
    assert all(torch.equal(a["cpu"], b["cpu"])
               for a, b in zip(resumed["rng"], straight_run["rng"], strict=True))


def _resume_with_a_seed_per_rank(rank, world_size, script, path, restore):
    """2 steps, save, 2 more (straight); then restart: build, load, the same 2 (resumed).

    Every rank starts from the same weights, then seeds its own dropout masks (seed + rank).
    ``restore="rank 0's"`` imitates a checkpoint that kept rank 0's generator only.
    Returns max |straight - resumed| over this rank's parameters.
    """
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    spec = importlib.util.spec_from_file_location("script_under_test", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    device = torch.device("cpu")

    def build():
        torch.manual_seed(1234)  # the same initial weights on every rank ...
        model = gst.model.Net()
        torch.manual_seed(1234 + rank)  # ... then each rank its own dropout masks
        return model, DDP(model), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)

    def steps(model, ddp_model, optimizer, numbers):
        model.train()  # dropout on: every step draws from the generator
        for step in numbers:
            g = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(10, (8,), generator=g)
            optimizer.zero_grad()
            F.nll_loss(ddp_model(x), y).backward()
            optimizer.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    model, ddp_model, optimizer = build()
    steps(model, ddp_model, optimizer, range(2))
    module.save_checkpoint(path, model, optimizer, 1, device)
    straight = steps(model, ddp_model, optimizer, range(2, 4))
    model, ddp_model, optimizer = build()
    module.load_checkpoint(path, model, optimizer, device)
    if restore == "rank 0's":
        torch.set_rng_state(load(path)["rng"][0]["cpu"])
    resumed = steps(model, ddp_model, optimizer, range(2, 4))
    return (straight - resumed).abs().max().item()


@pytest.mark.parametrize("script", ["train_manual.py", "train_ddp.py"])
def test_resume_is_exact_when_every_rank_seeds_its_own_dropout(tmp_path, script):
    """Each rank's own RNG state is in the checkpoint: with a seed per rank, a resumed run is
    the straight run on every rank; with rank 0's state everywhere, rank 1 draws other masks,
    and through the averaged gradients every rank drifts."""
    script, path = SCRIPTS / script, tmp_path / "seed-per-rank.pt"
    every = gst.launch(_resume_with_a_seed_per_rank, 2, args=(script, path, "every rank's"))
    rank_0s = gst.launch(_resume_with_a_seed_per_rank, 2, args=(script, path, "rank 0's"))
    assert every == [0.0, 0.0]
    assert min(rank_0s) > 0.0


# -- a failing rank -----------------------------------------------------------------------------


def test_failing_rank_exits_nonzero_and_is_the_root_cause_with_its_traceback():
    # The fault is injected from outside (scripts/fail_rank.py): the scripts have no test hook.
    run = torchrun("--standalone", "--nproc-per-node", 2, FAIL_RANK, 1, SCRIPTS / "train_ddp.py",
                   "--smoke", "--epochs", 1)
    assert run.returncode != 0
    # torchrun's summary ends stderr: one entry per failed rank, "Root Cause" being the one with
    # the earliest timestamp. Those timestamps are whole seconds (torch.distributed.elastic's
    # ProcessFailure.timestamp is int(time.time())) and ties go to the lowest rank, so when rank 0
    # loses its peer within the same second, rank 0's consequence is named (notebook 06 says so).
    summary = run.stderr[run.stderr.rindex("Failures:"):]
    entries = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)(.*?)(?=\n\s*\[\d+\]:|\n=+|$)",
                              summary, re.S))
    assert "1" in entries, summary
    # @record put rank 1's own traceback in its entry, not "To enable traceback see: ..."
    assert "RuntimeError: rank 1 fails on purpose (scripts/fail_rank.py 1)" in entries["1"]
    assert "train_ddp.py" in entries["1"]
    root_cause = summary[summary.index("Root Cause (first observed failure)"):]
    named = re.search(r"rank\s*:\s*(\d+)", root_cause).group(1)
    assert named == "1" or "Connection closed by peer" in entries[named], summary
    assert not EQUAL.search(run.stdout)


def test_the_preloaded_agent_says_what_torchrun_says(tmp_path):
    """tests/preloaded.py stands for ``python -m torch.distributed.run``: the same output and
    exit status, letter for letter, for a help text and for a command line it refuses."""
    for args in (["--help"], ["--nproc-per-node", "2"]):
        ours = preloaded.torchrun(args, cwd=tmp_path, env=dict(os.environ), timeout=TIMEOUT)
        theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args],
                                cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
        assert (ours.returncode, ours.stdout, ours.stderr) == (
            theirs.returncode, theirs.stdout, theirs.stderr), args


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="preloaded on Linux only")
def test_a_preloaded_agent_out_of_time_is_stopped_with_its_ranks(tmp_path):
    """A run that hangs fails the test that started it, and leaves no rank behind."""
    script = tmp_path / "hang.py"
    script.write_text("import os, time\n"
                      "open(f'pid{os.environ[\"RANK\"]}', 'w').write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    args = ["--standalone", "--nproc-per-node", 2, script]
    (tmp_path / "timed").mkdir()
    with pytest.raises(subprocess.TimeoutExpired):  # its ranks may or may not have started
        preloaded.torchrun(args, cwd=tmp_path / "timed", env=dict(os.environ), timeout=0.5)
    (tmp_path / "stopped").mkdir()
    agent = preloaded.start(args, cwd=tmp_path / "stopped", env=dict(os.environ),
                            streams=[tmp_path / "out", tmp_path / "err"])
    files = [tmp_path / "stopped" / f"pid{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + TIMEOUT
    while not all(f.exists() and f.read_text() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    preloaded.stop(agent)  # what a run out of time gets once its ranks run
    assert agent.exitcode is not None
    ranks = [int(f.read_text()) for f in (tmp_path / "timed").glob("pid*")]
    ranks += [int(f.read_text()) for f in files]
    assert wait_dead(ranks) == [], "ranks left running after their agent was stopped"


def test_the_scripts_carry_no_test_hooks():
    """People copy these files: nothing in them may exist only for the tests."""
    for script in ("train_ddp.py", "train_manual.py"):
        source = (SCRIPTS / script).read_text()
        assert "GRADSYNC_FAIL" not in source and "on purpose" not in source, script


# -- the command line, without starting any process ---------------------------------------------


@pytest.fixture(scope="module")
def train_ddp():
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPTS / "train_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_are_the_courses(train_ddp, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = train_ddp.parse_args([])
    assert (args.batch_size, args.lr, args.seed, args.dataset) == (256, 0.01, 1234, "fashion-mnist")
    assert (args.checkpoint, args.resume, args.smoke) == (None, False, False)


def test_resume_without_checkpoint_says_what_to_add(train_ddp, capsys):
    with pytest.raises(SystemExit):
        train_ddp.parse_args(["--resume"])
    err = capsys.readouterr().err
    assert "--resume continues from --checkpoint: give --checkpoint PATH too" in err


def test_batch_size_must_split_evenly_over_the_ranks(train_ddp, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")  # what torchrun sets
    with pytest.raises(SystemExit):
        train_ddp.parse_args(["--batch-size", "256"])
    assert "split evenly over 3 ranks: give a multiple of 3" in capsys.readouterr().err
    assert train_ddp.parse_args(["--batch-size", "255"]).batch_size == 255


# -- the two scripts: each stands alone, and their diff is the lesson -------------------------

#: At most this many lines may differ between the two scripts (``diff`` lines starting with < or
#: >). The lesson is about 30: average_gradients and its call, the DDP import and wrapper, and
#: the docstrings' lines that name the script. 40 leaves room for a comment, not for the
#: plumbing (arguments, checkpoints, logging) to drift apart.
MAX_SCRIPT_DIFF_LINES = 40
#: Functions that have nothing to do with who averages the gradients: the same in both scripts.
SHARED_FUNCTIONS = ("parse_args", "init_distributed", "log", "save_checkpoint", "_first_line",
                    "read_checkpoint", "load_checkpoint", "main")


def _functions(path: Path) -> dict[str, str]:
    source = path.read_text()
    tree = ast.parse(source)
    return {node.name: ast.get_source_segment(source, node) for node in tree.body
            if isinstance(node, ast.FunctionDef)}


def test_each_script_stands_alone():
    for script in ("train_manual.py", "train_ddp.py"):
        tree = ast.parse((SCRIPTS / script).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"train_ddp", "train_manual"}, f"{script} imports the other script"


def test_the_diff_between_the_scripts_is_the_lesson():
    manual, ddp = (SCRIPTS / "train_manual.py").read_text(), (SCRIPTS / "train_ddp.py").read_text()
    changed = [line for line in difflib.unified_diff(manual.splitlines(), ddp.splitlines(), n=0,
                                                     lineterm="")
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) <= MAX_SCRIPT_DIFF_LINES, "\n".join(changed)
    # what the diff must show: manual averaging on one side, DDP on the other
    assert any("average_gradients(model)" in line for line in changed if line[0] == "-")
    assert any("DDP(model" in line for line in changed if line[0] == "+")
    manual_functions = _functions(SCRIPTS / "train_manual.py")
    ddp_functions = _functions(SCRIPTS / "train_ddp.py")
    for name in SHARED_FUNCTIONS:
        assert manual_functions[name] == ddp_functions[name], (
            f"{name} differs between the scripts: change both the same way")


# -- shutting down ----------------------------------------------------------------------------


def _main_with_a_ddp_model_in_a_cycle(rank, world_size, script):
    """Run train_ddp.main on a launched rank, with a train() whose DDP model outlives it in a
    reference cycle (as when torchvision is first imported inside train()); report whether
    that model was still alive when main destroyed the process group."""
    import importlib.util
    import weakref

    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradsync_tutorial.model import Net

    spec = importlib.util.spec_from_file_location("train_ddp_under_test", script)
    train_ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_ddp)
    refs, alive_at_destroy = [], []

    def train(args):
        model = DDP(Net())
        model(torch.zeros(2, 1, 28, 28)).sum().backward()
        frame = sys._getframe()  # the frame refers to itself: a cycle that keeps `model`
        refs.append(weakref.ref(model))
        return frame is not None

    def destroy_process_group():
        alive_at_destroy.append(refs[0]() is not None)

    train_ddp.init_distributed = lambda: torch.device("cpu")  # gst.launch did it already
    train_ddp.train = train
    real_destroy = train_ddp.dist.destroy_process_group
    train_ddp.dist.destroy_process_group = destroy_process_group
    try:
        train_ddp.main(["--smoke"])
    finally:
        train_ddp.dist.destroy_process_group = real_destroy
    return alive_at_destroy


def test_main_frees_what_train_built_before_destroying_the_process_group():
    """Freed only at interpreter exit, after the group, DDP made gloo abort the finished
    process ("terminate called without an active exception", SIGABRT): 3 of 20 4-rank runs."""
    results = gst.launch(_main_with_a_ddp_model_in_a_cycle, world_size=2,
                         args=(str(SCRIPTS / "train_ddp.py"),))
    assert results == [[False], [False]]


# -- --resume from a file the script cannot continue from --------------------------


def _bad_checkpoints(folder: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a file --resume cannot continue from, what the message must say about it)."""
    import argparse

    data = good.read_bytes()
    files = {
        "empty": (b"", "the file is empty (0 bytes)"),
        "truncated": (data[: len(data) // 2], "it is not a whole torch.save file: cut short"),
        "corrupt": (bytes(range(256)) * 40, "it is not a whole torch.save file"),
    }
    made = {name: (folder / f"{name}.pt", say) for name, (_, say) in files.items()}
    for name, (content, _) in files.items():
        made[name][0].write_bytes(content)
    foreign = {  # whole files that another program, or another model, saved
        "another program's": ({"model": {}, "args": argparse.Namespace(lr=0.1)},
                              "another program wrote it: it holds Python objects "
                              "(argparse.Namespace)"),
        "another layout": ({"state_dict": torch.nn.Linear(20, 3).state_dict(), "epoch": 2},
                           "it holds ['epoch', 'state_dict'], not this script's ['epochs_done', "
                           "'model', 'optimizer', 'rng']"),
        "another model": ({**load(good), "model": torch.nn.Linear(20, 3).state_dict()},
                          "it was saved for another model (Error(s) in loading state_dict for "
                          "Net: Missing key(s)"),
        "a string epoch count": ({**load(good), "epochs_done": "2"},
                                 "its 'epochs_done' is '2', not a number of epochs"),
    }
    for name, (content, say) in foreign.items():
        made[name] = folder / f"{name.replace(' ', '_')}.pt", say
        torch.save(content, made[name][0])
    return made


def _load_on_a_rank(rank, world_size, script, path):
    """What the script's load_checkpoint says of ``path``: its BadCheckpoint message, or None."""
    spec = importlib.util.spec_from_file_location("script_under_test", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = gst.model.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    try:
        module.load_checkpoint(path, model, optimizer, torch.device("cpu"))
    except module.BadCheckpoint as e:
        return str(e)
    return None


BAD_CHECKPOINTS = ["empty", "truncated", "corrupt", "another program's", "another layout",
                   "another model", "a string epoch count"]


@pytest.mark.parametrize("case", BAD_CHECKPOINTS)
@pytest.mark.parametrize("script", ["train_manual.py", "train_ddp.py"])
def test_resume_says_what_is_wrong_with_a_bad_checkpoint(straight, tmp_path, script, case):
    """One sentence: which file, what is wrong with it, what to do (on main: torch's raw
    EOFError, KeyError, RuntimeError, or its weights_only advice)."""
    path, say = _bad_checkpoints(tmp_path, straight("train_ddp.py")[1])[case]
    message = gst.launch(_load_on_a_rank, 1, args=(SCRIPTS / script, str(path)))[0]
    assert message is not None, f"{case}: loaded without an error"
    assert message.startswith(f"--resume: cannot continue from {path}: {say}"), message
    assert message.endswith(f"Delete it to start from scratch (rm {path}), or give "
                            "--checkpoint a checkpoint this script saved."), message
    assert "weights_only" not in message and "github" not in message.lower(), message


def test_resume_on_another_number_of_ranks_goes_on_and_says_so(straight, tmp_path, capfd):
    """Not an error: the model and optimizer fit; only the random draws differ."""
    path = tmp_path / "two_ranks.pt"
    path.write_bytes(straight("train_ddp.py")[1].read_bytes())  # saved by 2 ranks
    assert gst.launch(_load_on_a_rank, 1, args=(SCRIPTS / "train_ddp.py", str(path))) == [None]
    assert f"{path} was saved by 2 ranks, resumed on 1: random draws" in capfd.readouterr().out


@pytest.mark.parametrize(("script", "case"), [("train_ddp.py", "corrupt"),
                                              ("train_manual.py", "truncated")])
def test_a_bad_checkpoint_is_reported_once_by_rank_0_without_a_traceback(straight, tmp_path,
                                                                           script, case):
    path, say = _bad_checkpoints(tmp_path, straight("train_ddp.py")[1])[case]
    run = standalone(script, "--epochs", 2, "--checkpoint", path, "--resume")
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert output.count(f"--resume: cannot continue from {path}: {say}") == 1, output
    assert output.count(f"rm {path}") == 1, output
    # no rank's traceback (torchrun's own summary of the agent stays), none of torch's advice
    assert f"{script}\", line" not in output and "weights_only" not in output, output
    assert not EQUAL.search(run.stdout)


@pytest.mark.parametrize("where", ["under a file", "a folder", "a read-only folder"])
def test_a_checkpoint_that_cannot_be_written_is_refused_before_training(train_ddp, tmp_path,
                                                                        capsys, where):
    """Not after a whole epoch, with a raw PermissionError: parse_args says so, first."""
    (tmp_path / "a file").write_text("")
    path = {"under a file": tmp_path / "a file" / "ckpt.pt", "a folder": tmp_path,
            "a read-only folder": tmp_path / "locked" / "ckpt.pt"}[where]
    if where == "a read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root may write into any folder")
        (tmp_path / "locked").mkdir(mode=0o500)
    with pytest.raises(SystemExit):
        train_ddp.parse_args(["--checkpoint", str(path)])
    err = capsys.readouterr().err
    assert f"--checkpoint {path}: " in err, err
    assert ("give a file in it" if where == "a folder" else "give a path in a folder you may "
            "write to") in err
    assert train_ddp.parse_args(["--checkpoint", str(tmp_path / "new" / "c.pt")]).checkpoint
