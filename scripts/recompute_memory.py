"""Saved-activation memory of a converted stack with and without activation checkpointing.

A stack of residual blocks (Linear d -> 4d, GELU, Linear 4d -> d), converted under each recipe
with ``default_exclude=False``, runs one forward and backward of ``tokens`` x ``d`` inputs; a
``torch.autograd.graph.saved_tensors_hooks`` around the forward counts the bytes of the distinct
storages saved for the backward (parameters left out): with no checkpointing, with ``torch.utils.checkpoint`` per
block, non-reentrant and reentrant. ``docs/nn.md`` quotes a run; ``tests/nn/test_recompute.py``
uses the same stack and counter.

    python scripts/recompute_memory.py
    python scripts/recompute_memory.py --d 512 --tokens 1024 --blocks 4 --recipes te-delayed
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from fp8lab.nn import convert

MODES = (None, "non-reentrant", "reentrant")


class Block(torch.nn.Module):
    """``x + down(gelu(up(x)))``, ``up``: d -> ``width`` d."""

    def __init__(self, d: int, width: int = 2) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, width * d)
        self.down = torch.nn.Linear(width * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(torch.nn.Module):
    """``n`` blocks; ``mode``: how each block is checkpointed (None: not at all);
    ``ckpt``: further keyword arguments of ``torch.utils.checkpoint.checkpoint``."""

    def __init__(
        self, d: int, n: int = 2, mode: str | None = None, width: int = 2, **ckpt: Any
    ) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, width) for _ in range(n))
        self.mode = mode
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.mode is None:
                x = b(x)
            else:
                x = checkpoint(b, x, use_reentrant=self.mode == "reentrant", **self.ckpt)
        return x


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """While active, counts the bytes of the distinct storages saved for the backward, leaving
    out parameters (saved, not copied: what remains is activation memory, the quantized copies
    of the weights included)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, torch.nn.Parameter):
                s = t.untyped_storage()
                self.storages[s.data_ptr()] = s.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def saved_bytes(
    recipe: str, mode: str | None, d: int, tokens: int, n: int = 2, width: int = 2
) -> int:
    """Bytes a converted `Stack` keeps for its backward over one forward + backward."""
    torch.manual_seed(0)
    net = convert(Stack(d, n, mode, width), recipe, default_exclude=False)
    x = torch.randn(tokens, d, requires_grad=True)
    hooks = SavedBytes()
    with hooks:
        y = net(x)
    y.square().mean().backward()
    return hooks.nbytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--recipes", nargs="+", default=["fp32", "te-delayed", "deepseek-v3", "mxfp8"])
    args = ap.parse_args(argv)
    print(
        f"{args.blocks} blocks, d={args.d}, up {args.width}x, {args.tokens} tokens: "
        "MiB saved for the backward"
    )
    print("| recipe | no checkpoint | non-reentrant | reentrant |")
    print("|---|---|---|---|")
    for r in args.recipes:
        row = [
            saved_bytes(r, m, args.d, args.tokens, args.blocks, args.width) / 2**20 for m in MODES
        ]
        print(f"| `{r}` | " + " | ".join(f"{v:.2f}" for v in row) + " |")


if __name__ == "__main__":
    main()
