"""Deprecated module path: the Linear's autograd Function and `linear` live in `fp8lab.nn.linear`."""

from fp8lab.nn.linear import linear

__all__ = ["linear"]
