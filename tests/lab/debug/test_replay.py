"""The attribution replay is bit-identical to the training step it replays."""

import json
from dataclasses import replace

import pytest
import torch

from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.debug import search
from fp8lab.lab.debug.attribution import StepReplay, pool_scores, screen_snapshot
from fp8lab.lab.debug.runner import ProbeSpec, load_state, run_probe, snapshot_path
from fp8lab.lab.debug.variants import with_cells_hp
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.train import LabConfig, TrainConfig, read_metrics
from fp8lab.recipe import get_recipe

TINY = LabConfig(
    model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
    train=TrainConfig(steps=8, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=4,
                      eval_batches=1, stats_every=0, checkpoint_every=100),
)  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("All the world's a stage, and all the men and women merely players. " * 40)
    return str(f)


def _cfg(text, **inject):
    cfg = replace(TINY, data=DataConfig(paths=(text,), split_chunk=256))
    return replace(cfg, inject=replace(cfg.inject, **inject)) if inject else cfg


@pytest.mark.parametrize(
    ("recipe", "inject"),
    [("te-delayed", {"grad_spike_step": 3, "grad_spike_scale": 1024.0}),
     ("fp16-amp", {}),  # dynamic loss scaling
     ("mxfp8", {"outlier_channels": 2, "outlier_layers": "blocks.0.mlp.down"})],
)  # fmt: skip
def test_replay_reproduces_the_recorded_step_bit_for_bit(tmp_path, text, recipe, inject):
    cfg = _cfg(text, **inject)
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    rec = get_recipe(recipe)
    spec = ProbeSpec("r", rec.to_dict(), snapshots=(3, 4))
    run_probe(spec, cfg.to_dict(), str(tmp_path / "r"))
    recs = {r["step"]: r for r in read_metrics(tmp_path / "r")}
    state = load_state(snapshot_path(tmp_path / "r", 3))
    replay = StepReplay(rec, cfg, corpus, state)
    assert replay.step == 3
    loss, g = replay.gradient()
    # the metrics hold float(loss) exactly (JSON round-trips a double)
    assert loss == recs[4]["train_loss"]
    full = replay.full_step()
    assert full["loss"] == recs[4]["train_loss"]
    assert full["grad_norm"] == recs[4]["grad_norm"]
    after = load_state(snapshot_path(tmp_path / "r", 4))["model"]
    assert full["model"].keys() == after.keys()
    assert all(torch.equal(full["model"][k], after[k]) for k in after)
    if rec.fprop.high_precision:  # every GEMM already in high precision: no cell to switch
        return
    # a counterfactual replay leaves the next plain replay untouched (state reloaded)
    layer = "blocks.0.mlp.down"
    switched = {layer: with_cells_hp(rec.for_layer(layer), [("fprop", "input")], "bf16")}
    _, g_c = replay.gradient(switched)
    assert not torch.equal(g_c, g)
    _, g_again = replay.gradient()
    assert torch.equal(g_again, g)


def test_screening_scores_a_cell_that_explains_everything(tmp_path, text):
    """A recipe that differs from the baseline in one cell only: switching that cell removes
    the whole gradient error (score 1), every other cell next to nothing."""
    cfg = _cfg(text)
    layer = "blocks.0.mlp.up"
    base = get_recipe("bf16")
    # bf16 everywhere except one layer's dgrad grad_output in unscaled E4M3
    from fp8lab.qtensor import QuantSpec
    from fp8lab.recipe import LayerRule

    hp = {
        "fprop": {"high_precision_roles": {"input": "bf16", "weight": "bf16"}},
        "dgrad": {"high_precision_roles": {"weight": "bf16"}},
        "wgrad": {"high_precision_roles": {"grad_output": "bf16", "input": "bf16"}},
    }
    rule = LayerRule(match=layer, base="te-current", changes={
        **hp, "grad_output": QuantSpec(format="e4m3", scaling=1.0).to_dict()})  # fmt: skip
    rec = base.with_layers(rule).replace(name="one-cell")
    run_probe(ProbeSpec("r", rec.to_dict(), snapshots=(4,)), cfg.to_dict(), str(tmp_path / "r"))
    s = screen_snapshot(rec.to_dict(), base.to_dict(), cfg.to_dict(),
                        str(snapshot_path(tmp_path / "r", 4)), [layer], "bf16")  # fmt: skip
    assert s["err_r"] > 0
    rows = pool_scores([s])
    assert (rows[0]["layer"], rows[0]["gemm"], rows[0]["role"]) == (layer, "dgrad", "grad_output")
    assert rows[0]["score"] == pytest.approx(1.0)
    # the pair (grad_output in high precision in dgrad and wgrad) removes the same error
    pair = [p for p in pool_scores([s], rows="pairs") if p["role"] == "grad_output"]
    assert [p["score"] for p in pair] == [pytest.approx(1.0)]
    json.dumps(rows)  # plain data


def test_optimizer_update_is_the_step_the_optimizer_takes(tmp_path, text):
    """The screening's error space: the optimizer's own update of the replayed gradient, times
    the learning rate, is the weight change of the recorded step (after weight decay)."""
    from fp8lab.lab.debug.attribution import OptimizerUpdate

    cfg = _cfg(text)
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    rec = get_recipe("te-delayed")
    run_probe(ProbeSpec("r", rec.to_dict(), snapshots=(3, 4)), cfg.to_dict(), str(tmp_path / "r"))
    state = load_state(snapshot_path(tmp_path / "r", 3))
    after = load_state(snapshot_path(tmp_path / "r", 4))["model"]
    replay = StepReplay(rec, cfg, corpus, state)
    _, g = replay.gradient()
    u = OptimizerUpdate(replay, cfg.train.grad_clip)(g)
    lr = cfg.train.lr_at(replay.step)
    names = {id(p): n for n, p in replay.model.named_parameters()}
    before = state["model"]
    wd = {id(p): grp["weight_decay"] for grp in replay.opt.param_groups for p in grp["params"]}
    i = 0
    for p in replay.params:
        n = names[id(p)]
        k = p.numel()
        want = (after[n].double() - before[n].double() * (1 - lr * wd[id(p)])).reshape(-1)
        step = -lr * u[i : i + k]
        # the weights are float32: the recorded change carries their rounding
        tol = 4 * torch.finfo(torch.float32).eps * float(after[n].abs().max())
        assert torch.allclose(step, want, rtol=1e-4, atol=tol), n
        i += k
    assert i == u.numel() and float(u.abs().max()) > 0.1  # Adam steps are O(1) in u


def test_outliers_with_zero_weights_change_only_the_quantized_run(tmp_path, text):
    """outlier_weights="zero": the weights reading the outlier channels stay zero, so the
    unquantized model does not depend on outlier_scale (bit for bit), while a per-tensor FP8
    recipe, whose one input scale the outliers set, does."""
    layer = "blocks.0.mlp.down"

    def run(recipe, scale):
        cfg = _cfg(text, outlier_channels=2, outlier_layers=layer, outlier_scale=scale,
                   outlier_weights="zero")  # fmt: skip
        d = tmp_path / f"{recipe}-{scale:g}"
        run_probe(ProbeSpec("r", get_recipe(recipe).to_dict()), cfg.to_dict(), str(d))
        w = load_state(d / "checkpoint.pt")["model"][f"{layer}.weight"]
        return [r["train_loss"] for r in read_metrics(d) if "train_loss" in r], w

    from fp8lab.lab.inject import outlier_channel_index

    idx = outlier_channel_index(TINY.model.d_ff, 2, layer)
    l_lo, w = run("fp32", 10.0)
    l_hi, _ = run("fp32", 1e5)
    assert l_lo == l_hi
    assert bool((w[:, idx] == 0).all()) and bool((w.abs().sum(0) > 0).sum() >= w.shape[1] - 2)
    d_lo, _ = run("te-delayed", 10.0)
    d_hi, _ = run("te-delayed", 1e5)
    assert d_lo != d_hi
    with pytest.raises(ValueError, match="outlier_weights"):
        _cfg(text, outlier_weights="frozen")


def test_outlier_channels_screening_puts_the_planted_cell_first(tmp_path, text):
    """The CI-sized part of the outlier-channels scenario (a full debug run needs the default
    model, README): planted on the tiny GPT, the one-step screening at a checkpoint of R ranks
    the planted layer's input first, far above every other cell."""
    from fp8lab.lab.debug.scenarios import plant
    from fp8lab.lab.debug.variants import converted_layers
    from fp8lab.lab.parts import build_model

    rec, cfg, expect = plant("outlier-channels", _cfg(text))
    (layer,) = expect["layers"]
    assert layer == "blocks.0.attn.qkv" and cfg.inject.outlier_weights == "zero"
    layers = converted_layers(build_model(cfg.model, rec, cfg.train.seed))
    run_probe(ProbeSpec("r", rec.to_dict(), snapshots=(6,)), cfg.to_dict(), str(tmp_path / "r"))
    s = screen_snapshot(rec.to_dict(), get_recipe("bf16").to_dict(), cfg.to_dict(),
                        str(snapshot_path(tmp_path / "r", 6)), layers, "bf16")  # fmt: skip
    rows = pool_scores([s])
    assert (rows[0]["layer"], rows[0]["role"]) == (layer, "input"), rows[:3]
    others = [r["score"] for r in rows if (r["layer"], r["role"]) != (layer, "input")]
    assert rows[0]["score"] > 5 * max(others), rows[:4]
    # the pair replay (the input in high precision in fprop and wgrad at once) and the layer
    # order of group testing put the planted layer first too
    pairs = pool_scores([s], rows="pairs")
    assert {(p["layer"], p["role"]) for p in pairs} == {
        (x, r) for x in layers for r in ("input", "weight", "grad_output")}  # fmt: skip
    assert (pairs[0]["layer"], pairs[0]["gemm"], pairs[0]["role"]) == (layer, "fprop+wgrad",
                                                                       "input"), pairs[:3]  # fmt: skip
    assert search.layer_order(layers, rows, "input", "fprop", pairs)[0] == layer
