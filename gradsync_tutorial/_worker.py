"""The worker side of :func:`gradsync_tutorial.launch`: one fresh interpreter per rank.

Started by the launcher as ``python -m gradsync_tutorial._worker``, never by hand. It

1. imports torch (the slow part, ~2 s) while the notebook is still busy,
2. connects back to the launcher over a loopback socket and proves itself with a token,
3. then serves jobs until the launcher closes the socket: for each job it sets the torchrun
   environment (RANK, WORLD_SIZE, ...), initializes the default process group, calls
   ``fn(rank, world_size, *args)``, and sends back the result or the error with its traceback.

The socket is also the lifeline: if the launcher goes away (kernel restarted, killed, crashed),
the read returns EOF and this process exits at once, so no worker ever outlives its notebook.
"""

from __future__ import annotations

import linecache
import os
import pickle
import queue
import re
import socket
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from gradsync_tutorial._messages import Finished, Job, Raised, Ready, Teardown

# Written on stdout and stderr after each job so the launcher knows it has every line.
END_MARK = "\x1egradsync-end-of-job"


def _to_cpu(obj):
    """Move every tensor in ``obj`` (nested lists, tuples, dicts) to the CPU, detached."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _end_of_job(job_id: int) -> None:
    """Flush both streams and mark the end of this job's output on each.

    The marks go to the original streams, in case ``fn`` replaced ``sys.stdout``.
    """
    for stream, original in ((sys.stdout, sys.__stdout__), (sys.stderr, sys.__stderr__)):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream fn closed or broke
            pass
        original.write(f"{END_MARK} {job_id}\n")
        original.flush()


def _run_job(job: Job) -> Finished | Raised:
    """Run one job; return the message for the launcher. Never raises."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    try:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # undo a previous job's swap
        os.environ.clear()  # exactly the notebook's environment, plus torchrun's variables
        os.environ.update(job.env, PYTHONUNBUFFERED="1")
        if job.cwd and os.path.isdir(job.cwd):
            os.chdir(job.cwd)
        sys.path[:] = job.sys_path + [p for p in sys.path if p not in job.sys_path]
        for filename, lines in job.sources.items():  # notebook cells: tracebacks show the line
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        torch.set_num_threads(job.num_threads)
        fn, args = cloudpickle.loads(job.payload)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if job.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # init_method="env://": read MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, exactly as under
        # torchrun. The store it connects to is hosted by the launcher (the "agent" store).
        dist.init_process_group(
            job.backend, timeout=timedelta(seconds=job.collective_timeout)
        )
        result = fn(rank, world_size, *args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return _raised(job.job_id, exc)
        # sys.exit() / sys.exit(0) ends a torchrun process successfully: the same here.
        print(f"fn called sys.exit({'' if exc.code is None else 0}): counted as success, as "
              "torchrun counts exit code 0; this rank's result is None.", file=sys.stderr)
        result = None
    except BaseException as exc:  # noqa: BLE001 - the launcher re-raises it in the notebook
        return _raised(job.job_id, exc)
    try:
        return Finished(job.job_id, cloudpickle.dumps(_to_cpu(result)))
    except Exception as exc:  # noqa: BLE001
        return _raised(job.job_id,
            TypeError(f"the return value of fn ({type(result).__name__}) could not be "
                      f"serialized back to the notebook: {exc}. Return tensors, numbers, "
                      "lists or dicts of them (for a model, return model.state_dict())."),
        )


# What gloo and nccl say when the other end of a connection went away.
_LOST_PEER = re.compile(
    r"connection (reset|closed) by peer|broken pipe|remote process exited|read error|"
    r"connection refused|socket timeout", re.IGNORECASE,
)


def _lost_peer(exc: BaseException, text: str) -> bool:
    """Did torch.distributed raise this because a peer's connection closed?

    Decided from the exception's class and where it was raised, not from its type's name:
    a RuntimeError (gloo's and nccl's DistBackendError is one) raised inside torch.distributed
    whose message describes a closed connection.
    """
    if not isinstance(exc, RuntimeError) or not _LOST_PEER.search(text):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return any(f"torch{os.sep}distributed{os.sep}" in f.filename for f in frames)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as e:  # noqa: BLE001 - a user's __str__ that raises
        return f"<its __str__ raised {type(e).__name__}: {_safe_repr(e)}>"


def _safe_repr(obj: object) -> str:
    try:
        return str(obj)
    except Exception:  # noqa: BLE001
        return "?"


def _raised(job_id: int, exc: BaseException) -> Raised:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _run_job.__code__ and tb.tb_next is not None:
        tb = tb.tb_next  # start the traceback at the user's code, not at this module
    try:
        text_tb = "".join(traceback.format_exception(type(exc), exc, tb))
    except Exception:  # noqa: BLE001 - a broken exception must not crash the worker
        text_tb = "".join(traceback.format_tb(tb)) + f"{type(exc).__qualname__}\n"
    text = _safe_str(exc)
    exit_code = None
    if isinstance(exc, SystemExit):  # sys.exit(3) exits 3; sys.exit("why") prints and exits 1
        exit_code = exc.code if isinstance(exc.code, int) else 1
        text = repr(exc.code) if isinstance(exc.code, str) else text
    try:
        import cloudpickle

        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)  # only send what the notebook can rebuild
    except Exception:  # noqa: BLE001 - the text alone is enough to report it
        pickled = None
    return Raised(job_id, type(exc).__qualname__, text, text_tb, pickled,
                  lost_peer=_lost_peer(exc, text), exit_code=exit_code)


def _connect() -> Connection:
    host, port = os.environ.pop("GRADSYNC_CONTROL").rsplit(":", 1)
    token = bytes.fromhex(os.environ.pop("GRADSYNC_TOKEN"))
    sock = socket.create_connection((host, int(port)))
    sock.sendall(token)
    return Connection(sock.detach())


def main() -> None:
    import torch  # noqa: F401 - preload: by the time the first job arrives this is done
    import torch.distributed  # noqa: F401

    conn = _connect()
    inbox: queue.Queue = queue.Queue()

    def read_forever() -> None:
        try:
            while True:
                inbox.put(conn.recv())
        except (EOFError, OSError):
            # The launcher closed the socket or died: never outlive it.
            os._exit(0)

    threading.Thread(target=read_forever, name="gradsync-control", daemon=True).start()

    while True:
        message = inbox.get()
        if isinstance(message, Job):
            reply = _run_job(message)
            _end_of_job(message.job_id)
            conn.send(reply)
        elif isinstance(message, Teardown):
            import torch.distributed as dist

            if dist.is_initialized():  # fn may have destroyed it itself, torchrun-style
                dist.destroy_process_group()
            conn.send(Ready(message.job_id))


if __name__ == "__main__":
    main()
