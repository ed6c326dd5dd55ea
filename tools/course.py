"""The course's table of contents, read from ``notebooks/course.toml``, and the README's tables
written from it: one reader and one writer for every fact the README's tables state.

    python tools/course.py            # write README.md's tables (as time_table.py --write does)
    python tools/course.py --check    # exit 1 if README.md's tables are not the record's

What each table is made of, and where each fact lives:

* **the notebooks** (``<!-- notebooks -->``): a row per notebook, in course order, under its part.
  The title and question come from the notebook's first cell (``short`` in the record where the
  table uses fewer words), the Colab badge from that cell too (``tools/colab.py`` puts it there),
  the run time from ``gradsync_tutorial/reference_times.json`` (``make times``).
* **the parts** (``<!-- parts -->``): each part's notebooks and their total run time. A part runs
  from its ``first`` notebook to the next part's, so a notebook is in exactly one part.
* **the agendas** (``<!-- agendas -->``): each agenda's notebooks and their total run time.
* **the claims** (``<!-- claims -->``): the short answer's figures, a row each, with its notebook.

Each table sits between ``<!-- NAME: ... -->`` and ``<!-- /NAME -->`` in the README; the text
around the tables is the README's own. :func:`problems` says what the tests refuse: a notebook
in no agenda, with no claim, a part or agenda that names a notebook there is not.

    >>> course = read()
    >>> course.parts[0].title, course.parts[0].notebooks[:2]
    ('The answer', ['00', '01'])
    >>> words(["00", "01", "02", "03"]), words(["14", "15"]), words(["07"])
    ('notebooks 00 to 03', 'notebooks 14 and 15', 'notebook 07')
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gradsync_tutorial._wording import duration
from gradsync_tutorial.notebooks import mentioned, paths

REPO = Path(__file__).resolve().parent.parent
RECORD = Path("notebooks") / "course.toml"
TIMES = Path("gradsync_tutorial") / "reference_times.json"
BADGE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")
BLOCK = re.compile(r"^<!-- (?P<name>[a-z]+):[^\n]*-->\n(?P<body>.*?)^<!-- /(?P=name) -->$",
                   re.M | re.S)
WRITTEN_BY = "written from notebooks/course.toml by tools/course.py, edit that file"


@dataclass
class Notebook:
    number: str
    name: str  # the file name, 02_manual_allreduce_averaging.ipynb
    title: str
    question: str
    badge: str | None = None  # the Colab badge of its first cell, if it has one


@dataclass
class Part:
    title: str
    who: str
    notebooks: list[str]


@dataclass
class Agenda:
    name: str
    notebooks: list[str]
    words: str  # "notebooks 00 to 03, 07, 14 and 15", as the record says it


@dataclass
class Claim:
    notebook: str
    claim: str
    measured: str


@dataclass
class Course:
    notebooks: dict[str, Notebook]
    parts: list[Part]
    agendas: list[Agenda]
    claims: list[Claim]
    no_claims: list[str] = field(default_factory=list)


class RecordError(ValueError):
    """``notebooks/course.toml`` says something the course's files contradict."""


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise SystemExit("tools/course.py reads TOML with tomllib: run it with Python 3.11 or "
                         "newer (the course itself runs on 3.10)") from None
    with path.open("rb") as f:
        return tomllib.load(f)


def first_cell(source: Path) -> str:
    """A notebook source's first cell (its markdown title cell), without the ``# `` prefixes."""
    cells = re.split(r"^# %%.*$", source.read_text(encoding="utf-8"), flags=re.M)
    first = next((c for c in cells if c.strip() and not c.lstrip().startswith("# ---")), "")
    return re.sub(r"^# ?", "", first, flags=re.M)


def _notebook(source: Path, short: dict) -> Notebook:
    cell = first_cell(source)
    heading = re.search(r"^#\s*(\d\d)\s*[—-]+\s*(.+)$", cell, re.M)
    question = re.search(r"\*\*Question:\s*(.+?)\*\*", cell, re.S)
    number = source.name[:2]
    title = heading.group(2).strip() if heading else source.stem[3:]
    asks = " ".join(question.group(1).split()) if question else ""
    asks = asks[:1].upper() + asks[1:]
    badge = BADGE.search(cell)
    mine = short.get(number, {})
    return Notebook(number, source.with_suffix(".ipynb").name, mine.get("title", title),
                    mine.get("question", asks), badge.group(0) if badge else None)


def read(root: Path = REPO) -> Course:
    """The record and the notebooks' first cells, checked against the notebooks there are."""
    data = _load_toml(root / RECORD)
    short = data.get("short", {})
    notebooks = {s.name[:2]: _notebook(s, short) for s in paths("source", root)}
    numbers = list(notebooks)

    def known(what: str, listed: list[str]) -> list[str]:
        unknown = [n for n in listed if n not in notebooks]
        if unknown:
            raise RecordError(f"{RECORD}: {what} names notebooks {unknown}, which do not exist "
                              f"(the notebooks are {numbers[0]} to {numbers[-1]})")
        return listed

    firsts = [known("a part", [p["first"]])[0] for p in data["parts"]]
    if firsts != sorted(set(firsts)) or (numbers and firsts[0] != numbers[0]):
        raise RecordError(f"{RECORD}: the parts' first notebooks {firsts} must rise, from "
                          f"notebook {numbers[0]}: a part runs to the next part's first")
    ends = [numbers.index(f) for f in firsts[1:]] + [len(numbers)]
    parts = [Part(p["title"], p["who"], numbers[numbers.index(p["first"]):end])
             for p, end in zip(data["parts"], ends, strict=True)]
    agendas = [Agenda(a["name"], known(f"agenda {a['name']!r}",
                                       mentioned(f"notebooks {a['notebooks']}")),
                      f"notebooks {a['notebooks']}") for a in data["agendas"]]
    claims = [Claim(c["notebook"], c["claim"], c["measured"]) for c in data["claims"]]
    known("a claim", [c.notebook for c in claims])
    known("short", list(short))
    return Course(notebooks, parts, agendas, claims,
                  known("no_claims", data.get("no_claims", [])))


def problems(course: Course) -> list[str]:
    """What a new notebook must not lack: an agenda, and a claim (or a place in ``no_claims``)."""
    found = []
    in_agendas = {n for a in course.agendas for n in a.notebooks}
    claimed = {c.notebook for c in course.claims} | set(course.no_claims)
    for number in course.notebooks:
        if number not in in_agendas:
            found.append(f"notebook {number} is in no workshop agenda ({RECORD}: agendas)")
        if number not in claimed:
            found.append(f"notebook {number} has no claim in the short answer's table "
                         f"({RECORD}: claims; or no_claims, saying why)")
    if not any(p.notebooks for p in course.parts):
        found.append(f"{RECORD}: no part holds a notebook")
    return found


def words(numbers: list[str]) -> str:
    """A run of notebooks as the README says it (and :func:`mentioned` reads it back)."""
    if len(numbers) == 1:
        return f"notebook {numbers[0]}"
    if len(numbers) == 2:
        return f"notebooks {numbers[0]} and {numbers[1]}"
    return f"notebooks {numbers[0]} to {numbers[-1]}"


def _total(numbers: list[str], course: Course, times: dict) -> str:
    seconds = times["notebooks"]
    missing = [n for n in numbers if course.notebooks[n].name not in seconds]
    if missing:
        raise RecordError(f"{TIMES} does not time notebooks {missing}: make times NB={missing[0]}")
    return duration(round(sum(seconds[course.notebooks[n].name] for n in numbers)))


def tables(course: Course, times: dict, under_notebooks: str = "") -> dict[str, str]:
    """Each README table's markdown, by the name of its block."""
    rows = ["| notebook | the question it answers | full run, 2-core CPU |", "|---|---|---|"]
    for i, part in enumerate(course.parts, 1):
        rows.append(f"| **Part {i} — {part.title}** | | |")
        for n in part.notebooks:
            nb = course.notebooks[n]
            badge = f" {nb.badge}" if nb.badge else ""
            rows.append(f"| [{n} {nb.title}](notebooks/{nb.name}){badge} | {nb.question} | "
                        f"{_total([n], course, times)} |")
    notebooks = "\n".join(rows) + (f"\n\n{under_notebooks}" if under_notebooks else "")
    parts = ["| part | notebooks | who needs it | run time |", "|---|---|---|---|"]
    parts += [f"| Part {i} — {p.title} | {words(p.notebooks)} | {p.who} | "
              f"{_total(p.notebooks, course, times)} |"
              for i, p in enumerate(course.parts, 1) if p.notebooks]
    agendas = ["| agenda | notebooks | their run time |", "|---|---|---|"]
    agendas += [f"| {a.name} | {a.words} | {_total(a.notebooks, course, times)} |"
                for a in course.agendas]
    claims = ["| claim | measured | notebook |", "|---|---|---|"]
    claims += [f"| {c.claim} | {c.measured} | "
               f"[{c.notebook}](notebooks/{course.notebooks[c.notebook].name}) |"
               for c in course.claims]
    return {"notebooks": notebooks, "parts": "\n".join(parts), "agendas": "\n".join(agendas),
            "claims": "\n".join(claims)}


def render(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each ``<!-- NAME: ... -->`` block's body replaced by ``blocks[NAME]``.

    >>> render("a\\n<!-- parts: x -->\\nold\\n<!-- /parts -->\\nb", {"parts": "new"})[-25:]
    '-->\\nnew\\n<!-- /parts -->\\nb'
    """
    found = {m["name"] for m in BLOCK.finditer(text)}
    missing = sorted(set(blocks) - found)
    if missing:
        raise RecordError(f"README.md has no block for {missing}: put its table between "
                          f"'<!-- NAME: {WRITTEN_BY} -->' and '<!-- /NAME -->'")
    return BLOCK.sub(lambda m: (f"<!-- {m['name']}: {WRITTEN_BY} -->\n{blocks[m['name']]}\n"
                                f"<!-- /{m['name']} -->") if m["name"] in blocks else m[0], text)


def run_line(times: dict) -> str:
    """The line under the notebook table: which run the times come from, and its load."""
    m = times["machine"]
    load = ("" if m["load_before"] is None else
            f", load average {m['load_before']:g} before and {m['load_after']:g} after")
    alone = "".join(
        f" Notebook {name[:2]} was timed alone by `make times NB={name[:2]}` ({t['measured']}"
        + ("" if t["load_before"] is None else f", load average {t['load_before']:g} before")
        + ")." for name, t in sorted(times.get("timed alone", {}).items()))
    return (f"Measured in one run by `make times` ({times['measured']}, {m['cores']} cores, "
            f"{m['gpus']} GPUs{load}).{alone}")


def readme(root: Path = REPO, times: dict | None = None) -> str:
    """README.md as the record and the timed run (default: the recorded one) say it should read."""
    if times is None:
        times = json.loads((root / TIMES).read_text(encoding="utf-8"))
    text = (root / "README.md").read_text(encoding="utf-8")
    return render(text, tables(read(root), times, run_line(times)))


def main(argv: list[str] | None = None, root: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md differs")
    args = parser.parse_args(argv)
    try:
        text = readme(root)
    except RecordError as error:
        print(error, file=sys.stderr)
        return 2
    if args.check:
        if (root / "README.md").read_text(encoding="utf-8") != text:
            print(f"README.md's tables are not {RECORD}'s: python tools/course.py")
            return 1
        return 0
    (root / "README.md").write_text(text, encoding="utf-8")
    print(f"README.md: tables written from {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
