"""The debug report from a hand-made result: figures, verdict, tables, fix file."""

import json

from fp8lab.lab.debug.result import DebugResult, Probe
from fp8lab.report.debug import write_report


def _probe(name, kind, gap, closure=None, explains=False):
    base = 2.5
    val = [(s, base * (1 + gap / 100 * s / 100)) for s in (25, 50, 75, 100)]
    return Probe(name, kind, f"what {name} tests", {"final_val_loss": val[-1][1]}, val,
                 gap_pct=gap, closure=closure, explains=explains)  # fmt: skip


def _result(tmp_path, fix=True):
    probes = {p.name: p for p in [
        _probe("baseline", "baseline", 0.0), _probe("noise-fp32", "noise", 0.01),
        _probe("recipe", "recipe", 3.0), _probe("recovery", "recovery", 0.5, 0.83, True),
        _probe("role-input", "role", 0.2, 0.93, True), _probe("remedy-current-scaling", "remedy",
                                                               0.3, 0.9, True)]}  # fmt: skip
    fix_path = tmp_path / "fix.toml"
    fix_path.write_text('base = "te-delayed"\n\n[[layer]]\nmatch = "blocks.1.mlp.down"\n')
    remedies = [{"name": "current-scaling", "label": "current scaling for input", "probe":
                 "remedy-current-scaling", "gap_pct": 0.3, "closure": 0.9, "explains": True,
                 "relative_cost": 0.07}]  # fmt: skip
    attribution = [{"layer": f"blocks.{i // 6}.mlp.down", "gemm": g, "role": r, "score": s}
                   for i, (g, r, s) in enumerate([("fprop", "input", 0.8), ("wgrad", "input", 0.3),
                                                  ("dgrad", "grad_output", -0.05)])]  # fmt: skip
    return DebugResult(
        recipe="te-delayed", baseline="bf16", gap_pct=3.0, noise_pct=0.01, recovers=False,
        culprit={"role": "input", "gemm": "fprop", "layers": ["blocks.1.mlp.down"]},
        attribution=attribution, remedies=[{k: remedies[0][k] for k in
                                            ("name", "gap_pct", "relative_cost")}],
        fix=str(fix_path) if fix else None, probes=probes,
        verdict="Culprit: the input operand on blocks.1.mlp.down <&>.", reason="culprit",
        details={"timings_s": {"gap_s": 10.0, "screen_s": None, "total_s": 60.0},
                 "state": {"screen_steps": [25, 50, 75]}, "remedies": remedies,
                 "best_remedy": "current-scaling", "layers": ["blocks.0.mlp.down",
                                                              "blocks.1.mlp.down"],
                 "lab": {"train": {"steps": 100}}},
    )  # fmt: skip


def test_report_files_figures_and_words(tmp_path):
    res = _result(tmp_path)
    paths = write_report(tmp_path, res, command="fp8lab debug --scenario x",
                         expect={"role": "input"})  # fmt: skip
    for name in ("report.md", "report.html", "probes.png", "attribution.png", "remedies.png"):
        assert paths[name].exists() and paths[name].stat().st_size > 0
    md = (tmp_path / "report.md").read_text()
    assert res.verdict in md
    assert "| remedy-current-scaling | remedy |" in md
    assert "![Attribution](figures/attribution.png)" in md
    assert 'base = "te-delayed"' in md  # the fix file is shown
    assert "fp8lab debug --scenario x" in md and '{"role": "input"}' in md
    html = (tmp_path / "report.html").read_text()
    assert "&lt;&amp;&gt;" in html  # escaped
    assert html.count("<img ") == 3 and "data-loaded" in html
    json.dumps(res.to_json(), allow_nan=False)


def test_report_without_culprit_or_remedies(tmp_path):
    res = _result(tmp_path, fix=False)
    res.culprit, res.attribution, res.details["remedies"] = None, [], []
    paths = write_report(tmp_path, res)
    assert "attribution.png" not in paths and "remedies.png" not in paths
    md = (tmp_path / "report.md").read_text()
    assert "| culprit | none |" in md and "fix.toml" not in md
