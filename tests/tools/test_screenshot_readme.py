"""tools/screenshot_readme.py: the README's screenshots are no older than what they show.

Each picture records, when ``make images`` takes it, a digest of the files it shows (the
notebook, how the site or Lab is made); a change to any of them without a new screenshot fails
here, in a second and without a browser.
"""

from __future__ import annotations

import pytest

from ..conftest import REPO, tool

screenshots = tool("screenshot_readme")


def test_the_tools_examples_run():
    import doctest

    result = doctest.testmod(screenshots)
    assert result.attempted >= 1 and result.failed == 0


@pytest.mark.parametrize("picture", sorted(screenshots.PICTURES))
def test_each_screenshot_shows_the_files_as_they_are(picture):
    path = REPO / "images" / picture
    assert f"](images/{picture})" in (REPO / "README.md").read_text(), "the README shows it"
    taken_of = screenshots.recorded(path)
    assert taken_of is not None, f"images/{picture} was not taken by make images"
    assert taken_of == screenshots.digest(screenshots.inputs(picture)), (
        f"images/{picture} is older than what it shows "
        f"({', '.join(screenshots.inputs(picture))}): make images")


@pytest.mark.parametrize("picture", sorted(screenshots.PICTURES))
def test_a_change_to_what_a_picture_shows_changes_its_digest(picture):
    shown = screenshots.inputs(picture)
    for name in shown:
        changed = dict(shown, **{name: shown[name] + b" "})
        assert screenshots.digest(changed) != screenshots.digest(shown), name
