"""gradsync_tutorial.launch: real worker processes, gloo on the CPU.

Every failure case ends with a check that no worker process is left (the `no_workers_left`
fixture). Functions are defined inside the tests (closures), in a `__main__` script and in a
real notebook, since functions defined where the worker cannot import them are the point.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import gradsync_tutorial as gst
from gradsync_tutorial.launcher import LaunchTimeoutError, RankFailedError, pool, preflight, run

from ..conftest import REPO, start_kernel_like, wait_dead, worker_pids

pytestmark = pytest.mark.usefixtures("no_workers_left")
# Signals (SIGKILL, SIGABRT), process groups and sessions: POSIX only.
posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX signals and sessions")


# -- success ---------------------------------------------------------------------------------


def test_closure_results_ordered_by_rank_tensors_on_cpu():
    captured = torch.arange(3.0)

    def fn(rank, world_size, scale):
        import torch.distributed as dist

        t = captured * (rank + 1)
        dist.all_reduce(t)  # every rank receives the sum over all ranks
        return {"rank": rank, "sum": t, "scale": scale}

    results = gst.launch(fn, world_size=3, args=(10,))
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert torch.equal(r["sum"], captured * 6)
        assert r["sum"].device.type == "cpu"
        assert r["scale"] == 10


def test_worker_environment_is_torchruns(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the default rule below

    def fn(rank, world_size):
        import torch.distributed as dist

        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"]
        return {k: os.environ[k] for k in keys} | {
            "initialized": dist.is_initialized(), "backend": dist.get_backend(),
            "threads": torch.get_num_threads(), "dist_rank": dist.get_rank(),
        }

    results = gst.launch(fn, world_size=2)
    cores = preflight.cpu_count()  # the cores this process may use, on every platform
    for rank, env in enumerate(results):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank) == str(env["dist_rank"])
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["initialized"] and env["backend"] == "gloo"
        assert env["threads"] == max(1, cores // 2)
    assert results[0]["MASTER_PORT"] == results[1]["MASTER_PORT"]
    # The rendezvous port is released when launch returns.
    with socket.socket() as s:
        s.bind(("127.0.0.1", int(results[0]["MASTER_PORT"])))
    assert gst.launch(lambda rank, ws: torch.get_num_threads(), 2, num_threads=1) == [1, 1]


def test_a_set_omp_num_threads_is_kept_as_torchrun_keeps_it(monkeypatch):
    """OMP_NUM_THREADS=1 in the notebook's environment (a cluster's default, say): the ranks get
    1 thread, as this process has, and as torchrun's ranks would. So one rank computes what this
    process computes, to the bit (notebook 02 compares a 1-rank launch with notebook 01's loop)."""
    def threads(rank, world_size):
        return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert gst.launch(threads, 1) == [(1, "1")]
    assert gst.launch(threads, 2) == [(1, "1"), (1, "1")]
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")  # ignored, as a value torch ignores
    assert gst.launch(threads, 1) == [(preflight.cpu_count(), str(preflight.cpu_count()))]


def test_output_is_prefixed_and_filterable(capsys):
    def fn(rank, world_size):
        print(f"hello from {rank}")
        print(f"warning from {rank}", file=sys.stderr)
        os.write(1, f"raw fd write {rank}\n".encode())  # below Python: still shown

    gst.launch(fn, world_size=2)
    out, err = capsys.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] hello from {rank}" in out.splitlines()
        assert f"[rank {rank}] raw fd write {rank}" in out.splitlines()
        assert f"[rank {rank}] warning from {rank}" in err.splitlines()
    gst.launch(fn, world_size=2, show_ranks=[1])
    out, err = capsys.readouterr()
    assert "[rank 1] hello from 1" in out and "[rank 0]" not in out + err


def test_reused_worker_starts_clean(capsys, monkeypatch):
    def fn(rank, world_size):
        import io

        print(f"visible {os.environ.get('GST_TEST_VAR')}")
        sys.stderr.write("progress 10%\rprogress 100%\n")  # a bar redrawn with \r
        sys.stdout = io.StringIO()  # a job that swaps stdout and never restores it
        print("swallowed")

    monkeypatch.setenv("GST_TEST_VAR", "one")
    gst.launch(fn, world_size=2)
    monkeypatch.delenv("GST_TEST_VAR")
    gst.launch(fn, world_size=2)  # same workers: stdout restored, environment the kernel's
    out, err = capsys.readouterr()
    assert out.count("[rank 0] visible one") == 1 and out.count("[rank 0] visible None") == 1
    assert err.count("[rank 1] progress 100%") == 2 and "10%" not in err


def test_repeat_launch_reuses_the_same_workers():
    pids = gst.launch(lambda rank, ws: os.getpid(), world_size=2)
    assert gst.launch(lambda rank, ws: os.getpid(), world_size=2) == pids
    # reuse_workers=False: fresh interpreters (new code imported), stopped after the launch.
    fresh = gst.launch(lambda rank, ws: os.getpid(), 2, reuse_workers=False)
    assert set(fresh).isdisjoint(pids)
    assert worker_pids() == []
    # A different world size cannot reuse the pool: it starts its own.
    three = gst.launch(lambda rank, ws: os.getpid(), world_size=3)
    assert gst.launch(lambda rank, ws: os.getpid(), world_size=3) == three


def _pids(world_size):
    return gst.launch(lambda rank, ws: os.getpid(), world_size=world_size)


def test_the_pools_of_the_last_two_sizes_stay_warm_and_a_failure_stops_both():
    """An exercise check runs at 2 and then 3 ranks: the next check starts no process. A third
    size retires the least recently launched pool; a failed launch leaves no worker at all."""
    two, three = _pids(2), _pids(3)
    assert _pids(2) == two and _pids(3) == three  # both kept
    assert sorted(worker_pids()) == sorted(two + three)
    four = _pids(4)  # 2 was launched least recently: retired
    assert sorted(worker_pids()) == sorted(three + four)
    assert _pids(3) == three and set(_pids(2)).isdisjoint(two)
    with pytest.raises(RankFailedError):
        gst.launch(lambda rank, ws: 1 / 0, world_size=2)
    assert worker_pids() == []


def _run_script(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, **kwargs)


def test_function_defined_in_main_script():
    proc = _run_script("""
        import gradsync_tutorial as gst

        def train(rank, world_size):
            print("training on", rank)
            return rank * 10

        if __name__ == "__main__":
            print("results", gst.launch(train, world_size=2))
    """)
    assert proc.returncode == 0, proc.stderr
    assert "results [0, 10]" in proc.stdout
    assert "[rank 1] training on 1" in proc.stdout


def test_function_defined_in_a_notebook_cell():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import gradsync_tutorial as gst\nimport torch"),
        nbformat.v4.new_code_cell(textwrap.dedent("""
            class Box:  # a class defined in the notebook travels too
                def __init__(self, v):
                    self.v = v

            def train(rank, world_size):
                import torch.distributed as dist
                t = torch.tensor([Box(rank + 1).v], dtype=torch.float32)
                dist.all_reduce(t)
                print("sum", t.item())
                return t.item()

            print("results", gst.launch(train, world_size=2))
        """)),
        nbformat.v4.new_code_cell("gst.launch(lambda rank, ws: 1 / 0, world_size=2)"),
    ]
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     allow_errors=True, resources={"metadata": {"path": REPO}})
    client.execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "results [3.0, 3.0]" in text
    assert "[rank 0] sum 3.0" in text and "[rank 1] sum 3.0" in text
    error = nb.cells[2].outputs[-1]
    assert error["ename"] == "RankFailedError"
    assert "raised ZeroDivisionError: division by zero" in error["evalue"]
    shown = "\n".join(error["traceback"])
    # The reader's line and the rank's traceback, nothing of the launcher (IPython would show
    # the line that raised, though hidden): no "During handling of ..." chain, no helper frames.
    assert "1 / 0" in shown and "gst.launch(lambda" in shown
    assert "Cell In[3], line 1, in <lambda>" in error["evalue"]  # not the kernel's temp file
    assert "run.py" not in shown and "gradsync_tutorial" not in shown, shown
    assert "During handling" not in shown


# -- failures --------------------------------------------------------------------------------


def test_rank_raises_names_rank_type_message_and_source_line(capsys):
    def train(rank, world_size):
        import torch.distributed as dist

        print(f"step 1 on {rank}")
        if rank == 1:
            raise ValueError("loss is NaN on rank 1")
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankFailedError) as info:
        gst.launch(train, world_size=2)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert str(err).startswith("rank 1 raised ValueError: loss is NaN on rank 1")
    assert 'raise ValueError("loss is NaN on rank 1")' in str(err)  # the user's line
    assert __file__ in err.traceback
    assert isinstance(err.exception, ValueError)
    assert err.__cause__ is None and err.__suppress_context__  # its traceback shown once
    assert "[rank 1] step 1 on 1" in capsys.readouterr().out
    assert worker_pids() == []


def test_every_rank_raises():
    def fn(rank, world_size):
        raise KeyError(f"missing-{rank}")

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    assert set(info.value.failures) == {0, 1}
    other = 1 - info.value.rank  # either rank may report first: the other is listed after it
    assert (f"Other ranks failed after it:\n  rank {other} raised KeyError: 'missing-{other}'"
            in str(info.value))
    assert "consequence" not in str(info.value)
    assert worker_pids() == []


@pytest.mark.parametrize(
    ("how", "expected"),
    [pytest.param("kill", "was killed by SIGKILL", marks=posix_only),
     ("exit", "exited with code 3")],
)
def test_rank_dies_without_result(how, expected):
    def fn(rank, world_size):
        import torch.distributed as dist

        if rank == 1:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    assert str(info.value).startswith(f"rank 1 {expected} before returning a result")
    if how == "exit":  # rank 0, in all_reduce with rank 1, then lost its peer
        assert "rank 0 raised" not in str(info.value) or "consequence" in str(info.value)
    assert info.value.rank == 1
    assert worker_pids() == []


def test_the_rank_that_died_is_blamed_even_when_its_peer_reports_first():
    """gloo's "Read error ... Connection reset by peer" on rank 0 can arrive before the launcher
    sees rank 1's process end; rank 1 is still the story."""
    from gradsync_tutorial.launcher.errors import _blame, exit_failure, rank_failed_error
    from gradsync_tutorial.launcher.pool import JobState
    from gradsync_tutorial.launcher.protocol import Raised

    state = JobState(1)
    state.sent = True
    state.on_message(0, Raised(1, "RuntimeError", "[pair.cc:545] Read error [127.0.0.1]:"
                               "41234: Connection reset by peer", "Traceback ...", None,
                               lost_peer=True))
    state.fail(exit_failure(1, -signal.SIGKILL, started=True))
    failures = list(state.failures.values())
    assert _blame(failures).rank == 1
    message = str(rank_failed_error(failures, started=True))
    assert message.startswith("rank 1 was killed by SIGKILL before returning a result")
    assert "rank 0 raised RuntimeError" in message
    assert "(a consequence: a peer went away)" in message


def test_skipped_collective_times_out_naming_the_stuck_rank():
    def fn(rank, world_size):
        import torch.distributed as dist

        if rank == 0:  # the bug: only rank 0 calls the collective
            dist.all_reduce(torch.ones(1))
        return rank

    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        gst.launch(fn, world_size=2, timeout=6)
    assert time.monotonic() - start < 6 + 5
    assert info.value.unfinished == [0]
    message = str(info.value)
    assert "rank 0 had not finished (rank 1 returned)" in message
    # the diagnosis and its advice; not "pass a larger timeout=": this hang never ends
    assert "rank 1 never reached the collective rank 0 is waiting in" in message
    assert "`if rank == 0:`" in message and "timeout=" not in message
    assert worker_pids() == []


def test_timeout_counts_from_ready_ranks_not_from_start_up(monkeypatch):
    """Cold workers take seconds to import torch; a 1-second job timeout must not count that."""
    gst.shutdown_workers()
    # An environment no template has imported torch in: this start is cold (Linux: a new
    # template; elsewhere every start is).
    monkeypatch.setenv("GRADSYNC_TEST_COLD_START", str(time.monotonic()))
    start = time.monotonic()
    assert gst.launch(_ok, world_size=2, timeout=1.0, reuse_workers=False) == [0, 1]
    assert time.monotonic() - start > 1.0  # it was a cold start, longer than the timeout


def test_workers_that_do_not_start_in_time_are_reported(monkeypatch):
    monkeypatch.setattr(run, "STARTUP_SECONDS", 0.2)  # importing torch takes longer
    monkeypatch.setattr(pool, "FORK_FROM_TEMPLATE", False)  # a fork of a warm template may not
    gst.shutdown_workers()
    with pytest.raises(LaunchTimeoutError, match="worker processes did not start within 0.2 s"):
        gst.launch(_ok, world_size=2, timeout=0.2)
    assert worker_pids() == []


def test_unserializable_return_value_is_reported():
    with pytest.raises(RankFailedError, match="could not be serialized back"):
        gst.launch(lambda rank, ws: threading.Lock(), world_size=2)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test, as in a Jupyter cell, however pytest was
    started: a shell starts background jobs (``nohup make test &``) with SIGINT ignored, and
    Python then installs no KeyboardInterrupt handler (test_sigint_ignored.py)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_keyboard_interrupt_stops_every_rank(sigint_raises):
    def fn(rank, world_size):
        print("sleeping")
        time.sleep(60)

    timer = threading.Timer(4.0, __import__("_thread").interrupt_main)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            gst.launch(fn, world_size=2)
    finally:
        timer.cancel()
    assert time.monotonic() - start < 15
    assert worker_pids() == []


# The script sets what ipykernel sets while a cell runs: SIGINT raises KeyboardInterrupt, even
# when the script inherited SIGINT ignored from a background job.
KERNEL_SCRIPT = """
    import os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import gradsync_tutorial as gst

    def fn(rank, world_size):
        print("pid", os.getpid(), flush=True)
        time.sleep(120)

    try:
        gst.launch(fn, world_size=2)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(42)
"""


@posix_only
@pytest.mark.parametrize("target", ["process", "process group"])
def test_sigint_to_kernel_stops_ranks(target):
    proc, pids = start_kernel_like(KERNEL_SCRIPT)
    if target == "process":
        proc.send_signal(signal.SIGINT)
    else:  # what Jupyter's stop button does to a kernel started in its own group
        os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:  # a failed check leaves no kernel behind, nor its ranks
        proc.kill()
        proc.wait()
    assert proc.returncode == 42 and "KeyboardInterrupt" in out
    assert wait_dead(pids) == []


@posix_only
def test_killed_kernel_leaves_no_orphans():
    proc, pids = start_kernel_like(KERNEL_SCRIPT)
    proc.kill()  # SIGKILL: no cleanup code runs in the kernel at all
    proc.wait()
    assert wait_dead(pids) == [], "workers outlived a killed kernel"


def test_two_launches_at_once_do_not_collide():
    code = """
        import gradsync_tutorial as gst, torch

        def fn(rank, world_size):
            import torch.distributed as dist
            t = torch.ones(1)
            for _ in range(200):
                dist.all_reduce(t)
                t /= world_size
            return t.item()

        print("result", gst.launch(fn, world_size=2))
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "result [1.0, 1.0]" in out


def test_taken_master_port_fails_fast_and_busy_env_port_is_ignored(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"master_port={port} is not free"):
            gst.launch(lambda rank, ws: rank, 2, master_port=port)
        assert worker_pids() == []
        # A MASTER_PORT left in the kernel's environment is not used: launch picks its own.
        monkeypatch.setenv("MASTER_PORT", str(port))
        ports = gst.launch(lambda rank, ws: os.environ["MASTER_PORT"], world_size=2)
        assert ports[0] == ports[1] != str(port)


# -- bad input fails fast, before any process starts -----------------------------------------


def _ok(rank, world_size):
    return rank


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_nccl_without_gpus_fails_fast():
    with pytest.raises(ValueError, match="backend='nccl' needs one CUDA GPU per rank"):
        gst.launch(_ok, world_size=2, backend="nccl")
    assert worker_pids() == []


@posix_only
def test_dead_rank_error_quotes_its_last_stderr_lines():
    def fn(rank, world_size):
        if rank == 1:
            print("about to abort: native library says why", file=sys.stderr, flush=True)
            os.abort()
        return rank

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    message = str(info.value)
    assert message.startswith("rank 1 was killed by SIGABRT")
    assert "Its last lines on stderr:\n  about to abort: native library says why" in message


def test_traceback_shows_source_lines_of_functions_passed_in_args():
    def average(values):
        return sum(values) / len(values)  # divides by zero for an empty list

    def fn(rank, world_size, reduce):
        return reduce([] if rank == 1 else [1.0])

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2, args=(average,))
    assert "return sum(values) / len(values)" in info.value.traceback


def test_a_rank_s_traceback_shows_the_reader_s_collective_not_the_launcher_s_wrappers():
    def fn(rank, world_size):
        import torch.distributed as dist

        dist.all_reduce([1.0, 2.0])  # a list, not a tensor: torch raises inside the call
        return rank

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    shown = info.value.traceback
    assert "dist.all_reduce([1.0, 2.0])" in shown  # the reader's line
    assert "distributed_c10d.py" in shown  # torch's own frames stay: they say what it checked
    # The launcher's wrappers (the collective counter, its own group) are not in the story.
    assert "detect.py" not in shown and "own_group.py" not in shown


def test_ranks_are_stopped_before_the_rendezvous_store_closes(capsys):
    """Found by the e2e suite: on a failure the launcher closed its store first, so a rank still
    talking to it (joining the rendezvous, say) printed torch's "Connection was likely closed"
    warning and a C++ stack dump into the cell before being stopped."""

    def fn(rank, world_size):
        import torch.distributed as dist

        if rank == 1:
            raise ValueError("rank 1 fails at once")
        store = dist.distributed_c10d._get_default_store()
        while True:  # rank 0 keeps using the store until the launcher stops it
            store.set("probe", "x")

    with pytest.raises(RankFailedError) as info:
        gst.launch(fn, world_size=2)
    assert info.value.rank == 1
    out, err = capsys.readouterr()
    assert "TCPStore" not in out + err and "Connection was likely closed" not in out + err
    assert worker_pids() == []
