"""The launcher in JupyterLab: live rank output, the stop button, a kernel restart.

They run cells of a small probe notebook written into the server's temporary course folder, in
one kernel, in this file's order (live output, stop, restart). The kernel's processes are found
by pid (see ``Notebook.kernel``), not by name, so other Python processes on the machine do not
count.
"""

from __future__ import annotations

import re
import sys
import time

import nbformat
import pytest

from tests.conftest import REPO
from tests.e2e.conftest import Steps
from tests.e2e.lab import alive, wait_gone, workers_under

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SETUP, TICKER, HANG, AFTER_HANG, WARM = range(5)  # the probe's code cells, in order
PROBE_CELLS = [
    """\
import os, sys, time
import torch
import torch.distributed as dist
import gradsync_tutorial as gst
print("python:", sys.executable)
print("package:", gst.__file__)""",
    """\
def ticker(rank, world_size):
    for i in range(10):  # a line every 0.5 s for 5 s
        print(f"tick {i}")
        time.sleep(0.5)
    return rank

print("returned:", gst.launch(ticker, world_size=2))""",
    """\
def skips_a_collective(rank, world_size):
    print("before the collective")
    if rank == 0:  # rank 1 never joins: rank 0 waits forever
        dist.all_reduce(torch.ones(1))

gst.launch(skips_a_collective, world_size=2)  # timeout: 300 s, so only the stop button ends it""",
    """print("next launch:", gst.launch(lambda rank, world_size: rank * 10, world_size=2))""",
    """print("worker pids:", gst.launch(lambda rank, world_size: os.getpid(), world_size=2))""",
]
FIRST_LINE_SECONDS = 60  # fresh workers import torch: slow on a loaded 2-core machine
STOP_SECONDS = 5  # the stop button ends a hang within 5 s
RESTART_SECONDS = 10  # a restart leaves no worker after 10 s


@pytest.fixture(scope="module")
def probe_page(lab, browser, artifacts):
    nb_file = lab.course / "notebooks" / "probe.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in PROBE_CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, nb_file)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.steps = Steps(page, artifacts, "probe-setup", lab.log)
    with page.steps("open the probe notebook and run its set-up cell"):
        nb = lab.open(page, "notebooks/probe.ipynb")
        nb.run_cell(SETUP, wait=120)
    try:
        yield nb
    finally:
        left = nb.shutdown_kernel()
        context.close()
        assert not left, f"still running after the probe kernel's shutdown: {left}"


@pytest.fixture
def probe(probe_page, lab, request, artifacts):
    probe_page.page.steps = Steps(probe_page.page, artifacts, request.node.name, lab.log)
    return probe_page


def test_kernel_is_this_python_with_the_package_under_test(probe):
    with probe.page.steps("the kernel runs this interpreter and imports this repository"):
        assert probe.kernel().cmdline()[0] == sys.executable
        shown = probe.output_text(SETUP)
        assert f"python: {sys.executable}" in shown, shown
        assert f"package: {REPO / 'gradsync_tutorial' / '__init__.py'}" in shown, shown


def test_rank_lines_show_while_the_cell_runs(probe):
    """Check 2: lines printed every 0.5 s show up in the cell one by one, not all at the end."""
    step = probe.page.steps
    pattern = re.compile(r"^\[rank (\d)\] tick (\d)$", re.M)
    with step("run a cell whose 2 ranks print a line every 0.5 s for 5 s"):
        probe.run_cell(TICKER)
        clicked = time.monotonic()
    with step("the first rank line shows while the cell is still running"):
        probe.wait_output(TICKER, r"^\[rank \d\] tick", FIRST_LINE_SECONDS)
        first_seen = time.monotonic() - clicked
        trace = []  # (seconds since click, tick lines shown) while the cell runs
        while probe.prompt(TICKER) == "[*]:":
            trace.append((time.monotonic() - clicked,
                          len(pattern.findall(probe.output_text(TICKER)))))
            time.sleep(0.1)
        running = [n for _, n in trace]
        assert running and 0 < running[0] < 20, f"lines shown while running: {running}"
        assert len(set(running)) >= 3, f"the lines came in at most 2 batches: {trace}"
    with step("all 20 lines and the result once the cell is done"):
        probe.wait_not_running(30)
        shown = probe.output_text(TICKER)
        ticks = sorted(pattern.findall(shown))
        assert ticks == sorted((str(r), str(i)) for r in range(2) for i in range(10)), shown
        assert "returned: [0, 1]" in shown, shown
    done = trace[-1][0] if trace else first_seen
    print(f"  first line {first_seen:.1f} s after the click, cell done after {done:.1f} s; "
          f"lines shown while running: {sorted(set(running))}")


def test_stop_button_ends_a_hang_and_the_next_launch_works(probe):
    """Check 3: stop button on a hang: KeyboardInterrupt, no worker left, next launch fine."""
    step = probe.page.steps
    kernel = probe.kernel()
    with step("start a cell that hangs: one rank skips a collective"):
        probe.run_cell(HANG)
        probe.wait_output(HANG, r"^\[rank 0\] before the collective", FIRST_LINE_SECONDS)
        probe.wait_output(HANG, r"^\[rank 1\] before the collective", 10)
        workers = workers_under(kernel)
        assert len(workers) == 2, f"the kernel's workers: {workers}"
        time.sleep(1)  # hung for a moment: rank 0 sits in all_reduce
        assert probe.prompt(HANG) == "[*]:"
    with step("click the toolbar's stop button (interrupt the kernel)"):
        probe.toolbar("notebook:interrupt-kernel")
        clicked = time.monotonic()
    with step(f"the cell shows KeyboardInterrupt within {STOP_SECONDS} s"):
        probe.wait_output(HANG, "KeyboardInterrupt", STOP_SECONDS)
        shown_after = time.monotonic() - clicked
    with step("no worker process of the kernel is left"):
        left = wait_gone(workers, max(0.0, STOP_SECONDS - (time.monotonic() - clicked)))
        gone_after = time.monotonic() - clicked
        assert not left, f"workers still running {gone_after:.1f} s after the stop: {left}"
        assert workers_under(kernel) == []
        assert alive(kernel), "the interrupt killed the kernel"
    with step("the next launch in the same kernel works"):
        probe.wait_not_running(30)
        probe.run_cell(AFTER_HANG, wait=120)
        assert "next launch: [0, 10]" in probe.output_text(AFTER_HANG)
        assert probe.kernel().pid == kernel.pid, "the kernel was replaced"
    print(f"  KeyboardInterrupt shown {shown_after:.1f} s after the click, "
          f"workers gone after {gone_after:.1f} s")


def test_restart_stops_the_warm_workers(probe, lab):
    """Check 4: Kernel > Restart with warm workers idle; within 10 s the old workers are gone."""
    step, page = probe.page.steps, probe.page
    with step("a launch leaves warm workers idle"):
        probe.run_cell(WARM, wait=120)
        kernel = probe.kernel()
        workers = workers_under(kernel)
        printed = re.search(r"worker pids: \[(\d+), (\d+)\]", probe.output_text(WARM))
        assert printed and sorted(map(int, printed.groups())) == sorted(
            w.pid for w in workers), (printed, workers)
    with step("Kernel > Restart Kernel…, then confirm"):
        probe.menu("Kernel", "kernelmenu:restart")
        page.locator(".jp-Dialog .jp-mod-accept").click()
        clicked = time.monotonic()
    with step(f"the old workers are gone within {RESTART_SECONDS} s"):
        left = wait_gone(workers, RESTART_SECONDS)
        gone_after = time.monotonic() - clicked
        assert not left, f"workers still running {gone_after:.1f} s after the restart: {left}"
    with step("the old kernel is gone and the new one is up and idle"):
        assert not wait_gone([kernel], 60), "the old kernel still runs"
        kernel_gone_after = time.monotonic() - clicked
        probe.wait_kernel_idle(60)
        new_kernel = probe.kernel()
        lab.seen_processes.append(new_kernel)
        assert new_kernel.pid != kernel.pid
    print(f"  old workers gone {gone_after:.1f} s after the restart, "
          f"the old kernel after {kernel_gone_after:.1f} s")
