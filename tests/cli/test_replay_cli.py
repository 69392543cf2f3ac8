"""``fp8lab compare --guard`` and ``fp8lab replay`` through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from tiny_lab import tiny_lab_toml

runner = CliRunner()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("run")
    (d / "t.txt").write_text("Now is the winter of our discontent made glorious summer. " * 60)
    (d / "cfg.toml").write_text(tiny_lab_toml(d / "t.txt", steps=12, batch_size=2, eval_every=6,
                                              checkpoint_every=4))  # fmt: skip
    (d / "guard.toml").write_text("checkpoint_every = 4\nkeep = 2\n")
    out = d / "out"
    r = runner.invoke(app, ["compare", "--config", str(d / "cfg.toml"), "--recipes",
                            "te-delayed", "--baseline", "te-delayed", "--out", str(out),
                            "--guard", "rollback", "--guard-config", str(d / "guard.toml"),
                            "--inject-nan-step", "6", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "te-delayed: guard rollback at step 6 (nonfinite loss) -> back to step 4" in r.stderr
    summary = json.loads(r.stdout)
    (ev,) = summary["recipes"]["te-delayed"]["guard_events"]
    assert ev["action"] == "rollback" and ev["step"] == 6 and ev["to_step"] == 4
    return out


def test_guarded_compare_keeps_checkpoints_and_logs_events(guarded):
    run = guarded / "runs" / "te-delayed"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000008.pt",
        "step-000012.pt",
    ]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert [len(r["guard_events"]) for r in recs] == [0] * 4 + [1] + [0] * 7


@pytest.mark.parametrize("step", [9, 2])  # from checkpoints/step-000008.pt; from step 0
def test_replay_is_bit_identical(guarded, step):
    r = runner.invoke(app, ["replay", str(guarded / "runs" / "te-delayed"), "--step", str(step),
                            "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["matches_record"] and res["record_step"] == step + 1
    assert res["torch_device"] == "cpu"  # --torch-device auto, resolved (no CUDA here)
    assert res["loss"] == res["record"]["train_loss"]
    assert res["start_step"] == (8 if step == 9 else 0)
    assert res["signals"]["headroom"] is not None and res["findings"] == []


def test_replay_text_output(guarded):
    r = runner.invoke(app, ["replay", str(guarded / "runs" / "te-delayed"), "--step", "10"])
    assert r.exit_code == 0, r.output
    assert "bit-identical to the record" in r.stdout and "staleness" in r.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--step", "99"], "steps 0..11"),
        (["--step", "1", "--json"], None),
    ],
)
def test_replay_bad_input(guarded, tmp_path, args, words):
    if words is None:  # a folder that is not a run
        r = runner.invoke(app, ["replay", str(tmp_path), *args])
        assert r.exit_code == 2 and "checkpoint" in r.output
        return
    r = runner.invoke(app, ["replay", str(guarded / "runs" / "te-delayed"), *args])
    assert r.exit_code == 2 and words in r.output


def test_guard_config_errors_are_exit_code_2(tmp_path):
    bad = tmp_path / "g.toml"
    bad.write_text("polcy = 'skip'\n")
    r = runner.invoke(app, ["compare", "--guard-config", str(bad), "--steps", "2",
                            "--out", str(tmp_path / "o")])  # fmt: skip
    assert r.exit_code == 2 and "g.toml" in r.output and "polcy" in r.output
    r = runner.invoke(app, ["compare", "--guard", "maybe", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--guard" in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("which", ["checkpoint.pt", "checkpoints/step-000008.pt"])
def test_replay_truncated_checkpoint_names_file_and_fix(guarded, tmp_path, which):
    import shutil

    run = tmp_path / "te-delayed"
    shutil.copytree(guarded / "runs" / "te-delayed", run)
    bad = run / which
    bad.write_bytes(bad.read_bytes()[:1000])
    r = runner.invoke(app, ["replay", str(run), "--step", "9"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert str(bad.name) in text and "truncated" in text and "Invalid argument" not in text
    assert "delete" in text  # the fix, as compare says it
