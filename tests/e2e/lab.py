"""Driving JupyterLab as a reader does: menus, toolbar buttons, cell prompts and output areas.

Only what the end-to-end checks need. The DOM selectors are JupyterLab 4's; the kernel's
process is found from the server's sessions API and the kernel's connection file name.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gradsync_tutorial.launcher.protocol import WORKER_MODULE
from gradsync_tutorial.launcher.template import TEMPLATE_MODULE

PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
CODE_CELLS = f"{PANEL} .jp-Notebook .jp-CodeCell"
PROMPTS = f"{CODE_CELLS} .jp-InputArea-prompt"


@dataclass
class Lab:
    """A running JupyterLab server (see the ``lab`` fixture)."""

    url: str
    token: str
    course: Path  # the server's root: temporary copies of notebooks/ and images/
    server: psutil.Process
    log: Path
    seen_processes: list[psutil.Process] = field(default_factory=list)  # checked at the end

    def api(self, method: str, path: str):
        request = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def open(self, page, path: str) -> Notebook:
        notebook = Notebook(self, page, path)
        notebook.open()
        return notebook


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def workers_under(proc: psutil.Process) -> list[psutil.Process]:
    """The launcher's worker processes among ``proc``'s live descendants: ``python -m
    WORKER_MODULE``, or (Linux) a fork of a template (``python -m TEMPLATE_MODULE``)."""
    found = []
    try:
        children = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    commands, parents = {}, {}
    for child in children:
        try:
            commands[child.pid], parents[child.pid] = child.cmdline(), child.ppid()
        except psutil.Error:
            continue
    # A fork shows its template's command line: a template is one whose parent is not one.
    templates = {pid for pid, cmd in commands.items() if TEMPLATE_MODULE in cmd
                 and TEMPLATE_MODULE not in commands.get(parents[pid], [])}
    for child in children:
        forked = parents.get(child.pid) in templates
        if (forked or WORKER_MODULE in commands.get(child.pid, [])) and alive(child):
            found.append(child)
    return found


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of ``procs`` runs (zombies count as gone); return those still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


class Notebook:
    """One notebook open in a Lab page."""

    def __init__(self, lab: Lab, page, path: str):
        self.lab, self.page, self.path = lab, page, path

    # -- opening, closing ---------------------------------------------------------------------

    def open(self) -> None:
        # ?reset: a fresh workspace, so no notebook of an earlier test opens (and starts a kernel)
        # generous limits: a loaded 2-core machine took more than 30 s to load Lab
        self.page.goto(f"{self.lab.url}/lab/tree/{self.path}?reset&token={self.lab.token}",
                       wait_until="commit", timeout=120_000)
        self.page.wait_for_selector(CODE_CELLS, timeout=180_000)
        deadline = time.monotonic() + 60
        while not self._session(missing_ok=True):  # the page asks the server for a kernel
            if time.monotonic() > deadline:
                raise TimeoutError(f"Lab started no kernel for {self.path} in 60 s")
            time.sleep(0.2)
        self.wait_kernel_idle(60)
        self.lab.seen_processes.append(self.kernel())

    def shutdown_kernel(self) -> list[psutil.Process]:
        """Shut this notebook's kernel down through the server; return the processes left."""
        kernel = self.kernel()
        procs = [kernel, *kernel.children(recursive=True)]
        session = self._session()
        self.lab.api("DELETE", f"/api/sessions/{session['id']}")
        return wait_gone(procs, 15)

    # -- the kernel ---------------------------------------------------------------------------

    def _session(self, missing_ok: bool = False) -> dict | None:
        for session in self.lab.api("GET", "/api/sessions"):
            if session["path"] == self.path:
                return session
        if missing_ok:
            return None
        raise LookupError(f"no kernel session for {self.path}")

    def kernel(self) -> psutil.Process:
        """The kernel's process: the server's descendant named by the kernel's connection file."""
        kernel_id = self._session()["kernel"]["id"]
        connection_file = f"kernel-{kernel_id}.json"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # just after a restart the new process may be starting
            for proc in self.lab.server.children(recursive=True):
                try:
                    if any(arg.endswith(connection_file) for arg in proc.cmdline()) and alive(proc):
                        return proc
                except psutil.Error:
                    continue
            time.sleep(0.1)
        raise LookupError(f"no process with connection file {connection_file}")

    def wait_kernel_idle(self, timeout: float) -> None:
        """Wait until the notebook has a kernel and the toolbar shows it idle."""
        self.page.wait_for_function(
            f"""() => {{
                const panel = document.querySelector("{PANEL}");
                const dot = panel && panel.querySelector(".jp-Notebook-ExecutionIndicator");
                return dot !== null && dot.dataset.status === "idle"
                    && !panel.querySelector(".jp-Toolbar").innerText.includes("No Kernel"); }}""",
            timeout=timeout * 1000, polling=100)

    # -- reading the notebook -----------------------------------------------------------------

    def code_cells(self):
        return self.page.locator(CODE_CELLS)

    def prompts(self) -> list[str]:
        return self.page.eval_on_selector_all(PROMPTS, "els => els.map(e => e.textContent.trim())")

    def output_text(self, index: int) -> str:
        """What code cell ``index`` (0-based, code cells only) shows in its output area."""
        # textContent, not innerText: Lab skips rendering cells out of view (content-visibility)
        return "\n".join(self.code_cells().nth(index).locator(".jp-OutputArea-output")
                         .evaluate_all("els => els.map(e => e.textContent)"))

    def saved_code_cells(self) -> list[dict]:
        """The code cells of the notebook file on disk (tags, source, and outputs once saved)."""
        cells = json.loads((self.lab.course / self.path).read_text())["cells"]
        return [c for c in cells if c["cell_type"] == "code"]

    # -- acting as the reader -----------------------------------------------------------------

    def menu(self, label: str, command: str) -> None:
        """Click ``label`` in the menu bar, then the item that runs ``command``."""
        bar = self.page.locator(".lm-MenuBar-item").filter(
            has_text=re.compile(rf"^\s*{re.escape(label)}\s*$"))
        bar.click()
        self.page.locator(f".lm-Menu-item[data-command='{command}']").first.click()

    def toolbar(self, command: str) -> None:
        self.page.locator(f"{PANEL} .jp-Toolbar [data-command='{command}']").first.click()

    def clear_outputs(self) -> None:
        """Edit > Clear Outputs of All Cells: what is shown afterwards comes from this run."""
        self.menu("Edit", "editmenu:clear-all")
        self.page.wait_for_function(
            f"""() => [...document.querySelectorAll("{PROMPTS}")]
                     .every(e => e.textContent.trim() === '[ ]:')""", timeout=10_000)

    def run_all(self, timeout: float) -> None:
        """Run > Run All Cells, then wait until no cell is queued or running."""
        self.menu("Run", "runmenu:run-all")
        self.page.wait_for_function(  # started: some cell is queued or running
            f"""() => [...document.querySelectorAll("{PROMPTS}")]
                     .some(e => e.textContent.trim() === '[*]:')""", timeout=10_000)
        self.wait_not_running(timeout)

    def wait_not_running(self, timeout: float) -> None:
        self.page.wait_for_function(
            f"""() => ![...document.querySelectorAll("{PROMPTS}")]
                      .some(e => e.textContent.trim() === '[*]:')""",
            timeout=timeout * 1000, polling=200)
        self.wait_kernel_idle(timeout)

    def prompt(self, index: int) -> str:
        return self.prompts()[index]

    def run_cell(self, index: int, wait: float | None = None) -> None:
        """Select code cell ``index`` and press the toolbar's run button.

        With ``wait``, wait (at most ``wait`` seconds) until the cell shows a new execution
        count and the kernel is idle: a fast cell may never be seen as ``[*]``.
        """
        before = self.prompt(index)
        self.code_cells().nth(index).locator(".jp-InputArea-prompt").click()
        self.toolbar("notebook:run-cell-and-select-next")
        if wait is not None:
            self.page.wait_for_function(
                f"""([i, before]) => {{
                    const t = document.querySelectorAll("{PROMPTS}")[i].textContent.trim();
                    return /^\\[\\d+\\]:$/.test(t) && t !== before; }}""",
                arg=[index, before], timeout=wait * 1000, polling=100)
            self.wait_kernel_idle(wait)

    def wait_output(self, index: int, pattern: str, timeout: float) -> None:
        """Wait until code cell ``index``'s output area matches the regex ``pattern``."""
        self.page.wait_for_function(
            f"""([i, pattern]) => {{
                const cell = document.querySelectorAll("{CODE_CELLS}")[i];
                const out = cell.querySelector(".jp-OutputArea");
                return out !== null && new RegExp(pattern, "m").test(out.textContent); }}""",
            arg=[index, pattern], timeout=timeout * 1000, polling=50)

    def save(self) -> None:
        self.toolbar("docmanager:save")
        self.page.wait_for_function(
            "() => !document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty')",
            timeout=30_000)
