"""Take the README's two screenshots in a real browser: the course in JupyterLab, and the site.

    make site PY=python && python tools/screenshot_readme.py   # make images runs both steps

* ``images/lab_error_cell.png``: JupyterLab started by the course's own launcher
  (``python -m gradsync_tutorial lab``), notebook 00 open at its error cell (tagged
  ``raises-exception``), as the reader sees it after Run All (the committed outputs).
* ``images/site_loss_curves.png``: the site, ``build/site/html`` (``make site``), served from
  127.0.0.1: notebook 02's page at its loss curves (the cell tagged ``image:loss_curves...``).

Chromium is the system's (Debian's ``/usr/bin/chromium``, or ``CHROMIUM=path``), driven by
Playwright with a fresh profile. Each picture records in its PNG text chunk (``gradsync:shows``)
a digest of what it shows (:func:`inputs`); ``tests/tools/test_screenshot_readme.py`` fails when
a picture is older than those files, so the README's pictures stay true.

    >>> digest({"a.ipynb": b"{}"}) == digest({"a.ipynb": b"{ }"})
    False
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from gradsync_tutorial import notebooks

REPO = Path(__file__).resolve().parent.parent
SITE = REPO / "build" / "site" / "html"
IMAGES = REPO / "images"
KEY = "gradsync:shows"  # the PNG text chunk that holds the digest of what a picture shows
VIEWPORT = {"width": 1280, "height": 900}
CHROMIUM_ARGS = [  # without the networking flags, chromium's connections get refused in bulk
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LAB_SETTINGS = {  # no pop-ups over the notebook, no requests to the internet
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
}


def notebook_tagged(tag_start: str, root: Path = REPO) -> tuple[Path, str]:
    """The first notebook with a cell whose tag starts with ``tag_start``, and that tag."""
    for notebook in notebooks.paths("ipynb", root):
        for cell in json.loads(notebook.read_text())["cells"]:
            for tag in cell.get("metadata", {}).get("tags", []):
                if tag.startswith(tag_start):
                    return notebook, tag
    raise SystemExit(f"no notebook has a cell tagged {tag_start}...: nothing to show")


def _titles(root: Path) -> bytes:
    """Every notebook's first line (its title): the site's navigation shows them."""
    titles = []
    for notebook in notebooks.paths("ipynb", root):
        first = json.loads(notebook.read_text())["cells"][0]["source"]
        titles.append(("".join(first) if isinstance(first, list) else first).split("\n")[0])
    return "\n".join(titles).encode()


def inputs(picture: str, root: Path = REPO) -> dict[str, bytes]:
    """What ``images/<picture>`` shows: the files (and the navigation's titles) it is taken of."""
    if picture == "lab_error_cell.png":
        notebook, _ = notebook_tagged("raises-exception", root)
        files = [notebook, root / "gradsync_tutorial" / "lab.py"]
        extra = {}
    elif picture == "site_loss_curves.png":
        notebook, _ = notebook_tagged("image:loss_curves", root)
        files = [notebook, root / "docs" / "build.py", root / "docs" / "conf.py"]
        extra = {"the navigation's titles": _titles(root)}
    else:
        raise ValueError(f"{picture}: not one of {sorted(PICTURES)}")
    return {str(p.relative_to(root)): p.read_bytes() for p in files} | extra


def digest(shown: dict[str, bytes]) -> str:
    """One sha256 over the names and contents of what a picture shows."""
    h = hashlib.sha256()
    for name in sorted(shown):
        h.update(name.encode() + b"\0" + hashlib.sha256(shown[name]).digest())
    return h.hexdigest()


def recorded(path: Path) -> str | None:
    """The digest a picture recorded when it was taken (None: taken by something else)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.text.get(KEY)


def save(png: bytes, picture: str) -> Path:
    """Write ``png`` to ``images/<picture>`` with the digest of what it shows."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text(KEY, digest(inputs(picture)))
    path = IMAGES / picture
    with Image.open(io.BytesIO(png)) as image:
        image.save(path, pnginfo=info, optimize=True)
    print(f"images/{picture}: {Image.open(path).size[0]}x{Image.open(path).size[1]}")
    return path


def clean_jupyter_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a clean Jupyter: no user config, kernels, workspaces or settings leak
    in or out (all under ``tmp``), no pop-ups, no requests to the internet."""
    for name, settings in LAB_SETTINGS.items():
        path = tmp / "lab-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    return dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), IPYTHONDIR=str(tmp / "ipython"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "lab-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), **extra)


def chromium() -> str:
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")
    if not found:
        raise SystemExit("screenshots need a chromium browser: apt-get install chromium, or "
                         "set CHROMIUM=path")
    return found


@contextmanager
def browser_page(tmp: Path):
    """A page of the system's Chromium, with a fresh profile under ``tmp``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp / "chromium-profile"), executable_path=chromium(), args=CHROMIUM_ARGS,
            headless=True, viewport=VIEWPORT)
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(120_000)
            yield page
        finally:
            context.close()


def shoot_site(page, tmp: Path) -> bytes:
    """Notebook 02's page of the site at its loss curves, the navigation on the left (``tmp``:
    unused, as :func:`shoot_lab` takes it)."""
    if not (SITE / "index.html").is_file():
        raise SystemExit(f"no site in {SITE.relative_to(REPO)}: make site PY=... builds it")
    notebook, tag = notebook_tagged("image:loss_curves")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{server.server_port}/notebooks/{notebook.stem}.html",
                  wait_until="load")
        page.wait_for_load_state("networkidle")
        cell = page.locator(f"div.cell[class~='tag_{tag}']")
        assert cell.count() == 1, f"the page of {notebook.name} has no cell tagged {tag}"
        assert cell.locator("img").evaluate("e => e.complete && e.naturalWidth > 0")
        cell.evaluate("e => { e.scrollIntoView({block: 'start'}); window.scrollBy(0, -150); }")
        page.wait_for_timeout(500)  # the sidebar's scroll position settles
        return page.screenshot()
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def shoot_lab(page, tmp: Path) -> bytes:
    """Notebook 00 in JupyterLab, started by ``python -m gradsync_tutorial lab``, at its
    error cell."""
    notebook, _ = notebook_tagged("raises-exception")
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    index = next(i for i, c in enumerate(cells)
                 if "raises-exception" in c.get("metadata", {}).get("tags", []))
    token = secrets.token_hex(16)
    env = clean_jupyter_env(tmp, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log_path = tmp / "lab.log"
    cmd = [sys.executable, "-m", "gradsync_tutorial", "lab", "--ip=127.0.0.1", "--port=0",
           "--no-browser", f"--IdentityProvider.token={token}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = _wait_for(lambda: re.search(r"(http://127\.0\.0\.1:\d+)/lab",
                                          log_path.read_text(errors="replace")),
                        launcher, log_path, "JupyterLab did not start").group(1)
        path = notebook.relative_to(REPO).as_posix()
        page.goto(f"{url}/lab/tree/{path}?reset&token={token}", wait_until="commit")
        code_cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")
        code_cells.first.wait_for()
        page.wait_for_timeout(2000)  # the kernel starts, the toolbar settles
        cell = code_cells.nth(index)
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-OutputArea-output").first.wait_for()
        page.wait_for_timeout(500)
        assert "RankFailedError" in cell.inner_text(), "the error cell shows its error"
        return cell.screenshot()
    finally:
        _stop(launcher)


def _wait_for(find: Callable, proc: subprocess.Popen, log: Path, failure: str, timeout=120):
    started = time.monotonic()
    while not (found := find()):
        if proc.poll() is not None or time.monotonic() - started > timeout:
            raise SystemExit(f"{failure}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    return found


def _stop(launcher: subprocess.Popen) -> None:
    """SIGTERM to the launcher, which stops the server, which shuts its kernels down."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


PICTURES = {"lab_error_cell.png": shoot_lab, "site_loss_curves.png": shoot_site}


def main(argv: list[str] | None = None) -> int:
    chosen = (sys.argv[1:] if argv is None else argv) or list(PICTURES)
    with tempfile.TemporaryDirectory(prefix="gradsync-screenshots-") as tmp:
        for picture in chosen:
            with browser_page(Path(tmp) / picture) as page:
                png = PICTURES[picture](page, Path(tmp))
            save(png, picture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
