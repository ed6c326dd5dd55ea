"""The course's CNN: size, output shape, and what the output means."""

import torch
import torch.nn.functional as F

from gradsync_tutorial.model import Net


def test_parameter_count_matches_the_tutorial():
    net = Net()
    assert sum(p.numel() for p in net.parameters()) == 21_840
    shapes = {name: tuple(p.shape) for name, p in net.named_parameters()}
    assert shapes == {
        "conv1.weight": (10, 1, 5, 5), "conv1.bias": (10,),
        "conv2.weight": (20, 10, 5, 5), "conv2.bias": (20,),
        "fc1.weight": (50, 320), "fc1.bias": (50,),
        "fc2.weight": (10, 50), "fc2.bias": (10,),
    }


def test_output_is_log_probabilities_per_image():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 1, 28, 28)
    for mode in (net.train, net.eval):
        mode()
        out = net(x)
        assert out.shape == (5, 10)
        assert out.dtype == torch.float32
        assert (out <= 0).all()
        torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(5))


def test_eval_is_deterministic_and_train_uses_dropout():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(8, 1, 28, 28)
    net.eval()
    torch.testing.assert_close(net(x), net(x), rtol=0, atol=0)
    net.train()
    torch.manual_seed(1)
    a = net(x)
    torch.manual_seed(2)
    b = net(x)
    assert not torch.equal(a, b)  # different dropout masks


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    net = Net()
    loss = F.nll_loss(net(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
