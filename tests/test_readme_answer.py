"""The README's answer quotes the notebooks' outputs: every figure of its claims table is printed
by the notebook that the row names, in its committed outputs.

So a figure cannot be typed by hand and go stale: re-executing a notebook that prints another
figure fails this test until the README says what the notebook now prints.
"""

from __future__ import annotations

import json
import re

import pytest

from .conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
# | claim | measured | [02](notebooks/02_manual_allreduce_averaging.ipynb) |
CLAIM_ROW = re.compile(r"^\| (?P<claim>[^|]+) \| (?P<measured>[^|]+) \| "
                       r"\[(?P<number>\d\d)\]\((?P<path>notebooks/\d\d_\w+\.ipynb)\) \|$", re.M)
# 5.6e-17, 0.23, 2.2e-03, 0.71, 0
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]\d+)?(?![\w.])")
ROWS = list(CLAIM_ROW.finditer(README))


def _outputs(path: str) -> str:
    """Everything a notebook printed, as one text."""
    cells = json.loads((REPO / path).read_text(encoding="utf-8"))["cells"]
    texts = []
    for cell in cells:
        for output in cell.get("outputs", []):
            texts.append("".join(output.get("text", "")))
            texts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


def test_the_answer_has_a_claims_table_with_a_row_per_lesson():
    assert len(ROWS) >= 10, "the README's answer lost its claims table"
    assert sorted({row["number"] for row in ROWS}) == sorted(
        {row["number"] for row in ROWS if (REPO / row["path"]).exists()})


@pytest.mark.parametrize("row", ROWS, ids=lambda row: f"{row['number']}: {row['claim'][:40]}")
def test_each_figure_is_printed_by_the_notebook_named(row):
    printed = _outputs(row["path"])
    figures = FIGURE.findall(row["measured"])
    assert figures, f"the row {row['claim']!r} shows no figure"
    missing = [f for f in figures if not re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", printed)]
    assert not missing, (f"README's claim {row['claim']!r}: {missing} not in the outputs of "
                         f"{row['path']}: copy what the notebook prints now")
