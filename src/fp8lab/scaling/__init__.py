"""L1: how a tensor is scaled before a cast — granularity, scale rules, delayed scaling."""

from fp8lab.scaling import rules as _rules
from fp8lab.scaling.delayed import DelayedScaling, DelayedScalingConfig, DelayedScalingState
from fp8lab.scaling.granularity import (
    NAMED_GRANULARITIES,
    block_amax,
    canonical_granularity,
    expand_blocks,
    normalize_granularity,
    transpose_granularity,
)
from fp8lab.scaling.rules import *  # noqa: F403  (re-exports exactly rules.__all__)

__all__ = [
    "NAMED_GRANULARITIES",
    "DelayedScaling",
    "DelayedScalingConfig",
    "DelayedScalingState",
    "block_amax",
    "canonical_granularity",
    "expand_blocks",
    "normalize_granularity",
    "transpose_granularity",
    *_rules.__all__,
]
