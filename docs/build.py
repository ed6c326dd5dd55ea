"""Build the course as a static website, from the committed notebooks: ``make site``.

    make site                                # build/site/html/index.html (installs the extra)
    python docs/build.py build/site          # the same, with an interpreter that has `site`
    python -m http.server -d build/site/html # then open http://localhost:8000

Nothing is executed: the pages show the outputs committed in ``notebooks/NN_*.ipynb``. Sphinx
renders them (MyST-NB reads the notebooks, the Sphinx Book Theme gives navigation and search,
``docs/conf.py`` configures both), from sources staged in ``build/site/src/``:

* the landing page (``index.md``) is the README's opening, "The question, answered", its Glossary
  section with ``docs/glossary.md``'s terms (a Sphinx glossary, so each term is a link target) and
  "The notebooks"; the README's other sections make the second page (``reference.md``), so every
  README anchor has a page;
* each guide the README links to, ``docs/*.md`` but the glossary (the launcher, clusters), a page of
  its own at the same path, so that links between them work on GitHub and on the site alike;
* one page per notebook, every ``notebooks/NN_*.ipynb`` there is, in order, each with a "Run this
  notebook" box under its title: the README's quickstart commands, and the notebook's Colab
  badge once ``colab.py`` has given it one (until then, no badge);
* in the markdown of every page, "notebook 02" (and "notebooks 02 and 03") becomes a link to that
  notebook's page, the first mention of a glossary term a link to its entry, a link to
  ``README.md#section`` a link to the page with that section; images and linked files are
  copied, and the Colab badge's picture is a local copy (the pages load nothing from elsewhere).

Sphinx runs with ``-W``: a link or an image that does not resolve fails the build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import posixpath
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from gradsync_tutorial.notebooks import MENTION as NOTEBOOK_MENTION
from gradsync_tutorial.notebooks import load_tool, paths

REPO = Path(__file__).resolve().parent.parent
DOCS = Path(__file__).resolve().parent
IMAGE_SUFFIXES = {".png", ".svg", ".jpg", ".jpeg", ".gif"}
#: README sections (by how their heading starts) that the landing page shows, in this order.
LANDING = ("The question", "Glossary", "The notebooks")
#: The glossary's own page: the README's Glossary section points to it; the site shows its terms
#: in that section of the landing page.
GLOSSARY = "docs/glossary.md"
COLAB_BADGE_SVG = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "_static/colab-badge.svg"
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](TARGET), as colab.py
# writes it; TARGET is https://colab.research.google.com/github/OWNER/NAME/blob/BRANCH/PATH
COLAB_BADGE = re.compile(
    r"\s*\[!\[Open In Colab\]\([^)]*\)\]"
    r"\((?P<target>https://colab\.research\.google\.com/github/(?P<owner>[\w.-]+)/"
    r"(?P<name>[\w.-]+)/blob/[^)\s]+)\)")
# Markdown that is not prose: nothing inside it becomes a link. Order matters (fences first).
PROTECTED = re.compile(
    r"^(?P<fence>`{3,}|~{3,})[^\n]*\n.*?^(?P=fence)[ \t]*$"  # fenced code
    r"|^[ \t]*#{1,6}[ \t][^\n]*$"                               # headings
    r"|<!--.*?-->|<a\b.*?</a>|<[^>\n]+>"                        # HTML
    r"|!?\[(?:[^\]\\\n]|\\.)*\]\([^)\n]*\)"                     # links and images
    r"|(?P<ticks>`+).+?(?P=ticks)"                              # inline code, roles
    r"|\$\$.+?\$\$|\$[^$\n]+\$"                                 # math
    r"|https?://\S+",                                           # bare URLs
    re.M | re.S)
LINK = re.compile(r"(?P<image>!?)\[(?P<text>(?:[^\]\\\n]|\\.)*)\]\((?P<target>[^)\s]*)"
                  r"(?P<title>\s+\"[^\"]*\")?\)")


class SiteError(Exception):
    """The course's files are not in the shape the site is built from; the message says why."""


@dataclass
class Section:
    heading: str  # "" for the README's opening, before its first "## "
    text: str     # the section, heading line included


@dataclass
class Course:
    """What the pages are made from: the README's parts and the notebooks."""

    root: Path
    opening: Section
    sections: list[Section]
    notebooks: dict[str, Path]           # "02" -> notebooks/02_x.ipynb, in course order
    guides: list[str] = field(default_factory=list)  # "docs/launcher.md", ...: pages of their own
    glossary: dict[str, str] = field(default_factory=dict)  # term -> definition
    anchors: dict[str, str] = field(default_factory=dict)   # README anchor -> page ("index")


def slug(heading: str) -> str:
    """GitHub's (and MyST's) anchor for a heading: lower case, punctuation dropped, - for spaces.

    >>> slug("Launching ranks from a notebook: `gst.launch`")
    'launching-ranks-from-a-notebook-gstlaunch'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def split_readme(text: str) -> tuple[Section, list[Section]]:
    """The README's opening and its ``## `` sections (a ``#`` inside a code block is not one)."""
    parts, current, fence = [], [], None
    for line in text.splitlines(keepends=True):
        marker = re.match(r"^(`{3,}|~{3,})", line)
        if marker and (fence is None or marker.group(1).startswith(fence)):
            fence = None if fence else marker.group(1)
        if fence is None and line.startswith("## ") and current:
            parts.append("".join(current))
            current = []
        current.append(line)
    parts.append("".join(current))
    opening = Section("", parts[0])
    sections = [Section(p.splitlines()[0][3:].strip(), p) for p in parts[1:]]
    return opening, sections


def read_course(root: Path = REPO) -> Course:
    """Read the README and find the notebooks (``notebooks/NN_*.ipynb``, in order)."""
    opening, sections = split_readme((root / "README.md").read_text(encoding="utf-8"))
    notebooks = {p.name[:2]: p for p in paths("ipynb", root)}
    if not notebooks:
        raise SiteError(f"no notebooks/NN_*.ipynb under {root}")
    guides = [f"docs/{p.name}" for p in sorted((root / "docs").glob("*.md"))
              if f"docs/{p.name}" != GLOSSARY]  # its terms are on the landing page
    course = Course(root, opening, sections, notebooks, guides)
    _section(course, "Glossary")  # the README's pointer to the glossary must be there
    glossary = root / GLOSSARY
    course.glossary = glossary_items(glossary.read_text(encoding="utf-8")
                                     if glossary.exists() else "")
    if not course.glossary:
        raise SiteError(f"{GLOSSARY} has no '- **term**: definition' items")
    for section in [opening, *sections]:
        page = "index" if _on_landing(section) else "reference"
        for heading in re.findall(r"^#{1,6} (.+)$", _without_code(section.text), re.M):
            course.anchors.setdefault(slug(heading), page)
    return course


# "- **term**: definition", the definition possibly continued on indented lines
GLOSSARY_ITEM = re.compile(r"^- \*\*(?P<term>[^*]+)\*\*:?[ \t]*(?P<definition>.+(?:\n[ \t]+\S.*)*)",
                           re.M)


def glossary_items(text: str) -> dict[str, str]:
    """The README glossary's terms and their definitions (one line each).

    >>> glossary_items("Words.\\n\\n- **rank**: one process\\n  of N.\\n- **bucket**: a buffer\\n")
    {'rank': 'one process of N.', 'bucket': 'a buffer'}
    """
    return {m["term"].strip(): " ".join(m["definition"].split())
            for m in GLOSSARY_ITEM.finditer(text)}


def _on_landing(section: Section) -> bool:
    return section.heading == "" or section.heading.startswith(LANDING)


def _section(course: Course, start: str) -> Section:
    for section in course.sections:
        if section.heading.startswith(start):
            return section
    raise SiteError(f"README.md has no '## {start}...' section: the site needs it "
                    f"(docs/build.py, LANDING)")


def _without_code(text: str) -> str:
    return re.sub(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", "", text, flags=re.M | re.S)


def colab_target(notebook: nbformat.NotebookNode) -> re.Match | None:
    """The Colab badge under the notebook's title (as colab.py writes it), or None.

    >>> nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
    ...     "# 00 Title\\n\\n[![Open In Colab](https://colab.research.google.com/assets/"
    ...     "colab-badge.svg)](https://colab.research.google.com/github/me/course/blob/main/"
    ...     "notebooks/00_x.ipynb)")])
    >>> colab_target(nb)["owner"], colab_target(nb)["name"]
    ('me', 'course')
    """
    cells = notebook.cells
    if not cells or cells[0].cell_type != "markdown":
        return None
    return COLAB_BADGE.search(cells[0].source)


class Linker:
    """Turns notebook mentions and glossary terms in one page's markdown into links."""

    def __init__(self, course: Course, page: str):
        self.course, self.page = course, page  # page: "index", "notebooks/02_x", ...
        self.here = posixpath.dirname(page)
        self.seen: set[str] = set()  # glossary terms already linked on this page
        terms = sorted(course.glossary, key=len, reverse=True)
        alternatives = "|".join(r"\s+".join(map(re.escape, t.split())) for t in terms)
        self.term = re.compile(rf"(?<![\w-])(?P<term>{alternatives})(?:s|es)?(?![\w-])", re.I)
        self.files: set[str] = set()  # repository files that links point to (copied)

    def rel(self, path: str) -> str:
        """``path`` (from the site's root) as a link from this page."""
        return posixpath.relpath(path, self.here or ".")

    def markdown(self, text: str, terms: bool = True) -> str:
        out, start = [], 0
        for match in PROTECTED.finditer(text):
            out.append(self._prose(text[start:match.start()], terms))
            out.append(self._protected(match.group(0)))
            start = match.end()
        out.append(self._prose(text[start:], terms))
        return "".join(out)

    # -- prose: mentions and terms ----------------------------------------------------------

    def _prose(self, text: str, terms: bool) -> str:
        text = NOTEBOOK_MENTION.sub(self._mention, text)
        if not terms or not self.course.glossary:
            return text
        # the mentions just made are links: keep the term links out of them
        parts = re.split(r"(\[[^\]]*\]\([^)]*\))", text)
        return "".join(p if i % 2 else self.term.sub(self._term, p) for i, p in enumerate(parts))

    def _mention(self, match: re.Match) -> str:
        numbers = re.findall(r"\d\d", match["numbers"])
        targets = [self._notebook_page(n) for n in numbers]
        if len(numbers) == 1:
            if targets[0] is None:
                return match.group(0)
            return f"[{match.group(0)}]({targets[0]})"
        linked = re.sub(r"\d\d", lambda m: (f"[{m.group(0)}]({self._notebook_page(m.group(0))})"
                                            if self._notebook_page(m.group(0)) else m.group(0)),
                        match["numbers"])
        return f"{match['word']}{match['sp']}{linked}"

    def _notebook_page(self, number: str) -> str | None:
        path = self.course.notebooks.get(number)
        if path is None or f"notebooks/{path.stem}" == self.page:
            return None  # no such notebook (yet), or this page itself
        return self.rel(f"notebooks/{path.name}")

    def _term(self, match: re.Match) -> str:
        word = " ".join(match["term"].split()).lower()
        term = next(t for t in self.course.glossary if t.lower() == word)
        if term in self.seen:
            return match.group(0)
        self.seen.add(term)
        return f"{{term}}`{' '.join(match.group(0).split())} <{term}>`"

    # -- links --------------------------------------------------------------------------------

    def _protected(self, text: str) -> str:
        if not text.startswith(("[", "![")):
            return text
        return LINK.sub(self._link, text)

    def _link(self, match: re.Match) -> str:
        target = match["target"]
        if target == COLAB_BADGE_SVG:  # the badge's picture, from here rather than Google's
            target = self.rel(LOCAL_BADGE)
        elif not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # relative: a page or a file
            target = self._local(target)
        return f"{match['image']}[{match['text']}]({target}{match['title'] or ''})"

    def _local(self, target: str) -> str:
        path, _, anchor = target.partition("#")
        if not path:  # an anchor of this page: the README's may now be on the other page
            page = self.course.anchors.get(anchor) if self.page in ("index", "reference") else None
            return f"{self.rel(page + '.md')}#{anchor}" if page and page != self.page else target
        in_repo = posixpath.normpath(posixpath.join(self.here, path))
        if in_repo == "README.md":
            page = self.course.anchors.get(anchor, "index") if anchor else "index"
            return self.rel(f"{page}.md") + (f"#{anchor}" if anchor else "")
        if in_repo.startswith("../") or not (self.course.root / in_repo).exists():
            raise SiteError(f"{self.page}: links to {target}, which is not in the repository")
        if not in_repo.endswith(".ipynb") and in_repo not in self.course.guides:
            self.files.add(in_repo)  # images/x.png, snippets/02_x.py: copied as they are
        return target


# -- the pages --------------------------------------------------------------------------------


def landing_page(course: Course) -> tuple[str, set[str]]:
    linker = Linker(course, "index")
    parts = [linker.markdown(course.opening.text)]
    for start in LANDING:
        section = _section(course, start)
        if start == "Glossary":
            parts.append(_glossary(course, section, linker))
        else:
            parts.append(linker.markdown(section.text))
    for caption, pages in course_parts(course):
        parts.append(_toctree(caption, pages))
    parts.append(_toctree("More", ["reference", *(g[:-3] for g in course.guides)]))
    return "\n".join(parts), linker.files


def _glossary(course: Course, section: Section, linker: Linker) -> str:
    """The README's Glossary heading, then the glossary page's words as a Sphinx glossary: each
    term a target of {term} links."""
    page = (course.root / GLOSSARY).read_text(encoding="utf-8")
    intro = GLOSSARY_ITEM.sub("", page.split("\n", 1)[1])  # without its "# Glossary" title
    lines = [section.text.splitlines()[0], *linker.markdown(intro).splitlines()]
    entries = []
    for term, definition in course.glossary.items():
        entries.append(f"{term}\n  {linker.markdown(definition, terms=False)}\n")
    return "\n".join(lines).rstrip() + "\n\n```{glossary}\n" + "\n".join(entries) + "```\n"


def course_parts(course: Course) -> list[tuple[str, list[str]]]:
    """The site's navigation: the course's parts (``notebooks/course.toml``, read by
    ``tools/course.py``, as the README's tables are), each with its notebooks' pages. A notebook
    with no source yet (so in no part) comes last, under "The course"."""
    record = load_tool("course", course.root)
    stems = {number: f"notebooks/{path.stem}" for number, path in course.notebooks.items()}
    parts = [(f"Part {i} — {part.title}", [stems[n] for n in part.notebooks if n in stems])
             for i, part in enumerate(record.read(course.root).parts, 1)]
    placed = {page for _, pages in parts for page in pages}
    rest = [page for page in stems.values() if page not in placed]  # no source yet
    return [(c, p) for c, p in parts if p] + ([("The course", rest)] if rest else [])


def _toctree(caption: str, pages: list[str]) -> str:
    return (f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n" + "\n".join(pages)
            + "\n```\n")


def reference_page(course: Course) -> tuple[str, set[str]]:
    linker = Linker(course, "reference")
    rest = [s.text for s in course.sections if not _on_landing(s)]
    text = ("# Setup and reference\n\nThe rest of the course's README: installing and running "
            "it, the launcher, torchrun, teaching a workshop, and the repository.\n\n"
            + "\n".join(rest))
    return linker.markdown(text), linker.files


def run_locally(course: Course) -> str:
    """The README's quickstart commands (its first fenced block), for the box on each page."""
    section = _section(course, "Quickstart")
    match = re.search(r"^```(?:bash|sh|shell)?\n(.*?)^```", section.text, re.M | re.S)
    if not match:
        raise SiteError("README's Quickstart has no ```bash block of commands: the site's "
                        "'Run this notebook' box shows it")
    return match.group(1)


def notebook_page(course: Course, path: Path, commands: str) -> tuple[nbformat.NotebookNode,
                                                                        set[str], str | None]:
    """The notebook with its markdown linked and a "Run this notebook" box under its title."""
    nb = nbformat.read(path, as_version=4)
    page = f"notebooks/{path.stem}"
    linker = Linker(course, page)
    colab = colab_target(nb)
    if colab:  # the badge moves into the box, where a reader looks for where to run it
        nb.cells[0].source = COLAB_BADGE.sub("", nb.cells[0].source, count=1)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = linker.markdown(cell.source)
    quickstart = linker.rel("reference.md") + "#" + slug(_section(course, "Quickstart").heading)
    clone = (f"`git clone https://github.com/{colab['owner']}/{colab['name']}`" if colab
             else "a clone of the repository")
    box = [f"````{{admonition}} Run this notebook\n:class: tip run-it\n\n**Run locally**, in "
           f"{clone} ([Quickstart]({quickstart})):\n\n```bash\n{commands}```\n\n"
           f"then open `{page}.ipynb` in JupyterLab.\n"]
    if colab:
        box.append(f"\n**Or on Colab**: [![Open In Colab]({linker.rel(LOCAL_BADGE)})]"
                   f"({colab['target']})\n")
    box.append("````")
    cell = nbformat.v4.new_markdown_cell("".join(box), id="run-this-notebook")  # same each build
    cell.metadata["tags"] = ["run-it"]
    nb.cells.insert(1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0, cell)
    repository = f"https://github.com/{colab['owner']}/{colab['name']}" if colab else None
    return nb, linker.files, repository


# -- staging and building ---------------------------------------------------------------------


def stage(root: Path, dest: Path) -> dict:
    """Write the sources Sphinx reads into ``dest``; only files whose content changed (so a
    second build re-reads only those), and remove the ones no longer made."""
    course = read_course(root)
    commands = run_locally(course)
    files: dict[str, bytes] = {}
    linked: set[str] = set()
    index, used = landing_page(course)
    files["index.md"], linked = index.encode(), linked | used
    reference, used = reference_page(course)
    files["reference.md"], linked = reference.encode(), linked | used
    for guide in course.guides:
        linker = Linker(course, guide[:-3])
        files[guide] = linker.markdown((root / guide).read_text(encoding="utf-8")).encode()
        linked |= linker.files
    repositories = set()
    for path in course.notebooks.values():
        nb, used, repository = notebook_page(course, path, commands)
        files[f"notebooks/{path.name}"] = nbformat.writes(nb).encode()
        linked |= used
        repositories.add(repository)
    for image in sorted((root / "images").iterdir()):
        if image.suffix.lower() in IMAGE_SUFFIXES:
            linked.add(f"images/{image.name}")
    for rel in sorted(linked):
        files[rel] = (root / rel).read_bytes()
    # the repository's URL, from the Colab badges: known once every notebook has one
    repository = repositories.pop() if len(repositories) == 1 else None
    context = {"repository_url": repository, "notebooks": len(course.notebooks)}
    files["_context.json"] = json.dumps(context, indent=1).encode()
    files["conf.py"] = (DOCS / "conf.py").read_bytes()
    for asset in sorted((DOCS / "_static").iterdir()):
        files[f"_static/{asset.name}"] = asset.read_bytes()
    _sync(dest, files)
    return context


def _sync(dest: Path, files: dict[str, bytes]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = dest / rel
        if not path.exists() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    for path in sorted(dest.rglob("*"), reverse=True):
        rel = path.relative_to(dest).as_posix()
        if path.is_file() and rel not in files:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def build(work: Path, root: Path = REPO, quiet: bool = True) -> Path:
    """Stage the sources in ``work/src`` and build the site into ``work/html``; returns its
    ``index.html``. (MyST-NB writes the outputs' images to ``work/jupyter_execute``.)

    Sphinx runs unless ``work/html`` was built from exactly these staged sources with these
    tools' versions (``work/built-from.sha256``): a second ``make site``, or the site test right
    after ``make site``, reuses that build. (Sphinx's own incremental build re-reads every
    notebook anyway: the extensions change the configuration it compares.)
    """
    work = work.resolve()
    src, html, stamp = work / "src", work / "html", work / "built-from.sha256"
    stage(root, src)
    fingerprint = _fingerprint(src)
    if (html / "index.html").exists() and stamp.exists() and stamp.read_text() == fingerprint:
        return html / "index.html"
    stamp.unlink(missing_ok=True)
    # -E: a fresh environment, so that every page's navigation shows today's parts (Sphinx's
    # incremental build rewrote only the changed pages, leaving stale sidebars on the others)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-W", "--keep-going", "-n",
           "-d", str(work / "doctrees"), str(src), str(html)]
    if quiet:
        cmd.insert(3, "-q")
    result = subprocess.run(cmd, cwd=src)
    if result.returncode != 0:
        raise SiteError(f"sphinx-build failed (exit {result.returncode}): see its messages above")
    stamp.write_text(fingerprint)
    return html / "index.html"


def _fingerprint(src: Path) -> str:
    """What a build is made from: the staged files, this script and the tools' versions."""
    from importlib.metadata import version

    digest = hashlib.sha256(Path(__file__).read_bytes())
    for tool in ("sphinx", "myst-nb", "sphinx-book-theme", "pydata-sphinx-theme",
                 "sphinx-mathjax-offline"):
        digest.update(f"{tool}=={version(tool)}\n".encode())
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        digest.update(path.relative_to(src).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", nargs="?", type=Path, default=REPO / "build" / "site",
                        help="the build's folder; the site is its html/ (default: build/site)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show Sphinx's progress")
    args = parser.parse_args(argv)
    try:
        import myst_nb  # noqa: F401
        import sphinx_book_theme  # noqa: F401
    except ImportError as error:
        print(f"docs/build.py: {error.name} is missing: pip install -e '.[site]' "
              "(or make site)", file=sys.stderr)
        return 2
    started = time.monotonic()
    stamp = (args.work / "built-from.sha256").resolve()
    before = stamp.stat().st_mtime if stamp.exists() else None
    try:
        index = build(args.work, quiet=not args.verbose)
    except SiteError as error:
        print(f"docs/build.py: {error}", file=sys.stderr)
        return 1
    rebuilt = before is None or stamp.stat().st_mtime != before
    print(f"site {'built' if rebuilt else 'up to date'} in {time.monotonic() - started:.0f} s: "
          f"{index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
