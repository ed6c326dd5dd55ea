"""Is this machine ready for the course? ``python -m gradsync_tutorial doctor`` says, in ~15 s.

Instructors send attendees this one command before a workshop (``make doctor`` does the same).
It prints one line per check, ``ok``, ``info``, ``warn`` or ``FAIL``, and under every failure a
``fix:`` line that says what to do:

* ``python``, ``torch``: the versions (Python >= 3.10, torch >= 2.14, torchvision >= 0.29);
* ``devices``, ``backends``: the CUDA GPUs, and whether gloo and nccl are available;
* ``data``: whether Fashion-MNIST is on disk (it never downloads: run ``make data`` for that);
* ``network``: whether this machine may connect to itself (127.0.0.1), as the ranks do;
* ``launch``: a real 2-rank launch with one ``all_reduce``, timed (firewall prompts show here);
* ``epoch``: the time of one training epoch of notebook 01: the median time of up to
  ``TIMING_STEPS`` steps (about 3 s of them), extrapolated to the full 60,000 images;
* ``notebooks``: each notebook's expected run time on this machine: its time on the reference
  machine (:data:`REFERENCE_SECONDS`) scaled by this machine's epoch time over the reference's.

The exit status is 0 when no check failed (warnings allowed), 1 otherwise. (The example is
skipped when the docstrings run as tests: it takes ~15 s and its output is the machine's.)

    >>> from gradsync_tutorial import doctor
    >>> doctor.main([])                                 # doctest: +SKIP
    gradsync-tutorial doctor: can this machine run the course?
      ok    python     3.11.7 (CPython, Linux x86_64)
      ...
    Ready: every check passed.
    0

Each check is a function returning :class:`Check`, so tests can call them one by one (nine
checks, each with the fix it prints, in one place an instructor can read). Not
taught in a notebook: it is run once, before the course (``make doctor``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._wording import duration, plural
from .device import gpu_count, local_device
from .launcher.preflight import (
    cpu_count,  # the cores this process may use, as the launch counts them
)

__all__ = [
    "REFERENCE_EPOCH_SECONDS",
    "REFERENCE_SECONDS",
    "Check",
    "check_backends",
    "check_data",
    "check_devices",
    "check_launch",
    "check_network",
    "check_python",
    "check_torch",
    "main",
    "measure_epoch",
    "notebook_estimates",
]

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 14)  # every notebook's asserts were seen to pass on 2.14.1 (08-13: new APIs)
MIN_TORCHVISION = (0, 29)  # the torchvision of torch 2.14

#: The reference run, ``reference_times.json`` beside this file: every notebook executed top to
#: bottom in full (non-smoke) mode on the reference machine (2 CPU cores, no GPU, nothing else
#: running), in one run of ``make times``, which writes the file (``tools/time_table.py``).
REFERENCE_RUN: dict = json.loads(
    (Path(__file__).with_name("reference_times.json")).read_text(encoding="utf-8"))
#: Each notebook's run time in seconds, from that run. None: not measured yet.
REFERENCE_SECONDS: dict[str, float | None] = {
    name: round(seconds) for name, seconds in REFERENCE_RUN["notebooks"].items()}
#: :func:`measure_epoch`'s estimate of one full Fashion-MNIST epoch on the reference machine.
REFERENCE_EPOCH_SECONDS: float = REFERENCE_RUN["epoch_seconds"]  # the same run

TRAIN_IMAGES, GLOBAL_BATCH = 60_000, 256
TIMING_STEPS = 40  # at most this many timed training steps, after WARMUP_STEPS; their median
MIN_STEPS = 5  # ... at least this many, and more only while TIMING_BUDGET seconds last
TIMING_BUDGET = 3.0
WARMUP_STEPS = 3
LAUNCH_TIMEOUT = 60.0  # seconds for the 2-rank smoke test, start-up included
SLOW_LAUNCH = 20.0  # a first launch slower than this gets a warning
SLOW_NOTEBOOK = 15 * 60  # a notebook expected to run longer than this gets a warning


@dataclass
class Check:
    """The outcome of one check: ``status`` is "ok", "info", "warn" or "FAIL"."""

    name: str
    status: str
    detail: str
    fix: str = ""
    value: float | None = None  # a measurement, for the checks that make one (seconds)

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def _platform() -> str:
    """``sys.platform``, behind a function so that tests can pretend to be on macOS."""
    return sys.platform


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"2.14.1+cu130"`` -> ``(2, 14, 1)``; stops at the first part that is not a number."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d*", part).group()
        if not digits:
            break
        numbers.append(int(digits))
        if digits != part:  # "0rc1", "0a0": a pre-release; its number is enough
            break
    return tuple(numbers)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


INSTALL_FIX = (
    "in the course's environment run `make install` (or `pip install -e .`), or upgrade by hand: "
    "pip install --upgrade 'torch>=2.14' 'torchvision>=0.29' (conda: conda env update -f "
    "environment.yml)."
)


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------


def check_python(version_info: Sequence[int] | None = None) -> Check:
    """Python >= 3.10."""
    version = tuple(sys.version_info[:3] if version_info is None else version_info[:3])
    detail = (f"{_dotted(version)} ({platform.python_implementation()}, {platform.system()} "
              f"{platform.machine()})")
    if version < MIN_PYTHON:
        return Check("python", "FAIL", detail, f"install Python {_dotted(MIN_PYTHON)} or newer "
                     "(e.g. `conda env create -f environment.yml`) and create the course's "
                     "environment with it.")
    return Check("python", "ok", detail)


def check_torch() -> Check:
    """torch >= 2.14 and torchvision >= 0.29, importable: the versions the course was proven on."""
    try:
        import torch
    except ImportError as e:
        return Check("torch", "FAIL", f"torch cannot be imported ({e})", INSTALL_FIX)
    try:
        import torchvision

        vision = torchvision.__version__
    except ImportError as e:
        vision = None
        vision_error = str(e)
    detail = f"torch {torch.__version__}, torchvision {vision or 'missing'}"
    too_old = []
    if _version_tuple(torch.__version__) < MIN_TORCH:
        too_old.append(f"torch {torch.__version__} is older than {_dotted(MIN_TORCH)}, the "
                       "release every notebook was checked on (notebooks 08 to 13 use FSDP2, "
                       "DTensor and pipelining APIs that older releases lack or change)")
    if vision is None:
        too_old.append(f"torchvision cannot be imported ({vision_error})")
    elif _version_tuple(vision) < MIN_TORCHVISION:
        too_old.append(f"torchvision {vision} is older than {_dotted(MIN_TORCHVISION)}")
    if too_old:
        return Check("torch", "FAIL", f"{detail}: {'; '.join(too_old)}", INSTALL_FIX)
    return Check("torch", "ok", detail)


def check_devices() -> Check:
    """The CUDA GPUs (information only: the course runs on CPUs too)."""
    import torch

    gpus = gpu_count()
    if not gpus:
        cores = cpu_count()
        return Check("devices", "info", f"no CUDA GPU: the notebooks run on the CPU ({cores} "
                     "cores), one process per rank, over gloo")
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    listed = ", ".join(f"cuda:{i} {name}" for i, name in enumerate(names))
    return Check("devices", "info", f"{plural(gpus, 'CUDA GPU')}: {listed}")


def check_backends() -> Check:
    """gloo must be available; nccl matters only with a GPU per rank."""
    import torch.distributed as dist

    if not dist.is_available():
        return Check("backends", "FAIL", "this torch build has no torch.distributed",
                     "install torch from pytorch.org or PyPI (every official build includes "
                     "torch.distributed): " + INSTALL_FIX)
    gloo, nccl = dist.is_gloo_available(), dist.is_nccl_available()
    detail = (f"gloo {'available' if gloo else 'NOT available'}; nccl "
              f"{'available' if nccl else 'not available'}")
    if not gloo:
        return Check("backends", "FAIL", detail, "the course needs gloo, which every official "
                     "torch build includes: " + INSTALL_FIX)
    if gpu_count() >= 2 and not nccl:
        return Check("backends", "warn", detail + " although there are GPUs (nccl exists on "
                     "Linux only): launches with a GPU per rank pick nccl; pass backend='gloo' "
                     "to gst.launch")
    if not gpu_count():
        detail += " (nccl is only used with a GPU per rank)"
    return Check("backends", "ok", detail)


def check_data() -> Check:
    """Fashion-MNIST on disk, every file whole. Never downloads (unpacks a system copy, if any).

    Checks all four files (train and test, images and labels): present, unpacked, as long as
    their headers say, as many labels as images.
    """
    from . import data

    try:
        raw = data.ensure_files("fashion-mnist", download=False)  # verifies every file
        shapes = data.verify("fashion-mnist")
    except FileNotFoundError as e:
        root = data.resolve_root(None)
        lines = str(e).splitlines()
        found = lines[1].strip() if len(lines) > 1 else lines[0]  # "1. unpacked files ..."
        return Check(
            "data", "FAIL", f"Fashion-MNIST is not in {root} ({found.lstrip('1. ')})",
            "run `make data` (or `python -m gradsync_tutorial.data`) on a machine with "
            "internet; for an offline workshop copy the instructor's prepared data/ folder to "
            f"{root}, or point the GRADSYNC_DATA environment variable at a copy.",
        )
    except data.DataError as e:  # present but unusable: named file, and what to do
        return Check("data", "FAIL", e.problem, e.fix)
    except OSError as e:  # the folder cannot be read: say so, with the fix (not "report this")
        return Check("data", "FAIL", f"the data folder cannot be read: {e.strerror or e} "
                     f"({e.filename or data.DEFAULT_ROOT})",
                     "point the GRADSYNC_DATA environment variable at a folder you may read "
                     "and write, or unset it, then run `make data`.")
    train, test = shapes["train-images-idx3-ubyte"][0], shapes["t10k-images-idx3-ubyte"][0]
    return Check("data", "ok", f"Fashion-MNIST in {raw} (4 files checked: {train:,} training "
                 f"and {test:,} test images)")


def _network_fix() -> str:
    return ("a firewall, VPN or security program blocks connections from this machine to "
            "itself (127.0.0.1), which the ranks need: allow Python in it, or try with the VPN "
            "off.")


def check_network() -> Check:
    """Can this process open a port on 127.0.0.1 and connect to it, as the ranks do?"""
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                peer, _ = server.accept()
                with peer:
                    client.sendall(b"ping")
                    peer.settimeout(5)
                    if peer.recv(4) != b"ping":
                        raise OSError("the bytes sent did not arrive")
    except OSError as e:
        return Check("network", "FAIL", f"a connection to 127.0.0.1 failed: {e}", _network_fix())
    return Check("network", "ok", "connections to this machine (127.0.0.1) work")


def _smoke(rank: int, world_size: int) -> tuple[float, str]:
    """What every notebook does first: each rank contributes rank + 1, all receive the sum."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0], device=local_device())
    dist.all_reduce(t)
    return t.item(), dist.get_backend()


def _launch_fix(what: str) -> str:
    platform_ = _platform()
    if platform_ == "darwin":
        return (f"{what} On macOS a firewall prompt may be waiting for you, \"Do you want the "
                "application Python to accept incoming network connections?\": click Allow, then "
                "run the doctor again. If you denied it, allow Python in System Settings > "
                "Network > Firewall > Options; or run with GLOO_SOCKET_IFNAME=lo0, which keeps "
                "the ranks on the loopback interface.")
    if platform_.startswith("win"):
        return (f"{what} Windows Defender Firewall may have asked whether Python may use the "
                "network: allow it on private networks (Windows Security > Firewall & network "
                "protection > Allow an app through firewall), then run the doctor again.")
    return (f"{what} A firewall may block the ranks' connections, or this machine's hostname "
            "may resolve to an address that is not this machine (check `getent hosts "
            "$(hostname)`): run with GLOO_SOCKET_IFNAME=lo, which keeps gloo on the loopback "
            "interface.")


def check_launch(timeout: float = LAUNCH_TIMEOUT) -> Check:
    """A real launch: 2 ranks, one all_reduce, timed (start-up included)."""
    from . import launcher

    start = time.perf_counter()
    try:
        results = launcher.launch(_smoke, world_size=2, timeout=timeout, reuse_workers=False)
    except (launcher.LaunchError, OSError) as e:
        # The launcher's own first line (who failed and how, or which ranks hung): the doctor
        # words no launch failure of its own, it adds what to check on this platform.
        hung = isinstance(e, launcher.LaunchTimeoutError)
        return Check("launch", "FAIL", f"a 2-rank launch failed: {str(e).splitlines()[0]}",
                     _launch_fix("The ranks could not reach each other." if hung
                                 else "Read the error above."))
    seconds = time.perf_counter() - start
    sums = [r[0] for r in results]
    if sums != [3.0, 3.0]:
        return Check("launch", "FAIL", f"all_reduce returned {sums}, not [3.0, 3.0]",
                     "reinstall torch (" + INSTALL_FIX + ")", seconds)
    detail = f"2 ranks started and all-reduced over {results[0][1]} in {seconds:.1f} s"
    if seconds > SLOW_LAUNCH:
        return Check("launch", "warn", detail + ": slow. Each notebook's first launch will take "
                     "as long (an antivirus scanning Python at start-up is a common cause).",
                     value=seconds)
    return Check("launch", "ok", detail, value=seconds)


def measure_epoch(steps: int = TIMING_STEPS) -> Check:
    """Time notebook 01's training step on random data; extrapolate to one full epoch.

    The same model, batch (256) and optimizer as notebook 01, on the device notebook 01 uses
    (a GPU if there is one), with torch's default number of threads. Random images cost as
    much as real ones, so this works before the data is there.
    """
    import torch
    import torch.nn.functional as F

    from .model import Net

    device = local_device()  # the rule every notebook uses: here, rank 0 of 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Net().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
        x = torch.randn(GLOBAL_BATCH, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (GLOBAL_BATCH,), device=device)

        def step() -> None:
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss.item()  # waits for the GPU, as the notebooks' loss.item() does

        for _ in range(WARMUP_STEPS):
            step()
        times: list[float] = []
        deadline = time.perf_counter() + TIMING_BUDGET
        while len(times) < steps and (len(times) < MIN_STEPS or time.perf_counter() < deadline):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        per_step = statistics.median(times)  # robust to a step slowed by something else
    steps_per_epoch = math.ceil(TRAIN_IMAGES / GLOBAL_BATCH)
    epoch = per_step * steps_per_epoch
    detail = (f"one Fashion-MNIST epoch ~ {epoch:.1f} s on {device} (the median of {len(times)} "
              f"steps of {GLOBAL_BATCH} timed, extrapolated to {steps_per_epoch}; "
              f"{torch.get_num_threads()} threads)")
    busy = _busy()
    if busy:
        detail += f"; {busy}, so this is pessimistic"
    ratio = epoch / REFERENCE_EPOCH_SECONDS
    if ratio > 4:
        return Check("epoch", "warn", f"{detail}: {ratio:.1f}x slower than the reference "
                     "machine. The full notebooks will be slow here; run them with the "
                     "environment variable SMOKE_TEST=1 for a small subset of the data.",
                     value=epoch)
    return Check("epoch", "ok", detail, value=epoch)


def _busy() -> str:
    """"the machine is busy (load average 3.1 on 2 cores)", or "" (or where unknown)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has no load average
        return ""
    cores = cpu_count()
    if load <= cores:
        return ""
    return f"the machine is busy (load average {load:.1f} on {cores} cores)"


def notebook_estimates(epoch_seconds: float) -> Check:
    """Each notebook's expected run time here: its reference time x (epoch here / reference)."""
    ratio = epoch_seconds / REFERENCE_EPOCH_SECONDS
    width = max(len(name) for name in REFERENCE_SECONDS)
    lines, slow = [], []
    for name, seconds in REFERENCE_SECONDS.items():
        if seconds is None:
            lines.append(f"{name:<{width}}  (not measured yet)")
            continue
        estimate = seconds * ratio
        lines.append(f"{name:<{width}}  ~ {duration(estimate)}")
        if estimate > SLOW_NOTEBOOK:
            slow.append(name)
    detail = (f"expected run time on this machine ({ratio:.2f}x the reference machine's, "
              "full mode):\n" + "\n".join(lines))
    if slow:
        return Check("notebooks", "warn", detail + f"\n{len(slow)} notebook(s) would take over "
                     f"{SLOW_NOTEBOOK // 60} min: run them with SMOKE_TEST=1 (less data).")
    return Check("notebooks", "info", detail)


# --------------------------------------------------------------------------------------------
# python -m gradsync_tutorial doctor
# --------------------------------------------------------------------------------------------


def _print(check: Check) -> None:
    first, *more = check.detail.splitlines()
    print(f"  {check.status:<5} {check.name:<10} {first}", flush=True)
    for line in more:
        print(f"  {'':<5} {'':<10}   {line}", flush=True)
    if check.fix:
        print(f"  {'':<5} {'':<10} fix: {check.fix}", flush=True)


def _run(name: str, fn: Callable[[], Check]) -> Check:
    """Run one check; a check that crashes is a failure, not a crash of the doctor."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        return Check(name, "FAIL", f"the check itself failed: {type(e).__name__}: {e}",
                     "report this to your instructor, with the whole output.")


def main(argv: Sequence[str] | None = None) -> int:
    """Run every check, print the report; return 0 if none failed, else 1."""
    parser = argparse.ArgumentParser(
        prog="python -m gradsync_tutorial doctor",
        description="Check that this machine can run the gradsync tutorial: versions, devices, "
        "data, a 2-rank launch, and how long the notebooks will take.",
    )
    parser.parse_args(argv)
    print("gradsync-tutorial doctor: can this machine run the course?", flush=True)
    start = time.perf_counter()
    results = []
    for name, fn in (("python", check_python), ("torch", check_torch)):
        results.append(_run(name, fn))
        _print(results[-1])
    try:
        import torch  # noqa: F401 - everything below needs it
    except ImportError:
        print("  (the other checks need torch: fix it first, then run the doctor again)")
    else:
        for name, fn in (("devices", check_devices), ("backends", check_backends),
                         ("data", check_data), ("network", check_network),
                         ("launch", check_launch), ("epoch", measure_epoch)):
            results.append(_run(name, fn))
            _print(results[-1])
        epoch = results[-1].value
        if epoch is not None:
            results.append(_run("notebooks", lambda: notebook_estimates(epoch)))
            _print(results[-1])
    failed = [r.name for r in results if r.failed]
    took = time.perf_counter() - start
    if failed:
        print(f"NOT READY: {plural(len(failed), 'check')} failed "
              f"({', '.join(failed)}). Follow each 'fix:' above, then run `python -m "
              f"gradsync_tutorial doctor` again. ({took:.0f} s)")
        return 1
    warned = [r.name for r in results if r.status == "warn"]
    note = f" (read the warnings: {', '.join(warned)})" if warned else ""
    print(f"Ready: every check passed{note}. ({took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
