"""Run checkpoints of the lab: the one place that saves (atomically), loads (``weights_only``),
keeps / rotates them, and says whether a checkpoint's configuration matches the run's.

A checkpoint (``checkpoint.pt``) holds the hooks' extras (`fp8lab.step.TrainStep.checkpoint`:
the guard's detectors, each rank's scaling state), ``config`` (`checkpoint_config`: lab config,
recipe settings, corpus fingerprint, a user model's identity), ``model``, ``optimizer``,
``scaler``, ``loop`` (the loop state), ``torch_rng`` and, on a GPU, ``cuda_rng`` (that device's
generator). Guarded runs keep the last ``keep`` of them as ``checkpoints/step-NNNNNN.pt`` (`keep`,
for ``fp8lab replay``).

Devices: every tensor is saved as a CPU tensor, whatever device the run computes on, and `load`
maps it onto the run's device (`fp8lab.lab.machine.torch_device`): a checkpoint written on a GPU
resumes on the CPU and the other way round (the device is not part of the configuration).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fp8lab.lab import models
from fp8lab.lab.data import Corpus
from fp8lab.lab.machine import torch_device

CHECKPOINT = "checkpoint.pt"
CHECKPOINTS = "checkpoints"  # guarded runs: the last `keep` checkpoints (step-NNNNNN.pt), replay


class ConfigMismatchError(ValueError):
    """A checkpoint or output directory was written under a different configuration."""


class CheckpointError(ValueError):
    """A run's checkpoint cannot be read (corrupt or truncated); the message says how to
    restart that run."""


def config_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            out += config_diff(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def mismatch_message(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why a run or output directory written under ``old`` cannot continue under ``new`` (None
    when it can). A recipe's description and source are prose and may change. Written before
    the corpus fingerprint existed, ``old`` lacks ``corpus``: its text cannot be checked and is
    accepted."""
    if "corpus" not in old:
        new = {k: v for k, v in new.items() if k != "corpus"}
    prose = ("recipe.description:", "recipe.source:")  # words, not numerics: may be reworded
    diff = [d for d in config_diff(old, new) if not d.startswith(prose)]
    if not diff:
        return None
    if all(d.startswith("corpus.") for d in diff):
        return (
            "the training text changed since this run started (corpus content hash "
            f"{old['corpus'].get('sha256', '?')[:12]}... -> {new['corpus']['sha256'][:12]}...)"
        )
    return f"Differences: {'; '.join(diff[:8])}"


def corpus_config(corpus: Corpus) -> dict[str, Any]:
    """What a run records of its training text: the content hash and the sizes."""
    return {
        "sha256": corpus.fingerprint,
        "train_bytes": int(corpus.train.numel()),
        "val_bytes": int(corpus.val.numel()),
    }


def recipe_settings(recipe: Any) -> dict[str, Any]:
    """The recipe's full settings as plain data (for the report and the config check);
    ``None`` is the plain-fp32 ``torch.nn.Linear`` model."""
    if recipe is None:
        return {"name": "fp32-torch", "description": "plain torch.nn.Linear in fp32"}
    return json.loads(json.dumps(recipe.to_dict(), default=str))


def recipe_name(recipe: Any) -> str:
    return "fp32-torch" if recipe is None else str(getattr(recipe, "name", repr(recipe)))


def checkpoint_config(cfg: Any, recipe: Any, corpus: Corpus | None = None) -> dict[str, Any]:
    """What a checkpoint must have been written under to be resumed: lab config, recipe
    settings, (when given) the corpus fingerprint, and a user model's identity (its factory
    and source hash, or its config file's hash: ``fp8lab.lab.models.model_identity``)."""
    out = {"lab": cfg.to_dict(), "recipe": recipe_settings(recipe)}
    identity = models.model_identity(cfg.model)
    if identity is not None:
        out["model"] = identity
    if corpus is not None:
        out["corpus"] = corpus_config(corpus)
    return out


def keep_last(run_path: Path, step: int, keep: int, rollback: bool = False) -> None:
    """Keep ``checkpoint.pt`` (just written at ``step``) as ``checkpoints/step-NNNNNN.pt`` too (a
    hard link: no copy; the next atomic save replaces checkpoint.pt, not the link), the newest
    ``keep`` of them. After a rollback the abandoned trajectory's checkpoints go."""
    d = run_path / CHECKPOINTS
    d.mkdir(exist_ok=True)
    for f in d.glob("step-*.pt"):
        if rollback and int(f.stem[5:]) > step:
            f.unlink()
    target = d / f"step-{step:06d}.pt"
    target.unlink(missing_ok=True)
    try:
        os.link(run_path / CHECKPOINT, target)
    except OSError:  # no hard links here (some network or FAT file systems): a copy
        shutil.copyfile(run_path / CHECKPOINT, target)
    for f in sorted(d.glob("step-*.pt"))[:-keep]:
        f.unlink()


def _no_space(path: Path, exc: BaseException) -> OSError:
    return OSError(errno.ENOSPC, f"no space left on the device while writing {path} ({exc})")


def write_text(path: Path, text: str) -> None:
    """Write a whole file atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def to_cpu(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples of tensors and plain data) with every tensor on the CPU
    (a CPU tensor is kept as is, not copied)."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


def save(path: Path, ckpt_cfg, model, opt, scaler, st: Any, extra=None) -> None:
    """Write a run checkpoint atomically (a temporary file, then a rename), every tensor on the
    CPU; a full disk is an ENOSPC OSError naming the file."""
    state = {
        **(extra or {}),
        "config": ckpt_cfg,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "loop": asdict(st),
        "torch_rng": torch.get_rng_state(),
    }
    device = torch_device()
    if device.type == "cuda":  # a user's model may draw on the GPU (dropout)
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    state = to_cpu(state)
    tmp = path.with_suffix(".tmp")
    try:
        torch.save(state, tmp)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        # a full disk reaches torch's zip writer as "... inline_container.cc ... unexpected pos"
        text = str(exc)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise _no_space(path, exc) from None
        if isinstance(exc, RuntimeError) and ("unexpected pos" in text or "write failed" in text):
            raise _no_space(path, exc) from None
        raise
    os.replace(tmp, path)  # atomic: an interrupted save never leaves a half checkpoint


def read(
    path: Path, fix: str, check: bool = True, map_location: str | torch.device = "cpu"
) -> dict[str, Any]:
    """A checkpoint's contents (``torch.load`` with ``weights_only=True``, tensors mapped to
    ``map_location``; the RNG states stay on the CPU); `CheckpointError` ``"PATH: corrupt or
    truncated checkpoint (REASON)" + fix`` when it cannot be read (with ``check``: also when it
    is not an fp8lab run checkpoint)."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
        for key in ("torch_rng", "cuda_rng"):  # byte tensors the generators take on the CPU
            if isinstance(state, dict) and isinstance(state.get(key), torch.Tensor):
                state[key] = state[key].cpu()
        if check and (not isinstance(state, dict) or not {"config", "model", "loop"} <= set(state)):
            raise ValueError("not an fp8lab run checkpoint")
    except Exception as exc:  # zip errors, EOFError, UnpicklingError, OSError, ...
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no detail'}"
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint ({reason}){fix}") from None
    return state


def load(path: Path, ckpt_cfg, model, opt, scaler, name: str = "", prepare=None) -> dict[str, Any]:
    """Resume from ``path``: refuse a checkpoint written under another configuration
    (`ConfigMismatchError`), load model, optimizer, scaler and RNG (``prepare(state)`` first:
    the guard's escalations) onto the lab's torch device (the model's and optimizer's tensors
    follow their parameters' device); return the loop state's fields."""
    device = torch_device()
    state = read(
        path,
        f". To restart {'recipe ' + repr(name) if name else 'this run'} from step 0, delete its "
        f"folder {path.parent} and rerun the same command (the other runs are kept).",
        map_location=device,
    )
    why = mismatch_message(state["config"], ckpt_cfg)
    if why:
        raise ConfigMismatchError(
            f"{path} was written under a different configuration; refusing to resume "
            f"(use a new output directory). {why}"
        )
    if prepare is not None:  # the guard: escalated layers' recipes before their state loads
        prepare(state)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["torch_rng"])
    if device.type == "cuda" and state.get("cuda_rng") is not None:  # absent: written on a CPU
        torch.cuda.set_rng_state(state["cuda_rng"], device)
    # written before the data cursor existed: batch index = step
    return {"cursor": state["loop"]["step"], **state["loop"]}
