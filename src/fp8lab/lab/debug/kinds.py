"""The debugger's culprit kinds beyond one operand, and what the run's records say about them.

A culprit is of one ``kind`` (:data:`CULPRIT_KINDS`):

- ``operand``: a quantized operand ``role`` of linear layers, mattering most in one ``gemm``,
  on the fewest ``layers`` that explain the gap (the kind the debugger always had);
- ``norm_weight``: the norms' affine parameters, quantized (``norm_weights = "quantized"``;
  Su et al., arXiv 2506.20752); ``layers`` are the norms whose parameters are quantized;
- ``attention``: FP8 attention (``attention = true``); ``tensor`` is the one of
  :data:`ATTENTION_TENSORS` whose quantization did worst in R's records
  (:func:`attention_tensor`; None without records: ``train.stats_every = 0``); no linear layer
  is named;
- ``loss_scale``: the static loss scale (``loss_scaling = "static"``): too small a scale
  underflows the gradients, too large a one overflows them and skips steps. No layer is named.

Each kind other than ``operand`` has one probe (:func:`kind_probes`): R with that part in
high precision or made dynamic, on every layer; it runs beside the role probes and is the
remedy of its kind when it explains the gap.

From the run's operand statistics (``stats.jsonl``, `fp8lab.lab.loop.read_stats`):
:func:`amax_fell` (a delayed-scaling history holds an old maximum: ``shorter-history`` may fix
it) and :func:`grown_layers` (the layers whose operand amax grew most; scenarios compute their
expected layers with it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fp8lab.recipe import Recipe

#: culprit kinds (module doc)
CULPRIT_KINDS = ("operand", "norm_weight", "attention", "loss_scale")
#: attention's quantized tensors a culprit of kind ``attention`` names (TE's quantization
#: points: queries, keys, values, the logits' softmax S, and its gradient dP)
ATTENTION_TENSORS = ("Q", "K", "V", "S", "dP")
#: the remedy each non-operand kind's probe is
KIND_REMEDY = {"norm_weight": "norm-weights-high-precision",
               "attention": "attention-high-precision",
               "loss_scale": "dynamic-loss-scaling"}  # fmt: skip
#: the amax history ``shorter-history`` keeps (steps); TE's default is 1024
SHORT_HISTORY = 16
#: an amax "fell" when its last record is below its earlier peak by this factor
FELL = 4.0


def applicable_kinds(recipe: Recipe) -> list[str]:
    """The non-operand kinds ``recipe`` can have a fault of (on any layer's resolution it is
    the top-level setting that counts: these keys are whole-model keys)."""
    out = []
    if recipe.norm_weights == "quantized":
        out.append("norm_weight")
    if recipe.attention or any(r.changes.get("attention") for r in recipe.layers):
        out.append("attention")
    if recipe.loss_scaling == "static":
        out.append("loss_scale")
    return out


def kind_probes(recipe: Recipe) -> dict[str, Recipe]:
    """``{kind: variant}`` for each applicable kind: R with that part fixed (module doc)."""
    import fp8lab.lab.debug.variants as variants

    fns = {"norm_weight": variants.norm_weights_hp, "attention": variants.attention_hp,
           "loss_scale": variants.dynamic_loss_scaling}  # fmt: skip
    return {k: fns[k](recipe).replace(name=f"{recipe.name}+{KIND_REMEDY[k]}")
            for k in applicable_kinds(recipe)}  # fmt: skip


def norm_layers(model: Any, converted: Sequence[str]) -> list[str]:
    """The norms whose affine parameters a ``norm_weights = "quantized"`` recipe quantizes: the
    lab GPT's ``attn_norm`` and ``mlp_norm`` of blocks whose next projection is converted
    (the final norm feeds the high-precision output head)."""
    conv = set(converted)
    out = []
    for name, _ in model.named_modules():
        m = re.fullmatch(r"(.*)\.(attn|mlp)_norm", name)
        if m is None:
            continue
        nxt = f"{m.group(1)}.attn.qkv" if m.group(2) == "attn" else f"{m.group(1)}.mlp.gate"
        if nxt in conv:
            out.append(name)
    return out


# ----------------------------------------------------------------------------- the records
def amax_series(records: Iterable[Mapping[str, Any]], role: str,
                layers: Iterable[str] | None = None) -> dict[str, list[tuple[int, float]]]:  # fmt: skip
    """``{layer: [(step, amax), ...]}`` of ``role`` (the largest over the GEMMs that consumed
    it at that step), from ``stats.jsonl`` records; non-finite or missing amaxes skipped."""
    want = None if layers is None else set(layers)
    by: dict[str, dict[int, float]] = {}
    for r in records:
        if r.get("role") != role or (want is not None and r.get("layer") not in want):
            continue
        a = r.get("amax")
        if a is None or not math.isfinite(a):
            continue
        d = by.setdefault(r["layer"], {})
        d[r["step"]] = max(d.get(r["step"], 0.0), float(a))
    return {x: sorted(d.items()) for x, d in by.items()}


def amax_fell(records: Iterable[Mapping[str, Any]], role: str, layers: Iterable[str],
              factor: float = FELL) -> list[str]:  # fmt: skip
    """The ``layers`` whose ``role`` amax fell gradually: the last record is below the peak
    of the earlier ones by ``factor`` and at least two earlier records lie above the last by
    that factor (a single high record is a spike, not a fall)."""
    out = []
    for x, series in amax_series(records, role, layers).items():
        if len(series) < 3:
            continue
        last = series[-1][1]
        above = [a for _, a in series[:-1] if a > factor * last]
        if len(above) >= 2:
            out.append(x)
    return out


def grown_layers(records: Iterable[Mapping[str, Any]], role: str, suffix: str = "",
                 share: float = 0.5) -> list[str]:  # fmt: skip
    """The layers ending in ``suffix`` whose ``role`` amax grew most over the run: growth
    (last record / first record) within ``share`` of the largest growth, in log terms
    (``log g >= share * log g_max``), the largest first; [] without growth or records."""
    series = {x: s for x, s in amax_series(records, role).items()
              if x.endswith(suffix) and len(s) >= 2 and s[0][1] > 0}  # fmt: skip
    growth = {x: s[-1][1] / s[0][1] for x, s in series.items()}
    top = max(growth.values(), default=1.0)
    if top <= 1.0:
        return []
    hits = [x for x, g in growth.items() if g > 1.0 and math.log(g) >= share * math.log(top)]
    return sorted(hits, key=lambda x: -growth[x])  # the largest growth first


def block_index(layer: str) -> int | None:
    """The transformer block a layer name belongs to (``blocks.3.mlp.up``, ``model.layers.3.
    self_attn.q_proj``, ``decoder.layers.3...``: 3), None outside blocks."""
    m = re.search(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.", layer)
    return None if m is None else int(m.group(1))


def last_blocks(layers: Sequence[str], culprit: Sequence[str]) -> list[str]:
    """Every layer of the blocks from the first culprit block to the model's last block, when
    the culprit layers reach the last block; else []."""
    idx = {x: block_index(x) for x in layers}
    blocks = [b for b in idx.values() if b is not None]
    hit = [idx.get(x) for x in culprit if idx.get(x) is not None]
    if not blocks or not hit or max(hit) != max(blocks):
        return []
    first = min(hit)
    return [x for x in layers if idx[x] is not None and idx[x] >= first]


def attention_tensor(records: Iterable[Mapping[str, Any]]) -> str | None:
    """The one of :data:`ATTENTION_TENSORS` whose FP8 quantization did worst in R's records
    (``gemm = "dpa"``, `fp8lab.nn.DotProductAttention`): the largest underflow + saturation
    share (%) at the last recorded step, over attention layers; None without such records."""
    last: dict[str, tuple[int, float]] = {}
    for r in records:
        if r.get("gemm") != "dpa" or r.get("role") not in ATTENTION_TENSORS:
            continue
        bad = float(r.get("underflow_pct") or 0.0) + float(r.get("saturation_pct") or 0.0)
        step, worst = last.get(r["role"], (-1, 0.0))
        if r["step"] > step:
            last[r["role"]] = (r["step"], bad)
        elif r["step"] == step:
            last[r["role"]] = (step, max(worst, bad))
    if not last:
        return None
    return max(ATTENTION_TENSORS, key=lambda t: last.get(t, (-1, -1.0))[1])
