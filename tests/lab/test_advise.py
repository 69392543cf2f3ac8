"""`fp8lab.lab.advise`: the budget, the pricing per layer, the ladder, the per-layer mixes, the
Pareto front, the output directory, and (slow) the whole search on a tiny GPT: the chosen recipe
within the budget and no slower than the best single recipe within it, a rerun read back, a
budget below 2x the noise refused, Ray's advise.toml equal to the local pool's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fp8lab.lab import advise
from fp8lab.lab.advise import (
    AdviseProbe,
    ladder,
    mix_recipe,
    pareto_front,
    parse_budget,
    prepare_out,
    price_candidates,
    run_advise,
)
from fp8lab.lab.train import LabConfig
from fp8lab.recipe import Recipe, get_recipe
from fp8lab.recipe.layers import LAYER_KEYS
from tiny_lab import tiny_lab_toml

#: the tiny GPT's Linears priced at a width where FP8 and NVFP4 pay on a B200 (the tiny widths
#: are launch-bound: every low-precision recipe is predicted slower than bf16 there)
WIDE = ("model.d_model=2048", "model.d_ff=5632", "model.block_size=1024", "train.batch_size=8")


def _cfg(tmp_path: Path, steps: int = 20) -> LabConfig:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    p = tmp_path / "lab.toml"
    p.write_text(tiny_lab_toml(text, steps=steps, eval_every=steps // 2, batch_size=4))
    return LabConfig.from_toml(p)[0]


def _layer_numerics(r: Recipe) -> str:
    d = r.to_dict()
    return json.dumps({k: d.get(k) for k in LAYER_KEYS}, sort_keys=True)


@pytest.mark.no_arithmetic
@pytest.mark.parametrize(("text", "want"), [("0.5", 0.5), ("0.5%", 0.5), (" 2 % ", 2.0), (1, 1.0)])
def test_budget_takes_a_percentage_with_or_without_the_sign(text, want):
    assert parse_budget(text) == want


@pytest.mark.no_arithmetic
@pytest.mark.parametrize("text", ["0", "-1", "0%", "abc", "nan", "inf", "%"])
def test_budget_refuses_anything_but_a_positive_number(text):
    with pytest.raises(ValueError, match="--budget"):
        parse_budget(text)


def test_pricing_per_layer_adds_up_and_refuses_what_the_device_cannot_run(tmp_path):
    cfg = _cfg(tmp_path)
    p = price_candidates(cfg, ["nvfp4-te", "mxfp8", "te-current"], "b200", price_overrides=WIDE)
    assert p.layers == [n for n, _, _ in p.linears] and len(p.layers) == 5
    for c in ("nvfp4-te", "mxfp8", "te-current", "bf16"):  # the model is its Linears' sum
        assert math.isclose(sum(p.layer_ms[c].values()), p.ms[c], rel_tol=1e-9)
    assert p.ms["nvfp4-te"] < p.ms["mxfp8"] < p.ms["bf16"]
    assert ladder(p, ["nvfp4-te", "mxfp8", "te-current"])[0] == "nvfp4-te"
    assert ladder(p, ["nvfp4-te", "mxfp8", "te-current"])[-1] == "bf16"
    # the tiny widths themselves: nothing is predicted faster than bf16, the ladder is bf16 alone
    small = price_candidates(cfg, ["nvfp4-te", "mxfp8"], "b200")
    assert ladder(small, ["nvfp4-te", "mxfp8"]) == ["bf16"]
    with pytest.raises(ValueError, match="candidate 'mxfp8': h100 cannot run it"):
        price_candidates(cfg, ["mxfp8"], "h100")
    default = price_candidates(cfg, list(advise.DEFAULT_CANDIDATES), "h100", named=False)
    assert {"mxfp8", "nvfp4-te"} <= set(default.skipped) and "te-current" in default.ms
    with pytest.raises(ValueError, match="unknown candidate 'fp9'"):
        price_candidates(cfg, ["fp9"], "b200")
    with pytest.raises(ValueError, match="not the trained model's"):
        price_candidates(cfg, ["mxfp8"], "b200", price_overrides=("model.n_layer=2",))


@pytest.mark.no_arithmetic
def test_a_mix_runs_the_rung_on_its_layers_and_the_base_elsewhere():
    r = mix_recipe("nvfp4-te", "mxfp8", ["blocks.0.attn.qkv"], "m")
    assert _layer_numerics(r.for_layer("blocks.0.attn.qkv")) == _layer_numerics(get_recipe("mxfp8"))
    assert _layer_numerics(r.for_layer("blocks.0.mlp.up")) == _layer_numerics(
        get_recipe("nvfp4-te")
    )
    # the random Hadamard transform is NVFP4's: the FP8 layer drops it
    assert r.for_layer("blocks.0.attn.qkv").rht_gemms == "none"
    assert Recipe.from_toml(r.to_toml()).fingerprint() == r.fingerprint()
    assert mix_recipe("mxfp8", "bf16", [], "n").fingerprint() == get_recipe("mxfp8").fingerprint()


def _probe(name, speedup, gap, kind="single"):
    return AdviseProbe(name, kind, None, name, predicted_speedup=speedup, gap_pct=gap)


@pytest.mark.no_arithmetic
def test_the_pareto_front_keeps_exactly_the_probes_nothing_beats_on_both():
    ps = [_probe("bf16", 1.0, 0.0, "baseline"), _probe("a", 1.7, 0.3), _probe("b", 1.3, -0.01),
          _probe("c", 1.2, 0.1), _probe("d", 1.6, 0.02, "mix"), _probe("e", 1.6, 0.05, "mix"),
          _probe("f", None, 0.0), _probe("noise", 1.0, None, "noise")]  # fmt: skip
    front = pareto_front(ps)
    # brute force: p is on the front iff no q is >= on speedup and <= on gap, one strictly
    pts = [(p.name, p.predicted_speedup, p.gap_pct) for p in ps[:6]]
    want = {n for n, s, g in pts if not any((s2 >= s and g2 <= g and (s2 > s or g2 < g))
                                            for _, s2, g2 in pts)}  # fmt: skip
    assert set(front) == want == {"a", "d", "b"}
    assert front == ["a", "d", "b"]  # fastest first


@pytest.mark.no_arithmetic
def test_an_output_directory_not_made_by_advise_is_refused(tmp_path):
    from fp8lab.lab.data import load_corpus

    cfg = _cfg(tmp_path)
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not made by fp8lab advise"):
        prepare_out(theirs, cfg, corpus)
    assert (theirs / "notes.txt").read_text() == "mine" and len(list(theirs.iterdir())) == 1
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        prepare_out(tmp_path / "file", cfg, corpus)
    ours = tmp_path / "ours"
    prepare_out(ours, cfg, corpus)
    prepare_out(ours, cfg, corpus)  # continued
    (ours / "probes" / "bf16").mkdir(parents=True)
    with pytest.raises(ValueError, match="different configuration"):
        prepare_out(ours, cfg.replace_train(steps=7), corpus)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow  # ~6 tiny runs + one replay per layer (~30-60 s on 2 busy cores)
def test_advise_chooses_a_mix_within_budget_faster_than_any_single_and_resumes(tmp_path):
    cfg = _cfg(tmp_path)
    out = tmp_path / "out"
    events = []
    r = run_advise(cfg, "b200", "0.05%", out, candidates=["nvfp4-te", "mxfp8"], seeds=1,
                   threads=1, callback=events.append, price_overrides=WIDE)  # fmt: skip
    c, s = r.probes[r.chosen], r.probes[r.best_single]
    assert c.within_budget and c.gap_pct <= 0.05
    singles = [p for p in r.probes.values() if p.kind in ("single", "baseline") and p.within_budget]
    assert c.predicted_speedup >= max(p.predicted_speedup for p in singles) == s.predicted_speedup
    # the chosen gap is the paired gap of its runs, recomputed here from their run.json
    for i, seed in enumerate(r.seeds):
        fin = {n: json.loads((out / "probes" / n / f"seed{seed}" / "run.json").read_text())
               ["summary"]["final_val_loss"] for n in (c.name, "bf16")}  # fmt: skip
        assert c.gap_pct_seeds[i] == pytest.approx(100 * (fin[c.name] - fin["bf16"]) / fin["bf16"])
    # advise.toml reads back to the chosen numerics on every layer
    back = Recipe.load(out / "advise.toml")
    assert all(back.for_layer(x).fingerprint() == c.recipe.for_layer(x).fingerprint()
               for x in r.layers)  # fmt: skip
    doc = json.loads((out / "advise_result.json").read_text())
    assert doc["schema_version"] == 1 and doc["chosen"]["name"] == r.chosen
    assert {"megatron", "te", "recipe"} <= set(doc["files"])
    assert (out / "advise.megatron.yaml").exists() and (out / "advise.te.yaml").exists()
    trained = {e["recipe"] for e in events if e.get("event") == "start"}
    assert trained  # the first run trained its probes
    # a rerun reads every probe back: nothing is trained again, the same choice
    again = []
    r2 = run_advise(cfg, "b200", 0.05, out, candidates=["nvfp4-te", "mxfp8"], seeds=1, threads=1,
                    callback=again.append, price_overrides=WIDE)  # fmt: skip
    assert not [e for e in again if e.get("event") == "start"]
    assert r2.chosen == r.chosen and set(r2.probes) == set(r.probes)
    assert (out / "advise.toml").read_text() == Path(r.files["recipe"]).read_text()
    # a budget below 2x the noise: refused, from the runs already there
    noise = r.noise_pct
    with pytest.raises(ValueError, match="below 2x the run-to-run noise"):
        run_advise(cfg, "b200", noise * 1.5, out, candidates=["mxfp8"], seeds=1, threads=1,
                   price_overrides=WIDE)  # fmt: skip


@pytest.mark.slow  # the search twice, once on a local 2-CPU Ray instance (~1-2 min)
def test_ray_gives_the_same_advise_toml_as_the_local_pool(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from fp8lab.lab.pool import set_executor

    cfg = _cfg(tmp_path, steps=8)
    kw = {"candidates": ["nvfp4-te", "mxfp8"], "seeds": 1, "threads": 1, "price_overrides": WIDE}
    local = run_advise(cfg, "b200", 0.05, tmp_path / "local", **kw)  # here, one after another
    try:
        set_executor("ray")
        ray = run_advise(cfg, "b200", 0.05, tmp_path / "ray", jobs=2, **kw)
    finally:
        set_executor("local")
    assert (tmp_path / "ray" / "advise.toml").read_text() == (
        tmp_path / "local" / "advise.toml"
    ).read_text()
    assert {n: p.gap_pct for n, p in ray.probes.items()} == {
        n: p.gap_pct for n, p in local.probes.items()
    }
