"""The toy mixture-of-experts layer of notebook 12: a dense layer, a top-1 router, experts.

One copy, read by the notebook (which shows its source) and by notebook 12's exercise. Its
``forward`` is the whole layer in one process, every expert here: the reference that the
expert-parallel version, one expert per rank, must match.

    >>> import torch
    >>> from gradsync_tutorial.moe import ToyMoE
    >>> layer = ToyMoE(hidden=4, experts=2, seed=0).double()
    >>> x = torch.randn(6, 4, dtype=torch.float64)
    >>> h, choice, gate = layer.route(x)
    >>> choice.shape, gate.shape, layer(x).shape      # an expert and a gate for each token
    (torch.Size([6]), torch.Size([6, 1]), torch.Size([6, 4]))

Introduced in ``notebooks/12_expert_gradients.ipynb``.
"""

from __future__ import annotations

import torch
from torch import nn


class ToyMoE(nn.Module):
    """A dense layer, a top-1 router and ``experts`` experts: the whole layer, in one process.

    The router picks each token's expert by its largest logit. The expert's output is
    multiplied by that logit's softmax probability, the *gate*, so that the router gets a
    gradient. ``seed`` gives the same initial weights wherever the layer is built.
    """

    def __init__(self, hidden: int, experts: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)  # the same initial weights wherever it is built
        self.dense = nn.Linear(hidden, hidden)
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        with torch.no_grad():  # route by the sign of the first feature: a rough share each
            self.router.weight[:, 0] += torch.linspace(3.0, -3.0, experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dense features, each token's expert, and its gate."""
        h = torch.tanh(self.dense(x))
        logits = self.router(h)
        choice = logits.argmax(dim=-1)  # top-1: each token's expert
        gate = logits.softmax(dim=-1).gather(1, choice[:, None])  # the router's gradient path
        return h, choice, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, choice, gate = self.route(x)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            y[choice == e] = expert(h[choice == e])  # expert e sees only its own tokens
        return gate * y
