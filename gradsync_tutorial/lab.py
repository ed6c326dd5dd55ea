"""``make lab`` (``python -m gradsync_tutorial lab``): the course in JupyterLab, wherever it runs.

    make lab                                # then open notebooks/00_launching_workers.ipynb
    make lab LAB_ARGS="--port 9999"         # any option of `jupyter lab`, added at the end
    make lab LAB_ARGS="--ip 0.0.0.0"        # reachable from other machines: read what it prints

It runs ``jupyter lab`` with the repository as the server's root, opened at ``notebooks/`` (so
the notebooks' ``../images/`` figures show), and adds what the machine needs:

* as root (a Docker container, a cloud VM, a workshop's image) ``--allow-root``, saying so in
  one line: Jupyter refuses to start as root without it;
* without a desktop (no display, or over SSH) ``--no-browser``; once the server is up it prints
  the URL with its token again and how to open it from a laptop: an SSH tunnel, or
  ``--ip 0.0.0.0`` with what that exposes.

The user's ``LAB_ARGS`` come last, so they can override any of these (the root folder too: then
it is given once, theirs). A port that cannot be one (``--port 99999``) is refused before the
server starts. Ctrl-C stops the server as
``jupyter lab`` does; SIGTERM (to ``make`` or to this process) stops it too, kernels and all.
"""

from __future__ import annotations

import getpass
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["bad_port", "has_desktop", "lab_command", "main", "reach_from_a_laptop"]

URL = re.compile(r"(https?://[^\s/]+):(\d+)(/\S*\?token=\S+)")
ROOT_NOTICE = ("gradsync lab: running as root (a container or a VM?), so jupyter lab gets "
               "--allow-root, without which Jupyter refuses to start; notebooks run as root too.")


def course_root() -> Path:
    """The checkout this package belongs to, else the current folder: the one with notebooks/."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / "notebooks").is_dir():
            return root
    raise SystemExit("gradsync lab: no notebooks/ folder here: run it in the course's folder "
                     "(the clone of the repository)")


def has_desktop(environ: dict[str, str] | None = None, platform: str | None = None) -> bool:
    """Whether a browser opened here is one the user sees.

    Not over SSH, and on Linux (and other Unixes) only with a display.

    >>> has_desktop({"DISPLAY": ":0"}, "linux"), has_desktop({}, "linux")
    (True, False)
    >>> has_desktop({"SSH_CONNECTION": "10.0.0.2 5122 10.0.0.1 22"}, "darwin")
    False
    """
    environ = os.environ if environ is None else environ
    platform = sys.platform if platform is None else platform
    if environ.get("SSH_CONNECTION") or environ.get("SSH_TTY"):
        return False
    if platform in ("darwin", "win32", "cygwin"):
        return True
    return bool(environ.get("DISPLAY") or environ.get("WAYLAND_DISPLAY"))


def lab_command(user_args: list[str], root: Path, as_root: bool, desktop: bool,
                python: str = sys.executable) -> tuple[list[str], list[str]]:
    """The ``jupyter lab`` command line for this machine, and the notices that say why.

    >>> cmd, notices = lab_command(["--port", "9999"], Path("/course"), as_root=True,
    ...                            desktop=False, python="python")
    >>> cmd[:3], cmd[-4:]
    (['python', '-m', 'jupyterlab'], ['--allow-root', '--no-browser', '--port', '9999'])
    >>> notices == [ROOT_NOTICE]
    True
    """
    cmd = [python, "-m", "jupyterlab"]
    # Jupyter refuses an option given twice: one of the user's replaces ours.
    if not _value(user_args, "--ServerApp.root_dir", "--notebook-dir", "--ServerApp.notebook_dir"):
        cmd.append(f"--ServerApp.root_dir={root}")
        if not _value(user_args, "--ContentsManager.preferred_dir",
                      "--ServerApp.preferred_dir"):
            cmd.append("--ContentsManager.preferred_dir=notebooks")
    notices = []
    if as_root and "--allow-root" not in user_args:
        cmd.append("--allow-root")
        notices.append(ROOT_NOTICE)
    if not desktop:
        cmd.append("--no-browser")
    return cmd + list(user_args), notices


def reach_from_a_laptop(url: str, user_args: list[str], user: str, host: str) -> str:
    """What to do with the server's URL on a machine without a desktop.

    >>> print(reach_from_a_laptop("http://localhost:8888/lab?token=abc", [], "ana", "gpu1"))
    gradsync lab: no desktop here, so no browser opened. To open the course from your laptop:
      either tunnel through SSH: on the laptop run  ssh -N -L 8888:localhost:8888 ana@gpu1
        then open  http://localhost:8888/lab?token=abc
      or serve on every network interface:  make lab LAB_ARGS="--ip 0.0.0.0"
        then open  http://gpu1:8888/lab?token=abc  (with the port and token it prints)
        Security: then anyone who can reach port 8888 of gpu1 and has the token can run any
        code here as ana, and the traffic is not encrypted: use it only on a network you trust.
    """
    match = URL.search(url)
    port, path = (match.group(2), match.group(3)) if match else ("8888", "/lab?token=...")
    security = (f"Security: then anyone who can reach port {port} of {host} and has the token "
                f"can run any\n    code here as {user}, and the traffic is not encrypted: use "
                "it only on a network you trust.")
    public = _ip(user_args) not in (None, "localhost", "127.0.0.1", "::1")
    if public:
        return (f"gradsync lab: no desktop here, so no browser opened. Serving on {_ip(user_args)}"
                f": from your laptop open  http://{host}:{port}{path}\n  "
                + security.replace("then anyone", "anyone"))
    return (
        "gradsync lab: no desktop here, so no browser opened. To open the course from your "
        "laptop:\n"
        f"  either tunnel through SSH: on the laptop run  ssh -N -L {port}:localhost:{port} "
        f"{user}@{host}\n"
        f"    then open  http://localhost:{port}{path}\n"
        '  or serve on every network interface:  make lab LAB_ARGS="--ip 0.0.0.0"\n'
        f"    then open  http://{host}:{port}{path}  (with the port and token it prints)\n"
        f"    {security}")


def _value(args: list[str], *names: str) -> str | None:
    """The last value given to any of ``names`` (``--name=v`` or ``--name v``), else None."""
    value = None
    for i, arg in enumerate(args):
        name, is_set, given = arg.partition("=")
        if name in names and is_set:
            value = given
        elif arg in names and i + 1 < len(args):
            value = args[i + 1]
    return value


def _ip(args: list[str]) -> str | None:
    return _value(args, "--ip", "--ServerApp.ip")


def bad_port(args: list[str]) -> str | None:
    """Why the port in ``args`` cannot be served on, else None (no port, or a good one).

    >>> print(bad_port(["--port", "99999"]))
    gradsync lab: --port 99999 is not a port: pass a number from 1 to 65535, such as --port 8888 ...
    """
    port = _value(args, "--port", "--ServerApp.port")
    if port is None or (port.isascii() and port.isdigit() and int(port) <= 65535):
        return None
    return (f"gradsync lab: --port {port} is not a port: pass a number from 1 to 65535, such as "
            "--port 8888 (or 0: any free port).")


def main(argv: list[str] | None = None) -> int:
    user_args = list(sys.argv[1:] if argv is None else argv)
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        print("gradsync lab: JupyterLab is not installed: pip install -e '.[dev]' "
              "(make lab does it)", file=sys.stderr)
        return 2
    if bad_port(user_args):  # before the server starts, and says nothing about it
        print(bad_port(user_args), file=sys.stderr)
        return 2
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    desktop = has_desktop()
    cmd, notices = lab_command(user_args, course_root(), as_root, desktop)
    for notice in notices:
        print(notice, file=sys.stderr, flush=True)
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
    _forward_stop_signals(server)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_lines, args=(server.stderr, lines), daemon=True).start()
    url, told = None, desktop
    while True:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:  # the banner is over: say how to open it, once
            if url and not told:
                print(reach_from_a_laptop(url, user_args, getpass.getuser(),
                                          socket.gethostname()), file=sys.stderr, flush=True)
                told = True
            continue
        if line is None:
            break
        sys.stderr.write(line)
        sys.stderr.flush()
        url = url or (line if URL.search(line) else None)
    code = server.wait()
    return 128 - code if code < 0 else code  # killed by signal N: exit 128 + N, as a shell says


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _forward_stop_signals(server: subprocess.Popen) -> None:
    """SIGTERM and SIGHUP stop the server (it shuts its kernels down); Ctrl-C is the server's:
    it asks for confirmation, as ``jupyter lab`` does, so this process ignores it."""

    def stop(signum, frame):
        server.terminate()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), stop)


if __name__ == "__main__":
    sys.exit(main())
