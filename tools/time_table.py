"""Measure how long each notebook takes, in one run: the doctor's reference times and the
README's table come from that run (never typed by hand).

    python tools/time_table.py            # make times: measure, record, write (minutes)
    python tools/time_table.py --write    # only write README.md from the record
    python tools/time_table.py --check    # exit 1 if README.md is not as recorded (as the tests)
    python tools/time_table.py --against ../main   # also time that checkout's notebooks
    python tools/time_table.py --only 14  # make times NB=14: time one notebook, merge it in

``--against DIR`` executes, just before each notebook, the notebook of the same number in another
checkout of the course (its own package, nothing written there), and prints each pair's wall
times and CPU times (the kernel's and its workers', from ``getrusage``) and their ratios:
measured side by side. On a busy machine wall times mean little (a rank waits to be scheduled
at every collective); CPU times, the work done, much less affected, are the ratio to read.

Measuring is one run on this machine, in this order: the doctor's epoch estimate
(``gradsync_tutorial.doctor.measure_epoch``), then every notebook built from its source and
executed top to bottom in full mode (``tools/build_notebooks.py``'s ``build``: the committed
outputs come from the same run), then the epoch estimate again. Every notebook found in
``notebooks/`` is timed, so a new one (07, 08, ...) is picked up by itself. The run is
recorded in ``gradsync_tutorial/reference_times.json`` (each notebook's seconds, the epoch's,
the machine, its load average before and after), the one record of these facts: the doctor
(``gradsync_tutorial.doctor.REFERENCE_SECONDS``) reads it as it is, and ``--write`` writes the
README's tables from it and from ``notebooks/course.toml`` (``tools/course.py``): each notebook's
time, each part's and each agenda's total, and the line under the notebook table that says when
and where the run was made.

``--only NN`` (``make times NB=NN``) times one notebook, with the epoch estimate before and
after it, and merges its time into the record: the other notebooks keep theirs, and the record
keeps this notebook's own date, load and epoch under ``"timed alone"``. The README's line under
the table says which figures come from such a run. A whole run (``make times``) starts the record
afresh. A new notebook is timed this way without re-executing, and re-committing, the others.

The times mean something only on a quiet machine: measuring refuses to start when the load
average is 1 or more (``--allow-load`` measures anyway, and the record says so). The course's
budget, printed at the end: each notebook at most 2 minutes, 00 to 06 at most 8 in all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from gradsync_tutorial._wording import duration
from gradsync_tutorial.notebooks import load_tool

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECORD = REPO / "gradsync_tutorial" / "reference_times.json"
README = REPO / "README.md"
BUDGET_EACH, BUDGET_CORE = 120, 8 * 60  # seconds: each notebook; notebooks 00 to 06 together
CORE = [f"{n:02d}" for n in range(7)]  # the notebooks the 8-minute budget is for

def _notebooks_script():
    """tools/build_notebooks.py: the build."""
    return load_tool("build_notebooks", REPO)


def _course():
    """tools/course.py: the README's tables, written from notebooks/course.toml."""
    return load_tool("course", REPO)



def measure(allow_load: bool = False, against: Path | None = None) -> dict:
    """Time the doctor's epoch and every notebook's full build, in one run; the record."""
    load = _load()
    if load is not None and load >= 1 and not allow_load:
        raise SystemExit(f"the load average is {load:.2f}: the times would be false. Measure on a "
                         "quiet machine (nothing else running), or pass --allow-load to record "
                         "them anyway (the record and the README will say so).")
    from gradsync_tutorial import doctor

    build = _notebooks_script()
    epochs = [doctor.measure_epoch().value]
    times, cpu = {}, {}
    for source in build.sources(REPO):
        other = next(iter(sorted((against / "notebooks").glob(f"{source.name[:2]}_*.py"))), None) \
            if against else None
        if other is not None:
            there = _timed(_execute_elsewhere, build, other, against)
        name = build.notebook_of(source).name
        times[name], cpu[name] = _timed(build.build, source, run=True)
        if other is not None:
            print(f"  {name[:2]}: wall {there[0]:.0f} s there, {times[name]:.0f} s here "
                  f"({times[name] / there[0]:.2f}x); CPU {there[1]:.0f} s there, {cpu[name]:.0f} s "
                  f"here ({cpu[name] / there[1]:.2f}x)", flush=True)
    epochs.append(doctor.measure_epoch().value)
    import torch

    return {
        "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cores": os.cpu_count(), "gpus": torch.cuda.device_count(),
                    "platform": f"{platform.system()} {platform.machine()}",
                    "python": platform.python_version(), "torch": torch.__version__,
                    "load_before": load, "load_after": _load()},
        "epoch_seconds": round(sum(epochs) / len(epochs), 2),
        "notebooks": times,
        "cpu_seconds": cpu,  # the kernel's and its workers' (getrusage), for comparisons
    }


def measure_one(number: str, allow_load: bool = False) -> dict:
    """Time notebook ``number`` alone, between two epoch estimates: what :func:`merge` adds."""
    load = _load()
    if load is not None and load >= 1 and not allow_load:
        raise SystemExit(f"the load average is {load:.2f}: the time would be false. Measure on a "
                         "quiet machine, or pass --allow-load.")
    from gradsync_tutorial import doctor

    build = _notebooks_script()
    sources = [s for s in build.sources(REPO) if s.name[:2] == number]
    if not sources:
        raise SystemExit(f"no notebook {number}: name it by its number, e.g. --only 07")
    epochs = [doctor.measure_epoch().value]
    seconds, cpu = _timed(build.build, sources[0], run=True)
    epochs.append(doctor.measure_epoch().value)
    return {"name": build.notebook_of(sources[0]).name, "seconds": seconds, "cpu": cpu,
            "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_before": load, "load_after": _load(),
            "epoch_seconds": round(sum(epochs) / len(epochs), 2)}


def merge(record: dict, timed: dict) -> dict:
    """The record with one notebook's time from :func:`measure_one` (the others unchanged).

        >>> old = {"measured": "then", "notebooks": {"00_a.ipynb": 5.0}, "cpu_seconds": {}}
        >>> new = merge(old, {"name": "01_b.ipynb", "seconds": 9.0, "cpu": 8.0, "measured": "now",
        ...                   "load_before": 0.2, "load_after": 0.9, "epoch_seconds": 7.0})
        >>> new["notebooks"], new["timed alone"]["01_b.ipynb"]["measured"]
        ({'00_a.ipynb': 5.0, '01_b.ipynb': 9.0}, 'now')
    """
    merged = json.loads(json.dumps(record))  # a copy
    name = timed["name"]
    merged["notebooks"] = dict(sorted({**merged["notebooks"], name: timed["seconds"]}.items()))
    merged["cpu_seconds"] = dict(sorted({**merged.get("cpu_seconds", {}),
                                         name: timed["cpu"]}.items()))
    alone = {k: timed[k] for k in ("measured", "load_before", "load_after", "epoch_seconds")}
    merged["timed alone"] = {**merged.get("timed alone", {}), name: alone}
    return merged


def _execute_elsewhere(build, source: Path, checkout: Path) -> None:
    """Execute another checkout's notebook source, full mode, its package first on the kernel's
    path; nothing is written."""
    nb = build.read_source(source)
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), path) if p)
    try:
        build.execute(nb, source.with_suffix(".ipynb"))
    finally:
        os.environ["PYTHONPATH"] = path


def _timed(fn, *args, **kwargs) -> tuple[float, float | None]:
    """(wall seconds, CPU seconds of the processes fn started and waited for) of ``fn(...)``.

    A notebook's kernel is such a process, and its workers are its children, so their CPU time
    is counted once the kernel has ended (None where there is no ``resource``: Windows).
    """
    try:
        import resource
    except ImportError:
        resource = None

    def children() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    cpu, started = children() if resource else 0.0, time.monotonic()
    fn(*args, **kwargs)
    wall = round(time.monotonic() - started, 1)
    return wall, (round(children() - cpu, 1) if resource else None)


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # Windows
        return None


def rendered(record: dict) -> str:
    """README.md as the record says it should read (``tools/course.py`` writes its tables)."""
    return _course().readme(REPO, record)


def budget(record: dict) -> list[str]:
    """What the run says about the course's budget, one line each."""
    times = record["notebooks"]
    over = [f"{n} {duration(round(s))}" for n, s in times.items() if s > BUDGET_EACH]
    core = sum(s for n, s in times.items() if n[:2] in CORE)
    return [f"each notebook <= {duration(BUDGET_EACH)}: "
            + ("met" if not over else "NOT met (" + ", ".join(over) + ")"),
            f"notebooks 00 to 06 <= {duration(BUDGET_CORE)}: {duration(round(core))}, "
            + ("met" if core <= BUDGET_CORE else "NOT met")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="only write, from the record")
    mode.add_argument("--check", action="store_true", help="exit 1 if a file differs")
    parser.add_argument("--allow-load", action="store_true",
                        help="measure even on a busy machine (the record says so)")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="also time another checkout's notebooks, each just before ours")
    parser.add_argument("--only", metavar="NN",
                        help="time notebook NN alone and merge its time into the record")
    args = parser.parse_args(argv)
    if args.only and not (args.write or args.check):
        old = json.loads(RECORD.read_text(encoding="utf-8"))
        record = merge(old, measure_one(args.only.zfill(2), args.allow_load))
        RECORD.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"{RECORD.relative_to(REPO)}: notebook {args.only} merged in")
    elif not (args.write or args.check):
        record = measure(args.allow_load, args.against)
        RECORD.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"{RECORD.relative_to(REPO)}: written")
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    readme = rendered(record)
    if args.check:
        if README.read_text(encoding="utf-8") != readme:
            print(f"README.md: not as {RECORD.name} says: python {Path(__file__).name} --write")
            return 1
        return 0
    README.write_text(readme, encoding="utf-8")
    print("README.md: written from the record")
    for line in budget(record):
        print(f"budget: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
