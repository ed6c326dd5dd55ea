"""A preloaded interpreter that forks the ranks (Linux): torch is imported once, not per rank.

Importing torch costs about 2.5 s of CPU a process here. A launch of 4 ranks paid it 4 times on
every fresh pool: after a failure, at a new world size, with ``reuse_workers=False``. So the
launcher starts one *template* per rank and environment (``python -m
gradsync_tutorial.launcher.template``). The template imports what a worker imports at start-up,
then forks that rank's worker whenever a fresh one is needed. A fork is as fresh as a new
interpreter: nothing but those imports ran before it. It gets the session, environment and
standard streams the launcher would have started it with; its parent-death signal and reaper
come from the worker's usual start-up. Python reseeds ``random`` in a fork; ``numpy.random`` is
not imported yet. One template per rank keeps what a fork cannot redraw, the string-hash seed,
different on each rank.

Seen from the launcher, a forked rank is a :class:`Forked`: a ``subprocess.Popen`` in what the
launcher uses of one (``pid``, ``poll``, ``wait``, ``stdout``, ``stderr``; it signals the rank's
process group itself). Its exit status comes from the template, which is its parent and reaps
it. Set ``GRADSYNC_FRESH_INTERPRETERS=1`` to start every rank as ``python -m`` instead, as other
platforms do.

The environment at the template's start is the one torch read at import. So a template
serves only launches whose environment matches, bar the launcher's own per-rank variables
(:func:`key`). A change to ``TORCH_DISTRIBUTED_DEBUG`` in the notebook starts a new template.

Part of ``gst.launch`` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import os
import pickle
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from . import spawner
from .process_tree import alive
from .protocol import CONTROL_ENV, END_MARK_ENV, PARENT_ENV, TOKEN_ENV, WORKER_MODULE

TEMPLATE_MODULE = "gradsync_tutorial.launcher.template"
SOCKET_ENV = "GRADSYNC_TEMPLATE_FD"  # the template's end of its socket to the launcher
START_SECONDS = 60.0  # a template not ready by then is given up (the launcher execs instead)
MESSAGE_BYTES = 1 << 20  # the largest request: an environment of up to 1 MB
#: Variables that differ between the ranks or between launches, and that torch does not read
#: at import: a template started with other values still serves.
PER_LAUNCH_ENV = (CONTROL_ENV, TOKEN_ENV, END_MARK_ENV, "PYTEST_CURRENT_TEST")


# The variables that can change what importing Python, torch and its libraries does (thread
# pools, allocators, debug levels, sys.path, the locale): a template imported torch with them,
# so another value needs another template. Any other variable reaches the forked rank as set.
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "PYTHON", "OMP_", "KMP_", "GOMP_", "MKL", "OPENBLAS",
                        "CUDA", "NVIDIA", "HIP", "ROCM", "TRITON", "LD_", "LC_", "LANG", "GRADSYNC")
IMPORT_TIME_NAMES = ("PATH", "HOME", "TMPDIR", "VIRTUAL_ENV", "CONDA_PREFIX")


def key(env: dict[str, str], cwd: str) -> tuple:
    """What a template must share with a launch to serve it: the interpreter, the working
    directory (it is the first entry of ``sys.path``), and the variables that importing torch
    may read (:data:`IMPORT_TIME_PREFIXES`). A variable of the user's own changes no template:

        >>> key({"RUN_NAME": "a"}, "/tmp") == key({"RUN_NAME": "b"}, "/tmp")
        True
        >>> key({"OMP_NUM_THREADS": "1"}, "/tmp") == key({"OMP_NUM_THREADS": "2"}, "/tmp")
        False
    """
    kept = tuple(sorted((k, v) for k, v in env.items() if k not in PER_LAUNCH_ENV and (
        k.startswith(IMPORT_TIME_PREFIXES) or k in IMPORT_TIME_NAMES)))
    return (sys.executable, cwd, kept)


class TemplateGone(OSError):
    """The template ended, or never started: it cannot fork another rank."""


class Forked:
    """One rank forked by a :class:`Template`, with the part of ``subprocess.Popen`` the
    launcher uses. Its exit status arrives from the template; if the template itself is gone,
    the rank went with it (its parent-death signal), and it is reported killed."""

    def __init__(self, template: Template, pid: int, stdout, stderr):
        self.template, self.pid, self.stdout, self.stderr = template, pid, stdout, stderr
        self.args = [sys.executable, "-m", WORKER_MODULE]  # what it stands for

    def poll(self) -> int | None:
        status = self.template.exits.get(self.pid)
        if status is None and not self.template.running() and not alive(self.pid):
            status = -signal.SIGKILL  # its parent, the template, died; so did it
        return status

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        with self.template.changed:
            while self.poll() is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self.template.changed.wait(0.05 if left is None else min(left, 0.05))
        return self.poll()


class Template:
    """A started template process, and the socket the launcher asks it to fork through."""

    def __init__(self, env: dict[str, str], cwd: str):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.exits: dict[int, int] = {}  # pid -> return code, as Popen gives it
        self.changed = threading.Condition()
        self.lock = threading.Lock()  # one fork request at a time
        self.pending: list[int] = []  # pids the template replied with, not yet taken
        self.abandoned = 0  # requests whose asker gave up (an interrupt): kill their ranks
        self.stderr_tail: list[str] = []
        self.ended = False
        try:
            # A session of its own: an interrupt is not for it. Started from the long-lived
            # thread, so that it outlives the thread that launched (its parent-death signal).
            self.proc = spawner.start(lambda: subprocess.Popen(
                [sys.executable, "-m", TEMPLATE_MODULE], cwd=cwd, start_new_session=True,
                env=dict(env, **{SOCKET_ENV: str(theirs.fileno())}),
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        threading.Thread(target=self._read_stderr, daemon=True, name="gradsync-template").start()
        threading.Thread(target=self._read_replies, daemon=True, name="gradsync-template").start()

    def running(self) -> bool:
        return not self.ended and self.proc.poll() is None

    def fork(self, env: dict[str, str]) -> Forked:
        """Fork one worker with environment ``env``; return it once the template says its pid."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self.lock:
                try:
                    socket.send_fds(self.sock, [pickle.dumps(env)], [out_w, err_w])
                except OSError as e:
                    raise self._gone() from e
                try:
                    pid = self._next_pid()
                except BaseException:  # the stop button, say: the fork may come all the same
                    self._abandon()
                    raise
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return Forked(self, pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))

    def _next_pid(self) -> int:
        end = time.monotonic() + START_SECONDS
        with self.changed:
            while not self.pending:
                if not self.running():
                    raise self._gone()
                if time.monotonic() > end:
                    raise TemplateGone(f"the template did not start in {START_SECONDS:.0f} s")
                self.changed.wait(0.05)
            return self.pending.pop(0)

    def _abandon(self) -> None:
        """The launcher stopped waiting for a fork it asked for: stop that rank when its pid
        comes, so that it neither runs on nor is handed to the next request."""
        with self.changed:
            self.abandoned += 1
            self._kill_abandoned()

    def _kill_abandoned(self) -> None:
        """(With ``changed`` held.) Kill each rank that a request given up was answered with."""
        while self.abandoned and self.pending:
            self.abandoned -= 1
            pid = self.pending.pop(0)
            for kill in (os.killpg, os.kill):  # its session and reaper; else the rank itself
                try:
                    kill(pid, signal.SIGKILL)
                    break
                except OSError:
                    continue

    def _gone(self) -> TemplateGone:
        tail = "".join(self.stderr_tail[-20:]).strip()
        said = f"; it printed:\n{tail}" if tail else ""
        return TemplateGone(f"the process that starts the ranks ({TEMPLATE_MODULE}) ended{said}")

    def _read_replies(self) -> None:
        try:
            while True:
                data = self.sock.recv(4096)
                if not data:
                    break
                kind, pid, code = pickle.loads(data)
                with self.changed:
                    if kind == "started":
                        self.pending.append(pid)
                        self._kill_abandoned()
                    else:
                        self.exits[pid] = code
                    self.changed.notify_all()
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
        finally:
            with self.changed:
                self.ended = True
                self.changed.notify_all()

    def _read_stderr(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            self.stderr_tail.append(raw.decode("utf-8", "replace"))
            del self.stderr_tail[:-50]
        self.proc.stderr.close()

    def stop(self) -> None:
        """End the template now (:func:`stop_all`): the ranks it forked go with it (their
        parent-death signal); the launcher stops them first."""
        self.retire()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.sock.close()

    def retire(self) -> None:
        """Fork no more: the template ends with the last rank it forked, and reports each exit
        until then (ending it at once would kill them: their parent-death signal)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


# -- the launcher's templates, one per environment ------------------------------------------------

KEPT = 2  # environments whose templates are kept: a test and its neighbour start none
_lock = threading.Lock()
# By environment (the least recently used first), then by rank: each rank has a template of its
# own, so that each keeps a string-hash seed of its own (a set of strings iterates in another
# order on each rank, as under torchrun: code that relies on one order fails here too).
_templates: dict[tuple, dict[int, Template]] = {}


def start(env: dict[str, str], cwd: str, ranks: range) -> None:
    """Start the templates of ``ranks`` for this environment that are not running, without
    waiting: they import torch side by side while the ranks are forked one by one."""
    k = key(env, cwd)
    with _lock:
        templates = _templates.pop(k, {})
        for rank in ranks:
            if rank not in templates or not templates[rank].running():
                templates[rank] = Template(
                    {n: v for n, v in env.items() if n not in PER_LAUNCH_ENV}, cwd)
        _templates[k] = templates
        retired = [_templates.pop(next(iter(_templates))) for _ in range(len(_templates) - KEPT)]
    for old in retired:
        for t in old.values():
            t.retire()


def stop_all() -> None:
    """End every template (``gst.shutdown_workers()``): the memory of their imports is freed,
    and the next launch starts new ones, which import torch again."""
    with _lock:
        stopping = [t for templates in _templates.values() for t in templates.values()]
        _templates.clear()
    for t in stopping:
        t.stop()


def fork(env: dict[str, str], cwd: str, rank: int) -> Forked:
    """Fork rank ``rank``'s worker with ``env`` from its template for this environment,
    started if need be (:func:`start` starts them all at once).

    Raises :class:`TemplateGone` if the template could not start or fork (the caller starts
    the worker as a fresh interpreter instead)."""
    start(env, cwd, range(rank, rank + 1))
    k = key(env, cwd)
    with _lock:
        template = _templates[k][rank]
    try:
        return template.fork(env)
    except TemplateGone:
        with _lock:
            if _templates.get(k, {}).get(rank) is template:
                del _templates[k][rank]
        template.retire()
        raise


# -- the template process ----------------------------------------------------------------------


def main() -> None:
    from . import process_tree

    sock = socket.socket(fileno=int(os.environ.pop(SOCKET_ENV)))
    parent = os.environ.pop(PARENT_ENV, "")  # never outlive the launcher (its starter thread)
    process_tree.die_with_parent(int(parent) if parent.isdigit() else None)
    import cloudpickle  # noqa: F401 - what a worker imports before its first job
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    if torch.cuda.is_initialized():  # a fork would then be CUDA-unsafe: exec the ranks instead
        raise SystemExit("CUDA was initialized while importing torch: not forking from it")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    children: set[int] = set()
    me = os.getpid()  # the forked ranks' parent: read before a fork, as it may die meanwhile
    serving = True
    while serving or children:
        ready, _, _ = select.select([sock, wake_r] if serving else [wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock, children)
        if sock in ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 2)
            except OSError:
                data, fds = b"", []
            if not data:  # retired: fork no more, end with the last rank (reported as it ends)
                serving = False
                continue
            in_session_r, in_session_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(in_session_r)
                env = dict(pickle.loads(data), **{PARENT_ENV: str(me)})
                _become_worker(env, fds, (sock, wake_r, wake_w), in_session_w)
            os.close(in_session_w)
            os.read(in_session_r, 1)  # its own session first: the launcher signals that group
            os.close(in_session_r)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, ("started", pid, None))


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            _send(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _send(sock: socket.socket, message: tuple) -> None:
    try:
        sock.send(pickle.dumps(message))
    except OSError:
        pass  # the launcher is gone: the next read ends the loop


def _become_worker(env: dict[str, str], fds: list[int], own: tuple, in_session: int) -> None:
    """In the forked child: take the streams and environment, then run the worker as
    ``python -m`` would; never return into the template's loop."""

    def prepare() -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        own[0].close()
        for fd in own[1:]:
            os.close(fd)
        os.setsid()  # a session of its own, as Popen(start_new_session=True) gives a rank
        os.write(in_session, b"s")
        os.close(in_session)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), *zip(fds, (1, 2), strict=True)):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)

    run_module_as_main(WORKER_MODULE, prepare)


def run_module_as_main(module: str, prepare: Callable[[], None]) -> NoReturn:
    """In a forked child: ``prepare()``, then ``module`` as ``python -m MODULE`` runs it, then
    exit with its status. What either raises is shown and exits 1, as an interpreter does.

    The module may have been imported before the fork (that is the point of forking): it runs
    again, as ``__main__`` only, as under ``python -m``.
    """
    code = 1
    try:
        prepare()
        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)  # sys.exit("why"), as Python shows it
    except BaseException:  # noqa: BLE001 - show it, as an interpreter would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    main()
