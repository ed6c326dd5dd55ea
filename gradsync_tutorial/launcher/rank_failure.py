"""The rank's side of a failure: what ``fn`` raised, as the message the launcher receives.

The notebook's side, the error it raises, is :mod:`.errors`. Here, inside the rank: the text
and traceback of the exception (cut when a cell could not show it), with the launcher's own
frames left out; whether torch.distributed raised it because a peer's connection closed (a
*consequence* of another rank's failure, :func:`lost_peer`); and the exception itself, when
the notebook can rebuild it.

    >>> import sys
    >>> def fn():
    ...     raise ValueError("a bad batch")
    >>> try:
    ...     fn()
    ... except ValueError as e:
    ...     message = raised(7, e)
    >>> message.job_id, message.exc_type, message.message
    (7, 'ValueError', 'a bad batch')
    >>> 'raise ValueError("a bad batch")' in message.traceback
    True

Part of ``gst.launch`` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import os
import pickle
import re
import traceback
import types

from . import own_group
from .protocol import Raised

# What gloo and nccl say when the other end of a connection went away.
LOST_PEER = re.compile(
    r"connection (reset|closed) by peer|broken pipe|remote process exited|read error|"
    r"connection refused|socket timeout|connection was likely closed|failed to recv",
    re.IGNORECASE,
)


def lost_peer(exc: BaseException, text: str) -> bool:
    """Did torch.distributed raise this because a peer's connection closed?

    Decided from the exception's class and where it was raised, not from its type's name:
    a RuntimeError (gloo's and nccl's DistBackendError is one) raised inside torch.distributed
    whose message describes a closed connection.
    """
    if not isinstance(exc, RuntimeError) or not LOST_PEER.search(text):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return any(f"torch{os.sep}distributed{os.sep}" in f.filename for f in frames)


def safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as e:  # noqa: BLE001 - a user's __str__ that raises
        return f"<its __str__ raised {type(e).__name__}: {safe_repr(e)}>"


def safe_repr(obj: object) -> str:
    try:
        return str(obj)
    except Exception:  # noqa: BLE001
        return "?"


_OWN_GROUP = os.path.abspath(own_group.__file__)


def hidden_frames(exc: BaseException | None, depth: int = 0) -> set[tuple[str, int, str]]:
    """The frames of ``exc``'s tracebacks (its causes' included) that are plumbing, not part of
    the reader's story: the launcher's own group (``_own_group``), and every function that sets
    ``__tracebackhide__``, as IPython and pytest hide it (``detect.py``'s counted collectives)."""
    hidden: set[tuple[str, int, str]] = set()
    if exc is None or depth > 10:
        return hidden
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if ("__tracebackhide__" in code.co_varnames
                or os.path.abspath(code.co_filename) == _OWN_GROUP):
            hidden.add((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return (hidden | hidden_frames(exc.__cause__, depth + 1)
            | hidden_frames(exc.__context__, depth + 1))


def hide_plumbing(shown: traceback.TracebackException, hidden: set, depth: int = 0) -> None:
    shown.stack = traceback.StackSummary.from_list(
        [f for f in shown.stack if (f.filename, f.lineno, f.name) not in hidden])
    for chained in (shown.__cause__, shown.__context__):
        if chained is not None and depth < 10:
            hide_plumbing(chained, hidden, depth + 1)


def raised(job_id: int, exc: BaseException, runner: types.CodeType | None = None) -> Raised:
    """The message that tells the launcher job ``job_id`` raised ``exc``: its text and its
    traceback (from the user's code on: the frame of ``runner``, the worker's, left out)."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is runner and tb.tb_next is not None:
        tb = tb.tb_next  # start the traceback at the user's code, not at the worker
    try:
        shown = traceback.TracebackException(type(exc), exc, tb)
        hide_plumbing(shown, hidden_frames(exc))
        text_tb = "".join(shown.format())
    except Exception:  # noqa: BLE001 - a broken exception must not crash the worker
        text_tb = "".join(traceback.format_tb(tb)) + f"{type(exc).__qualname__}\n"
    text = safe_str(exc)
    exit_code = None
    if isinstance(exc, SystemExit):  # sys.exit(3) exits 3; sys.exit("why") prints and exits 1
        exit_code = exc.code if isinstance(exc.code, int) else 1
        text = repr(exc.code) if isinstance(exc.code, str) else text
    peer_gone = lost_peer(exc, text[:MAX_MESSAGE_CHARS])
    if len(text) > MAX_MESSAGE_CHARS or len(text_tb) > 2 * MAX_MESSAGE_CHARS:
        # A cell cannot show millions of characters: keep both ends, and do not send the
        # exception itself (the notebook would show its whole message again as the cause).
        text, text_tb = cut(text, MAX_MESSAGE_CHARS), cut(text_tb, 2 * MAX_MESSAGE_CHARS)
        pickled = None
    else:
        pickled = picklable(exc)
    return Raised(job_id, type(exc).__qualname__, text, text_tb, pickled,
                  lost_peer=peer_gone, exit_code=exit_code)


MAX_MESSAGE_CHARS = 20_000  # of an exception's message sent to the notebook (the traceback: 2x)


def cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: its start and its end, and how much was cut."""
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 3 // 4], text[-(limit // 4):]
    return f"{head} [... {len(text) - len(head) - len(tail):,} characters cut ...] {tail}"


def picklable(exc: BaseException) -> bytes | None:
    try:
        import cloudpickle

        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)  # only send what the notebook can rebuild
        return pickled
    except Exception:  # noqa: BLE001 - the text alone is enough to report it
        return None
