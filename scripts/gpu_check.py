"""One command for a GPU machine: does fp8lab on CUDA give the CPU's bits, does fp8lab's ``h100``
accumulator model match the GPU's own FP8 GEMM, and what does a training step cost there.

Writes ONE JSON (``--out``) with the sections

* ``bit_identity``: CUDA (kernels "torch", the device-generic ones) against the CPU (kernels
  "auto", i.e. numba) on the same inputs: `fp8lab.cast` (every format, every rounding incl.
  stochastic with the same CPU generator seed, saturating or not, four input dtypes),
  `fp8lab.encode`/`decode`, `fp8lab.quantize` (every scale rule and block shape of the recipes:
  per-tensor, row/col, 1x128, 128x128, 128x1, MX 1x32, NVFP4) and `fp8lab.qmatmul` (every
  accumulator: ``limited`` and the fused ``h100``/``h200``/``ada``/``b200`` models bit for bit,
  ``fp32`` within a bound derived from K) on random and edge tensors: mismatch counts per case;
* ``scaled_mm``: fp8lab's ``h100`` fused model, never promoted, against
  ``torch._scaled_mm(..., use_fast_accum=True)`` on e4m3 x e4m3 and e4m3 x e5m2, K = 32..8192,
  unit and non-unit per-tensor scales (mismatch counts), and against ``use_fast_accum=False``
  with fp8lab's model promoted every P elements of K for several P (the cuBLAS interval is
  undocumented: which P fits best);
* ``step_time``: median step (forward + backward + optimizer) of the lab's GPT at GPT-2 small
  size under torch's native fp32 (TF32 off) and native bf16 (autocast) and under fp8lab's
  recipes, as ratios to both native steps measured in the same run; every case time-boxed in a
  worker process ("skipped: time" rather than overrunning the budget);
* ``cast_time``: a cast of 16M float32 against a device copy of the same bytes;
* ``device``, ``torch``, ``date``, ``fp8lab`` (version, commit).

    python scripts/gpu_check.py --out gpu_check.json          # a CUDA machine: under 5 minutes
    python scripts/gpu_check.py --out r.json --markdown r.md  # ... and the README's tables
    python scripts/gpu_check.py --markdown gpu_check.json     # print an existing report's tables
    python scripts/gpu_check.py --smoke --out smoke.json      # tiny sizes on the CPU (the tests)

The JSON is rewritten (atomically) after every section with ``"complete": false`` and the
section that runs next, so a run that is cut off keeps what it measured. A watchdog ends a run
that is still going `HARD_GRACE_S` seconds past its budget (a hung compile, a hung collective):
it writes the report with the section it interrupted (its cases so far, for ``bit_identity``),
kills the worker processes and exits 1.

``--smoke`` runs every section at tiny sizes; on the CPU the candidate is the device-generic
torch kernels against numba on the same CPU, and ``scaled_mm`` is skipped ("needs CUDA").
The exit code is 0 when every exact case gave 0 mismatches and nothing failed, 1 otherwise,
2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

import fp8lab
from fp8lab.gemm import Accumulator, fused_triton
from fp8lab.kernels import kernel_counts, using_kernels
from fp8lab.qtensor import QTensor

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("bit_identity", "scaled_mm", "cast_time", "distributed", "step_time")
STEP_CASES = (
    "native-fp32",
    "native-bf16",
    "bf16",
    "te-current",
    "te-delayed",
    "mxfp8",
    "deepseek-v3",
    "deepseek-v3-h100",
)
#: the issue's targets for the step ratio to the native fp32 step (TF32 off)
STEP_TARGETS = {"te-current": 1.3, "te-delayed": 1.3, "deepseek-v3-h100": 5.0}
PROMOTION_INTERVALS = (32, 64, 96, 128, 192, 256, 384, 512)
GRACE_S = 5.0  # how long past a case's budget the worker may run before it is killed
#: how long past the whole budget the watchdog lets a run go on (budget 270 s + 20 s + start)
HARD_GRACE_S = 20.0
#: the worker processes started (step workers; torchrun, in a session of its own), for the
#: watchdog to kill
CHILDREN: list[subprocess.Popen] = []
_WORKER_TAG = "GPU_CHECK "  # prefix of the step worker's protocol lines on its stdout
_U = 2.0**-24  # unit roundoff of float32


@dataclass(frozen=True)
class Sizes:
    """How big each section's tensors are (``FULL`` on a GPU, ``SMOKE`` for the tests)."""

    random_n: int  # random float32 bit patterns per cast case
    grid_stride: int  # every k-th of the 65536 high halves of the exhaustive 16-bit sweep
    cast_dtypes: tuple[str, ...]  # input dtypes of the cast cases (keys of _DTYPES)
    quant_shapes: tuple[tuple[int, int], ...]
    mm: tuple[int, int, int]  # M, K, N of the qmatmul cases
    scaled_mm_mn: int
    scaled_mm_ks: tuple[int, ...]
    gpt: dict[str, int]
    batch: int
    warmup: int
    iters: int
    min_case_s: float  # a step case with less time than this left is skipped
    cast_n: int
    budget_s: float  # the whole run


FULL = Sizes(
    random_n=1 << 16,
    grid_stride=1,
    cast_dtypes=("f32", "bf16", "f16", "f64"),
    quant_shapes=((512, 768), (300, 500)),
    mm=(128, 1024, 128),
    scaled_mm_mn=128,
    scaled_mm_ks=tuple(2**i for i in range(5, 14)),
    gpt={"n_layer": 12, "n_head": 12, "d_model": 768, "d_ff": 2048, "block_size": 1024},
    batch=8,
    warmup=2,
    iters=10,
    min_case_s=5.0,
    cast_n=1 << 24,
    budget_s=270.0,  # + a killed case's grace, the start and the JSON: under 5 minutes
)
SMOKE = Sizes(
    random_n=1 << 10,
    grid_stride=61,
    cast_dtypes=("f32", "f16"),
    quant_shapes=((130, 200),),  # ragged: partial edge blocks
    mm=(32, 256, 32),
    scaled_mm_mn=32,
    scaled_mm_ks=(32, 64),
    gpt={"n_layer": 1, "n_head": 2, "d_model": 128, "d_ff": 256, "block_size": 64},
    batch=2,
    warmup=1,
    iters=2,
    min_case_s=1.0,
    cast_n=1 << 16,
    budget_s=600.0,
)


# =============================================================================== comparing
def _fields(result: Any) -> dict[str, torch.Tensor]:
    """The tensors of a case's result by name (a QTensor's values and scales, a tuple's items)."""
    if isinstance(result, QTensor):
        named = {
            "values": result.values,
            "scales": result.scales,
            "scale_multipliers": result.scale_multipliers,
            "global_scale": result.global_scale,
        }
        return {k: v for k, v in named.items() if v is not None}
    if isinstance(result, tuple | list):
        out: dict[str, torch.Tensor] = {}
        for i, r in enumerate(result):
            out.update({f"{i}.{k}": v for k, v in _fields(r).items()})
        return out
    return {"out": result}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a CPU tensor as integers of the same width (NaN payloads count)."""
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        return t.view(
            {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
        )
    return t


def bit_mismatches(ref: Any, got: Any) -> dict[str, Any]:
    """Elements whose bits differ between two results of one case (``elements``, ``mismatches``;
    a field whose shape or dtype differs counts every element and is named in ``note``)."""
    rf, gf = _fields(ref), _fields(got)
    n = bad = 0
    notes: list[str] = []
    by_field: dict[str, int] = {}
    nan_only = 0
    for name in sorted(set(rf) | set(gf)):
        r, g = rf.get(name), gf.get(name)
        if r is None or g is None or r.shape != g.shape or r.dtype != g.dtype:
            size = max(x.numel() for x in (r, g) if x is not None)
            n, bad = n + size, bad + size
            notes.append(f"{name}: {_desc(r)} vs {_desc(g)}")
            continue
        n += r.numel()
        differ = _bits(r) != _bits(g)
        diff = int(differ.sum())
        bad += diff
        if diff:
            by_field[name] = diff
        if diff and r.is_floating_point():  # both NaN, sign or payload differ
            nan_only += int((differ & torch.isnan(r.cpu()) & torch.isnan(g.cpu())).sum())
    rec: dict[str, Any] = {"elements": n, "mismatches": bad}
    if len(by_field) > 1 or (by_field and len(rf) > 1):
        rec["by_field"] = by_field
    if nan_only:
        rec["nan_bits_only"] = nan_only
    if notes:
        rec["note"] = "; ".join(notes)
    return rec


def _desc(t: torch.Tensor | None) -> str:
    return "missing" if t is None else f"{t.dtype}{list(t.shape)}"


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in the order of the values (adjacent floats differ by 1: ulp distance)."""
    i = _bits(t.float()).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def bounded_mismatches(ref: torch.Tensor, got: torch.Tensor, bound: torch.Tensor) -> dict[str, Any]:
    """A float32 result whose summation order is the BLAS's: ``|got - ref| <= bound`` per element
    (a non-finite element must be the same infinity, or NaN on both sides: the BLAS's NaN bit
    pattern is its own); the largest ulp distance is reported."""
    ref, got = ref.detach().cpu().float(), got.detach().cpu().float()
    rec = bit_mismatches(ref, got)
    if "note" in rec:
        return {**rec, "bound_violations": rec["elements"], "max_ulp": None}
    finite = torch.isfinite(ref) & torch.isfinite(got)
    over = (ref.double() - got.double()).abs() > bound
    both_nan = torch.isnan(ref) & torch.isnan(got)
    violations = (finite & over) | (~finite & ~both_nan & (ref != got))
    ulp = (_ordered(ref) - _ordered(got)).abs()[finite]
    return {
        "elements": rec["elements"],
        "bit_mismatches": rec["mismatches"],
        "bound_violations": int(violations.sum()),
        "max_ulp": int(ulp.max()) if ulp.numel() else 0,
    }


def fp32_gemm_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Largest difference two FP32 GEMMs of the same operands (float32 ``[M, K]``, ``[K, N]``,
    dequantized) can show whatever their summation order: each is within
    ``gamma_(K+4) * (|A| @ |B|)`` of the exact product (K - 1 additions, the products, and up to
    four roundings of scales and the epilogue; Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., eq. 3.5), plus an absolute ``K * 2**-149`` each for underflow."""
    k = a.shape[1]
    gamma = (k + 4) * _U / (1 - (k + 4) * _U)
    return 2 * (gamma * (a.double().abs() @ b.double().abs()) + k * 2.0**-149)


# ============================================================================ running a case
@dataclass(frozen=True)
class Case:
    """One bit-identity case: ``run(device)`` computes the result from inputs made on the CPU;
    ``bound`` (fp32 GEMMs only) gives the per-element tolerance instead of bit equality."""

    name: str
    run: Callable[[torch.device], Any]
    bound: Callable[[], torch.Tensor] | None = None


def _error(exc: BaseException) -> str:
    """The exception, its message (cut at 400 characters) and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = f"{type(exc).__name__}: {exc}{where}"
    return text if len(text) < 400 else text[:400] + "..."


def _attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:  # recorded per case: one kernel's failure must not end the run
        return None, exc


def run_case(case: Case, device: torch.device) -> dict[str, Any]:
    """The case on the CPU with the default kernels (numba) and on ``device`` with the
    device-generic torch kernels; what differed. Both refusing the input alike is recorded as
    ``refused`` (agreement), one side failing as ``error``. ``torch_dispatches``: kernel calls
    that chose the torch implementation on the device side (0: none went through
    `fp8lab.kernels.use_torch`, e.g. a kernel not ported yet)."""
    cpu = torch.device("cpu")
    with using_kernels("auto"):
        ref, ref_exc = _attempt(lambda: case.run(cpu))
    kernel_counts(reset=True)
    with using_kernels("torch"):
        got, got_exc = _attempt(lambda: case.run(device))
    rec: dict[str, Any] = {"case": case.name, "torch_dispatches": kernel_counts()["torch"]}
    if ref_exc is not None or got_exc is not None:
        if ref_exc is not None and got_exc is not None and type(ref_exc) is type(got_exc):
            rec["refused"] = _error(ref_exc)
        elif ref_exc is None:
            rec["error"] = f"{device}: {_error(got_exc)}"
        else:
            rec["error"] = f"cpu: {_error(ref_exc)}; {device}: " + (
                "returned a result" if got_exc is None else _error(got_exc)
            )
        return rec
    rec.update(
        bounded_mismatches(ref, got, case.bound()) if case.bound else bit_mismatches(ref, got)
    )
    return rec


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over a section's case records."""
    exact = [r for r in records if "mismatches" in r]
    bounded = [r for r in records if "bound_violations" in r]
    # cases whose device side never asked fp8lab.kernels.use_torch (e.g. a kernel not ported yet;
    # on the CPU numba then ran on both sides, so their 0 mismatches prove nothing)
    quiet = [r["case"] for r in records if r.get("torch_dispatches") == 0 and "elements" in r]
    return {
        "cases": len(records),
        "exact_cases": len(exact),
        "exact_mismatches": sum(r["mismatches"] for r in exact),
        "exact_elements": sum(r["elements"] for r in exact),
        "nan_bits_only": sum(r.get("nan_bits_only", 0) for r in exact),
        "bounded_cases": len(bounded),
        "bound_violations": sum(r["bound_violations"] for r in bounded),
        "max_ulp_fp32_gemm": max((r["max_ulp"] or 0 for r in bounded), default=0),
        "refused": sum("refused" in r for r in records),
        "errors": sum("error" in r for r in records),
        "skipped": sum("skipped" in r for r in records),
        "not_dispatched_to_torch": len(quiet),
        "not_dispatched_examples": quiet[:8],
    }


# ================================================================================ the inputs
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _from_bits(i: torch.Tensor) -> torch.Tensor:
    return i.to(torch.int32).view(torch.float32)


def cast_inputs(fmt_name: str, sizes: Sizes, seed: int = 0) -> torch.Tensor:
    """float32 inputs for casts onto ``fmt_name``: named edge values (0, -0, +-inf, NaN, FLT_MAX,
    the format's max / min normal / min subnormal and their neighbours), the exhaustive sweep of
    the 65536 high halves of a float32 (every sign, exponent and top 7 fraction bits) with low
    halves 0, 1, 0x8000 and 0xFFFF (ties and their neighbours for formats of up to 7 fraction
    bits), ties of the format's own fraction width at random exponents with +-1 ulp, and random
    bit patterns."""
    fmt = fp8lab.get_format(fmt_name)
    m = fmt.mbits
    anchors = [fmt.max, fmt.min_normal, fmt.min_subnormal, 1.0]
    mults = [1.0, 0.5, 0.75, 1.25, 1.5, 2.0, 1 - 2.0 ** -(m + 1), 1 + 2.0 ** -(m + 1)]
    mults += [1 + 2.0 ** -(m + 2), 1 - 2.0 ** -(m + 2), 1 + 2.0 ** -(m + 1) + 2.0**-22]
    named = [a * k for a in anchors for k in mults]
    named += [0.0, math.inf, math.nan, 3.4028234663852886e38, 2.0**-126, 2.0**-149]
    named_t = torch.tensor(named, dtype=torch.float64).float()
    named_t = torch.cat([named_t, -named_t])
    high = torch.arange(0, 1 << 16, sizes.grid_stride, dtype=torch.int64) << 16
    sweep = torch.cat([high | low for low in (0, 1, 0x8000, 0xFFFF)])
    g = _gen(seed)
    rnd = torch.randint(-(2**31), 2**31, (sizes.random_n,), generator=g, dtype=torch.int64)
    parts = [named_t, _from_bits(sweep - ((sweep >= 2**31) * 2**32)), _from_bits(rnd)]
    if m < 23:
        keep = ~((1 << (23 - m)) - 1)
        base = torch.randint(-(2**31), 2**31, (sizes.random_n,), generator=g) & keep
        tie = base | (1 << (22 - m))
        parts += [_from_bits(t) for t in (tie, tie + 1, tie - 1)]
    return torch.cat(parts)


def quant_inputs(shape: tuple[int, int], kind: str, seed: int) -> torch.Tensor:
    """A float32 tensor to quantize: ``random`` (normal, rows spread over 2**-12..2**12),
    ``edge`` (random plus zeros, an all-zero 128x128 block, float32 subnormals, huge values),
    ``zeros``, or ``nonfinite`` (random plus a few inf and NaN)."""
    g = _gen(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-12, 13, (shape[0], 1), generator=g).float()
    )
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "edge":
        pick = torch.rand(shape, generator=g)
        x[pick < 0.05] = 0.0
        x[(pick > 0.05) & (pick < 0.07)] = 1e-40  # float32 subnormal
        x[(pick > 0.07) & (pick < 0.08)] = -3e38
        x[:128, :128] = 0.0
    if kind == "nonfinite":
        pick = torch.rand(shape, generator=g)
        x[pick < 0.001] = math.inf
        x[pick > 0.999] = math.nan
    return x


def grid_operand(shape: tuple[int, int], fmt_name: str, seed: int, edge: bool) -> torch.Tensor:
    """Values on ``fmt_name``'s grid: random normal ones, or (``edge``) spanning the format's
    range with subnormals, zeros and +-max."""
    g = _gen(seed)
    fmt = fp8lab.get_format(fmt_name)
    x = torch.randn(shape, generator=g)
    if edge:
        hi = 40 if fmt.emax > 20 else fmt.emax + 1  # bf16: keep products finite
        x = x * torch.exp2(torch.randint(fmt.emin - 3, hi, shape, generator=g).float())
    x = fp8lab.cast(x, fmt_name)
    if edge:
        x[torch.rand(shape, generator=g) < 0.05] = 0.0
        if fmt.emax <= 20:
            x[torch.rand(shape, generator=g) < 0.03] = float(fmt.max)
            x[torch.rand(shape, generator=g) < 0.03] = -float(fmt.max)
    return x


def to_device(q: QTensor, device: torch.device) -> QTensor:
    """A QTensor with every tensor moved to ``device`` (a fresh one: no memoised copies)."""

    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return QTensor(
        values=mv(q.values),
        scales=mv(q.scales),
        spec=q.spec,
        global_scale=mv(q.global_scale),
        retiled=q.retiled,
        meta=dict(q.meta),
        scale_multipliers=mv(q.scale_multipliers),
        block_shape=q.block_shape,
    )


# ================================================================================ the cases
_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}


def cast_cases(sizes: Sizes) -> Iterator[Case]:
    """`fp8lab.cast` for every format x rounding x saturate x input dtype, and encode/decode
    of every format of 8 bits or fewer."""
    for fmt in fp8lab.format_names():
        x32 = cast_inputs(fmt, sizes)
        for dname in sizes.cast_dtypes:
            x = x32.to(_DTYPES[dname])
            for rounding in fp8lab.ROUNDING_MODES:
                for sat in (True, False):

                    def run(d: torch.device, x=x, fmt=fmt, r=rounding, s=sat) -> torch.Tensor:
                        return fp8lab.cast(x.to(d), fmt, r, saturate=s, generator=_gen(7))

                    yield Case(f"cast {fmt} {rounding} sat={sat} {dname}", run)
        if fp8lab.get_format(fmt).bits <= 8:
            yield Case(f"encode {fmt}", lambda d, x=x32, f=fmt: fp8lab.encode(x.to(d), f))
            codes = torch.arange(256, dtype=torch.uint8)
            yield Case(f"decode {fmt}", lambda d, c=codes, f=fmt: fp8lab.decode(c.to(d), f))


def quant_specs() -> list[fp8lab.QuantSpec]:
    """Every role spec of the recipes, plus every scale rule on its granularity."""
    specs: dict[str, fp8lab.QuantSpec] = {}
    for name in fp8lab.recipes():
        recipe = fp8lab.get_recipe(name)
        for spec in (recipe.input, recipe.weight, recipe.grad_output):
            if spec is not None and spec.format != "fp32":
                specs.setdefault(repr(spec), spec)
    extra = [
        ("e4m3", "tensor", "pow2_down"),
        ("e4m3", "tensor", "pow2_up"),
        ("e5m2", "row", "max"),
        ("e4m3", "col", "max"),
        ("e4m3", (128, 1), "max"),
        ("e4m3", "mx", "mx_floor"),
        ("e4m3", "mx", "mx_ceil"),
        ("e4m3", "mx", "mx_even"),
        ("e5m2", "mx_col", "mx_rceil"),
        ("e2m1", "nvfp4_col", "nvfp4"),
    ]
    for fmt, gran, rule in extra:
        spec = fp8lab.QuantSpec(format=fmt, granularity=gran, scaling=rule)
        specs.setdefault(repr(spec), spec)
    specs.setdefault("sr", fp8lab.QuantSpec("e4m3", "tensor", "max", rounding="stochastic"))
    specs.setdefault("margin", fp8lab.QuantSpec("e4m3", (1, 128), "max", margin=1, epsilon=1e-3))
    return list(specs.values())


def quantize_cases(sizes: Sizes) -> Iterator[Case]:
    """`fp8lab.quantize` for every spec of `quant_specs` on random, edge, all-zero and
    non-finite inputs (float32; bfloat16 for the random ones), ragged shapes included."""
    for spec in quant_specs():
        for shape in sizes.quant_shapes:
            for kind in ("random", "edge", "zeros", "nonfinite"):
                for dname in ("f32", "bf16") if kind == "random" else ("f32",):
                    x = quant_inputs(shape, kind, seed=len(kind)).to(_DTYPES[dname])

                    def run(d: torch.device, x=x, spec=spec) -> QTensor:
                        return fp8lab.quantize(x.to(d), spec, generator=_gen(11))

                    yield Case(f"quantize {spec} {list(shape)} {kind} {dname}", run)


def _operands(sizes: Sizes, fa: str, fb: str, ga: Any, gb: Any, edge: bool, seed: int):
    """QTensors ``a`` [M, K] and ``b`` [K, N] on the CPU: grid values with unit per-tensor scales
    (``ga``/``gb`` None), or random values quantized under granularity ``ga``/``gb`` (max rule)."""
    m, k, n = sizes.mm
    if ga is None:
        a = grid_operand((m, k), fa, seed, edge)
        b = grid_operand((k, n), fb, seed + 1, edge)
        return fp8lab.quantize(a, fa, "tensor", 1.0), fp8lab.quantize(b, fb, "tensor", 1.0)
    rule = "nvfp4" if fa == "e2m1" else ("mx_rceil" if "mx" in str(ga) else "max")
    a = quant_inputs((m, k), "random", seed)
    b = quant_inputs((k, n), "random", seed + 1)
    return fp8lab.quantize(a, fa, ga, rule), fp8lab.quantize(b, fb, gb, rule)


def _accumulators(fa: str, fb: str) -> list[Accumulator | str]:
    fp8 = {fa, fb} <= {"e4m3", "e5m2"}
    accs: list[Accumulator | str] = ["fp32"]
    if fp8:
        accs += [
            Accumulator("limited"),
            Accumulator("limited", promote_every=128),
            Accumulator("limited", rounding="nearest_even", promote_every=128),
        ]
    if fp8 or fa == fb:
        accs += ["h100", "h200", "ada", "b200", Accumulator("h100", promote_every=128)]
    if fp8:
        accs.append("b200-tcgen05")
    return accs


def qmatmul_cases(sizes: Sizes) -> Iterator[Case]:
    """`fp8lab.qmatmul` for every accumulator on per-tensor FP8 (random and edge grids, both
    format pairs), bf16 and fp16 operands, DeepSeek's 1x128 x 128x128 blocks, MX and NVFP4, plus
    the epilogue (bias, c, bf16 output)."""
    operand_sets = [
        ("e4m3", "e4m3", None, None, False),
        ("e4m3", "e5m2", None, None, True),
        ("e5m2", "e4m3", None, None, True),
        ("bf16", "bf16", None, None, True),
        ("fp16", "fp16", None, None, False),
    ]
    for i, (fa, fb, ga, gb, edge) in enumerate(operand_sets):
        qa, qb = _operands(sizes, fa, fb, ga, gb, edge, seed=100 + i)
        for acc in _accumulators(fa, fb):
            yield _mm_case(f"{fa}x{fb}{' edge' if edge else ''}", qa, qb, acc)
    blocked = [
        ("e4m3", "e4m3", (1, 128), (128, 128), [Accumulator("limited", promote_every=128),
         Accumulator("h100", promote_every=128), "fp32"]),
        ("e4m3", "e4m3", "mx", "mx_col", ["fp32"]),
        ("e2m1", "e2m1", "nvfp4", "nvfp4_col", ["fp32"]),
    ]  # fmt: skip
    for i, (fa, fb, ga, gb, accs) in enumerate(blocked):
        qa, qb = _operands(sizes, fa, fb, ga, gb, False, seed=200 + i)
        for acc in accs:
            yield _mm_case(f"{fa}x{fb} {ga}x{gb}", qa, qb, acc)
    qa, qb = _operands(sizes, "e4m3", "e4m3", None, None, False, seed=300)
    m, _, n = sizes.mm
    bias, c = torch.randn(n, generator=_gen(301)), torch.randn(m, n, generator=_gen(302))
    for acc in ("fp32", "h100", Accumulator("limited", promote_every=128)):
        yield _mm_case("e4m3xe4m3 bias+c", qa, qb, acc, bias=bias, c=c)
        yield _mm_case("e4m3xe4m3 bias out=bf16", qa, qb, acc, bias=bias, out_format="bf16")


def _mm_case(label: str, qa: QTensor, qb: QTensor, acc: Accumulator | str, **kw: Any) -> Case:
    desc = acc if isinstance(acc, str) else acc.describe()

    def run(d: torch.device) -> torch.Tensor:
        moved = {k: (v.to(d) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        return fp8lab.qmatmul(to_device(qa, d), to_device(qb, d), acc, **moved)

    bound = None
    if desc == "fp32":

        def bound() -> torch.Tensor:
            b = fp32_gemm_bound(qa.dequantize(), qb.dequantize())
            if kw.get("out_format") == "bf16":  # one bf16 rounding after: 2**-8 relative
                return b + 2.0**-8 * (
                    qa.dequantize().double().abs() @ qb.dequantize().double().abs()
                )
            return b

    return Case(f"qmatmul {label} acc={desc}", run, bound)


def bit_identity(
    sizes: Sizes, device: torch.device, deadline: float, into: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``bit_identity`` section: every case of `cast_cases`, `quantize_cases` and
    `qmatmul_cases`, CPU (numba) against ``device`` (torch kernels). Casts may take the time until
    40 % of the section's, quantize until 70 %, qmatmul the rest; a group that reaches its
    deadline records the cases it did not run as one ``skipped`` record. ``into``: the dict to
    fill as cases finish (the watchdog writes what it holds if the section hangs); returned."""
    out: dict[str, Any] = {} if into is None else into
    out.update(reference="cpu, kernels auto (numba)", candidate=f"{device}, kernels torch")
    t0 = time.time()
    groups = (("cast", cast_cases, 0.4), ("quantize", quantize_cases, 0.7))
    for group, cases, share in (*groups, ("qmatmul", qmatmul_cases, 1.0)):
        end = t0 + share * (deadline - t0)
        records: list[dict[str, Any]] = []
        out[group] = {"cases": records}
        for case in cases(sizes):
            if time.time() > end:
                records.append({"case": f"{group} from {case.name} on", "skipped": "time"})
                break
            t = time.time()
            records.append({**run_case(case, device), "seconds": round(time.time() - t, 3)})
        out[group] = {"summary": summarize(records), "cases": records}
    out["summary"] = summarize(
        [r for g in ("cast", "quantize", "qmatmul") for r in out[g]["cases"]]
    )
    out["seconds"] = round(time.time() - t0, 1)
    return out


# ============================================================================== scaled_mm
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _scaled_mm(qa: QTensor, qb: QTensor, fast: bool) -> torch.Tensor:
    """The GPU's own FP8 GEMM of two per-tensor QTensors on a CUDA device (b column-major)."""
    a8 = qa.values.to(_FP8_DTYPES[qa.spec.format])
    b8 = qb.values.to(_FP8_DTYPES[qb.spec.format]).t().contiguous().t()
    return torch._scaled_mm(
        a8,
        b8,
        scale_a=qa.scales.reshape(()).float(),
        scale_b=qb.scales.reshape(()).float(),
        out_dtype=torch.float32,
        use_fast_accum=fast,
    )


def _scaled_operands(
    fa: str, fb: str, mn: int, k: int, unit: bool, seed: int, device: torch.device
):
    g = _gen(seed)
    a, b = torch.randn(mn, k, generator=g), torch.randn(k, mn, generator=g)
    if unit:  # values on the grids, scale 1
        qa = fp8lab.quantize(fp8lab.cast(a * 8, fa), fa, "tensor", 1.0)
        qb = fp8lab.quantize(fp8lab.cast(b * 8, fb), fb, "tensor", 1.0)
    else:  # current scaling: scales amax / fmt max, not powers of two
        qa = fp8lab.quantize(a * 3.3, fa, "tensor", "max")
        qb = fp8lab.quantize(b * 0.07, fb, "tensor", "max")
    return to_device(qa, device), to_device(qb, device)


def _count(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((_bits(a) != _bits(b)).sum())


def scaled_mm_case(
    fa: str, fb: str, k: int, unit: bool, mn: int, device: torch.device
) -> dict[str, Any]:
    """One (formats, K, scales) case: mismatches of the never-promoted h100 model against
    use_fast_accum=True, and of each promotion interval against use_fast_accum=False."""
    qa, qb = _scaled_operands(fa, fb, mn, k, unit, seed=k + 7 * unit, device=device)
    rec: dict[str, Any] = {"a": fa, "b": fb, "k": k, "scales": "unit" if unit else "current"}
    rec["elements"] = mn * mn
    model = fp8lab.qmatmul(qa, qb, "h100")
    rec["fast_accum_mismatches"] = _count(model, _scaled_mm(qa, qb, True))
    slow = _scaled_mm(qa, qb, False)
    fits = {"never": _count(model, slow)}
    for p in PROMOTION_INTERVALS:
        fits[str(p)] = _count(fp8lab.qmatmul(qa, qb, Accumulator("h100", promote_every=p)), slow)
    rec["slow_accum_mismatches_by_interval"] = fits
    rec["best_interval"] = min(fits, key=lambda p: fits[p])
    return rec


def scaled_mm(sizes: Sizes, device: torch.device, deadline: float) -> dict[str, Any]:
    """The ``scaled_mm`` section (CUDA with FP8 tensor cores only; otherwise the reason)."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return {"skipped": f"needs FP8 tensor cores (compute capability >= 8.9), got {cap}"}
    t0 = time.time()
    cases = []
    with using_kernels("auto"):
        for fa, fb in (("e4m3", "e4m3"), ("e4m3", "e5m2")):
            for unit in (True, False):
                for k in sizes.scaled_mm_ks:
                    label = {"a": fa, "b": fb, "k": k, "scales": "unit" if unit else "current"}
                    if time.time() > deadline:
                        cases.append({**label, "skipped": "time"})
                        continue
                    try:
                        cases.append(scaled_mm_case(fa, fb, k, unit, sizes.scaled_mm_mn, device))
                    except Exception as exc:
                        cases.append({**label, "error": _error(exc)})
    done = [c for c in cases if "fast_accum_mismatches" in c]
    totals = {"never": 0, **{str(p): 0 for p in PROMOTION_INTERVALS}}
    for c in done:
        for p, v in c["slow_accum_mismatches_by_interval"].items():
            totals[p] += v
    return {
        "model": "h100 (fused, never promoted) vs torch._scaled_mm(use_fast_accum=True)",
        "m_n": sizes.scaled_mm_mn,
        "fast_accum_mismatches": sum(c["fast_accum_mismatches"] for c in done),
        "elements": sum(c["elements"] for c in done),
        "slow_accum_mismatches_by_interval": totals,
        "best_interval": min(totals, key=lambda p: totals[p]) if done else None,
        "errors": sum("error" in c for c in cases),
        "skipped": sum("skipped" in c for c in cases),
        "cases": cases,
        "seconds": round(time.time() - t0, 1),
    }


# ============================================================================== step time
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _no_tf32() -> None:
    """fp32 GEMMs in full FP32 (TF32 off): the honest baseline of an exact emulation."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def build_step(case: str, sizes: Sizes, device: torch.device) -> Callable[[], None]:
    """One training step of the lab's GPT for ``case`` on a fixed random batch, gradients clipped
    at 1.0: ``native-fp32``/``native-bf16`` are torch's own step (the unconverted model, bf16 by
    autocast, ``torch.nn.utils.clip_grad_norm_``, torch AdamW); a recipe name is the lab's step
    (the converted model, `TrainStep`, ``AdamW.from_recipe``)."""
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.parts import build_model, make_optimizer
    from fp8lab.lab.train import TrainConfig
    from fp8lab.step import TrainStep

    cfg = GPTConfig(**sizes.gpt)
    native = case.startswith("native-")
    recipe = None if native else fp8lab.get_recipe(case)
    model = build_model(cfg, recipe, seed=0).to(device)
    if native:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    else:
        opt = make_optimizer(model, recipe, TrainConfig(lr=1e-4))
    g = _gen(1)
    idx = torch.randint(0, cfg.vocab_size, (sizes.batch, cfg.block_size + 1), generator=g)
    x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
    if native:

        def native_step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=case == "native-bf16"):
                loss = model(x, y)[1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return native_step
    step = TrainStep(lambda _batch: model(x, y)[1], opt, clip=1.0)
    counter = iter(range(1 << 30))

    def lab_step() -> None:
        step(next(counter), None)

    return lab_step


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes, the device's queued work included."""
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def time_case(case: str, sizes: Sizes, device: torch.device, budget_s: float) -> dict[str, Any]:
    """Warm up, then the median of up to ``sizes.iters`` steps, within ``budget_s`` seconds
    (fewer steps when they do not fit; ``skipped: time`` when not even one timed step does)."""
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = build_step(case, sizes, device)
    rec: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 2)}
    last = 0.0
    for _ in range(sizes.warmup):
        last = _timed(step, device)
        rec.setdefault("first_step_s", round(last, 3))
        if time.perf_counter() - t0 + last > budget_s:
            break
    left = budget_s - (time.perf_counter() - t0)
    n = min(sizes.iters, int(left / last)) if last > 0 else sizes.iters
    if n < 1:
        return {**rec, "skipped": "time", "budget_s": round(budget_s, 1)}
    times = [_timed(step, device) for _ in range(n)]
    rec.update(median_ms=round(1e3 * statistics.median(times), 3), steps=n)
    rec["min_ms"] = round(1e3 * min(times), 3)
    if device.type == "cuda":
        rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return rec


def step_worker(spec: dict[str, Any]) -> None:
    """The worker process: time each case of ``spec["cases"]`` in turn, each with an equal share
    of the time left, announcing it (``start``, its budget) and its result (``done``) on stdout."""
    sizes = Sizes(**spec["sizes"])
    device = torch.device(spec["device"])
    _no_tf32()
    cases = list(spec["cases"])
    for i, case in enumerate(cases):
        budget = (spec["deadline"] - time.time()) / (len(cases) - i)
        _emit({"event": "start", "case": case, "budget_s": budget})
        if budget < sizes.min_case_s:
            result: dict[str, Any] = {"skipped": "time", "budget_s": round(budget, 1)}
        else:
            try:
                result = time_case(case, sizes, device, budget)
            except Exception as exc:
                result = {"error": _error(exc)}
        _emit({"event": "done", "case": case, "result": result})
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _emit(msg: dict[str, Any]) -> None:
    print(_WORKER_TAG + json.dumps(msg), flush=True)


def _spawn(cases: list[str], sizes: Sizes, device: torch.device, deadline: float, err):
    spec = {
        "cases": cases,
        "sizes": _sizes_json(sizes),
        "device": str(device),
        "deadline": deadline,
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_step-worker", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    CHILDREN.append(proc)
    return proc, reader(proc)


def reader(proc: subprocess.Popen) -> queue.Queue:
    """A queue of the worker's protocol messages (dicts), then None at the end of its output."""
    lines: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(_WORKER_TAG):
                lines.put(json.loads(line[len(_WORKER_TAG) :]))
        lines.put(None)  # end of output

    threading.Thread(target=read, daemon=True).start()
    return lines


def _tail(path: str, n: int = 600) -> str:
    text = Path(path).read_text(errors="replace").strip()
    return text[-n:]


def drive(proc, lines, results: dict[str, Any], pending: list[str], deadline: float, err) -> None:
    """Read one worker's messages into ``results`` until it ends or overruns a case's budget
    (then it is killed and that case is recorded as ``skipped: time``)."""
    current, case_end = None, deadline
    while True:
        wait = max(0.1, case_end - time.time() + GRACE_S)
        try:
            msg = lines.get(timeout=wait)
        except queue.Empty:
            proc.kill()
            proc.wait()
            if current is not None:
                results[current] = {"skipped": "time", "note": "killed after its budget"}
                pending.remove(current)
            return
        if msg is None:
            proc.wait()
            if current is not None:
                results[current] = {"error": f"worker exited {proc.returncode}: {_tail(err.name)}"}
                pending.remove(current)
            return
        if msg["event"] == "start":
            current, case_end = msg["case"], time.time() + msg["budget_s"]
        else:
            results[msg["case"]] = msg["result"]
            pending.remove(msg["case"])
            current, case_end = None, deadline


def step_time(sizes: Sizes, device: torch.device, deadline: float) -> dict[str, Any]:
    """The ``step_time`` section: `STEP_CASES` in worker processes (a new one after a kill or a
    crash), then the ratios to both native steps."""
    t0 = time.time()
    results: dict[str, Any] = {}
    pending = list(STEP_CASES)
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as err:
        while pending and deadline - time.time() > sizes.min_case_s:
            before = len(pending)
            proc, lines = _spawn(pending, sizes, device, deadline, err)
            drive(proc, lines, results, pending, deadline, err)
            if len(pending) == before:  # the worker died before its first case: say why, stop
                for case in pending:
                    results[case] = {"error": f"step worker failed: {_tail(err.name)}"}
                pending.clear()
    for case in pending:
        results[case] = {"skipped": "time"}
    return {
        "model": {**sizes.gpt, "vocab_size": 256, "batch": sizes.batch},
        "method": f"median of up to {sizes.iters} steps after {sizes.warmup} warm-up steps; "
        "clip 1.0; native: torch's own step, recipes: the lab's TrainStep; TF32 off",
        "cases": results,
        "ratios": step_ratios(results),
        "seconds": round(time.time() - t0, 1),
    }


def step_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each timed case's median over the native bf16 and native fp32 medians (None when either
    side was not timed), with the issue's target where it has one."""
    base = {k: results.get(f"native-{k}", {}).get("median_ms") for k in ("bf16", "fp32")}
    out: dict[str, Any] = {}
    for case, rec in results.items():
        ms = rec.get("median_ms")
        r: dict[str, Any] = {
            f"vs_native_{k}": (round(ms / b, 3) if ms and b else None) for k, b in base.items()
        }
        if case in STEP_TARGETS:
            r["target_vs_native_fp32"] = STEP_TARGETS[case]
            r["meets_target"] = (
                None if r["vs_native_fp32"] is None else r["vs_native_fp32"] <= STEP_TARGETS[case]
            )
        out[case] = r
    return out


# ============================================================================ distributed
DIST_CASES = (("ddp", False, False), ("fsdp", True, False), ("fsdp-fp8-allgather", True, True))


def distributed(sizes: Sizes, device: torch.device, deadline: float) -> dict[str, Any]:
    """The ``distributed`` section: one torchrun rank (``--standalone --nproc-per-node 1``) joins
    the process group the lab's way (`fp8lab.distributed.runtime.init_from_env`: NCCL on LOCAL_RANK's GPU
    on CUDA, gloo on the CPU) and trains three steps of the lab's GPT under te-delayed (amax group
    world) with DDP, FSDP2 and FSDP2 with the FP8 all-gather. More ranks: not measured here."""
    left = deadline - time.time()
    if left < sizes.min_case_s:
        return {"skipped": "time"}
    spec = {"device": str(device), "sizes": _sizes_json(sizes)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += [str(Path(__file__).resolve()), "--_dist-worker", json.dumps(spec)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    CHILDREN.append(proc)
    try:
        out, err = proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its rank: the whole session it started
        proc.communicate()
        return {"skipped": "time", "budget_s": round(left, 1)}
    msgs = [
        json.loads(line[len(_WORKER_TAG) :])
        for line in out.splitlines()
        if line.startswith(_WORKER_TAG)
    ]
    if proc.returncode or not msgs:
        return {"error": f"torchrun exited {proc.returncode}: {err.strip()[-600:]}"}
    return msgs[-1]


def _sizes_json(sizes: Sizes) -> dict[str, Any]:
    return {**dataclasses.asdict(sizes), "quant_shapes": []}


def dist_worker(spec: dict[str, Any]) -> None:
    """The torchrun rank of `distributed`: join, train each of `DIST_CASES`, leave, report."""
    from fp8lab.distributed.runtime import init_from_env, leave_group, resolve_torch_device

    sizes = Sizes(**spec["sizes"])
    device = resolve_torch_device(spec["device"])
    joined = "fp8lab.distributed.runtime.init_from_env"
    if init_from_env(device=spec["device"]) is None:
        # the lab joins a group only when WORLD_SIZE > 1; one rank joins here the same way
        joined = "gpu_check (init_from_env joins only when WORLD_SIZE > 1)"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    _no_tf32()
    d = torch.distributed
    out: dict[str, Any] = {
        "backend": d.get_backend(),
        "world": d.get_world_size(),
        "joined": joined,
    }
    out.update(rank=d.get_rank(), device=str(device), recipe="te-delayed", cases={})
    for name, fsdp, fp8 in DIST_CASES:
        try:
            out["cases"][name] = _dist_case(sizes, device, fsdp, fp8)
        except Exception as exc:
            out["cases"][name] = {"error": _error(exc)}
    _emit(out)
    leave_group()


def _dist_case(sizes: Sizes, device: torch.device, fsdp: bool, fp8: bool) -> dict[str, Any]:
    from fp8lab.distributed.ddp import DataParallel
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.loop import DataParallelHook
    from fp8lab.lab.parts import build_model, make_optimizer
    from fp8lab.lab.train import TrainConfig
    from fp8lab.step import TrainStep

    cfg = GPTConfig(**{**sizes.gpt, "n_layer": min(2, sizes.gpt["n_layer"])})
    recipe = fp8lab.get_recipe("te-delayed")
    model = build_model(cfg, recipe, seed=0).to(device)
    dp = DataParallel(model, "world", "fp32", fsdp=fsdp, fp8_allgather=fp8)
    opt = make_optimizer(model, recipe, TrainConfig(lr=1e-4))  # after sharding: FSDP's params
    hook = DataParallelHook(dp)
    step = TrainStep(hook.loss, opt, None, 1.0, [hook])
    idx = torch.randint(0, cfg.vocab_size, (sizes.batch, cfg.block_size + 1), generator=_gen(2))
    batch = (idx[:, :-1].to(device), idx[:, 1:].to(device))
    losses, times = [], []
    for i in range(3):
        t = time.perf_counter()
        losses.append(step(i, batch).loss_value)
        _sync(device)
        times.append(time.perf_counter() - t)
    rec = {"losses": losses, "finite": all(math.isfinite(v) for v in losses)}
    rec.update(
        step_ms=round(1e3 * statistics.median(times[1:]), 2), sharding=dp.state()["sharding"]
    )
    return rec


# ============================================================================== cast time
def cast_time(sizes: Sizes, device: torch.device, deadline: float) -> dict[str, Any]:
    """A cast of ``sizes.cast_n`` float32 onto e4m3 (nearest-even and stochastic) against a
    device copy of the same bytes: medians of 10 after 2 warm-ups."""
    if time.time() > deadline:
        return {"skipped": "time"}
    x = torch.randn(sizes.cast_n, generator=_gen(5)).to(device)
    out = torch.empty_like(x)

    def timed(fn: Callable[[], Any]) -> float:
        for _ in range(2):
            _timed(fn, device)
        return 1e3 * statistics.median(_timed(fn, device) for _ in range(10))

    try:
        copy = timed(lambda: out.copy_(x))
        rec: dict[str, Any] = {"elements": sizes.cast_n, "copy_ms": round(copy, 4)}
        for r in ("nearest_even", "stochastic"):
            ms = timed(lambda r=r: fp8lab.cast(x, "e4m3", r, generator=_gen(3), out=out))
            rec[f"cast_{r}_ms"] = round(ms, 4)
            rec[f"cast_{r}_vs_copy"] = round(ms / copy, 2)
        rec["target_vs_copy"] = 2.0
        return rec
    except Exception as exc:
        return {"error": _error(exc)}


# ============================================================================== the report
def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def environment(device: torch.device) -> dict[str, Any]:
    """The ``device``, ``torch``, ``fp8lab`` and ``date`` entries."""
    dev: dict[str, Any] = {
        "torch_device": str(device),
        "cpu": platform.processor() or platform.machine(),
    }
    dev["cpu_count"] = os.cpu_count()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev.update(name=p.name, capability=list(torch.cuda.get_device_capability(device)))
        dev.update(memory_gib=round(p.total_memory / 2**30, 1), count=torch.cuda.device_count())
    tch = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    status = _git("status", "--porcelain", "--untracked-files=no")
    # a copy of the tree without .git: the commit the caller names
    commit = _git("rev-parse", "HEAD") or os.environ.get("GPU_CHECK_COMMIT") or None
    lab = {"version": fp8lab.__version__, "commit": commit}
    lab["dirty"] = None if status is None else bool(status)
    return {
        "device": dev,
        "torch": tch,
        "fp8lab": lab,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def warnings(report: dict[str, Any]) -> list[str]:
    """What is reported but does not fail the run: elements that differ only in a NaN's sign or
    payload (a NaN made by the device's own arithmetic carries that device's bit pattern)."""
    n = report.get("bit_identity", {}).get("summary", {}).get("nan_bits_only", 0)
    return [f"bit_identity: {n} elements differ only in NaN sign/payload"] if n else []


def failures(report: dict[str, Any]) -> list[str]:
    """What makes the run fail (exit 1): mismatches beyond NaN sign/payload, bound violations,
    errors."""
    out = []
    bits = report.get("bit_identity", {}).get("summary")
    if bits:
        if bits["exact_mismatches"] > bits["nan_bits_only"]:
            n = bits["exact_mismatches"] - bits["nan_bits_only"]
            out.append(f"bit_identity: exact_mismatches = {n} (NaN sign/payload aside)")
        for key in ("bound_violations", "errors"):
            if bits[key]:
                out.append(f"bit_identity: {key} = {bits[key]}")
    for section in SECTIONS:
        if report.get(section, {}).get("error"):
            out.append(f"{section}: error")
    if report.get("scaled_mm", {}).get("errors"):
        out.append("scaled_mm: errors")
    for section in ("distributed", "step_time"):
        cases = report.get(section, {}).get("cases", {})
        errs = [c for c, r in cases.items() if "error" in r or r.get("finite") is False]
        if errs:
            out.append(f"{section}: errors in {', '.join(errs)}")
    return out


def markdown(report: dict[str, Any]) -> str:
    """The README's tables from a report: bit identity per group, the scaled_mm agreement and
    the step times, with the card, torch and date they came from."""
    dev, tch = report["device"], report["torch"]
    card = dev.get("name") or f"CPU ({dev.get('cpu')})"
    lines = [
        f"`python scripts/gpu_check.py` on {card}, torch {tch['version']} (CUDA {tch['cuda']}), "
        f"fp8lab {report['fp8lab']['commit'] or report['fp8lab']['version']}, {report['date']}:",
        "",
        "| bit identity | cases | elements | mismatches | NaN bits only | errors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    bits = report["bit_identity"]
    for group in ("cast", "quantize", "qmatmul"):
        t = bits.get(group, {}).get("summary")
        if t:
            lines.append(
                f"| {group} | {t['exact_cases'] + t['bounded_cases']} | {t['exact_elements']} | "
                f"{t['exact_mismatches']} | {t['nan_bits_only']} | {t['errors']} |"
            )
    if "summary" in bits:
        t = bits["summary"]
        lines.append(
            f"\nfp32 GEMMs: {t['bound_violations']} bound violations, largest difference "
            f"{t['max_ulp_fp32_gemm']} ulp."
        )
    mm = report["scaled_mm"]
    if "fast_accum_mismatches" in mm:
        lines.append(
            f"\n`h100` model vs `torch._scaled_mm(use_fast_accum=True)`: "
            f"{mm['fast_accum_mismatches']} of {mm['elements']} elements differ; "
            f"`use_fast_accum=False` fits promotion every {mm['best_interval']} "
            f"({mm['slow_accum_mismatches_by_interval'][mm['best_interval']]} differ)."
        )
    lines += _markdown_notes(report)
    steps = report["step_time"]
    if "cases" in steps:
        lines += [
            "",
            "| step | ms | / native bf16 | / native fp32 (TF32 off) |",
            "|---|---:|---:|---:|",
        ]
        for case, rec in steps["cases"].items():
            r = steps["ratios"][case]
            ms = rec.get("median_ms", rec.get("skipped") or "error")
            lines.append(f"| {case} | {ms} | {r['vs_native_bf16']} | {r['vs_native_fp32']} |")
    return "\n".join(lines) + "\n"


def _markdown_notes(report: dict[str, Any]) -> list[str]:
    """The markdown's lines on the cast time, the distributed run, and every section that was
    skipped, failed or cut off."""
    lines = []
    ct = report.get("cast_time", {})
    if "copy_ms" in ct:
        lines.append(
            f"\nCast of {ct['elements']} float32 onto e4m3: nearest-even "
            f"{ct['cast_nearest_even_ms']} ms ({ct['cast_nearest_even_vs_copy']}x a device copy, "
            f"{ct['copy_ms']} ms), stochastic {ct['cast_stochastic_ms']} ms "
            f"({ct['cast_stochastic_vs_copy']}x)."
        )
    dist = report.get("distributed", {})
    if "cases" in dist:
        done = [
            f"{name} {rec['step_ms']} ms/step" if rec.get("finite") else f"{name} FAILED"
            for name, rec in dist["cases"].items()
        ]
        lines.append(
            f"\nDistributed, {dist['world']} rank ({dist['backend']}), te-delayed: "
            + ", ".join(done)
            + "."
        )
    for name in SECTIONS:
        rec = report.get(name, {})
        why = rec.get("error") or rec.get("interrupted") or rec.get("skipped")
        if why and why != "not requested":
            lines.append(f"\n`{name}`: {why}.")
    if report.get("complete") is False:
        lines.append("\n**Incomplete run** (cut off): " + "; ".join(report.get("failures", [])))
    return lines


#: where each section's deadline lies, as a fraction of the budget (time a section leaves unused
#: passes on to the next)
SECTION_ENDS = {
    "bit_identity": 0.4,  # 108 s of 270: cold numba compiles (~25 s) and the Triton compiles too
    "scaled_mm": 0.5,  # 32 cases of 10 small GEMMs each: ~10 s
    "cast_time": 0.52,
    # torchrun's start, NCCL's init and 9 steps of a 2-layer GPT: 20-40 s, at least ~43 s here
    "distributed": 0.68,
    "step_time": 1.0,  # 8 cases in the ~86 s (or more) left
}


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` atomically (a temporary file beside it, then a rename): a
    reader never sees half a report (`fp8lab.lab.checkpoint.write_text`)."""
    from fp8lab.lab.checkpoint import write_text  # here: the lab's imports cost ~1.4 s

    write_text(path, json.dumps(report, indent=1, default=str) + "\n")


def finished(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with its ``failures`` and ``warnings``; a ``bit_identity`` cut off mid-group
    (the watchdog's snapshot) gets the summaries of the cases it holds."""
    bits = report.get("bit_identity", {})
    groups = [g for g in ("cast", "quantize", "qmatmul") if g in bits]
    for g in groups:
        bits[g].setdefault("summary", summarize(bits[g]["cases"]))
    if groups and "summary" not in bits:
        bits["summary"] = summarize([r for g in groups for r in bits[g]["cases"]])
    return {**report, "failures": failures(report), "warnings": warnings(report)}


class Watchdog:
    """Ends the run at ``deadline`` (epoch seconds) if it is still going: writes a snapshot of
    ``report`` to ``out`` with ``section`` (the one running) marked, kills `CHILDREN`, exits 1."""

    def __init__(self, report: dict[str, Any], out: Path, deadline: float) -> None:
        self.report, self.out, self.section = report, out, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(deadline,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _watch(self, deadline: float) -> None:
        if self._done.wait(max(0.0, deadline - time.time())):
            return
        for _ in range(20):  # the main thread may be changing the report: snapshot again
            try:
                snap = json.loads(json.dumps(self.report, default=str))
                break
            except (RuntimeError, ValueError):
                time.sleep(0.05)
        else:
            snap = {k: self.report[k] for k in ("device", "torch", "fp8lab", "date")}
        note = {"interrupted": "still running at the watchdog's deadline (budget + grace)"}
        snap[self.section] = {**snap.get(self.section, {}), **note}
        snap = finished(snap)
        snap["failures"].append(f"watchdog: {self.section} still running at the hard deadline")
        write_json(self.out, snap)
        for proc in CHILDREN:
            with contextlib.suppress(OSError):  # already gone
                if os.getpgid(proc.pid) == proc.pid:  # torchrun: its whole session
                    os.killpg(proc.pid, 9)
                else:
                    proc.kill()
        print(
            f"gpu_check: FAIL watchdog: {self.section} overran; wrote {self.out}", file=sys.stderr
        )
        os._exit(1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every requested section, in `SECTIONS` order, each by its deadline (`SECTION_ENDS`); the
    report is written to ``args.out`` after each section (``complete`` false until the end) and
    by a `Watchdog` at the budget plus `HARD_GRACE_S` if a section hangs."""
    sizes = SMOKE if args.smoke else FULL
    if args.budget_s:
        sizes = dataclasses.replace(sizes, budget_s=args.budget_s)
    device = torch.device(args.device)
    t0 = time.time()
    report = environment(device)
    report.update(mode="smoke" if args.smoke else "full", complete=False)
    dog = Watchdog(report, args.out, t0 + sizes.budget_s + HARD_GRACE_S)
    fns = {
        "bit_identity": bit_identity,
        "scaled_mm": scaled_mm,
        "cast_time": cast_time,
        "distributed": distributed,
        "step_time": step_time,
    }
    for name in SECTIONS:
        if name not in args.sections:
            report[name] = {"skipped": "not requested"}
            continue
        report["running"] = dog.section = name
        write_json(args.out, report)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the worker processes share the GPU's memory
        deadline = t0 + SECTION_ENDS[name] * sizes.budget_s
        try:
            if name == "bit_identity":  # filled case by case: the watchdog writes what it holds
                report[name] = {}
                bit_identity(sizes, device, deadline, into=report[name])
            else:
                report[name] = fns[name](sizes, device, deadline)
        except Exception as exc:  # one section's failure must not lose the others' results
            report[name] = {**report.get(name, {}), "error": _error(exc)}
        if args.progress:
            print(f"gpu_check: {name} done at {time.time() - t0:.0f} s", file=sys.stderr)
    # was the Triton fused-accumulator kernel verified (its probe) and so used on this device
    report["triton_fused"] = fused_triton.triton_status(device)
    report.pop("running", None)
    report.update(complete=True, seconds=round(time.time() - t0, 1))
    dog.stop()
    return finished(report)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, help="the JSON file to write (required)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (the tests; CPU by default)")
    p.add_argument(
        "--device",
        default=None,
        help="torch device of the candidate side (default: cuda; cpu with --smoke)",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {', '.join(SECTIONS)}",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for the whole run (default 270; smoke 600)",
    )
    p.add_argument("--progress", action="store_true", help="print each section's end on stderr")
    p.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="with --out: also write the report's tables (markdown, for the README) to this "
        "file; without --out: print the tables of this existing report (JSON) instead of running",
    )
    p.add_argument("--_step-worker", dest="step_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_dist-worker", dest="dist_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step_worker is not None or args.dist_worker is not None:
        return args
    if args.markdown and args.out is None:
        return args
    if args.out is None:
        p.error("--out PATH is required")
    for flag, path in (("--out", args.out), ("--markdown", args.markdown)):
        if path is not None and path.exists():
            p.error(f"{flag} {path}: the file exists; gpu_check never overwrites a result")
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(
            f"--device {args.device}: torch {torch.__version__} sees no CUDA device here (use --smoke for the CPU)"
        )
    if args.budget_s is not None and args.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.step_worker is not None:
        step_worker(json.loads(args.step_worker))
        return 0
    if args.dist_worker is not None:
        dist_worker(json.loads(args.dist_worker))
        return 0
    if args.markdown and args.out is None:
        try:
            report = json.loads(args.markdown.read_text())
            print(markdown(report), end="")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(
                f"gpu_check: --markdown {args.markdown}: not a gpu_check report ({exc})",
                file=sys.stderr,
            )
            return 2
        return 0
    report = run(args)
    write_json(args.out, report)
    if args.markdown:
        args.markdown.write_text(markdown(report))
    for line in report["failures"]:
        print(f"gpu_check: FAIL {line}", file=sys.stderr)
    for line in report["warnings"]:
        print(f"gpu_check: warning: {line}", file=sys.stderr)
    print(f"gpu_check: wrote {args.out} ({report['seconds']} s)", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
