"""Accelerate's ``examples/cv_example.py`` shape, on synthetic data: ``training_function(config,
args)`` builds an ``Accelerator(cpu=..., mixed_precision=...)``, prepares a model, an optimizer and
two data loaders, trains, and gathers the evaluation predictions; ``main()`` parses ``sys.argv``.

    torchrun --standalone --nproc-per-node 2 tests/programs/accelerate_cv.py --cpu

Each rank prints (and ``main`` returns) what it saw: Accelerate's process count and index, the
distributed type, the mixed precision, and how many evaluation samples the gather returned.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset


class ToyImages(Dataset):
    """64 'images' of 3x8x8 pixels, labelled by the sign of their mean."""

    def __init__(self, n=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        self.y = (self.x.mean(dim=(1, 2, 3)) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"image": self.x[i], "label": self.y[i]}


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train = DataLoader(ToyImages(64, 0), shuffle=True, batch_size=config["batch_size"])
    evaluation = DataLoader(ToyImages(32, 1), shuffle=False, batch_size=config["batch_size"])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    for _ in range(config["num_epochs"]):
        model.train()
        for batch in train:
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    seen = 0
    for batch in evaluation:
        with torch.no_grad():
            predictions = model(batch["image"]).argmax(dim=-1)
        predictions, _ = accelerator.gather_for_metrics((predictions, batch["label"]))
        seen += predictions.shape[0]
    state = {
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision,
        "eval_samples_gathered": seen,
    }
    # Free the DDP model before the group goes (a DDP object alive at exit can abort gloo).
    del model, optimizer, train, evaluation
    accelerator.free_memory()
    accelerator.end_training()
    return state


def main():
    parser = argparse.ArgumentParser(description="cv_example's shape, on toy data.")
    parser.add_argument("--mixed_precision", type=str, default=None,
                        choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    config = {"lr": 3e-2, "num_epochs": 1, "seed": 42, "batch_size": 8}
    state = training_function(config, args)
    print("STATE " + json.dumps(state, sort_keys=True))
    return state


if __name__ == "__main__":
    main()
