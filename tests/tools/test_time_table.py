"""The README's time table and the doctor's reference times come from one measured run.

``make times`` (``tools/time_table.py``) executes every notebook in one run and records the
times in ``gradsync_tutorial/reference_times.json``, which the doctor reads as it is; the
README's tables are written from that record and ``notebooks/course.toml`` (``tools/course.py``,
tested in ``test_course_record.py``). These tests
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


def test_the_budget_names_a_notebook_over_it():
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
            "average 0.3 before).") in table._course().run_line(merged)
    assert "99_new.ipynb" not in record["notebooks"]  # the record itself is left alone
