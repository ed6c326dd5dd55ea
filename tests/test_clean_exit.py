"""Every program the course ships under torchrun exits cleanly: no gloo abort after a good run.

The cause of the abort ("terminate called without an active exception", SIGABRT, after the
program printed its results): ``torch.distributed.nn.functional`` declares its collectives with
``group=group.WORLD`` as a default argument. Python evaluates defaults once, at import, so a
program that imports it after ``init_process_group`` keeps the live group in ten functions'
defaults: ``destroy_process_group()`` cannot free it, gloo's threads run on until the
interpreter tears down, and gloo aborts there. DDP's ``__init__`` imports it late (through
``torch._dynamo``), so any program that builds a DDP model after init does. Imported before
init, the defaults are ``None``. Each shipped program imports it first, with a one-line comment;
``tools/exit_check.py`` runs each one 20 times and counts aborts (too slow, and too flaky a
signal, for a test).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
from exit_check import shipped_programs  # noqa: E402

HOLDER = "torch.distributed.nn"

HELD = """
import sys
import torch.distributed as dist
if sys.argv[1] == "before":
    import torch.distributed.nn
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
group = dist.group.WORLD
if sys.argv[1] == "after":
    import torch.distributed.nn
dist.destroy_process_group()
print(sys.getrefcount(group) - 2)  # references left besides `group` and the call's argument
"""


def references_left(when: str) -> int:
    proc = subprocess.run([sys.executable, "-c", HELD, when], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1])


def test_a_late_import_of_torch_distributed_nn_keeps_the_group_after_destroy():
    """The cause, on this torch: imported after init, its defaults hold the group (10 functions);
    imported before, nothing does. If torch stops binding the group, this says the import can go."""
    assert references_left("before") == 0
    assert references_left("after") > 0


def imports_before_any_call(path: Path, module: str) -> bool:
    """``import MODULE`` is a top-level statement of PATH, before any function is called."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import) and any(a.name == module for a in node.names):
            return True
        if not isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                                 ast.Assign, ast.AnnAssign)) and not (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            return False  # a statement that may run code (an `if __name__` block) comes first
    return False


def test_the_shipped_programs_are_found():
    names = {p.name for p in shipped_programs()}
    assert {"04_pitfall_fixes.py", "train_ddp.py", "train_manual.py", "gloo_cuda.py"} <= names


@pytest.mark.parametrize("program", shipped_programs(), ids=lambda p: p.name)
def test_every_shipped_program_imports_the_holder_before_init(program):
    """A program run by torchrun that does not start a group itself (fail_rank.py loads a script
    that does) is exempt; every one that calls init_process_group imports it at the top."""
    if "init_process_group" not in program.read_text():
        pytest.skip(f"{program.name} starts no group itself")
    assert imports_before_any_call(program, HOLDER), (
        f"{program.relative_to(REPO)}: add `import {HOLDER}  # noqa: F401` to its imports, "
        "before init_process_group, so gloo does not abort at exit (see this module's docstring)")
