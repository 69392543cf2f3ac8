"""A small TOML writer for recipes (tomllib only reads)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["dump_toml"]


def _toml_key(k: str) -> str:
    if k and all(c.isalnum() or c in "_-" for c in k):
        return k
    return json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are valid TOML
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_array_of_tables(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, Mapping) for x in v)


def dump_toml(d: Mapping[str, Any], prefix: str = "") -> str:
    """``d`` as TOML: scalars, then ``[tables]``, then ``[[arrays of tables]]`` (a list of
    tables, e.g. a recipe's ``[[layer]]`` rules) last, so no key lands in the wrong table."""
    arrays = [(k, v) for k, v in d.items() if _is_array_of_tables(v)]
    tables = [(k, v) for k, v in d.items() if isinstance(v, Mapping)]
    scalars = [
        (k, v) for k, v in d.items() if not isinstance(v, Mapping) and not _is_array_of_tables(v)
    ]
    out = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars]
    for k, v in tables:
        name = f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k)
        body = dump_toml(v, name)
        out.append("")
        out.append(f"[{name}]")
        if body:
            out.append(body)
    for k, items in arrays:
        name = f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k)
        for item in items:
            body = dump_toml(item, name)
            out += ["", f"[[{name}]]"] + ([body] if body else [])
    return "\n".join(out).strip("\n") + ("\n" if not prefix else "")
