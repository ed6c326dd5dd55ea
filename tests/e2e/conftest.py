"""The end-to-end suite's fixtures: JupyterLab on a temporary copy of the course, in Chromium.

    make e2e                                   # this suite alone
    python -m pytest -m e2e tests/e2e -s       # the same, printing what each check measured

A session-wide Lab server runs in a temporary copy of ``notebooks/`` and ``images/`` (nothing in
the checkout changes), with the kernel on this interpreter and this repository first on
``PYTHONPATH``. Chromium is the system's (Debian's ``chromium``), driven by Playwright.
Without Chromium or Playwright the suite is skipped, saying why; with ``GRADSYNC_E2E=required``
(the project's CI, ``.ci/run``) it fails instead. Not ``CI``: GitHub's runners set that, and the
workflow there does not install a browser. Screenshots, and the screenshot of the moment a step
failed, go to ``test-artifacts/e2e/`` (gitignored).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, tool
from tests.e2e.lab import Lab

ARTIFACTS = REPO / "test-artifacts" / "e2e"
# the browser's flags and a clean Jupyter's environment: as make images takes its screenshots
CHROMIUM_ARGS = tool("screenshot_readme").CHROMIUM_ARGS
clean_jupyter_env = tool("screenshot_readme").clean_jupyter_env


def _chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")


def _missing_tools() -> list[str]:
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (pip install -e '.[e2e]')")
    if _chromium() is None:
        missing.append("a chromium browser (apt-get install chromium, or set CHROMIUM=path)")
    return missing


@pytest.fixture(scope="session")
def e2e_tools() -> str:
    """Chromium's path; skips the suite (fails it under CI) when a tool is missing."""
    missing = _missing_tools()
    if missing:
        message = "end-to-end suite needs " + " and ".join(missing)
        if os.environ.get("GRADSYNC_E2E") == "required":  # set by .ci/run
            pytest.fail(message + " (GRADSYNC_E2E=required: failing instead of skipping)",
                        pytrace=False)
        pytest.skip(message)
    return _chromium()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # no stale screenshots from an earlier run
    ARTIFACTS.mkdir(parents=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def lab(e2e_tools):
    """A JupyterLab server on a temporary copy of the course; stopped by pid at the end."""
    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="gradsync-e2e-"))
    course = tmp / "course"
    ignore = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__")
    shutil.copytree(REPO / "notebooks", course / "notebooks", ignore=ignore)
    shutil.copytree(REPO / "images", course / "images", ignore=ignore)  # notebooks link to it
    env = clean_jupyter_env(
        tmp,
        # the kernel imports the package from the repository under test
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        SMOKE_TEST="1",  # the notebooks' short mode
    )
    token = secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", "--port=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={course}",
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log_path = tmp / "lab.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, env=env, cwd=course, stdout=log, stderr=subprocess.STDOUT)
    started = time.monotonic()
    url = None
    while url is None:
        match = re.search(r"(http://127\.0\.0\.1:\d+)/lab", log_path.read_text(errors="replace"))
        if match:
            url = match.group(1)
        elif server.poll() is not None or time.monotonic() - started > 60:
            server.kill()
            server.wait()
            pytest.fail(f"JupyterLab did not start:\n{log_path.read_text()[-3000:]}")
        else:
            time.sleep(0.2)
    print(f"\nJupyterLab up in {time.monotonic() - started:.1f} s at {url}, course in {course}")
    lab = Lab(url=url, token=token, course=course, server=psutil.Process(server.pid),
              log=log_path)
    try:
        yield lab
    finally:
        _stop_server(server, lab)
        if not os.environ.get("E2E_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)


def _stop_server(server: subprocess.Popen, lab: Lab) -> None:
    """Stop the server by pid (it shuts its kernels down); then nothing of it may be left."""
    import psutil

    descendants = lab.server.children(recursive=True)
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    _, alive = psutil.wait_procs(descendants + lab.seen_processes, timeout=10)
    alive = [p for p in alive if _running(p)]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    if alive:
        pytest.fail(f"processes left behind by JupyterLab's kernels: {alive}", pytrace=False)


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def browser(e2e_tools):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=e2e_tools, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, lab, request, artifacts):
    """A fresh browser page; its ``steps`` name each step and screenshot a failing one."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.steps = Steps(page, artifacts, request.node.name, lab.log)
    yield page
    context.close()


class Steps:
    """``with page.steps("Run All"):`` a failure inside names the step and keeps a screenshot."""

    def __init__(self, page, artifacts: Path, test_name: str, server_log: Path):
        self.page, self.artifacts, self.test_name = page, artifacts, test_name
        self.server_log = server_log

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        except Exception as exc:
            slug = re.sub(r"[^a-z0-9]+", "-", f"{self.test_name} {name}".lower()).strip("-")
            shot = self.artifacts / f"FAILED-{slug}.png"
            try:
                self.page.screenshot(path=str(shot), full_page=True)
            except Exception as shot_error:  # the page itself may be gone
                shot = f"(no screenshot: {shot_error})"
            log = self.server_log.read_text(errors="replace").splitlines()[-15:]
            raise AssertionError(
                f"step {name!r} failed: {type(exc).__name__}: {exc}\nscreenshot: {shot}\n"
                "last lines of JupyterLab's log:\n" + "\n".join(log)
            ) from exc
        print(f"  {name}: {time.monotonic() - t0:.1f} s")
