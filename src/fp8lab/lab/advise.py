"""`fp8lab advise`: the fastest per-layer recipe that keeps a model within a loss budget.

:func:`run_advise` answers "which recipe should I train with on this GPU?" by search. The
budget is the final validation-loss gap to bf16 in percent, ``(loss - bf16's) / bf16's x 100``,
measured as the mean over ``seeds`` of the *paired* gap (a probe and bf16 trained on the same
seed, so the same initial weights and batches). The speed is the cost model's prediction of one
training step's GEMM + quantization time on ``device`` (`fp8lab.cost.predict_step_ms`, each
Linear priced under the recipe it runs), as a speedup over bf16. The method (docs/advise.md):

1. **Price** every candidate on every converted layer of the model on ``device``. A candidate
   the device cannot run (MX or NVFP4 on Hopper) is refused when named, and left out of the
   defaults (:data:`DEFAULT_CANDIDATES`). The *ladder* is the runnable candidates predicted
   faster than bf16, fastest first, then bf16.
2. **Baseline and noise**: bf16 and fp32 on every seed. The noise is the lab's rule
   (`fp8lab.lab.noise.late_gap_pct` of fp32 against bf16, the larger over the seeds); a budget
   below `fp8lab.lab.noise.WITHIN` (2) x the noise is an error that says so.
3. **Singles**: every candidate alone on every seed (the Pareto front's single-recipe points,
   and the reference the chosen recipe must beat). The first rung of the ladder whose gap is
   within the budget is ``r*`` (bf16, gap 0, always is).
4. **Ranking**: for each faster rung ``a`` < ``r*``, one training step of rung ``a``'s run
   (its checkpoint half-way, seed 0) is replayed bit for bit once per layer with only that layer
   on rung ``r*`` (`fp8lab.lab.debug.attribution.StepReplay`); a layer's score is the share of
   the AdamW-update error against bf16 it removes, as the debugger scores a cell.
5. **Group testing**: the shortest prefix of that order promoted to rung ``r*`` whose mean gap
   is within the budget (`fp8lab.lab.debug.search.prefix_search`, ``jobs`` prefixes a round;
   the whole order is rung ``r*`` alone, known to be within it). A base whose best possible mix
   (one layer promoted) is predicted no faster than rung ``r*`` alone is not searched.
6. **Choice**: among every measured probe within the budget (singles and mixes), the largest
   predicted speedup (ties: the smaller gap). The Pareto front is every probe no other probe
   beats on both predicted speedup and measured gap.

Every probe is `fp8lab.lab.debug.runner.run_probe` of one recipe on one seed into
``OUT/probes/<probe>/seed<S>`` (resumed from its checkpoint; a finished one is read back, not
retrained), ``jobs`` at a time in the lab's one pool (`fp8lab.lab.pool.WorkerPool`, local
processes or Ray: `fp8lab.lab.pool.set_executor`). Layout of ``OUT``::

    OUT/advise_config.json   the lab config + corpus (+ the user model's identity): what a rerun
                             must match to continue (a non-empty OUT without it is refused)
    OUT/probes/<probe>/seed<S>/   metrics.jsonl, checkpoint.pt, run.json (one run)
    OUT/probes/<probe>/recipe.toml   a mix probe's per-layer recipe
    OUT/ranking/<base>-to-<rung>.json   the one-step ranking (read back on a rerun)
    OUT/advise.toml          the chosen recipe (``base =`` + ``[[layer]]``), as `fp8lab debug`
                             writes fix.toml (`fp8lab.lab.debug.verdict.write_fix`)
    OUT/advise.megatron.yaml, advise.te.yaml   the same for Megatron-LM and TE's debug tools
                             (`fp8lab.lab.debug.export`)
    OUT/advise_result.json   :meth:`AdviseResult.to_json` (the ``--json`` document)

The library never prints: progress goes to ``callback`` as events (``{"event": "stage",
"text"}``, ``{"event": "probe", "probe", "gap_pct", "label"}`` and the runs' own ``start`` /
``end`` events). The report (Pareto figure and table, Markdown + HTML) is
`fp8lab.report.advise.write_report`'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8lab.lab import models
from fp8lab.lab import noise as noise_rule
from fp8lab.lab.checkpoint import corpus_config
from fp8lab.lab.compare_summary import val_curve
from fp8lab.lab.data import load_corpus
from fp8lab.lab.debug.runner import ProbeSpec, run_probe, snapshot_path
from fp8lab.lab.debug.search import prefix_search
from fp8lab.lab.loop import diverged_loss
from fp8lab.lab.pool import Callback, Job, WorkerPool, check_count
from fp8lab.lab.train import LabConfig, read_metrics

SCHEMA_VERSION = 1
#: what `fp8lab advise` tries without --candidates (those of them the device can run)
DEFAULT_CANDIDATES = ("nvfp4-te", "mxfp8", "te-current", "te-delayed", "deepseek-v3", "bf16")
#: the reference every gap and speedup is measured against
BASELINE = "bf16"
CONFIG_FILE = "advise_config.json"
RESULT_FILE = "advise_result.json"
RECIPE_FILE = "advise.toml"
#: the stem of the Megatron-LM and TE files (`fp8lab.lab.debug.export.write_exports`)
EXPORT_STEM = "advise"
PROBES = "probes"


def parse_budget(value: str | float) -> float:
    """The loss budget in percent from ``0.5``, ``"0.5"`` or ``"0.5%"``; ValueError for anything
    that is not a finite number > 0."""
    text = str(value).strip()
    num = text[:-1].strip() if text.endswith("%") else text
    try:
        b = float(num)
    except ValueError:
        raise ValueError(f"--budget {value!r}: not a number (a percentage such as 0.5 or 2%)"
                         ) from None  # fmt: skip
    if not math.isfinite(b) or b <= 0:
        raise ValueError(f"--budget {value!r}: must be a percentage > 0")
    return b


# ----------------------------------------------------------------------------- pricing
@dataclass
class Pricing:
    """The cost model's view of the model on one device: ``ms[cand]`` the predicted step time
    (ms) of the whole model under ``cand``, ``layer_ms[cand][layer]`` per Linear, ``skipped``
    the candidates the device cannot run (with the reason)."""

    device: str
    layers: list[str]
    ms: dict[str, float]
    layer_ms: dict[str, dict[str, float]]
    skipped: dict[str, str]
    linears: list[tuple[str, int, int]] = field(repr=False, default_factory=list)
    tokens: int = 0
    experts: dict[str, tuple[int, int]] = field(repr=False, default_factory=dict)

    def predict(self, recipe: Any) -> float:
        """The predicted step time (ms) of ``recipe`` (per-layer rules applied per name)."""
        from fp8lab.cost import predict_step_ms

        return predict_step_ms(recipe, self.device, linears=self.linears, tokens=self.tokens,
                               experts=self.experts)  # fmt: skip

    def speedup(self, ms: float | None) -> float | None:
        return None if ms is None or ms <= 0 else self.ms[BASELINE] / ms


def _shapes_only(cfg: LabConfig) -> torch.nn.Module:
    """The unconverted model for its Linears' shapes: the built-in GPT on the meta device (no
    weights made: a full-width one would take seconds), a user's model built as the lab does."""
    if models.is_builtin(cfg.model) and not cfg.model.init_from:
        from fp8lab.lab.gpt import GPT

        with torch.device("meta"):
            return GPT(cfg.model)
    return models.build(cfg.model, cfg.train.seed)


def price_candidates(
    cfg: LabConfig, candidates: Sequence[str], device: str, named: bool = True,
    price_overrides: Sequence[str] = (),
) -> Pricing:  # fmt: skip
    """Price ``candidates`` (and bf16) on ``device`` for ``cfg``'s model, per Linear and whole,
    on ``train.batch_size x model.block_size`` tokens. ``named``: the user named the
    candidates, so one the device cannot run is a ValueError (otherwise it is left out, in
    ``skipped``). ``price_overrides``: ``SECTION.KEY=VALUE`` assignments
    (`LabConfig.with_overrides`) of the model that is priced instead of the trained one (a
    small proxy trained, the full-width model priced); its Linears must have the trained
    model's names. ValueError for an unknown candidate or device, a model with no Linear to
    quantize, or a priced model whose Linears are named differently."""
    from fp8lab.cost import expert_routing, get_device, linear_shapes, predict_step_ms
    from fp8lab.cost.model import UnpriceableError
    from fp8lab.recipe import get_recipe, recipes

    dev = get_device(device).name
    valid = recipes()
    for c in candidates:
        if c not in valid:
            raise ValueError(f"unknown candidate {c!r}; valid: {', '.join(valid)}")
    priced = cfg.with_overrides(list(price_overrides)) if price_overrides else cfg
    with torch.random.fork_rng(devices=[]):
        model = _shapes_only(priced)
        linears = linear_shapes(model)
        if price_overrides:
            trained = [n for n, _, _ in linear_shapes(_shapes_only(cfg))]
            if trained != [n for n, _, _ in linears]:
                raise ValueError(f"--price-set {' '.join(price_overrides)}: the priced model's "
                                 "Linear layers are not the trained model's (same names, same "
                                 "order needed: change widths, not depth)")  # fmt: skip
    tokens = priced.train.batch_size * priced.model.block_size
    experts = expert_routing(model)
    out = Pricing(dev, [n for n, _, _ in linears], {}, {}, {}, linears, tokens, experts)
    for c in dict.fromkeys([*candidates, BASELINE]):
        rec = get_recipe(c)
        try:
            out.ms[c] = predict_step_ms(rec, dev, linears=linears, tokens=tokens, experts=experts)
        except UnpriceableError as exc:
            if named and c in candidates:
                raise ValueError(f"candidate {c!r}: {dev} cannot run it ({exc})") from None
            out.skipped[c] = str(exc)
            continue
        out.layer_ms[c] = {
            n: predict_step_ms(rec, dev, linears=[(n, i, o)], tokens=tokens, experts=experts)
            for n, i, o in linears
        }
    return out


def ladder(pricing: Pricing, candidates: Sequence[str]) -> list[str]:
    """The runnable candidates predicted faster than bf16, fastest first, then bf16."""
    fast = [c for c in candidates if c in pricing.ms and c != BASELINE
            and pricing.ms[c] < pricing.ms[BASELINE]]  # fmt: skip
    return [*sorted(fast, key=lambda c: (pricing.ms[c], candidates.index(c))), BASELINE]


# ----------------------------------------------------------------------------- probes
@dataclass
class AdviseProbe:
    """One recipe trained on every seed. ``kind``: baseline, noise (fp32), single or mix;
    ``promoted``: a mix's layers that run ``promoted_to`` instead of ``base``."""

    name: str
    kind: str
    recipe: Any  # a Recipe
    base: str
    promoted_to: str | None = None
    promoted: list[str] = field(default_factory=list)
    predicted_ms: float | None = None
    predicted_speedup: float | None = None
    final_val_loss: list[float | None] = field(default_factory=list)
    gap_pct_seeds: list[float | None] = field(default_factory=list)
    gap_pct: float | None = None
    diverged: bool = False
    within_budget: bool | None = None
    label: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "base": self.base,
            "promoted_to": self.promoted_to, "promoted": list(self.promoted),
            "predicted_ms": _num(self.predicted_ms),
            "predicted_speedup": _num(self.predicted_speedup),
            "final_val_loss": [_num(v) for v in self.final_val_loss],
            "gap_pct_seeds": [_num(v) for v in self.gap_pct_seeds],
            "gap_pct": _num(self.gap_pct), "diverged": self.diverged,
            "within_budget": self.within_budget, "label": self.label,
        }  # fmt: skip


@dataclass
class AdviseResult:
    """What `run_advise` found, as plain data (see :meth:`to_json` for the ``--json`` schema)."""

    out: Path
    device: str
    budget_pct: float
    noise_pct: float | None
    seeds: list[int]
    candidates: list[str]
    ladder: list[str]
    skipped: dict[str, str]
    layers: list[str]
    probes: dict[str, AdviseProbe]
    ranking: dict[str, list[dict[str, Any]]]
    chosen: str
    best_single: str
    pareto: list[str]
    verdict: str
    files: dict[str, str]
    lab_config: dict[str, Any]
    price_overrides: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document: ``schema_version``, ``device``, ``budget_pct``,
        ``noise_pct``, ``seeds``, ``candidates``, ``ladder``, ``skipped``, ``price_overrides``,
        ``chosen`` {name,
        recipe_file, base, promoted_to, promoted, predicted_speedup, predicted_ms, gap_pct,
        gap_pct_seeds}, ``best_single`` {name, predicted_speedup, gap_pct}, ``pareto``
        [{name, predicted_speedup, gap_pct}], ``probes`` [AdviseProbe], ``ranking``, ``verdict``,
        ``files`` (non-finite numbers null)."""
        c, s = self.probes[self.chosen], self.probes[self.best_single]
        return {
            "schema_version": SCHEMA_VERSION,
            "device": self.device,
            "budget_pct": self.budget_pct,
            "noise_pct": _num(self.noise_pct),
            "seeds": list(self.seeds),
            "candidates": list(self.candidates),
            "ladder": list(self.ladder),
            "skipped": dict(self.skipped),
            "price_overrides": list(self.price_overrides),
            "chosen": {
                "name": c.name,
                "recipe_file": self.files.get("recipe"),
                "base": c.base,
                "promoted_to": c.promoted_to,
                "promoted": list(c.promoted),
                "predicted_speedup": _num(c.predicted_speedup),
                "predicted_ms": _num(c.predicted_ms),
                "gap_pct": _num(c.gap_pct),
                "gap_pct_seeds": [_num(v) for v in c.gap_pct_seeds],
            },
            "best_single": {
                "name": s.name,
                "predicted_speedup": _num(s.predicted_speedup),
                "gap_pct": _num(s.gap_pct),
            },
            "pareto": [
                {
                    "name": n,
                    "predicted_speedup": _num(self.probes[n].predicted_speedup),
                    "gap_pct": _num(self.probes[n].gap_pct),
                }
                for n in self.pareto
            ],
            "probes": [p.to_json() for p in self.probes.values()],
            "ranking": self.ranking,
            "verdict": self.verdict,
            "files": dict(self.files),
        }


def _num(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _seed_dir(out: Path, probe: str, seed: int) -> Path:
    return out / PROBES / probe / f"seed{seed}"


def _read_run(d: Path) -> dict[str, Any]:
    return json.loads((d / "run.json").read_text())


class _Ctx:
    """The state of one search: the pool, the config, the probes measured so far."""

    def __init__(self, cfg: LabConfig, out: Path, seeds: list[int], budget: float,
                 pricing: Pricing, pool: WorkerPool, emit: Callback) -> None:  # fmt: skip
        self.cfg, self.out, self.seeds, self.budget = cfg, out, seeds, budget
        self.pricing, self.pool, self.emit = pricing, pool, emit
        self.probes: dict[str, AdviseProbe] = {}

    def measure(self, probes: Sequence[AdviseProbe], snapshot_of: Sequence[str] = ()) -> None:
        """Train every probe on every seed (one pool batch; finished runs are read back), then
        record their gaps. ``snapshot_of``: probes whose first seed keeps the checkpoint half
        way (for the ranking's replay)."""
        half = (self.cfg.train.steps // 2,)
        jobs = []
        for p in probes:
            if p.kind == "mix":  # the per-layer recipe, for the user to read
                d = self.out / PROBES / p.name
                d.mkdir(parents=True, exist_ok=True)
                (d / "recipe.toml").write_text(p.recipe.to_toml())
            for i, s in enumerate(self.seeds):
                spec = ProbeSpec(name=f"{p.name}@seed{s}", recipe=p.recipe.to_dict(),
                                 snapshots=half if i == 0 and p.name in snapshot_of else (),
                                 label=p.label, kind=p.kind)  # fmt: skip
                jobs.append(Job(spec.name, run_probe, {
                    "spec": spec, "cfg_dict": self.cfg.replace_train(seed=s).to_dict(),
                    "run_dir": str(_seed_dir(self.out, p.name, s))}))  # fmt: skip
        self.pool.run(jobs, self.emit)
        for p in probes:
            self._record(p)

    def _record(self, p: AdviseProbe) -> None:
        finals, div = [], False
        for s in self.seeds:
            run = _read_run(_seed_dir(self.out, p.name, s))
            sm = run["summary"]
            vocab = run.get("vocab_size", self.cfg.model.vocab_size)
            bad = bool(sm.get("diverged")) or diverged_loss(
                sm.get("final_train_loss"), sm.get("final_val_loss"), vocab
            )
            div = div or bad
            v = sm.get("final_val_loss")
            finals.append(None if bad or v is None or not math.isfinite(v) else float(v))
        p.final_val_loss, p.diverged = finals, div
        self.probes[p.name] = p
        if p.kind == "noise":
            return
        if p.kind == "baseline":
            p.gap_pct_seeds, p.gap_pct = [0.0] * len(finals), 0.0
        else:
            base = self.probes[BASELINE].final_val_loss
            p.gap_pct_seeds = [None if v is None or b is None or b == 0 else 100.0 * (v - b) / b
                               for v, b in zip(finals, base, strict=True)]  # fmt: skip
            known = [g for g in p.gap_pct_seeds if g is not None]
            p.gap_pct = sum(known) / len(known) if len(known) == len(finals) else None
        p.within_budget = p.gap_pct is not None and p.gap_pct <= self.budget
        try:
            p.predicted_ms = self.pricing.predict(p.recipe)
        except ValueError:
            p.predicted_ms = None
        p.predicted_speedup = self.pricing.speedup(p.predicted_ms)
        self.emit({"event": "probe", "probe": p.name, "gap_pct": p.gap_pct,
                   "speedup": p.predicted_speedup, "label": p.label})  # fmt: skip

    def noise(self) -> float | None:
        """The fp32-vs-bf16 noise (%): `fp8lab.lab.noise.late_gap_pct`, largest over seeds."""
        a, b = noise_rule.PAIR
        vals = []
        for s in self.seeds:
            ca, cb = (val_curve(read_metrics(_seed_dir(self.out, n, s))) for n in (a, b))
            v = noise_rule.late_gap_pct(ca, cb, cb)
            if v is None:
                return None
            vals.append(v)
        return max(vals)


# ----------------------------------------------------------------------------- the ranking
def rank_layers(
    recipe: dict[str, Any],
    promote: dict[str, Any],
    baseline: dict[str, Any],
    cfg_dict: dict[str, Any],
    snapshot: str,
    layers: Sequence[str],
    events: Any = None,
) -> list[dict[str, Any]]:
    """Replay the step after ``snapshot`` (a checkpoint of a run of ``recipe``) once per layer
    with only that layer running ``promote``; each layer's ``score`` is the share of the AdamW
    update error against ``baseline`` (at the same weights) that the switch removes,
    ``(e_R - e_l) / e_R`` (`fp8lab.lab.debug.attribution`). Highest first, ties in module order.
    A pool job (plain-data arguments)."""
    from fp8lab.lab.debug.attribution import Counterfactual
    from fp8lab.recipe import Recipe

    cf = Counterfactual(recipe, baseline, cfg_dict, snapshot)
    pro = Recipe.from_dict(promote, where="promote")
    e_r = cf.err_r
    rows = []
    for i, layer in enumerate(layers):
        e_l, _ = cf.errors({layer: pro.for_layer(layer)})
        if math.isinf(e_r):
            score = 1.0 if math.isfinite(e_l) else 0.0
        else:
            score = (e_r - e_l) / e_r if e_r > 0 else 0.0
        rows.append({"layer": layer, "score": score, "err": e_l, "err_r": e_r})
        if events is not None:
            events.put({"event": "replay", "probe": "ranking", "recipe": "ranking",
                        "done": i + 1, "total": len(layers)})  # fmt: skip
    order = sorted(range(len(rows)), key=lambda i: (-rows[i]["score"], i))
    return [rows[i] for i in order]


def _ranking(ctx: _Ctx, base: str, rung: str) -> list[dict[str, Any]]:
    """:func:`rank_layers` of ``base``'s seed-0 run promoting to ``rung`` (read back from
    ``OUT/ranking`` when there)."""
    from fp8lab.recipe import get_recipe

    path = ctx.out / "ranking" / f"{base}-to-{rung}.json"
    if path.exists():
        return json.loads(path.read_text())
    cfg = ctx.cfg.replace_train(seed=ctx.seeds[0])
    snap = snapshot_path(_seed_dir(ctx.out, base, ctx.seeds[0]), cfg.train.steps // 2)
    ctx.emit({"event": "stage", "text": f"ranking the layers of {base} (one-step replay, each "
              f"layer on {rung})"})  # fmt: skip
    rows = ctx.pool.run([Job(f"ranking {base}", rank_layers, {
        "recipe": get_recipe(base).to_dict(), "promote": get_recipe(rung).to_dict(),
        "baseline": get_recipe(BASELINE).to_dict(), "cfg_dict": cfg.to_dict(),
        "snapshot": str(snap), "layers": ctx.pricing.layers})], ctx.emit)[0]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def mix_recipe(base: str, rung: str, layers: Sequence[str], name: str) -> Any:
    """Preset ``base`` with ``layers`` restarting from preset ``rung`` (one ``[[layer]]``)."""
    from fp8lab.recipe import LayerRule, get_recipe

    rec = get_recipe(base)
    if layers:
        rec = rec.with_layers(LayerRule(match=tuple(layers), base=rung))
    return rec.replace(name=name, description=f"{base} with {len(layers)} layer(s) on {rung} "
                       "(fp8lab advise)", source="fp8lab advise")  # fmt: skip


def _mix(ctx: _Ctx, base: str, rung: str, order: Sequence[str], k: int) -> AdviseProbe:
    import hashlib

    layers = list(order[:k])
    # the name says what it is; the hash tells apart two prefixes of different orders
    h = hashlib.sha256(json.dumps(sorted(layers)).encode()).hexdigest()[:6]
    name = f"{base}+{k}x{rung}-{h}"
    return AdviseProbe(name, "mix", mix_recipe(base, rung, layers, name), base, rung, layers,
                       label=f"{base}, the top {k} of {len(order)} layers on {rung}")  # fmt: skip


# ----------------------------------------------------------------------------- OUT
def prepare_out(out: Path, cfg: LabConfig, corpus: Any) -> None:
    """Create ``out`` or check that it can be continued, and write ``advise_config.json``.
    ValueError: ``out`` is a file; a non-empty directory `fp8lab advise` did not make (nothing
    a user made is overwritten); probes made under another lab configuration or data."""
    from fp8lab.lab.train import mismatch_message

    meta = {"fp8lab_advise": SCHEMA_VERSION, "lab": cfg.to_dict(),
            "corpus": corpus_config(corpus)}  # fmt: skip
    identity = models.model_identity(cfg.model)
    if identity is not None:
        meta["model"] = identity
    path = out / CONFIG_FILE
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict) or "fp8lab_advise" not in old:
            raise ValueError(f"--out {out}: a non-empty directory not made by fp8lab advise (no "
                             f"{CONFIG_FILE}); refusing to write into it: choose a new or "
                             "empty directory")  # fmt: skip
        why = mismatch_message(old, meta)
        if why and (out / PROBES).is_dir() and any((out / PROBES).iterdir()):
            raise ValueError(f"--out {out} holds probes of a different configuration; refusing "
                             f"to mix them (choose another --out). {why}")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2) + "\n")


# ----------------------------------------------------------------------------- the search
def run_advise(
    cfg: LabConfig,
    device: str,
    budget: float | str,
    out_dir: str | Path = "runs/advise",
    candidates: Sequence[str] | None = None,
    seeds: int = 3,
    jobs: int = 1,
    threads: int = 0,
    callback: Callback | None = None,
    price_overrides: Sequence[str] = (),
) -> AdviseResult:
    """Search the fastest per-layer recipe within ``budget`` (% of bf16's final validation
    loss) on ``device`` (see the module doc); write ``OUT``'s files and return the result.

    ``candidates``: preset names (default: those of :data:`DEFAULT_CANDIDATES` the device can
    run; a named one it cannot run is an error); bf16 is always added. ``price_overrides``:
    price another width of the model (:func:`price_candidates`). ``seeds``: the gap is the
    mean over ``train.seed``, + 1, ... of the paired gap. Everything is checked before anything
    is trained (ValueError: budget, candidates, device, seeds, jobs, the config, the data,
    ``OUT``); a budget below 2x the noise is a ValueError after the baseline runs (kept: a rerun
    with a larger budget reads them back)."""
    from fp8lab.recipe import get_recipe

    budget = parse_budget(budget)
    check_count("seeds", seeds, 1)
    check_count("jobs", jobs, 1)
    check_count("threads", threads, 0, " (0 = the defaults)")
    cfg.check()
    named = candidates is not None
    cands = list(dict.fromkeys(candidates if named else DEFAULT_CANDIDATES))
    if not cands:
        raise ValueError("no candidates given")
    pricing = price_candidates(cfg, cands, device, named=named, price_overrides=price_overrides)
    cands = [c for c in cands if c in pricing.ms]
    steps = ladder(pricing, cands)
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    out = Path(out_dir)
    prepare_out(out, cfg, corpus)
    seed_list = [cfg.train.seed + i for i in range(seeds)]
    emit = callback or (lambda e: None)
    a, _ = noise_rule.PAIR
    with WorkerPool(jobs, threads, label="probe") as pool:
        ctx = _Ctx(cfg, out, seed_list, budget, pricing, pool, emit)
        emit({"event": "stage", "text": f"baseline: {BASELINE} and {a} on {seeds} seed(s)"})
        ctx.measure([AdviseProbe(BASELINE, "baseline", get_recipe(BASELINE), BASELINE,
                                 label="the baseline"),
                     AdviseProbe(a, "noise", get_recipe(a), a,
                                 label=f"{a}: the noise (rounding only)")])  # fmt: skip
        noise = ctx.noise()
        if noise is not None and budget < noise_rule.WITHIN * noise:
            raise ValueError(
                f"--budget {budget:g} % is below {noise_rule.WITHIN:g}x the run-to-run noise "
                f"({noise:.3f} %: fp32 vs bf16 over the second half of the run): no probe "
                f"could be told apart from bf16; use --budget {noise_rule.WITHIN * noise:.3g} "
                "or more, or train longer"
            )
        singles = [c for c in cands if c != BASELINE]
        emit({"event": "stage", "text": f"single recipes: {', '.join(singles) or 'none'}"})
        ctx.measure([AdviseProbe(c, "single", get_recipe(c), c, label=f"{c} on every layer")
                     for c in singles], snapshot_of=steps[:-1])  # fmt: skip
        ranking = _search(ctx, steps)
    result = _decide(ctx, cfg, device=pricing.device, budget=budget, noise=noise,
                     candidates=cands, steps=steps, ranking=ranking)  # fmt: skip
    result.price_overrides = list(price_overrides)
    result.files = _write_outputs(cfg, ctx, result)
    (out / RESULT_FILE).write_text(json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n")
    return result


def _write_outputs(cfg: LabConfig, ctx: _Ctx, result: AdviseResult) -> dict[str, str]:
    """Write ``advise.toml`` (checked to read back, `fp8lab.lab.debug.verdict.write_fix`) and
    its Megatron-LM and TE forms (`fp8lab.lab.debug.export`); the files by kind."""
    from fp8lab.lab.debug.export import export_fix, write_exports
    from fp8lab.lab.debug.names import lab_prefix
    from fp8lab.lab.debug.verdict import write_fix
    from fp8lab.recipe import get_recipe

    out, chosen = ctx.out, ctx.probes[result.chosen]
    base = get_recipe(chosen.base)
    note = (f"fp8lab advise on {result.device}: {result.verdict}\n"
            f"the run's global recipe is {chosen.base}; the layers below override it")  # fmt: skip
    remedy = chosen.recipe.replace(name="advise")
    write_fix(remedy, base, out / RECIPE_FILE, note, what="the fp8lab advise per-layer choice",
              source="fp8lab advise")  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        prefix = lab_prefix(models.build(cfg.model, cfg.train.seed))
    ex = export_fix("advise", remedy, base, result.layers, prefix=prefix, note=note)
    return {"recipe": str(out / RECIPE_FILE), "config": str(out / CONFIG_FILE),
            "result": str(out / RESULT_FILE), **write_exports(out, ex, stem=EXPORT_STEM)}  # fmt: skip


def _search(ctx: _Ctx, steps: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Stages 4-5: for every rung faster than the first within budget, rank its layers and
    group-test the shortest promoted prefix. Returns the rankings by ``"base-to-rung"``."""
    probes = ctx.probes
    ok = next(i for i, c in enumerate(steps) if probes[c].within_budget)
    top = steps[ok]
    rankings: dict[str, list[dict[str, Any]]] = {}
    for base in steps[:ok]:
        if probes[base].diverged:
            ctx.emit({"event": "stage", "text": f"{base} diverged alone: not searched"})
            continue
        order_rows = _ranking(ctx, base, top)
        rankings[f"{base}-to-{top}"] = order_rows
        order = [r["layer"] for r in order_rows]
        one = _mix(ctx, base, top, order, 1)
        try:
            best_ms = ctx.pricing.predict(one.recipe)
        except ValueError:
            continue
        if best_ms >= ctx.pricing.ms[top]:
            ctx.emit({"event": "stage", "text": f"{base} with one layer on {top} is predicted no "
                      f"faster than {top} alone: not searched"})  # fmt: skip
            continue
        ctx.emit({"event": "stage", "text": f"group testing: the fewest layers of {base} on "
                  f"{top} within {ctx.budget:g} %"})  # fmt: skip

        def within(prefixes: list[list[str]], _b: str = base, _o: list = order) -> list[bool]:
            mixes = [_mix(ctx, _b, top, _o, len(p)) for p in prefixes]
            ctx.measure(mixes)
            return [bool(m.within_budget) for m in mixes]

        prefix_search(order, within, jobs=max(1, ctx.pool.jobs // len(ctx.seeds)))
    return rankings


def pareto_front(probes: Sequence[AdviseProbe]) -> list[str]:
    """The probes no other beats on both predicted speedup (higher) and measured gap (lower),
    fastest first; probes without both numbers are left out."""
    pts = [p for p in probes if p.predicted_speedup is not None and p.gap_pct is not None
           and p.kind != "noise"]  # fmt: skip
    front = []
    for p in pts:
        beaten = any(q is not p and q.predicted_speedup >= p.predicted_speedup
                     and q.gap_pct <= p.gap_pct
                     and (q.predicted_speedup > p.predicted_speedup or q.gap_pct < p.gap_pct)
                     for q in pts)  # fmt: skip
        if not beaten:
            front.append(p)
    front.sort(key=lambda p: (-p.predicted_speedup, p.gap_pct))
    return [p.name for p in front]


def _best(probes: Sequence[AdviseProbe]) -> AdviseProbe:
    ok = [p for p in probes if p.within_budget and p.predicted_speedup is not None]
    return max(ok, key=lambda p: (round(p.predicted_speedup, 9), -p.gap_pct))


def _decide(ctx: _Ctx, cfg: LabConfig, *, device: str, budget: float, noise: float | None,
            candidates: list[str], steps: list[str],
            ranking: dict[str, list[dict[str, Any]]]) -> AdviseResult:  # fmt: skip
    """Stage 6: the chosen recipe, the best single, the Pareto front and the verdict."""
    probes = list(ctx.probes.values())
    chosen = _best([p for p in probes if p.kind in ("baseline", "single", "mix")])
    single = _best([p for p in probes if p.kind in ("baseline", "single")])
    n = len(ctx.pricing.layers)
    words = [f"{chosen.name}: predicted {chosen.predicted_speedup:.2f}x over {BASELINE} on "
             f"{device}, measured gap {chosen.gap_pct:+.3f} % (mean over {len(ctx.seeds)} "
             f"seed(s); budget {budget:g} %)."]  # fmt: skip
    if chosen.kind == "mix":
        words.append(f"{len(chosen.promoted)} of {n} layers run {chosen.promoted_to}, the rest "
                     f"{chosen.base}: {', '.join(chosen.promoted)}.")  # fmt: skip
    if single.name != chosen.name:
        words.append(f"Best single recipe within the budget: {single.name} "
                     f"({single.predicted_speedup:.2f}x, {single.gap_pct:+.3f} %).")  # fmt: skip
    over = [p.name for p in probes if p.kind == "single" and not p.within_budget]
    if over:
        words.append(f"Over the budget alone: {', '.join(over)}.")
    if len(steps) == 1:
        words.append(f"No candidate is predicted faster than {BASELINE} on {device} for these "
                     f"layer shapes: train in {BASELINE}.")  # fmt: skip
    elif chosen.name == BASELINE:
        words.append(f"No candidate faster than {BASELINE} stays within {budget:g} % on this "
                     f"model: train in {BASELINE}.")  # fmt: skip
    return AdviseResult(
        out=ctx.out, device=device, budget_pct=budget, noise_pct=noise, seeds=ctx.seeds,
        candidates=candidates, ladder=steps, skipped=dict(ctx.pricing.skipped),
        layers=list(ctx.pricing.layers), probes=dict(ctx.probes), ranking=ranking,
        chosen=chosen.name, best_single=single.name, pareto=pareto_front(probes),
        verdict=" ".join(words), files={}, lab_config=cfg.to_dict(),
    )  # fmt: skip
