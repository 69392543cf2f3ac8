"""GPU device tables (``fp8lab/cost/devices/*.toml``): peaks, bandwidth, sources, and the
calibrated efficiencies (``fp8lab/cost/data/calibration.toml``).

Every number carries its source and a status: ``verified`` (the same figure on every public page
consulted) or ``reported`` (one source, or derived: dense = half of a "with sparsity" figure).
Where spec sheets disagree the table's ``note`` says so.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["DATA", "Device", "device_names", "get_device", "load_calibration"]

_HERE = Path(__file__).resolve().parent
DEVICES_DIR = _HERE / "devices"
DATA = _HERE / "data"

#: GEMM class -> the peak it runs at
PEAK_OF = {
    "bf16": "bf16",
    "fp16": "bf16",
    "fp8": "fp8",
    "fp8_block": "fp8",
    "mxfp8": "fp8",
    "nvfp4": "fp4",
}


@dataclass(frozen=True)
class Device:
    """One GPU: dense peaks (TFLOPS) by peak kind, bandwidth (TB/s), supported GEMM classes,
    whether FP8 operands must be K-major (Hopper), and calibrated efficiencies."""

    name: str
    description: str
    architecture: str
    fp8_needs_k_major: bool
    formats: tuple[str, ...]
    peak_tflops: dict[str, float]
    bandwidth_tbs: float
    efficiencies_from: str
    note: str = ""
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=dict)
    bandwidth_efficiency: float = 1.0
    kernel_us: float = 0.0
    peak_scaling: dict[str, Any] = field(default_factory=dict)

    def peak(self, gemm_class: str) -> float:
        """Dense peak in FLOP/s of a GEMM class."""
        return self.peak_tflops[PEAK_OF[gemm_class]] * 1e12

    def simt_flops(self) -> float | None:
        """FLOP/s of the CUDA cores in FP32 (non-tensor: per-element arithmetic of the
        quantization kernels, e.g. 4over6's candidate scales), None when the table lacks it."""
        v = self.peak_tflops.get("fp32")
        return None if v is None else v * 1e12

    def gemm_efficiency(self, gemm_class: str) -> float | None:
        """The calibrated efficiency of a GEMM class at this device's peak, None if not
        calibrated. A class listed in ``peak_scaling`` (``{"classes": [...],
        "tensor_core_efficiency": e, "fixed_tflops": r}``) has a kernel time of FLOPs / (peak x e)
        + FLOPs / r: the tensor cores' share scales with the peak, the rest (``r``, TFLOP/s) does
        not; its efficiency at peak P is 1 / (1/e + P/r) (`fp8lab.cost.calibration`)."""
        ps = self.peak_scaling
        if gemm_class in ps.get("classes", ()):
            peak_t = self.peak(gemm_class) / 1e12
            return 1.0 / (1.0 / ps["tensor_core_efficiency"] + peak_t / ps["fixed_tflops"])
        return self.efficiency.get(gemm_class)

    @property
    def bandwidth(self) -> float:
        """Bytes/s."""
        return self.bandwidth_tbs * 1e12

    def with_calibration(self, cal: dict[str, Any]) -> Device:
        """This device with efficiencies ``cal`` (``{"efficiency": {...},
        "bandwidth_efficiency": x, "kernel_us": y}``, optionally ``"peak_scaling"``: see
        `gemm_efficiency`)."""
        from dataclasses import replace

        return replace(
            self,
            efficiency=dict(cal.get("efficiency", {})),
            bandwidth_efficiency=float(cal.get("bandwidth_efficiency", 1.0)),
            kernel_us=float(cal.get("kernel_us", 0.0)),
            peak_scaling=dict(cal.get("peak_scaling", {})),
        )


def device_names() -> list[str]:
    """Names of the shipped device tables."""
    return sorted(p.stem for p in DEVICES_DIR.glob("*.toml"))


@cache
def _raw(name: str) -> dict[str, Any]:
    path = DEVICES_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(device_names())}")
    return tomllib.loads(path.read_text())


@cache
def load_calibration() -> dict[str, Any]:
    """The shipped calibration (``data/calibration.toml``), ``{}`` if absent."""
    path = DATA / "calibration.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def get_device(name: str, calibration: dict[str, Any] | None = None) -> Device:
    """The device table ``name`` with its calibrated efficiencies (from ``calibration``, default
    the shipped one, under the device's ``efficiencies_from`` key). Unknown names raise."""
    if not isinstance(name, str):
        raise TypeError(f"device name must be a str, got {type(name).__name__}")
    d = _raw(name.strip().lower())
    dev = Device(
        name=d["name"],
        description=d["description"],
        architecture=d["architecture"],
        fp8_needs_k_major=bool(d["fp8_needs_k_major"]),
        formats=tuple(d["formats"]),
        peak_tflops={k: float(v["value"]) for k, v in d["peak_tflops"].items()},
        bandwidth_tbs=float(d["bandwidth_tbs"]["value"]),
        efficiencies_from=d["efficiencies_from"],
        note=d.get("note", ""),
        sources={
            **{f"peak_{k}": v for k, v in d["peak_tflops"].items()},
            "bandwidth": d["bandwidth_tbs"],
        },
    )
    cal = load_calibration() if calibration is None else calibration
    return dev.with_calibration(cal.get(dev.efficiencies_from, {}))
