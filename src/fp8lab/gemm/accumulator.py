"""`Accumulator`: how a GEMM sums its products (frozen configuration; see `fp8lab.gemm`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["ACCUMULATOR_KINDS", "ACC_ROUNDINGS", "Accumulator"]

ACCUMULATOR_KINDS = ("fp32", "limited")
ACC_ROUNDINGS = ("toward_zero", "nearest_even")


@dataclass(frozen=True)
class Accumulator:
    """How a GEMM accumulates. Frozen; `to_dict`/`from_dict` round-trip through TOML/JSON.

    Attributes:
        kind: ``"fp32"`` (products exact, FP32 sums) or ``"limited"`` (Hopper FP8 tensor core).
        mantissa_bits: fraction bits kept by the limited accumulator (13 = DeepSeek's "about 14
            bits" counting the leading one; e8m13 per other measurements).
        group: products summed per MMA step before the accumulator is truncated (32 = WGMMA K).
        promote_every: K elements between promotions of the limited accumulator into FP32 with
            the K group's scales (DeepSeek N_C = 128); ``None`` never promotes (TE fast accum).
        rounding: how the limited accumulator drops bits: ``toward_zero`` (measured) or
            ``nearest_even``.
        per_product: DeepSeek §3.5.2's wording: each product aligned to the group's largest
            exponent and truncated before the sum (slower reference variant).
    """

    kind: str = "fp32"
    mantissa_bits: int = 13
    group: int = 32
    promote_every: int | None = None
    rounding: str = "toward_zero"
    per_product: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ACCUMULATOR_KINDS:
            raise ValueError(
                f"accumulator kind must be one of {ACCUMULATOR_KINDS}, got {self.kind!r}"
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
        if self.rounding not in ACC_ROUNDINGS:
            raise ValueError(
                f"accumulator rounding must be one of {ACC_ROUNDINGS}, got {self.rounding!r}"
            )
        object.__setattr__(self, "mantissa_bits", int(self.mantissa_bits))
        object.__setattr__(self, "group", int(self.group))

    def to_dict(self) -> dict[str, Any]:
        """Plain data; ``promote_every=None`` is omitted (TOML has no null)."""
        d = dataclasses.asdict(self)
        if d["promote_every"] is None:
            del d["promote_every"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Accumulator:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown Accumulator keys: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def parse(
        cls,
        acc: str | Accumulator | dict[str, Any] | None,
        formats: tuple[str, str] | None = None,
    ) -> Accumulator:
        """An `Accumulator` from itself, a kind name, a dict, or None (fp32). ``formats``: the
        operands' element formats (a hardware name picks its row for them)."""
        if acc is None:
            return cls()
        if isinstance(acc, Accumulator):
            return acc
        if isinstance(acc, str):
            return cls(kind=acc)
        if isinstance(acc, dict):
            return cls.from_dict(acc)
        raise TypeError(f"accumulator must be a kind name, Accumulator or dict, got {type(acc)}")
