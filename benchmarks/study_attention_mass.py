"""Attention mass lost per query when the softmax output P is cast to E4M3 (docs/attention.md).

One command: ``python benchmarks/study_attention_mass.py [--seq 8192] [--queries 16]``. Each
scenario builds attention rows over ``--seq`` keys whose logits it sets directly (``q = sqrt(d)
e_0``, so ``q·k / sqrt(d) = k[..., 0]``), runs `fp8lab.nn.DotProductAttention` under
``te-current`` with ``attention = true`` and reads the S quantization point through
`fp8lab.nn.on_operand` (the fp32 tensor the kernel cast and what it became):

- **FA offset 0**: ``[dpa] path = "fa"``, ``p_prescale_log2 = 0``: ``exp(logits - rowmax)`` cast
  to E4M3 as is (the flaw flashinfer PR 5020 fixes); mass lost = ``1 - sum(P8) / rowsum``, the
  row sum exact in fp32 as the kernels keep it;
- **FA offset 8**: the same with FlashAttention-3's ``2**8`` pre-scale;
- **TE scaled S**: TE's path, ``P = exp(logits - logsumexp)`` quantized with the S quantizer's
  delayed scale (history 1, most_recent: TE's default for current scaling), on the second of two
  identical calls so the scale is ``448 / amax(P)`` of the first; mass lost = ``1 - sum(S8 / scale)``.

Scenarios (long, diffuse rows): one hot key at logit ``gap`` above ``seq - 1`` cold keys (gap 6,
8, 10: the cold keys hold 1 - 1/(1 + (seq-1) e^-gap) of the mass), and logits drawn from
N(0, sigma^2) per key (sigma 1, 2, 3; no hot key). Prints a Markdown table of the mean and the
largest loss over the queries, and the time it took.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from fp8lab.nn import DotProductAttention, on_operand
from fp8lab.recipe import DPAConfig, get_recipe

D = 64


def _rows(seq: int, queries: int, kind: str, value: float, gen: torch.Generator):
    """q [1, 1, queries, D], k, v [1, 1, seq, D] giving the scenario's logits on every query."""
    q = torch.zeros(1, 1, queries, D)
    q[..., 0] = math.sqrt(D)
    k = torch.zeros(1, 1, seq, D)
    if kind == "hot":
        k[..., 0, 0] = value  # one key `value` above the rest (logit 0)
    else:
        k[..., 0] = torch.randn(seq, generator=gen) * value
    # a small per-query tilt so the rows are not all alike
    q[..., 1] = torch.randn(queries, generator=gen) * math.sqrt(D) * 0.1
    k[..., 1] = torch.randn(seq, generator=gen) * 0.1
    v = torch.randn(1, 1, seq, D, generator=gen)
    return q, k, v


def _mass_lost(rec, q, k, v, calls: int) -> torch.Tensor:
    """Per query: the share of the row's softmax mass the S cast dropped (last of ``calls``)."""
    seen = {}

    def keep(layer, gemm, role, src, used):
        if role == "S":
            seen["S"] = (src, used)

    m = DotProductAttention(rec)
    handle = on_operand(keep)
    try:
        for _ in range(calls):  # grad mode on: a training forward updates the delayed scales
            m(q, k, v)
    finally:
        handle.remove()
    src, qt = seen["S"]
    kept = qt.dequantize().double()
    if rec.dpa.path == "fa":  # unnormalised exp(logits - rowmax), exact fp32 row sums
        return (1 - kept.sum(-1) / src.double().sum(-1)).reshape(-1)
    return (1 - kept.sum(-1)).reshape(-1)  # P = exp(logits - logsumexp) sums to 1


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="No --torch-device: the attention mass of a row is fp8lab's own arithmetic, "
        "the same bits on every device; it runs on the CPU.",
    )
    ap.add_argument("--seq", type=int, default=8192, help="keys per row (default 8192)")
    ap.add_argument("--queries", type=int, default=16, help="query rows (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    base = get_recipe("te-current")
    paths = {
        "FA offset 0": (
            base.replace(attention=True, dpa=DPAConfig(path="fa", p_prescale_log2=0)),
            1,
        ),
        "FA offset 8": (base.replace(attention=True, dpa=DPAConfig(path="fa")), 1),
        "TE scaled S": (base.replace(attention=True), 2),
    }
    scenarios = [("hot", g) for g in (6.0, 8.0, 10.0)] + [("gauss", s) for s in (1.0, 2.0, 3.0)]
    print(f"attention mass lost per query, {args.seq} keys, {args.queries} queries "
          "(mean / largest |.| over the queries, % of the row's mass; negative: mass gained by rounding up)\n")  # fmt: skip
    print("| rows | " + " | ".join(paths) + " |")
    print("|---|" + "---:|" * len(paths))
    for kind, value in scenarios:
        gen = torch.Generator().manual_seed(args.seed)
        q, k, v = _rows(args.seq, args.queries, kind, value, gen)
        cells = []
        for rec, calls in paths.values():
            lost = _mass_lost(rec, q, k, v, calls) * 100
            cells.append(f"{float(lost.mean()):.3g} / {float(lost.abs().max()):.3g}")
        what = f"1 hot key, rest {value:g} below" if kind == "hot" else f"N(0, {value:g}^2) logits"
        print(f"| {what} | " + " | ".join(cells) + " |")
    print(f"\ntime: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
