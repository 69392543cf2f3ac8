"""A built model's quantized Linears as shapes: the selection convert uses, folded per block."""

from __future__ import annotations

import pytest
import torch

from fp8lab.cost import linear_shapes, other_parameters, repeated_block


class Block(torch.nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, f)
        self.down = torch.nn.Linear(f, d, bias=False)


class Net(torch.nn.Module):
    def __init__(self, d: int = 16, f: int = 48, layers: int = 3, vocab: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, f) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)


def test_linear_shapes_follow_convert_selection():
    net = Net()
    lins = linear_shapes(net)
    # the head (the last Linear) stays high precision, as convert leaves it
    assert lins == [(f"blocks.{k}.{n}", i, o) for k in range(3)
                    for n, i, o in (("up", 16, 48), ("down", 48, 16))]  # fmt: skip
    # embedding 32x16, 3 up biases of 48, the head 32x16
    assert other_parameters(net, lins) == 32 * 16 + 3 * 48 + 32 * 16
    block, layers = repeated_block(lins)
    assert layers == 3 and block == [("blocks.*.up", 16, 48), ("blocks.*.down", 48, 16)]


def test_repeated_block_refuses_unequal_blocks():
    lins = [("blocks.0.up", 16, 48), ("blocks.1.up", 16, 64)]
    assert repeated_block(lins) == (lins, 1)
    lins = [("blocks.0.up", 16, 48), ("blocks.1.up", 16, 48), ("extra", 4, 4)]
    assert repeated_block(lins) == (lins, 1)
    assert repeated_block([("a", 1, 2)]) == ([("a", 1, 2)], 1)


def test_no_linear_is_an_error():
    with pytest.raises(ValueError, match="no Linear"):
        linear_shapes(torch.nn.Sequential(torch.nn.Embedding(4, 4)))
