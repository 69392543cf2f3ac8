"""Deprecated module path: `fp8lab.nn.Linear` lives in `fp8lab.nn.linear`."""

from fp8lab.nn.linear import Linear

__all__ = ["Linear"]
