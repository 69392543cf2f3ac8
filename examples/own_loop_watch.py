"""Your own training loop with the statistics hooks: ``fp8lab.watch`` records, every N steps, the
amax, scale, underflow, saturation and SQNR of every GEMM operand of the converted layers into a
JSONL file, without changing a bit of the training. Draw it with
``fp8lab observe-report FILE --out heatmap.png``.

    .venv/bin/python examples/own_loop_watch.py [--tiny] [--out runs/own-loop-watch.jsonl]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from own_loop import batches, make_model

import fp8lab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model and a few steps")
    ap.add_argument("--recipe", default="te-delayed")
    ap.add_argument("--out", default="runs/own-loop-watch.jsonl")
    args = ap.parse_args(argv)
    d, steps, every = (32, 3, 1) if args.tiny else (128, 300, 50)
    torch.manual_seed(0)
    model = make_model(256, d)
    fp8lab.nn.convert(model, args.recipe)
    opt = fp8lab.optim.AdamW.from_recipe(model.parameters(), args.recipe, lr=3e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    text = b"To be, or not to be, that is the question: " * 200
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with fp8lab.watch(model, every=every, out=args.out) as w:
        for x, y in batches(text, steps, batch=8, seq=32):
            loss = loss_fn(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
    print(f"{len(w.records)} records in {args.out}; worst underflow:")
    r = max(w.records, key=lambda r: r["underflow_pct"] or 0.0)
    print(
        f"  layer {r['layer']} {r['gemm']} {r['role']}: {r['underflow_pct']:.2f} % at step {r['step']}"
    )
    return len(w.records)


if __name__ == "__main__":
    main()
