"""The set-up files agree with each other, so the pip and conda routes install the same thing."""

from __future__ import annotations

import re
import sys

import pytest

from .conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

CONDA_NAMES = {"torch": "pytorch"}  # pip name -> conda-forge name, where they differ


def _split(requirement: str) -> tuple[str, str]:
    name, spec = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(.*)$", requirement).groups()
    return name.lower(), spec.replace(" ", "")


def _pyproject() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["dev"]
    return {CONDA_NAMES.get(n, n): s for n, s in map(_split, reqs)}


def _environment_yml() -> dict[str, str]:
    deps, inside = {}, False
    for line in (REPO / "environment.yml").read_text().splitlines():
        if line.startswith("dependencies:"):
            inside = True
        elif inside and re.match(r"^  - [A-Za-z]", line):
            name, spec = _split(line[4:])
            if name not in {"python", "pip"}:
                deps[name] = spec
    return deps


def test_environment_yml_lists_the_same_packages_as_pyproject():
    assert _environment_yml() == _pyproject()


def test_environment_yml_installs_this_package_with_dev_extra():
    assert "- -e .[dev]" in (REPO / "environment.yml").read_text()


def test_torch_ranges_admit_the_versions_this_course_is_tested_with():
    deps = _pyproject()
    assert deps["pytorch"] == ">=2.14" and deps["torchvision"] == ">=0.29"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in readme and re.search(r"^make test\b", ci, re.M)


def test_make_clean_removes_every_ignored_folder_the_targets_write():
    """What .gitignore lists as written by the targets (the venv, data, the site, notebook 06's
    checkpoints, test artifacts), `make clean` removes."""
    ignored = (REPO / ".gitignore").read_text()
    rule = re.search(r"^clean:\n\trm -rf (.*)$", (REPO / "Makefile").read_text(), re.M).group(1)
    removed = set(rule.replace("$(VENV)", ".venv").split())
    for folder in ("data", "build", "checkpoints", "test-artifacts"):
        assert f"/{folder}" in ignored and folder in removed, folder
    assert ".venv" in removed


def test_wheel_ships_every_module_of_the_package(tmp_path):
    """A module missing from the wheel would only show up after `pip install .` (not `-e .`)."""
    import subprocess
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("gradsync_tutorial-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    source = {p.relative_to(REPO).as_posix()
              for p in (REPO / "gradsync_tutorial").rglob("*.py")}
    assert source and source <= shipped, f"missing from the wheel: {sorted(source - shipped)}"


def test_every_module_of_the_package_is_an_attribute_found_not_listed():
    """A lesson module added to gradsync_tutorial/ is gst.<name> with no other edit."""
    import gradsync_tutorial as gst

    modules = {p.stem for p in (REPO / "gradsync_tutorial").glob("[a-z]*.py")}
    folders = {p.parent.name for p in (REPO / "gradsync_tutorial").glob("[a-z]*/__init__.py")}
    assert modules | folders <= set(dir(gst))
    assert all(getattr(gst, name).__name__ == f"gradsync_tutorial.{name}"
               for name in sorted(modules | folders))
