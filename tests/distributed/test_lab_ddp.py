"""The training lab under torchrun (2 gloo ranks): rank-0 files, resume across rank counts, and
a rank killed with SIGKILL -> bounded failure naming it, then the rerun resumes to the same loss."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# multi-process torch.distributed (gloo) runs: make test-slow
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_lab_worker.py")
TEXT = "Now is the winter of our discontent made glorious summer by this sun. " * 40


def _run(run_dir: Path, ranks: int, *args: str, timeout: float = 120.0):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(WORKER), str(run_dir), *args]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(ranks), *cmd[1:]]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _final(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lab")
    (d / "t.txt").write_text(TEXT)
    return d


def test_kill_a_rank_then_resume_and_change_rank_count(base: Path) -> None:
    full = _run(base / "full", 2, "6")
    assert full.returncode == 0, full.stderr[-3000:]
    want = _final(full.stdout)
    metrics = [json.loads(x) for x in (base / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))  # rank 0 alone wrote them

    killed = _run(base / "killed", 2, "6", "4")
    assert killed.returncode != 0
    err = killed.stderr + killed.stdout
    assert "rank" in err and ("1 (local_rank: 1)" in err or "rank 1" in err), err[-3000:]
    shutil.copytree(base / "killed", base / "to_one")  # a 2-rank checkpoint (step 3)

    again = _run(base / "killed", 2, "6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _final(again.stdout)["final"] == want["final"]  # resumed bit for bit

    one = _run(base / "to_one", 1, "6")  # the 2-rank checkpoint resumes on one rank
    assert one.returncode == 0, one.stderr[-3000:]
    got = _final(one.stdout)
    assert got["steps"] == 6
    assert abs(got["final"] - want["final"]) < 1e-3 * abs(want["final"])

    assert _run(base / "to_two", 1, "6", "4").returncode != 0  # a 1-rank checkpoint (step 3)
    two = _run(base / "to_two", 2, "6")  # ... resumes on two ranks
    assert two.returncode == 0, two.stderr[-3000:]
    got = _final(two.stdout)
    assert got["steps"] == 6
    assert abs(got["final"] - want["final"]) < 1e-3 * abs(want["final"])


def test_fsdp_fp8_allgather_checkpoint_resumes_on_two_and_one_rank(base: Path) -> None:
    # FSDP2 with the FP8 all-gather (te-current): rank 0 writes a consolidated checkpoint (every
    # rank gathers the full tensors); a 2-rank rerun loads its rows back bit for bit, and the
    # same checkpoint resumes on one rank (plain model)
    full = _run(base / "f_full", 2, "6", "-1", "fsdp8")
    assert full.returncode == 0, full.stderr[-3000:]
    want = _final(full.stdout)
    metrics = [json.loads(x) for x in (base / "f_full" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["sharding"] == "fsdp-fp8" and metrics[0]["ranks"] == 2
    # 1-byte codes for the Linear weights: less than the fp32 reduce-scatter of all gradients
    assert 0 < metrics[0]["allgather_bytes"] < metrics[0]["grad_comm_bytes"]
    killed = _run(base / "f_killed", 2, "6", "4", "fsdp8")
    assert killed.returncode != 0
    shutil.copytree(base / "f_killed", base / "f_one")  # the step-3 checkpoint
    again = _run(base / "f_killed", 2, "6", "-1", "fsdp8")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _final(again.stdout)["final"] == want["final"]  # resumed bit for bit
    one = _run(base / "f_one", 1, "6", "-1", "fsdp8")
    assert one.returncode == 0, one.stderr[-3000:]
    got = _final(one.stdout)
    assert got["steps"] == 6
    # one rank scales activations with the global batch's amax, not each half's: close only
    assert abs(got["final"] - want["final"]) < 1e-3 * abs(want["final"])


def test_fsdp_fp8_allgather_te_delayed_resumes_bit_for_bit(base: Path) -> None:
    # te-delayed weights gathered as FP8 codes with the delayed scale: a run stopped at its
    # step-3 checkpoint and resumed (the delayed states restored on every rank, the gathers
    # taking their scale from them) ends at the uninterrupted run's loss bit for bit
    res = _run(base / "fsdp8d", 2, "6", "-1", "fsdp8d-resume")
    assert res.returncode == 0, res.stderr[-3000:]
    got = _final(res.stdout)
    assert got["sharding"] == "fsdp-fp8"
    assert got["steps"] == 6 and got["final"] == got["want"]


def test_amax_group_none_checkpoint_keeps_every_rank_scaling_state(base: Path) -> None:
    # with local amaxes the ranks' scales differ; the consolidated checkpoint carries each
    # rank's scaling state, so a resumed run continues bit for bit (with rank 0's state on
    # every rank it would not)
    res = _run(base / "none", 2, "6", "-1", "none-resume")
    assert res.returncode == 0, res.stderr[-3000:]
    got = _final(res.stdout)
    assert got["spread"] > 0  # the ranks' scales do differ
    assert got["steps"] == 6 and got["final"] == got["want"]
    state = torch.load(base / "none" / "checkpoint.pt", weights_only=True)
    assert len(state["rank_scaling"]) == 2 and state["rank_scaling"][0].keys() == (
        state["rank_scaling"][1].keys()
    )


def test_torchrun_compare_writes_on_rank_0(base: Path) -> None:
    out = base / "cmp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fp8lab", "compare", "--recipes", "te-delayed", "--baseline", "te-delayed",
           "--steps", "2", "--set", "model.d_model=32", "--set", "model.n_layer=1",
           "--set", "model.n_head=2", "--set", "model.d_ff=64", "--set", "model.block_size=16",
           "--set", "train.batch_size=4", "--set", "train.eval_batches=1",
           "--amax-group", "none", "--grad-comm", "fp8",
           "--quiet", "--json", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    js = json.loads(res.stdout.strip().splitlines()[-1])["recipes"]["te-delayed"]["distributed"]
    assert js["ranks"] == 2 and js["amax_group"] == "none" and js["grad_comm"] == "fp8"
    assert (
        js["grad_bytes_per_step_by_precision"]["fp8"]
        < js["grad_bytes_per_step_by_precision"]["fp32"]
        and 0 < js["grad_comm_rel_error"] < 0.5
        and js["max_scale_spread_binades"] > 0
    )
    assert (out / "report.html").exists()
    lines = (out / "runs" / "te-delayed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]  # one writer
    rec = json.loads(lines[-1])  # the flags reached train_run: per-step communication fields
    assert rec["ranks"] == 2 and rec["amax_group"] == "none" and rec["grad_comm"] == "fp8"
    assert 0 < rec["grad_comm_rel_error"] < 0.5 and rec["grad_comm_messages"] > 0
    assert rec["scale_spread_binades"] > 0  # local amaxes: the ranks' scales differ
    report = (out / "report.md").read_text()
    assert "## Distributed training" in report and "| none | ddp | fp8 |" in report


def test_jobs_under_torchrun_exit_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fp8lab.cli import app

    monkeypatch.setenv("WORLD_SIZE", "2")
    res = CliRunner().invoke(app, ["compare", "--jobs", "2", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "torchrun" in res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["compare", "debug"])
def test_batch_not_divisible_by_the_ranks_exits_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    from typer.testing import CliRunner

    from fp8lab.cli import app

    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun; refused before joining a group
    args = [command, "--set", "train.batch_size=5", "--out", str(tmp_path / "o")]
    args += ["--recipe", "te-current"] if command == "debug" else ["--recipes", "te-current"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "train.batch_size=5 (the global batch, split across the ranks) is not divisible by " \
        "the world size 2" in " ".join(res.output.split())  # fmt: skip
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fsdp"], "--fsdp needs 2 or more ranks: run under torchrun"),
        (["--grad-comm", "fp8"], "--grad-comm fp8 needs 2 or more ranks"),
        (["--amax-group", "none"], "--amax-group none needs 2 or more ranks"),
        (["--grad-comm", "fp16"], "unknown gradient communication 'fp16'"),
        (["--amax-group", "rank"], "--amax-group 'rank': expected one of world, none"),
        (["--fp8-allgather"], "--fp8-allgather needs --fsdp"),
        (["--fsdp", "--grad-comm", "bf16"], "with --fsdp the gradients are reduce-scattered"),
    ],
)
def test_distributed_flags_without_torchrun_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str], message: str
) -> None:
    from typer.testing import CliRunner

    from fp8lab.cli import app

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    res = CliRunner().invoke(app, ["compare", *flags, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output
    assert not (tmp_path / "o").exists()


def test_fp8_allgather_refuses_per_rank_delayed_weights_before_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # delayed-scaled weights are gathered as FP8 with --amax-group world (identical histories);
    # with none each rank would quantize its shard with its own scale: refused, naming the recipe
    from typer.testing import CliRunner

    from fp8lab.cli import app

    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun; refused before joining a group
    args = ["compare", "--fsdp", "--fp8-allgather", "--amax-group", "none", "--recipes",
            "te-current", "--baseline", "te-delayed", "--out", str(tmp_path / "o")]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "recipe 'te-delayed': delayed-scaled weights need --amax-group world" in " ".join(
        res.output.split()
    )
    assert not (tmp_path / "o").exists()
