"""``--torch-device`` on compare, debug, replay, snr and inspect, and FP8LAB_KERNELS, through
the command line (issue 24): bad values and CUDA without CUDA exit 2 naming the problem; the
device is recorded (machine.torch_device in --json, config.json and run.json) and not part of
a run's identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fp8lab.gemm.fused_triton as fused_triton
import fp8lab.kernels as kernels
from fp8lab.cli import app
from tiny_lab import tiny_lab_toml

runner = CliRunner()
COMMANDS = ("compare", "debug", "replay", "snr", "inspect")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _args(cmd: str, tmp_path: Path) -> list[str]:
    """The smallest otherwise valid arguments of each command (the device fails first)."""
    weights = tmp_path / "w.pt"
    torch.save({"w": torch.ones(4, 4)}, weights)
    return {
        "compare": ["compare", "--out", str(tmp_path / "out"), "--steps", "1", "--quiet"],
        "debug": ["debug", "--recipe", "bf16", "--out", str(tmp_path / "dbg"), "--quiet"],
        "replay": ["replay", str(tmp_path), "--step", "0"],
        "snr": ["snr", "--length", "16", "--samples", "2"],
        "inspect": ["inspect", str(weights)],
    }[cmd]


def _bad(res, *words: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    for w in words:
        assert w in res.stderr, (w, res.stderr)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_names_the_flag(cmd: str) -> None:
    res = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--torch-device" in res.output


@NO_CUDA
@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("value", ["cuda", "cuda:7"])
def test_cuda_without_cuda_exits_2(cmd: str, value: str, tmp_path: Path) -> None:
    res = runner.invoke(app, [*_args(cmd, tmp_path), "--torch-device", value])
    _bad(res, f"--torch-device {value}: CUDA is not available")
    assert not (tmp_path / "out").exists() and not (tmp_path / "dbg").exists()


@pytest.mark.parametrize("cmd", COMMANDS)
def test_bad_value_exits_2(cmd: str, tmp_path: Path) -> None:
    res = runner.invoke(app, [*_args(cmd, tmp_path), "--torch-device", "gpu0"])
    _bad(res, "--torch-device 'gpu0': expected one of auto, cpu, cuda, cuda:N")


@pytest.mark.parametrize("cmd", ["formats", "cost", *COMMANDS])
def test_unknown_kernels_exit_2_from_every_command(cmd: str, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FP8LAB_KERNELS", "fastest")
    monkeypatch.setattr(kernels._KERNELS, "value", None)  # read the environment again
    args = {"formats": ["formats", "list"], "cost": ["cost"]}.get(cmd) or _args(cmd, tmp_path)
    res = runner.invoke(app, args)
    _bad(res, "FP8LAB_KERNELS", "'fastest'", "auto, numba, torch")


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize(
    ("var", "value", "message"),
    [("FP8LAB_DETERMINISTIC", "yes", "FP8LAB_DETERMINISTIC='yes': expected 0 or 1"),
     ("FP8LAB_TRITON", "off", "environment variable FP8LAB_TRITON: unknown Triton mode 'off'")],
)  # fmt: skip
def test_bad_deterministic_setting_exits_2(cmd, var, value, message, monkeypatch, tmp_path):
    monkeypatch.setenv(var, value)
    monkeypatch.setattr(fused_triton._TRITON, "value", None)  # read the environment again
    res = runner.invoke(app, [*_args(cmd, tmp_path), "--torch-device", "cpu"])
    _bad(res, message)
    assert not (tmp_path / "out").exists() and not (tmp_path / "dbg").exists()


def test_snr_runs_on_the_cpu_and_inspect_json_records_the_device(tmp_path: Path) -> None:
    res = runner.invoke(app, [*_args("snr", tmp_path), "--json", "--torch-device", "cpu"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # the schema of fp8lab snr --json, with the device
    assert set(data) == {"runs", "torch_device"} and data["torch_device"] == "cpu"
    res = runner.invoke(app, [*_args("inspect", tmp_path), "--json", "--torch-device", "auto"])
    assert res.exit_code == 0, res.output
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert json.loads(res.stdout)["torch_device"] == expected


def test_compare_records_the_device_outside_the_identity(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("Friends, Romans, countrymen, lend me your ears. " * 60)
    conf = tmp_path / "c.toml"
    conf.write_text(tiny_lab_toml(text, {}, steps=2, batch_size=2, eval_every=2,
                                  checkpoint_every=2))  # fmt: skip
    out = tmp_path / "out"
    args = ["compare", "--config", str(conf), "--out", str(out), "--quiet", "--recipes",
            "bf16", "--baseline", "bf16", "--jobs", "1", "--threads", "1", "--json"]  # fmt: skip
    res = runner.invoke(app, [*args, "--torch-device", "cpu"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["machine"]["torch_device"] == "cpu"
    assert summary["machine"]["kernels"] in ("auto", "numba", "torch")
    assert json.loads((out / "config.json").read_text())["machine"]["torch_device"] == "cpu"
    run = json.loads((out / "runs" / "bf16" / "run.json").read_text())
    assert run["machine"]["torch_device"] == "cpu" and "gpu" in run["machine"]
    # the same run under another --torch-device value continues (auto is cpu or cuda here)
    res = runner.invoke(app, [*args, "--torch-device", "auto"])
    assert res.exit_code == 0, res.output
