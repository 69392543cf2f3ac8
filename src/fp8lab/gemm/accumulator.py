"""`Accumulator`: how a GEMM sums its products (frozen configuration; see `fp8lab.gemm`), and the
named tensor-core parameter sets (`accumulators`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fp8lab._keys import check_choice, check_keys

__all__ = [
    "ACCUMULATOR_KINDS",
    "ACC_ROUNDINGS",
    "C_ENTRIES",
    "HARDWARE",
    "Accumulator",
    "accumulators",
]

ACCUMULATOR_KINDS = ("fp32", "limited", "fused")
ACC_ROUNDINGS = ("toward_zero", "nearest_even")
C_ENTRIES = ("aligned", "after")

_KM = (
    "Khattak & Mikaitis, 'Accurate Models of NVIDIA Tensor Cores', arXiv 2512.07004 "
    "(github.com/north-numerical-computing/MATLAB-tensor-core, models/{}.m, validated on the GPU)"
)
_MMASIM = "Xie et al., MMA-Sim, arXiv 2511.10909"
_FP8 = ("e4m3", "e5m2")
_HALF = ("bf16", "fp16")

# name -> rows: (operand formats, group G, alignment bits F (None: exact), FP32 output fraction
# bits, c entry, exponent floor of the alignment, source, note)
_ROWS: dict[str, tuple[tuple[Any, ...], ...]] = {
    "h100": (
        (_FP8, 32, 13, 13, "aligned", -133, _KM.format("H100TC"), ""),
        (_HALF, 16, 25, 23, "aligned", -133, _KM.format("H100TC"), ""),
    ),
    "ada": (
        (_FP8, 16, 13, 13, "aligned", -132, _KM.format("AdaTC"), "a k32 MMA is two chained k16 steps"),
        (_HALF, 8, 24, 23, "aligned", -132, _KM.format("AdaTC"), ""),
    ),
    "b200": (
        (_FP8, 32, None, 23, "after", -133, _KM.format("B200TC") + "; published B200 mma.sync "
         "measurements", "32 products summed exactly, RZ to FP32, then c added with one FP32 RNE "
         "addition"),
        (_HALF, 16, 25, 23, "aligned", -133, _KM.format("B200TC"), ""),
    ),
    "b200-tcgen05": (
        (_FP8, 32, 25, 23, "aligned", -133, _MMASIM, "tcgen05 f8f6f4 per MMA-Sim; not confirmed "
         "by published measurements"),
    ),
}  # fmt: skip
_ALIASES = {"h200": "h100", "l40s": "ada"}
HARDWARE = ("h100", "h200", "ada", "l40s", "b200", "b200-tcgen05")


def accumulators() -> list[dict[str, Any]]:
    """The named tensor-core accumulator models, one row per (name, operand formats): ``name``,
    ``same_as`` (an alias's model), ``formats``, ``group``, ``align_bits`` (None: exact),
    ``out_bits``, ``c_entry``, ``exp_floor``, ``source``, ``note``."""
    rows = []
    for name in HARDWARE:
        base = _ALIASES.get(name, name)
        for fmts, g, f, fo, ce, fl, src, note in _ROWS[base]:
            rows.append({
                "name": name, "same_as": base if base != name else None, "formats": fmts,
                "group": g, "align_bits": f, "out_bits": fo, "c_entry": ce, "exp_floor": fl,
                "source": src, "note": note,
            })  # fmt: skip
    return rows


@dataclass(frozen=True)
class Accumulator:
    """How a GEMM accumulates. Frozen; `to_dict`/`from_dict` round-trip through TOML/JSON.

    Attributes:
        kind: ``"fp32"`` (products exact, FP32 sums), ``"limited"`` (the fast approximate Hopper
            model: exact group sums cut to ``mantissa_bits``), ``"fused"`` (the hardware-exact
            fused block FMA of `fp8lab.gemm.fused`), or a hardware name (``"h100"``, ``"h200"``,
            ``"ada"``, ``"l40s"``, ``"b200"``, ``"b200-tcgen05"``): ``fused`` with that GPU's
            row for the operands' formats (`resolve`).
        mantissa_bits: fraction bits kept by the limited accumulator (13 = DeepSeek's "about 14
            bits" counting the leading one; e8m13 per other measurements).
        group: products per MMA step (limited: summed before the cut; fused: G of one fused step).
        promote_every: K elements between promotions of the tensor-core accumulator into FP32
            with the K group's scales (DeepSeek N_C = 128); ``None`` never promotes.
        rounding: how the limited accumulator drops bits: ``toward_zero`` or ``nearest_even``.
        per_product: limited only: DeepSeek §3.5.2's wording (slower reference variant).
        align_bits: fused: F, the fraction bits kept below the step's largest exponent when the
            terms are aligned (``None``: exact sum).
        out_bits: fused: fraction bits of the step's normalised FP32 result (13 = "e8m13").
        out_rounding: fused: ``toward_zero`` (FP32 destinations) or ``nearest_even`` (FP16).
        c_entry: fused: ``"aligned"`` (c is a term of the alignment) or ``"after"`` (c added to
            the rounded product sum with one FP32 round-to-nearest addition: B200 mma.sync).
        exp_floor: fused: lower bound of the alignment exponent E (-133; Ada/L40S -132).
        hardware: the GPU name this fused model came from (rows: `accumulators`).
    """

    kind: str = "fp32"
    mantissa_bits: int = 13
    group: int = 32
    promote_every: int | None = None
    rounding: str = "toward_zero"
    per_product: bool = False
    align_bits: int | None = 13
    out_bits: int = 13
    out_rounding: str = "toward_zero"
    c_entry: str = "aligned"
    exp_floor: int = -133
    hardware: str | None = None

    def __post_init__(self) -> None:
        if self.kind in HARDWARE:
            object.__setattr__(self, "hardware", self.kind)
            object.__setattr__(self, "kind", "fused")
        if self.kind not in ACCUMULATOR_KINDS:
            raise ValueError(
                f"accumulator kind must be one of {ACCUMULATOR_KINDS} or a GPU name "
                f"{HARDWARE}, got {self.kind!r}"
            )
        if self.hardware is not None and self.hardware not in HARDWARE:
            raise ValueError(
                f"accumulator hardware must be one of {HARDWARE}, got {self.hardware!r}"
            )
        if not 1 <= int(self.mantissa_bits) <= 23:
            raise ValueError(f"mantissa_bits must be in [1, 23], got {self.mantissa_bits}")
        if int(self.group) < 1:
            raise ValueError(f"group must be >= 1, got {self.group}")
        if self.promote_every is not None:
            pe = int(self.promote_every)
            if pe < 1 or pe % int(self.group):
                raise ValueError(
                    f"promote_every must be a positive multiple of group={self.group}, got {pe}"
                )
            object.__setattr__(self, "promote_every", pe)
        check_choice(self.rounding, ACC_ROUNDINGS, "accumulator rounding")
        check_choice(self.out_rounding, ACC_ROUNDINGS, "out_rounding")
        check_choice(self.c_entry, C_ENTRIES, "c_entry")
        if self.align_bits is not None and not 1 <= int(self.align_bits) <= 40:
            raise ValueError(
                f"align_bits must be in [1, 40] or None (exact), got {self.align_bits}"
            )
        if not 1 <= int(self.out_bits) <= 23:
            raise ValueError(f"out_bits must be in [1, 23], got {self.out_bits}")
        if not -149 <= int(self.exp_floor) <= -100:
            raise ValueError(f"exp_floor must be in [-149, -100], got {self.exp_floor}")
        for f in ("mantissa_bits", "group", "out_bits", "exp_floor"):
            object.__setattr__(self, f, int(getattr(self, f)))
        if self.align_bits is not None:
            object.__setattr__(self, "align_bits", int(self.align_bits))

    def resolve(self, fmt_a: str, fmt_b: str) -> Accumulator:
        """This accumulator for operands of element formats ``fmt_a`` x ``fmt_b``: a hardware
        name picks its row (ValueError for formats without one); other kinds are returned as is."""
        if self.hardware is None:
            return self
        base = _ALIASES.get(self.hardware, self.hardware)
        for fmts, g, f, fo, ce, fl, _src, _note in _ROWS[base]:
            if fmt_a in fmts and fmt_b in fmts and (fmts == _FP8 or fmt_a == fmt_b):
                return dataclasses.replace(
                    self, group=g, align_bits=f, out_bits=fo, out_rounding="toward_zero",
                    c_entry=ce, exp_floor=fl,
                )  # fmt: skip
        have = [r[0] for r in _ROWS[base]]
        raise ValueError(
            f"accumulator {self.hardware!r} has no model for {fmt_a} x {fmt_b} operands (its "
            f"tensor-core rows take {have}; 16-bit operands must share one format)"
        )

    def describe(self) -> str:
        """One-line text form: ``fp32``, ``limited(m=13, promote=128)``, ``h100(promote=128)``,
        ``ada``, ``fused(G=32, F=13, out=13)``."""
        pe = f", promote={self.promote_every}" if self.promote_every else ""
        if self.kind == "fp32":
            return "fp32"
        if self.kind == "limited":
            pp = ", per_product" if self.per_product else ""
            rn = "" if self.rounding == "toward_zero" else f", {self.rounding}"
            return f"limited(m={self.mantissa_bits}{pe}{rn}{pp})"
        if self.hardware is not None:
            return f"{self.hardware}({pe[2:]})" if pe else self.hardware
        f = "exact" if self.align_bits is None else self.align_bits
        extra = "" if self.c_entry == "aligned" else f", c {self.c_entry}"
        extra += "" if self.out_rounding == "toward_zero" else f", {self.out_rounding}"
        return f"fused(G={self.group}, F={f}, out={self.out_bits}{extra}{pe})"

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the fields of this kind; ``promote_every=None`` is omitted (TOML has no
        null), a hardware model is its name (plus promote_every)."""
        d = dataclasses.asdict(self)
        if self.hardware is not None:
            d = {"kind": self.hardware, "promote_every": self.promote_every}
        elif self.kind == "fused":
            for f in ("mantissa_bits", "rounding", "per_product", "hardware"):
                del d[f]
            if d["align_bits"] is None:
                d["align_bits"] = "exact"
        else:
            for f in ("align_bits", "out_bits", "out_rounding", "c_entry", "exp_floor", "hardware"):
                del d[f]
        if d["promote_every"] is None:
            del d["promote_every"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Accumulator:
        check_keys(d, (f.name for f in dataclasses.fields(cls)), "Accumulator")
        if d.get("align_bits") == "exact":
            d = {**d, "align_bits": None}
        return cls(**d)

    @classmethod
    def parse(
        cls,
        acc: str | Accumulator | dict[str, Any] | None,
        formats: tuple[str, str] | None = None,
    ) -> Accumulator:
        """An `Accumulator` from itself, a kind or GPU name, a dict, or None (fp32).
        ``formats``: the operands' element formats; a GPU name is resolved to its row for them."""
        if acc is None:
            out = cls()
        elif isinstance(acc, Accumulator):
            out = acc
        elif isinstance(acc, str):
            out = cls(kind=acc)
        elif isinstance(acc, dict):
            out = cls.from_dict(acc)
        else:
            raise TypeError(
                f"accumulator must be a kind name, Accumulator or dict, got {type(acc)}"
            )
        return out if formats is None else out.resolve(*formats)
