"""The objects of one lab run, built in one place for training (`fp8lab.lab.train.train_run`),
`fp8lab replay` and the debugger's step replay: the model (the same initial weights for every
recipe), data parallelism under torchrun, the optimizer, the loss scaler, the fault injector and
the anomaly guard's hook. ``cfg`` arguments are `fp8lab.lab.train.LabConfig` (its ``model``,
``train`` and ``inject`` sections; this module sits below ``train`` and reads them by name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fp8lab.lab import machine as machines
from fp8lab.lab import models
from fp8lab.lab.gpt import check_attention_recipe
from fp8lab.lab.inject import Injector

__all__ = [
    "RunParts",
    "build_model",
    "build_run_parts",
    "data_parallel",
    "guard_hook",
    "make_optimizer",
    "make_scaler",
    "write_resolved_recipe",
]

#: the run directory's copy of the recipe as resolved against the model (`write_resolved_recipe`)
RESOLVED_RECIPE = "recipe.toml"


def build_model(model_cfg: Any, recipe: Any, seed: int) -> torch.nn.Module:
    """Same initial weights for every recipe: init under ``seed`` first, then convert. The
    model is the built-in GPT or a user's (``model_cfg.factory``, see ``fp8lab.lab.models``),
    which maps ``(idx, targets)`` to ``(logits, loss)`` either way. Built and initialised on
    the CPU (the same weights on every device), then moved with its scaling state to the lab's
    torch device (`fp8lab.lab.machine.torch_device`). ``param_storage = "fp8"``: the converted
    weights then hold their FP8 values (`fp8lab.nn.fp8_params.store_fp8_params_`)."""
    model = models.build(model_cfg, seed)
    if recipe is not None:
        from fp8lab.nn import convert  # L3, imported lazily so the fp32 path needs no recipes

        convert(model, recipe)
        if models.is_builtin(model_cfg):  # FP8 attention's head size against its blocks
            check_attention_recipe(model_cfg, recipe)
        if recipe.param_storage == "fp8":
            from fp8lab.nn.fp8_params import store_fp8_params_

            store_fp8_params_(model)
    return model.to(machines.torch_device())


def write_resolved_recipe(run_path: Any, recipe: Any, model: torch.nn.Module) -> None:
    """Write ``run_path/recipe.toml``: ``recipe`` with its high-precision blocks
    (``hp_first_blocks`` / ``hp_last_blocks``) written out as the ``[[layer]]`` rule `convert`
    resolved for ``model``, for the user to read and edit (a recipe file). Only for a recipe
    with such blocks: nothing else is resolved against the model."""
    from fp8lab.nn import converted, resolve_blocks
    from fp8lab.recipe import Recipe

    if not isinstance(recipe, Recipe) or (
        recipe.hp_last_blocks == 0 and recipe.hp_first_blocks == 0
    ):
        return
    resolved = resolve_blocks(model, recipe, converted(model))
    (run_path / RESOLVED_RECIPE).write_text(resolved.to_toml(), encoding="utf-8")


def make_optimizer(model: torch.nn.Module, recipe: Any, cfg: Any) -> Any:
    """fp8lab AdamW (``AdamW.from_recipe``: the recipe's moment precision and master weights).

    Weight decay applies to matrices only (not to norm gains), as in nanoGPT."""
    from fp8lab.optim import AdamW

    groups = [
        {
            "params": [p for p in model.parameters() if p.dim() >= 2],
            "weight_decay": cfg.weight_decay,
        },
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    kw: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2)}
    if recipe is None:
        return AdamW(groups, **kw)
    if recipe.param_storage == "fp8":  # re-quantized after every step
        from fp8lab.nn.fp8_params import fp8_param_specs

        kw["param_specs"] = fp8_param_specs(model)
    return AdamW.from_recipe(groups, recipe, **kw)


def make_scaler(recipe: Any) -> Any:
    """The run's loss scaler: ``LossScaler.from_recipe`` (None for fp32, ``recipe`` None)."""
    from fp8lab.optim import LossScaler

    return None if recipe is None else LossScaler.from_recipe(recipe)


@dataclass
class RunParts:
    """The objects of one run (`build_run_parts`). ``dp``: `fp8lab.distributed.ddp.DataParallel`
    under torchrun with > 1 rank, else None; ``grun``: the guard's `fp8lab.guard.GuardHook` or
    None."""

    model: torch.nn.Module
    opt: Any
    scaler: Any
    injector: Injector
    dp: Any
    grun: Any


def build_run_parts(
    cfg: Any, recipe: Any, guard: Any = None, amax_group: str = "world",
    grad_comm: str = "fp32", fsdp: bool = False, fp8_allgather: bool = False,
) -> RunParts:  # fmt: skip
    """The objects of one run of ``recipe`` under ``cfg``: the one place the lab builds them,
    for training (`train_run`), `fp8lab replay` and the debugger's step replay alike, in this
    order: the model (`build_model`: the same initial weights for every recipe), data
    parallelism under torchrun (before the optimizer: FSDP's ``fully_shard`` replaces the
    parameters), the optimizer (`make_optimizer`), the loss scaler (`make_scaler`), the fault
    injector and the anomaly guard's hook (``guard``: an `fp8lab.AnomalyGuard` or its plain
    dict; None: none)."""
    if fsdp and recipe is not None and recipe.param_storage == "fp8":
        raise ValueError(
            f"recipe {recipe.name!r}: param_storage = 'fp8' is simulated on unsharded weights; "
            "--fsdp (which all-gathers shards) does not combine with it"
        )
    model = build_model(cfg.model, recipe, cfg.train.seed)
    dp = data_parallel(model, amax_group, grad_comm, fsdp, fp8_allgather)
    opt = make_optimizer(model, recipe, cfg.train)
    scaler = make_scaler(recipe)
    injector = Injector(model, cfg.inject)
    return RunParts(model, opt, scaler, injector, dp, guard_hook(guard, model, opt, scaler, recipe))


def data_parallel(
    model: torch.nn.Module, amax_group: str, grad_comm: str, fsdp: bool = False,
    fp8_allgather: bool = False,
) -> Any:  # fmt: skip
    """`fp8lab.distributed.ddp.DataParallel` of ``model`` under torch.distributed with > 1 rank (options
    checked either way: a bad value is an error even on one rank). ValueError for a model on the
    CPU under an NCCL process group (NCCL reaches GPU tensors only)."""
    from fp8lab.distributed.ddp import DataParallel, check_options
    from fp8lab.distributed.runtime import collective_device, world_size

    check_options(amax_group, grad_comm, fsdp, fp8_allgather)
    if world_size() == 1:
        return None
    param = next(model.parameters(), None)
    where = "cpu" if param is None else param.device.type
    if collective_device().type == "cuda" and where != "cuda":
        raise ValueError(
            f"the model is on {where} but the process group is NCCL (GPU tensors only): join "
            "it with the run's device (fp8lab.distributed.runtime.init_from_env(device=...), as "
            "--torch-device does) or train on the GPU"
        )
    return DataParallel(model, amax_group, grad_comm, fsdp, fp8_allgather)


def guard_hook(guard: Any, model, opt, scaler, recipe) -> Any:
    """The run's `fp8lab.guard.GuardHook` for ``guard`` (an AnomalyGuard or its dict; None:
    none)."""
    if guard is None:
        return None
    from fp8lab.guard.hook import GuardHook, as_guard

    return GuardHook(as_guard(guard, "train_run"), model, opt, scaler, recipe)
