"""The course's notebooks as code: diff one notebook's training loop against the previous one's,
or run the previous notebook's function again, read from the notebook itself.

Notebooks 01 -> 02 -> 03 keep the same names and the same loop, so that the lines that change
*are* the lesson (as in pytorch/examples' ddp-tutorial-series). These helpers read the code from
the committed notebooks, so a diff shown in a notebook cannot go stale:

    >>> import gradsync_tutorial as gst
    >>> old = gst.notebooks.function_source("01_single_device_baseline", "train")
    >>> old.splitlines()[0]
    'def train(epochs, lr=LR, dropout=True, dtype=torch.float32):'
    >>> changes = gst.notebooks.show_diff(old, old)        # nothing changed
    changed places: 0
    >>> train_01 = gst.notebooks.load_function("01_single_device_baseline", "train")
    >>> train_01.__name__
    'train'

The course's own files are found here too, never listed by hand: ``paths()`` are the
notebooks (or their sources, or the snippets) in course order, and ``MENTION`` is the one
grammar of "notebook 02" / "notebooks 02 and 03" that the site's links and the tests read:

    >>> [p.name for p in gst.notebooks.paths()][:2]
    ['00_launching_workers.ipynb', '01_single_device_baseline.ipynb']
    >>> gst.notebooks.mentioned("as notebooks 02 and 03 show, and notebooks 07 to 09")
    ['02', '03', '07', '08', '09']

Introduced in ``notebooks/02_manual_allreduce_averaging.ipynb``.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import json
import linecache
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MENTION", "count_changes", "function_source", "load_function", "mentioned",
           "notebook_path", "paths", "show_diff"]

REPO = Path(__file__).resolve().parent.parent
#: What the course's numbered files are called: ``NN_topic`` (two digits, then a name).
NUMBERED = "[0-9][0-9]_*"
#: The folders and suffixes ``paths(kind)`` looks in.
KINDS = {"ipynb": ("notebooks", ".ipynb"), "source": ("notebooks", ".py"),
         "snippet": ("snippets", ".py")}
#: "notebook 05", "notebooks 02 and 03", "Notebooks 00 to 05", "notebooks 02, 03 or 04": the
#: word, the space after it, and the numbers (groups ``word``, ``sp``, ``numbers``).
MENTION = re.compile(
    r"\b(?P<word>[Nn]otebooks?)(?P<sp>\s+)"
    r"(?P<numbers>\d\d(?:(?:,\s+|,?\s+and\s+|\s+to\s+|\s+or\s+)\d\d)*)\b")


def paths(kind: str = "ipynb", root: Path | str | None = None) -> list[Path]:
    """The course's numbered files in course order: ``kind`` is ``"ipynb"`` (the notebooks),
    ``"source"`` (their ``.py`` sources) or ``"snippet"`` (``snippets/NN_*.py``); ``root`` is a
    checkout of the course (default: this one).

    A new notebook, source or snippet is found by this one rule, so no list needs a new line.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    folder, suffix = KINDS[kind]
    return sorted((Path(root or REPO) / folder).glob(NUMBERED + suffix))


def mentioned(text: str) -> list[str]:
    """The notebook numbers that ``text`` names with :data:`MENTION`, in the order named; "00
    to 03" names 00, 01, 02 and 03."""
    found = []
    for match in MENTION.finditer(text):
        for first, last in re.findall(r"(\d\d)(?:\s+to\s+(\d\d))?", match["numbers"]):
            found += [f"{n:02d}" for n in range(int(first), int(last or first) + 1)]
    return found


def _notebooks_dir() -> Path:
    """``<repo>/notebooks`` in a checkout of the course, else the current folder (a notebook's
    kernel runs in the folder of the notebook)."""
    repo = Path(__file__).resolve().parent.parent
    if (repo / "notebooks").is_dir():
        return repo / "notebooks"
    return Path.cwd()


def notebook_path(notebook: str) -> Path:
    """The ``.ipynb`` file of a notebook named with or without its extension, e.g.
    ``"01_single_device_baseline"``."""
    name = notebook if notebook.endswith(".ipynb") else notebook + ".ipynb"
    path = _notebooks_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"no notebook {name} in {path.parent}: run this from the course's "
                                "notebooks/ folder, or pass a name such as "
                                "'01_single_device_baseline'.")
    return path


def _code_cells(notebook: str) -> list[str]:
    cells = json.loads(notebook_path(notebook).read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _defining_cell(notebook: str, name: str) -> tuple[str, ast.FunctionDef]:
    for source in _code_cells(notebook):
        try:
            tree = ast.parse(source)
        except SyntaxError:  # IPython magics: not where the course defines functions
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return source, node
    raise LookupError(f"notebook {notebook} defines no function {name!r} at the top of a cell.")


def function_source(notebook: str, name: str) -> str:
    """The source of ``def name(...)`` as written in a notebook's cell (decorators included)."""
    source, node = _defining_cell(notebook, name)
    lines = source.splitlines()
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return "\n".join(lines[first - 1 : node.end_lineno]) + "\n"


def load_tool(name: str, root: Path | str | None = None) -> Any:
    """``tools/NAME.py`` of a checkout (default: this one), a maintainer's script and no package,
    loaded as the module ``tools_NAME``. It is registered in ``sys.modules``, where its
    dataclasses look their module up. The tools, the site's build and the tests load them so.

        >>> load_tool("course").words(["14", "15"])
        'notebooks 14 and 15'
    """
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        f"tools_{name}", Path(root or REPO) / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_function(notebook: str, name: str, requires: Sequence[str] = (),
                  settings: Mapping[str, Any] | None = None) -> Callable:
    """Run a notebook's first code cell (its settings and imports), the definitions of the
    functions it ``requires`` and the function's own, in a namespace of their own; return it.

    So notebook 02 can run notebook 01's ``train`` as notebook 01 wrote it, with notebook 01's
    settings. ``settings`` replaces some of them after the first cell ran, for example
    ``{"N_TRAIN": 12_288}`` to train on the images the calling notebook uses. The function can
    be sent to ``gst.launch`` like one defined in a cell.
    """
    namespace: dict = {"__name__": f"notebook_{Path(notebook).stem}"}
    setup = _code_cells(notebook)[0]
    exec(compile(setup, f"<{notebook}: first cell>", "exec"), namespace)  # noqa: S102
    unknown = sorted(set(settings or {}) - set(namespace))
    if unknown:
        raise KeyError(f"notebook {notebook}'s first cell sets no {', '.join(unknown)}: "
                       "settings= can only replace a setting the notebook has.")
    namespace.update(settings or {})
    for needed in [*requires, name]:
        code = function_source(notebook, needed)
        filename = f"<{notebook}: {needed}>"
        # As IPython does for cells: tracebacks and inspect.getsource can then show the code.
        linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
        exec(compile(code, filename, "exec"), namespace)  # noqa: S102
    return namespace[name]


def _source(code: str | Callable) -> str:
    return code if isinstance(code, str) else inspect.getsource(code)


def count_changes(old: str | Callable, new: str | Callable) -> int:
    """How many separate places differ: runs of consecutive added, removed or changed lines."""
    a, b = _source(old).splitlines(), _source(new).splitlines()
    opcodes = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum(tag != "equal" for tag, *_ in opcodes)


def show_diff(
    old: str | Callable,
    new: str | Callable,
    names: tuple[str, str] = ("before", "after"),
    context: int = 1,
) -> int:
    """Print a unified diff (``-`` removed, ``+`` added) and how many places changed; return it.

    ``old`` and ``new`` are source strings or functions (read with ``inspect.getsource``, which
    also works for a function defined in a notebook cell).

        >>> from gradsync_tutorial.notebooks import show_diff
        >>> show_diff("x = 1\\ny = 2\\n", "x = 1\\ny = 3\\n", names=("a", "b"))
        --- a
        +++ b
        @@ -1,2 +1,2 @@
         x = 1
        -y = 2
        +y = 3
        changed places: 1
        1
    """
    a, b = _source(old).splitlines(), _source(new).splitlines()
    for line in difflib.unified_diff(a, b, *names, n=context, lineterm=""):
        print(line)
    changes = count_changes(old, new)
    print(f"changed places: {changes}")
    return changes
