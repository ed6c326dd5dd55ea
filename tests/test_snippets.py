"""The notebooks' "copy this into your code" snippets are code that ran.

Each snippet is a file, ``snippets/NN_*.py``, that its notebook shows (filled in by the build).
Here each one runs as a reader would run it: ``torchrun --standalone --nproc-per-node 2`` on CPUs,
in a fresh interpreter, from an empty folder, importing only torch and the standard library (no
``gradsync_tutorial``, no notebook globals). Each snippet ends by checking what it claims.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import nbformat
import pytest
import torch

from .conftest import REPO

SNIPPETS = sorted((REPO / "snippets").glob("[0-9][0-9]_*.py"))
NOTEBOOKS = {p.name[:2]: p for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}
ALLOWED = {"torch", "torchvision"}  # and the standard library


def torchrun(snippet, cwd, *args, ranks=2):
    """Run a snippet as its docstring says; PYTHONPATH is cleared, so the course is not found."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SMOKE_TEST")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(ranks), str(snippet), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )
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
    imported = set()
    for node in ast.walk(ast.parse(snippet.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - ALLOWED - sys.stdlib_module_names == set()


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if not s.name.startswith("06")],
                         ids=lambda p: p.name)
def test_snippet_runs_under_torchrun_and_checks_itself(snippet, tmp_path):
    out = torchrun(snippet, tmp_path)
    # Each snippet ends with its check, printed "rank R: ..." by every rank once it passed (two
    # processes share the pipe, so their lines may run into each other).
    assert sorted(re.findall(r"rank (\d+): ", out)) == ["0", "1"], out


def test_checkpoint_is_written_by_rank_0_then_a_barrier():
    """Notebook 03's and 06's snippets: one rank writes the file, every rank waits for it."""
    for name in ("03_ddp.py", "06_torchrun_script.py"):
        lines = (REPO / "snippets" / name).read_text().splitlines()
        saves = [i for i, line in enumerate(lines) if "torch.save(" in line]
        assert saves, name
        for i in saves:
            assert "if rank == 0:" in "\n".join(lines[max(0, i - 2):i]), name
            assert any("dist.barrier()" in line for line in lines[i:i + 6]), name


def test_torchrun_script_resumes_where_a_straight_run_would_be(tmp_path):
    """Notebook 06's snippet: 2 epochs, then --resume to 4, equals 4 epochs straight."""
    snippet = REPO / "snippets" / "06_torchrun_script.py"
    straight = torchrun(snippet, tmp_path, "--checkpoint", "straight.pt", "--epochs", "4")
    torchrun(snippet, tmp_path, "--checkpoint", "resumed.pt", "--epochs", "2")
    resumed = torchrun(snippet, tmp_path, "--checkpoint", "resumed.pt", "--epochs", "4", "--resume")
    assert straight.splitlines()[-2:] == resumed.splitlines()[-2:]  # epochs 3 and 4 logged
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("straight.pt", "resumed.pt"))
    assert a["epochs_done"] == b["epochs_done"] == 4
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert "gc.collect" not in snippet.read_text()  # not needed here (notebook 06 says when)
