"""A launch failure says each thing once, and gives the advice that fits what happened.

A hang's message is built from two places (the launcher's headline and the report of where each
rank was); a failed rank's from its record and a hint. Each shape of failure below is a real
launch: its message must repeat no sentence (nor clause), say each idea of advice at most once,
and give the advice of its own diagnosis, not another's.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

import gradsync_tutorial as gst

from ..programs import cell

pytestmark = pytest.mark.usefixtures("no_workers_left")

TIMEOUT = 4

#: Ideas of advice (or of blame) that a message may say once: repeating one, in any words, is
#: the same sentence twice to its reader.
IDEAS = {
    "a rank did not call it": r"never reached|without calling|not every rank called",
    "same calls, same order": r"same (collective )?calls in the same order",
    "a larger timeout": r"larger timeout=",
    "same shape and dtype": r"same shape and dtype",
    "a branch on the rank": r"if rank == 0",
}


def sentences(message: str) -> list[str]:
    """The message's sentences and clauses, lower-cased, without the rank's own traceback and
    the code it quotes (two ranks at the same line quote the same code)."""
    prose = message.split("\nTraceback from rank")[0]
    prose = re.sub(r"`[^`\n]*`", "`code`", prose)
    parts = re.split(r"(?<=[.:;])\s+|\n", prose)
    return [p.strip().rstrip(".:;").lower() for p in parts if p.strip()]


def repeats(message: str) -> list[str]:
    said = Counter(sentences(message))
    twice = [f"said {n} times: {s!r}" for s, n in said.items() if n > 1]
    twice += [f"the idea '{idea}' said {n} times"
              for idea, pattern in IDEAS.items()
              if (n := len(re.findall(pattern, message.split("\nTraceback from rank")[0]))) > 1]
    return twice


def test_the_repeat_finder_finds_a_sentence_or_an_idea_said_twice():
    assert repeats("a. b: c; d.\n  e") == []
    assert repeats("It hangs. Every rank must wait.\nevery rank must wait.")
    assert repeats("check shapes; if the work is only slow, pass a larger timeout=.\n"
                   "If the work is only slow, pass a larger timeout=.")
    assert repeats("rank 1 never reached it. The cause is a collective not every rank called.")
    assert repeats("x `a: b` y\nz `a: b` w") == []  # quoted code is not prose


HANGS = {
    "a rank skips a collective": ("""
        import torch
        import torch.distributed as dist

        def train(rank, world_size):
            if rank == 0:
                dist.all_reduce(torch.ones(1))
        """, r"if rank == 0", r"same shape|larger timeout"),
    "ranks in different collectives": ("""
        import torch
        import torch.distributed as dist

        def train(rank, world_size):
            t = torch.ones(1)
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        """, r"different collectives", r"never reached|if rank == 0"),
    "the same collective, tensors of different sizes": ("""
        import torch
        import torch.distributed as dist

        def train(rank, world_size):
            dist.all_reduce(torch.ones(2 + rank))
        """, r"same shape and dtype", r"never reached|not every rank|if rank == 0"),
    "each rank waits to receive from the other": ("""
        import torch
        import torch.distributed as dist

        def train(rank, world_size):
            dist.recv(torch.ones(1), src=1 - rank)
        """, r"matching call", r"same shape|if rank == 0|never reached"),
    "a deadlock in the ranks' own code": ("""
        import threading

        def train(rank, world_size):
            threading.Event().wait()
        """, r"No rank was found in a collective", r"never reached|if rank == 0|same shape"),
}


@pytest.mark.parametrize("shape", HANGS)
def test_a_hang_message_says_each_thing_once_with_the_advice_of_its_diagnosis(shape):
    source, advice, wrong = HANGS[shape]
    gst.launch(lambda rank, world_size: rank, 2)  # warm workers: the timeout is the job's
    with pytest.raises(gst.LaunchTimeoutError) as info:
        gst.launch(cell(source)["train"], world_size=2, timeout=TIMEOUT)
    message = str(info.value)
    print(message)
    assert repeats(message) == []
    assert re.search(advice, message), f"the advice that fits is missing:\n{message}"
    assert not re.search(wrong, message), f"advice of another diagnosis:\n{message}"


def test_a_failed_rank_s_message_says_each_thing_once():
    ns = cell("""
        def train(rank, world_size):
            if rank == 1:
                input("continue? ")     # no standard input in a rank: EOFError, and its hint
            return rank
    """)
    with pytest.raises(gst.RankFailedError) as info:
        gst.launch(ns["train"], world_size=2)
    assert "have no standard input" in str(info.value)
    assert repeats(str(info.value)) == []


def test_a_timeout_without_a_report_gives_the_usual_advice_once():
    from gradsync_tutorial.launcher.errors import timeout_error

    message = str(timeout_error(2, finished=[1], timeout=5, startup=60, started=True))
    assert "if rank == 0" in message and "larger timeout=" in message
    assert repeats(message) == []


def test_descriptor_exhaustion_is_named_once_with_what_to_do():
    """A rank out of file descriptors (gloo's epoll_create, a socket, an open()): one hint."""
    from gradsync_tutorial.launcher.errors import Failure, rank_failed_error

    gloo = ("[enforce fail at /gloo/transport/tcp/loop.cc:105] fd_ != -1. -1 vs -1. "
            "epoll_create: Too many open files")
    failures = [Failure(0, "raised", "RuntimeError", gloo, "Traceback ..."),
                Failure(1, "raised", "OSError", "[Errno 24] Too many open files: 'x'", "...")]
    message = str(rank_failed_error(failures, started=True))
    assert message.count("ran out of file descriptors") == 1, message
    assert "ulimit -n" in message and "Close what fn opens" in message
    assert repeats(message) == []
