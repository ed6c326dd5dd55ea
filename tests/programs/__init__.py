"""Whole programs that the launcher must run unedited, kept as files so that they can be read,
linted and diffed against the programs they have the shape of; and :func:`cell`, which runs a
program (or any source) the way a notebook cell defines it.

Each file's docstring names the program it has the shape of: written for the course's tests, not
copied, with only the device edits a CPU laptop needs (nccl -> gloo, cuda -> cpu), each marked
"device edit". ``tests/launcher/test_own_group.py`` launches their functions unedited.
"""

from __future__ import annotations

import itertools
import linecache
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
_cells = itertools.count(1)


def cell(source: str) -> dict:
    """Run ``source`` as IPython runs a notebook cell: in ``__main__``, from a file only
    linecache has. Returns the cell's namespace."""
    source = textwrap.dedent(source)
    filename = f"/tmp/ipykernel_test/cell_{next(_cells)}.py"  # never a file on disk
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def source(name: str) -> str:
    """The text of ``tests/programs/NAME.py``."""
    return (HERE / f"{name}.py").read_text()


def program(name: str) -> dict:
    """``tests/programs/NAME.py`` defined as a notebook cell defines it (see :func:`cell`)."""
    return cell(source(name))
