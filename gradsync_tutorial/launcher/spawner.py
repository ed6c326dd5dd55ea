"""Processes started from one long-lived thread, so that they outlive the thread that asked.

On Linux a process's parent-death signal (``PR_SET_PDEATHSIG``, which the templates and the
workers set so that they never outlive the notebook) is sent when the *thread* that started it
ends, not the process. A launch from a short-lived thread (a ``ThreadPoolExecutor`` task, a
callback) would lose its templates with that thread, and with them the ranks of every later
launch they forked. So every process the launcher keeps is started here, by one daemon thread
that lives as long as the notebook's process.

    >>> import subprocess, sys
    >>> proc = start(lambda: subprocess.Popen([sys.executable, "-c", "pass"]))
    >>> proc.wait()
    0

Part of ``gst.launch`` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_requests: queue.Queue = queue.Queue()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def start(make: Callable[[], Any]) -> Any:
    """``make()`` (a ``subprocess.Popen``), run on the long-lived starter thread; its result,
    or what it raised. Interrupted while waiting, the process started all the same is killed."""
    future: Future = Future()
    _requests.put((make, future))
    _ensure_thread()
    try:
        return future.result()
    except BaseException:
        future.add_done_callback(_kill_orphan)  # the stop button: nobody will stop it else
        raise


def _kill_orphan(future: Future) -> None:
    if future.exception() is None:
        proc = future.result()
        proc.kill()
        proc.wait()


def _ensure_thread() -> None:
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, daemon=True, name="gradsync-starter")
            _thread.start()


def _serve() -> None:
    while True:
        make, future = _requests.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(make())
        except BaseException as e:  # noqa: BLE001 - raised in the thread that asked
            future.set_exception(e)
