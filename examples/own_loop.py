"""Your own training loop under an FP8 recipe: convert the model's ``nn.Linear`` layers in place,
take the recipe's optimizer, keep the loop. Trains the same tiny character model from the same
weights on the same batches under bf16 and te-delayed and prints both losses.

    .venv/bin/python examples/own_loop.py [--tiny] [--recipes bf16,te-delayed]
"""

from __future__ import annotations

import argparse
import copy

import torch

import fp8lab


def make_model(vocab: int, d: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab, d),
        torch.nn.Linear(d, 4 * d),
        torch.nn.GELU(),
        torch.nn.Linear(4 * d, d),
        torch.nn.Linear(d, vocab),
    )


def batches(text: bytes, n: int, batch: int, seq: int, seed: int = 0):
    """``n`` batches of (input, next byte) from ``text``, the same for every recipe."""
    g = torch.Generator().manual_seed(seed)
    data = torch.tensor(list(text), dtype=torch.long)
    for _ in range(n):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        yield x, y


def train(model: torch.nn.Module, recipe: str, data: list, lr: float) -> float:
    fp8lab.nn.convert(model, recipe)  # nn.Linear -> fp8lab.nn.Linear, in place
    opt = fp8lab.optim.AdamW.from_recipe(model.parameters(), recipe, lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in data:  # the loop itself is plain PyTorch
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model and a few steps")
    ap.add_argument("--recipes", default="bf16,te-delayed")
    args = ap.parse_args(argv)
    d, steps = (32, 3) if args.tiny else (128, 300)
    text = b"To be, or not to be, that is the question: " * 200
    data = list(batches(text, steps, batch=8, seq=32))
    torch.manual_seed(0)
    initial = make_model(256, d)
    losses = {}
    for recipe in args.recipes.split(","):
        losses[recipe] = train(copy.deepcopy(initial), recipe, data, lr=3e-3)
        print(f"{recipe:<12} final train loss {losses[recipe]:.4f}")
    return losses


if __name__ == "__main__":
    main()
