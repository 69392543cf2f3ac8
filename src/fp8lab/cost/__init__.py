"""`fp8lab.cost`: what a recipe costs on a GPU before anyone rents one.

* `count_linear_step` — exact per-tensor passes of one Linear step (amax, cast, transpose,
  re-tilings from quantized values or from high precision, scale bytes, promotion FMAs), counted
  from fp8lab's own execution (`fp8lab.cost.counting`);
* `price_layer` / `predict_step_ms` — a roofline with efficiencies calibrated on Transformer
  Engine's published GEMM timings (`fp8lab.cost.model`, `fp8lab.cost.calibration`);
* `get_device` / `device_names` — device tables with sources (`fp8lab.cost.devices`);
* `collective_bytes` — bytes per rank and step of the gradient reduction, amax all-reduces and
  FSDP all-gathers (`fp8lab.cost.collectives`);
* `linear_shapes` / `repeated_block` — a built model's quantized Linears as shapes to price
  (`fp8lab.cost.shapes`);
* `expert_rows` / `wire_traffic` / `expert_routing` — mixture of experts: the rows each
  expert's grouped GEMMs run on (padding included) and the token all-to-alls' bytes in the
  ``[moe] dispatch`` format (`fp8lab.cost.moe`);
* `simulated_memory` / `model_memory` — the bytes a recipe's training step would hold: weights,
  optimizer states, saved activations (`fp8lab.cost.memory`).
"""

from fp8lab.cost.collectives import CollectiveBytes, collective_bytes
from fp8lab.cost.counting import Event, GemmEvent, StepCounts, count_linear_step
from fp8lab.cost.devices import Device, device_names, get_device
from fp8lab.cost.memory import model_memory, simulated_memory
from fp8lab.cost.model import (
    SCENARIOS,
    LayerCost,
    TransformerShape,
    UnpriceableError,
    predict_or_reason,
    predict_step_ms,
    price_layer,
    price_linears,
)
from fp8lab.cost.moe import expert_rows, wire_traffic
from fp8lab.cost.shapes import expert_routing, linear_shapes, other_parameters, repeated_block

__all__ = [
    "SCENARIOS",
    "CollectiveBytes",
    "Device",
    "Event",
    "GemmEvent",
    "LayerCost",
    "StepCounts",
    "TransformerShape",
    "UnpriceableError",
    "collective_bytes",
    "count_linear_step",
    "device_names",
    "expert_routing",
    "expert_rows",
    "get_device",
    "linear_shapes",
    "model_memory",
    "other_parameters",
    "predict_or_reason",
    "predict_step_ms",
    "price_layer",
    "price_linears",
    "repeated_block",
    "simulated_memory",
    "wire_traffic",
]
