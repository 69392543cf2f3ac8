"""The recipe files under examples/ load, round-trip and differ from their preset as they say."""

from pathlib import Path

import pytest

import fp8lab
from fp8lab.lab.recipes import resolve_recipe

EXAMPLES = sorted((Path(__file__).parents[1] / "examples" / "recipes").glob("*.toml"))


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_recipe_loads_and_round_trips(path):
    r = resolve_recipe(str(path))
    assert r.name == path.stem
    assert fp8lab.Recipe.from_toml(r.to_toml()).to_dict() == r.to_dict()


def test_hif8_g12_differs_from_the_preset_only_in_nguard():
    r = resolve_recipe(str(EXAMPLES[[p.stem for p in EXAMPLES].index("hif8-delayed-g12")]))
    preset = fp8lab.get_recipe("hif8-delayed")
    for role in ("input", "weight", "grad_output"):
        got, want = getattr(r, role), getattr(preset, role)
        assert got.scaling.nguard == 12 and want.scaling.nguard == 8
        assert got.format == want.format == "hif8" and got.rounding == want.rounding
        assert got.scaling.interval == want.scaling.interval
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert getattr(r, gemm).to_dict() == getattr(preset, gemm).to_dict()


# --- the example scripts (examples/*.py): each runs at tiny size, so none rots -------------------

SCRIPTS_DIR = Path(__file__).parents[1] / "examples"
SCRIPTS = sorted(SCRIPTS_DIR.glob("*.py"))


def _load(path: Path):
    """Import an example script as a module (its folder on sys.path, as ``python FILE`` has)."""
    import importlib.util
    import sys

    if str(SCRIPTS_DIR) not in sys.path:
        sys.path.insert(0, str(SCRIPTS_DIR))
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_script_is_run_below():
    assert {p.stem for p in SCRIPTS} == set(TINY_ARGS), "add the new example to TINY_ARGS"


# the arguments that make each script tiny; "{tmp}" is the test's temporary folder
TINY_ARGS = {
    "quickstart_compare": ["--tiny", "--out", "{tmp}/compare"],
    "quickstart_drift": ["--tiny", "--out", "{tmp}/drift.jsonl"],
    "quickstart_numerics": ["--tiny"],
    "own_loop": ["--tiny"],
    "own_loop_watch": ["--tiny", "--out", "{tmp}/watch.jsonl"],
    "guarded_loop": ["--tiny"],
}


@pytest.mark.parametrize("name", sorted(TINY_ARGS))
def test_example_script_runs_at_tiny_size(name, tmp_path, capsys):
    result = _load(SCRIPTS_DIR / f"{name}.py").main(
        [a.replace("{tmp}", str(tmp_path)) for a in TINY_ARGS[name]]
    )
    assert result and capsys.readouterr().out.strip()
    if name == "quickstart_compare":
        assert set(result["recipes"]) == {"bf16", "te-delayed", "deepseek-v3", "mxfp8"}
        assert (tmp_path / "compare" / "summary.json").is_file()
    if name == "guarded_loop":  # the NaN and the 2^40 gradient spike, both rolled back
        assert result["rollbacks"] == 2 and result["rel"] <= 0.005
    if name in ("quickstart_drift", "own_loop_watch"):
        out = tmp_path / ("drift.jsonl" if name == "quickstart_drift" else "watch.jsonl")
        assert out.read_text().count("\n") > 0
