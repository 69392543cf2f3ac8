import json
import math

import pytest
from typer.testing import CliRunner

from fp8lab.cli.compare import compare_and_report
from fp8lab.cost.memory import simulated_memory
from fp8lab.lab.compare import DEFAULT_RECIPES, compare
from fp8lab.lab.compare_summary import json_summary, summarize_comparison
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.recipes import NEGATIVE_CONTROL, resolve_recipe
from fp8lab.lab.train import ConfigMismatchError, LabConfig, TrainConfig


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar. " * 40)
    return str(f)


def tiny(text, **train):
    kw = dict(steps=6, batch_size=2, warmup_steps=1, eval_every=3, eval_batches=1,
              stats_every=3, checkpoint_every=3)  # fmt: skip
    kw.update(train)
    cfg = LabConfig(
        model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=128, d_ff=256),
        train=TrainConfig(**kw),
    )
    return cfg.with_overrides([f"data.paths=[{json.dumps(text)}]", "data.split_chunk=256"])


SCHEMA_KEYS = {
    "final_train_loss",
    "final_val_loss",
    "rel_gap_pct",
    "max_rel_gap_pct",
    "skipped_steps",
    "tokens_per_s",
    "diverged",
    "predicted_step_ms",
    "distributed",  # null on one process (fp8lab.distributed.ddp.comm_summary)
    "guard_events",  # [] without an anomaly guard (fp8lab.guard)
}


def test_default_recipes_have_five_plus_a_negative_control():
    assert NEGATIVE_CONTROL in DEFAULT_RECIPES and "bf16" in DEFAULT_RECIPES
    assert "fp32" in DEFAULT_RECIPES
    # at least 5 recipes besides the control, and the four FP8 families among them
    assert len([r for r in DEFAULT_RECIPES if r != NEGATIVE_CONTROL]) >= 5
    assert {"te-delayed", "deepseek-v3", "mxfp8", "hif8-delayed"} <= set(DEFAULT_RECIPES)
    for r in DEFAULT_RECIPES:
        resolve_recipe(r)


def test_compare_end_to_end(text, tmp_path):
    out = tmp_path / "out"
    names = ["te-current", "bf16", NEGATIVE_CONTROL]
    events = []
    # the lab trains and returns results; the CLI layer writes the report from them
    s = compare_and_report(tiny(text), names, "bf16", out, callback=events.append)
    js = json_summary(s)
    assert set(js) == {"schema_version", "baseline", "baseline_diverged", "device", "machine",
                       "noise", "recipes"}  # fmt: skip
    assert js["schema_version"] == 1 and js["baseline"] == "bf16"
    assert js["baseline_diverged"] is False
    assert list(js["recipes"]) == names
    for r in js["recipes"].values():
        assert set(r) == SCHEMA_KEYS
    assert js["recipes"]["bf16"]["rel_gap_pct"] == 0.0
    rc = js["recipes"]["te-current"]
    expected = 100 * (rc["final_val_loss"] - js["recipes"]["bf16"]["final_val_loss"])
    assert rc["rel_gap_pct"] == pytest.approx(expected / js["recipes"]["bf16"]["final_val_loss"])
    json.dumps(js, allow_nan=False)
    for f in ("report.html", "report.md", "summary.json", "metrics.csv", "config.json",
              "figures/loss.png", "figures/gap.png", "figures/grad_norm.png"):  # fmt: skip
        assert (out / f).stat().st_size > 0, f
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 * 6
    assert {e["event"] for e in events} == {"start", "step", "end"}
    md = (out / "report.md").read_text()
    assert "negative control" in md and "![Loss curves](figures/loss.png)" in md
    assert '"grad_output"' in md  # the recipes' full settings

    # rerun: finished runs are read back, nothing is retrained, same summary
    events.clear()
    s2 = compare(tiny(text), names, "bf16", out, callback=events.append)
    assert not [e for e in events if e["event"] == "step"]
    # the machine is where the command runs now (its thread count may differ), not a result
    assert {**json_summary(s2), "machine": None} == {**js, "machine": None}

    # a different configuration in the same --out is refused
    with pytest.raises(ConfigMismatchError, match=r"train\.lr"):
        compare(tiny(text, lr=1e-4), names, "bf16", out)


PAR_NAMES = ["bf16", "te-delayed"]


@pytest.fixture(scope="module")
def par_run(text, tmp_path_factory):
    """One comparison in 2 spawned worker processes, shared by the two tests that need one
    (each start of the pool costs seconds): (its folder, its result)."""
    out = tmp_path_factory.mktemp("par")
    return out, compare(tiny(text), PAR_NAMES, "bf16", out, jobs=2, threads=1)


def test_parallel_processes_equal_sequential(text, tmp_path, par_run):
    names = PAR_NAMES
    seq = compare(tiny(text), names, "bf16", tmp_path / "seq", jobs=1, threads=1)
    par = par_run[1]
    for n in names:
        a, b = seq["recipes"][n], par["recipes"][n]
        assert a["final_val_loss"] == b["final_val_loss"]
        assert a["final_train_loss"] == b["final_train_loss"]


def test_unknown_recipe_fails_before_training(text, tmp_path):
    with pytest.raises(ValueError, match=r"unknown recipe 'nope'.*te-delayed.*e4m3-unscaled"):
        compare(tiny(text), ["bf16", "nope"], "bf16", tmp_path)
    assert not (tmp_path / "runs").exists()


def test_diverged_recipe_is_null_never_nan(text, tmp_path):
    out = tmp_path
    cfg = tiny(text)
    compare(cfg, ["bf16"], "bf16", out)
    # a run that diverged: non-finite losses from step 2 on
    bad = out / "runs" / "te-current"
    bad.mkdir(parents=True)
    recs = [
        {"step": 1, "train_loss": 5.0, "grad_norm": 1.0, "skipped_steps": 0, "spike": False,
         "tokens": 32, "step_time_s": 0.1},
        {"step": 2, "train_loss": None, "grad_norm": None, "skipped_steps": 1, "spike": False,
         "tokens": 32, "step_time_s": 0.1, "val_loss": None},
    ]  # fmt: skip
    (bad / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"final_train_loss": None, "final_val_loss": None, "skipped_steps": 1,
               "spikes": 0, "tokens_per_s": 320.0, "step_time_ms": 100.0, "steps_done": 2,
               "diverged": True, "complete": False}  # fmt: skip
    (bad / "run.json").write_text(json.dumps({"summary": summary}))
    s = summarize_comparison(cfg, ["bf16", "te-current"], "bf16", out)
    r = json_summary(s)["recipes"]["te-current"]
    assert r["diverged"] is True
    assert r["final_val_loss"] is None and r["rel_gap_pct"] is None and r["max_rel_gap_pct"] is None
    text_json = json.dumps(json_summary(s), allow_nan=False)
    assert "NaN" not in text_json


def test_simulated_memory_orders_recipes():
    cfg = GPTConfig()
    mem = {n: simulated_memory(cfg, 8, resolve_recipe(n)) for n in ("fp32", "bf16", "deepseek-v3")}
    assert (
        mem["fp32"]["activations"] > mem["bf16"]["activations"] > mem["deepseek-v3"]["activations"]
    )
    assert mem["deepseek-v3"]["optimizer"] == mem["fp32"]["optimizer"] / 2  # bf16 moments
    for m in mem.values():
        assert m["total"] == pytest.approx(m["weights"] + m["optimizer"] + m["activations"])
        assert all(math.isfinite(v) and v > 0 for v in m.values())


# ----------------------------------------------------------------------------- the CLI
def test_cli_json(text, tmp_path):
    from fp8lab.cli import app

    conf = tmp_path / "c.toml"
    conf.write_text(
        f"[model]\nblock_size = 16\nn_layer = 1\nn_head = 2\nd_model = 128\nd_ff = 256\n"
        f"[data]\npaths = [{json.dumps(text)}]\nsplit_chunk = 256\n"
        "[train]\nsteps = 4\nbatch_size = 2\nwarmup_steps = 1\neval_every = 2\n"
        "eval_batches = 1\nstats_every = 0\n"
        '[compare]\nrecipes = ["bf16", "e4m3-unscaled-grads"]\n'
    )
    res = CliRunner().invoke(
        app, ["compare", "--config", str(conf), "--out", str(tmp_path / "o"), "--json"]
    )
    assert res.exit_code == 0, res.output
    js = json.loads(res.stdout)
    assert list(js["recipes"]) == ["bf16", "e4m3-unscaled-grads"]
    assert set(js["recipes"]["bf16"]) == SCHEMA_KEYS


def test_cli_bad_input(text, tmp_path):
    from fp8lab.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["compare", "--recipes", "bf16,nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown recipe 'nope'" in res.output
    res = runner.invoke(app, ["compare", "--set", "train.stepz=3", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "stepz" in res.output
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    res = runner.invoke(app, ["compare", "--data", str(empty), "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "empty" in res.output


# ----------------------------------------------------------------------------- issue 11 item 18
def _fake_run(out, name, final_val, final_train=2.0, diverged=False):
    """A finished run as an older fp8lab wrote it (its run.json may say diverged: false)."""
    d = out / "runs" / name
    d.mkdir(parents=True)
    recs = [{"step": 1, "train_loss": final_train, "grad_norm": 1.0, "skipped_steps": 0,
             "spike": False, "tokens": 32, "step_time_s": 0.1, "val_loss": final_val}]  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"final_train_loss": final_train, "final_val_loss": final_val, "skipped_steps": 0,
               "spikes": 0, "tokens_per_s": 320.0, "step_time_ms": 100.0, "steps_done": 1,
               "diverged": diverged, "complete": True}  # fmt: skip
    (d / "run.json").write_text(json.dumps({"summary": summary}))


def test_diverged_baseline_nulls_every_gap(text, tmp_path):
    # issue 11: bf16 at validation loss 3449 and nvfp4 at 2022, both "diverged": false, and
    # nvfp4 reported 41 % better than bf16
    _fake_run(tmp_path, "bf16", 3449.0)
    _fake_run(tmp_path, "nvfp4", 2022.0)
    _fake_run(tmp_path, "fp32", 2.3)
    s = summarize_comparison(tiny(text), ["bf16", "nvfp4", "fp32"], "bf16", tmp_path)
    js = json_summary(s)
    assert js["baseline_diverged"] is True
    assert js["recipes"]["bf16"]["diverged"] and js["recipes"]["nvfp4"]["diverged"]
    assert not js["recipes"]["fp32"]["diverged"]
    for r in js["recipes"].values():
        assert r["rel_gap_pct"] is None and r["max_rel_gap_pct"] is None


def test_healthy_baseline_keeps_gaps(text, tmp_path):
    _fake_run(tmp_path, "bf16", 2.0)
    _fake_run(tmp_path, "fp32", 2.2)
    js = json_summary(summarize_comparison(tiny(text), ["bf16", "fp32"], "bf16", tmp_path))
    assert js["baseline_diverged"] is False
    assert js["recipes"]["fp32"]["rel_gap_pct"] == pytest.approx(10.0)


def test_untrained_baseline_is_not_diverged(text, tmp_path):
    # `compare --steps 2`: bf16 at validation loss 5.5501, just above ln 256 = 5.545 (an
    # untrained model's near-uniform guess): not diverged, the gaps are reported
    _fake_run(tmp_path, "bf16", 5.5501)
    _fake_run(tmp_path, "fp32", 5.5490)
    _fake_run(tmp_path, "mxfp8", 6.8)  # 1.25 nats worse than a uniform guess: diverged
    js = json_summary(summarize_comparison(tiny(text), ["bf16", "fp32", "mxfp8"], "bf16", tmp_path))
    assert js["baseline_diverged"] is False and not js["recipes"]["fp32"]["diverged"]
    assert js["recipes"]["fp32"]["rel_gap_pct"] == pytest.approx(100 * (5.5490 / 5.5501 - 1))
    assert js["recipes"]["mxfp8"]["diverged"] and js["recipes"]["mxfp8"]["rel_gap_pct"] is None


def test_lab_imports_no_report_module():
    # issue 10: the lab returns results, the CLI writes reports (lab -> report -> cli, one way)
    import subprocess
    import sys

    code = (
        "import sys, fp8lab.lab.compare, fp8lab.lab.train\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('fp8lab.report', 'fp8lab.cli')))\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    import re
    from pathlib import Path

    import fp8lab.lab

    upward = re.compile(r"^\s*(from|import)\s+fp8lab\.(report|cli)\b", re.MULTILINE)
    for f in Path(fp8lab.lab.__file__).parent.glob("*.py"):
        assert not upward.search(f.read_text()), f  # also imports inside functions


# ----------------------------------------------------------------------------- issue 17
def _tiny_linears():
    """tiny(): 1 block, d_model 128, d_ff 256 (SwiGLU gate/up); the head stays high precision."""
    return [("blocks.0.attn.qkv", 128, 384), ("blocks.0.attn.proj", 128, 128),
            ("blocks.0.mlp.gate", 128, 256), ("blocks.0.mlp.up", 128, 256),
            ("blocks.0.mlp.down", 256, 128)]  # fmt: skip


def test_predicted_step_column_in_the_summary(text, tmp_path):
    from fp8lab.cost import predict_step_ms

    for n, v in (("bf16", 2.0), ("te-current", 2.01), ("fp32", 2.0), ("mxfp8", 2.02)):
        _fake_run(tmp_path, n, v)
    names = ["bf16", "te-current", "fp32", "mxfp8"]
    s = summarize_comparison(tiny(text), names, "bf16", tmp_path, device="h100")
    js = json_summary(s)
    assert js["device"] == "h100"
    rec = js["recipes"]
    # the model's converted Linears (hand-listed) on batch 2 x block 16 = 32 tokens
    for n in ("bf16", "te-current"):
        expected = predict_step_ms(n, "h100", linears=_tiny_linears(), tokens=32)
        assert rec[n]["predicted_step_ms"] == pytest.approx(expected, rel=1e-12)
        assert s["details"][n]["predicted_step"] == {"device": "h100", "ms": rec[n][
            "predicted_step_ms"], "reason": None}  # fmt: skip
    # not priceable: null in the JSON, the reason in the details, never a crash
    assert rec["fp32"]["predicted_step_ms"] is None and rec["mxfp8"]["predicted_step_ms"] is None
    assert "fp32 GEMMs" in s["details"]["fp32"]["predicted_step"]["reason"]
    assert "h100" in s["details"]["mxfp8"]["predicted_step"]["reason"]
    json.dumps(js, allow_nan=False)
    # Blackwell has MXFP8 tensor cores
    s2 = summarize_comparison(tiny(text), names, "bf16", tmp_path, device="b200")
    assert s2["device"] == "b200" and s2["recipes"]["mxfp8"]["predicted_step_ms"] > 0


def test_predicted_step_of_a_per_layer_recipe(text):
    from fp8lab.cost import predict_or_reason, predict_step_ms
    from fp8lab.recipe import Recipe, get_recipe

    if not hasattr(Recipe, "for_layer"):
        pytest.skip("per-layer recipes (Recipe.layers) not in this tree yet")
    from fp8lab.recipe import LayerRule

    lins = _tiny_linears()
    mixed = get_recipe("te-current").with_layers(LayerRule("blocks.0.mlp.*", base="bf16"))
    ms, why = predict_or_reason(mixed, "h100", linears=lins, tokens=32)
    attn, mlp = lins[:2], lins[2:]
    expected = predict_step_ms("te-current", "h100", linears=attn, tokens=32)
    expected += predict_step_ms("bf16", "h100", linears=mlp, tokens=32)
    assert why is None and ms == pytest.approx(expected, rel=1e-12)
    bad = get_recipe("te-current").with_layers(LayerRule("blocks.0.attn.proj", base="hif8-delayed"))
    ms, why = predict_or_reason(bad, "h100", linears=lins, tokens=32)
    assert ms is None and "blocks.0.attn.proj" in why and "HiF8" in why


def test_cli_predicted_step_column_and_bad_device(text, tmp_path):
    from fp8lab.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["compare", "--device", "a100", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "unknown device 'a100'" in res.output
    assert not (tmp_path / "x").exists()  # nothing written
    conf = tmp_path / "c.toml"
    conf.write_text(
        f"[model]\nblock_size = 16\nn_layer = 1\nn_head = 2\nd_model = 128\nd_ff = 256\n"
        f"[data]\npaths = [{json.dumps(text)}]\nsplit_chunk = 256\n"
        "[train]\nsteps = 2\nbatch_size = 2\nwarmup_steps = 1\neval_every = 2\n"
        "eval_batches = 1\nstats_every = 0\n"
    )
    out = tmp_path / "o"
    args = ["compare", "--config", str(conf), "--recipes", "bf16,fp32", "--device", "b200",
            "--out", str(out), "--quiet"]  # fmt: skip
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    js = json.loads(res.stdout)
    assert js["device"] == "b200"
    assert js["recipes"]["bf16"]["predicted_step_ms"] > 0
    assert js["recipes"]["fp32"]["predicted_step_ms"] is None
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    for doc in (md, page):
        assert "predicted step ms on b200" in doc and "n/a" in doc and "fp32 GEMMs" in doc
    res = runner.invoke(app, args)  # the terminal table (finished runs are read back)
    assert res.exit_code == 0 and "b200" in res.stdout


# ----------------------------------------------------------------------------- issue 22
def test_machine_is_recorded_and_a_run_resumes_on_another(text, tmp_path, monkeypatch):
    from fp8lab.lab import machine as machines

    out, names = tmp_path / "out", ["bf16", "te-delayed"]
    ref = compare(tiny(text), names, "bf16", tmp_path / "ref")
    here = machines.machine_info()
    js = json_summary(ref)
    assert js["machine"]["cpu"] == here["cpu"] and js["machine"]["torch"] == here["torch"]
    assert js["machine"]["cpu_capability"] == here["cpu_capability"]
    assert ref["details"]["bf16"]["machine"]["cpu"] == here["cpu"]

    def stop(ev):  # interrupted after the checkpoint at step 3
        if ev["event"] == "step" and ev["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compare(tiny(text), names, "bf16", out, callback=stop)
    other = {**here, "cpu": "Another CPU", "cpu_capability": "AVX2", "torch_threads": 7}
    monkeypatch.setattr(machines, "machine_info", lambda: dict(other))
    events = []
    s = compare(tiny(text), names, "bf16", out, callback=events.append)  # resumes, not refused
    starts = {e["recipe"]: e["step"] for e in events if e["event"] == "start"}
    assert starts["bf16"] == 3  # bf16 resumed from its checkpoint
    assert json.loads((out / "config.json").read_text())["machine"]["cpu"] == "Another CPU"
    assert s["machine"]["cpu"] == "Another CPU" and s["details"]["bf16"]["machine"] == other
    # same real machine underneath: the resumed runs equal the uninterrupted ones
    for n in names:
        assert s["recipes"][n]["final_val_loss"] == ref["recipes"][n]["final_val_loss"]


def test_rerun_of_a_finished_comparison_starts_no_process_and_builds_once(
    text, tmp_path, monkeypatch, par_run
):
    import fp8lab.lab.compare as lab_compare
    import fp8lab.lab.pool as lab_pool
    from fp8lab.lab import models

    names = PAR_NAMES
    done, first = par_run  # a finished comparison, run with jobs=2

    def no_process(*a, **k):
        raise AssertionError("a worker process was started for a finished run")

    monkeypatch.setattr(lab_pool.mp, "get_context", no_process)
    reads, real_read = [], lab_compare.read_metrics
    monkeypatch.setattr(lab_compare, "read_metrics", lambda d: reads.append(d) or real_read(d))
    events = []
    again = compare(tiny(text), names, "bf16", done, jobs=2, threads=1, callback=events.append)
    assert json_summary(again)["recipes"] == json_summary(first)["recipes"]
    assert [e["event"] for e in events] == ["start", "end"] * 2
    assert len(reads) == len(names)  # metrics.jsonl read once per recipe
    # a user's model is built once by the comparison itself (check + summary)
    src = tmp_path / "m.py"
    src.write_text(
        "from torch import nn\n"
        "def tiny():\n"
        "    return nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 32), nn.Linear(32, 256))\n"
    )
    cfg = tiny(text).with_overrides([f"model.factory={json.dumps(f'{src}:tiny')}"])
    compare(cfg, ["bf16"], "bf16", tmp_path / "user")
    builds, real_build = [], models.build
    monkeypatch.setattr(models, "build", lambda *a: builds.append(a) or real_build(*a))
    compare(cfg, ["bf16"], "bf16", tmp_path / "user")
    assert len(builds) == 1


def _fake_curve(out, name, vals):
    d = out / "runs" / name
    d.mkdir(parents=True)
    recs = [{"step": 10 * (i + 1), "train_loss": 2.0, "grad_norm": 1.0, "skipped_steps": 0,
             "spike": False, "tokens": 32, "step_time_s": 0.1, "val_loss": v}
            for i, v in enumerate(vals)]  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"final_train_loss": 2.0, "final_val_loss": vals[-1], "skipped_steps": 0,
               "spikes": 0, "tokens_per_s": 320.0, "step_time_ms": 100.0,
               "steps_done": 10 * len(vals), "diverged": False, "complete": True}  # fmt: skip
    (d / "run.json").write_text(json.dumps({"summary": summary}))


def test_noise_estimate_keeps_recipes_inside_it_unranked(text, tmp_path):
    # fp32 and bf16 differ only in rounding: their largest gap over the second half of the run
    # (steps 30, 40: 0.5 %; step 10's 3 % is early) is the noise; 2x it is not ranked
    _fake_curve(tmp_path, "bf16", [4.0, 3.0, 2.000, 2.0])
    _fake_curve(tmp_path, "fp32", [4.12, 3.0, 2.010, 1.996])
    _fake_curve(tmp_path, "mxfp8", [4.0, 3.0, 2.0, 2.018])  # +0.9 %: within 2 x 0.5 %
    _fake_curve(tmp_path, "hif8-delayed", [4.0, 3.0, 2.0, 1.99])  # -0.5 %
    _fake_curve(tmp_path, NEGATIVE_CONTROL, [4.0, 3.0, 2.5, 2.5])  # +25 %
    names = ["bf16", "fp32", "mxfp8", "hif8-delayed", NEGATIVE_CONTROL]
    s = summarize_comparison(tiny(text), names, "bf16", tmp_path)
    assert json_summary(s)["noise"]["rel_gap_pct"] == pytest.approx(0.5)
    assert json_summary(s)["noise"]["factor"] == 2.0
    within = {n: s["details"][n]["within_noise"] for n in names}
    assert within == {"bf16": None, "fp32": True, "mxfp8": True, "hif8-delayed": True,
                      NEGATIVE_CONTROL: False}  # fmt: skip
    # without the fp32/bf16 pair there is no estimate, and nothing is called within noise
    s2 = summarize_comparison(tiny(text), ["bf16", "mxfp8"], "bf16", tmp_path)
    assert s2["noise"]["rel_gap_pct"] is None and s2["details"]["mxfp8"]["within_noise"] is None


def test_noise_seeds_train_baseline_replicas_outside_the_table(text, tmp_path):
    names = ["fp32", "bf16"]
    cfg = tiny(text)
    events = []
    s = compare(cfg, names, "bf16", tmp_path, callback=events.append, noise_seeds=1)
    rep = f"bf16@seed{cfg.train.seed + 1}"
    run = json.loads((tmp_path / "runs" / rep / "run.json").read_text())
    assert run["lab"]["train"]["seed"] == cfg.train.seed + 1
    assert {e["recipe"] for e in events} == {"fp32", "bf16", rep}  # its own progress name
    assert list(s["recipes"]) == names and rep not in s["details"]
    assert rep not in (tmp_path / "metrics.csv").read_text()
    base = s["recipes"]["bf16"]["final_val_loss"]
    seeds = abs(100 * (run["summary"]["final_val_loss"] - base) / base)
    noise = json_summary(s)["noise"]
    assert noise["seeds_pct"] == pytest.approx(seeds) and noise["fp32_bf16_pct"] is not None
    assert noise["rel_gap_pct"] == max(noise["seeds_pct"], noise["fp32_bf16_pct"])
    assert "other seed" in noise["source"] and "fp32 vs bf16" in noise["source"]
    # rerun: the replica is finished too, nothing trains, the same estimate
    events.clear()
    again = compare(cfg, names, "bf16", tmp_path, callback=events.append, noise_seeds=1)
    assert not [e for e in events if e["event"] == "step"]
    assert json_summary(again)["noise"] == noise
    with pytest.raises(ValueError, match="noise_seeds"):
        compare(cfg, names, "bf16", tmp_path / "x", noise_seeds=-1)
    with pytest.raises(ValueError, match="seed replica"):
        compare(cfg, ["bf16", "bf16@seed3"], "bf16", tmp_path / "x")
