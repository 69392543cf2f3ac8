"""What a number format is: `FloatFormat` and the registry of named formats.

A `FloatFormat` is pure data. Everything a cast needs (largest finite value, smallest normal,
subnormal spacing, special-value encodings) is derived here, once, so that rounding, encoding,
scaling and the CLI all read the same numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

NanStyle = Literal["ieee", "fn", "fnuz", "none"]
Kind = Literal["exmy", "hif8"]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format.

    Attributes:
        name: registry name (or a descriptive one for custom formats).
        ebits, mbits: exponent and stored-mantissa widths.
        bias: exponent bias; a normal value is ``2**(e - bias) * (1 + m / 2**mbits)``.
        inf: whether ±inf exist (IEEE: exponent all ones, mantissa zero).
        nan: how NaN is encoded. ``"ieee"``: exponent all ones, mantissa non-zero;
            ``"fn"``: only the all-ones pattern (``S.1111.111``; for ``mbits == 0`` the whole top
            exponent); ``"fnuz"``: only ``0x80`` (the would-be -0); ``"none"``: no NaN.
        signed_zero: whether -0 exists. Formats without it map -0 and negative underflow to +0.
        subnormals: whether exponent field 0 encodes subnormals (else it is a normal binade, as in
            E8M0, whose code 0 is ``2**-127``).
        signed: False for unsigned formats (E8M0).
        has_zero: False for E8M0.
        kind: ``"exmy"`` for sign/exponent/mantissa formats, ``"hif8"`` for HiFloat8.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    inf: bool = True
    nan: NanStyle = "ieee"
    signed_zero: bool = True
    subnormals: bool = True
    signed: bool = True
    has_zero: bool = True
    kind: Kind = "exmy"
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kind == "hif8":
            return
        if not 1 <= self.ebits <= 8:
            raise ValueError(f"{self.name}: ebits must be in [1, 8], got {self.ebits}")
        if not 0 <= self.mbits <= 23:
            raise ValueError(f"{self.name}: mbits must be in [0, 23], got {self.mbits}")
        if self.nan not in ("ieee", "fn", "fnuz", "none"):
            raise ValueError(f"{self.name}: unknown NaN style {self.nan!r}")
        if self.nan == "fnuz" and self.signed_zero:
            raise ValueError(f"{self.name}: an FNUZ format has no -0 (0x80 is its NaN)")
        if self.emax < self.emin and not self.subnormals:
            raise ValueError(f"{self.name}: no finite values")

    # ----------------------------------------------------------------- derived numbers
    @property
    def bits(self) -> int:
        """Storage width in bits."""
        if self.kind == "hif8":
            return 8
        return int(self.signed) + self.ebits + self.mbits

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite binade."""
        if self.kind == "hif8":
            return 15
        top = (1 << self.ebits) - 1
        if self.inf or self.nan == "ieee" or (self.nan == "fn" and self.mbits == 0):
            top -= 1  # the all-ones exponent holds only specials
        return top - self.bias

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        if self.kind == "hif8":
            return -15
        return (1 if self.subnormals else 0) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        if self.kind == "hif8":
            return 32768.0
        if self.emax < self.emin:  # IEEE-like e1mY: subnormals only
            return (1.0 - 2.0**-self.mbits) * 2.0**self.emin
        top_mantissa = (1 << self.mbits) - 1
        if self.nan == "fn" and self.mbits > 0:
            top_mantissa -= 1  # S.1111.111 is NaN
        return 2.0**self.emax * (1.0 + top_mantissa / 2.0**self.mbits)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value."""
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (the subnormal spacing, or min normal without subnormals)."""
        if self.kind == "hif8":
            return 2.0**-22
        if not self.subnormals:
            return self.min_normal
        return 2.0 ** (self.emin - self.mbits)

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value (``2**-mbits``; 0.125 for HiF8)."""
        if self.kind == "hif8":
            return 0.125
        return 2.0**-self.mbits

    @property
    def binades(self) -> int:
        """Number of distinct powers of two spanned by non-zero finite values."""
        if self.kind == "hif8":
            return 38
        normal = max(self.emax - self.emin + 1, 0)
        return normal + (self.mbits if self.subnormals else 0)

    @property
    def has_nan(self) -> bool:
        return self.nan != "none"

    def __repr__(self) -> str:
        return f"FloatFormat({self.name!r})"


def _ieee_like(name: str, ebits: int, mbits: int) -> FloatFormat:
    return FloatFormat(name, ebits, mbits, bias=(1 << (ebits - 1)) - 1)


_REGISTRY: dict[str, FloatFormat] = {}


def _register(fmt: FloatFormat) -> FloatFormat:
    for key in (fmt.name, *fmt.aliases):
        _REGISTRY[key] = fmt
    return fmt


FP32 = _register(FloatFormat("fp32", 8, 23, 127, aliases=("float32",)))
TF32 = _register(FloatFormat("tf32", 8, 10, 127))
BF16 = _register(FloatFormat("bf16", 8, 7, 127, aliases=("bfloat16",)))
FP16 = _register(FloatFormat("fp16", 5, 10, 15, aliases=("float16", "half")))
E4M3 = _register(FloatFormat("e4m3", 4, 3, 7, inf=False, nan="fn", aliases=("e4m3fn",)))
E5M2 = _register(FloatFormat("e5m2", 5, 2, 15))
E4M3FNUZ = _register(FloatFormat("e4m3fnuz", 4, 3, 8, inf=False, nan="fnuz", signed_zero=False))
E5M2FNUZ = _register(FloatFormat("e5m2fnuz", 5, 2, 16, inf=False, nan="fnuz", signed_zero=False))
E4M3_IEEE = _register(FloatFormat("e4m3-ieee", 4, 3, 7))
E3M4 = _register(FloatFormat("e3m4", 3, 4, 3))
E5M6 = _register(FloatFormat("e5m6", 5, 6, 15))
E8M0 = _register(
    FloatFormat(
        "e8m0",
        8,
        0,
        127,
        inf=False,
        nan="fn",
        signed_zero=False,
        subnormals=False,
        signed=False,
        has_zero=False,
        aliases=("e8m0fnu", "ue8m0"),
    )
)
E2M1 = _register(FloatFormat("e2m1", 2, 1, 1, inf=False, nan="none", aliases=("fp4", "e2m1fn")))
E2M3 = _register(FloatFormat("e2m3", 2, 3, 1, inf=False, nan="none", aliases=("e2m3fn",)))
E3M2 = _register(FloatFormat("e3m2", 3, 2, 3, inf=False, nan="none", aliases=("e3m2fn",)))
HIF8 = _register(
    FloatFormat(
        "hif8",
        0,
        0,
        0,
        inf=True,
        nan="fnuz",
        signed_zero=False,
        kind="hif8",
        aliases=("hifloat8",),
    )
)

_EXMY = re.compile(r"^e([1-8])m(\d{1,2})$")


def format_names() -> list[str]:
    """Canonical names of the registered formats, in registry order (aliases excluded)."""
    seen: list[str] = []
    for fmt in _REGISTRY.values():
        if fmt.name not in seen:
            seen.append(fmt.name)
    return seen


def get_format(fmt: str | FloatFormat) -> FloatFormat:
    """Look up a format by name, or pass a `FloatFormat` through.

    Registry names (and aliases) win; any other ``eXmY`` with 1 <= X <= 8 and 0 <= Y <= 23 names an
    IEEE-like format with bias ``2**(X-1) - 1``. Anything else raises ``ValueError`` listing the
    valid names.
    """
    if isinstance(fmt, FloatFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a name or a FloatFormat, got {type(fmt).__name__}")
    key = fmt.strip().lower()
    if key in _REGISTRY:
        return _REGISTRY[key]
    match = _EXMY.match(key)
    if match and int(match.group(2)) <= 23:
        return _ieee_like(key, int(match.group(1)), int(match.group(2)))
    raise ValueError(
        f"unknown format {fmt!r}; valid names: {', '.join(format_names())} "
        "(or any eXmY with 1<=X<=8, 0<=Y<=23 for an IEEE-like format)"
    )
