"""The README's time table and the doctor's reference times come from one measured run.

``make times`` (``tools/time_table.py``) executes every notebook in one run and records the
times in ``gradsync_tutorial/reference_times.json``, which the doctor reads as it is; the
README's table is written from that record. These tests
fail when either file says something else (a figure typed by hand, a notebook added without
measuring again), and check the writer on small examples. Nothing here executes a notebook.
"""

from __future__ import annotations

import doctest
import json
import re

import pytest

from ..conftest import NOTEBOOKS as NOTEBOOK_PATHS
from ..conftest import REPO, tool

table = tool("time_table")
NOTEBOOKS = [p.name for p in NOTEBOOK_PATHS]


@pytest.fixture(scope="module")
def record() -> dict:
    assert table.RECORD.exists(), "no recorded run: make times (on a quiet machine)"
    return json.loads(table.RECORD.read_text(encoding="utf-8"))


def test_the_recorded_run_timed_every_notebook(record):
    assert sorted(record["notebooks"]) == NOTEBOOKS, (
        "the recorded run does not time exactly the notebooks there are: make times")


def test_the_readme_is_written_from_the_recorded_run(record):
    """The README's run times, the line under its table and notebook 05's benchmark table."""
    assert (REPO / "README.md").read_text(encoding="utf-8") == table.rendered(record), (
        "README.md's run times (or the line under the table, or the benchmark table) are not "
        "the recorded run's: python tools/time_table.py --write (or make times to measure)")


def _seconds(duration: str) -> int:
    """"2 min 10 s (mostly the benchmark)" -> 130; "40 s" -> 40."""
    m = re.match(r"\s*(?:(\d+) min)?\s*(?:(\d+) s)?", duration)
    if not m or not any(m.groups()):
        raise ValueError(f"not a run time: {duration!r}")
    return int(m.group(1) or 0) * 60 + int(m.group(2) or 0)


def test_durations_read_back_as_the_seconds_they_were_written_from():
    from gradsync_tutorial._wording import duration

    assert doctest.testmod(table, verbose=False).failed == 0
    for seconds in (0, 7, 59, 60, 61, 119, 120, 130, 481):
        assert _seconds(duration(seconds)) == seconds


RUN = {"measured": "2026-12-01 20:00 UTC", "epoch_seconds": 5.0,
       "machine": {"cores": 2, "gpus": 0, "load_before": 0.1, "load_after": 0.2},
       "notebooks": {"00_a.ipynb": 19.4, "01_b.ipynb": 130.6, "07_new.ipynb": 61.0}}
README = """# x

| notebook | the question it answers | full run, 2-core CPU |
|---|---|---|
| [00 A](notebooks/00_a.ipynb) | How? | 40 s |
| [01 B](notebooks/01_b.ipynb) | Why? | 35 s |

More text.
"""


def test_a_run_writes_the_times_and_a_row_for_a_new_notebook():
    first = {"07_new.ipynb": "# 07 — Which mean?\n\n**Question: what is the mean\nover?**\n"}
    text = table.render_readme(README, RUN, first)
    assert "| [00 A](notebooks/00_a.ipynb) | How? | 19 s |" in text
    assert "| [01 B](notebooks/01_b.ipynb) | Why? | 2 min 11 s |" in text
    rows = text.splitlines()
    new = rows.index("| [07 Which mean?](notebooks/07_new.ipynb) | what is the mean over? | "
                     "1 min 1 s |")
    assert rows[new - 1].startswith("| [01 B]")  # in course order
    assert table.run_line(RUN) in text and "notebooks 00 to 06 take 2 min 30 s" in text
    assert table.render_readme(text, RUN, first) == text  # writing twice changes nothing
    assert table.budget(RUN) == ["each notebook <= 2 min: NOT met (01_b.ipynb 2 min 11 s)",
                                 "notebooks 00 to 06 <= 8 min: 2 min 30 s, met"]


def test_the_doctor_reads_the_record_as_it_is(record):
    """One record: the doctor's reference times are the recorded run's, rounded, nothing typed."""
    from gradsync_tutorial import doctor

    assert doctor.REFERENCE_SECONDS == {name: round(s) for name, s in record["notebooks"].items()}
    assert doctor.REFERENCE_EPOCH_SECONDS == record["epoch_seconds"]


def test_a_notebook_timed_alone_is_merged_and_said_under_the_table(record):
    """make times NB=NN: one notebook's time joins the record; the others keep theirs."""
    alone = {"name": "99_new.ipynb", "seconds": 12.0, "cpu": 20.0,
             "measured": "2026-12-06 04:00 UTC", "load_before": 0.3, "load_after": 0.8,
             "epoch_seconds": 7.0}
    merged = table.merge(record, alone)
    assert merged["notebooks"]["99_new.ipynb"] == 12.0
    assert {k: v for k, v in merged["notebooks"].items() if k != "99_new.ipynb"} == \
        record["notebooks"]
    assert merged["timed alone"]["99_new.ipynb"]["load_before"] == 0.3
    assert ("Notebook 99 was timed alone by `make times NB=99` (2026-12-06 04:00 UTC, load "
            "average 0.3 before).") in table.run_line(merged)
    assert "99_new.ipynb" not in record["notebooks"]  # the record itself is left alone


def _table_after(heading: str, first_cell: str) -> list[str]:
    """The rows of the README table under ``heading`` whose first cell starts ``first_cell``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines()
            if line.startswith("| ") and line[2:].startswith(first_cell)]


def test_every_notebook_is_in_exactly_one_part_and_in_an_agenda():
    """A new notebook must be placed: in one part (the parts do not overlap), and in at least
    one workshop agenda. Else it silently drops out of both totals."""
    from gradsync_tutorial.notebooks import mentioned

    numbers = [name[:2] for name in NOTEBOOKS]
    parts = [mentioned(row.split("|")[1]) for row in _table_after("## Who needs which part",
                                                                   "Part ")]
    assert parts, "no part rows found under '## Who needs which part'"
    placed = [n for part in parts for n in part]
    assert sorted(placed) == numbers, (
        f"each notebook in exactly one part: the parts name {sorted(placed)}, "
        f"the notebooks are {numbers}")
    agendas = {n for row in _table_after("## Teaching a workshop", "")
               for n in mentioned(row.split("|")[2])}
    missing = [n for n in numbers if n not in agendas]
    assert not missing, f"notebooks in no workshop agenda: {missing}"
