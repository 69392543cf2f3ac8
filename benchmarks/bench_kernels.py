"""numba kernels vs the device-generic torch kernels on the CPU, in one run (issue 24: the generic
backend within 3x of numba for casts).

    .venv/bin/python benchmarks/bench_kernels.py                  # 16M float32, 5 rounds
    .venv/bin/python benchmarks/bench_kernels.py --n 4000000 --repeat 3

For each row: the best time of ``--repeat`` rounds of numba (``set_kernels("numba")``) and of the
torch kernels (``set_kernels("torch")``) on the same input (``--n`` float32 values, randn * 100:
every rounding path is taken), measured interleaved, and torch / numba. Both run at torch's thread
count (numba follows it, `fp8lab.kernels`). ``--eager``: the torch kernels without torch.compile.
Report the CPU and ``uptime`` with the numbers.
Rows: `cast` e4m3 RNE, e5m2 RNE, e4m3 stochastic, hif8 TA (its native rounding), `encode` e4m3;
`quantize` e4m3 per tensor (te-current), 1x128 (DeepSeek-V3 activations), 128x128 (its weights),
MXFP8 1x32 (mx_floor), NVFP4 (e2m1, 1x16 E4M3 scales under a per-tensor scale). Other kernel
families add their rows to `ROWS`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fp8lab import cast, encode, quantize
from fp8lab.formats import rounding_torch
from fp8lab.kernels import using_kernels

Row = tuple[str, Callable[[torch.Tensor], object]]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


ROWS: list[Row] = [
    ("cast e4m3 RNE", lambda x: cast(x, "e4m3")),
    ("cast e5m2 RNE", lambda x: cast(x, "e5m2")),
    ("cast e4m3 stochastic", lambda x: cast(x, "e4m3", rounding="stochastic", generator=_gen())),
    ("cast hif8 TA", lambda x: cast(x, "hif8")),
    ("encode e4m3", lambda x: encode(x, "e4m3")),
]

# quantize (K2, issue 24: within 3x of numba): x viewed as [n / 4096, 4096]; "out=" rows write
# into a warm caller-owned buffer, as fp8lab.nn does (a fresh 64 MB output costs page faults
# that hide the kernels' difference)
_OUT: dict[tuple[int, ...], torch.Tensor] = {}


def _quantize(
    gran: object, rule: str, out: bool = False, fmt: str = "e4m3"
) -> Callable[[torch.Tensor], object]:
    def run(x: torch.Tensor) -> object:
        x2 = x[: x.numel() // 4096 * 4096].view(-1, 4096)
        buf = _OUT.get(tuple(x2.shape)) if out else None
        if out and buf is None:
            buf = _OUT[tuple(x2.shape)] = torch.empty(x2.shape)
        return quantize(x2, fmt, gran, rule, out=buf)

    return run


ROWS += [
    ("quantize te-current", _quantize("tensor", "max")),
    ("quantize te-current out=", _quantize("tensor", "max", out=True)),
    ("quantize 1x128 act out=", _quantize((1, 128), "max", out=True)),
    ("quantize 128x128 w out=", _quantize((128, 128), "max", out=True)),
    ("quantize mxfp8 1x32 out=", _quantize("mx", "mx_floor", out=True)),
    ("quantize nvfp4 1x16 out=", _quantize("nvfp4", "nvfp4", out=True, fmt="e2m1")),
]


def _best(fn: Callable[[], object], kernels: str, times: list[float]) -> None:
    with using_kernels(kernels):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16 * 1024 * 1024, help="elements (float32)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per implementation (best)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--eager", action="store_true", help="torch kernels without torch.compile")
    ap.add_argument("--only", default="", help="run only the rows whose name contains this")
    args = ap.parse_args()
    if args.eager:
        rounding_torch.COMPILE_MIN = 1 << 62
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.n, generator=_gen()) * 100
    mode = "eager" if args.eager else "compiled"
    print(f"n={args.n} float32, threads={torch.get_num_threads()}, best of {args.repeat}, {mode}")
    print(f"{'kernel':24s} {'numba ms':>9s} {'torch ms':>9s} {'torch/numba':>11s}")
    for name, fn in [r for r in ROWS if args.only in r[0]]:
        for kernels in ("numba", "torch"):  # warm-up: compiles and first touches, untimed
            with using_kernels(kernels):
                fn(x)
        t_numba: list[float] = []
        t_torch: list[float] = []
        for _ in range(args.repeat):
            _best(lambda fn=fn: fn(x), "numba", t_numba)
            _best(lambda fn=fn: fn(x), "torch", t_torch)
        a, b = min(t_numba) * 1e3, min(t_torch) * 1e3
        print(f"{name:24s} {a:9.1f} {b:9.1f} {b / a:11.2f}")


if __name__ == "__main__":
    main()
