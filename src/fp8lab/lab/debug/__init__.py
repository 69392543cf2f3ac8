"""``fp8lab debug``: find which GEMM of which layer breaks an FP8 run, and a fix.

The method (:mod:`.method`): gap and noise, recovery, fake quantization, one-step attribution
screening (:mod:`.attribution`), confirmation probes and group testing over layers
(:mod:`.search`), culprit kinds beyond an operand (:mod:`.kinds`), remedies (:mod:`.remedies`),
verdict (:mod:`.verdict`) and the fix for Megatron-LM and Transformer Engine (:mod:`.export`).
Built-in scenarios plant known faults or set up published ones (:mod:`.scenarios`). See
docs/debug.md.
"""

from fp8lab.lab.debug.method import run_debug
from fp8lab.lab.debug.result import DebugResult
from fp8lab.lab.debug.scenarios import SCENARIOS, Scenario, get_scenario, plant

__all__ = ["SCENARIOS", "DebugResult", "Scenario", "get_scenario", "plant", "run_debug"]
