"""Quick start 2: find where an FP8 run loses precision (the library side of ``fp8lab.watch``).

Converts a small MLP to te-delayed, trains it in a plain PyTorch loop under ``fp8lab.watch``, one
of whose layers gets inputs with a few huge channels (the classic cause of FP8 drift: the per-tensor
scale follows the outliers and the rest of the tensor underflows), then prints the forward operands with
the lowest SQNR: the planted layer's input comes first. The records also go to a JSONL file that
``fp8lab observe-report FILE --out heatmap.png`` draws. ``--tiny``: fewer steps and a smaller model.

    .venv/bin/python examples/quickstart_drift.py [--tiny] [--out runs/quickstart-drift.jsonl]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fp8lab


class OutlierInput(torch.nn.Module):
    """Multiplies a few input channels by 1e4 (a planted fault)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(x.shape[-1])
        scale[:4] = 1e4
        return x * scale


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model and a few steps")
    ap.add_argument("--out", default="runs/quickstart-drift.jsonl")
    args = ap.parse_args(argv)
    d, steps = (32, 4) if args.tiny else (256, 100)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(d, d),  # "0"
        torch.nn.GELU(),
        OutlierInput(),
        torch.nn.Linear(d, d),  # "3": its input carries the outlier channels
        torch.nn.GELU(),
        torch.nn.Linear(d, d),  # "5"
    )
    fp8lab.nn.convert(model, "te-delayed")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with fp8lab.watch(model, every=max(1, steps // 4), out=args.out) as w:
        for _ in range(steps):
            x = torch.randn(64, d)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    # the forward GEMMs' operands on the last sampled step, lowest SQNR first
    last = max(r["step"] for r in w.records)
    fprop = [r for r in w.records if r["step"] == last and r["gemm"] == "fprop"]
    worst = sorted(fprop, key=lambda r: r["sqnr_db"] if r["sqnr_db"] is not None else 1e9)[:3]
    print(f"{'layer':<6} {'gemm':<6} {'role':<12} {'SQNR dB':>8} {'underflow %':>12}")
    for r in worst:
        print(
            f"{r['layer']:<6} {r['gemm']:<6} {r['role']:<12} {r['sqnr_db']:>8.1f}"
            f" {r['underflow_pct']:>12.2f}"
        )
    return worst


if __name__ == "__main__":
    main()
