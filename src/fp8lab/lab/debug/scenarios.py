"""Built-in scenarios: a known fault planted in the default model and data (ground truth).

Each scenario gives the recipe under debug and the lab configuration; the debugger is not told
what was planted (it only gets the recipe and the config, as for any user run), and the
scenario says what it should find (``expect``). A scenario picks its target layer among the
model's converted layers, so it also works with other sizes (``--set model.n_layer=4``).

- ``outlier-channels``: 4 input channels of one layer (the first attention QKV projection: the
  normalized hidden state, where Dettmers et al. 2022, LLM.int8(), find outlier features) are
  x1e5 larger, under te-delayed (per-tensor delayed scaling): one scale for the whole tensor is
  set by the outliers and the other channels fall below E4M3's smallest subnormal, so that
  layer's attention gets (almost) nothing in fprop and its weights no gradient in wgrad. The
  weights reading the outlier channels are held at zero (``outlier_weights="zero"``): the
  channels carry range without signal, so the high-precision baselines do not depend on the
  scale (bit for bit in fp32) and the gap is FP8's alone. With trained weights instead, Adam
  moves them by about its step size, x1e5 in the output, and even fp32 and bf16 drift apart.
  Expect: that layer, role ``input``.
- ``unscaled-gradient``: one layer's gradient operand (the last attention output projection)
  cast to E4M3 with a fixed scale of 1 (no scaling), via a per-layer recipe rule on te-delayed:
  gradients below E4M3's smallest subnormal (2^-9) flush to zero in that layer. Expect: that layer, role ``grad_output``.
- ``gradient-spike``: a one-step gradient spike (the loss scaled up before backward and the
  gradients scaled down after: the update is unchanged in exact arithmetic) poisons every
  delayed-scaling gradient history of te-delayed: for the rest of the run (history 1024) every
  layer's gradient scale is far too small and most gradients underflow. Expect: role
  ``grad_output`` on many layers, current scaling as the fix.

Published failures (the gallery; each names its source, what the paper measured and its
published fix, the ``fixed`` counterpart a study runs; docs/debug.md, benchmarks/
study_gallery.py). Which of them reproduce at CPU size, and the measurements of those that do
not: docs/gallery.md.

- ``swiglu-outliers``: Fishman et al., arXiv 2409.12517. With SwiGLU and weight decay the gate
  and linear weight vectors of a channel align over long training, their product grows
  quadratically and delayed scaling overflows late in a 2T-token run. Accelerated here by a
  strong decoupled weight decay (1.0) and a higher learning rate (3e-3): weight decay drives
  the weights to the aligned stationary point the paper analyses in far fewer steps. Fixed:
  ``model.mlp = "smooth_swiglu"`` (`fp8lab.nn.SmoothSwiGLU`). Expect: role ``input``, fprop,
  on the ``mlp.down`` layers whose input amax grew most (computed from R's operand records).
- ``mx-layernorm-affine``: Su et al., arXiv 2506.20752: MX quantization of LayerNorm affine
  parameters biases their gradient multiplicatively and gives loss spikes in their small proxy
  models. The GPT with LayerNorm (``model.norm = "layernorm"``) under mxfp8 with
  ``norm_weights = "quantized"``. Fixed: those parameters in high precision. Expect: kind
  ``norm_weight``, the norms feeding converted layers.
- ``stale-after-warmup``: TE's ``DelayedScaling`` defaults (``amax_history_len=1024``,
  ``amax_compute_algo="max"``): when a tensor's amax falls gradually (after the warm-up, as the
  loss falls) the history keeps the old maximum and the scale stays too small. A large initial
  weight scale (``init_std`` 0.2) makes the early gradients large and lets the model shrink
  them itself. Fixed: te-current. Expect: remedy ``shorter-history`` or ``current-scaling``
  ranked first, on the tensors whose amax fell (computed from R's records).
- ``attention-logit-growth``: attention logits grow by orders of magnitude before a divergence
  (the lab's early-warning study shows it under a learning-rate range test; Wortsman et al.,
  arXiv 2309.14322, at high learning rates without QK-norm). te-delayed with FP8 attention
  (`fp8lab.nn.DotProductAttention`) at a learning rate of 1e-2: Q and K amaxes grow, the rows
  of S turn one-hot and their small entries underflow. Fixed: QK-norm
  (``model.qk_norm = true``). Expect: kind ``attention``, tensor Q, K or S.
- ``nvfp4-all-layers``: NVIDIA, "Pretraining LLMs with NVFP4" (arXiv 2509.25149): NVFP4 on
  every linear layer trains worse than with the last blocks in BF16 (their ablation). nvfp4
  against ``nvfp4-paper``. Expect: the last block's layers named, remedy
  ``last-blocks-high-precision``.
- ``fp16-loss-scale``: Micikevicius et al., arXiv 1710.03740: a loss scale must keep FP16's
  gradients above 2^-24 (they flush to zero) and below 65504 (they overflow and the step is
  skipped). fp16-amp with a static loss scale of 2^21 (32x the dynamic scaler's initial
  2^16): the gradients grow as the model leaves its uniform start, outgrow the scale, and a
  few percent of the steps overflow and are skipped, from a few dozen steps in. The too-small
  side (a static scale of 1) does not show at the small sizes: the gradients of a 128-token
  batch stay above 2^-24 (docs/gallery.md). Fixed: the dynamic loss scaler. Expect: kind
  ``loss_scale``, remedy ``dynamic-loss-scaling`` ranked first, no layer named.

``expect`` keys: ``kind`` (`fp8lab.lab.debug.kinds.CULPRIT_KINDS`; ``operand`` when absent),
``role``, ``gemm``, ``tensor`` (attention: the tensors one of which must be named), ``layers`` (a list, ``"many"``, or a function of R's run directory computing
them from the run: :func:`resolve_expect`), ``remedy`` (a name or a tuple of names, one of which
must rank first), ``fix`` (the old spelling of ``remedy``). :func:`check_verdict` scores a result
against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fp8lab.lab.train import LabConfig


@dataclass(frozen=True)
class Scenario:
    """A planted fault: ``build(cfg, layers)`` -> (recipe, cfg, expect) for the converted
    ``layers`` of the model; ``train`` holds the scenario's default training settings (the
    user's ``--set``/``--steps`` apply on top)."""

    name: str
    description: str
    build: Callable[[LabConfig, Sequence[str]], tuple[Any, LabConfig, dict[str, Any]]]
    train: dict[str, Any]


def _pick(layers: Sequence[str], suffix: str, last: bool = True) -> str:
    hits = [n for n in layers if n.endswith(suffix)]
    if hits:
        return hits[-1] if last else hits[0]
    return layers[len(layers) // 2]


def _outliers(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.recipe import get_recipe

    target = _pick(layers, "attn.qkv", last=False)
    inject = cfg.inject
    if inject.outlier_channels == 0:  # the user may have set their own
        inject = replace(inject, outlier_channels=4, outlier_scale=1e5, outlier_weights="zero")
    inject = replace(inject, outlier_layers=target)
    recipe = get_recipe("te-delayed")
    return recipe, replace(cfg, inject=inject), {"role": "input", "layers": [target]}


def _unscaled(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.qtensor import QuantSpec
    from fp8lab.recipe import LayerRule, get_recipe

    target = _pick(layers, "attn.proj")
    rule = LayerRule(match=target,
                     changes={"grad_output": QuantSpec(format="e4m3", scaling=1.0).to_dict()})  # fmt: skip
    recipe = (
        get_recipe("te-delayed")
        .with_layers(rule)
        .replace(
            name="te-delayed+unscaled-grad",
            description=f"te-delayed, but {target}'s gradient operand is cast to E4M3 with a "
            "fixed scale of 1 (no scaling): a planted fault",
        )
    )
    return recipe, cfg, {"role": "grad_output", "layers": [target]}


def _spike(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.recipe import get_recipe

    inject = cfg.inject
    if inject.grad_spike_step < 0:
        # 2^40: E5M2's 32 binades absorb a 1024x spike; this one leaves the later gradients
        # 40 binades under the poisoned scale, i.e. flushed to zero
        inject = replace(inject, grad_spike_step=max(1, cfg.train.steps // 6),
                         grad_spike_scale=2.0**40)  # fmt: skip
    return (get_recipe("te-delayed"), replace(cfg, inject=inject),
            {"role": "grad_output", "layers": "many", "fix": "current-scaling"})  # fmt: skip


def _swiglu(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.recipe import get_recipe

    def grown(run_dir: Any) -> list[str]:
        from fp8lab.lab.debug.kinds import grown_layers
        from fp8lab.lab.loop import read_stats

        return grown_layers(read_stats(run_dir), "input", "mlp.down")

    return (get_recipe("te-delayed"), cfg,
            {"kind": "operand", "role": "input", "gemm": "fprop", "layers": grown,
             "fixed": {"model": {"mlp": "smooth_swiglu"}}})  # fmt: skip


def _mx_affine(cfg: LabConfig, layers: Sequence[str]):
    import torch

    from fp8lab.lab.debug.kinds import norm_layers
    from fp8lab.lab.parts import build_model
    from fp8lab.recipe import get_recipe

    cfg = replace(cfg, model=replace(cfg.model, norm="layernorm"))
    recipe = get_recipe("mxfp8").replace(
        name="mxfp8+quantized-norms", norm_weights="quantized",
        description="mxfp8 with the LayerNorm affine parameters quantized as MX weights")  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model, None, cfg.train.seed)
    return recipe, cfg, {"kind": "norm_weight", "layers": norm_layers(model, layers),
                         "remedy": "norm-weights-high-precision",
                         "fixed": {"recipe": "mxfp8"}}  # fmt: skip


def _stale(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.recipe import get_recipe

    def fell(run_dir: Any) -> list[str]:
        from fp8lab.lab.debug.kinds import amax_fell
        from fp8lab.lab.loop import read_stats

        stats = read_stats(run_dir)
        return sorted({x for r in ("input", "grad_output") for x in amax_fell(stats, r, layers)})

    cfg = replace(cfg, model=replace(cfg.model, init_std=0.2))
    return (get_recipe("te-delayed"), cfg,
            {"kind": "operand", "layers": fell, "remedy": ("shorter-history", "current-scaling"),
             "fixed": {"recipe": "te-current"}})  # fmt: skip


def _fp16(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.recipe import get_recipe

    recipe = get_recipe("fp16-amp").replace(
        name="fp16-amp+static-2^21", loss_scaling="static", loss_scale=2.0**21,
        description="fp16-amp with a static loss scale of 2^21 (too large: the gradients "
        "outgrow it as training proceeds, overflow fp16 and the steps are skipped)")  # fmt: skip
    return recipe, cfg, {"kind": "loss_scale", "layers": [], "remedy": "dynamic-loss-scaling",
                         "fixed": {"recipe": "fp16-amp"}}  # fmt: skip


def _logits(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.recipe import get_recipe

    recipe = get_recipe("te-delayed").replace(
        name="te-delayed+fp8-attention", attention=True,
        description="te-delayed with FP8 attention (TE's quantization points)")  # fmt: skip
    return recipe, cfg, {"kind": "attention", "tensor": ("Q", "K", "S"), "layers": [],
                         "remedy": "attention-high-precision",
                         "fixed": {"model": {"qk_norm": True}}}  # fmt: skip


def _nvfp4_all(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.lab.debug.kinds import block_index
    from fp8lab.recipe import get_recipe

    blocks = [block_index(x) for x in layers if block_index(x) is not None]
    last = [x for x in layers if blocks and block_index(x) == max(blocks)]
    return get_recipe("nvfp4"), cfg, {"kind": "operand", "layers": last,
                                      "remedy": "last-blocks-high-precision",
                                      "fixed": {"recipe": "nvfp4-paper"}}  # fmt: skip


#: the gallery's scenarios (module doc): published failures, in the README table's order
GALLERY = ("swiglu-outliers", "mx-layernorm-affine", "stale-after-warmup",
           "attention-logit-growth", "fp16-loss-scale", "nvfp4-all-layers")  # fmt: skip

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("outlier-channels", "4 input channels of the first attn.qkv x1e5 (their "
                 "weights held at zero) under te-delayed (per-tensor delayed scaling)", _outliers,
                 {"steps": 200, "eval_every": 20}),
        Scenario("unscaled-gradient", "the last attn.proj gradient operand in E4M3 with a "
                 "fixed scale of 1 (a per-layer recipe rule on te-delayed)", _unscaled,
                 {"steps": 200, "eval_every": 20}),
        Scenario("gradient-spike", "a one-step x2^40 gradient spike poisons te-delayed's "
                 "gradient amax histories", _spike, {"steps": 200, "eval_every": 20}),
        Scenario("swiglu-outliers", "SwiGLU channels align under strong weight decay and their "
                 "product outgrows te-delayed's scale (Fishman et al. arXiv 2409.12517)",
                 _swiglu, {"steps": 300, "eval_every": 20, "stats_every": 10, "lr": 3e-3,
                           "weight_decay": 1.0}),
        Scenario("mx-layernorm-affine", "LayerNorm affine parameters MX-quantized under mxfp8 "
                 "(Su et al. arXiv 2506.20752)", _mx_affine, {"steps": 200, "eval_every": 20}),
        Scenario("stale-after-warmup", "amaxes fall after the warm-up while te-delayed's "
                 "1024-step histories hold the old maximum", _stale,
                 {"steps": 200, "eval_every": 20, "stats_every": 10}),
        Scenario("attention-logit-growth", "FP8 attention under te-delayed at a high learning "
                 "rate: attention logits grow, S turns one-hot and underflows", _logits,
                 {"steps": 200, "eval_every": 20, "stats_every": 10, "lr": 1e-2,
                  "warmup_steps": 10}),
        Scenario("nvfp4-all-layers", "NVFP4 on every layer, against nvfp4-paper's last blocks "
                 "in BF16 (NVIDIA arXiv 2509.25149's ablation)", _nvfp4_all,
                 {"steps": 200, "eval_every": 20}),
        Scenario("fp16-loss-scale", "fp16-amp with a static loss scale of 2^21: the growing "
                 "gradients overflow and steps are skipped (Micikevicius et al. arXiv "
                 "1710.03740)", _fp16,
                 {"steps": 200, "eval_every": 20}),
    )
}  # fmt: skip


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def scenario_config(cfg: LabConfig, name: str, train: dict[str, Any] | None = None) -> LabConfig:
    """``cfg`` with the scenario's default training settings, then ``train`` (the user's)."""
    sc = get_scenario(name)
    return cfg.replace_train(**{**sc.train, **(train or {})})


def plant(name: str, cfg: LabConfig) -> tuple[Any, LabConfig, dict[str, Any]]:
    """(recipe, config, expectation) of scenario ``name`` on the model of ``cfg``."""
    import torch

    from fp8lab.lab.debug.variants import converted_layers
    from fp8lab.lab.parts import build_model
    from fp8lab.recipe import get_recipe

    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model, get_recipe("te-delayed"), cfg.train.seed)
    return get_scenario(name).build(cfg, converted_layers(model))


def resolve_expect(expect: dict[str, Any], run_dir: Any) -> dict[str, Any]:
    """``expect`` with a computed ``layers`` (a function of R's run directory) evaluated on
    ``run_dir`` (the debugger's ``OUT/probes/recipe``) and ``fixed`` left out: plain data."""
    out = {k: v for k, v in expect.items() if k != "fixed"}
    if callable(out.get("layers")):
        out["layers"] = list(out["layers"](run_dir))
    return out


def check_verdict(expect: dict[str, Any], result: dict[str, Any], slack: int = 1) -> dict[str, Any]:
    """Whether a debug result (``debug_result.json``'s data) gives the ``expect``ed verdict
    (``expect`` resolved: :func:`resolve_expect`): ``{"right": bool, "why": [...]}``. Layers
    named must lie within the expected ones plus ``slack`` others and include the first
    expected one (``"many"``: at least 3); a culprit of kind ``loss_scale`` names none."""
    why: list[str] = []
    c = result.get("culprit")
    if c is None:
        return {"right": False, "why": ["no culprit"]}
    kind = expect.get("kind", "operand")
    if c.get("kind", "operand") != kind:
        why.append(f"kind {c.get('kind', 'operand')} (expected {kind})")
    if "tensor" in expect and c.get("tensor") not in tuple(expect["tensor"]):
        why.append(f"tensor {c.get('tensor')} (expected {' or '.join(expect['tensor'])})")
    for key in ("role", "gemm"):
        if key in expect and c.get(key) != expect[key]:
            why.append(f"{key} {c.get(key)} (expected {expect[key]})")
    want, got = expect.get("layers"), list(c.get("layers") or [])
    if want == "many":
        if len(got) < 3:
            why.append(f"{len(got)} layers (expected many)")
    elif want is not None:
        extra = [x for x in got if x not in want]
        if len(extra) > slack or (want and got and want[0] not in got and kind == "operand"):
            why.append(f"layers {got} (expected within {want} plus {slack})")
        if not want and got:
            why.append(f"layers {got} (expected none)")
    remedy = expect.get("remedy", expect.get("fix"))
    if remedy is not None:
        ok = (remedy,) if isinstance(remedy, str) else tuple(remedy)
        best = (result.get("details") or {}).get("best_remedy")
        if best not in ok:
            why.append(f"best remedy {best} (expected {' or '.join(ok)})")
    return {"right": not why, "why": why}
