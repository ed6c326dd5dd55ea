"""When ``fn`` calls ``dist.init_process_group`` itself: the worker side of bring-your-own-group.

PyTorch's tutorials and most torchrun scripts start with their own ``setup``::

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

while :func:`gradsync_tutorial.launch` has already initialized the default group (so that code
written *for* the course runs under torchrun unchanged). Torch refuses a second
``init_process_group``. So, for the duration of a job, a worker's ``init_process_group`` is
this module's :func:`init_process_group`:

* the call's ``rank`` and ``world_size`` must match the launch, else a ``ValueError`` says
  what to change;
* a call that asks for the group the launcher made (the same backend, or none, and no other
  argument) is a no-op: the group is already there, as under torchrun, where ``env://`` finds
  everything ready;
* a call for another backend, or with arguments of its own (``timeout=``, ``device_id=``,
  ``pg_options=``), replaces the launcher's group by one made with the call's own arguments, so
  that they count as they do under torchrun: a shorter timeout applies, and
  ``device_id=torch.device("cpu")`` fails as torch makes it fail there; arguments torch refuses
  (``timeout=30``, a ``rank`` read from ``os.environ`` as a string) are refused in its words;
* the rendezvous goes through the launcher's store, not ``MASTER_PORT`` (12355 in the
  tutorials, which two notebooks would fight over, and which nobody hosts here). An explicit
  ``init_method="tcp://..."``/``"file://..."`` or ``store=`` is the caller's own choice and is
  used as given.

Its own ``dist.destroy_process_group()`` works as usual; a later ``init_process_group`` in the
same job rendezvouses again through the launcher's store.
"""

from __future__ import annotations

import itertools
from typing import Any

_original = None  # torch's init_process_group
_job: dict[str, Any] = {}  # this job's rank, world size and the launcher's store address


def install(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Use :func:`init_process_group` for this job (call after the launcher's own init)."""
    global _original
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if _original is None:
        _original = distributed_c10d.init_process_group
    _job.update(rank=rank, world_size=world_size, addr=master_addr, port=master_port)
    _job["generation"] = itertools.count()  # every rank counts its re-initializations from 0
    for namespace in (dist, distributed_c10d):
        namespace.init_process_group = init_process_group


def original():
    """torch's own ``init_process_group`` (what the launcher itself calls)."""
    from torch.distributed import distributed_c10d

    return _original or distributed_c10d.init_process_group


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout=None, world_size: int = -1, rank: int = -1, store=None,
                       **kwargs) -> None:
    """``torch.distributed.init_process_group``, inside a :func:`gradsync_tutorial.launch`."""
    __tracebackhide__ = True
    import torch.distributed as dist

    _check_types(timeout, rank, world_size)
    launched_rank, launched_size = _job["rank"], _job["world_size"]
    if world_size not in (-1, None) and world_size != launched_size:
        raise ValueError(
            f"init_process_group(world_size={world_size}) in a launch of {launched_size} "
            f"ranks: launch it with gst.launch(fn, world_size={world_size}), or pass "
            "world_size=int(os.environ['WORLD_SIZE']) (what torchrun scripts do) or the "
            "world_size fn receives."
        )
    if rank not in (-1, None) and rank != launched_rank:
        raise ValueError(
            f"init_process_group(rank={rank}) on the process that gst.launch numbered rank "
            f"{launched_rank}: pass the rank fn receives (its first argument) or "
            "int(os.environ['RANK'])."
        )
    if init_method not in (None, "env://") or store is not None:
        # The caller's own rendezvous: used as given (a hang there is reported with its address).
        if dist.is_initialized():
            _destroy_default_group()
        original()(backend, init_method, timeout, world_size, rank, store, **kwargs)
        return
    if dist.is_initialized():
        if _same_backend(backend, dist.get_backend()) and timeout is None and not any(
                value is not None for key, value in kwargs.items() if key != "group_desc"):
            return  # the launcher's group already is the one asked for
        # Another backend, or arguments of its own (timeout=, device_id=, pg_options=): replace
        # the launcher's group, once every rank has finished joining it, so that the call's
        # arguments count as under torchrun (a shorter timeout applies, device_id=cpu fails).
        dist.barrier()
        _destroy_default_group()
    store = dist.PrefixStore(
        f"gradsync/init/{next(_job['generation'])}",
        dist.TCPStore(_job["addr"], _job["port"], is_master=False, **_timeout(timeout)),
    )
    original()(backend, timeout=timeout, world_size=launched_size, rank=launched_rank,
               store=store, **kwargs)


def _check_types(timeout, rank, world_size) -> None:
    """Refuse what torch refuses, in torch's words, before touching the launcher's group."""
    from datetime import timedelta

    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"Expected timeout argument to be of type datetime.timedelta, got {timeout} (torch's "
            f"words: torchrun refuses it too). Pass timeout=datetime.timedelta(seconds={timeout})."
        )
    for name, value, variable in (("rank", rank, "RANK"), ("world_size", world_size,
                                                            "WORLD_SIZE")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RuntimeError(
                f"`{name}` must be an integer. {value} (torch's words: torchrun refuses it "
                f"too). It is {type(value).__name__} {value!r}"
                + (": os.environ holds strings, so pass " f"{name}=int(os.environ['{variable}'])"
                   if isinstance(value, str) else "")
                + f", or the {name} fn receives."
            )


def _destroy_default_group() -> None:
    """destroy_process_group(), with freeing the group (gloo: ~20 ms) left to a thread."""
    import threading

    import torch.distributed as dist

    group = [dist.distributed_c10d._get_default_group()]
    dist.destroy_process_group()
    threading.Thread(target=group.clear, name="gradsync-free-group", daemon=True).start()


def _same_backend(asked, current: str) -> bool:
    return asked is None or str(asked).lower() == current.lower()


def _timeout(timeout) -> dict:
    return {} if timeout is None else {"timeout": timeout}
