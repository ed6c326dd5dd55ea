"""The README's tables come from one record, ``notebooks/course.toml``, read and written by
``tools/course.py``: a notebook left out of an agenda or the claims fails here, a total typed by
hand fails here, and a new notebook joins its part with no line of data.

The course's own record is checked first; then the reader and the writer on a small course of
three fake notebooks in a temporary folder. Nothing here executes a notebook.
"""

from __future__ import annotations

import doctest
import json

import pytest

from ..conftest import NOTEBOOKS, REPO, tool

course = tool("course")


def test_the_courses_record_places_every_notebook():
    record = course.read(REPO)
    assert list(record.notebooks) == [p.name[:2] for p in NOTEBOOKS]
    assert course.problems(record) == []
    placed = [n for part in record.parts for n in part.notebooks]
    assert placed == list(record.notebooks), "each notebook in exactly one part, in order"


def test_the_readme_has_every_table_as_the_record_writes_it():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = {m["name"] for m in course.BLOCK.finditer(text)}
    assert blocks == {"claims", "notebooks", "parts", "agendas"}
    assert course.readme(REPO) == text, "README.md's tables: python tools/course.py"


def test_the_writers_examples_hold():
    assert doctest.testmod(course, verbose=False).failed == 0


# -- a small course ---------------------------------------------------------------------------

RECORD = """\
parts = [
  { first = "00", title = "Start", who = "everyone" },
  { first = "01", title = "More", who = "some" },
]
agendas = [{ name = "an hour", notebooks = "00 and 01" }]
claims = [{ notebook = "01", claim = "B is exact", measured = "1e-16" }]
no_claims = ["00"]

[short]
"00" = { title = "A", question = "How?" }
"""
TIMES = {"measured": "2026-12-01 20:00 UTC", "epoch_seconds": 5.0,
         "machine": {"cores": 2, "gpus": 0, "load_before": 0.1, "load_after": 0.2},
         "notebooks": {"00_a.ipynb": 19.4, "01_b.ipynb": 130.6, "02_c.ipynb": 61.0}}
README = """# x

<!-- claims: old -->
<!-- /claims -->

<!-- notebooks: old -->
| a table typed by hand |
<!-- /notebooks -->

<!-- parts: old -->
<!-- /parts -->

<!-- agendas: old -->
<!-- /agendas -->
"""


def _source(number: str, title: str, question: str) -> str:
    """A notebook source (jupytext's percent format) with a title cell and one code cell."""
    asks = question.replace("\n", "\n# ")  # a question over two lines of the cell
    return (f"# %% [markdown]\n# # {number} — {title}\n#\n# **Question: {asks}**\n\n"
            "# %%\nprint(1)\n")


@pytest.fixture
def small(tmp_path):
    """Notebooks 00 and 01, a record, the times of 00 to 02, and a README with empty tables."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "gradsync_tutorial").mkdir()
    (tmp_path / "notebooks" / "course.toml").write_text(RECORD, encoding="utf-8")
    (tmp_path / "notebooks" / "00_a.py").write_text(_source("00", "A long title", "how?"))
    (tmp_path / "notebooks" / "01_b.py").write_text(_source("01", "B", "why is it\nexact?"))
    (tmp_path / "gradsync_tutorial" / "reference_times.json").write_text(json.dumps(TIMES))
    (tmp_path / "README.md").write_text(README, encoding="utf-8")
    return tmp_path


def test_each_table_is_written_from_the_record_the_first_cells_and_the_times(small):
    text = course.readme(small)
    assert "| **Part 1 — Start** | | |\n| [00 A](notebooks/00_a.ipynb) | How? | 19 s |" in text
    assert "| [01 B](notebooks/01_b.ipynb) | Why is it exact? | 2 min 11 s |" in text
    assert "| Part 2 — More | notebook 01 | some | 2 min 11 s |" in text
    assert "| an hour | notebooks 00 and 01 | 2 min 30 s |" in text  # 19.4 + 130.6 s
    assert "| B is exact | 1e-16 | [01](notebooks/01_b.ipynb) |" in text
    assert "Measured in one run by `make times` (2026-12-01 20:00 UTC" in text
    assert "typed by hand" not in text
    (small / "README.md").write_text(text, encoding="utf-8")
    assert course.readme(small) == text, "writing twice changes nothing"
    assert course.main(["--check"], root=small) == 0


def test_a_total_typed_by_hand_is_refused(small):
    (small / "README.md").write_text(course.readme(small), encoding="utf-8")
    text = (small / "README.md").read_text(encoding="utf-8")
    (small / "README.md").write_text(text.replace("| 2 min 30 s |", "| 2 min |"))
    assert course.main(["--check"], root=small) == 1


def test_a_new_notebook_joins_the_last_part_and_is_named_until_placed(small):
    (small / "notebooks" / "02_c.py").write_text(_source("02", "C", "what next?"))
    record = course.read(small)
    assert record.parts[-1].notebooks == ["01", "02"]  # no line of data for that
    assert course.problems(record) == [
        "notebook 02 is in no workshop agenda (notebooks/course.toml: agendas)",
        "notebook 02 has no claim in the short answer's table (notebooks/course.toml: claims; "
        "or no_claims, saying why)"]
    toml = small / "notebooks" / "course.toml"  # the two lines that place it
    toml.write_text(toml.read_text().replace('"00 and 01"', '"00 to 02"').replace(
        '\nclaims = [', '\nclaims = [{ notebook = "02", claim = "C", measured = "0" }, '))
    assert course.problems(course.read(small)) == []
    assert "| an hour | notebooks 00 to 02 | 3 min 31 s |" in course.readme(small)


@pytest.mark.parametrize("change, said", [
    (('first = "01"', 'first = "05"'), "a part names notebooks ['05'], which do not exist"),
    (('first = "01"', 'first = "00"'), "the parts' first notebooks ['00', '00'] must rise"),
    (('"00 and 01"', '"00 to 03"'), "agenda 'an hour' names notebooks ['02', '03']"),
    (('notebook = "01"', 'notebook = "07"'), "a claim names notebooks ['07']"),
])
def test_a_record_that_names_what_is_not_there_says_what(small, change, said):
    toml = small / "notebooks" / "course.toml"
    toml.write_text(toml.read_text().replace(*change))
    with pytest.raises(course.RecordError, match=said.replace("[", r"\[").replace("]", r"\]")):
        course.read(small)
    assert course.main([], root=small) == 2
    assert (small / "README.md").read_text(encoding="utf-8") == README  # nothing written


def test_a_readme_without_a_tables_block_says_how_to_add_one(small):
    (small / "README.md").write_text(README.replace("<!-- /parts -->", ""))
    with pytest.raises(course.RecordError, match=r"README.md has no block for \['parts'\]"):
        course.readme(small)


def test_a_colab_badge_in_a_notebooks_title_cell_is_in_its_row(small):
    badge = "[![Open In Colab](https://x/badge.svg)](https://colab/00_a.ipynb)"
    path = small / "notebooks" / "00_a.py"
    path.write_text(path.read_text().replace("# **Question", f"# {badge}\n#\n# **Question"))
    assert f"| [00 A](notebooks/00_a.ipynb) {badge} | How? |" in course.readme(small)
