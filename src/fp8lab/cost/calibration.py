"""Calibration of the roofline on part of Transformer Engine's published timings, and the
held-out check on the rest.

Published data (``data/te_gemm_profiling.toml``): TE's GEMM profiling tutorial, per-layer fprop /
dgrad / wgrad times of a 5B configuration on H200 NVL and B300 in autocast mode (quantization
included), plus pre-quantized times and the ~17 % quantization share of current scaling on H200.

Split (`SPLIT`, the default): calibrate on the **fprop** sums only; everything else is predicted.
Per architecture the fitted parameters are one GEMM efficiency per GEMM class that appears in the
fprop data (bf16; fp8 per-tensor; fp8 block on Hopper; mxfp8 and nvfp4 on Blackwell) and one
bandwidth efficiency of the memory-bound quantization kernels. The fp8 efficiency and the bandwidth
efficiency come from current and delayed scaling together (they differ only by the amax pass):
as many parameters as fprop observations, solved exactly by bisection, no least squares. Held
out: dgrad and wgrad of every recipe on both devices, the pre-quantized GEMM times, the
quantization share of current scaling on H200, and the recipe ordering.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fp8lab.cost.devices import DATA, Device, get_device
from fp8lab.cost.model import TransformerShape, price_layer

__all__ = [
    "SPLIT",
    "Residual",
    "calibrate",
    "calibration_toml",
    "cross_architecture_check",
    "external_check",
    "ordering_check",
    "published",
    "quantization_share",
    "residuals",
]

#: the calibration split: these passes are fitted, the others predicted
SPLIT = ("fprop",)
PASSES = ("fprop", "dgrad", "wgrad")
#: device -> (GEMM class fitted, recipe whose fprop sum fits it), in fitting order
_FIT = {
    "h200-nvl": [("bf16", "bf16"), ("fp8_block", "deepseek-v3")],
    "b300": [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4")],
}


@cache
def published() -> dict[str, Any]:
    """TE's published numbers (``data/te_gemm_profiling.toml``)."""
    return tomllib.loads((DATA / "te_gemm_profiling.toml").read_text())


def te_shape() -> TransformerShape:
    m = published()["model"]
    return TransformerShape(m["hidden"], m["ffn"], m["layers"], m["tokens"])


def _bisect(f: Callable[[float], float], target: float, lo: float = 0.02, hi: float = 1.5) -> float:
    """x in [lo, hi] with f(x) == target for f decreasing in x (44 halvings: 1e-13 wide)."""
    for _ in range(44):
        mid = 0.5 * (lo + hi)
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _fprop(recipe: str, dev: Device, cal: dict[str, Any]) -> float:
    d = dev.with_calibration(cal)
    return price_layer(recipe, d, te_shape(), "te-benchmark").pass_ms("fprop")


def _fit_device(name: str) -> dict[str, Any]:
    obs = published()[name]
    dev = get_device(name, calibration={})
    cal: dict[str, Any] = {"efficiency": {"bf16": 1.0, "fp8": 1.0}, "bandwidth_efficiency": 1.0}

    def with_(key: str, value: float, bw: float | None = None) -> dict[str, Any]:
        eff = {**cal["efficiency"], key: value}
        return {**cal, "efficiency": eff, "bandwidth_efficiency": bw or cal["bandwidth_efficiency"]}

    def fp8_given_bw(bw: float) -> float:
        target = obs["te-delayed"]["fprop"]
        return _bisect(lambda e: _fprop("te-delayed", dev, with_("fp8", e, bw)), target)

    def current_at(bw: float) -> float:
        return _fprop("te-current", dev, with_("fp8", fp8_given_bw(bw), bw))

    # current - delayed = the amax pass: a larger bandwidth efficiency makes current faster
    bw = _bisect(current_at, obs["te-current"]["fprop"], 0.05, 1.5)
    cal = with_("fp8", fp8_given_bw(bw), bw)
    for cls, recipe in _FIT[name]:
        target = obs[recipe]["fprop"]
        cal = with_(cls, _bisect(lambda e, c=cls, r=recipe: _fprop(r, dev, with_(c, e)), target))
    cal["fitted_on"] = [f"{r} fprop" for r in ("te-current", "te-delayed")] + [
        f"{r} fprop" for _, r in _FIT[name]
    ]
    return cal


def calibrate() -> dict[str, Any]:
    """Fit every calibrated architecture on the `SPLIT` passes: ``{device: {"efficiency":
    {class: e}, "bandwidth_efficiency": b, "fitted_on": [...]}}``."""
    return {name: _fit_device(name) for name in _FIT}


def calibration_toml(cal: dict[str, Any]) -> str:
    """The calibration as the TOML text shipped in ``data/calibration.toml``."""
    lines = [
        "# Written by fp8lab.cost.calibration.calibrate() (benchmarks/bench_cost.py --write):",
        "# fitted on the fprop sums of TE's published GEMM timings only; see docs/cost.md.",
    ]
    for name, c in cal.items():
        lines += ["", f"[{name}]", f"bandwidth_efficiency = {c['bandwidth_efficiency']:.6f}"]
        fitted = ", ".join(f'"{f}"' for f in c.get("fitted_on", []))
        lines += [f"fitted_on = [{fitted}]", "", f"[{name}.efficiency]"]
        lines += [f"{k} = {v:.6f}" for k, v in sorted(c["efficiency"].items())]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Residual:
    """One published quantity against its prediction; ``held_out``: not used in fitting."""

    device: str
    recipe: str
    quantity: str
    published: float
    predicted: float
    held_out: bool

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted - self.published) / self.published


def residuals(cal: dict[str, Any] | None = None) -> list[Residual]:
    """Every published per-pass and per-layer time (autocast and pre-quantized) against the
    model calibrated with ``cal`` (default: the shipped calibration)."""
    out = []
    pub = published()
    for name in _FIT:
        dev = get_device(name, calibration=cal)
        for table, pre in ((name, False), (f"{name}-prequantized", True)):
            for recipe, row in pub[table].items():
                if recipe == "source":
                    continue
                c = price_layer(recipe, dev, te_shape(), "te-benchmark")
                for q in (*PASSES, "layer"):
                    if pre:  # raw GEMM kernels: the GEMM part of the prediction
                        pred = (
                            c.gemm_ms
                            if q == "layer"
                            else sum(g.ms for g in c.gemms if g.name.endswith("." + q))
                        )
                        label = f"{q} (pre-quantized)"
                    else:
                        pred = c.layer_ms if q == "layer" else c.pass_ms(q)
                        label = q
                    held = pre or q not in SPLIT
                    out.append(Residual(name, recipe, label, row[q], pred, held))
    return out


def quantization_share(cal: dict[str, Any] | None = None) -> tuple[float, float]:
    """(published, predicted) share of quantization in current scaling's H200 layer time."""
    q = published()["quantization_share"]
    c = price_layer(q["recipe"], get_device(q["device"], cal), te_shape(), "te-benchmark")
    return q["share"], c.quantize_ms / c.layer_ms


def ordering_check(cal: dict[str, Any] | None = None, margin: float = 0.05) -> list[dict]:
    """Every pair of recipes on a device whose published speedups over bf16 differ by more than
    ``margin`` (relative): published and predicted order, and whether they agree."""
    out = []
    pub = published()
    for name in _FIT:
        dev = get_device(name, cal)
        rows = {r: v["layer"] for r, v in pub[name].items() if r != "source"}
        pred = {r: price_layer(r, dev, te_shape(), "te-benchmark").layer_ms for r in rows}
        sp = {r: rows["bf16"] / t for r, t in rows.items()}
        sq = {r: pred["bf16"] / t for r, t in pred.items()}
        names = sorted(rows)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if abs(sp[a] / sp[b] - 1) <= margin:
                    continue
                agree = (sp[a] > sp[b]) == (sq[a] > sq[b])
                out.append(
                    {"device": name, "pair": (a, b), "published": (sp[a], sp[b]),
                     "predicted": (sq[a], sq[b]), "agree": agree}
                )  # fmt: skip
    return out


def cross_architecture_check(cal: dict[str, Any] | None = None) -> list[Residual]:
    """Second split: Hopper's calibration (H200 NVL) applied to B300's peaks and bandwidth, for
    the recipes both devices publish (bf16, te-current, te-delayed): layer times and speedups
    over bf16 (quantity ``layer`` / ``speedup``), all held out."""
    from fp8lab.cost.devices import load_calibration

    full = load_calibration() if cal is None else cal
    hop = full["h200-nvl"]
    dev = get_device("b300", calibration={"b300": hop})
    pub = published()["b300"]
    layer = {
        r: price_layer(r, dev, te_shape(), "te-benchmark").layer_ms
        for r in ("bf16", "te-current", "te-delayed")
    }
    out = [Residual("b300", r, "layer", pub[r]["layer"], t, True) for r, t in layer.items()]
    for r in ("te-current", "te-delayed"):
        sp_pub = pub["bf16"]["layer"] / pub[r]["layer"]
        out.append(Residual("b300", r, "speedup", sp_pub, layer["bf16"] / layer[r], True))
    return out


def external_check(cal: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Llama 3.1 405B Blackwell ordering (HiFloat8 article citing GTC25 S72778): predicted
    GEMM-only training speedups over bf16 against the reported end-to-end ones."""
    ext = published()["external"]["llama-405b-blackwell"]
    m = ext["model"]
    shape = TransformerShape(
        hidden=m["hidden"], ffn=m["ffn"], layers=m["layers"], tokens=m["tokens"],
        qkv_out=m["hidden"] + 2 * 1024, up_out=2 * m["ffn"],
    )  # fmt: skip
    dev = get_device(ext["device"], cal)
    base = price_layer("bf16", dev, shape).layer_ms
    pred = {r: base / price_layer(r, dev, shape).layer_ms for r in ext["speedup"]}
    order_pub = sorted(ext["speedup"], key=ext["speedup"].get)
    order_pred = sorted(pred, key=pred.get)
    return {
        "source": ext["source"],
        "status": ext["status"],
        "device": ext["device"],
        "reported": dict(ext["speedup"]),
        "predicted": pred,
        "reported_order": order_pub,
        "predicted_order": order_pred,
        "agree": order_pub == order_pred,
    }


def main(path: str | Path | None = None) -> str:
    """Recompute the calibration; write it to ``path`` when given; return the TOML text."""
    text = calibration_toml(calibrate())
    if path is not None:
        Path(path).write_text(text)
    return text
