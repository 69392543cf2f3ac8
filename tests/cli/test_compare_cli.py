"""``fp8lab compare`` through the command line: exit codes and messages for bad input, nothing
written before everything is checked, resume safety, config files, help, progress, divergence."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from tiny_lab import tiny_lab_toml

runner = CliRunner()


@pytest.fixture
def text(tmp_path) -> Path:
    f = tmp_path / "text.txt"
    f.write_text("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar. " * 40)
    return f


# width 128: the tiny GPT of the other CLI tests is too narrow for 128-wide blocks
MODEL = {"d_model": 128, "d_ff": 256}
TRAIN = {"steps": 4, "batch_size": 2, "eval_every": 2, "checkpoint_every": 2}


def _config(tmp_path: Path, text: Path, extra: str = "", name: str = "c.toml") -> Path:
    conf = tmp_path / name
    conf.write_text(tiny_lab_toml(text, MODEL, **TRAIN) + extra)
    return conf


def _run(*args: str, **kw):
    return runner.invoke(app, ["compare", *args], **kw)


def _tiny_run(tmp_path, text, *args: str, out: Path | None = None, extra: str = ""):
    out = out or tmp_path / "out"
    conf = _config(tmp_path, text, extra)
    return _run("--config", str(conf), "--out", str(out), "--quiet", *args), out


def _bad(res, *words: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    for w in words:
        assert w in res.stderr, (w, res.stderr)


# ----------------------------------------------------------------------------- issue 11 item 12
def test_changed_corpus_is_refused_on_rerun(tmp_path, text):
    res, out = _tiny_run(tmp_path, text, "--recipes", "bf16", "--json")
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert len(cfg["corpus"]["sha256"]) == 64
    text.write_text(text.read_text().replace("Caesar", "Brutus"))  # same path, other content
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16", "--json")
    _bad(res, "training text changed")


# ----------------------------------------------------------------------------- item 13
@pytest.mark.parametrize(
    ("args", "extra", "words"),
    [
        (("--data", "MISSING"), "", ("missing.txt", "no such file")),
        (("--data", "SHORT"), "", ("too small",)),
        (("--outlier-channels", "1", "--outlier-layers", "nope*"), "", ("matches no layer",)),
    ],
)
def test_failed_start_writes_nothing_and_the_fix_reuses_the_dir(tmp_path, text, args, extra, words):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    args = tuple(
        {"MISSING": str(tmp_path / "missing.txt"), "SHORT": str(short)}.get(a, a) for a in args
    )
    res, out = _tiny_run(tmp_path, text, "--recipes", "bf16", *args)
    _bad(res, *words)
    assert not out.exists()  # nothing written, not even config.json
    res, out = _tiny_run(tmp_path, text, "--recipes", "bf16", "--json")
    assert res.exit_code == 0, res.output


def test_dir_holding_no_run_is_reused_under_another_config(tmp_path, text):
    out = tmp_path / "out"
    out.mkdir()
    # config.json of a comparison that never trained (e.g. made by an older fp8lab's failed start)
    (out / "config.json").write_text(json.dumps({"lab": {"train": {"lr": 5.0}}, "baseline": "x"}))
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16", "--json", out=out)
    assert res.exit_code == 0, res.output
    # once it holds a run, another configuration is refused
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16", "--set", "train.lr=2e-3", out=out)
    _bad(res, "different configuration", "train.lr")


# ----------------------------------------------------------------------------- item 14
def test_data_paths_that_are_not_text_files(tmp_path, text):
    res, _ = _tiny_run(tmp_path, text, "--data", str(tmp_path / "nope.txt"))
    _bad(res, "nope.txt: no such file")
    res, _ = _tiny_run(tmp_path, text, "--data", "/dev/null")
    _bad(res, "/dev/null: not a regular file")


def test_unwritable_out(tmp_path, text):
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16", out=Path("/proc/fp8lab-x"))
    _bad(res, "/proc/fp8lab-x")
    f = tmp_path / "file.txt"
    f.write_text("mine")
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16", out=f)
    _bad(res, "not a directory")
    assert f.read_text() == "mine"


def test_disk_full_says_no_space_left(tmp_path, text, monkeypatch):
    import torch

    def full(*a, **k):  # what torch's zip writer raises when the disk fills up
        raise RuntimeError(
            "[enforce fail at inline_container.cc:664] . unexpected pos 4416 vs 4304"
        )

    monkeypatch.setattr(torch, "save", full)
    res, out = _tiny_run(tmp_path, text, "--recipes", "bf16")
    _bad(res, "no space left", "checkpoint.pt")
    assert not list(out.rglob("*.tmp"))  # the half-written temporary file is removed


def test_corrupt_checkpoint_names_file_and_how_to_restart(tmp_path, text):
    res, out = _tiny_run(tmp_path, text, "--recipes", "bf16", "--json")
    assert res.exit_code == 0, res.output
    ckpt = out / "runs" / "bf16" / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])  # truncated
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16", "--json")
    _bad(res, str(ckpt), "corrupt or truncated", "'bf16'", "delete its folder")


def test_ctrl_c_says_how_to_resume(tmp_path, text, monkeypatch):
    import fp8lab.lab.compare as lab

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(lab, "run_recipes", interrupted)
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16")
    assert res.exit_code == 130
    assert "interrupted; rerun the same command to resume" in res.stderr


# ----------------------------------------------------------------------------- item 15
@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("[inject]\noutlier_layers = 3\n", ("[inject]", "outlier_layers", "expected a string")),
        ('[compare]\njobs = "2"\n', ("[compare]", "jobs")),
        ("[compare]\nrecipez = []\n", ("[compare]", "recipez")),
        ("[comparre]\n", ("comparre",)),
    ],
)
def test_config_errors_name_file_table_and_key(tmp_path, text, extra, words):
    res, _ = _tiny_run(tmp_path, text, extra=extra)
    _bad(res, "c.toml", *words)


def test_config_string_where_a_number_is_expected(tmp_path, text):
    conf = _config(tmp_path, text)
    conf.write_text(conf.read_text().replace("steps = 4\n", 'steps = 4\nlr = "1e-3"\n'))
    res = _run("--config", str(conf), "--out", str(tmp_path / "o"))
    _bad(res, "c.toml", "[train] lr", "expected a number", "'1e-3'")


def test_config_strings_for_lists_are_never_split_into_characters(tmp_path, text):
    conf = _config(tmp_path, text, '[compare]\nrecipes = "bf16, te-current"\n')
    conf.write_text(conf.read_text().replace(f"paths = [{json.dumps(str(text))}]",
                                             f"paths = {json.dumps(str(text))}"))  # fmt: skip
    res = _run("--config", str(conf), "--print-config")
    assert res.exit_code == 0, res.output
    printed = tomllib.loads(res.stdout)
    assert printed["data"]["paths"] == [str(text)]
    assert printed["compare"]["recipes"] == ["bf16", "te-current"]


def test_missing_recipe_file(tmp_path, text):
    res, _ = _tiny_run(tmp_path, text, "--recipes", f"bf16,{tmp_path / 'mine.toml'}")
    _bad(res, "no such recipe file", "mine.toml")


# ----------------------------------------------------------------------------- item 16
def test_help_keeps_brackets_defaults_and_lists_set_keys():
    res = runner.invoke(app, ["compare", "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0
    flat = " ".join(res.output.split())
    assert "[model] [data] [train] [inject]" in flat and "[compare]" in flat
    # the whole default recipe list, unwrapped words joined again
    from fp8lab.lab.compare import DEFAULT_RECIPES

    assert ",".join(DEFAULT_RECIPES) in flat.replace(", ", ",").replace("- ", "-").replace(" ", "")
    for key in ("train: steps", "warmup_steps", "outlier_layers", "split_chunk", "--print-config"):
        assert key in flat, key


def test_print_config_roundtrips(tmp_path, text):
    from fp8lab.lab.train import LabConfig

    conf = _config(tmp_path, text)
    res = _run("--config", str(conf), "--set", "train.lr=2e-3", "--steps", "9", "--print-config")
    assert res.exit_code == 0, res.output
    printed = tomllib.loads(res.stdout)
    compare = printed.pop("compare")
    cfg = LabConfig.from_dict(printed)
    expected, _ = LabConfig.from_toml(conf)
    assert cfg == expected.with_overrides(["train.lr=2e-3", "train.steps=9"])
    assert compare["baseline"] == "bf16" and compare["jobs"] == 1
    assert not (tmp_path / "runs").exists()


def test_progress_lines_without_a_tty_and_a_rich_summary(tmp_path, text):
    conf = _config(tmp_path, text)
    res = _run("--config", str(conf), "--out", str(tmp_path / "o"), "--recipes", "bf16",
               env={"COLUMNS": "100"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "bf16: step 2/4" in res.stderr and "bf16: step 4/4" in res.stderr
    assert "fp8lab compare (baseline bf16)" in res.stdout  # the rich table's title
    assert "|---" not in res.stdout  # no markdown table
    # the table and the text wrap at COLUMNS; the report's path is one word and may not
    table = [line for line in res.stdout.splitlines() if not line.lstrip().startswith("report:")]
    assert max(len(line) for line in table) <= 100, res.stdout


def test_summary_says_which_gaps_are_within_the_noise(tmp_path, text):
    # issue 22: the text under the table names the noise and does not rank recipes inside it
    res, out = _tiny_run(tmp_path, text, "--recipes", "fp32,bf16", "--noise-seeds", "1")
    assert res.exit_code == 0, res.output
    lines = res.stdout[res.stdout.index("Noise: ") :].split("\n\n")[0].splitlines()
    assert "fp32 vs bf16" in " ".join(lines) and max(len(x) for x in lines) <= 80
    assert "bf16 under 1 other seed(s)" in " ".join(lines) and (out / "runs/bf16@seed1338").is_dir()


# ----------------------------------------------------------------------------- item 17
def test_negative_threads_and_late_spike_are_refused(tmp_path, text):
    res, out = _tiny_run(tmp_path, text, "--threads", "-2")
    assert res.exit_code == 2 and "--threads" in res.output
    res, out = _tiny_run(tmp_path, text, "--grad-spike-step", "4")  # steps = 4: 0..3
    _bad(res, "grad_spike_step=4", "train.steps=4")
    assert not out.exists()


def test_foreign_non_empty_dir_is_refused(tmp_path, text):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.json").write_text("my own file")
    (out / "config.json").write_text('{"mine": true}')
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16", out=out)
    _bad(res, "not made by fp8lab")
    assert (out / "summary.json").read_text() == "my own file"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "summary.json"]


# ----------------------------------------------------------------------------- item 18
def test_diverged_baseline_is_reported_honestly(tmp_path, text):
    # issue 11's reproduction, on the tiny model: lr 50 without clipping
    res, out = _tiny_run(tmp_path, text, "--set", "train.lr=50", "--set", "train.grad_clip=0",
                         "--recipes", "bf16,fp16-amp", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    js = json.loads(res.stdout)
    assert js["baseline_diverged"] is True
    assert {"schema_version", "baseline", "recipes"} <= set(js)  # fields are only added
    for name, r in js["recipes"].items():
        assert r["diverged"] is True, name
        assert r["rel_gap_pct"] is None and r["max_rel_gap_pct"] is None
    bf16 = js["recipes"]["bf16"]
    assert bf16["final_val_loss"] is None or bf16["final_val_loss"] > 5.55
    assert "baseline bf16 diverged" in (out / "report.md").read_text()
    assert json.loads((out / "summary.json").read_text())["baseline_diverged"] is True


def test_scripts_check_report_help():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "scripts/check_report.py"), "--help"],
                         capture_output=True, text=True, env={**os.environ}, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "usage" in res.stdout.lower() and "report.html" in res.stdout
    assert "does not exist" not in res.stderr


def test_readme_tables_regenerates_the_marked_block(tmp_path, text):
    # issue 22: `make readme-tables` writes a run's table, with its machine and date, between
    # its markers; the rest of the page is left as it is
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "readme_tables", root / "scripts/readme_tables.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "demo"
    res, _ = _tiny_run(tmp_path, text, "--recipes", "fp32,bf16", out=out)
    assert res.exit_code == 0, res.output
    body = mod.block(out)
    assert "Machine: " in body and "CPU capability" in body and "| fp32 |" in body
    # the command, from the report (its arguments are the test process's argv, empty under a
    # bare `python -m pytest`)
    assert "Noise: " in body and "(`fp8lab" in body
    page = "intro\n<!-- table: demo -->\nold numbers\n<!-- /table: demo -->\nrest\n"
    new, hit = mod.replace_marked(page, "demo", body, "README.md")
    assert hit and "old numbers" not in new and new.startswith("intro\n<!-- table: demo -->\n")
    assert new.endswith(body + "\n<!-- /table: demo -->\nrest\n")
    assert mod.replace_marked(page, "demo-long", body, "README.md") == (page, False)
    with pytest.raises(ValueError, match="no closing"):
        mod.replace_marked("<!-- table: demo -->\n", "demo", body, "README.md")


# ----------------------------------------------------------------------------- issue 13: --model
USER_MODEL = """
import torch
from torch import nn

class Tiny(nn.Module):
    def __init__(self, vocab=256):
        super().__init__()
        self.emb = nn.Embedding(256, 128)
        self.fc = nn.Linear(128, 128)
        self.head = nn.Linear(128, vocab)

    def forward(self, idx):
        return self.head(torch.relu(self.fc(self.emb(idx))))

def tiny():
    return Tiny()

def narrow():
    return Tiny(vocab=100)

def no_linear():  # logits straight from an embedding: nothing for a recipe to quantize
    return nn.Embedding(256, 256)

def head_only():  # its only Linear is the output head, which convert leaves high precision
    return nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 256))

VALUE = 1
"""


def test_model_from_file_and_transformers_config(tmp_path, text):
    pytest.importorskip("transformers")
    src = tmp_path / "mymodel.py"
    src.write_text(USER_MODEL)
    res, out = _tiny_run(tmp_path, text, "--recipes", "bf16,te-delayed", "--json", "--steps", "2",
                         "--model", f"{src}:tiny")  # fmt: skip
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert set(summary["recipes"]) == {"bf16", "te-delayed"}
    assert not any(r["diverged"] for r in summary["recipes"].values())
    meta = json.loads((out / "config.json").read_text())
    assert meta["lab"]["model"]["factory"] == f"{src}:tiny" and len(meta["model"]["sha256"]) == 64
    # the factory's source changed: the runs are refused, with the reason
    src.write_text(USER_MODEL + "# changed\n")
    res2, _ = _tiny_run(tmp_path, text, "--recipes", "bf16,te-delayed", "--steps", "2",
                        "--model", f"{src}:tiny")  # fmt: skip
    _bad(res2, "different configuration", "sha256")
    # the acceptance command's shape (README): a Llama config, three recipes; smaller sizes
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 128,
                                 "intermediate_size": 256, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "max_position_embeddings": 64}))  # fmt: skip
    res3, out3 = _tiny_run(tmp_path, text, "--recipes", "bf16,te-delayed,mxfp8", "--json", "--steps", "2",
                           "--model", f"hf:{llama}", out=tmp_path / "hf")  # fmt: skip
    assert res3.exit_code == 0, res3.output
    assert set(json.loads(res3.stdout)["recipes"]) == {"bf16", "te-delayed", "mxfp8"}
    assert (out3 / "report.html").exists()


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("no_such_pkg_123:make", ["cannot import module 'no_such_pkg_123'"]),
        ("{src}:missing", ["has no attribute 'missing'", "mymodel.py"]),
        ("{src}:no_linear", ["no Linear layer to quantize"]),
        ("{src}:head_only", ["no Linear layer to quantize"]),
        ("{src}:VALUE", ["'VALUE' is not callable"]),
        ("{src}:narrow", ["V >= 256", "[1, 16, 100]"]),
        ("hf:{bad_json}", ["not valid JSON"]),
        ("hf:{no_file}", ["no such config file"]),
    ],
)
def test_bad_model_is_exit_code_2_and_writes_nothing(tmp_path, text, model, words):
    src = tmp_path / "mymodel.py"
    src.write_text(USER_MODEL)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"model_type": "llama",,}')
    spec = model.format(src=src, bad_json=bad_json, no_file=tmp_path / "none.json")
    res, out = _tiny_run(tmp_path, text, "--recipes", "bf16", "--model", spec)
    _bad(res, *words)
    assert "_fp8lab_user_model" not in res.output  # the file, not the private module name
    assert not out.exists()


@pytest.mark.parametrize("command", [["compare", "--recipes", "bf16"], ["debug", "--recipe",
                                     "te-delayed"], ["cost"]])  # fmt: skip
def test_a_model_without_linears_is_refused_alike_by_every_command(tmp_path, command):
    # issue 22: compare trained identical runs (a UserWarning only) where debug and cost refused
    src = tmp_path / "mymodel.py"
    src.write_text(USER_MODEL)
    out = ["--out", str(tmp_path / "o")] if command[0] != "cost" else []
    res = runner.invoke(app, [*command, "--model", f"{src}:no_linear", *out])
    _bad(res, "no Linear layer to quantize", "nothing to compare, debug or price")
    assert not (tmp_path / "o").exists()


def test_missing_transformers_names_the_package(tmp_path, text, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    llama = Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-tiny.json"
    res, _ = _tiny_run(tmp_path, text, "--recipes", "bf16", "--model", f"hf:{llama}")
    _bad(res, "'transformers' is not installed", "fp8lab[hf]")


def test_print_config_shows_the_model_factory(tmp_path, text):
    res = _run("--print-config", "--model", "hf:examples/models/llama-tiny.json")
    assert res.exit_code == 0, res.output
    assert tomllib.loads(res.stdout)["model"]["factory"] == "hf:examples/models/llama-tiny.json"
