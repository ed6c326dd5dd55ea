"""tools/colab.py: badges and a Colab-only install cell, on a copy of the course."""

from __future__ import annotations

import shutil
import sys
import types

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from ..conftest import NOTEBOOKS, REPO, tool

URL = "https://github.com/someone/gradsync-tutorial"


colab = tool("colab")


@pytest.fixture
def course(tmp_path):
    """A copy of the README, the notebooks and their sources, for the script to change, and
    what the README's tables are written from (the course record, its writer, the times)."""
    for name in ("README.md", "notebooks/course.toml", "tools/course.py",
                 "gradsync_tutorial/reference_times.json"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    for path in colab.course_notebooks(REPO):
        shutil.copy(path, tmp_path / "notebooks" / path.name)
        shutil.copy(path.with_suffix(".py"), tmp_path / "notebooks" / f"{path.stem}.py")
    return tmp_path


def _state(root):
    notebooks = colab.course_notebooks(root)
    return {p.name: p.read_bytes()
            for p in [root / "README.md", *notebooks, *(n.with_suffix(".py") for n in notebooks)]}


def test_every_notebook_gets_its_badge_and_install_cell_and_keeps_its_outputs(course, capsys):
    before = {p.name: nbformat.read(p, as_version=4) for p in colab.course_notebooks(course)}
    n = len(NOTEBOOKS)
    assert len(before) == n
    assert colab.main([URL], root=course) == 0
    assert f"{n} notebooks and {n} README rows" in capsys.readouterr().out

    for path in colab.course_notebooks(course):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        old = before[path.name]
        link = (f"(https://colab.research.google.com/github/someone/gradsync-tutorial/blob/main/"
                f"notebooks/{path.name})")
        assert nb.cells[0].source.count("colab-badge.svg") == 1 and link in nb.cells[0].source
        assert nb.cells[0].source.startswith(old.cells[0].source.partition("\n")[0] + "\n\n[!")
        setup = [c for c in nb.cells if c.get("id") == colab.SETUP_CELL_ID]
        assert len(setup) == 1 and f"git+{URL}@main" in setup[0].source
        first_code = next(c for c in nb.cells if c.cell_type == "code")
        assert first_code is setup[0]
        rest = [c for c in nb.cells if c.get("id") != colab.SETUP_CELL_ID]
        assert [c.get("outputs") for c in rest[1:]] == [c.get("outputs") for c in old.cells[1:]]

    # The sources got the same cells: the notebooks still match them (tests/test_notebook_sources).
    script = tool("build_notebooks")
    for path in colab.course_notebooks(course):
        source = script.read_source(path.with_suffix(".py"))
        assert script.first_difference(nbformat.read(path, as_version=4), source) is None

    readme = (course / "README.md").read_text()
    for path in colab.course_notebooks(course):
        assert (f"]({URL.replace('github.com', 'colab.research.google.com/github')}/blob/main/"
                f"notebooks/{path.name})") in readme


def test_a_second_run_changes_nothing_and_another_url_replaces_the_first(course):
    colab.main([URL], root=course)
    once = _state(course)
    colab.main([URL], root=course)
    assert _state(course) == once

    colab.main(["https://github.com/other/fork.git", "--branch", "v1"], root=course)
    for path in colab.course_notebooks(course):
        text = path.read_text()
        assert "someone" not in text and text.count("colab-badge.svg") == 1
        assert "git+https://github.com/other/fork@v1" in text
    readme = (course / "README.md").read_text()
    assert "someone/gradsync" not in readme
    assert readme.count("colab-badge.svg") == len(colab.course_notebooks(course))


@pytest.mark.parametrize(
    "argv",
    [["gitlab.com/someone/x"], ["https://github.com/someone"], [URL, "--branch", "a b"]],
)
def test_bad_input_says_what_is_expected_and_writes_nothing(course, argv, capsys):
    before = _state(course)
    with pytest.raises(SystemExit) as exit_info:
        colab.main(argv, root=course)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "https://github.com/OWNER/NAME" in err or "not a branch or tag name" in err
    assert _state(course) == before


def _run_setup_cell(source: str, on_colab: bool, monkeypatch) -> list[tuple[str, str]]:
    """Execute the cell as IPython would (magics transformed); return the magics it called."""
    calls = []
    shell = types.SimpleNamespace(run_line_magic=lambda name, line: calls.append((name, line)))
    if on_colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    code = TransformerManager().transform_cell(source)
    exec(compile(code, "<colab-setup>", "exec"), {"get_ipython": lambda: shell})
    return calls


def test_install_cell_installs_on_colab_and_does_nothing_elsewhere(monkeypatch):
    source = colab.SETUP_CELL.format(url=URL, branch="main")
    assert _run_setup_cell(source, on_colab=False, monkeypatch=monkeypatch) == []
    calls = _run_setup_cell(source, on_colab=True, monkeypatch=monkeypatch)
    assert calls == [("pip", f'install -q "gradsync-tutorial @ git+{URL}@main"')]


def test_the_repository_has_colab_cells_in_every_notebook_or_in_none():
    """A half-applied script (a new notebook added later, say) would leave some without."""
    has = [
        any(c.get("id") == colab.SETUP_CELL_ID for c in nbformat.read(p, as_version=4).cells)
        for p in colab.course_notebooks(REPO)
    ]
    readme_badges = (REPO / "README.md").read_text().count("colab-badge.svg")
    assert all(has) or not any(has), "run tools/colab.py again with the repository's URL"
    assert readme_badges == (len(has) if all(has) else 0)
