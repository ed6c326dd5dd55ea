"""The course as a website: ``make site``'s pages, built here and read in Chromium.

    python -m pytest tests/e2e/test_site.py -s     # prints what each check measured

The site is built once per session from this checkout (``docs/build.py``, what ``make site``
runs, into ``build/site/``), and served over HTTP from ``127.0.0.1`` under a sub-path, as
GitHub Pages serves a project (``/NAME/``): a link that leaves the site's folder fails here as it
would there. Nothing is fetched from anywhere else: a page that needs a CDN shows a console error
and a broken resource here. Needs the ``site`` extra (``pip install -e '.[site]'``) besides the
e2e suite's tools; skipped without it, failed under ``GRADSYNC_E2E=required`` (``.ci/run``).
Screenshots go to ``test-artifacts/e2e/`` (``site-*.png``; the README shows one of them).
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import importlib.util
import json
import os
import posixpath
import re
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from gradsync_tutorial.notebooks import paths
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NOTEBOOKS = paths("ipynb")
PREFIX = "/gradsync-tutorial/"  # served as GitHub Pages serves a project site


def _load_build():
    spec = importlib.util.spec_from_file_location("site_build", REPO / "docs" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look themselves up there)
    spec.loader.exec_module(module)
    return module


site_build = _load_build()


# -- the built site, served -------------------------------------------------------------------


@pytest.fixture(scope="session")
def site(e2e_tools) -> Path:
    """The site's html folder, built from this checkout where ``make site`` builds it
    (``build/site/``, gitignored); right after ``make site`` (as in ``.ci/run``), from the same
    files, that build is the one read."""
    missing = [name for name in ("sphinx", "myst_nb", "sphinx_book_theme")
               if importlib.util.find_spec(name) is None]
    if missing:
        message = f"the site test needs {', '.join(missing)}: pip install -e '.[site]'"
        if os.environ.get("GRADSYNC_E2E") == "required":
            pytest.fail(message + " (GRADSYNC_E2E=required: failing instead of skipping)",
                        pytrace=False)
        pytest.skip(message)
    started = time.monotonic()
    index = site_build.build(REPO / "build" / "site")
    print(f"\nsite ready in {time.monotonic() - started:.1f} s (built now, or by make site from "
          f"the same files): {index}")
    return index.parent


class _Handler(http.server.SimpleHTTPRequestHandler):
    def translate_path(self, path: str) -> str:
        path = urllib.parse.urlsplit(path).path
        if not path.startswith(PREFIX):
            return str(Path(self.directory) / "does-not-exist" / "outside-the-site")
        return super().translate_path("/" + path[len(PREFIX):])

    def log_message(self, *args):  # quiet: failures are collected from the browser's side
        pass


@pytest.fixture(scope="session")
def site_url(site) -> str:
    handler = functools.partial(_Handler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}{PREFIX}"
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture
def reader(browser, site_url):
    """A browser page that records every console error, script error and failed request."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.problems = []
    page.on("console", lambda m: m.type == "error" and page.problems.append(
        f"console error: {m.text} ({m.location.get('url')})"))
    page.on("pageerror", lambda e: page.problems.append(f"script error: {e}"))
    page.on("requestfailed", lambda r: page.problems.append(
        f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and page.problems.append(
        f"HTTP {r.status}: {r.url}"))
    yield page
    context.close()


def _open(page, site_url: str, path: str) -> None:
    page.goto(site_url + path, wait_until="load")
    page.wait_for_load_state("networkidle")


def _page_of(notebook: Path) -> str:
    return f"notebooks/{notebook.stem}.html"


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text(encoding="utf-8"))["cells"]


def _images_in(notebook: Path) -> int:
    """Pictures the notebook shows: image outputs, and images its markdown cells link."""
    cells = _cells(notebook)
    outputs = sum(1 for c in cells for o in c.get("outputs", [])
                  if any(k.startswith("image/") for k in o.get("data", {})))
    markdown = sum(len(re.findall(r"!\[[^\]]*\]\(", "".join(c["source"])))
                   for c in cells if c["cell_type"] == "markdown")
    return outputs + markdown


# -- every page -------------------------------------------------------------------------------


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_every_notebook_page_opens_with_its_images_and_no_error(reader, site_url, notebook):
    _open(reader, site_url, _page_of(notebook))
    title = _cells(notebook)[0]["source"][0].lstrip("# ").strip()
    heading = reader.locator("article h1").first.inner_text().replace("#", "").strip()
    assert heading == re.sub(r"`", "", title), "the page is not the notebook's"
    images = reader.eval_on_selector_all(
        "article img", "els => els.map(e => [e.getAttribute('src'), e.complete && "
                       "e.naturalWidth > 0])")
    broken = [src for src, ok in images if not ok]
    assert not broken, f"images that did not load: {broken}"
    assert len(images) == _images_in(notebook), (
        f"the page shows {len(images)} images, the notebook has {_images_in(notebook)}")
    box = reader.locator("div.admonition.run-it")
    assert box.count() == 1 and "make lab" in box.inner_text()
    assert f"notebooks/{notebook.name}" in box.inner_text()
    # no Colab badge until colab.py has given the notebook one (then the box has it)
    has_badge = site_build.colab_target(site_build.nbformat.read(notebook, as_version=4))
    assert box.locator("img[alt='Open In Colab']").count() == (1 if has_badge else 0)
    if any(re.search(r"\$[^$\n]+\$", "".join(c["source"])) for c in _cells(notebook)
           if c["cell_type"] == "markdown"):  # math, typeset by the site's own MathJax
        reader.wait_for_selector("mjx-container", state="attached", timeout=30_000)
    assert not reader.problems, "\n".join(reader.problems)
    print(f"  {notebook.name}: {len(images)} images, no console error")


@pytest.mark.parametrize("path", ["index.html", "reference.html"])
def test_the_readme_pages_open_with_their_images_and_no_error(reader, site_url, path):
    _open(reader, site_url, path)
    images = reader.eval_on_selector_all(
        "article img", "els => els.map(e => [e.getAttribute('src'), e.complete && "
                       "e.naturalWidth > 0])")
    assert images and all(ok for _, ok in images), f"images: {images}"
    assert not reader.problems, "\n".join(reader.problems)
    if path == "index.html":  # the landing page: the answer, the glossary, the notebooks
        text = reader.locator("article").inner_text()
        assert "The question, answered" in text and "Glossary" in text
        nav = reader.eval_on_selector_all(
            "nav.bd-links a", "els => els.map(e => e.getAttribute('href'))")
        pages = [h for h in nav if h.startswith("notebooks/")]
        assert pages == [_page_of(n) for n in NOTEBOOKS], "one page per notebook, in order"


# -- links ------------------------------------------------------------------------------------


class _PageReader(html.parser.HTMLParser):
    """A page's ids, its links and resources, and mentions of notebooks that are not links."""

    SKIP = {"a", "code", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "script", "style"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.links, self.resources, self.unlinked = set(), [], [], []
        self.stack: list[str] = []
        self.article = 0  # depth inside <article>

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        for name in ("src", "href"):
            if attrs.get(name) and (tag in {"img", "script"} or
                                    (tag == "link" and name == "href")):
                self.resources.append(attrs[name])
        if tag not in {"img", "br", "hr", "meta", "link", "input", "source", "wbr"}:
            self.stack.append(tag)
            if tag == "article":
                self.article += 1

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack:
                if self.stack.pop() == tag:
                    break
            if tag == "article":
                self.article -= 1

    def handle_data(self, data):
        if self.article and not self.SKIP & set(self.stack):
            for mention in site_build.NOTEBOOK_MENTION.finditer(data):
                self.unlinked.append(mention.group(0))


def _read_pages(site: Path) -> dict[str, _PageReader]:
    pages = {}
    for path in sorted(site.rglob("*.html")):
        if path.relative_to(site).parts[0] == "_static":  # the themes' templates, not pages
            continue
        parser = _PageReader()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[path.relative_to(site).as_posix()] = parser
    return pages


def test_every_internal_link_and_resource_resolves(site):
    pages = _read_pages(site)
    broken, external = [], []
    for name, page in pages.items():
        for href in page.links + page.resources:
            parts = urllib.parse.urlsplit(href)
            if parts.scheme in {"http", "https", "mailto"}:
                if href in page.resources:
                    external.append(f"{name}: {href}")
                continue
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), parts.path)) \
                if parts.path else name
            if target.startswith("../") or not (site / target).exists():
                broken.append(f"{name}: {href} (no file {target})")
            elif parts.fragment and target.endswith(".html") and \
                    urllib.parse.unquote(parts.fragment) not in pages[target].ids:
                broken.append(f"{name}: {href} (no #{parts.fragment} in {target})")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)
    assert not external, "resources loaded from elsewhere (the site must work offline):\n" + \
        "\n".join(external)
    print(f"  {sum(len(p.links) for p in pages.values())} links and "
          f"{sum(len(p.resources) for p in pages.values())} resources in {len(pages)} pages")


def test_notebook_names_and_glossary_terms_are_links(site):
    pages = _read_pages(site)
    unlinked = {name: p.unlinked for name, p in pages.items() if p.unlinked}
    # a notebook's mention of itself, or of one that does not exist (yet), stays text
    numbers = {n.name[:2] for n in NOTEBOOKS}
    for name in list(unlinked):
        own = re.match(r"notebooks/(\d\d)_", name)
        left = [m for m in unlinked[name]
                if set(re.findall(r"\d\d", m)) & (numbers - {own and own.group(1)})]
        unlinked[name] = left
        if not left:
            del unlinked[name]
    assert not unlinked, f"notebook mentions that are not links: {unlinked}"
    course = site_build.read_course(REPO)
    # Sphinx's own id for a glossary term: spaces become -, case kept (term-ZeRO, term-local-SGD)
    from sphinx.util.nodes import _make_id
    term_ids = {_make_id(f"term-{t}") for t in course.glossary}
    assert term_ids <= pages["index.html"].ids, "the glossary's terms are link targets"
    linked = {urllib.parse.urlsplit(h).fragment for n, p in pages.items()
              if n.startswith("notebooks/") for h in p.links if "index.html#term-" in h}
    assert linked <= term_ids and linked, "notebook pages link glossary terms"
    for notebook in NOTEBOOKS:
        page = pages[_page_of(notebook)]
        others = {h for h in page.links if re.fullmatch(r"\d\d_\w+\.html(#.*)?", h)}
        assert others, f"{notebook.name}'s page links no other notebook"


# -- search -----------------------------------------------------------------------------------


def test_search_finds_all_reduce(reader, site_url):
    _open(reader, site_url, "search.html?q=all_reduce")
    reader.wait_for_selector("#search-results ul.search li a", timeout=30_000)
    results = reader.eval_on_selector_all(
        "#search-results ul.search li a", "els => els.map(e => e.getAttribute('href'))")
    manual = _page_of(next(n for n in NOTEBOOKS if n.name.startswith("02_")))
    assert any(urllib.parse.urlsplit(r).path == manual for r in results), results
    assert not reader.problems, "\n".join(reader.problems)
    print(f"  search for all_reduce: {len(results)} results")


# -- screenshots for the README ---------------------------------------------------------------


def _tagged(tag_start: str) -> tuple[Path, str]:
    """The first notebook with a cell whose tag starts with ``tag_start``, and that tag."""
    for notebook in NOTEBOOKS:
        for cell in _cells(notebook):
            for tag in cell.get("metadata", {}).get("tags", []):
                if tag.startswith(tag_start):
                    return notebook, tag
    pytest.fail(f"no notebook has a cell tagged {tag_start}...")


@pytest.mark.parametrize("what, tag", [("error-cell", "raises-exception"),
                                       ("loss-curves", "image:loss_curves")])
def test_screenshot_of_the_error_cell_and_the_loss_curves(reader, site_url, artifacts, what,
                                                          tag):
    notebook, full_tag = _tagged(tag)
    _open(reader, site_url, _page_of(notebook))
    cell = reader.locator(f"div.cell[class~='tag_{full_tag}']")
    assert cell.count() == 1, f"the page has no cell tagged {full_tag}"
    if what == "error-cell":
        assert "RankFailedError" in cell.inner_text(), "the error cell shows its error"
    else:
        assert cell.locator("img").evaluate("e => e.complete && e.naturalWidth > 0")
    cell.evaluate("e => { e.scrollIntoView({block: 'start'}); window.scrollBy(0, -150); }")
    reader.wait_for_timeout(300)  # the sidebar's scroll position settles
    shot = artifacts / f"site-{what}.png"
    reader.screenshot(path=str(shot))
    assert not reader.problems, "\n".join(reader.problems)
    print(f"  {shot.relative_to(REPO)}: {_page_of(notebook)}")
