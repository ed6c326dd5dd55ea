"""Every notebook and section that the README, the package and the docstrings name exists
and agrees, so that renaming, adding or re-timing a notebook cannot leave a reference
behind.

The tests read names and numbers only (file names, "notebook NN", table rows, anchors), never
prose, so editing a notebook's text does not break them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gradsync_tutorial.exercises import EXERCISES
from gradsync_tutorial.notebooks import MENTION, mentioned

from .conftest import NOTEBOOKS as NOTEBOOK_PATHS
from .conftest import REPO

NOTEBOOKS = [p.name for p in NOTEBOOK_PATHS]
NUMBERS = {name[:2] for name in NOTEBOOKS}
README = (REPO / "README.md").read_text()
#: Where the course refers to its notebooks: the README, the package, the scripts, the tools,
#: the benchmarks.
REFERRING = [REPO / "README.md", *sorted((REPO / "gradsync_tutorial").rglob("*.py")),
             *(path for folder in ("scripts", "tools", "benchmarks")
               for path in sorted((REPO / folder).glob("*.py")))]

# notebooks/02_manual_allreduce_averaging.ipynb (a path, in prose, a link or a docstring)
NOTEBOOK_PATH = re.compile(r"notebooks/(\d\d_[A-Za-z0-9_]+)\.ipynb")
# | [02 Manual ...](notebooks/02_manual_allreduce_averaging.ipynb) | question | 2 min 10 s |
TABLE_ROW = re.compile(r"^\| \[(\d\d) [^]]*\]\(notebooks/(\d\d_\w+\.ipynb)\) \|.*\| ([^|]+) \|$",
                       re.M)
# Names that stand for "any notebook" in the docs of the tools that build them.
PLACEHOLDERS = {"02_x", "NN_x"}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 7 and NOTEBOOKS[0].startswith("00_")


@pytest.mark.parametrize("path", REFERRING, ids=lambda p: str(p.relative_to(REPO)))
def test_every_notebook_path_named_exists(path):
    named = {m for m in NOTEBOOK_PATH.findall(_text(path)) if m not in PLACEHOLDERS}
    missing = sorted(f"{m}.ipynb" for m in named if f"{m}.ipynb" not in NOTEBOOKS)
    assert not missing, f"{path.name} names notebooks that do not exist: {missing}"


@pytest.mark.parametrize("path", REFERRING, ids=lambda p: str(p.relative_to(REPO)))
def test_every_notebook_number_named_exists(path):
    named = set(mentioned(_text(path)))  # the site's links read the same grammar
    assert named <= NUMBERS, f"{path.name} names notebooks {sorted(named - NUMBERS)}: none exist"


#: Public modules that name no notebook, and why.
NOT_TAUGHT = {
    "doctor.py": "run once before the course (make doctor), and says so",
}


def test_every_public_module_says_where_it_is_introduced():
    """d2l's rule: each helper points back to the notebook that teaches it (a folder: its
    __init__.py)."""
    package = REPO / "gradsync_tutorial"
    for path in sorted([*package.glob("[a-z]*.py"), *package.glob("[a-z]*/__init__.py")]):
        if path.name in NOT_TAUGHT:
            continue
        text = _text(path)
        assert NOTEBOOK_PATH.search(text) or MENTION.search(text), (
            f"{path.relative_to(package)} names no notebook: say which one introduces it")


def test_the_readme_notebook_table_lists_every_notebook_once_in_course_order():
    """(Its run times are the recorded run's: tests/test_time_table.py.)"""
    rows = TABLE_ROW.findall(README)
    assert [file for _, file, _ in rows] == NOTEBOOKS, "one row per notebook, in course order"
    for number, file, _ in rows:
        assert file.startswith(number), f"the row titled {number} links to {file}"


def test_every_exercise_names_an_existing_notebook():
    for exercise in EXERCISES.values():
        assert exercise.notebook in NOTEBOOKS, exercise


# gst.exercises.check_gather_ranks(gather_ranks): a notebook's exercise cell
EXERCISE_CALL = re.compile(r"^gst\.exercises\.(check_\w+)\(", re.M)


def test_the_exercises_are_found_in_the_notebooks_and_each_calls_its_own_check():
    """Found, not listed: each notebook's "## Exercise" calls a check registered for that
    notebook, and every registered exercise is called by its notebook."""
    called = {}
    for name in NOTEBOOKS:
        source = _text(REPO / "notebooks" / name.replace(".ipynb", ".py"))
        checks = EXERCISE_CALL.findall(source)
        if re.search(r"^# ## Exercise", source, re.M):
            assert checks, f"{name} has an Exercise section that calls no gst.exercises.check_"
        for check in checks:
            called.setdefault(check, name)
    registered = {e.check.__name__: e.notebook for e in EXERCISES.values()}
    assert called == registered, (
        "each check is called first in the notebook it is registered for (@exercise(notebook, "
        f"...)): called {called}, registered {registered}")


def test_every_readme_link_to_a_file_or_section_resolves():
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", README, re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (REPO / path).exists(), f"README links to {path}, which does not exist"
        elif anchor:
            assert anchor in anchors, f"README links to #{anchor}: no such heading"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


# A traceback quoted in the docs:   File "scripts/train_ddp.py", line 307, in main
#                                     train(args)
QUOTED_FRAME = re.compile(r'^\s*File "((?:scripts|gradsync_tutorial)/[\w/]+\.py)", line (\d+), '
                          r"in (\w+)\n\s*(\S.*)$", re.M)
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def _enclosing_function(source: str, line: int) -> str | None:
    """The name of the innermost def around ``line`` (1-based), None at module level."""
    found = None
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.lineno <= line <= node.end_lineno
                and (found is None or node.lineno > found.lineno)):
            found = node
    return found.name if found else None


def test_the_docs_quote_tracebacks_at_the_lines_the_code_has_now():
    """Moving code in a script must not leave a quoted traceback pointing at another line."""
    frames = [(doc, *m.groups()) for doc in DOCS for m in QUOTED_FRAME.finditer(_text(doc))]
    assert frames, "docs/cluster.md quotes torchrun's summary of scripts/fail_rank.py"
    for doc, path, line, function, code in frames:
        source = _text(REPO / path)
        where = f'{doc.name} quotes File "{path}", line {line}, in {function}'
        assert source.splitlines()[int(line) - 1].strip() == code.strip(), (
            f"{where}: {code.strip()!r} is not that line now")
        assert _enclosing_function(source, int(line)) == function, f"{where}: not in {function}"


# "The check runs it on 2 ranks, then on 3": a size typed next to a check drifts from the sizes
# the check draws (3 to 5). The check prints its own sizes; the words around it do not say 3.
SIZE_IN_PROSE = re.compile(r"\bthen (?:on )?3\b(?! to)|\band (?:on )?3 ranks\b|\b3 ranks with \d")


@pytest.mark.parametrize("path", NOTEBOOK_PATHS, ids=lambda p: p.name[:2])
def test_an_exercise_section_states_no_world_size_of_its_check(path):
    source = path.with_suffix(".py").read_text(encoding="utf-8")
    if "## Exercise" not in source:
        return
    section = source.split("## Exercise", 1)[1].split("gst.exercises.check_", 1)[0]
    prose = "\n".join(line for line in section.splitlines() if line.startswith("#"))
    assert not SIZE_IN_PROSE.search(prose), (
        f"{path.name}'s exercise text states a size its check may not run at: "
        f"{SIZE_IN_PROSE.search(prose).group(0)!r}: the second size is drawn from 3 to 5; say "
        "'at two world sizes' (the check prints which)")


def test_every_glossary_term_is_defined_once():
    """The site keeps one definition per term: a second one would silently replace the first."""
    glossary = (REPO / "docs" / "glossary.md").read_text(encoding="utf-8")
    terms = re.findall(r"^- \*\*([^*]+)\*\*:", glossary, re.M)
    assert len(terms) > 30, "docs/glossary.md lost its entries"
    twice = sorted({t for t in terms if terms.count(t) > 1})
    assert not twice, f"docs/glossary.md defines {twice} more than once: keep one entry"


def test_the_glossary_is_in_the_order_the_notebooks_need_its_terms():
    """Each entry names the notebook that teaches it; read top to bottom, those never go back, so
    no term is defined after one that a later notebook needs (entries that name none, the first
    words of notebook 00, come first)."""
    glossary = (REPO / "docs" / "glossary.md").read_text(encoding="utf-8")
    entries = re.findall(r"^- \*\*([^*]+)\*\*:?(.*)$", glossary, re.M)
    taught = [(term, min(mentioned(text), default="00")) for term, text in entries]
    back = [f"{term} (notebook {n}) after {before} (notebook {m})"
            for (before, m), (term, n) in zip(taught, taught[1:], strict=False) if n < m]
    assert not back, f"docs/glossary.md goes back: {back}; move each entry up"


def _quoted_rule(text: str, prefix: str = "") -> str | None:
    """The blockquote that opens with "**The rule.**" in ``text`` (lines ``prefix> ...``),
    whitespace folded; None if there is none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith(f"{prefix}> **The rule.**")), None)
    if start is None:
        return None
    quote = []
    for line in lines[start:]:
        if not line.startswith(f"{prefix}>"):
            break
        quote.append(line[len(prefix) + 1:])
    return " ".join(" ".join(quote).split())


def test_the_rule_is_said_once_in_the_readmes_words_wherever_a_notebook_states_it():
    """The README states the rule in both of its forms; a notebook that states it quotes those
    words, so that no notebook drifts into a form of its own (10's once left out context
    parallel). The notebooks that teach a form of it (07, 10, 11, 12, 14) all state it."""
    rule = _quoted_rule(README)
    assert rule and "Sum form" in rule and "Mean form" in rule and "context-parallel" in rule
    stating = {}
    for path in NOTEBOOK_PATHS:
        quoted = _quoted_rule(path.with_suffix(".py").read_text(encoding="utf-8"), "# ")
        if quoted is not None:
            stating[path.name[:2]] = quoted
    drifted = sorted(n for n, quoted in stating.items() if quoted != rule)
    assert not drifted, f"notebooks {drifted} state the rule in other words than the README's"
    assert {"07", "10", "11", "12", "14"} <= set(stating), sorted(stating)
