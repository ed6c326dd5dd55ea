"""gradsync_tutorial.launch under adversarial use: hangs, leaks, odd output, odd results, reused
ports, state left behind by a previous job, and the platform branches of the process code, each
monkeypatched so that Linux runs them all (bad arguments: test_preflight.py).

Every test here failed before the fix it checks. Tests that need a real process tree read
/proc and are Linux-only; the platform tests run everywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import (
    LaunchTimeoutError,
    RankFailedError,
    pool,
    preflight,
    process_tree,
    run,
)
from gradsync_tutorial.launcher.protocol import END_MARK

from ..conftest import REPO, start_kernel_like, wait_dead, worker_pids

pytestmark = pytest.mark.usefixtures("no_workers_left")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _ok(rank, world_size):
    return rank


def _run_script(code: str, timeout: float = 150) -> tuple[int | None, str, str]:
    """Run ``code`` in its own session; on a hang kill the whole session and return None."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()  # its ranks may still hold the pipes: do not wait for them
        proc.stderr.close()
        return None, "", ""


# -- 1: a rank's child in a session of its own -----------------------------------------------

DETACHED_CHILD = """
    import os, subprocess, sys
    import gradsync_tutorial as gst

    def fn(rank, world_size, fail):
        # A child in a session of its own, holding the rank's stdout: out of reach of the
        # rank's process group, and the pipe stays open after the rank is gone.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
        print("child", child.pid, flush=True)
        if fail and rank == 1:
            raise ValueError("fails after starting a child")
        return child.pid

    gst.launch(fn, 2, args=(False,), reuse_workers=False)   # stops the ranks on return
    try:
        gst.launch(fn, 2, args=(True,))                       # stops the ranks on failure
    except gst.RankFailedError as e:
        print("failed as expected:", str(e).splitlines()[0], flush=True)
    gst.launch(fn, 2, args=(False,))                          # the idle pool, kept...
    gst.shutdown_workers()                                    # ...and stopped
    gst.launch(fn, 2, args=(False,))                          # kept, and stopped at exit
    print("done", flush=True)
"""


@linux_only
def test_rank_child_in_its_own_session_neither_hangs_nor_survives():
    returncode, out, err = _run_script(DETACHED_CHILD)
    assert returncode == 0, f"launch, shutdown_workers or exit hung (or failed): {err[-2000:]}"
    assert "failed as expected: rank 1 raised ValueError" in out and "done" in out
    children = [int(line.split()[-1]) for line in out.splitlines() if " child " in line]
    assert len(children) == 8
    assert wait_dead(children) == [], "a rank's child outlived its rank"


KILLED_KERNEL = """
    import ctypes, os, sys, time
    import gradsync_tutorial as gst

    def fn(rank, world_size):
        child = os.fork()
        if child == 0:  # a child forked from Python, say a data-loader worker
            time.sleep(60)
            os._exit(0)
        print("pid", os.getpid(), child, flush=True)
        ctypes.PyDLL(None).sleep(60)  # C code that keeps the GIL: the rank cannot react

    gst.launch(fn, world_size=2)
"""


@linux_only
def test_rank_holding_the_gil_and_its_forked_child_die_with_the_kernel():
    proc, pids = start_kernel_like(KILLED_KERNEL, count=4, seconds=120)  # ranks and children
    time.sleep(0.5)  # let both ranks enter the GIL-holding sleep
    proc.kill()  # SIGKILL: no cleanup code runs in the kernel
    proc.wait()
    proc.stdout.close()
    assert wait_dead(pids) == [], "a rank, or a process it forked, outlived the kernel"


# -- 3: everything started is stopped, on every path -----------------------------------------


def test_stop_pressed_while_a_failure_is_reported(monkeypatch):
    drain = pool.Workers.drain

    def interrupted(self, state, *args, **kwargs):
        if state.failures:
            raise KeyboardInterrupt  # the stop button, while launch waits for other reports
        return drain(self, state, *args, **kwargs)

    monkeypatch.setattr(pool.Workers, "drain", interrupted)

    def fn(rank, world_size):
        if rank == 1:
            raise ValueError("rank 1 fails")
        time.sleep(60)

    with pytest.raises(KeyboardInterrupt):
        gst.launch(fn, world_size=2)
    assert worker_pids() == []


class _FailingStart:
    """The launcher's start of one worker (forked or ``subprocess.Popen``), raising ``error``
    on call number ``at`` (1-based)."""

    def __init__(self, monkeypatch, at, error):
        self.real, self.calls, self.at, self.error = pool.start_worker, 0, at, error
        monkeypatch.setattr(pool, "start_worker", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.real(*args, **kwargs)


def test_interrupt_between_two_worker_starts_stops_the_first(monkeypatch):
    gst.shutdown_workers()
    _FailingStart(monkeypatch, at=2, error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        gst.launch(_ok, world_size=3)
    assert worker_pids() == []


def test_too_many_open_files_half_way_stops_the_started_ones(monkeypatch):
    gst.shutdown_workers()
    _FailingStart(monkeypatch, at=3, error=OSError(errno.EMFILE, "Too many open files"))
    with pytest.raises(OSError, match="ran out of file descriptors.*smaller world_size"):
        gst.launch(_ok, world_size=4)
    assert worker_pids() == []


@pytest.mark.skipif(os.name != "posix", reason="RLIMIT_NOFILE is POSIX")
def test_world_size_beyond_the_file_descriptor_limit_is_refused_before_starting():
    returncode, out, err = _run_script("""
        import resource
        import gradsync_tutorial as gst

        resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
        try:
            gst.launch(lambda rank, world_size: rank, world_size=40)
        except ValueError as e:
            print("refused:", e)
    """)
    assert returncode == 0, err[-2000:]
    assert "refused: world_size=40 is more ranks than this machine can start" in out
    assert "file descriptors" in out and "ulimit -n" in out


@pytest.mark.skipif(os.name != "posix", reason="RLIMIT_NOFILE is POSIX")
@pytest.mark.parametrize("spare", [0, 6, 10])
def test_descriptors_running_out_past_the_estimate_fail_at_once_with_the_hint(spare):
    """The estimate off (as when the descriptors cannot be counted), a limit of a few spare
    descriptors: the launch says so within seconds. It waited for the store's client, which
    retries until timeout + 30 s (130 s here), then raised DistNetworkError without the hint;
    with none spare, a bare OSError."""
    returncode, out, err = _run_script(f"""
        import os, resource, sys, time
        import torch.distributed  # loaded before the limit, as in a notebook that used it
        import gradsync_tutorial as gst
        from gradsync_tutorial.launcher import preflight

        preflight.max_world_size = lambda: (sys.maxsize, "")
        soft = len(os.listdir("/proc/self/fd")) + {spare}
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
        start = time.monotonic()
        try:
            gst.launch(lambda rank, world_size: rank, world_size=2, timeout=100)
        except OSError as e:
            print(f"refused in {{time.monotonic() - start:.1f}} s:", e)
    """)
    assert returncode == 0, err[-2000:]
    assert "could not start 2 worker processes: this process ran out of file descriptors" in out
    assert "`ulimit -n`" in out
    assert float(out.split("refused in ")[1].split(" s:")[0]) < 5, out


@pytest.mark.skipif(not hasattr(os, "sysconf"), reason="no sysconf on Windows")
def test_world_size_beyond_the_memory_is_refused_with_the_largest_that_fits(monkeypatch):
    if preflight.max_world_size()[0] < 2:
        pytest.skip("this machine cannot start 2 ranks")
    per_rank = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 3
    monkeypatch.setattr(preflight, "RANK_MEMORY_BYTES", per_rank)
    with pytest.raises(ValueError, match=r"world_size=5 is more ranks .* GB.*world_size=3 or f"):
        gst.launch(_ok, world_size=5)
    assert worker_pids() == []


# -- 4: output without a trailing newline, and lines that look like the end mark -------------


def test_output_without_a_final_newline_is_its_own_line_without_the_end_mark(capsys):
    def fn(rank, world_size):
        print(f"no newline {rank}", end="")
        sys.stderr.write("bar 50%\rbar 100%")  # a progress bar that never printed "\n"

    gst.launch(fn, world_size=2)
    out, err = capsys.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] no newline {rank}" in out.splitlines()
        assert f"[rank {rank}] bar 100%" in err.splitlines()
    assert "end-of-job" not in out + err and "\x1e" not in out + err


def test_a_line_that_looks_like_the_end_mark_is_printed_and_breaks_nothing(capsys):
    def fn(rank, world_size, mark):
        print(f"{mark} 1")  # what the mark of job 1 looked like
        print(f"{mark} not-a-job-number")
        print(f"after {rank}")

    for _ in range(2):
        gst.launch(fn, world_size=2, args=(END_MARK,))
    out, _ = capsys.readouterr()
    assert out.count("gradsync-end-of-job 1") == 4
    assert out.count("gradsync-end-of-job not-a-job-number") == 4
    assert out.count("[rank 0] after 0") == 2 and out.count("[rank 1] after 1") == 2


# -- 5: the timeout judges results, not the output still being printed -----------------------


class _SlowTerminal:
    """A notebook that takes 1 ms to show each line."""

    def __init__(self):
        self.lines = 0

    def write(self, text):
        if text.strip():
            self.lines += 1
            time.sleep(0.001)
        return len(text)

    def flush(self):
        pass


def test_ranks_that_printed_a_lot_and_returned_in_time_do_not_time_out(monkeypatch):
    gst.launch(_ok, world_size=2)  # warm workers: the job alone counts

    def fn(rank, world_size):
        sys.stdout.write("".join(f"line {i}\n" for i in range(2500)))  # returns in ms
        return rank

    terminal = _SlowTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert gst.launch(fn, world_size=2, timeout=2) == [0, 1]  # ~5 s to show the lines
    assert terminal.lines == 5000  # and every line was shown


# -- 6: results come back as they were -------------------------------------------------------


def test_results_keep_their_containers_and_tensors_arrive_detached_on_cpu():
    def fn(rank, world_size):
        @dataclasses.dataclass
        class Stats:
            weights: torch.Tensor

        w = torch.ones(2, requires_grad=True)
        by_label = collections.defaultdict(list, {"a": [w * 2]})
        return {"by_label": by_label, "counts": collections.Counter("aab"),
                "stats": Stats(w * 3), "ordered": collections.OrderedDict(b=1, a=w * 4)}

    result = gst.launch(fn, world_size=2)[1]
    by_label = result["by_label"]
    assert type(by_label) is collections.defaultdict and by_label.default_factory is list
    assert torch.equal(by_label["a"][0], torch.full((2,), 2.0))
    assert by_label["missing"] == []  # the default factory still works
    assert result["counts"] == collections.Counter({"a": 2, "b": 1})
    stats = result["stats"]
    assert torch.equal(stats.weights, torch.full((2,), 3.0))
    assert list(result["ordered"]) == ["b", "a"]
    for t in (by_label["a"][0], stats.weights, result["ordered"]["a"]):
        assert t.device.type == "cpu" and not t.requires_grad


# -- 8: a port used by a failed launch is free again at once ---------------------------------


def test_master_port_of_a_failed_launch_can_be_used_again_at_once():
    def fn(rank, world_size):
        import torch.distributed as dist

        if rank == 1:
            raise ValueError("fails")
        dist.all_reduce(torch.ones(1))

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RankFailedError):
        gst.launch(fn, world_size=2, master_port=port)
    assert gst.launch(lambda rank, ws: os.environ["MASTER_PORT"], 2, master_port=port) == [
        str(port)] * 2


# -- 9: bad arguments: tests/launcher/test_preflight.py -----------------------------------------


def test_show_ranks_given_as_an_iterator_shows_those_ranks(capsys):
    def fn(rank, world_size):
        print(f"hello from {rank}")

    gst.launch(fn, world_size=2, show_ranks=iter([1]))
    gst.launch(fn, world_size=2, show_ranks=(r for r in range(2) if r == 0))
    out = capsys.readouterr().out
    assert "[rank 1] hello from 1" in out and "[rank 0] hello from 0" in out
    assert out.count("hello") == 2


# -- 10: a warm worker starts each job as a fresh interpreter would --------------------------


def _global_state(rank, world_size):
    import random
    import warnings

    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("shown", UserWarning, stacklevel=1)  # raises after simplefilter("error")
    return {
        "grad": torch.is_grad_enabled(), "dtype": torch.get_default_dtype(),
        "all_reduce": t.item(), "warning": [str(w.message) for w in caught],
        "spoiled_path": "/spoiled" in sys.path, "sigterm": signal.getsignal(signal.SIGTERM),
        "recursion": sys.getrecursionlimit(), "deterministic":
        torch.are_deterministic_algorithms_enabled(),
        "seed": torch.initial_seed(), "random": random.random(),
    }


def _spoil(rank, world_size):
    import random
    import warnings

    import torch.distributed as dist

    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    dist.all_reduce = lambda tensor, *args, **kwargs: None  # a monkeypatch left behind
    warnings.simplefilter("error")
    sys.path.append("/spoiled")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setrecursionlimit(5000)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    random.seed(0)


def test_warm_workers_start_each_job_with_a_fresh_interpreters_state():
    gst.shutdown_workers()
    fresh = gst.launch(_global_state, world_size=2)
    pids = gst.launch(lambda rank, ws: os.getpid(), world_size=2)
    gst.launch(_spoil, world_size=2)
    after = gst.launch(_global_state, world_size=2)
    assert gst.launch(lambda rank, ws: os.getpid(), world_size=2) == pids  # same processes
    for before, now in zip(fresh, after, strict=True):
        random_state = ("seed", "random")
        assert {k: v for k, v in now.items() if k not in random_state} == {
            k: v for k, v in before.items() if k not in random_state}
        assert now["all_reduce"] == 2.0 and now["grad"] and now["warning"] == ["shown"]
        assert now["seed"] != 0  # reseeded, as a new process is


# -- 11: the rendezvous store listens on the loopback interface only -------------------------


def _listening_addresses(port: int) -> list[str]:
    """Addresses with a socket listening on ``port`` (Linux: /proc/net/tcp and tcp6)."""
    found = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


@linux_only
def test_rendezvous_store_listens_on_loopback_only():
    def fn(rank, world_size, listening):
        return listening(int(os.environ["MASTER_PORT"]))

    for addresses in gst.launch(fn, world_size=2, args=(_listening_addresses,)):
        assert addresses == ["0100007F"]  # 127.0.0.1 only, nothing on 0.0.0.0 or ::


# -- platforms: each branch, with the platform monkeypatched ---------------------------------


class _FakeProc:
    pid = 424242

    def __init__(self):
        self.killed = False

    def poll(self):
        return None

    def kill(self):
        self.killed = True


def test_windows_branch_starts_in_a_new_group_and_stops_the_tree_with_taskkill(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "name", "nt")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setattr(os, "killpg", lambda *a: pytest.fail("no killpg on Windows"),
                        raising=False)
    assert process_tree.popen_kwargs() == {"creationflags": 0x200}  # CREATE_NEW_PROCESS_GROUP
    proc = _FakeProc()
    assert process_tree.tree(proc) == set()  # taskkill /T finds the tree itself
    process_tree.signal_tree(proc, set(), signal.SIGTERM)
    assert calls == [["taskkill", "/F", "/T", "/PID", "424242"]] and proc.killed


def test_posix_branch_starts_a_new_session_and_signals_group_and_tree(monkeypatch):
    sent = []
    monkeypatch.setattr(os, "name", "posix")
    monkeypatch.setattr(os, "killpg", lambda pid, sig: sent.append(("group", pid, sig)),
                        raising=False)
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(("pid", pid, sig)))
    assert process_tree.popen_kwargs() == {"start_new_session": True}
    process_tree.signal_tree(_FakeProc(), {7, 8}, 15)
    assert sent[0] == ("group", 424242, 15) and sorted(sent[1:]) == [("pid", 7, 15),
                                                                    ("pid", 8, 15)]


def test_macos_branch_reads_the_process_table_from_ps(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")

    class Done:
        stdout = "  1     0\n 10     1\n 11    10\n 12    11\n garbage\n"

    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: Done)
    assert process_tree.process_table() == [(1, 0), (10, 1), (11, 10), (12, 11)]
    proc = _FakeProc()
    proc.pid = 10
    monkeypatch.setattr(os, "name", "posix")
    assert process_tree.tree(proc) == {11, 12}  # the child and the grandchild


@linux_only
def test_linux_branch_reads_the_process_table_from_proc():
    table = dict(process_tree.process_table())
    assert table[os.getpid()] == os.getppid()


def test_parent_death_signal_only_on_linux(monkeypatch):
    import ctypes

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail("no prctl off Linux"))
    process_tree.die_with_parent()  # a no-op, not an error


def test_store_on_windows_binds_its_own_port(monkeypatch):
    import torch.distributed as dist

    made = []
    monkeypatch.setattr(os, "name", "nt")
    monkeypatch.setattr(dist, "TCPStore", lambda host, port, **kw: made.append((host, kw)))
    run._rendezvous_store(None, 5, 2)
    assert made[0][0] == "127.0.0.1" and "master_listen_fd" not in made[0][1]


def test_limits_without_sysconf_or_resource(monkeypatch):
    """Windows has neither os.sysconf nor the resource module: no cap, and no crash."""
    monkeypatch.delattr(os, "sysconf")
    monkeypatch.setitem(sys.modules, "resource", None)  # import resource -> ImportError
    assert preflight.max_world_size() == (sys.maxsize, "")


def test_cpu_count_without_sched_getaffinity(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert preflight.cpu_count() == 6


def test_a_job_timeout_still_ends_on_time_with_output_pending():
    """The deadline still applies to ranks that have not returned (the fault matrix)."""

    def fn(rank, world_size):
        import torch.distributed as dist

        print("x" * 100, end="")  # pending output without a newline, then a hang
        if rank == 0:
            dist.all_reduce(torch.ones(1))
        return rank

    with pytest.raises(LaunchTimeoutError, match="rank 0 had not finished"):
        gst.launch(fn, world_size=2, timeout=5)
    assert worker_pids() == []
