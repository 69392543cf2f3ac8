"""``fp8lab debug --from-checkpoint``: start every probe from a user's training checkpoint.

A checkpoint written by `fp8lab.save_debug_checkpoint` in the user's own loop becomes the
debugger's step 0: :func:`read_start` checks it against the lab's model (``--model``: the
weights must fit it exactly) and turns it into a lab run checkpoint at step 0 (weights, the
AdamW moments picked by parameter name, the FP8 state, the loop at step 0, the saved RNG);
:func:`write_start` writes it into the debug run's folder. R, the baseline and the noise pair
then continue from it for ``--steps`` (`fp8lab.lab.debug.runner.convert_checkpoint`: a layer
whose saved recipe has the probe's numerics keeps its saved scaling state, as R's layers do
when R is the recipe the user trained with; the others start fresh), and every later stage
works from their runs as it does from scratch.

The user's names become the lab's: a factory's model is wrapped in
`fp8lab.lab.models.CausalLM`, whose parameter names gain the prefix ``model.``
(`fp8lab.lab.debug.names`); ``fix.toml`` names the layers both ways (`fp8lab.lab.debug.verdict`).
The optimizer's moments are taken when it kept Adam's (``exp_avg``, ``exp_avg_sq``, ``step``:
``torch.optim.Adam``/``AdamW``, fp8lab's AdamW); any other optimizer's state is not AdamW's
and the debugger's AdamW starts with fresh moments (``start["moments"]`` says which).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fp8lab.lab.checkpoint import checkpoint_config
from fp8lab.lab.data import Corpus
from fp8lab.lab.debug.names import lab_prefix
from fp8lab.lab.loop import LoopState
from fp8lab.lab.parts import build_model, make_optimizer
from fp8lab.lab.train import LabConfig
from fp8lab.lab.weights import sha256_file

START = "start.pt"
_ADAM = ("exp_avg", "exp_avg_sq", "step")


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path,
                  spec: str) -> None:  # fmt: skip
    """Load ``weights`` into ``model`` strictly; ValueError naming the file otherwise."""
    try:
        res = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # shapes
        lines = [ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln]
        raise ValueError(
            f"{path}: the weights do not fit --model {spec!r}: " + "; ".join(lines[:4])
        ) from None
    if res.missing_keys or res.unexpected_keys:
        parts = []
        for what, keys in (("missing", res.missing_keys), ("unexpected", res.unexpected_keys)):
            if keys:
                more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
                parts.append(f"{len(keys)} {what}: {', '.join(keys[:5])}{more}")
        raise ValueError(f"{path}: the weights do not fit --model {spec!r}: " + "; ".join(parts))


def _moments(model: torch.nn.Module, opt: Any, saved: dict[str, Any], prefix: str) -> dict:
    """The lab optimizer's state (by its parameter index) from the saved optimizer's (by the
    saved parameter names); empty when the saved optimizer kept no Adam moments."""
    names = [prefix + n for n in saved.get("param_names", [])]
    states = saved.get("state_dict", {}).get("state", {})
    by_name = {n: states.get(i, states.get(str(i))) for i, n in enumerate(names)}
    if not any(isinstance(s, dict) and all(k in s for k in _ADAM) for s in by_name.values()):
        return {}
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        s = by_name.get(name_of[id(p)])
        if not s or any(k not in s for k in _ADAM):
            continue
        out[i] = {k: torch.as_tensor(s[k]).detach().to(torch.float32).clone() for k in _ADAM}
        out[i]["step"] = out[i]["step"].reshape(())
    return out


def read_start(path: str | Path, cfg: LabConfig, corpus: Corpus) -> dict[str, Any]:
    """The lab run checkpoint at step 0 made from the debug checkpoint ``path`` (in memory);
    its ``"start"`` entry records the source (path, SHA-256, the user's step, moments kept or
    fresh, layers with saved FP8 state). ValueError naming the file: missing, unreadable, not
    a debug checkpoint, or weights that do not fit ``cfg``'s model."""
    from fp8lab.nn.debug_checkpoint import read_debug_checkpoint

    p = Path(path)
    state = read_debug_checkpoint(p)
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model, None, cfg.train.seed)
    prefix = lab_prefix(model)
    spec = getattr(cfg.model, "factory", "gpt")
    _load_weights(model, {prefix + k: v for k, v in state["model"].items()}, p, spec)
    opt = make_optimizer(model, None, cfg.train)
    osd = opt.state_dict()
    osd["state"] = _moments(model, opt, state["optimizer"], prefix)
    fp8 = {prefix + k: v for k, v in state["fp8_state"].items()}
    return {
        "config": checkpoint_config(cfg, None, corpus),
        "model": {**model.state_dict(), **fp8},
        "optimizer": osd,
        "scaler": None,
        "loop": asdict(LoopState()),
        "torch_rng": state["rng"]["torch"],
        "start": {
            "path": str(p),
            "sha256": sha256_file(p),
            "step": int(state["step"]),
            "moments": "kept" if osd["state"] else "fresh",
            "fp8_layers": sorted({k.rpartition(".")[0] for k in fp8}),
        },
    }


def write_start(start: dict[str, Any], out: Path) -> Path:
    """Write :func:`read_start`'s checkpoint as ``out/start.pt`` (atomically); its path."""
    dst = out / START
    tmp = dst.with_name(dst.name + ".tmp")
    torch.save(start, tmp)
    tmp.replace(dst)
    return dst
