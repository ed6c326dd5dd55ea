"""Add "Open in Colab" badges and a Colab install cell to the course, for a public repository URL.

    python tools/colab.py https://github.com/OWNER/NAME              # branch main
    python tools/colab.py https://github.com/OWNER/NAME --branch v1  # another branch or tag

A notebook opened in Colab arrives alone: without this repository, so without the helper
package. This script makes every notebook fit for that, in place, and it can run again (a second
run with another URL replaces what the first wrote):

* each notebook's title cell gets a badge that opens it in Colab;
* each notebook gets a first code cell that installs the helper package from the repository,
  **only on Colab** (``"google.colab" in sys.modules``); elsewhere it does nothing, so the same
  notebook still runs on a laptop, in CI and in a workshop without wifi;
* the README's notebook table gets the same badges (written again by ``tools/course.py``,
  which takes each row's badge from its notebook's title cell).

On Colab the rest works as it does on a laptop: the data comes through torchvision's download,
the ranks run on the runtime's CPU cores with gloo, or on its GPU (nccl needs one GPU per rank, so
a 1-GPU runtime with ``WORLD_SIZE = 2`` runs gloo on the CPUs). Afterwards, re-execute the
notebooks (the new cell has no output yet: ``make notebooks``) and commit. Each notebook's
source, ``notebooks/NN_*.py``, gets the same changes, so the two stay in sync. Images linked as
``../images/...`` in markdown cells do not show on Colab, which fetches the notebook alone.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import jupytext
import nbformat

from gradsync_tutorial.notebooks import load_tool, paths

REPO = Path(__file__).resolve().parent.parent
BADGE_SVG = "https://colab.research.google.com/assets/colab-badge.svg"
SETUP_CELL_ID = "colab-setup"
SETUP_CELL = """\
# On Google Colab only: install the helper package (elsewhere, `make lab` already did).
import sys

if "google.colab" in sys.modules:
    %pip install -q "gradsync-tutorial @ git+{url}@{branch}"
"""
_URL = re.compile(r"^https://github\.com/([A-Za-z0-9-]+)/([A-Za-z0-9._-]+?)(?:\.git)?/?$")
_BADGE = re.compile(r"\s*\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")


def parse_repository(url: str) -> tuple[str, str]:
    """``https://github.com/OWNER/NAME`` -> ``("OWNER", "NAME")``, or a ValueError saying why.

    >>> parse_repository("https://github.com/someone/gradsync-tutorial.git")
    ('someone', 'gradsync-tutorial')
    """
    match = _URL.match(url.strip())
    if not match:
        raise ValueError(
            f"expected the repository's public GitHub URL, like https://github.com/OWNER/NAME, "
            f"got {url!r}: Colab opens notebooks from GitHub only"
        )
    return match.group(1), match.group(2)


def badge(owner: str, name: str, branch: str, path: str) -> str:
    """The markdown of an "Open in Colab" badge for the notebook at ``path`` in the repository."""
    target = f"https://colab.research.google.com/github/{owner}/{name}/blob/{branch}/{path}"
    return f"[![Open In Colab]({BADGE_SVG})]({target})"


def course_notebooks(root: Path) -> list[Path]:
    """The course's notebooks, in order (``notebooks/NN_*.ipynb``)."""
    return paths("ipynb", root)


def add_to_notebook(path: Path, owner: str, name: str, branch: str, root: Path) -> None:
    """Badge under the title, install cell before the first code cell; replaces earlier ones.

    In the notebook and in its jupytext source next to it (``NN_*.py``), if there is one.
    """
    nb = nbformat.read(path, as_version=4)
    _add(nb, path, owner, name, branch, root)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    source = path.with_suffix(".py")
    if source.exists():
        text = jupytext.read(source, fmt="py:percent")
        _add(text, path, owner, name, branch, root)
        jupytext.write(text, source, fmt="py:percent")


def _add(nb: nbformat.NotebookNode, path: Path, owner: str, name: str, branch: str,
         root: Path) -> None:
    title = nb.cells[0]
    if title.cell_type != "markdown" or not title.source.startswith("# "):
        raise ValueError(f"{path}: the first cell should be the notebook's markdown title")
    heading, _, rest = title.source.partition("\n")
    rest = _BADGE.sub("", rest, count=1).lstrip("\n")
    link = badge(owner, name, branch, path.relative_to(root).as_posix())
    title.source = f"{heading}\n\n{link}\n\n{rest}" if rest else f"{heading}\n\n{link}"

    url = f"https://github.com/{owner}/{name}"
    source = SETUP_CELL.format(url=url, branch=branch).rstrip("\n")
    first_line = SETUP_CELL.splitlines()[0]  # a source (.py) keeps no cell ids
    cells = [c for c in nb.cells
             if c.get("id") != SETUP_CELL_ID and not c.source.startswith(first_line)]
    first_code = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    setup = nbformat.v4.new_code_cell(source, id=SETUP_CELL_ID)
    nb.cells = cells[:first_code] + [setup] + cells[first_code:]


def add_to_readme(root: Path) -> int:
    """The README's notebook table written again (``tools/course.py``): each row takes the badge
    of its notebook's title cell. Returns how many rows have one."""
    course = load_tool("course", root)
    (root / "README.md").write_text(course.readme(root), encoding="utf-8")
    return sum(1 for nb in course.read(root).notebooks.values() if nb.badge)


def main(argv: list[str] | None = None, root: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the repository's public URL: https://github.com/OWNER/NAME")
    parser.add_argument("--branch", default="main", help="branch or tag to open and install")
    args = parser.parse_args(argv)
    try:
        owner, name = parse_repository(args.url)
    except ValueError as error:
        parser.error(str(error))
    if not re.fullmatch(r"[A-Za-z0-9._/-]+", args.branch):
        parser.error(f"--branch {args.branch!r} is not a branch or tag name")
    notebooks = course_notebooks(root)
    if not notebooks:
        parser.error(f"no notebooks/NN_*.ipynb under {root}: run this from the repository")
    for path in notebooks:
        add_to_notebook(path, owner, name, args.branch, root)
    rows = add_to_readme(root)
    print(f"{len(notebooks)} notebooks and {rows} README rows now open in Colab from "
          f"https://github.com/{owner}/{name}/tree/{args.branch}")
    print("Next: re-execute the notebooks (make notebooks: the install cell has no output yet), "
          "then commit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
