"""Where watch records go: JSONL (default), CSV (``.csv``), TensorBoard scalars; and reading a
record file back (`read_records`, with clear errors for missing, empty or corrupt files)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from fp8lab.observe.records import FIELDS
from fp8lab.stats import json_safe

__all__ = ["CsvSink", "JsonlSink", "TensorBoardSink", "open_sink", "read_records"]

#: the metrics written as TensorBoard scalars
TB_METRICS = ("amax", "scale", "underflow_pct", "saturation_pct", "sqnr_db")


class JsonlSink:
    """One JSON object per line; non-finite floats (an exact operand's SQNR) become null."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.f.write(json.dumps(json_safe(r)) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class CsvSink:
    """A header of `FIELDS`, then one line per record (``inf`` written as ``inf``)."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115
        self.w = csv.DictWriter(self.f, fieldnames=list(FIELDS))
        self.w.writeheader()

    def write(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in FIELDS})
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class TensorBoardSink:
    """Scalars ``LAYER/GEMM/ROLE/METRIC`` at the record's step (``torch.utils.tensorboard``)."""

    def __init__(self, logdir: Path) -> None:
        try:
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "fp8lab.watch(tensorboard=...) needs the 'tensorboard' package: "
                "pip install tensorboard"
            ) from None
        self.w = SummaryWriter(log_dir=str(logdir))

    def write(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            tag = f"{r['layer']}/{r['gemm']}/{r['role']}"
            for k in TB_METRICS:
                v = r.get(k)
                if isinstance(v, float) and math.isfinite(v):
                    self.w.add_scalar(f"{tag}/{k}", v, r["step"])
        self.w.flush()

    def close(self) -> None:
        self.w.close()


def open_sink(path: str | Path) -> JsonlSink | CsvSink:
    """CSV when ``path`` ends in ``.csv``, else JSONL. The parent directory is created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return CsvSink(p) if p.suffix.lower() == ".csv" else JsonlSink(p)


_NUMERIC = ("amax", "scale", "scale_min", "scale_max", "underflow_pct", "saturation_pct",
            "sqnr_db")  # fmt: skip
_REQUIRED = ("step", "layer", "gemm", "role", "underflow_pct", "saturation_pct")


def _num(v: Any, where: str, key: str) -> float | None:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field {key!r} is not a number: {v!r}") from None


def _check(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise ValueError(f"{where}: not an fp8lab.watch record (missing {', '.join(missing)})")
    out = dict(row)
    try:
        out["step"] = int(row["step"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field 'step' is not an integer: {row['step']!r}") from None
    for k in _NUMERIC:
        if k in out:
            out[k] = _num(out[k], where, k)
    return out


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a watch file (JSONL, or CSV by its ``.csv`` suffix).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file and line
    for an empty file, a line that does not parse, or rows that are not watch records."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    if p.is_dir():
        raise ValueError(f"{p}: is a directory, expected a watch record file (JSONL or CSV)")
    rows: list[dict[str, Any]] = []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not a text file (expected JSONL or CSV watch records)") from None
    if p.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        for i, r in enumerate(reader, start=2):
            rows.append(_check(r, f"{p}:{i}"))
    else:
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{i}: not valid JSON ({exc.msg})") from None
            rows.append(_check(obj, f"{p}:{i}"))
    if not rows:
        raise ValueError(f"{p}: no records (empty file)")
    return rows
