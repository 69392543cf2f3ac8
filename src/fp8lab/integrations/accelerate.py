"""HF accelerate and a model fp8lab converted: `check_prepared`.

``Accelerator(mixed_precision="fp8")`` runs FP8 through one of its own backends, a closed set:
torchao (``Float8Linear``), NVIDIA Transformer Engine and MS-AMP. Its ``prepare`` swaps every
``torch.nn.Linear`` but the first and the last for the backend's layer -- and an
`fp8lab.nn.Linear` *is* a ``torch.nn.Linear``, so a converted model silently loses its fp8lab
layers (13 of a Llama's 14, issue 25) and trains under torchao's recipe instead of fp8lab's.
`check_prepared` finds that and refuses. fp8lab's numerics come from its own layers: keep
``mixed_precision="bf16"`` or ``"no"`` in accelerate and the recipe in `fp8lab.nn.convert`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["FOREIGN_FP8", "check_prepared", "foreign_fp8_layers"]

#: module prefixes of the FP8 layers accelerate's backends put into a model
FOREIGN_FP8 = {
    "torchao.float8": "torchao",
    "transformer_engine": "Transformer Engine",
    "msamp": "MS-AMP",
}


def foreign_fp8_layers(model: torch.nn.Module) -> dict[str, str]:
    """Layer name -> backend of every module of ``model`` that is another library's FP8 layer."""
    out = {}
    for name, m in model.named_modules():
        mod = type(m).__module__
        for prefix, backend in FOREIGN_FP8.items():
            if mod == prefix or mod.startswith(prefix + "."):
                out[name] = backend
    return out


def _accelerate_fp8() -> bool:
    """Whether an ``Accelerator`` of this process was built with ``mixed_precision="fp8"``."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return False
    shared = getattr(AcceleratorState, "_shared_state", {})
    return bool(shared) and str(shared.get("_mixed_precision", "")) == "fp8"


def check_prepared(model: torch.nn.Module, converted: Iterable[str] | None = None) -> None:
    """Refuse a converted model that an FP8 backend of accelerate has (partly) taken over.

    ``model``: the model after ``accelerator.prepare`` (unwrapped or not); ``converted``: the
    qualified names of its `fp8lab.nn.Linear` layers before ``prepare`` (the callbacks note them
    at init), so layers replaced entirely are found too. Raises RuntimeError naming the replaced
    layers and what to use instead when fp8lab layers were replaced by torchao / Transformer
    Engine / MS-AMP layers, or sit beside them, or the process's Accelerator runs
    ``mixed_precision="fp8"``; returns None otherwise."""
    from fp8lab.nn import Linear

    inner = getattr(model, "module", model)  # DistributedDataParallel and friends
    ours = [n for n, m in inner.named_modules() if isinstance(m, Linear)]
    foreign = foreign_fp8_layers(inner)
    before = set(converted or ())
    replaced = sorted(n for n in before if n in foreign)
    if not ours and not replaced:
        return  # not an fp8lab model (or fp8lab layers were never there)
    if not foreign and not _accelerate_fp8():
        return
    backends = sorted(set(foreign.values())) or ["accelerate's FP8 backend"]
    what = (f"{len(replaced)} of its {len(before)} fp8lab layers were replaced"
            f" ({', '.join(replaced[:4])}{', ...' if len(replaced) > 4 else ''})" if replaced
            else f"{len(foreign)} layers run {' and '.join(backends)} FP8 beside its "
                 f"{len(ours)} fp8lab layers" if foreign
            else "accelerate's mixed_precision is 'fp8'")  # fmt: skip
    raise RuntimeError(
        f"this model was converted with fp8lab.nn.convert, but accelerate's FP8 mode took it "
        f"over: {what} by {' and '.join(backends)}. accelerate's mixed_precision='fp8' runs its "
        "own FP8 backends (a closed set: torchao, Transformer Engine, MS-AMP), not fp8lab's "
        "recipe. Use Accelerator(mixed_precision='bf16') or 'no' (TrainingArguments: bf16=True "
        "or neither bf16 nor fp16) and keep the recipe in fp8lab.nn.convert(model, recipe)."
    )
