"""The readiness check: every check passes here, and each simulated failure prints its fix.

Failures are simulated with monkeypatch (an old torch, missing or truncated data, a blocked
port, a launch that hangs as behind a macOS firewall prompt); one test runs the real command,
``python -m gradsync_tutorial doctor``, end to end.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from gradsync_tutorial import __main__ as cli
from gradsync_tutorial import data, doctor, launcher
from gradsync_tutorial.doctor import Check
from gradsync_tutorial.launcher.errors import rank_failed_error, timeout_error

from .conftest import REPO
from .test_data import DAMAGES, _damage, _not_a_folder, fake_files, write_unpacked


def test_the_command_passes_on_this_machine():
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync_tutorial", "doctor"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    assert lines[0] == "gradsync-tutorial doctor: can this machine run the course?"
    names = [line.split()[1] for line in lines[1:] if line.startswith("  ") and line.split()
             and line.split()[0] in ("ok", "info", "warn", "FAIL")]
    assert names == ["python", "torch", "devices", "backends", "data", "network", "launch",
                     "epoch", "notebooks"]
    assert "2 ranks started and all-reduced over gloo in" in out
    for notebook in doctor.REFERENCE_SECONDS:
        assert notebook in out
    assert lines[-1].startswith("Ready: every check passed")


# --------------------------------------------------------------------------------------------
# One check at a time
# --------------------------------------------------------------------------------------------


def test_version_parsing():
    assert doctor._version_tuple("2.14.1+cu130") == (2, 14, 1)
    assert doctor._version_tuple("2.5.0a0+git1234") == (2, 5, 0)
    assert doctor._version_tuple("0.19.0rc1") == (0, 19, 0)
    assert doctor._version_tuple("2.4") == (2, 4)


def test_the_minimum_versions_are_pyproject_s():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f">={doctor._dotted(doctor.MIN_PYTHON)}"
    assert f"torch>={doctor._dotted(doctor.MIN_TORCH)}" in project["dependencies"]
    assert f"torchvision>={doctor._dotted(doctor.MIN_TORCHVISION)}" in project["dependencies"]


def test_python_versions():
    assert doctor.check_python().status == "ok"
    old = doctor.check_python((3, 9, 18))
    assert old.failed and old.detail.startswith("3.9.18")
    assert "Python 3.10 or newer" in old.fix


def test_an_old_torch_or_a_missing_torchvision_fails_with_the_upgrade_command(monkeypatch):
    assert doctor.check_torch().status == "ok"
    monkeypatch.setattr(torch, "__version__", "2.1.2")
    old = doctor.check_torch()
    assert old.failed
    assert "torch 2.1.2 is older than 2.14" in old.detail
    assert "pip install --upgrade 'torch>=2.14' 'torchvision>=0.29'" in old.fix
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` now fails
    missing = doctor.check_torch()
    assert missing.failed and "torchvision cannot be imported" in missing.detail


def test_devices_and_backends_here():
    assert doctor.check_devices().status == "info"
    backends = doctor.check_backends()
    assert backends.status == "ok" and "gloo available" in backends.detail


def test_missing_data_fails_with_make_data(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADSYNC_DATA", str(tmp_path))
    monkeypatch.setattr(data, "DEBIAN_DIRS", {"fashion-mnist": (), "mnist": ()})
    check = doctor.check_data()
    assert check.failed
    assert f"Fashion-MNIST is not in {tmp_path}" in check.detail
    assert "missing train-images-idx3-ubyte" in check.detail
    assert "`make data`" in check.fix and "GRADSYNC_DATA" in check.fix


@pytest.mark.parametrize("kind", ["a file", "under a file", "a symbolic link loop"])
def test_gradsync_data_that_cannot_be_a_folder_fails_with_its_fix(monkeypatch, tmp_path, kind):
    """It was "the check itself failed: NotADirectoryError ... report this to your instructor"."""
    root, says = _not_a_folder(tmp_path, kind)
    monkeypatch.setenv("GRADSYNC_DATA", str(root))
    check = doctor._run("data", doctor.check_data)
    assert check.failed
    assert check.detail.startswith(f"GRADSYNC_DATA ({root}) {says}")
    assert check.fix.startswith(("point GRADSYNC_DATA at a folder", "remove or repair the link"))
    assert "report this" not in check.fix and "the check itself failed" not in check.detail


def test_an_unreadable_data_folder_fails_with_its_fix(monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/srv/course-data")

    monkeypatch.setattr(data, "ensure_files", refused)
    check = doctor._run("data", doctor.check_data)
    assert check.failed
    assert check.detail == ("the data folder cannot be read: Permission denied "
                            "(/srv/course-data)")
    assert "GRADSYNC_DATA" in check.fix and "report this" not in check.fix


def test_truncated_data_fails_with_delete_and_fetch_again(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADSYNC_DATA", str(tmp_path))
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in data.RAW_FILES:
        (raw / name).write_bytes(b"\x00\x00\x08")  # an interrupted download
    check = doctor.check_data()
    assert check.failed
    assert check.detail.startswith(f"{raw / 'train-images-idx3-ubyte'} is not an IDX file")
    assert check.fix.startswith(f"delete {raw / 'train-images-idx3-ubyte'} and run `python -m "
                                "gradsync_tutorial.data")


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_every_file_is_checked_and_a_damaged_one_named(monkeypatch, tmp_path, damage):
    """Training images truncated to half were "ok": the doctor read the test split only."""
    monkeypatch.setenv("GRADSYNC_DATA", str(tmp_path))
    raw = tmp_path / "FashionMNIST" / "raw"
    _, blobs = fake_files()
    write_unpacked(raw, blobs)
    assert doctor.check_data().status == "ok"
    _damage(damage, raw, blobs)
    check = doctor.check_data()
    name, message = DAMAGES[damage]
    assert check.failed and str(raw / name) in check.detail
    assert re.search(message, f"{check.detail}\nfix: {check.fix}")
    assert "delete" in check.fix and "python -m gradsync_tutorial.data" in check.fix


def test_data_present_here():
    check = doctor.check_data()
    assert check.status == "ok"
    assert "4 files checked: 60,000 training and 10,000 test images" in check.detail


def test_a_blocked_port_fails_with_a_firewall_hint(monkeypatch):
    assert doctor.check_network().status == "ok"

    def blocked(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(doctor.socket, "create_server", blocked)
    check = doctor.check_network()
    assert check.failed and "Permission denied" in check.detail
    assert "firewall" in check.fix and "127.0.0.1" in check.fix


@pytest.mark.parametrize("platform, hint", [
    ("darwin", "click Allow"),
    ("darwin", "GLOO_SOCKET_IFNAME=lo0"),
    ("win32", "Windows Defender Firewall"),
    ("linux", "GLOO_SOCKET_IFNAME=lo,"),
])
def test_a_launch_that_hangs_explains_the_firewall_of_each_system(monkeypatch, platform, hint):
    def hangs(*args, **kwargs):
        raise timeout_error(2, finished=[], timeout=7, startup=60, started=True,
                            report="rank 0 is waiting in dist.all_reduce")

    monkeypatch.setattr(launcher, "launch", hangs)
    monkeypatch.setattr(doctor, "_platform", lambda: platform)
    check = doctor.check_launch(timeout=7)
    assert check.failed
    # The launcher's own words (its first line), not a wording of the doctor's.
    assert check.detail == ("a 2-rank launch failed: launch timed out after 7 s: ranks 0, 1 had "
                            "not finished. All ranks were stopped.")
    assert hint in check.fix


def test_a_launch_that_fails_shows_the_error(monkeypatch):
    def fails(*args, **kwargs):
        failure = launcher.Failure(1, "raised", exc_type="RuntimeError",
                                   message="Connection refused\nmore", traceback="Traceback")
        raise rank_failed_error([failure], started=True)

    monkeypatch.setattr(launcher, "launch", fails)
    check = doctor.check_launch()
    assert check.failed
    assert check.detail == ("a 2-rank launch failed: rank 1 raised RuntimeError: Connection "
                            "refused")  # the launcher's first line


def test_epoch_timing_and_the_notebook_estimates(monkeypatch):
    epoch = doctor.measure_epoch(steps=6)
    assert epoch.status in ("ok", "warn") and epoch.value > 0
    assert "extrapolated to 235" in epoch.detail

    monkeypatch.setattr(doctor.os, "getloadavg", lambda: (9.5, 9.0, 9.0), raising=False)
    monkeypatch.setattr(doctor, "cpu_count", lambda: 4)
    busy = doctor.measure_epoch(steps=1)
    assert "; the machine is busy (load average 9.5 on 4 cores), so this is pessimistic" in (
        busy.detail)
    monkeypatch.setattr(doctor.os, "getloadavg", lambda: (0.5, 0.5, 0.5), raising=False)
    assert "busy" not in doctor.measure_epoch(steps=1).detail

    twice = doctor.notebook_estimates(2 * doctor.REFERENCE_EPOCH_SECONDS)
    assert twice.status == "info" and "(2.00x the reference machine's" in twice.detail
    for name, seconds in doctor.REFERENCE_SECONDS.items():
        line = next(x for x in twice.detail.splitlines() if x.startswith(name))
        assert line.endswith(doctor.duration(2 * seconds))
    monkeypatch.setattr(doctor, "REFERENCE_SECONDS", {"00_a.ipynb": 60, "09_new.ipynb": None})
    slow = doctor.notebook_estimates(20 * doctor.REFERENCE_EPOCH_SECONDS)
    assert slow.status == "warn"
    assert "00_a.ipynb    ~ 20 min" in slow.detail
    assert "09_new.ipynb  (not measured yet)" in slow.detail
    assert "SMOKE_TEST=1" in slow.detail


# --------------------------------------------------------------------------------------------
# The report and the exit status
# --------------------------------------------------------------------------------------------


def _fake_checks(monkeypatch, **overrides):
    """Replace the slow checks by instant ones; ``overrides`` replaces some by name."""
    fakes = {
        "check_devices": lambda: Check("devices", "info", "no CUDA GPU"),
        "check_backends": lambda: Check("backends", "ok", "gloo available"),
        "check_data": lambda: Check("data", "ok", "Fashion-MNIST"),
        "check_network": lambda: Check("network", "ok", "works"),
        "check_launch": lambda: Check("launch", "ok", "2 ranks", value=2.0),
        "measure_epoch": lambda: Check(
            "epoch", "ok", "one epoch", value=doctor.REFERENCE_EPOCH_SECONDS
        ),
    }
    fakes.update(overrides)
    for name, fake in fakes.items():
        monkeypatch.setattr(doctor, name, fake)


def test_exit_status_zero_when_ready(monkeypatch, capsys):
    _fake_checks(monkeypatch)
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "  ok    launch     2 ranks" in out
    assert "(1.00x the reference machine's" in out
    assert out.splitlines()[-1].startswith("Ready: every check passed. (")


def test_exit_status_one_and_a_fix_per_failure(monkeypatch, capsys):
    def crashes():
        raise RuntimeError("boom")

    _fake_checks(
        monkeypatch,
        check_data=lambda: Check("data", "FAIL", "Fashion-MNIST is not in /x", "run make data"),
        check_network=crashes,
        measure_epoch=lambda: Check("epoch", "warn", "slow", value=45.0),
    )
    assert doctor.main([]) == 1
    lines = capsys.readouterr().out.splitlines()
    data_line = lines.index("  FAIL  data       Fashion-MNIST is not in /x")
    assert lines[data_line + 1] == "                   fix: run make data"
    assert "  FAIL  network    the check itself failed: RuntimeError: boom" in lines
    assert "  warn  epoch      slow" in lines
    assert lines[-1].startswith("NOT READY: 2 checks failed (data, network). Follow each 'fix:'")


def test_without_torch_the_other_checks_are_skipped(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "  FAIL  torch      torch cannot be imported" in out
    assert "the other checks need torch" in out
    assert "launch" not in out


def test_python_m_gradsync_tutorial_dispatches(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(doctor, "main", lambda argv: seen.append(argv) or 3)
    assert cli.main(["doctor", "--extra"]) == 3
    assert seen == [["--extra"]]
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "doctor" in capsys.readouterr().err
    monkeypatch.undo()
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--help"])
    assert info.value.code == 0
    assert "usage: python -m gradsync_tutorial doctor" in capsys.readouterr().out
