"""The course's model: the small CNN of PyTorch's "Writing Distributed Applications" tutorial.

It is the network that tutorial trains on MNIST with hand-written gradient averaging, written
the modern way (``super().__init__()``, ``nn.Dropout2d``, ``log_softmax(dim=1)``). It is small
on purpose, 21,840 parameters, so that a whole training run fits in a notebook cell on a laptop
CPU and every rank's copy can be compared number by number.

    >>> import torch
    >>> from gradsync_tutorial.model import Net
    >>> net = Net()
    >>> sum(p.numel() for p in net.parameters())
    21840
    >>> net(torch.zeros(4, 1, 28, 28)).shape        # a batch of four 28x28 grey images
    torch.Size([4, 10])

Introduced in ``notebooks/01_single_device_baseline.ipynb``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Net"]


class Net(nn.Module):
    """Two conv layers, two linear layers; input ``(B, 1, 28, 28)``, output ``(B, 10)``.

    The output is a row of log-probabilities per image (``log_softmax``), so train it with
    ``F.nll_loss(net(x), y)``, which is the same as ``F.cross_entropy`` on raw scores.

    The layers and their parameter counts (weights + biases)::

        conv1  1 -> 10 channels, 5x5 kernel      10*1*5*5 + 10 =    260
        conv2 10 -> 20 channels, 5x5 kernel    20*10*5*5 + 20 =  5,020
        fc1   320 -> 50                           320*50 + 50 = 16,050
        fc2    50 -> 10                            50*10 + 10 =    510
                                                         total = 21,840

    The dropout layers have no parameters, but they make ``net.train()`` and ``net.eval()``
    behave differently, and they draw random numbers: each rank must seed its generator the
    same way if the replicas are to stay equal (see notebook 02).

    Example:
        >>> import torch
        >>> from gradsync_tutorial.model import Net
        >>> _ = torch.manual_seed(0)
        >>> log_probs = Net().eval()(torch.randn(2, 1, 28, 28))
        >>> log_probs.shape
        torch.Size([2, 10])
        >>> torch.allclose(log_probs.exp().sum(dim=1), torch.ones(2))  # rows are distributions
        True

    Introduced in ``notebooks/01_single_device_baseline.ipynb``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()  # drops whole channels (p=0.5) while training
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes for a batch of B images:          (B,  1, 28, 28)
        x = F.relu(F.max_pool2d(self.conv1(x), 2))  # conv 5x5 -> 24x24, pool -> (B, 10, 12, 12)
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # 8x8, pool -> (B, 20, 4, 4)
        x = x.view(-1, 320)  # flatten: 20 * 4 * 4 = 320 features per image
        x = F.relu(self.fc1(x))  # (B, 50)
        x = F.dropout(x, training=self.training)  # p=0.5, only in train() mode
        x = self.fc2(x)  # (B, 10): one score per class
        return F.log_softmax(x, dim=1)
