"""``make gpu-check``: run what the course says works on GPUs, on this machine's GPUs, and print
one table (what ran, on which device and backend, the figures) to paste into the README.

    python -m tests.gpu.check                 # everything, within --budget seconds (default 540)
    python -m tests.gpu.check --plan-for 2    # what a machine with 2 GPUs would run; runs nothing

On a machine with N >= 1 CUDA GPUs, with R = min(N, 2) ranks:

* every snippet (``snippets/NN_*.py``, found by glob) under torchrun with nccl on R ranks, each
  command of its docstring in turn, in an empty folder;
* both scripts (``--smoke``) with nccl on R ranks, checked against each other (manual averaging
  vs DDP) and against a resumed run;
* gloo with CUDA tensors on 2 ranks (``tests/gpu/gloo_cuda.py``): what a 1-GPU machine can test
  of 2 ranks, since nccl cannot put two ranks on one GPU;
* the checks of every notebook whose source calls ``gst.local_device()`` (found, not listed:
  ``gpu_notebooks()``; 00 to 13 today), ``SMOKE_TEST=1`` under nbval: every
  launch with a GPU per rank runs nccl on them, a launch with more ranks than GPUs gloo on the
  CPU, and the notebook's own process uses GPU 0.

Each part has a time limit, and the whole a budget: a part that no longer fits is reported as
not run. Without a GPU every part is reported as skipped, with the reason, and the exit status
is 0; with one, it is 1 if any part failed. ``tests/gpu/test_on_gpu.py`` runs the same parts as
pytest tests marked ``gpu``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gradsync_tutorial import notebooks

REPO = Path(__file__).resolve().parents[2]
BUDGET = 540  # seconds for everything: a GPU machine lent for ~10 minutes


@dataclass
class Part:
    """One row of the table: what runs, how, and for how long at most."""

    kind: str  # "snippet", "script", "gloo+cuda", "notebook"
    name: str
    ranks: int
    device: str
    backend: str
    commands: list[list[str]] = field(default_factory=list)  # run in turn, in one folder
    timeout: int = 120  # seconds, all its commands together
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Row:
    part: Part
    result: str  # "ok", "FAILED", "skipped", "not run"
    figures: str = ""
    seconds: float = 0.0


def torchrun(ranks: int, program: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), str(program), *args]


def snippet_commands(snippet: Path, ranks: int) -> list[list[str]]:
    """The torchrun command lines of a snippet's docstring, on ``ranks`` ranks."""
    text = snippet.read_text().split('"""')[1].replace("\\\\\n", " ").replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if not line.strip().startswith("torchrun "):
            continue
        words = shlex.split(line, comments=True)
        at = [i for i, word in enumerate(words) if word.endswith(snippet.name)]
        if at:
            commands.append(torchrun(ranks, snippet, *words[at[0] + 1:]))
    return commands or [torchrun(ranks, snippet)]


def gpu_notebooks() -> list[Path]:
    """The notebooks with GPU behaviour to check: those whose source calls ``local_device()``
    (their ranks, or their kernel, put tensors on the GPU when there is one), in course order."""
    return [nb for nb in notebooks.paths()
            if "local_device(" in nb.with_suffix(".py").read_text()]


def plan(gpus: int) -> list[Part]:
    """What a machine with ``gpus`` CUDA GPUs runs, in order of importance."""
    ranks = max(1, min(gpus, 2))
    nccl = [f"cuda:{r}" for r in range(ranks)]
    device = " ".join(nccl) if gpus else "cuda"
    parts = []
    for snippet in notebooks.paths("snippet", REPO):
        parts.append(Part("snippet", f"snippets/{snippet.name}", ranks, device, "nccl",
                          snippet_commands(snippet, ranks), timeout=90))
    parts.append(Part("gloo+cuda", "tests/gpu/gloo_cuda.py", 2, "cuda:0 (both ranks)"
                      if gpus < 2 else "cuda:0 cuda:1", "gloo",
                      [torchrun(2, REPO / "tests" / "gpu" / "gloo_cuda.py")], timeout=90))
    scripts = REPO / "scripts"
    parts.append(Part("script", "scripts/train_manual.py, train_ddp.py --smoke", ranks, device,
                      "nccl", [torchrun(ranks, scripts / s, "--smoke", "--epochs", "2",
                                        "--checkpoint", f"{s}.pt")
                               for s in ("train_manual.py", "train_ddp.py")], timeout=180))
    parts.append(Part("script", "scripts/train_ddp.py --resume", ranks, device, "nccl",
                      [torchrun(ranks, scripts / "train_ddp.py", "--smoke", "--epochs", str(e),
                                "--checkpoint", "resumed.pt", "--resume") for e in (1, 2)]
                      + [torchrun(ranks, scripts / "train_ddp.py", "--smoke", "--epochs", "2",
                                  "--checkpoint", "straight.pt")], timeout=180))
    kernel = f"kernel cuda:0; ranks on cuda up to {gpus}, more on cpu"
    for notebook in gpu_notebooks():
        parts.append(Part("notebook", f"notebooks/{notebook.name}", 0, kernel, "nccl / gloo",
                          [[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(notebook)]], timeout=180, env={"SMOKE_TEST": "1"}))
    return parts


# -- figures: what each part printed that a reader wants in the table ---------------------------


def figures(part: Part, outputs: list[str], folder: Path) -> str:
    text = "\n".join(outputs)
    found = []
    nccl = len(re.findall(r"NCCL version \S+", text))
    if part.backend == "nccl":
        found.append(f"nccl started {nccl}x" if nccl else "nccl never started")
    if part.kind == "snippet":
        checks = sorted(set(re.findall(r"^rank 0: (.*)$", text, re.M)))
        losses = re.findall(r"^epoch (\d+): loss (\S+)", text, re.M)
        found += checks or [f"epoch {e}: loss {loss}" for e, loss in losses[-1:]]
    elif part.kind == "script":
        found += re.findall(r"^parameters equal across .*$", text, re.M)[-1:]
        found += [f"last {m}" for m in re.findall(r"^epoch 2/2: loss \S+", text, re.M)[-1:]]
        found.append(_compare_checkpoints(part, folder))
    elif part.kind == "gloo+cuda":
        found += re.findall(r"^rank 0: (.*)$", text, re.M)
    elif part.kind == "notebook":
        found += re.findall(r"^(\d+ (?:passed|failed).*?) in ", text, re.M)[-1:]
    return "; ".join(f for f in found if f)


def _compare_checkpoints(part: Part, folder: Path) -> str:
    import torch

    def load(name):
        path = folder / name
        return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None

    pairs = {"manual vs DDP": ("train_manual.py.pt", "train_ddp.py.pt"),
             "resumed vs straight": ("resumed.pt", "straight.pt")}
    for what, (a, b) in pairs.items():
        a, b = load(a), load(b)
        if a is not None and b is not None:
            diff = max((a["model"][k].double() - b["model"][k].double()).abs().max().item()
                       for k in a["model"])
            return f"{what}: max |difference| {diff:.1e}"
    return ""


def failed(part: Part, runs: list[subprocess.CompletedProcess], text: str, shown: str) -> str:
    """Why a part failed, or '': an exit status, nccl not used, a claimed equality not held."""
    if any(run.returncode for run in runs):
        return f"exit {runs[-1].returncode}"
    if part.backend == "nccl" and not re.search(r"NCCL version", text):
        return "exited 0, but nccl never started (fell back to gloo?)"
    # the course's claim on 1 or 2 ranks: manual = DDP and resumed = straight, to the last bit
    if part.kind == "script" and "max |difference| 0.0e+00" not in shown:
        return "the runs differ (notebooks 03 and 06 say: bit for bit on 2 ranks)"
    return ""


# -- running -----------------------------------------------------------------------------------


def run_part(part: Part, folder: Path, time_left: float) -> Row:
    limit = min(part.timeout, time_left)
    if limit < part.timeout / 2:  # too little time left to be worth starting
        return Row(part, "not run", f"out of time: {time_left:.0f} s left of the budget")
    env = dict(os.environ, NCCL_DEBUG="VERSION", **part.env)
    if part.kind != "notebook":  # torchrun's own default for several ranks, for one rank too
        env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if part.kind == "snippet":  # a reader's copy: torch only, not the course's package
        env.pop("PYTHONPATH")
    start, runs, outputs = time.perf_counter(), [], []
    for command in part.commands:
        remaining = limit - (time.perf_counter() - start)
        try:
            run = subprocess.run(command, cwd=folder if part.kind != "notebook" else REPO,
                                 env=env, capture_output=True, text=True, timeout=remaining)
        except subprocess.TimeoutExpired:
            return Row(part, "FAILED", f"timed out after {limit:.0f} s",
                       time.perf_counter() - start)
        runs.append(run)
        outputs.append(run.stdout + run.stderr)
        if run.returncode:
            break
    seconds = time.perf_counter() - start
    text = "\n".join(outputs)
    shown = figures(part, outputs, folder)
    why = failed(part, runs, text, shown)
    if why:
        tail = " | ".join(text.strip().splitlines()[-3:])[-300:]
        return Row(part, "FAILED", f"{why}: {tail}", seconds)
    return Row(part, "ok", shown, seconds)


def missing_data() -> str:
    """Why the parts that train on Fashion-MNIST cannot run here, or ''."""
    try:
        from gradsync_tutorial.data import ensure_files

        ensure_files(download=False)
    except Exception as e:  # noqa: BLE001 - any reason is a reason to skip, said in the table
        return f"no Fashion-MNIST here ({str(e).splitlines()[0][:120]}): make data"
    return ""


def machine() -> tuple[int, str]:
    """(number of CUDA GPUs, one line about this machine)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(gpus)})) or "none"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else "-"
    line = (f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, "
            f"cuDNN {torch.backends.cudnn.version() if gpus else '-'}, NCCL {nccl}; "
            f"{gpus} GPU(s): {names}")
    return gpus, line


def table(rows: list[Row]) -> str:
    lines = ["| part | ranks | device | backend | result | figures | s |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        p = row.part
        figures_text = row.figures.replace("|", "\\|")
        lines.append(f"| {p.name} | {p.ranks or 'its own'} | {p.device} | {p.backend} | "
                     f"{row.result} | {figures_text} | {row.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=BUDGET,
                        help="seconds for everything (%(default)s)")
    parser.add_argument("--plan-for", type=int, metavar="N",
                        help="print what a machine with N GPUs would run, and run nothing")
    parser.add_argument("--only", default="", help="run only parts whose name contains this")
    args = parser.parse_args(argv)
    if args.plan_for is not None:
        parts = plan(args.plan_for)
        print(f"plan for {args.plan_for} GPU(s):")
        print(table([Row(p, "planned", f"{len(p.commands)} command(s), at most {p.timeout} s")
                     for p in parts]))
        return 0
    gpus, about = machine()
    print(f"gpu-check on {about}", flush=True)
    parts = [p for p in plan(max(gpus, 1)) if args.only in p.name]
    rows, start = [], time.perf_counter()
    no_data = missing_data() if gpus else ""
    for part in parts:
        if not gpus:
            rows.append(Row(part, "skipped", "no CUDA GPU visible (torch.cuda.device_count() "
                                             "== 0): nothing here can run on one"))
            continue
        if no_data and part.kind in ("script", "notebook"):
            rows.append(Row(part, "skipped", no_data))
            continue
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
            row = run_part(part, Path(folder), args.budget - (time.perf_counter() - start))
        print(f"  {row.result:7} {part.name} ({row.seconds:.0f} s)", flush=True)
        rows.append(row)
    print(table(rows))
    counts = {r: sum(row.result == r for row in rows) for r in ("ok", "FAILED", "skipped",
                                                                 "not run")}
    print(", ".join(f"{n} {r}" for r, n in counts.items() if n) + f", on {about}")
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
