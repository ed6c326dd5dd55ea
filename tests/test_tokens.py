"""gst.tokens: notebook 07's variable-length lines, padded and packed."""

import pytest
import torch
import torch.nn.functional as F

from gradsync_tutorial import tokens


def test_pad_shifts_each_line_and_pads_with_ignore_index():
    inputs, targets = tokens.pad(["abc", "a", "ab"])
    assert inputs.shape == targets.shape == (3, 2) and inputs.dtype == targets.dtype == torch.int64
    assert tokens.decode(inputs[0]) == "ab" and tokens.decode(targets[0]) == "bc"
    assert targets[1].tolist() == [tokens.IGNORE_INDEX] * 2  # one character: nothing to predict
    assert inputs[2].tolist() == [tokens.encode("a").item(), tokens.PAD]
    assert (targets != tokens.IGNORE_INDEX).sum(dim=1).tolist() == [2, 0, 1]  # L - 1 each


def test_padding_is_skipped_by_cross_entropy():
    inputs, targets = tokens.pad(["each rank", "ok"])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*inputs.shape, tokens.VOCAB_SIZE, generator=g)
    valid = targets != tokens.IGNORE_INDEX
    mean = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # ignore_index=-100
    assert torch.allclose(mean, F.cross_entropy(logits[valid], targets[valid]))


def test_every_line_encodes_and_the_lengths_differ():
    assert tokens.VOCAB_SIZE == len(tokens.VOCAB) + 1 and tokens.PAD == 0
    for line in tokens.LINES:
        ids = tokens.encode(line)
        assert ids.min() >= 1 and ids.max() < tokens.VOCAB_SIZE and tokens.decode(ids) == line
    lengths = {len(line) for line in tokens.LINES}
    assert min(lengths) >= 2 and max(lengths) >= 10 * min(lengths)  # tokens 1 to 60


def test_pack_gives_pieces_of_one_length():
    pieces = tokens.pack(100, 24)  # more text than LINES holds: it repeats
    assert len(pieces) == 100 and {len(p) for p in pieces} == {25}
    _, targets = tokens.pad(pieces)
    assert (targets != tokens.IGNORE_INDEX).sum(dim=1).tolist() == [24] * 100  # no padding


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match=r"characters not in tokens\.VOCAB: \['Z'\]"):
        tokens.encode("Zero")
    with pytest.raises(ValueError, match="at least one line"):
        tokens.pad([])
