"""Every exercise check passes its reference solution and rejects wrong answers, saying what is
wrong.

The wrong answers (the table WRONG below) are what learners write -- no division, notebook 02's
loop instead of one call, a reduced copy never copied back, ``[t] * world_size``, a broadcast
into a clone -- and answers that guess instead of computing: a hard-coded world size (2 or 3)
or number of micro-batches (3 or 4), a piece size, a list of ranks built without the others'
numbers, data exchanged through files next to a dummy collective, an answer that also changes
what it must leave alone. Each must be rejected with the message that names the mistake.

The checks launch real ranks (gloo) at 2 and then 3 ranks, and reuse the idle workers of the
size launched last.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import all_reduce as imported_all_reduce

from gradsync_tutorial import exercises
from gradsync_tutorial.exercises import EXERCISES, ExerciseFailed

from .conftest import REPO

SOLUTIONS = REPO / "notebooks" / "solutions"


@pytest.fixture(autouse=True, scope="module")
def _no_files_left():
    """The wrong answers that exchange data through files write them under the temporary
    folder, named after this process (the ranks' parent): remove them afterwards."""
    yield
    for path in Path(tempfile.gettempdir()).glob(f"gradsync-cheat-{os.getpid()}*"):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def solution(name: str):
    """The reference function, read from notebooks/solutions/ (not imported by name)."""
    return runpy.run_path(str(SOLUTIONS / EXERCISES[name].solution))[name]


def check(name: str):
    return EXERCISES[name].check


# --------------------------------------------------------------------------------------------
# Every exercise: a solution, a notebook, a stub
# --------------------------------------------------------------------------------------------


def test_every_exercise_has_a_solution_and_a_notebook_that_calls_its_check():
    for name, exercise in EXERCISES.items():
        assert (SOLUTIONS / exercise.solution).is_file(), exercise.solution
        notebook = (REPO / "notebooks" / exercise.notebook).read_text()
        assert f"def {name}(" in notebook  # the stub
        assert f"gst.exercises.{exercise.check.__name__}({name})" in notebook
        assert exercise.check is getattr(exercises, exercise.check.__name__)


# What each check's "✓ correct" sentence says it ran at: every size it uses by default.
SIZES = {"accumulate_gradients": ("3 micro-batches of 8", "5 micro-batches of 4"),
         "global_mean_loss": ("on 2 ranks, with rank 0: ", "; on 3 ranks, with rank 0: "),
         "token_mean_backward": ("on 2 ranks × 4 micro-batches", "on 3 ranks × 3 micro-batches")}


@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_reference_solution_passes_at_every_size(name, capsys):
    assert check(name)(solution(name)) is None
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: ")
    for size in SIZES.get(name, ("on 2 and 3 ranks",)):
        assert size in out


@pytest.mark.parametrize("name", list(EXERCISES))
def test_a_stub_is_not_attempted_and_does_not_fail(name, capsys):
    def stub(*args):
        raise NotImplementedError("replace this line with your code")

    stub.__name__ = name
    assert check(name)(stub) is None
    out = capsys.readouterr().out
    assert out.startswith(f"... not attempted yet: {name} still raises NotImplementedError")
    assert f"%load solutions/{EXERCISES[name].solution}" in out


def test_not_a_function_or_the_wrong_arguments_or_sizes():
    with pytest.raises(ExerciseFailed, match=r"pass your function itself.*got list"):
        exercises.check_gather_ranks([0, 1])  # the result of gather_ranks(...), not the function

    def average_gradients_flat(model, world_size):
        pass

    with pytest.raises(ExerciseFailed, match=r"average_gradients_flat\(model, world_size\) cannot"
                                             r" be called as average_gradients_flat\(model\)"):
        exercises.check_average_gradients_flat(average_gradients_flat)
    for sizes in (1, (2, 1), ()):
        with pytest.raises(ValueError, match="world_size must be an int"):
            exercises.check_broadcast_parameters(solution("broadcast_parameters"),
                                                 world_size=sizes)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 2"):
        exercises.check_accumulate_gradients(solution("accumulate_gradients"), micro_batches=1)


def test_one_size_on_request(capsys):
    exercises.check_gather_ranks(solution("gather_ranks"), world_size=4)  # notebook 00's advice
    assert capsys.readouterr().out.startswith("✓ correct: on 4 ranks, every rank returned "
                                              "[0, 1, 2, 3]")


# --------------------------------------------------------------------------------------------
# The wrong answers, one factory per exercise: mistake -> a learner's function
# --------------------------------------------------------------------------------------------


def _gather(mistake):
    def gather_ranks(rank, world_size):
        if mistake == "computed locally":
            return list(range(world_size))
        if mistake == "barrier, then a guess":
            dist.barrier()
            return list(range(world_size))
        if mistake in ("one dummy all_reduce, then a guess", "ranks counted with all_reduce"):
            t = torch.ones(1)
            dist.all_reduce(t)  # every rank sends 1: the sum is the number of ranks
            return list(range(world_size if mistake[0] == "o" else int(t.item())))
        if mistake == "own rank summed, then a guess":
            dist.all_reduce(torch.tensor([float(rank)]))
            return list(range(world_size))
        if mistake == "through files, one dummy all_reduce":
            import os
            import tempfile

            folder = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{os.getppid()}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, str(rank)), "w") as f:
                f.write(str(rank))
            dist.all_reduce(torch.zeros(1))  # for show; it also waits for every file
            return sorted(int(open(os.path.join(folder, n)).read()) for n in os.listdir(folder)
                          if int(n) < world_size)
        n = {"hard-coded 2 ranks": 2, "hard-coded 3 ranks": 3}.get(mistake, world_size)
        everyone = ([torch.zeros(1)] * n if mistake == "one tensor repeated" else
                    [torch.zeros(1) for _ in range(n)])
        dist.all_gather(everyone, torch.tensor([float(rank)]))
        return everyone if mistake == "returns tensors" else [int(t.item()) for t in everyone]

    return gather_ranks


def _accumulate(divide=True, zero_inside=False, whole_batch=False, returns="float",
                pieces=None, divisor=None, piece_size=None, steps=False):
    """A learner's accumulate_gradients, with one of the typical mistakes switched on (pieces,
    divisor, piece_size: hard-coded numbers of micro-batches to split into, to divide by, or
    images per piece)."""

    def accumulate_gradients(model, images, labels, micro_batches):
        k = 1 if whole_batch else pieces or micro_batches
        xs, ys = ((images.split(piece_size), labels.split(piece_size)) if piece_size else
                  (images.chunk(k), labels.chunk(k)))
        total, last, raw = 0.0, None, 0.0
        for x, y in zip(xs, ys, strict=True):
            if zero_inside:
                model.zero_grad()
            loss = F.nll_loss(model(x), y)
            raw += loss.item()
            if divide:
                loss = loss / (divisor or (len(xs) if piece_size else micro_batches))
            loss.backward()
            total, last = total + loss.item(), loss
        if steps:
            torch.optim.SGD(model.parameters(), lr=0.1).step()  # the caller's job
        return {"float": total, "tensor": last, "last": last.item() * micro_batches,
                "sum": raw}[returns]

    return accumulate_gradients


def _flat(divide=True, copy_back=True, divide_on=None, world_size=None, put_back="view_as",
          then=None):
    """A learner's average_gradients_flat, with one of the typical mistakes switched on."""

    def average_gradients_flat(model):
        grads = [p.grad for p in model.parameters()]
        buffer = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(buffer)
        if divide and (divide_on is None or dist.get_rank() in divide_on):
            buffer /= world_size or dist.get_world_size()
        if copy_back:
            pieces = buffer.split([g.numel() for g in grads])
            for p, g, piece in zip(model.parameters(), grads, pieces, strict=True):
                if put_back == "view_as":
                    g.copy_(piece.view_as(g))
                elif put_back == "copy_":
                    g.copy_(piece)  # (150,) into (6, 1, 5, 5)
                elif put_back == "assign":
                    p.grad = piece
                else:  # .data =: no error, a gradient of the wrong shape
                    p.grad.data = piece
        if then == "zeroes the parameters":
            for p in model.parameters():
                p.detach().zero_()

    return average_gradients_flat


def _flat_other(mistake):
    def average_gradients_flat(model):
        if mistake in ("per parameter", "per parameter, imported all_reduce"):
            for p in model.parameters():  # notebook 02's loop: right values, 8 calls
                (dist.all_reduce if mistake == "per parameter" else imported_all_reduce)(p.grad)
                p.grad /= dist.get_world_size()
            return
        # Through files: each rank saves its gradients, one all_reduce "for show" (of one
        # number, or of a zero tensor of the right size), then the mean from the files.
        import os
        import tempfile

        rank, n = dist.get_rank(), dist.get_world_size()
        folder = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{os.getppid()}-{n}")
        os.makedirs(folder, exist_ok=True)
        torch.save([p.grad for p in model.parameters()], os.path.join(folder, f"{rank}.pt"))
        size = 1 if mistake.endswith("one number") else sum(p.numel() for p in model.parameters())
        dist.all_reduce(torch.zeros(size))
        everyone = [torch.load(os.path.join(folder, f"{r}.pt")) for r in range(n)]
        dist.barrier()
        for i, p in enumerate(model.parameters()):
            p.grad.copy_(sum(grads[i] for grads in everyone) / n)

    return average_gradients_flat


def _broadcast(mistake):
    def broadcast_parameters(model):
        params = list(model.named_parameters())
        if mistake == "recomputed locally":  # rank 0's weights were Net() under the seed?
            torch.manual_seed(1234)
            for module in (model.conv1, model.conv2, model.fc1, model.fc2):
                module.reset_parameters()
            return
        if mistake == "through files, one dummy broadcast":
            import os
            import tempfile

            path = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{os.getppid()}.pt")
            if dist.get_rank() == 0:
                torch.save(model.state_dict(), path)
            dist.broadcast(torch.zeros(1), src=0)  # for show; it also waits for the file
            model.load_state_dict(torch.load(path))
            dist.barrier()
            return
        for name, p in params:
            if mistake == "weights only" and not name.endswith("weight"):
                continue
            if mistake == "averaged":
                dist.all_reduce(p.detach())
                p.detach().div_(dist.get_world_size())
            elif mistake == "frozen":
                p.requires_grad_(False)  # "no autograd during the broadcast", never undone
                dist.broadcast(p, src=0)
            else:
                dist.broadcast(p.detach().clone() if mistake == "into a copy" else p.detach(),
                               src=1 if mistake == "from rank 1" else 0)
        if mistake == "rank 0 zeroes its own" and dist.get_rank() == 0:
            for _, p in params:
                p.detach().zero_()

    return broadcast_parameters


def _mean_loss(mistake=None):
    """A learner's global_mean_loss, with one of the typical mistakes switched on."""

    def global_mean_loss(losses):
        losses = losses.detach()
        if mistake in ("mean of means", "no division"):
            mean = losses.mean()
            dist.all_reduce(mean)
            return (mean / (dist.get_world_size() if mistake == "mean of means" else 1)).item()
        if mistake == "local":
            return losses.mean().item()
        if mistake == "through files, one dummy all_reduce":
            import os
            import tempfile

            folder = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{os.getppid()}")
            os.makedirs(folder, exist_ok=True)
            rank, n = dist.get_rank(), dist.get_world_size()
            torch.save(losses, os.path.join(folder, f"{n}-{rank}.pt"))
            dist.all_reduce(torch.zeros(1))  # for show; it also waits for every file
            return torch.cat([torch.load(os.path.join(folder, f"{n}-{r}.pt"))
                              for r in range(n)]).mean().item()
        loss_sum = losses.sum()
        dist.all_reduce(loss_sum)
        if mistake == "own count":
            return (loss_sum / len(losses)).item()
        if mistake == "by world size":
            return (loss_sum / dist.get_world_size()).item()
        if mistake == "hard-coded count":
            return (loss_sum / 100).item()
        count = torch.tensor(float(len(losses)))
        dist.all_reduce(count)  # a second call: right, with a note
        return loss_sum / count if mistake == "tensor" else (loss_sum / count).item()

    return global_mean_loss


def _overlapped(divide=True, clear=True, use_async=True, world_size=None, then=None,
                reduce="grad"):
    """A learner's average_overlapped, with one of the typical mistakes switched on."""

    def average_overlapped(model):
        pending = []

        def start(param):
            tensor = param.grad if reduce == "grad" else torch.zeros(1)  # "for show"
            pending.append((param, dist.all_reduce(tensor, async_op=use_async)))

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(start)

        def finish():
            for param, handle in pending:
                if use_async:
                    handle.wait()
                if divide:
                    param.grad /= world_size or dist.get_world_size()
            if clear:
                pending.clear()
            if reduce == "files":
                _mean_through_files(model)
            if then == "zeroes the parameters":
                for p in model.parameters():
                    p.detach().zero_()

        return finish

    return average_overlapped


def _mean_through_files(model):
    import os
    import tempfile

    rank, n = dist.get_rank(), dist.get_world_size()
    folder = os.path.join(tempfile.gettempdir(), f"gradsync-cheat-{os.getppid()}-{n}")
    os.makedirs(folder, exist_ok=True)
    torch.save([p.grad for p in model.parameters()], os.path.join(folder, f"{rank}.pt"))
    dist.barrier()
    everyone = [torch.load(os.path.join(folder, f"{r}.pt")) for r in range(n)]
    dist.barrier()  # before anyone writes the next step's files
    for i, p in enumerate(model.parameters()):
        p.grad.copy_(sum(grads[i] for grads in everyone) / n)


def _save(leave_out=(), every_rank=False, barrier=True, prefixed=False, objects=False,
          epoch=lambda epochs_done: epochs_done, writer=0, then=None):
    """A learner's save_checkpoint, with one of the typical mistakes switched on."""

    def save_checkpoint(path, model, optimizer, epochs_done):
        checkpoint = {
            "model": (model if prefixed else model.module).state_dict(),
            "optimizer": optimizer if objects else optimizer.state_dict(),
            "epoch": epoch(epochs_done),  # any key: the check finds the pieces by what they are
            "rng_state": {"cpu": torch.get_rng_state()},
        }
        for key in leave_out:
            del checkpoint[key]
        if every_rank or dist.get_rank() == writer:
            torch.save(checkpoint, path)
        if barrier:
            dist.barrier()
        if then == "zeroes the parameters":
            for p in model.parameters():
                p.detach().zero_()

    return save_checkpoint


def _forgot_to_save(path, model, optimizer, epochs_done):
    dist.barrier()


# --------------------------------------------------------------------------------------------
# The table: each wrong answer, and what its check must say
# --------------------------------------------------------------------------------------------

ON_2, ON_3 = r"^on 2 ranks: ", r"^right on 2 ranks, but on 3 ranks: "

WRONG = [
    # 00: gather_ranks
    ("gather_ranks", "computed locally", _gather("computed locally"),
     ON_2 + r"gather_ranks made no collective call that moves data \(collectives called: "
            r"none\).*dist\.all_gather"),
    ("gather_ranks", "barrier, then a guess", _gather("barrier, then a guess"),
     r"made no collective call that moves data \(collectives called: barrier once\)"),
    ("gather_ranks", "one dummy all_reduce, then a guess",
     _gather("one dummy all_reduce, then a guess"),
     ON_2 + r"every rank sent the same numbers through its collectives \(1 number \(\[1\]\)\), "
            r"so no rank learned anything from the others"),
    ("gather_ranks", "ranks counted with all_reduce", _gather("ranks counted with all_reduce"),
     ON_2 + r"every rank sent the same numbers"),
    ("gather_ranks", "own rank summed, then a guess", _gather("own rank summed, then a guess"),
     ON_2 + r"rank 0 returned the right list, but its collectives delivered all_reduce of 1 "
            r"number \(\[1\]\): not every rank's number"),
    ("gather_ranks", "through files, one dummy all_reduce",
     _gather("through files, one dummy all_reduce"), ON_2 + r"every rank sent the same numbers"),
    ("gather_ranks", "one tensor repeated", _gather("one tensor repeated"),
     ON_2 + r"the list you passed to all_gather holds the same tensor 2 times \(rank 0 "
            r"returned \[1, 1\]\): `\[t\] \* 2` repeats"),
    ("gather_ranks", "returns tensors", _gather("returns tensors"),
     r"rank 0 returned a list of tensors.*t\.item\(\)"),
    ("gather_ranks", "hard-coded 3 ranks", _gather("hard-coded 3 ranks"),
     r"^gather_ranks raised an error on rank \d \(of 2\)"),
    ("gather_ranks", "hard-coded 2 ranks", _gather("hard-coded 2 ranks"),
     r"^gather_ranks raised an error on rank \d \(of 3\)"),
    # 01: accumulate_gradients (one process)
    ("accumulate_gradients", "no division", _accumulate(divide=False),
     r"^with micro_batches=3 \(a batch of 24\): your gradients are 3\.0× the expected ones "
     r"\(the gradient of the whole batch's mean loss\): did you divide each micro-batch's loss "
     r"by micro_batches\?"),
    ("accumulate_gradients", "zero_grad inside the loop", _accumulate(zero_inside=True),
     r"your gradient is the last micro-batch's only \(times 0\.333\).*zero_grad\(\).*inside"),
    ("accumulate_gradients", "zero_grad inside, no division",
     _accumulate(zero_inside=True, divide=False), r"the last micro-batch's only \(times 1\)"),
    ("accumulate_gradients", "the whole batch at once", _accumulate(whole_batch=True),
     r"your model saw 24 samples in one forward pass: split the batch of 24 into 3 "
     r"micro-batches of 8"),
    ("accumulate_gradients", "hard-coded 4 (the notebook's)", _accumulate(pieces=4, divisor=4),
     r"your model ran 4 forward passes \(of 6, 6, 6, 6 samples\); with micro_batches=3, run "
     r"one per micro-batch: 3 of 8"),
    ("accumulate_gradients", "hard-coded 3", _accumulate(pieces=3, divisor=3),
     r"^right with micro_batches=3 \(a batch of 24\), but with micro_batches=5 \(a batch of "
     r"20\): your model ran 3 forward passes \(of 7, 7, 6 samples\)"),
    ("accumulate_gradients", "hard-coded pieces of 8", _accumulate(piece_size=8),
     r"^right with micro_batches=3 .*, but with micro_batches=5 \(a batch of 20\): your model "
     r"ran 3 forward passes \(of 8, 8, 4 samples\); with micro_batches=5, run one per "
     r"micro-batch: 5 of 4"),
    ("accumulate_gradients", "divided by 4", _accumulate(divisor=4),
     r"your gradients are 0\.75× the expected ones.*Did you divide by 4 instead of "
     r"micro_batches \(3 here\)\?"),
    ("accumulate_gradients", "steps the optimizer", _accumulate(steps=True),
     r"accumulate_gradients changed the parameters: `conv1\.weight`.*the caller steps the "
     r"optimizer"),
    ("accumulate_gradients", "returns a tensor", _accumulate(returns="tensor"),
     r"returned a tensor.*return a float \(`loss\.item\(\)`\)"),
    ("accumulate_gradients", "returns the last loss", _accumulate(returns="last"),
     r"returned the loss .*; the whole batch's mean loss is .*It is the last micro-batch's"),
    ("accumulate_gradients", "returns the sum of the losses", _accumulate(returns="sum"),
     r"It is the sum of the 3 micro-batch losses: divide by micro_batches"),
    # 02: average_gradients_flat
    ("average_gradients_flat", "per parameter", _flat_other("per parameter"),
     ON_2 + r"the gradients are right, but you called all_reduce 8 times; one call is enough"),
    ("average_gradients_flat", "per parameter, imported all_reduce",
     _flat_other("per parameter, imported all_reduce"), r"called all_reduce 8 times"),
    ("average_gradients_flat", "no division", _flat(divide=False),
     ON_2 + r"your gradients are 2\.0× the expected ones \(the mean over ranks\): did you "
            r"divide by the world size\?"),
    ("average_gradients_flat", "hard-coded / 3", _flat(world_size=3),
     ON_2 + r"your gradients are 0\.67× the expected ones .*Did you divide by 3 instead of "
            r"world_size"),
    ("average_gradients_flat", "hard-coded / 2", _flat(world_size=2),
     ON_3 + r"your gradients are 1\.5× the expected ones .*Did you divide by 2 instead of "
            r"world_size"),
    ("average_gradients_flat", "a reduced copy", _flat(copy_back=False),
     r"the gradients did not change: every rank still holds its own\. You reduced a copy"),
    ("average_gradients_flat", "divided on rank 0 only", _flat(divide_on=(0,)),
     r"rank 1's gradients differ from rank 0's in `conv1\.weight` \(max abs difference .*; 8 "
     r"of 8 tensors differ\)"),
    ("average_gradients_flat", ".data = a flat piece", _flat(put_back="data"),
     r"differ from the mean over ranks in `conv1\.weight` \(a different shape; 4 of 8 tensors "
     r"differ\).*piece\.view_as\(p\.grad\)"),
    ("average_gradients_flat", "through files, one dummy all_reduce of one number",
     _flat_other("through files, one dummy all_reduce of one number"),
     ON_2 + r"the gradients are right, but on rank 0 the all_reduce delivered 1 number "
            r"\(\[0\]\), not the sum of the ranks' 21,840 gradient numbers"),
    ("average_gradients_flat", "through files, one dummy all_reduce of 21,840 zeros",
     _flat_other("through files, one dummy all_reduce of 21,840 zeros"),
     r"the all_reduce delivered 21,840 numbers \(\[0, 0, 0, 0, \.\.\.\]\), not the sum"),
    ("average_gradients_flat", "zeroes the parameters", _flat(then="zeroes the parameters"),
     ON_2 + r"on rank 0, average_gradients_flat changed the parameters: `conv1\.weight`.*"
            r"leave the weights alone"),
    # 03: broadcast_parameters
    ("broadcast_parameters", "into a copy", _broadcast("into a copy"),
     ON_2 + r"rank 1's parameters did not change, although you called broadcast 8 times: you "
            r"broadcast into a copy"),
    ("broadcast_parameters", "weights only", _broadcast("weights only"),
     r"rank 1's parameters differ from rank 0's in `conv1\.bias` \(max abs difference .*; 4 "
     r"of 8 tensors differ\): did you broadcast every parameter\?"),
    ("broadcast_parameters", "averaged", _broadcast("averaged"),
     r"the replicas agree, but on the average of the ranks' weights, not on rank 0's"),
    ("broadcast_parameters", "from rank 1", _broadcast("from rank 1"),
     r"every rank holds rank 1's weights: broadcast from rank 0, src=0"),
    ("broadcast_parameters", "frozen", _broadcast("frozen"),
     r"on rank 0, `conv1\.weight` is no longer a trainable parameter"),
    ("broadcast_parameters", "recomputed locally", _broadcast("recomputed locally"),
     r"broadcast_parameters made no collective call, so the other ranks cannot have received "
     r"rank 0's weights"),
    ("broadcast_parameters", "rank 0 zeroes its own", _broadcast("rank 0 zeroes its own"),
     r"rank 0's own parameters changed, in `conv1\.weight`"),
    ("broadcast_parameters", "through files, one dummy broadcast",
     _broadcast("through files, one dummy broadcast"),
     ON_2 + r"rank 1 holds rank 0's weights, but its collectives delivered 1 number \(\[0\]\), "
            r"not rank 0's 21,840 numbers: they reached it another way"),
    # 04: global_mean_loss
    ("global_mean_loss", "mean of means", _mean_loss("mean of means"),
     ON_2 + r"every rank returned .*; the mean over all \d+ samples is .* Yours is the mean of "
            r"the ranks' means .*\(rank 0: \d+, rank 1: \d+\).*mean-of-means"),
    ("global_mean_loss", "no division", _mean_loss("no division"),
     r"Yours is the sum of the ranks' means: all_reduce\(SUM\) adds them up"),
    ("global_mean_loss", "local", _mean_loss("local"),
     r"every rank returned its own mean \(rank 0: .*, rank 1: .*; collectives called: none\)"),
    ("global_mean_loss", "own count", _mean_loss("own count"),
     r"each divided the global sum of the losses by its own count"),
    ("global_mean_loss", "by world size", _mean_loss("by world size"),
     r"Yours is the sum of all losses divided by the world size; divide by the number of "
     r"samples, \d+ in all"),
    ("global_mean_loss", "hard-coded count", _mean_loss("hard-coded count"),
     ON_2 + r"every rank returned .*; the mean over all \d+ samples is .* Yours is the sum of all "
            r"losses divided by 100: the ranks hold \d+ samples in all"),
    ("global_mean_loss", "returns a tensor", _mean_loss("tensor"),
     r"rank 0 returned a tensor, tensor\(.*return a float \(`\.item\(\)`\)"),
    ("global_mean_loss", "through files, one dummy all_reduce",
     _mean_loss("through files, one dummy all_reduce"),
     ON_2 + r"every rank returned the right mean, but rank 0's collectives delivered all_reduce "
            r"of 1 number \(\[0\]\): not the sum of the losses and the count"),
    # 05: average_overlapped
    ("average_overlapped", "no division", _overlapped(divide=False),
     ON_2 + r"in step 1, your gradients are 2\.0× the expected ones \(the mean over ranks\): "
            r"divide by the world size in finish\(\)"),
    ("average_overlapped", "hard-coded / 3", _overlapped(world_size=3),
     ON_2 + r"in step 1, your gradients are 0\.67× .*Did you divide by 3 instead of world_size"),
    ("average_overlapped", "hard-coded / 2", _overlapped(world_size=2),
     ON_3 + r"in step 1, your gradients are 1\.5× .*Did you divide by 2 instead of world_size"),
    ("average_overlapped", "blocking calls", _overlapped(use_async=False),
     r"8 of the 8 all_reduce calls made during backward in step 1 had no async_op=True"),
    ("average_overlapped", "handles kept", _overlapped(clear=False),
     r"step 1 is right, but in step 2 your gradients .*: did finish\(\) handle step 1's "
     r"handles again\?"),
    ("average_overlapped", "zeroes the parameters", _overlapped(then="zeroes the parameters"),
     r"on rank 0, average_overlapped changed the parameters in 2 steps of backward and "
     r"finish\(\): `conv1\.weight`.*average the gradients only"),
    ("average_overlapped", "through files, dummy async calls",
     _overlapped(reduce="files", divide=False),
     ON_2 + r"the gradients are right, but in step 1 rank 0's all_reduce calls delivered 8 "
            r"numbers \(\[0, 0, 0, 0, \.\.\.\]\), not the sum"),
    # 06: save_checkpoint
    ("save_checkpoint", "no optimizer", _save(leave_out=["optimizer"]),
     ON_2 + r"your checkpoint has no optimizer state: SGD's momentum buffers .*\(2 steps after "
            r"a resume from your file end up .* away from the straight run's parameters\)"),
    ("save_checkpoint", "no RNG", _save(leave_out=["rng_state"]),
     r"your checkpoint has no RNG state .* dropout draws random numbers.*torch\.get_rng_state"),
    ("save_checkpoint", "no epoch", _save(leave_out=["epoch"]),
     ON_2 + r"your checkpoint does not record epochs_done \(the check passed 7; the epoch to "
            r"start from, 8, would do too\)"),
    ("save_checkpoint", "hard-coded epoch 3", _save(epoch=lambda epochs_done: 3),
     r"your checkpoint does not record epochs_done"),
    ("save_checkpoint", "hard-coded epoch 7", _save(epoch=lambda epochs_done: 7),
     ON_3 + r"your checkpoint does not record epochs_done \(the check passed 11"),
    ("save_checkpoint", "no model", _save(leave_out=["model"]),
     r"your checkpoint has no model state dict"),
    ("save_checkpoint", "every rank writes", _save(every_rank=True),
     ON_2 + r"ranks 0, 1 all wrote the file.*Save on rank 0 only"),
    ("save_checkpoint", "rank 1 writes", _save(writer=1), ON_2 + r"rank 1 wrote the file"),
    ("save_checkpoint", "no barrier", _save(barrier=False),
     ON_2 + r"rank 1 returned from save_checkpoint before the file existed.*dist\.barrier\(\)"),
    ("save_checkpoint", "DDP's prefix", _save(prefixed=True),
     r"your model state dict's names start with 'module\.'"),
    ("save_checkpoint", "objects", _save(objects=True),
     ON_2 + r"torch\.load\(path, weights_only=True\) cannot read your file: it holds a "
            r"torch\.optim\.sgd\.SGD object\. Save state dicts.*not the model or optimizer "
            r"objects"),
    ("save_checkpoint", "zeroes the parameters", _save(then="zeroes the parameters"),
     ON_2 + r"on rank 0, save_checkpoint changed `conv1\.weight`.*a save must leave the run"),
    ("save_checkpoint", "nothing written", _forgot_to_save,
     r"no file at `path` after _forgot_to_save \(collectives called: barrier once\)"),
]


@pytest.mark.parametrize("name, mistake, wrong, message", WRONG,
                         ids=[f"{name}: {mistake}" for name, mistake, _, _ in WRONG])
def test_a_wrong_answer_is_rejected_with_what_is_wrong(name, mistake, wrong, message):
    with pytest.raises(ExerciseFailed) as info:
        check(name)(wrong)
    assert re.search(message, str(info.value)), f"{mistake}: {info.value}"


# --------------------------------------------------------------------------------------------
# What a check says beyond a wrong value: an error's line, a hang, the right answers it accepts
# --------------------------------------------------------------------------------------------


def test_an_error_shows_the_learner_s_line():
    def passes_an_int(rank, world_size):
        everyone = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(everyone, rank)  # not a tensor
        return everyone

    with pytest.raises(ExerciseFailed) as info:
        exercises.check_gather_ranks(passes_an_int)
    message = str(info.value)
    assert message.startswith("passes_an_int raised an error on rank ")
    assert "dist.all_gather(everyone, rank)" in message  # the traceback shows the line


@pytest.mark.parametrize("name, hangs", [
    ("gather_ranks", lambda rank, world_size: (
        dist.all_gather([torch.zeros(1) for _ in range(world_size)], torch.zeros(1))
        if rank == 0 else None) or list(range(world_size))),
    ("global_mean_loss", lambda losses: (  # "only rank 0 logs", so only rank 0 reduces
        dist.all_reduce(losses.detach().sum()) if dist.get_rank() == 0 else None) or 1.0),
])
def test_a_hang_gets_the_launcher_s_own_message_with_where_each_rank_was(name, hangs):
    from gradsync_tutorial import launcher

    with pytest.raises(ExerciseFailed) as info:
        check(name)(hangs, timeout=5)
    message = str(info.value)
    # The launcher stops it early (rank 1 returned while rank 0 waits: issue 25), or at 5 s.
    assert message.startswith("<lambda> hangs on 2 ranks: launch ")
    assert "rank 0 had not finished (rank 1 returned)" in message
    assert "All ranks were stopped." in message
    assert "\nWhere each rank was:\n" in message
    assert message.endswith(launcher.HANG_HINT)


def test_gather_ranks_floats_are_fine(capsys):
    def floats(rank, world_size):  # [0.0, 1.0] == [0, 1]: accepted
        everyone = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(everyone, torch.tensor([float(rank)]))
        return torch.cat(everyone).tolist()

    assert exercises.check_gather_ranks(floats) is None
    assert "✓ correct" in capsys.readouterr().out


def test_the_accumulate_check_leaves_the_random_state_alone(capsys):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert exercises.check_accumulate_gradients(_accumulate(), micro_batches=2) is None
    assert torch.equal(torch.rand(3), expected)
    assert "2 micro-batches of 8" in capsys.readouterr().out


def test_the_flat_check_accepts_avg(capsys):
    def averaged_by_gloo(model):  # ReduceOp.AVG: the mean in one call (gloo has it here)
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))

    exercises.check_average_gradients_flat(averaged_by_gloo)
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: on 2 and 3 ranks, one all_reduce carried all 21,840 "
                          "numbers of the 8 gradients")


def test_broadcast_parameters_replacing_the_parameters_passes_with_a_note(capsys):
    def replaces(model):
        for module in (model.conv1, model.conv2, model.fc1, model.fc2):
            for name in ("weight", "bias"):
                t = getattr(module, name).detach().clone()
                dist.broadcast(t, src=0)
                setattr(module, name, nn.Parameter(t))

    assert exercises.check_broadcast_parameters(replaces) is None
    out = capsys.readouterr().out
    assert out.startswith("note: replaces replaced the model's parameter objects")
    assert "✓ correct" in out and "bit for bit" in out


def test_global_mean_loss_two_calls_pass_with_a_note(capsys):
    assert exercises.check_global_mean_loss(_mean_loss()) is None  # two calls: right, a note
    out = capsys.readouterr().out
    assert out.startswith("note: you called all_reduce 2 times; one call on torch.stack")
    assert "✓ correct: on 2 ranks, with rank 0: " in out


def test_global_mean_loss_changed_losses_are_caught():
    def in_place(losses):
        losses.detach().mul_(2)  # detach() shares the memory: the caller's losses change
        return solution("global_mean_loss")(losses) / 2

    with pytest.raises(ExerciseFailed, match=r"on rank 0, in_place changed the `losses` tensor"):
        exercises.check_global_mean_loss(in_place)


def test_save_checkpoint_says_where_the_file_holds_each_piece(capsys):
    # "epoch", the epoch to start from (epochs_done + 1), resumes right, as epochs done does;
    # the sentence names the keys the file has, not the solution's.
    exercises.check_save_checkpoint(_save(epoch=lambda epochs_done: epochs_done + 1))
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: on 2 and 3 ranks, your file holds the model (at "
                          "['model']), the optimizer with its momentum (at ['optimizer']), the "
                          "RNG state (at ['rng_state']['cpu']) and the epoch count (at "
                          "['epoch'])")
    assert "epochs_done" not in out
