"""tools/build_notebooks.py: how a notebook is built from its source, and what a failed build says.

A build that fails names the notebook, the cell and its line in the source, in a few lines (not
nbclient's traceback), and leaves the committed ``.ipynb`` as it was.
"""

from __future__ import annotations

import doctest
import re
import shutil
import textwrap

import nbformat
import pytest

from ..conftest import NOTEBOOKS, SOURCES, tool

build_notebooks = tool("build_notebooks")


def test_the_tools_examples_run():
    result = doctest.testmod(build_notebooks, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2 and result.failed == 0


def _course(tmp_path, source: str):
    """A course of one notebook, 99_x: its source, and a built .ipynb without outputs."""
    (tmp_path / "notebooks").mkdir()
    path = tmp_path / "notebooks" / "99_x.py"
    path.write_text(textwrap.dedent(source))
    nbformat.write(build_notebooks.read_source(path), path.with_suffix(".ipynb"))
    return path


@pytest.mark.parametrize("cell, error, shown", [
    ("y = 1\nz = y / 0\n", "cell 3 raised ZeroDivisionError: division by zero, at its line 2",
     "z = y / 0"),
    ("y = (1,\n", "cell 3 raised SyntaxError", "y = (1,"),
])
def test_a_failing_cell_is_named_with_its_line_and_the_notebook_is_kept(tmp_path, cell, error,
                                                                         shown):
    path = _course(tmp_path, "# %% [markdown]\n# A title\n\n# %%\nx = 1\n\n# %%\n" + cell)
    before = path.with_suffix(".ipynb").read_bytes()
    with pytest.raises(SystemExit) as info:
        build_notebooks.build(path)
    message = str(info.value)
    assert message.startswith("notebooks/99_x.py:7: " + error), message
    assert f"\n  {shown}" in message
    assert "99_x.ipynb was left as it was" in message and "make notebooks NB=99" in message
    assert len(message.splitlines()) <= 4 and "Traceback" not in message
    assert path.with_suffix(".ipynb").read_bytes() == before


def test_no_execute_without_a_notebook_says_to_build_it(tmp_path):
    (tmp_path / "notebooks").mkdir()
    path = tmp_path / "notebooks" / "99_x.py"
    path.write_text("# %%\nx = 1\n")
    with pytest.raises(SystemExit, match=r"notebooks/99_x.ipynb does not exist yet.*without "
                                         r"--no-execute \(make notebooks NB=99\)"):
        build_notebooks.build(path, run=False)
    assert not path.with_suffix(".ipynb").exists()


def test_build_keeps_cell_ids_and_strips_timestamps(tmp_path):
    """Rebuilding from an edited source: unchanged cells keep their ids, the edited one too."""
    (tmp_path / "notebooks").mkdir()
    path = NOTEBOOKS[0]
    target = tmp_path / "notebooks" / path.name
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    nbformat.write(nb, target)
    source = target.with_suffix(".py")
    text = path.with_suffix(".py").read_text()
    edited = text.replace("# %% [markdown]\n", "# %% [markdown]\n# A new first line.\n#\n", 1)
    source.write_text(edited)
    built = build_notebooks.assemble(source)
    assert [c.id for c in built.cells] == [c.id for c in nb.cells]
    assert built.cells[0].source.startswith("A new first line.")
    assert "execution" not in built.cells[0].metadata
    assert build_notebooks.first_difference(built, build_notebooks.read_source(source)) is None


def test_no_execute_refuses_a_code_change(tmp_path):
    """--no-execute keeps outputs, so it builds only when no code changed (NBVAL comments aside)."""
    (tmp_path / "notebooks").mkdir()
    path = NOTEBOOKS[0]
    shutil.copy(path, tmp_path / "notebooks" / path.name)
    source = tmp_path / "notebooks" / path.with_suffix(".py").name
    text = path.with_suffix(".py").read_text()
    source.write_text(text.replace("\n# %%\n", "\n# %%\n# NBVAL_CHECK_OUTPUT\n", 1))
    build_notebooks.build(source, run=False)
    nb = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    assert "# NBVAL_CHECK_OUTPUT" in next(c.source for c in nb.cells if c.cell_type == "code")
    source.write_text(text.replace("\n# %%\n", "\n# %%\nx = 1\n", 1))
    with pytest.raises(SystemExit, match="its code changed"):
        build_notebooks.build(source, run=False)


# -- bad input is refused with a message that names the notebook --------------------------------


def test_a_missing_snippet_names_the_source_and_the_file(tmp_path):
    path = _course(tmp_path, "# %% [markdown]\n# <!-- snippets/99_gone.py -->\n# ```python\n"
                             "# ```\n\n# %%\nx = 1\n")
    with pytest.raises(SystemExit) as info:
        build_notebooks.build(path, run=False)
    message = str(info.value)
    assert message.startswith("notebooks/99_x.py: ") and "snippets/99_gone.py" in message
    assert "does not exist" in message


def test_a_source_that_is_not_utf8_is_named(tmp_path):
    path = _course(tmp_path, "# %%\nx = 1\n")
    path.write_bytes(b"# %%\nx = '\xe9'\n")  # Latin-1, as an editor on Windows may save it
    with pytest.raises(SystemExit, match=r"^notebooks/99_x.py: not UTF-8 .*byte 0xe9"):
        build_notebooks.build(path, run=False)


def test_a_corrupt_notebook_is_named_with_what_to_do(tmp_path):
    path = _course(tmp_path, "# %%\nx = 1\n")
    path.with_suffix(".ipynb").write_text('{"cells": [')  # cut short, e.g. by a full disk
    with pytest.raises(SystemExit) as info:
        build_notebooks.build(path, run=False)
    message = str(info.value)
    assert message.startswith("notebooks/99_x.ipynb: not a notebook"), message
    assert "git checkout notebooks/99_x.ipynb" in message and "Traceback" not in message


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_world_size_below_one_is_refused_before_anything_runs(value, capsys):
    with pytest.raises(SystemExit) as info:
        build_notebooks.main(["--world-size", value, "99"])
    assert info.value.code == 2
    assert "--world-size must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("source", SOURCES, ids=[s.name[:2] for s in SOURCES])
def test_world_size_rewrites_each_notebook_s_own_line(source):
    """``--world-size 4`` sets the first code cell's ``WORLD_SIZE = ...`` line, whatever its
    value (notebook 13 starts with 3), and nothing else in the cell."""
    first = next(c for c in build_notebooks.read_source(source).cells if c.cell_type == "code")
    own = re.search(r"^WORLD_SIZE = (\d+)", first.source, re.M)
    assert own, f"{source.name}: its first code cell has no WORLD_SIZE line"
    changed = build_notebooks.with_world_size(first.source, 4)
    assert changed == first.source.replace(own.group(0), "WORLD_SIZE = 4", 1)
    assert re.search(r"^WORLD_SIZE = 4\b", changed, re.M)
