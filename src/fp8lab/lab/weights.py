"""Pretrained weights for the lab's models: safetensors files loaded strictly, and their hashes.

`fp8lab.lab.models` starts a model from weights in two ways: ``--model hf:DIR`` (a
``save_pretrained`` directory: ``config.json`` plus ``model.safetensors`` or the shards named by
``model.safetensors.index.json``) and ``--init-from FILE.safetensors`` (any model, the keys of
its own ``state_dict()``). Both go through :func:`load_strict`: every key of the model must be
in the files with its shape, and no other key may be (a tied weight, stored once, counts for
each of its names); a floating tensor of the model must be floating in the file (integer or
boolean values are not weights) and finite (a NaN or infinite weight is refused naming the
file and the tensor, instead of a run that "diverges" from its first step). Only safetensors is read: a pickled ``pytorch_model.bin`` could run code.
The run records :func:`weights_identity` (SHA-256 of each file, read in 1 MiB chunks), so a
run resumed on other weights is refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"  # a save_pretrained directory's tokenizer (fp8lab.lab.models)
_SHOWN = 6  # keys listed per kind of mismatch


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    """SHA-256 (hex) of a file, streamed; cached per file version (size, mtime)."""
    st = path.stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def weights_identity(files: list[Path]) -> dict[str, str]:
    """``{file name: sha256}`` of the weight files, in order."""
    return {f.name: sha256_file(f) for f in files}


def hf_dir_files(spec: str, d: Path) -> tuple[Path, list[Path]]:
    """(config.json, weight files) of a ``save_pretrained`` directory; ValueError naming the
    directory and what is missing."""
    config = d / CONFIG
    if not config.is_file():
        raise ValueError(
            f"--model {spec!r}: {d} has no {CONFIG}; hf:DIR takes a save_pretrained directory "
            f"({CONFIG} and {SINGLE}, or {INDEX} and its shards)"
        )
    if (d / SINGLE).is_file():
        return config, [d / SINGLE]
    if (d / INDEX).is_file():
        return config, _shards(spec, d / INDEX)
    pickled = [p.name for p in d.glob("*.bin")] + [p.name for p in d.glob("*.pt*")]
    hint = f" (found {', '.join(sorted(pickled))}: only safetensors is read)" if pickled else ""
    raise ValueError(
        f"--model {spec!r}: {d} has no weights: neither {SINGLE} nor {INDEX}{hint}; save with "
        "model.save_pretrained(DIR) (safetensors is its default)"
    )


def _shards(spec: str, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"--model {spec!r}: {index} is not a safetensors index (a JSON object with "
            f"'weight_map': {{key: shard file}}) ({type(exc).__name__}: {exc})"
        ) from None
    files = [index.parent / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"--model {spec!r}: {index} names shard(s) that are missing: {missing}")
    return files


def _shapes(files: list[Path], what: str) -> dict[str, tuple[Path, list[int], str]]:
    """Each key of the files -> (its file, its shape, its safetensors dtype such as "F32" or
    "I64"), read from the headers only."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[Path, list[int], str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 (a safetensors handle: not iterable)
                    sl = h.get_slice(k)
                    out[k] = (f, list(sl.get_shape()), str(sl.get_dtype()))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{what}: {f} is not a readable safetensors file ({exc})") from None
    return out


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each state_dict key -> the other keys sharing its tensor (tied weights)."""
    by_ptr: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        by_ptr.setdefault((v.data_ptr(), tuple(v.shape)), []).append(k)
    return {k: [o for o in ks if o != k] for ks in by_ptr.values() for k in ks}


def _listed(keys: list[str]) -> str:
    more = f" (+{len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def load_strict(model: nn.Module, files: list[Path], what: str) -> None:
    """Copy the tensors of ``files`` into ``model`` (cast to its dtypes), checking first, from
    the files' headers, that they fit: ValueError naming ``what`` and the files, listing the
    missing, unexpected and mismatched keys. Keys matching the model's
    ``_keys_to_ignore_on_load_unexpected`` patterns (transformers) are ignored. One tensor is
    read at a time: loading needs no second copy of the model in memory."""
    from safetensors import safe_open

    found = _shapes(files, what)
    own = model.state_dict()
    aliases = _aliases(model)
    ignore = [
        re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    ]
    source = {k: k if k in found else next((a for a in aliases[k] if a in found), None)
              for k in own}  # fmt: skip
    missing = [k for k, src in source.items() if src is None]
    unexpected = [k for k in found if k not in own and not any(p.search(k) for p in ignore)]
    wrong = [f"{k} {found[k][1]} (model {list(own[k].shape)})"
             for k in own if k in found and found[k][1] != list(own[k].shape)]  # fmt: skip
    # a floating weight stored as integers or booleans (safetensors "F*" and "BF16" are floats)
    kind = [f"{src} {found[src][2]} (model {own[k].dtype})" for k, src in source.items()
            if src is not None and own[k].is_floating_point()
            and not found[src][2].startswith(("F", "BF"))]  # fmt: skip
    if missing or unexpected or wrong or kind:
        parts = [f"{len(missing)} missing: {_listed(missing)}" if missing else "",
                 f"{len(unexpected)} unexpected: {_listed(unexpected)}" if unexpected else "",
                 f"{len(wrong)} of another shape: {_listed(wrong)}" if wrong else "",
                 f"{len(kind)} not floating point: {_listed(kind)}" if kind else ""]  # fmt: skip
        names = ", ".join(str(f) for f in files)
        raise ValueError(
            f"{what}: the weights in {names} do not fit the model: "
            + "; ".join(p for p in parts if p)
        )
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for k, t in own.items():
                    if found[source[k]][0] == f:
                        value = h.get_tensor(source[k])
                        if value.is_floating_point() and not bool(value.isfinite().all()):
                            bad = int((~value.isfinite()).sum())
                            raise ValueError(
                                f"{what}: {f}: tensor {source[k]} holds {bad} NaN or infinite "
                                f"value(s) of {value.numel()}; weights must be finite"
                            )
                        t.copy_(value)


def read_config(spec: str, path: Path) -> dict[str, Any]:
    """The JSON object of a config file (ValueError naming it when it does not parse)."""
    try:
        d = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"--model {spec!r}: {path} is not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--model {spec!r}: {path} must hold a JSON object (a model config)")
    return d
