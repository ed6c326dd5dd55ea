"""Run a course script under torchrun with one rank failing on purpose: fault injection for the
tests and for notebook 06's demonstration, kept out of the training scripts people copy.

    torchrun --standalone --nproc-per-node 2 scripts/fail_rank.py 1 scripts/train_ddp.py --smoke

It loads the script (``scripts/train_ddp.py`` or ``train_manual.py``) as a module, replaces its
``train`` with one that raises on rank RANK once the process group is up (the other ranks train
as usual and lose their peer), then calls the script's own ``main``, so ``@record`` and
torchrun's error summary see exactly what a real failure would produce.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: scripts/fail_rank.py RANK SCRIPT [SCRIPT ARGUMENTS...]")
    fail_rank, script, script_argv = int(argv[0]), Path(argv[1]), argv[2:]
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real_train = module.train

    def train(args):
        rank = module.dist.get_rank()
        if rank == fail_rank:
            raise RuntimeError(f"rank {rank} fails on purpose (scripts/fail_rank.py {fail_rank})")
        return real_train(args)

    module.train = train  # main() looks train up in the script's globals when it calls it
    module.main(script_argv)


if __name__ == "__main__":
    main(sys.argv[1:])
