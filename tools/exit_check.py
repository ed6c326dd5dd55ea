"""Does every program the course ships exit cleanly? Each one run N times under torchrun.

    python tools/exit_check.py                      # every shipped program, 20 runs each
    python tools/exit_check.py -n 5 snippets/04_pitfall_fixes.py

The programs are found, not listed: every ``snippets/*.py``, ``scripts/*.py`` and ``tests/gpu/*.py``
whose docstring shows a ``torchrun`` command line for it. Each run is the first such command, on 2
ranks (``--nproc-per-node 2``), in an empty folder, on the CPU (``CUDA_VISIBLE_DEVICES=""``: gloo).
An abort is a run in which a rank ended by a signal (torchrun reports ``Signal 6 (SIGABRT)``) or
printed gloo's ``terminate called without an active exception``: the abort that marks a good job
failed. The table prints as each program finishes (each run's count to stderr); the exit status is
1 if any run aborted.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.gpu.check import snippet_commands  # noqa: E402 - the docstring's command lines

FOLDERS = ("snippets", "scripts", "tests/gpu")
ABORT = re.compile(r"terminate called|Signal \d+ \(SIG\w+\)|exitcode\s*:\s*-\d+")


def shipped_programs() -> list[Path]:
    """Every program of FOLDERS whose docstring has a ``torchrun ... NAME`` line."""
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).glob("*.py")):
            docstring = path.read_text().split('"""')[1] if '"""' in path.read_text() else ""
            if re.search(rf"^\s*torchrun .*{re.escape(path.name)}", docstring, re.M):
                found.append(path)
    return found


def command(program: Path) -> list[str]:
    """The docstring's first torchrun line on 2 ranks, repository paths in it made absolute."""
    words = snippet_commands(program, 2)[0]
    return [str(REPO / w) if (REPO / w).is_file() and "/" in w else w for w in words]


def run_once(program: Path) -> tuple[bool, int]:
    """One run in an empty folder: (aborted, exit status)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SMOKE_TEST")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.setdefault("GRADSYNC_DATA", str(REPO / "data"))
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.run(command(program), cwd=folder, env=env, capture_output=True,
                              text=True, timeout=600)
    return bool(ABORT.search(proc.stdout + proc.stderr)), proc.returncode


def check(program: Path, runs: int) -> tuple[int, int, list[int]]:
    """(runs, aborts, the exit statuses seen) for one program."""
    results = []
    for run in range(1, runs + 1):
        results.append(run_once(program))
        print(f"  {program.name}: run {run}/{runs}, aborts so far {sum(a for a, _ in results)}",
              file=sys.stderr, flush=True)
    return runs, sum(aborted for aborted, _ in results), sorted({rc for _, rc in results})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("programs", nargs="*", type=Path, help="default: every shipped program")
    parser.add_argument("-n", "--runs", type=int, default=20, help="runs per program (20)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="programs checked at once (1)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.jobs < 1:
        parser.error("--runs and --jobs must be 1 or more")
    programs = [p.resolve() for p in args.programs] or shipped_programs()
    missing = [str(p) for p in programs if not p.is_file()]
    if missing:
        parser.error(f"no such program: {', '.join(missing)}")
    print("| program | runs | aborts | exit statuses |\n|---|---|---|---|", flush=True)
    total = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for program, (runs, aborts, statuses) in zip(
                programs, pool.map(lambda p: check(p, args.runs), programs), strict=True):
            name = program.relative_to(REPO) if program.is_relative_to(REPO) else program
            print(f"| {name} | {runs} | {aborts} | {', '.join(map(str, statuses))} |", flush=True)
            total += aborts
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
