"""gst.notebooks: reading, diffing and re-running a notebook's function (notebooks 02 and 03)."""

import json

import pytest

from gradsync_tutorial import notebooks


@pytest.fixture
def course(tmp_path, monkeypatch):
    """Two tiny notebooks, 01 and 02, in a folder of their own."""
    def write(name, *cells):
        nb = {"cells": [{"cell_type": "code", "source": c, "metadata": {}} for c in cells]}
        (tmp_path / f"{name}.ipynb").write_text(json.dumps(nb))
    write("01_a", "SCALE = 2\n", "%matplotlib inline\n",
          "def helper(x):\n    return x + 1\n\n\ndef train(x):\n    return helper(x) * SCALE\n")
    write("02_b", "SCALE = 3\n", "@staticmethod\ndef train(x):\n    return x\n")
    monkeypatch.setattr(notebooks, "_notebooks_dir", lambda: tmp_path)
    return tmp_path


def test_function_source_takes_one_function_from_its_cell(course):
    assert notebooks.function_source("01_a", "train") == (
        "def train(x):\n    return helper(x) * SCALE\n")
    assert notebooks.function_source("02_b.ipynb", "train").startswith("@staticmethod\n")


def test_load_function_runs_with_the_notebooks_own_settings(course):
    train = notebooks.load_function("01_a", "train", requires=["helper"])
    assert train(1) == 4  # (1 + 1) * SCALE, with 01's SCALE = 2
    assert notebooks.count_changes(train, notebooks.function_source("01_a", "train")) == 0
    with pytest.raises(NameError):
        notebooks.load_function("01_a", "train")(1)  # helper was not asked for


def test_load_function_can_replace_a_setting(course):
    train = notebooks.load_function("01_a", "train", requires=["helper"], settings={"SCALE": 5})
    assert train(1) == 10  # (1 + 1) * 5
    with pytest.raises(KeyError, match="sets no SCLAE"):
        notebooks.load_function("01_a", "train", settings={"SCLAE": 5})


def test_count_and_show_changes(capsys):
    old = "a = 1\nb = 2\nc = 3\nd = 4\n"
    new = "a = 1\nb = 20\nc = 3\nd = 4\ne = 5\n"
    assert notebooks.count_changes(old, old) == 0
    assert notebooks.count_changes(old, new) == 2  # b changed; e added elsewhere
    assert notebooks.show_diff(old, new, names=("x", "y")) == 2
    out = capsys.readouterr().out
    assert "-b = 2\n+b = 20\n" in out and "+e = 5" in out and "changed places: 2" in out


def test_errors_say_what_is_missing(course):
    with pytest.raises(FileNotFoundError, match="no notebook 09_x.ipynb"):
        notebooks.function_source("09_x", "train")
    with pytest.raises(LookupError, match="defines no function 'nope'"):
        notebooks.function_source("01_a", "nope")


def test_the_course_notebooks_keep_one_train_each():
    """Notebooks 02 and 03 diff their train against the previous notebook's: it must exist."""
    for name in ("01_single_device_baseline", "02_manual_allreduce_averaging",
                 "03_distributed_data_parallel"):
        assert notebooks.function_source(name, "train").startswith("def train(")
