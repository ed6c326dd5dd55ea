"""Each notebook is built from its jupytext source (notebooks/NN_*.py): they must not drift apart.

A failure names the notebook and its first differing cell. Fix it by editing the source and
rebuilding: ``make notebooks NB=NN`` (CONTRIBUTING.md, "Contributing: changing a notebook").
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import nbformat
import pytest

from .conftest import NOTEBOOKS, REPO, SNIPPETS, SOURCES, tool

notebooks = tool("build_notebooks")


def test_every_notebook_has_a_source_and_every_source_a_notebook():
    assert NOTEBOOKS, "no notebooks found"
    assert [p.stem for p in NOTEBOOKS] == [s.stem for s in notebooks.sources(REPO)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_matches_its_source(path):
    source = path.with_suffix(".py")
    difference = notebooks.first_difference(nbformat.read(path, as_version=4),
                                            notebooks.read_source(source))
    assert difference is None, (
        f"{path.name} differs from its source {source.name}: {difference}. Edit the source, "
        f"then rebuild: make notebooks NB={path.name[:2]}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_markdown_heading_hides_in_a_code_cell(path):
    """A markdown cell whose ``# %% [markdown]`` line was lost joins the code cell above it: its
    heading and prose show as comments in code (notebook 10 had one)."""
    nb = nbformat.read(path, as_version=4)
    hidden = [(i, line) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for line in cell.source.splitlines() if re.match(r"^# #{1,4} \S", line)]
    assert not hidden, (f"{path.name}: cell {hidden[0][0]} is code but holds the markdown "
                        f"heading {hidden[0][1]!r}: put '# %% [markdown]' before it in the source")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_names_its_kernel(path):
    """Opened in JupyterLab, it starts the course's Python kernel without asking."""
    spec = json.loads(path.read_text())["metadata"].get("kernelspec")
    assert spec == notebooks.KERNELSPEC, (
        f"{path.name} names no kernel (or another): make notebooks NB={path.name[:2]}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_execution_timestamps(path):
    nb = json.loads(path.read_text())
    stamped = [n for n, c in enumerate(nb["cells"], start=1)
               if set(c["metadata"]) & set(notebooks.VOLATILE_CELL_METADATA)]
    assert not stamped, f"{path.name}: cells {stamped} carry execution timestamps"


def test_a_forgotten_sync_is_named():
    """Editing one side alone is caught: the message gives the cell's number and the line."""
    path = NOTEBOOKS[0]
    nb = nbformat.read(path, as_version=4)
    source = notebooks.read_source(path.with_suffix(".py"))
    assert notebooks.first_difference(nb, source) is None
    code = next(n for n, c in enumerate(nb.cells) if c.cell_type == "code")
    first_line = nb.cells[code].source.splitlines()[0]
    nb.cells[code].source = nb.cells[code].source.replace(first_line, "import sys", 1)
    assert notebooks.first_difference(nb, source) == (
        f"cell {code + 1} (code): the notebook has 'import sys', the source has {first_line!r}"
    )
    nb.cells[code] = source.cells[code]
    nb.cells.append(nbformat.v4.new_markdown_cell("added to the notebook only"))
    assert notebooks.first_difference(nb, source) == (
        f"the notebook has {len(source.cells) + 1} cells, the source has {len(source.cells)}"
    )


def test_a_notebook_is_checked_at_another_world_size_without_writing_it(tmp_path):
    """``build_notebooks.py --world-size N``: the first cell's WORLD_SIZE line becomes N, the
    cells run, and a failure says where; nothing is written next to the source."""
    source = tmp_path / "99_probe.py"
    source.write_text("# %%\nWORLD_SIZE = 2  # number of ranks\n\n# %%\nassert WORLD_SIZE == 4\n")
    assert notebooks.run_at_world_size(source, 4) is None
    failure = notebooks.run_at_world_size(source, 3)
    assert "cell 2 raised AssertionError" in failure
    assert not (tmp_path / "99_probe.ipynb").exists()
    source.write_text("# %%\nRANKS = 2\n")
    assert "no line 'WORLD_SIZE = N'" in notebooks.run_at_world_size(source, 4)


def test_notebook_15_runs_unchanged_with_4_ranks():
    """The README's promise for every notebook, checked in CI on the quickest (15: full mode,
    about 10 s on 2 cores, 07 took 25 s); `python tools/build_notebooks.py --world-size 4`
    checks them all."""
    source = REPO / "notebooks" / "15_verify_your_own_step.py"
    assert notebooks.run_at_world_size(source, 4) is None


def test_pytest_runs_the_notebooks_in_their_short_mode_unless_told(request):
    """``make test`` (or ``pytest``) runs nbval on ``SMOKE_TEST=1``: the checkout's conftest.py
    sets it when it is not set; ``SMOKE_TEST=0`` keeps the full mode."""
    root = REPO / "conftest.py"
    loaded = [p for p in request.config.pluginmanager.get_plugins()
              if getattr(p, "__file__", None) == str(root)]
    assert loaded, f"pytest did not load {root}: the notebooks would run in full mode"
    for given, expected in ((None, "1"), ("0", "0"), ("1", "1")):
        env = {k: v for k, v in os.environ.items() if k != "SMOKE_TEST"}
        if given is not None:
            env["SMOKE_TEST"] = given
        seen = subprocess.run(
            [sys.executable, "-c", f"import os, runpy; runpy.run_path({str(root)!r}); "
                                   "print(os.environ['SMOKE_TEST'])"],
            env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert seen == expected, f"SMOKE_TEST={given}: the notebooks see {seen!r}"


def _meshes_on_a_named_device(path) -> list[str]:
    """The init_device_mesh calls of a program whose device type is a literal ("cpu")."""
    calls = [node for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(
                 node.func, "attr", None)) == "init_device_mesh"]
    return [f"line {c.lineno}: {ast.unparse(c)}" for c in calls
            if c.args and isinstance(c.args[0], ast.Constant)]


@pytest.mark.parametrize("path", [*SOURCES, *SNIPPETS], ids=lambda p: p.name)
def test_every_mesh_is_on_the_device_local_device_picks(path):
    """The course's rule: the same code on a CPU laptop (gloo) and on a GPU per rank (nccl).
    A mesh built on "cpu" runs gloo on GPUs too: take its type from the rank's device."""
    named = _meshes_on_a_named_device(path)
    assert not named, (f"{path.name} builds meshes on a named device, not on "
                       f"gst.local_device().type (or init_distributed()'s): {named}")


def test_a_mesh_on_a_named_device_is_found(tmp_path):
    """The check above is not empty: it finds "cpu", and lets device.type through."""
    program = tmp_path / "mesh.py"
    program.write_text('mesh = init_device_mesh("cpu", (2,))\n'
                       "ok = init_device_mesh(device.type, (2,))\n")
    assert _meshes_on_a_named_device(program) == ["line 1: init_device_mesh('cpu', (2,))"]


def test_notebook_12_and_its_exercise_share_one_moe_layer():
    """One copy of the toy mixture-of-experts layer: the exercise checks against the model the
    notebook teaches with, not a copy that may drift."""
    from gradsync_tutorial import moe
    from gradsync_tutorial.exercises import moe_gradients

    assert moe_gradients.ToyMoE is moe.ToyMoE
    (source,) = [s for s in SOURCES if s.name.startswith("12_")]
    tree = ast.parse(source.read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    assert "ToyMoE" not in defined, "notebook 12 defines its own ToyMoE again"
    assert "from gradsync_tutorial.moe import ToyMoE" in source.read_text()
