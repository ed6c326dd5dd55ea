"""Every exercise check passes its reference solution and catches typical wrong answers.

The wrong answers are what learners write: no division, the loop of notebook 02 instead of one
call, a reduced copy never copied back, ``[t] * world_size``, a broadcast into a clone... Each
must be caught with the message that names the mistake. So must answers that guess instead of
computing: a hard-coded world size (2) or number of micro-batches (4), a value computed locally
that only communication can deliver. The checks launch 3 real ranks (gloo), a number a solution
cannot take for granted; they reuse the same idle workers from one launch to the next.
"""

from __future__ import annotations

import contextlib
import functools
import re
import runpy

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


def solution(name: str):
    """The reference function, read from notebooks/solutions/ (not imported by name)."""
    return runpy.run_path(str(SOLUTIONS / EXERCISES[name].solution))[name]


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


@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_reference_solution_passes(name, capsys):
    assert EXERCISES[name].check(solution(name)) is None
    out = capsys.readouterr().out
    assert out.startswith("✓ correct: ")


@pytest.mark.parametrize("name", list(EXERCISES))
def test_a_stub_is_not_attempted_and_does_not_fail(name, capsys):
    def stub(*args):
        raise NotImplementedError("replace this line with your code")

    stub.__name__ = name
    assert EXERCISES[name].check(stub) is None
    out = capsys.readouterr().out
    assert out.startswith(f"... not attempted yet: {name} still raises NotImplementedError")
    assert f"%load solutions/{EXERCISES[name].solution}" in out


def test_not_a_function_or_the_wrong_arguments():
    with pytest.raises(ExerciseFailed, match=r"pass your function itself.*got list"):
        exercises.check_gather_ranks([0, 1])  # the result of gather_ranks(...), not the function
    def average_gradients_flat(model, world_size):
        pass

    with pytest.raises(ExerciseFailed, match=r"average_gradients_flat\(model, world_size\) cannot"
                                             r" be called as average_gradients_flat\(model\)"):
        exercises.check_average_gradients_flat(average_gradients_flat)
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        exercises.check_broadcast_parameters(solution("broadcast_parameters"), world_size=1)


# --------------------------------------------------------------------------------------------
# 00: gather_ranks
# --------------------------------------------------------------------------------------------


def test_gather_ranks_wrong_answers(capsys):
    def computed_locally(rank, world_size):
        return list(range(world_size))

    with pytest.raises(ExerciseFailed, match=r"made no collective call.*dist\.all_gather"):
        exercises.check_gather_ranks(computed_locally)

    def one_tensor_repeated(rank, world_size):
        everyone = [torch.zeros(1)] * world_size  # ONE tensor, world_size times
        dist.all_gather(everyone, torch.tensor([float(rank)]))
        return [int(t.item()) for t in everyone]

    with pytest.raises(ExerciseFailed, match=r"holds the same tensor 3 times \(rank 0 returned "
                                             r"\[2, 2, 2\]\): `\[t\] \* 3` repeats one tensor"):
        exercises.check_gather_ranks(one_tensor_repeated)

    def returns_tensors(rank, world_size):
        everyone = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(everyone, torch.tensor([float(rank)]))
        return everyone

    with pytest.raises(ExerciseFailed, match=r"rank 0 returned a list of tensors.*t\.item\(\)"):
        exercises.check_gather_ranks(returns_tensors)

    def floats_are_fine(rank, world_size):  # [0.0, 1.0] == [0, 1]: accepted
        return torch.cat(returns_tensors(rank, world_size)).tolist()

    assert exercises.check_gather_ranks(floats_are_fine) is None
    assert "✓ correct" in capsys.readouterr().out


def test_gather_ranks_guesses_are_caught():
    def barrier_then_guess(rank, world_size):  # a collective, but no data exchanged
        dist.barrier()
        return list(range(world_size))

    with pytest.raises(ExerciseFailed, match=r"made no collective call that moves data "
                                             r"\(collectives called: barrier once\)"):
        exercises.check_gather_ranks(barrier_then_guess)

    def two_ranks(rank, world_size):  # "there are 2 ranks": the course's examples use 2
        everyone = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(everyone, torch.tensor([float(rank)]))
        return [int(t.item()) for t in everyone]

    with pytest.raises(ExerciseFailed, match=r"two_ranks raised an error on rank"):
        exercises.check_gather_ranks(two_ranks)


def test_gather_ranks_an_error_and_a_hang_are_reported():
    def passes_an_int(rank, world_size):
        everyone = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(everyone, rank)  # not a tensor
        return everyone

    with pytest.raises(ExerciseFailed) as info:
        exercises.check_gather_ranks(passes_an_int)
    message = str(info.value)
    assert message.startswith("passes_an_int raised an error on rank ")
    assert "dist.all_gather(everyone, rank)" in message  # the traceback shows the line

    def only_rank_0_gathers(rank, world_size):
        everyone = [torch.zeros(1) for _ in range(world_size)]
        if rank == 0:
            dist.all_gather(everyone, torch.tensor([0.0]))
        return [int(t.item()) for t in everyone]

    with pytest.raises(ExerciseFailed, match=r"did not finish within 5 s: rank 0 had not "
                                             r"finished.*collective that not every rank called"):
        exercises.check_gather_ranks(only_rank_0_gathers, timeout=5)


# --------------------------------------------------------------------------------------------
# 01: accumulate_gradients (one process)
# --------------------------------------------------------------------------------------------


def _accumulate(divide=True, zero_inside=False, whole_batch=False, returns="float",
                pieces=None, divisor=None):
    """A learner's accumulate_gradients, with one of the typical mistakes switched on (pieces,
    divisor: a hard-coded number of micro-batches to split into, to divide by)."""

    def accumulate_gradients(model, images, labels, micro_batches):
        k = 1 if whole_batch else pieces or micro_batches
        total, last = 0.0, None
        for x, y in zip(images.chunk(k), labels.chunk(k), strict=True):
            if zero_inside:
                model.zero_grad()
            loss = F.nll_loss(model(x), y)
            if divide:
                loss = loss / (divisor or micro_batches)
            loss.backward()
            total, last = total + loss.item(), loss
        return {"float": total, "tensor": last, "last": last.item() * micro_batches}[returns]

    return accumulate_gradients


@pytest.mark.parametrize("mistake, message", [
    (dict(divide=False), r"your gradients are 3\.0× the expected ones: did you divide each "
                         r"micro-batch's loss by micro_batches\?"),
    (dict(zero_inside=True), r"your gradient is the last micro-batch's only \(times 0\.333\).*"
                             r"zero_grad\(\).*inside the loop"),
    (dict(zero_inside=True, divide=False), r"the last micro-batch's only \(times 1\)"),
    (dict(whole_batch=True), r"your model saw 24 samples in one forward pass: split the batch "
                             r"of 24 into 3 micro-batches of 8"),
    # Hard-coded 4, the notebook's number: the check asks for 3.
    (dict(pieces=4, divisor=4), r"your model ran 4 forward passes \(of 6, 6, 6, 6 samples\); "
                                r"with micro_batches=3, run one per micro-batch: 3 of 8"),
    (dict(divisor=4), r"your gradients are 0\.75× the expected ones.*Did you divide by 4 "
                      r"instead of micro_batches \(3 here\)\?"),
    (dict(returns="tensor"), r"returned a tensor.*return a float \(`loss\.item\(\)`\)"),
    (dict(returns="last"), r"returned the loss .*; the whole batch's mean loss is .*It is the "
                           r"last micro-batch's"),
])
def test_accumulate_gradients_wrong_answers(mistake, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_accumulate_gradients(_accumulate(**mistake))


def test_accumulate_gradients_check_leaves_the_random_state_alone(capsys):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert exercises.check_accumulate_gradients(_accumulate(), micro_batches=2) is None
    assert torch.equal(torch.rand(3), expected)
    assert "2 micro-batches of 8" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# 02: average_gradients_flat
# --------------------------------------------------------------------------------------------


def _flat(model, divide=True, copy_back=True, divide_on=(0, 1, 2), world_size=None,
          put_back="view_as"):
    """A learner's average_gradients_flat, with one of the typical mistakes switched on."""
    grads = [p.grad for p in model.parameters()]
    buffer = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(buffer)
    if divide and dist.get_rank() in divide_on:
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


def test_average_gradients_flat_wrong_answers():
    def per_parameter(model):  # notebook 02's loop: right values, 8 calls
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    with pytest.raises(ExerciseFailed, match=r"the gradients are right, but you called "
                                             r"all_reduce 8 times; one call is enough"):
        exercises.check_average_gradients_flat(per_parameter)

    def per_parameter_imported(model):  # `from torch.distributed import all_reduce` is counted
        for p in model.parameters():
            imported_all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    with pytest.raises(ExerciseFailed, match="called all_reduce 8 times"):
        exercises.check_average_gradients_flat(per_parameter_imported)

    with pytest.raises(ExerciseFailed, match=r"your gradients are 3\.0× the expected ones: did "
                                             r"you divide by the world size\?"):
        exercises.check_average_gradients_flat(lambda model: _flat(model, divide=False))
    with pytest.raises(ExerciseFailed, match=r"the gradients did not change: every rank still "
                                             r"holds its own\. You reduced a copy"):
        exercises.check_average_gradients_flat(lambda model: _flat(model, copy_back=False))
    with pytest.raises(ExerciseFailed, match=r"rank 1's gradients differ from rank 0's in "
                                             r"`conv1\.weight` \(max abs difference .*; 8 of 8 "
                                             r"tensors differ\)"):
        exercises.check_average_gradients_flat(lambda model: _flat(model, divide_on=(0,)))


def test_average_gradients_flat_hard_coded_world_size():
    with pytest.raises(ExerciseFailed, match=r"your gradients are 1\.5× the expected ones .*Did "
                                             r"you divide by 2 instead of world_size"):
        exercises.check_average_gradients_flat(lambda model: _flat(model, world_size=2))


def test_average_gradients_flat_a_piece_without_its_shape_gets_a_message():
    for put_back, error in (("copy_", "The size of tensor a"),
                            ("assign", "attempting to assign a gradient of size")):
        with pytest.raises(ExerciseFailed) as info:
            exercises.check_average_gradients_flat(functools.partial(_flat, put_back=put_back))
        message = str(info.value)
        assert message.startswith("on rank 0, putting a piece of the flat tensor back into a "
                                  f"gradient failed ({error}")
        assert "p.grad.copy_(piece.view_as(p.grad))" in message
        assert "Traceback" not in message
    with pytest.raises(ExerciseFailed, match=r"differ from the mean over ranks in `conv1\.weight` "
                                             r"\(a different shape; 4 of 8 tensors differ\).*"
                                             r"piece\.view_as\(p\.grad\)"):
        exercises.check_average_gradients_flat(lambda model: _flat(model, put_back="data"))


# --------------------------------------------------------------------------------------------
# 03: broadcast_parameters
# --------------------------------------------------------------------------------------------


def test_broadcast_parameters_wrong_answers():
    def into_a_copy(model):
        for p in model.parameters():
            dist.broadcast(p.detach().clone(), src=0)

    with pytest.raises(ExerciseFailed, match=r"rank 1's parameters did not change, although you "
                                             r"called broadcast 8 times: you broadcast into a "
                                             r"copy"):
        exercises.check_broadcast_parameters(into_a_copy)

    def weights_only(model):
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                dist.broadcast(p.detach(), src=0)

    with pytest.raises(ExerciseFailed, match=r"rank 1's parameters differ from rank 0's in "
                                             r"`conv1\.bias` \(max abs difference .*; 4 of 8 "
                                             r"tensors differ\): did you broadcast every "
                                             r"parameter\?"):
        exercises.check_broadcast_parameters(weights_only)

    def averaged(model):
        for p in model.parameters():
            dist.all_reduce(p.detach())
            p.detach().div_(dist.get_world_size())

    with pytest.raises(ExerciseFailed, match=r"the replicas agree, but on the average of the "
                                             r"ranks' weights, not on rank 0's"):
        exercises.check_broadcast_parameters(averaged)

    def from_rank_1(model):
        for p in model.parameters():
            dist.broadcast(p.detach(), src=1)

    with pytest.raises(ExerciseFailed, match=r"every rank holds rank 1's weights: broadcast "
                                             r"from rank 0, src=0"):
        exercises.check_broadcast_parameters(from_rank_1)

    def frozen(model):
        for p in model.parameters():
            p.requires_grad_(False)  # "no autograd during the broadcast", never switched back
            dist.broadcast(p, src=0)

    with pytest.raises(ExerciseFailed, match=r"on rank 0, `conv1\.weight` is no longer a "
                                             r"trainable parameter"):
        exercises.check_broadcast_parameters(frozen)


def test_broadcast_parameters_recomputed_locally_is_caught():
    def reseeded(model):  # rank 0's weights were Net() under the check's seed: no broadcast
        torch.manual_seed(1234)
        for module in (model.conv1, model.conv2, model.fc1, model.fc2):
            module.reset_parameters()

    with pytest.raises(ExerciseFailed, match=r"reseeded made no collective call, so the other "
                                             r"ranks cannot have received rank 0's weights"):
        exercises.check_broadcast_parameters(reseeded)


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
    assert "✓ correct" in out


# --------------------------------------------------------------------------------------------
# 04: global_mean_loss
# --------------------------------------------------------------------------------------------


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
        loss_sum = losses.sum()
        dist.all_reduce(loss_sum)
        if mistake == "own count":
            return (loss_sum / len(losses)).item()
        if mistake == "by world size":
            return (loss_sum / dist.get_world_size()).item()
        if mistake == "11 samples":  # the total with 2 ranks: 8 + 3
            return (loss_sum / 11).item()
        count = torch.tensor(float(len(losses)))
        dist.all_reduce(count)  # a second call: right, with a note
        return loss_sum / count if mistake == "tensor" else (loss_sum / count).item()

    return global_mean_loss


@pytest.mark.parametrize("mistake, message", [
    ("mean of means", r"every rank returned .*; the mean over all 20 samples is .* Yours is the "
                      r"mean of the ranks' means .*\(rank 0: 8, rank 1: 3, rank 2: 9\).*"
                      r"mean-of-means"),
    ("no division", r"Yours is the sum of the ranks' means: all_reduce\(SUM\) adds them up"),
    ("local", r"every rank returned its own mean \(rank 0: .*, rank 1: .*; collectives called: "
              r"none\)"),
    ("own count", r"each divided the global sum of the losses by its own count"),
    ("by world size", r"Yours is the sum of all losses divided by the world size; divide by the "
                      r"number of samples, 20 in all"),
    ("11 samples", r"every rank returned .*; the mean over all 20 samples is"),
    ("tensor", r"rank 0 returned a tensor, tensor\(.*return a float \(`\.item\(\)`\)"),
])
def test_global_mean_loss_wrong_answers(mistake, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_global_mean_loss(_mean_loss(mistake))


def test_global_mean_loss_a_hang_and_two_calls(capsys):
    def only_rank_0_reduces(losses):  # "only rank 0 logs", so only rank 0 reduces
        totals = torch.stack([losses.detach().sum(), torch.tensor(float(len(losses)))])
        if dist.get_rank() == 0:
            dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()

    with pytest.raises(ExerciseFailed, match=r"did not finish within 5 s: rank 0 had not "
                                             r"finished.*collective that not every rank called"):
        exercises.check_global_mean_loss(only_rank_0_reduces, timeout=5)

    def in_place(losses):
        losses.detach().mul_(2)  # detach() shares the memory: the caller's losses change
        return solution("global_mean_loss")(losses) / 2

    with pytest.raises(ExerciseFailed, match=r"on rank 0, in_place changed the `losses` tensor"):
        exercises.check_global_mean_loss(in_place)

    assert exercises.check_global_mean_loss(_mean_loss()) is None  # two calls: right, a note
    out = capsys.readouterr().out
    assert out.startswith("note: you called all_reduce 2 times; one call on torch.stack")
    assert "✓ correct: with rank 0: 8, rank 1: 3, rank 2: 9 samples" in out


def test_global_mean_loss_recomputed_locally_is_caught():
    def recomputes(losses):  # every rank's losses from the check's own generator: no collective
        from gradsync_tutorial.exercises.mean_loss import _uneven_losses

        everyone = torch.cat([_uneven_losses(r).detach() for r in range(dist.get_world_size())])
        return everyone.mean().item()

    with pytest.raises(ExerciseFailed, match=r"recomputes made no collective call, so no rank "
                                             r"knows the others' losses"):
        exercises.check_global_mean_loss(recomputes)


# --------------------------------------------------------------------------------------------
# 06: save_checkpoint
# --------------------------------------------------------------------------------------------


def _save(leave_out=(), every_rank=False, barrier=True, prefixed=False, objects=False,
          epoch=lambda epochs_done: epochs_done):
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
        if every_rank or dist.get_rank() == 0:
            torch.save(checkpoint, path)
        if barrier:
            dist.barrier()

    return save_checkpoint


@pytest.mark.parametrize("mistake, message", [
    (dict(leave_out=["optimizer"]), r"your checkpoint has no optimizer state: SGD's momentum "
                                    r"buffers .*\(2 steps after a resume from your file end up "
                                    r"to .* away from the straight run's parameters\)"),
    (dict(leave_out=["rng_state"]), r"your checkpoint has no RNG state .* dropout draws random "
                                    r"numbers.*torch\.get_rng_state\(\)"),
    (dict(leave_out=["epoch"]), r"your checkpoint does not record epochs_done \(the check "
                                r"passed 7; the epoch to start from, 8, would do too\)"),
    (dict(epoch=lambda epochs_done: 3), r"your checkpoint does not record epochs_done"),
    (dict(leave_out=["model"]), r"your checkpoint has no model state dict"),
    (dict(every_rank=True), r"ranks 0, 1, 2 all wrote the file.*Save on rank 0 only"),
    (dict(barrier=False), r"ranks 1, 2 returned from save_checkpoint before the file existed"
                          r".*dist\.barrier\(\)"),
    (dict(prefixed=True), r"your model state dict's names start with 'module\.'"),
    (dict(objects=True), r"torch\.load\(path, weights_only=True\) cannot read your file: .*"
                         r"not the model or optimizer objects"),
])
def test_save_checkpoint_wrong_answers(mistake, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_save_checkpoint(_save(**mistake))


def test_save_checkpoint_the_next_epoch_is_accepted(capsys):
    # "epoch": the epoch to start from (epochs_done + 1) resumes right, as epochs done does.
    exercises.check_save_checkpoint(_save(epoch=lambda epochs_done: epochs_done + 1))
    assert capsys.readouterr().out.startswith("✓ correct: your file holds")


def test_save_checkpoint_nothing_written():
    def forgot_to_save(path, model, optimizer, epochs_done):
        dist.barrier()

    with pytest.raises(ExerciseFailed, match=r"no file at `path` after forgot_to_save "
                                             r"\(collectives called: barrier once\)"):
        exercises.check_save_checkpoint(forgot_to_save)


# --------------------------------------------------------------------------------------------
# 05: average_overlapped
# --------------------------------------------------------------------------------------------


def _overlapped(divide=True, clear=True, use_async=True, world_size=None):
    """A learner's average_overlapped, with one of the typical mistakes switched on."""

    def average_overlapped(model):
        pending = []

        def start(param):
            pending.append((param, dist.all_reduce(param.grad, async_op=use_async)))

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

        return finish

    return average_overlapped


def test_average_overlapped_wrong_answers():
    def after_backward(model):  # notebook 02's loop, moved into finish(): right, no overlap
        def finish():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()

        return finish

    with pytest.raises(ExerciseFailed, match=r"no all_reduce started during backward in step 1 "
                                             r"\(all 8 in finish\(\)\): nothing overlaps"):
        exercises.check_average_overlapped(after_backward)
    with pytest.raises(ExerciseFailed, match=r"8 of the 8 all_reduce calls made during backward "
                                             r"in step 1 had no async_op=True"):
        exercises.check_average_overlapped(_overlapped(use_async=False))
    with pytest.raises(ExerciseFailed, match=r"in step 1, your gradients are 3\.0× the mean over "
                                             r"ranks: divide by the world size"):
        exercises.check_average_overlapped(_overlapped(divide=False))
    with pytest.raises(ExerciseFailed, match=r"step 1 is right, but in step 2 your gradients .*: "
                                             r"did finish\(\) handle step 1's handles again\?"):
        exercises.check_average_overlapped(_overlapped(clear=False))

    def returns_none(model):  # forgot `return finish`
        pass

    with pytest.raises(ExerciseFailed, match=r"returns_none\(model\) returned NoneType None: "
                                             r"return the function"):
        exercises.check_average_overlapped(returns_none)


def test_average_overlapped_hard_coded_world_size():
    with pytest.raises(ExerciseFailed, match=r"in step 1, your gradients are 1\.5× the mean over "
                                             r"ranks.*Did you divide by 2 instead of world_size"):
        exercises.check_average_overlapped(_overlapped(world_size=2))  # / 2: right on 2 ranks


# --------------------------------------------------------------------------------------------
# 07: token_mean_backward (DDP, gradient accumulation, variable-length sequences)
# --------------------------------------------------------------------------------------------


def _token_mean(mean="global", times=None, no_sync=True, count=None, log="global",
                zero_inside=False, sum_gradients=False):
    """A learner's token_mean_backward, with one of the typical mistakes switched on (times: a
    hard-coded world size to multiply by; count: "padding" or "micro-batch")."""

    def token_mean_backward(model, micro_batches):
        def valid(targets):
            return torch.tensor(targets.numel()) if count == "padding" else (targets != -100).sum()

        local = sum(valid(targets) for _, targets in micro_batches)
        total_count = local.clone()
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


@pytest.mark.parametrize("mistake, message", [
    (dict(mean="per micro-batch"), r"^on 2 ranks × 4 micro-batches: your gradient is not the mean "
                                   r"over all \d+ valid tokens: this is the 2024 accumulation "
                                   r"bug: each micro-batch's own mean"),
    (dict(mean="per micro-batch", times=1), r"2024 accumulation bug.*And multiply by the world "
                                            r"size: DDP divides the summed gradients by it\."),
    (dict(mean="local"), r"this is each rank's own mean \(its loss sum / its own count\), which "
                         r"DDP then averages over the ranks: all_reduce the count"),
    (dict(mean="local", times=1), r"each rank's own mean.*And multiply by the world size"),
    (dict(times=1), r"you forgot the × N: DDP divides the summed gradients by the world size "
                    r"\(2 here\)"),
    # Hard-coded 2, the notebook's world size: right on 2 ranks, caught on 3.
    (dict(times=2), r"^right on 2 ranks × 4 micro-batches, but on 3 ranks × 3 micro-batches: "
                    r"your gradients are 0\.67× the expected ones.*Did you multiply by 2 instead "
                    r"of the world size \(3 here\)\?"),
    (dict(count="padding"), r"you counted every position, padding included \(targets\.numel\(\)\)"),
    (dict(count="micro-batch"), r"you divided each micro-batch by the count of that micro-batch "
                                r"over the ranks"),
    (dict(zero_inside=True), r"only the last micro-batch's gradient is left: do not zero the "
                             r"gradients"),
    (dict(sum_gradients=True), r"you multiplied by the world size and also summed the gradients "
                               r"yourself: DDP already averages them"),
    (dict(no_sync=False), r"DDP all-reduced the gradients in 4 backward passes: run every "
                          r"micro-batch but the last inside `with model\.no_sync\(\):`"),
    (dict(log="own"), r"token_mean_backward returned .* on rank 0; the mean loss over all \d+ "
                      r"valid tokens is .*Yours is this rank's own mean"),
    (dict(log="tensor"), r"token_mean_backward returned Tensor tensor\(.* on rank 0: return the "
                         r"mean loss as a float"),
])
def test_token_mean_backward_wrong_answers(mistake, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_token_mean_backward(_token_mean(**mistake))


def test_token_mean_backward_count_exchanged_through_files_is_caught(tmp_path):
    def counts_through_files(model, micro_batches):  # the loss all-reduced, the count not
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local = sum(int((y != -100).sum()) for _, y in micro_batches)
        (tmp_path / f"c{world_size}-{rank}").write_text(str(local))
        dist.barrier()
        count = sum(int((tmp_path / f"c{world_size}-{r}").read_text()) for r in range(world_size))
        total = torch.zeros((), dtype=torch.float64)
        for k, (x, y) in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
                (loss / count * world_size).backward()
            total += loss.detach()
        dist.all_reduce(total)
        return (total / count).item()

    with pytest.raises(ExerciseFailed, match=r"on 2 ranks × 4 micro-batches: rank 0's collectives "
                                             r"delivered \[[\d.]+\] \(.*barrier once.*\), never "
                                             r"the count of valid tokens of all the ranks \(\d+\)"):
        exercises.check_token_mean_backward(counts_through_files)


def test_token_mean_backward_what_it_must_leave_alone():
    right = _token_mean()

    def steps_too(model, micro_batches):  # the optimizer's job, done here
        loss = right(model, micro_batches)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        return loss

    with pytest.raises(ExerciseFailed, match=r"on rank 0, steps_too changed the parameter "
                                             r"`0\.weight`: compute the gradients only"):
        exercises.check_token_mean_backward(steps_too)

    def masks_in_place(model, micro_batches):
        for _, y in micro_batches:
            y[y == -100] = -100  # a no-op...
            y[:, 0] = y[:, 0]  # ...and another
        for x, _ in micro_batches:
            x.clamp_(max=5)  # changes the inputs
        return right(model, micro_batches)

    with pytest.raises(ExerciseFailed, match=r"masks_in_place changed the micro-batches it was "
                                             r"given"):
        exercises.check_token_mean_backward(masks_in_place)


def test_token_mean_backward_checks_two_configurations(capsys):
    exercises.check_token_mean_backward(_token_mean())
    out = capsys.readouterr().out
    assert re.search(r"✓ correct: the gradient and the loss are those of one process on every "
                     r"valid token, on 2 ranks × 4 micro-batches \((\d+) valid tokens, loss .*; "
                     r"collectives: all_reduce 2 times, ddp_bucket_allreduce once, delivering the "
                     r"count \1\) and on 3 ranks × 3 micro-batches", out), out
    exercises.check_token_mean_backward(_token_mean(), world_size=3)  # one size, as asked
    out = capsys.readouterr().out
    assert "on 3 ranks × 3 micro-batches" in out and "2 ranks" not in out
