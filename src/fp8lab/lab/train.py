"""The training loop of the lab: one recipe, one model, fp32 master weights, resumable.

``train_run(recipe, cfg, corpus, run_dir, callback)`` trains a :class:`~fp8lab.lab.gpt.GPT` (or
a user's model: ``cfg.model.factory``, see :mod:`fp8lab.lab.models`) under a recipe (``None`` =
plain fp32 ``torch.nn.Linear``) and writes into ``run_dir``:

- ``metrics.jsonl``: one record per step -- ``step`` (steps done), ``lr``, ``train_loss``,
  ``grad_norm`` (before clipping), ``skipped`` / ``skipped_steps``, ``loss_scale``, ``spike``,
  ``tokens``, ``step_time_s``, and ``val_loss`` on evaluation steps; non-finite numbers are null.
- ``stats.jsonl``: every ``stats_every`` steps, one record per layer x GEMM x role of each
  quantized operand the GEMMs consumed: amax, scale, underflow %, saturation %, SQNR -- the
  records of ``fp8lab.watch`` (``fp8lab.observe.sample``, docs/observe.md), with ``step`` the
  number of steps done.
- ``checkpoint.pt``: model (incl. scaling state), optimizer, loss scaler, RNG and loop state.
- with an anomaly guard (``guard=``, `fp8lab.guard.GuardHook`, docs/guard.md): ``guard_events`` in
  every metrics record and the summary, and ``checkpoints/step-NNNNNN.pt``, the last ``keep``
  checkpoints (for ``fp8lab replay``).

Guarantees: the initial weights depend on ``train.seed`` only (the model is built and
initialised before the recipe converts it), batch ``i`` is the same for every recipe, and
rerunning with the same ``run_dir`` continues from the checkpoint with bit-identical results;
a checkpoint written under another configuration, recipe or training text (the corpus content
hash, not its path) is refused. A step whose loss or gradients are not finite is skipped
(weights untouched) and counted; ``max_nonfinite_steps`` such steps in a row end the run as
diverged. A finished run is diverged too when its final losses are not finite or its final
validation loss exceeds ln(vocabulary) (5.55 nats for bytes: worse than a uniform guess).
The library never prints: progress goes to ``callback``.
"""

from __future__ import annotations

import contextlib
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from fp8lab._keys import check_keys
from fp8lab.lab import machine as machines
from fp8lab.lab import models
from fp8lab.lab.checkpoint import (  # noqa: F401  (public names of this module)
    CHECKPOINT,
    CHECKPOINTS,
    CheckpointError,
    ConfigMismatchError,
    checkpoint_config,
    config_diff,
    corpus_config,
    mismatch_message,
    recipe_name,
    recipe_settings,
)
from fp8lab.lab.data import Corpus, DataConfig
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.inject import InjectConfig, Injector
from fp8lab.lab.loop import (  # noqa: F401  (public names of this module)
    DIVERGED_MARGIN_NATS,
    METRICS,
    STATS,
    Callback,
    LoopState,
    Run,
    RunResult,
    diverged_loss,
    evaluate,
    read_metrics,
    read_stats,
    run_loop,
    summarize,
)
from fp8lab.lab.models import ModelConfig
from fp8lab.lab.parts import build_run_parts


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and logging settings (the same for every recipe of a comparison)."""

    steps: int = 400
    batch_size: int = 8  # sequences of model.block_size bytes per step
    # peak learning rate. With beta2 0.99, 1e-3 leaves the byte-bigram plateau (val ~2.49) within
    # 400 steps (fp32: 2.26) and keeps runs that differ only in rounding close (fp32 vs bf16:
    # 0.05 %); 2e-3 learns faster but fp32 and bf16 drift 1-2 % apart; 3e-3 / 0.95 stays on the
    # plateau (2.47)
    lr: float = 1e-3
    warmup_steps: int = 25  # linear warmup, then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    seed: int = 1337  # initial weights and batch order
    eval_every: int = 25  # validation loss every k steps (and at the end)
    eval_batches: int = 4
    stats_every: int = 100  # operand statistics every k steps (0 = off)
    checkpoint_every: int = 50  # and at the end
    spike_threshold: float = 0.2  # a spike: loss > (1 + t) * EMA of the previous losses
    max_nonfinite_steps: int = 10  # that many non-finite losses in a row = diverged

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "max_nonfinite_steps",
        ):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"train.{name} must be a positive integer, got {v!r}")
        for name in ("warmup_steps", "stats_every", "seed"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ValueError(f"train.{name} must be an integer >= 0, got {v!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"train.lr must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("weight_decay", "grad_clip", "spike_threshold"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based): linear warmup, cosine to the floor."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LabConfig:
    """Everything that defines a run except the recipe: model, data, training, injection.
    ``model`` is a :class:`~fp8lab.lab.models.ModelConfig` (the GPT's sizes and ``factory``;
    a plain GPTConfig is the built-in GPT)."""

    model: GPTConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = self.model.to_dict()  # "factory" only when it is not the built-in GPT
        d["data"] = self.data.to_dict()  # tokenizer, token_dtype only when set
        if d["inject"]["nan_step"] == -1:  # off: configs written before the key existed match
            del d["inject"]["nan_step"]
        if d["inject"]["outlier_weights"] == "train":  # the default: older configs match
            del d["inject"]["outlier_weights"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LabConfig:
        """Build from plain data, type-checking every key: an error names the table and key
        (``[train] lr: expected a number, got the string '1e-3'``). A string where a list of
        paths is expected is one path (``[data] paths = "file.txt"``), never its characters."""
        check_keys(d, SECTIONS, "config section")
        kwargs = {}
        for name, klass in SECTIONS.items():
            section = d.get(name, {})
            if not isinstance(section, Mapping):
                raise ValueError(f"[{name}] must be a table, got {_describe(section)}")
            check_keys(section, [f.name for f in fields(klass)], f"[{name}]")
            typed = {f.name: _typed(name, f, section[f.name]) for f in fields(klass)
                     if f.name in section}  # fmt: skip
            try:
                kwargs[name] = klass(**typed)
            except (TypeError, ValueError) as exc:
                msg = str(exc)
                known = msg.startswith((f"[{name}]", f"{name}."))
                raise ValueError(msg if known else f"[{name}] {msg}") from None
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> tuple[LabConfig, dict[str, Any]]:
        """Read a TOML file: sections ``[model]`` ``[data]`` ``[train]`` ``[inject]`` -> LabConfig; any other
        top-level table (e.g. ``[compare]``) is returned untouched as the second value. Every
        error starts with the file name."""
        try:
            with open(path, "rb") as f:
                d = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML ({exc})") from None
        rest = {k: v for k, v in d.items() if k not in SECTIONS}
        try:
            return cls.from_dict({k: v for k, v in d.items() if k in SECTIONS}), rest
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def check(self) -> None:
        """Checks across sections (each section checks itself when built): the gradient spike
        must fall inside the run, the model factory must resolve (module or file found, the
        function callable, a config file that parses), and the outlier glob must match a Linear
        of the model. Raises ValueError naming the keys."""
        spike = self.inject.grad_spike_step
        if spike >= self.train.steps:
            raise ValueError(
                f"inject.grad_spike_step={spike} is beyond the run (train.steps="
                f"{self.train.steps}: steps 0..{self.train.steps - 1}); use -1 for no spike"
            )
        if self.inject.nan_step >= self.train.steps:
            raise ValueError(
                f"inject.nan_step={self.inject.nan_step} is beyond the run (train.steps="
                f"{self.train.steps}); use -1 for no NaN"
            )
        if not models.is_builtin(self.model):
            models.resolve(models.factory_of(self.model))
        if self.inject.outlier_channels > 0:
            # the built-in GPT on the meta device (names and shapes only: no memory, no
            # initialisation); a user's model may not build there
            meta = (
                torch.device("meta") if models.is_builtin(self.model) else contextlib.nullcontext()
            )
            with torch.random.fork_rng(devices=[]), meta:
                model = models.build(self.model, self.train.seed)
            Injector(model, self.inject).remove()

    def with_overrides(self, assignments: list[str] | tuple[str, ...]) -> LabConfig:
        """Apply ``SECTION.KEY=VALUE`` strings (VALUE in TOML syntax, bare words as strings),
        e.g. ``train.batch_size=16`` or ``data.paths=["a.txt"]``."""
        d = self.to_dict()
        for item in assignments:
            key, sep, raw = item.partition("=")
            section, dot, name = key.strip().partition(".")
            if not sep or not dot or section not in d:
                raise ValueError(
                    f"--set {item!r}: expected SECTION.KEY=VALUE with SECTION one of {sorted(d)}"
                )
            try:
                value = tomllib.loads(f"v = {raw.strip()}")["v"]
            except tomllib.TOMLDecodeError:
                value = raw.strip()
            d[section][name.strip()] = value
        try:
            return LabConfig.from_dict(d)
        except ValueError as exc:
            raise ValueError(f"--set: {exc}") from None

    def to_toml(self) -> str:
        """The configuration as a TOML document that :meth:`from_toml` reads back."""
        blocks = []
        for name, section in self.to_dict().items():
            body = [f"{k} = {toml_value(v)}" for k, v in section.items()]
            blocks.append("\n".join([f"[{name}]", *body]))
        return "\n\n".join(blocks) + "\n"

    def replace_train(self, **kw: Any) -> LabConfig:
        return replace(self, train=replace(self.train, **kw))


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "inject": InjectConfig}


def _describe(v: Any) -> str:
    if isinstance(v, str):
        return f"the string {v!r}"
    return f"{type(v).__name__} {v!r}"


def _typed(section: str, f: Any, v: Any) -> Any:
    """``v`` checked against the field's annotation (a string: postponed annotations)."""
    where, t = f"[{section}] {f.name}", f.type
    if t == "int" and not (isinstance(v, int) and not isinstance(v, bool)):
        raise ValueError(f"{where}: expected an integer, got {_describe(v)}")
    if t == "float":
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{where}: expected a number, got {_describe(v)}")
        return float(v)
    if t == "str" and not isinstance(v, str):
        raise ValueError(f"{where}: expected a string, got {_describe(v)}")
    if t.startswith("tuple[str"):
        if isinstance(v, str):
            return (v,)
        if not (isinstance(v, list | tuple) and all(isinstance(x, str) for x in v)):
            raise ValueError(f"{where}: expected a list of strings, got {_describe(v)}")
        return tuple(v)
    return v


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    return repr(v)


# ----------------------------------------------------------------------------- the run
def train_run(
    recipe: Any,
    cfg: LabConfig,
    corpus: Corpus,
    run_dir: str | Path | None = None,
    callback: Callback | None = None,
    stop_after: int | None = None,
    amax_group: str = "world",
    grad_comm: str = "fp32",
    guard: Any = None,
    fsdp: bool = False,
    fp8_allgather: bool = False,
    torch_device: str | torch.device | None = None,
) -> RunResult:
    """Train one recipe; return its summary (see :func:`summarize`), model and records.

    ``torch_device``: where the model, its scaling state, the batches and the optimizer state
    live (``cpu``, ``cuda``, ``cuda:N``, ``auto``); None: the lab's device of this process
    (`fp8lab.lab.machine.torch_device`, the CPU unless set). Checkpoints hold CPU tensors and
    load onto the run's device, so a run resumes on another device.

    ``guard``: an `fp8lab.guard.AnomalyGuard` (or its plain dict) watching every step
    (`fp8lab.guard.GuardHook`); the summary then has ``guard_events`` (actions taken: rollback,
    skip, escalate; empty for a clean run) and, after an escalation, ``effective_recipe``;
    every metrics record has ``guard_events`` (the events handled just before it). A guard
    that takes no action changes nothing: the run is bit-identical to an unguarded one.

    ``run_dir`` None keeps everything in memory (no checkpoint). ``stop_after`` stops after that
    many steps in total (for tests of resume; the run is then incomplete).

    Under torch.distributed (torchrun) the model runs as DDP on every rank
    (`fp8lab.distributed.ddp.DataParallel`: the global batch split across ranks, loss = token sum /
    global token count, ``amax_group`` world|none, ``grad_comm`` fp32|bf16|fp8|fp8-msamp; or
    FSDP2 with ``fsdp``, gathering weights as FP8 codes with ``fp8_allgather``); rank 0 alone
    writes metrics (plus the ranks' communication fields), checkpoints (consolidated) and
    run.json, so a checkpoint resumes on any number of ranks. Single-process runs are unchanged.
    The steps run through `fp8lab.step.TrainStep`; the loop is `fp8lab.lab.loop.run_loop`;
    the run's objects come from `build_run_parts`.
    """
    if torch_device is not None:
        with machines.using_torch_device(torch_device):
            return train_run(recipe, cfg, corpus, run_dir, callback, stop_after, amax_group,
                             grad_comm, guard, fsdp, fp8_allgather)  # fmt: skip
    cfg.check()
    # on a GPU, deterministic kernels: a resumed run must give the uninterrupted run's bits
    with machines.deterministic_kernels(machines.torch_device()):
        p = build_run_parts(cfg, recipe, guard, amax_group, grad_comm, fsdp, fp8_allgather)
        run = Run(
            cfg=cfg, recipe=recipe, corpus=corpus, parts=p,
            run_path=None if run_dir is None else Path(run_dir),
            ckpt_cfg=checkpoint_config(cfg, recipe, corpus), emit=callback or (lambda event: None),
            name=recipe_name(recipe),
        )  # fmt: skip
        return run_loop(run, stop_after)
