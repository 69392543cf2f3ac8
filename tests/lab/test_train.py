import json
import math
from pathlib import Path

import pytest
import torch

from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.inject import InjectConfig, Injector
from fp8lab.lab.train import (
    ConfigMismatchError,
    LabConfig,
    TrainConfig,
    summarize,
    train_run,
)

TINY = LabConfig(
    model=GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, d_ff=64),
    train=TrainConfig(
        steps=12, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=2,
        stats_every=0, checkpoint_every=5,
    ),
)  # fmt: skip


def _text_corpus(tmp_path_factory, line: str, repeats: int):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text(line * repeats)
    return load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _text_corpus(
        tmp_path_factory, "All the world's a stage, and all the men and women merely players. ", 60
    )


def _losses(records):
    return [(r["step"], r["train_loss"], r.get("val_loss"), r["grad_norm"]) for r in records]


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_loss_decreases_and_records_are_complete(corpus):
    r = train_run(None, TINY, corpus)
    recs = r.records
    assert [x["step"] for x in recs] == list(range(1, 13))
    assert recs[-1]["train_loss"] < recs[0]["train_loss"] - 0.5
    assert [x["step"] for x in recs if "val_loss" in x] == [4, 8, 12]
    s = r.summary
    assert s["complete"] and not s["diverged"] and s["skipped_steps"] == 0
    assert s["final_val_loss"] == recs[-1]["val_loss"]
    assert s["tokens_per_s"] > 0


def test_deterministic(corpus):
    a = train_run(None, TINY, corpus)
    b = train_run(None, TINY, corpus)
    assert _losses(a.records) == _losses(b.records)
    assert _same_state(a.model, b.model)


def test_resume_is_bit_identical(corpus, tmp_path):
    full = train_run(None, TINY, corpus, tmp_path / "full")
    part = tmp_path / "part"
    train_run(None, TINY, corpus, part, stop_after=7)  # checkpoint at 5 and at 7 (the stop)
    # simulate a crash after step 7's checkpoint but with a stray metrics line past it
    with open(part / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 8, "train_loss": 123.0}) + "\n")
    resumed = train_run(None, TINY, corpus, part)
    assert _losses(resumed.records) == _losses(full.records)
    assert _same_state(resumed.model, full.model)
    lines = (part / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 13))


def test_resume_refuses_other_config(corpus, tmp_path):
    train_run(None, TINY, corpus, tmp_path, stop_after=5)
    other = TINY.replace_train(lr=1e-3)
    with pytest.raises(ConfigMismatchError, match=r"train\.lr"):
        train_run(None, other, corpus, tmp_path)


def test_nonfinite_loss_is_skipped_then_diverges(corpus, monkeypatch):
    from fp8lab.lab.gpt import GPT

    cfg = TINY.replace_train(max_nonfinite_steps=3)
    forward = GPT.forward
    calls = []

    def nan_from_third_call(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        calls.append(1)
        if self.training and len(calls) > 2:
            loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", nan_from_third_call)
    r = train_run(None, cfg, corpus)
    recs = r.records
    assert recs[1]["train_loss"] is not None
    assert [x["skipped"] for x in recs[2:]] == [True] * 3
    assert r.summary["diverged"] and not r.summary["complete"]
    assert r.summary["final_train_loss"] is None
    assert all(torch.isfinite(p).all() for p in r.model.parameters())  # weights never NaN
    json.dumps(r.summary, allow_nan=False)  # never NaN in the summary


def test_grad_spike_is_exactly_undone_in_fp32(corpus):
    base = train_run(None, TINY, corpus)
    cfg = LabConfig(model=TINY.model, train=TINY.train, inject=InjectConfig(grad_spike_step=3))
    spiked = train_run(None, cfg, corpus)
    # power-of-two multiplier: without quantization the run is unchanged bit for bit
    assert _losses(spiked.records) == _losses(base.records)


def test_outlier_injection_scales_chosen_channels():
    from fp8lab.lab.gpt import GPT

    model = GPT(TINY.model)
    inj = Injector(model, InjectConfig(outlier_channels=2, outlier_scale=8.0, outlier_from_step=1))
    assert set(inj.layers) == {"blocks.0.mlp.down", "blocks.1.mlp.down"}
    seen = []
    model.blocks[0].mlp.down.register_forward_hook(lambda m, a, o: seen.append(a[0].clone()))
    x = torch.randint(0, 256, (1, 8))
    inj.set_step(0)
    model(x)
    inj.set_step(1)
    model(x)
    ratio = seen[1] / seen[0]
    gained = (ratio - 8.0).abs().amax(dim=(0, 1)) < 1e-4
    assert int(gained.sum()) == 2
    with pytest.raises(ValueError, match="matches no layer"):
        Injector(model, InjectConfig(outlier_channels=1, outlier_layers="nope*"))


def test_lr_schedule():
    tc = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert tc.lr_at(0) == pytest.approx(0.1) and tc.lr_at(9) == pytest.approx(1.0)
    assert tc.lr_at(99) == pytest.approx(0.1, abs=1e-3)
    assert all(tc.lr_at(i) >= tc.lr_at(i + 1) for i in range(10, 99))


def test_config_toml_roundtrip_and_errors(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nn_layer = 3\n[train]\nsteps = 7\n[compare]\nrecipes = ["bf16"]\n')
    cfg, rest = LabConfig.from_toml(f)
    assert (
        cfg.model.n_layer == 3
        and cfg.train.steps == 7
        and rest == {"compare": {"recipes": ["bf16"]}}
    )
    assert LabConfig.from_dict(cfg.to_dict()) == cfg
    f.write_text("[train]\nstepz = 7\n")
    with pytest.raises(ValueError, match="stepz"):
        LabConfig.from_toml(f)
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_summary_never_nan():
    from fp8lab.lab.train import LoopState

    recs = [{"step": 1, "train_loss": None, "val_loss": None, "skipped_steps": 1, "spike": False,
             "tokens": 8, "step_time_s": 0.1}]  # fmt: skip
    s = summarize(recs, 1, LoopState(step=1))
    assert s["diverged"] and s["final_val_loss"] is None
    assert not any(isinstance(v, float) and math.isnan(v) for v in s.values())


# ----------------------------------------------------------------------------- with recipes
QTINY = LabConfig(
    model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=128, d_ff=256),
    train=TrainConfig(
        steps=8, batch_size=2, lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=1,
        stats_every=4, checkpoint_every=3,
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def qcorpus(tmp_path_factory):
    return _text_corpus(
        tmp_path_factory,
        "Now is the winter of our discontent made glorious summer by this sun. ",
        40,
    )


@pytest.mark.parametrize("name", ["te-delayed", "hif8-delayed"])
def test_resume_bit_identical_with_delayed_scaling_state(qcorpus, tmp_path, name):
    import fp8lab

    recipe = fp8lab.get_recipe(name)
    full = train_run(recipe, QTINY, qcorpus, tmp_path / "full")
    train_run(recipe, QTINY, qcorpus, tmp_path / "part", stop_after=5)  # checkpoints at 3 and 5
    resumed = train_run(recipe, QTINY, qcorpus, tmp_path / "part")
    assert _losses(resumed.records) == _losses(full.records)
    assert _same_state(resumed.model, full.model)  # incl. amax histories and scales
    full_stats = (tmp_path / "full" / "stats.jsonl").read_text()
    assert (tmp_path / "part" / "stats.jsonl").read_text() == full_stats


def test_resume_under_another_recipe_is_refused(qcorpus, tmp_path):
    import fp8lab

    train_run(fp8lab.get_recipe("te-delayed"), QTINY, qcorpus, tmp_path, stop_after=3)
    with pytest.raises(ConfigMismatchError, match="recipe"):
        train_run(fp8lab.get_recipe("te-current"), QTINY, qcorpus, tmp_path)


def test_evaluation_does_not_change_training(qcorpus):
    import fp8lab

    recipe = fp8lab.get_recipe("te-delayed")
    every = train_run(recipe, QTINY.replace_train(eval_every=1, stats_every=1), qcorpus)
    rarely = train_run(recipe, QTINY.replace_train(eval_every=8, stats_every=0), qcorpus)
    assert [r["train_loss"] for r in every.records] == [r["train_loss"] for r in rarely.records]
    assert _same_state(every.model, rarely.model)


def test_operand_stats_are_recorded(qcorpus, tmp_path):
    import fp8lab

    train_run(fp8lab.get_recipe("te-current"), QTINY, qcorpus, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {4, 8}
    roles = {(r["layer"], r["role"]) for r in rows if r["step"] == 8}
    # 5 converted Linears of one block x 3 roles; lm_head stays high precision
    assert len(roles) == 15 and not any(layer == "lm_head" for layer, _ in roles)
    for r in rows:
        assert r["amax"] > 0 and 0 <= r["underflow_pct"] <= 100
        assert r["sqnr_db"] > 15  # E4M3 / E5M2 with current per-tensor scaling


def test_negative_control_gradients_underflow(qcorpus, tmp_path):
    from fp8lab.lab.recipes import NEGATIVE_CONTROL, resolve_recipe

    train_run(resolve_recipe(NEGATIVE_CONTROL), QTINY, qcorpus, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    grads = [r["underflow_pct"] for r in rows if r["role"] == "grad_output"]
    # unscaled E4M3 flushes a large share of the gradients to zero (te-current: ~0 %)
    assert grads and sum(grads) / len(grads) > 30 and max(grads) > 90


@pytest.mark.parametrize("name", ["te-delayed", "deepseek-v3"])
def test_stats_are_the_watch_records_of_the_consumed_operands(qcorpus, tmp_path, monkeypatch, name):
    """stats.jsonl holds `fp8lab.watch` records (`fp8lab.observe.sample`), equal to statistics
    computed independently from copies of the operands the GEMMs consumed on that step; every
    record is exact (saturation counted from the scaled values, also for block scales); and
    `fp8lab observe-report` reads the file."""
    from contextlib import contextmanager

    import fp8lab
    from fp8lab import stats
    from fp8lab import step as step_mod
    from fp8lab.formats import cast, get_format
    from fp8lab.nn import collect_operands
    from fp8lab.observe import FIELDS, read_records

    seen = {}
    orig = step_mod.sample_rows

    @contextmanager
    def spy(model, enabled, step):  # the lab's sampler plus an independent copy of the operands
        with orig(model, enabled, step) as rows:
            if not enabled:
                yield rows
                return
            copy = lambda hp, used: (hp.clone(), used.clone())  # noqa: E731
            with collect_operands(model, fn=copy) as ops:
                yield rows
            seen[step] = dict(ops)

    monkeypatch.setattr(step_mod, "sample_rows", spy)
    train_run(fp8lab.get_recipe(name), QTINY, qcorpus, tmp_path)
    rows = read_records(tmp_path / "stats.jsonl")
    assert {r["step"] for r in rows} == set(seen) == {4, 8}
    for step, ops in seen.items():  # one record per quantized (layer, GEMM, role), 6 per layer
        assert sorted((r["layer"], r["gemm"], r["role"]) for r in rows if r["step"] == step) == (
            sorted(k for k in ops if k[0] != "lm_head")
        )
    for r in rows:
        assert set(FIELDS) <= set(r) and r["exact"] is True, r
        hp, used = seen[r["step"]][(r["layer"], r["gemm"], r["role"])]
        assert r["amax"] == stats.amax(hp) and r["numel"] == hp.numel()
        assert r["underflow_pct"] == pytest.approx(stats.underflow_pct(hp, used), abs=1e-12)
        sq = stats.sqnr_db(hp, used)
        assert r["sqnr_db"] == pytest.approx(sq, rel=1e-9) if math.isfinite(sq) else True
        assert r["saturation_pct"] is not None and r["scale_min"] <= r["scale_max"]
        if r["scale"] is not None:  # one multiplier: the scaled values are cast(used / scale_inv)
            v = cast(used / torch.tensor(r["scale_inv"], dtype=torch.float32), r["format"])
            assert torch.equal(v * torch.tensor(r["scale_inv"], dtype=torch.float32), used)
            ref = stats.saturation_pct(hp, used, r["format"], v)
            assert r["saturation_pct"] == pytest.approx(ref, abs=1e-12)
            assert get_format(r["format"]).max >= float(v.abs().max())
    from typer.testing import CliRunner

    from fp8lab.cli import app

    res = CliRunner().invoke(app, ["observe-report", str(tmp_path / "stats.jsonl"), "--out",
                                   str(tmp_path / "stats.html"), "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["steps"] == [4, 8] and out["layers"] == sorted({r["layer"] for r in rows})
    assert (tmp_path / "stats.html").stat().st_size > 0


@pytest.mark.parametrize("name", ["deepseek-v3", "nvfp4"])
def test_recording_stats_does_not_change_training(qcorpus, tmp_path, name):
    """Stats on every step vs none: bit-identical losses, gradient norms and weights (incl.
    scaling state). nvfp4 rounds gradients stochastically: sampling must not draw from torch's
    generator, and its records are exact too (the GEMM's own quantized operand is measured)."""
    import fp8lab
    from fp8lab.observe import read_records

    recipe = fp8lab.get_recipe(name)
    cfg = QTINY.replace_train(steps=5, eval_every=5)
    every = train_run(recipe, cfg.replace_train(stats_every=1), qcorpus, tmp_path)
    never = train_run(recipe, cfg.replace_train(stats_every=0), qcorpus)
    assert _losses(every.records) == _losses(never.records)
    assert _same_state(every.model, never.model)
    rows = read_records(tmp_path / "stats.jsonl")
    assert {r["step"] for r in rows} == {1, 2, 3, 4, 5}
    assert all(r["exact"] and r["saturation_pct"] is not None for r in rows)


def test_grad_spike_leaves_delayed_scaling_stale(qcorpus, tmp_path):
    """One-step gradient spike: current scaling is untouched (the spike is undone exactly),
    TE delayed scaling keeps the spiked amax in its 1024-step history and flushes the gradients
    of every later step to zero."""
    import fp8lab

    spiked = LabConfig(
        model=QTINY.model,
        train=QTINY.train,
        inject=InjectConfig(grad_spike_step=2, grad_spike_scale=2.0**40),
    )
    cur = fp8lab.get_recipe("te-current")
    assert _losses(train_run(cur, spiked, qcorpus).records) == _losses(
        train_run(cur, QTINY, qcorpus).records
    )
    train_run(fp8lab.get_recipe("te-delayed"), spiked, qcorpus, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    after = [r for r in rows if r["role"] == "grad_output"]
    # flushed to zero, or all zero already: upstream of a flushed gradient (amax 0 leaves no
    # nonzero element to underflow; such operands are recorded too)
    assert after and all(r["underflow_pct"] > 99.0 or r["amax"] == 0.0 for r in after)
    assert any(r["underflow_pct"] > 99.0 for r in after if r["step"] == 8)


# ----------------------------------------------------------------------------- issue 11
def test_resume_refuses_a_changed_corpus(tmp_path_factory, tmp_path):
    line = "All the world's a stage, and all the men and women merely players. "
    a = _text_corpus(tmp_path_factory, line, 60)
    train_run(None, TINY, a, tmp_path, stop_after=5)
    b = _text_corpus(tmp_path_factory, line.replace("stage", "state"), 60)  # same size and name
    assert a.fingerprint != b.fingerprint and a.n_bytes == b.n_bytes
    with pytest.raises(ConfigMismatchError, match="training text changed"):
        train_run(None, TINY, b, tmp_path)
    train_run(None, TINY, a, tmp_path)  # the same text resumes


def test_checkpoint_from_before_the_corpus_hash_still_resumes(corpus, tmp_path):
    full = train_run(None, TINY, corpus)
    train_run(None, TINY, corpus, tmp_path, stop_after=5)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    del state["config"]["corpus"]  # as written by an older fp8lab
    torch.save(state, tmp_path / "checkpoint.pt")
    resumed = train_run(None, TINY, corpus, tmp_path)
    assert _losses(resumed.records) == _losses(full.records)


def test_config_keys_are_type_checked():
    with pytest.raises(ValueError, match=r"\[train\] lr: expected a number, got the string '1e-3'"):
        LabConfig.from_dict({"train": {"lr": "1e-3"}})
    with pytest.raises(ValueError, match=r"\[train\] steps: expected an integer"):
        LabConfig.from_dict({"train": {"steps": 4.5}})
    with pytest.raises(ValueError, match=r"\[train\] steps: expected an integer"):
        LabConfig.from_dict({"train": {"steps": True}})
    with pytest.raises(ValueError, match=r"\[data\] paths: expected a list of strings"):
        LabConfig.from_dict({"data": {"paths": [1, 2]}})
    with pytest.raises(ValueError, match=r"\[model\] must be a table"):
        LabConfig.from_dict({"model": 3})
    with pytest.raises(ValueError, match=r"--set: \[train\] lr"):
        LabConfig().with_overrides(["train.lr=abc"])
    # a single string is one path, never its characters
    assert LabConfig.from_dict({"data": {"paths": "file.txt"}}).data.paths == ("file.txt",)
    assert LabConfig().with_overrides(["data.paths=file.txt"]).data.paths == ("file.txt",)
    assert LabConfig.from_dict({"train": {"lr": 1}}).train.lr == 1.0  # an int is a number


def test_config_toml_text_roundtrips(tmp_path):
    cfg = TINY.with_overrides(['data.paths=["a b.txt", "c\\"d.txt"]', "inject.grad_spike_step=3"])
    f = tmp_path / "c.toml"
    f.write_text(cfg.to_toml())
    assert LabConfig.from_toml(f) == (cfg, {})


def test_grad_spike_beyond_the_run_is_refused_before_writing(corpus, tmp_path):
    cfg = TINY.with_overrides([f"inject.grad_spike_step={TINY.train.steps}"])
    with pytest.raises(ValueError, match="grad_spike_step=12 is beyond the run"):
        train_run(None, cfg, corpus, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    TINY.with_overrides(["inject.grad_spike_step=11"]).check()  # the last step is fine


def test_tokens_per_s_leaves_out_warm_up():
    from fp8lab.lab.train import LoopState

    times = [9.0, 0.1, 0.1, 0.2, 0.1, 3.0, 0.1]  # compile at step 1; a resume's compile at 6
    recs = [{"step": i + 1, "train_loss": 2.0, "skipped_steps": 0, "spike": False,
             "tokens": 100, "step_time_s": t} for i, t in enumerate(times)]  # fmt: skip
    recs[-1]["val_loss"] = 2.0
    s = summarize(recs, len(recs), LoopState(step=len(recs)))
    assert s["tokens_per_s"] == pytest.approx(500 / 0.6)
    assert s["step_time_ms"] == pytest.approx(120.0)


# ln 256 = 5.545 plus the 0.5-nat margin (an untrained model sits just above ln V) = 6.045
@pytest.mark.parametrize(("val", "diverged"),
                         [(5.5, False), (5.6, False), (6.0, False), (6.1, True), (3449.0, True)])  # fmt: skip
def test_validation_loss_worse_than_uniform_is_divergence(val, diverged):
    from fp8lab.lab.train import LoopState

    recs = [{"step": 1, "train_loss": 5.0, "val_loss": val, "skipped_steps": 0, "spike": False,
             "tokens": 8, "step_time_s": 0.1}]  # fmt: skip
    s = summarize(recs, 1, LoopState(step=1), vocab_size=256)  # ln 256 = 5.545
    assert s["diverged"] is diverged and s["final_val_loss"] == val


def test_full_disk_while_checkpointing_says_no_space_left(corpus, tmp_path, monkeypatch):
    import errno

    def full(obj, f, *a, **k):  # torch's zip writer on a full disk
        Path(f).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="no space left") as info:
        train_run(None, TINY, corpus, tmp_path)
    assert info.value.errno == errno.ENOSPC
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "checkpoint.pt").exists()


def test_corrupt_checkpoint_is_named_with_the_way_out(corpus, tmp_path):
    from fp8lab.lab.train import CheckpointError

    train_run(None, TINY, corpus, tmp_path, stop_after=5)
    (tmp_path / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt: corrupt or truncated.*delete"):
        train_run(None, TINY, corpus, tmp_path)
