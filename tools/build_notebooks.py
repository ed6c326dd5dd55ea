"""Build the course notebooks from their sources: ``notebooks/NN_*.py`` -> ``notebooks/NN_*.ipynb``.

    python tools/build_notebooks.py            # every notebook (what `make notebooks` runs)
    python tools/build_notebooks.py 02 05      # notebooks 02 and 05 (`make notebooks NB=02`)
    python tools/build_notebooks.py 02 --no-execute   # markdown or NBVAL comments: keep outputs
    python tools/build_notebooks.py --images   # images/*.png from the notebooks (`make images`)
    python tools/build_notebooks.py --world-size 4   # check: each runs unchanged on 4 ranks

Each notebook's source is a jupytext ``py:percent`` file next to it, with the same name: that is
what people edit and review. The ``.ipynb`` with outputs is what readers open and what nbval runs.
Building one:

1. reads the source and takes over the existing ``.ipynb``'s cell ids (jupytext matches the
   cells), so an unchanged cell keeps its id and a diff shows what really changed;
2. executes it top to bottom in a fresh kernel, in the full (non-smoke) mode: ``SMOKE_TEST`` is
   removed from the kernel's environment; cells tagged ``raises-exception`` may raise, any other
   error stops the build and leaves the ``.ipynb`` as it was, with one message that names the
   notebook, the cell and its line in the source (``notebooks/02_x.py:57: cell 12 raised ...``);
3. merges consecutive prints into one output, as Jupyter shows them, and writes it without
   execution timestamps, so re-executing changes outputs only.

Python and the kernel: the kernel is this interpreter's ``python3`` kernel and inherits its
environment (``PYTHONPATH`` included).

Snippets: a markdown block that follows ``<!-- snippets/NN_x.py -->`` is filled with that file
(a script the tests run under torchrun) when the notebook is built, in the source and so in the
notebook: what a reader copies is code that ran.

Other world sizes: ``--world-size N`` executes each notebook with ``WORLD_SIZE = N`` in its first
cell instead of its own (2, or 3 in notebook 13), in the full mode, and writes nothing: the
README's promise that every notebook runs unchanged with 4 ranks, checked (exit status 1 and
each failure's message when one fails).

Figures: running a notebook writes no file. A plot the README shows comes from a cell tagged
``image:NAME.png``; ``--images`` copies that cell's committed output to ``images/NAME.png``.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from jupytext.combine import combine_inputs_with_outputs

from gradsync_tutorial.notebooks import paths

REPO = Path(__file__).resolve().parent.parent
SOURCE_FORMAT = "py:percent"
# Cell metadata that says when a cell ran, not what it is: never committed.
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime")
IMAGE_TAG = "image:"  # a cell tagged image:NAME.png draws images/NAME.png
CELL_TIMEOUT = 3600  # seconds one cell may run (05's benchmark takes minutes on a laptop)
# In a source: "<!-- snippets/NN_x.py -->", then a fenced python block (filled from the file).
SNIPPET = re.compile(r"^# <!-- (snippets/[\w.-]+\.py) -->\n# ```python\n(?:#.*\n)*?# ```\n", re.M)


def sources(root: Path = REPO) -> list[Path]:
    """The notebooks' sources, in course order (``notebooks/NN_*.py``)."""
    return paths("source", root)


def notebook_of(source: Path) -> Path:
    """``notebooks/02_x.py`` -> ``notebooks/02_x.ipynb``."""
    return source.with_suffix(".ipynb")


def read_source(source: Path) -> nbformat.NotebookNode:
    return jupytext.read(source, fmt=SOURCE_FORMAT)


def _compared(cell) -> tuple:
    """What must agree between a notebook cell and its source cell: type, text, tags, metadata."""
    metadata = {k: v for k, v in cell.metadata.items() if k not in VOLATILE_CELL_METADATA}
    return cell.cell_type, cell.source, metadata


def first_difference(notebook: nbformat.NotebookNode, source: nbformat.NotebookNode) -> str | None:
    """None when the notebook's cells are its source's cells; else which cell differs, and how.

    >>> nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    >>> src = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 2")])
    >>> first_difference(nb, src)
    "cell 1 (code): the notebook has 'x = 1', the source has 'x = 2'"
    """
    pairs = zip(notebook.cells, source.cells, strict=False)
    for number, (ours, theirs) in enumerate(pairs, start=1):
        if _compared(ours) == _compared(theirs):
            continue
        if ours.cell_type != theirs.cell_type:
            what = f"the notebook has a {ours.cell_type} cell, the source a {theirs.cell_type} cell"
        elif ours.source != theirs.source:
            pairs = zip(ours.source.splitlines(), theirs.source.splitlines(), strict=False)
            a, b = next(((a, b) for a, b in pairs if a != b), (ours.source, theirs.source))
            what = f"the notebook has {a[:70]!r}, the source has {b[:70]!r}"
        else:
            what = (f"metadata: the notebook has {_compared(ours)[2]}, "
                    f"the source has {_compared(theirs)[2]}")
        return f"cell {number} ({ours.cell_type}): {what}"
    if len(notebook.cells) != len(source.cells):
        return (f"the notebook has {len(notebook.cells)} cells, "
                f"the source has {len(source.cells)}")
    return None


KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def _strip_volatile(nb: nbformat.NotebookNode) -> None:
    for cell in nb.cells:
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
    nb.metadata.pop("jupytext", None)  # the pairing lives in pyproject.toml, not in each notebook
    # a notebook without one makes JupyterLab ask which kernel to start, and nbval warn
    nb.metadata.setdefault("kernelspec", dict(KERNELSPEC))


def include_snippets(source: Path, root: Path | None = None) -> None:
    """Fill each snippet block of ``source`` with its file, as it is now (``root``: the
    course the source is in, by default the folder above its ``notebooks/``)."""
    root = source.resolve().parent.parent if root is None else root

    def fill(match: re.Match) -> str:
        snippet = root / match.group(1)
        if not snippet.is_file():
            raise SystemExit(f"notebooks/{source.name}: its block <!-- {match.group(1)} --> "
                             f"shows {match.group(1)}, which does not exist: add the file, or "
                             "fix the name in the source.")
        lines = snippet.read_text(encoding="utf-8").rstrip("\n").splitlines()
        body = "".join(f"# {line}\n" if line else "#\n" for line in lines)
        return f"# <!-- {match.group(1)} -->\n# ```python\n{body}# ```\n"

    text = source.read_text(encoding="utf-8")
    filled = SNIPPET.sub(fill, text)
    if filled != text:
        source.write_text(filled, encoding="utf-8")


def _readable(source: Path) -> None:
    """Refuse a source that is not UTF-8 (jupytext would raise deep inside), naming it."""
    try:
        source.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"notebooks/{source.name}: not UTF-8 (byte 0x{e.object[e.start]:02x} "
                         f"at offset {e.start}): save it as UTF-8 in your editor, then build "
                         "again.") from None


def _committed(target: Path) -> nbformat.NotebookNode:
    """The committed notebook, or a message naming it when it cannot be read as one."""
    try:
        return nbformat.read(target, as_version=4)
    except Exception as e:  # nbformat's NotJSONError, a ValueError, a UnicodeDecodeError...
        raise SystemExit(f"notebooks/{target.name}: not a notebook ({type(e).__name__}: "
                         f"{str(e)[:80]}). Restore it (git checkout notebooks/{target.name}), or "
                         f"delete it to build it from its source without its cell ids.") from None


def assemble(source: Path) -> nbformat.NotebookNode:
    """The source's cells, with the existing notebook's cell ids and outputs where cells match."""
    _readable(source)
    nb = read_source(source)
    target = notebook_of(source)
    if target.exists():
        nb = combine_inputs_with_outputs(nb, _committed(target), fmt=SOURCE_FORMAT)
    _strip_volatile(nb)
    return nb


def execute(nb: nbformat.NotebookNode, path: Path) -> None:
    """Run every cell in a fresh kernel, in the notebook's folder, in the full mode.

    A cell that raises (and is not tagged ``raises-exception``), runs past the timeout or kills
    the kernel stops the build with :func:`cell_failure`'s message, not nbclient's traceback.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor

    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env = {k: v for k, v in os.environ.items() if k != "SMOKE_TEST"}
    started: list[int] = []  # the index of each cell the kernel was given, in order
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}},
                            on_cell_start=lambda cell, cell_index: started.append(cell_index))
    try:
        client.execute(env=env)
    except CellExecutionError as e:
        raise SystemExit(cell_failure(path, nb, started[-1], f"raised {e.ename}: {e.evalue}",
                                      e.traceback)) from None
    except CellTimeoutError:
        raise SystemExit(cell_failure(path, nb, started[-1],
                                      f"did not finish within {CELL_TIMEOUT} s")) from None
    except DeadKernelError:
        raise SystemExit(cell_failure(path, nb, started[-1] if started else 0,
                                      "killed the kernel (out of memory?)")) from None
    # One stream output per flush run, as Jupyter shows it (and nbconvert --execute wrote it).
    CoalesceStreamsPreprocessor().preprocess(nb, {})


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CELL_LINE = re.compile(r"Cell In\[\d+\], line (\d+)")


def cell_failure(path: Path, nb: nbformat.NotebookNode, index: int, what: str,
                 traceback: str = "") -> str:
    """What a build that stopped at cell ``index`` says: the notebook, the cell, its line.

    >>> nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title"),
    ...                                      nbformat.v4.new_code_cell("x = 1\\ny = x / 0")])
    >>> error = "raised ZeroDivisionError: division by zero"
    >>> print(cell_failure(Path("notebooks/02_x.ipynb"), nb, 1, error,
    ...                    "Cell In[1], line 2"))  # doctest: +NORMALIZE_WHITESPACE
    notebooks/02_x.py: cell 2 raised ZeroDivisionError: division by zero, at its line 2:
      y = x / 0
    notebooks/02_x.ipynb was not written: fix the source, then build again (make notebooks NB=02).
    """
    cell = nb.cells[index]
    lines = cell.source.splitlines()
    found = _CELL_LINE.findall(_ANSI.sub("", traceback))
    where, shown = "", ""
    if found and 0 < int(found[-1]) <= len(lines):
        where, shown = f", at its line {found[-1]}", f"\n  {lines[int(found[-1]) - 1].strip()}"
    elif lines:
        shown = f"\n  {lines[0].strip()}" + (" ..." if len(lines) > 1 else "")
    source, notebook = path.with_suffix(".py"), path.with_suffix(".ipynb")
    marker = _cell_line(source, index)
    at = f"notebooks/{source.name}" + (f":{marker}" if marker else "")
    kept = "was left as it was" if notebook.exists() else "was not written"
    return (f"{at}: cell {index + 1} {what}{where}:{shown}\n"
            f"notebooks/{notebook.name} {kept}: fix the source, then build again "
            f"(make notebooks NB={source.name[:2]}).")


def _cell_line(source: Path, index: int) -> int | None:
    """The line of the source where cell ``index`` starts (its ``# %%`` marker), if found."""
    try:
        text = source.read_text()
    except OSError:
        return None
    markers = [n for n, line in enumerate(text.splitlines(), start=1) if line.startswith("# %%")]
    return markers[index] if len(markers) == len(read_source(source).cells) else None


def build(source: Path, run: bool = True) -> None:
    target = notebook_of(source)
    if not run and not target.exists():
        raise SystemExit(f"notebooks/{target.name} does not exist yet, so there are no outputs "
                         f"to keep: build it without --no-execute (make notebooks "
                         f"NB={source.name[:2]}), which executes it.")
    _readable(source)
    include_snippets(source)
    nb = assemble(source)
    if run:
        started = time.monotonic()
        execute(nb, target)
        took = f"executed in {time.monotonic() - started:.0f} s"
    else:
        def code(cells):
            return [_code(c.source) for c in cells if c.cell_type == "code"]

        if code(_committed(target).cells) != code(nb.cells):
            raise SystemExit(f"{source.name}: its code changed, so the outputs would be stale: "
                             f"build it without --no-execute")
        took = "outputs kept (no code cell changed)"
    _strip_volatile(nb)
    nbformat.validate(nb)
    nbformat.write(nb, target)
    print(f"notebooks/{target.name}: {took}", flush=True)


def _code(source: str) -> str:
    """A cell's code without nbval's comments (they change how nbval compares, not outputs)."""
    return "\n".join(line for line in source.splitlines() if not line.startswith("# NBVAL_"))


def figures(notebook: Path) -> dict[str, bytes]:
    """``{"NAME.png": png}`` for each cell of ``notebook`` tagged ``image:NAME.png``."""
    found = {}
    for cell in nbformat.read(notebook, as_version=4).cells:
        for tag in cell.metadata.get("tags", []):
            if tag.startswith(IMAGE_TAG):
                pngs = [o.data["image/png"] for o in cell.get("outputs", [])
                        if "image/png" in o.get("data", {})]
                if len(pngs) != 1:
                    raise SystemExit(f"{notebook.name}: the cell tagged {tag} shows "
                                     f"{len(pngs)} PNG figures, expected 1")
                found[tag[len(IMAGE_TAG):]] = base64.b64decode(pngs[0])
    return found


def write_images(root: Path = REPO) -> None:
    for source in sources(root):
        for name, png in figures(notebook_of(source)).items():
            (root / "images" / name).write_bytes(png)
            print(f"images/{name}: from {notebook_of(source).name}")


def select(names: list[str], root: Path = REPO) -> list[Path]:
    """``["02"]`` or ``["notebooks/02_x.ipynb"]`` -> the matching sources; all when empty."""
    every = sources(root)
    if not names:
        return every
    chosen = []
    for name in names:
        stem = Path(name).stem
        match = [s for s in every if s.stem == stem or s.stem.startswith(f"{stem}_")]
        if len(match) != 1:
            raise SystemExit(f"{name!r}: expected one of {[s.stem[:2] for s in every]} "
                             f"or a notebook's name, found {len(match)} matches")
        chosen += match
    return chosen


WORLD_SIZE_LINE = re.compile(r"^WORLD_SIZE = \d+\b", re.M)  # the notebook's own, 2 or 3


def with_world_size(code: str, world_size: int) -> str | None:
    """``code`` (a notebook's first code cell) with its ``WORLD_SIZE = ...`` line set to
    ``world_size``, whatever it was; None when it has no such line.

    >>> with_world_size("WORLD_SIZE = 3  # the replicas\\nSMOKE = 1", 4)
    'WORLD_SIZE = 4  # the replicas\\nSMOKE = 1'
    >>> with_world_size("x = 1", 4) is None
    True
    """
    if not WORLD_SIZE_LINE.search(code):
        return None
    return WORLD_SIZE_LINE.sub(f"WORLD_SIZE = {world_size}", code, count=1)


def run_at_world_size(source: Path, world_size: int) -> str | None:
    """Execute ``source`` with ``WORLD_SIZE = world_size`` in its first code cell (full mode),
    writing nothing. Returns None when every cell passed, else what failed and where."""
    nb = read_source(source)
    first = next(cell for cell in nb.cells if cell.cell_type == "code")
    changed = with_world_size(first.source, world_size)
    if changed is None:
        return f"{source.name}: its first code cell has no line 'WORLD_SIZE = N' to change"
    first.source = changed
    try:
        execute(nb, notebook_of(source))
    except SystemExit as failure:
        return str(failure)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="NN or a notebook's name; default: all")
    parser.add_argument("--no-execute", action="store_true",
                        help="keep the outputs (refused when a code cell changed)")
    parser.add_argument("--images", action="store_true",
                        help="only write images/*.png from the committed notebooks' figures")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="only check that each notebook runs with WORLD_SIZE = N (writes "
                             "nothing)")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size must be at least 1 (the number of ranks), got "
                     f"{args.world_size}")
    if args.images:
        write_images()
        return 0
    if args.world_size is not None:
        failures = 0
        for source in select(args.notebooks):
            start = time.monotonic()
            failure = run_at_world_size(source, args.world_size)
            print(f"{source.name}: {'ok' if failure is None else 'FAILED'} with WORLD_SIZE = "
                  f"{args.world_size} ({time.monotonic() - start:.0f} s)", flush=True)
            if failure is not None:
                failures += 1
                print(failure, file=sys.stderr, flush=True)
        return 1 if failures else 0
    for source in select(args.notebooks):
        build(source, run=not args.no_execute)
    return 0


if __name__ == "__main__":
    sys.exit(main())
