"""L0: number formats and rounding onto them."""

from fp8lab.formats.spec import FloatFormat, format_names, get_format

__all__ = [
    "ROUNDING_MODES",
    "FloatFormat",
    "cast",
    "decode",
    "default_rounding",
    "encode",
    "format_names",
    "from_torch_float8",
    "get_format",
    "to_torch_float8",
]

_LAZY = {
    "ROUNDING_MODES": "fp8lab.formats.rounding",
    "cast": "fp8lab.formats.rounding",
    "default_rounding": "fp8lab.formats.rounding",
    "encode": "fp8lab.formats.codec",
    "decode": "fp8lab.formats.codec",
    "to_torch_float8": "fp8lab.formats.codec",
    "from_torch_float8": "fp8lab.formats.codec",
}


def __getattr__(name: str):
    # torch and numba are imported only when a cast/codec name is first used
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fp8lab.formats' has no attribute {name!r}")
