"""Counterfactual variants, relative cost, group testing and the fix file."""

import pytest
import torch

from fp8lab.lab.debug import remedies, search, variants
from fp8lab.lab.debug.verdict import best_remedy, write_fix
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.parts import build_model
from fp8lab.recipe import LayerRule, Recipe, get_recipe

MODEL = GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, d_ff=64)


@pytest.fixture(scope="module")
def layers():
    with torch.random.fork_rng(devices=[]):
        m = build_model(MODEL, get_recipe("te-delayed"), 0)
    names = variants.converted_layers(m)
    return names, variants.layer_dims(m, names)


def test_per_layer_variant_changes_only_the_chosen_layers(layers):
    names, _ = layers
    r = get_recipe("te-delayed")
    v = variants.cells_hp(r, {names[0]: [("fprop", "input")], names[3]: [("fprop", "input")]},
                          "bf16", "v")  # fmt: skip
    assert v.name == "v" and len(v.layers) == 1  # one rule for both layers
    for n in names:
        got = v.for_layer(n)
        if n in (names[0], names[3]):
            assert got.precision("fprop", "input") == "bf16"
            assert got.precision("wgrad", "input") is None
        else:
            assert got.fingerprint() == r.fingerprint()


def test_variant_on_top_of_a_layered_recipe_keeps_its_rules(layers):
    """A remedy on a layer that already has a rule (the planted fault) keeps the fault's other
    settings: only what the remedy changes differs."""
    from fp8lab.qtensor import QuantSpec

    names, _ = layers
    fault = QuantSpec(format="e4m3", scaling=1.0).to_dict()
    r = get_recipe("te-delayed").with_layers(LayerRule(match=names[2],
                                                       changes={"grad_output": fault}))  # fmt: skip
    v = variants.per_layer(r, [names[2]], lambda x: variants.current_scaling(x, ["grad_output"]),
                           "cur")  # fmt: skip
    g = v.for_layer(names[2]).grad_output
    assert g.format == "e4m3" and g.scaling == "max"
    assert v.for_layer(names[1]).fingerprint() == r.for_layer(names[1]).fingerprint()


def test_fake_quant_keeps_grids_and_uses_current_scaling():
    r = get_recipe("deepseek-v3")
    fq = variants.fake_quant_recipe(get_recipe("te-delayed"))
    assert all(getattr(fq, role).scaling == "max" for role in variants.ROLES)
    assert fq.input.format == "e4m3" and fq.grad_output.format == "e5m2"
    fq2 = variants.fake_quant_recipe(r)
    assert fq2.input.block == r.input.block
    assert all(fq2.gemm(g).accumulator.kind == "fp32" for g in ("fprop", "dgrad", "wgrad"))


def test_fake_quant_is_a_deprecated_alias_of_fake_quant_recipe():
    r = get_recipe("te-delayed")
    with pytest.deprecated_call():
        old = variants.fake_quant(r)
    assert old.fingerprint() == variants.fake_quant_recipe(r).fingerprint()
    from fp8lab.recipe.layers import LAYER_KEYS

    assert variants.LAYER_KEYS is LAYER_KEYS  # one definition, still importable here


def test_relative_cost_proxy(layers):
    names, dims = layers
    r = get_recipe("te-delayed")
    tokens = 64
    assert remedies.relative_cost(r, r, dims, tokens) == 0.0
    # all three GEMMs in high precision everywhere: every FLOP moved
    hp = variants.per_layer(r, names, lambda x: x.with_high_precision("fprop", "dgrad", "wgrad"),
                            "hp")  # fmt: skip
    assert remedies.relative_cost(hp, r, dims, tokens) >= 1.0
    cur = variants.per_layer(r, names, lambda x: variants.current_scaling(x, ["grad_output"]), "c")
    cost_cur = remedies.relative_cost(cur, r, dims, tokens)
    assert 0 < cost_cur < 1  # no FLOP moved, one amax pass more per gradient
    one = variants.cells_hp(r, {names[0]: [("dgrad", "grad_output")]}, "bf16", "one")
    all_ = variants.cells_hp(r, {n: [("dgrad", "grad_output")] for n in names}, "bf16", "all")
    assert (
        0
        < remedies.relative_cost(one, r, dims, tokens)
        < remedies.relative_cost(all_, r, dims, tokens)
    )


def test_remedy_variants_skip_what_changes_nothing(layers):
    names, _ = layers
    got = remedies.remedy_variants(get_recipe("te-current"), "input", "fprop", names[:1], "bf16")
    assert "current-scaling" not in got  # te-current already scales currently
    assert {"finer-granularity", "high-precision-cells"} <= set(got)
    got = remedies.remedy_variants(get_recipe("te-delayed"), "grad_output", "dgrad", names[:2],
                                   "bf16")  # fmt: skip
    assert "e5m2-gradients" not in got  # te-delayed's gradients are E5M2 already
    assert "current-scaling" in got


@pytest.mark.parametrize(("n", "culprits"), [(10, {3}), (10, {0}), (7, {0, 1, 2, 3, 4, 5, 6}),
                                             (5, {1, 3}), (1, {0})])  # fmt: skip
@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_prefix_search_finds_the_shortest_explaining_prefix(n, culprits, jobs):
    order = [f"l{i}" for i in range(n)]
    calls = []

    def explains(prefixes):
        calls.append(len(prefixes))
        assert len(prefixes) <= jobs
        return [all(f"l{c}" in p for c in culprits) for p in prefixes]

    found, tried = search.prefix_search(order, explains, jobs)
    assert found == order[: max(culprits) + 1]
    assert len(calls) <= n  # never more rounds than layers
    assert all(k < n for k, _ in tried)


def test_best_remedy_is_the_cheapest_that_explains():
    rows = [
        {"name": "current-scaling", "explains": True, "relative_cost": 0.2, "gap_pct": 0.5},
        {"name": "finer-granularity", "explains": True, "relative_cost": 0.2, "gap_pct": 0.4},
        {"name": "high-precision-cells", "explains": False, "relative_cost": 0.1, "gap_pct": 3.0},
        {"name": "high-precision-role", "explains": True, "relative_cost": 0.6, "gap_pct": 0.1},
    ]
    assert best_remedy(rows)["name"] == "current-scaling"  # equal cost: the simpler change
    assert best_remedy([{**r, "explains": False} for r in rows])["name"] == "high-precision-role"
    assert best_remedy([]) is None


def test_fix_file_is_a_per_layer_recipe_that_reads_back(tmp_path, layers):
    names, _ = layers
    r = get_recipe("te-delayed")
    v = variants.per_layer(r, names[:3], lambda x: variants.current_scaling(x, ["grad_output"]),
                           "te-delayed-fix")  # fmt: skip
    path = write_fix(v, r, tmp_path / "fix.toml", "a note\nsecond line")
    text = path.read_text()
    assert text.startswith("# a note\n# second line\n")
    assert 'base = "te-delayed"' in text and "[[layer]]" in text
    back = Recipe.load(path)
    for n in names:
        assert back.for_layer(n).fingerprint() == v.for_layer(n).fingerprint()


def test_fix_file_of_a_recipe_that_is_no_preset_is_expanded(tmp_path, layers):
    from fp8lab.lab.recipes import resolve_recipe

    names, _ = layers
    r = resolve_recipe("e4m3-unscaled-grads")  # the lab's own recipe, not a preset
    v = variants.per_layer(r, names[:2], variants.e5m2_gradients, "fix")
    text = write_fix(v, r, tmp_path / "fix.toml", "note").read_text()
    assert "base =" not in text and "NEGATIVE CONTROL" not in text
    back = Recipe.load(tmp_path / "fix.toml")
    assert all(back.for_layer(n).fingerprint() == v.for_layer(n).fingerprint() for n in names)


def _issue_scores(n=15, culprit=7):
    """The issue's screening: one layer's (fprop, input) cell strong (0.172), the same layer's
    (wgrad, input) cell strongly negative (-0.346), every other cell <= 0.0003."""
    names = [f"blocks.{i}.lin" for i in range(n)]
    rows = []
    for i, x in enumerate(names):
        for g, r in variants.CELLS:
            rows.append({"layer": x, "gemm": g, "role": r, "score": 0.0003 * (i % 3) / 2})
    for row in rows:
        if row["layer"] == names[culprit] and row["role"] == "input":
            row["score"] = 0.172 if row["gemm"] == "fprop" else -0.346
    return names, rows


def test_layer_order_a_strong_cell_is_not_cancelled_by_its_opposite():
    names, rows = _issue_scores()
    # the culprit GEMM's cells decide: the planted layer comes first
    assert search.layer_order(names, rows, "input", "fprop")[0] == names[7]
    # without a culprit GEMM, the role's strongest cell of a layer counts, not the sum
    assert search.layer_order(names, rows, "input")[0] == names[7]


def test_layer_order_uses_the_pair_replay_of_the_operand():
    names, rows = _issue_scores()
    # the pair replay (input in high precision in fprop AND wgrad) of layer 3 removes more
    # error than any single cell: it leads, then the planted layer's strong cell
    pairs = [{"layer": x, "role": "input", "score": 0.0} for x in names]
    pairs[3]["score"] = 0.5
    pairs[7]["score"] = 0.2
    order = search.layer_order(names, rows, "input", "fprop", pairs)
    assert order[:2] == [names[3], names[7]]
    assert sorted(order) == sorted(names)


def test_a_gap_below_the_floor_is_not_attributed():
    from fp8lab.lab.debug.method import gap_floor, too_small_to_attribute

    # the issue: te-delayed on a tiny healthy model, +0.007 % against a noise of 0.001 %
    assert too_small_to_attribute(0.007, 0.001)
    assert too_small_to_attribute(-0.009, 0.0)
    assert gap_floor(0.001) == 0.01 and gap_floor(0.1) == pytest.approx(0.3)
    assert too_small_to_attribute(0.29, 0.1) and not too_small_to_attribute(0.31, 0.1)
    assert not too_small_to_attribute(0.44, 0.006)  # outlier-channels, seed 1337
    assert not too_small_to_attribute(None, 0.001)
