"""The README quotes the benchmark run recorded in notebook 05's outputs, not another run.

Step times vary from run to run, so the README and the notebook must not each keep their own:
the README's table is the one notebook 05 printed when it was last executed. ``make times``
(``tools/time_table.py``) copies it into the README after the run that re-executes notebook 05.
"""

from __future__ import annotations

import json
import re

from .conftest import REPO

NOTEBOOK = REPO / "notebooks" / "05_performance.ipynb"
HEADER = "ms/step: median of"


def notebook_table() -> list[str]:
    """The lines of the first benchmark table that notebook 05 printed (every variant, DDP)."""
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", ""))
            if HEADER in text and "compute only" in text:
                lines = text[text.index(HEADER):].rstrip().splitlines()
                return [line.rstrip() for line in lines]
    raise AssertionError(f"{NOTEBOOK.name} has no benchmark table in its outputs: execute it")


def readme_table() -> list[str]:
    readme = (REPO / "README.md").read_text()
    block = re.search(rf"```text\n({re.escape(HEADER)}.*?)\n```", readme, re.S)
    assert block, f"README.md has no ```text block starting with {HEADER!r}"
    return [line.rstrip() for line in block.group(1).splitlines()]


def test_readme_quotes_the_benchmark_run_of_notebook_05():
    expected = notebook_table()
    assert readme_table() == expected, (
        "README.md's benchmark table is not the one notebook 05 printed: "
        "python tools/time_table.py --write copies it:\n" + "\n".join(expected))

