"""The verdict: culprit, best remedy, ``fix.toml`` and the words that explain them.

The best remedy is the cheapest (``relative_cost``; equal costs: the simpler change, in the
order of ``remedies.REMEDIES``) among those that explain the gap (close at least 70 % of it, or
land within twice the noise); when none does, the one with the smallest gap, and ``fix`` is
then null. ``fix.toml`` is a per-layer recipe file: ``base = "<preset>"``
and ``[[layer]]`` tables when R is a preset, else R's full settings plus the tables; it is read
back and checked to give the remedy's numerics on every layer before it is kept. For a
factory's model its rules name each layer as the user's model does and as the lab does
(`fp8lab.lab.debug.names.with_user_names`): ``fp8lab.nn.convert(model, "fix.toml")`` and
``fp8lab compare --recipes fix.toml`` both take it. Beside it, the same fix for Megatron-LM
(``fix.megatron.yaml``) and Transformer Engine's debug tool (``fix.te.yaml``):
`fp8lab.lab.debug.export`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from fp8lab.lab import noise as noise_rule
from fp8lab.lab.debug.export import export_fix, write_exports
from fp8lab.lab.debug.names import with_user_names
from fp8lab.lab.debug.result import DebugResult
from fp8lab.recipe import Recipe

FIX = "fix.toml"
RESULT = "debug_result.json"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.3f} %"


def best_remedy(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Cheapest explaining remedy; else the smallest gap (None without remedies)."""
    from fp8lab.lab.debug.remedies import REMEDIES

    ok = [r for r in rows if r["explains"]]
    if ok:  # equal costs: the simpler change (REMEDIES order), never a gap difference in noise
        return min(ok, key=lambda r: (round(r["relative_cost"], 9), REMEDIES.index(r["name"])))
    finite = [r for r in rows if r["gap_pct"] is not None]
    return min(finite, key=lambda r: abs(r["gap_pct"])) if finite else None


def fix_text(remedy: Recipe, recipe: Recipe, note: str,
             what: str = "the fp8lab debug remedy", source: str = "fp8lab debug") -> str:  # fmt: skip
    """The remedy as a recipe file: ``base = R`` + the layer rules when R is a preset whose
    numerics it still has, otherwise the remedy's full settings (with its rules). ``what``:
    the file's description after "R with", ``source`` its source (`fp8lab advise` writes its
    own)."""
    from fp8lab.recipe import get_recipe, recipes
    from fp8lab.recipe.toml_writer import dump_toml

    head = "".join(f"# {line}\n" for line in note.splitlines())
    base_name = recipe.name if recipe.name in recipes() else None
    if base_name is not None:
        rule_free = recipe.replace(layers=()) if recipe.layers else recipe
        if rule_free.fingerprint() != get_recipe(base_name).fingerprint():
            base_name = None
    if base_name is None:
        return head + _described(remedy, recipe, what, source).to_toml()
    d: dict[str, Any] = {"base": base_name, "name": remedy.name,
                         "description": f"{base_name} with {what}"}  # fmt: skip
    d["layer"] = [r.to_dict() for r in remedy.layers]
    return head + dump_toml(d)


def write_fix(remedy: Recipe, recipe: Recipe, path: Path, note: str,
              what: str = "the fp8lab debug remedy", source: str = "fp8lab debug") -> Path:  # fmt: skip
    """Write ``fix.toml`` (``path``) and check it reads back to the remedy's numerics on every
    layer. ``what``, ``source``: as for :func:`fix_text`."""
    text = fix_text(remedy, recipe, note, what, source)
    tmp = path.with_suffix(".tmp.toml")
    tmp.write_text(text)
    try:
        back = Recipe.load(tmp)
        same = back.replace(layers=()).fingerprint() == remedy.replace(layers=()).fingerprint()
        same = same and all(back.for_layer(x).fingerprint() == remedy.for_layer(x).fingerprint()
                            for r in remedy.layers for x in _names(r))  # fmt: skip
        if not same:  # fall back to the fully expanded recipe
            tmp.write_text(
                "".join(f"# {ln}\n" for ln in note.splitlines())
                + _described(remedy, recipe, what, source).to_toml()
            )
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _described(remedy: Recipe, recipe: Recipe, what: str = "the fp8lab debug remedy",
               source: str = "fp8lab debug") -> Recipe:  # fmt: skip
    """The remedy with its own description (R's prose would describe R, not the fix)."""
    return remedy.replace(description=f"{recipe.name} with {what}", source=source)


def _names(rule: Any) -> tuple[str, ...]:
    m = rule.match
    return (m,) if isinstance(m, str) else tuple(m)


def decide(
    ctx: Any,
    state: dict[str, Any],
    scores: list[dict[str, Any]],
    remedy_rows: list[dict[str, Any]],
    t_start: float,
    found: dict[str, Any] | None = None,
) -> DebugResult:
    """Assemble the :class:`DebugResult` (and write ``fix.toml`` and ``debug_result.json``)."""
    recovers = _recovers(ctx, state)
    reason, words = _early_verdict(ctx, state)
    verdict: dict[str, Any] = {"culprit": None, "fix": None, "best": None}
    if reason is None:
        reason, words, verdict = _diagnose(ctx, state, found or {}, remedy_rows, recovers)
    return _result(ctx, state, scores, remedy_rows, t_start, found, recovers, reason, words,
                   verdict)  # fmt: skip


def _recovers(ctx: Any, state: dict[str, Any]) -> bool:
    """Whether R's checkpoint continued under the baseline ends within noise (`noise.WITHIN` x
    the noise; or there is nothing to recover from)."""
    if state.get("no_problem") or state.get("r_better"):
        return True
    recovery, noise = ctx.probes.get("recovery"), ctx.noise
    if recovery is not None and recovery.gap_pct is not None and noise is not None:
        return abs(recovery.gap_pct) <= noise_rule.WITHIN * noise
    return False


def _r_words(ctx: Any, state: dict[str, Any]) -> str:
    rec, base = ctx.recipe, ctx.baseline
    if state.get("r_diverged"):
        return f"R = {rec.name} diverged (the baseline {base.name} did not)."
    return (f"R = {rec.name} ends {_pct(ctx.gap)} from the baseline {base.name} "
            f"(noise: fp32 vs bf16 differ by up to {_pct(ctx.noise).lstrip('+')}).")  # fmt: skip


def _early_verdict(ctx: Any, state: dict[str, Any]) -> tuple[str | None, list[str]]:
    """The verdicts that need no probe beyond the gap: (reason, words), or (None, [])."""
    base = ctx.baseline
    if state.get("base_diverged"):
        return "baseline-diverged", [
            f"The baseline {base.name} diverged, so a gap to it means nothing: no verdict. "
            "Choose another --baseline or a smaller learning rate."
        ]
    if state.get("no_problem"):
        return "no-problem", [
            _r_words(ctx, state)
            + f" That is within max(0.01 %, {noise_rule.ATTRIBUTE:g}x the noise) = "
            f"{_pct(state.get('floor_pct')).lstrip('+')}, too small to attribute: no FP8 "
            "problem found."
        ]
    if state.get("r_better"):
        return "no-problem", [
            _r_words(ctx, state) + " R is better than the baseline beyond the noise: no FP8 "
            "problem to find."
        ]
    return None, []


def _diagnose(
    ctx: Any, state: dict[str, Any], found: dict[str, Any], remedy_rows: list[dict[str, Any]],
    recovers: bool,
) -> tuple[str, list[str], dict[str, Any]]:  # fmt: skip
    """The verdict of a full run: (reason, words, {culprit, fix, best})."""
    base = ctx.baseline
    words = [_r_words(ctx, state)]
    recovery = ctx.probes.get("recovery")
    if recovery is not None:
        words.append(
            f"Recovery: R's checkpoint at step {state['recovery_step']} continued under "
            f"{base.name} ends {_pct(recovery.gap_pct)} from the baseline: "
            + (
                "it recovers (the damage is in the computation, not the weights)."
                if recovers
                else "it does not recover within the noise."
            )
        )
    fq = ctx.probes.get("fake-quant")
    if fq is not None:
        words.append(
            f"Fake quantization (R's grids, current scaling, fp32 accumulation) ends "
            f"{_pct(fq.gap_pct)}: "
            + ("the grids themselves are fine; scaling or accumulation is at fault."
               if fq.explains else "the grids (format or granularity) are part of it.")
        )  # fmt: skip
    verdict: dict[str, Any] = {"culprit": None, "fix": None, "best": None}
    if found.get("kind") not in (None, "operand"):  # norm weights, attention, loss scale
        words += _kind_words(ctx, found, remedy_rows, verdict)
        return "culprit", words, verdict
    role = found.get("role")
    if role is None:
        tried = found.get("tried_roles", [])
        words.append(
            "No single operand role explains the gap: with "
            + (", ".join(f"{r} ({_pct(ctx.probes[f'role-{r}'].gap_pct)})" for r in tried)
               or "no role")
            + " in high precision on every layer the gap stays above 30 % of R's. "
            "The fault may need several roles, or lie outside the quantized GEMMs "
            "(attention, optimizer state, master weights, loss scaling)."
        )  # fmt: skip
        return "unexplained", words, verdict
    words += _culprit_words(ctx, found, remedy_rows, verdict)
    return "culprit", words, verdict


def _culprit_words(
    ctx: Any, found: dict[str, Any], remedy_rows: list[dict[str, Any]], verdict: dict[str, Any]
) -> list[str]:
    """The culprit's sentences; fills ``verdict`` (culprit, best remedy, the fix file)."""
    role, layers = found["role"], found["layers"]
    # no "kind" key for an operand: the --json schema of an operand culprit stays as it was
    verdict["culprit"] = {"role": role, "gemm": found["gemm"], "layers": list(layers)}
    gp = {g: ctx.probes.get(f"gemm-{g}-{role}") for g in ("fprop", "dgrad", "wgrad")}
    gtxt = ", ".join(f"{g} only {_pct(p.gap_pct)}" for g, p in gp.items() if p)
    where = (f"{len(layers)} of {len(ctx.layers)} layers" if len(layers) > 3
             else ", ".join(layers))  # fmt: skip
    words = [
        f"Culprit: the {role} operand on {where}, mattering most in {found['gemm']} "
        f"(in high precision on every layer: {gtxt})."
    ]
    return words + _remedy_words(ctx, remedy_rows, verdict)


_KIND_TEXT = {
    "norm_weight": "the norms' quantized affine parameters",
    "attention": "FP8 attention",
    "loss_scale": "the static loss scale (the gradients underflow or overflow under it)",
}


def _kind_words(
    ctx: Any, found: dict[str, Any], remedy_rows: list[dict[str, Any]], verdict: dict[str, Any]
) -> list[str]:
    """A culprit of a kind other than an operand (`fp8lab.lab.debug.kinds`)."""
    kind, layers = found["kind"], list(found.get("layers") or [])
    verdict["culprit"] = {"kind": kind, "role": None, "gemm": None, "layers": layers}
    if kind == "attention":
        verdict["culprit"]["tensor"] = found.get("tensor")
    p = ctx.probes.get(f"kind-{kind}")
    where = f" ({', '.join(layers)})" if layers and len(layers) <= 4 else (
        f" ({len(layers)} norms)" if layers else "")  # fmt: skip
    words = [f"Culprit: {_KIND_TEXT[kind]}{where}: with "
             f"{p.label if p else kind} R ends {_pct(p.gap_pct if p else None)}."]  # fmt: skip
    return words + _remedy_words(ctx, remedy_rows, verdict)


def _remedy_words(
    ctx: Any, remedy_rows: list[dict[str, Any]], verdict: dict[str, Any]
) -> list[str]:
    """The best remedy's sentence; writes ``fix.toml`` (and the fix in the formats where users
    apply it: `fp8lab.lab.debug.export`) when it explains the gap."""
    rec, base = ctx.recipe, ctx.baseline
    words = []
    best = verdict["best"] = best_remedy(remedy_rows)
    if best is not None:
        words.append(
            f"Best remedy: {best['label']} (gap {_pct(best['gap_pct'])}, relative cost "
            f"{best['relative_cost']:+.3f})"
            + ("." if best["explains"] else "; it does not close 70 % of the gap.")
        )
    if best is not None and best["explains"]:
        note = (
            f"fp8lab debug fix for {rec.name}: {best['label']}\n"
            f"gap {_pct(ctx.gap)} -> {_pct(best['gap_pct'])} against {base.name}"
        )
        # the layers as the user's model names them too (fp8lab.lab.debug.names)
        fix = with_user_names(best["recipe"].replace(name=f"{rec.name}-fix"), rec, ctx.prefix)
        verdict["fix"] = str(write_fix(fix, rec, ctx.out / FIX, note))
        # the same fix for Megatron-LM and TE's debug tool (fp8lab.lab.debug.export)
        exp = export_fix(best["name"], best["recipe"], rec, ctx.all_layers, ctx.prefix, note)
        verdict["exports"] = write_exports(ctx.out, exp)
        verdict["export_notes"] = exp.notes
    return words


def _result(
    ctx: Any, state: dict[str, Any], scores: list[dict[str, Any]],
    remedy_rows: list[dict[str, Any]], t_start: float, found: dict[str, Any] | None,
    recovers: bool, reason: str, words: list[str], verdict: dict[str, Any],
) -> DebugResult:  # fmt: skip
    """The `DebugResult`, also written as ``debug_result.json``."""
    best = verdict["best"]
    attribution = [{k: r[k] for k in ("layer", "gemm", "role", "score")} for r in scores]
    ctx.timings["total_s"] = time.perf_counter() - t_start
    result = DebugResult(
        recipe=ctx.recipe.name,
        baseline=ctx.baseline.name,
        gap_pct=ctx.gap,
        noise_pct=ctx.noise,
        recovers=recovers,
        culprit=verdict["culprit"],
        attribution=attribution,
        remedies=[{k: r[k] for k in ("name", "gap_pct", "relative_cost")} for r in remedy_rows],
        fix=verdict["fix"],
        probes=ctx.probes,
        verdict=" ".join(words),
        reason=reason,
        details={
            "timings_s": dict(ctx.timings),
            "state": {k: v for k, v in state.items()},
            "found": _plain(found or {}),
            "remedies": [{k: v for k, v in r.items() if k != "recipe"} for r in remedy_rows],
            "best_remedy": None if best is None else best["name"],
            "exports": verdict.get("exports", {}),
            "export_notes": verdict.get("export_notes", []),
            "layers": ctx.layers,
            "precision": ctx.precision,
            "lab": ctx.cfg.to_dict(),
            **({"start": ctx.start_info} if getattr(ctx, "start_info", None) else {}),
        },
    )
    (ctx.out / RESULT).write_text(json.dumps(
        {**result.to_json(), "verdict": result.verdict, "reason": reason,
         "details": result.details}, indent=2, default=str, allow_nan=False) + "\n")  # fmt: skip
    return result


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
