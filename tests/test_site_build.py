"""docs/build.py, the pages ``make site`` builds from: fast checks, without Sphinx.

The built site itself, in Chromium, is tests/e2e/test_site.py.
"""

from __future__ import annotations

import doctest
import importlib.util
import re
import shutil
import sys

import nbformat
import pytest

from gradsync_tutorial.notebooks import paths

from .conftest import REPO

URL = "https://github.com/someone/gradsync-tutorial"


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


site = _load(REPO / "docs" / "build.py", "site_build")


@pytest.fixture
def course(tmp_path):
    """A copy of what the site is made from: the README, its guides, the notebooks, the images,
    the course record and its reader (the site's parts)."""
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "course.py", tmp_path / "tools" / "course.py")
    (tmp_path / "gradsync_tutorial").mkdir()  # the run times the README's tables show
    shutil.copy(REPO / "gradsync_tutorial" / "reference_times.json", tmp_path / "gradsync_tutorial")
    shutil.copytree(REPO / "images", tmp_path / "images")
    (tmp_path / "docs").mkdir()
    for guide in sorted((REPO / "docs").glob("*.md")):
        shutil.copy(guide, tmp_path / "docs" / guide.name)
    (tmp_path / "notebooks").mkdir()
    for path in [*paths("ipynb"), *paths("source"), REPO / "notebooks" / "course.toml"]:
        shutil.copy(path, tmp_path / "notebooks" / path.name)
    return tmp_path


def _linker(page="notebooks/02_manual_allreduce_averaging"):
    return site.Linker(site.read_course(REPO), page)


def test_the_docstring_examples_run():
    assert doctest.testmod(site, optionflags=doctest.ELLIPSIS).failed == 0


# -- the README's parts -----------------------------------------------------------------------


def test_the_landing_page_has_the_answer_the_glossary_and_the_notebooks():
    course = site.read_course(REPO)
    landing, _ = site.landing_page(course)
    for start in site.LANDING:
        assert f"\n## {start}" in landing
    assert "```{glossary}" in landing and "rank\n  one of the processes" in landing
    # the navigation: the README table's five parts, every notebook once, in course order
    captions = re.findall(r":caption: (Part .+)\n", landing)
    assert [c.split(" — ")[0] for c in captions] == [f"Part {n}" for n in range(1, 6)]
    pages = [page for caption in captions
             for page in landing.split(f":caption: {caption}\n\n")[1].split("```")[0].split()]
    assert pages == [f"notebooks/{p.stem}" for p in course.notebooks.values()]


def test_every_readme_section_is_on_one_page_and_its_anchor_goes_there():
    course = site.read_course(REPO)
    reference, _ = site.reference_page(course)
    landing, _ = site.landing_page(course)
    for section in course.sections:
        page = landing if site._on_landing(section) else reference
        assert f"## {section.heading}" in page
        assert course.anchors[site.slug(section.heading)] == ("index" if page is landing
                                                              else "reference")


def test_a_readme_without_a_glossary_is_refused_saying_what_is_missing(course):
    readme = course / "README.md"
    readme.write_text(readme.read_text(encoding="utf-8").replace("## Glossary", "## Words"),
                      encoding="utf-8")
    with pytest.raises(site.SiteError, match="no '## Glossary...' section"):
        site.read_course(course)


def test_the_run_box_shows_the_readmes_quickstart_commands():
    commands = site.run_locally(site.read_course(REPO))
    assert commands.startswith("make lab")


# -- links in the markdown --------------------------------------------------------------------


@pytest.mark.parametrize("text, linked", [
    ("as notebook 01 showed", "as [notebook 01](01_single_device_baseline.ipynb) showed"),
    ("Notebooks 03 and 05 do", "Notebooks [03](03_distributed_data_parallel.ipynb) and "
                               "[05](05_performance.ipynb) do"),
    ("notebooks 00 to\n01", "notebooks [00](00_launching_workers.ipynb) to\n"
                            "[01](01_single_device_baseline.ipynb)"),
    ("this is notebook 02", "this is notebook 02"),      # the page itself
    ("notebook 99 is to come", "notebook 99 is to come"),  # no such notebook (yet)
    ("`notebook 01`", "`notebook 01`"),                    # code
    ("## After notebook 01", "## After notebook 01"),      # headings
    ("[see notebook 01](01_single_device_baseline.ipynb)",  # already a link
     "[see notebook 01](01_single_device_baseline.ipynb)"),
])
def test_notebook_mentions_become_links_to_their_pages(text, linked):
    assert _linker().markdown(text, terms=False) == linked


def test_a_glossary_term_is_linked_once_a_page_where_it_first_appears():
    linker = _linker()
    first = linker.markdown("Every rank holds a replica; the world\nsize is N.")
    assert first == ("Every {term}`rank <rank>` holds a replica; the "
                     "{term}`world size <world size>` is N.")
    assert linker.markdown("Two ranks, `rank` in code.") == "Two ranks, `rank` in code."
    plural = _linker().markdown("Buckets and collectives")
    assert plural == "{term}`Buckets <bucket>` and {term}`collectives <collective>`"


def test_links_to_readme_sections_go_to_the_page_with_that_section():
    linker = _linker()
    glossary = linker.markdown("[glossary](../README.md#glossary)")
    assert glossary == "[glossary](../index.md#glossary)"
    assert linker.markdown("[q](../README.md#quickstart)") == "[q](../reference.md#quickstart)"
    assert linker.markdown("![f](../images/allreduce.png)") == "![f](../images/allreduce.png)"
    assert "images/allreduce.png" in linker.files
    with pytest.raises(site.SiteError, match="not in the repository"):
        linker.markdown("[x](../no_such_file.py)")


# -- staging: every notebook, and Colab once it has a URL ------------------------------------


def test_every_notebook_is_staged_with_its_run_box_and_no_colab_badge_today(course, tmp_path):
    context = site.stage(course, tmp_path / "src")
    assert context == {"repository_url": None, "notebooks": len(paths("ipynb", course))}
    for path in paths("ipynb", course):
        staged = nbformat.read(tmp_path / "src" / "notebooks" / path.name, as_version=4)
        original = nbformat.read(path, as_version=4)
        box = staged.cells[1]
        assert box.metadata.tags == ["run-it"] and "make lab" in box.source
        assert "Colab" not in box.source
        assert len(staged.cells) == len(original.cells) + 1
        assert [c.get("outputs") for c in staged.cells[2:]] == [
            c.get("outputs") for c in original.cells[1:]], "outputs are shown as committed"


def test_a_notebook_that_lands_later_gets_its_page(course, tmp_path):
    new = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "# 42 — A later notebook\n\nAfter notebook 02.")])
    nbformat.write(new, course / "notebooks" / "42_later.ipynb")
    site.stage(course, tmp_path / "src")
    index = (tmp_path / "src" / "index.md").read_text(encoding="utf-8")
    assert "notebooks/42_later\n```" in index
    staged = nbformat.read(tmp_path / "src" / "notebooks" / "42_later.ipynb", as_version=4)
    assert "[notebook 02](02_manual_allreduce_averaging.ipynb)" in staged.cells[0].source


def _colab_module():
    """The maintainers' colab.py, wherever the repository keeps it."""
    found = sorted([*REPO.glob("*/colab.py"), *REPO.glob("*/*/colab.py")])
    assert found, "no colab.py in the repository's folders"
    return _load(found[0], "colab_for_site")


def test_once_colab_py_has_a_url_each_page_shows_its_badge_from_the_site_itself(course, tmp_path):
    colab = _colab_module()
    assert colab.main([URL], root=course) == 0
    context = site.stage(course, tmp_path / "src")
    assert context["repository_url"] == URL
    staged = sorted((tmp_path / "src").rglob("*.ipynb")) + [tmp_path / "src" / "index.md"]
    for path in staged:
        text = path.read_text(encoding="utf-8")
        assert site.COLAB_BADGE_SVG not in text, f"{path.name} loads Google's badge"
    nb = nbformat.read(tmp_path / "src" / "notebooks" / "00_launching_workers.ipynb",
                       as_version=4)
    assert "Open In Colab" not in nb.cells[0].source  # moved into the box
    assert ("[![Open In Colab](../_static/colab-badge.svg)](https://colab.research.google.com/"
            "github/someone/gradsync-tutorial/blob/main/notebooks/00_launching_workers.ipynb)"
            in nb.cells[1].source)
    assert f"git clone {URL}" in nb.cells[1].source
