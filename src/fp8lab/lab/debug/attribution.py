"""One-step attribution: replay one training step under counterfactual cells.

Because the lab's runs are deterministic and resume bit for bit, the step after a saved
checkpoint can be replayed exactly: same weights, same scaling state, same batch, same RNG
(:class:`StepReplay`; a replay with nothing switched reproduces the recorded loss and gradient
bit for bit, and applying the optimizer gives the next checkpoint's weights). Screening
(:func:`screen_snapshot`) replays that step

- under the recipe under debug R: gradient ``g_R``;
- under the baseline at the same weights: ``g_B``;
- once per cell (layer, GEMM, role) with only that operand in high precision: ``g_c``;
- once per (layer, role) with that operand in high precision in both GEMMs that consume it
  (input: fprop and wgrad; weight: fprop and dgrad; grad_output: dgrad and wgrad): the pair
  rows (``"pairs"``), which group testing orders the layers by (one strong cell and its strong
  opposite in the other GEMM do not cancel there, as a sum of cell scores would);

and scores each cell by the share of the error it removes, ``(e_R - e_c) / e_R``, where the error
``e_x = |u(g_x) - u(g_B)|`` is measured in the space training applies: ``u`` is the update the
checkpoint's optimizer makes from that gradient (:class:`OptimizerUpdate`: the optimizer's own
``step()`` from the saved moments and step count, after the run's own gradient clipping). The
replayed step itself is the lab's `fp8lab.step.TrainStep` with the run's fault hook, on the
objects the lab builds for every run (`fp8lab.lab.parts.build_run_parts`) and the batch the
lab's loop picks (`fp8lab.lab.loop.next_batch`). A raw
gradient-norm
error is dominated by whichever entries have the largest gradients (e.g. the weight columns that
meet outlier activations), which Adam divides by their equally large second moments; the update
error weighs every parameter as the optimizer does. The raw gradient-norm errors are kept
too (``err_raw``; :func:`pool_scores` with ``key="err_raw"``). Over several checkpoints the
scores are pooled weighted by ``e_R`` (:func:`pool_scores`): a checkpoint where R's update is
far off counts more.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fp8lab.lab.data import Corpus, load_corpus
from fp8lab.lab.debug.runner import load_state, load_weights, rebatch
from fp8lab.lab.debug.variants import CELLS, ROLE_GEMMS, with_cells_hp
from fp8lab.lab.inject import InjectionHook
from fp8lab.lab.loop import batch_at, next_batch
from fp8lab.lab.parts import build_run_parts, make_scaler
from fp8lab.lab.train import LabConfig
from fp8lab.step import StepContext, TrainStep


class StepReplay:
    """Replays the step that follows checkpoint ``state`` of a run of ``recipe``.

    ``baseline_weights``: load only the weights (the model runs ``recipe`` with fresh scaling
    state: used for the baseline's gradient at R's weights)."""

    def __init__(
        self,
        recipe: Any,
        cfg: LabConfig,
        corpus: Corpus,
        state: dict[str, Any],
        baseline_weights: bool = False,
    ) -> None:
        self.recipe, self.cfg, self.state = recipe, cfg, state
        # under torchrun `dp` replays the step as the ranks ran it (this rank's shard)
        parts = build_run_parts(cfg, recipe)
        self.model, self.dp, self.opt, self.injector = (parts.model, parts.dp, parts.opt,
                                                        parts.injector)  # fmt: skip
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.own = not baseline_weights
        if self.own:
            self.model_state = state["model"]
        else:
            load_weights(self.model, state["model"])
            self.model_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self._scaler_state = state.get("scaler") if self.own else None
        self._new_scaler = lambda: make_scaler(recipe)
        loop = state["loop"]
        self.step = int(loop["step"])
        # the batch the run's next step trained on (past batches a guard rollback skipped)
        index = next_batch(int(loop.get("cursor", self.step)), loop.get("skip_batches", ()))
        self.batch = batch_at(corpus, cfg, index)
        self.layer_recipes: dict[str, Any] = {}

    def _reset(self) -> Any:
        self.model.load_state_dict(self.model_state)
        torch.set_rng_state(self.state["torch_rng"])
        self.opt.zero_grad(set_to_none=True)
        scaler = self._new_scaler()
        if scaler is not None and self._scaler_state is not None:
            scaler.load_state_dict(self._scaler_state)
        return scaler

    def _train_step(self, scaler: Any, clip: float, hooks: Sequence[Any] = ()) -> TrainStep:
        """The lab's training step on this replay's model, optimizer and scaler, with the run's
        planted gradient spike of this step (its NaN fault is not replayed: a NaN gradient
        attributes nothing)."""

        def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
            if self.dp is None:
                return self.model(*batch)[1]
            loss, loss_all, _ = self.dp.loss(*self.dp.shard(*batch))
            return loss, loss_all  # this rank's shard; the global batch's loss reported

        faults = InjectionHook(self.injector, self.params, [f"nan@{self.step}"])
        return TrainStep(loss_fn, self.opt, scaler, clip, [faults, *hooks], self.params)

    def gradient(self, switched: dict[str, Any] | None = None) -> tuple[float, torch.Tensor]:
        """(loss, flat gradient of every parameter) of the replayed step: unscaled, before
        clipping, no update. ``switched``: layer -> the recipe that layer runs instead (its
        delayed-scaling state carried over)."""
        scaler = self._reset()
        mods = []
        for layer, rec in (switched or {}).items():
            mod = self.model.get_submodule(layer)
            mods.append((mod, mod.recipe))
            mod.set_recipe(rec, keep_state=True)
            rebatch(self.dp, mod)
        grab = _GradientOnly(self.params)
        try:
            ctx = self._train_step(scaler, 0.0, [grab])(self.step, self.batch)
        finally:
            for mod, rec in mods:
                mod.set_recipe(rec)
                rebatch(self.dp, mod)
        return ctx.loss_value, grab.flat  # type: ignore[return-value]

    def full_step(self) -> dict[str, Any]:
        """Replay the whole training step (clipping, optimizer, loss scaler); return the loss,
        the gradient norm before clipping and the model state after the step."""
        tc = self.cfg.train
        scaler = self._reset()
        self.opt.load_state_dict(self.state["optimizer"])
        for g in self.opt.param_groups:
            g["lr"] = tc.lr_at(self.step)
        ctx = self._train_step(scaler, tc.grad_clip)(self.step, self.batch)
        return {"loss": ctx.loss_value, "grad_norm": ctx.grad_norm,
                "model": self.model.state_dict()}  # fmt: skip


class _GradientOnly:
    """A `TrainStep` hook that takes the unscaled gradients (before clipping: the step clips
    with 0) as one flat float32 vector and vetoes the update."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.flat: torch.Tensor | None = None

    def on_before_optimizer_step(self, ctx: StepContext) -> bool:
        self.flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
            for p in self.params
        ])  # fmt: skip
        return False


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    v = float(torch.linalg.vector_norm((a - b).double()))
    return v if math.isfinite(v) else math.inf


class OptimizerUpdate:
    """The update a checkpoint's optimizer makes from a flat gradient ``g``: its own ``step()``
    from the checkpoint's state (moments, step count, moment storage), after the run's own
    gradient clipping (`fp8lab.optim.clip_grad_norm_` at ``grad_clip``), with the learning rate
    1 and no weight decay (one learning rate for every parameter and the same decay at the same
    weights do not change shares of an error), taken from zero weights, so that the new weights
    are exactly ``-u(g)`` (no cancellation against the weights). A non-finite gradient gives a
    non-finite update (the step would be skipped). Runs on the replay's optimizer and
    parameters and puts both back as they were (weights, moments, learning rate, decay)."""

    def __init__(self, replay: StepReplay, grad_clip: float = 0.0) -> None:
        self.opt, self.params = replay.opt, replay.params
        self.saved = replay.state["optimizer"]
        self.grad_clip = grad_clip
        if len(self.params) != sum(len(g["params"]) for g in self.saved["param_groups"]):
            raise ValueError("the optimizer state does not cover the replay's parameters")

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(g).all()):
            return torch.full_like(g, math.inf, dtype=torch.float64)
        kept = [p.detach().clone() for p in self.params]
        try:
            return self._update(g)
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept, strict=True):
                    p.copy_(k)
            self.opt.load_state_dict(self.saved)
            self.opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def _update(self, g: torch.Tensor) -> torch.Tensor:
        from fp8lab.optim import clip_grad_norm_

        opt = self.opt
        # fp8lab's AdamW may keep fp32 masters apart; torch's AdamW steps the parameters
        master = getattr(opt, "master_weight", lambda p: p)
        opt.load_state_dict(self.saved)
        for group in opt.param_groups:
            group["lr"], group["weight_decay"] = 1.0, 0.0
        for p, gi in zip(self.params, torch.split(g, [p.numel() for p in self.params]),
                         strict=True):  # fmt: skip
            p.zero_()
            master(p).zero_()
            p.grad = gi.reshape(p.shape).to(p.dtype)
        if self.grad_clip > 0:
            clip_grad_norm_(self.params, self.grad_clip)
        opt.step()
        return -torch.cat([master(p).reshape(-1) for p in self.params]).double()


class Counterfactual:
    """The step after checkpoint ``snapshot`` of a run of ``recipe`` (plain-data recipe and
    config, as pool jobs pass them), replayed under R and under ``baseline`` at R's weights, and
    the errors of replays with some layers switched: ``err_r`` = |u(g_R) - u(g_B)| (update
    error), ``err_r_raw`` = |g_R - g_B|, ``loss`` = R's replayed loss."""

    def __init__(
        self, recipe: dict[str, Any], baseline: dict[str, Any], cfg_dict: dict[str, Any],
        snapshot: str,
    ) -> None:  # fmt: skip
        from fp8lab.recipe import Recipe

        cfg = LabConfig.from_dict(cfg_dict)
        corpus = load_corpus(cfg.data, cfg.model.block_size)
        self.recipe = Recipe.from_dict(recipe, where="recipe")
        base = Recipe.from_dict(baseline, where="baseline")
        state = load_state(snapshot)
        self.replay = StepReplay(self.recipe, cfg, corpus, state)
        b = StepReplay(base, cfg, corpus, state, baseline_weights=True)
        self.loss, g_r = self.replay.gradient()
        _, self.g_b = b.gradient()
        self.update = OptimizerUpdate(self.replay, cfg.train.grad_clip)
        self.u_b = self.update(self.g_b)
        self.err_r, self.err_r_raw = _err(self.update(g_r), self.u_b), _err(g_r, self.g_b)

    def errors(self, switched: dict[str, Any]) -> tuple[float, float]:
        """(update error, raw gradient error) of the replay with ``switched`` ({layer: its
        recipe}) in place of R's layers."""
        _, g = self.replay.gradient(switched)
        return _err(self.update(g), self.u_b), _err(g, self.g_b)


def screen_snapshot(
    recipe: dict[str, Any],
    baseline: dict[str, Any],
    cfg_dict: dict[str, Any],
    snapshot: str,
    layers: Sequence[str],
    precision: str,
    cells: Sequence[tuple[str, str]] = CELLS,
    events: Any = None,
) -> dict[str, Any]:
    """Screen every (layer, cell) at one checkpoint (see the module doc). Returns ``{"step",
    "loss", "err_r", "err_r_raw", "rows": [{layer, gemm, role, err, err_raw}]}`` (``err``:
    |u(g_c) - u(g_B)|, the optimizer update error; ``err_raw``: |g_c - g_B|)."""
    import time

    t0 = time.perf_counter()
    cf = Counterfactual(recipe, baseline, cfg_dict, snapshot)
    rec, r = cf.recipe, cf.replay
    todo = [(layer, g, ro) for layer in layers for g, ro in cells
            if rec.for_layer(layer).spec(g, ro) is not None
            and rec.for_layer(layer).gemm(g).high_precision is None]  # fmt: skip
    rows = []
    name = f"screen@{r.step}"
    for i, (layer, g, ro) in enumerate(todo):
        switched = {layer: with_cells_hp(rec.for_layer(layer), [(g, ro)], precision)}
        err, err_raw = cf.errors(switched)
        rows.append({"layer": layer, "gemm": g, "role": ro, "err": err, "err_raw": err_raw})
        if events is not None:
            events.put({"event": "replay", "recipe": name, "probe": name, "done": i + 1,
                        "total": len(todo)})  # fmt: skip
    # pairs: an operand in high precision in both GEMMs that consume it (one replay); a role
    # quantized in one GEMM only has its cell's error
    pairs = []
    for layer in layers:
        for ro in ROLE_GEMMS:
            gs = [g for g in ROLE_GEMMS[ro] if (layer, g, ro) in todo]
            if not gs:
                continue
            if len(gs) == 1:
                row = rows[todo.index((layer, gs[0], ro))]
                err, err_raw = row["err"], row["err_raw"]
            else:
                switched = {layer: with_cells_hp(rec.for_layer(layer), [(g, ro) for g in gs],
                                                 precision)}  # fmt: skip
                err, err_raw = cf.errors(switched)
            pairs.append({"layer": layer, "gemm": "+".join(gs), "role": ro, "err": err,
                          "err_raw": err_raw})  # fmt: skip
    return {"step": r.step, "loss": cf.loss, "err_r": cf.err_r, "err_r_raw": cf.err_r_raw,
            "rows": rows, "pairs": pairs, "seconds": time.perf_counter() - t0}  # fmt: skip


def pool_scores(
    screens: Iterable[dict[str, Any]], key: str = "err", rows: str = "rows"
) -> list[dict[str, Any]]:
    """Per cell (``rows="pairs"``: per operand pair, ``gemm`` e.g. ``"fprop+wgrad"``), the share of the error its switch removes, pooled over the screened
    checkpoints: ``sum_t (e_R,t - e_c,t) / sum_t e_R,t``, with the AdamW update error
    (``key="err"``) or the raw gradient error (``"err_raw"``). A checkpoint where R's error is
    not finite counts a cell as fully explaining it when its switch makes the error finite.
    Sorted by score, highest first."""
    num: dict[tuple[str, str, str], float] = {}
    den: dict[tuple[str, str, str], float] = {}
    for s in screens:
        e_r = s[{"err": "err_r", "err_raw": "err_r_raw"}[key]]
        for row in s.get(rows, ()):
            cell = (row["layer"], row["gemm"], row["role"])
            if math.isinf(e_r):
                n, d = (1.0 if math.isfinite(row[key]) else 0.0), 1.0
            else:
                n, d = e_r - min(row[key], 1e300), e_r
            num[cell] = num.get(cell, 0.0) + n
            den[cell] = den.get(cell, 0.0) + d
    rows = [
        {"layer": k[0], "gemm": k[1], "role": k[2],
         "score": (num[k] / den[k]) if den[k] > 0 else 0.0}
        for k in num
    ]  # fmt: skip
    rows.sort(key=lambda r: -r["score"])
    return rows


def aggregate(rows: Sequence[dict[str, Any]], by: Sequence[str]) -> list[tuple[tuple, float]]:
    """Sum of cell scores grouped by the keys ``by`` (e.g. ``("role",)``), highest first."""
    out: dict[tuple, float] = {}
    for r in rows:
        k = tuple(r[b] for b in by)
        out[k] = out.get(k, 0.0) + r["score"]
    return sorted(out.items(), key=lambda kv: -kv[1])


def snapshot_steps(steps: int, n: int) -> list[int]:
    """``n`` checkpoint steps spread over a run of ``steps`` (never 0 or the last step)."""
    pts = sorted({max(1, min(steps - 1, round(steps * (i + 1) / (n + 1)))) for i in range(n)})
    return pts
