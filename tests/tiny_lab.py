"""A tiny training-lab configuration (TOML) for the CLI and torchrun tests.

Importable from any test as ``from tiny_lab import tiny_lab_toml``: ``tests/conftest.py`` puts
``tests/`` on the import path (pytest's default ``prepend`` import mode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# one layer of width 32: seconds per run, still every GEMM kind and role of a GPT block
TINY_MODEL = {"block_size": 16, "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64}
TINY_TRAIN = {"warmup_steps": 1, "eval_batches": 1, "stats_every": 0}

#: a user's own model file: embedding, one hidden Linear, head (factory ``tiny``)
TINY_USER_MODEL = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 256)

    def forward(self, idx):
        return self.head(torch.relu(self.fc(self.emb(idx))))


def tiny():
    return Tiny()
"""


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)  # numbers and strings are valid TOML as JSON writes them


def tiny_lab_toml(text: Path | str, model: dict[str, Any] | None = None, **train: Any) -> str:
    """A lab config (TOML) training the tiny GPT on the file ``text``: ``model`` overrides the
    tiny model's keys, ``train`` the ``[train]`` keys (on top of TINY_TRAIN)."""
    sections = {
        "model": {**TINY_MODEL, **(model or {})},
        "data": {"paths": [str(text)], "split_chunk": 256},
        "train": {**TINY_TRAIN, **train},
    }
    lines = []
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"
