"""Whole jobs, as torchrun runs them: a launch pickles what torch scripts touch, stops only
jobs that can never end, loses no rank's work, and forgets each job exactly.

Each test is a class of program that a torchrun script is, run through ``gst.launch``: what
torchrun would do is what the launch must do.
"""

from __future__ import annotations

import pytest

import gradsync_tutorial as gst

pytestmark = pytest.mark.usefixtures("no_workers_left")


# -- (1) what fn touches is sent: torch's module subclasses by reference -------------------------


def test_a_function_that_sets_torch_backends_flags_is_launched():
    import torch.backends.cudnn  # noqa: F401 - the module subclasses torch puts in sys.modules
    import torch.backends.mkldnn  # noqa: F401

    def train(rank, world_size):
        torch.backends.cudnn.benchmark = True  # the first line of many torchrun scripts
        torch.backends.cuda.matmul.allow_tf32 = False
        return torch.backends.mkldnn.is_available() in (True, False)

    assert gst.launch(train, world_size=2) == [True, True]


def test_a_module_passed_as_an_argument_arrives_as_the_worker_s_own():
    import torch.backends.cudnn

    def same_module(rank, world_size, module):
        import sys

        return module is sys.modules["torch.backends.cudnn"]

    assert gst.launch(same_module, 2, args=(torch.backends.cudnn,)) == [True, True]


def test_an_unpicklable_global_is_named_as_what_fn_uses_not_as_an_argument():
    import threading

    lock = threading.Lock()

    def uses_a_lock(rank, world_size):
        with lock:
            return rank

    with pytest.raises(TypeError) as caught:
        gst.launch(uses_a_lock, world_size=2)
    message = str(caught.value)
    assert "`lock`" in message and "inside fn" in message
    assert "pass tensors" not in message  # fn was passed nothing

    with pytest.raises(TypeError) as caught:
        gst.launch(lambda rank, world_size, x: rank, 2, args=(threading.Lock(),))
    assert "args[0]" in str(caught.value)


# -- (2) the early stop: only a collective (or send/recv) of a group a returned rank is in --------


def test_a_subgroup_made_with_local_synchronization_is_not_stopped_early():
    def fn(rank, world_size):
        import time

        import torch
        import torch.distributed as dist

        if rank == 0:
            return "skipped"  # the flag exists so that rank 0 need not call new_group
        if rank == 2:
            time.sleep(5)  # late: rank 1 waits in new_group meanwhile, in no collective
        pair = dist.new_group([1, 2], use_local_synchronization=True)
        t = torch.ones(1)
        dist.all_reduce(t, group=pair)
        return t.item()

    assert gst.launch(fn, world_size=3, timeout=120) == ["skipped", 2.0, 2.0]


def test_a_checkpoint_saved_alone_is_not_stopped_early(tmp_path):
    def fn(rank, world_size, folder):
        import time
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        if rank == 1:  # saved by rank 1 alone, as no_dist=True allows, again and again for 6 s
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single..."
            state = {f"w{i}": torch.randn(512, 512) for i in range(20)}
            end = time.monotonic() + 6
            while time.monotonic() < end:
                dcp.save(state, checkpoint_id=str(folder / "step"), no_dist=True)
        return rank

    assert gst.launch(fn, 2, args=(tmp_path,), timeout=120) == [0, 1]
    assert (tmp_path / "step" / ".metadata").exists()


def test_a_monitored_barrier_whose_coordinator_returned_fails_at_once():
    import time

    def fn(rank, world_size):
        from datetime import timedelta

        import torch.distributed as dist

        if rank == 1:  # rank 0, its coordinator, never calls it: it returns at once
            dist.monitored_barrier(timeout=timedelta(seconds=100))
        return rank

    start = time.monotonic()
    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=100)
    assert time.monotonic() - start < 30  # torchrun fails in seconds, not at the 100 s timeout
    message = str(caught.value)
    assert "rank 0 returned" in message and "rank 1 is waiting in dist.monitored_barrier" in message


# -- (3) threads fn leaves running finish, as at the exit of a torchrun process ----------------


def test_a_thread_fn_left_running_finishes_before_the_launch_returns(tmp_path):
    def fn(rank, world_size, folder):
        import threading
        import time

        def save():
            time.sleep(2)  # a background save, still writing when fn returns
            (folder / f"rank{rank}").write_text("saved")

        threading.Thread(target=save, name="background-save").start()
        return rank

    assert gst.launch(fn, 2, args=(tmp_path,), timeout=60) == [0, 1]
    gst.shutdown_workers()  # under torchrun the process would have waited for the thread
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_a_thread_that_reuses_an_ended_thread_s_ident_is_still_waited_for():
    """A thread alive at the job's start ends; the next thread often gets its ident (on Linux,
    the same stack reused). The job still waits for that new thread."""
    import threading
    import time

    from gradsync_tutorial.launcher import worker

    gate = threading.Event()
    old = threading.Thread(target=gate.wait)
    old.start()
    before = set(threading.enumerate())  # as at the job's start: the old thread alive
    gate.set()
    old.join()
    saved = []
    new = threading.Thread(target=lambda: (time.sleep(0.3), saved.append(True)))
    new.start()
    worker._wait_for_threads(before, None)
    assert saved, f"not waited for (ident reused: {new.ident == old.ident})"


def _print_from_a_daemon_forever(rank, world_size):
    import threading
    import time

    def chatter():
        while True:
            print("left-behind daemon says hi", flush=True)
            time.sleep(0.05)

    threading.Thread(target=chatter, name="chatter", daemon=True).start()
    time.sleep(0.2)
    return rank


def _rank_of(rank, world_size):
    return rank


def test_a_daemon_thread_left_running_retires_the_workers_and_prints_no_more(capfd):
    """Under torchrun a daemon thread ends with the rank's process: here it would print into
    every later cell. The workers are retired, and the launch says why."""
    assert gst.launch(_print_from_a_daemon_forever, 2) == [0, 1]
    first = capfd.readouterr().err
    assert "daemon thread 'chatter'" in first and "retired" in first
    assert gst.launch(_rank_of, 2) == [0, 1]
    later = capfd.readouterr()
    assert "left-behind daemon" not in later.out + later.err


def test_work_queued_on_an_executor_finishes_and_an_idle_one_does_not_hold_the_launch(tmp_path):
    def fn(rank, world_size, folder):
        import builtins
        import time
        from concurrent.futures import ThreadPoolExecutor

        def save():
            time.sleep(2)
            (folder / f"rank{rank}").write_text("saved")

        ThreadPoolExecutor(1).submit(save)  # dropped: its thread ends after the save
        builtins.idle_pool = kept = ThreadPoolExecutor(2)  # kept alive, idle, across the job
        kept.submit(time.sleep, 0).result()
        return rank

    start = __import__("time").monotonic()
    assert gst.launch(fn, 2, args=(tmp_path,), timeout=60) == [0, 1]
    assert __import__("time").monotonic() - start < 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_a_thread_that_never_ends_is_named_at_the_timeout():
    def fn(rank, world_size):
        import threading
        import time

        def forever():
            while True:
                time.sleep(0.1)

        threading.Thread(target=forever, name="never-ending").start()
        return rank

    with pytest.raises(gst.LaunchTimeoutError) as caught:
        gst.launch(fn, world_size=2, timeout=5)
    assert "'never-ending'" in str(caught.value) and "in forever" in str(caught.value)


# -- (4) a job on warm workers sees what a fresh process would: nothing of the job before ------


def looks_fresh_after(leak, look, **launch):
    """``look``'s answer on fresh workers, then after ``leak`` ran on them: (fresh, after)."""
    fresh = gst.launch(look, world_size=2, **launch)
    gst.launch(leak, world_size=2, **launch)
    return fresh, gst.launch(look, world_size=2, **launch)


def precision_flags(rank, world_size):
    """Every float32-precision flag torch has, old API and new (an error read as its text)."""
    import torch

    backends = torch.backends
    read = {
        "matmul precision": torch.get_float32_matmul_precision,
        "cudnn.allow_tf32": lambda: backends.cudnn.allow_tf32,
        "cuda.matmul.allow_tf32": lambda: backends.cuda.matmul.allow_tf32,
        **{f"{name}.fp32_precision": (lambda o=o: o.fp32_precision) for name, o in [
            ("backends", backends), ("cuda.matmul", backends.cuda.matmul),
            ("cudnn.conv", backends.cudnn.conv), ("cudnn.rnn", backends.cudnn.rnn),
            ("mkldnn.matmul", backends.mkldnn.matmul)]},
    }
    flags = {}
    for name, get in read.items():
        try:
            flags[name] = get()
        except RuntimeError as e:
            flags[name] = f"raised {str(e)[:60]}"
    return flags


def test_a_job_s_matmul_precision_does_not_reach_the_next_and_reads_without_error():
    def medium(rank, world_size):
        import torch

        torch.set_float32_matmul_precision("medium")  # float32 matmuls in bfloat16 from here
        torch.backends.cudnn.allow_tf32 = True  # the old API, mixed in

    fresh, after = looks_fresh_after(medium, precision_flags)
    assert after == fresh
    assert fresh[0]["matmul precision"] == "highest"  # read without "mix of the legacy and new"


def test_a_pending_alarm_does_not_reach_the_next_job():
    def arm(rank, world_size):
        import signal

        signal.alarm(1)  # fn's own watchdog, never cancelled: SIGALRM kills a fresh process...

    def slow(rank, world_size):
        import signal
        import time

        time.sleep(2)  # ...but this is another job, started after it
        return signal.alarm(0)

    gst.launch(arm, world_size=2)
    assert gst.launch(slow, world_size=2) == [0, 0]


def test_a_worker_that_set_its_interop_threads_is_not_reused():
    def interop(rank, world_size):
        import torch

        torch.set_num_interop_threads(2)  # once per process: a second call raises
        return torch.get_num_interop_threads()

    assert gst.launch(interop, world_size=2) == [2, 2]
    assert gst.launch(interop, world_size=2) == [2, 2]  # fresh workers, as a second torchrun


def test_functions_patched_in_torch_autograd_and_nn_init_are_put_back():
    def patch(rank, world_size):
        import torch

        zeros = torch.nn.init.zeros_
        torch.nn.init.kaiming_uniform_ = lambda tensor, *args, **kwargs: zeros(tensor)
        torch.autograd.backward = lambda *args, **kwargs: None

    def look(rank, world_size):
        import torch

        return (torch.nn.init.kaiming_uniform_.__module__, torch.autograd.backward.__module__,
                bool(torch.nn.Linear(4, 4).weight.abs().sum() > 0))

    fresh, after = looks_fresh_after(patch, look)
    assert after == fresh == [("torch.nn.init", "torch.autograd", True)] * 2


def test_a_global_module_hook_does_not_reach_the_next_job():
    def hook(rank, world_size):
        import importlib

        import torch

        def zero(module, inputs, output):
            return output * 0

        torch.nn.modules.module.register_module_forward_hook(zero)
        torch.nn.modules.module.register_module_forward_pre_hook(lambda module, inputs: None)
        importlib.import_module("torch.optim.optimizer").register_optimizer_step_pre_hook(
            lambda *args: None)

    def look(rank, world_size):
        import importlib

        import torch

        torch.manual_seed(0)
        hooks = [len(getattr(torch.nn.modules.module, name)) for name in (
            "_global_forward_hooks", "_global_forward_pre_hooks")]
        hooks.append(len(importlib.import_module("torch.optim.optimizer")._global_optimizer_pre_hooks))
        return hooks, torch.nn.Linear(2, 2)(torch.ones(2)).abs().sum().item() > 0

    fresh, after = looks_fresh_after(hook, look)
    assert after == fresh == [([0, 0, 0], True)] * 2


def test_logging_configured_inside_fn_does_not_reach_the_next_job():
    def configure(version):
        def fn(rank, world_size):
            import logging

            logging.basicConfig(level=logging.DEBUG, format=f"{version} %(message)s")
            logging.getLogger("train").setLevel(logging.ERROR)
            root = logging.getLogger()
            return [h.formatter._fmt for h in root.handlers], root.level
        return fn

    def look(rank, world_size):
        import logging

        root = logging.getLogger()
        return len(root.handlers), root.level, logging.getLogger("train").level

    fresh, after = looks_fresh_after(configure("v1"), look)
    assert after == fresh
    # An edited format is the one used, as in a fresh process (basicConfig once per process).
    assert gst.launch(configure("v2"), world_size=2) == [(["v2 %(message)s"], 10)] * 2


def test_warnings_captured_and_a_library_logger_configured_inside_fn_are_put_back():
    """logging.captureWarnings(True) routes warnings.showwarning through logging; torch's
    loggers set to DEBUG, with a handler: "torch.distributed" (torch configures it), and
    "torch.nn.parallel" (a placeholder until a job asks for it). The next job gets none of
    it, as a fresh process would."""
    NAMES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.nn.parallel")  # noqa: N806

    def configure(rank, world_size):
        import logging
        import sys

        logging.captureWarnings(True)
        for name in NAMES:
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(logging.StreamHandler(sys.stderr))
            logger.propagate = False

    def look(rank, world_size):
        import logging
        import warnings

        loggers = [(lg.level, len(lg.handlers), lg.propagate)
                   for lg in map(logging.getLogger, NAMES)]
        return warnings.showwarning.__module__, loggers

    fresh, after = looks_fresh_after(configure, look)
    assert fresh[0][0] == "warnings"
    assert after == fresh


def test_a_function_of_the_user_s_own_module_runs_as_edited_and_reloaded(tmp_path, monkeypatch):
    import importlib
    import os
    import sys

    module = tmp_path / "my_training.py"
    module.write_text("def train(rank, world_size):\n    return 'v1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_training", raising=False)
    my_training = importlib.import_module("my_training")
    assert gst.launch(my_training.train, world_size=2) == ["v1", "v1"]

    module.write_text("def train(rank, world_size):\n    return 'v2'\n")  # edited, same size
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    importlib.reload(my_training)  # what the notebook does after an edit
    assert gst.launch(my_training.train, world_size=2) == ["v2", "v2"]


def test_a_job_that_closed_its_standard_output_leaves_the_next_launches_fast_and_heard(capsys):
    import time

    def close_stdout(rank, world_size):
        import os

        os.close(1)  # a C library's clean-up, say: the rank's prints are lost from here

    def hello(rank, world_size):
        print(f"hello from rank {rank}")

    gst.launch(close_stdout, world_size=2)
    for _ in range(2):
        start = time.monotonic()
        gst.launch(hello, world_size=2)
        assert time.monotonic() - start < 3  # not the 5 s wait for an end mark that never came
    out = capsys.readouterr().out
    assert out.count("hello from rank 0") == out.count("hello from rank 1") == 2


def installed_library(site, name: str, code: str, files: dict[str, str] | None = None):
    """A library ``name`` installed under ``site`` (a folder named site-packages), with its
    ``.dist-info`` as pip writes it."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(code)
    for path, text in (files or {}).items():
        (site / name / path).parent.mkdir(parents=True, exist_ok=True)
        (site / name / path).write_text(text)
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{name}\n")


# A library whose compiled part registers a top-level helper module (pandas' _cyutility).
WITH_A_HELPER_MODULE = """
import importlib.util, pathlib, sys
_path = pathlib.Path(__file__).parent / "_libs" / "_cyutility_fake.py"
_spec = importlib.util.spec_from_file_location("_cyutility_fake", _path)
sys.modules["_cyutility_fake"] = _module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
"""


def test_an_installed_library_s_helper_module_does_not_retire_the_workers(
        tmp_path, monkeypatch, capsys):
    site = tmp_path / "lib" / "site-packages"
    installed_library(site, "fakepandas", WITH_A_HELPER_MODULE,
                      {"_libs/_cyutility_fake.py": "X = 1\n"})
    monkeypatch.syspath_prepend(str(site))

    def uses_the_library(rank, world_size):
        import os

        import fakepandas  # noqa: F401
        return os.getpid()

    def also_a_stateful_one(rank, world_size):
        import fakepandas  # noqa: F401

        from tests.programs import stateful_library  # noqa: F401

    first = gst.launch(uses_the_library, world_size=2)
    assert gst.launch(uses_the_library, world_size=2) == first  # kept warm
    assert "retired" not in capsys.readouterr().err
    gst.launch(also_a_stateful_one, world_size=2)
    note = capsys.readouterr().err
    assert "fn imported tests," in note and "fake" not in note  # only what the job imported


DATASETS_SWITCHES = """
_caching = True
def disable_caching():
    global _caching
    _caching = False
def is_caching_enabled():
    return _caching
"""


def test_datasets_switches_set_by_a_job_do_not_reach_the_next(tmp_path, monkeypatch):
    site = tmp_path / "lib" / "site-packages"
    installed_library(site, "datasets", DATASETS_SWITCHES)  # its process-wide switches
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(__import__("sys").modules, "datasets", raising=False)

    def no_cache(rank, world_size):
        import datasets

        datasets.disable_caching()

    def caching(rank, world_size):
        import datasets

        return datasets.is_caching_enabled()

    fresh, after = looks_fresh_after(no_cache, caching)
    assert after == fresh == [True, True]


def test_a_stateful_library_loaded_with_fn_s_module_retires_and_the_note_says_so(
        tmp_path, monkeypatch, capsys):
    """fn's module imports datasets at its top: unpickling fn imports it in the worker (it is
    there now: the workers retire), and the note says who imported it (not fn)."""
    site = tmp_path / "lib" / "site-packages"
    installed_library(site, "datasets", DATASETS_SWITCHES)
    (tmp_path / "train_with_datasets.py").write_text(
        "import os\nimport datasets\n\ndef train(rank, world_size):\n"
        "    datasets.disable_caching()\n    return os.getpid()\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("datasets", "train_with_datasets"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    from train_with_datasets import train

    first = gst.launch(train, world_size=2)
    note = capsys.readouterr().err
    assert "loading fn's module (or its arguments) imported datasets, which may keep" in note
    assert "fn imported" not in note and "so these workers were retired" in note
    assert not set(gst.launch(train, world_size=2)) & set(first)


# -- (6) a cell's logging.basicConfig configures the notebook, not the ranks -------------------


def test_records_a_notebook_s_logging_config_does_not_show_in_the_ranks_are_explained(capsys):
    import logging

    def progress(rank, world_size):
        import logging

        for step in range(3):
            logging.getLogger("train").info("step %d", step)  # torchrun shows none either
        logging.info("done")

    def quiet(rank, world_size):
        return rank

    root, handler, level = logging.getLogger(), logging.StreamHandler(), logging.getLogger().level
    root.addHandler(handler)  # what a cell's logging.basicConfig(level=logging.INFO) does
    root.setLevel(logging.INFO)
    try:
        gst.launch(progress, world_size=2)
        err = capsys.readouterr().err
        assert err.count("configures the notebook, not the ranks") == 1  # rank 0 says it, once
        assert "fn logged 4 record(s)" in err and "inside fn" in err
        gst.launch(quiet, world_size=2)
        assert "not the ranks" not in capsys.readouterr().err  # nothing was dropped: quiet
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    gst.launch(progress, world_size=2)
    assert "not the ranks" not in capsys.readouterr().err  # the notebook shows no INFO either


# -- (4) a job's atexit handlers run when it ends, as at the exit of a torchrun process ---------


def _log_and_register(rank, world_size, folder, job):
    import atexit
    import threading
    import time

    log = open(folder / f"rank{rank}.log", "a")  # noqa: SIM115 - closed by its atexit handler
    log.write(f"{job}: trained\n")  # buffered: lost unless the handler closes the file
    atexit.register(log.close)
    atexit.register(log.write, f"{job}: first registered\n")
    atexit.register(log.write, f"{job}: last registered\n")

    def save():
        time.sleep(0.5)
        log.write(f"{job}: thread\n")

    threading.Thread(target=save).start()
    return rank


def test_a_job_s_atexit_handlers_run_when_it_ends_last_registered_first(tmp_path):
    assert gst.launch(_log_and_register, 2, args=(tmp_path, "job 1")) == [0, 1]
    expected = ["job 1: trained", "job 1: thread", "job 1: last registered",
                "job 1: first registered"]
    for rank in range(2):  # before shutdown_workers: the job has ended
        assert (tmp_path / f"rank{rank}.log").read_text().splitlines() == expected


def test_a_job_s_atexit_handlers_do_not_pile_up_for_the_next_job(tmp_path):
    gst.launch(_log_and_register, 2, args=(tmp_path, "job 1"))
    first = gst.launch(lambda rank, world_size: __import__("os").getpid(), 2)
    gst.launch(_log_and_register, 2, args=(tmp_path, "job 2"))
    assert gst.launch(lambda rank, world_size: __import__("os").getpid(), 2) == first  # warm
    log = (tmp_path / "rank0.log").read_text().splitlines()
    assert [line for line in log if line.startswith("job 1")] == [
        "job 1: trained", "job 1: thread", "job 1: last registered", "job 1: first registered"]
    assert len([line for line in log if line.startswith("job 2")]) == 4


def test_a_library_s_daemon_thread_keeps_the_workers_warm(capfd):
    """tqdm leaves its monitor thread (a daemon) after a bar: a library's thread, quiet, kept."""
    def fn(rank, world_size):
        import os

        from tqdm import tqdm

        list(tqdm(range(3), disable=False, file=open(os.devnull, "w")))
        return os.getpid()

    first = gst.launch(fn, 2)
    assert "retired" not in capfd.readouterr().err
    assert gst.launch(fn, 2) == first  # the same workers
