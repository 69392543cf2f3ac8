"""``fp8lab inspect``: safetensors / weights-only torch checkpoints, specs, recipes, JSON, and
clear errors for unreadable or unsafe files."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from fp8lab.cli import app

runner = CliRunner()


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(128, 256, generator=g) * 0.02,
        "grid": torch.tensor([[1.0, -0.5, 448.0, 0.0]]),  # exactly on the e4m3 grid
        "tiny": torch.full((4, 4), 2.0**-12),  # below e4m3's smallest subnormal
        "step": torch.tensor([7]),  # not floating: skipped
    }


def _inspect(*args: str):
    return runner.invoke(app, ["inspect", *args])


def test_safetensors_json_report(tmp_path, tensors) -> None:
    f = tmp_path / "m.safetensors"
    save_file(tensors, str(f))
    res = _inspect(str(f), "--spec", "e4m3", "--spec", "e4m3:1x128", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["specs"] == ["e4m3", "e4m3:1x128"]
    by = {t["name"]: t for t in rep["tensors"]}
    assert set(by) == {"w", "grid", "tiny"} and rep["skipped_non_float"] == ["step"]
    grid = by["grid"]["specs"]["e4m3"]
    assert grid["exact"] is True and grid["sqnr_db"] is None  # infinite SQNR, reported as exact
    assert by["tiny"]["specs"]["e4m3"]["underflow_pct"] == 100.0
    assert by["tiny"]["specs"]["e4m3:1x128"]["underflow_pct"] == 0.0
    w = by["w"]["specs"]["e4m3:1x128"]
    assert 25 < w["sqnr_db"] < 40 and w["cosine"] > 0.99
    assert by["w"]["shape"] == [128, 256] and by["w"]["dtype"] == "float32"


def test_torch_checkpoint_nested_with_recipe_and_table(tmp_path, tensors) -> None:
    f = tmp_path / "ckpt.pt"
    torch.save({"model": tensors, "meta": {"epoch": 3}}, f)
    res = _inspect(
        str(f), "--recipe", "deepseek-v3", "--tensors", "model.w", "--per-block", "64x64"
    )
    assert res.exit_code == 0, res.output
    assert "model.w" in res.stdout and "recipe:deepseek-v3" in res.stdout
    assert "model.grid" not in res.stdout  # filtered by --tensors
    res = _inspect(str(f), "--tensors", "model.grid")
    assert "inf (exact)" in res.stdout


class _Payload:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_arbitrary_pickle_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "evil.pt"
    torch.save({"x": _Payload()}, f)
    res = _inspect(str(f))
    assert res.exit_code == 2
    assert "weights_only=True" in res.stderr
    assert not (tmp_path / "PWNED").exists()
    g = tmp_path / "evil.pkl"
    g.write_bytes(pickle.dumps(_Payload()))
    assert _inspect(str(g)).exit_code == 2
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize(
    ("content", "name", "match"),
    [
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{ not json at all", "c.safetensors", "safetensors"),
        (b"just some bytes" * 5, "junk.bin", "cannot read"),
        (b"", "empty.pt", "cannot read"),
    ],
)
def test_corrupt_files_give_clear_errors(tmp_path, content, name, match) -> None:
    f = tmp_path / name
    f.write_bytes(content)
    res = _inspect(str(f))
    assert res.exit_code == 2
    assert match in res.stderr and "Traceback" not in res.output


def test_other_bad_input(tmp_path, tensors) -> None:
    assert "no such file" in _inspect(str(tmp_path / "missing.pt")).stderr
    f = tmp_path / "m.safetensors"
    save_file(tensors, str(f))
    assert "bad spec" in _inspect(str(f), "--spec", "e4m3:7y").stderr
    assert "unknown recipe" in _inspect(str(f), "--recipe", "nope").stderr
    assert "unquantized" in _inspect(str(f), "--recipe", "bf16").stderr
    assert "no floating-point tensors" in _inspect(str(f), "--tensors", "zzz*").stderr
    assert "MxK" in _inspect(str(f), "--per-block", "big").stderr


# ----------------------------------------------------------------------------- issue 11
def test_empty_float_tensor_is_float_and_nan_inf_are_counted(tmp_path) -> None:
    f = tmp_path / "m.safetensors"
    bad = torch.tensor([[1.0, float("nan"), float("inf"), -float("inf")]])
    save_file({"empty": torch.zeros(0, 4), "bad": bad, "step": torch.tensor([1])}, str(f))
    res = _inspect(str(f), "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["empty_float"] == ["empty"] and rep["skipped_non_float"] == ["step"]
    (t,) = rep["tensors"]
    assert (t["nan_count"], t["inf_count"]) == (1, 2)
    res = _inspect(str(f))
    assert "NaN 1, Inf 2" in res.stdout and "1 empty floating tensor(s)" in res.stdout


def test_table_fits_80_columns_and_folds_names(tmp_path, tensors) -> None:
    name = "model.layers.11.self_attention.query_key_value.weight"
    f = tmp_path / "m.safetensors"
    save_file({name: tensors["w"], "other": tensors["grid"]}, str(f))
    res = runner.invoke(app, ["inspect", str(f), "--per-block", "64x64"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in res.stdout  # nothing cut
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(name[:8]))
    folded = "".join(line.split()[0] for line in lines[start : start + 8] if line.split())
    assert name in folded
    for spec in ("e4m3:tensor", "e4m3:128x128", "mxfp8"):  # spec names may fold as well
        assert spec in "".join(res.stdout.split()) or spec[:6] in res.stdout


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_refused_pickle_says_what_fp8lab_reads(tmp_path) -> None:
    f = tmp_path / "evil.pt"
    torch.save({"x": _Payload()}, f)
    res = _inspect(str(f))
    assert res.exit_code == 2
    # PyTorch's advice (weights_only=False, "two options") names a way fp8lab does not offer
    assert "weights_only=False" not in res.stderr and "can still be loaded" not in res.stderr
    assert "fp8lab reads .safetensors files" in res.stderr and "refused" in res.stderr


def test_unreadable_files_are_clear_errors(tmp_path) -> None:
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    res = _inspect(str(empty))
    assert res.exit_code == 2 and "empty" in res.stderr
    assert "EOFError" not in res.stderr and "no detail" not in res.stderr
    res = _inspect("/proc/self/mem")
    assert res.exit_code == 2 and "/proc/self/mem" in res.stderr
    assert ("Traceback" not in res.output and res.exception is None) or isinstance(
        res.exception, SystemExit
    )
    res = _inspect("/dev/null")
    assert res.exit_code == 2 and "not a regular file" in res.stderr


def test_converted_model_checkpoint_operands_apart_and_fp8_state_skipped(tmp_path) -> None:
    # issue 22: inspect "quantized" norm weights and fp8lab's own FP8 state tensors
    from fp8lab.nn import convert

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32)
    )
    convert(model, "te-delayed", default_exclude=False)
    model(torch.randn(8, 64)).sum().backward()
    f = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), f)
    res = _inspect(str(f), "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    kinds = {t["name"]: t["kind"] for t in rep["tensors"]}
    assert kinds == {"0.weight": "gemm_operand", "0.bias": "other", "1.weight": "other",
                     "1.bias": "other", "2.weight": "gemm_operand", "2.bias": "other"}  # fmt: skip
    assert "0.fp8_weight_amax_history" in rep["skipped_fp8_state"]
    assert "2.fp8_recipe" in rep["skipped_fp8_state"]
    res = runner.invoke(app, ["inspect", str(f)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    flat = " ".join(res.stdout.split())
    assert "GEMM operands" in flat and "other tensors" in flat
    assert flat.index("GEMM operands") < flat.index("other tensors")
    assert "fp8_" not in res.stdout.split("skipped")[0]  # no state tensor in the tables
    assert "tensors of fp8lab's own state" in res.stdout


def test_plain_checkpoint_operands_are_tensors_of_two_or_more_dims(tmp_path, tensors) -> None:
    f = tmp_path / "m.safetensors"
    save_file({"fc.weight": tensors["w"], "norm.weight": torch.ones(16)}, str(f))
    res = _inspect(str(f), "--json")
    kinds = {t["name"]: t["kind"] for t in json.loads(res.stdout)["tensors"]}
    assert kinds == {"fc.weight": "gemm_operand", "norm.weight": "other"}
