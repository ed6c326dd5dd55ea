"""The README's time table and the doctor's reference times come from one measured run.

``make times`` (``tools/time_table.py``) executes every notebook in one run, records the
times in ``benchmarks/notebook_times.json`` and writes both files from that record. These tests
fail when either file says something else (a figure typed by hand, a notebook added without
measuring again), and check the writer on small examples. Nothing here executes a notebook.
"""

from __future__ import annotations

import doctest
import importlib.util
import json

import pytest

from .conftest import REPO


def _load():
    spec = importlib.util.spec_from_file_location("time_table", REPO / "tools" / "time_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


table = _load()
NOTEBOOKS = sorted(p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="module")
def record() -> dict:
    assert table.RECORD.exists(), "no recorded run: make times (on a quiet machine)"
    return json.loads(table.RECORD.read_text(encoding="utf-8"))


def test_the_recorded_run_timed_every_notebook(record):
    assert sorted(record["notebooks"]) == NOTEBOOKS, (
        "the recorded run does not time exactly the notebooks there are: make times")


def test_readme_and_doctor_are_written_from_the_recorded_run(record):
    readme, doctor_py = table.rendered(record)
    assert (REPO / "README.md").read_text(encoding="utf-8") == readme, (
        "README.md's run times (or the line under the table, or the benchmark table) are not "
        "the recorded run's: python tools/time_table.py --write (or make times to measure)")
    assert (REPO / "gradsync_tutorial" / "doctor.py").read_text(encoding="utf-8") == doctor_py, (
        "doctor.py's REFERENCE_SECONDS / REFERENCE_EPOCH_SECONDS are not the recorded run's: "
        "python tools/time_table.py --write")


def test_durations_read_as_the_cross_reference_test_parses_them():
    from .test_cross_references import _seconds

    assert doctest.testmod(table, verbose=False).failed == 0
    for seconds in (0, 7, 59, 60, 61, 119, 120, 130, 481):
        assert _seconds(table.duration(seconds)) == seconds


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


def test_the_doctor_gets_one_entry_per_timed_notebook():
    doctor = ('#: Measured long ago.\nREFERENCE_SECONDS: dict[str, float | None] = {\n'
              '    "00_a.ipynb": 40,\n}\nREFERENCE_EPOCH_SECONDS = 6.5  # old\n')
    text = table.render_doctor(doctor, RUN)
    assert '"00_a.ipynb": 19,\n    "01_b.ipynb": 131,\n    "07_new.ipynb": 61,\n}' in text
    assert "REFERENCE_EPOCH_SECONDS = 5.0  # the same run" in text
    assert "#: Measured 2026-12-01 20:00 UTC by `make times`, 2 cores, load average 0.1." in text
