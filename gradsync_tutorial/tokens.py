"""Variable-length sequences for a character-level task, in memory: the data of notebook 07.

Each line of :data:`LINES` is one sequence. The task is next-character prediction: the inputs
are a line's characters but the last, the targets its characters but the first. Lines have
different lengths, so a batch is padded: :func:`pad` fills the inputs with :data:`PAD` and the
targets with :data:`IGNORE_INDEX`, which ``F.cross_entropy(..., ignore_index=IGNORE_INDEX)``
skips. A batch then holds fewer *valid* tokens than positions, and two batches of as many lines
hold different numbers of them: the counts that notebook 07 is about.

    >>> from gradsync_tutorial import tokens
    >>> inputs, targets = tokens.pad(["abc", "ab"])
    >>> [tokens.decode(row) for row in inputs], [tokens.decode(row) for row in targets]
    (['ab', 'a'], ['bc', 'b'])
    >>> inputs[1].tolist()[1] == tokens.PAD, targets[1].tolist()[1]   # "ab" is one token shorter
    (True, -100)
    >>> int((targets != tokens.IGNORE_INDEX).sum())   # the valid tokens: 2 + 1
    3

:func:`pack` cuts the same text into pieces of one length instead (no padding, every piece the
same number of tokens), the case where a per-rank mean is right.

Introduced in ``notebooks/07_which_mean.ipynb``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["IGNORE_INDEX", "LINES", "PAD", "VOCAB", "VOCAB_SIZE", "decode", "encode", "pack",
           "pad"]

#: The sequences: short sentences of very different lengths (2 to 61 characters).
LINES: tuple[str, ...] = (
    "each rank holds a full copy of the model",
    "sum, then divide",
    "the mean over what?",
    "a token is one character here",
    "padding is not a token",
    "ranks see different batches",
    "every rank calls all_reduce with its own tensor",
    "ok",
    "count the valid tokens first",
    "one process on the whole batch is the reference",
    "divide by the global count",
    "ddp divides by the world size",
    "so multiply by it",
    "micro-batches add their gradients",
    "a short line weighs as much as a long one in a mean of means",
    "no_sync skips the all-reduce",
    "the last micro-batch syncs",
    "log the loss of the whole batch",
    "yes",
    "gradients are linear in the loss",
    "a rank with few tokens",
    "and a rank with many",
    "the per-rank mean is right when the counts are equal",
    "pack the text and every piece has one length",
    "the count costs one small all_reduce",
    "each loss is a sum over tokens",
    "a step",
    "the learning rate stays the same",
    "float64 for the proofs",
    "float32 for training",
    "two ranks or four, the same step",
    "the curve looks fine while the gradient is off",
    "hi",
    "mean of the means is not the mean",
    "weights stay identical across ranks",
    "what is the denominator?",
    "the number of valid tokens in the global batch",
    "over every micro-batch and every rank",
    "tokens",
    "a long sequence of characters to predict, one after the other",
    "short",
    "the sum over ranks of local sums",
)
#: The input id of padding (targets are padded with :data:`IGNORE_INDEX`).
PAD = 0
#: The target of a position that is not a token: ``F.cross_entropy``'s default ``ignore_index``.
IGNORE_INDEX = -100
#: The characters, in the order of their ids 1, 2, ... (id 0 is :data:`PAD`).
VOCAB: str = "".join(sorted(set("".join(LINES))))
#: Ids 0 (padding) to ``len(VOCAB)``: the size of an embedding table and of the output layer.
VOCAB_SIZE = len(VOCAB) + 1

_ID = {c: i + 1 for i, c in enumerate(VOCAB)}


def encode(text: str) -> torch.Tensor:
    """The ids of ``text``'s characters (1 to ``len(VOCAB)``), a 1-D int64 tensor."""
    unknown = sorted(set(text) - set(_ID))
    if unknown:
        raise ValueError(f"characters not in tokens.VOCAB: {unknown}; use the characters of "
                         "tokens.LINES")
    return torch.tensor([_ID[c] for c in text], dtype=torch.int64)


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """The text of ``ids``, skipping padding and ignored positions."""
    return "".join(VOCAB[i - 1] for i in torch.as_tensor(ids).tolist() if i > 0)


def pad(lines: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, both ``(len(lines), longest line - 1)`` int64: next-character
    prediction on each line, inputs padded with :data:`PAD`, targets with :data:`IGNORE_INDEX`.

    A line of ``L`` characters gives ``L - 1`` valid tokens.
    """
    if not lines:
        raise ValueError("pad() needs at least one line")
    width = max(max(len(line) for line in lines) - 1, 1)
    inputs = torch.full((len(lines), width), PAD, dtype=torch.int64)
    targets = torch.full((len(lines), width), IGNORE_INDEX, dtype=torch.int64)
    for row, line in enumerate(lines):
        ids = encode(line)
        inputs[row, : len(ids) - 1] = ids[:-1]
        targets[row, : len(ids) - 1] = ids[1:]
    return inputs, targets


def pack(n: int, length: int) -> list[str]:
    """``n`` pieces of ``length + 1`` characters cut from :data:`LINES` joined by spaces (the text
    repeats if needed): every piece gives exactly ``length`` valid tokens, no padding.

        >>> [len(p) for p in pack(3, 9)]
        [10, 10, 10]
    """
    text = " ".join(LINES)
    needed = n * (length + 1)
    text = text * (needed // len(text) + 1)
    return [text[i * (length + 1): (i + 1) * (length + 1)] for i in range(n)]
