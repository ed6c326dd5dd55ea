"""The libraries people bring run under ``gst.launch`` as under torchrun.

Each program in ``tests/programs/`` runs twice: ``torchrun --standalone --nproc-per-node 2``,
and ``gst.launch`` of the same program defined as a notebook cell defines it. Both print one
``STATE {json}`` line a rank; the two must agree (world-size mismatches fail as torchrun fails,
and a second launch behaves as a fresh one). Accelerate and Lightning come with the ``peers``
extra (``pip install -e '.[peers]'``; ``make test`` installs it); without them those tests skip.
"""

from __future__ import annotations

import json
import os
import re

import pytest

import gradsync_tutorial as gst

from .. import preloaded
from ..conftest import REPO
from ..programs import HERE as PROGRAMS
from ..programs import cell, source

pytestmark = pytest.mark.usefixtures("no_workers_left")


def torchrun(name: str, *argv: str, nproc: int = 2) -> tuple[int, list[dict], str]:
    """Run ``tests/programs/NAME.py`` under torchrun: exit code, each rank's STATE, output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = preloaded.torchrun(["--standalone", f"--nproc-per-node={nproc}",
                              PROGRAMS / f"{name}.py", *argv], cwd=REPO, env=env, timeout=600)
    output = run.stdout + run.stderr
    # The ranks share torchrun's stdout, and two prints can land on one line
    # ('STATE {...}STATE {...}'): decode one JSON object after each marker, not one per line.
    decoder = json.JSONDecoder()
    states = [decoder.raw_decode(run.stdout, found.end())[0]
              for found in re.finditer(r"STATE (?=\{)", run.stdout)]
    return run.returncode, states, output


def program(name: str) -> dict:
    """``tests/programs/NAME.py`` pasted into a notebook cell without its script entry point
    (``if __name__ == "__main__": main()``, which torchrun runs)."""
    return cell(source(name).rsplit('\nif __name__ == "__main__":', 1)[0])


def as_main(name: str, *argv: str):
    """``NAME.main`` as a notebook cell defines it, run with torchrun's ``sys.argv``."""
    main = program(name)["main"]
    path = str(PROGRAMS / f"{name}.py")

    def fn(rank, world_size):
        import sys

        sys.argv = [path, *argv]  # what torchrun gives the script
        return main()

    return fn


def by_rank(states: list[dict], key: str = "RANK") -> list[dict]:
    return sorted(states, key=lambda s: int(s.get(key, s.get("process_index", 0)) or 0))


# -- the environment ----------------------------------------------------------------------------

# Where gst.launch differs from torchrun on purpose, and why (docs/launcher.md says the same).
DIFFER = {
    "MASTER_ADDR": "127.0.0.1, the store listens on the loopback only; torchrun: localhost",
    "MASTER_PORT": "a port the OS picks, each launch",
    "TORCHELASTIC_RUN_ID": "a new id for each launch (torchrun: one per run)",
    "OMP_NUM_THREADS": "CPU cores // world_size (torchrun: 1)",
    "TORCHELASTIC_ERROR_FILE": "not set: a rank's error comes back over the launcher's socket",
}


def test_each_rank_gets_the_environment_torchrun_gives():
    code, theirs, output = torchrun("torchrun_env")
    assert code == 0, output[-3000:]
    ours = gst.launch(as_main("torchrun_env"), world_size=2)
    theirs = by_rank(theirs)
    for rank, (mine, torchruns) in enumerate(zip(ours, theirs, strict=True)):
        assert mine["is_torchelastic_launched"] and torchruns["is_torchelastic_launched"]
        for name, value in torchruns.items():
            if name in DIFFER or value is None:
                continue
            assert mine[name] == value, f"rank {rank}: {name}={mine[name]!r}, torchrun {value!r}"
        assert mine["TORCHELASTIC_RUN_ID"] and mine["MASTER_PORT"]
    assert ours[0]["TORCHELASTIC_RUN_ID"] == ours[1]["TORCHELASTIC_RUN_ID"]
    again = gst.launch(as_main("torchrun_env"), world_size=2)
    assert again[0]["TORCHELASTIC_RUN_ID"] != ours[0]["TORCHELASTIC_RUN_ID"]  # a new job


# -- Lightning Fabric ---------------------------------------------------------------------------


def test_fabric_asking_for_more_devices_than_ranks_fails_as_under_torchrun():
    pytest.importorskip("lightning")
    code, _, output = torchrun("fabric_devices", "4")
    assert code != 0 and "does not match the world size (2)" in output
    with pytest.raises(gst.RankFailedError, match=r"does not match the world size \(2\)"):
        gst.launch(as_main("fabric_devices", "4"), world_size=2)


def test_fabric_with_a_device_per_rank_trains_on_all_the_data_as_under_torchrun():
    pytest.importorskip("lightning")
    code, theirs, output = torchrun("fabric_devices", "2")
    assert code == 0, output[-3000:]
    ours = gst.launch(as_main("fabric_devices", "2"), world_size=2)
    assert ours == by_rank(theirs, "global_rank")
    assert sum(s["samples_seen"] for s in ours) == 64


# -- Accelerate ---------------------------------------------------------------------------------

# cv_example's command lines, in one kernel one after the other: a warm worker must not carry
# Accelerate's process-wide state (AcceleratorState) from one launch into the next.
ACCELERATE_RUNS = [("--cpu",), (), ("--mixed_precision", "bf16"), ("--cpu",)]


@pytest.fixture(scope="module")
def accelerate_under_torchrun():
    pytest.importorskip("accelerate")
    out = {}
    for argv in set(ACCELERATE_RUNS):
        code, states, output = torchrun("accelerate_cv", *argv)
        assert code == 0, output[-3000:]
        out[argv] = by_rank(states)
    return out


def test_accelerate_cv_example_runs_as_under_torchrun_launch_after_launch(
        accelerate_under_torchrun):
    for argv in ACCELERATE_RUNS:
        ours = gst.launch(as_main("accelerate_cv", *argv), world_size=2)
        assert ours == accelerate_under_torchrun[argv], f"accelerate_cv.py {' '.join(argv)}"


def test_training_function_with_args_as_accelerate_launches_it():
    """``notebook_launcher(training_function, args=(config, args))``: the lambda the TypeError
    suggests runs it."""
    pytest.importorskip("accelerate")
    import argparse

    cv = program("accelerate_cv")
    config = {"lr": 3e-2, "num_epochs": 1, "seed": 42, "batch_size": 8}
    args = argparse.Namespace(cpu=True, mixed_precision=None)
    with pytest.raises(TypeError, match=r"lambda rank, world_size: training_function\(config, "
                                        r"args\)"):
        gst.launch(cv["training_function"], world_size=2, args=(config, args))
    training_function = cv["training_function"]
    ours = gst.launch(lambda rank, world_size: training_function(config, args), world_size=2)
    assert [s["num_processes"] for s in ours] == [2, 2]


def _docs_block(heading: str) -> str:
    """The first python block under ``heading`` in docs/launcher.md, as a reader copies it."""
    text = (REPO / "docs" / "launcher.md").read_text(encoding="utf-8")
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"^```python\n(.*?)^```$", section, re.M | re.S).group(1)


def test_torchft_replica_groups_of_one_rank_average_over_the_participants():
    """docs/launcher.md's recipe, run as written: each rank its own replica group, the mean of
    the ranks' tensors over the 2 participants (torchft's Manager.allreduce: SUM, then / n)."""
    pytest.importorskip("torchft")
    results = cell(_docs_block("## Replica groups: torchft"))["results"]
    assert [n for _, n in results] == [2, 2]
    for grad, _ in results:
        assert grad.tolist() == [0.5, 0.5, 0.5]
