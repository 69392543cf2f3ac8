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
  plain tensors, keys as in the converted model's ``state_dict``), with the delayed-scaling
  state of each attention layer that runs `fp8lab.nn.DotProductAttention` (kept outside the
  module tree: ``<attention module>.dpa.fp8_dpa_*``, `fp8lab.nn.attention.hf_attention_dpas`).

The file proves which weights it belongs to: its safetensors metadata holds
``weights_sha256``, :func:`weights_sha256` of the model's parameters when it was written (names,
dtypes, shapes and bytes). A scale and amax history only mean something for the weights they
were measured with.

Restoring: ``convert`` of a model loaded with ``from_pretrained(DIR)`` (transformers records DIR
as ``config.name_or_path``) finds ``DIR/fp8lab_state.safetensors`` and loads it into the layers
it converts (a resume script does ``from_pretrained`` then ``convert``, as before) when the
model's weights are the file's; otherwise (a model built with
``from_config(AutoConfig.from_pretrained(DIR))``, random weights; a stale file left beside
newer weights by a plain ``save_pretrained``; a file without the hash) it is not applied and a
`UserWarning` says why. A script can call :func:`load_fp8_state` itself (weights that are not
the file's are a ValueError there; ``check_weights=False`` loads anyway). A file written under
another recipe, or for other layers, is refused with a ValueError naming the file
(``convert(..., retarget=True)`` starts fresh instead). :func:`save_fp8_state` writes the file
for any converted model (a model without converted layers is a ValueError: there is no state).

Loading weights without their FP8 state: a resume that loads only the weights into a converted
``transformers`` model (the HF ``Trainer``'s ``resume_from_checkpoint`` without
``fp8lab.integrations.hf.FP8LabCallback`` calls ``model.load_state_dict`` with the checkpoint's
``model.safetensors``) would restart the delayed-scaling state without a word. So the converted
model notes which layers got their weights but no ``fp8_*`` tensors; when no
:func:`load_fp8_state` has restored them by the next training forward, that forward warns once,
naming the layers and the remedy (the callback restores the state before the first step).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fp8lab.nn.attention import hf_attention_dpas
from fp8lab.nn.linear import Linear

__all__ = [
    "FP8_STATE_FILE",
    "fp8_state_dict",
    "load_fp8_state",
    "pretrained_dir",
    "save_fp8_state",
    "saved_weights_sha256",
    "strip_fp8_state",
    "weights_mismatch",
    "weights_sha256",
]

#: the file ``save_pretrained`` of a converted model writes beside its weights
FP8_STATE_FILE = "fp8lab_state.safetensors"
_FORMAT = {"format": "fp8lab-state", "version": "2"}  # safetensors metadata of the file
_WEIGHTS_KEY = "weights_sha256"  # the metadata entry binding the file to its weights (version 2)
_PENDING = "_fp8lab_weights_without_fp8_state"  # model.__dict__: layers loaded without their state
_HOOKED = "_fp8lab_load_hooks"  # model.__dict__: the load and forward hooks are registered
_PREFIX = "fp8_"  # every key a converted Linear adds to its state_dict
_DPA_PREFIX = "fp8_dpa_"  # every key of a DotProductAttention's state_dict


def _layers(model: torch.nn.Module) -> dict[str, Linear]:
    """``{state_dict prefix: module}`` of the converted layers ("" for a Linear model)."""
    return {(f"{n}." if n else ""): m for n, m in model.named_modules() if isinstance(m, Linear)}


def fp8_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The ``fp8_*`` entries of ``model.state_dict()`` (recipe fingerprints as uint8 tensors,
    delayed-scaling state) and, for a ``transformers`` model whose attention runs
    `fp8lab.nn.DotProductAttention` (kept outside its module tree), that attention's
    delayed-scaling state (``<attention module>.dpa.fp8_dpa_*``); copies on the CPU; empty for
    a model without converted layers."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in _layers(model).items():
        for k, v in m.state_dict().items():
            if k.startswith(_PREFIX):
                out[prefix + k] = v.detach().to("cpu", copy=True).contiguous()
    for name, dpa in hf_attention_dpas(model).items():
        for k, v in dpa.state_dict().items():
            out[f"{name}.{k}"] = v.detach().to("cpu", copy=True).contiguous()
    return out


def _is_attention_key(key: str) -> bool:
    """Whether a saved key is a routed attention's state (``<module>.dpa.fp8_dpa_*``)."""
    return key.rpartition(".")[2].startswith(_DPA_PREFIX)


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


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of ``model``'s parameters: each one's name, dtype, shape and bytes, in
    name order (a tied weight once, under its first name). The same for the converted and the
    unconverted model (a converted layer shares the original Parameters); another dtype, or
    one changed bit, is another digest. Reads every parameter once (copied to the CPU when it
    lives elsewhere)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name} {t.dtype} {list(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the bytes, without a copy
    return h.hexdigest()


def save_fp8_state(model: torch.nn.Module, path: str | Path) -> Path:
    """Write :func:`fp8_state_dict` of ``model`` to ``path`` (safetensors, atomically: a
    temporary file, then a rename) with :func:`weights_sha256` of its parameters in the
    metadata; returns ``path``. A directory ``path`` gets :data:`FP8_STATE_FILE` inside it.
    ValueError when ``model`` has no converted layer (there is no FP8 state to write)."""
    from safetensors.torch import save_file

    p = _state_file(path)
    if not _layers(model):
        raise ValueError(
            f"save_fp8_state: {type(model).__name__} has no converted layer, so no FP8 state "
            f"to write to {p}; convert it first (fp8lab.nn.convert(model, recipe))"
        )
    tmp = p.with_name(p.name + ".tmp")
    try:
        meta = {**_FORMAT, _WEIGHTS_KEY: weights_sha256(model)}
        save_file(fp8_state_dict(model), str(tmp), metadata=meta)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, p)
    return p


def _state_file(path: str | Path) -> Path:
    """The FP8 state file ``path`` names: itself, or :data:`FP8_STATE_FILE` in a directory."""
    p = Path(path)
    return p / FP8_STATE_FILE if p.is_dir() else p


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"{path}: no such FP8 state file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable FP8 state file ({exc})") from None


def saved_weights_sha256(path: str | Path) -> str | None:
    """The ``weights_sha256`` an FP8 state file (or a directory holding
    :data:`FP8_STATE_FILE`) was written with; None for a file written before it was recorded.
    ValueError naming the file when it is missing or unreadable."""
    from safetensors import SafetensorError, safe_open

    p = _state_file(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such FP8 state file")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{p}: not a readable FP8 state file ({exc})") from None
    return meta.get(_WEIGHTS_KEY)


def weights_mismatch(model: torch.nn.Module, path: str | Path) -> str | None:
    """Why the FP8 state file at ``path`` does not belong to ``model``'s weights (one sentence
    naming the file), or None when its recorded :func:`weights_sha256` is the model's."""
    p = _state_file(path)
    saved = saved_weights_sha256(p)
    if saved is None:
        return f"{p} does not record which weights it was saved with (written by an earlier fp8lab)"
    mine = weights_sha256(model)
    if saved != mine:
        return (
            f"{p} was saved with other weights than the model's (weights SHA-256 "
            f"{saved[:12]}... there, {mine[:12]}... here: a model built from the config with "
            "new weights, weights trained or saved after the file, or another dtype)"
        )
    return None


def load_fp8_state(
    model: torch.nn.Module,
    path: str | Path | Mapping[str, torch.Tensor],
    *,
    layers: Iterable[str] | None = None,
    strict: bool = True,
    check_weights: bool = True,
) -> list[str]:
    """Load the FP8 state saved by :func:`save_fp8_state` (or a converted model's
    ``save_pretrained``) into ``model``'s converted layers; returns their names.

    ``path``: the file, a directory holding :data:`FP8_STATE_FILE`, or the tensors themselves
    (:func:`fp8_state_dict`, e.g. a debug checkpoint's ``"fp8_state"``). ``layers``: only these
    converted layers (qualified names; default all; a routed attention's state is named
    ``<attention module>.dpa`` and is loaded into its `DotProductAttention`, made now when it
    has not run yet, which checks the saved recipe at its first forward). Every error is a
    ValueError naming the file: unreadable, a layer saved under another recipe (the saved
    numerics are named), a mismatched history length, with ``strict`` (the default) a
    converted layer the file has no state for, or state for a layer that is not converted (or
    for attention that does not run fp8lab's), and with ``check_weights``
    (the default) a file saved with other weights than ``model``'s (its recorded
    :func:`weights_sha256`; a file without it, or tensors given directly, are not checked)."""
    if isinstance(path, Mapping):
        p, saved = "FP8 state", dict(path)
    else:
        p = _state_file(path)
        saved = _read(p)
        # a file without the hash (version 1) is not checked: the caller named it
        why = None
        if check_weights and saved_weights_sha256(p) is not None:
            why = weights_mismatch(model, p)
        if why is not None:
            raise ValueError(
                f"{why}; its scales and amax histories were measured on those weights. Pass "
                "check_weights=False to load them anyway"
            )
    attention = {k: v for k, v in saved.items() if _is_attention_key(k)}
    saved = {k: v for k, v in saved.items() if k not in attention}
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
    done += _load_attention(model, attention, wanted, strict, p)
    pending = model.__dict__.get(_PENDING)
    if pending:  # these layers have their state back
        model.__dict__[_PENDING] = [n for n in pending if n not in done]
    return done


def _load_attention(model: torch.nn.Module, saved: Mapping[str, torch.Tensor],
                    wanted: set[str] | None, strict: bool, where: Any) -> list[str]:  # fmt: skip
    """Load the saved state of a ``transformers`` model's routed attention
    (``<module>.dpa.fp8_dpa_*``) into its `fp8lab.nn.DotProductAttention`, made now when it has
    not run yet (it applies the state at its first forward, checking the recipe there); returns
    the names loaded. ``strict``: state for attention that is not routed is a ValueError."""
    by_layer: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in saved.items():
        layer, _, last = k.rpartition(".")
        by_layer.setdefault(layer, {})[last] = v
    by_layer = {n: sub for n, sub in by_layer.items() if wanted is None or n in wanted}
    if not by_layer:
        return []
    dpas = hf_attention_dpas(model, create=True)
    extra = sorted(set(by_layer) - set(dpas))
    if strict and extra:
        raise ValueError(
            f"{where}: the FP8 state does not fit the model: attention state for layers that "
            f"do not run fp8lab's attention {extra}"
        )
    done = []
    for name, sub in by_layer.items():
        if name in dpas:
            try:
                dpas[name].load_state_dict(sub)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            done.append(name)
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
    :class:`SavePretrained` and the load check (module doc: weights loaded without their FP8
    state warn at the next training forward); remove it when no converted layer is left (the
    hooks stay registered, inert without it)."""
    has = isinstance(model.__dict__.get("save_pretrained"), SavePretrained)
    want = callable(getattr(type(model), "save_pretrained", None)) and bool(_layers(model))
    if want and not has:
        model.__dict__["save_pretrained"] = SavePretrained(model)
        if not model.__dict__.get(_HOOKED):
            model.register_load_state_dict_pre_hook(_before_load)
            model.register_forward_pre_hook(_before_forward)
            model.__dict__[_HOOKED] = True
    elif has and not want:
        del model.__dict__["save_pretrained"]
        model.__dict__.pop(_PENDING, None)


def _has_delayed_state(m: Linear) -> bool:
    """Whether a converted layer keeps state beyond its recipe fingerprint (delayed scaling)."""
    return any(k.startswith(_PREFIX) and k != "fp8_recipe" for k in m.state_dict())


def _before_load(module: torch.nn.Module, state_dict: Mapping[str, Any], prefix: str,
                 *_: Any) -> None:  # fmt: skip
    """``load_state_dict`` pre-hook: note the converted layers whose weights arrive without
    their ``fp8_*`` state (the weights of a ``save_pretrained`` directory), and forget those
    whose state arrives."""
    if not isinstance(module.__dict__.get("save_pretrained"), SavePretrained):
        return  # unconverted since
    pending = set(module.__dict__.get(_PENDING, ()))
    for pre, m in _layers(module).items():
        key = prefix + pre
        if f"{key}fp8_recipe" in state_dict:
            pending.discard(pre[:-1])
        elif f"{key}weight" in state_dict and _has_delayed_state(m):
            pending.add(pre[:-1])
    module.__dict__[_PENDING] = sorted(pending)


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook: the first training forward after weights were loaded without their
    FP8 state (and no :func:`load_fp8_state` since) warns once."""
    lost = module.__dict__.get(_PENDING)
    if not lost or not (module.training and torch.is_grad_enabled()):
        return
    module.__dict__[_PENDING] = []
    names = [n or "<model>" for n in lost]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    warnings.warn(
        f"fp8lab: {type(module).__name__} trains with weights loaded (load_state_dict) without "
        f"the FP8 state of its converted layers ({shown}): their delayed-scaling scales and amax "
        f"histories start afresh. A save_pretrained or HF Trainer checkpoint keeps that state in "
        f"{FP8_STATE_FILE}: after loading the weights call fp8lab.nn.load_fp8_state(model, "
        "CHECKPOINT_DIR), or give the Trainer fp8lab.integrations.hf.FP8LabCallback(), which "
        "restores it on resume_from_checkpoint",
        UserWarning,
        stacklevel=2,
    )
