"""L0: number formats and rounding onto them."""

from fp8lab.formats.spec import FloatFormat, format_names, get_format

__all__ = ["FloatFormat", "format_names", "get_format"]
