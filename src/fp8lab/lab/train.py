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
- with an anomaly guard (``guard=``, `fp8lab.lab.guard_run`, docs/guard.md): ``guard_events`` in
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
import errno
import json
import math
import os
import shutil
import statistics
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from fp8lab._keys import check_keys
from fp8lab.lab import machine as machines
from fp8lab.lab import models
from fp8lab.lab.data import Corpus, DataConfig, get_batch, val_batches
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.inject import InjectConfig, Injector
from fp8lab.lab.models import ModelConfig
from fp8lab.stats import json_safe

Callback = Callable[[dict[str, Any]], None]
CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
STATS = "stats.jsonl"
CHECKPOINTS = "checkpoints"  # guarded runs: the last `keep` checkpoints (step-NNNNNN.pt), replay


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
        d["data"]["paths"] = list(self.data.paths)
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


# ----------------------------------------------------------------------------- recipes
def recipe_settings(recipe: Any) -> dict[str, Any]:
    """The recipe's full settings as plain data (for the report and the config check);
    ``None`` is the plain-fp32 ``torch.nn.Linear`` model."""
    if recipe is None:
        return {"name": "fp32-torch", "description": "plain torch.nn.Linear in fp32"}
    return json.loads(json.dumps(recipe.to_dict(), default=str))


def recipe_name(recipe: Any) -> str:
    return "fp32-torch" if recipe is None else str(getattr(recipe, "name", repr(recipe)))


def build_model(model_cfg: GPTConfig, recipe: Any, seed: int) -> torch.nn.Module:
    """Same initial weights for every recipe: init under ``seed`` first, then convert. The
    model is the built-in GPT or a user's (``model_cfg.factory``, see ``fp8lab.lab.models``),
    which maps ``(idx, targets)`` to ``(logits, loss)`` either way."""
    model = models.build(model_cfg, seed)
    if recipe is not None:
        from fp8lab.nn import convert  # L3, imported lazily so the fp32 path needs no recipes

        convert(model, recipe)
    return model


def make_optimizer(model: torch.nn.Module, recipe: Any, cfg: TrainConfig):
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
    kw = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2)}
    return AdamW(groups, **kw) if recipe is None else AdamW.from_recipe(groups, recipe, **kw)


# ----------------------------------------------------------------------------- helpers
def _num(x: float | None) -> float | None:
    """JSON-safe number: non-finite -> None."""
    return x if x is not None and math.isfinite(x) else None


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats/byte) over fixed validation batches.

    Runs under ``no_grad``, where converted layers discard the forward amaxes instead of
    updating their delayed scales, so evaluating never changes the training trajectory
    (tested: a run evaluated every step equals one evaluated at the end only)."""
    was_training = model.training
    model.eval()
    try:
        losses = [float(model(x, y)[1]) for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep only records with step <= max_step (work done after the last checkpoint is redone)."""
    records = [r for r in _read_jsonl(path) if r["step"] <= max_step]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return _read_jsonl(Path(run_dir) / METRICS)


def read_stats(run_dir: str | Path) -> list[dict[str, Any]]:
    return _read_jsonl(Path(run_dir) / STATS)


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


#: nats above ln(vocab_size) a final validation loss may sit without counting as diverged: an
#: untrained model guesses nearly uniformly (the GPT after 2 steps: 5.5501 vs ln 256 = 5.5452),
#: a diverged one is far above (3449 in issue 11); 0.5 nats = 1.65x less likely than uniform
DIVERGED_MARGIN_NATS = 0.5


def diverged_loss(final_train: float | None, final_val: float | None, vocab_size: int) -> bool:
    """The loss rule of divergence: a non-finite (None) final loss, or a final validation loss
    more than :data:`DIVERGED_MARGIN_NATS` above ln(vocab_size) nats (clearly worse than a
    uniform guess: 6.05 for bytes)."""
    if final_train is None or final_val is None:
        return True
    return final_val > math.log(vocab_size) + DIVERGED_MARGIN_NATS


# ----------------------------------------------------------------------------- the loop
@dataclass
class RunResult:
    summary: dict[str, Any]
    model: torch.nn.Module
    records: list[dict[str, Any]]


@dataclass
class LoopState:
    step: int = 0  # steps done
    ema: float | None = None  # EMA of finite train losses (spike detector)
    skipped_steps: int = 0
    nonfinite_run: int = 0
    diverged: bool = False
    # anomaly guard (fp8lab.lab.guard_run): the batch index of the next step (ahead of `step`
    # once batches were skipped) and the fields a rollback never rewinds
    cursor: int = 0
    injected: list[str] = field(default_factory=list)  # one-shot faults that fired ("nan@T")
    guard_events: list[dict[str, Any]] = field(default_factory=list)
    skip_batches: list[int] = field(default_factory=list)
    escalations: list[list[str]] = field(default_factory=list)  # [layer, key] pinned to current


def checkpoint_config(cfg: LabConfig, recipe: Any, corpus: Corpus | None = None) -> dict[str, Any]:
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
) -> RunResult:
    """Train one recipe; return its summary (see :func:`summarize`), model and records.

    ``guard``: an `fp8lab.guard.AnomalyGuard` (or its plain dict) watching every step
    (`fp8lab.lab.guard_run`); the summary then has ``guard_events`` (actions taken: rollback,
    skip, escalate; empty for a clean run) and, after an escalation, ``effective_recipe``;
    every metrics record has ``guard_events`` (the events handled just before it). A guard
    that takes no action changes nothing: the run is bit-identical to an unguarded one.

    ``run_dir`` None keeps everything in memory (no checkpoint). ``stop_after`` stops after that
    many steps in total (for tests of resume; the run is then incomplete).

    Under torch.distributed (torchrun) the model runs as DDP on every rank
    (`fp8lab.dist.ddp.DataParallel`: the global batch split across ranks, loss = token sum /
    global token count, ``amax_group`` world|none, ``grad_comm`` fp32|bf16|fp8|fp8-msamp; or
    FSDP2 with ``fsdp``, gathering weights as FP8 codes with ``fp8_allgather``); rank 0 alone
    writes metrics (plus the ranks' communication fields), checkpoints (consolidated) and
    run.json, so a checkpoint resumes on any number of ranks. Single-process runs are unchanged.
    """
    from fp8lab.optim import LossScaler

    cfg.check()
    tc = cfg.train
    name = recipe_name(recipe)
    emit = callback or (lambda event: None)
    model = build_model(cfg.model, recipe, tc.seed)
    # before the optimizer: FSDP's fully_shard replaces the parameters
    dp = _data_parallel(model, amax_group, grad_comm, fsdp, fp8_allgather)
    opt = make_optimizer(model, recipe, tc)
    scaler = None if recipe is None else LossScaler.from_recipe(recipe)
    injector = Injector(model, cfg.inject)
    params = [p for g in opt.param_groups for p in g["params"]]
    writer = dp is None or dp.is_main  # rank 0 writes every file
    st = LoopState()
    grun = _guard_run(guard, model, opt, scaler, recipe)
    run_path = None if run_dir is None else Path(run_dir)
    ckpt_cfg = checkpoint_config(cfg, recipe, corpus)
    if run_path is not None:
        run_path.mkdir(parents=True, exist_ok=True)
        if (run_path / CHECKPOINT).exists():
            ck_model, ck_opt = (model, opt) if dp is None else dp.for_checkpoint(opt, save=False)
            st = _load_checkpoint(run_path / CHECKPOINT, ckpt_cfg, ck_model, ck_opt, scaler, name,
                                  prepare=grun.prepare_load if grun else None)  # fmt: skip
            if dp is not None:  # each rank's own scaling state (they differ with amax none)
                dp.load_checkpoint_extra(run_path / CHECKPOINT)
            if writer:
                _truncate_jsonl(run_path / METRICS, st.step)
                _truncate_jsonl(run_path / STATS, st.step)
        elif writer:  # a fresh run: drop partial logs of a run that never checkpointed
            for f in (METRICS, STATS):
                (run_path / f).unlink(missing_ok=True)
            shutil.rmtree(run_path / CHECKPOINTS, ignore_errors=True)
    records: list[dict[str, Any]] = read_metrics(run_path) if run_path is not None else []
    val = val_batches(corpus.val, tc.batch_size, cfg.model.block_size, tc.seed, tc.eval_batches)
    tokens_per_step = tc.batch_size * cfg.model.block_size
    emit({"event": "start", "recipe": name, "step": st.step, "steps": tc.steps})
    metrics_f = open(run_path / METRICS, "a") if run_path and writer else None  # noqa: SIM115
    stats_f = open(run_path / STATS, "a") if run_path and writer else None  # noqa: SIM115
    try:
        end = tc.steps if stop_after is None else min(tc.steps, stop_after)
        if grun is not None:
            grun.snapshot(st)  # the first last-good state: the start (or the checkpoint)
        while st.step < end and not st.diverged:
            rec, stat_rows = _train_step(
                model, opt, scaler, injector, params, corpus, cfg, recipe, st, tokens_per_step, dp,
                grun,
            )  # fmt: skip
            if grun is not None:  # every detector signal of the step (the early-warning study)
                emit({"event": "guard_signals", "recipe": name, **grun.monitor.signals})
            if grun is not None and grun.after_step(st) == "rollback":
                # the abandoned steps leave the records, the logs and the checkpoint
                records[:] = [r for r in records if r["step"] <= st.step]
                if metrics_f:
                    metrics_f.close()
                    stats_f.close()
                    _truncate_jsonl(run_path / METRICS, st.step)
                    _truncate_jsonl(run_path / STATS, st.step)
                    metrics_f = open(run_path / METRICS, "a")  # noqa: SIM115
                    stats_f = open(run_path / STATS, "a")  # noqa: SIM115
                if run_path:  # the restored state at once (FSDP: every rank gathers it)
                    ck_model, ck_opt = (model, opt) if dp is None else dp.for_checkpoint(opt)
                    ck_extra = {**grun.checkpoint_extra(),
                                **(dp.checkpoint_extra() if dp is not None else {})}  # fmt: skip
                    if writer:
                        _save_checkpoint(run_path / CHECKPOINT, ckpt_cfg, ck_model, ck_opt,
                                         scaler, st, ck_extra)  # fmt: skip
                        _keep_checkpoint(run_path, st.step, grun.guard.keep, rollback=True)
                    if dp is not None:
                        dp.barrier()
                emit({"event": "guard", "recipe": name, **st.guard_events[-1]})
                continue
            if grun is not None:
                rec["guard_events"] = grun.take_events()
                for ev in rec["guard_events"]:
                    emit({"event": "guard", "recipe": name, **ev})
            done = st.step
            if done % tc.eval_every == 0 or done == tc.steps:
                rec["val_loss"] = _num(evaluate(model, val))
            records.append(rec)
            if metrics_f:
                metrics_f.write(json.dumps(rec) + "\n")
            if stats_f:
                for row in stat_rows:
                    stats_f.write(json.dumps(json_safe({**row, "step": done})) + "\n")
            last = done == tc.steps or st.diverged or done == end
            if run_path and (done % tc.checkpoint_every == 0 or last):
                # FSDP: every rank gathers the full tensors for rank 0's consolidated checkpoint
                ck_model, ck_opt = (model, opt) if dp is None else dp.for_checkpoint(opt)
                # every rank's scaling state too (collective: gathered on every rank)
                ck_extra = {**(grun.checkpoint_extra() if grun else {}),
                            **(dp.checkpoint_extra() if dp is not None else {})}  # fmt: skip
                if writer:
                    metrics_f.flush()
                    stats_f.flush()
                    _save_checkpoint(run_path / CHECKPOINT, ckpt_cfg, ck_model, ck_opt, scaler,
                                     st, ck_extra or None)  # fmt: skip
                    if grun is not None:
                        _keep_checkpoint(run_path, st.step, grun.guard.keep)
                if dp is not None:
                    dp.barrier()  # no rank runs ahead of the last checkpoint
            emit({"event": "step", "recipe": name, **rec, "steps": tc.steps})
    finally:
        injector.remove()
        for f in (metrics_f, stats_f):
            if f:
                f.close()
    summary = summarize(records, tc.steps, st, models.vocab_size_of(model, cfg.model))
    summary["recipe"] = name
    if grun is not None:
        summary["guard_events"] = list(st.guard_events)
        if st.escalations:
            summary["effective_recipe"] = recipe_settings(grun.effective_recipe)
    emit({"event": "end", "recipe": name, **summary})
    if run_path and writer:
        vocab = models.vocab_size_of(model, cfg.model)
        # the machine that computed it (fp8lab.lab.machine): recorded, not part of the identity
        run = {"summary": summary, "vocab_size": vocab, **ckpt_cfg,
               "machine": machines.machine_info()}  # fmt: skip
        _write_text(run_path / "run.json", json.dumps(run, indent=2))
    return RunResult(summary=summary, model=model, records=records)


def _data_parallel(
    model: torch.nn.Module, amax_group: str, grad_comm: str, fsdp: bool = False,
    fp8_allgather: bool = False,
) -> Any:  # fmt: skip
    """`fp8lab.dist.ddp.DataParallel` of ``model`` under torch.distributed with > 1 rank (options
    checked either way: a bad value is an error even on one rank)."""
    from fp8lab.dist.ddp import DataParallel, check_options
    from fp8lab.dist.runtime import world_size

    check_options(amax_group, grad_comm, fsdp, fp8_allgather)
    if world_size() == 1:
        return None
    return DataParallel(model, amax_group, grad_comm, fsdp, fp8_allgather)


def _guard_run(guard: Any, model, opt, scaler, recipe) -> Any:
    """`fp8lab.lab.guard_run.GuardRun` for ``guard`` (an AnomalyGuard or its dict; None: none)."""
    if guard is None:
        return None
    from fp8lab.guard import AnomalyGuard
    from fp8lab.lab.guard_run import GuardRun

    if isinstance(guard, Mapping):
        guard = AnomalyGuard.from_dict(guard)
    if not isinstance(guard, AnomalyGuard):
        raise TypeError(f"guard must be an AnomalyGuard, got {type(guard).__name__}")
    return GuardRun(guard, model, opt, scaler, recipe)


def _train_step(
    model, opt, scaler, injector, params, corpus, cfg, recipe, st, tokens_per_step, dp=None,
    grun=None,
):  # fmt: skip
    tc = cfg.train
    step = st.step  # 0-based index of this step
    lr = tc.lr_at(step)
    for g in opt.param_groups:
        g["lr"] = lr
    while st.cursor in st.skip_batches:  # batches a guard rollback chose to skip
        st.cursor += 1
    x, y = get_batch(corpus.train, tc.batch_size, cfg.model.block_size, tc.seed, st.cursor)
    st.cursor += 1
    collect = tc.stats_every > 0 and (step + 1) % tc.stats_every == 0 and recipe is not None
    # per-operand percentages are per-rank numbers (each rank measures its own shard): under
    # torchrun the ranks agree on the findings before acting (fp8lab.lab.guard_run.agree)
    guard_rows = grun is not None and recipe is not None and grun.wants_rows(step)
    t0 = time.perf_counter()
    injector.set_step(step)
    mult, nan_loss = injector.fire(step, st.injected)
    loss_scale = scaler.get_scale() if scaler is not None else 1.0
    if grun is not None:
        grun.before_step()
    with _collect(model, collect, step + 1) as stat_rows, _guard_rows(guard_rows) as g_rows:
        if dp is None:
            _, loss = model(x, y)
        else:  # this rank's shard; loss_all: the global batch's loss, equal on every rank
            loss, loss_all, _ = dp.loss(*dp.shard(x, y))
        if nan_loss:  # injected fault: the loss and every gradient become NaN
            loss = loss * float("nan")
            loss_all = float("nan")
        (loss * (loss_scale * mult)).backward()
    if mult != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.div_(mult)
    found_inf = scaler.unscale_(opt) if scaler is not None else False
    from fp8lab.optim import clip_grad_norm_, grad_norm

    gnorm = float(grad_norm(params)) if found_inf else float("nan")
    skipped = True
    if not found_inf:
        gnorm = (
            float(clip_grad_norm_(params, tc.grad_clip))
            if tc.grad_clip > 0
            else float(grad_norm(params))
        )
    blocked = grun is not None and grun.check(
        step, float(loss.detach()) if dp is None else loss_all, gnorm,
        g_rows if guard_rows else None,
    )  # fmt: skip
    if not found_inf and math.isfinite(gnorm) and not blocked:
        opt.step()
        skipped = opt.last_step_skipped
    if scaler is not None:
        scaler.update()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0

    loss_v = float(loss.detach()) if dp is None else loss_all
    st.step += 1
    st.skipped_steps += int(skipped)
    spike = False
    if math.isfinite(loss_v):
        st.nonfinite_run = 0
        if st.ema is not None and loss_v > (1 + tc.spike_threshold) * st.ema:
            spike = True
        st.ema = loss_v if st.ema is None else 0.9 * st.ema + 0.1 * loss_v
    else:
        st.nonfinite_run += 1
        if st.nonfinite_run >= tc.max_nonfinite_steps:
            st.diverged = True
    rec = {
        "step": st.step,
        "lr": lr,
        "train_loss": _num(loss_v),
        "grad_norm": _num(gnorm),
        "skipped": bool(skipped),
        "skipped_steps": st.skipped_steps,
        "loss_scale": loss_scale,
        "spike": spike,
        "tokens": tokens_per_step,
        "step_time_s": dt,
    }
    if dp is not None:  # ranks, amax group, gradient communication (fp8lab.dist.ddp.state)
        rec.update(dp.state())
    return rec, stat_rows


def _collect(model: torch.nn.Module, enabled: bool, step: int):
    """``fp8lab.observe.sample``: the rows of this step's operands (the watch records), or []."""
    if not enabled:
        return contextlib.nullcontext([])
    from fp8lab.observe import sample

    return sample(model, step)


def _keep_checkpoint(run_path: Path, step: int, keep: int, rollback: bool = False) -> None:
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


def _guard_rows(enabled: bool):
    """The anomaly guard's per-operand underflow / saturation % of this step, or []."""
    if not enabled:
        return contextlib.nullcontext([])
    from fp8lab.guard.percent import operand_percentages

    return operand_percentages()


def _no_space(path: Path, exc: BaseException) -> OSError:
    return OSError(errno.ENOSPC, f"no space left on the device while writing {path} ({exc})")


def _write_text(path: Path, text: str) -> None:
    """Write a whole file atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _save_checkpoint(path: Path, ckpt_cfg, model, opt, scaler, st: LoopState, extra=None) -> None:
    state = {
        **(extra or {}),
        "config": ckpt_cfg,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "loop": asdict(st),
        "torch_rng": torch.get_rng_state(),
    }
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


def _load_checkpoint(
    path: Path, ckpt_cfg, model, opt, scaler, name: str = "", prepare=None
) -> LoopState:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not {"config", "model", "loop"} <= set(state):
            raise ValueError("not an fp8lab run checkpoint")
    except Exception as exc:  # zip errors, EOFError, UnpicklingError, ...
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no detail'}"
        raise CheckpointError(
            f"{path}: corrupt or truncated checkpoint ({reason}). To restart "
            f"{'recipe ' + repr(name) if name else 'this run'} from step 0, delete its folder "
            f"{path.parent} and rerun the same command (the other runs are kept)."
        ) from None
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
    # written before the data cursor existed: batch index = step
    return LoopState(**{"cursor": state["loop"]["step"], **state["loop"]})


def _timed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that measure speed: without warm-up, i.e. the first step (numba compiles or
    loads its kernels) and any step slower than 4x the median (kernels first used after a
    resume, or a newly seen shape)."""
    if len(records) < 3:
        return records
    rest = records[1:]
    med = statistics.median(r["step_time_s"] for r in rest)
    return [r for r in rest if r["step_time_s"] <= 4 * med]


def summarize(
    records: list[dict[str, Any]], steps: int, st: LoopState, vocab_size: int = 256
) -> dict[str, Any]:
    """Run summary from the per-step records.

    final_train_loss: mean train loss of the last ``min(10, steps)`` steps (one batch is noisy);
    final_val_loss: the last validation loss; tokens_per_s and step_time_ms: over the training
    steps after warm-up (see :func:`_timed`; evaluation excluded). Non-finite values are None;
    diverged: ``max_nonfinite_steps`` non-finite losses in a row, or a complete run whose final
    losses are not finite or whose validation loss exceeds ln(vocab_size).
    """
    tail = [r["train_loss"] for r in records[-min(10, len(records)) :]] if records else []
    finite_tail = [v for v in tail if v is not None]
    final_train = (
        sum(finite_tail) / len(finite_tail) if tail and len(finite_tail) == len(tail) else None
    )
    vals = [r for r in records if "val_loss" in r]
    final_val = vals[-1]["val_loss"] if vals else None
    timed = _timed(records)
    time_s = sum(r["step_time_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    complete = bool(records) and records[-1]["step"] == steps
    diverged = st.diverged or (complete and diverged_loss(final_train, final_val, vocab_size))
    return {
        "steps_done": records[-1]["step"] if records else 0,
        "complete": complete,
        "final_train_loss": final_train,
        "final_val_loss": final_val,
        "skipped_steps": records[-1]["skipped_steps"] if records else 0,
        "spikes": sum(bool(r["spike"]) for r in records),
        "tokens_per_s": tokens / time_s if time_s > 0 else None,
        "step_time_ms": 1000 * time_s / len(timed) if timed else None,
        "diverged": bool(diverged),
    }
