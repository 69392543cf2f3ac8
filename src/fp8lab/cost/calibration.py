"""Calibration of the roofline on part of Transformer Engine's published timings, and the
held-out check on the rest.

Published data (``data/te_gemm_profiling.toml``): TE's GEMM profiling tutorial, per-layer fprop /
dgrad / wgrad times of a 5B configuration on H200 NVL and B300 in autocast mode (quantization
included), plus pre-quantized times and the ~17 % quantization share of current scaling on H200.

Split (`SPLIT`, the default): calibrate on **fprop** sums only; everything else is predicted.
Per architecture the fitted parameters are one GEMM efficiency per GEMM class (bf16; fp8
per-tensor; fp8 block on Hopper; mxfp8 and nvfp4 on Blackwell) and one bandwidth efficiency of
the memory-bound quantization kernels, identified in that order:

1. each GEMM efficiency from the **pre-quantized** fprop sum of its recipe where TE publishes one
   (raw GEMM kernels: bf16 and te-current on H200 NVL; bf16, te-current, mxfp8 and nvfp4 on B300),
   so GEMM time and quantization time are measured apart;
2. the bandwidth efficiency from te-current's **autocast** fprop sum (its GEMMs now known, the
   rest is quantization: amax, cast, transpose);
3. a class without pre-quantized data (fp8 block on H200) from its autocast fprop sum.

As many parameters as observations (4 on H200 NVL, 5 on B300), each solved exactly by bisection,
no least squares. Held out: every dgrad, wgrad and layer sum (autocast and pre-quantized), the
autocast fprop of te-delayed, mxfp8 and nvfp4 (their quantization is predicted, not fitted), the
quantization share of current scaling on H200, and the recipe ordering.

(The first calibration fitted the autocast fprop sums alone; on B300 that could not tell GEMM
time from quantization time and predicted the raw kernels 11-47 % too fast: docs/cost.md.)

**Blackwell from B200 figures** (`blackwell_calibration`, the ``b200`` entry): no TE timing and no
B300 number; each GEMM class's efficiency is a named public B200 GEMM throughput over the b200
table's dense peak, the bandwidth efficiency a named B200 cast kernel's GB/s over its bandwidth
(``data/b200_gemm_figures.toml``). `b300_speedup_check` prices TE's B300 benchmark with it (held
out entirely); `nvfp4_blog_check` sets it against NVIDIA's end-to-end Llama 3 8B NVFP4 figure.
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
    "b200_figures",
    "b300_speedup_check",
    "blackwell_calibration",
    "calibrate",
    "calibration_toml",
    "cross_architecture_check",
    "external_check",
    "nvfp4_blog_check",
    "ordering_check",
    "peak_scaling",
    "published",
    "quantization_share",
    "residuals",
]

#: the calibration split: these passes are fitted, the others predicted
SPLIT = ("fprop",)
PASSES = ("fprop", "dgrad", "wgrad")
#: device -> (GEMM class fitted, recipe whose fprop sum fits it): pre-quantized where published
_FIT = {
    "h200-nvl": [("bf16", "bf16"), ("fp8", "te-current"), ("fp8_block", "deepseek-v3")],
    "b300": [("bf16", "bf16"), ("fp8", "te-current"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4")],
}
#: the recipe whose autocast fprop fits the bandwidth efficiency of the quantization kernels
_BW_RECIPE = "te-current"
PRE = " (pre-quantized)"


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


def _fprop(recipe: str, dev: Device, cal: dict[str, Any], gemm_only: bool = False) -> float:
    """Predicted fprop sum of the TE benchmark: GEMMs + quantization (autocast), or the GEMM
    kernels alone (``gemm_only``: the pre-quantized mode)."""
    d = dev.with_calibration(cal)
    c = price_layer(recipe, d, te_shape(), "te-benchmark")
    if gemm_only:
        return sum(g.ms for g in c.gemms if g.name.endswith(".fprop"))
    return c.pass_ms("fprop")


def _fit_device(name: str) -> dict[str, Any]:
    obs, pre = published()[name], published().get(f"{name}-prequantized", {})
    dev = get_device(name, calibration={})
    cal: dict[str, Any] = {"efficiency": {"bf16": 1.0, "fp8": 1.0}, "bandwidth_efficiency": 1.0}
    fitted: list[str] = []

    def with_(key: str, value: float) -> dict[str, Any]:
        return {**cal, "efficiency": {**cal["efficiency"], key: value}}

    def fit_class(cls: str, recipe: str, target: float, gemm_only: bool) -> None:
        nonlocal cal
        e = _bisect(lambda v: _fprop(recipe, dev, with_(cls, v), gemm_only), target)
        cal = with_(cls, e)
        fitted.append(f"{recipe} fprop" + (PRE if gemm_only else ""))

    for cls, recipe in _FIT[name]:  # 1. GEMM kernels measured alone
        if recipe in pre:
            fit_class(cls, recipe, pre[recipe]["fprop"], True)
    # 2. quantization kernels: the rest of te-current's autocast fprop (a larger bandwidth
    # efficiency makes it faster)
    bw = _bisect(
        lambda b: _fprop(_BW_RECIPE, dev, {**cal, "bandwidth_efficiency": b}),
        obs[_BW_RECIPE]["fprop"],
        0.05,
        1.5,
    )
    cal = {**cal, "bandwidth_efficiency": bw}
    fitted.append(f"{_BW_RECIPE} fprop")
    for cls, recipe in _FIT[name]:  # 3. classes without pre-quantized data
        if recipe not in pre:
            fit_class(cls, recipe, obs[recipe]["fprop"], False)
    cal["fitted_on"] = fitted
    return cal


@cache
def b200_figures() -> dict[str, Any]:
    """The named B200 figures (``data/b200_gemm_figures.toml``)."""
    return tomllib.loads((DATA / "b200_gemm_figures.toml").read_text())


def blackwell_calibration() -> dict[str, Any]:
    """Blackwell efficiencies from named B200 figures only (module docstring): GEMM class ->
    published TFLOPS / the b200 table's dense peak, bandwidth efficiency = the cast kernel's
    GB/s / the b200 bandwidth. Uses no B300 number."""
    fig = b200_figures()
    dev = get_device("b200", calibration={})
    eff = {cls: row["tflops"] * 1e12 / dev.peak(cls) for cls, row in fig["gemm"].items()}
    fitted = [f"b200 {cls} GEMM" for cls in fig["gemm"]]
    return {
        "efficiency": eff,
        "bandwidth_efficiency": fig["quantize"]["gbs"] * 1e9 / dev.bandwidth,
        "peak_scaling": peak_scaling(fig, dev),
        "fitted_on": [*fitted, "b200 mxfp8 cast kernel"],
    }


def peak_scaling(fig: dict[str, Any], dev: Device) -> dict[str, Any]:
    """How a low-precision GEMM's time changes with its tensor-core peak, from two B200 figures
    at the same shape (``fig["peak_scaling"]["pair"]``: FP8 and NVFP4, whose peaks differ 2x):
    time = FLOPs / (peak x e) + FLOPs / r. With throughputs T1, T2 at peaks P1, P2,
    e = (1/P1 - 1/P2) / (1/T1 - 1/T2) and 1/r = 1/T1 - 1/(P1 e). Reproduces both figures on
    B200 and prices a device whose peak differs (B300's FP4: 1.5x B200's) by the tensor-core
    share alone. ``{"classes", "tensor_core_efficiency", "fixed_tflops"}``."""
    spec = fig["peak_scaling"]
    (c1, c2) = spec["pair"]
    t1, t2 = fig["gemm"][c1]["tflops"], fig["gemm"][c2]["tflops"]
    p1, p2 = dev.peak(c1) / 1e12, dev.peak(c2) / 1e12
    e = (1 / p1 - 1 / p2) / (1 / t1 - 1 / t2)
    r = 1 / (1 / t1 - 1 / (p1 * e))
    return {"classes": list(spec["classes"]), "tensor_core_efficiency": e, "fixed_tflops": r}


def calibrate() -> dict[str, Any]:
    """Fit every calibrated architecture on the `SPLIT` passes (module docstring): ``{device:
    {"efficiency": {class: e}, "bandwidth_efficiency": b, "fitted_on": ["RECIPE fprop", "RECIPE
    fprop (pre-quantized)", ...]}}``, plus ``b200``: `blackwell_calibration`."""
    return {**{name: _fit_device(name) for name in _FIT}, "b200": blackwell_calibration()}


def calibration_toml(cal: dict[str, Any]) -> str:
    """The calibration as the TOML text shipped in ``data/calibration.toml``."""
    lines = [
        "# Written by fp8lab.cost.calibration.calibrate() (benchmarks/bench_cost.py --write):",
        "# fitted on fprop sums of TE's published GEMM timings only (pre-quantized where published,",
        "# then te-current's autocast fprop for the quantization kernels); b200: named B200 GEMM and",
        "# cast-kernel figures only (data/b200_gemm_figures.toml); see docs/cost.md.",
    ]
    for name, c in cal.items():
        lines += ["", f"[{name}]", f"bandwidth_efficiency = {c['bandwidth_efficiency']:.6f}"]
        fitted = ", ".join(f'"{f}"' for f in c.get("fitted_on", []))
        lines += [f"fitted_on = [{fitted}]", "", f"[{name}.efficiency]"]
        lines += [f"{k} = {v:.6f}" for k, v in sorted(c["efficiency"].items())]
        ps = c.get("peak_scaling")
        if ps:
            classes = ", ".join(f'"{k}"' for k in ps["classes"])
            lines += ["", f"[{name}.peak_scaling]", f"classes = [{classes}]"]
            lines += [f"fixed_tflops = {ps['fixed_tflops']:.3f}"]
            lines += [f"tensor_core_efficiency = {ps['tensor_core_efficiency']:.6f}"]
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
    model calibrated with ``cal`` (default: the shipped calibration); ``held_out`` is false for
    the quantities the calibration lists in its ``fitted_on``."""
    from fp8lab.cost.devices import load_calibration

    out = []
    pub = published()
    full = load_calibration() if cal is None else cal
    for name in _FIT:
        dev = get_device(name, calibration=cal)
        fitted = set(full.get(name, {}).get("fitted_on", []))
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
                        label = f"{q}{PRE}"
                    else:
                        pred = c.layer_ms if q == "layer" else c.pass_ms(q)
                        label = q
                    held = f"{recipe} {label}" not in fitted
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


#: TE's four B300 layer speedups checked against the B200-only calibration
B300_CHECK = ("te-current", "te-delayed", "mxfp8", "nvfp4")


def b300_speedup_check(cal: dict[str, Any] | None = None) -> list[Residual]:
    """TE's B300 autocast layer speedups over bf16 (``te-benchmark``) priced on B300's peaks and
    bandwidth with the ``b200`` calibration (`blackwell_calibration`, no B300 number): one
    ``speedup`` residual per recipe of `B300_CHECK`, all held out."""
    from fp8lab.cost.devices import load_calibration

    full = load_calibration() if cal is None else cal
    dev = get_device("b300", calibration={"b300": full["b200"]})
    pub = published()["b300"]
    t = {r: price_layer(r, dev, te_shape(), "te-benchmark").layer_ms for r in ("bf16", *B300_CHECK)}
    return [
        Residual("b300", r, "speedup", pub["bf16"]["layer"] / pub[r]["layer"],
                 t["bf16"] / t[r], True)
        for r in B300_CHECK
    ]  # fmt: skip


def nvfp4_blog_check(cal: dict[str, Any] | None = None) -> dict[str, Any]:
    """NVIDIA's end-to-end Llama 3 8B NVFP4 speedup on GB200 (priced as ``b200``) against the
    model's: the Linears alone (``predicted_gemm_only``: the last ``bf16_last_layers`` layers in
    bf16, as trained; the others as ``nvfp4-te``, TE's NVFP4 recipe with its RHT) and the
    Linears plus causal attention in bf16 (``predicted_with_attention``: NVIDIA's NVFP4 recipe
    leaves attention in BF16), and the share of the bf16 step outside what is priced that each
    implies: with priced speedup S and end-to-end E, a share f of the bf16 step that NVFP4
    leaves unchanged gives 1/E = f + (1-f)/S, so f = (1/E - 1/S) / (1 - 1/S). Reported, not
    fitted."""
    chk = b200_figures()["check"]["nvfp4-blog-llama3-8b"]
    m = chk["model"]
    dims = {k: m[k] for k in ("hidden", "ffn", "layers", "tokens", "qkv_out", "up_out")}
    dev = get_device(chk["device"], cal)
    n, hp = m["layers"], chk["bf16_last_layers"]
    e2e = chk["speedup"]["nvfp4"]

    def speedup(shape: TransformerShape) -> float:
        bf16 = price_layer("bf16", dev, shape).layer_ms
        fp4 = price_layer("nvfp4-te", dev, shape).layer_ms
        return n * bf16 / ((n - hp) * fp4 + hp * bf16)

    def share(s: float) -> float:
        return (1 / e2e - 1 / s) / (1 - 1 / s)

    gemm = speedup(TransformerShape(**dims))
    att = speedup(TransformerShape(**dims, heads=m["heads"], seq_len=m["seq_len"]))
    return {
        "source": chk["source"],
        "status": chk["status"],
        "device": chk["device"],
        "reported": e2e,
        "predicted_gemm_only": gemm,
        "implied_non_gemm_share": share(gemm),
        "predicted_with_attention": att,
        "implied_other_share": share(att),
    }


def main(path: str | Path | None = None) -> str:
    """Recompute the calibration; write it to ``path`` when given; return the TOML text."""
    text = calibration_toml(calibrate())
    if path is not None:
        Path(path).write_text(text)
    return text
