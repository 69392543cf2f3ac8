"""The debugging method: seven stages from "R drifts from the baseline" to a tested fix.

1. **gap and noise**: R, the baseline, and the pair fp32 / bf16 (two baselines that differ only
   in rounding) from one initial model and one batch order. ``gap_pct`` is R's final validation
   loss relative to the baseline's (as ``fp8lab compare``); ``noise_pct`` the largest |gap|
   between fp32 and bf16 over the second half of the run. A gap within max(0.01 %, 3x the
   noise) is "no FP8 problem found" (:func:`gap_floor`; the factors: `fp8lab.lab.noise`).
2. **recovery**: R's checkpoint at ``recovery_from`` of the run, loaded into the baseline recipe
   (weights and optimizer moments; loaded explicitly: the lab refuses it for users) and trained
   to the end; ``recovers`` = its gap falls back within twice the noise.
3. **fake quantization**: R's operand grids with current scaling and fp32 accumulation.
4. **screening**: one-step attribution at R's checkpoints (:mod:`.attribution`).
5. **confirmation**: training probes with one operand role in high precision in every layer
   (every quantized role), the culprit role's GEMMs one at a time, then group testing over the
   layers in the screening's order (:mod:`.search`); beside the first role probes, one probe per
   other culprit kind the recipe can have (quantized norm weights, FP8 attention, a static loss
   scale: :mod:`.kinds`), which is that kind's remedy when it wins.
6. **remedies** for the culprit role on the culprit layers, each a probe (:mod:`.remedies`).
7. **verdict** (:mod:`.verdict`): the culprit, the best remedy as a per-layer recipe file.

A probe *explains* the gap when it closes at least ``close`` (70 %) of it or lands within twice
the noise. A diverged R counts as a gap as large as a uniform guess's (ln V).
"""

from __future__ import annotations

import fnmatch
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import fp8lab.lab.debug.attribution as attribution
import fp8lab.lab.debug.kinds as kinds
import fp8lab.lab.debug.names as names
import fp8lab.lab.debug.remedies as remedies
import fp8lab.lab.debug.search as search
import fp8lab.lab.debug.variants as variants
from fp8lab.lab import noise as noise_rule
from fp8lab.lab.data import load_corpus
from fp8lab.lab.debug.result import DebugResult, Probe, _rel
from fp8lab.lab.debug.runner import (
    ProbeSpec,
    TaskPool,
    check_distributed,
    on_rank0,
    rank0_writes,
    run_probe,
    snapshot_path,
)
from fp8lab.lab.debug.start import START, read_start, write_start
from fp8lab.lab.debug.verdict import decide
from fp8lab.lab.parts import build_model
from fp8lab.lab.pool import Callback, check_count
from fp8lab.lab.train import LabConfig, read_metrics
from fp8lab.nn import convert, select_linears

CONFIG_FILE = "debug.json"
#: share of the gap a layer subset must close in group testing (the verdict asks 70 %)
LAYER_CLOSE = 0.85
#: the smallest gap (%) attributed to FP8 is max(MIN_GAP_PCT, noise.ATTRIBUTE x the noise)
MIN_GAP_PCT = 0.01


# ----------------------------------------------------------------------------- inputs
def resolve(name_or_recipe: Any) -> Any:
    """A Recipe, a preset or lab recipe name, or a recipe file path."""
    from fp8lab.lab.recipes import resolve_recipe
    from fp8lab.recipe import Recipe

    if isinstance(name_or_recipe, Recipe):
        return name_or_recipe
    return resolve_recipe(str(name_or_recipe))


def select_layers(all_layers: Sequence[str], globs: Sequence[str] | None) -> list[str]:
    """The converted layers matching any of ``globs`` (all without globs); a glob matching no
    converted layer is a ValueError naming it."""
    if not globs:
        return list(all_layers)
    out = []
    for g in globs:
        hit = [n for n in all_layers if fnmatch.fnmatchcase(n, g)]
        if not hit:
            raise ValueError(
                f"--layers {g!r} matches no converted layer; converted layers: "
                + ", ".join(all_layers[:12])
                + (" ..." if len(all_layers) > 12 else "")
            )
        out += [n for n in hit if n not in out]
    return [n for n in all_layers if n in out]


@dataclass
class _Ctx:
    recipe: Any
    baseline: Any
    cfg: LabConfig
    out: Path
    jobs: int
    threads: int
    emit: Callback
    layers: list[str]
    all_layers: list[str]
    dims: dict[str, tuple[int, int]]
    precision: str
    close: float
    probes: dict[str, Probe] = field(default_factory=dict)
    base_final: float | None = None
    base_val: dict[int, float | None] = field(default_factory=dict)
    gap: float | None = None
    gap_ref: float | None = None
    noise: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    pool: Any = None  # the TaskPool running probes
    prefix: str = ""  # the lab's prefix of the user's layer names (fp8lab.lab.debug.names)
    start: str | None = None  # the lab checkpoint every stage-1 probe starts from
    start_info: dict[str, Any] | None = None  # where it came from (fp8lab.lab.debug.start)
    norms: list[str] = field(default_factory=list)  # norms whose affine params R may quantize

    # ------------------------------------------------------------------ probes
    def run(self, specs: Sequence[ProbeSpec], extra: Sequence[tuple] = ()) -> list[Any]:
        """Run probes (and extra tasks) in the pool; record the probes."""
        cfg_d = self.cfg.to_dict()
        todo = [s for s in specs if s.name not in self.probes]
        tasks = [
            (
                run_probe,
                {"spec": s, "cfg_dict": cfg_d, "run_dir": str(self.out / "probes" / s.name)},
            )
            for s in todo
        ]
        tasks += list(extra)
        results = self.pool.run(tasks, self.emit)
        for s in todo:
            p = self._record(s)
            if self.base_final is not None:
                self.announce(p)
        return results[len(todo) :]

    def announce(self, p: Probe) -> None:
        """A progress event for a finished probe."""
        self.emit({"event": "probe", "probe": p.name, "recipe": p.name, "gap_pct": p.gap_pct,
                   "label": p.label})  # fmt: skip

    def _record(self, s: ProbeSpec) -> Probe:
        from fp8lab.recipe import Recipe

        run = json.loads((self.out / "probes" / s.name / "run.json").read_text())
        recs = read_metrics(self.out / "probes" / s.name)
        val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        p = Probe(s.name, s.kind, s.label, run["summary"], val,
                  recipe=Recipe.from_dict(s.recipe, where=s.name))  # fmt: skip
        self.probes[s.name] = p
        if self.base_final is not None:
            self._score(p)
        return p

    def _score(self, p: Probe) -> None:
        s = p.summary
        final = s.get("final_val_loss")
        diverged = bool(s.get("diverged")) or final is None
        p.gap_pct = None if diverged else _rel(final, self.base_final)
        if self.gap_ref is None or p.kind == "baseline":
            return
        gap_p = self.gap_ref if diverged else (p.gap_pct if p.gap_pct is not None else 0.0)
        p.closure = 1.0 - gap_p / self.gap_ref if self.gap_ref else None
        within = (not diverged and self.noise is not None
                  and abs(gap_p) <= noise_rule.WITHIN * self.noise)  # fmt: skip
        p.explains = not diverged and (within or (p.closure is not None
                                                  and p.closure >= self.close))  # fmt: skip

    def spec(self, name: str, recipe: Any, kind: str, label: str, **kw: Any) -> ProbeSpec:
        if self.start is not None:  # --from-checkpoint: a probe not continuing another run
            kw.setdefault("start", self.start)  # continues from the user's checkpoint
        return ProbeSpec(name=name, recipe=recipe.replace(name=name).to_dict(), kind=kind,
                         label=label, **kw)  # fmt: skip


# ----------------------------------------------------------------------------- the method
def run_debug(
    recipe: Any,
    cfg: LabConfig,
    out_dir: str | Path,
    baseline: Any = "bf16",
    jobs: int = 1,
    threads: int = 0,
    layers: Sequence[str] | None = None,
    checkpoints: int = 3,
    close: float = 0.7,
    recovery_from: float = 0.5,
    callback: Callback | None = None,
    scenario: str | None = None,
    start: str | Path | None = None,
) -> DebugResult:
    """Run the seven stages (module doc) for ``recipe`` against ``baseline`` under ``cfg``,
    writing every probe into ``out_dir/probes``; return the :class:`DebugResult` (the report
    and ``fix.toml`` are written by :func:`fp8lab.lab.debug.verdict.write_fix` and
    ``fp8lab.report.debug``).

    ``start``: a checkpoint of the user's own loop (`fp8lab.save_debug_checkpoint`); R, the
    baseline and the noise pair then continue from it for ``cfg.train.steps``
    (`fp8lab.lab.debug.start`). ``recipe`` may name layers as the user's model does
    (`fp8lab.lab.debug.names`).

    Bad input raises ValueError before any training: an unknown recipe or baseline, a
    baseline with R's numerics, ``layers`` globs matching no converted layer, a bad config,
    a start checkpoint that is missing, unreadable or does not fit the model."""
    t_start = time.perf_counter()
    emit = callback or (lambda e: None)
    rec = resolve(recipe)
    base = resolve(baseline)
    if rec.fingerprint() == base.fingerprint():
        # suggest a baseline that differs from the recipe (bf16 against bf16 is no suggestion)
        other = next(n for n in ("bf16", "fp32") if resolve(n).fingerprint() != rec.fingerprint())
        raise ValueError(
            f"the baseline {base.name!r} has the same numerics as the recipe {rec.name!r}: "
            f"nothing to debug (choose another --baseline, e.g. --baseline {other})"
        )
    check_count("jobs", jobs, 1)  # the pool's rule (a bool is not a count)
    if not (isinstance(checkpoints, int) and 1 <= checkpoints <= 20):
        raise ValueError(f"checkpoints must be an integer in 1..20, got {checkpoints!r}")
    if not 0 < close <= 1:
        raise ValueError(f"close must be in (0, 1], got {close!r}")
    if not 0 < recovery_from < 1:
        raise ValueError(f"recovery_from must be in (0, 1), got {recovery_from!r}")
    cfg.check()
    check_distributed(jobs, cfg.train.batch_size)  # torchrun: --jobs 1, a divisible batch
    if cfg.train.steps < 4:
        raise ValueError(f"train.steps must be >= 4 for the debugger, got {cfg.train.steps}")
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model, None, cfg.train.seed)
    prefix = names.lab_prefix(model)
    rec = names.to_lab_names(rec, prefix, select_linears(model))  # R in the user's names
    convert(model, rec)
    all_layers = variants.converted_layers(model)
    if not all_layers:
        raise ValueError("the recipe converts no layer of the model: nothing to debug")
    chosen = select_layers(all_layers, layers)
    corpus = load_corpus(cfg.data, cfg.model.block_size)  # a missing data path fails here
    begin = None if start is None else read_start(start, cfg, corpus)  # checked before writing
    out = Path(out_dir)
    # torchrun: rank 0 writes files
    on_rank0(_prepare_out, out, cfg, rec, base, chosen, begin and begin["start"])
    ctx = _Ctx(rec, base, cfg, out, jobs, threads, emit, chosen, all_layers,
               variants.layer_dims(model, all_layers), variants.hp_precision(base), close,
               prefix=prefix, norms=kinds.norm_layers(model, all_layers))  # fmt: skip
    if begin is not None:
        on_rank0(write_start, begin, out)
        ctx.start, ctx.start_info = str(out / START), begin["start"]
    del model, begin
    steps = cfg.train.steps
    with TaskPool(jobs, threads) as pool:
        ctx.pool = pool
        return _stages(ctx, steps, checkpoints, recovery_from, t_start, scenario)


def _stages(ctx: _Ctx, steps: int, checkpoints: int, recovery_from: float, t_start: float,
            scenario: str | None) -> DebugResult:  # fmt: skip
    """Stages 1-7 of :func:`run_debug` (probes run in ``ctx.pool``)."""
    state = _stage_gap(ctx, steps, checkpoints, recovery_from, scenario)
    if state["base_diverged"] or state["no_problem"] or state["r_better"]:
        return rank0_writes(decide, ctx, state, [], [], t_start)
    scores, pair_scores = _stage_screen(ctx, state)
    found = _stage_confirm(ctx, scores, pair_scores)
    remedy_rows: list[dict[str, Any]] = []
    if found.get("kind") in kinds.KIND_REMEDY:  # its probe is its remedy
        remedy_rows = _kind_remedy_rows(ctx, found)
    elif found["role"] is not None:
        _stage_layers(ctx, found, scores, pair_scores)
        remedy_rows = _stage_remedies(ctx, found)
    return rank0_writes(decide, ctx, state, scores, remedy_rows, t_start, found)


def _stage_gap(ctx: _Ctx, steps: int, checkpoints: int, recovery_from: float,
               scenario: str | None) -> dict[str, Any]:  # fmt: skip
    """Stage 1: R, the baseline and the noise pair; the gap and the noise. Returns the state
    the verdict reads (``base_diverged``, ``no_problem``, ``r_better``: nothing to debug)."""
    rec, base, cfg, emit = ctx.recipe, ctx.baseline, ctx.cfg, ctx.emit
    # 1. gap and noise -------------------------------------------------------------------
    t0 = time.perf_counter()
    emit({"event": "stage", "stage": "gap", "text": "gap and noise: R, baseline, fp32, bf16"})
    screen_steps = attribution.snapshot_steps(steps, checkpoints)
    rec_step = max(1, min(steps - 1, round(steps * recovery_from)))
    specs = [ctx.spec("recipe", rec, "recipe", f"R = {rec.name}",
                      snapshots=tuple(sorted({*screen_steps, rec_step})))]  # fmt: skip
    runs = {"baseline": base}
    for n in noise_rule.PAIR:
        r = resolve(n)
        if r.fingerprint() != base.fingerprint():
            runs[f"noise-{n}"] = r
    for name, r in runs.items():
        kind = "baseline" if name == "baseline" else "noise"
        specs.insert(0, ctx.spec(name, r, kind, f"{kind}: {r.name}"))
    ctx.run(specs)
    bp = ctx.probes["baseline"]
    ctx.base_final = bp.summary.get("final_val_loss")
    ctx.base_val = dict(bp.val)
    curves = {n: (ctx.probes["baseline"].val if f"noise-{n}" not in ctx.probes
                  else ctx.probes[f"noise-{n}"].val) for n in noise_rule.PAIR}  # fmt: skip
    ctx.noise = noise_rule.late_gap_pct(*(curves[n] for n in noise_rule.PAIR), bp.val)
    vocab = _vocab(cfg)
    base_diverged = bool(bp.summary.get("diverged")) or ctx.base_final is None
    rp = ctx.probes["recipe"]
    r_diverged = bool(rp.summary.get("diverged")) or rp.summary.get("final_val_loss") is None
    if not base_diverged:
        ctx.gap = None if r_diverged else _rel(rp.summary["final_val_loss"], ctx.base_final)
        ctx.gap_ref = ctx.gap if not r_diverged else _rel(math.log(vocab), ctx.base_final)
    for p in ctx.probes.values():
        ctx._score(p)
        ctx.announce(p)
    ctx.timings["gap_s"] = time.perf_counter() - t0
    no_problem = (not base_diverged and not r_diverged
                  and too_small_to_attribute(ctx.gap, ctx.noise))  # fmt: skip
    state: dict[str, Any] = {"screen_steps": screen_steps, "recovery_step": rec_step,
                             "base_diverged": base_diverged, "r_diverged": r_diverged,
                             "no_problem": no_problem, "vocab": vocab, "scenario": scenario,
                             "floor_pct": gap_floor(ctx.noise)}  # fmt: skip
    # R better than the baseline beyond the noise: nothing to debug either
    state["r_better"] = not no_problem and ctx.gap_ref is not None and ctx.gap_ref < 0
    return state


def _stage_screen(ctx: _Ctx, state: dict[str, Any]) -> tuple[list, list]:
    """Stages 2-4: recovery from R's checkpoint, fake quantization and the one-step screening
    of R's snapshots; returns the cell scores and the operand-pair scores."""
    rec, base, cfg, out, emit = ctx.recipe, ctx.baseline, ctx.cfg, ctx.out, ctx.emit
    chosen, all_layers, jobs = ctx.layers, ctx.all_layers, ctx.jobs
    screen_steps, rec_step = state["screen_steps"], state["recovery_step"]
    # 2-4. recovery, fake quantization, screening -----------------------------------------
    t0 = time.perf_counter()
    emit({"event": "stage", "stage": "screen",
          "text": "recovery, fake quantization and one-step attribution"})  # fmt: skip
    r_dir = out / "probes" / "recipe"
    fq = variants.per_layer(rec, all_layers, variants.fake_quant_recipe, "fake-quant")
    # a diverged R stops early: only the checkpoints it reached exist
    screen_steps = [t for t in screen_steps if snapshot_path(r_dir, t).exists()]
    state["screen_steps"] = screen_steps
    reached = [t for t in (rec_step, *reversed(screen_steps)) if snapshot_path(r_dir, t).exists()]
    rec_specs = [
        ctx.spec("fake-quant", fq, "fake-quant",
                 "R's grids, current scaling, fp32 accumulation"),
    ]  # fmt: skip
    if reached:
        state["recovery_step"] = reached[0]
        rec_specs.insert(0, ctx.spec(
            "recovery", base, "recovery",
            f"R's checkpoint at step {reached[0]} continued under {base.name}",
            start=str(snapshot_path(r_dir, reached[0])), start_metrics=str(r_dir)))  # fmt: skip
    screen_tasks = [
        (attribution.screen_snapshot, {
            "recipe": rec.to_dict(), "baseline": base.to_dict(), "cfg_dict": cfg.to_dict(),
            "snapshot": str(snapshot_path(r_dir, t)), "layers": chosen,
            "precision": ctx.precision})
        for t in screen_steps
    ]  # fmt: skip
    t_screen = time.perf_counter()
    if jobs > 1:
        screens = ctx.run(rec_specs, screen_tasks)
        ctx.timings["screen_s"] = None  # overlapped with the probes
    else:
        screens = ctx.pool.run(screen_tasks, emit)
        ctx.timings["screen_s"] = time.perf_counter() - t_screen
        ctx.run(rec_specs)
    scores = attribution.pool_scores(screens)
    # the raw gradient-norm scores, for comparison in the result's details (not used)
    state["attribution_raw"] = [
        {k: r[k] for k in ("layer", "gemm", "role", "score")}
        for r in attribution.pool_scores(screens, "err_raw")
    ]
    pair_scores = attribution.pool_scores(screens, rows="pairs")
    state["attribution_pairs"] = [
        {k: r[k] for k in ("layer", "gemm", "role", "score")} for r in pair_scores
    ]
    ctx.timings["stage2_4_s"] = time.perf_counter() - t0
    if ctx.timings["screen_s"] is None:
        ctx.timings["screen_s"] = sum(s.get("seconds", 0.0) for s in screens)

    return scores, pair_scores


def _stage_confirm(ctx: _Ctx, scores: list, pair_scores: list) -> dict[str, Any]:
    """Stage 5: role probes in the screening's order until one explains the gap, then that
    role's GEMM probes; returns ``{"role", "tried_roles"}`` and, with a culprit, ``"gemm"``."""
    rec, chosen, emit = ctx.recipe, ctx.layers, ctx.emit
    # 5. confirmation ------------------------------------------------------------------------
    t0 = time.perf_counter()
    emit({"event": "stage", "stage": "confirm", "text": "confirmation probes"})
    # roles by their pair scores summed over layers (cells when a screen has no pairs)
    role_rank = [k[0] for k, v in attribution.aggregate(pair_scores or scores, ("role",))
                 if v > 0]  # fmt: skip
    for r in variants.ROLES:
        if r not in role_rank and any(getattr(rec.for_layer(x), r) is not None for x in chosen):
            role_rank.append(r)
    culprit = None
    tried_roles: list[str] = []
    gemm_probes: dict[str, Probe] = {}
    # the other culprit kinds (norm weights, attention, loss scale) R can have: one probe each,
    # beside the first batch of role probes (none for a recipe without them)
    kind_specs = [ctx.spec(f"kind-{k}", v, "kind", _KIND_WORDS[k])
                  for k, v in kinds.kind_probes(rec).items()]  # fmt: skip
    while role_rank and culprit is None:
        # every quantized role at once: the screening orders them, the probes decide
        batch = list(role_rank)
        role_rank = role_rank[len(batch) :]
        specs, kind_specs = list(kind_specs), []
        for r in batch:
            tried_roles.append(r)
            cells = {x: [(g, r) for g in variants.ROLE_GEMMS[r]] for x in chosen}
            specs.append(
                ctx.spec(
                    f"role-{r}",
                    variants.cells_hp(rec, cells, ctx.precision, "x"),
                    "role",
                    f"{r} in {ctx.precision} in every GEMM, all layers",
                )
            )
        top = batch[0]
        for g in variants.ROLE_GEMMS[top]:
            cells = {x: [(g, top)] for x in chosen}
            specs.append(
                ctx.spec(
                    f"gemm-{g}-{top}",
                    variants.cells_hp(rec, cells, ctx.precision, "x"),
                    "gemm",
                    f"{top} in {ctx.precision} in {g} only, all layers",
                )
            )
        ctx.run(specs)
        ok = [r for r in batch if ctx.probes[f"role-{r}"].explains]
        if ok:
            culprit = max(ok, key=lambda r: ctx.probes[f"role-{r}"].closure or 0.0)
    if kind_specs:  # no quantized role to probe: the kind probes alone
        ctx.run(kind_specs)
    kind = _kind_culprit(ctx, culprit)
    if kind is not None:
        ctx.timings["confirm_s"] = time.perf_counter() - t0
        return {"kind": kind, "role": None, "tried_roles": tried_roles,
                "tried_kinds": _tried_kinds(ctx)}  # fmt: skip
    if culprit is not None:
        need = [g for g in variants.ROLE_GEMMS[culprit] if f"gemm-{g}-{culprit}" not in ctx.probes]
        if need:
            ctx.run([ctx.spec(f"gemm-{g}-{culprit}",
                              variants.cells_hp(rec, {x: [(g, culprit)] for x in chosen},
                                                ctx.precision, "x"), "gemm",
                              f"{culprit} in {ctx.precision} in {g} only, all layers")
                     for g in need])  # fmt: skip
        gemm_probes = {g: ctx.probes[f"gemm-{g}-{culprit}"] for g in variants.ROLE_GEMMS[culprit]}
    ctx.timings["confirm_s"] = time.perf_counter() - t0

    found: dict[str, Any] = {"role": culprit, "tried_roles": tried_roles,
                             "tried_kinds": _tried_kinds(ctx)}  # fmt: skip
    if culprit is not None:  # the GEMM where the operand matters most: the larger share closed
        found["kind"] = "operand"
        found["gemm"] = max(gemm_probes, key=lambda g: gemm_probes[g].closure or -math.inf)
    return found


def _stage_layers(ctx: _Ctx, found: dict[str, Any], scores: list, pair_scores: list) -> None:
    """Group testing over the layers, ordered by the culprit role's attribution: adds
    ``layers``, ``order``, ``tried``, ``layer_scores`` to ``found``."""
    rec, chosen, emit, jobs = ctx.recipe, ctx.layers, ctx.emit, ctx.jobs
    culprit, gemm = found["role"], found["gemm"]
    # group testing over the layers, ordered by the role's attribution
    t0 = time.perf_counter()
    emit({"event": "stage", "stage": "layers", "text": "group testing over layers"})
    per_layer_score = {x: 0.0 for x in chosen}
    for row in scores:
        if row["role"] == culprit and row["layer"] in per_layer_score:
            per_layer_score[row["layer"]] += row["score"]
    # by the operand pair's replay and the culprit GEMM's cell, never the sum over GEMMs
    # (a strong cell and its strong opposite in the other GEMM would cancel)
    order = search.layer_order(chosen, scores, culprit, gemm, pair_scores)

    def layer_probe_name(k: int) -> str:
        return _layer_probe_name(culprit, k, len(order))

    def explains(prefixes: list[list[str]]) -> list[bool]:
        specs = []
        for pre in prefixes:
            name = layer_probe_name(len(pre))
            cells = {x: [(g, culprit) for g in variants.ROLE_GEMMS[culprit]] for x in pre}
            specs.append(ctx.spec(name, variants.cells_hp(rec, cells, ctx.precision, "x"),
                                  "layers", f"{culprit} in {ctx.precision} on "
                                  + ", ".join(pre)))  # fmt: skip
        ctx.run(specs)
        # stricter than the verdict's 70 %: the remedies then act on these layers only,
        # and a prefix that barely explains leaves them no margin
        return [_strict(ctx, ctx.probes[layer_probe_name(len(p))]) for p in prefixes]

    layers_found, tried = search.prefix_search(order, explains, jobs)
    found.update(layers=layers_found, order=order, tried=tried,
                 layer_scores=per_layer_score)  # fmt: skip
    ctx.timings["layers_s"] = time.perf_counter() - t0


_KIND_WORDS = {
    "norm_weight": "the norms' affine parameters in high precision",
    "attention": "attention in high precision",
    "loss_scale": "dynamic loss scaling instead of the static loss scale",
}


def _tried_kinds(ctx: _Ctx) -> list[str]:
    return [k for k in kinds.KIND_REMEDY if f"kind-{k}" in ctx.probes]


def _kind_culprit(ctx: _Ctx, role: str | None) -> str | None:
    """The non-operand kind whose probe explains the gap and closes at least as much of it as
    the explaining role probe ``role`` (None: no role explains); None when no kind does."""
    ok = [k for k in _tried_kinds(ctx) if ctx.probes[f"kind-{k}"].explains]
    if not ok:
        return None
    best = max(ok, key=lambda k: ctx.probes[f"kind-{k}"].closure or 0.0)
    closure = ctx.probes[f"kind-{best}"].closure or 0.0
    if role is not None and (ctx.probes[f"role-{role}"].closure or 0.0) > closure:
        return None
    return best


def _kind_remedy_rows(ctx: _Ctx, found: dict[str, Any]) -> list[dict[str, Any]]:
    """The remedy rows of a non-operand culprit: its probe (the only remedy of its kind)."""
    kind = found["kind"]
    found["layers"] = list(ctx.norms) if kind == "norm_weight" else []
    found["gemm"] = None
    if kind == "attention":  # which of Q, K, V, S, dP: from R's attention records
        from fp8lab.lab.loop import read_stats

        found["tensor"] = kinds.attention_tensor(read_stats(ctx.out / "probes" / "recipe"))
    p = ctx.probes[f"kind-{kind}"]
    tokens = ctx.cfg.train.batch_size * ctx.cfg.model.block_size
    return [{"name": kinds.KIND_REMEDY[kind], "probe": p.name, "gap_pct": p.gap_pct,
             "closure": p.closure, "explains": p.explains,
             "relative_cost": remedies.relative_cost(p.recipe, ctx.recipe, ctx.dims, tokens),
             "recipe": p.recipe, "label": _KIND_WORDS[kind]}]  # fmt: skip


def _layer_probe_name(role: str, k: int, n_layers: int) -> str:
    """The probe of the culprit role in high precision on the first ``k`` of ``n_layers``
    ordered layers (all of them: the role probe)."""
    return f"layers-{role}-top{k}" if k < n_layers else f"role-{role}"


def _stage_remedies(ctx: _Ctx, found: dict[str, Any]) -> list[dict[str, Any]]:
    """Stage 6: the remedies for the culprit cells, each a probe; their rows for the verdict."""
    rec, cfg, emit = ctx.recipe, ctx.cfg, ctx.emit
    culprit, gemm, layers_found = found["role"], found["gemm"], found["layers"]
    remedy_rows: list[dict[str, Any]] = []
    # 6. remedies ------------------------------------------------------------------------
    t0 = time.perf_counter()
    emit({"event": "stage", "stage": "remedies", "text": "remedies"})
    from fp8lab.lab.loop import read_stats

    # the operand's amax fell gradually on these culprit layers: a shorter history may do
    fell = kinds.amax_fell(read_stats(ctx.out / "probes" / "recipe"), culprit, layers_found)
    found["amax_fell"] = fell
    cand = remedies.remedy_variants(rec, culprit, gemm, layers_found, ctx.precision, fell=fell,
                                    all_layers=ctx.all_layers)  # fmt: skip
    ctx.run([ctx.spec(f"remedy-{n}", v, "remedy", _remedy_words(n, culprit, gemm,
                                                                  layers_found))
             for n, v in cand.items()])  # fmt: skip
    role_probe = ctx.probes[_layer_probe_name(culprit, len(layers_found), len(found["order"]))]
    tokens = cfg.train.batch_size * cfg.model.block_size
    for n in remedies.REMEDIES:
        p = role_probe if n == "high-precision-role" else ctx.probes.get(f"remedy-{n}")
        if p is None:
            continue
        remedy_rows.append({
            "name": n, "probe": p.name, "gap_pct": p.gap_pct, "closure": p.closure,
            "explains": p.explains,
            "relative_cost": remedies.relative_cost(p.recipe, rec, ctx.dims, tokens),
            "recipe": p.recipe,
            "label": _remedy_words(n, culprit, gemm, layers_found),
        })  # fmt: skip
    ctx.timings["remedies_s"] = time.perf_counter() - t0
    return remedy_rows


def gap_floor(noise: float | None) -> float:
    """The smallest gap (%) the debugger attributes: max(MIN_GAP_PCT, noise.ATTRIBUTE x noise).

    Twice the noise alone is not enough: on a tiny healthy model fp32 and bf16 can agree to
    0.001 %, and a +0.007 % gap of te-delayed (20 steps) was then "debugged" into a culprit and
    a fix file that 40 steps showed to be nothing."""
    return max(MIN_GAP_PCT, noise_rule.ATTRIBUTE * noise) if noise is not None else MIN_GAP_PCT


def too_small_to_attribute(gap: float | None, noise: float | None) -> bool:
    """A gap (%) at or below :func:`gap_floor`: "no FP8 problem found"."""
    return gap is not None and abs(gap) <= gap_floor(noise)


def _strict(ctx: _Ctx, p: Probe) -> bool:
    """Explains the gap with a margin: closes >= LAYER_CLOSE of it, or ends within noise
    (`noise.WITHIN` x the noise)."""
    within = (p.gap_pct is not None and ctx.noise is not None
              and abs(p.gap_pct) <= noise_rule.WITHIN * ctx.noise)  # fmt: skip
    return p.explains and (within or (p.closure or 0.0) >= LAYER_CLOSE)


def _remedy_words(name: str, role: str, gemm: str | None, layers: Sequence[str]) -> str:
    where = ", ".join(layers) if len(layers) <= 4 else f"{len(layers)} layers"
    return {
        "current-scaling": f"current scaling for {role} on {where}",
        "finer-granularity": f"finer scaling blocks for {role} on {where}",
        "e5m2-gradients": f"E5M2 for {role} on {where}",
        "high-precision-cells": f"{role} of {gemm} in high precision on {where}",
        "high-precision-role": f"{role} in high precision in every GEMM on {where}",
        "shorter-history": f"amax history of {kinds.SHORT_HISTORY} steps for {role} on {where}",
        "last-blocks-high-precision": "every GEMM of the last blocks in high precision",
    }[name]


def _vocab(cfg: LabConfig) -> int:
    return getattr(cfg.model, "vocab_size", 256)


def _prepare_out(out: Path, cfg: LabConfig, rec: Any, base: Any, layers: list[str],
                 start: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Create ``out`` or check it holds a debug run of the same inputs (then probes resume);
    ``start``: the start checkpoint's record (its SHA-256 and step are inputs too)."""
    from fp8lab.lab.train import mismatch_message, recipe_settings

    meta = {"lab": cfg.to_dict(), "recipe": recipe_settings(rec),
            "baseline": recipe_settings(base), "layers": layers}  # fmt: skip
    if start is not None:
        meta["start"] = {"sha256": start["sha256"], "step": start["step"]}
    path = out / CONFIG_FILE
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ValueError(
                f"{out}: a non-empty directory not made by fp8lab debug; refusing to write into "
                "it (choose a new or empty --out)"
            ) from None
        why = mismatch_message(old, meta)
        if why:
            raise ValueError(
                f"{out} holds a debug run of other inputs; choose another --out. {why}"
            )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2) + "\n")
