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

import os
import pickle
import queue
import socket
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

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


def _run_job(job: dict) -> tuple:
    """Run one job; return the message for the launcher. Never raises."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    try:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # undo a previous job's swap
        os.environ.clear()  # exactly the notebook's environment, plus torchrun's variables
        os.environ.update(job["env"], PYTHONUNBUFFERED="1")
        if job["cwd"] and os.path.isdir(job["cwd"]):
            os.chdir(job["cwd"])
        sys.path[:] = job["sys_path"] + [p for p in sys.path if p not in job["sys_path"]]
        torch.set_num_threads(job["num_threads"])
        fn, args = cloudpickle.loads(job["payload"])
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if job["device"] == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # init_method="env://": read MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, exactly as under
        # torchrun. The store it connects to is hosted by the launcher (the "agent" store).
        dist.init_process_group(
            job["backend"], timeout=timedelta(seconds=job["collective_timeout"])
        )
        result = fn(rank, world_size, *args)
    except BaseException as exc:  # noqa: BLE001 - the launcher re-raises it in the notebook
        return _error_message(exc)
    try:
        return ("ok", cloudpickle.dumps(_to_cpu(result)))
    except Exception as exc:  # noqa: BLE001
        return _error_message(
            TypeError(f"the return value of fn ({type(result).__name__}) could not be "
                      f"serialized back to the notebook: {exc}. Return tensors, numbers, "
                      "lists or dicts of them (for a model, return model.state_dict()).")
        )


def _error_message(exc: BaseException) -> tuple:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _run_job.__code__ and tb.tb_next is not None:
        tb = tb.tb_next  # start the traceback at the user's code, not at this module
    tb = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        import cloudpickle

        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)  # only send what the notebook can rebuild
    except Exception:  # noqa: BLE001 - the text alone is enough to report it
        pickled = None
    return ("error", type(exc).__qualname__, str(exc), tb, pickled)


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
        kind, *rest = inbox.get()
        if kind == "job":
            job_id, job = rest
            reply = _run_job(job)
            _end_of_job(job_id)
            conn.send((reply[0], job_id, *reply[1:]))
        elif kind == "teardown":
            import torch.distributed as dist

            if dist.is_initialized():  # fn may have destroyed it itself, torchrun-style
                dist.destroy_process_group()
            conn.send(("ready", rest[0]))


if __name__ == "__main__":
    main()
