"""gst.rollouts: notebook 14's completions, padded into micro-batches, and their policy loss."""

import pytest
import torch
from torch import nn

from gradsync_tutorial import rollouts


def test_sample_draws_groups_of_completions_of_one_to_max_len_tokens_reproducibly():
    done = rollouts.sample(prompts=3, group=4, seed=7)
    assert [c.prompt for c in done] == [p for p in range(3) for _ in range(4)]
    assert all(1 <= len(c.completion) <= rollouts.MAX_LEN for c in done)
    assert all(torch.equal(c.prompt_ids, done[4 * c.prompt].prompt_ids) for c in done)
    assert all(c.reward == (c.completion % 2 == 0).double().mean().item() for c in done)
    assert all((c.completion != rollouts.PAD).all() for c in done)  # padding is never sampled
    again = rollouts.sample(prompts=3, group=4, seed=7)
    assert all(torch.equal(a.completion, b.completion) for a, b in zip(done, again, strict=True))
    assert len({len(c.completion) for c in done}) > 1  # lengths differ


def test_pad_masks_the_completion_tokens_only():
    done = rollouts.sample(prompts=1, group=3, seed=0)
    batch = rollouts.pad(done, [0.5, -1.0, 2.0])
    width = rollouts.PROMPT_LEN + max(len(c.completion) for c in done) - 1
    assert batch["inputs"].shape == batch["targets"].shape == batch["mask"].shape == (3, width)
    assert batch["mask"].dtype == batch["advantages"].dtype == torch.float64
    for row, c in enumerate(done):
        ids = torch.cat([c.prompt_ids, c.completion])
        valid = batch["mask"][row].bool()
        assert torch.equal(batch["targets"][row][valid], c.completion)  # what is trained
        assert torch.equal(batch["inputs"][row, : len(ids) - 1], ids[:-1])
    assert batch["advantages"].tolist() == [0.5, -1.0, 2.0]


def test_bad_input_says_what_to_pass():
    done = rollouts.sample(prompts=1, group=2, seed=0)
    with pytest.raises(ValueError, match="one advantage per completion: 2 completions"):
        rollouts.pad(done, [1.0])
    with pytest.raises(ValueError, match="at least one completion"):
        rollouts.pad([], [])
    with pytest.raises(ValueError, match="max_len <= 12"):
        rollouts.sample(prompts=1, group=1, seed=0, max_len=13)


def test_the_policy_loss_has_the_gradient_of_minus_advantage_times_log_pi():
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Embedding(rollouts.VOCAB_SIZE, 4),
                           nn.Linear(4, rollouts.VOCAB_SIZE)).double()
    batch = rollouts.pad(rollouts.sample(prompts=2, group=2, seed=1), [1.0, -0.5, 0.25, 2.0])
    per_token = rollouts.per_token_loss(policy, batch)
    assert per_token.shape == batch["mask"].shape
    assert torch.allclose(per_token, -batch["advantages"][:, None].expand_as(per_token))  # ratio 1
    g = torch.autograd.grad((per_token * batch["mask"]).sum(), list(policy.parameters()))
    logp = torch.log_softmax(policy(batch["inputs"]), -1).gather(
        -1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    expected = torch.autograd.grad((-batch["advantages"][:, None] * logp * batch["mask"]).sum(),
                                   list(policy.parameters()))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(g, expected, strict=True))
