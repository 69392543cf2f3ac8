"""fp8lab.watch: records equal statistics computed independently from the collected operands,
every N honoured in both counting modes, training untouched, output files, bad input."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import fp8lab
from fp8lab import stats
from fp8lab.formats import cast, get_format
from fp8lab.nn import collect_operands, convert
from fp8lab.nn.linear import _OBSERVERS
from fp8lab.observe import FIELDS, read_records, sample, watch

PRESETS = ("te-delayed", "deepseek-v3", "mxfp8")


def _model(preset: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64), torch.nn.Linear(64, 8)
    )
    convert(m, preset)  # the last Linear stays in high precision (convert's default)
    return m


def _step(m, opt, x):
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 64, generator=g) * 3 for _ in range(n)]


# hif8-delayed: first_step="current", the step-0 scale comes from the tensor's own amax
@pytest.mark.parametrize("preset", [*PRESETS, "hif8-delayed"])
def test_records_equal_independent_statistics(preset):
    m = _model(preset)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    collected = {}
    with watch(m, every=1) as w:
        for k, x in enumerate(_batches(3)):
            # copies: the weight is updated in place by the optimizer after the step
            with collect_operands(m, fn=lambda hp, used: (hp.clone(), used.clone())) as ops:
                _step(m, opt, x)
            collected[k] = dict(ops)
    rows = w.records
    assert {r["step"] for r in rows} == {0, 1, 2}
    for r in rows:
        assert r["exact"] is True, r
        hp, used = collected[r["step"]][(r["layer"], r["gemm"], r["role"])]
        assert r["numel"] == hp.numel()
        assert r["amax"] == stats.amax(hp)
        assert r["underflow_pct"] == pytest.approx(stats.underflow_pct(hp, used), abs=1e-12)
        sq = stats.sqnr_db(hp, used)
        assert r["sqnr_db"] == pytest.approx(sq, rel=1e-9) if math.isfinite(sq) else True
        assert r["scale_min"] <= r["scale_max"]
        if r["scale"] is not None:  # one multiplier for the tensor
            # used = values * scale_inv with values on the grid, values = cast(clamp(hp * scale))
            inv = torch.tensor(r["scale_inv"], dtype=torch.float32)
            v = cast(used / inv, r["format"])
            assert torch.equal(v * inv, used)
            f = get_format(r["format"]).max
            scaled = (hp * torch.tensor(r["scale"], dtype=torch.float32)).clamp(-f, f)
            assert torch.equal(cast(scaled, r["format"]), v)
            ref = stats.saturation_pct(hp, used, r["format"], v)
            assert r["saturation_pct"] == pytest.approx(ref, abs=1e-12)
    # every quantized operand of the two converted layers: 6 of layer 2, 4 of layer 0 (no dgrad:
    # its input does not require grad)
    keys = {(r["layer"], r["gemm"], r["role"]) for r in rows if r["step"] == 0}
    assert keys == {k for k in collected[0] if k[0] in ("0", "2")}
    assert len(keys) == 4 + 6


def test_delayed_scale_and_saturation_are_the_stale_scale_that_acted():
    """A 1000x input spike under te-delayed saturates with last step's scale: the record's scale
    is the state's scale before the forward, its saturation the elements beyond fmax."""
    m = _model("te-delayed")
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    xs = _batches(3)
    xs[2] = xs[2] * 1000
    with watch(m, every=1) as w:
        for k, x in enumerate(xs):
            if k == 2:
                scale = float(m[0].scaling_states["input"].scale)
            _step(m, opt, x)
    r = next(
        r
        for r in w.records
        if (r["step"], r["layer"], r["gemm"], r["role"]) == (2, "0", "fprop", "input")
    )
    assert r["scale"] == scale
    expected = 100.0 * float((xs[2].double().abs() * scale > 448.0).sum()) / xs[2].numel()
    assert expected > 50.0
    assert r["saturation_pct"] == pytest.approx(expected, abs=1e-12)


def test_every_n_forward_counting_and_no_hook_on_skipped_steps():
    m = _model("te-delayed")
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    active = []
    m[0].register_forward_pre_hook(lambda mod, a: active.append(len(_OBSERVERS.active)))
    with watch(m, every=3) as w:
        for x in _batches(7):
            _step(m, opt, x)
    assert sorted({r["step"] for r in w.records}) == [0, 3, 6]
    assert active == [1, 0, 0, 1, 0, 0, 1]
    assert _OBSERVERS.active == []
    assert w.step_index == 6


def test_every_n_explicit_steps_with_gradient_accumulation():
    m = _model("mxfp8")
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    xs = _batches(10)
    with watch(m, every=2, count="step") as w:
        for s in range(5):
            for x in xs[2 * s : 2 * s + 2]:  # two micro-batches per optimizer step
                m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            w.step()
    assert sorted({r["step"] for r in w.records}) == [0, 2, 4]
    calls = {
        r["call"]
        for r in w.records
        if (r["layer"], r["gemm"], r["role"]) == ("0", "fprop", "input")
    }
    assert calls == {0, 1}
    with pytest.raises(ValueError, match="count='step'"), watch(m, every=2) as w2:
        w2.step()


@pytest.mark.parametrize("preset", PRESETS)
def test_training_is_bit_identical_with_and_without_watch(preset):
    weights = []
    for watched in (False, True):
        m = _model(preset)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        xs = _batches(3)
        if watched:
            with watch(m, every=1):
                for x in xs:
                    _step(m, opt, x)
        else:
            for x in xs:
                _step(m, opt, x)
        weights.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*weights, strict=True):
        assert torch.equal(a, b)


def test_jsonl_and_csv_files(tmp_path):
    out = {}
    for suffix in ("jsonl", "csv"):
        m = _model("deepseek-v3")
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        path = tmp_path / f"w.{suffix}"
        with fp8lab.watch(m, every=2, out=path) as w:
            for x in _batches(3):
                _step(m, opt, x)
        out[suffix] = (path, w.records)
    lines = out["jsonl"][0].read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [r["step"] for r in out["jsonl"][1]]
    assert set(json.loads(lines[0])) == set(FIELDS)
    with open(out["csv"][0], newline="") as f:
        header = next(csv.reader(f))
    assert header == list(FIELDS)
    a, b = read_records(out["jsonl"][0]), read_records(out["csv"][0])
    assert len(a) == len(b) == len(out["csv"][1]) > 0
    for ra, rb in zip(a, b, strict=True):
        assert (ra["layer"], ra["gemm"], ra["role"], ra["step"]) == (
            rb["layer"], rb["gemm"], rb["role"], rb["step"])  # fmt: skip
        assert ra["underflow_pct"] == rb["underflow_pct"]
        assert ra["saturation_pct"] == rb["saturation_pct"]


def test_sample_one_step_rows_for_a_loop_with_its_own_writer():
    m = _model("te-delayed")
    x = _batches(1)[0]
    with sample(m, step=7) as rows:
        m(x).pow(2).mean().backward()
    assert rows and {r["step"] for r in rows} == {7}
    assert _OBSERVERS.active == []


def test_bad_arguments():
    m = _model("te-delayed")
    for every in (0, -1, 2.0, "5", True):
        with pytest.raises(ValueError, match="every"):
            watch(m, every=every)
    with pytest.raises(ValueError, match="count"):
        watch(m, count="epoch")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        watch("model")
    with pytest.raises(ValueError, match="no converted"), watch(torch.nn.Linear(4, 4)):
        pass
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with (
            pytest.raises(ImportError, match="pip install tensorboard"),
            watch(m, tensorboard="tb"),
        ):
            pass
    assert _OBSERVERS.active == []


def test_read_records_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_records(tmp_path / "e.jsonl")
    (tmp_path / "c.jsonl").write_text('{"step": 0}\n{oops\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1: not an fp8lab.watch record"):
        read_records(tmp_path / "c.jsonl")
    (tmp_path / "d.jsonl").write_text(
        '{"step": 0, "layer": "a", "gemm": "fprop", "role": "input", "underflow_pct": 1, '
        '"saturation_pct": null}\n{oops\n'
    )
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        read_records(tmp_path / "d.jsonl")


def test_autocast_recipe_override_is_measured_in_forward_and_backward():
    """Under fp8lab.autocast(other recipe) around the forward only, the backward operands are
    still measured under the forward's recipe (exact rows, the other recipe's formats)."""
    m = _model("te-delayed")
    x = _batches(1)[0]
    with watch(m, every=1) as w:
        with fp8lab.autocast("mxfp8"):
            y = m(x)
        y.pow(2).mean().backward()
    assert w.records and all(r["exact"] for r in w.records)
    assert {r["spec"].split(":")[1] for r in w.records} <= {"mx", "mx_col"}
    assert {r["gemm"] for r in w.records} == {"fprop", "dgrad", "wgrad"}
