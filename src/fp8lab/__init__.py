"""fp8lab: simulate, analyse and debug FP8-family low-precision training on a CPU, bit-faithfully.

The public API is re-exported here lazily (importing ``fp8lab`` does not import torch until a name
that needs it is used), layer by layer: formats -> scaling -> gemm -> nn -> lab.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # L0 formats
    "FloatFormat": "fp8lab.formats",
    "get_format": "fp8lab.formats",
    "format_names": "fp8lab.formats",
    "ROUNDING_MODES": "fp8lab.formats",
    "cast": "fp8lab.formats",
    "encode": "fp8lab.formats",
    "decode": "fp8lab.formats",
    "to_torch_float8": "fp8lab.formats",
    "from_torch_float8": "fp8lab.formats",
    # L0 which kernels run (numba on the CPU, device-generic torch elsewhere)
    "set_kernels": "fp8lab.kernels",
    "get_kernels": "fp8lab.kernels",
    "using_kernels": "fp8lab.kernels",
    # the fused GEMM's Triton kernel on CUDA (FP8LAB_TRITON, read once)
    "set_triton": "fp8lab.gemm.fused_triton",
    "get_triton": "fp8lab.gemm.fused_triton",
    "using_triton": "fp8lab.gemm.fused_triton",
    # L1 scaling / quantized tensors / statistics
    "QuantSpec": "fp8lab.qtensor",
    "QTensor": "fp8lab.qtensor",
    "quantize": "fp8lab.qtensor",
    "fake_quant": "fp8lab.qtensor",
    "retile": "fp8lab.qtensor",
    "rht16": "fp8lab.qtensor",
    "hadamard_transform": "fp8lab.qtensor",
    "DelayedScaling": "fp8lab.scaling",
    "DelayedScalingConfig": "fp8lab.scaling",
    # L2 GEMM and recipes
    "Accumulator": "fp8lab.gemm",
    "accumulators": "fp8lab.gemm",
    "qmatmul": "fp8lab.gemm",
    "Recipe": "fp8lab.recipe",
    "LayerRule": "fp8lab.recipe",
    "recipes": "fp8lab.recipe",
    "get_recipe": "fp8lab.recipe",
    # L3 PyTorch integration
    "autocast": "fp8lab.nn",
    "LossScaler": "fp8lab.optim",
    "save_debug_checkpoint": "fp8lab.nn",  # what `fp8lab debug --from-checkpoint` reads
    "watch": "fp8lab.observe",  # L6 statistics hooks
    # L6 cost model
    "predict_step_ms": "fp8lab.cost",
    # L7 anomaly guard
    "AnomalyGuard": "fp8lab.guard",
    "GuardedStep": "fp8lab.guard",
}
_SUBMODULES = {
    "formats",
    "kernels",
    "scaling",
    "qtensor",
    "gemm",
    "recipe",
    "nn",
    "optim",
    "stats",
    "lab",
}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"fp8lab.{name}")
    raise AttributeError(f"module 'fp8lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
