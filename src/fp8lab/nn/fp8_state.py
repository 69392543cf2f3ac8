"""The FP8 state of a converted model on its own: saved beside the weights, restored on convert.

A converted :class:`fp8lab.nn.Linear` keeps its recipe fingerprint (``fp8_recipe``) and its
delayed-scaling state (``fp8_<key>_<field>``) in its own ``state_dict``, so the lab's run
checkpoints and their bit-identical resume need nothing else. A ``transformers`` model is
different: ``save_pretrained`` writes what the *unconverted* architecture loads, and a plain
``from_pretrained`` would report every ``fp8_*`` tensor as an unexpected key. So, for a model
that has ``save_pretrained``, `fp8lab.nn.convert` installs a per-instance ``save_pretrained``
that

* writes the weights without the ``fp8_*`` tensors (the unconverted architecture loads them
  with no unexpected keys), through transformers' own ``save_pretrained(state_dict=...)``;
* writes the FP8 state beside them as ``fp8lab_state.safetensors`` (:data:`FP8_STATE_FILE`,
  plain tensors, keys as in the converted model's ``state_dict``).

Restoring: ``convert`` of a model loaded with ``from_pretrained(DIR)`` (transformers records DIR
as ``config.name_or_path``) finds ``DIR/fp8lab_state.safetensors`` and loads it into the layers
it converts (a resume script does ``from_pretrained`` then ``convert``, as before), or a script
calls :func:`load_fp8_state` itself. A file written under another recipe, or for other layers,
is refused with a ValueError naming the file (``convert(..., retarget=True)`` starts fresh
instead). :func:`save_fp8_state` writes the file for any model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fp8lab.nn.linear import Linear

__all__ = [
    "FP8_STATE_FILE",
    "fp8_state_dict",
    "load_fp8_state",
    "pretrained_dir",
    "save_fp8_state",
    "strip_fp8_state",
]

#: the file ``save_pretrained`` of a converted model writes beside its weights
FP8_STATE_FILE = "fp8lab_state.safetensors"
_FORMAT = {"format": "fp8lab-state", "version": "1"}  # safetensors metadata of the file
_PREFIX = "fp8_"  # every key a converted Linear adds to its state_dict


def _layers(model: torch.nn.Module) -> dict[str, Linear]:
    """``{state_dict prefix: module}`` of the converted layers ("" for a Linear model)."""
    return {(f"{n}." if n else ""): m for n, m in model.named_modules() if isinstance(m, Linear)}


def fp8_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The ``fp8_*`` entries of ``model.state_dict()`` (recipe fingerprints as uint8 tensors,
    delayed-scaling state), copies on the CPU; empty for a model without converted layers."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in _layers(model).items():
        for k, v in m.state_dict().items():
            if k.startswith(_PREFIX):
                out[prefix + k] = v.detach().to("cpu", copy=True).contiguous()
    return out


def strip_fp8_state(
    model: torch.nn.Module, state_dict: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``state_dict`` (default ``model.state_dict()``) without the converted layers' ``fp8_*``
    entries: what the unconverted architecture loads with no unexpected keys."""
    sd = model.state_dict() if state_dict is None else state_dict
    layers = _layers(model)

    def ours(key: str) -> bool:
        prefix, _, last = key.rpartition(".")
        return last.startswith(_PREFIX) and (f"{prefix}." if prefix else "") in layers

    return {k: v for k, v in sd.items() if not ours(k)}


def save_fp8_state(model: torch.nn.Module, path: str | Path) -> Path:
    """Write :func:`fp8_state_dict` of ``model`` to ``path`` (safetensors, atomically: a
    temporary file, then a rename); returns ``path``. A directory ``path`` gets
    :data:`FP8_STATE_FILE` inside it."""
    from safetensors.torch import save_file

    p = Path(path)
    if p.is_dir():
        p = p / FP8_STATE_FILE
    tmp = p.with_name(p.name + ".tmp")
    try:
        save_file(fp8_state_dict(model), str(tmp), metadata=dict(_FORMAT))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, p)
    return p


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"{path}: no such FP8 state file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable FP8 state file ({exc})") from None


def load_fp8_state(
    model: torch.nn.Module,
    path: str | Path | Mapping[str, torch.Tensor],
    *,
    layers: Iterable[str] | None = None,
    strict: bool = True,
) -> list[str]:
    """Load the FP8 state saved by :func:`save_fp8_state` (or a converted model's
    ``save_pretrained``) into ``model``'s converted layers; returns their names.

    ``path``: the file, a directory holding :data:`FP8_STATE_FILE`, or the tensors themselves
    (:func:`fp8_state_dict`, e.g. a debug checkpoint's ``"fp8_state"``). ``layers``: only these
    converted layers (qualified names; default all). Every error is a ValueError naming the
    file: unreadable, a layer saved under another recipe (the saved numerics are named), a
    mismatched history length, and with ``strict`` (the default) a converted layer the file
    has no state for, or state for a layer that is not converted."""
    if isinstance(path, Mapping):
        p, saved = "FP8 state", dict(path)
    else:
        p = Path(path)
        p = p / FP8_STATE_FILE if p.is_dir() else p
        saved = _read(p)
    all_layers = _layers(model)
    wanted = None if layers is None else set(layers)
    chosen = {pre: m for pre, m in all_layers.items() if wanted is None or pre[:-1] in wanted}
    if strict:
        extra = {k.rpartition(".")[0] for k in saved} - {pre[:-1] for pre in all_layers}
        missing = [pre[:-1] or "<model>" for pre in chosen if f"{pre}fp8_recipe" not in saved]
        if extra or missing:
            why = []
            if missing:
                why.append(f"no state for the converted layers {missing}")
            if extra:
                why.append(f"state for layers that are not converted {sorted(extra)}")
            raise ValueError(f"{p}: the FP8 state does not fit the model: " + "; ".join(why))
    done = []
    for pre, m in chosen.items():
        sub = {k[len(pre) :]: v for k, v in saved.items()
               if k.startswith(pre) and "." not in k[len(pre) :]}  # fmt: skip
        if not sub:
            continue
        try:  # the Linear checks recipe, keys, history length and finiteness
            m.load_state_dict(sub, strict=False)
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from None
        done.append(pre[:-1])
    return done


def pretrained_dir(model: torch.nn.Module) -> Path | None:
    """The directory ``model`` was loaded from with ``transformers``' ``from_pretrained``
    (``config.name_or_path``) when it holds :data:`FP8_STATE_FILE`; else None."""
    cfg = getattr(model, "config", None)
    where = getattr(cfg, "name_or_path", None) or getattr(model, "name_or_path", None)
    if not isinstance(where, (str, os.PathLike)) or not str(where):
        return None
    d = Path(where)
    return d if (d / FP8_STATE_FILE).is_file() else None


class SavePretrained:
    """A converted model's ``save_pretrained`` (installed on the instance by ``convert``):
    transformers' own, given the state_dict without the ``fp8_*`` tensors, then
    :data:`FP8_STATE_FILE` beside the weights (main process only, as transformers writes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        kwargs["state_dict"] = strip_fp8_state(model, kwargs.get("state_dict"))
        out = type(model).save_pretrained(model, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True) and Path(save_directory).is_dir():
            save_fp8_state(model, Path(save_directory) / FP8_STATE_FILE)
        return out


def install_save_pretrained(model: torch.nn.Module) -> None:
    """Give a model with ``save_pretrained`` (transformers) the converted model's
    :class:`SavePretrained`; remove it when no converted layer is left."""
    has = isinstance(model.__dict__.get("save_pretrained"), SavePretrained)
    want = callable(getattr(type(model), "save_pretrained", None)) and bool(_layers(model))
    if want and not has:
        model.__dict__["save_pretrained"] = SavePretrained(model)
    elif has and not want:
        del model.__dict__["save_pretrained"]
