"""``torchrun`` for the tests: the agent forked from an interpreter that imported it already.

The tests of snippets, scripts and peers start a torchrun agent again and again. On 2 cores an
agent spent about 1.8 s of its 5.4 s importing torch, before it started a rank. Here (Linux)
the agent is forked by multiprocessing's forkserver, which imported ``torch.distributed.run``
once. The rest is torchrun as a reader runs it: its ``main`` with the same command line,
working directory, environment and exit status. The agent starts each rank as a fresh
interpreter, as ever. tests/test_torchrun.py checks that it says what ``python -m
torch.distributed.run`` says, and that it stops its ranks when out of time.

    run = torchrun(["--standalone", "--nproc-per-node", 2, "train.py"], cwd=folder,
                   env=dict(os.environ), timeout=300)  # a subprocess.CompletedProcess
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from gradsync_tutorial.launcher.template import run_module_as_main

AGENT = "torch.distributed.run"
STOP_SECONDS = 30.0  # for an agent out of time to stop its ranks, before it is killed
_context = None


def _forkserver():
    """multiprocessing's forkserver context, with torchrun preloaded, on Linux; None elsewhere
    (Windows cannot fork; macOS may not, once torch is imported, as gst.launch's templates)."""
    global _context
    if _context is None and sys.platform.startswith("linux"):
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([AGENT])
    return _context


def torchrun(args: list, *, cwd: str | Path, env: dict[str, str],
             timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "torch.distributed.run", *args], cwd=cwd, env=env,
    capture_output=True, text=True, timeout=timeout)``, with a preloaded agent. On a timeout
    the agent is stopped with its ranks (:func:`stop`) and ``TimeoutExpired`` raised."""
    command = [sys.executable, "-m", AGENT, *map(str, args)]
    if _forkserver() is None:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="gradsync-torchrun-") as folder:
        streams = [Path(folder, name) for name in ("stdout", "stderr")]
        agent = start(args, cwd=cwd, env=env, streams=streams)
        agent.join(timeout)
        timed_out = agent.exitcode is None
        if timed_out:
            stop(agent)
        out, err = (s.read_text(errors="replace") for s in streams)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, out, err)
    return subprocess.CompletedProcess(command, agent.exitcode, out, err)


def start(args: list, *, cwd: str | Path, env: dict[str, str],
          streams: list[Path]) -> multiprocessing.Process:
    """Start ``torchrun ARGS`` (Linux), its stdout and stderr written to ``streams``."""
    for path in streams:
        path.touch()  # there even if the agent never starts
    agent = _forkserver().Process(target=_agent, args=(
        [str(a) for a in args], str(cwd), env, [str(s) for s in streams]))
    agent.start()
    return agent


def stop(agent: multiprocessing.Process) -> None:
    """Stop an agent and its ranks, which have sessions of their own: torchrun stops them on
    SIGTERM; if it has not in :data:`STOP_SECONDS`, its process group is killed."""
    agent.terminate()
    agent.join(STOP_SECONDS)
    if agent.exitcode is None:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.join()


def _agent(args: list[str], cwd: str, env: dict[str, str], streams: list[str]) -> None:
    """In the forked agent: what ``python -m torch.distributed.run ARGS`` does, in a session of
    its own (as ``start_new_session``), its streams in the files ``streams``; never returns."""

    def prepare() -> None:
        os.setsid()
        for path, fd in zip(streams, (1, 2), strict=True):
            opened = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [AGENT, *args]  # run_module puts the module's path first, as python -m does

    run_module_as_main(AGENT, prepare)
