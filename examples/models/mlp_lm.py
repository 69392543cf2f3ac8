"""A small byte-level MLP language model, a "user's model" for ``fp8lab`` (``--model
examples/models/mlp_lm.py:build``).

Each position sees its own byte and the previous one (two embeddings, summed), then
``N_BLOCKS`` pre-norm residual MLP blocks (``blocks.i.up`` d -> 2d, GELU, ``blocks.i.down``
2d -> d) and a linear head: 2 x N_BLOCKS + 1 Linear layers, 9 by default. Used by the debugger's
acceptance runs (docs/debug.md, "A user's model with one planted layer") with a few huge input
channels planted on one of its layers through ``[inject]``.
"""

from __future__ import annotations

import torch
from torch import nn

D_MODEL = 64
N_BLOCKS = 4
VOCAB = 256


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MlpLM(nn.Module):
    def __init__(self, d: int = D_MODEL, n_blocks: int = N_BLOCKS, vocab: int = VOCAB) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.prev = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        prev = torch.nn.functional.pad(idx, (1, 0))[:, :-1]
        x = self.emb(idx) + self.prev(prev)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def build() -> nn.Module:
    return MlpLM()
