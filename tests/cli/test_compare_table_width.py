"""``fp8lab compare``'s summary table at 80 columns (issue 22): every column, names whole."""

from __future__ import annotations

from io import StringIO

from rich.console import Console
from table_width_check import assert_readable

from fp8lab.cli.compare import _summary_tables
from fp8lab.lab.compare import DEFAULT_RECIPES


def _summary(names, device="h100"):
    recipes, details = {}, {}
    for n in names:
        recipes[n] = {"final_train_loss": 3.21, "final_val_loss": 3.3456, "rel_gap_pct": 0.123,
                      "max_rel_gap_pct": 1.5, "skipped_steps": 0, "tokens_per_s": 12345.0,
                      "diverged": n == "e4m3-unscaled-grads", "predicted_step_ms": 1.234}  # fmt: skip
        details[n] = {"spikes": 0, "steps_done": 20, "step_time_ms": 10.0,
                      "memory_bytes": {"weights": 2**20, "optimizer": 2**21,
                                       "activations": 2**22, "total": 7 * 2**20},
                      "negative_control": n == "e4m3-unscaled-grads"}  # fmt: skip
    return {"schema_version": 1, "baseline": "bf16", "recipes": recipes, "details": details,
            "device": device}  # fmt: skip


def _render(summary, width=80):
    buf = StringIO()
    con = Console(width=width, file=buf)
    for t in _summary_tables(summary, width):
        con.print(t)
    return buf.getvalue()


def test_summary_table_of_the_demo_recipes_is_readable_at_80_columns():
    out = _render(_summary(DEFAULT_RECIPES))
    headers = ["val", "gap", "skipped", "tokens", "time /", "total", "pred. ms", "diverged"]
    assert_readable(out, headers, [*DEFAULT_RECIPES, "(negative control)"])
    assert "yes" in out  # the diverged cell of the negative control
    # wide terminals keep one table
    wide = _render(_summary(DEFAULT_RECIPES), width=160)
    assert wide.count("fp8lab compare (baseline bf16)") == 1


def test_per_layer_settings_readable_at_80_columns():
    from fp8lab.cli.compare import _layer_tables

    cell = "input=e4m3:tensor:delayed(h=1024, max), weight=e4m3:tensor:delayed(h=1024, max)"
    dy = "grad_output=e5m2:tensor:delayed(h=1024, max), weight=e4m3:128x128:max"
    per_layer = {
        f"blocks.{i}.attn.qkv": {"rules": [1, 2], "gemms": {"fprop": cell, "dgrad": dy,
                                                            "wgrad": dy}}
        for i in range(3)
    }  # fmt: skip
    buf = StringIO()
    con = Console(width=80, file=buf)
    for t in _layer_tables("fix.toml", per_layer, 80):
        con.print(t)
    out = buf.getvalue()
    headers = ["layer", "rules", "fprop", "dgrad", "wgrad"]
    assert_readable(out, headers, ["blocks.0.attn.qkv", "e5m2:tensor:delayed", "e4m3:128x128:max"])


def _varied(names, device="h100"):
    """A summary whose every column differs between rows (nothing to move to a caption)."""
    s = _summary(names, device)
    for i, n in enumerate(names):
        s["recipes"][n].update(final_val_loss=3.3 + 0.01 * i, rel_gap_pct=0.2 * i,
                               max_rel_gap_pct=float(i), skipped_steps=i,
                               tokens_per_s=1000.0 * i, predicted_step_ms=i + 0.5)  # fmt: skip
        s["details"][n]["memory_bytes"]["total"] = 2**20 * (i + 1)
        s["details"][n]["step_time_ms"] = 10.0 + i
    return s


def test_columns_fold_into_tables_and_recipe_names_wrap_at_spaces_only():
    # the summary goes through cli._common.fitted_tables, the one table-fitting routine
    out = _render(_varied(DEFAULT_RECIPES))
    headers = ["val", "gap", "skipped", "tokens", "time /", "total", "pred. ms", "diverged"]
    assert_readable(out, headers, [*DEFAULT_RECIPES, "(negative control)"])
    assert "fp8lab compare (baseline bf16) (continued)" in out
    # at 80 columns the narrow first table wraps the long name at its space, never mid-word
    assert any(line.split() == ["(negative", "control)"] for line in out.splitlines()), out


def test_a_column_equal_in_every_row_goes_to_a_caption():
    # fitted_tables' rule, as for every other command's tables
    s = _varied(DEFAULT_RECIPES)
    for n in DEFAULT_RECIPES:
        s["recipes"][n]["skipped_steps"] = 0
    out = _render(s, width=80)
    assert "same in every row: skipped steps 0" in " ".join(out.split())
    assert "skipped" not in out.split("same in every row")[0]
