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

import contextlib
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
# torch 2.13 renamed reduce_scatter_tensor reduce_scatter_single: the same function.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def _cheat_folder(tag):
    """A folder for the answers that exchange data through files: named after the ranks'
    parent (this process), the answer and the world size, removed by _no_files_left."""
    import os
    import tempfile

    folder = os.path.join(tempfile.gettempdir(),
                          f"gradsync-cheat-{os.getppid()}-{tag}-{dist.get_world_size()}")
    os.makedirs(folder, exist_ok=True)
    return folder


def _save_for_all(value, folder):
    """Save this rank's ``value`` in ``folder`` (whole, even while another rank reads)."""
    import os

    path = os.path.join(folder, f"{dist.get_rank()}.pt")
    torch.save(value, path + ".tmp")
    os.replace(path + ".tmp", path)


def _load_everyone(folder):
    import os

    return [torch.load(os.path.join(folder, f"{r}.pt")) for r in range(dist.get_world_size())]


def _token_mean(mean="global", times=None, no_sync=True, count=None, log="global",
                zero_inside=False, sum_gradients=False, count_through_files=False):
    """A learner's token_mean_backward, with one of the typical mistakes switched on (times: a
    hard-coded world size to multiply by; count: "padding" or "micro-batch")."""

    def token_mean_backward(model, micro_batches):
        def valid(targets):
            return torch.tensor(targets.numel()) if count == "padding" else (targets != -100).sum()

        local = sum(valid(targets) for _, targets in micro_batches)
        total_count = local.clone()
        if count_through_files:  # each rank's count in a file, a barrier "to wait for them"
            folder = _cheat_folder("token-count")
            _save_for_all(local, folder)
            dist.barrier()
            total_count = sum(_load_everyone(folder))
        else:
            dist.all_reduce(total_count)
        world_size = dist.get_world_size() if times is None else times
        total = torch.zeros((), dtype=torch.float64)
        for k, (inputs, targets) in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            if zero_inside:
                model.zero_grad()
            with contextlib.nullcontext() if last or not no_sync else model.no_sync():
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                                       reduction="sum")
                if mean == "per micro-batch":
                    scaled = loss / valid(targets) / len(micro_batches)  # the 2024 bug
                elif mean == "local":
                    scaled = loss / local
                elif count == "micro-batch":  # each micro-batch's count over the ranks
                    piece = valid(targets).clone()
                    dist.all_reduce(piece)
                    scaled = loss / piece
                else:
                    scaled = loss / total_count
                (scaled * world_size).backward()
            total += loss.detach()
        if sum_gradients:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        if log == "own":
            return (total / local).item()
        if log == "tensor":
            return total / total_count
        dist.all_reduce(total)
        return (total / total_count).item()

    return token_mean_backward


def _token_mean_then(then):
    """The right token_mean_backward, which also changes what it must leave alone."""
    right = _token_mean()

    def token_mean_backward(model, micro_batches):
        if then == "changes the inputs":
            for x, y in micro_batches:
                y[y == -100] = -100  # a no-op (the same numbers: not a change)...
                x.clamp_(max=5)  # ...and a change
        loss = right(model, micro_batches)
        if then == "steps the optimizer":  # the caller's job, done here
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        return loss

    return token_mean_backward


def _shard(divide="world_size", op="SUM", norm="global", clip=True, collective="reduce_scatter",
           whole=False, size=None):
    """A learner's average_and_clip_shard, with one mistake switched on (divide: "two" or
    "three", a hard-coded world size; size: a hard-coded shard size)."""

    def average_and_clip_shard(flat_grad, max_norm):
        n, rank = dist.get_world_size(), dist.get_rank()
        piece = size or len(flat_grad) // n
        if divide == "flat_grad in place":  # the right numbers, but the caller's gradient too
            flat_grad /= n
        if collective == "all_reduce":  # notebook 02's way, then this rank's slice
            summed = flat_grad.clone()
            dist.all_reduce(summed)
            shard = summed[rank * piece : (rank + 1) * piece].clone()
        elif collective == "reversed list":  # the shards listed in the wrong order
            shard = torch.empty(piece)
            dist.reduce_scatter(shard, list(reversed(flat_grad.split(piece))))
        elif collective == "none":
            shard = flat_grad[rank * piece : (rank + 1) * piece].clone()
        elif collective == "files":  # every rank's gradient in a file, a dummy reduce-scatter
            folder = _cheat_folder("shard")
            _save_for_all(flat_grad, folder)
            shard = torch.zeros(piece)
            _reduce_scatter(shard, torch.zeros_like(flat_grad))  # for show; it waits too
            shard = sum(_load_everyone(folder))[rank * piece : (rank + 1) * piece]
        else:
            shard = torch.empty(piece)
            _reduce_scatter(shard, flat_grad, op=getattr(dist.ReduceOp, op))
        if divide in ("world_size", "two", "three"):
            shard /= {"two": 2, "three": 3}.get(divide, n)
        squares = (shard**2).sum()
        total = _shard_norm(norm, shard, squares, flat_grad)
        if clip:
            shard = shard * min(1.0, max_norm / (float(total) + 1e-6))
        return torch.cat([shard] * n) if whole else shard

    return average_and_clip_shard


def _shard_norm(norm, shard, squares, flat_grad):
    """The norm an average_and_clip_shard clips by: the whole mean gradient's ("global"), or
    one of the mistakes."""
    if norm == "global":
        dist.all_reduce(squares)
        return squares.sqrt()
    if norm == "shard":  # this rank's shard alone
        return squares.sqrt()
    if norm == "sum of norms":
        total = squares.sqrt()
        dist.all_reduce(total)
        return total
    if norm == "before averaging":  # this rank's own gradient, before the reduce-scatter
        dist.all_reduce(squares)
        return flat_grad.norm()
    if norm == "vector":  # right, but the all_reduce carries every square
        each = shard**2
        dist.all_reduce(each)
        return each.sum().sqrt()
    folder = _cheat_folder("norm")  # "files": the squares in files, a dummy all_reduce
    _save_for_all(squares, folder)
    dist.all_reduce(torch.zeros(1))  # for show; it also waits for every file
    return sum(_load_everyone(folder)).sqrt()


def _fp32(divide=True, world_size=None, copy_back=True, bf16_division=False, dummy=None,
          then=None):
    """A learner's average_gradients_in_fp32, with one of the typical mistakes switched on
    (dummy: the gradients through files, next to a dummy all_reduce of that many zeros)."""

    def average_gradients_in_fp32(model):
        grads = [p.grad for p in model.parameters()]
        n = world_size or dist.get_world_size()
        if then == "turns the model float32":  # "reduce in fp32": the parameters too
            model.float()
            grads = [p.grad for p in model.parameters()]
        if bf16_division:  # divide each bf16 gradient first: rounded in bf16, then summed
            buffer = torch.cat([(g / n).float().flatten() for g in grads])
        else:
            buffer = torch.cat([g.float().flatten() for g in grads])
        if dummy:
            folder = _cheat_folder(f"fp32-{dummy}")
            _save_for_all(buffer, folder)
            dist.all_reduce(torch.zeros(dummy))  # a float32 all_reduce, as a barrier
            buffer = sum(_load_everyone(folder))
        else:
            dist.all_reduce(buffer)
        if divide and not bf16_division:
            buffer /= n
        if copy_back:
            for g, piece in zip(grads, buffer.split([g.numel() for g in grads]), strict=True):
                g.copy_(piece.view_as(g))
        if then == "steps the optimizer":
            torch.optim.SGD(model.parameters(), lr=0.1).step()

    return average_gradients_in_fp32


def _fp32_in_bf16(model):
    """Notebook 02's loop on a bf16 model: the sum in bf16 (right numbers on 2 ranks)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


# --------------------------------------------------------------------------------------------
# The table: each wrong answer, and what its check must say
# --------------------------------------------------------------------------------------------

ON_2, ON_3 = r"^on 2 ranks: ", r"^right on 2 ranks, but on 3 ranks: "
TM_2, TM_3 = (r"^on 2 ranks × 4 micro-batches: ",
              r"^right on 2 ranks × 4 micro-batches, but on 3 ranks × 3 micro-batches: ")

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
    # 07: token_mean_backward (2 ranks × 4 micro-batches, then 3 × 3)
    ("token_mean_backward", "the mean per micro-batch", _token_mean(mean="per micro-batch"),
     TM_2 + r"your gradient is not the mean over all \d+ valid tokens: this is the 2024 "
            r"accumulation bug: each micro-batch's own mean"),
    ("token_mean_backward", "the mean per micro-batch, no × N",
     _token_mean(mean="per micro-batch", times=1),
     r"2024 accumulation bug.*And multiply by the world size: DDP divides the summed "
     r"gradients by it\."),
    ("token_mean_backward", "a rank's own count", _token_mean(mean="local"),
     r"this is each rank's own mean \(its loss sum / its own count\), which DDP then averages "
     r"over the ranks: all_reduce the count"),
    ("token_mean_backward", "a rank's own count, no × N", _token_mean(mean="local", times=1),
     r"each rank's own mean.*And multiply by the world size"),
    ("token_mean_backward", "no × N", _token_mean(times=1),
     r"you forgot the × N: DDP divides the summed gradients by the world size \(2 here\)"),
    ("token_mean_backward", "hard-coded × 2", _token_mean(times=2),
     TM_3 + r"your gradients are 0\.67× the expected ones.*Did you multiply by 2 instead of the "
            r"world size \(3 here\)\? Use dist\.get_world_size\(\): it is not always 2\."),
    ("token_mean_backward", "hard-coded × 3", _token_mean(times=3),
     TM_2 + r"your gradients are 1\.5× the expected ones.*Did you multiply by 3 instead of the "
            r"world size \(2 here\)\? Use dist\.get_world_size\(\): it is not always 3\."),
    ("token_mean_backward", "padding counted", _token_mean(count="padding"),
     r"you counted every position, padding included \(targets\.numel\(\)\)"),
    ("token_mean_backward", "a count per micro-batch", _token_mean(count="micro-batch"),
     r"you divided each micro-batch by the count of that micro-batch over the ranks"),
    ("token_mean_backward", "zero_grad inside the loop", _token_mean(zero_inside=True),
     r"only the last micro-batch's gradient is left: do not zero the gradients"),
    ("token_mean_backward", "gradients summed again", _token_mean(sum_gradients=True),
     r"you multiplied by the world size and also summed the gradients yourself: DDP already "
     r"averages them"),
    ("token_mean_backward", "no no_sync", _token_mean(no_sync=False),
     r"DDP all-reduced the gradients in 4 backward passes: run every micro-batch but the last "
     r"inside `with model\.no_sync\(\):`"),
    ("token_mean_backward", "logs its own mean", _token_mean(log="own"),
     r"token_mean_backward returned .* on rank 0; the mean loss over all \d+ valid tokens is "
     r".*Yours is this rank's own mean"),
    ("token_mean_backward", "returns a tensor", _token_mean(log="tensor"),
     r"token_mean_backward returned Tensor tensor\(.* on rank 0: return the mean loss as a "
     r"float"),
    ("token_mean_backward", "the count through files, a barrier",
     _token_mean(count_through_files=True),
     TM_2 + r"rank 0's collectives delivered barrier, all_reduce of 1 number \(\[[\d.]+\]\): "
            r"never the count of valid tokens of all the ranks \(\d+\), nor every rank's count"),
    ("token_mean_backward", "steps the optimizer", _token_mean_then("steps the optimizer"),
     TM_2 + r"on rank 0, token_mean_backward changed the parameters: `0\.weight` .*: compute "
            r"the gradients only; the caller's optimizer takes the step"),
    ("token_mean_backward", "changes the inputs", _token_mean_then("changes the inputs"),
     TM_2 + r"on rank 0, token_mean_backward changed the micro-batches it was given: "
            r"`inputs\[0\]` .*: leave the inputs and targets as they are"),
    # 08: average_and_clip_shard (shards of 12 numbers on 2 ranks, of 10 on 3)
    ("average_and_clip_shard", "no division", _shard(divide=None),
     ON_2 + r"on rank 0 of 2, without clipping, your shard is 2\.0× the mean: it is the sum that "
            r"the reduce-scatter returns\. Divide it by the world size"),
    ("average_and_clip_shard", "ReduceOp.AVG, then divided", _shard(op="AVG"),
     r"your shard is 0\.5× the mean: op=ReduceOp\.AVG already divides by the world size; do "
     r"not divide again"),
    ("average_and_clip_shard", "hard-coded / 2", _shard(divide="two"),
     ON_3 + r"on rank 0 of 3, without clipping, your shard is 1\.5× the mean.*Did you divide by "
            r"2 instead of world_size, dist\.get_world_size\(\) \(3 here\)\?"),
    ("average_and_clip_shard", "hard-coded / 3", _shard(divide="three"),
     ON_2 + r"on rank 0 of 2, without clipping, your shard is 0\.67× the mean.*Did you divide "
            r"by 3 instead of world_size"),
    ("average_and_clip_shard", "hard-coded shard of 12", _shard(size=12),
     ON_3 + r"on rank 0, the reduce-scatter refused your tensors \(outputShape\[0\] \* "
            r"worldSize == inputShape\[0\] \(36 vs\. 30\)\): with 3 ranks and a flat gradient "
            r"of 30 numbers, each shard has 10"),
    ("average_and_clip_shard", "clipped by its own shard's norm", _shard(norm="shard"),
     ON_2 + r"on rank 0 of 2, with max_norm .*, you clipped with the norm of your own shard, "
            r".*× the whole gradient's norm .*: each rank clips by its own factor\. All-reduce "
            r"the squared norm of your shard"),
    ("average_and_clip_shard", "not clipped", _shard(clip=False),
     r"your shard was not clipped, although the gradient's norm is"),
    ("average_and_clip_shard", "the sum of the norms", _shard(norm="sum of norms"),
     r"you clipped with the sum of the shards' norms"),
    ("average_and_clip_shard", "the norm before averaging", _shard(norm="before averaging"),
     r"you clipped with the norm of this rank's gradient before averaging"),
    ("average_and_clip_shard", "every square all-reduced", _shard(norm="vector"),
     ON_2 + r"the values are right, but your all_reduce carried 12 numbers: the norm needs one "
            r"per rank"),
    ("average_and_clip_shard", "all_reduce of the whole gradient",
     _shard(collective="all_reduce"),
     r"made no reduce-scatter \(all_reduce of the whole gradient \(24 numbers\): every rank "
     r"then holds every shard, as in notebook 02\)"),
    ("average_and_clip_shard", "no collective", _shard(collective="none", norm="shard"),
     r"made no collective call, so no rank knows the others' gradients"),
    ("average_and_clip_shard", "no reduce-scatter", _shard(collective="none"),
     r"made no reduce-scatter \(only all_reduce of 1 number \(\[.*\]\)\)\. The exercise is a "
     r"sharded step"),
    ("average_and_clip_shard", "the shards in reverse", _shard(collective="reversed list"),
     r"on rank 0 of 2, without clipping, you returned shard 1 of the mean"),
    ("average_and_clip_shard", "returns the whole gradient", _shard(whole=True),
     r"on rank 0, average_and_clip_shard returned 24 numbers, the whole gradient: return this "
     r"rank's shard only, 12 numbers"),
    ("average_and_clip_shard", "divides flat_grad in place",
     _shard(divide="flat_grad in place"),
     ON_2 + r"on rank 0, average_and_clip_shard changed the flat gradient it was given \(max "
            r"abs difference .*\): return the shard, and leave the flat gradient"),
    ("average_and_clip_shard", "through files, a dummy reduce-scatter",
     _shard(collective="files"),
     ON_2 + r"the values are right, but on rank 0 the reduce-scatter's output and input held 36 "
            r"numbers \(\[0, 0, 0, 0, \.\.\.\]\) afterwards, not the sum over the ranks of shard "
            r"0"),
    ("average_and_clip_shard", "the norm through files, a dummy all_reduce",
     _shard(norm="files"),
     ON_2 + r"the values are right, but on rank 0 \(with no clipping\) your all_reduce of 1 "
            r"number \(\[0\]\) is not the squared norm of the mean gradient"),
    # 09: average_gradients_in_fp32 (a bf16 model)
    ("average_gradients_in_fp32", "the sum in bf16", _fp32_in_bf16,
     ON_2 + r"your all_reduce carried bfloat16, not float32: the sum was computed in bfloat16"),
    ("average_gradients_in_fp32", "no division", _fp32(divide=False),
     ON_2 + r"your gradients are 2\.0× the mean: all_reduce\(SUM\) gives the sum; divide it by "
            r"the world size"),
    ("average_gradients_in_fp32", "hard-coded / 2", _fp32(world_size=2),
     ON_3 + r"your gradients are 1\.5× the mean over ranks.*Did you divide by 2 instead of the "
            r"world size \(3 here\)"),
    ("average_gradients_in_fp32", "hard-coded / 3", _fp32(world_size=3),
     ON_2 + r"your gradients are 0\.67× the mean over ranks.*Did you divide by 3 instead of the "
            r"world size \(2 here\)"),
    ("average_gradients_in_fp32", "a division in bf16", _fp32(bf16_division=True),
     ON_3 + r"[\d,]+ of your 21,840 numbers are not the float32 mean rounded once to bf16"),
    ("average_gradients_in_fp32", "a reduced copy", _fp32(copy_back=False),
     ON_2 + r"the gradients did not change: every rank still holds its own"),
    ("average_gradients_in_fp32", "turns the model float32",
     _fp32(then="turns the model float32"),
     ON_2 + r"on rank 0, average_gradients_in_fp32 turned the parameters float32: leave the "
            r"model as it is"),
    ("average_gradients_in_fp32", "steps the optimizer", _fp32(then="steps the optimizer"),
     ON_2 + r"on rank 0, average_gradients_in_fp32 changed the parameters: `conv1\.weight`.*"
            r"leave the model as it is"),
    ("average_gradients_in_fp32", "through files, a dummy all_reduce of one number",
     _fp32(dummy=1),
     ON_2 + r"the gradients are right, but on rank 0 your all_reduce calls delivered 1 number "
            r"\(\[0\]\), not the sum of the ranks' 21,840 gradient numbers"),
    ("average_gradients_in_fp32", "through files, a dummy all_reduce of 21,840 zeros",
     _fp32(dummy=21840),
     ON_2 + r"the gradients are right, but on rank 0 your all_reduce calls delivered 21,840 "
            r"numbers \(\[0, 0, 0, 0, \.\.\.\]\), not the sum"),
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
    # The launcher stops it early (rank 1 returned while rank 0 waits), or at 5 s.
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


def test_token_mean_backward_says_what_it_verified_at_each_configuration(capsys):
    exercises.check_token_mean_backward(_token_mean())
    out = capsys.readouterr().out
    assert re.search(r"✓ correct: the gradient and the loss are those of one process on every "
                     r"valid token, on 2 ranks × 4 micro-batches \((\d+) valid tokens, loss .*; "
                     r"collectives: all_reduce 2 times, ddp_bucket_allreduce once, delivering the "
                     r"count \1\) and on 3 ranks × 3 micro-batches .*; the parameters and the "
                     r"micro-batches are untouched\.", out), out
    exercises.check_token_mean_backward(_token_mean(), world_size=3)  # one size, as asked
    out = capsys.readouterr().out
    assert "on 3 ranks × 3 micro-batches" in out and "2 ranks" not in out


def test_the_sharded_check_accepts_avg_alone(capsys):
    exercises.check_average_and_clip_shard(_shard(op="AVG", divide=None), world_size=3)
    assert capsys.readouterr().out.startswith(
        "✓ correct: on 3 ranks (shards of 10 numbers), with and without clipping, one "
        "reduce-scatter delivered every rank the mean of its shard over the ranks, and one "
        "all_reduce of one number the squared norm")


def test_the_fp32_check_says_what_it_verified(capsys):
    exercises.check_average_gradients_in_fp32(_fp32(), world_size=3)
    assert capsys.readouterr().out.startswith(
        "✓ correct: on 3 ranks, your all_reduce carried float32 (1 call, 21,840 numbers) and "
        "delivered the sum of the ranks' bf16 gradients; every rank's bf16 gradients are the "
        "mean rounded once")
