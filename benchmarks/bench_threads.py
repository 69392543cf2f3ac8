"""The thread policy of the numba kernels (`fp8lab.kernels`): where the serial cut-off lies, the
issue-22 loop (converted 128x128 bf16 layers) with and without the policy, and the GEMM models
beside a busy neighbour.

    .venv/bin/python benchmarks/bench_threads.py              # --sweep and --loop
    .venv/bin/python benchmarks/bench_threads.py --sweep      # serial vs parallel by size
    .venv/bin/python benchmarks/bench_threads.py --loop       # the user's loop
    .venv/bin/python benchmarks/bench_threads.py --neighbour  # limited GEMM, one core shared

``--sweep``: for each kernel and size, the parallel variant's time (numba at torch's thread
count) over the serial variant's, measured in the same run, interleaved, the median of
``--repeat`` rounds: the cut-off `SERIAL_BELOW` is where the ratio falls below 1 (on a loaded
machine it moves up: the workers have to win a core first). ``--loop``: median step time (forward +
backward) of ``--layers`` converted 128 x 128 Linear layers on 128 tokens, torch at 1 and at 2
threads, under the policy and under "always parallel with numba's whole pool" (the behaviour before
the policy for the bf16 rounding and GEMM kernels), and the fp32 recipe (no numba kernel) as the
control; the ratio is to the policy's time in the same run. ``--neighbour``: the ``limited``
qmatmul at ``--size``^3 (incl. quantization, as in bench_gemm.py) over the fp32 ``a @ b`` timed
in the same phase, best of ``--repeat``, alone and then beside a CPU-bound process at nice 19
pinned to the last core, in a process session of its own (`setsid`, as a job from another terminal: nice only
weighs within a session's autogroup, so it takes half of that core); the neighbour stops when the
measurement ends, and by itself after ``--neighbour-seconds`` whatever happens here.
Report the machine's load (``uptime``) with the numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numba
import torch

import fp8lab.kernels as th
from fp8lab import Accumulator, QuantSpec, cast, qmatmul, quantize
from fp8lab.nn import convert
from fp8lab.nn._kernels import round_bf16


def _time(fn: Callable[[], object], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _force(mode: str) -> None:
    """'policy': fp8lab's rule; 'serial' / 'parallel': every kernel so (parallel at torch's
    count); 'old': every kernel parallel with numba's whole pool, whatever torch's count."""
    th.SERIAL_BELOW = {"policy": _CUTOFF, "serial": 1 << 62, "parallel": 0, "old": 0}[mode]
    if mode == "old":
        th.parallel = _old_parallel
    else:
        th.parallel = _policy_parallel
    _rebind()


_CUTOFF = th.SERIAL_BELOW
_policy_parallel = th.parallel


def _old_parallel(work: int) -> bool:
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return True


def _rebind() -> None:
    """The kernels imported `parallel` by name: point them at the current one."""
    import fp8lab.formats.codec as codec
    import fp8lab.formats.rounding as rounding
    import fp8lab.gemm.fused as fused
    import fp8lab.gemm.limited as limited
    import fp8lab.nn._kernels as nk

    for mod in (codec, rounding, fused, limited, nk):
        mod.parallel = th.parallel


def sweep(repeat: int) -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    h100 = Accumulator("h100", promote_every=128)
    act, wgt = QuantSpec("e4m3", (1, 128)), QuantSpec("e4m3", (128, 128))
    print(f"## serial vs parallel (torch and numba at {torch.get_num_threads()} threads)\n")
    print("| kernel | work (ops) | serial (us) | parallel (us) | parallel / serial |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for n in (1 << 14, 1 << 16, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22):
        x = torch.randn(n, generator=g)
        inner = max(2, (1 << 22) // n)
        rows.append(("cast e4m3", n, lambda x=x: cast(x, "e4m3"), inner))
        rows.append(("round_bf16", n, lambda x=x: round_bf16(x), inner))
    for m, k, nn in (
        (16, 128, 32),
        (32, 128, 64),
        (64, 128, 128),
        (128, 256, 128),
        (256, 256, 256),
    ):
        qa = quantize(torch.randn(m, k, generator=g), act)
        qb = quantize(torch.randn(k, nn, generator=g), wgt)
        inner = max(2, (1 << 25) // (m * k * nn))
        rows.append(("H100 qmatmul", m * k * nn, lambda qa=qa, qb=qb: qmatmul(qa, qb, h100), inner))
    for name, work, fn, inner in rows:
        ts: dict[str, list[float]] = {"serial": [], "parallel": []}
        fn()
        for _ in range(repeat):
            for mode in ("serial", "parallel"):
                _force(mode)
                ts[mode].append(_time(fn, inner))
        s, p = statistics.median(ts["serial"]), statistics.median(ts["parallel"])
        print(f"| {name} | {work} | {s * 1e6:.1f} | {p * 1e6:.1f} | {p / s:.2f} |", flush=True)
    _force("policy")
    print()


def loop(layers: int, steps: int, repeat: int) -> None:
    print(f"## {layers} converted 128 x 128 Linear layers, 128 tokens, fwd + bwd: median ms/step\n")
    print("| recipe | torch threads | kernels | ms/step | / policy |")
    print("|---|---:|---|---:|---:|")
    for recipe in ("bf16", "te-delayed", "fp32"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(layers)])
        convert(model, recipe, default_exclude=False)
        x = torch.randn(128, 128)

        def step(model: torch.nn.Module = model, x: torch.Tensor = x) -> None:
            model(x).sum().backward()

        modes = ("policy", "old") if recipe != "fp32" else ("policy",)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            res: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(repeat):
                for mode in modes:
                    _force(mode)
                    for _ in range(3):
                        step()
                    res[mode].append(statistics.median(_time(step, 1) for _ in range(steps)))
            base = statistics.median(res["policy"])
            for mode in modes:
                t = statistics.median(res[mode])
                print(f"| {recipe} | {threads} | {mode} | {t * 1e3:.2f} | {t / base:.2f} |",
                      flush=True)  # fmt: skip
    _force("policy")
    print()


_NEIGHBOUR = """
import os, time
os.nice(19)
os.sched_setaffinity(0, {{{cpu}}})
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    pass
"""


def _neighbour(seconds: float) -> subprocess.Popen:
    """A CPU-bound nice-19 process on the last core, in its own process session, ending by itself."""
    cpu = max(os.sched_getaffinity(0))
    code = _NEIGHBOUR.format(cpu=cpu, seconds=seconds)
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up (numba compilation, allocator)
    return min(_time(fn, 1) for _ in range(repeat))


def neighbour(size: int, repeat: int, seconds: float) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g)
    b = torch.randn(size, size, generator=g)
    tensor = QuantSpec("e4m3")
    act = QuantSpec("e4m3", (1, 128), "pow2_down")
    wgt = QuantSpec("e4m3", (128, 128), "pow2_down")
    lim, lim_p = Accumulator("limited"), Accumulator("limited", promote_every=128)
    cases = {
        "per-tensor, limited 13 bits, no promotion": lambda: qmatmul(
            a, b, lim, spec=tensor, spec_b=tensor
        ),
        "1x128 x 128x128, limited 13 bits, promote 128": lambda: qmatmul(
            a, b, lim_p, spec=act, spec_b=wgt
        ),
    }
    print(f"## limited qmatmul / fp32 a @ b, M = N = K = {size}, incl. quantization, torch "
          f"threads = {torch.get_num_threads()}, best of {repeat}\n")  # fmt: skip
    print("| case | alone: fp32 (s) | alone: time (s) | alone: ratio "
          "| neighbour: fp32 (s) | neighbour: time (s) | neighbour: ratio |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    res: dict[str, list[float]] = {name: [] for name in cases}
    for phase in ("alone", "neighbour"):
        proc = _neighbour(seconds) if phase == "neighbour" else None
        try:
            if proc is not None:
                time.sleep(0.5)  # let it start spinning
            for name, fn in cases.items():
                base = _best(lambda: a @ b, repeat)
                res[name] += [base, _best(fn, repeat)]
        finally:
            if proc is not None:
                proc.kill()
                proc.wait(timeout=10)
    for name, (b0, t0, b1, t1) in res.items():
        print(f"| {name} | {b0:.3f} | {t0:.3f} | {t0 / b0:.2f}x | {b1:.3f} | {t1:.3f} "
              f"| {t1 / b1:.2f}x |", flush=True)  # fmt: skip
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel numba kernel ran in this process
        layer = "none started"
    print(f"\nnumba threading layer: {layer}; load average after: {os.getloadavg()}\n")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="No --torch-device: it measures the CPU thread policy of the numba kernels, "
        "which run on the CPU only.",
    )
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--loop", action="store_true")
    ap.add_argument("--neighbour", action="store_true", help="limited GEMM beside a nice-19 job")
    ap.add_argument("--size", type=int, default=2048, help="--neighbour: M = N = K")
    ap.add_argument(
        "--neighbour-seconds", type=float, default=600.0, help="the neighbour's longest life"
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    both = not (args.sweep or args.loop or args.neighbour)
    print(f"load average: {os.getloadavg()}, NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}")
    if args.sweep or both:
        sweep(args.repeat)
    if args.loop or both:
        loop(args.layers, args.steps, args.repeat)
    if args.neighbour:
        neighbour(args.size, args.repeat, args.neighbour_seconds)


if __name__ == "__main__":
    main()
