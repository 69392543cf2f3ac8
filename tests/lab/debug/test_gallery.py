"""The gallery's scenarios at the cheapest stage that shows each failure (make test-slow): the
small GPT of benchmarks/study_gallery.py (2 layers of width 48) under the scenario's own
training settings, R against its published fix and the bf16 baseline; the full debugger runs
and their verdicts are the study's (docs/gallery.md). Only the scenarios that reproduce at this
size have one (fp16-loss-scale; the others' measurements: docs/gallery.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fp8lab.lab.data import load_corpus
from fp8lab.lab.debug.scenarios import plant, scenario_config
from fp8lab.lab.recipes import resolve_recipe
from fp8lab.lab.train import LabConfig, train_run

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))
from study_gallery import SMALL  # noqa: E402  (the study's size: one definition)


def _cfg(name: str, *sets: str) -> LabConfig:
    return scenario_config(LabConfig(), name).with_overrides([*SMALL, "train.seed=1337", *sets])


def _run(recipe, cfg: LabConfig, out: Path) -> dict:
    train_run(recipe, cfg, load_corpus(cfg.data, cfg.model.block_size), out)
    return json.loads((out / "run.json").read_text())["summary"]


def _gap(s: dict, base: dict) -> float:
    return 100.0 * (s["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]


def test_fp16_static_loss_scale_too_large_skips_steps_and_the_dynamic_scaler_fixes_it(tmp_path):
    """A static scale of 2^21: the gradients grow as the model learns, overflow fp16 and
    their steps are skipped (none at first); the dynamic scaler (fp16-amp) skips none and
    removes >= 70 % of the gap to bf16."""
    recipe, cfg, expect = plant("fp16-loss-scale", _cfg("fp16-loss-scale", "train.stats_every=0"))
    r = _run(recipe, cfg, tmp_path / "R")
    first = next(json.loads(ln) for ln in (tmp_path / "R" / "metrics.jsonl").open()
                 if json.loads(ln)["skipped"])  # fmt: skip
    assert r["skipped_steps"] >= 3 and first["step"] > 20
    fixed = _run(resolve_recipe(expect["fixed"]["recipe"]), cfg, tmp_path / "fixed")
    base = _run(resolve_recipe("bf16"), cfg, tmp_path / "bf16")
    assert fixed["skipped_steps"] == 0
    gap, fixed_gap = _gap(r, base), _gap(fixed, base)
    assert gap > 0.1 and fixed_gap < 0.3 * gap, (gap, fixed_gap)
