"""The variables torchrun gives each worker, as a worker sees them.

    torchrun --standalone --nproc-per-node 2 tests/programs/torchrun_env.py

Prints (and ``main`` returns) each variable's value from a fixed list of torchrun's (``None``
when unset), and whether ``torch.distributed.is_torchelastic_launched()``.
"""

import json
import os

import torch.distributed as dist

# What torch's elastic agent sets for a worker (LocalElasticAgent._start_workers, torch 2.14).
NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
         "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
         "TORCHELASTIC_ERROR_FILE")


def main():
    seen = {name: os.environ.get(name) for name in NAMES}
    seen["is_torchelastic_launched"] = dist.is_torchelastic_launched()
    print("STATE " + json.dumps(seen, sort_keys=True))
    return seen


if __name__ == "__main__":
    main()
