"""Issue 39: a launch pickles what torch scripts touch, stops only jobs that can never end,
loses no rank's work, and forgets each job exactly.

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
