"""Every ``>>>`` example in the package's docstrings runs, and shows what it says it shows.

One test per module, so a failure names the module; the report is doctest's own. The examples
that start ranks really start them (``gst.launch``, 2 or 4 gloo ranks on the CPU); only an
example marked ``# doctest: +SKIP`` on its line is skipped, and its docstring says why.

This runs doctest itself rather than ``pytest --doctest-modules``: that option would also
import the notebooks' jupytext sources (``notebooks/NN_*.py``) as modules, that is, run them.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

import gradsync_tutorial

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
    names = [gradsync_tutorial.__name__]
    for info in pkgutil.walk_packages(gradsync_tutorial.__path__, f"{gradsync_tutorial.__name__}."):
        names.append(info.name)
    return sorted(names)


def _examples(module_name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(module_name)
    return [t for t in doctest.DocTestFinder().find(module, module_name) if t.examples]


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples(module_name):
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    for test in _examples(module_name):
        runner.run(test, out=report.write)
    assert runner.failures == 0, f"{runner.failures} example(s) failed:\n{report.getvalue()}"


def test_the_examples_are_found():
    """A finder that found nothing would pass every test above: count what there is to run."""
    examples = [e for name in _modules() for t in _examples(name) for e in t.examples]
    skipped = [e for e in examples if e.options.get(doctest.SKIP)]
    assert len(examples) >= 100
    assert len(skipped) <= len(examples) // 5, "skip only the examples that cannot run here"
