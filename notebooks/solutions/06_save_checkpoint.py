"""Notebook 06, exercise: a checkpoint from which a resumed run is the run that never stopped.

In the notebook: `%load solutions/06_save_checkpoint.py`. From the repository root:
`python notebooks/solutions/06_save_checkpoint.py` runs the check.
"""

import torch
import torch.distributed as dist

import gradsync_tutorial as gst


def save_checkpoint(path, model, optimizer, epochs_done):
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, torch.get_rng_state())  # every rank's generator (dropout)
    if dist.get_rank() == 0:  # every rank holds the same model: one copy is enough
        checkpoint = {
            "model": model.module.state_dict(),  # the Net's, without DDP's "module." prefix
            "optimizer": optimizer.state_dict(),  # SGD's momentum buffers
            "epochs_done": epochs_done,  # where to go on
            "rng": rngs,  # rngs[r]: rank r's generator (on GPUs: torch.cuda's too)
        }
        torch.save(checkpoint, path)
    dist.barrier()  # no rank goes on before the file is complete


if __name__ == "__main__":
    gst.exercises.check_save_checkpoint(save_checkpoint)
