"""``make lab`` serves the course, as root too: started, asked for notebook 00, stopped.

Runs the README's first command as a reader would (``make lab``, with this interpreter as
``PY`` so nothing is installed), on a machine without a desktop (no ``DISPLAY``, as in CI and in
a container): as root when the tests run as root (``.ci/run``), as a normal user otherwise (the
public CI). The server runs with a clean Jupyter configuration in a temporary folder, and is
stopped by ``make``'s pid; then none of its processes may be left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from gradsync_tutorial.lab import has_desktop

from .conftest import REPO

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sys.platform == "win32", reason="make lab and its signals: POSIX only"),
    pytest.mark.skipif(shutil.which("make") is None, reason="needs make"),
]
psutil = pytest.importorskip("psutil")
pytest.importorskip("jupyterlab")

URL = re.compile(r"http://(?:localhost|127\.0\.0\.1):(\d+)/lab\?token=(\w+)")
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture
def lab_output():
    tmp = Path(tempfile.mkdtemp(prefix="gradsync-make-lab-"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def _get(url: str, token: str) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.status, reply.headers.get("Content-Type", ""), reply.read()


def test_make_lab_serves_the_course_and_stops_by_its_pid(lab_output):
    env = {k: v for k, v in os.environ.items()
           if k not in {"DISPLAY", "WAYLAND_DISPLAY", "SSH_CONNECTION", "SSH_TTY"}}
    if has_desktop(env):  # macOS always has one: be a reader logged in over SSH instead
        env["SSH_CONNECTION"] = "127.0.0.1 50000 127.0.0.1 22"
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # a clean Jupyter: no user config or runtime files leak in or out
        JUPYTER_CONFIG_DIR=str(lab_output / "config"), JUPYTER_RUNTIME_DIR=str(lab_output / "rt"),
        JUPYTERLAB_WORKSPACES_DIR=str(lab_output / "workspaces"),
    )
    log = lab_output / "make-lab.log"
    with open(log, "wb") as out:
        make = subprocess.Popen(
            ["make", "--no-print-directory", "lab", f"PY={sys.executable}",
             "LAB_ARGS=--port=0 --LabApp.news_url= "
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # (the test stops make alone, by its pid)
    started, match, text = time.monotonic(), None, ""
    try:
        while not (match and "no desktop here" in text):  # the URL, then what to do with it
            text = log.read_text(errors="replace")
            match = URL.search(text)
            if make.poll() is not None or time.monotonic() - started > 180:
                pytest.fail(f"make lab did not serve the course:\n{text[-3000:]}")
            time.sleep(0.2)
        port, token = match.groups()
        processes = psutil.Process(make.pid).children(recursive=True)
        print(f"\nmake lab answered in {time.monotonic() - started:.1f} s on port {port}")

        # root: the flag, and the one line that says why; a normal user: neither
        notice = [line for line in text.splitlines() if "--allow-root" in line]
        assert len(notice) == (1 if AS_ROOT else 0), text
        # no desktop: the URL with its token, and how to reach it from a laptop
        assert f"ssh -N -L {port}:localhost:{port}" in text
        assert f"http://localhost:{port}/lab?token={token}" in text
        assert 'LAB_ARGS="--ip 0.0.0.0"' in text and "Security:" in text

        base = f"http://127.0.0.1:{port}"
        status, _, body = _get(f"{base}/api/contents/notebooks/00_launching_workers.ipynb", token)
        model = json.loads(body)
        assert status == 200 and model["type"] == "notebook", model.get("type")
        assert model["content"]["cells"][0]["source"].startswith("# 00")
        status, kind, _ = _get(f"{base}/lab/tree/notebooks/00_launching_workers.ipynb", token)
        assert status == 200 and kind.startswith("text/html")
        # the server's root is the repository: the notebooks' ../images/ figures show
        status, kind, _ = _get(f"{base}/files/images/allreduce.png", token)
        assert status == 200 and kind == "image/png"
    finally:
        if make.poll() is None:
            make.send_signal(signal.SIGTERM)  # by make's pid alone: it stops the launcher
        try:
            make.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
            pytest.fail("make lab did not stop within 60 s of SIGTERM")
    _, alive = psutil.wait_procs(locals().get("processes", []), timeout=30)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in alive:
        proc.kill()
    assert not alive, f"make lab left processes behind: {alive}"
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", int(port))) != 0, "the port still answers"
    print(f"  stopped, nothing left, in {time.monotonic() - started:.1f} s in all")


@pytest.mark.parametrize("given", [["--ServerApp.root_dir=/srv/course"],
                                   ["--ServerApp.root_dir", "/srv/course"],
                                   ["--notebook-dir=/srv/course"]])
def test_lab_args_override_the_root_folder_which_is_then_given_once(given):
    """Jupyter refuses an option given twice, so LAB_ARGS' root folder replaces the course's
    (and the course's notebooks/ start folder, which may not be under it)."""
    from gradsync_tutorial.lab import lab_command

    cmd, _ = lab_command(given, Path("/course"), as_root=False, desktop=True, python="python")
    roots = [a for a in cmd if "root_dir" in a or "notebook-dir" in a or "preferred_dir" in a]
    assert roots == [a for a in given if a != "/srv/course"], cmd
    assert cmd[-len(given):] == given


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "http", "８８８８"])
def test_an_impossible_port_is_refused_before_the_server_starts(port, monkeypatch, capsys):
    from gradsync_tutorial import lab

    monkeypatch.setattr(lab.subprocess, "Popen", lambda *a, **k: pytest.fail("it started"))
    assert lab.main(["--port", port]) == 2
    err = capsys.readouterr().err
    assert err == (f"gradsync lab: --port {port} is not a port: pass a number from 1 to 65535, "
                   "such as --port 8888 (or 0: any free port).\n")
    assert lab.bad_port([f"--ServerApp.port={port}"]) and lab.bad_port(["--port=8888"]) is None
