"""The lab's models: the built-in GPT, a user's factory, or a ``transformers`` model.

``[model] factory`` (``--model`` on ``fp8lab compare``) names where the model comes from:

- ``"gpt"`` (the default): :class:`fp8lab.lab.gpt.GPT` with the sizes of the ``[model]`` table;
- ``"MODULE:FACTORY"``: a function imported by dotted path (``mypkg.models:tiny_llama``);
- ``"path/to/file.py:FACTORY"``: a function in a Python file (imported under a private name);
- ``"hf:CONFIG.json"``: a ``transformers`` causal LM built from a config file with random init
  (``AutoModelForCausalLM.from_config``; nothing is ever downloaded; needs ``pip install
  'fp8lab[hf]'``);
- ``"hf:DIR"``: a ``save_pretrained`` directory (``config.json`` and ``model.safetensors``, or
  ``model.safetensors.index.json`` and its shards): the same, started from those weights (finite
  floating-point values only). A ``tokenizer.json`` in DIR (``tokenizer.save_pretrained(DIR)``)
  is the data's tokenizer unless ``[data] tokenizer`` names one (:func:`hf_tokenizer`).

Nothing reaches the Hugging Face hub and the process environment is left alone: the config is
read from the file and the model built with ``from_config(..., trust_remote_code=False)``, which
reads no file of the hub (a config naming remote code is refused).

``[model] init_from`` (``--init-from FILE.safetensors``) starts the built-in GPT, a factory's
model or an ``hf:CONFIG.json`` model from the weights of a safetensors file holding the keys of
the model's own ``state_dict()`` (not ``hf:DIR``, whose directory holds the weights: the pair is
a ValueError). Weights load strictly (`fp8lab.lab.weights.load_strict`:
missing, unexpected and mismatched keys are listed) after the seeded initialisation, and the
run records each weight file's SHA-256.

A factory is called without arguments and returns a ``torch.nn.Module`` that maps int64 tokens
[B, T] to logits [B, T, V] (or an object with ``.logits``, as Hugging Face models return), with
V >= 256 (the lab's default data are bytes; a tokenizer's or a token file's ids must lie below V:
`fp8lab.lab.data.Corpus.check_vocab`). With a factory, only ``block_size`` (the sequence length) of
the ``[model]`` table is read; the sizes are the factory's. The lab wraps such a model in
:class:`CausalLM` (parameter names gain the prefix ``model.``), which computes the same
cross-entropy as the GPT.

The model is built under ``train.seed`` before any conversion, so every recipe starts from the
same weights. Its identity (:func:`model_identity`: the factory and the SHA-256 of its source
file, or of the config file, the ``transformers`` version, and the weight files' SHA-256) is
part of a run's configuration:
a checkpoint written for another model is refused on resume. Bad input (factory not found, not
callable, wrong output, a config that does not parse, ``transformers`` missing) raises
``ValueError`` naming it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8lab.lab import weights
from fp8lab.lab.gpt import GPT, MOE_DEFAULTS, OPTIONS, GPTConfig, without_default_options

BUILTIN = "gpt"
HF_PREFIX = "hf:"
MIN_VOCAB = 256  # byte tokens


@dataclass(frozen=True)
class ModelConfig(GPTConfig):
    """The ``[model]`` table: the GPT's sizes and ``factory`` (where the model comes from; see
    the module docstring). With a factory other than ``"gpt"`` only ``block_size`` is read."""

    factory: str = BUILTIN
    init_from: str = ""  # a .safetensors file of initial weights ("": the seeded init)

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str) or not self.factory.strip():
            raise ValueError(
                f"model.factory must be 'gpt', 'MODULE:FACTORY', 'path/to/file.py:FACTORY', "
                f"'hf:CONFIG.json' or 'hf:DIR', got {self.factory!r}"
            )
        if not isinstance(self.init_from, str) or (
            self.init_from and not self.init_from.endswith(".safetensors")
        ):
            raise ValueError(
                f"model.init_from (--init-from) must name a .safetensors file, got "
                f"{self.init_from!r} (pickled .bin/.pt files are not read: they can run code)"
            )
        self.gpt()  # the sizes are checked as the GPT checks them

    def gpt(self) -> GPTConfig:
        """The plain GPT sizes (without ``factory``)."""
        return GPTConfig(**{f.name: getattr(self, f.name) for f in fields(GPTConfig)})

    def to_dict(self) -> dict:
        d = without_default_options(asdict(self))  # norm, mlp, qk_norm, n_experts, top_k: when set
        if self.factory == BUILTIN:  # the built-in GPT's configuration stays what it always was
            del d["factory"]
        if not self.init_from:
            del d["init_from"]
        return d


def factory_of(model_cfg: GPTConfig) -> str:
    """The factory string of a model config (a plain GPTConfig is the built-in GPT)."""
    return getattr(model_cfg, "factory", BUILTIN)


def is_builtin(model_cfg: GPTConfig) -> bool:
    return factory_of(model_cfg) == BUILTIN


# ----------------------------------------------------------------------------- resolving
@dataclass(frozen=True)
class ModelSource:
    """A resolved factory: ``make()`` builds the raw model (uses the global torch RNG);
    ``identity`` is what a checkpoint records of it; ``call_kwargs`` are passed to its forward."""

    spec: str
    make: Callable[[], Any]
    identity: dict[str, Any]
    call_kwargs: dict[str, Any]


def _sha256_file(path: Path) -> str:
    return weights.sha256_file(path)


def _source_hash(obj: Any) -> str:
    """SHA-256 of the file that defines ``obj`` (its source text when it has no file)."""
    try:
        f = inspect.getsourcefile(obj)
        if f and os.path.isfile(f):
            return _sha256_file(Path(f))
        return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()
    except (TypeError, OSError):
        return "unknown"


def _attr(module: Any, dotted: str, spec: str, where: str | None = None) -> Any:
    """``module.dotted``; ``where``: how the message names the module (a file's path instead of
    the private name it is imported under)."""
    obj = module
    for part in dotted.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"--model {spec!r}: {where or module.__name__} has no attribute {dotted!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"--model {spec!r}: {dotted!r} is not callable (a {type(obj).__name__}); name a "
            "function returning a torch.nn.Module"
        )
    return obj


def _from_file(spec: str, path_text: str, name: str) -> ModelSource:
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"--model {spec!r}: no such Python file: {path}")
    digest = _sha256_file(path)
    mod_name = f"_fp8lab_user_model_{digest[:16]}"
    module = sys.modules.get(mod_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"--model {spec!r}: cannot import {path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module  # before running it, as `import` does (dataclasses need it)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[mod_name]
            raise ValueError(f"--model {spec!r}: importing {path} failed: "
                             f"{type(exc).__name__}: {exc}") from None  # fmt: skip
    fn = _attr(module, name, spec, where=str(path))
    return ModelSource(spec, fn, {"factory": spec, "sha256": digest}, {})


def _from_module(spec: str, module_name: str, name: str) -> ModelSource:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"--model {spec!r}: cannot import module {module_name!r} ({exc}); give "
            "'MODULE:FACTORY' with MODULE importable, or 'path/to/file.py:FACTORY'"
        ) from None
    fn = _attr(module, name, spec)
    return ModelSource(spec, fn, {"factory": spec, "sha256": _source_hash(fn)}, {})


def read_hf_config(spec: str, path_text: str) -> dict[str, Any]:
    """The JSON object of a ``transformers`` config file; ValueError when it does not parse."""
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"--model {spec!r}: no such config file or directory: {path}")
    d = weights.read_config(spec, path)
    if not isinstance(d.get("model_type"), str):
        raise ValueError(
            f'--model {spec!r}: {path} has no "model_type" (e.g. "llama", "gpt2"); '
            "transformers needs it to choose the architecture"
        )
    return d


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(
            "--model hf:...: the package 'transformers' is not installed (pip install "
            f"'fp8lab[hf]' or pip install transformers) ({exc})"
        ) from None
    return transformers


def _from_hf(spec: str, path_text: str) -> ModelSource:
    """``hf:CONFIG.json`` (random init) or ``hf:DIR`` (a save_pretrained directory's weights)."""
    path = Path(path_text)
    files: list[Path] = []
    if path.is_dir():
        path, files = weights.hf_dir_files(spec, path)
    d = read_hf_config(spec, str(path))
    digest = _sha256_file(path)
    version = _transformers().__version__  # a clear error now when it is missing

    def make() -> Any:
        tf = _transformers()
        kw = dict(d)
        model_type = kw.pop("model_type")
        try:
            config = tf.AutoConfig.for_model(model_type, **kw)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--model {spec!r}: transformers rejects the config: {exc}") from None
        try:
            # trust_remote_code=False: a config naming code on the hub is refused, not fetched
            model = tf.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, trust_remote_code=False
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"--model {spec!r}: no causal LM for this config ({type(exc).__name__}: {exc})"
            ) from None
        if files:
            weights.load_strict(model, files, f"--model {spec!r}")
        return model

    identity = {"factory": spec, "sha256": digest, "transformers": version}
    if files:
        identity["weights_sha256"] = weights.weights_identity(files)
    return ModelSource(spec, make, identity, {"use_cache": False})


def resolve(factory: str) -> ModelSource:
    """Resolve a factory string (not ``"gpt"``) without building the model; ValueError when it
    cannot be found, is not callable, or its config file does not parse."""
    spec = factory.strip()
    if spec.startswith(HF_PREFIX):
        return _from_hf(spec, spec[len(HF_PREFIX) :])
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(
            f"--model {spec!r}: expected 'gpt', 'MODULE:FACTORY', 'path/to/file.py:FACTORY', "
            "'hf:CONFIG.json' or 'hf:DIR'"
        )
    if target.endswith(".py") or "/" in target or os.sep in target:
        return _from_file(spec, target, name)
    return _from_module(spec, target, name)


def model_identity(model_cfg: GPTConfig) -> dict[str, Any] | None:
    """What a run records of its model beyond the ``[model]`` table: None for the built-in GPT
    (its sizes are the table), else ``{"factory", "sha256"}`` (+ ``"transformers"`` version,
    + ``"weights_sha256"``: ``{file name: SHA-256}`` of ``hf:DIR``'s weight files); with
    ``init_from``, ``"init_from_sha256"`` too (the built-in GPT's identity is then
    ``{"factory": "gpt", "init_from_sha256": ...}``)."""
    init = init_file(model_cfg)
    if is_builtin(model_cfg):
        identity = None if init is None else {"factory": BUILTIN}
    else:
        identity = dict(resolve(factory_of(model_cfg)).identity)
    if init is not None and identity is not None:
        identity["init_from_sha256"] = weights.weights_identity([init])
    return identity


def init_file(model_cfg: GPTConfig) -> Path | None:
    """The ``init_from`` file of a model config (None: the seeded init); ValueError when it is
    missing, or given with ``hf:DIR`` (whose directory holds the weights)."""
    name = getattr(model_cfg, "init_from", "")
    if not name:
        return None
    spec = factory_of(model_cfg)
    if spec.startswith(HF_PREFIX) and Path(spec[len(HF_PREFIX) :]).is_dir():
        raise ValueError(
            f"--init-from {name}: --model {spec!r} already starts from the weights of its "
            "directory; give one of them"
        )
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--init-from {name}: no such file")
    return path


def hf_tokenizer(model_cfg: GPTConfig) -> Path | None:
    """The ``tokenizer.json`` of an ``hf:DIR`` model (what ``tokenizer.save_pretrained(DIR)``
    writes beside the weights), the data's tokenizer when none is given; None for any other
    model or a directory without one."""
    spec = factory_of(model_cfg)
    if not spec.startswith(HF_PREFIX):
        return None
    f = Path(spec[len(HF_PREFIX) :]) / weights.TOKENIZER
    return f if f.is_file() else None


def check_factory_keys(model_cfg: GPTConfig, keys: list[str], where: str) -> None:
    """ValueError when ``keys`` (``[model]`` keys the user set, e.g. by ``--set``) hold
    ``vocab_size`` for a factory's or ``transformers`` model: its vocabulary is its own (the
    factory's or its config's), and the data's ids are checked against that one, so the value
    would be silently ignored. The GPT's other sizes are documented as not read with a factory
    (only ``block_size`` is) and stay accepted."""
    if is_builtin(model_cfg):
        return
    spec = factory_of(model_cfg)
    options = [k for k in keys if k in OPTIONS or k in MOE_DEFAULTS]
    if options:
        raise ValueError(
            f"{where} model.{options[0]}: a built-in GPT option (norm, mlp, qk_norm, n_experts, "
            f"top_k); --model "
            f"{spec!r} is built by its factory, which the lab cannot change (its attention, "
            "norms and MLP are its own); drop the key or set it in the model"
        )
    if "vocab_size" not in keys:
        return
    whose = "its config file's" if spec.startswith(HF_PREFIX) else "the one its factory builds"
    raise ValueError(
        f"{where} model.vocab_size: --model {spec!r} has its own vocabulary ({whose}), which the "
        "data's ids are checked against; model.vocab_size sizes only the built-in GPT. Change "
        "the vocabulary in the model (its config's vocab_size) instead"
    )


def check_data_fits(model_cfg: GPTConfig, corpus: Any, seed: int) -> None:
    """ValueError when the tokens of ``corpus`` (an `fp8lab.lab.data.Corpus`) do not fit the
    model's vocabulary (`Corpus.check_vocab`); a factory's model is built to learn it."""
    vocab = declared_vocab(model_cfg)
    if vocab is None:
        with torch.random.fork_rng(devices=[]):
            vocab = vocab_size_of(build(model_cfg, seed), model_cfg)
    corpus.check_vocab(vocab, repr(factory_of(model_cfg)))


def declared_vocab(model_cfg: GPTConfig) -> int | None:
    """The vocabulary size a model config declares without building the model: the GPT's
    ``vocab_size``, an ``hf:`` config's ``vocab_size``; None for a factory (known once built:
    :func:`vocab_size_of`)."""
    if is_builtin(model_cfg):
        return int(model_cfg.vocab_size)
    spec = factory_of(model_cfg)
    if not spec.startswith(HF_PREFIX):
        return None
    path = Path(spec[len(HF_PREFIX) :])
    d = read_hf_config(spec, str(path / weights.CONFIG if path.is_dir() else path))
    v = d.get("vocab_size", (d.get("text_config") or {}).get("vocab_size"))
    return int(v) if isinstance(v, int) else None


# ----------------------------------------------------------------------------- the wrapper
class CausalLM(nn.Module):
    """A user's model with the GPT's interface: ``forward(idx, targets=None) -> (logits, loss)``,
    loss = mean cross-entropy over [B*T]. Checks every output: logits [B, T, V >= 256]."""

    def __init__(self, model: nn.Module, spec: str, call_kwargs: dict[str, Any] | None = None):
        super().__init__()
        self.model = model
        self.spec = spec
        self.call_kwargs = dict(call_kwargs or {})
        self.vocab_size: int | None = None

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.model(idx, **self.call_kwargs)
        logits = logits_of(out, idx, self.spec)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def logits_of(out: Any, idx: torch.Tensor, spec: str) -> torch.Tensor:
    """The logits of a model's output (a tensor, or an object with ``.logits``), checked to be a
    floating [B, T, V >= 256] tensor for ``idx`` [B, T]; ValueError naming the model otherwise."""
    logits = getattr(out, "logits", out)
    if isinstance(logits, tuple | list) and logits and isinstance(logits[0], torch.Tensor):
        logits = logits[0]
    B, T = idx.shape
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"--model {spec!r}: the model returned a {type(out).__name__}, expected logits "
            "[B, T, V] (a tensor or an object with .logits)"
        )
    shape = tuple(logits.shape)
    if (len(shape) != 3 or shape[:2] != (B, T) or shape[2] < MIN_VOCAB
            or not logits.is_floating_point()):  # fmt: skip
        raise ValueError(
            f"--model {spec!r}: the model maps tokens [{B}, {T}] to {logits.dtype} {list(shape)}; "
            f"expected floating logits [{B}, {T}, V] with V >= {MIN_VOCAB} (byte tokens)"
        )
    return logits


# ----------------------------------------------------------------------------- building
def build(model_cfg: GPTConfig, seed: int) -> nn.Module:
    """The unconverted model, initialised under ``seed`` (the global torch RNG is seeded here):
    a :class:`GPT`, or a user's model (cast to fp32: the lab keeps fp32 master weights) in
    :class:`CausalLM` after a probe forward (eval mode, no grad, the RNG state restored) of
    ``[1, block_size]`` tokens that checks its output. Built on the CPU whatever the process's
    default device (`torch.set_default_device`): the same weights on every device."""
    with torch.device("cpu"):
        return _build(model_cfg, seed)


def _build(model_cfg: GPTConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    init = init_file(model_cfg)
    if is_builtin(model_cfg):
        gpt = GPT(model_cfg)
        if init is not None:
            weights.load_strict(gpt, [init], f"--init-from {init}")
        return gpt
    source = resolve(factory_of(model_cfg))
    try:
        raw = source.make()
    except Exception as exc:  # the user's code failed: name it, keep its message
        if isinstance(exc, ValueError) and str(exc).startswith("--model"):
            raise
        raise ValueError(
            f"--model {source.spec!r}: the factory raised {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(raw, nn.Module):
        raise ValueError(
            f"--model {source.spec!r}: the factory returned a {type(raw).__name__}, expected a "
            "torch.nn.Module"
        )
    raw = raw.float()
    if init is not None:  # the keys of the factory's own model (no "model." prefix)
        weights.load_strict(raw, [init], f"--init-from {init}")
    model = CausalLM(raw, source.spec, source.call_kwargs)
    model.vocab_size = probe(model, model_cfg.block_size)
    require_linears(model, source.spec)
    model.train()
    return model


def require_linears(model: nn.Module, spec: str) -> list[str]:
    """The names of the Linear layers a recipe would quantize in ``model``
    (`fp8lab.nn.select_linears`: the output head and embedding-tied layers stay high precision);
    ValueError when there is none: every recipe would train the same model, so a comparison,
    a debug run or a price of it means nothing. The one rule of every command taking
    ``--model`` (compare, debug, cost: each builds the model through :func:`build`)."""
    from fp8lab.nn import select_linears

    names = select_linears(model)
    if not names:
        n_all = sum(isinstance(m, nn.Linear) for m in model.modules())
        kept = ""
        if n_all:
            kept = (f" (its {n_all} Linear layer(s): the output head or tied to the embedding, "
                    "which stay high precision)")  # fmt: skip
        raise ValueError(
            f"--model {spec!r}: the model has no Linear layer to quantize{kept}; every recipe "
            "would leave it unchanged (nothing to compare, debug or price). Give a model whose "
            "hidden layers are torch.nn.Linear (or transformers' Conv1D)"
        )
    return names


def probe(model: CausalLM, block_size: int) -> int:
    """Run one forward of zeros [1, block_size] and return V; ValueError on a wrong output."""
    idx = torch.zeros(1, block_size, dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                logits, _ = model(idx)
            except Exception as exc:
                if isinstance(exc, ValueError) and str(exc).startswith("--model"):
                    raise
                raise ValueError(
                    f"--model {model.spec!r}: a forward of tokens [1, {block_size}] (int64) "
                    f"failed: {type(exc).__name__}: {exc}"
                ) from None
    finally:
        model.train(was_training)
    return int(logits.shape[-1])


def vocab_size_of(model: nn.Module, model_cfg: GPTConfig) -> int:
    """V of a built model (the GPT's ``vocab_size``, or what the probe found)."""
    v = getattr(model, "vocab_size", None)
    return int(v) if isinstance(v, int) else int(model_cfg.vocab_size)
