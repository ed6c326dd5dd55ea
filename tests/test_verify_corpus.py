"""verify_gradients on a corpus of real bugs: every buggy program caught with its diagnosis,
every fixed one passed, no false alarm.

``tests/verify_corpus/cNN_*.py``: small programs in the shape of the projects where each bug was
reported (each docstring quotes its issue), each with a ``buggy_step`` and a ``fixed_step``, an
``EXPECT`` (words the diagnosis must contain) and a ``FACTOR`` (the fitted factor, or None for a
bug that is not one). One launch at world_size=2 runs them all, each program loaded from its
file by the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import gradsync_tutorial as gst

CORPUS = sorted((Path(__file__).parent / "verify_corpus").glob("c[0-9][0-9]_*.py"))


def _run_corpus(rank, world_size, paths):
    import importlib.util
    from pathlib import Path

    out = {}
    for path in paths:
        name = Path(path).stem
        spec = importlib.util.spec_from_file_location(f"verify_corpus_{name}", path)
        program = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(program)
        for kind in ("buggy", "fixed"):
            report = getattr(program, f"{kind}_step")(rank, world_size)
            worst = report.worst
            out[f"{name}:{kind}"] = {"ok": report.ok, "diagnosis": worst.diagnosis,
                                     "factor": worst.factor, "rel": worst.rel_error,
                                     "text": str(report)}
        out[f"{name}:expect"] = (program.EXPECT, program.FACTOR)
    return out


@pytest.fixture(scope="module")
def results():
    return gst.launch(_run_corpus, world_size=2, args=([str(p) for p in CORPUS],),
                      backend="gloo", timeout=240)


def test_the_corpus_is_there():
    assert len(CORPUS) >= 12
    for path in CORPUS:
        text = path.read_text()
        assert "Source: " in text and "https://github.com/" in text, path.name
        assert "def buggy_step" in text and "def fixed_step" in text, path.name


def test_every_rank_reports_the_same(results):
    assert results[0] == results[1]


@pytest.mark.parametrize("name", [p.stem for p in CORPUS])
def test_the_bug_is_caught_with_its_diagnosis(results, name):
    expect, factor = results[0][f"{name}:expect"]
    buggy = results[0][f"{name}:buggy"]
    assert not buggy["ok"], buggy["text"]
    assert expect in buggy["diagnosis"], buggy["text"]
    if factor is not None:
        assert buggy["factor"] == pytest.approx(factor, rel=1e-9), buggy["text"]


@pytest.mark.parametrize("name", [p.stem for p in CORPUS])
def test_the_fixed_program_passes(results, name):
    fixed = results[0][f"{name}:fixed"]
    assert fixed["ok"], fixed["text"]
    assert fixed["rel"] < 1e-12, fixed["text"]
