"""A tiny causal LM for the framework tests: ``forward(input_ids, labels)`` returns a dict with
``loss`` and ``logits`` (as a transformers model does), optionally a NaN loss on one call."""

from __future__ import annotations

import torch

import fp8lab

VOCAB, SEQ, D = 32, 16, 32


class _GradTimes(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` (a corrupted gradient)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class TinyLM(torch.nn.Module):
    def __init__(self, nan_at: int | None = None, spike_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.up = torch.nn.Linear(D, 4 * D)
        self.down = torch.nn.Linear(4 * D, D)
        self.head = torch.nn.Linear(D, VOCAB)
        self.nan_at, self.spike_at, self.calls = nan_at, spike_at, 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        h = self.emb(input_ids)
        if self.training and self.calls == self.spike_at:  # a 2^40 gradient spike, loss unchanged
            h = _GradTimes.apply(h, 2.0**40)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            if self.training and torch.is_grad_enabled():
                if self.calls == self.nan_at:  # a fault planted in one training forward
                    loss = loss * float("nan")
                self.calls += 1
            out["loss"] = loss
        return out


def converted(
    nan_at: int | None = None, recipe: str = "te-delayed", spike_at: int | None = None
) -> TinyLM:
    return fp8lab.nn.convert(TinyLM(nan_at, spike_at), recipe, default_exclude=False)


def samples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` training samples: a token sequence and its next tokens (a learnable pattern)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        ids = (start + torch.arange(SEQ + 1) * 3) % VOCAB
        out.append({"input_ids": ids[:-1], "labels": ids[1:]})
    return out
