"""The roofline: fp8lab's counted passes and GEMMs priced on a device.

GEMM time = max(FLOPs / (peak x efficiency(class)), bytes / (bandwidth x bandwidth_efficiency))
+ one kernel latency; quantization kernels are memory-bound: bytes / (bandwidth x
bandwidth_efficiency) + one kernel latency per launch. GEMM classes: ``bf16``/``fp16``, ``fp8``
(per-tensor scales), ``fp8_block`` (scales varying along K: DeepSeek-V3 / TE Float8BlockScaling),
``mxfp8``, ``nvfp4``. Efficiencies are calibrated per architecture on Transformer Engine's
published timings (`fp8lab.cost.calibration`).

How counted events become kernels (the hardware's fused kernels, as Transformer Engine runs them):

* high-precision sources are bf16 (``SOURCE_BYTES``; fp16 for an fp16 model): rounding to the
  GEMM's 16-bit dtype is free;
* ``amax``: one kernel reading the tensor; ``cast``: one kernel reading it and writing values and
  scales;
* ``transpose``: only on devices whose FP8 GEMMs need K-major operands (Hopper); written by the
  tensor's cast kernel (TE's fused cast-transpose: the write only) when the step casts it;
* a GEMM with one bf16/fp16 cell (`fp8lab.recipe.GemmConfig.high_precision_roles`) runs in 16
  bits: its quantized operand is dequantized by one kernel (read values + scales, write 2 bytes
  per element; no transpose needed) and the GEMM is priced as a bf16/fp16 GEMM;
* ``retile_from_source``: the other tiling written by the same cast kernel (TE quantizes rowwise and
  columnwise from one read): the write only; ``retile_from_quantized``: a kernel reading the
  quantized values and scales and writing the new ones (DeepSeek-V3);
* ``scale_update``: delayed scaling's amax-history update, one fused multi-tensor kernel per
  step in TE: not priced per tensor (counted only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fp8lab.cost.counting import (
    GEMM_AB,
    GEMM_DIMS,
    GemmEvent,
    StepCounts,
    count_linear_step,
    scale_bytes,
)
from fp8lab.cost.devices import Device, get_device
from fp8lab.cost.moe import dispatch_passes, moe_blocks, rows_of, wire_traffic
from fp8lab.formats import get_format
from fp8lab.recipe import Recipe, get_recipe
from fp8lab.recipe.dpa import DPAConfig
from fp8lab.recipe.moe import MoEConfig

__all__ = [
    "SCENARIOS",
    "SOURCE_BYTES",
    "GemmCost",
    "KernelCost",
    "LayerCost",
    "TransformerShape",
    "UnpriceableError",
    "gemm_class",
    "layer_recipe",
    "predict_or_reason",
    "predict_step_ms",
    "price_layer",
    "price_linears",
]

#: bytes per element of the high-precision tensors the GPU quantizes (bf16 activations/weights)
SOURCE_BYTES = 2
#: bytes per element of a GEMM's output (bf16)
OUTPUT_BYTES = 2
#: ``training``: one fwd+bwd step per Linear (each tensor quantized as fp8lab does);
#: ``te-benchmark``: TE's benchmark_gemm.py, every GEMM shape timed as one te.Linear forward
SCENARIOS = ("training", "te-benchmark")


class UnpriceableError(ValueError):
    """The recipe cannot be priced. ``device_limit``: this device lacks the tensor cores (another
    device may run the recipe: mxfp8 on Hopper); otherwise no device can (HiF8, fp32 GEMMs)."""

    def __init__(self, message: str, device_limit: bool = False) -> None:
        super().__init__(message)
        self.device_limit = device_limit


@dataclass(frozen=True)
class TransformerShape:
    """The Linear layers of one transformer layer: ``qkv`` (hidden -> qkv_out, default 3 x
    hidden), ``proj`` (hidden -> hidden), ``up`` (hidden -> up_out, default ffn; 2 x ffn for a
    fused SwiGLU gate+up), ``down`` (ffn -> hidden), on ``tokens`` tokens; ``layers`` layers."""

    hidden: int = 4096
    ffn: int = 16384
    layers: int = 24
    tokens: int = 15872
    qkv_out: int | None = None
    up_out: int | None = None
    #: attention (priced only when both are given): query heads and sequence length; ``tokens``
    #: is then ``tokens / seq_len`` sequences. K and V have ``(qkv_out - hidden) / 2`` features
    #: (grouped-query attention), causal masking
    heads: int | None = None
    seq_len: int | None = None

    def __post_init__(self) -> None:
        optional = ("qkv_out", "up_out", "heads", "seq_len")
        for name in ("hidden", "ffn", "layers", "tokens", *optional):
            v = getattr(self, name)
            if v is None and name in optional:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if (self.heads is None) != (self.seq_len is None):
            raise ValueError("attention needs both heads and seq_len (or neither)")
        if self.heads is not None and self.seq_len is not None:
            if self.hidden % self.heads:
                raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
            if self.tokens % self.seq_len:
                raise ValueError(
                    f"tokens {self.tokens} is not a whole number of sequences of {self.seq_len}"
                )
            kv = (self.qkv_out or 3 * self.hidden) - self.hidden
            if kv <= 0 or kv % 2 or (kv // 2) % (self.hidden // self.heads):
                raise ValueError(
                    f"qkv_out {self.qkv_out} leaves no whole K and V heads of "
                    f"{self.hidden // self.heads} features"
                )

    @property
    def kv_features(self) -> int:
        """Features of K (and of V): ``(qkv_out - hidden) / 2``."""
        return ((self.qkv_out or 3 * self.hidden) - self.hidden) // 2

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of the layer's Linears."""
        h = self.hidden
        return [
            ("qkv", h, self.qkv_out or 3 * h),
            ("proj", h, h),
            ("up", h, self.up_out or self.ffn),
            ("down", self.ffn, h),
        ]


@dataclass(frozen=True)
class KernelCost:
    """One priced pass: ``tensor`` (``linear.role``), ``kind`` (the counted event, or ``rht``:
    TE's separate Hadamard kernel where the fused one does not apply), bytes read and written by
    precision, kernel launches, time in ms; ``flops``: Hadamard-transform FLOPs on the tensor
    cores, ``simt_ops``: CUDA-core operations (4over6) done inside it."""

    tensor: str
    gemm: str
    kind: str
    read: dict[str, int]
    written: dict[str, int]
    launches: int
    ms: float
    flops: int = 0
    simt_ops: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())


@dataclass(frozen=True)
class GemmCost:
    """One priced GEMM: ``name`` (``linear.gemm``), M x K x N, class, FLOPs, bytes, promotion
    FMAs, time in ms and what bounds it (``compute``/``memory``)."""

    name: str
    m: int
    k: int
    n: int
    cls: str
    flops: int
    bytes: int
    promotion_fmas: int
    ms: float
    bound: str


@dataclass
class LayerCost:
    """One transformer layer under one recipe on one device (GEMMs and their quantization)."""

    recipe: str
    device: str
    scenario: str
    shape: TransformerShape | None
    gemms: list[GemmCost] = field(default_factory=list)
    kernels: list[KernelCost] = field(default_factory=list)
    #: MoE block -> bytes its token all-to-alls send per step in the recipe's ``[moe]
    #: dispatch`` format (`fp8lab.cost.moe.wire_traffic`; empty without MoE blocks)
    wire_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def gemm_ms(self) -> float:
        return sum((g.ms for g in self.gemms), 0.0)

    @property
    def quantize_ms(self) -> float:
        return sum((k.ms for k in self.kernels), 0.0)

    @property
    def layer_ms(self) -> float:
        return self.gemm_ms + self.quantize_ms

    @property
    def bytes(self) -> int:
        """Bytes moved by the layer's GEMMs and quantization kernels."""
        return sum(g.bytes for g in self.gemms) + sum(k.bytes for k in self.kernels)

    def pass_ms(self, gemm: str) -> float:
        """Time of one GEMM kind (fprop/dgrad/wgrad) over the layer, its kernels included."""
        g = sum(c.ms for c in self.gemms if c.name.endswith("." + gemm))
        return g + sum(k.ms for k in self.kernels if k.gemm == gemm)

    def ledger(self) -> dict[str, dict[str, int]]:
        """Per tensor: bytes read and written by precision (``read:bf16``, ``written:fp8``...)."""
        out: dict[str, dict[str, int]] = {}
        for k in self.kernels:
            row = out.setdefault(k.tensor, {})
            for p, b in k.read.items():
                row[f"read:{p}"] = row.get(f"read:{p}", 0) + b
            for p, b in k.written.items():
                row[f"written:{p}"] = row.get(f"written:{p}", 0) + b
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("layer_ms", "gemm_ms", "quantize_ms", "bytes")}


# --------------------------------------------------------------------------- classes
def _fp8_like(fmt: str) -> bool:
    return fmt in ("e4m3", "e5m2")


def gemm_class(g: GemmEvent) -> str:
    """The tensor-core class of a counted GEMM; `UnpriceableError` for formats no NVIDIA GPU
    multiplies natively (HiF8, fp32 GEMMs, 6-bit or mixed high/low precision)."""
    fa, fb = g.fmt_a, g.fmt_b
    if fa in ("bf16", "fp16") and fa == fb:
        return fa
    mixed = _mixed_high(g)
    if mixed is not None:  # one cell switched to 16 bits: the other operand is dequantized
        return mixed
    if "fp32" in (fa, fb):
        raise UnpriceableError(
            f"{g.gemm}: fp32 GEMMs are not priced (no calibrated FP32/TF32 efficiency)"
        )
    if "hif8" in (fa, fb):
        raise UnpriceableError(
            f"{g.gemm}: HiF8 operands have no tensor cores on NVIDIA GPUs (Ascend format)"
        )
    if g.gran_a is None or g.gran_b is None:
        raise UnpriceableError(
            f"{g.gemm}: one quantized and one high-precision operand ({fa} x {fb})"
        )
    rules = {g.scaling_a, g.scaling_b}
    if fa == fb == "e2m1" and rules == {"nvfp4"}:
        return "nvfp4"
    if all(_fp8_like(f) for f in (fa, fb)):
        if all(r is not None and r.startswith("mx") for r in rules):
            return "mxfp8"
        if g.gran_a == (-1, -1) and g.gran_b == (-1, -1):
            return "fp8"
        if not any(r is not None and r.startswith("mx") for r in rules):
            return "fp8_block"
    raise UnpriceableError(f"{g.gemm}: no tensor-core GEMM for {fa} x {fb} with these scales")


def _mixed_high(g: GemmEvent) -> str | None:
    """The 16-bit format of a GEMM with one quantized and one bf16/fp16 operand (a single
    high-precision cell, `fp8lab.recipe.GemmConfig.high_precision_roles`), else None. No tensor
    core multiplies FP8 by bf16: the quantized operand is dequantized to that format (one
    memory-bound kernel, `_dequantize_kernels`) and the GEMM runs in 16 bits."""
    for hp, hp_gran, q_gran in ((g.fmt_a, g.gran_a, g.gran_b), (g.fmt_b, g.gran_b, g.gran_a)):
        if hp in ("bf16", "fp16") and hp_gran is None and q_gran is not None:
            return hp
    return None


def _efficiency(dev: Device, cls: str, recipe: str) -> float:
    if cls not in dev.formats:
        raise UnpriceableError(
            f"recipe {recipe!r} needs {cls} GEMMs, which {dev.name} ({dev.architecture}) "
            f"does not have; {dev.name} runs: {', '.join(dev.formats)}",
            device_limit=True,
        )
    own = dev.gemm_efficiency(cls)
    if own is not None:
        return own
    # fp16 runs at bf16's rate; Blackwell runs FP8 block scaling as MXFP8 (TE emulates it)
    fallback = {"fp16": "bf16", "fp8_block": "mxfp8"}.get(cls)
    if fallback is not None and (cls != "fp8_block" or dev.architecture == "blackwell"):
        eff = dev.gemm_efficiency(fallback)
        if eff is not None:
            return eff
    raise UnpriceableError(
        f"no calibrated {cls} efficiency for {dev.name} (calibration {dev.efficiencies_from!r})"
    )


# --------------------------------------------------------------------------- pricing
def _bits(fmt: str) -> float:
    return get_format(fmt).bits / 8


def _operand_bytes(fmt: str, gran: tuple[int, int] | None, rule: str | None, r: int, c: int) -> int:
    return int(r * c * _bits(fmt)) + scale_bytes(gran, rule, (r, c))


def _price_gemm(g: GemmEvent, name: str, dev: Device, recipe: str) -> GemmCost:
    try:
        cls = gemm_class(g)
    except UnpriceableError as exc:  # name the recipe (and layer) the GEMM belongs to
        raise UnpriceableError(f"recipe {recipe!r}: {exc}", exc.device_limit) from None
    eff = _efficiency(dev, cls, recipe)
    # operands as stored: their blocks refer to the natural layout
    (ra, ca), (rb, cb) = g.natural_shapes()
    if cls in ("bf16", "fp16"):  # a mixed GEMM reads the dequantized 16-bit copy
        a, b = ra * ca * 2, rb * cb * 2
    else:
        a = _operand_bytes(g.fmt_a, g.gran_a, g.scaling_a, ra, ca)
        b = _operand_bytes(g.fmt_b, g.gran_b, g.scaling_b, rb, cb)
    nbytes = a + b + g.m * g.n * OUTPUT_BYTES
    t_compute = g.flops / (dev.peak(cls) * eff)
    t_memory = nbytes / (dev.bandwidth * dev.bandwidth_efficiency)
    ms = (max(t_compute, t_memory) + dev.kernel_us * 1e-6) * 1e3
    bound = "compute" if t_compute >= t_memory else "memory"
    return GemmCost(name, g.m, g.k, g.n, cls, g.flops, nbytes, g.promotion_fmas, ms, bound)


def _prec(fmt: str | None) -> str:
    if fmt is None:
        return "bf16"
    return {"e4m3": "fp8", "e5m2": "fp8", "e2m1": "fp4", "hif8": "fp8"}.get(fmt, fmt)


#: TE's random Hadamard transform: a 16 x 16 matrix applied to 16-element vectors along the
#: token axis of the wgrad operands (TE ``NVFP4BlockScaling``; `fp8lab.rht16`)
RHT_POINTS = 16
#: CUDA-core FP32 operations per element that 4over6 adds to an NVFP4 cast (arXiv 2512.02010;
#: TE ``nvfp4_4over6``): the second candidate (map the block amax to 4 instead of 6) scaled and
#: rounded (2), both candidates dequantized (2), their errors against the source accumulated
#: (subtract, absolute value or square, add: 3 each) -- a count of the algorithm's arithmetic,
#: not a measurement
FOUR_OVER_SIX_OPS = 10


def hadamard_flops(points: int) -> int:
    """FLOPs per element of a Hadamard transform over ``points``-element vectors run as a matrix
    product (TE runs the RHT on the tensor cores): ``2 * points`` (a multiply and an add per
    matrix entry)."""
    return 2 * points


def rht_fused(dev: Device, shape: tuple[int, int]) -> bool:
    """Whether TE fuses the RHT into the NVFP4 cast (``NVFP4Quantizer::
    is_eligible_for_rht_cast_fusion``, TE ``pytorch/csrc/quantizer.cpp``): Blackwell (SM100 to
    SM110), a bf16 tensor with rows a multiple of 64 and columns of 128. Otherwise TE writes
    RHT(x^T) in bf16 with a separate kernel and quantizes that copy in another."""
    rows, cols = shape
    return dev.architecture == "blackwell" and rows % 64 == 0 and cols % 128 == 0


def _kernel_seconds(dev: Device, nbytes: int, launches: int, flops: int, simt_ops: int) -> float:
    """A quantization kernel's time: its memory time, or its arithmetic where that is longer
    (transforms on the tensor cores at bf16's calibrated rate, 4over6 on the CUDA cores at the
    table's FP32 peak), plus the launches' latency."""
    t = nbytes / (dev.bandwidth * dev.bandwidth_efficiency)
    if flops:
        t = max(t, flops / (dev.peak("bf16") * (dev.gemm_efficiency("bf16") or 1.0)))
    if simt_ops:
        rate = dev.simt_flops()
        if rate is None:
            raise UnpriceableError(f"{dev.name}: no FP32 CUDA-core peak to price 4over6")
        t = max(t, simt_ops / rate)
    return t + launches * dev.kernel_us * 1e-6


def _price_kernels(counts: StepCounts, lin: str, dev: Device) -> list[KernelCost]:
    out = []
    cast_roles = {e.role for e in counts.events if e.kind == "cast"}
    # roles whose wgrad copy is Hadamard-transformed: TE's amax kernel transforms too
    rht_roles = {e.role for e in counts.events if e.rht}
    # a mixed GEMM dequantizes its quantized operand from the stored copy, in either layout
    mixed = {g.gemm for g in counts.gemms if _mixed_high(g) is not None}
    tensor_amax: set[str] = set()  # roles whose whole-tensor amax is already priced this step
    groups: list[str] = []  # the kernel each piece belongs to (see `_timed`)
    for e in counts.events:
        if e.kind == "amax" and (e.scaling == "nvfp4" or e.granularity == (-1, -1)):
            if e.role in tensor_amax:
                continue  # the same tensor's amax again (NVFP4's second copy): computed once
            tensor_amax.add(e.role)
        n = counts.elements(e)
        shape = counts.shape(e)
        read: dict[str, int] = {}
        written: dict[str, int] = {}
        launches = 1
        flops = simt = 0
        vals = int(n * _bits(e.fmt)) if e.fmt is not None else 0
        sb = scale_bytes(e.granularity, e.scaling, shape) if e.granularity else 0
        if e.kind in ("cast", "retile_from_source", "retile_from_quantized"):
            if e.hadamard:
                flops += hadamard_flops(e.hadamard) * n
            if e.four_over_six:
                simt += FOUR_OVER_SIX_OPS * n
        if e.kind == "round":
            if e.fmt in ("bf16", "fp16"):
                continue  # a 16-bit GEMM's model keeps its tensors in that dtype already
            read, written = {"bf16": n * SOURCE_BYTES}, {e.fmt: n * 4}
        elif e.kind == "amax":
            read = {"bf16": n * SOURCE_BYTES}
            if e.role in rht_roles:  # TE's hadamard_transform_amax: RHT(x^T)'s amax too
                flops += hadamard_flops(RHT_POINTS) * n
        elif e.kind == "cast":
            read = {"bf16": n * SOURCE_BYTES}
            written = {_prec(e.fmt): vals, "scales": sb}
        elif e.kind == "transpose":
            if not dev.fp8_needs_k_major or e.gemm in mixed:
                continue
            written = {_prec(e.fmt): vals}
            if e.role in cast_roles:
                launches = 0  # fused cast-transpose
            else:
                read = {_prec(e.fmt): vals}
        elif e.kind == "retile_from_source":
            written = {_prec(e.fmt): vals, "scales": sb}
            if e.role in cast_roles and not (e.rht and not rht_fused(dev, shape)):
                launches = 0  # rowwise + columnwise from one read
                if e.rht:  # the fused row-cast + column-RHT-cast kernel transforms in place
                    flops += hadamard_flops(RHT_POINTS) * n
            elif e.rht:  # unfused: RHT(x^T) written in bf16, then quantized by its own kernel
                hp = n * SOURCE_BYTES
                out.append(KernelCost(f"{lin}.{e.role}", e.gemm or "fprop", "rht",
                                      {"bf16": hp}, {"bf16": hp}, 1, 0.0,
                                      flops=hadamard_flops(RHT_POINTS) * n))  # fmt: skip
                groups.append(f"{len(out)}:rht")
                read = {"bf16": hp}
            else:
                read = {"bf16": n * SOURCE_BYTES}
        elif e.kind == "retile_from_quantized":
            src_gran = (e.granularity[1], e.granularity[0]) if e.granularity else None
            read = {_prec(e.fmt): vals, "scales": scale_bytes(src_gran, e.scaling, shape)}
            written = {_prec(e.fmt): vals, "scales": sb}
        else:  # scale_update: one fused multi-tensor kernel per step in TE
            continue
        gemm = e.gemm or "fprop"
        # passes fused into the tensor's cast kernel (launches 0) share its time: one kernel
        group = f"cast:{e.role}" if e.kind == "cast" or launches == 0 else f"{len(out)}"
        out.append(KernelCost(f"{lin}.{e.role}", gemm, e.kind, read, written, launches, 0.0,
                              flops=flops, simt_ops=simt))  # fmt: skip
        groups.append(group)
    return _timed(out, groups, dev)


def _timed(pieces: list[KernelCost], groups: list[str], dev: Device) -> list[KernelCost]:
    """Time each kernel: the pieces of one group run as one kernel (a cast with the transposes
    and second tilings it writes), memory-bound unless its arithmetic takes longer; each piece
    gets its own memory and launch time, and the group's first piece any arithmetic excess."""
    out = list(pieces)
    for g in dict.fromkeys(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        ks = [pieces[i] for i in idx]
        total = _kernel_seconds(dev, sum(k.bytes for k in ks), sum(k.launches for k in ks),
                                sum(k.flops for k in ks), sum(k.simt_ops for k in ks))  # fmt: skip
        own = [_kernel_seconds(dev, k.bytes, k.launches, 0, 0) for k in ks]
        excess = total - sum(own)
        for j, (i, k) in enumerate(zip(idx, ks, strict=True)):
            out[i] = replace(k, ms=(own[j] + (excess if j == 0 else 0.0)) * 1e3)
    return out


def _dequantize_kernels(counts: StepCounts, lin: str, dev: Device) -> list[KernelCost]:
    """A mixed GEMM's quantized operand dequantized to 16 bits: read values + scales, write
    2 bytes per element (one kernel)."""
    out = []
    for g in counts.gemms:
        hp = _mixed_high(g)
        if hp is None:
            continue
        a_role, b_role = GEMM_AB[g.gemm]
        (ra, ca), (rb, cb) = g.natural_shapes()
        if g.gran_a is not None:
            role, fmt, gran, rule, (r, c) = a_role, g.fmt_a, g.gran_a, g.scaling_a, (ra, ca)
        else:
            role, fmt, gran, rule, (r, c) = b_role, g.fmt_b, g.gran_b, g.scaling_b, (rb, cb)
        read = {_prec(fmt): int(r * c * _bits(fmt)), "scales": scale_bytes(gran, rule, (r, c))}
        written = {hp: r * c * 2}
        nbytes = sum(read.values()) + sum(written.values())
        sec = nbytes / (dev.bandwidth * dev.bandwidth_efficiency) + dev.kernel_us * 1e-6
        out.append(KernelCost(f"{lin}.{role}", g.gemm, "dequantize", read, written, 1, sec * 1e3))
    return out


#: TE's benchmark times a te.Linear forward per GEMM shape: both operands quantized, the input's
#: column-wise copy made for backward (the weight's is not: the input does not require grad)
_BENCH_KEEP = [("fprop", "input"), ("fprop", "weight"), ("wgrad", "input")]


def _bench_dims(gemm: str, t: int, i: int, o: int) -> tuple[int, int, int]:
    """(M, K, N) of the GEMM ``gemm`` of a Linear i -> o on t tokens."""
    d = {"T": t, "I": i, "O": o}
    m, k, n = (d[s] for s in GEMM_DIMS[gemm])
    return m, k, n


_COUNTS: dict[str, StepCounts] = {}


def _counts(recipe: Recipe) -> StepCounts:
    # a Linear's step does not depend on the attention or MoE options: count it once
    if recipe.attention or not recipe.dpa.is_default or not recipe.moe.is_default:
        recipe = recipe.replace(attention=False, dpa=DPAConfig(), moe=MoEConfig())
    key = recipe.fingerprint()
    if key not in _COUNTS:
        _COUNTS[key] = count_linear_step(recipe)
    return _COUNTS[key]


def price_layer(
    recipe: Recipe | str,
    device: Device | str,
    shape: TransformerShape | None = None,
    scenario: str = "training",
) -> LayerCost:
    """One transformer layer's GEMMs and quantization under ``recipe`` on ``device``.

    ``scenario``: ``training`` (each Linear's forward + backward step as fp8lab counts it) or
    ``te-benchmark`` (Transformer Engine's benchmark_gemm.py autocast mode: each of the 12 GEMM
    shapes timed as an independent te.Linear forward, quantizing both operands each time).
    Raises `UnpriceableError` (a ValueError) when the device cannot run the recipe's GEMMs.
    """
    shape = shape or TransformerShape()
    return price_linears(recipe, device, shape.linears(), shape.tokens, scenario, shape)


def price_linears(
    recipe: Recipe | str,
    device: Device | str,
    linears: list[tuple[str, int, int]],
    tokens: int,
    scenario: str = "training",
    shape: TransformerShape | None = None,
    *,
    experts: Mapping[str, tuple[int, int]] | None = None,
) -> LayerCost:
    """Like `price_layer` for any Linear layers: ``linears`` = ``[(name, in_features,
    out_features)]``, each run on ``tokens`` tokens (e.g. a model's converted Linears).
    ``experts``: the mixture-of-experts Linears among them, ``name -> (n_experts, top_k)``
    (`fp8lab.cost.shapes.expert_routing`), each run on its padded share of the routed tokens
    (`fp8lab.cost.moe.expert_rows`)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    rec = get_recipe(recipe)
    dev = get_device(device) if isinstance(device, str) else device
    cost = LayerCost(rec.name, dev.name, scenario, shape)
    if scenario == "training":
        _price_moe(cost, rec, dev, linears, tokens, experts)
        if shape is not None and shape.heads is not None:
            _price_attention(cost, rec, dev, shape)
    for lin, i, o in linears:
        lrec, label = layer_recipe(rec, lin)
        base = _counts(lrec)
        if scenario == "training":
            c = base.scaled(T=rows_of(lin, tokens, experts, lrec), I=i, O=o)
            cost.gemms += [_price_gemm(g, f"{lin}.{g.gemm}", dev, label) for g in c.gemms]
            cost.kernels += _price_kernels(c, lin, dev) + _dequantize_kernels(c, lin, dev)
            continue
        for gemm in ("fprop", "dgrad", "wgrad"):
            m, k, n = _bench_dims(gemm, tokens, i, o)
            c = base.scaled(T=m, I=k, O=n).select(_BENCH_KEEP, ("fprop",))
            for kc in _price_kernels(c, f"{lin}.{gemm}", dev):
                cost.kernels.append(replace(kc, gemm=gemm))
            cost.gemms.append(_price_gemm(c.gemms[0], f"{lin}.{gemm}", dev, label))
    return cost


def _price_moe(
    cost: LayerCost,
    rec: Recipe,
    dev: Device,
    linears: list[tuple[str, int, int]],
    tokens: int,
    experts: Mapping[str, tuple[int, int]] | None,
) -> None:
    """The ``[moe] dispatch`` wire format of each MoE block among ``linears``: its quantize and
    dequantize passes as memory-bound kernels (`fp8lab.cost.moe.dispatch_passes`; none for
    BF16) and the bytes its all-to-alls send (`LayerCost.wire_bytes`)."""
    fmt = getattr(getattr(rec, "moe", None), "dispatch", "bf16")
    for block, (d_model, top_k) in moe_blocks(linears, experts).items():
        cost.wire_bytes[block] = wire_traffic(tokens, d_model, top_k, fmt)["total"]
        for p in dispatch_passes(tokens, d_model, top_k, fmt):
            nbytes = p["read"] + p["written"]
            sec = _kernel_seconds(dev, nbytes, 1, 0, 0)
            read = {"bf16" if p["pass"].endswith("_quantize") else "fp8": p["read"]}
            written = {"fp8" if p["pass"].endswith("_quantize") else "bf16": p["written"]}
            cost.kernels.append(KernelCost(f"{block}.{p['pass'].split('_')[0]}", p["step"],
                                           p["pass"], read, written, 1, sec * 1e3))  # fmt: skip


#: attention's matmuls per layer and step as flash attention runs them: the forward's Q K^T
#: and P V; the backward recomputes Q K^T, then dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q
ATTENTION_GEMMS = (
    ("attn.qk", "fprop"), ("attn.pv", "fprop"), ("attn.qk_recompute", "dgrad"),
    ("attn.dp", "dgrad"), ("attn.dv", "wgrad"), ("attn.dq", "dgrad"), ("attn.dk", "wgrad"),
)  # fmt: skip


def _price_attention(cost: LayerCost, rec: Recipe, dev: Device, shape: TransformerShape) -> None:
    """Dot-product attention of one layer (``shape.heads``, ``shape.seq_len``): the seven
    matmuls of `ATTENTION_GEMMS`, each ``2 * tokens * seq_len * hidden`` FLOPs halved by the
    causal mask (flash attention skips masked tiles), compute-bound at the class's calibrated
    efficiency (an assumption: no attention kernel is in the calibration; softmax's
    exponentials are not priced). BF16 unless the recipe's ``attention`` is on: then Transformer
    Engine's FP8 attention (`fp8lab.nn.dpa.dpa_plan`): path ``te`` runs all seven in FP8
    (``mxfp8`` scaling as MXFP8, else per-tensor FP8), path ``fa`` the forward two only; its
    memory passes: Q, K, V cast from bf16 unless ``fp8_mha`` (they arrive in FP8), dO cast,
    O and dQKV dequantized to bf16 when they leave in FP8 without ``fp8_mha``, and one amax pass
    before each per-tensor current-scaled cast (S and dP stay inside the kernel)."""
    t, hid, kv = shape.tokens, shape.hidden, shape.kv_features
    flops = 2 * t * shape.seq_len * hid // 2  # causal: half the score matrix
    plan = None
    if rec.attention:
        from fp8lab.nn.dpa import dpa_plan

        plan = dpa_plan(rec)
    low = "mxfp8" if plan is not None and plan.scaling == "mxfp8" else "fp8"
    eb = 1 if plan is not None else 2  # bytes per element of Q, K, V, dO as the kernels read them
    for name, step in ATTENTION_GEMMS:
        fp8 = plan is not None and (plan.path == "te" or step == "fprop")
        cls = low if fp8 else "bf16"
        eff = _efficiency(dev, cls, rec.name)
        nbytes = (t * hid + t * kv) * (eb if fp8 else 2)  # the two operands read once
        t_c = flops / (dev.peak(cls) * eff)
        t_m = nbytes / (dev.bandwidth * dev.bandwidth_efficiency)
        ms = (max(t_c, t_m) + dev.kernel_us * 1e-6) * 1e3
        bound = "compute" if t_c >= t_m else "memory"
        cost.gemms.append(GemmCost(f"{name}.{step}", t, hid, shape.seq_len, cls, flops, nbytes,
                                   0, ms, bound))  # fmt: skip
    if plan is None:
        return
    current = plan.scaling == "current"
    passes: list[tuple[str, str, str, int]] = []  # (tensor, step, kind, elements)
    if not plan.fp8_mha:
        passes.append(("attn.qkv", "fprop", "cast", t * (hid + 2 * kv)))
    if plan.path == "te":
        passes.append(("attn.dO", "dgrad", "cast", t * hid))
        if plan.quantizes_output and not plan.fp8_mha:
            passes.append(("attn.O", "fprop", "dequantize", t * hid))
            passes.append(("attn.dQKV", "dgrad", "dequantize", t * (hid + 2 * kv)))
    for tensor, step, kind, n in passes:
        if kind == "cast" and current:
            sec = _kernel_seconds(dev, 2 * n, 1, 0, 0)
            cost.kernels.append(KernelCost(tensor, step, "amax", {"bf16": 2 * n}, {}, 1,
                                           sec * 1e3))  # fmt: skip
        # values and scales: E8M0 per 1x32 block (MXFP8) or one FP32 scale per tensor
        hp, q = {"bf16": 2 * n}, {"fp8": n, "scales": n // 32 if low == "mxfp8" else 4}
        read, written = (hp, q) if kind == "cast" else (q, hp)
        sec = _kernel_seconds(dev, sum(read.values()) + sum(written.values()), 1, 0, 0)
        cost.kernels.append(KernelCost(tensor, step, kind, read, written, 1, sec * 1e3))


def layer_recipe(recipe: Recipe, name: str) -> tuple[Recipe, str]:
    """(the recipe the Linear ``name`` runs, a label for messages). A recipe with per-layer rules
    (``recipe.layers``) runs ``recipe.for_layer(name)``; any other runs itself."""
    if not getattr(recipe, "layers", ()):
        return recipe, recipe.name
    return recipe.for_layer(name), f"{recipe.name} (layer {name})"


def predict_step_ms(
    recipe: Recipe | str,
    device: Device | str,
    shape: TransformerShape | None = None,
    *,
    linears: list[tuple[str, int, int]] | None = None,
    tokens: int | None = None,
    experts: Mapping[str, tuple[int, int]] | None = None,
) -> float:
    """Predicted GEMM + quantization time (ms) of one training step (the ``training``
    scenario): all ``shape.layers`` layers of ``shape``, or the given ``linears`` (``[(name,
    in, out)]``, each once) on ``tokens`` tokens. Attention, norms, the optimizer and
    communication are not included. For `fp8lab compare`'s "predicted step time on DEVICE"
    column. Raises `UnpriceableError` for a recipe the device cannot run."""
    if linears is not None:
        if tokens is None:
            raise ValueError("predict_step_ms: linears= needs tokens=")
        return price_linears(recipe, device, linears, tokens, experts=experts).layer_ms
    shape = shape or TransformerShape()
    return price_layer(recipe, device, shape, "training").layer_ms * shape.layers


def predict_or_reason(
    recipe: Recipe | str,
    device: Device | str,
    *,
    linears: list[tuple[str, int, int]],
    tokens: int,
    experts: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[float | None, str | None]:
    """`predict_step_ms` for the given ``linears`` on ``tokens`` tokens, or ``(None, reason)``
    when the recipe cannot be priced on ``device`` (`UnpriceableError`: HiF8, fp32 GEMMs, MX or
    NVFP4 on Hopper) or one of its per-layer rules cannot be applied (ValueError). A report can
    then show "n/a" with the reason instead of failing."""
    try:
        return predict_step_ms(
            recipe, device, linears=linears, tokens=tokens, experts=experts
        ), None
    except ValueError as exc:  # UnpriceableError is a ValueError
        return None, str(exc)
