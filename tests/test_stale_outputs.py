"""The committed notebooks show the package's messages as the package words them *now*.

A notebook's outputs are written when it is executed; the package's messages (a launch that
timed out, a failed rank, an exercise check, a detector) change more often. This test fails
when an output shows a package message in a wording the package no longer produces, so that
changing a message and forgetting to re-execute the notebooks that show it is caught by
``pytest tests/``, in a second, without executing anything.

How, cheaply and exactly: the package's source is read, not run. Every string it builds, a
literal or an f-string, becomes a *template*: its literal parts in order, with a hole for
each ``{value}``. A hole is resolved where the source says what it holds: a module constant
(``HANG_HINT``) becomes its text, a local variable assigned a string expression in the same
function (``report = f"..." if where else ""``) becomes each of its alternatives. Then, for
every output cell: whenever it contains a long literal part of the package (a phrase of at
least :data:`PHRASE` characters), one of the templates that contain that phrase must match the
output whole, its literal parts in order, its holes taking anything (ranks, seconds, ports,
a traceback). The variable parts never matter; a changed, added or removed fixed part does,
and so does a message cut in the middle ("The usual cause is a coll ..."): show package
messages whole.

What it cannot see: a message rewritten so completely that none of its phrases is left (the
old output then contains no phrase of the package at all), and wording produced by helpers
through short literals only. Fix a failure by re-executing the notebook:
``make notebooks NB=NN``.
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from functools import cache

import nbformat
import pytest

from .conftest import NOTEBOOKS, REPO

PACKAGE = REPO / "gradsync_tutorial"
PHRASE = 20  # characters: shorter literals ("rank ", " raised ") identify no message
MAX_ALTERNATIVES = 64  # per template, from the alternatives of the variables it contains
HOLE = None
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RANK_PREFIX = re.compile(r"^\[rank \d+\] ", re.M)  # how gst.launch tags each rank's lines


@dataclass(frozen=True)
class Template:
    """A string the package builds: literal parts and holes (``None``), and where it is."""

    parts: tuple[str | None, ...]
    where: str  # "launch_errors.py:147", for the failure message

    def phrases(self) -> list[str]:
        return [p for p in self.parts if p is not None and _is_phrase(p)]

    def text(self) -> str:
        return "".join("{…}" if p is None else p for p in self.parts)


def _is_phrase(literal: str) -> bool:
    return len(literal.strip()) >= PHRASE and literal.count(" ") >= 2


def _normalized(parts) -> tuple:
    """Adjacent literals merged, runs of holes collapsed, empty literals dropped."""
    out: list = []
    for part in parts:
        if part == "":
            continue
        if out and part is not None and out[-1] is not None:
            out[-1] += part
        elif not (out and part is None and out[-1] is None):
            out.append(part)
    return tuple(out)


def matches(template: tuple, text: str) -> bool:
    """Whether ``text`` contains the template: its literals in order, holes taking anything.

    Leftmost-first search is enough: a hole takes any text, so the earliest place for each
    literal after the previous one never rules out a match that a later place would allow.

    >>> matches(("timed out after ", None, " s.\\nWhere", None), "x timed out after 5 s.\\nWhere a")
    True
    >>> matches(("timed out after ", None, " s.\\nWhere", None), "timed out after 5 s. Where a")
    False
    """
    literals = [p for p in template if p is not None]
    if not literals:
        return True
    start = text.find(literals[0])
    while start != -1:
        at = start + len(literals[0])
        for literal in literals[1:]:
            at = text.find(literal, at)
            if at == -1:
                return False  # a later start of the first literal cannot find it either
            at += len(literal)
        return True
    return False


class _Templates(ast.NodeVisitor):
    """Every string expression of one module, as templates (see the module's docstring)."""

    def __init__(self, module: ast.Module, where: str, constants: dict[str, list[tuple]]):
        self.where, self.constants = where, constants
        self.found: list[Template] = []
        self.local: dict[str, list[tuple]] = {}
        self.docstrings = {id(node.body[0].value) for node in ast.walk(module)
                           if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                ast.AsyncFunctionDef))
                           and node.body and isinstance(node.body[0], ast.Expr)
                           and isinstance(node.body[0].value, ast.Constant)}
        self.inner: set[int] = set()

    def visit_FunctionDef(self, node):  # locals: the string assignments of this function
        outer, self.local = self.local, {}
        for child in ast.walk(node):
            if (isinstance(child, ast.Assign) and len(child.targets) == 1
                    and isinstance(child.targets[0], ast.Name) and _stringy(child.value)):
                alternatives = self.local.setdefault(child.targets[0].id, [])
                alternatives += self.alternatives(child.value)
        self.generic_visit(node)
        self.local = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_JoinedStr(self, node):
        self.record(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and id(node) not in self.docstrings:
            self.record(node)

    def record(self, node):
        if id(node) in self.inner:
            return
        for sub in ast.walk(node):
            self.inner.add(id(sub))
        for parts in self.alternatives(node):
            self.found.append(Template(parts, f"{self.where}:{node.lineno}"))

    def alternatives(self, node) -> list[tuple]:
        """The templates an expression can produce (holes where the source does not say)."""
        if isinstance(node, ast.Constant):
            return [(node.value,)] if isinstance(node.value, str) else [(HOLE,)]
        if isinstance(node, ast.JoinedStr):
            pieces = [self.alternatives(v.value) if isinstance(v, ast.FormattedValue)
                      else self.alternatives(v) for v in node.values]
            return self.product(pieces)
        if isinstance(node, ast.IfExp):
            return (self.alternatives(node.body) + self.alternatives(node.orelse))[
                :MAX_ALTERNATIVES]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.product([self.alternatives(node.left), self.alternatives(node.right)])
        if isinstance(node, ast.Name):
            if node.id in self.local:
                return self.local[node.id]
            if node.id in self.constants:
                return self.constants[node.id]
        return [(HOLE,)]

    @staticmethod
    def product(pieces: list[list[tuple]]) -> list[tuple]:
        combos = itertools.islice(itertools.product(*pieces), MAX_ALTERNATIVES)
        return [_normalized(p for piece in combo for p in piece) for combo in combos]


def _stringy(node) -> bool:
    return (isinstance(node, (ast.JoinedStr, ast.IfExp))
            or (isinstance(node, ast.Constant) and isinstance(node.value, str))
            or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)))


@cache
def package_templates() -> tuple[Template, ...]:
    """Every template of the package, with module-level string constants resolved."""
    modules = {path: ast.parse(path.read_text(encoding="utf-8"))
               for path in sorted(PACKAGE.rglob("*.py"))}
    constants: dict[str, list[tuple]] = {}
    for tree in modules.values():  # HANG_HINT = ("..." "..."): by name, package-wide
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                            str)):
                constants[node.targets[0].id] = [(node.value.value,)]
    found = []
    for path, tree in modules.items():
        visitor = _Templates(tree, str(path.relative_to(PACKAGE)), constants)
        visitor.visit(tree)
        found += [t for t in visitor.found if t.phrases()]
    return tuple(found)


@cache
def by_phrase() -> dict[str, list[Template]]:
    """Each phrase of the package -> the templates whose literal parts contain it (its own,
    and those that quote it inside a longer literal)."""
    templates = package_templates()
    phrases = {phrase for t in templates for phrase in t.phrases()}
    return {phrase: [t for t in templates
                     if any(p is not None and phrase in p for p in t.parts)]
            for phrase in phrases}


def output_text(cell) -> str:
    """What a reader sees of a cell's outputs, as one text: ANSI colours and gst.launch's
    ``[rank N]`` tags removed (a message a rank printed is the package's text again)."""
    texts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            texts.append(output.text)
        elif output.output_type == "error":
            texts.append(output.evalue)
        elif not _shows_code(output):  # shown source: test_shown_source_is_todays
            texts += [str(v) for k, v in output.get("data", {}).items()
                      if k.startswith("text/") and k != "text/html"]
    return RANK_PREFIX.sub("", ANSI.sub("", "\n".join(texts)))


def _shows_code(output) -> bool:
    """Notebook 05's ``show(fn)``: the source as a Markdown code block (or, before, an
    ``IPython.display.Code``)."""
    data = output.get("data", {})
    return (str(data.get("text/markdown", "")).startswith("```python")
            or 'class="highlight' in str(data.get("text/html", "")))


def stale_messages(text: str) -> list[str]:
    """For each package phrase in ``text`` that no current template containing it matches,
    a line saying which, and what the package says now."""
    problems = []
    for phrase, templates in by_phrase().items():
        if phrase not in text:
            continue
        if not any(matches(t.parts, text) for t in templates):
            now = templates[0]
            problems.append(f"{phrase.strip()!r} is part of a message that the package now "
                            f"words as {now.text()!r} ({now.where})")
    return problems


def test_the_templates_are_read_from_the_package():
    texts = [t.text() for t in package_templates()]
    hang = [t for t in texts if t.startswith("launch timed out after")]
    assert hang, "the launcher's timeout message should be a template"
    # `where`, a local variable, is resolved: the report of where each rank was, or else
    # HANG_HINT, a module constant of another module (the report gives its own advice)
    assert any("Where each rank was:" in t and "The usual cause" not in t for t in hang)
    assert any("Where each rank was:" not in t and "The usual cause" in t for t in hang)


def test_a_message_cut_or_in_an_old_wording_is_stale_and_the_current_one_is_not():
    # The launcher's hint after a hang (HANG_HINT), wherever the launcher's modules live:
    [HANG_HINT] = {t.text() for t in package_templates() if t.text().startswith("The usual cause")}
    cut = ("launch timed out after 5 s: rank 0 had not finished (rank 1 returned). All ranks "
           "were stopped.\nWhere each ra ...")
    old = ("launch timed out after 5 s: rank 0 had not finished (rank 1 returned). All ranks "
           f"were stopped. {HANG_HINT}")  # before the report of where each rank was
    now = ("launch timed out after 5 s: rank 0 had not finished (rank 1 returned). All ranks "
           "were stopped.\nWhere each rank was:\n  rank 0 is waiting in all_reduce\n"
           f"  {HANG_HINT}")  # the report ends with the advice that fits it
    assert stale_messages(cut) and stale_messages(old)
    assert stale_messages(now) == []
    assert stale_messages("a line of the notebook's own") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_show_the_package_messages_of_today(path):
    notebook = nbformat.read(path, as_version=4)
    found = [f"cell {number}: {problem}"
             for number, cell in enumerate(notebook.cells, start=1) if cell.cell_type == "code"
             for problem in stale_messages(output_text(cell))]
    assert not found, (
        f"{path.name} shows package messages in a wording the package no longer produces, or "
        f"cut short; re-execute it (make notebooks NB={path.name[:2]}), and print package "
        "messages whole:\n" + "\n".join(found))



# show(gst.averaging.FlatAverager)  or  print(inspect.getsource(train_ddp.main))
SHOWN = re.compile(r"^(?:show\((gst\.[\w.]+)\)|print\(inspect\.getsource\((train_ddp\.\w+)\)\))$",
                   re.M)
SHOWN_FROM = {"gst": PACKAGE, "train_ddp": REPO / "scripts" / "train_ddp.py"}


def current_source(dotted: str) -> str:
    """``inspect.getsource`` of a course function or class, read from its file (no import):
    ``gst.averaging.Bucket`` -> the lines of ``class Bucket`` in gradsync_tutorial/averaging.py.
    """
    root, *modules, name = dotted.split(".")
    path = SHOWN_FROM[root]
    if path.is_dir():
        path = path.joinpath(*modules)
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    lines = path.read_text(encoding="utf-8").splitlines()
    for node in ast.parse("\n".join(lines)).body:
        if getattr(node, "name", None) == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return "\n".join(lines[first - 1 : node.end_lineno]) + "\n"
    raise LookupError(f"{dotted}: no such definition in {path}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_shown_source_is_todays(path):
    """A cell that shows the course's own code (notebook 05's ``show(gst.averaging.X)``,
    notebook 06's ``inspect.getsource(train_ddp.f)``) shows the code as it is now."""
    stale = []
    for number, cell in enumerate(nbformat.read(path, as_version=4).cells, start=1):
        shown = [a or b for a, b in SHOWN.findall(cell.source)] if cell.cell_type == "code" else []
        if not shown:
            continue
        text = "".join(o.get("text", "") or o.get("data", {}).get("text/markdown", "")
                       or o.get("data", {}).get("text/plain", "") for o in cell.outputs)
        stale += [f"cell {number}: {name}" for name in shown
                  if current_source(name).strip() not in text]
    assert not stale, (f"{path.name} shows code that has changed since it was executed: "
                       f"{stale}; re-execute it (make notebooks NB={path.name[:2]})")
