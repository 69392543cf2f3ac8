"""Quick start 3: study numerics without training (the library side of ``fp8lab snr``).

For a few FP8-family formats, the quantization error of a Gaussian tensor under per-tensor and
1x128 block scaling; then the error of one long dot product of E4M3 operands under three
accumulators (exact FP32 sums, the Hopper tensor core's bit-exact model, DeepSeek-V3's promotion
every 128 elements). ``--tiny``: smaller tensors.

    .venv/bin/python examples/quickstart_numerics.py [--tiny]
"""

from __future__ import annotations

import argparse

import torch

import fp8lab
from fp8lab import Accumulator


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small tensors")
    args = ap.parse_args(argv)
    m, k, n = (4, 512, 4) if args.tiny else (64, 8192, 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    out: dict[str, float] = {}
    print(f"{'format':<8} {'per-tensor SQNR dB':>19} {'1x128 SQNR dB':>14}")
    for fmt in ("e4m3", "e5m2", "hif8"):
        tensor = sqnr_db(x, fp8lab.fake_quant(x, fmt))
        block = sqnr_db(x, fp8lab.fake_quant(x, fmt, (1, 128)))
        out[fmt] = block
        print(f"{fmt:<8} {tensor:>19.2f} {block:>14.2f}")
    w = torch.randn(k, n, generator=g)
    qx, qw = fp8lab.quantize(x, "e4m3", (1, 128)), fp8lab.quantize(w, "e4m3", (128, 128))
    exact = qx.dequantize().double() @ qw.dequantize().double()
    print(f"\nK = {k}: {'accumulator':<32} {'SQNR dB vs exact':>16}")
    for label, acc in (
        ("fp32", Accumulator("fp32")),
        ("h100, promote every 128", Accumulator("h100", promote_every=128)),
        ("limited, promote every 128", Accumulator("limited", promote_every=128)),
    ):
        y = fp8lab.qmatmul(qx, qw, acc)
        out[label] = sqnr_db(exact, y)
        print(f"{'':>{len(str(k)) + 6}}{label:<32} {out[label]:>16.1f}")
    return out


if __name__ == "__main__":
    main()
