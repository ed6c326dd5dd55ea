"""Sampled completions with rewards, in memory: the data of notebook 14 (reinforcement learning).

A policy-gradient trainer (GRPO, DAPO, Dr. GRPO) samples a *group* of completions of each
prompt, scores each with a reward, and trains on them. Averaging does not care how they were
sampled, so here they are drawn at random: each is a prompt of :data:`PROMPT_LEN` tokens and a
completion of 1 to :data:`MAX_LEN` tokens. Its reward is the share of even token ids in the
completion, a task the notebook's small policy can learn. :func:`pad` turns completions into a
micro-batch: inputs, targets, and a mask of the completion's tokens, the only ones trained.
:func:`per_token_loss` is the policy loss of every position of a micro-batch: the notebook and
its exercise weigh it, each mode its own way.

    >>> from gradsync_tutorial import rollouts
    >>> done = rollouts.sample(prompts=2, group=3, seed=0)
    >>> len(done), [c.prompt for c in done]
    (6, [0, 0, 0, 1, 1, 1])
    >>> batch = rollouts.pad(done[:2], advantages=[1.0, -1.0])
    >>> batch["mask"].sum(dim=1).tolist() == [len(c.completion) for c in done[:2]]
    True
    >>> sorted(batch)
    ['advantages', 'inputs', 'mask', 'targets']
    >>> policy = torch.nn.Sequential(torch.nn.Embedding(rollouts.VOCAB_SIZE, 4),
    ...                              torch.nn.Linear(4, rollouts.VOCAB_SIZE)).double()
    >>> rollouts.per_token_loss(policy, batch).shape == batch["mask"].shape
    True

Introduced in ``notebooks/14_rl_losses.ipynb``; its exercise draws its data here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MAX_LEN", "PAD", "PROMPT_LEN", "VOCAB_SIZE", "Completion", "pad", "per_token_loss",
           "sample"]

#: Token ids 0 to VOCAB_SIZE - 1; id 0 is :data:`PAD`, never sampled.
VOCAB_SIZE = 12
#: The input id of padding (its mask is 0, so it is never trained).
PAD = 0
#: Tokens of every prompt.
PROMPT_LEN = 2
#: The longest completion: a trainer's ``max_completion_length`` (Dr. GRPO divides by it).
MAX_LEN = 12


@dataclass(frozen=True)
class Completion:
    """One sampled completion of prompt number ``prompt``, and its reward."""

    prompt: int
    prompt_ids: torch.Tensor  # (PROMPT_LEN,) int64
    completion: torch.Tensor  # (1 to MAX_LEN,) int64
    reward: float


def sample(prompts: int, group: int, seed: int, max_len: int = MAX_LEN) -> list[Completion]:
    """``group`` completions of each of ``prompts`` prompts, prompt by prompt: completions of
    1 to ``max_len`` tokens, each rewarded with the share of its tokens that are even."""
    if prompts < 1 or group < 1 or not 1 <= max_len <= MAX_LEN:
        raise ValueError(f"sample() needs prompts >= 1, group >= 1 and 1 <= max_len <= {MAX_LEN}; "
                         f"got prompts={prompts}, group={group}, max_len={max_len}")
    g = torch.Generator().manual_seed(seed)
    done = []
    for p in range(prompts):
        prompt_ids = torch.randint(1, VOCAB_SIZE, (PROMPT_LEN,), generator=g)
        for _ in range(group):
            length = int(torch.randint(1, max_len + 1, (), generator=g))
            completion = torch.randint(1, VOCAB_SIZE, (length,), generator=g)
            reward = (completion % 2 == 0).double().mean().item()
            done.append(Completion(p, prompt_ids, completion, reward))
    return done


def pad(completions: Sequence[Completion], advantages: Sequence[float] | torch.Tensor,
        dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """A micro-batch of ``completions``: ``inputs`` and ``targets`` (S, W) int64, next-token
    prediction on prompt + completion, padded to the longest; ``mask`` (S, W) ``dtype``, 1 where
    the target is a completion token; ``advantages`` (S,) ``dtype``, one per completion."""
    if not completions:
        raise ValueError("pad() needs at least one completion")
    advantages = torch.as_tensor(advantages, dtype=dtype)
    if advantages.shape != (len(completions),):
        raise ValueError(f"pad() needs one advantage per completion: {len(completions)} "
                         f"completions, advantages of shape {tuple(advantages.shape)}")
    width = PROMPT_LEN + max(len(c.completion) for c in completions) - 1
    inputs = torch.full((len(completions), width), PAD, dtype=torch.int64)
    targets = torch.full_like(inputs, PAD)
    mask = torch.zeros(len(completions), width, dtype=dtype)
    for row, c in enumerate(completions):
        ids = torch.cat([c.prompt_ids, c.completion])
        inputs[row, : len(ids) - 1] = ids[:-1]
        targets[row, : len(ids) - 1] = ids[1:]
        mask[row, PROMPT_LEN - 1: len(ids) - 1] = 1  # the targets that are completion tokens
    return {"inputs": inputs, "targets": targets, "mask": mask, "advantages": advantages}


def per_token_loss(policy: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The policy loss of every position, (completions, positions): −ratio × advantage, where
    ratio = π / π_old of the target token. ``batch["mask"]`` says which positions count."""
    logits = policy(batch["inputs"])  # (completions, positions, VOCAB_SIZE)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch["targets"].unsqueeze(-1))
    logp = logp.squeeze(-1)  # log π of each target token
    ratio = torch.exp(logp - logp.detach())  # π / π_old: 1 here, with the gradient of log π
    return -ratio * batch["advantages"].unsqueeze(-1)
