"""The README's answer quotes the notebooks' outputs: every figure of its claims table
(``notebooks/course.toml``'s claims) is printed by the notebook that the row names, in its
committed outputs.

So a figure cannot be typed by hand and go stale: re-executing a notebook that prints another
figure fails this test until the README says what the notebook now prints.
"""

from __future__ import annotations

import json
import re

import pytest

from .conftest import REPO, tool

README = (REPO / "README.md").read_text(encoding="utf-8")
COURSE = tool("course").read(REPO)  # notebooks/course.toml: the table's rows, as data
# 5.6e-17, 0.23, 2.2e-03, 0.71, 0
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]\d+)?(?![\w.])")
ROWS = [{"claim": c.claim, "measured": c.measured, "number": c.notebook,
         "path": f"notebooks/{COURSE.notebooks[c.notebook].name}"} for c in COURSE.claims]


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
    assert all((REPO / row["path"]).exists() for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda row: f"{row['number']}: {row['claim'][:40]}")
def test_each_figure_is_printed_by_the_notebook_named(row):
    printed = _outputs(row["path"])
    figures = FIGURE.findall(row["measured"])
    assert figures, f"the row {row['claim']!r} shows no figure"
    missing = [f for f in figures if not re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", printed)]
    assert not missing, (f"README's claim {row['claim']!r}: {missing} not in the outputs of "
                         f"{row['path']}: copy what the notebook prints now")


def _short_answer() -> str:
    """The README's short answer: the paragraph that opens with it, in bold."""
    start = README.index("**Short answer:")
    return README[start:README.index("\n\n", start)]


def test_the_short_answer_is_short_instruction_first_with_a_measured_figure():
    """About 150 words at most, the instruction in bold first, and a figure the claims table
    shows (so that the test above checks it against the outputs)."""
    answer = _short_answer()
    words = len(answer.split())
    assert words <= 150, f"the README's short answer has {words} words: keep it to 150"
    assert re.match(r"\*\*Short answer: yes, keep the division", answer), answer[:80]
    table = {f for row in ROWS for f in FIGURE.findall(row["measured"])}
    assert any(f in table for f in FIGURE.findall(answer) if "e-" in f), (
        "the short answer quotes no figure of the claims table")


def test_each_question_of_the_notebook_table_starts_with_a_capital():
    questions = [nb.question for nb in COURSE.notebooks.values()]
    assert len(questions) >= 14
    lower = [q[:40] for q in questions if not q[0].isupper()]
    assert not lower, f"questions of the README's notebook table that start in lower case: {lower}"
