"""A checkpoint of the user's own training loop that ``fp8lab debug --from-checkpoint`` starts from.

``save_debug_checkpoint(model, optimizer, step, path)`` writes one ``torch.save`` file of plain
tensors, numbers and strings (it loads with ``torch.load(weights_only=True)``), atomically (a
temporary file beside it, then a rename):

* ``model``: the weights, without the converted layers' ``fp8_*`` entries, named as the user's
  model names them (``model.state_dict()`` minus `fp8lab.nn.fp8_state.strip_fp8_state`);
* ``fp8_state``: those ``fp8_*`` entries (recipe fingerprints, delayed-scaling state);
* ``optimizer``: ``optimizer.state_dict()`` and ``param_names``, the model's name of each
  parameter in the optimizer's order (its state is keyed by position: the names let another
  optimizer over the same model, the debugger's, pick each parameter's moments);
* ``step``, ``rng`` (torch's CPU generator state, and CUDA's when initialised), ``recipe`` (the
  recipe's plain data, or None), ``model_identity`` (class, parameter names and shapes, the
  converted layers) and ``extra`` (the caller's plain data).

`read_debug_checkpoint` reads it back; every problem is a ValueError naming the file. What
``torch.load(weights_only=True)`` would refuse is refused when saving instead (the file would be
unreadable to ``fp8lab debug``): a NumPy array or any other object in ``extra`` or in the
optimizer's state is a ValueError naming its key; a ``model`` that is not a
``torch.nn.Module`` or an ``optimizer`` without ``state_dict``/``param_groups`` is a TypeError.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from fp8lab.nn.fp8_state import fp8_state_dict, strip_fp8_state
from fp8lab.nn.linear import Linear
from fp8lab.recipe import Recipe

__all__ = ["DEBUG_CHECKPOINT_FORMAT", "read_debug_checkpoint", "save_debug_checkpoint"]

DEBUG_CHECKPOINT_FORMAT = "fp8lab-debug-checkpoint"
_VERSION = 1
_KEYS = ("format", "version", "step", "model", "fp8_state", "optimizer", "rng", "model_identity")


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name of each optimizer parameter, in the optimizer's order."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        if id(p) not in names:
            raise ValueError(
                f"save_debug_checkpoint: optimizer parameter {i} ({tuple(p.shape)}) is not a "
                "parameter of the model"
            )
        out.append(names[id(p)])
    return out


def _identity(model: torch.nn.Module) -> dict[str, Any]:
    cls = type(model)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "parameters": {n: list(p.shape) for n, p in model.named_parameters()},
        "converted": [n for n, m in model.named_modules() if isinstance(m, Linear)],
    }


# what torch.load(weights_only=True) reads back besides containers and tensors
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size)  # fmt: skip


def _check_plain(obj: Any, where: str) -> None:
    """ValueError naming ``where`` (``extra['a'][2]``) at the first value that a
    ``weights_only`` load refuses: anything but plain numbers, strings, tensors and
    lists/tuples/dicts of them."""
    if type(obj) in _PLAIN:  # exact types: numpy.float64 is a float subclass, not plain
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise ValueError(
                f"save_debug_checkpoint: {where} is a {type(obj).__name__} (a tensor subclass); "
                "give a plain torch.Tensor (t.detach().clone() or torch.as_tensor)"
            )
        return
    if type(obj) in (dict, OrderedDict):  # not a defaultdict or other subclass
        for k, v in obj.items():
            _check_plain(k, f"a key of {where} ({k!r})")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple, set):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    hint = (
        " (torch.from_numpy(a), or a.tolist())"
        if type(obj).__module__.split(".")[0] == "numpy"
        else ""
    )
    raise ValueError(
        f"save_debug_checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}; "
        "the checkpoint holds plain data only (numbers, strings, tensors, lists, tuples and "
        f"dicts of them), which fp8lab debug reads back with torch.load(weights_only=True){hint}"
    )


def _rng() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return rng


def save_debug_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    path: str | Path,
    *,
    recipe: Recipe | str | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write what ``fp8lab debug --from-checkpoint`` needs from a training loop (module doc):
    weights, optimizer state, FP8 scaling state, ``step`` (steps done), RNG, model identity,
    ``recipe`` (a Recipe or preset name, recorded for the report; None: not recorded) and
    ``extra`` (plain data: numbers, strings, lists, dicts, tensors). Returns the path.

    The file is replaced atomically when it exists (a loop saves to the same path again);
    a directory ``path`` is a ValueError. Tensors are copied to the CPU."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"save_debug_checkpoint: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if not (hasattr(optimizer, "state_dict") and hasattr(optimizer, "param_groups")):
        raise TypeError(
            "save_debug_checkpoint: optimizer must be a torch.optim.Optimizer (the one training "
            f"model, for its moments), got {type(optimizer).__name__}"
        )
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"save_debug_checkpoint: {p} is a directory; give a file path")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_debug_checkpoint: step must be an integer >= 0, got {step!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        from fp8lab.recipe import get_recipe

        recipe = get_recipe(recipe)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_debug_checkpoint: extra must be a dict, got {type(extra).__name__}")
    _check_plain(dict(extra or {}), "extra")
    opt_state = _to_cpu(optimizer.state_dict())
    _check_plain(opt_state, f"the state of optimizer {type(optimizer).__name__}")
    cpu = torch.device("cpu")
    state = {
        "format": DEBUG_CHECKPOINT_FORMAT,
        "version": _VERSION,
        "step": step,
        "model": {k: v.detach().to(cpu) for k, v in strip_fp8_state(model).items()},
        "fp8_state": fp8_state_dict(model),
        "optimizer": {
            "class": type(optimizer).__name__,
            "param_names": _param_names(model, optimizer),
            "state_dict": opt_state,
        },
        "rng": _rng(),
        "recipe": None if recipe is None else recipe.to_dict(),
        "model_identity": _identity(model),
        "extra": dict(extra or {}),
    }
    tmp = p.with_name(p.name + ".tmp")
    try:
        torch.save(state, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, p)
    return p


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def read_debug_checkpoint(path: str | Path) -> dict[str, Any]:
    """The contents of a `save_debug_checkpoint` file (``weights_only`` load); ValueError
    naming the file when it is missing, unreadable (corrupt, truncated) or not such a file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such debug checkpoint file")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # zip errors, EOFError, UnpicklingError, OSError, ...
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no detail'}"
        raise ValueError(f"{p}: corrupt or truncated debug checkpoint ({reason})") from None
    if not isinstance(state, dict) or state.get("format") != DEBUG_CHECKPOINT_FORMAT:
        raise ValueError(
            f"{p}: not an fp8lab debug checkpoint (write one with "
            "fp8lab.save_debug_checkpoint(model, optimizer, step, path))"
        )
    missing = [k for k in _KEYS if k not in state]
    if missing or state["version"] != _VERSION:
        raise ValueError(
            f"{p}: debug checkpoint version {state.get('version')!r} with missing keys "
            f"{missing}; this fp8lab reads version {_VERSION}"
        )
    return state
